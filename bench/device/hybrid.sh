#!/usr/bin/env bash
# On the GPU machine: build kairox with CUDA and test-backend-ops, run the kx ops' CUDA
# kernels against the CPU reference, the hybrid-layer tests on the GPU, and (optionally)
# the static-hybrid offload benchmark rows. Results and logs to $OUT.
#
#   bash bench/device/hybrid.sh                 # repo root; carry vendor/llama.cpp and .whl
#   KX_BENCH="KB-7B" bash bench/device/hybrid.sh  # also the offload rows of those configs
#   KX_BENCH_ARGS="--no-dense --ab-pageable" ...  # more offload.py arguments
#   KX_SYNTH_BG="KB-70B" ...     # write that model during the build, then its pack (in its own
#                                session: a pack that outlasts the call is waited for by the next)
#   KX_SKIP_TESTS=1 ...          # a warm rerun: no test-backend-ops, no pytest
#   KX_SKIP_OPS=1 ...            # no test-backend-ops (CUDA sources unchanged since a checked run)
#   KX_TEST_TIMEOUT=300 ...      # stop pytest after that many seconds (a hang must not eat the call)
#   KX_RELOAD=1 ...              # the reload transfer methods (bench/reload.py)
#   KX_LIVE="KB-7B" ...          # the live balancer ablation (bench/balance_live.py) of those configs
#   KX_LIVE_SESSIONS="code,prose,dialogue,code code" ...  # ... on these session workloads (one run each)
#   KX_NCU="KB-7B" ...           # after the rows: every kernel's time over a few decoded tokens of the
#                                static split (Nsight Compute, bench/kernel_profile.py; KX_NCU_ARGS: tpot.py's)
#   KX_AFTER="cmd" ...           # a last command, with $B (the build's bin/) and $OUT set
set -uo pipefail
. bench/device/env.sh
mkdir -p /tmp/kxbench
bg_model() {  # "PRESET PATH": a configuration's preset and where offload.py looks for its model
    python3 -c "import sys; sys.path.insert(0, 'bench'); from offload import CONFIGS; from kairox.synth import PRESETS; \
p = CONFIGS['$1'][0]; print(p, f'/tmp/kxbench/{p}-{PRESETS[p].ftype}.gguf')"
}
for cfg in ${KX_SYNTH_BG:-}; do
    read -r pre m < <(bg_model "$cfg")
    [ -f "$m" ] || (nice python3 -m kairox synth --preset "$pre" -o "$m" -q > "$OUT/synth-$cfg.log" 2>&1 &)
done
# only what this script runs (libllama, llama-bench, test-backend-ops): the build tree's
# bin/ holds the shared libraries next to the tools
ops=test-backend-ops  # not built when neither the op checks nor their perf run (saves ~100 s)
[ -n "${KX_SKIP_OPS:-}${KX_SKIP_TESTS:-}" ] && [ -z "${KX_PERF:-}" ] && ops=
KX_CMAKE_ARGS=-DKAIROX_BUILD_TESTS=ON kx_build llama llama-bench $ops || exit 1
[ -z "${KX_SKIP_TESTS:-}${KX_SKIP_OPS:-}" ] && for op in KX_SELECT KX_MUL_MAT_ROWS KX_AXPY_ROWS; do
    "$B/test-backend-ops" -b CUDA0 -o "$op" > "$OUT/test-backend-ops-$op.log" 2>&1
    echo "test-backend-ops $op: rc=$? $(grep -cE '^\s+.*OK' "$OUT/test-backend-ops-$op.log") OK, $(grep -c FAIL "$OUT/test-backend-ops-$op.log") FAIL; $(tail -1 "$OUT/test-backend-ops-$op.log")"
done
if [ -n "${KX_PERF:-}" ]; then
    "$B/test-backend-ops" perf -b CUDA0 -o KX_MUL_MAT_ROWS > "$OUT/test-backend-ops-perf.log" 2>&1
    "$B/test-backend-ops" perf -b CUDA0 -o KX_AXPY_ROWS >> "$OUT/test-backend-ops-perf.log" 2>&1
fi
[ -z "${KX_SKIP_TESTS:-}" ] && timeout "${KX_TEST_TIMEOUT:-0}" python3 -m pytest -q -p no:cacheprovider \
    ${KX_TESTS:-tests/test_hybrid.py tests/test_sparse_ops.py tests/test_budget.py tests/test_trace.py tests/test_pack.py} \
    2>&1 | tee "$OUT/pytest.log" | tail -15
echo "tests done ($(( $(date +%s) - t0 )) s)"
df -h /tmp | tail -1
wait_for() {  # PATTERN: until no such process runs or the call's deadline is near
    while pgrep -f "$1" > /dev/null; do
        [ $(( $(date +%s) - t0 )) -gt $(( ${KX_DEADLINE:-575} - 15 )) ] && return 1
        sleep 2
    done
}
for cfg in ${KX_SYNTH_BG:-}; do
    read -r pre m < <(bg_model "$cfg")
    wait_for "kairox synth --preset $pre -o" || echo "synth $cfg still running"
    echo "synth $cfg (model) done at $(( $(date +%s) - t0 )) s: $(cat "$OUT/synth-$cfg.log" 2>/dev/null | tail -1)"
    # The pack runs in its own session (setsid), so a call's end does not stop it: when it
    # outlasts this call, the next call (same KX_SYNTH_BG, machine still warm) waits for it.
    if [ -f "${m%.gguf}.kxpack.gguf" ]; then echo "pack $cfg exists"
    elif pgrep -f "synth --preset $pre -o $m --pack-only" > /dev/null; then echo "pack $cfg running (an earlier call's)"
    else
        rm -f /tmp/kxbench/.*.tmp  # a pack cut short by a machine that went back
        setsid nohup python3 -m kairox synth --preset "$pre" -o "$m" --pack-only -q > "$W/pack-$cfg.log" 2>&1 < /dev/null &
        sleep 1
    fi
    wait_for "synth --preset $pre -o $m --pack-only" || echo "pack $cfg continues after this call (log $W/pack-$cfg.log)"
    [ -f "${m%.gguf}.kxpack.gguf" ] && echo "synth $cfg (pack) done at $(( $(date +%s) - t0 )) s: $(tail -1 "$W/pack-$cfg.log" 2>/dev/null)"
    df -h /tmp | tail -1
done
for cfg in ${KX_BENCH:-}; do
    python3 bench/offload.py --config "$cfg" --stock-bin "$B" --kairox-bin "$B" --kairox-lib "$B" \
        --work /tmp/kxbench --out "$OUT" --reps 1 --modes "${KX_MODES:-predicted,hybrid}" --no-baseline ${KX_KEEP:+--keep} \
        ${KX_BENCH_ARGS:-} || echo "config $cfg FAILED"
    echo "config $cfg done at $(( $(date +%s) - t0 )) s"
done
# slot reload transfer methods, and the live balancer's ablation (KX_LIVE configs)
[ -n "${KX_RELOAD:-}" ] && { python3 bench/reload.py --out "$OUT" ${KX_RELOAD_ARGS:-} > "$OUT/reload.log" 2>&1 \
    || echo "reload bench FAILED"; tail -40 "$OUT/reload.log"; echo "reload bench done at $(( $(date +%s) - t0 )) s"; }
for cfg in ${KX_LIVE:-}; do
  for sess in ${KX_LIVE_SESSIONS:-none}; do
    python3 bench/balance_live.py --config "$cfg" --work /tmp/kxbench --out "$OUT" ${KX_LIVE_ARGS:-} \
        $([ "$sess" = none ] || echo "--session $sess") || echo "live $cfg $sess FAILED"
  done
    for t in $(ls "$OUT"/balance-live-"$cfg"*.jsonl 2>/dev/null | sed "s/\.jsonl$//"); do
        [ -f "$t.jsonl" ] && python3 -m kairox report "$t.jsonl" --png "$t.png" && gzip -f "$t.jsonl"
    done
    echo "live $cfg done at $(( $(date +%s) - t0 )) s"
done
# where a layer step's device time goes: Nsight Compute times each kernel of a short static
# decode (CUDA graphs off, so each kernel is a launch; clocks and caches left alone)
for cfg in ${KX_NCU:-}; do
    read -r pre m < <(bg_model "$cfg")
    bud=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from offload import CONFIGS; print(CONFIGS['$cfg'][1])")
    tok=/tmp/kxbench/ncu-$cfg.tokens.json
    python3 -c "import json, sys; t = json.load(open(sys.argv[1])); json.dump(t[:64 + 40], open(sys.argv[2], 'w'))" \
        "${m%.gguf}.drift64.tokens.json" "$tok" || { echo "ncu $cfg: no token file (run KX_LIVE first)"; continue; }
    left=$(( ${KX_DEADLINE:-575} - 10 - ($(date +%s) - t0) ))
    [ "$left" -gt 30 ] || { echo "ncu $cfg: no time left"; continue; }
    GGML_CUDA_DISABLE_GRAPHS=1 timeout "$left" ncu --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --launch-skip "${KX_NCU_SKIP:-16000}" --launch-count "${KX_NCU_COUNT:-2400}" \
        --csv --log-file "$OUT/ncu-$cfg.csv" \
        python3 bench/tpot.py --impl kairox --mode predicted --model "$m" --tokens "$tok" --prompt-len 64 --ngl 999 \
        --threads "$(nproc)" --vram-budget "${bud}GiB" --balancer static ${KX_NCU_ARGS:-} > "$OUT/ncu-$cfg.log" 2>&1
    echo "ncu $cfg: rc=$? at $(( $(date +%s) - t0 )) s"
    python3 bench/kernel_profile.py "$OUT/ncu-$cfg.csv" -o "$OUT/kernel-profile-$cfg.md" | tail -40
    gzip -f "$OUT/ncu-$cfg.csv"
done
# (an if: a last `[ ] &&` would make the call's status 1 whenever nothing follows)
if [ -n "${KX_AFTER:-}" ]; then
    eval "$KX_AFTER"; echo "after: rc=$? at $(( $(date +%s) - t0 )) s"
fi
