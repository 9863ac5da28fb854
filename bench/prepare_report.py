#!/usr/bin/env python3
"""Run `kairox prepare` on a model, time it, measure held-out perplexity across target
sparsities, and write a report: OUT.json (raw: command, commit, machine, stage times,
statistics, perplexity), OUT.md (tables) and PNG plots next to it.

    python3 bench/prepare_report.py                      # Gemma 3 270M, docs/results/gemma3-270m
    python3 bench/prepare_report.py --model m.gguf --out docs/results/m --ppl-curve 0.3,0.5

Stages cached in --work-dir are reused (pass --fresh to time a full run from scratch).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

from kairox.bench import git_commit, machine_facts  # noqa: E402


def runtime_density(model: Path, pack: Path, text: Path, threads: int | None, n: int = 256) -> dict:
    """Threshold and predicted mode on the same held-out tokens: fraction of FFN rows the sparse
    kernels computed (and, raw, the nonzero activations they met: for ReLU models, whose
    threshold is 0, the ratio predicted/threshold is the runtime recall; gated models have no
    exact zeros, and their exact mode runs dense)."""
    from kairox import Llama
    from kairox.bench import counters_per_mode

    llm = Llama(str(model), sparse="threshold", sparse_pack=str(pack), n_ctx=n + 8,
                n_threads=threads or 2, verbose=False)
    toks = llm.tokenize(text.read_text()[:4 * n + 400].encode())[:n]
    counts = counters_per_mode(llm, toks, modes=("threshold", "predicted"))
    llm.close()
    return {"tokens": len(toks), **{m: {"density": c.density, "nonzero": c.nonzero} for m, c in counts.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--out", default="docs/results/gemma3-270m", help="output prefix (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ppl-curve", default="0.3,0.4,0.5,0.6", help="target sparsities (default: %(default)s)")
    ap.add_argument("--ppl-chunks", type=int, default=8)
    ap.add_argument("--work-dir", default="/tmp/kairox-prepare-report")
    ap.add_argument("--fresh", action="store_true", help="discard cached stages first")
    args = ap.parse_args()

    from kairox.default_model import default_model_path
    from kairox.prepare import PrepareConfig, prepare
    from kairox.stats import format_table, plot_stats

    model = Path(args.model) if args.model else default_model_path(install=False)
    work = Path(args.work_dir)
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = dict(work_dir=work, out=work / "report.kxpack.gguf", threads=args.threads)

    t0 = time.perf_counter()
    res = prepare(model, PrepareConfig(**base))          # the timed run: what a user waits for
    wall = time.perf_counter() - t0
    targets = tuple(float(x) for x in args.ppl_curve.split(",") if x)
    res_ppl = prepare(model, PrepareConfig(**base, ppl_targets=targets, ppl_chunks=args.ppl_chunks))
    stats = res_ppl.stats

    runtime = runtime_density(model, res_ppl.pack, res_ppl.work_dir / "heldout.txt", args.threads)

    pngs = plot_stats(stats, out.parent)
    for p in pngs:  # name the plots after the report
        p.rename(out.parent / f"{out.name}-{p.name}")
    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "commit": git_commit(), "machine": machine_facts(), "model": model.name,
        "prepare_seconds": res.seconds, "prepare_wall_seconds": wall,
        "prepare_seconds_all_runs": res.spent,
        "perplexity_seconds": res_ppl.seconds.get("perplexity"),
        "stats": json.loads(stats.to_json()), "runtime": runtime,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")

    e = stats.extra
    lines = [f"# `kairox prepare` on {model.name}", "",
             f"Machine: {result['machine'].get('cpu', '?')}, {result['machine']['cpus']} cores. "
             f"Commit `{result['commit'][:12]}`.", "",
             f"**Time** of `kairox prepare` in this run: {wall:.0f} s "
             f"({', '.join(f'{k} {v:.0f} s' for k, v in res.seconds.items() if k != 'total')})"
             + ("; stages cached in the work folder were reused (run with --fresh to time them)"
                if not args.fresh else ", from an empty work folder") + ". "
             f"The perplexity measurements took {res_ppl.seconds.get('perplexity', 0):.0f} s more.", "",
             "## Statistics (all profiled tokens; recall/precision and over-fetch on held-out text)", "",
             format_table(stats), ""]
    if "ppl_curve" in e:
        lines += ["## Held-out perplexity", "",
                  f"llama-perplexity, {e['ppl_chunks']} chunks of 512 tokens of the held-out text, "
                  f"one token per micro-batch, no weight repacking in any row.", "",
                  "| mode | target sparsity | perplexity | vs dense |", "|---|---:|---:|---:|",
                  f"| dense | - | {e['dense_ppl']:.4f} | 1.000 |"]
        for c in e["ppl_curve"]:
            lines.append(f"| exact (threshold) | {c['target_sparsity']:.0%} | {c['ppl']:.4f} | "
                         f"{c['ppl'] / e['dense_ppl']:.3f} |")
        lines.append(f"| predicted (pack) | {e['target_sparsity'] or 0:.0%} | {e['predicted_ppl']:.4f} | "
                     f"{e['predicted_ppl'] / e['dense_ppl']:.3f} |")
        lines.append("")
    lines += ["## In the runtime (held-out tokens, one per decode)", "",
              f"{runtime['tokens']} tokens through `kairox.Llama`; fraction of FFN rows the sparse "
              f"kernels computed (a layer whose list exceeds 60% of its rows runs all of them):", "",
              "| mode | rows computed |", "|---|---:|"]
    for mode in ("threshold", "predicted"):
        lines.append(f"| {mode} | {runtime[mode]['density']:.3f} |")
    lines.append("")
    ahead = e.get("ahead") or []
    if ahead:
        same_r = [ls.recall for ls in stats.layers]
        same_p = [ls.precision for ls in stats.layers]
        lines += ["## Predictor input: same layer vs one layer ahead (held-out)", "",
                  f"rank {e.get('predictor_rank')}", "",
                  "The runtime lists layer l's neurons one layer early, while layer l-1 computes. "
                  "*ahead*: the ahead predictor (trained on layer l-1's FFN input); *own on l-1*: "
                  "layer l's own predictor fed layer l-1's input (what a pack without ahead "
                  "predictors lists).", "",
                  "| layer | recall same | precision same | recall ahead | precision ahead "
                  "| recall own on l-1 | precision own on l-1 |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for il, a in enumerate(ahead):
            proxy = (f"{a['proxy_recall']:.3f} | {a['proxy_precision']:.3f}" if "proxy_recall" in a else "- | -")
            lines.append(f"| {il} | {same_r[il]:.3f} | {same_p[il]:.3f} | {a['recall']:.3f} | {a['precision']:.3f} "
                         f"| {proxy} |")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({out.name}-{p.name})" for p in pngs] + [
        "", "Command:", "", "```", result["command"], "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
