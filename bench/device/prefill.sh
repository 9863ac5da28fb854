#!/usr/bin/env bash
# On the GPU machine, after hybrid.sh built kairox and kept a model (KX_KEEP=1): where a
# 512-token prefill's time goes, traced (--sched-trace): llama.cpp's own placement at -ngl (the
# dense path of kairox's build, llama.cpp's code) against the static hybrid at the same
# budget with page-locked and with pageable host weights. Results to $OUT/pp-*.json, each
# with its command, commit and machine.
#
#   KX_MODEL=/tmp/kxbench/KB-7B-f16.gguf KX_NGL=17 KX_BUDGET=7168MiB bash bench/device/prefill.sh
set -uo pipefail
. bench/device/env.sh
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B
M=$KX_MODEL
toks=/tmp/kxbench/$(basename "${M%.gguf}").tokens.json
stamp() {  # FILE COMMAND...: the raw result gets its command, commit and machine
    local f=$1; shift
    python3 -m kairox.bench "$f" --command "$*"
}
tok_s() { python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['result']; print(round((d[0]['avg_ts'] if isinstance(d, list) else d['pp_tok_s']), 1))" "$1"; }
# llama.cpp's default (the model mapped: CPU layers in pageable memory) and --no-mmap (-mmp 0:
# its CPU layers then go to the GPU's page-locked host buffer type)
for mmp in 1 0; do
    cmd=("$B/llama-bench" -m "$M" -ngl "$KX_NGL" -mmp $mmp -p 512 -n 0 -d 64 -r 2 -t "$(nproc)" -o json)
    "${cmd[@]}" > "$OUT/pp-ngl-mmp$mmp-bench.json" 2>/dev/null
    stamp "$OUT/pp-ngl-mmp$mmp-bench.json" "${cmd[@]}"
    echo "llama.cpp placement, -ngl $KX_NGL -mmp $mmp, untraced: $(tok_s "$OUT/pp-ngl-mmp$mmp-bench.json") tok/s"
done
# llama.cpp's placement traced: kairox dense at the same -ngl (the same graph and scheduler)
cmd=(python3 bench/tpot.py --impl kairox --mode dense --model "$M" --tokens "$toks" --ngl "$KX_NGL" --pp 512
     --sched-trace /tmp/pp-ngl.jsonl --sched-trace-max 1000000)
"${cmd[@]}" > /dev/null 2>&1
python3 -m kairox trace /tmp/pp-ngl.jsonl --breakdown --json "$OUT/pp-ngl.json"
stamp "$OUT/pp-ngl.json" "${cmd[@]}" "&&" kairox trace /tmp/pp-ngl.jsonl --breakdown
for pin in pinned pageable; do
    cmd=(python3 bench/tpot.py --impl kairox --mode predicted --model "$M" --tokens "$toks" --ngl 999
         --vram-budget "$KX_BUDGET" --pp 512 $([ $pin = pageable ] && echo --no-pinned)
         --sched-trace /tmp/pp-$pin.jsonl --sched-trace-max 1000000)
    "${cmd[@]}" > "$OUT/pp-$pin-tpot.json"
    stamp "$OUT/pp-$pin-tpot.json" "${cmd[@]}"
    echo "hybrid, $pin host weights, traced: $(tok_s "$OUT/pp-$pin-tpot.json") tok/s"
    python3 -m kairox trace /tmp/pp-$pin.jsonl --breakdown --json "$OUT/pp-$pin.json"
    stamp "$OUT/pp-$pin.json" kairox trace /tmp/pp-$pin.jsonl --breakdown "(the run of pp-$pin-tpot.json)"
done
echo "prefill traces done at $(( $(date +%s) - t0 )) s"
