"""`kairox report TRACE`: the live balancer's records drawn over time.

A trace is what `kairox run --kx-trace FILE` (or `bench/tpot.py --balance-trace`) writes:
one JSON object per step and hybrid layer (struct kx_balance_record: step, layer, n_active,
n_hit, n_load, n_evict, stall, lam, wait_us, decide_us, reload_bytes; late, decided), plain or
gzip-compressed. The report draws, per step, the GPU hit rate (listed neurons computed from
slots), the reloads, the stall types and λ (mean over layers, with the spread), and prints a
summary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .balancer import STALLS
from .trace import READ_ERRORS, read_text

FIELDS = ("step", "layer", "n_active", "n_hit", "n_load", "n_evict", "stall", "lam", "wait_us", "decide_us",
          "reload_bytes")


class TraceError(ValueError):
    """Not a balancer trace."""


def write_trace(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Records of a trace file (JSON lines, plain or gzip-compressed: told by the file's first
    bytes, as the scheduler trace's reader does)."""
    try:
        text = read_text(path)
    except READ_ERRORS as e:
        raise TraceError(f"{path}: cannot read ({e})") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            missing = [f for f in FIELDS if f not in r]
            if missing or r["stall"] not in STALLS:
                raise ValueError(f"missing {', '.join(missing)}" if missing else f"stall {r['stall']!r}")
        except ValueError as e:
            raise TraceError(f"{path}:{i}: not a balancer trace record ({e})") from None
        out.append(r)
    if not out:
        raise TraceError(f"{path}: no records")
    return out


def per_step(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Arrays over steps: hit rate, loads, reload MiB, stall counts, λ mean / min / max."""
    steps = sorted({r["step"] for r in records})
    idx = {s: k for k, s in enumerate(steps)}
    n = len(steps)
    act, hit, loads, mib = (np.zeros(n) for _ in range(4))
    stalls = {s: np.zeros(n) for s in STALLS}
    lams: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        k = idx[r["step"]]
        act[k] += r["n_active"]
        hit[k] += r["n_hit"]
        loads[k] += r["n_load"]
        mib[k] += r["reload_bytes"] / 2**20
        stalls[r["stall"]][k] += 1
        lams[k].append(r["lam"])
    # a step whose activity was not recorded (the pipeline's last one) has no hit rate: a gap
    return {"step": np.array(steps), "hit_rate": np.divide(hit, act, out=np.full(n, np.nan), where=act > 0),
            "loads": loads, "reload_mib": mib, **{f"stall_{s}": v for s, v in stalls.items()},
            "lam_mean": np.array([np.mean(x) for x in lams]), "lam_min": np.array([min(x) for x in lams]),
            "lam_max": np.array([max(x) for x in lams])}


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of a whole trace: hit rate, loads and MiB per step, stalls, worst wait,
    decision time per step, λ at the first and last step (mean over layers)."""
    s = per_step(records)
    n = len(s["step"])
    act = sum(r["n_active"] for r in records)
    return {"steps": n, "layers": len({r["layer"] for r in records}),
            "hit_rate": sum(r["n_hit"] for r in records) / act if act else 0.0,
            "loads_per_step": float(s["loads"].mean()), "reload_mib_per_step": float(s["reload_mib"].mean()),
            "stalls": {k: int(sum(s[f"stall_{k}"])) for k in STALLS},
            "wait_us_max": max(r["wait_us"] for r in records),
            # pipeline: layer steps whose loads had not landed when their layer began, and steps
            # skipped because earlier loads were still in flight
            "late_loads": sum(1 for r in records if r.get("late", 0) & 2),
            "skipped": sum(1 for r in records if r.get("late", 0) & 1),
            "decide_us_per_step": sum(r["decide_us"] for r in records) / n,
            # pipeline with the balancer's thread: the CPU parts' waits for its decisions
            "hold_us_per_step": sum(r.get("hold_us", 0.0) for r in records) / n,
            "lam_first": float(s["lam_mean"][0]), "lam_last": float(s["lam_mean"][-1])}


def draw(records: list[dict[str, Any]], png: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = per_step(records)
    x = s["step"]
    fig, ax = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    ax[0].plot(x, s["hit_rate"], lw=1)
    ax[0].set_ylabel("GPU hit rate")
    ax[0].set_ylim(0, 1)
    ax[1].plot(x, s["reload_mib"], lw=1, color="tab:orange")
    ax[1].set_ylabel("reload MiB")
    bottom = np.zeros(len(x))
    for k, c in zip(STALLS, ("tab:gray", "tab:red", "tab:blue")):
        ax[2].bar(x, s[f"stall_{k}"], bottom=bottom, width=1.0, color=c, label=k)
        bottom += s[f"stall_{k}"]
    ax[2].set_ylabel("layers by stall")
    ax[2].legend(loc="upper right", ncol=3, fontsize=8)
    ax[3].plot(x, s["lam_mean"], lw=1, color="k", label="mean")
    ax[3].fill_between(x, s["lam_min"], s["lam_max"], alpha=0.3, label="min-max over layers")
    ax[3].set_ylabel("λ")
    ax[3].set_xlabel("decode step")
    ax[3].legend(loc="upper right", fontsize=8)
    fig.suptitle(title or "live balancer")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
