#!/usr/bin/env bash
# On the GPU machine: offload benchmarks (bench/offload.py) for the configurations given,
# results and a log to $OUT. Builds kairox and the unpatched llama-bench unless a build
# archive was carried in .kxbuild/ (made by an earlier call: KX_PACK_BUILD=1 writes it to
# $OUT as parts of at most 15 MiB).
#
#   bash bench/device/offload.sh KB-7B [KB-13B ...]     # repo root; carry .whl (+ vendor or .kxbuild)
#   bash bench/device/offload.sh KB-7B:4 KB-7B:10      # CONFIG:BUDGET_GIB, a budget sweep
#   env: KX_REPS (llama-bench repetitions), KX_NOPACK="KB-13B KB-70B" (configs without sparse pack),
#        KX_MODES (kairox sparse modes, default predicted), KX_KEEP=1 (keep models in
#        /tmp/kxbench for a later call on the warm machine)
set -uo pipefail
. bench/device/env.sh
if [ -f .kxbuild/kxbuild.tar.xz.00 ]; then
    cat .kxbuild/kxbuild.tar.xz.* | tar -xJ -C "$W" && echo "build unpacked ($(( $(date +%s) - t0 )) s)"
elif [ ! -x "$W/kx/bin/llama-bench" ] || [ ! -x "$W/build-stock/bin/llama-bench" ]; then
    bash bench/device/build.sh || exit 1
    echo "build done ($(( $(date +%s) - t0 )) s)"
fi
if [ -n "${KX_PACK_BUILD:-}" ]; then
    tar -C "$W" -cf - kx/bin kx/lib $(cd "$W" && ls build-stock/bin/llama-bench build-stock/bin/*.so*) \
        | xz -T0 -6 | split -b 15M -d - "$OUT/kxbuild.tar.xz."
    ls -l "$OUT"/kxbuild.tar.xz.*
fi
export KX_COMMIT=${KX_COMMIT:-unknown}
for arg in "$@"; do
    cfg=${arg%%:*}
    extra=()
    [ "$arg" = "$cfg" ] || extra+=(--budget "${arg#*:}")
    [ -z "${KX_KEEP:-}" ] || extra+=(--keep)
    case " ${KX_NOPACK:-} " in *" $cfg "*) extra+=(--no-pack) ;; esac
    if [ "$cfg" = gemma3-270m ]; then  # the real file is too large to send: a layout clone
        mkdir -p /tmp/kxbench
        python3 bench/shape_clone.py expand .kxshape/gemma3-270m.kxshape /tmp/kxbench/gemma-3-270m-q4_k_m.gguf
        extra+=(--model /tmp/kxbench/gemma-3-270m-q4_k_m.gguf --note "Model: layout clone of gemma-3-270m-q4_k_m.gguf (bench/shape_clone.py: identical header, tensor data tiled from real blocks of each type); dense speed only.")
    fi
    python3 bench/offload.py --config "$cfg" --stock-bin "$W/build-stock/bin" --kairox-bin "$W/kx/bin" \
        --kairox-lib "$W/kx/lib" --work /tmp/kxbench --out "$OUT" --reps "${KX_REPS:-2}" \
        --modes "${KX_MODES:-predicted}" "${extra[@]}" || echo "config $cfg FAILED"
    echo "config $arg done at $(( $(date +%s) - t0 )) s"
done
