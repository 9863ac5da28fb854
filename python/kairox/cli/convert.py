"""`kairox convert HF_DIR`: a Hugging Face llama-family checkpoint to GGUF (kairox.convert)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..convert import OUTTYPES, ConvertError, convert, default_outfile


def cmd_convert(args: argparse.Namespace) -> int:
    out = Path(args.outfile) if args.outfile else default_outfile(args.hf_dir, args.outtype)
    try:
        path = convert(args.hf_dir, out, outtype=args.outtype, vocab_gguf=args.vocab_gguf,
                       quiet=args.quiet)
    except ConvertError as e:
        print(f"kairox convert: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the `convert` subcommand to an argparse subparsers object."""
    p = sub.add_parser(
        "convert", help="Hugging Face llama-family checkpoint -> GGUF",
        description="Convert a Hugging Face checkpoint folder (config.json + *.safetensors) of a "
        "LlamaForCausalLM or MistralForCausalLM model to GGUF. The FFN activation (relu, silu, "
        "gelu) is recorded so that kairox's llama.cpp computes the one the model was trained with.",
        epilog="The vocabulary comes from --vocab-gguf if given, else from the checkpoint's "
        "tokenizer.model (needs the sentencepiece package) or tokenizer.json (byte-level BPE).")
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint folder holding config.json and safetensors")
    p.add_argument("-o", "--outfile", metavar="FILE",
                   help="output GGUF (default: HF_DIR/<folder name>-<outtype>.gguf)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16",
                   help="type of the weight matrices; norms always stay f32 (default: %(default)s)")
    p.add_argument("--vocab-gguf", metavar="FILE",
                   help="copy the tokenizer (every tokenizer.* key) from this GGUF instead of "
                   "reading the checkpoint's tokenizer files")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)
    return p
