"""`kairox` command line: one entry point, one subcommand per job.

  kairox run [-m MODEL] [-p PROMPT]   generate text (default model: Gemma 3 270M)
  kairox info [MODEL]                 build facts, or a GGUF's shape and types
  kairox convert HF_DIR               Hugging Face llama-family checkpoint -> GGUF
  kairox synth --preset KB-7B         synthetic LLaMA-shaped ReLU model for benchmarks
  kairox pack MODEL                   the sparse pack next to a model (sketch predictor)
  kairox prepare MODEL                profile on text: a pack with trained predictors and groups
  kairox stats PACK                   a pack's activation statistics against the papers'
  kairox plan MODEL --vram-budget S   the GPU placement for a VRAM budget
  kairox profile-hw                   this machine's bandwidths, for `kairox plan --hw`
  kairox trace FILE                   a scheduler trace: CPU/GPU overlap per layer
  kairox balance MODEL                the online balancer simulated on recorded activations
  kairox report FILE                  a live-balancer trace drawn over time
"""
from __future__ import annotations

import argparse

from .._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kairox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"kairox {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    # one module per subcommand group, each adding its parsers in the order of the help
    from . import balance, convert, hw, pack, plan, prepare, report, run, stats, synth, trace
    for group in (run, convert, synth, pack, prepare, stats, plan, hw, trace, balance, report):
        group.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not getattr(args, "func", None):
        ap.print_help()
        return 2
    return args.func(args)

