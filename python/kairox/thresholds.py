"""Load-aware thresholds (DynamicInfer): one predictor threshold per side of a hybrid layer.

A hybrid layer takes as long as the slower of its parts, max(T_gpu, T_cpu). The static split
computes a neuron on either side when its predictor score s_i > 0. With one offset per side,
a resident neuron (in the GPU's slots) is computed when s_i > θ_g and a host-side one when
s_i > θ_c: when the CPU part is the critical path, a lower θ_g lets the GPU compute more of
its residents (neurons the predictor nearly missed) and a higher θ_c lets the CPU skip the
neurons it was least sure of. The error the skipped neurons cause is held under a bound.

Calibration (stored in the pack, `kx_thr_*`): on recorded FFN inputs x of each layer, with
the pack's own predictor, for a grid of offsets θ_k (ascending, θ_K0 = 0):

    sel[i, k] = E[work_i · 1(s_i > θ_k)]            neuron i's expected work when listed
    err[i, k] = E[|h_i| ‖d_i‖ · 1(s_i <= θ_k)]      what skipping it drops, as a norm
    norm      = E[‖y‖]                              the layer's FFN output norm

work_i is the share of the neuron's three rows (gate, up, down) the kernels read: 1, or for
ReLU 1/3 where the gate is <= 0 (the up and down rows are then skipped, kx-ffn-rows.c). h_i =
act(g_i) u_i is the neuron's GLU output and d_i its down row: |h_i| ‖d_i‖ is the norm of the
term the FFN output y loses, so the summed err bounds the output's error (triangle
inequality). For resident set R and grid points (kg, kc):

    Err(kg, kc) = Σ_{i∈R} err[i, kg] + Σ_{i∉R} err[i, kc]
    T_gpu = o_gpu + t_gpu Σ_{i∈R} sel[i, kg],   T_cpu = o_cpu + t_cpu Σ_{i∉R} sel[i, kc]

The bound is Err(kg, kc) <= Err(K0, K0) + budget · norm: budget 0 is DynamicInfer's (no more
error than the static threshold), budget > 0 a declared approximation, the relative error of
the FFN output it may add (an upper bound: the summed norms of the skipped terms). The bound
is absolute in the output's norm, not a multiple of Err(K0, K0), because a recall-first
predictor misses almost nothing: its static error is ~0 on calibration data (KB-350M's sketch:
5.5e-9 of a unit-scale output), and a multiple of ~0 leaves no room, while the CPU lists 20-30%
false positives it could skip for nothing. The search takes every
pair of the grid, the least max(T_gpu, T_cpu) within the bound; ties go to the lower error,
then to the pair nearer (K0, K0). DynamicInfer walks greedily from the static pair; the full
search over K² = 121 pairs costs less than the sums it reads and never stops at a local step.
The static pair is always feasible, so by the model a solution is never slower than static.
t_cpu and o_cpu are measured by the runtime as it decodes (kx-thresholds.cpp); this module is
the reference it is tested against (tests/test_thresholds.py).

For ReLU models exact mode is untouched: thresholds apply to the predicted mode's scores.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .pack import THR_GRID_REL, THR_K, THR_K0, inspect_model, predictor_scores, read_model_tensor

# the grid of score offsets (relative to the layer's score spread), its width and its zero
GRID_REL, K, K0 = THR_GRID_REL, THR_K, THR_K0
# FFN inputs per layer a pack's calibration uses (`kairox synth --pack`, `kairox prepare`):
# the tables are means over tokens, and 512 puts a neuron firing on 5% of tokens at ~26 samples
CALIBRATION_TOKENS = 512


@dataclass
class ThresholdTables:
    """Calibration of the load-aware thresholds, per layer (neuron ids as the pack's freq)."""
    grid: np.ndarray                 # float32 [n_layer, K]: score offsets, ascending, grid[:, K0] == 0
    sel: list[np.ndarray]            # per layer float32 [n_ff, K]
    err: list[np.ndarray]            # per layer float32 [n_ff, K]
    norm: np.ndarray                 # float32 [n_layer]: mean FFN output norm

    def layer(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sel[il], self.err[il]


def layer_tables(scores: np.ndarray, contrib: np.ndarray, grid: np.ndarray,
                 work: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """sel, err [n_ff, K] from one layer's scores, |h| ‖d‖ and (optional) work on T tokens
    ([T, n_ff] each; work None: 1, every row read)."""
    T = max(1, scores.shape[0])
    sel = np.empty((scores.shape[1], len(grid)), np.float32)
    err = np.empty_like(sel)
    for k, th in enumerate(grid):
        on = scores > th
        sel[:, k] = (on.sum(axis=0) if work is None else np.where(on, work, 0.0).sum(axis=0, dtype=np.float64)) / T
        err[:, k] = np.where(on, 0.0, contrib).sum(axis=0, dtype=np.float64) / T
    return sel, err


def layer_grid(scores: np.ndarray) -> np.ndarray:
    sd = float(np.std(scores)) if scores.size else 0.0
    return (GRID_REL * (sd if np.isfinite(sd) and sd > 0 else 1.0)).astype(np.float32)


def calibrate(model_path: str | Path, predictor: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]],
              xs: list[np.ndarray], quiet: bool = True) -> ThresholdTables:
    """The tables of every layer from recorded FFN inputs xs[il] ([T, n_embd]) and the pack's
    predictor (`predictor(il)` = (A, B, c)), with the model's own gate, up and down weights."""
    from tqdm import tqdm

    from .reference import ACTIVATIONS

    hdr, base = inspect_model(model_path)
    act = ACTIVATIONS[base.activation]
    grids, sels, errs, norms = [], [], [], []
    for il in tqdm(range(base.n_layer), desc="thresholds", unit="layer", disable=quiet, file=sys.stderr):
        x = np.asarray(xs[il], np.float32)
        g = x @ read_model_tensor(hdr, f"blk.{il}.ffn_gate.weight").T     # [T, n_ff]
        h = act(g) * (x @ read_model_tensor(hdr, f"blk.{il}.ffn_up.weight").T)
        down = read_model_tensor(hdr, f"blk.{il}.ffn_down.weight")         # [n_embd, n_ff]
        contrib = np.abs(h) * np.linalg.norm(down, axis=0)
        norms.append(float(np.linalg.norm(h @ down.T, axis=1).mean()) if len(x) else 0.0)
        # ReLU: a listed neuron whose gate is <= 0 costs its gate row only
        work = np.where(g > 0, 1.0, 1.0 / 3.0).astype(np.float32) if base.activation == "relu" else None
        del g, h, down
        a, b, c = predictor(il)
        s = predictor_scores(a, b, c, x)
        grid = layer_grid(s)
        sel, err = layer_tables(s, contrib, grid, work)
        grids.append(grid)
        sels.append(sel)
        errs.append(err)
    return ThresholdTables(np.stack(grids), sels, errs, np.asarray(norms, np.float32))


@dataclass
class SideCosts:
    """The layer-time model: seconds per neuron on each side and each part's fixed cost."""
    t_gpu: float
    t_cpu: float
    o_gpu: float = 0.0
    o_cpu: float = 0.0


@dataclass
class LayerSums:
    """Per grid point, the computed neurons and the error of each side for one resident set."""
    n_gpu: np.ndarray   # float64 [K]
    n_cpu: np.ndarray
    e_gpu: np.ndarray
    e_cpu: np.ndarray


def layer_sums(sel: np.ndarray, err: np.ndarray, resident: np.ndarray) -> LayerSums:
    """Sums over the resident neurons (resident: bool [n_ff]) and over the others, in neuron
    order and float64 (the runtime's loop adds the same terms in the same order)."""
    r = np.asarray(resident, bool)

    def side(t: np.ndarray, m: np.ndarray) -> np.ndarray:
        rows = t[m].astype(np.float64)
        # add.accumulate adds row after row (sum() would add pairwise)
        return np.add.accumulate(rows, axis=0)[-1] if len(rows) else np.zeros(t.shape[1], np.float64)
    return LayerSums(side(sel, r), side(sel, ~r), side(err, r), side(err, ~r))


# relative slack of the error bound and of a time tie (float sums in another order)
BOUND_TOL = 1e-6
TIE_TOL = 1e-9


def solve_sums(s: LayerSums, budget: float, norm: float, costs: SideCosts) -> tuple[int, int]:
    """(kg, kc): the grid points of the GPU and CPU thresholds (module docstring); norm: the
    layer's mean FFN output norm."""
    bound = (s.e_gpu[K0] + s.e_cpu[K0]) * (1.0 + BOUND_TOL) + budget * norm
    best = (K0, K0)
    best_t = max(costs.o_gpu + costs.t_gpu * s.n_gpu[K0], costs.o_cpu + costs.t_cpu * s.n_cpu[K0])
    best_e = s.e_gpu[K0] + s.e_cpu[K0]
    for kg in range(K):
        for kc in range(K):
            e = s.e_gpu[kg] + s.e_cpu[kc]
            if e > bound:
                continue
            t = max(costs.o_gpu + costs.t_gpu * s.n_gpu[kg], costs.o_cpu + costs.t_cpu * s.n_cpu[kc])
            d, best_d = abs(kg - K0) + abs(kc - K0), abs(best[0] - K0) + abs(best[1] - K0)
            if t < best_t * (1.0 - TIE_TOL) or (t <= best_t * (1.0 + TIE_TOL) and
                                                 (e < best_e or (e == best_e and d < best_d))):
                best, best_t, best_e = (kg, kc), t, e
    return best


def solve_layer(sel: np.ndarray, err: np.ndarray, resident: np.ndarray, budget: float, norm: float,
                costs: SideCosts) -> tuple[int, int]:
    return solve_sums(layer_sums(sel, err, resident), budget, norm, costs)
