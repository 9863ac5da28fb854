#!/usr/bin/env bash
# On the GPU machine, after bench/device/kquant.sh built kairox and wrote KB-7B Q4_K_M and its
# pack (the same warm machine): the held hand-off (kx_params.hold) on and off, interleaved.
#   - per-token counters (bench/tpot.py, 8 threads) at each budget of KX_HOLD_GIB: the
#     scheduler's host time per phase with and without the hold, KX_HOLD_ROUNDS pairs;
#   - kairox-bench at 8 GiB (every neuron in slots: the device's path alone) with and without
#     it, and llama.cpp with the whole model on the GPU.
# Results to $OUT: tpot-GIB-hold-{on,off}-R.json, budget-8GiB-hold.md.
#
#   bash bench/device/hold.sh        # repo root; carry vendor/llama.cpp and .whl
set -uo pipefail
. bench/device/env.sh
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
M=/tmp/kxbench/KB-7B-q4_k_m.gguf
T=${M%.gguf}.tokens.json
[ -f "$M" ] && [ -f "${M%.gguf}.kxpack.gguf" ] || { echo "no model or pack: run bench/device/kquant.sh first"; exit 1; }
[ -f "$T" ] || python3 -c "import sys; sys.path.insert(0, 'bench')
from pathlib import Path; from offload import write_tokens; write_tokens(Path('$M'), Path('$T'))"
for r in $(seq 1 "${KX_HOLD_ROUNDS:-2}"); do
    for g in ${KX_HOLD_GIB:-3 8}; do
        for h in on off; do
            f=$OUT/tpot-${g}GiB-hold-$h-$r
            python3 bench/tpot.py --impl kairox --mode predicted --model "$M" --tokens "$T" --prompt-len 64 \
                --ngl 999 --threads 8 --vram-budget "${g}GiB" --hold "$h" > "$f.json" 2> "$f.log"
            python3 -c "import json, statistics as s; d = json.load(open('$f.json')); c = d['counters']; n = c['ffn_calls'] or 1
x = c['sched']; print('$g GiB hold $h ($r): tpot p50 %.3f ms; per layer us: cpu %.1f drain %.1f copy %.1f launch %.1f; held %d'
% (s.median(d['tpot_s']) * 1e3, x['cpu_ns'] / n / 1e3, x['drain_ns'] / n / 1e3, x['copy_ns'] / n / 1e3,
   x['launch_ns'] / n / 1e3, x['held']))" || tail -3 "$f.log"
        done
    done
done
{
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md --vram-budget 8GiB --sparse predicted
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md --vram-budget 8GiB --sparse predicted --no-kx-hold
    "$B/llama-bench" -m "$M" -p 0 -n 128 -r 3 -t 8 -o md -ngl 99 -fa 1
} 2>&1 | grep -E "^\|" | tee "$OUT/budget-8GiB-hold.md"
echo "all done ($(( $(date +%s) - t0 )) s)"
