"""`kairox pack MODEL.gguf`: write the model's sparse pack, with a sketch predictor by default.

A pack is a sidecar GGUF next to the model (`model.gguf` -> `model.kxpack.gguf`) holding
what kairox needs to run the model's FFN sparsely: each layer's down projection laid out
one row per neuron, the neuron order and grouping, activation statistics and, optionally,
an activation predictor per layer (docs/pack-format.md). The model file is only read; the
pack records the model's fingerprint, so it is refused if used with any other model.

This command writes an *identity* pack (neurons in their original order, groups of
consecutive neurons, frequencies unknown) and, by default, the *sketch* predictor: a
low-rank projection of each layer's gate computed from the weights alone (no sample
text), biased upward by K (--margin) standard deviations of its own error so that it
over-predicts rather than misses active neurons (python/kairox/predictor.py).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from ..argtypes import number_in, positive_int
from ..pack import DOWN_TYPES, PRED_TYPES, PackError, default_down_type, inspect_model, pack_path_for, write_pack
from ..predictor import DEFAULT_MARGIN, sketch_for_model

# what `kairox pack --help` says (the module docstring above is for developers)
HELP = """Write a model's sparse pack, a sidecar GGUF next to it (model.gguf -> model.kxpack.gguf):
the down projection one row per neuron and, by default, a predictor computed from the weights
alone (no text needed) that over-predicts rather than misses active neurons (--margin). The
model file is only read; the pack is tied to it by a fingerprint and checksummed. For a pack
measured on real text (trained predictors, neuron groups, statistics) use `kairox prepare`.
The format: docs/pack-format.md."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_pack(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"kairox pack: error: {msg}", file=sys.stderr)
        return 2

    model = Path(args.model)
    if not model.is_file():
        return fail(f"model file not found: {model}")
    if args.predictor == "none" and (args.rank is not None or args.margin is not None
                                     or args.pred_type is not None):
        return fail("--rank, --margin and --pred-type apply only to --predictor sketch")
    out = Path(args.outfile) if args.outfile else pack_path_for(model)
    if out.exists() and not args.force:
        return fail(f"{out} exists; give --force to replace it")
    t0 = time.perf_counter()
    try:
        hdr, base = inspect_model(model)
        down_type = args.down_type or default_down_type(hdr)
        predictor = None
        if args.predictor == "sketch":
            margin = DEFAULT_MARGIN if args.margin is None else args.margin
            predictor = sketch_for_model(model, args.rank, margin, args.pred_type)
        # its thresholds are 0, and every neuron of a gated (SiLU/GELU) model fires above 0: its
        # lists hold every neuron, so the runtime keeps such a model dense (docs/prepare.md)
        gated = base.activation != "relu"
        path = write_pack(model, out, group_size=args.group_size, down_type=down_type,
                          predictor=predictor, quiet=args.quiet,
                          listed_density=[1.0] * base.n_layer if gated else None)
    except PackError as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot write {out} ({e.strerror or e})")
    wall = time.perf_counter() - t0
    pred = ("no predictor" if predictor is None else
            f"sketch predictor rank {predictor.rank}, margin {predictor.info['margin']:g} "
            f"({predictor.dtype})")
    print(f"kairox pack: wrote {path} ({_size(path.stat().st_size)})")
    print(f"kairox pack: {base.n_layer} layers x {base.n_ff} neurons ({base.architecture}, "
          f"{base.activation}), groups of {args.group_size}, down rows {down_type}, {pred}; "
          f"{wall:.1f} s")
    if gated:
        print(f"kairox pack: every neuron of a {base.activation} model fires at threshold 0, so its sparse modes run "
              f"it dense; `kairox prepare {model}` measures thresholds within a perplexity budget")
    return 0


def register(sub) -> None:
    p = sub.add_parser("pack", help="write a model's sparse pack (model.kxpack.gguf), with a predictor",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL.gguf", help="the model GGUF (llama, qwen2 or gemma3); only read")
    p.add_argument("-o", "--outfile", metavar="OUT",
                   help="pack to write (default: next to the model, MODEL.kxpack.gguf)")
    p.add_argument("--down-type", choices=DOWN_TYPES,
                   help="storage of the down-projection rows: f32, f16, q8_0 (n_embd divisible by "
                        "32), or q4_k / q6_k (by 256: half or three quarters of q8_0's bytes, more "
                        "neurons per GPU slot byte, the model's own rounding twice) (default: f32 if "
                        "the model's ffn_down is F32, f16 if F16/BF16, q4_k for a 2-4-bit K-quant such "
                        "as Q4_K_M, else q8_0)")
    p.add_argument("--group-size", type=positive_int, default=32, metavar="G",
                   help="neurons per group, the unit the sparse FFN loads and computes "
                        "(default: %(default)s)")
    p.add_argument("--predictor", choices=("none", "sketch"), default="sketch",
                   help="per-layer activation predictor: the low-rank sketch of the gate, or none "
                        "(default: %(default)s)")
    p.add_argument("--rank", type=positive_int, metavar="R",
                   help="sketch rank, at most min(n_ff, n_embd); higher predicts more precisely "
                        "and costs more per token (default: max(8, n_embd/16))")
    p.add_argument("--margin", type=number_in(0.0, math.inf), metavar="K",
                   help="sketch bias in standard deviations of its error; higher misses fewer "
                        f"active neurons and predicts more inactive ones (default: {DEFAULT_MARGIN:g})")
    p.add_argument("--pred-type", choices=PRED_TYPES,
                   help="storage of the sketch factors (default: f32 for an F32 model, f16 for "
                        "F16/BF16, q8_0 for a quantized one)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.set_defaults(func=cmd_pack)
