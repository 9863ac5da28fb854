"""`kairox stats PACK`: a pack's activation statistics next to the papers' values (kairox.stats)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..stats import ModelStats, format_table, plot_stats

# what `kairox stats --help` says (kairox.stats's docstring is for developers)
HELP = """Print a pack's activation statistics, measured by `kairox prepare`, next to the values the
papers report: FFN density, the share of neurons carrying 80% of the activations, the
distance between the active sets of adjacent tokens and of different prompts, and how well
one layer predicts the next. --png draws them. Definitions: `python -m pydoc kairox.stats`.
"""


def cmd_stats(args: argparse.Namespace) -> int:
    """Show the statistics stored in a pack: table (default) or JSON, optionally PNGs."""
    from ..pack import PackError, read_pack_stats

    def fail(msg: str) -> int:
        print(f"kairox stats: error: {msg}", file=sys.stderr)
        return 2

    path = Path(args.pack)
    if not path.is_file():
        return fail(f"pack file not found: {path}")
    try:
        text = read_pack_stats(path)
    except PackError as e:
        return fail(f"cannot read {path}: {e}")
    except OSError as e:
        return fail(f"cannot read {path} ({e.strerror or e})")
    if text is None:
        return fail(f"{path} has no activation statistics; profile the model with "
                    f"`kairox prepare MODEL.gguf` to write a pack that has them")
    try:
        stats = ModelStats.from_json(text)
    except ValueError as e:
        return fail(f"{path} holds unreadable statistics: {e}")
    print(stats.to_json(indent=1) if args.json else format_table(stats))
    if args.png:
        try:
            paths = plot_stats(stats, args.png)
        except (RuntimeError, OSError) as e:
            return fail(str(e))
        # with --json, stdout stays pure JSON
        for p in paths:
            print(f"kairox stats: wrote {p}", file=sys.stderr if args.json else sys.stdout)
    return 0


def register(sub: Any) -> argparse.ArgumentParser:
    """Add the `stats` subcommand to an argparse subparsers object."""
    p = sub.add_parser("stats", help="show a pack's activation statistics next to the papers' values",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pack", metavar="PACK", help="the sparse pack (MODEL.kxpack.gguf)")
    p.add_argument("--png", metavar="DIR", help="also write the plots (stats-*.png) into DIR")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON instead of a table")
    p.set_defaults(func=cmd_stats)
    return p
