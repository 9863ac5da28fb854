# Sourced by the device scripts: work and output folders, everything printed also logged to
# $OUT/device.log, the carried wheels installed, Python paths set. Defines W, OUT, t0.
W=${KX_WORK:-/tmp/kx}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/device.log") 2>&1
t0=$(date +%s)
# by name from the carried folder: pip picks each package's wheel for this Python (xxhash
# carries one per CPython version)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --find-links .whl $(ls .whl | sed 's/-.*//' | sort -u)
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/tests PYTHONUNBUFFERED=1
export KAIROX_VOCAB_GGUF=${KAIROX_VOCAB_GGUF:-$PWD/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf}
