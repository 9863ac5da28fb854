"""Perplexity of CATS vs TEAL activation sparsity on a real model, with the weight bytes each
reads per token.

Calibrates thresholds on the training part of kairox's bundled corpus (the documents'
heads, as `kairox prepare` splits them), then measures perplexity on held-out tails
(segments of --ctx tokens, each one prompt, second half scored; kairox.quality) densely and,
at each sparsity level, under CATS (kairox's rule: |act(gate)| <= t_l skipped, per layer)
and TEAL (|x| <= t zeroed on the input of every projection). Writes raw JSON and a
markdown table to --out.

Weight bytes per token, as a fraction of the dense model's, from the GGUF's tensor sizes:
  cats-thr   kairox's threshold mode: gate read whole, up/down rows of skipped neurons not read
  cats-pred  kairox's predicted mode: gate rows skipped too (the predictor's cost not counted)
  teal       each projection's columns skipped at its input's realized sparsity
"all" counts the output head (read whole) too, "layers" the per-layer matrices only.
TEAL's column access needs transposed copies of q/k/v/o/gate/up (kairox holds down
transposed already): the bytes added are reported once.

With --budget F it also runs kairox.threshold_search's perplexity-budget search on the same
held-out segments over both of its ladders (the same share of activation mass per layer, as
`kairox prepare` uses; the same sparsity per layer, CATS's uniform rule) and reports the
sparsity each buys within the budget.

  KAIROX_LIB_DIR=... PYTHONPATH=python python3 bench/sparsity_quality.py
  ... --levels --methods --budget 0.02      # only the budget search
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def default_model() -> Path:
    p = Path.home() / ".cache" / "kairox" / "models" / "gemma-3-270m-q4_k_m.gguf"
    if p.exists():
        return p
    from kairox.default_model import default_model_path
    return default_model_path(install=False)


def machine() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__}


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def segments(em, ctx: int, n_calib: int, n_eval: int, heldout: float) -> tuple[list, list]:
    """First n_calib training and n_eval held-out segments, round robin over the documents."""
    from kairox.prepare import PrepareConfig, default_corpus, make_segments
    cfg = PrepareConfig(n_ctx=ctx, max_tokens=1 << 30, heldout=heldout)
    segs = make_segments(default_corpus(), em.tokenize, em.bos(), cfg)
    train = [segs.seg(k) for k in range(len(segs.length)) if not segs.heldout[k]]
    held = [segs.seg(k) for k in range(len(segs.length)) if segs.heldout[k]]
    if len(train) < n_calib or len(held) < n_eval:
        sys.exit(f"the corpus gives {len(train)} training and {len(held)} held-out segments of {ctx} "
                 f"tokens; asked for {n_calib} and {n_eval}")
    return train[:n_calib], held[:n_eval]


def bar(total: int, desc: str, quiet: bool):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="tok", disable=quiet, file=sys.stderr)
    except ImportError:
        class Plain:
            def update(self, n: int) -> None:
                pass

            def close(self) -> None:
                if not quiet:
                    print(desc, "done", file=sys.stderr)
        return Plain()


def markdown(res: dict) -> str:
    lines = [f"# Sparsity quality: {res['model']}", "",
             f"Perplexity on {res['eval_tokens']} held-out tokens ({res['eval_segments']} segments of up to "
             f"{res['ctx']}, second half scored; {res['scored']} tokens scored), thresholds calibrated on "
             f"{res['calib_tokens']} training tokens of kairox's bundled corpus. Weight bytes per token "
             f"as a fraction of dense (all: with the output head; layers: per-layer matrices only).", "",
             "| method | target | ppl | vs dense | realized sparsity | bytes all | bytes layers | "
             "pred. mode all | pred. mode layers |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r["method"] == "teal":
            real = ", ".join(f"{k} {v:.2f}" for k, v in r["realized"].items() if k != "gate")
        elif r["method"] == "cats":
            real = f"gate {r['realized']['gate']:.2f}"
        else:
            real = "-"
        pred = r.get("bytes_predicted")
        lines.append(f"| {r['method']} | {r['target']:.2f} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | {real} | "
                     f"{r['bytes']['all']:.3f} | {r['bytes']['layers']:.3f} | "
                     f"{pred['all']:.3f} | {pred['layers']:.3f} |" if pred else
                     f"| {r['method']} | {r['target']:.2f} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | {real} | "
                     f"{r['bytes']['all']:.3f} | {r['bytes']['layers']:.3f} | - | - |")
    for name, sr in res.get("budget_search", {}).items():
        if name == next(iter(res["budget_search"])):
            lines += ["", f"Perplexity budget +{sr['budget']:.1%} (kairox.threshold_search on these segments):", "",
                      "| ladder | level | ppl | vs dense | expected sparsity (mean, layers) | steps | "
                      "bytes layers (threshold / predicted) |", "|---|---|---|---|---|---|---|"]
        sp = sr["sparsity"]
        lines.append(f"| {name} | {sr['share']:.4f} | {sr['ppl']:.3f} | {100 * sr['rise']:+.2f}% | "
                     f"{np.mean(sp):.3f} ({min(sp):.2f}-{max(sp):.2f}) | {len(sr['steps'])} | "
                     f"{sr['bytes']['threshold']['layers']:.3f} / {sr['bytes']['predicted']['layers']:.3f} |")
    wb = res["weight_bytes"]
    lines += ["", "CATS bytes: kairox's threshold mode (gate read whole, up/down rows skipped); "
              "predicted mode: the gate's rows skipped too, the predictor's own cost not counted. "
              "TEAL bytes: each projection's columns skipped at its input's realized sparsity.", "",
              f"Dense bytes per token: {wb['dense'] / 2**20:.1f} MiB ({wb['dense_layers'] / 2**20:.1f} MiB in the "
              f"layers, {wb['head'] / 2**20:.1f} MiB output head). TEAL's layout cost: transposed copies of "
              f"q/k/v/o/gate/up add {wb['teal_layout'] / 2**20:.1f} MiB "
              f"({100 * wb['teal_layout'] / wb['dense_layers']:.0f}% of the layers' matrices; kairox holds down "
              f"transposed already).", "",
              f"Command: `{res['command']}` at {res['git_head'][:12]}; {res['machine']['cpu']}, "
              f"{res['machine']['cores']} cores; {res['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="GGUF model (default: Gemma 3 270M Q4_K_M)")
    ap.add_argument("--levels", type=float, nargs="*", default=[0.1, 0.2, 0.3, 0.4, 0.5],
                    help="target sparsities (dense is always measured)")
    ap.add_argument("--methods", nargs="*", default=["cats", "teal"], choices=["cats", "teal"])
    ap.add_argument("--budget", type=float, default=None, metavar="F",
                    help="also search CATS thresholds within a perplexity rise of F, on both ladders")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per segment")
    ap.add_argument("--calib-segments", type=int, default=8, help="training segments for calibration")
    ap.add_argument("--eval-segments", type=int, default=8, help="held-out segments for perplexity")
    ap.add_argument("--heldout", type=float, default=0.15, help="tail of each document held out")
    ap.add_argument("--max-values", type=int, default=200_000,
                    help="calibration values kept per tensor per layer (random subsample)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gemma3-270m-cpu")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)

    from kairox.quality import TEAL_INPUTS, Emulator, WeightBytes

    model = a.model or default_model()
    t_all = time.perf_counter()
    wb = WeightBytes.of_model(model)
    rows = []
    with Emulator(model, n_ctx=a.ctx, n_batch=a.ctx, threads=a.threads) as em:
        calib, held = segments(em, a.ctx, a.calib_segments, a.eval_segments, a.heldout)
        b = bar(sum(map(len, calib)), "calibrate", a.quiet)
        cal = em.calibrate(calib, max_values=a.max_values, progress=b.update)
        b.close()

        def measure(method: str, target: float) -> dict:
            b = bar(sum(map(len, held)), f"{method} {target:.2f}", a.quiet)
            r = em.perplexity(held, cal.rule(method, target), progress=b.update)
            b.close()
            row = {"method": method, "target": target, "ppl": r.ppl, "nll": r.nll, "scored": r.scored,
                   "seconds": r.seconds, "segment_nll": r.per_segment, "sparsity": r.sparsity.to_json(),
                   "realized": {k: r.sparsity.fraction(k) for k in ("gate", *TEAL_INPUTS)}}
            if method == "cats":
                thr, pred = wb.cats(r.sparsity.per_layer("gate"), False), wb.cats(r.sparsity.per_layer("gate"), True)
                row["bytes_predicted"] = {"all": pred[0], "layers": pred[1]}
                row["thresholds"] = cal.thresholds("gate", target).tolist()
            elif method == "teal":
                thr = wb.teal({k: r.sparsity.per_layer(k) for k in TEAL_INPUTS})
                row["thresholds"] = {k: cal.thresholds(k, target).tolist() for k in TEAL_INPUTS}
            else:
                thr = (1.0, 1.0)
            row["bytes"] = {"all": thr[0], "layers": thr[1]}
            if not a.quiet:
                print(f"{method} {target:.2f}: ppl {r.ppl:.4f}", file=sys.stderr)
            return row

        dense = measure("none", 0.0)
        rows.append(dense)
        for method in a.methods:
            for t in sorted(x for x in a.levels if x > 0):
                rows.append(measure(method, t))
        searches = {}
        if a.budget is not None:
            from kairox.threshold_search import mass_ladder, quantile_ladder, search

            hist = cal.hist("gate")
            say = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
            for ladder in (mass_ladder(hist), quantile_ladder(hist)):
                sr = search(ladder, lambda thr: em.cats_perplexity(held, thr), a.budget, say=say)
                searches[ladder.name] = sr.to_json()
                g = wb.cats(sr.sparsity, False), wb.cats(sr.sparsity, True)
                searches[ladder.name]["bytes"] = {"threshold": {"all": g[0][0], "layers": g[0][1]},
                                                  "predicted": {"all": g[1][0], "layers": g[1][1]}}
    for r in rows:
        r["delta_pct"] = 100.0 * (r["ppl"] / dense["ppl"] - 1.0)
    res = {"model": model.name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "git_head": git_head(), "machine": machine(), "ctx": a.ctx,
           "calib_segments": len(calib), "calib_tokens": int(sum(map(len, calib))),
           "eval_segments": len(held), "eval_tokens": int(sum(map(len, held))), "scored": dense["scored"],
           "max_values": a.max_values,
           "perplexity": "each segment one prompt from an empty KV cache, logits for every token, the "
                         "second half scored (positions n//2 .. n-2 predict the next token), exp of the mean "
                         "natural-log NLL over all scored tokens",
           "weight_bytes": {"dense": wb.dense, "dense_layers": wb.dense_layers, "head": wb.head,
                            "embd_row": wb.embd_row, "teal_layout": wb.teal_layout_bytes(),
                            "per_layer": wb.layers},
           "rows": rows, "budget_search": searches, "seconds": time.perf_counter() - t_all}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = f"sparsity-quality-{model.stem}" + ("" if a.levels and a.methods else "-budget")
    (a.out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (a.out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
