#!/usr/bin/env bash
# kairox's native code under AddressSanitizer and UBSan: a clang build of libllama with both
# (and libFuzzer's coverage), the native test files run against it, then libFuzzer over the
# sparse pack loader, as llama.cpp fuzzes its GGUF reader. Any sanitizer report, crash or
# failing test fails.
#
#   bash scripts/sanitize.sh [SECONDS]     # fuzzing time, default 180; needs clang and kairox
#
# Builds in build/sanitize (~9 min on 2 cores the first time). The tests: the CPU kernels
# against numpy, damaged packs, the live balancer over slots in host memory and its faults
# (KX_SANITIZE_TESTS: other pytest arguments; under ASan the CPU kernels run far slower). The fuzzer
# (ggml_ext/tests/kx-fuzz-pack.cpp) starts from valid packs of a tiny model (f32; f16 with a
# predictor and an ahead predictor; q8_0 with the thresholds' calibration); findings go to
# build/sanitize/findings/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-180}
PY=${PYTHON:-python3}
B=build/sanitize
say() { printf 'sanitize: %s\n' "$*" >&2; }

command -v clang++ >/dev/null || { say "clang++ not found (apt-get install clang)"; exit 2; }
say "building libllama and the fuzz target (clang, ASan + UBSan + libFuzzer; log: $B/build.log)"
mkdir -p "$B"
{
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DKAIROX_FUZZ=ON -DKAIROX_RPC=OFF -DGGML_OPENMP=OFF
    cmake --build "$B" --target kx-fuzz-pack kairox-ext -j "$(nproc)"
} >"$B/build.log" 2>&1 || { tail -n 30 "$B/build.log" >&2; say "build failed"; exit 1; }

say "native tests under ASan + UBSan"
# Python itself is not instrumented: the ASan runtime is preloaded, leak checks off (the
# interpreter keeps its objects at exit); one test's report stops the run (-x, no recover)
asan_rt=$(clang -print-file-name=libclang_rt.asan-x86_64.so)
tests=${KX_SANITIZE_TESTS:-tests/test_sparse_ops.py tests/test_pack_integrity.py
    tests/test_balance_live.py::test_live_balancing_keeps_the_output
    tests/test_balance_live.py::test_a_failing_reload_stops_the_balancer_not_the_output}
# shellcheck disable=SC2086
KAIROX_LIB_DIR="$PWD/$B/bin" KAIROX_BIN_DIR="$PWD/$B/bin" PYTHONPATH="$PWD/python:$PWD/tests" \
    LD_PRELOAD="$asan_rt" ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$PY" -m pytest -q -x -s -p no:cacheprovider $tests >"$B/tests.log" 2>&1 \
    || { grep -E -A12 "runtime error|ERROR: AddressSanitizer" "$B/tests.log" | head -40 >&2; tail -n 20 "$B/tests.log" >&2
         say "FAILED: native tests under the sanitizers (log: $B/tests.log)"; exit 1; }
say "native tests clean under the sanitizers ($(grep -oE '[0-9]+ passed' "$B/tests.log" | tail -1 | cut -d' ' -f1) tests)"

say "seed corpus"
rm -rf "$B/seeds" && mkdir -p "$B/seeds" "$B/corpus" "$B/findings"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$B" <<'EOF'
import sys, tempfile
from pathlib import Path
import numpy as np
from kairox.convert import convert
from kairox.pack import PackPredictor, write_pack
from kairox.thresholds import K, ThresholdTables
from kairox.tiny import default_vocab_gguf, make_tiny_checkpoint

b = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    model = convert(make_tiny_checkpoint(d, hidden_act="relu"), b / "model.gguf", outtype="f32",
                    vocab_gguf=default_vocab_gguf(), quiet=True)
rng = np.random.default_rng(0)
fac = lambda il: (rng.standard_normal((4, 64)), rng.standard_normal((256, 4)), rng.standard_normal(256))
grid = np.tile(np.linspace(-1, 1, K, dtype=np.float32), (2, 1))  # 0 in the middle (K0)
sel, err = np.full((256, K), 0.5, np.float32), np.full((256, K), 0.1, np.float32)
tables = ThresholdTables(grid, [sel, sel], [err, err], np.ones(2, np.float32))
write_pack(model, b / "seeds/f32.gguf", quiet=True)
write_pack(model, b / "seeds/f16.gguf", down_type="f16", predictor=PackPredictor(4, fac, "f16"),
           ahead=PackPredictor(4, fac, "f32"), stats='{"x": 1}', quiet=True)
write_pack(model, b / "seeds/q8.gguf", down_type="q8_0", predictor=PackPredictor(4, fac), thresholds=tables,
           quiet=True)
EOF

say "running for ${secs} s"
# the packs are ~100-300 KB: let libFuzzer grow inputs to a little past them
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$B/bin/kx-fuzz-pack" -kx_model="$B/model.gguf" "$B/corpus" "$B/seeds" -max_total_time="$secs" -max_len=400000 -rss_limit_mb=2048 \
    -timeout=60 -artifact_prefix="$B/findings/" -print_final_stats=1 2>"$B/fuzz.log" \
    || { tail -n 60 "$B/fuzz.log" >&2; say "FAILED: a finding is in $B/findings/"; exit 1; }
grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$B/fuzz.log" | sed 's/^/sanitize: /' >&2
say "passed: no sanitizer report, no crash in ${secs} s of fuzzing"
