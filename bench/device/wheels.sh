#!/usr/bin/env bash
# Here, before the first device call of a fresh checkout: fills .whl/ (git-ignored, carried with
# the device calls) with the wheels of the Python packages the GPU machine cannot download
# (it has no registry): gguf, diskcache, xxhash for its Python (3.12), and llama-cpp-python
# 0.3.36 from the pinned sdist built without its native part. bench/device/env.sh installs them.
#
#   bash bench/device/wheels.sh            # repo root; KX_WHL_PY="311 312" for more CPython versions
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip --disable-pip-version-check -q)
mkdir -p .whl
"${PIP[@]}" download --no-deps -d .whl gguf diskcache
for v in ${KX_WHL_PY:-312}; do
    "${PIP[@]}" download --no-deps --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 -d .whl xxhash
done
sdist=$("$PY" scripts/vendor.py --print-sdist)
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" wheel --no-deps -w .whl "$sdist"
ls .whl
