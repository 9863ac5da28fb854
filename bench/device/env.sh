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
# kx_build TARGET...: configure (CUDA, sm_90, KX_CMAKE_ARGS too) and build those targets into
# $W/build-kx; sets B (its bin/, libraries beside the tools) and KAIROX_LIB_DIR
kx_build() {
    cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_CUDA_ARCHITECTURES=90 \
        ${KX_CMAKE_ARGS:-} > "$W/kx-configure.log" || return 1
    cmake --build "$W/build-kx" -j "$(nproc)" --target "$@" > "$W/kx-build.log" 2>&1 \
        || { tail -30 "$W/kx-build.log"; return 1; }
    echo "build done ($(( $(date +%s) - t0 )) s)"
    B=$W/build-kx/bin
    export KAIROX_LIB_DIR=$B
}
# kx_gpu_tests SECONDS: the GPU tests named by KX_TESTS, if any, stopped after that long
kx_gpu_tests() {
    [ -z "${KX_TESTS:-}" ] || timeout "$1" python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 \
        | tee "$OUT/pytest.log" | tail -8
}
