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
set -uo pipefail
. bench/device/env.sh
mkdir -p /tmp/kxbench
M=/tmp/kxbench/KB-7B-f16.gguf
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON \
    -DKAIROX_CUDA_ARCHITECTURES=90 > "$W/kx-configure.log" || exit 1
cmake --build "$W/build-kx" -j "$(nproc)" --target llama llama-bench llama-server llama-completion > "$W/kx-build.log" 2>&1 \
    || { tail -30 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B KAIROX_BIN_DIR=$B
# the synthetic model and its pack (the pack's predictor runs on the native library)
[ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset KB-7B -o "$M" --pack -q > "$OUT/synth.log" 2>&1 &
while pgrep -f "kairox synth --preset KB-7B" > /dev/null; do sleep 2; done
echo "model ready ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/synth.log" 2>/dev/null)"
if [ -n "${KX_TESTS:-}" ]; then
    cmake --build "$W/build-kx" -j "$(nproc)" --target llama-completion > "$W/kx-build2.log" 2>&1 || tail -20 "$W/kx-build2.log"
    timeout "${KX_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 | tee "$OUT/pytest.log" | tail -15
    echo "tests done ($(( $(date +%s) - t0 )) s)"
fi
[ -n "${KX_TOOLS_ONLY_BUILD:-}" ] && exit 0
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
