#!/usr/bin/env bash
# On the GPU machine: the mixture-of-experts model (KB-MoE: Qwen3-30B-A3B's shape in Q4_0,
# written during the build) under VRAM budgets. One verbose kairox-bench row shows the
# placement the budget chose, one more that --n-cpu-moe still works beside a budget, then
# bench/budget_sweep.py against llama.cpp's best -ngl / --n-cpu-moe placement. Results to $OUT.
#
#   bash bench/device/moe_budget.sh          # repo root; carry vendor/llama.cpp and .whl
#   KX_MOE_BUDGETS="4,8,12"                  # GiB (the sweep's)
#   KX_TESTS="tests/test_budget.py"          # also these GPU tests, after the build
#   KX_MOE_TPOT=1                            # then per-token decode times (TPOT p50/p99) at every budget
#   KX_DEADLINE=590                          # seconds from the start the sweep must end by
set -uo pipefail
. bench/device/env.sh
M=/tmp/kxbench/KB-MoE-q4_0.gguf
mkdir -p /tmp/kxbench
[ -f "$M" ] || (nice python3 -m kairox synth --preset KB-MoE -o "$M" -q > "$OUT/synth.log" 2>&1 &)
kx_build llama llama-bench || exit 1
kx_gpu_tests 150
kx_wait_model "kairox synth --preset KB-MoE" "$M" || exit 1
b1=${KX_MOE_BUDGETS:-4,8,12}
kx_budget_rows "$M" "${b1%%,*}" moe "" "-ncmoe 48"
timeout $(( ${KX_DEADLINE:-590} - ($(date +%s) - t0) )) python3 bench/budget_sweep.py --model "$M" \
    --budgets "${KX_MOE_BUDGETS:-4,8,12}" --sparse auto --bin "$B" --out "$OUT" --gen 32 --threads "$(nproc)" --prefill 512 \
    ${KX_MOE_TPOT:+--tpot}
echo "done ($(( $(date +%s) - t0 )) s)"
