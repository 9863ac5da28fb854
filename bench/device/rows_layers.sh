#!/usr/bin/env bash
# On the GPU machine: the device kernels of a hybrid layer step, timed by Nsight Compute on a
# few layers of a preset's shape (the same kernels and list sizes as the whole model: the
# per-layer figures compare with a whole model's kernel profile, at a fraction of the time to
# write, quantize and profile it). Builds kairox with CUDA, checks the row ops on CUDA
# (test-backend-ops), writes the preset with KX_RL_LAYERS layers (F16, then KX_RL_TYPE with
# this build's llama-quantize) and its pack, then profiles bench/tpot.py's decode at
# KX_RL_SLOTS neuron slots per layer. Results to $OUT.
#
#   bash bench/device/rows_layers.sh                  # repo root; carry vendor/llama.cpp and .whl
#   KX_RL_PRESET=KB-7B KX_RL_LAYERS=4 KX_RL_TYPE=Q4_K_M KX_RL_SLOTS=4166   # the defaults
#   KX_RL_OPS="KX_SELECT"                  # the ops test-backend-ops checks (default: the three)
#   KX_TESTS="tests/..."                   # these GPU tests right after the build
#   KX_RL_AB="--no-kx-warm" KX_RL_ROUNDS=3      # instead of the profile: kairox-bench decode rows
#                                          # at KX_RL_SLOTS slots, without and with these flags,
#                                          # interleaved ($OUT/ab-layers.json, medians printed;
#                                          # KX_COMMIT names this tree's commit there)
set -uo pipefail
. bench/device/env.sh
PRESET=${KX_RL_PRESET:-KB-7B}
LAYERS=${KX_RL_LAYERS:-4}
TYPE=${KX_RL_TYPE:-Q4_K_M}
SLOTS=${KX_RL_SLOTS:-4166}
D=/tmp/kxbench/layers
mkdir -p "$D"
F=$D/$PRESET-l$LAYERS-f16.gguf
Q=$D/$PRESET-l$LAYERS-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf
# the preset's shape with fewer layers, written while the build runs
synth() { python3 -m kairox synth --preset "$PRESET" --layers "$LAYERS" "$@"; }
[ -f "$Q" ] || (synth -o "$F" -q > "$OUT/synth.log" 2>&1 &)
KX_CMAKE_ARGS="-DKAIROX_BUILD_TESTS=ON ${KX_CMAKE_ARGS:-}" kx_build llama llama-bench llama-quantize test-backend-ops || exit 1
export KAIROX_BIN_DIR=$B
for op in ${KX_RL_OPS:-KX_MUL_MAT_ROWS KX_AXPY_ROWS KX_SELECT}; do
    "$B/test-backend-ops" -b CUDA0 -o "$op" > "$OUT/test-backend-ops-$op.log" 2>&1
    echo "test-backend-ops $op: rc=$? $(grep -cE '^\s+.*OK' "$OUT/test-backend-ops-$op.log") OK, $(grep -c FAIL "$OUT/test-backend-ops-$op.log") FAIL"
done
grep -h FAIL "$OUT"/test-backend-ops-*.log | head -5
kx_gpu_tests 120
if [ ! -f "$Q" ]; then
    kx_wait_model "synth --preset $PRESET" "$F" || exit 1
    "$B/llama-quantize" "$F" "$Q" "$TYPE" "$(nproc)" > "$OUT/quantize.log" 2>&1 || { tail -20 "$OUT/quantize.log"; exit 1; }
    rm -f "$F"
fi
[ -f "${Q%.gguf}.kxpack.gguf" ] || synth -o "$Q" --pack-only -q > "$OUT/pack.log" 2>&1 || { tail -5 "$OUT/pack.log"; exit 1; }
echo "model and pack ($(( $(date +%s) - t0 )) s)"
if [ -n "${KX_RL_AB:-}" ]; then
    for r in $(seq "${KX_RL_ROUNDS:-3}"); do
        for flags in "" "$KX_RL_AB"; do
            f=$OUT/ab-$r-${#flags}.json
            "$B/llama-bench" -m "$Q" -p 0 -n 128 -r 1 -t "$(nproc)" -o json --sparse predicted --gpu-slots "$SLOTS" \
                $flags > "$f" 2> "${f%.json}.log"
            echo "round $r [${flags:-default}]: rc=$?"
        done
    done
    # one results file (KX_COMMIT: set it from the development machine, this copy has no history)
    python3 - "$OUT" "$KX_RL_AB" "$Q" "${KX_COMMIT:-unknown}" <<'PY'
import glob, json, os, statistics, sys
out, ab, model, commit = sys.argv[1:]
rows = []
for f in sorted(glob.glob(f"{out}/ab-*-*.json")):
    r, k = os.path.basename(f)[3:-5].split("-")
    b = json.load(open(f))[0]
    rows.append({"round": int(r), "flags": ab if k != "0" else "", "tok_s": round(b["avg_ts"], 2), "llama_bench": b})
    os.remove(f)
med = {name: statistics.median(r["tok_s"] for r in rows if bool(r["flags"]) == on) for name, on in (("default", False), (ab, True))}
json.dump({"command": "KX_RL_AB=" + ab + " bash bench/device/rows_layers.sh", "commit": commit, "model": model,
           "machine": {"gpu": rows[0]["llama_bench"]["gpu_info"], "cpu": rows[0]["llama_bench"]["cpu_info"]},
           "rows": rows, "medians": med}, open(f"{out}/ab-layers.json", "w"), indent=1)
print("medians tok/s:", med)
PY
    exit 0
fi
python3 -c "import json, sys; json.dump(list(range(1000, 1256)), open(sys.argv[1], 'w'))" "$D/tokens.json"
GGML_CUDA_DISABLE_GRAPHS=1 timeout 150 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \
    --launch-skip "${KX_NCU_SKIP:-2000}" --launch-count "${KX_NCU_COUNT:-1500}" --csv --log-file "$OUT/ncu-layers.csv" \
    python3 bench/tpot.py --impl kairox --mode predicted --model "$Q" --tokens "$D/tokens.json" --prompt-len 64 \
    --ngl 999 --threads 8 --gpu-slots "$SLOTS" > "$OUT/ncu-layers.log" 2>&1
echo "ncu: rc=$? ($(( $(date +%s) - t0 )) s)"
python3 bench/kernel_profile.py "$OUT/ncu-layers.csv" -o "$OUT/kernel-profile-layers.md" | tail -32
gzip -f "$OUT/ncu-layers.csv"
