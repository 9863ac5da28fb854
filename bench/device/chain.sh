#!/usr/bin/env bash
# On the GPU machine, after bench/device/kquant.sh (KX_KQ_STAGE=prepare) left its build and
# KB-7B Q4_K_M with its pack in /tmp: where a decode step's time goes at the VRAM budget.
# A scheduler trace of kairox-completion's free generation (`kairox trace`: per layer the CPU
# part, the GPU part queued beside it, the hand-offs; a typical step's timeline and its
# longest splits), then kairox-bench over CPU thread counts and flash attention, and with
# CUDA graphs off (whether the GPU splits run as graphs). Results to $OUT.
#
#   bash bench/device/chain.sh           # repo root, on the machine kquant.sh prepared
#   KX_KQ_BUDGET=3GiB KX_KQ_TYPE=Q4_K_M  # as kquant.sh
#   KX_CHAIN_THREADS=4,8,12,16           # kairox-bench's -t values
set -uo pipefail
. bench/device/env.sh
TYPE=${KX_KQ_TYPE:-Q4_K_M}
BUDGET=${KX_KQ_BUDGET:-3GiB}
Q=/tmp/kxbench/KB-7B-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
[ -x "$B/llama-completion" ] && [ -f "$Q" ] || { echo "run bench/device/kquant.sh first (no build or model)"; exit 1; }
while pgrep -f "pack-only" > /dev/null; do sleep 2; done
[ -f "${Q%.gguf}.kxpack.gguf" ] || { echo "no pack for $Q"; exit 1; }
N=$(nproc)
FLAGS=(--vram-budget "$BUDGET" --sparse predicted)
"$B/llama-completion" -m "$Q" -p "The history of the city begins with" -n 192 -c 512 --temp 0 -no-cnv -t "$N" \
    "${FLAGS[@]}" --kx-sched-trace "$OUT/trace-chain.jsonl" > "$OUT/completion.txt" 2> "$OUT/completion.log" \
    || { tail -20 "$OUT/completion.log"; exit 1; }
grep -E "eval time|kairox" "$OUT/completion.log" | head -8
python3 -m kairox trace "$OUT/trace-chain.jsonl" --png "$OUT/trace-chain.png" --json "$OUT/trace-chain.json"
# a typical decode step (the median overlapped one): its longest splits, then per layer the
# CPU split, the GPU work between two CPU splits and the CPU's idle gap before its next split
python3 - "$OUT/trace-chain.jsonl" <<'PY' | tee "$OUT/trace-chain-step.txt"
import statistics as st, sys
from kairox.trace import breakdown, breakdown_text, by_graph, pick_graph, read_trace
recs, _ = read_trace(sys.argv[1])
g = pick_graph(recs)
print(breakdown_text(breakdown(recs, g, top=8)))
rs = sorted((r for r in by_graph(recs)[g] if r.part != "i"), key=lambda r: r.t0)
cpu = [r for r in rs if r.cpu]
rows = []
for a, b in zip(cpu, cpu[1:]):
    gpu = sum(r.us for r in rs if not r.cpu and a.t1 <= r.t0 < b.t0)
    rows.append((a.layer, a.us, gpu, b.t0 - a.t1))
for name, k in (("CPU split", 1), ("GPU between", 2), ("CPU idle gap", 3)):
    v = [x[k] for x in rows]
    print(f"{name}: median {st.median(v):.0f} us, max {max(v)} us, sum {sum(v) / 1e3:.2f} ms over {len(v)}")
PY
gzip -f "$OUT/trace-chain.jsonl"
echo "trace done ($(( $(date +%s) - t0 )) s)"
"$B/llama-bench" -m "$Q" -p 0 -n 128 -r 3 -t "${KX_CHAIN_THREADS:-4,8,12,16}" -fa 0,1 "${FLAGS[@]}" -o md \
    > "$OUT/threads.md" 2> "$OUT/threads.log" || tail -20 "$OUT/threads.log"
cat "$OUT/threads.md"
# whether the GPU splits run as CUDA graphs: the same rows with them off
GGML_CUDA_DISABLE_GRAPHS=1 "$B/llama-bench" -m "$Q" -p 0 -n 128 -r 3 -t "$N" -fa 0,1 "${FLAGS[@]}" -o md \
    > "$OUT/no-graphs.md" 2> "$OUT/no-graphs.log" || tail -20 "$OUT/no-graphs.log"
cat "$OUT/no-graphs.md"
echo "all done ($(( $(date +%s) - t0 )) s)"
