"""DynamicInfer's two-level neuron cache, in readable Python: the policy to compare with the
momentum balancer (kairox.balancer) on the same recorded workloads.

Per layer the GPU holds `capacity` neuron groups. Each group has a history frequency f, an
exponential average of how often the predictor listed it (half-life in tokens, started
from the pack's offline frequency), and an importance for the coming step

    v = a + λ·f,   a = 1 when the predictor lists the group for this step, else 0.

* **Macro level.** The `macro` share of the slots is pinned to the groups of highest f:
  a pinned group is never evicted, so the groups an input keeps using stay resident and are
  not moved back and forth token by token.
* **Micro level.** The predictor sees the layer's input one layer ahead, so what it lists can
  be loaded before the layer runs. Missing groups (listed, or newly pinned) are loaded in
  order of v, each in a free slot or in place of the resident of least v that is not pinned,
  only while the newcomer's v is larger (a tie keeps the resident), and at most `window`
  groups a step: what the PCIe link moves while the layer before computes.

Numbers are float32; f moves as the momentum score does (kairox.balancer, s ← β·s + (1 − β)·a
with β = 0.5^(1/half_life)); groups are ordered by (v, then the lower id), so every decision
is deterministic.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .balancer import BalancerConfig, Decision, LayerBalancer, PrefetchLayer


@dataclass(frozen=True)
class CacheConfig:
    lam: float = 0.5            # λ: weight of the history frequency in v = a + λ·f
    macro: float = 0.5          # share of the slots pinned to the most frequent groups (0: micro only)
    half_life: float = 64.0     # tokens: how fast the history frequency forgets
    window: int | None = None   # groups loaded per layer step (None: no limit)

    def __post_init__(self) -> None:
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not 0 <= self.macro <= 1:
            raise ValueError(f"macro must be in [0, 1], got {self.macro}")
        if not self.half_life > 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    @property
    def beta(self) -> np.float32:
        return np.float32(0.5 ** (1.0 / self.half_life))


class TwoLevelLayer:
    """History frequency, pinned set and residency of one layer."""

    def __init__(self, n_groups: int, capacity: int, freq: Sequence[float] | np.ndarray,
                 initial: Sequence[int] = (), config: CacheConfig | None = None) -> None:
        if not 0 <= capacity <= n_groups:
            raise ValueError(f"capacity must be in 0..{n_groups}, got {capacity}")
        f = np.asarray(freq, np.float32)
        if f.shape != (n_groups,) or not np.all(np.isfinite(f)) or f.min(initial=0) < 0:
            raise ValueError(f"freq must be {n_groups} finite values >= 0")
        init = np.asarray(list(initial), np.int64)
        if init.size > capacity or (init.size and (init.min() < 0 or init.max() >= n_groups)) \
                or np.unique(init).size != init.size:
            raise ValueError(f"initial residents must be at most {capacity} distinct groups in 0..{n_groups - 1}")
        self.n_groups, self.capacity = n_groups, capacity
        self.config = config or CacheConfig()
        self.f = f.copy()
        self.resident = np.zeros(n_groups, bool)
        self.resident[init] = True
        self.n_macro = int(round(self.config.macro * capacity))

    def pinned(self) -> np.ndarray:
        """The `macro` share of the slots' groups by f (ties: the lower id)."""
        out = np.zeros(self.n_groups, bool)
        if self.n_macro:
            out[np.lexsort((np.arange(self.n_groups), -self.f))[:self.n_macro]] = True
        return out

    def step(self, listed: np.ndarray, step: int = 0, layer: int = 0) -> Decision:
        """The loads and evictions before a step whose predicted groups are `listed` (bool per
        group); they land before the layer runs. Then f takes in the listed groups."""
        a = np.asarray(listed, bool)
        if a.shape != (self.n_groups,):
            raise ValueError(f"listed must be {self.n_groups} booleans, got shape {a.shape}")
        cfg = self.config
        v = a.astype(np.float32) + np.float32(cfg.lam) * self.f
        pin = self.pinned()
        ids = np.arange(self.n_groups)
        want = ~self.resident & (a | pin)
        cand = ids[want][np.lexsort((ids[want], -v[want]))]           # best first
        pool = self.resident & ~pin
        victims = ids[pool][np.lexsort((-ids[pool], v[pool]))]       # worst first
        free = self.capacity - int(self.resident.sum())
        limit = len(cand) if cfg.window is None else min(len(cand), cfg.window)
        admit, evict = [], []
        for g in cand[:limit]:
            if free > 0:
                free -= 1
            elif len(evict) < len(victims) and v[g] > v[victims[len(evict)]]:
                evict.append(int(victims[len(evict)]))
            else:
                break
            admit.append(int(g))
        self.resident[admit] = True
        self.resident[evict] = False
        # f ← β·f + (1 − β)·a, rounded after the product and after the sum
        beta = cfg.beta
        self.f = (beta * self.f).astype(np.float32) + (np.float32(1) - beta) * a.astype(np.float32)
        return Decision(step, layer, admit, sorted(evict), float(cfg.lam))

    def residents(self) -> list[int]:
        return np.flatnonzero(self.resident).tolist()


# ----------------------------------------------------------------------------- offline comparison


@dataclass
class ListedResult:
    """What a policy did over a workload, counted in neurons of the predicted lists."""
    policy: str
    tokens: int = 0
    listed: int = 0       # neurons the predicted lists held
    on_gpu: int = 0       # of which resident when the layer ran
    loads: int = 0        # groups loaded

    @property
    def share(self) -> float:
        return self.on_gpu / self.listed if self.listed else 0.0

    @property
    def cpu_per_token(self) -> float:
        return (self.listed - self.on_gpu) / self.tokens if self.tokens else 0.0

    @property
    def loads_per_token(self) -> float:
        return self.loads / self.tokens if self.tokens else 0.0


def predicted_lists(trace, n_groups: int, recall: float = 1.0, precision: float = 1.0,
                    freq: dict[int, np.ndarray] | None = None, seed: int = 0) -> list[np.ndarray]:
    """A predictor's lists for a recorded trace of true activations (kairox.balancer.TraceStep):
    each active group kept with probability `recall`, and wrong groups added until the list's
    precision is about `precision`, drawn among the inactive ones in proportion to the
    layer's offline frequency (`freq[layer]`; uniform without): a predictor errs toward
    groups that often fire. recall = precision = 1 is the oracle."""
    if not 0 < recall <= 1 or not 0 < precision <= 1:
        raise ValueError(f"recall and precision must be in (0, 1], got {recall}, {precision}")
    rng = np.random.default_rng(seed)
    out = []
    for s in trace:
        m = np.zeros(n_groups, bool)
        act = np.asarray(s.active, np.int64)
        kept = act[rng.random(act.size) < recall] if recall < 1 else act
        m[kept] = True
        n_fp = int(round(kept.size * (1 / precision - 1)))
        if n_fp:
            pool = np.flatnonzero(~m)
            p = None
            if freq is not None:
                w = freq[s.layer][pool].astype(np.float64) + 1e-6
                p = w / w.sum()
            m[rng.choice(pool, size=min(n_fp, pool.size), replace=False, p=p)] = True
        out.append(m)
    return out


def replay_listed(trace, listed: Sequence[np.ndarray], n_groups: int, capacity: int,
                  initial: dict[int, Sequence[int]], policy: str, config=None,
                  freq: dict[int, np.ndarray] | None = None, window: int | None = None,
                  group_size: int = 1, name: str = "") -> ListedResult:
    """One policy over a workload: per layer step, the predicted groups (`listed`, aligned
    with the trace) are computed on the GPU where resident, on the CPU otherwise. Policies:
    "static" (the initial residents stay), "tam" (kairox.balancer.LayerBalancer between
    decodes: this step's list moves the scores, its loads serve the next token), "tam-ahead"
    (PrefetchLayer one layer ahead: loads land before the layer runs) and "two-level"
    (TwoLevelLayer, `config` a CacheConfig, `freq` its starting f per layer). `window` caps
    the loads of one layer step for every dynamic policy. A listed group weighs the neurons
    that fired in it, or `group_size` when none did (a wrong prediction)."""
    if policy not in ("static", "tam", "tam-ahead", "two-level"):
        raise ValueError(f"unknown policy {policy!r}")
    if len(listed) != len(trace):
        raise ValueError(f"{len(listed)} lists for {len(trace)} trace steps")
    res = ListedResult(name or policy)
    layers: dict[int, object] = {}
    first_layer = None
    for s, lst in zip(trace, listed):
        first_layer = s.layer if first_layer is None else first_layer
        res.tokens += s.layer == first_layer
        pol = layers.get(s.layer)
        if pol is None:
            init = list(initial.get(s.layer, ()))
            if policy == "two-level":
                c = config or CacheConfig()
                c = c if window is None else dataclasses.replace(c, window=window)
                pol = TwoLevelLayer(n_groups, capacity, freq[s.layer], init, c)
            else:
                c = config or BalancerConfig(adaptive=False)
                c = c if window is None else dataclasses.replace(c, max_admit=window)
                pol = (PrefetchLayer(n_groups, init + [-1] * (capacity - len(init)), c) if policy == "tam-ahead"
                       else LayerBalancer(n_groups, capacity, c, init))
            layers[s.layer] = pol
        w = np.full(n_groups, group_size, np.int64)
        if s.active:
            w[list(s.active)] = s.counts or 1
        lst = np.asarray(lst, bool)
        if policy == "tam":
            on = pol.resident.copy()
            d = pol.step(lst, "none", s.step, s.layer)
        elif policy == "static":
            on, d = pol.resident, None
        elif policy == "tam-ahead":
            d = pol.step(np.flatnonzero(lst).tolist(), "none", 0, s.step, s.layer)
            on = pol.slot_of >= 0   # late = 0: this step's loads have landed
        else:
            d = pol.step(lst, s.step, s.layer)
            on = pol.resident
        res.listed += int(w[lst].sum())
        res.on_gpu += int(w[lst & on].sum())
        res.loads += len(d.admit) if d else 0
    return res


def static_hits(trace, n_groups: int, initial: dict[int, Sequence[int]]) -> np.ndarray:
    """The static split's hit rate token by token over a recorded trace (kairox.balancer.
    TraceStep): of the neurons that fired in every layer, the share in resident groups
    (`initial[layer]`); what the back-off's drift gate watches while held. A token where
    nothing fired counts 1."""
    resident = {}
    hit: dict[int, float] = {}
    act: dict[int, float] = {}
    for s in trace:
        r = resident.get(s.layer)
        if r is None:
            r = resident[s.layer] = np.zeros(n_groups, bool)
            r[list(initial.get(s.layer, ()))] = True
        g = np.asarray(s.active, np.int64)
        w = np.asarray(s.counts, np.int64) if s.counts else np.ones(g.size, np.int64)
        hit[s.step] = hit.get(s.step, 0.0) + float(w[r[g]].sum())
        act[s.step] = act.get(s.step, 0.0) + float(w.sum())
    steps = sorted(act)
    return np.array([hit[t] / act[t] if act[t] else 1.0 for t in steps])
