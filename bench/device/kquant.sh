#!/usr/bin/env bash
# On the GPU machine: a K-quant model in the hybrid. Builds kairox with CUDA (libllama, the
# tools, llama-quantize, test-backend-ops) while KB-7B F16 is written, checks the row ops'
# CUDA kernels against the CPU (test-backend-ops, K-quant cases included), quantizes KB-7B to
# Q4_K_M with the same build's llama-quantize and writes that model's pack, then measures it
# at a VRAM budget through the binaries (bench/tools_bench.py: llama.cpp's largest fitting
# -ngl with -fa 0 and 1, kairox-bench, kairox-completion, kairox run) and per token
# (bench/offload.py: TPOT p50/p99). Results to $OUT.
#
#   bash bench/device/kquant.sh          # repo root; carry vendor/llama.cpp and .whl
#   KX_TESTS="tests/..." ...            # these tests on the GPU once the pack is written
#   KX_TEST_TIMEOUT=200 ...             # stop pytest after that many seconds
#   KX_OPS="KX_SELECT" ...              # the ops test-backend-ops checks (default: the kx ops and MUL_MAT_SHARED_X)
#   KX_KQ_BUDGET=3GiB KX_KQ_TYPE=Q4_K_M # the budget and the quantization (defaults shown)
#   KX_KQ_STAGE=prepare ...             # build, checks, tests, model and pack only (a first call;
#                                       # the next call on the still-warm machine finds them)
#   KX_KQ_STAGE=ncu ...                 # none of the timed rows: only KX_KQ_NCU's profiles
#   KX_KQ_STAGE=tpot ...                # only the per-token run (TPOT p50/p99, trace): a call after
#                                       # one that measured the binaries' rows on the same machine
#   KX_ROUNDS=3 ...                     # interleaved rounds of the binaries' rows
#   KX_KQ_ROWS="mapped 0.3=--mapped-share 0.3;no warm=--no-kx-warm"  # more kairox-completion rows
#   KX_KQ_BENCH_ROWS="no warm=--no-kx-warm"  # more kairox-bench rows (each searched thread count)
#   KX_KQ_NAME=tools-bench-x ...        # the results' file stem
#   KX_KQ_THREADS="8,16" ...            # thread counts searched for llama.cpp's and kairox-bench's rows
#   KX_KQ_DOWN="q4_k q6_k" ...          # also packs with these down-row types (the model
#                                       # linked under another name, its pack written the same
#                                       # way), each a kairox-completion row with --sparse-pack
#   KX_KQ_PRED="f16" ...                # the same for packs with these predictor types
#   KX_KQ_NCU="3 8" ...                 # Nsight Compute's kernel times of the hybrid at these budgets
#                                       # (GiB) and of llama.cpp with every layer on the GPU
set -uo pipefail
. bench/device/env.sh
mkdir -p /tmp/kxbench
TYPE=${KX_KQ_TYPE:-Q4_K_M}
BUDGET=${KX_KQ_BUDGET:-3GiB}
F=/tmp/kxbench/KB-7B-f16.gguf
Q=/tmp/kxbench/KB-7B-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf
[ -f "$F" ] || [ -f "$Q" ] || (python3 -m kairox synth --preset KB-7B -o "$F" -q > "$OUT/synth.log" 2>&1 &)
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_BUILD_TESTS=ON \
    -DKAIROX_CUDA_ARCHITECTURES=90 > "$W/kx-configure.log" || exit 1
# niced: the model written beside it is the longer path (F16 KB-7B ~285 s beside the build, ~46 s alone)
nice -n 10 cmake --build "$W/build-kx" -j "$(nproc)" \
    --target llama llama-bench llama-completion llama-quantize test-backend-ops > "$W/kx-build.log" 2>&1 \
    || { tail -30 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
if [ -z "${KX_SKIP_OPS:-}" ] && [ ! -f "$OUT/.ops-done" ]; then
    for op in ${KX_OPS:-KX_MUL_MAT_ROWS KX_AXPY_ROWS KX_SELECT MUL_MAT_SHARED_X}; do
        "$B/test-backend-ops" -b CUDA0 -o "$op" > "$OUT/test-backend-ops-$op.log" 2>&1
        echo "test-backend-ops $op: rc=$? $(grep -cE '^\s+.*OK' "$OUT/test-backend-ops-$op.log") OK, $(grep -c FAIL "$OUT/test-backend-ops-$op.log") FAIL; $(tail -1 "$OUT/test-backend-ops-$op.log")"
    done
    grep -h FAIL "$OUT"/test-backend-ops-*.log | head -5
    touch "$OUT/.ops-done"
fi
# the model: F16 written during the build, quantized with this build, its pack (the pack's
# profile runs the model on the GPU)
if [ ! -f "$Q" ]; then
    while pgrep -f "kairox synth --preset KB-7B -o $F" > /dev/null; do sleep 2; done
    echo "f16 model ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/synth.log" 2>/dev/null)"
    "$B/llama-quantize" "$F" "$Q" "$TYPE" "$(nproc)" > "$OUT/quantize.log" 2>&1 || { tail -20 "$OUT/quantize.log"; exit 1; }
    rm -f "$F"
    echo "quantized to $TYPE ($(( $(date +%s) - t0 )) s): $(du -h "$Q" | cut -f1)"
fi
if [ ! -f "${Q%.gguf}.kxpack.gguf" ] && ! pgrep -f "pack-only" > /dev/null; then
    rm -f /tmp/kxbench/.*.tmp
    # its own session: a pack that outlasts this call is waited for by the next one
    setsid nohup python3 -m kairox synth --preset KB-7B -o "$Q" --pack-only -q > "$W/pack.log" 2>&1 < /dev/null &
    sleep 1
fi
while pgrep -f "pack-only" > /dev/null; do
    [ $(( $(date +%s) - t0 )) -gt 560 ] && { echo "pack still running (log $W/pack.log)"; exit 0; }
    sleep 2
done
echo "pack ($(( $(date +%s) - t0 )) s): $(tail -1 "$W/pack.log")"
# the tests after the pack: its profile runs on the same GPU, and the budget tests read the
# device's free memory (with the pack beside them a load measured another process's memory)
if [ -n "${KX_TESTS:-}" ]; then
    timeout "${KX_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "tests done ($(( $(date +%s) - t0 )) s)"
fi
rows=()
# each extra pack: the model linked under another name, its pack written with one option changed
for spec in $(for d in ${KX_KQ_DOWN:-}; do echo "down-type:$d"; done; for t in ${KX_KQ_PRED:-}; do echo "pred-type:$t"; done); do
    opt=${spec%%:*} val=${spec#*:}
    Qd=${Q%.gguf}-${opt%%-*}$val.gguf
    [ -e "$Qd" ] || ln "$Q" "$Qd"
    if [ ! -f "${Qd%.gguf}.kxpack.gguf" ]; then
        rm -f /tmp/kxbench/.*.tmp
        python3 -m kairox synth --preset KB-7B -o "$Qd" --pack-only --$opt "$val" -q > "$W/pack-$val.log" 2>&1 \
            || { tail -5 "$W/pack-$val.log"; exit 1; }
        echo "pack $opt $val ($(( $(date +%s) - t0 )) s): $(tail -1 "$W/pack-$val.log")"
    fi
    rows+=(--completion-row "${opt%%-*} $val=--sparse-pack ${Qd%.gguf}.kxpack.gguf")
done
[ "${KX_KQ_STAGE:-}" = prepare ] && exit 0
if [ "${KX_KQ_STAGE:-}" != ncu ]; then
    IFS=';' read -ra extra <<< "${KX_KQ_ROWS:-}"
    for r in "${extra[@]}"; do rows+=(--completion-row "$r"); done
    IFS=';' read -ra extra <<< "${KX_KQ_BENCH_ROWS:-}"
    for r in "${extra[@]}"; do rows+=(--bench-row "$r"); done
    if [ "${KX_KQ_STAGE:-}" != tpot ]; then
        python3 bench/tools_bench.py --model "$Q" --budget "$BUDGET" --ngl auto --bin "$B" --out "$OUT" \
            --rounds "${KX_ROUNDS:-3}" --gen 128 --threads "$(nproc)" "${rows[@]}" ${KX_KQ_NAME:+--name "$KX_KQ_NAME"} \
            ${KX_KQ_THREADS:+--bench-threads "$KX_KQ_THREADS"} \
            || echo "tools_bench FAILED"
        echo "tools_bench done ($(( $(date +%s) - t0 )) s)"
    fi
    if [ -n "${KX_KQ_TPOT:-}" ] || [ "${KX_KQ_STAGE:-}" = tpot ]; then
        python3 bench/offload.py --config KB-7B --model "$Q" --budget "${BUDGET%GiB}" \
            --stock-bin "$B" --kairox-bin "$B" --kairox-lib "$B" --work /tmp/kxbench --out "$OUT" --reps 1 \
            --modes hybrid --no-dense --keep --note "KB-7B $TYPE (llama-quantize of the F16 synth)" || echo "offload FAILED"
    fi
fi
# where a layer step's device time goes: each kernel of a few decoded tokens timed alone by Nsight
# Compute (CUDA graphs off; clocks and caches left alone), the hybrid at each budget of KX_KQ_NCU
# (GiB) and llama.cpp with every layer on the GPU
ncu_run() { # NAME COMMAND...: the CSV, its per-step table, then the CSV compressed
    local name=$1
    shift
    GGML_CUDA_DISABLE_GRAPHS=1 timeout "${KX_NCU_TIMEOUT:-150}" ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --launch-skip "${KX_NCU_SKIP:-6000}" --launch-count "${KX_NCU_COUNT:-2000}" \
        --csv --log-file "$OUT/ncu-$name.csv" "$@" > "$OUT/ncu-$name.log" 2>&1
    echo "ncu $name: rc=$? at $(( $(date +%s) - t0 )) s"
    python3 bench/kernel_profile.py "$OUT/ncu-$name.csv" -o "$OUT/kernel-profile-$name.md" | tail -25
    gzip -f "$OUT/ncu-$name.csv"
}
# the decoded tokens of the hybrid's profile: KX_KQ_TPOT's run writes them, or here
[ -z "${KX_KQ_NCU:-}" ] || [ -f "${Q%.gguf}.tokens.json" ] || python3 -c "import sys; sys.path.insert(0, 'bench')
from pathlib import Path; from offload import write_tokens; write_tokens(Path('$Q'), Path('${Q%.gguf}.tokens.json'))"
for b in ${KX_KQ_NCU:-}; do
    ncu_run "hybrid-${b}GiB" python3 bench/tpot.py --impl kairox --mode predicted --model "$Q" \
        --tokens "${Q%.gguf}.tokens.json" --prompt-len 64 --ngl 999 --threads 8 --vram-budget "${b}GiB"
done
[ -z "${KX_KQ_NCU:-}" ] || ncu_run dense-ngl99 "$B/llama-bench" -m "$Q" -p 0 -n 16 -r 1 -t 8 -ngl 99 -fa 1
echo "all done ($(( $(date +%s) - t0 )) s)"
