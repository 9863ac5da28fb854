#!/usr/bin/env python3
"""What the back-off's probing costs over a long run, modelled from measured rows.

A balancer that loses every probe (as every kind has on KB-7B, stationary and drifting) still
runs the probe's tokens and pays a return to the static split after each. How many of each a
run of N tokens holds follows from the schedule alone (kairox.backoff fed probes that always
lose: exact); what each costs comes from `bench/balance_live.py` rows of one workload:

    speed vs static = N / (held + on / r + returns * t_return / t_static)

t_return from the back-off rows' `counters.boundary.home_ns / homes`, t_static the static
rows' median token time, and r, a probe token's speed against the static split, two ways:
  bound       the balancer's speed in rows run without the back-off (it runs throughout; a
              probe token, which starts from the static split, costs no more);
  calibrated  the r that reproduces the back-off rows' own median ratio at their length and
              the default cap (noisy: the machine's spread between static rows is of the
              same size as the whole effect at 1024 tokens).
The table says what each doubling cap costs over longer runs, and how late a drift that
starts after a long stationary stretch is seen (the longest hold, window x 2^max_doubling).

  python3 bench/backoff_schedule.py --backoff WITH.json --no-backoff NO.json --out DIR/backoff-schedule
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.backoff import Backoff, BackoffConfig  # noqa: E402
from kairox.bench import git_commit, write_results  # noqa: E402


def schedule(n: int, cfg: BackoffConfig) -> tuple[int, int]:
    """(balancer tokens, returns) in n tokens when every probe loses."""
    b = Backoff(cfg)
    on = homes = 0
    for _ in range(n):
        on += b.on
        b.step(2.0 if b.on else 1.0)  # the balancer's tokens always slower: every probe lost
        homes += b.home
    return on, homes


def kind_of(label: str) -> str:
    """A balance_live.py row label's kind: 'adaptive λ0=0.5 [--backoff=16]' -> 'adaptive'."""
    return label.split()[0]


def medians_by_kind(rows: list[dict]) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(kind_of(r["row"]), []).append(r["tok_s"])
    return {k: statistics.median(v) for k, v in out.items()}


def return_seconds(rows: list[dict]) -> dict[str, float]:
    """Per kind: the mean return's seconds over the rows that made any."""
    ns: dict[str, list[float]] = {}
    for r in rows:
        b = (r.get("counters") or {}).get("boundary") or {}
        if b.get("homes"):
            ns.setdefault(kind_of(r["row"]), []).append(b["home_ns"] / b["homes"] / 1e9)
    return {k: statistics.mean(v) for k, v in ns.items()}


def cost(n: int, cfg: BackoffConfig, ratio: float, t_return: float, t_static: float) -> dict:
    """The modelled run: balancer tokens, returns and speed against the static split."""
    on, homes = schedule(n, cfg)
    t = (n - on) + on / ratio + homes * t_return / t_static
    return {"tokens": n, "max_doubling": cfg.max_doubling, "longest_hold": cfg.window * 2 ** cfg.max_doubling,
            "balancer_tokens": on, "returns": homes, "vs_static": n / t}


def probe_ratio(measured: float, n: int, cfg: BackoffConfig, t_return: float, t_static: float) -> float:
    """r such that cost(n, cfg, r, ...) is the measured speed ratio (inf: probe tokens free)."""
    on, homes = schedule(n, cfg)
    probe = n / measured - (n - on) - homes * t_return / t_static
    return on / probe if probe > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backoff", required=True, help="bench/balance_live.py JSON of rows run with the back-off")
    ap.add_argument("--no-backoff", required=True, help="... and of the same kinds run without it")
    ap.add_argument("--doubling", type=int, nargs="+", default=[4, 5, 6, 8], help="max_doubling values")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 65536], help="run lengths")
    ap.add_argument("--out", required=True, help="output prefix (.json and .md)")
    args = ap.parse_args(argv)
    wi = json.loads(Path(args.backoff).read_text())
    med = medians_by_kind(wi["rows"])
    no = medians_by_kind(json.loads(Path(args.no_backoff).read_text())["rows"])
    if "static" not in med or "static" not in no:
        ap.error("both files need static rows")
    t_static = 1.0 / med["static"]
    ret = return_seconds(wi["rows"])
    m = re.search(r"--backoff=(\d+)", " ".join(r["row"] for r in wi["rows"]))
    window = int(m.group(1)) if m else BackoffConfig().window
    rows = []
    for k in [k for k in med if k in ret and k in no]:
        bound = no[k] / no["static"]
        calibrated = probe_ratio(med[k] / med["static"], wi["gen"], BackoffConfig(window=window), ret[k], t_static)
        for md in args.doubling:
            cfg = BackoffConfig(window=window, max_doubling=md)
            for n in args.tokens:
                c = cost(n, cfg, bound, ret[k], t_static)
                rows.append({"kind": k, "measured": med[k] / med["static"], "without": bound,
                             "probe_calibrated": calibrated, "return_ms": ret[k] * 1e3, **c,
                             "vs_static_bound": c.pop("vs_static"),
                             "vs_static_calibrated": cost(n, cfg, calibrated, ret[k], t_static)["vs_static"]})
    if not rows:
        ap.error("no balancer kind has rows with returns in one file and rows in the other")
    lines = [f"# The back-off's probing over long runs, modelled ({wi['config']}, session {wi.get('session')})", "",
             f"Measured: `{args.backoff}` (commit {wi['commit'][:10]}, {wi['gen']} tokens, window {window}, every "
             f"probe lost) and `{args.no_backoff}`. Modelled (`bench/backoff_schedule.py`: the schedule exactly, "
             "each token's cost from the rows): bound = probe tokens at the speed of the rows without the "
             "back-off; calibrated = at the speed that reproduces the back-off rows' median (within the "
             "machine's spread). Longest hold: how late a drift after a long stationary stretch is seen.",
             "", "| kind | with back-off (measured) | without (measured) | return ms | max_doubling | longest hold "
             "| tokens | balancer tokens | returns | modelled: bound | calibrated |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['measured']:.3f}x | {r['without']:.3f}x | {r['return_ms']:.1f} | "
                     f"{r['max_doubling']} | {r['longest_hold']} | {r['tokens']} | {r['balancer_tokens']} | "
                     f"{r['returns']} | {r['vs_static_bound']:.3f}x | {r['vs_static_calibrated']:.3f}x |")
    cmd = shlex.join([sys.executable] + (sys.argv if argv is None else [__file__, *argv]))
    write_results(args.out, {"command": cmd, "commit": git_commit(), "inputs": [args.backoff, args.no_backoff],
                             "window": window, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
