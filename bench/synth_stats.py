#!/usr/bin/env python3
"""Activation statistics of a synthetic model (kairox synth) next to the papers' targets.

Profiles the real forward pass (llama.cpp with kairox's collector) over topic text from
`kairox.synth.topic_prompts`, and over random tokens for contrast, and writes
<out>/synth-stats-<name>.json (raw, per layer) and .md (means vs targets).

  python3 bench/synth_stats.py --preset KB-350M --threads 2
  python3 bench/synth_stats.py --model /tmp/KB-7B-f16.gguf --ngl 99
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

# The targets the synthetic models are fitted to (ProSparse-7B sparsity, PowerInfer, DynamicInfer, KAIROX).
TARGETS = {
    "density": ("≈ 0.11", "ProSparse-7B: ~89% of FFN activations are zero"),
    "hot_fraction_80": ("0.20-0.40", "PowerInfer: a minority of neurons carries 80% of activations"),
    "adjacent_jaccard": ("0.70-0.75", "DynamicInfer: Jaccard distance between adjacent tokens"),
    "cross_prompt_jaccard": ("0.53-0.57", "DynamicInfer: distance between prompts' working sets"),
    "cold_reactivation": ("< 0.2", "KAIROX: cold neurons re-fire after a gap > 2"),
    "hidden_cosine": ("≥ 0.9", "KAIROX: adjacent-layer hidden-state cosine (≈ 0.98)"),
}


def main() -> int:
    import numpy as np

    from kairox.bench import git_commit, machine_facts, write_results
    from kairox.profile import stats_on_prompts
    from kairox.stats import reactivation_after_gap
    from kairox.synth import PRESETS, synth, topic_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS), help="synthesize this preset (temporary)")
    src.add_argument("--model", help="an existing synthetic model")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--ngl", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        if args.preset:
            model = synth(Path(tmp) / f"{args.preset}.gguf", PRESETS[args.preset], quiet=True)
        else:
            model = Path(args.model)
        t_synth = time.time() - t0
        name = args.preset or model.stem
        rng = np.random.default_rng(1)
        sets = {"topic text": topic_prompts(model, args.prompts, args.length, seed=1),
                "random tokens": [list(map(int, rng.integers(300, 32000, args.length)))
                                  for _ in range(args.prompts)]}
        measured = {}
        for kind, prompts in sets.items():
            t0 = time.time()
            st = stats_on_prompts(model, prompts, threads=args.threads, n_gpu_layers=args.ngl, quiet=False)
            layers = [dataclasses.asdict(layer) for layer in st.layers]
            for d, layer in zip(layers, st.layers):
                d["cold_reactivation"] = reactivation_after_gap(layer.reactivation, "cold")
                d.pop("reactivation")
            measured[kind] = {"layers": layers, "seconds": time.time() - t0}

    def mean(kind: str, key: str) -> float | None:
        v = [x[key] for x in measured[kind]["layers"] if x[key] is not None]
        return float(np.mean(v)) if v else None

    result = {"benchmark": "synth-stats", "model": name, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "command": shlex.join([sys.executable] + sys.argv), "commit": git_commit(),
              "machine": machine_facts(), "prompts": args.prompts, "length": args.length,
              "synth_seconds": t_synth, "targets": TARGETS, "measured": measured,
              "means": {k: {key: mean(k, key) for key in TARGETS} for k in measured}}
    lines = [f"# Activation statistics of {name} (real forward pass)", "",
             f"{args.prompts} prompts x {args.length} tokens; mean over layers; commit {result['commit'][:10]}", "",
             "| statistic | target | topic text | random tokens | source |", "|---|---|---:|---:|---|"]
    for key, (target, source) in TARGETS.items():
        vals = [result["means"][k][key] for k in ("topic text", "random tokens")]
        cells = ["-" if v is None else f"{v:.3f}" for v in vals]
        lines.append(f"| {key} | {target} | {cells[0]} | {cells[1]} | {source} |")
    write_results(Path(args.out) / f"synth-stats-{name}", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
