#!/usr/bin/env bash
# On the GPU machine: build kairox with CUDA and test-backend-ops, run the kx ops' CUDA
# kernels against the CPU reference, the hybrid-layer tests on the GPU, and (optionally)
# the static-hybrid offload benchmark rows. Results and logs to $OUT.
#
#   bash bench/device/hybrid.sh                 # repo root; carry vendor/llama.cpp and .whl
#   KX_BENCH="KB-7B" bash bench/device/hybrid.sh  # also the offload rows of those configs
set -uo pipefail
. bench/device/env.sh
# numpy before the CUDA libllama crashes the first load on this machine (sparse_smoke.sh)
mkdir -p /tmp/sc && printf "try:\n    import kairox.llama\nexcept ImportError:\n    pass\n" > /tmp/sc/sitecustomize.py
# only what this script runs (libllama, llama-bench, test-backend-ops): the build tree's
# bin/ holds the shared libraries next to the tools
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_BUILD_TESTS=ON \
    -DKAIROX_CUDA_ARCHITECTURES=90 > "$W/kx-configure.log" || exit 1
cmake --build "$W/build-kx" -j "$(nproc)" --target llama llama-bench test-backend-ops > "$W/kx-build.log" 2>&1 \
    || { tail -30 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B
[ -z "${KX_SKIP_TESTS:-}" ] && for op in KX_SELECT KX_MUL_MAT_ROWS KX_AXPY_ROWS; do
    "$B/test-backend-ops" -b CUDA0 -o "$op" > "$OUT/test-backend-ops-$op.log" 2>&1
    echo "test-backend-ops $op: rc=$? $(grep -cE '^\s+.*OK' "$OUT/test-backend-ops-$op.log") OK, $(grep -c FAIL "$OUT/test-backend-ops-$op.log") FAIL; $(tail -1 "$OUT/test-backend-ops-$op.log")"
done
if [ -n "${KX_PERF:-}" ]; then
    "$B/test-backend-ops" perf -b CUDA0 -o KX_MUL_MAT_ROWS > "$OUT/test-backend-ops-perf.log" 2>&1
    "$B/test-backend-ops" perf -b CUDA0 -o KX_AXPY_ROWS >> "$OUT/test-backend-ops-perf.log" 2>&1
fi
# (the library-first import only for pytest: offload.py's own process uses torch, not libllama)
[ -z "${KX_SKIP_TESTS:-}" ] && PYTHONPATH=/tmp/sc:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider \
    tests/test_hybrid.py tests/test_sparse_ops.py tests/test_budget.py tests/test_trace.py 2>&1 | tail -15
echo "tests done ($(( $(date +%s) - t0 )) s)"
for cfg in ${KX_BENCH:-}; do
    python3 bench/offload.py --config "$cfg" --stock-bin "$B" --kairox-bin "$B" --kairox-lib "$B" \
        --work /tmp/kxbench --out "$OUT" --reps 1 --modes "${KX_MODES:-predicted,hybrid}" --no-baseline ${KX_KEEP:+--keep} \
        || echo "config $cfg FAILED"
    echo "config $cfg done at $(( $(date +%s) - t0 )) s"
done
