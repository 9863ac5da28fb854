#!/usr/bin/env bash
# On the GPU machine: build kairox with CUDA, and the unpatched vendored llama.cpp's
# llama-bench for comparison, outside the carried tree (build dirs survive between calls
# while the machine stays warm; ninja resumes an interrupted build).
#
#   bash bench/device/build.sh        # from the repo root, vendor/llama.cpp carried
#   KX_NO_STOCK=1 bash bench/device/build.sh   # kairox only
#
# "Unpatched" = vendor/llama.cpp with every patch reversed except the build-only ones
# (0001 lets the trimmed tree configure; it changes no compiled code).
set -euo pipefail
W=${KX_WORK:-/tmp/kx}
ARCH=${KAIROX_CUDA_ARCH:-90}
BUILD_ONLY_PATCHES="0001-tools-build-present-folders.patch"
mkdir -p "$W"
if [ -z "${KX_NO_STOCK:-}" ] && [ ! -f "$W/stock/.ready" ]; then
    rm -rf "$W/stock"
    cp -r vendor/llama.cpp "$W/stock"
    for p in $(ls patches/*.patch | sort -r); do
        case " $BUILD_ONLY_PATCHES " in *" $(basename "$p") "*) continue ;; esac
        patch -R -p1 --batch --silent -d "$W/stock" -i "$PWD/$p"
    done
    touch "$W/stock/.ready"
fi
J=$(nproc)
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON \
    -DKAIROX_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_INSTALL_PREFIX="$W/kx" > "$W/kx-configure.log"
[ -n "${KX_NO_STOCK:-}" ] || cmake -S "$W/stock" -B "$W/build-stock" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$W/stock-configure.log"
t0=$(date +%s)
# Both at once: the CUDA template instances dominate and keep 16 cores busy either way.
(cmake --build "$W/build-kx" -j "$J" > "$W/kx-build.log" 2>&1 && cmake --install "$W/build-kx" > /dev/null \
    && echo "kairox CUDA build ok ($(( $(date +%s) - t0 )) s)") &
kx=$!
rc=0
if [ -z "${KX_NO_STOCK:-}" ]; then
    (cmake --build "$W/build-stock" -j "$J" --target llama-bench > "$W/stock-build.log" 2>&1 \
        && echo "stock llama-bench build ok ($(( $(date +%s) - t0 )) s)") &
    st=$!
    wait $st || { rc=1; tail -20 "$W/stock-build.log"; }
fi
wait $kx || { rc=1; tail -20 "$W/kx-build.log"; }
exit $rc
