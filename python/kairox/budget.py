"""VRAM budget: how many neuron slots fit, and whether a run stayed under its budget.

The runtime measures, it does not model: `kairox.Llama(vram_budget=...)` reads the GPU's
free memory (cudaMemGetInfo) before the model loads, after it loaded with its dense
tensors, KV cache and compute buffers on the GPU ("base"), and after a warm-up batch of
n_ubatch tokens with the slots in place ("used", which includes the predictors, the slot
buffers and whatever the first batches allocate: cuBLAS workspaces, memory pools). The
CUDA context itself exists before the first reading and is not counted, as llama.cpp's
own buffer log does not count it (~0.3-0.5 GiB on the GPU machine). Other processes on the
same GPU change the readings: the budget assumes the GPU is ours while loading.

The arithmetic is here, apart from the measurements, so it can be tested anywhere.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .plan import HwProfile, SlotCosts, solve_slots

MiB = 1 << 20


class VramBudgetError(ValueError):
    """The model cannot run within the VRAM budget; the message says what took the memory."""


def margin_for(budget: int) -> int:
    """Bytes kept free for what the run allocates after the base reading: the hybrid graph's
    buffers, and what the first kernels take outside llama.cpp's buffers (cuBLAS workspaces,
    the CUDA memory pool's temporaries, kernel code loaded on first use): 3%, at least 256
    MiB. Measured on the GPU machine with no slots at all, the warm-up added 98 MiB on KB-tiny
    and 192-196 MiB on KB-7B F16; KB-7B's hybrid took 6953 MiB of buffers under a 7168 MiB
    budget with 3% kept free."""
    return max(256 * MiB, budget * 3 // 100)


def _mib(b: int) -> str:
    return f"{b / MiB:.0f} MiB"


def auto_slots(budget: int, base: int, costs: SlotCosts) -> int:
    """Slots per layer (the same for every layer) that fill what the budget leaves; 0 when
    the slots' predictors do not fit (every FFN then runs on the CPU)."""
    margin = margin_for(budget)
    if budget < base + margin:
        raise VramBudgetError(
            f"a VRAM budget of {_mib(budget)} is too small: the dense tensors, KV cache and compute buffers "
            f"alone took {_mib(base)} on the GPU, with a margin of {_mib(margin)}. Give at least "
            f"{_mib(base + margin)}, or lower n_ctx / n_ubatch")
    left = budget - margin - base - costs.pred
    return 0 if left < 0 else max(0, min(costs.n_ff, left // (costs.per_neuron * costs.n_layer)))


def auto_slot_counts(budget: int, base: int, costs: SlotCosts, freqs: Sequence[np.ndarray] | None,
                     hw: HwProfile | None = None) -> list[int]:
    """Slots per layer that fill what the budget leaves: the slot solve (plan.solve_slots) over
    each layer's measured activation frequencies (the pack's), so the bytes go to the neurons
    that save the most seconds per byte, whichever layer they are in. Every layer gets
    `auto_slots`' count when the frequencies are unknown (None, or all 1)."""
    s = auto_slots(budget, base, costs)
    if freqs is None or all(np.all(np.asarray(f) == 1) for f in freqs):
        return [s] * costs.n_layer
    left = budget - margin_for(budget) - base - costs.pred
    if left <= 0:
        return [0] * costs.n_layer
    slots, _ = solve_slots([np.asarray(f, np.float64) for f in freqs], [costs.per_neuron] * costs.n_layer, left,
                           hw or HwProfile())
    out = [len(x) for x in slots]
    # the solve stops where a layer's GPU side would become its critical path (by the rates
    # alone); what it leaves goes to every layer with room, as evenly as they allow: a layer
    # wholly on the GPU has no host part to wait for, which the rates do not see
    spare = left // costs.per_neuron - sum(out)
    while spare > 0 and any(c < costs.n_ff for c in out):
        live = sum(c < costs.n_ff for c in out)
        k = -(-spare // live)
        for i, c in enumerate(out):
            take = min(k, costs.n_ff - c, spare)
            out[i] += take
            spare -= take
    return out


def check_slots(budget: int, base: int, costs: SlotCosts, counts: Sequence[int]) -> None:
    """Refuse slot counts (given, or from a plan) that cannot fit beside the base."""
    need = sum(min(c, costs.n_ff) for c in counts) * costs.per_neuron + costs.pred
    if base + need + margin_for(budget) > budget:
        raise VramBudgetError(
            f"the neuron slots asked for need {_mib(need)} (with the GPU predictors) beside the {_mib(base)} the "
            f"dense tensors, KV cache and compute buffers took: {_mib(base + need)} with a margin of "
            f"{_mib(margin_for(budget))}, over the budget of {_mib(budget)}. Use fewer slots, or re-plan with "
            f"`kairox plan --reserve {(base + margin_for(budget)) // MiB}MiB` (the measured base)")


def shrink(counts: Sequence[int], over: int, costs: SlotCosts) -> list[int]:
    """Slot counts lowered as evenly as the layers allow so that at least `over` bytes are
    given back (a layer with few slots gives what it has, the others the rest)."""
    out = list(counts)
    need = -(-over // costs.per_neuron)  # neurons
    while need > 0 and any(out):
        live = [i for i, c in enumerate(out) if c > 0]
        k = -(-need // len(live))
        for i in live:
            take = min(k, out[i], need)
            out[i] -= take
            need -= take
    return out


@dataclass
class VramReport:
    budget: int
    base: int          # after load: dense tensors, KV cache, compute buffers
    slots: int         # the slot buffers (kx_model_slots_bytes)
    used: int          # after the warm-up batch: everything
    slot_counts: list[int]

    def text(self) -> str:
        return (f"VRAM {_mib(self.used)} of {_mib(self.budget)}: base {_mib(self.base)} (dense tensors, KV cache, "
                f"compute buffers), slots {_mib(self.slots)} ({sum(self.slot_counts)} neurons), "
                f"rest {_mib(self.used - self.base - self.slots)} "
                f"({'predictors, maps, workspaces' if sum(self.slot_counts) else 'workspaces and pools'})")
