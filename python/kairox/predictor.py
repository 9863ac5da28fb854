"""The "sketch" activation predictor: a low-rank guess of the FFN gate, biased to over-predict.

A sparse FFN computes only the neurons predicted active, so a neuron missed by the
predictor silently changes the output, while a neuron predicted in vain only costs time.
The sketch therefore aims for high recall first and pays for it with over-prediction.

Derivation. The FFN input of a layer is x = x̂ ⊙ w, where x̂ is the RMS-normalised hidden
state (RMS exactly 1) and w the layer's ffn_norm weight. The gate pre-activation is

    g = W x = (W diag(w)) x̂ = G' x̂        W: ffn_gate [n_ff, n_embd]

Let G' ≈ U S Vᵀ be its rank-r truncated SVD and Vr the first r right singular vectors.
The predicted gate projects x̂ onto that subspace:

    ĝ = G' Vr Vrᵀ x̂ = (G' Vr) (Vrᵀ diag(1/w)) x = B (A x)

so A = Vrᵀ diag(1/w) [r, n_embd] reads the FFN input directly (a channel with |w| < 1e-6
carries no signal, and its 1/w is taken as 0 rather than a huge factor) and
B = G' Vr [n_ff, r]. The error g − ĝ = G' (I − Vr Vrᵀ) x̂; for an isotropic x̂ with unit
RMS, neuron i's error has standard deviation

    ρ_i = ‖row i of G' (I − Vr Vrᵀ)‖₂

computed from the residual matrix itself: the shortcut sqrt(‖row of G'‖² − ‖row of B‖²)
cancels catastrophically in float32 when the fit is good (measured: ~1e-3 of the row norm
on an exactly low-rank gate, where the true ρ is 0). The bias c_i = margin · ρ_i shifts
every score up by `margin` standard deviations of its own error, so a neuron whose true
gate is positive scores below 0 only if its error exceeds margin·ρ_i: for a Gaussian
error and margin 3, 0.13% of the time. The pack stores (A, B, c); neuron i is predicted
active iff (B (A x) + c)[i] > 0.

The guarantee holds for any orthonormal Vr, not only the exact singular vectors, because
ρ is computed from the Vr actually used. That is why a randomized range finder (seeded,
so packs are reproducible) may replace the exact SVD on large matrices: a less accurate
subspace only raises ρ, i.e. over-prediction, never the miss rate. Hidden states of real
models are not isotropic (a few channels carry most of the energy); there the sketch is a
cheap recall-first starting point, and predictors calibrated on activations replace it.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .pack import PRED_TYPES, PackError, PackPredictor, default_pred_type, inspect_model, read_model_tensor

DEFAULT_MARGIN = 3.0
# Below this |ffn_norm weight| a channel is treated as dead (1/w -> 0), see above.
NORM_EPS = 1e-6
# The randomized range finder: extra dimensions beyond the rank, and power iterations
# (each sharpens the subspace where the singular values decay slowly).
_OVERSAMPLE = 10
_POWER_ITERS = 2
# Exact SVD only while it is cheap: measured on 2 cores, svd of a 2816x1024 float32 matrix
# takes 0.8-1.5 s against 0.1 s for the range finder at rank 64, with the same recall and
# over-prediction (1.566 vs 1.569 on a rank-64 gate with 10% noise); a 7B layer
# (11008x4096, rank 256) takes ~1 s, the whole sketch ~2 s.
_EXACT_MAX_SIDE = 256
SVD_METHODS = ("auto", "exact", "randomized")
_RESIDUAL_ROWS = 2048


def default_rank(n_embd: int, n_ff: int) -> int:
    """max(8, n_embd // 16), capped at min(n_ff, n_embd)."""
    return min(max(8, n_embd // 16), n_ff, n_embd)


def _top_right_singular(g: np.ndarray, rank: int, method: str, seed: int) -> np.ndarray:
    """An orthonormal [n, rank] basis of g's top-`rank` right singular subspace (float32)."""
    m, n = g.shape
    small = min(m, n)
    width = min(rank + _OVERSAMPLE, small)
    if method == "auto":
        # the range finder pays off only when the subspace is a small part of the matrix
        method = "randomized" if small > _EXACT_MAX_SIDE and 4 * width <= small else "exact"
    if method == "exact":
        _, _, vt = np.linalg.svd(g, full_matrices=False)
        return np.ascontiguousarray(vt[:rank].T, dtype=np.float32)
    # Subspace iteration on G'ᵀG' (after Halko, Martinsson & Tropp 2011, section 4.5),
    # re-orthonormalised on the n_embd side only: a QR of a tall n_ff-row matrix is a
    # long chain of small LAPACK steps, which crawls when the cores are busy. Squaring
    # the spectrum costs float32 accuracy in the small singular values only, and an
    # inexact subspace only raises ρ (module docstring).
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, width), dtype=np.float32)
    for _ in range(1 + _POWER_ITERS):
        q, _ = np.linalg.qr(g.T @ (g @ q))
    # The best rank-`rank` subspace inside span(q): eigenvectors of (g q)ᵀ(g q), a small
    # width x width matrix, formed in float64 so the squared singular values keep their order.
    y = (g @ q).astype(np.float64)
    _, evecs = np.linalg.eigh(y.T @ y)                # ascending eigenvalues
    top = evecs[:, ::-1][:, :rank].astype(np.float32)
    return np.ascontiguousarray(q @ top, dtype=np.float32)


def sketch_predictor(w_gate: np.ndarray, norm_w: np.ndarray, rank: int,
                     margin: float = DEFAULT_MARGIN, *, method: str = "auto",
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sketch predictor (A [rank, n_embd], B [n_ff, rank], c [n_ff]) of one layer, float32.

    w_gate: the gate projection [n_ff, n_embd]; norm_w: the ffn_norm weight [n_embd];
    margin: bias in standard deviations of each neuron's prediction error (module
    docstring). method: "exact" SVD, the seeded "randomized" range finder, or "auto"
    (randomized when the rank is a small part of a large matrix).
    """
    w_gate = np.asarray(w_gate)
    norm_w = np.asarray(norm_w)
    if w_gate.ndim != 2:
        raise ValueError(f"w_gate must be 2-D [n_ff, n_embd], got shape {w_gate.shape}")
    n_ff, n_embd = w_gate.shape
    if norm_w.shape != (n_embd,):
        raise ValueError(f"norm_w must have shape ({n_embd},) to match w_gate, got {norm_w.shape}")
    is_int = isinstance(rank, (int, np.integer)) and not isinstance(rank, bool)
    if not is_int or not 1 <= rank <= min(n_ff, n_embd):
        raise ValueError(f"rank must be an integer in 1..{min(n_ff, n_embd)} "
                         f"(min of n_ff {n_ff} and n_embd {n_embd}), got {rank!r}")
    if not (isinstance(margin, (int, float, np.floating)) and math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    if method not in SVD_METHODS:
        raise ValueError(f"method must be one of {', '.join(SVD_METHODS)}, got {method!r}")
    if not (np.all(np.isfinite(w_gate)) and np.all(np.isfinite(norm_w))):
        raise ValueError("w_gate and norm_w must be finite")

    w = norm_w.astype(np.float32)
    g = np.multiply(w_gate, w[None, :], dtype=np.float32)     # G' = W diag(w), one pass
    vr = _top_right_singular(g, int(rank), method, seed)       # [n_embd, rank]
    b = g @ vr                                                 # [n_ff, rank]
    dead = np.abs(w) < NORM_EPS
    inv_w = np.where(dead, np.float32(0), 1 / np.where(dead, np.float32(1), w))
    a = vr.T * inv_w[None, :]                                  # Vrᵀ diag(1/w)
    rho = np.empty(n_ff, np.float32)
    for lo in range(0, n_ff, _RESIDUAL_ROWS):  # in row blocks: the residual is as big as G'
        hi = min(lo + _RESIDUAL_ROWS, n_ff)
        r = g[lo:hi] - b[lo:hi] @ vr.T
        rho[lo:hi] = np.sqrt(np.einsum("ij,ij->i", r, r))
    c = (np.float32(margin) * rho).astype(np.float32)
    return np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32), c


def never_fires(model_path: str | Path) -> PackPredictor:
    """A rank-1 predictor that lists no neuron (B = 0, c = -1) for every layer of a model:
    predicted mode with it skips every FFN, which measures what the rest of the model costs
    (benchmarks) and what the FFNs contribute to the logits (tests)."""
    _, base = inspect_model(model_path)

    def layer(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.ones((1, base.n_embd), np.float32), np.zeros((base.n_ff, 1), np.float32),
                np.full(base.n_ff, -1.0, np.float32))
    return PackPredictor(1, layer, info={"kind": "never-fires"})


def recall_and_overprediction(pred_mask: np.ndarray, true_mask: np.ndarray) -> tuple[float, float]:
    """(recall, over-prediction) of a predicted active set against the true one.

    recall = |pred ∩ true| / |true|, over-prediction = |pred| / |true|, counted over all
    entries (e.g. tokens x neurons). With no truly active neuron, nothing can be missed:
    recall is 1.0, and over-prediction is 1.0 if nothing is predicted either, else inf.
    """
    pred = np.asarray(pred_mask, dtype=bool)
    true = np.asarray(true_mask, dtype=bool)
    if pred.shape != true.shape:
        raise ValueError(f"pred_mask shape {pred.shape} differs from true_mask shape {true.shape}")
    n_true, n_pred = int(true.sum()), int(pred.sum())
    if n_true == 0:
        return 1.0, (1.0 if n_pred == 0 else math.inf)
    return int((pred & true).sum()) / n_true, n_pred / n_true


def sketch_for_model(model_path: str | Path, rank: int | None = None,
                     margin: float = DEFAULT_MARGIN, dtype: str | None = None) -> PackPredictor:
    """The sketch predictor of every layer of a model GGUF, as write_pack's `predictor`.

    Each layer's factors are computed from blk.{l}.ffn_gate.weight and
    blk.{l}.ffn_norm.weight (any type gguf can dequantize) only when write_pack asks for
    that layer. rank defaults to `default_rank`; dtype (storage of A and B) to
    `pack.default_pred_type`: a predictor finer than the weights it imitates buys nothing,
    and each halving of its bytes is read once less per token. Problems with the model or
    the arguments raise PackError before anything is written.
    """
    hdr, base = inspect_model(model_path)
    tensors = {t.name: t for t in hdr.tensors}
    for il in range(base.n_layer):
        gate, norm = f"blk.{il}.ffn_gate.weight", f"blk.{il}.ffn_norm.weight"
        if tensors.get(gate) is None or tensors[gate].ne != (base.n_embd, base.n_ff):
            raise PackError(f"{hdr.path} has no gated FFN in layer {il} "
                            f"(no {gate} of shape {base.n_ff}x{base.n_embd}); the sketch needs one")
        if tensors.get(norm) is None or tensors[norm].ne != (base.n_embd,):
            raise PackError(f"{hdr.path} has no {norm} of {base.n_embd} values; the sketch needs it")
    limit = min(base.n_ff, base.n_embd)
    rank = default_rank(base.n_embd, base.n_ff) if rank is None else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= limit:
        raise PackError(f"predictor rank must be in 1..{limit} (min of n_ff {base.n_ff} and "
                        f"n_embd {base.n_embd}), got {rank!r}")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
        raise PackError(f"predictor margin must be a finite number >= 0, got {margin!r}")
    dtype = dtype or default_pred_type(hdr)
    if dtype not in PRED_TYPES:
        raise PackError(f"unsupported predictor type {dtype!r} (supported: {', '.join(PRED_TYPES)})")

    def layer(il: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        w_gate = read_model_tensor(hdr, f"blk.{il}.ffn_gate.weight")
        norm_w = read_model_tensor(hdr, f"blk.{il}.ffn_norm.weight")
        # seeded by layer: the same model gives the same pack
        return sketch_predictor(w_gate, norm_w, rank, margin, seed=il)

    return PackPredictor(rank, layer, dtype, {"kind": "sketch", "margin": float(margin)})
