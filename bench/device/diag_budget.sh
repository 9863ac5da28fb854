#!/usr/bin/env bash
# On the GPU machine: kairox-bench under VRAM budgets on a small model (KB-350M F16 and its
# pack, written during the build), each run verbose, to see the budget's dense placement and
# where a run stops (an over-budget refusal names llama.cpp's device buffers after the warm-up).
# Results to $OUT.
#
#   bash bench/device/diag_budget.sh        # repo root; carry vendor/llama.cpp and .whl
#   KX_DIAG_BUDGETS="0.3 0.6 2"             # GiB
#   KX_TESTS="tests/test_budget.py"         # also these GPU tests, after the build
set -uo pipefail
. bench/device/env.sh
M=/tmp/kxbench/KB-350M-f16.gguf
mkdir -p /tmp/kxbench
# the model during the build; its pack after it (profiling runs the built library)
[ -f "$M" ] || (nice python3 -m kairox synth --preset KB-350M -o "$M" -q > "$OUT/synth.log" 2>&1 &)
kx_build llama llama-bench || exit 1
kx_gpu_tests 120
while pgrep -f "kairox synth --preset KB-350M" > /dev/null; do sleep 1; done
[ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset KB-350M -o "$M" --pack-only -q >> "$OUT/synth.log" 2>&1 \
    || { tail -5 "$OUT/synth.log"; exit 1; }
for b in ${KX_DIAG_BUDGETS:-0.3 0.6 2}; do
    timeout 60 "$B/llama-bench" -m "$M" -p 0 -n 16 -r 1 -t "$(nproc)" -o md --vram-budget "${b}GiB" --sparse predicted \
        -fa 1 -v > "$OUT/diag-$b.log" 2>&1
    echo "budget $b GiB: rc=$?"
    grep -E "^kairox|error|tg16|compute buffer size" "$OUT/diag-$b.log" | cut -c1-600 | tail -8
done
echo "done ($(( $(date +%s) - t0 )) s)"
