#!/usr/bin/env python3
"""The load's streaming choice against the CPU rate it is priced at. For a model's matrices
(a GGUF's, or a synthetic preset's shape) and budgets, the reference placement with streamed
weights (kairox.migrate.stream_placement, what the runtime's kx_stream_choose reproduces) is
made at each --cpu rate, then each choice's decode step is replayed through the same chain
model at each --truth rate: the CPU rate a host's decode actually reads host weights at. The
table says which pricing chooses best on such a host, and what a wrong one costs: a choice
priced too fast leaves the CPU the critical path, one priced too slow waits on PCIe.

CPU only: a model of the step, not a measurement (bench/device/stream.sh KX_STREAM_HW_CPU
measures the same rows through kairox-bench).

  python3 bench/stream_rates.py --preset KB-7B --budgets 4,7,8 --cpu 19,30,57,100 --truth 57,65,124 --out DIR
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

MiB = 1 << 20


def preset_items(name: str, n_vocab: int) -> list:
    """The placement's matrices of a `kairox synth` preset (no pack): attention, FFN, head."""
    import gguf

    from kairox.gguf_header import tensor_nbytes
    from kairox.plan import DenseItem
    from kairox.synth import PRESETS
    s = PRESETS[name]
    q = gguf.GGMLQuantizationType[s.ftype.upper()]
    kv = (s.head_dim or s.n_embd // s.n_head) * s.n_head_kv
    shapes = {"attn_q": (s.n_embd, s.n_embd), "attn_k": (kv, s.n_embd), "attn_v": (kv, s.n_embd),
              "attn_output": (s.n_embd, s.n_embd), "ffn_gate": (s.n_ff, s.n_embd), "ffn_up": (s.n_ff, s.n_embd),
              "ffn_down": (s.n_embd, s.n_ff)}  # numpy order: (rows, row length)
    items = [DenseItem(f"blk.{il}.{k}.weight", tensor_nbytes(ne, q), s.ftype) for il in range(s.n_layer)
             for k, ne in shapes.items()]
    items.append(DenseItem("output.weight", tensor_nbytes((n_vocab, s.n_embd), q), s.ftype))
    return items


def sweep(items: list, budgets_mib: list[int], fixed: int, cpu: list[float], truth: list[float],
          gpu_gbs: float, pcie_gbs: float, handoff_us: float) -> list[dict]:
    """One row per (budget, pricing): the choice's host and streamed bytes, its modelled step
    at its own rate and at each truth rate (ms)."""
    from kairox.costs import Rates
    from kairox.migrate import host_chain, step_time, stream_placement
    from kairox.plan import HwProfile, PlanError
    by = {it.name: it.nbytes for it in items}
    rows = []
    for b in budgets_mib:
        for c in cpu:
            row = {"budget_mib": b, "cpu_gbs": c}
            try:
                sp = stream_placement(items, fixed, b * MiB, HwProfile(c, gpu_gbs, pcie_gbs, handoff_us))
            except PlanError as e:
                rows.append({**row, "refused": str(e)})
                continue
            chain, gpu = host_chain(items, sp.cpu, sp.scratch)
            row.update(host=len(sp.cpu), streamed=len(sp.streamed),
                       cpu_mib=sum(by[n] for n in sp.cpu if n not in sp.streamed) / MiB,
                       pcie_mib=sum(by[n] for n in sp.streamed) / MiB, modelled_ms=sp.step_s * 1e3,
                       truth_ms={str(t): step_time(chain, set(sp.streamed), Rates(t, gpu_gbs, pcie_gbs), gpu)[0] * 1e3
                                 for t in truth})
            rows.append(row)
    return rows


def summary(rows: list[dict], truth: list[float], name: str) -> list[str]:
    lines = [f"# {name}: the streaming choice priced at each CPU rate, replayed at the host's true rate", "",
             "Step ms per token of each choice (the chain model); **bold**: the best choice for that true rate "
             "at that budget.", "",
             "| budget | priced at CPU GB/s | host / streamed tensors | CPU MiB | PCIe MiB | modelled ms | "
             + " | ".join(f"at {t:g} GB/s" for t in truth) + " |",
             "|---:|---:|---|---:|---:|---:|" + "---:|" * len(truth)]
    for b in sorted({r["budget_mib"] for r in rows}):
        rb = [r for r in rows if r["budget_mib"] == b and "refused" not in r]
        best = {str(t): min((r["truth_ms"][str(t)] for r in rb), default=None) for t in truth}
        for r in (r for r in rows if r["budget_mib"] == b):
            if "refused" in r:
                lines.append(f"| {b} MiB | {r['cpu_gbs']:g} | refused: {r['refused']} |" + " |" * (3 + len(truth)))
                continue
            cells = [(f"**{v:.1f}**" if v == best[k] else f"{v:.1f}") for k, v in r["truth_ms"].items()]
            lines.append(f"| {b} MiB | {r['cpu_gbs']:g} | {r['host']} / {r['streamed']} | {r['cpu_mib']:.0f} | "
                         f"{r['pcie_mib']:.0f} | {r['modelled_ms']:.1f} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from kairox.bench import git_commit, machine_facts, write_results
    from kairox.synth import PRESETS

    def rates(s: str) -> list[float]:
        try:
            v = [float(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of GB/s: {s!r}") from None
        if not v or any(x <= 0 for x in v):
            raise argparse.ArgumentTypeError(f"rates must be positive: {s!r}")
        return v

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=sorted(PRESETS), default="KB-7B", help="a synthetic model's shape")
    src.add_argument("--model", help="a GGUF: its matrices")
    ap.add_argument("--vocab", type=int, default=32000, help="a preset's vocabulary (default: the llama SPM one's)")
    ap.add_argument("--budgets", type=rates, default=[4, 7, 8], help="GiB, comma-separated (default: 4,7,8)")
    ap.add_argument("--fixed-mib", type=float, default=134,
                    help="KV cache and compute buffers on the GPU, MiB (default: KB-7B's at 4096 tokens, 134)")
    ap.add_argument("--cpu", type=rates, default=[19, 30, 45, 57, 75, 100], help="CPU rates to price at, GB/s")
    ap.add_argument("--truth", type=rates, default=[57, 65, 100, 124], help="CPU rates to replay at, GB/s")
    ap.add_argument("--gpu-gbs", type=float, default=2000.0)
    ap.add_argument("--pcie-gbs", type=float, default=55.0)
    ap.add_argument("--handoff-us", type=float, default=23.5)
    ap.add_argument("--out", required=True, help="folder for the JSON and the table")
    a = ap.parse_args(argv)
    if a.model:
        from kairox.gguf_header import scan_header
        from kairox.plan import dense_items
        items = dense_items(scan_header(a.model))
    else:
        items = preset_items(a.preset, a.vocab)
    name = Path(a.model).stem if a.model else a.preset
    budgets = [int(round(b * 1024)) for b in a.budgets]
    rows = sweep(items, budgets, int(a.fixed_mib * MiB), a.cpu, a.truth, a.gpu_gbs, a.pcie_gbs, a.handoff_us)
    result = {"command": "python3 bench/stream_rates.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
              "commit": git_commit(), "machine": machine_facts(), "model": name,
              "rates": {"gpu_gbs": a.gpu_gbs, "pcie_gbs": a.pcie_gbs, "handoff_us": a.handoff_us},
              "fixed_mib": a.fixed_mib, "rows": rows}
    write_results(Path(a.out) / f"stream-rates-{name}", result, summary(rows, a.truth, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
