#!/usr/bin/env bash
# On the GPU machine's host CPU, no GPU: the ReLU host op alone (bench/host_op.c) on KB-70B's
# layer shapes in 4 KiB and 2 MiB pages, interleaved, beside the scattered-read roof of the
# same rows (bench/host_pages.c). A CPU-only ggml build (about a minute on 16 cores). To $OUT.
#
#   bash bench/device/host_op.sh          # repo root; carry vendor/llama.cpp
#   KX_HOST_OP_ARGS="8 800 20 11008 4096 q4k" ...  # KB-7B Q4_K_M's host part instead (host_op.c's
#                                         # arguments after the threads; its JSON splits the op's span)
#   KX_HOST_OP_THREADS="8 16" ...        # these thread counts (default: every core)
#   KX_HOST_OP_OLD=old-tree ...           # also an earlier tree's op, rows interleaved and labelled
#                                         # "tree": "old" / "new" (old-tree as for bench/device/ab.sh)
set -uo pipefail
. bench/device/env.sh
# host_op_build SRC NAME: SRC's CPU-only ggml and the probe linked to it, as $W/host_op-NAME
host_op_build() {
    kx_vendor_into "$1" || return 1
    cmake -S "$1" -B "$W/build-cpu-$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=OFF > "$W/cpu-configure-$2.log" \
        || return 1
    cmake --build "$W/build-cpu-$2" -j "$(nproc)" --target ggml-cpu > "$W/cpu-build-$2.log" 2>&1 \
        || { tail -30 "$W/cpu-build-$2.log"; return 1; }
    local L
    L=$(dirname "$(find "$W/build-cpu-$2" -name 'libggml-cpu.so' | head -1)")
    gcc -O2 -march=native -Wall bench/host_op.c -I vendor/llama.cpp/ggml/include -I ggml_ext/include \
        -L "$L" -lggml-base -lggml-cpu -Wl,-rpath,"$L" -o "$W/host_op-$2"
}
TREES="new"
host_op_build . new || exit 1
if [ -n "${KX_HOST_OP_OLD:-}" ]; then
    host_op_build "$KX_HOST_OP_OLD" old || exit 1
    TREES="old new"
fi
echo "build done ($(( $(date +%s) - t0 )) s)"
gcc -O3 -march=native -fopenmp -Wall bench/host_pages.c -o "$W/host_pages" || exit 1
cat /sys/kernel/mm/transparent_hugepage/enabled > "$OUT/thp.txt"
{
    for rep in 1 2; do
        for pg in 4k 2M; do
            for th in ${KX_HOST_OP_THREADS:-$(nproc)}; do
                for tree in $TREES; do
                    "$W/host_op-$tree" $pg "$th" ${KX_HOST_OP_ARGS:-8 1305 20} | sed "s/^{/{\"tree\": \"$tree\", /"
                done
            done
        done
    done
    "$W/host_pages" 32 4608 2400 512
    "$W/host_pages" 32 8704 700 512
} | tee "$OUT/host-op.jsonl"
echo "done ($(( $(date +%s) - t0 )) s)"
