# Sourced by the device scripts: work and output folders, everything printed also logged to
# $OUT/device.log, the carried wheels installed, Python paths set. Defines W, OUT, t0.
W=${KX_WORK:-/tmp/kx}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/device.log") 2>&1
t0=$(date +%s)
. bench/device/out_fit.sh  # kx_out_fit: past 8 files, $OUT's results leave as one archive
trap kx_out_fit EXIT
trap 'exit 143' TERM
# by name from the carried folder: pip picks each package's wheel for this Python (xxhash
# carries one per CPython version)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    --find-links .whl $(ls .whl | sed 's/-.*//' | sort -u)
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/tests PYTHONUNBUFFERED=1
export KAIROX_VOCAB_GGUF=${KAIROX_VOCAB_GGUF:-$PWD/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf}
# kx_vendor_into TREE: an earlier tree (git archive: no vendor/) gets this tree's patched
# llama.cpp as TREE/vendor/llama.cpp (its patches/ must be the same)
kx_vendor_into() {
    [ -d "$1/vendor/llama.cpp" ] || { mkdir -p "$1/vendor" && cp -a vendor/llama.cpp "$1/vendor/"; }
}
# kx_build TARGET...: configure (CUDA, sm_90, KX_CMAKE_ARGS too) and build those targets into
# $W/build-kx; sets B (its bin/, libraries beside the tools) and KAIROX_LIB_DIR
kx_build() {
    cmake -S . -B "$W/build-kx" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKAIROX_CUDA=ON -DKAIROX_CUDA_ARCHITECTURES=90 \
        ${KX_CMAKE_ARGS:-} > "$W/kx-configure.log" || return 1
    cmake --build "$W/build-kx" -j "$(nproc)" --target "$@" > "$W/kx-build.log" 2>&1 \
        || { tail -30 "$W/kx-build.log"; return 1; }
    echo "build done ($(( $(date +%s) - t0 )) s)"
    B=$W/build-kx/bin
    export KAIROX_LIB_DIR=$B
}
# kx_gpu_tests SECONDS: the GPU tests named by KX_TESTS, if any, stopped after that long
kx_gpu_tests() {
    [ -z "${KX_TESTS:-}" ] || timeout "$1" python3 -m pytest -q -p no:cacheprovider $KX_TESTS 2>&1 \
        | tee "$OUT/pytest.log" | tail -8
}
# kx_wait_model PATTERN MODEL: waits for the background `kairox synth` whose command matches
# PATTERN (its output in $OUT/synth.log), then checks that MODEL was written
kx_wait_model() {
    while pgrep -f "$1" > /dev/null; do sleep 1; done
    [ -f "$2" ] || { tail -5 "$OUT/synth.log"; return 1; }
    echo "model done ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/synth.log")"
}
# kx_budget_rows MODEL GIB NAME VARIANT...: one verbose kairox-bench row under that budget per
# variant (extra flags, "" for none), so the load's log shows the placement; the logs go to
# $OUT/NAME-GIB.log, then NAME-GIB-1.log ...
kx_budget_rows() {
    local m=$1 b=$2 name=$3 k=0
    shift 3
    for extra in "$@"; do
        local log="$OUT/$name-$b.log"
        [ "$k" = 0 ] || log="$OUT/$name-$b-$k.log"
        timeout 120 "$B/llama-bench" -m "$m" -p 0 -n 16 -r 1 -t "$(nproc)" -o md --vram-budget "${b}GiB" -fa 1 \
            $extra -v > "$log" 2>&1
        echo "budget $b GiB $extra: rc=$?"
        grep -E "^kairox|error|tg16" "$log" | cut -c1-1200 | tail -6
        k=$((k + 1))
    done
}
