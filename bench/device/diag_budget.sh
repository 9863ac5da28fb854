#!/usr/bin/env bash
# On the GPU machine: kairox-bench under VRAM budgets on a small model (KB-350M F16 and its
# pack, written during the build), each run verbose, to see the budget's dense placement and
# where a run stops (an over-budget refusal names llama.cpp's device buffers after the warm-up).
# Results to $OUT.
#
#   bash bench/device/diag_budget.sh        # repo root; carry vendor/llama.cpp and .whl
#   KX_DIAG_BUDGETS="0.3 0.6 2"             # GiB
#   KX_TESTS="tests/test_budget.py"         # also these GPU tests, after the build
set -uo pipefail
. bench/device/env.sh
M=/tmp/kxbench/KB-350M-f16.gguf
mkdir -p /tmp/kxbench
# the model during the build; its pack after it (profiling runs the built library)
[ -f "$M" ] || (nice python3 -m kairox synth --preset KB-350M -o "$M" -q > "$OUT/synth.log" 2>&1 &)
cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_CUDA_ARCHITECTURES=90 \
    > "$W/kx-configure.log" || exit 1
cmake --build "$W/build-kx" -j "$(nproc)" --target llama llama-bench > "$W/kx-build.log" 2>&1 \
    || { tail -20 "$W/kx-build.log"; exit 1; }
echo "build done ($(( $(date +%s) - t0 )) s)"
B=$W/build-kx/bin
export KAIROX_LIB_DIR=$B
[ -n "${KX_TESTS:-}" ] && timeout 120 python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 | tee "$OUT/pytest.log" | tail -8
while pgrep -f "kairox synth --preset KB-350M" > /dev/null; do sleep 1; done
[ -f "${M%.gguf}.kxpack.gguf" ] || python3 -m kairox synth --preset KB-350M -o "$M" --pack-only -q >> "$OUT/synth.log" 2>&1 \
    || { tail -5 "$OUT/synth.log"; exit 1; }
for b in ${KX_DIAG_BUDGETS:-0.3 0.6 2}; do
    timeout 60 "$B/llama-bench" -m "$M" -p 0 -n 16 -r 1 -t "$(nproc)" -o md --vram-budget "${b}GiB" --sparse predicted \
        -fa 1 -v > "$OUT/diag-$b.log" 2>&1
    echo "budget $b GiB: rc=$?"
    grep -E "^kairox|error|tg16|compute buffer size" "$OUT/diag-$b.log" | cut -c1-600 | tail -8
done
echo "done ($(( $(date +%s) - t0 )) s)"
