"""`kairox prepare MODEL.gguf`: profile a model on text and write its sparse pack (kairox.prepare)."""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from ..argtypes import number_in, positive_int
from ..pack import DOWN_TYPES, PRED_TYPES, PackError, fingerprint
from ..prepare import DEFAULT_BUDGET, PrepareConfig, PrepareError, default_work_dir, prepare
from ..stats import format_table

# what `kairox prepare --help` says (kairox.prepare's docstring is for developers)
HELP = """Profile a model on calibration text (a bundled public-domain corpus, or --calib files) and
write its sparse pack: predictors trained on the model's own activations, neurons grouped
by co-activation, thresholds for SiLU/GELU models, statistics, and optionally perplexity
against dense. Each stage is cached in a work folder, so an interrupted run (even a killed
one) continues where it stopped; the pack appears only when complete.
"""


def _fractions(v: str) -> tuple[float, ...]:
    return tuple(number_in(0.0, 1.0)(x) for x in v.split(",") if x.strip())


def cmd_prepare(args: Any) -> int:
    cfg = PrepareConfig(
        calib=[Path(c) for c in args.calib or []], target_sparsity=args.target_sparsity,
        ppl_budget=args.ppl_budget,
        group_size=args.group_size, rank=args.rank, max_tokens=args.tokens,
        max_fit_tokens=args.fit_tokens, heldout=args.heldout, n_ctx=args.ctx,
        target_recall=args.recall, threads=args.threads, seed=args.seed, down_type=args.down_type,
        pred_type=args.pred_type,
        ppl_targets=args.ppl_curve or (), ppl_chunks=args.ppl_chunks,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        out=Path(args.outfile) if args.outfile else None, quiet=args.quiet)
    model = Path(args.model)
    if not model.is_file():
        print(f"kairox prepare: error: model file not found: {model}", file=sys.stderr)
        return 2
    if args.fresh:
        try:
            root = cfg.work_dir or default_work_dir(model, fingerprint(model))
        except PackError as e:
            print(f"kairox prepare: error: {e}", file=sys.stderr)
            return 2
        shutil.rmtree(root, ignore_errors=True)
    try:
        res = prepare(model, cfg)
    except (PrepareError, ValueError) as e:
        print(f"kairox prepare: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kairox prepare: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    print(format_table(res.stats))
    times = ", ".join(f"{k} {v:.1f} s" for k, v in res.seconds.items())
    print(f"\nkairox prepare: wrote {res.pack} ({times})")
    if b := res.stats.extra.get("ppl_budget"):
        sp = b["sparsity"]
        print(f"kairox prepare: thresholds within a perplexity budget of +{b['budget']:.1%}: held-out perplexity "
              f"{b['dense_ppl']:.4f} dense, {b['ppl']:.4f} thresholded ({b['rise']:+.2%}); they skip "
              f"{sum(sp) / len(sp):.1%} of the neurons (layers {min(sp):.0%}-{max(sp):.0%})")
    print(f"kairox prepare: {res.stats.extra['gain']}")
    if res.stats.extra.get("sparse_layers"):
        print(f"kairox prepare: run it with: kairox run -m {model} --sparse predicted")
    else:
        print(f"kairox prepare: run the model dense (the default): kairox run -m {model}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("prepare", help="profile a model on text and write its sparse pack "
                       "(thresholds, predictors, neuron groups, statistics)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.gguf", help="the model (llama, qwen2 or gemma3); only read")
    p.add_argument("-o", "--outfile", metavar="OUT", help="pack to write (default: MODEL.kxpack.gguf)")
    p.add_argument("--calib", action="append", metavar="TEXTFILE",
                   help="calibration text, UTF-8, one document per file; repeat for several "
                        "(default: the bundled public-domain corpus, see kairox/data/calib/SOURCES.md)")
    p.add_argument("--ppl-budget", type=number_in(0.0, 1.0), default=DEFAULT_BUDGET, metavar="F",
                   help="gated SiLU/GELU models: the per-layer thresholds on |act(gate)| are the largest "
                        "whose perplexity on held-out text rises by at most F over dense (default: "
                        "%(default)s = 2%%); each layer leaves out the same share of its activation mass. "
                        "ReLU models always use their exact zeros")
    p.add_argument("--target-sparsity", type=number_in(0.0, 1.0), metavar="S",
                   help="gated models, instead of --ppl-budget: the same fraction of neurons left "
                        "inactive per token in every layer, whatever it costs in quality")
    p.add_argument("--group-size", type=positive_int, default=32, metavar="G",
                   help="neurons per group, the unit of loading (default: %(default)s)")
    p.add_argument("--rank", type=positive_int, metavar="R",
                   help="predictor rank (default: from a budget of 6%% of the model's parameters "
                        "for both predictors, at most n_embd/8)")
    p.add_argument("--tokens", type=positive_int, default=32768, metavar="N",
                   help="calibration tokens to profile, training and held-out (default: %(default)s)")
    p.add_argument("--fit-tokens", type=positive_int, default=16384, metavar="N",
                   help="training tokens whose FFN inputs train the predictors (default: %(default)s)")
    p.add_argument("--heldout", type=number_in(0.01, 0.5), default=0.15, metavar="F",
                   help="tail of each document held out for evaluation (default: %(default)s)")
    p.add_argument("--ctx", type=positive_int, default=512, metavar="N",
                   help="tokens per profiled prompt (default: %(default)s)")
    p.add_argument("--recall", type=number_in(0.5, 1.0), default=0.99, metavar="R",
                   help="per-neuron recall the predictors are calibrated to (default: %(default)s)")
    p.add_argument("-t", "--threads", type=positive_int, metavar="N", help="CPU threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling, training, grouping (default: 0)")
    p.add_argument("--down-type", choices=DOWN_TYPES,
                   help="storage of the down rows, as `kairox pack --down-type` (and the same default)")
    p.add_argument("--pred-type", choices=PRED_TYPES,
                   help="storage of the predictors (default: f32 for an F32 model, f16 for F16/BF16, "
                        "q8_0 for a quantized one)")
    p.add_argument("--ppl-curve", type=_fractions, metavar="S1,S2,...",
                   help="also measure held-out perplexity (llama-perplexity): dense, predicted, "
                        "and threshold mode at these target sparsities, e.g. 0.3,0.4,0.5,0.6 (slow)")
    p.add_argument("--ppl-chunks", type=positive_int, default=8, metavar="N",
                   help="perplexity chunks of --ctx tokens (default: %(default)s)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="where stages are cached; an interrupted run continues from it "
                        "(default: $KAIROX_CACHE/prepare/MODEL-FINGERPRINT, ~/.cache/kairox)")
    p.add_argument("--fresh", action="store_true", help="discard the cached stages first")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prepare)
