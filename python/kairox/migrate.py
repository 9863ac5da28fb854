"""Runtime migration (ATSInfer), the readable reference of the policy: the machine's rates
re-estimated from the last decode steps, and when they moved, which CPU-resident tensors to
stream into GPU scratch each step (and which to leave to the CPU again).

A tensor the budget left on the CPU costs its bytes over the CPU's rate every token. Streamed,
it is copied into a GPU scratch buffer ahead of its use, behind the compute before it, and
multiplied there: it costs its bytes over the GPU's rate plus the part of its copy that the
compute before it could not hide (the *exposed* transfer). Idle, the CPU wins (100 GB/s
against 50 over PCIe on the H200 machine); under load it may not: 60% of the cores busy
leaves the CPU ~40% of its rate, and then a copy hidden behind the GPU's own work is free.

The policy (`Migrator`):
* every step's sample (bytes each side read and the seconds it took, the copies and the time
  the copy engine could run unseen) feeds a window estimate of the three rates (`RateTracker`);
* when a rate moved by more than `threshold` (15%) from the rates of the last choice, and at
  least `cooldown` steps (5 TPOT) after it, the choice is made again (`stream_choice`, exact):
  which CPU tensors to stream so that the step, a chain in execution order with one copy
  engine running ahead, is shortest, each streamed tensor fitting a slot of the scratch;
* the new choice is returned as the tensors to start and stop streaming.

`simulate` runs the policy on a modelled decode under a load profile (tests/test_migrate.py:
a CPU stress, a PCIe stress, started mid-run). The runtime (ggml_ext/llama/kx-stream.cpp)
makes the first choice at load, with the C++ port of `stream_choice`, and streams that set; a
streamed tensor needs its plain layout in page-locked host memory, so the set is fixed at load
and the re-estimate under load is not wired yet.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .budget import margin_for
from .costs import GB, Rates
from .plan import DenseItem, HwProfile, MiB, PlanError, dense_groups, solve_dense


@dataclass(frozen=True)
class MigrateConfig:
    threshold: float = 0.15  # relative change of a rate that makes the choice again
    cooldown: int = 5        # decode steps at least between two choices
    window: int = 8          # steps the rates are estimated over
    # a new set must model at least this much faster than keeping the current one at the new
    # rates: a change costs a graph split anew and a CUDA graph capture, and the measured rates
    # move with the set itself (fewer CPU tensors, more fixed cost per byte), so without it the
    # runtime went back and forth (KB-7B F16 at 7 GiB under a PCIe stress: 21 changes in 150
    # steps)
    min_gain: float = 0.03


@dataclass(frozen=True)
class HostTensor:
    """A tensor the budget left on the CPU: its bytes (what streaming it copies), the share of
    them a token reads (an MoE expert tensor's n_expert_used / n_expert: streamed, all of it
    crosses PCIe for that share's work), and the GPU-resident bytes the step reads before it."""
    name: str
    nbytes: int
    gpu_bytes_before: int = 0
    read: float = 1.0

    @property
    def read_bytes(self) -> float:
        return self.nbytes * self.read


@dataclass(frozen=True)
class StepSample:
    """One decode step as the runtime measures it."""
    cpu_bytes: float  # host-resident weight bytes the CPU read
    cpu_s: float      # ... and the seconds it spent on them
    gpu_bytes: float  # device weight bytes the GPU read (scratch included)
    gpu_s: float
    copy_bytes: float = 0.0  # host-to-device copies (streamed tensors)
    copy_s: float = 0.0


class RateTracker:
    """The rates over the last `window` steps: bytes over seconds, summed (a slow step weighs
    as much as it took). A side that did no work in the window (nothing copied, nothing left
    to the CPU) keeps its last estimate: its rate cannot be seen."""

    def __init__(self, window: int, rates: Rates) -> None:
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.last = rates

    def add(self, s: StepSample) -> None:
        self.samples.append(s)

    def full(self) -> bool:
        return len(self.samples) == self.samples.maxlen

    def rates(self) -> Rates:
        def rate(b: float, t: float) -> float | None:
            return b / t / GB if b > 0 and t > 0 else None
        cpu = rate(sum(s.cpu_bytes for s in self.samples), sum(s.cpu_s for s in self.samples))
        gpu = rate(sum(s.gpu_bytes for s in self.samples), sum(s.gpu_s for s in self.samples))
        pcie = rate(sum(s.copy_bytes for s in self.samples), sum(s.copy_s for s in self.samples))
        self.last = Rates(cpu or self.last.cpu_gbs, gpu or self.last.gpu_gbs, pcie or self.last.pcie_gbs)
        return self.last


def moved(a: Rates, b: Rates) -> float:
    """The largest relative change of a rate from a to b."""
    return max(abs(y / x - 1) for x, y in ((a.cpu_gbs, b.cpu_gbs), (a.gpu_gbs, b.gpu_gbs), (a.pcie_gbs, b.pcie_gbs)))


# The runtime's streamed weights (ggml_ext/llama/kx-stream.cpp): the scratch's slots, one tensor
# in use and the next arriving; what the placement keeps free beyond the budget's margin for
# the driver's rounding (kx_place_alloc_slack)
SLOTS = 2
PLACE_SLACK = 16 * MiB


def step_time(tensors: Sequence[HostTensor], chosen: set[str], rates: Rates, gpu_bytes: int,
              slots: int = SLOTS) -> tuple[float, float]:
    """(seconds of one decode step, of which waiting for copies): the step as a chain in
    execution order, the GPU-resident work (gpu_bytes in all) between the host tensors, each
    host tensor on the CPU or, streamed, multiplied on the GPU once its copy has arrived. The
    one copy engine copies the streamed tensors in order into `slots` slots (SLOTS): the j-th
    streamed tensor takes slot j % slots, so its copy starts once the copy before it is done
    and the reader of the tensor that slot held last (j - slots) has finished, as the runtime's
    engine waits on that reader's event. The first ones start with the step. (A copy engine
    free to run any distance ahead hid copies the slots cannot: measured on an H100 host at 7
    GiB of KB-7B F16, docs/results-log.md.)"""
    elapsed = waited = copy_end = 0.0
    free = [0.0] * slots  # when the last reader of each slot finished
    done = j = 0  # resident GPU bytes run so far; streamed tensors so far
    for t in tensors:
        elapsed += rates.gpu_s(t.gpu_bytes_before - done)
        done = t.gpu_bytes_before
        if t.name in chosen:
            copy_end = max(copy_end, free[j % slots]) + rates.pcie_s(t.nbytes)
            wait = max(0.0, copy_end - elapsed)
            waited += wait
            elapsed += wait + rates.gpu_s(t.read_bytes)
            free[j % slots] = elapsed
            j += 1
        else:
            elapsed += rates.cpu_s(t.read_bytes)
    return elapsed + rates.gpu_s(gpu_bytes - done), waited


def stream_choice(tensors: Sequence[HostTensor], rates: Rates, gpu_bytes: int,
                  scratch_bytes: int, slots: int = SLOTS) -> tuple[list[str], float]:
    """The CPU tensors to stream into scratch (names, in execution order) and the modelled
    seconds of the step (step_time with `slots` slots), exactly. The scratch buffer is SLOTS
    slots (one tensor in use, the next arriving), so a streamed tensor takes at most one of
    them, and no more than `slots` stream in a row without a CPU tensor between (one device
    split reads such a run at once; choosing without the limit and cutting the runs
    afterwards, a choice priced at a slow CPU modelled steps its cut set could not reach).

    A dynamic program in execution order. What follows a chain's prefix depends only on its
    time so far, the earliest start of the next copy (the copy engine's end, or the end of the
    reader of the tensor that copy's slot held) and the ends of the readers of the last
    slots - 1 streamed tensors (the slots the copies after it take), and grows with each of
    them; so per length of the streamed run the prefix ends in, a state no earlier on every
    count than another can never end first, and each step keeps only that Pareto front."""
    slot = scratch_bytes // SLOTS
    # per run length: (elapsed, next copy's earliest start, readers' ends of the last slots - 1
    # streamed tensors, oldest first, streamed names so far as a linked tuple)
    State = tuple[float, float, tuple[float, ...], tuple | None]
    fronts: list[list[State]] = [[(0.0, 0.0, (0.0,) * (slots - 1), None)]] + [[] for _ in range(slots)]
    done = 0
    for t in tensors:
        run = rates.gpu_s(t.gpu_bytes_before - done)
        done = t.gpu_bytes_before
        nxt: list[list[State]] = [[] for _ in range(slots + 1)]
        for k, front in enumerate(fronts):
            for e, c, ends, names in front:
                e += run
                nxt[0].append((e + rates.cpu_s(t.read_bytes), c, ends, names))
                if t.nbytes <= slot and k < slots:
                    arrived = c + rates.pcie_s(t.nbytes)
                    e2 = max(e, arrived) + rates.gpu_s(t.read_bytes)
                    ends2 = (*ends, e2)
                    nxt[k + 1].append((e2, max(arrived, ends2[0]), ends2[1:], (t.name, names)))
        fronts = [_pareto(cands) for cands in nxt]
    # the earliest end (then the idler copy engine, then the shorter run)
    e, _, _, names = min((f[0] for f in fronts if f), key=lambda x: (x[0], x[1]))
    chosen = set()
    while names is not None:
        chosen.add(names[0])
        names = names[1]
    return [t.name for t in tensors if t.name in chosen], e + rates.gpu_s(gpu_bytes - done)


def _pareto(cands: list) -> list:
    """The states of cands no other is at least as early as on every count (elapsed, next
    copy's start, readers' ends), in order of elapsed time; of equal ones the first made."""
    cands = sorted(cands, key=lambda x: (x[0], x[1], x[2]))
    front: list = []
    for cand in cands:
        if not any(f[1] <= cand[1] and all(a <= b for a, b in zip(f[2], cand[2])) for f in front):
            front.append(cand)
    return front


def place_fixed(items: list[DenseItem], fixed: int, budget: int, hw: HwProfile, copies: bool = False) -> list[str]:
    """The runtime's knapsack placement (kx_place_dense) for a load whose KV cache and compute
    buffers take `fixed` bytes on the GPU with nothing moved: the host tensors' names, none
    when everything fits. With `copies` the compute buffers also hold a copy of the largest
    host tensor (llama.cpp's op offload of a prompt batch), as the runtime's dry runs find.
    Raises PlanError when nothing fits.

    The runtime's choice: with copies, once per tensor size as a cap on what may leave the GPU
    (items holding a larger tensor kept there, the cap charged for the copy), largest first;
    without, once; the fastest modelled one kept. (The runtime then dry-runs the winner and
    cuts the room by what it was over; here the count is exact, so it never is.)"""
    margin = margin_for(budget) + PLACE_SLACK
    by_name = {it.name: it for it in items}
    movable = sum(it.nbytes for it in items)
    if fixed + movable + margin <= budget:
        return []
    if fixed + margin > budget:
        raise PlanError(f"a budget of {budget / MiB:.0f} MiB does not hold the fixed {fixed / MiB:.0f} MiB")
    groups = dense_groups(items)
    sizes = sorted({it.nbytes for it in items}, reverse=True)
    # (the runtime's probe: a copy no larger than the slack does not count as one)
    copies = copies and sizes[0] > PLACE_SLACK
    best: tuple[float, list[str]] = (math.inf, [])
    for cap in sizes if copies else sizes[:1]:
        gpu_only = [any(by_name[n].nbytes > cap for n in g.names) for g in groups]
        on_gpu, t = solve_dense(groups, budget - margin - fixed - (cap if copies else 0), hw, gpu_only=gpu_only)
        if t < best[0]:
            best = (t, [n for g, on in zip(groups, on_gpu) if not on for n in g.names])
    cpu = best[1]
    over = fixed + movable - sum(by_name[n].nbytes for n in cpu) + margin - budget
    if copies and cpu:
        over += max(by_name[n].nbytes for n in cpu)
    if over > 0:
        raise PlanError(f"a budget of {budget / MiB:.0f} MiB does not hold the fixed {fixed / MiB:.0f} MiB "
                        "and what must stay on the GPU")
    return cpu


def host_chain(items: list[DenseItem], cpu: list[str], scratch: int) -> tuple[list[HostTensor], int]:
    """The host tensors of a placement (cpu) as the migrator's chain, in execution order, and
    the GPU-resident bytes a step reads. One a slot cannot hold, or an MoE expert tensor (read
    in part: streamed it would cross PCIe whole), is made larger than the scratch."""
    by_name = {it.name: it for it in items}
    chain, gpu = [], 0
    for n in (n for g in dense_groups(items) for n in g.names):
        it = by_name[n]
        if n not in cpu:
            gpu += int(it.nbytes * it.read)
            continue
        chain.append(HostTensor(n, it.nbytes if it.read >= 1.0 else scratch + 1, gpu, it.read))
    return chain, gpu


def stream_rates(hw: HwProfile, items: list[DenseItem], cpu: list[str]) -> Rates:
    """The streaming policy's rates for these host tensors (the runtime's kx_stream_rates): the
    CPU's and the GPU's the byte-weighted harmonic mean of each weight type's rate, so the one
    rate the policy takes prices the host tensors, all on one side, as the per-type rates do;
    one type's rate exactly as given; PCIe as the profile says."""
    host = set(cpu)
    type_bytes: dict[str, float] = {}
    for it in items:
        if it.name in host:
            type_bytes[it.type] = type_bytes.get(it.type, 0.0) + it.nbytes * it.read
    r = hw.rates
    if len(type_bytes) == 1:
        (t,) = type_bytes
        return Rates(hw.cpu_rate(t) / GB, hw.gpu_rate(t) / GB, r.pcie_gbs)
    if type_bytes:
        total = cpu_s = gpu_s = 0.0
        for t in sorted(type_bytes):  # the runtime sums over a map ordered by type name
            b = type_bytes[t]
            total += b
            cpu_s += b / (hw.cpu_rate(t) / GB)
            gpu_s += b / (hw.gpu_rate(t) / GB)
        return Rates(total / cpu_s, total / gpu_s, r.pcie_gbs)
    return r


def stream_step(items: list[DenseItem], cpu: list[str], scratch: int, hw: HwProfile) -> tuple[float, list[str]]:
    """The modelled decode step of a placement (cpu: its host tensors) streaming what the
    exact choice picks into `scratch` (0: nothing), and the streamed tensors."""
    chain, gpu = host_chain(items, cpu, scratch)
    chosen, t = stream_choice(chain, stream_rates(hw, items, cpu), gpu, scratch)
    return t, chosen


@dataclass(frozen=True)
class StreamPlacement:
    cpu: list[str]        # the host tensors, the streamed ones among them
    streamed: list[str]   # in execution order
    scratch: int          # the slots' bytes on the GPU: two of the largest tensor a slot holds
    slotted: list[str]    # the host tensors a slot holds: streamed now, or later by migration
    step_s: float         # the modelled decode step
    plain_s: float        # ... of the placement without streaming


def stream_placement(items: list[DenseItem], fixed: int, budget: int, hw: HwProfile,
                     copies: bool = False) -> StreamPlacement:
    """The budget's placement with streamed weights, the reference of the runtime's
    kx_stream_choose: the plain placement; then for each of its host tensors' sizes (largest
    first, three at most) the placement again under the budget less two slots of that size and
    the exact streaming choice over its host tensors (runs within the slots); the fastest
    modelled one, the plain one when none beats it. An MoE expert tensor (read in part) never
    streams: it would cross PCIe whole. The scratch is two of the largest tensor a slot of the
    winner holds (the same choice: no tensor between that and the size tried is on the CPU)."""
    by_name = {it.name: it for it in items}
    cpu = place_fixed(items, fixed, budget, hw, copies)
    plain_s = stream_step(items, cpu, 0, hw)[0]
    best = StreamPlacement(cpu, [], 0, [], plain_s, plain_s)
    if not cpu:
        return best
    sizes = sorted({by_name[n].nbytes for n in cpu if by_name[n].read >= 1.0}, reverse=True)[:3]
    for size in sizes:
        try:
            cpu_k = place_fixed(items, fixed, budget - SLOTS * size, hw, copies)
        except PlanError:
            continue  # the scratch does not fit beside the fixed part
        t, streamed = stream_step(items, cpu_k, SLOTS * size, hw)
        if streamed and t < best.step_s:
            chain, _ = host_chain(items, cpu_k, SLOTS * size)
            slotted = [h.name for h in chain if h.nbytes <= size]
            best = StreamPlacement(cpu_k, streamed, SLOTS * max(by_name[n].nbytes for n in slotted), slotted,
                                   t, plain_s)
    return best


@dataclass(frozen=True)
class Choice:
    step: int
    rates: Rates
    streamed: list[str]
    start: list[str]  # begin streaming these
    stop: list[str]   # leave these to the CPU again
    seconds: float    # modelled per token


@dataclass
class Migrator:
    tensors: list[HostTensor]
    gpu_bytes: int       # the GPU-resident weights a step reads
    scratch_bytes: int
    rates: Rates = field(default_factory=Rates)  # those of the current choice (the load's plan)
    cfg: MigrateConfig = field(default_factory=MigrateConfig)

    def __post_init__(self) -> None:
        self.tracker = RateTracker(self.cfg.window, self.rates)
        self.streamed, _ = stream_choice(self.tensors, self.rates, self.gpu_bytes, self.scratch_bytes)
        self.steps = 0
        self.last = 0
        self.moved_n = 0  # re-estimates past the threshold (a new set or not)

    def step(self, s: StepSample) -> Choice | None:
        """Feed one step; a new choice when the rates moved past the threshold, the last
        re-estimate is at least `cooldown` steps old (the window full) and the best set at the
        new rates models `min_gain` faster than the current one, else None."""
        self.steps += 1
        self.tracker.add(s)
        if not self.tracker.full() or self.steps - self.last < self.cfg.cooldown:
            return None
        now = self.tracker.rates()
        if moved(self.rates, now) <= self.cfg.threshold:
            return None
        self.rates, self.last = now, self.steps
        self.moved_n += 1
        streamed, seconds = stream_choice(self.tensors, now, self.gpu_bytes, self.scratch_bytes)
        if seconds > (1.0 - self.cfg.min_gain) * step_time(self.tensors, set(self.streamed), now, self.gpu_bytes)[0]:
            return None  # hardly faster at these rates: not worth a new split
        c = Choice(self.steps, now, streamed, [n for n in streamed if n not in self.streamed],
                   [n for n in self.streamed if n not in streamed], seconds)
        self.streamed = streamed
        return c


def step_sample(tensors: Sequence[HostTensor], chosen: set[str], rates: Rates, gpu_bytes: int) -> StepSample:
    """What the runtime would measure of a step run at these rates with `chosen` streamed."""
    cpu_b = sum(t.read_bytes for t in tensors if t.name not in chosen)
    gpu_b = gpu_bytes + sum(t.read_bytes for t in tensors if t.name in chosen)
    copy_b = sum(t.nbytes for t in tensors if t.name in chosen)
    return StepSample(cpu_b, rates.cpu_s(cpu_b), gpu_b, rates.gpu_s(gpu_b), copy_b, rates.pcie_s(copy_b))


def simulate(tensors: Sequence[HostTensor], gpu_bytes: int, scratch_bytes: int, load: Callable[[int], Rates],
             steps: int, migrate: bool = True, cfg: MigrateConfig | None = None) -> tuple[list[float], list[Choice]]:
    """Modelled TPOT (seconds) of `steps` decode steps whose machine runs at load(step)'s rates
    (step_time), the host tensors streamed as the policy last chose; without `migrate`, as
    chosen at the first step's rates and never again."""
    m = Migrator(list(tensors), gpu_bytes, scratch_bytes, load(0), cfg or MigrateConfig())
    tpot: list[float] = []
    choices: list[Choice] = []
    for k in range(steps):
        r = load(k)
        chosen = set(m.streamed)
        tpot.append(step_time(tensors, chosen, r, gpu_bytes)[0])
        if migrate:
            c = m.step(step_sample(tensors, chosen, r, gpu_bytes))
            if c is not None:
                choices.append(c)
    return tpot, choices
