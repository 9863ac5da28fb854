#!/usr/bin/env bash
# On the GPU machine, after bench/device/kquant.sh built kairox and wrote KB-7B Q4_K_M and its
# pack (the same warm machine): the held hand-off (kx_params.hold) on and off, interleaved.
#   - per-token counters (bench/tpot.py, 8 threads) at each budget of KX_HOLD_GIB: the
#     scheduler's host time per phase with and without the hold, KX_HOLD_ROUNDS pairs;
#   - kairox-bench at 8 GiB (every neuron in slots: the device's path alone) with and without
#     it, and llama.cpp with the whole model on the GPU.
# Results to $OUT: tpot-BUDGET-hold-{on,off}-R.json, budget-8GiB-hold.md.
#
#   bash bench/device/hold.sh        # repo root; carry vendor/llama.cpp and .whl
#   KX_HOLD_PRESET=KB-350M KX_HOLD_MIB="400 1000" bash bench/device/hold.sh
#                                    # on a fresh machine: builds, writes that synthetic F16 model
#                                    # and its pack, runs KX_TESTS, then the pairs at those budgets
#                                    # (MiB; no kairox-bench rows)
set -uo pipefail
. bench/device/env.sh
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
if [ -n "${KX_HOLD_PRESET:-}" ]; then
    [ -x "$B/llama-bench" ] || kx_build llama llama-bench || exit 1
    export KAIROX_BIN_DIR=$B
    kx_gpu_tests "${KX_TEST_TIMEOUT:-150}"
    M=/tmp/kxbench/$KX_HOLD_PRESET.gguf
    mkdir -p /tmp/kxbench
    [ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset "$KX_HOLD_PRESET" -o "$M" --pack --force -q > "$OUT/synth.log" 2>&1 \
        || { tail -5 "$OUT/synth.log"; exit 1; }
    echo "model and pack ($(( $(date +%s) - t0 )) s)"
else
    M=/tmp/kxbench/KB-7B-q4_k_m.gguf
fi
T=${M%.gguf}.tokens.json
[ -f "$M" ] && [ -f "${M%.gguf}.kxpack.gguf" ] || { echo "no model or pack: run bench/device/kquant.sh first"; exit 1; }
[ -f "$T" ] || python3 -c "import sys; sys.path.insert(0, 'bench')
from pathlib import Path; from offload import write_tokens; write_tokens(Path('$M'), Path('$T'))"
for r in $(seq 1 "${KX_HOLD_ROUNDS:-2}"); do
    for g in ${KX_HOLD_MIB:-3072 8192}; do
        for h in on off; do
            f=$OUT/tpot-${g}MiB-hold-$h-$r
            python3 bench/tpot.py --impl kairox --mode predicted --model "$M" --tokens "$T" --prompt-len 64 \
                --ngl 999 --threads 8 --vram-budget "${g}MiB" --hold "$h" > "$f.json" 2> "$f.log"
            python3 -c "import json, statistics as s; d = json.load(open('$f.json')); c = d['counters']; n = c['ffn_calls'] or 1
x = c['sched']; print('$g MiB hold $h ($r): tpot p50 %.3f ms; per layer us: cpu %.1f drain %.1f copy %.1f launch %.1f; held %d'
% (s.median(d['tpot_s']) * 1e3, x['cpu_ns'] / n / 1e3, x['drain_ns'] / n / 1e3, x['copy_ns'] / n / 1e3,
   x['launch_ns'] / n / 1e3, x['held']))" || tail -3 "$f.log"
        done
    done
done
[ -n "${KX_HOLD_PRESET:-}" ] && { echo "all done ($(( $(date +%s) - t0 )) s)"; exit 0; }
{
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md --vram-budget 8GiB --sparse predicted
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md --vram-budget 8GiB --sparse predicted --no-kx-hold
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md -ngl 99 -fa 1
} 2>&1 | grep -E "^\|" | tee "$OUT/budget-8GiB-hold.md"
echo "all done ($(( $(date +%s) - t0 )) s)"
