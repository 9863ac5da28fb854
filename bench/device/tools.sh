#!/usr/bin/env bash
# On the GPU machine: the hybrid through the binaries (issue: the hybrid inside libllama).
# Builds kairox with CUDA (libllama, llama-bench, llama-server), writes KB-7B and its pack
# meanwhile, then kairox-bench against `kairox run` beside llama.cpp's best -ngl
# (bench/tools_bench.py), and kairox-server under concurrent streams with the balancer's
# trace drawn by `kairox report` (bench/server_streams.py). Results to $OUT.
#
#   bash bench/device/tools.sh          # repo root; carry vendor/llama.cpp and .whl
#   KX_TESTS="tests/..." ...            # first these tests on the GPU (pytest)
#   KX_TOOLS_ONLY_BUILD=1 ...           # build, model and tests only (a first call; the next one finds them)
#   KX_ROUNDS=3 ...                     # interleaved rounds of the binaries' rows
#   KX_TOOLS_SKIP_BENCH=1 ...           # only the server rows
#   KX_TOOLS_SKIP_SERVER=1 ...          # only the binaries' rows
#   KX_SERVER_ARGS="..." KX_SERVER_NAME=N  # the server's kairox flags (default: 7 GiB, predicted, adaptive, trace)
#   KX_SPEC=1 ...                       # only speculative decoding (bench/spec_decode.py): no draft, the target
#                                       # as its own draft (overhead ceiling), KB-350M as a small draft
set -uo pipefail
. bench/device/env.sh
mkdir -p /tmp/kxbench
M=/tmp/kxbench/KB-7B-f16.gguf
D=/tmp/kxbench/KB-350M-f16.gguf
# the weights need no native library: written while the build runs, the pack after it
pids=()
[ -f "$M" ] || { python3 -m kairox synth --preset KB-7B -o "$M" -q > "$OUT/synth.log" 2>&1 & pids+=($!); }
if [ -n "${KX_SPEC:-}" ] && [ ! -f "$D" ]; then
    python3 -m kairox synth --preset KB-350M -o "$D" -q > "$OUT/synth-draft.log" 2>&1 & pids+=($!)
fi
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON \
    -DKAIROX_CUDA_ARCHITECTURES=90 > "$W/kx-configure.log" || exit 1
cmake --build "$W/build-kx" -j "$(nproc)" --target llama llama-bench llama-server llama-completion > "$W/kx-build.log" 2>&1 \
    || { tail -30 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
# the synthetic model and its pack (the pack's predictor runs on the native library)
for p in "${pids[@]}"; do wait "$p"; done
[ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset KB-7B -o "$M" --pack-only -q >> "$OUT/synth.log" 2>&1
echo "model ready ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/synth.log" 2>/dev/null)"
if [ -n "${KX_TESTS:-}" ]; then
    cmake --build "$W/build-kx" -j "$(nproc)" --target llama-completion > "$W/kx-build2.log" 2>&1 || tail -20 "$W/kx-build2.log"
    timeout "${KX_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "tests done ($(( $(date +%s) - t0 )) s)"
fi
[ -n "${KX_TOOLS_ONLY_BUILD:-}" ] && exit 0
if [ -n "${KX_SPEC:-}" ]; then
    H="--vram-budget 7GiB --sparse predicted"
    python3 bench/spec_decode.py --bin "$B" --model "$M" --out "$OUT" --rounds "${KX_ROUNDS:-2}" \
        --row "no draft=$H" \
        --row "draft: the target, 3 tokens=$H --spec-type draft-simple --spec-draft-model $M -ngld 99" \
        --row "draft: the target, 7 tokens=$H --spec-type draft-simple --spec-draft-model $M -ngld 99 --spec-draft-n-max 7" \
        --row "draft: KB-350M, 3 tokens=$H --spec-type draft-simple --spec-draft-model $D -ngld 99" \
        || echo "spec_decode FAILED"
    echo "all done ($(( $(date +%s) - t0 )) s)"
    exit 0
fi
if [ -z "${KX_TOOLS_SKIP_BENCH:-}" ]; then
    python3 bench/tools_bench.py --model "$M" --budget 7GiB --ngl 17 --bin "$B" --out "$OUT" \
        --rounds "${KX_ROUNDS:-3}" --gen 128 --threads 16 || echo "tools_bench FAILED"
fi
[ -n "${KX_TOOLS_SKIP_SERVER:-}" ] && exit 0
python3 bench/server_streams.py --bin "$B" --model "$M" --streams 4 --tokens 128 --out "$OUT" \
    --name "${KX_SERVER_NAME:-server-streams}" -- \
    ${KX_SERVER_ARGS:---vram-budget 7GiB --sparse predicted --balancer adaptive --kx-trace $OUT/server-trace.jsonl} \
    || echo "server_streams FAILED"
[ -f "$OUT/server-trace.jsonl" ] || exit 0
python3 -m kairox report "$OUT/server-trace.jsonl" --png "$OUT/server-trace.png" || echo "report FAILED"
echo "all done ($(( $(date +%s) - t0 )) s)"
