"""`kairox synth`: write a synthetic LLaMA-shaped model, and its pack, for benchmarks (kairox.synth)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from ..pack import DOWN_TYPES, PRED_TYPES
from ..argtypes import number_in, positive_int
from ..synth import (DEFAULT_DOMAIN_SHARE, DEFAULT_DOMAINS, DEFAULT_RATE_SPREAD, DEFAULT_SPARSITY, DEFAULT_TOPIC_SHARE,
                     DEFAULT_TOPICS, DOMAIN_NAMES, FTYPES, PRESETS, SparseFFN, SynthError, calibrated_thresholds,
                     measured_layout, synth)

# what `kairox synth --help` says (kairox.synth's docstring is for developers)
HELP = """Write a synthetic LLaMA-shaped model (presets KB-tiny to KB-70B, or your own shape) for
benchmarks: random weights at disk speed, the same bytes for the same seed. With ReLU (the
default) about 89% of the FFN activations are zero and which ones is predictable, as in a
real sparse model; topics and domains make the active neurons drift between prompts.
--pack also writes its sparse pack. KB-MoE (Qwen3-30B-A3B's shape in Q4_0, ~16 GiB) and
KB-MoE-tiny are mixtures of experts with random weights, for the VRAM budget's placement.
How the weights are built: `python -m pydoc kairox.synth`.
"""


def cmd_synth(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"kairox synth: error: {msg}", file=sys.stderr)
        return 2

    shape = PRESETS[args.preset]
    if args.act is None:
        args.act = "silu" if shape.moe else "relu"
    if shape.moe and (args.act != "silu" or args.pack or args.pack_only):
        return fail(f"{args.preset} is a mixture of experts: its experts are dense random SwiGLU (--act silu) and "
                    "it has no sparse pack (a VRAM budget places its tensors whole, experts by the share a token reads)")
    if args.type:
        shape = dataclasses.replace(shape, ftype=args.type)
    if args.layers:
        shape = dataclasses.replace(shape, n_layer=args.layers)
    sparse = None
    given = {k: v for k in ("sparsity", "gate_rank", "rate_spread", "topics", "topic_share", "domains",
                            "domain_share")
             if (v := getattr(args, k)) is not None}
    if args.act == "relu":
        sparse = SparseFFN(**given)
    elif given:
        return fail("--sparsity, --gate-rank, --rate-spread, --topics, --topic-share, --domains and "
                    "--domain-share apply only to --act relu (a SiLU model is dense)")
    out = Path(args.outfile or f"{args.preset}-{shape.ftype}.gguf")
    if args.pack_only:
        # the model was written by an earlier run (same preset and options): its pack only
        if not out.is_file():
            return fail(f"--pack-only: no model at {out} (synthesize it first, without --pack-only)")
        path = out
    else:
        if out.exists() and not args.force:
            return fail(f"{out} exists; give --force to replace it (or --pack-only to write its pack)")
        try:
            path = synth(out, shape, seed=args.seed, vocab_gguf=args.vocab_gguf,
                         act=args.act, sparse=sparse, quiet=args.quiet)
        except SynthError as e:
            return fail(str(e))
        print(f"kairox synth: wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB)")
    if args.pack or args.pack_only:
        from ..pack import PackError, default_down_type, inspect_model, write_pack
        from ..predictor import sketch_for_model
        try:
            layout = tables = None
            predictor = sketch_for_model(path, dtype=args.pred_type)
            if args.profile and args.act == "relu":
                from ..thresholds import CALIBRATION_TOKENS
                layout, xs = measured_layout(path, args.profile, args.seed, quiet=args.quiet,
                                             keep_x=CALIBRATION_TOKENS)
                predictor, tables = calibrated_thresholds(path, predictor, xs, quiet=args.quiet)
            pk = write_pack(path, predictor=predictor, quiet=args.quiet, layout=layout, thresholds=tables,
                            method={"kind": "synth", "profile_tokens": args.profile if layout else 0},
                            down_type=args.down_type or default_down_type(inspect_model(path)[0]))
        except PackError as e:
            return fail(str(e))
        print(f"kairox synth: wrote {pk} ({os.path.getsize(pk) / 2**30:.2f} GiB)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic LLaMA-shaped model, sparse with ReLU (benchmarks)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="KB-7B",
                   help="model shape (default: %(default)s)")
    p.add_argument("-o", "--outfile", help="output GGUF (default: PRESET-TYPE.gguf)")
    p.add_argument("--force", action="store_true", help="replace an existing output model")
    p.add_argument("--type", choices=FTYPES, help="weight type (default: the preset's)")
    p.add_argument("--layers", type=positive_int, metavar="N",
                   help="the preset's shape with N layers (default: the preset's): a layer's kernels and "
                        "timings at a fraction of the model's size")
    p.add_argument("--act", choices=["relu", "silu"],
                   help="FFN activation; silu writes a dense all-random model (default: relu; silu for "
                        "the mixture-of-experts presets KB-MoE*, Qwen3-MoE's layout)")
    p.add_argument("--sparsity", type=number_in(0.0, 1.0, lo_open=True), metavar="S",
                   help=f"ReLU only: target fraction of zero FFN activations (default: {DEFAULT_SPARSITY})")
    p.add_argument("--gate-rank", type=int, metavar="R",
                   help="ReLU only: rank of each ffn_gate, the bias channel included, in "
                        "2..min(n_ff, n_embd); the sketch predictor needs rank >= R to see it "
                        "all (default: n_embd/16)")
    p.add_argument("--rate-spread", type=float, metavar="SIGMA",
                   help=f"ReLU only: σ of the log firing rate across neurons, 0 for equal rates "
                        f"(default: {DEFAULT_RATE_SPREAD})")
    p.add_argument("--topics", type=int, metavar="K",
                   help=f"ReLU only: token topics in the embedding, 0 for none (default: {DEFAULT_TOPICS})")
    p.add_argument("--topic-share", type=float, metavar="RHO",
                   help=f"ReLU only: share of a token's embedding from its topic (default: {DEFAULT_TOPIC_SHARE})")
    p.add_argument("--domains", type=int, metavar="D",
                   help=f"ReLU only: topic domains (each with its own common words), 0 for none "
                        f"(default: {DEFAULT_DOMAINS}: {', '.join(DOMAIN_NAMES)})")
    p.add_argument("--domain-share", type=float, metavar="RHO",
                   help=f"ReLU only: share of a token's embedding from its domain (default: {DEFAULT_DOMAIN_SHARE})")
    p.add_argument("--profile", type=int, default=2048, metavar="TOKENS",
                   help="with --pack: measure each neuron's activation frequency on this many tokens "
                        "of topic text and store it in the pack (static placement ranks neurons by it); "
                        "0: frequencies unknown (default: %(default)s)")
    p.add_argument("--pack", action="store_true",
                   help="also write the sparse pack (sketch predictor; down rows F16 for F16 "
                        "models, Q8_0 for quantized ones) so that predicted mode works")
    p.add_argument("--pack-only", action="store_true",
                   help="write only the pack of a model an earlier run synthesized at OUTFILE "
                        "(model writing needs no GPU, the pack's --profile uses one: split on a GPU machine)")
    p.add_argument("--down-type", choices=DOWN_TYPES,
                   help="with --pack / --pack-only: the pack's down rows, as `kairox pack --down-type`")
    p.add_argument("--pred-type", choices=PRED_TYPES,
                   help="with --pack / --pack-only: the predictor's storage, as `kairox pack --pred-type`")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--vocab-gguf", type=Path, help="GGUF whose tokenizer to copy (default: LLaMA SPM)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)
