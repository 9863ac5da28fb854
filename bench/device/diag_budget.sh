#!/usr/bin/env bash
# On the GPU machine: kairox-bench under VRAM budgets on a small model (KB-350M F16 and its
# pack, written during the build), each run verbose, to see the budget's dense placement and
# where a run stops; with gdb, a backtrace of one budgeted run. Results to $OUT.
#
#   bash bench/device/diag_budget.sh        # repo root; carry vendor/llama.cpp and .whl
#   KX_DIAG_BUDGETS="0.3 0.6 2"             # GiB
set -uo pipefail
. bench/device/env.sh
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_CUDA_ARCHITECTURES=90 \
    > "$W/kx-configure.log" || exit 1
cmake --build "$W/build-kx" -j "$(nproc)" --target llama llama-bench > "$W/kx-build.log" 2>&1 \
    || { tail -20 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B
M=/tmp/kxbench/KB-350M-f16.gguf
mkdir -p /tmp/kxbench
[ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset KB-350M -o "$M" --pack -q > "$OUT/synth.log" 2>&1 \
    || { tail -5 "$OUT/synth.log"; exit 1; }
for b in ${KX_DIAG_BUDGETS:-0.3 0.6 2}; do
    timeout 60 "$B/llama-bench" -m "$M" -p 0 -n 16 -r 1 -t "$(nproc)" -o md --vram-budget "${b}GiB" --sparse predicted \
        -fa 1 -v > "$OUT/diag-$b.log" 2>&1
    echo "budget $b GiB: rc=$?"
    grep -E "^kairox|free\(\)|error|tg16" "$OUT/diag-$b.log" | cut -c1-400 | tail -6
done
if command -v gdb > /dev/null; then
    timeout 90 gdb -batch -ex run -ex bt --args "$B/llama-bench" -m "$M" -p 0 -n 16 -r 1 -t "$(nproc)" \
        --vram-budget "${KX_DIAG_GDB:-0.3}GiB" --sparse predicted -fa 1 2>&1 | grep -E "^#|signal" | head -40
fi
echo "done ($(( $(date +%s) - t0 )) s)"
