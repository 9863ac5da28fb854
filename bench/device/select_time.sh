#!/usr/bin/env bash
# On the GPU machine: kx_select's kernel alone (bench/select_time.cu, no ggml build: the op's
# file compiled into the bench), at the decode's shapes, scores evicted from L2 before each
# launch. KX_OLD_DIR: a folder holding another kx-select.cu to time beside it (interleaved).
#
#   bash bench/device/select_time.sh            # repo root; carry vendor/llama.cpp
#   git show REV:ggml_ext/cuda/kx-select.cu > old/kx-select.cu; KX_OLD_DIR=old bash bench/device/select_time.sh
set -uo pipefail
. bench/device/env.sh
G=vendor/llama.cpp/ggml
build() {  # OUTPUT [EXTRA -I ...]: the bench against the op file first found on the include path
    nvcc -O2 -arch=sm_90 -std=c++17 bench/select_time.cu "${@:2}" -I ggml_ext/include -I ggml_ext/cuda \
        -I $G/include -I $G/src -o "$1"
}
build "$W/st_new" || exit 1
[ -n "${KX_OLD_DIR:-}" ] && { build "$W/st_old" -I "$KX_OLD_DIR" || exit 1; }
for rep in 1 2; do
    for n in ${KX_SELECT_N:-1024 11008 28672 131072}; do
        for v in new ${KX_OLD_DIR:+old}; do
            "$W/st_$v" "$n" 0.045 300 | tail -1 | sed "s/^{/{\"kernel\": \"$v\", /"
        done
    done
done | tee "$OUT/select-time.jsonl"
echo "done ($(( $(date +%s) - t0 )) s)"
