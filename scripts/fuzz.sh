#!/usr/bin/env bash
# Fuzz the sparse pack loader with libFuzzer under AddressSanitizer and UBSan, as llama.cpp
# fuzzes its GGUF reader; any crash, sanitizer report or unexpected exception fails.
#
#   bash scripts/fuzz.sh [SECONDS]     # default 180; needs clang and the kairox package
#
# Builds libllama and the target (ggml_ext/tests/kx-fuzz-pack.cpp) in build/fuzz (~10 min on
# 2 cores the first time), writes a tiny model and a seed corpus of valid packs (f32, f16 with
# a predictor and an ahead predictor, q8_0 with the threshold calibration), then runs the
# target for SECONDS. Findings are written to build/fuzz/findings/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-180}
PY=${PYTHON:-python3}
B=build/fuzz
say() { printf 'fuzz: %s\n' "$*" >&2; }

command -v clang++ >/dev/null || { say "clang++ not found (apt-get install clang)"; exit 2; }
say "building the fuzz target (clang, ASan + UBSan + libFuzzer; log: $B/build.log)"
mkdir -p "$B"
{
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DKAIROX_FUZZ=ON -DKAIROX_RPC=OFF -DGGML_OPENMP=OFF
    cmake --build "$B" --target kx-fuzz-pack -j "$(nproc)"
} >"$B/build.log" 2>&1 || { tail -n 30 "$B/build.log" >&2; say "build failed"; exit 1; }

say "seed corpus"
rm -rf "$B/seeds" && mkdir -p "$B/seeds" "$B/corpus" "$B/findings"
"$PY" - "$B" <<'EOF'
import sys, tempfile
from pathlib import Path
import numpy as np
from kairox.convert import convert
from kairox.pack import PackPredictor, write_pack
from kairox.thresholds import K, ThresholdTables
from kairox.tiny import make_tiny_checkpoint

b = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    model = convert(make_tiny_checkpoint(d, hidden_act="relu"), b / "model.gguf", outtype="f32", quiet=True)
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
KX_FUZZ_MODEL="$B/model.gguf" ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$B/bin/kx-fuzz-pack" "$B/corpus" "$B/seeds" -max_total_time="$secs" -max_len=400000 -rss_limit_mb=2048 \
    -timeout=60 -artifact_prefix="$B/findings/" -print_final_stats=1 2>"$B/fuzz.log" \
    || { tail -n 60 "$B/fuzz.log" >&2; say "FAILED: a finding is in $B/findings/"; exit 1; }
grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb" "$B/fuzz.log" | sed 's/^/fuzz: /' >&2
say "passed: no crash in ${secs} s"
