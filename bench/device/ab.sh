#!/usr/bin/env bash
# On the GPU machine, after hybrid.sh built this tree: the same decode measured on this build
# and on an earlier tree's, rows interleaved, so a change meant to keep behaviour shows its
# speed beside the old one on the same machine and minute (run after hybrid.sh, machine warm).
#
#   KX_AB_OLD=old-tree KX_AB_MODEL=/tmp/kxbench/KB-7B-f16.gguf bash bench/device/ab.sh
#   (old-tree: `git archive OLD -- . ':!bench/results' | tar -x -C old-tree`, carried; its
#    vendor/llama.cpp is this tree's, so patches/ must be the same)
#   KX_AB_CPU_ONLY=1 ...  # the old tree's CPU backend alone (libggml-cpu, a minute), loaded
#                         # in place of this build's by LD_LIBRARY_PATH: for a change that
#                         # touched only ggml_ext/cpu, without a second CUDA build (~5 min)
#   KX_AB_MODEL2=M2 ...    # also this build on M2 (e.g. the same model with another pack)
# Rows per round: kairox-bench and `kairox run` with KX_AB_FLAGS on each build. Writes
# $OUT/ab.json (every round; KX_COMMIT and KX_AB_COMMAND recorded: set them from the
# development machine, the copy here has no history) and prints the medians.
set -uo pipefail
. bench/device/env.sh
OLD=${KX_AB_OLD:?the earlier tree}
M=${KX_AB_MODEL:?a model with its pack}
FLAGS=${KX_AB_FLAGS:---vram-budget 7GiB --sparse predicted}
ROUNDS=${KX_AB_ROUNDS:-3}
kx_vendor_into "$OLD" || exit 1
if [ -n "${KX_AB_CPU_ONLY:-}" ]; then
    cmake -S "$OLD" -B "$W/build-old" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=OFF \
        > "$W/old-configure.log" || exit 1
    cmake --build "$W/build-old" -j "$(nproc)" --target ggml-cpu > "$W/old-build.log" 2>&1 \
        || { tail -20 "$W/old-build.log"; exit 1; }
    mkdir -p "$W/old-cpu"
    cp -a "$(dirname "$(find "$W/build-old" -name 'libggml-cpu.so' | head -1)")"/libggml-cpu.so* "$W/old-cpu/"
    # the tools' run path must let LD_LIBRARY_PATH win (RUNPATH, not RPATH): shown, then checked
    LD_LIBRARY_PATH=$W/old-cpu ldd "$W/build-kx/bin/llama-bench" | grep ggml-cpu
    LD_LIBRARY_PATH=$W/old-cpu ldd "$W/build-kx/bin/llama-bench" | grep -q "$W/old-cpu/libggml-cpu.so" \
        || { echo "old libggml-cpu not picked up"; exit 1; }
else
    cmake -S "$OLD" -B "$W/build-old" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON \
        -DKAIROX_CUDA_ARCHITECTURES=90 > "$W/old-configure.log" || exit 1
    cmake --build "$W/build-old" -j "$(nproc)" --target llama llama-bench > "$W/old-build.log" 2>&1 \
        || { tail -20 "$W/old-build.log"; exit 1; }
fi
echo "old build done ($(( $(date +%s) - t0 )) s)"
python3 - "$OLD" "$M" "$FLAGS" "$ROUNDS" "$W" "$OUT" "${KX_AB_CPU_ONLY:-}" "${KX_AB_MODEL2:-}" <<'PY'
import json, os, re, shlex, statistics, subprocess, sys
old, model, flags, rounds, w, out = sys.argv[1], sys.argv[2], shlex.split(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
cpu_only, model2 = sys.argv[7], sys.argv[8]
new_bin = f"{w}/build-kx/bin"
# name: (tools' folder, Python tree, model, extra environment)
builds = {"new": (new_bin, os.getcwd(), model, {})}
if cpu_only:
    builds["old"] = (new_bin, os.getcwd(), model, {"LD_LIBRARY_PATH": f"{w}/old-cpu"})
else:
    builds["old"] = (f"{w}/build-old/bin", old, model, {})
if model2:
    builds["new model2"] = (new_bin, os.getcwd(), model2, {})
prompt = "The history of the printing press begins in the fifteenth century, when movable type made books cheaper"
res = {}
for r in range(rounds):
    for name, (b, tree, model, extra) in builds.items():
        env = dict(os.environ, KAIROX_LIB_DIR=b, PYTHONPATH=f"/tmp/site:{tree}/python", **extra)
        p = subprocess.run([f"{b}/llama-bench", "-m", model, "-p", "0", "-n", "128", "-r", "1", "-t", "16", "-o", "json",
                            *flags], capture_output=True, text=True, env=env)
        res.setdefault(f"kairox-bench {name}", []).append(json.loads(p.stdout)[0]["avg_ts"] if p.returncode == 0 else None)
        p = subprocess.run([sys.executable, "-m", "kairox", "run", "-m", model, "-n", "128", "-t", "16", "-c", "256",
                            "-p", prompt, *flags], capture_output=True, text=True, env=env)
        m = re.search(r"decode ([\d.]+) tokens/s", p.stderr + p.stdout)
        res.setdefault(f"kairox run {name}", []).append(float(m.group(1)) if m else None)
        print(name, r, {k: v[-1] for k, v in res.items() if k.endswith(name)}, flush=True)
json.dump({"command": os.environ.get("KX_AB_COMMAND", ""), "commit": os.environ.get("KX_COMMIT", ""),
           "model": builds["new"][2], "model2": model2, "cpu_only": bool(cpu_only), "flags": flags, "rounds": res,
           "rows": [{"row": k, "tok_s": [x for x in v if x]} for k, v in res.items()]},
          open(f"{out}/ab.json", "w"), indent=1)
for k, v in res.items():
    v = [x for x in v if x]
    print(f"{k}: median {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else f"{k}: failed")
PY
echo "ab done ($(( $(date +%s) - t0 )) s)"
