#!/usr/bin/env python3
"""What ahead lists (`--kx-list-ahead`) cost in quality: held-out perplexity of a model with its
prepared pack, dense and in the predicted hybrid (slots on the CPU device, so it runs on any
machine; the lists and the arithmetic are the GPU's), each layer's own list against the list
the layer before selected for it, with the pack's ahead predictors and without them (the same
pack rewritten without kx_ahead_*: the layer's own predictor then reads the previous layer's
input). llama-perplexity decodes one token per micro-batch, so every list is a decode's.

Writes OUT.json (raw: commands, commit, machine, each perplexity with its error) and OUT.md.

    KAIROX_LIB_DIR=... KAIROX_BIN_DIR=... PYTHONPATH=python python3 bench/ahead_quality.py \\
        --model M.gguf --pack M.kxpack.gguf --text heldout.txt --out bench/results/X/ahead-quality
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kairox.bench import git_commit, machine_facts  # noqa: E402


def without_ahead(model: Path, pack: Path, out: Path) -> Path:
    """`pack` rewritten without its ahead predictors: the same own predictors (stored type),
    neuron order, groups, frequencies and thresholds, the same listed densities."""
    from kairox.pack import PackLayout, PackPredictor, read_pack, write_pack
    pk = read_pack(pack, model)
    layers = pk.layers
    if not all(L.has_predictor and L.ahead_a is not None for L in layers[1:]):
        raise SystemExit(f"{pack} lacks own or ahead predictors: prepare the model first (kairox prepare)")
    dtype = layers[0].stored["pred_a"][1]
    rank = int(layers[0].pred_a.shape[0])
    return write_pack(model, out, group_size=pk.group_size, down_type=layers[0].down_type, quiet=True,
                      method={**pk.method, "ahead": "removed"}, listed_density=pk.listed_density,
                      predictor=PackPredictor(rank, lambda il: (layers[il].pred_a, layers[il].pred_b,
                                                                layers[il].pred_c), dtype),
                      layout=PackLayout(lambda il: (layers[il].perm, layers[il].group, layers[il].freq),
                                        pk.threshold))


def perplexity(model: Path, text: Path, args: argparse.Namespace, pack: Path | None, flags: list[str]) -> dict:
    """kairox.prepare.perplexity (llama-perplexity, one token per micro-batch) with `flags`:
    {ppl, err, seconds}."""
    from kairox.prepare import PrepareError
    from kairox.prepare import perplexity as ppl_of
    t0 = time.perf_counter()
    try:
        ppl, err = ppl_of(model, text, chunks=args.chunks, n_ctx=args.ctx, threads=args.threads,
                          sparse="predicted" if pack else None, pack=pack, extra=flags)
    except PrepareError as e:
        sys.exit(str(e))
    return {"ppl": ppl, "err": err, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--pack", required=True, help="the model's prepared pack (with ahead predictors)")
    ap.add_argument("--text", required=True, help="held-out text (kairox prepare's work folder has heldout.txt)")
    ap.add_argument("--out", required=True, help="output prefix")
    ap.add_argument("--slots", type=int, default=0, help="slots per layer (default: half of each layer's neurons)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    args.threads = args.threads or os.cpu_count() or 1
    from kairox.pack import inspect_model
    model, pack, text = Path(args.model), Path(args.pack), Path(args.text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_ff = inspect_model(model)[1].n_ff
    slots = args.slots or n_ff // 2
    bare = without_ahead(model, pack, out.parent / (out.name + "-no-ahead.kxpack.gguf"))
    hybrid = ["--gpu-slots", str(slots), "--kx-slots-device", "CPU"]
    rows = [("dense", None, []),
            ("predicted hybrid, own lists", pack, hybrid),
            ("predicted hybrid, ahead lists (ahead predictors)", pack, [*hybrid, "--kx-list-ahead"]),
            ("predicted hybrid, ahead lists (own predictor on the layer before's input)", bare,
             [*hybrid, "--kx-list-ahead"])]
    res = []
    for name, pk, flags in rows:
        r = perplexity(model, text, args, pk, flags)
        print(f"{name}: {r['ppl']:.4f} +/- {r['err']:.4f} ({r['seconds']} s)", flush=True)
        res.append({"row": name, "flags": (["--sparse", "predicted", "--sparse-pack", pk.name] if pk else []) + flags,
                    **r})
    bare.unlink()
    dense = res[0]["ppl"]
    raw = {"command": " ".join([sys.executable, *sys.argv]), "commit": git_commit(), "machine": machine_facts(),
           "model": str(model), "pack": str(pack), "slots_per_layer": slots, "n_ff": n_ff, "ctx": args.ctx,
           "chunks": args.chunks, "rows": res}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    lines = [f"# Ahead lists: held-out perplexity of {model.name}",
             "",
             f"llama-perplexity, {args.chunks} chunks of {args.ctx} tokens, one token per micro-batch, "
             f"{args.threads} threads; the hybrid with {slots} of {n_ff} neurons a layer in slots on the CPU "
             f"device; commit {raw['commit']}",
             "",
             "| row | perplexity | ± | vs dense |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['row']} | {r['ppl']:.4f} | {r['err']:.4f} | {r['ppl'] / dense - 1:+.2%} |" for r in res]
    lines += ["", "Command:", "", "```", raw["command"], "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
