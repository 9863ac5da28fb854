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
import subprocess
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


def perplexity(model: Path, text: Path, args: argparse.Namespace, flags: list[str]) -> dict:
    """llama-perplexity with `flags`: {ppl, err, seconds, command}."""
    from kairox._native import find_bin_dir
    from kairox.prepare import _PPL_RE
    cmd = [str(find_bin_dir() / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(args.ctx),
           "-b", str(args.ctx), "-ub", "1", "--chunks", str(args.chunks), "-t", str(args.threads), "--no-repack",
           *flags]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    m = _PPL_RE.search(p.stdout + p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"llama-perplexity failed (exit {p.returncode}): {(p.stdout + p.stderr)[-800:]}")
    return {"ppl": float(m.group(1)), "err": float(m.group(2)), "seconds": round(time.perf_counter() - t0, 1),
            "command": " ".join(cmd)}


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
    hybrid = ["--sparse", "predicted", "--gpu-slots", str(slots), "--kx-slots-device", "CPU"]
    rows = [("dense", []),
            ("predicted hybrid, own lists", [*hybrid, "--sparse-pack", str(pack)]),
            ("predicted hybrid, ahead lists (ahead predictors)", [*hybrid, "--sparse-pack", str(pack), "--kx-list-ahead"]),
            ("predicted hybrid, ahead lists (own predictor on the layer before's input)",
             [*hybrid, "--sparse-pack", str(bare), "--kx-list-ahead"])]
    res = []
    for name, flags in rows:
        r = perplexity(model, text, args, flags)
        print(f"{name}: {r['ppl']:.4f} +/- {r['err']:.4f} ({r['seconds']} s)", flush=True)
        res.append({"row": name, **r})
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
