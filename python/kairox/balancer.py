"""The online neuron balancer's policy, in readable Python: the reference the runtime's
C++/CUDA version is checked against on recorded traces.

Per layer, the GPU holds `capacity` neuron groups in slots. Each decode step the balancer
sees which groups the predictor listed ("active") and why the last step stalled, and
decides which groups to load into the slots and which to give up:

* **Temporal Activation Momentum (TAM).** Each group's score decays by λ per step and
  gains (1 − λ) when the group is active: s ← λ·s + (1 − λ)·a, a ∈ {0, 1}. A group is a
  candidate only when s > τ = (1 − λ) + ε, a little above what one isolated activation
  scores, so a one-hit wonder never displaces a group in sustained use; a group active two
  steps in a row scores (1 − λ)(1 + λ) and passes as soon as λ(1 − λ) > ε.
* **Admission and eviction.** The slots go to the top-`capacity` groups by score among the
  residents and the candidates (a resident wins a tie, so equal scores never churn). What
  enters is loaded, what leaves is evicted; `max_admit` caps the loads of one step (the
  reload stream's budget), taking the best candidates first and evicting only as many of
  the worst residents as it loads.
* **Adaptive λ (the Adaptive Neuron Balancer).** A step that waited on reloads ("io")
  raises λ (conservative: history weighs more, fewer loads); one that waited on the CPU
  ("cpu") lowers it (react faster: recent activity gets to the GPU sooner). λ moves by a
  step α within [lam_min, lam_max]; the step halves each time the direction flips and
  grows back (×2, up to alpha) while it holds, so a layer sitting at its balance point
  dithers by ever smaller steps instead of oscillating.

Numbers are float32, as the GPU computes them; groups are ordered by (score descending,
resident first, id ascending), so every decision is deterministic.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .capi import STALLS, TamConfig  # enum kx_tam_stall, struct kx_tam_config
from .costs import Rates


@dataclass(frozen=True)
class BalancerConfig:
    lam: float = 0.5        # λ at start
    eps: float = 0.01       # τ = (1 − λ) + ε; ε ≤ −(1 − λ_min) admits every listed group (micro level)
    adaptive: bool = True   # adapt λ from the stall type (False: fixed λ)
    alpha: float = 0.05     # largest step of λ
    alpha_min: float = 0.005
    lam_min: float = 0.05
    lam_max: float = 0.95
    # groups loaded per step and layer (None: as many as qualify; the pipeline: PIPE_MAX_ADMIT)
    max_admit: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.lam_min <= self.lam <= self.lam_max < 1:
            raise ValueError(f"need 0 < lam_min <= lam <= lam_max < 1, got {self.lam_min}, {self.lam}, {self.lam_max}")
        if not -1 <= self.eps < 1:
            raise ValueError(f"eps must be in [-1, 1), got {self.eps}")
        if not 0 < self.alpha_min <= self.alpha:
            raise ValueError(f"need 0 < alpha_min <= alpha, got {self.alpha_min}, {self.alpha}")
        if self.max_admit is not None and self.max_admit < 0:
            raise ValueError(f"max_admit must be >= 0, got {self.max_admit}")

    def native(self) -> TamConfig:
        """The runtime's struct kx_tam_config for this configuration."""
        return TamConfig(self.lam, self.eps, self.alpha, self.alpha_min, self.lam_min, self.lam_max,
                         int(self.adaptive), -1 if self.max_admit is None else self.max_admit)


@dataclass
class Decision:
    """One layer's step: groups to load into slots, groups to give up, λ after the step."""
    step: int
    layer: int
    admit: list[int]
    evict: list[int]
    lam: float


@dataclass
class LayerBalancer:
    """TAM scores, residency and λ of one layer."""
    n_groups: int
    capacity: int
    config: BalancerConfig = field(default_factory=BalancerConfig)
    initial: Sequence[int] = ()   # groups resident at start (a static plan's hottest)

    def __post_init__(self) -> None:
        if not 0 <= self.capacity <= self.n_groups:
            raise ValueError(f"capacity must be in 0..{self.n_groups}, got {self.capacity}")
        init = np.asarray(list(self.initial), np.int64)
        if init.size > self.capacity or (init.size and (init.min() < 0 or init.max() >= self.n_groups)) \
                or np.unique(init).size != init.size:
            raise ValueError(f"initial residents must be at most {self.capacity} distinct groups in 0..{self.n_groups - 1}")
        self.score = np.zeros(self.n_groups, np.float32)
        self.resident = np.zeros(self.n_groups, bool)
        self.resident[init] = True
        self.lam = np.float32(self.config.lam)
        self._alpha = np.float32(self.config.alpha)
        self._last_dir = 0

    @property
    def tau(self) -> np.float32:
        return np.float32(1) - self.lam + np.float32(self.config.eps)

    def step(self, active: np.ndarray, stall: str = "none", step: int = 0, layer: int = 0) -> Decision:
        """Advance one decode step. active: bool per group (listed by the predictor this
        step); stall: why the previous step waited ("none", "io", "cpu")."""
        active = np.asarray(active, bool)
        if active.shape != (self.n_groups,):
            raise ValueError(f"active must be {self.n_groups} booleans, got shape {active.shape}")
        if stall not in STALLS:
            raise ValueError(f"stall must be one of {', '.join(STALLS)}, got {stall!r}")
        if self.config.adaptive:
            self._adapt(stall)
        lam = self.lam
        self.score = lam * self.score + (np.float32(1) - lam) * active.astype(np.float32)
        admit, evict = self._choose()
        self.resident[admit] = True
        self.resident[evict] = False
        return Decision(step, layer, admit.tolist(), evict.tolist(), float(self.lam))

    def _adapt(self, stall: str) -> None:
        _adapt_lam(self, stall)

    def _choose(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.arange(self.n_groups)
        eligible = self.resident | (self.score > self.tau)
        # order: score descending, resident first, id ascending (np.lexsort: last key first)
        order = np.lexsort((ids, ~self.resident, -self.score))
        order = order[eligible[order]]
        target = order[:self.capacity]
        want = np.zeros(self.n_groups, bool)
        want[target] = True
        admit = target[~self.resident[target]]            # best first
        evict_pool = order[self.capacity:]
        evict_pool = evict_pool[self.resident[evict_pool]][::-1]  # worst first
        free = self.capacity - int(self.resident.sum())
        if self.config.max_admit is not None and admit.size > self.config.max_admit:
            admit = admit[:self.config.max_admit]
        # a load needs a free slot or an eviction: give up the worst residents, only as many as needed
        n_evict = max(0, admit.size - free)
        return admit.astype(np.int64), np.sort(evict_pool[:n_evict]).astype(np.int64)

    def residents(self) -> list[int]:
        return np.flatnonzero(self.resident).tolist()


def _adapt_lam(b, stall: str) -> None:
    """λ after a step that stalled this way (b: lam, _alpha, _last_dir, config)."""
    d = {"io": 1, "cpu": -1}.get(stall, 0)
    if d == 0:
        return
    c = b.config
    if b._last_dir and d != b._last_dir:
        b._alpha = max(np.float32(c.alpha_min), b._alpha / np.float32(2))
    elif b._last_dir == d:
        b._alpha = min(np.float32(c.alpha), b._alpha * np.float32(2))
    b._last_dir = d
    b.lam = np.float32(np.clip(b.lam + np.float32(d) * b._alpha, c.lam_min, c.lam_max))


def tam_key(score: float, resident: bool, gid: int) -> int:
    """The total order of groups as one integer, larger is better: score (float32 bits,
    scores are >= 0), then resident before not, then the lower id (include/kx-tam.h)."""
    bits = int(np.float32(score).view(np.uint32))
    return (bits << 32) | (int(bool(resident)) << 31) | (0x7FFFFFFF - int(gid))


# The pipeline's loads per layer step where BalancerConfig.max_admit is None (include/kairox.h:
# KX_PIPE_MAX_ADMIT): an uncapped step sorts every candidate and victim on the critical path.
PIPE_MAX_ADMIT = 32


@dataclass
class PrefetchLayer:
    """One hybrid layer of the one-layer-ahead pipeline (the runtime's pipeline mode): each
    step sees the layer's active set *predicted* from the previous layer's input, within the
    same decode, and loads what is missing before the layer runs.

    A step: loads still in flight from an earlier step either landed (they become resident)
    or the step is skipped (their slots are taken; an I/O stall). Otherwise λ adapts, the TAM
    scores move with the predicted set, and the candidates (predicted, not resident, score
    > τ; best first, at most max_admit, PIPE_MAX_ADMIT where that is None) take free slots
    (lowest first), then the slots of the worst residents that are not predicted, each only
    while the candidate scores higher than the resident (a tie keeps the resident). The
    evicted leave at once; the loaded become resident when their rows have landed. `late`
    says what the runtime saw: bit 1, loads still in flight at the step's start; bit 2, this
    step's loads not landed at its end."""
    n_groups: int
    slots: Sequence[int]           # the group in each slot at start, -1 for an empty slot
    config: BalancerConfig = field(default_factory=BalancerConfig)

    def __post_init__(self) -> None:
        sl = np.asarray(list(self.slots), np.int64)
        held = sl[sl >= 0]
        if held.size and (held.max() >= self.n_groups or np.unique(held).size != held.size):
            raise ValueError(f"slots must hold distinct groups in 0..{self.n_groups - 1} (or -1)")
        self.capacity = int(sl.size)
        self.slot_group = sl.copy()
        self.slot_of = np.full(self.n_groups, -1, np.int64)
        self.slot_of[held] = np.flatnonzero(sl >= 0)
        self.free = np.flatnonzero(sl < 0).tolist()
        self.score = np.zeros(self.n_groups, np.float32)
        self.lam = np.float32(self.config.lam)
        self._alpha = np.float32(self.config.alpha)
        self._last_dir = 0
        self.pending: list[tuple[int, int]] = []   # (group, slot): rows in flight

    @property
    def tau(self) -> np.float32:
        return np.float32(1) - self.lam + np.float32(self.config.eps)

    def _commit(self) -> None:
        for g, s in self.pending:
            self.slot_of[g] = s
            self.slot_group[s] = g
        self.pending = []

    def step(self, predicted: Sequence[int], stall: str = "none", late: int = 0, step: int = 0,
             layer: int = 0) -> Decision:
        if stall not in STALLS:
            raise ValueError(f"stall must be one of {', '.join(STALLS)}, got {stall!r}")
        pred = np.asarray(list(predicted), np.int64)
        if pred.size and (pred.min() < 0 or pred.max() >= self.n_groups):
            raise ValueError(f"predicted groups must be in 0..{self.n_groups - 1}")
        if self.pending and late & 1:
            if not late & 2:
                self._commit()
            return Decision(step, layer, [], [], float(self.lam))
        self._commit()
        if self.config.adaptive:
            _adapt_lam(self, stall)
        lam = self.lam
        act = np.zeros(self.n_groups, np.float32)
        act[pred] = 1
        self.score = lam * self.score + (np.float32(1) - lam) * act
        tau = self.tau
        cand = sorted((g for g in np.unique(pred).tolist() if self.slot_of[g] < 0 and self.score[g] > tau),
                      key=lambda g: -tam_key(self.score[g], False, g))
        cand = cand[:PIPE_MAX_ADMIT if self.config.max_admit is None else self.config.max_admit]
        is_pred = act > 0
        victims = sorted((int(g) for g in self.slot_group if g >= 0 and not is_pred[g]),
                         key=lambda g: tam_key(self.score[g], True, g))
        loads, evicts = [], []
        for g in cand:
            if self.free:
                s = self.free.pop(0)
            else:
                if len(evicts) >= len(victims) or tam_key(self.score[g], False, g) <= \
                        tam_key(self.score[victims[len(evicts)]], True, victims[len(evicts)]):
                    break
                v = victims[len(evicts)]
                s = int(self.slot_of[v])
                self.slot_of[v] = -1
                self.slot_group[s] = -1
                evicts.append(v)
            loads.append((g, s))
        self.pending = loads
        if not late & 2:
            self._commit()
        return Decision(step, layer, [g for g, _ in loads], sorted(evicts), float(lam))

    def drain(self) -> None:
        """Every load in flight lands."""
        self._commit()

    def residents(self) -> list[int]:
        return sorted(int(g) for g in self.slot_group if g >= 0)


def groups_active(neurons: Iterable[int], group_of: np.ndarray, n_groups: int) -> np.ndarray:
    """Which groups hold at least one of the listed neurons (group_of: neuron → group)."""
    out = np.zeros(n_groups, bool)
    idx = np.fromiter(neurons, np.int64)
    if idx.size:
        out[group_of[idx]] = True
    return out


@dataclass(frozen=True)
class TraceStep:
    """One recorded step of one layer: the active groups, the stall type before it, and
    how many neurons of each active group fired (empty: one each)."""
    step: int
    layer: int
    active: tuple[int, ...]
    stall: str = "none"
    counts: tuple[int, ...] = ()


def read_activation_trace(path: str | Path) -> list[TraceStep]:
    """A recorded activation trace: one JSON object per line, {"step", "layer", "active":
    [group ids], "stall"}."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            out.append(TraceStep(int(d["step"]), int(d["layer"]), tuple(int(g) for g in d["active"]),
                                 str(d.get("stall", "none")), tuple(int(c) for c in d.get("counts", ()))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not an activation trace line ({e})") from None
    return out


def write_activation_trace(path: str | Path, steps: Iterable[TraceStep]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(s) | {"active": list(s.active), "counts": list(s.counts)})
                                  + "\n" for s in steps))


def replay(trace: Iterable[TraceStep], n_groups: int, capacity: int | Sequence[int],
           config: BalancerConfig | None = None,
           initial: dict[int, Sequence[int]] | None = None) -> Iterator[Decision]:
    """The decisions the balancer makes over a recorded trace, step by step, one layer
    balancer per layer met (capacity: one for all layers, or one per layer)."""
    config = config or BalancerConfig()
    layers: dict[int, LayerBalancer] = {}
    for s in trace:
        lb = layers.get(s.layer)
        if lb is None:
            cap = capacity if isinstance(capacity, int) else capacity[s.layer]
            lb = layers[s.layer] = LayerBalancer(n_groups, cap, config, (initial or {}).get(s.layer, ()))
        act = np.zeros(n_groups, bool)
        act[list(s.active)] = True
        yield lb.step(act, s.stall, s.step, s.layer)


# ----------------------------------------------------------------------------- offline simulation


@dataclass(frozen=True)
class SimCosts:
    """Seconds the CPU spends on one active neuron it computes (its rows were not resident)
    and seconds to load one group over PCIe: the cost model that names each step's stall."""
    cpu_s_per_neuron: float
    io_s_per_group: float

    @classmethod
    def from_rates(cls, neuron_bytes: float, group_size: int, rates: Rates) -> "SimCosts":
        return cls(rates.cpu_s(neuron_bytes), rates.pcie_s(group_size * neuron_bytes))


@dataclass
class SimResult:
    policy: str
    steps: int = 0           # layer steps
    active: int = 0          # active neurons met (one per active group without counts)
    hits: int = 0            # of which in a resident group when needed
    loads: int = 0           # groups loaded
    stalls: dict[str, int] = field(default_factory=lambda: {s: 0 for s in STALLS})
    lam: dict[int, list[float]] = field(default_factory=dict)  # λ per layer over time

    @property
    def hit_rate(self) -> float:
        return self.hits / self.active if self.active else 0.0

    def loads_per(self, steps_per_token: int) -> float:
        return self.loads * steps_per_token / self.steps if self.steps else 0.0


def simulate(trace: Sequence[TraceStep], n_groups: int, capacity: int, costs: SimCosts,
             initial: dict[int, Sequence[int]], config: BalancerConfig | None = None,
             policy: str = "") -> SimResult:
    """Replay a trace through the balancer (config None: static, the initial residents
    stay) and count hits, loads and the stall each layer step would end in: "io" when its
    loads take longer than the CPU's share of its misses, "cpu" when the misses do, "none"
    without either. A step's loads serve the layer's next step (one token later)."""
    res = SimResult(policy or ("static" if config is None else "TAM"))
    layers: dict[int, LayerBalancer] = {}
    stall: dict[int, str] = {}
    for s in trace:
        lb = layers.get(s.layer)
        if lb is None:
            lb = layers[s.layer] = LayerBalancer(n_groups, capacity, config or BalancerConfig(adaptive=False),
                                                 initial.get(s.layer, ()))
        a = np.zeros(n_groups, bool)
        a[list(s.active)] = True
        w = np.zeros(n_groups, np.int64)
        w[list(s.active)] = s.counts or 1
        hits = int(w[lb.resident].sum())
        misses = int(w.sum()) - hits
        loads = 0
        if config is not None:
            d = lb.step(a, stall.get(s.layer, "none"), s.step, s.layer)
            loads = len(d.admit)
            res.lam.setdefault(s.layer, []).append(d.lam)
        cpu, io = misses * costs.cpu_s_per_neuron, loads * costs.io_s_per_group
        st = "io" if io > cpu else "cpu" if cpu > 0 else "none"
        stall[s.layer] = st
        res.stalls[st] += 1
        res.steps += 1
        res.active += int(w.sum())
        res.hits += hits
        res.loads += loads
    return res


def neuron_groups(perm: np.ndarray, group: np.ndarray, freq: np.ndarray, group_size: int | None = None) -> np.ndarray:
    """neuron (model order) -> group: the pack's (row i of the pack is neuron perm[i], in
    group[i]), or, with group_size, groups of that many neurons by descending pack
    frequency (`freq` by neuron id, as the pack's kx_freq; ties by neuron id)."""
    perm, group, freq = (np.asarray(a) for a in (perm, group, freq))
    g = np.empty(perm.size, np.int64)
    if group_size is None:
        g[perm] = group
        return g
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    order = np.lexsort((np.arange(perm.size), -freq.astype(np.float64)))
    g[order] = np.arange(perm.size) // group_size
    return g


def static_residents(pack, n_groups: int, capacity: int, group_size: int | None = None) -> dict[int, list[int]]:
    """Per layer, the `capacity` groups of highest summed offline frequency (the pack's
    kx_freq): what a static placement keeps on the GPU."""
    out = {}
    for il, layer in enumerate(pack.layers):
        g = neuron_groups(layer.perm, layer.group, layer.freq, group_size)
        score = np.zeros(n_groups, np.float64)
        np.add.at(score, g, np.asarray(layer.freq, np.float64))  # kx_freq is by neuron id
        out[il] = sorted(np.lexsort((np.arange(n_groups), -score))[:capacity].tolist())
    return out
