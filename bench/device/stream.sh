#!/usr/bin/env bash
# On the GPU machine: streamed weights under a VRAM budget of whole tensors (a model without a
# pack). Writes the model during the build, runs one verbose kairox-bench row (the placement
# and what it streams), then bench/budget_sweep.py with a --no-kx-stream row beside each
# budget, against llama.cpp's best -ngl / -ot FFN-on-CPU placement. Results to $OUT.
#
#   bash bench/device/stream.sh              # repo root; carry vendor/llama.cpp and .whl
#   KX_STREAM_PRESET=KB-7B KX_STREAM_ACT=silu KX_STREAM_TYPE=f16   # the model (default)
#   KX_STREAM_QUANT=Q4_K_M                   # quantize it with this build's llama-quantize first
#   KX_STREAM_CEILING=1                      # also llama.cpp with the whole model on the GPU
#   KX_STREAM_BUDGETS="4,7"                  # GiB (the sweep's)
#   KX_STREAM_ROUNDS=3                       # interleaved rounds of the sweep
#   KX_TESTS="tests/test_budget.py"          # also these GPU tests, after the build
#   KX_STREAM_ALSO="no-stream=--no-kx-stream;migrate=--kx-migrate"   # the sweep's extra rows
#   KX_STREAM_ALSO=""                        # none (default: no-stream=--no-kx-stream)
#   KX_STREAM_HW=1                           # `kairox profile-hw` once (kept in $W), and a row
#                                            # priced at its rates (hw=--kx-hw-profile FILE)
#   KX_STREAM_HW_CPU="30,45,60"              # with KX_STREAM_HW: also a row per CPU rate (GB/s),
#                                            # the profile's copy with every CPU rate set to it
#   KX_STREAM_STRESS=cpu,pcie                # first bench/migrate_stress.py at the last budget
#   KX_STREAM_STRESS_ROUNDS=1 KX_STREAM_STRESS_TOKENS=160 KX_STREAM_STRESS_THREADS=8
#   KX_STREAM_STRESS_ROWS=off,threads        # its rows (bench/migrate_stress.py --rows)
#   KX_STREAM_PREFILL=512                    # also prefill that many tokens on every sweep row
#   KX_STREAM_TPOT=1                         # then per-token decode times (TPOT p50/p99) at every budget
#   KX_STREAM_TPOT="7,12"                    # ... at these budgets only (1 GiB alone: "1.0")
#   KX_DEADLINE=590                          # seconds from the start the sweep must end by
# Two calls on one warm machine (a 1-14 GiB sweep does not fit one call) merge into one table:
#   python3 bench/budget_sweep.py --merge A.json B.json --out DIR
set -uo pipefail
. bench/device/env.sh
pre=${KX_STREAM_PRESET:-KB-7B}; act=${KX_STREAM_ACT:-silu}; ty=${KX_STREAM_TYPE:-f16}
M=/tmp/kxbench/$pre-$act-$ty.gguf
mkdir -p /tmp/kxbench
[ -f "$M" ] || (nice python3 -m kairox synth --preset "$pre" --act "$act" --type "$ty" -o "$M" -q \
    > "$OUT/synth.log" 2>&1 &)
q=${KX_STREAM_QUANT:-}
kx_build llama llama-bench ${q:+llama-quantize} || exit 1
kx_gpu_tests 150
kx_wait_model "kairox synth --preset $pre" "$M" || exit 1
if [ -n "$q" ]; then
    Q=/tmp/kxbench/$pre-$act-$(echo "$q" | tr 'A-Z' 'a-z').gguf
    [ -f "$Q" ] || "$B/llama-quantize" "$M" "$Q" "$q" "$(nproc)" > "$OUT/quantize.log" 2>&1 \
        || { tail -20 "$OUT/quantize.log"; exit 1; }
    echo "quantized to $q ($(( $(date +%s) - t0 )) s): $(du -h "$Q" | cut -f1)"
    M=$Q
fi
if [ -n "${KX_STREAM_CEILING:-}" ]; then
    # what the whole model decodes at on the GPU: the ceiling no budget goes past
    "$B/llama-bench" -m "$M" -ngl 99 -fa 1 -p 0 -n 64 -r 3 -t "$(nproc)" -o md 2>&1 | grep -E "^\| " | tee "$OUT/ceiling.md"
fi
b1=${KX_STREAM_BUDGETS:-4,7}
also=()
IFS=';' read -ra rows <<< "${KX_STREAM_ALSO-no-stream=--no-kx-stream}"
if [ -n "${KX_STREAM_HW:-}" ]; then
    # measured on the idle machine (the build and the model are done): ~1 min, once per machine
    [ -f "$W/hw.json" ] || python3 -m kairox profile-hw -t "$(nproc)" -o "$W/hw.json" > "$OUT/profile-hw.log" 2>&1 \
        || { tail -5 "$OUT/profile-hw.log"; exit 1; }
    cp "$W/hw.json" "$OUT/" && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); \
print('profile-hw:', {k: d[k] for k in ('cpu_gbs', 'gpu_gbs', 'pcie_gbs', 'cpu_type_gbs')})" "$W/hw.json"
    rows+=("hw=--kx-hw-profile $W/hw.json")
    hw_cpu=${KX_STREAM_HW_CPU:-}
    for g in ${hw_cpu//,/ }; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); g=float(sys.argv[2]); d['cpu_gbs']=g; \
d['cpu_type_gbs']={t: g for t in d.get('cpu_type_gbs', {})}; json.dump(d, open(sys.argv[3], 'w'))" \
            "$W/hw.json" "$g" "$W/hw-cpu$g.json" || exit 1
        rows+=("hw-cpu$g=--kx-hw-profile $W/hw-cpu$g.json")
    done
fi
for r in "${rows[@]}"; do also+=(--also "$r"); done
kx_budget_rows "$M" "${b1##*,}" stream "" "${rows[@]#*=}"
if [ -n "${KX_STREAM_STRESS:-}" ]; then
    python3 bench/migrate_stress.py --model "$M" --budget "${b1##*,}GiB" --stress "$KX_STREAM_STRESS" \
        --rounds "${KX_STREAM_STRESS_ROUNDS:-1}" --tokens "${KX_STREAM_STRESS_TOKENS:-160}" \
        --threads "${KX_STREAM_STRESS_THREADS:-$(nproc)}" --rows "${KX_STREAM_STRESS_ROWS:-migrate,off}" --out "$OUT"
fi
timeout $(( ${KX_DEADLINE:-590} - ($(date +%s) - t0) )) python3 bench/budget_sweep.py --model "$M" \
    --budgets "$b1" --sparse auto "${also[@]}" --bin "$B" --out "$OUT" \
    --gen "${KX_STREAM_GEN:-32}" --threads "$(nproc)" --rounds "${KX_STREAM_ROUNDS:-3}" \
    ${KX_STREAM_PREFILL:+--prefill "$KX_STREAM_PREFILL"} ${KX_STREAM_TPOT:+--tpot $([ "$KX_STREAM_TPOT" = 1 ] || echo "$KX_STREAM_TPOT")}
echo "done ($(( $(date +%s) - t0 )) s)"
