"""Placement solver: which dense tensors and which FFN neuron groups live on the GPU.

The readable reference of kairox's static placement (PowerInfer's hot/cold split plus
ATSInfer's tensor-level placement). Decode is memory-bound, so every cost is bytes over a
measured bandwidth (`HwProfile`, from `kairox.hw`):

* A dense tensor (attention projections, output head) read on the CPU costs
  bytes / cpu_gbs per token, on the GPU bytes / gpu_gbs, where a profile measured the
  matvec rate of the tensor's weight type (`kairox profile-hw`) that rate instead. Where execution switches device
  between two consecutive tensors the hidden state crosses PCIe: `handoff_us` each time
  (measured on the GPU machine: 10.9-23.5 µs per round trip). `solve_dense` is a knapsack
  DP over the tensors in execution order with the previous tensor's device in the state,
  so it trades bytes saved against the hand-offs they cause.
* The FFN of layer l runs its CPU and GPU parts at the same time, so it costs
  max(cpu_l, gpu_l) with cpu_l = (expected active rows not resident) × row bytes / cpu_gbs
  and gpu_l = (expected active rows resident) × row bytes / gpu_gbs. `solve_slots` gives
  groups to the layer whose next group lowers Σ_l max(cpu_l, gpu_l) the most per byte,
  until the budget is spent, then trades groups between layers at the budget's edge: hot
  groups first, and no layer's CPU part is left to dominate while another layer's is
  already hidden behind its GPU part. `solve_slots_exact` solves the same problem as a
  mixed-integer program (PowerInfer's formulation, SciPy's HiGHS), the reference the
  greedy is tested against (within 1% on random layers of mixed group sizes and types).

Expected active rows come from the pack's measured per-neuron frequencies (or, for packs
without them, a uniform guess). The plan is explainable: `Plan.explain()`.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .costs import GB, Rates

GiB = 1 << 30
MiB = 1 << 20


# dense shares of the budget the planner tries (0, 1/PLAN_SPLITS, ..., all)
PLAN_SPLITS = 20


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class HwProfile:
    cpu_gbs: float = Rates.cpu_gbs    # CPU matvec, GB/s (kairox.costs: one set of rates and defaults)
    gpu_gbs: float = Rates.gpu_gbs    # GPU matvec
    pcie_gbs: float = Rates.pcie_gbs  # host-to-device
    handoff_us: float = 23.5   # one CPU<->GPU switch of the hidden state, µs
    # measured matvec rates per weight type (ggml type name in lower case -> weight GB/s per
    # token, from `kairox profile-hw`): a quantized matvec can run below the streaming read on
    # the CPU (unpacking costs compute); a type not listed falls back to cpu_gbs / gpu_gbs
    cpu_type_gbs: dict[str, float] = field(default_factory=dict)
    gpu_type_gbs: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "HwProfile":
        """A profile from `kairox profile-hw` (extra keys such as "details" are ignored)."""
        rates = ("cpu_type_gbs", "gpu_type_gbs")
        names = {f.name for f in dataclasses.fields(cls)} - set(rates)
        vals: dict[str, Any] = {k: float(v) for k, v in d.items() if k in names}
        if not vals or any(v <= 0 for v in vals.values()):
            raise ValueError("expected positive cpu_gbs, gpu_gbs, pcie_gbs, handoff_us")
        for k in rates:
            # (ggml spells the K-quants "q4_K", gguf-py "Q4_K": one key for both)
            r = {str(t).lower(): float(v) for t, v in (d.get(k) or {}).items()}
            if any(v <= 0 for v in r.values()):
                raise ValueError(f"expected positive {k} rates")
            vals[k] = r
        return cls(**vals)

    @classmethod
    def from_bandwidths(cls, bw: dict[str, Any]) -> "HwProfile":
        r = Rates.from_bandwidths(bw)
        return cls(r.cpu_gbs, r.gpu_gbs, r.pcie_gbs)

    @property
    def rates(self) -> Rates:
        return Rates(self.cpu_gbs, self.gpu_gbs, self.pcie_gbs)

    def cpu_rate(self, type_name: str = "") -> float:
        """bytes/s of a matvec over weights of this type on the CPU"""
        return self.cpu_type_gbs.get(type_name, self.cpu_gbs) * GB

    def gpu_rate(self, type_name: str = "") -> float:
        return self.gpu_type_gbs.get(type_name, self.gpu_gbs) * GB


@dataclass(frozen=True)
class DenseItem:
    name: str
    nbytes: int
    type: str = ""  # weight type ("f16", "q4_k"; lower case, as profiles key it): picks the measured rate
    # the share of its bytes a token reads: an MoE expert tensor's n_expert_used / n_expert
    # (ATSInfer counts experts apart: per byte of VRAM they save less than attention does)
    read: float = 1.0
    # the tensors placed as this one item (dense_groups); empty: the item is this tensor
    parts: tuple["DenseItem", ...] = ()
    # a point of the layer's execution that runs on the GPU whatever the placement (a norm,
    # whose weight stays there; attention over the KV cache there): no tensor, no bytes
    pinned: bool = False

    def __post_init__(self) -> None:
        # (ggml spells the K-quants "q4_K", gguf-py "Q4_K", the profile "q4_k")
        object.__setattr__(self, "type", self.type.lower())

    @property
    def names(self) -> tuple[str, ...]:
        return () if self.pinned else tuple(p.name for p in self.parts) or (self.name,)

    def seconds(self, rate: Callable[[str], float]) -> float:
        """Per token on a side of this rate (GB/s by type): what its tensors read."""
        return sum(p.nbytes * p.read / rate(p.type) for p in self.parts or (self,))


# A layer's execution, as the placement's chain of items (exec_rank): the attention norm (on
# the GPU), the attention's input projections, attention itself over the KV cache (on the
# GPU), its output projection, the FFN norm (on the GPU), the MoE router, the FFN's up side
# (gate and up, or the experts), its down side, anything else. Tensors of one rank run side by
# side on the same input and are one item: split over both devices they would pay a hand-off
# more for nothing (a layer's MoE experts are one item, as ATSInfer places them).
EXEC_PINS = {0: "attn_norm", 2: "attention", 4: "ffn_norm"}


def exec_rank(kind: str) -> int:
    """A tensor kind's rank in its layer's chain (EXEC_PINS holds the pinned ranks)."""
    if kind.startswith("attn_"):
        return 3 if kind.startswith("attn_output") else 1
    if kind.startswith("ffn_gate_inp"):
        return 5
    if kind.startswith(("ffn_gate", "ffn_up")) or "_exps" in kind:
        return 6
    return 7 if kind.startswith("ffn_down") else 8


def dense_groups(items: list[DenseItem]) -> list[DenseItem]:
    """The knapsack's chain: items in execution order (layers, then exec_rank; the output head
    last), the tensors of one layer and rank merged into one item, and each layer's pinned
    points (EXEC_PINS) between them."""
    ranked: dict[tuple[int, int], list[DenseItem]] = {}
    for it in items:
        m = re.match(r"blk\.(\d+)\.(.+)$", it.name)
        key = ((int(m.group(1)), exec_rank(m.group(2))) if m else
               ((1 << 62) if it.name == "output.weight" else -1, 0))
        ranked.setdefault(key, []).append(it)
    for il in {il for il, _ in ranked if 0 <= il < (1 << 62)}:
        for r, pin in EXEC_PINS.items():
            ranked[(il, r)] = [DenseItem(f"blk.{il}.{pin}", 0, pinned=True)]
    out = []
    for key in sorted(ranked):
        group = sorted(ranked[key], key=lambda it: it.name)
        if key[0] == -1 or key[0] == (1 << 62) or len(group) == 1:
            out += group  # outside the layers: one item each
            continue
        out.append(DenseItem(group[0].name, sum(it.nbytes for it in group), parts=tuple(group)))
    return out


def solve_dense(items: list[DenseItem], budget: int, hw: HwProfile, unit: int = MiB,
                gpu_only: Sequence[bool] = ()) -> tuple[list[bool], float]:
    """Knapsack over dense tensors in execution order: on_gpu[i] for each, and the modelled
    seconds per token (inf when the items kept on the GPU, pinned or gpu_only[i], do not
    fit). Weights are rounded up to `unit` bytes (the DP's resolution)."""
    n = len(items)
    cap = max(0, budget // unit)
    w = [-(-it.nbytes // unit) for it in items]
    cpu = [math.inf if it.pinned or (gpu_only and gpu_only[i]) else it.seconds(hw.cpu_rate)
           for i, it in enumerate(items)]
    gpu = [it.seconds(hw.gpu_rate) for it in items]
    hop = hw.handoff_us * 1e-6 / 2  # one direction of a round trip
    INF = math.inf
    # cost[c][d]: best time using c units with the last tensor on device d (0 CPU, 1 GPU)
    cost = np.full((cap + 1, 2), INF)
    cost[0, 0] = 0.0  # execution starts on the CPU (token embedding)
    choice = np.zeros((n, cap + 1, 2), np.int8)  # previous device of the best path
    for i in range(n):
        new = np.full_like(cost, INF)
        for d in (0, 1):
            t = cpu[i] if d == 0 else gpu[i]
            shift = 0 if d == 0 else w[i]
            if shift > cap:
                continue  # does not fit even alone
            for prev in (0, 1):
                src = cost[:cap + 1 - shift, prev] + t + (hop if prev != d else 0.0)
                dst = new[shift:, d]
                better = src < dst
                dst[better] = src[better]
                choice[i, shift:, d][better] = prev
        cost = new
    # end on the CPU: sampling reads the logits on the host
    final = cost + np.array([0.0, hop])
    c, d = np.unravel_index(np.argmin(final), final.shape)
    best = float(final[c, d])
    on_gpu = [False] * n
    for i in range(n - 1, -1, -1):
        on_gpu[i] = bool(d)
        prev = int(choice[i, c, d])
        if d == 1:
            c -= w[i]
        d = prev
    return on_gpu, best


def solve_slots(freqs: list[np.ndarray], group_bytes: list[int], budget: int, hw: HwProfile,
                rows_per_group: list[int] | None = None,
                types: list[str] | None = None) -> tuple[list[np.ndarray], float]:
    """Resident groups per layer (ids, hottest first) and the modelled FFN seconds per token.

    freqs[l][g]: expected active neurons of group g of layer l per token (sum of its
    neurons' frequencies); group_bytes[l]: bytes of one group (gate+up+down rows);
    types[l]: the layer's FFN weight type (its measured matvec rates)."""
    L = len(freqs)
    if len(group_bytes) != L:
        raise PlanError("one group size per layer is needed")
    order = [np.argsort(-np.asarray(f, np.float64), kind="stable") for f in freqs]
    rows = rows_per_group or [1] * L
    # bytes per expected active neuron: a group's bytes over its rows
    per_row = [group_bytes[l] / rows[l] for l in range(L)]
    # sequential sums in id order (np.sum is pairwise): the runtime's port sums alike, to the bit
    cpu_mass = [float(np.cumsum(np.asarray(f, np.float64))[-1]) if len(f) else 0.0 for f in freqs]
    gpu_mass = [0.0] * L
    taken = [0] * L

    tys = types or [""] * L
    cpu_rate = [hw.cpu_rate(ty) for ty in tys]
    gpu_rate = [hw.gpu_rate(ty) for ty in tys]

    def t(l: int, cm: float, gm: float) -> float:
        return max(cm * per_row[l] / cpu_rate[l], gm * per_row[l] / gpu_rate[l])

    def gain(l: int) -> float:
        if taken[l] >= len(order[l]):
            return -1.0
        f = float(freqs[l][order[l][taken[l]]])
        return t(l, cpu_mass[l], gpu_mass[l]) - t(l, cpu_mass[l] - f, gpu_mass[l] + f)

    # the best seconds saved per byte first (a knapsack's ratio: layers' groups differ in size)
    heap = [(-gain(l) / group_bytes[l], l) for l in range(L)]
    heapq.heapify(heap)
    left = budget
    while heap:
        g, l = heapq.heappop(heap)
        if -g <= 0:
            break  # no layer gains from another group
        if group_bytes[l] > left:
            continue  # this layer is done; others may have smaller groups
        f = float(freqs[l][order[l][taken[l]]])
        cpu_mass[l] -= f
        gpu_mass[l] += f
        taken[l] += 1
        left -= group_bytes[l]
        heapq.heappush(heap, (-gain(l) / group_bytes[l], l))

    # The ratio order's known loss is at the budget's edge (a group that no longer fits while
    # a smaller one of another layer would, or bytes better spent elsewhere): give back a
    # layer's last group for the next groups of another while that lowers the total.
    cum = [np.concatenate([[0.0], np.cumsum(np.asarray(freqs[l], np.float64)[order[l]])]) for l in range(L)]

    def mass(l: int, k: int) -> float:
        return float(cum[l][k])

    def cost(l: int, k: int) -> float:
        m = mass(l, k)
        return t(l, cpu_mass[l] + gpu_mass[l] - m, m)

    for _ in range(4 * L):
        best = (0.0, -1, -1, 0)
        for i in range(L):
            if taken[i] == 0:
                continue
            free = left + group_bytes[i]
            d_i = cost(i, taken[i] - 1) - cost(i, taken[i])
            for j in range(L):
                if j == i:
                    continue
                k = min(len(order[j]) - taken[j], free // group_bytes[j])
                # the best count of j's next groups within the freed bytes
                base = cost(j, taken[j])
                gain_j, add = max(((base - cost(j, taken[j] + a), a) for a in range(1, k + 1)), default=(0.0, 0))
                if gain_j - d_i > best[0] + 1e-15:
                    best = (gain_j - d_i, i, j, add)
        if best[1] < 0:
            break
        _, i, j, add = best
        for l, dk in ((i, -1), (j, add)):
            m0 = mass(l, taken[l])
            taken[l] += dk
            m1 = mass(l, taken[l])
            cpu_mass[l] -= m1 - m0
            gpu_mass[l] += m1 - m0
            left -= dk * group_bytes[l]
    total = sum(t(l, cpu_mass[l], gpu_mass[l]) for l in range(L))
    return [order[l][:taken[l]].astype(np.int32) for l in range(L)], total


def solve_slots_exact(freqs: list[np.ndarray], group_bytes: list[int], budget: int, hw: HwProfile,
                      rows_per_group: list[int] | None = None,
                      types: list[str] | None = None, rel_gap: float = 1e-4) -> tuple[list[np.ndarray], float]:
    """`solve_slots`' problem solved exactly, as a mixed-integer program (PowerInfer's
    placement is one): a 0/1 variable per group and layer, and per layer its time t_l, bound
    below by both sides' times; minimize Σ t_l within the budget. The reference the greedy is
    tested against (SciPy's HiGHS; small instances: one variable per group). rel_gap: the
    distance from the optimum at which the search may stop (on 200 groups in 5 layers HiGHS
    proves 1e-4 in under 2 s, and 1e-9 may take minutes)."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # an optional dependency: the planner itself needs only numpy
        raise PlanError("the exact slot solve needs SciPy (pip install scipy)") from e
    L = len(freqs)
    if len(group_bytes) != L:
        raise PlanError("one group size per layer is needed")
    rows = rows_per_group or [1] * L
    tys = types or [""] * L
    f = [np.asarray(x, np.float64) for x in freqs]
    n = [len(x) for x in f]
    off = np.concatenate([[0], np.cumsum(n)]).astype(int)
    nx = int(off[-1])
    # microseconds per expected active neuron on each side: in seconds the objective is
    # ~1e-4 and HiGHS's absolute gap (1e-6) would stop it ~1% short of the optimum
    a = [1e6 * group_bytes[l] / rows[l] / hw.cpu_rate(tys[l]) for l in range(L)]
    b = [1e6 * group_bytes[l] / rows[l] / hw.gpu_rate(tys[l]) for l in range(L)]
    c = np.concatenate([np.zeros(nx), np.ones(L)])
    A = np.zeros((2 * L + 1, nx + L))
    lo = np.full(2 * L + 1, -np.inf)
    hi = np.full(2 * L + 1, np.inf)
    for l in range(L):
        xs = slice(off[l], off[l + 1])
        A[2 * l, xs] = a[l] * f[l]            # t_l >= a_l (M_l - Σ f x)
        A[2 * l, nx + l] = 1.0
        lo[2 * l] = a[l] * float(f[l].sum())
        A[2 * l + 1, xs] = -b[l] * f[l]       # t_l >= b_l Σ f x
        A[2 * l + 1, nx + l] = 1.0
        lo[2 * l + 1] = 0.0
        A[2 * L, xs] = group_bytes[l]         # Σ bytes <= budget
    hi[2 * L] = budget
    integrality = np.concatenate([np.ones(nx), np.zeros(L)])
    bounds = Bounds(np.zeros(nx + L), np.concatenate([np.ones(nx), np.full(L, np.inf)]))
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=bounds,
               options={"mip_rel_gap": rel_gap, "time_limit": 60.0})
    if res.x is None:
        raise PlanError(f"the exact slot solve failed: {res.message}")
    x = res.x[:nx] > 0.5
    out = []
    for l in range(L):
        ids = np.flatnonzero(x[off[l]:off[l + 1]])
        out.append(ids[np.argsort(-f[l][ids], kind="stable")].astype(np.int32))
    total = sum(max(a[l] * (float(f[l].sum()) - float(f[l][out[l]].sum())), b[l] * float(f[l][out[l]].sum()))
                for l in range(L))
    return out, total * 1e-6


@dataclass
class Plan:
    model: str
    budget: int
    hw: HwProfile
    dense_gpu: list[str]
    dense_cpu: list[str]
    slots: list[list[int]]            # resident group ids per layer
    n_groups: list[int]
    reserved: int                     # bytes set aside (KV cache, compute buffers)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    gpu_share: list[float] = field(default_factory=list)  # expected active neurons on the GPU, per layer
    # neurons per layer the runtime keeps in GPU slots (the chosen groups' rows); the runtime
    # fills them with the layer's most frequently active neurons, which the hot-first group
    # choice above approximates at group granularity
    slot_neurons: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        try:
            d = json.loads(text)
            d["hw"] = HwProfile.from_json(d["hw"])
            plan = cls(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise PlanError(f"{where} is not a kairox plan file ({e}); write one with `kairox plan`") from None
        if len(plan.slot_neurons) != len(plan.slots):
            raise PlanError(f"{where} has no per-layer slot counts (an older plan); run `kairox plan` again")
        return plan

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read the plan {path}: {e.strerror or e}") from None
        return cls.from_json(text, str(path))

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d, indent=1)

    def explain(self) -> str:
        s = self.seconds
        out = [f"plan for {self.model}: budget {self.budget / GiB:.2f} GiB "
               f"(reserved {self.reserved / MiB:.0f} MiB for KV cache and compute buffers)",
               f"hardware: CPU {self.hw.cpu_gbs:g} GB/s, GPU {self.hw.gpu_gbs:g} GB/s, "
               f"hand-off {self.hw.handoff_us:g} µs" + _rates_text(self.hw),
               f"dense tensors on the GPU: {len(self.dense_gpu)} of {len(self.dense_gpu) + len(self.dense_cpu)} "
               f"({self.bytes.get('dense_gpu', 0) / MiB:.0f} MiB): modelled {s.get('dense', 0) * 1e3:.2f} ms/token",
               f"FFN slots: {sum(map(len, self.slots))} groups of {sum(self.n_groups)} "
               f"({self.bytes.get('slots', 0) / MiB:.0f} MiB): modelled {s.get('ffn', 0) * 1e3:.2f} ms/token, "
               f"GPU share of expected active neurons {np.mean(self.gpu_share):.2f} (mean over layers)"
               if self.slots else "FFN slots: none (no sparse pack: the FFN's tensors are placed whole)"]
        if self.slots:
            out.append("per layer: slots / groups, GPU share")
        for l, (sl, ng, sh) in enumerate(zip(self.slots, self.n_groups, self.gpu_share)):
            out.append(f"  layer {l:3d}: {len(sl):5d} / {ng:5d}  {sh:.2f}")
        out.append("dense on the GPU: " + (names_text(self.dense_gpu) or "none"))
        out.append("dense on the CPU: " + (names_text(self.dense_cpu) or "none"))
        return "\n".join(out)


def names_text(names: list[str]) -> str:
    """Tensor names by kind with their layers as ranges, as the runtime logs a placement:
    "attn_q.weight 0-11,14; output.weight"."""
    layers: dict[str, list[int]] = {}
    other = []
    for n in names:
        m = re.match(r"blk\.(\d+)\.(.+)$", n)
        if m:
            layers.setdefault(m.group(2), []).append(int(m.group(1)))
        else:
            other.append(n)
    parts = []
    for kind, ids in layers.items():
        ids = sorted(ids)
        runs, a = [], 0
        while a < len(ids):
            b = a
            while b + 1 < len(ids) and ids[b + 1] == ids[b] + 1:
                b += 1
            runs.append(str(ids[a]) if a == b else f"{ids[a]}-{ids[b]}")
            a = b + 1
        parts.append(f"{kind} {','.join(runs)}")
    return "; ".join(parts + other)


def _rates_text(hw: HwProfile) -> str:
    def one(side: str, r: dict[str, float]) -> str:
        return f"; {side} matvec " + ", ".join(f"{t} {v:.1f}" for t, v in sorted(r.items())) + " GB/s" if r else ""
    return one("CPU", hw.cpu_type_gbs) + one("GPU", hw.gpu_type_gbs)


FFN_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight$")


def dense_items(hdr: Any, skip: re.Pattern[str] | None = None) -> list[DenseItem]:
    """A GGUF header's matrices as the dense knapsack places them (those whose name `skip`
    matches left out): the token embeddings stay on the CPU (a row lookup), and an MoE expert
    tensor is read at n_expert_used / n_expert of its bytes a token."""
    arch = hdr.kv["general.architecture"]
    n_expert, n_used = int(hdr.kv.get(f"{arch}.expert_count", 0)), int(hdr.kv.get(f"{arch}.expert_used_count", 0))
    out = []
    for t in hdr.tensors:
        if t.name == "token_embd.weight" or len(t.ne) < 2 or (skip is not None and skip.match(t.name)):
            continue
        expert = len(t.ne) >= 3 and t.ne[2] > 1 and "_exps" in t.name and n_expert > 0
        out.append(DenseItem(t.name, t.nbytes, _type_name(t.type_id), n_used / n_expert if expert else 1.0))
    return out


def make_plan(model_path: str | Path, budget: int, hw: HwProfile, *, pack_path: str | Path | None = None,
              reserved: int = 512 * MiB) -> Plan:
    """Plan a model for a VRAM budget (bytes). Without a pack there are no neuron slots: the
    FFN's tensors are items of the dense knapsack like the others, as the runtime places a
    model it has no pack for (an MoE model's experts among them)."""
    from .gguf_header import scan_header
    from .pack import pack_path_for, read_pack

    hdr = scan_header(model_path)
    if budget <= reserved:
        raise PlanError(f"a budget of {budget / MiB:.0f} MiB leaves nothing after the {reserved / MiB:.0f} MiB "
                        f"reserved for the KV cache and compute buffers")
    arch = hdr.kv["general.architecture"]
    n_layer = int(hdr.kv[f"{arch}.block_count"])
    pp = Path(pack_path) if pack_path else pack_path_for(model_path)
    slotted = pp.exists()
    ffn_bytes = [0] * n_layer
    ffn_type = [""] * n_layer  # the gate's: most of a neuron's bytes are read at its type
    for t in hdr.tensors:
        m = FFN_RE.match(t.name) if slotted else None
        if m:
            ffn_bytes[int(m.group(1))] += t.nbytes
            if m.group(2) == "gate":
                ffn_type[int(m.group(1))] = _type_name(t.type_id)
    dense = dense_groups(dense_items(hdr, skip=FFN_RE if slotted else None))
    n_ff = int(hdr.kv.get(f"{arch}.feed_forward_length", 0))
    freqs, n_groups, gbytes, rows = [], [], [], []
    if slotted:
        pack = read_pack(pp, model_path)
        for l, pl in enumerate(pack.layers):
            f = np.asarray(pl.freq, np.float64)[pl.perm]  # in pack order
            if not f.any():
                f = np.full(n_ff, 0.1)
            ng = int(pl.group.max()) + 1
            freqs.append(np.bincount(pl.group, weights=f, minlength=ng))
            n_groups.append(ng)
            gbytes.append(ffn_bytes[l] * int(np.ceil(n_ff / ng)) // n_ff)
            rows.append(int(np.ceil(n_ff / ng)))
    avail = budget - reserved
    # Dense tensors and slots compete for the same bytes: a dense byte is read every token, a
    # slot byte only when its neuron fires, so dense first usually wins (the runtime's rule),
    # but not where a layer's GPU side would become its critical path. The split is solved
    # over a grid of dense shares, each the dense knapsack then the slot solve on the rest,
    # keeping the least modelled time (ties to the larger dense share). Without slots the
    # dense tensors take it all.
    best = None
    for k in range(PLAN_SPLITS, -1 if slotted else PLAN_SPLITS - 1, -1):
        on_gpu_k, t_dense_k = solve_dense(dense, avail * k // PLAN_SPLITS, hw)
        used_k = sum(it.nbytes for it, g in zip(dense, on_gpu_k) if g)
        slots_k, t_ffn_k = solve_slots(freqs, gbytes, avail - used_k, hw, rows, ffn_type)
        if best is None or t_dense_k + t_ffn_k < best[0] * (1 - 1e-9):
            best = (t_dense_k + t_ffn_k, on_gpu_k, t_dense_k, used_k, slots_k, t_ffn_k)
    _, on_gpu, t_dense, used, slots, t_ffn = best
    share = [float(np.sum(f[s]) / max(np.sum(f), 1e-30)) for f, s in zip(freqs, slots)]
    return Plan(Path(model_path).name, budget, hw, [n for it, g in zip(dense, on_gpu) if g for n in it.names],
                [n for it, g in zip(dense, on_gpu) if not g for n in it.names], [s.tolist() for s in slots], n_groups,
                reserved, {"dense": t_dense, "ffn": t_ffn},
                {"dense_gpu": used, "slots": sum(len(s) * b for s, b in zip(slots, gbytes))}, share,
                [min(n_ff, len(s) * r) for s, r in zip(slots, rows)])


def _type_name(type_id: int) -> str:
    import gguf
    try:
        return gguf.GGMLQuantizationType(type_id).name.lower()
    except ValueError:
        return ""


@dataclass(frozen=True)
class SlotCosts:
    """What neuron slots cost on the device, from the model's and the pack's headers."""
    n_layer: int
    n_ff: int
    per_neuron: int  # one neuron's slot: its gate row, up row and transposed down row
    pred: int        # predictors copied beside the slots, and the slot maps (all layers)
    # the gate row's share of per_neuron: a ReLU neuron that does not fire costs the host
    # part only its gate row
    gate_row: int = 0


def slot_costs(model_path: str | Path, pack_path: str | Path | None = None) -> SlotCosts:
    from .gguf_header import scan_header
    from .pack import pack_path_for
    hdr = scan_header(model_path)
    rows: dict[str, int] = {}
    n_ff = 0
    for t in hdr.tensors:
        if t.name in ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"):
            rows[t.name] = t.nbytes // t.ne[1]
            n_ff = t.ne[1]
    arch = hdr.kv["general.architecture"]
    n_layer = int(hdr.kv[f"{arch}.block_count"])
    pack = scan_header(pack_path or pack_path_for(model_path))
    down = next((t for t in pack.tensors if t.name == "blk.0.kx_down_t"), None)
    if down is None or len(rows) != 2:
        raise PlanError(f"{model_path} has no gated FFN with a pack down projection; it cannot have neuron slots")
    # the predictors on the GPU: each layer's own, and its ahead one but layer 0's (nothing lists
    # layer 0 a layer early), with the maps
    pred = sum(t.nbytes for t in pack.tensors
               if "kx_pred_" in t.name or ("kx_ahead_" in t.name and not t.name.startswith("blk.0."))) \
        + n_layer * 4 * n_ff
    return SlotCosts(n_layer, n_ff, sum(rows.values()) + down.nbytes // down.ne[1], pred,
                     rows["blk.0.ffn_gate.weight"])


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 7GiB, 512MiB)")
    unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * mult)
