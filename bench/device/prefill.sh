#!/usr/bin/env bash
# On the GPU machine, after hybrid.sh built kairox and kept a model (KX_KEEP=1): where a
# 512-token prefill's time goes, traced (KX_TRACE): llama.cpp's own placement at -ngl (the
# dense path of kairox's build, llama.cpp's code) against the static hybrid at the same
# budget with page-locked and with pageable host weights. Summaries to $OUT/pp-*.json.
#
#   KX_MODEL=/tmp/kxbench/KB-7B-f16.gguf KX_NGL=7 KX_BUDGET=7168MiB bash bench/device/prefill.sh
set -uo pipefail
. bench/device/env.sh
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KX_TRACE_MAX=1000000
M=$KX_MODEL
toks=/tmp/kxbench/$(basename "${M%.gguf}").tokens.json
# llama.cpp's default (the model mapped: CPU layers in pageable memory) and --no-mmap (-mmp 0:
# its CPU layers then go to the GPU's page-locked host buffer type)
for mmp in 1 0; do
    "$B/llama-bench" -m "$M" -ngl "$KX_NGL" -mmp $mmp -p 512 -n 0 -d 64 -r 2 -t "$(nproc)" -o json \
        > "$OUT/pp-ngl-mmp$mmp-bench.json" 2>/dev/null
    echo "llama.cpp placement, -ngl $KX_NGL -mmp $mmp, untraced: $(python3 -c "import json; print(round(json.load(open('$OUT/pp-ngl-mmp$mmp-bench.json'))[0]['avg_ts'], 1))") tok/s"
done
KX_TRACE=/tmp/pp-ngl.jsonl "$B/llama-bench" -m "$M" -ngl "$KX_NGL" -p 512 -n 0 -r 1 -t "$(nproc)" > /dev/null 2>&1
python3 -m kairox trace /tmp/pp-ngl.jsonl --breakdown --json "$OUT/pp-ngl.json"
for pin in pinned pageable; do
    KX_TRACE=/tmp/pp-$pin.jsonl python3 bench/tpot.py --impl kairox --mode predicted --model "$M" --tokens "$toks" \
        --ngl 999 --vram-budget "$KX_BUDGET" --pp 512 $([ $pin = pageable ] && echo --no-pinned) > /tmp/pp-$pin.tpot.json
    echo "hybrid, $pin host weights, traced: $(python3 -c "import json; print(round(json.load(open('/tmp/pp-$pin.tpot.json'))['pp_tok_s'], 1))") tok/s"
    python3 -m kairox trace /tmp/pp-$pin.jsonl --breakdown --json "$OUT/pp-$pin.json"
done
echo "prefill traces done at $(( $(date +%s) - t0 )) s"
