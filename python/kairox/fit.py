"""Fitting the activation predictor on recorded activations (recall first).

The pack's predictor scores the neurons of one FFN layer as s = B (A x) + c
(A [rank, n_embd], B [n_ff, rank], c [n_ff]) and computes neuron i iff s_i > 0. The
weight-only sketch (kairox.predictor) derives A and B from the gate alone and assumes an
isotropic input; real hidden states are strongly anisotropic, so a predictor fitted on
recorded (FFN input, active neurons) pairs can reach the same recall with fewer extra
neurons. A missed neuron changes the model's output while an extra one only costs time,
so the fit is built to reach a chosen recall first and to be as precise as it can second.

Method, in four steps:

1. Standardize. Each input channel is shifted and scaled to mean 0 and variance 1 over
   the training rows. Hidden states have a few channels hundreds of times larger than
   the rest; without this the initialization and the optimizer would see only those.
   The scaling is folded back at the end (A ← A_z diag(1/σ), c ← c_z − B A_z (μ/σ)), so
   the result reads raw x like any other predictor. Channels with (almost) no variance
   carry no signal and get weight 0.

2. Initialize by reduced-rank regression. Ridge-regress the centred targets y − p onto
   the standardized inputs z (W = (C + λI)⁻¹ Zᵀ(Y − p)/N, C = ZᵀZ/N), then keep the best
   rank-`rank` part of the fitted values Z W: its right singular vectors Vr give B = Vr
   and A = (W Vr)ᵀ. It is computed in n_embd-space (with C + λI for C, the fitted
   values' Gram matrix is Mᵀ M, M = Lᵀ Zᵀ(Y − p)/N, L Lᵀ = (C + λI)⁻¹), so the cost is
   one pass over the data plus dense algebra on [n_embd, n_ff] matrices. Unlike the top principal
   directions of z, these are the directions that predict the targets: on anisotropic
   synthetic data, starting from principal directions took about three times the epochs
   to reach the same training loss, and on a separable problem it ended 8 epochs at
   nearly twice the loss. The regression's 0.5-crossing becomes the logit 0 up to a scale α,
   chosen from a geometric grid by the loss on a sample of rows: steep on nearly
   separable data, flat on noisy data. Adam's steps are too small to travel between the
   two in a few epochs: with α fixed at 4, a separable problem ended 8 epochs at four
   times the loss and precision 0.88 instead of 0.96 at the same recall.

3. Refine with minibatch Adam on a class-weighted logistic loss: a positive entry costs
   pos_weight · softplus(−s), a negative one softplus(s); by default pos_weight is the
   negatives per positive, capped at POS_WEIGHT_CAP. The weight tilts the fit toward the
   positives near the boundary, which is where recall is decided; the final threshold
   comes from step 4 anyway, so its effect is small (at density 0.03, pos_weight 1, 10
   and 50 gave precision 0.214, 0.217 and 0.214 at the same recall). Each tensor (A, B,
   c) steps relative to its initial RMS: their scales differ by orders of magnitude and
   move with n_embd, rank and α, so no absolute step size suits all three. The step
   decays along a cosine to a tenth, which lets the last epochs settle.

4. Calibrate the biases on a held-out slice of the rows (val_fraction) that the
   optimizer never saw, so that over-fitted training scores do not set the threshold.
   A neuron with n positives there is shifted so that its positives' (1 −
   target_recall) quantile lands on 0, using the plotting position k = (1 −
   target_recall)(n + 1) of its ascending positive scores: a new positive falls below
   the k-th smallest of n with probability k / (n + 1) whatever the distribution, so the
   expected recall on new data is the target (interpolating between neighbours). This
   needs k ≥ 1, i.e. n ≥ 1 / (1 − target_recall) − 1 (99 for 0.99): below that the
   threshold would have to extrapolate under the smallest positive, and extrapolating
   missed the target by 2-5% for neurons with 8-32 positives on synthetic data. Such
   rarer neurons are grouped by rarity (log2 bins of n, merged until each group pools
   that many positives) and each group gets one shift that gives the group's pooled
   positives the target recall (for a group's pooled recall, one logit threshold is
   also the most precise rule when the logits are calibrated). Either shift may raise or lower c: a neuron the
   optimizer left permissive gains precision at the target. Neurons never active in any
   row give nothing to calibrate on: their bias is clipped so that they are predicted
   only where their score exceeds the highest score seen on the fit data, i.e. never on
   inputs like the recorded ones (predicting them would cost time for nothing observed).

All arithmetic is float32 numpy (BLAS) in chunks: for 16k rows of a 7B layer (n_embd 4096,
n_ff 11008, rank 256) the fit allocates 0.8 GB besides its inputs, and took 49 s on 16
cores. The optional torch backend runs step 3, where the time goes, on torch tensors (on
CUDA when available) with the same code, and steps 1, 2 and 4 stay in numpy: 16 s for the
same layer with an H200, with the same loss curve to four decimals. numpy is the
reference and the only backend that is bitwise reproducible: CUDA reductions are not.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from .pack import predictor_scores
from .predictor import _top_right_singular

BACKENDS = ("auto", "numpy", "torch")
# Fewest held-out positives for a neuron's own bias, whatever target_recall allows
# (module docstring, step 4; _alone_min).
MIN_POSITIVES = 8
# Upper limit of the automatic positive weight (negatives per positive).
POS_WEIGHT_CAP = 10.0
# Ridge of the initial regression, relative to the unit diagonal of the standardized
# inputs' correlation matrix: only keeps nearly collinear channels from blowing W up.
_RIDGE = 1e-3
# A channel whose std is below this fraction of the largest channel std is treated as dead.
_DEAD_STD = 1e-6
_ADAM_B1, _ADAM_B2, _ADAM_EPS = 0.9, 0.999, 1e-8
# Final learning rate as a fraction of lr (cosine decay): the last epochs settle instead
# of jittering around the minimum with batch-sized noise.
_LR_FLOOR = 0.1
# Candidate logit scales for the initial regression (geometric, factor √2) and the entries
# (rows x neurons) scored to choose one.
_SCALES = 2.0 ** np.arange(0, 8.5, 0.5)
_SCALE_ENTRIES = 1 << 20
# Bytes of one float32 temporary that chunked passes aim for.
_CHUNK_BYTES = 64 << 20


@dataclass
class FitConfig:
    """How `fit_predictor` trains one layer's predictor.

    rank: inner dimension of A and B. epochs/batch/lr/weight_decay: the Adam phase; lr is
    the step relative to each tensor's initial RMS (module docstring, step 3), decayed
    along a cosine to lr/10; weight decay is decoupled (AdamW) and spares c. pos_weight:
    weight of a positive entry in the logistic loss; None = negatives per positive of the
    data, capped at POS_WEIGHT_CAP.
    target_recall: per-neuron recall the bias calibration aims for on new data. seed: the
    held-out split, minibatch order and initialization. backend: "numpy", "torch", or
    "auto" (torch when it can be imported, else numpy). val_fraction: share of the rows
    held out from training to calibrate the biases on (0 calibrates on the training rows).
    """

    rank: int
    epochs: int = 8
    batch: int = 512
    lr: float = 0.1
    weight_decay: float = 0.0
    pos_weight: float | None = None
    target_recall: float = 0.99
    seed: int = 0
    backend: str = "auto"
    val_fraction: float = 0.1


@dataclass(frozen=True)
class PredictorQuality:
    """How a predictor's active sets compare with the true ones, counted over all entries
    (tokens x neurons). recall = |pred ∩ true| / |true| (1.0 with nothing true),
    precision = |pred ∩ true| / |pred| (1.0 with nothing predicted), overprediction =
    |pred| / |true| (as kairox.predictor.recall_and_overprediction), densities = |set| /
    entries."""

    recall: float
    precision: float
    overprediction: float
    predicted_density: float
    true_density: float


@dataclass
class FitResult:
    """A fitted predictor (A [rank, n_embd], B [n_ff, rank], c [n_ff], float32, reading raw
    x as the pack does) and how the fit went.

    loss_curve: mean weighted logistic loss per epoch over the training rows. train: the
    quality on all rows passed to the fit (training and calibration). n_train / n_calib:
    rows trained on / held out for calibration (0 when val_fraction is 0 and the training
    rows served). n_calibrated /
    n_pooled / n_never_active: neurons given their own bias, a shared one, and a clipped
    one (module docstring, step 4).
    """

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    loss_curve: list[float]
    train: PredictorQuality
    seconds: float
    backend: str
    pos_weight: float
    n_train: int
    n_calib: int
    n_calibrated: int
    n_pooled: int
    n_never_active: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def train_recall(self) -> float:
        return self.train.recall

    @property
    def train_precision(self) -> float:
        return self.train.precision


def predictor_params(n_embd: int, n_ff: int, rank: int) -> int:
    """Numbers stored for one layer's predictor: A and B (rank x (n_embd + n_ff)) plus c (n_ff)."""
    for name, v in (("n_embd", n_embd), ("n_ff", n_ff), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(rank) * (int(n_embd) + int(n_ff)) + int(n_ff)


def rank_for_budget(n_embd: int, n_ff: int, n_layer: int, model_params: int,
                    budget_fraction: float = 0.06) -> int:
    """The largest predictor rank whose n_layer predictors hold at most budget_fraction of
    the model's parameter count: n_layer * (rank * (n_embd + n_ff) + n_ff) <= budget.

    A rank of 8 or more is rounded down to a multiple of 8 (whole SIMD/tensor-core tiles);
    the rank never exceeds min(n_embd, n_ff), beyond which a factorization adds nothing.
    Raises ValueError when not even rank 1 fits the budget.
    """
    predictor_params(n_embd, n_ff, 1)  # validates the shapes
    for name, v in (("n_layer", n_layer), ("model_params", model_params)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if isinstance(budget_fraction, bool) or not isinstance(budget_fraction, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(budget_fraction) and budget_fraction > 0):
        raise ValueError(f"budget_fraction must be a finite number > 0, got {budget_fraction!r}")
    budget = budget_fraction * model_params
    per_layer = budget / n_layer - n_ff            # room left for A and B in one layer
    rank = math.floor(per_layer / (n_embd + n_ff)) if per_layer > 0 else 0
    if rank < 1:
        need = n_layer * predictor_params(n_embd, n_ff, 1)
        raise ValueError(f"even a rank-1 predictor ({need} parameters for {n_layer} layers) exceeds "
                         f"budget_fraction {budget_fraction} of {model_params} parameters "
                         f"({budget:.0f} parameters)")
    rank = min(rank, n_embd, n_ff)
    return rank - rank % 8 if rank >= 8 else rank


def _rows_per_chunk(width: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(1, width)))


def _check_xy(x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [n_tokens, n_embd], got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"x must be floating point (f16 or f32), got {x.dtype}")
    if y.ndim != 2:
        raise ValueError(f"y must be 2-D [n_tokens, n_ff], got shape {y.shape}")
    if y.dtype != np.bool_:
        raise ValueError(f"y must be a bool array (True = neuron active), got {y.dtype}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows (tokens) but y has {y.shape[0]}")
    if x.shape[1] == 0 or y.shape[1] == 0:
        raise ValueError(f"x and y need at least one channel and one neuron, got shapes "
                         f"{x.shape} and {y.shape}")


def evaluate_predictor(a: np.ndarray, b: np.ndarray, c: np.ndarray, x: np.ndarray,
                       y: np.ndarray) -> PredictorQuality:
    """The quality of predictor (A, B, c) on inputs x [N, n_embd] against active sets y
    [N, n_ff] (bool), scored in row chunks with kairox.pack.predictor_scores."""
    x, y = np.asarray(x), np.asarray(y)
    _check_xy(x, y)
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 1 or b.shape[1] != a.shape[0] or c.shape[0] != b.shape[0]:
        raise ValueError(f"predictor shapes A {a.shape}, B {b.shape}, c {c.shape} do not form "
                         f"A [rank, n_embd], B [n_ff, rank], c [n_ff]")
    if b.shape[0] != y.shape[1]:
        raise ValueError(f"y has {y.shape[1]} neurons but the predictor scores {b.shape[0]}")
    n_true = n_pred = n_hit = 0
    step = _rows_per_chunk(b.shape[0])
    for lo in range(0, x.shape[0], step):
        pred = predictor_scores(a, b, c, x[lo:lo + step]) > 0
        true = y[lo:lo + step]
        n_true += int(np.count_nonzero(true))
        n_pred += int(np.count_nonzero(pred))
        n_hit += int(np.count_nonzero(pred & true))
    entries = max(1, y.size)
    if n_true == 0:
        recall, over = 1.0, (1.0 if n_pred == 0 else math.inf)
    else:
        recall, over = n_hit / n_true, n_pred / n_true
    precision = n_hit / n_pred if n_pred else 1.0
    return PredictorQuality(recall, precision, over, n_pred / entries, n_true / entries)


def _check_config(cfg: FitConfig, n_tokens: int, n_embd: int, n_ff: int) -> None:
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
            and math.isfinite(v)

    limit = min(n_embd, n_ff)
    if not is_int(cfg.rank) or not 1 <= cfg.rank <= limit:
        raise ValueError(f"rank must be an integer in 1..{limit} (min of n_embd {n_embd} and "
                         f"n_ff {n_ff}), got {cfg.rank!r}")
    if not is_int(cfg.epochs) or cfg.epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {cfg.epochs!r}")
    if not is_int(cfg.batch) or cfg.batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {cfg.batch!r}")
    if not is_num(cfg.lr) or cfg.lr <= 0:
        raise ValueError(f"lr must be a finite number > 0, got {cfg.lr!r}")
    if not is_num(cfg.weight_decay) or cfg.weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    if cfg.pos_weight is not None and (not is_num(cfg.pos_weight) or cfg.pos_weight <= 0):
        raise ValueError(f"pos_weight must be None or a finite number > 0, got {cfg.pos_weight!r}")
    if not is_num(cfg.target_recall) or not 0 < cfg.target_recall <= 1:
        raise ValueError(f"target_recall must be in (0, 1], got {cfg.target_recall!r}")
    if not is_num(cfg.val_fraction) or not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {cfg.val_fraction!r}")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 rows (tokens) to fit a predictor, got {n_tokens}")


def _resolve_backend(name: str) -> str:
    if name == "numpy":
        return "numpy"
    try:
        import torch  # noqa: F401
    except ImportError as e:
        if name == "torch":
            raise ImportError("backend='torch' needs PyTorch, which is not installed; "
                              "use backend='numpy' (or 'auto')") from e
        return "numpy"
    return "torch"


def _split(n_tokens: int, val_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, calibration rows), each ascending. With val_fraction 0 the training
    rows double as calibration rows."""
    n_cal = int(round(val_fraction * n_tokens)) if val_fraction > 0 else 0
    n_cal = min(max(n_cal, 1 if val_fraction > 0 else 0), n_tokens - 1)
    perm = rng.permutation(n_tokens)
    train = np.sort(perm[n_cal:])
    cal = np.sort(perm[:n_cal]) if n_cal else train
    return train, cal


def _input_stats(x: np.ndarray, y: np.ndarray, train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean of x over the training rows (float64), active count per neuron over all rows);
    rejects non-finite x."""
    n_embd = x.shape[1]
    step = _rows_per_chunk(max(n_embd, y.shape[1]))
    total = np.zeros(n_embd, np.float64)
    counts = np.zeros(y.shape[1], np.int64)
    is_train = np.zeros(x.shape[0], bool)
    is_train[train] = True
    for lo in range(0, x.shape[0], step):
        xc = np.asarray(x[lo:lo + step], np.float32)
        bad = ~np.isfinite(xc)
        if bad.any():
            row = lo + int(np.argwhere(bad)[0, 0])
            raise ValueError(f"x has a NaN or infinite value (first in row {row}); "
                             f"the predictor cannot be fitted on it")
        total += xc[is_train[lo:lo + step]].sum(0, dtype=np.float64)
        counts += np.count_nonzero(y[lo:lo + step], axis=0)
    return total / train.size, counts


def _init_rrr(x: np.ndarray, y: np.ndarray, train: np.ndarray, mu: np.ndarray, rank: int,
              pos_weight: float | None, seed: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """Standardization and the reduced-rank-regression start (module docstring, steps 1-2).

    Returns (inv_sd, A_z, B, c_z, pos_weight), A_z reading
    standardized inputs z = (x - mu) * inv_sd.
    """
    n_embd, n_ff = x.shape[1], y.shape[1]
    mu32 = mu.astype(np.float32)
    cov = np.zeros((n_embd, n_embd), np.float64)
    # Σ (x - mu)ᵀ y. mu is the mean of these same rows, so Σ (x - mu) = 0 and this is also
    # Σ (x - mu)ᵀ (y - p), the centred cross-covariance, without a second [n_embd, n_ff] array.
    cross = np.zeros((n_embd, n_ff), np.float32)
    pos = np.zeros(n_ff, np.int64)
    step = _rows_per_chunk(max(n_embd, n_ff))
    for lo in range(0, train.size, step):
        rows = train[lo:lo + step]
        xc = np.asarray(x[rows], np.float32) - mu32
        yc = y[rows]
        cov += xc.T @ xc
        cross += xc.T @ yc.astype(np.float32)
        pos += np.count_nonzero(yc, axis=0)
    n = train.size
    p = pos / n
    cov /= n
    sd = np.sqrt(np.maximum(np.diag(cov), 0.0))
    live = sd > _DEAD_STD * max(float(sd.max()), 1e-30)
    inv_sd = np.where(live, 1.0 / np.where(live, sd, 1.0), 0.0)
    corr = cov * inv_sd[:, None] * inv_sd[None, :]
    del cov
    cross_z = cross
    cross_z *= (inv_sd / n).astype(np.float32)[:, None]     # z-space, per row of data

    # Ridge regression W = K cross_z with K = (C + λI)⁻¹, and the fitted values' Gram matrix
    # Wᵀ (C + λI) W = Mᵀ M with M = Lᵀ cross_z, K = L Lᵀ: the rank-r fit keeps M's top
    # right singular vectors.
    k = np.linalg.inv(corr + _RIDGE * np.eye(n_embd))
    k = (k + k.T) / 2
    m = np.linalg.cholesky(k).T.astype(np.float32) @ cross_z
    vr = _top_right_singular(m, rank, "auto", seed)                  # [n_ff, rank]
    del m
    a_z = (k.astype(np.float32) @ (cross_z @ vr)).T                 # (W Vr)ᵀ, [rank, n_embd]
    # Unit-variance latents h = A_z z: the latents' scale is fixed, B carries the weights.
    h_sd = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", a_z, corr, a_z), 1e-30)).astype(np.float32)
    a_z = a_z / h_sd[:, None]
    b = vr * h_sd[None, :]

    density = float(pos.sum()) / max(1, pos.size * n)
    if pos_weight is None:
        ratio = (1 - density) / density if density > 0 else math.inf    # negatives per positive
        pos_weight = min(POS_WEIGHT_CAP, max(1.0, ratio))
    # The regression predicts y (0 or 1) as p + h Bᵀ with h = A_z z. Logits
    # α (prediction - 0.5) + log(pos_weight) put its 0.5-crossing where the weighted loss
    # balances, with α searched on a sample of rows (module docstring, step 2).
    c0 = p.astype(np.float32) - np.float32(0.5)
    alpha = _best_scale(x, y, train, mu32, inv_sd.astype(np.float32), a_z, b, c0,
                        pos_weight, np.random.default_rng(seed))
    b = (alpha * b).astype(np.float32)
    c = (alpha * c0 + math.log(pos_weight)).astype(np.float32)
    return inv_sd.astype(np.float32), np.ascontiguousarray(a_z, np.float32), \
        np.ascontiguousarray(b), c, float(pos_weight)


def _best_scale(x: np.ndarray, y: np.ndarray, train: np.ndarray, mu: np.ndarray,
                inv_sd: np.ndarray, a_z: np.ndarray, b: np.ndarray, c0: np.ndarray,
                pos_weight: float, rng: np.random.Generator) -> float:
    """The α in _SCALES minimizing the weighted logistic loss of α (z A_zᵀ Bᵀ + c0) +
    log(pos_weight) on a sample of training rows."""
    n_rows = min(train.size, max(512, _SCALE_ENTRIES // max(1, b.shape[0])))
    rows = np.sort(rng.choice(train, n_rows, replace=False))
    z = (np.asarray(x[rows], np.float32) - mu) * inv_sd
    pred = (z @ a_z.T) @ b.T + c0
    yr = y[rows]
    shift = np.float32(math.log(pos_weight))
    losses = []
    for alpha in _SCALES:
        losses.append(_logistic_np(np.float32(alpha) * pred + shift, yr, pos_weight, grad=False)[0])
    return float(_SCALES[int(np.argmin(losses))])


def _logistic_np(s: np.ndarray, y: np.ndarray, pos_weight: float, grad: bool = True
                 ) -> tuple[float, np.ndarray | None]:
    """(Σ weighted logistic loss, its gradient in s) for logits s and bool targets y.

    An entry costs w·softplus(±s), w = pos_weight on positives (sign −) and 1 on negatives
    (sign +); the gradient is w (σ(s) − y). Written as in-place float32 passes: with
    np.where on the bool mask and np.logaddexp it took 32 ms instead of 6 ms for a
    512 x 2048 batch, more than the batch's matrix products.
    """
    yf = y.astype(np.float32)
    w = yf * np.float32(pos_weight - 1)
    w += 1
    t = yf * np.float32(-2)
    t += 1
    t *= s                                            # s on negatives, -s on positives
    sp = np.abs(t)                                    # softplus(t) = max(t, 0) + log1p(e^-|t|)
    np.negative(sp, out=sp)
    np.exp(sp, out=sp)
    np.log1p(sp, out=sp)
    sp += np.maximum(t, 0)
    loss = float(np.vdot(w, sp))
    if not grad:
        return loss, None
    g = np.tanh(s * np.float32(0.5))                  # σ(s) = (1 + tanh(s/2)) / 2, no overflow
    g += 1
    g *= np.float32(0.5)
    g -= yf
    g *= w
    return loss, g


def _ops(backend: str) -> SimpleNamespace:
    """The few array operations the Adam phase needs, for numpy or torch."""
    if backend == "numpy":
        return SimpleNamespace(
            put=lambda a: a, get=lambda a: np.asarray(a), index=lambda idx: idx,
            f32=lambda a: a.astype(np.float32), sqrt=np.sqrt, logistic=_logistic_np,
            device="cpu")
    import torch
    import torch.nn.functional as F
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def logistic(s: Any, y: Any, pos_weight: float) -> tuple[Any, Any]:
        yf = y.float()
        w = 1 + (pos_weight - 1) * yf
        loss = (w * F.softplus(s * (1 - 2 * yf))).sum()   # stays on the device until read
        return loss, w * (torch.sigmoid(s) - yf)

    return SimpleNamespace(
        put=lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev),
        get=lambda t: t.detach().cpu().numpy(), index=lambda idx: torch.from_numpy(idx).to(dev),
        f32=lambda t: t.float(), sqrt=torch.sqrt, logistic=logistic, device=str(dev))


def _adam(x: np.ndarray, y: np.ndarray, train: np.ndarray, mu: np.ndarray, inv_sd: np.ndarray,
          a_z: np.ndarray, b: np.ndarray, c: np.ndarray, cfg: FitConfig, pos_weight: float,
          rng: np.random.Generator, backend: str
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float], str]:
    """Minibatch Adam on the class-weighted logistic loss (module docstring, step 3).

    Written once for numpy and torch arrays; the minibatch order comes from the numpy rng
    on both, so the backends walk the same path up to rounding.
    """
    ops = _ops(backend)
    xs, ys = ops.put(x), ops.put(y)
    mu_t, isd_t = ops.put(mu.astype(np.float32)), ops.put(inv_sd)
    params = [ops.put(a_z.copy()), ops.put(b.copy()), ops.put(c.copy())]
    # Each tensor steps relative to its initial RMS (see FitConfig.lr): A, B and c live on
    # scales that differ by orders of magnitude and change with n_embd, rank and the
    # chosen logit scale, so one absolute step size cannot suit them all.
    rel = [float(np.sqrt(np.mean(np.square(v, dtype=np.float64)))) or 1.0 for v in (a_z, b, c)]
    moments = [(p * 0, p * 0) for p in params]
    batch = min(cfg.batch, train.size)
    steps_per_epoch = -(-train.size // batch)
    total = max(1, cfg.epochs * steps_per_epoch)
    n_ff = b.shape[0]
    curve: list[float] = []
    t = 0
    for _ in range(cfg.epochs):
        order = rng.permutation(train)
        loss_sum = 0.0
        for lo in range(0, order.size, batch):
            idx = ops.index(np.sort(order[lo:lo + batch]))
            z = (ops.f32(xs[idx]) - mu_t) * isd_t
            yb = ys[idx]
            a_p, b_p, c_p = params
            h = z @ a_p.T
            s = h @ b_p.T + c_p
            loss, g = ops.logistic(s, yb, pos_weight)
            loss_sum = loss_sum + loss
            g *= 1.0 / z.shape[0]                    # mean over tokens, sum over neurons
            grads = [(g @ b_p).T @ z, g.T @ h, g.sum(0)]
            t += 1
            # cosine decay from lr to _LR_FLOOR·lr over the whole run
            lr = cfg.lr * (_LR_FLOOR + (1 - _LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * (t - 1) / total)))
            bc1, bc2 = 1 - _ADAM_B1 ** t, 1 - _ADAM_B2 ** t
            for i, (p, gr, (m, v)) in enumerate(zip(params, grads, moments)):
                m *= _ADAM_B1
                m += (1 - _ADAM_B1) * gr
                v *= _ADAM_B2
                v += (1 - _ADAM_B2) * (gr * gr)
                if cfg.weight_decay and i < 2:          # decoupled (AdamW); c is not decayed
                    p *= 1 - lr * cfg.weight_decay
                p -= (rel[i] * lr / bc1) * m / (ops.sqrt(v / bc2) + _ADAM_EPS)
        curve.append(float(loss_sum) / (train.size * n_ff))
    a_out, b_out, c_out = (ops.get(p).astype(np.float32) for p in params)
    return a_out, b_out, c_out, curve, ops.device


def _recall_thresholds(sorted_scores: np.ndarray, n_pos: np.ndarray, target: float) -> np.ndarray:
    """Per column, the score a new positive exceeds with probability `target`.

    sorted_scores [rows, cols] holds each column's positive scores ascending first (the
    rest +inf); n_pos (>= 2) counts them. Rank k = (1 - target)(n + 1) in the order
    statistics (a new value falls below the k-th smallest of n with probability k/(n+1)),
    linear between neighbours, extrapolated from the two smallest when k < 1.
    """
    n = n_pos.astype(np.float64)
    k = np.minimum((1 - target) * (n + 1), n)
    k0 = np.clip(np.floor(k), 1, n - 1).astype(np.int64)     # 1-based lower neighbour
    cols = np.arange(sorted_scores.shape[1])
    lo = sorted_scores[k0 - 1, cols].astype(np.float64)
    hi = sorted_scores[k0, cols].astype(np.float64)
    return lo + (k - k0) * (hi - lo)


def _latents(x: np.ndarray, rows: np.ndarray, a: np.ndarray) -> np.ndarray:
    """x[rows] @ Aᵀ, the first product of predictor_scores, in row chunks."""
    out = np.empty((rows.size, a.shape[0]), np.float32)
    step = _rows_per_chunk(x.shape[1])
    for lo in range(0, rows.size, step):
        out[lo:lo + step] = np.asarray(x[rows[lo:lo + step]], np.float32) @ a.T
    return out


def _alone_min(target: float) -> float:
    """Fewest calibration positives for a neuron's own threshold: enough that rank
    k = (1 - target)(n + 1) is >= 1, i.e. the threshold interpolates between observed
    positives instead of extrapolating below the smallest (see _calibrate)."""
    if target >= 1:
        return math.inf
    return max(MIN_POSITIVES, math.ceil(1 / (1 - target) - 1 - 1e-9))


def _pool_groups(n_pos: np.ndarray, cols: np.ndarray, need: float) -> list[np.ndarray]:
    """Split the rare neurons `cols` into groups of similar rarity (log2 bins of their
    calibration positives n_pos, rarest first), merging neighbouring bins until each group
    pools at least `need` positives; a short last group joins the one before."""
    order = cols[np.argsort(n_pos[cols], kind="stable")]
    bins = np.floor(np.log2(np.maximum(n_pos[order], 1))).astype(np.int64)
    groups: list[np.ndarray] = []
    start, total = 0, 0
    for i in range(order.size):
        total += int(n_pos[order[i]])
        last_of_bin = i + 1 == order.size or bins[i + 1] != bins[i]
        if last_of_bin and total >= need:
            groups.append(order[start:i + 1])
            start, total = i + 1, 0
    if start < order.size:
        rest = order[start:]
        groups = groups[:-1] + [np.concatenate([groups[-1], rest])] if groups else [rest]
    return groups


def _calibrate(x: np.ndarray, y: np.ndarray, train: np.ndarray, cal: np.ndarray, a: np.ndarray,
               b: np.ndarray, c: np.ndarray, counts: np.ndarray, target: float
               ) -> tuple[np.ndarray, int, int, int]:
    """Bias calibration on the calibration rows (module docstring, step 4). Returns
    (c, neurons calibrated alone, pooled, never active)."""
    n_ff = b.shape[0]
    c = c.astype(np.float64)
    h_cal = _latents(x, cal, a)
    y_cal = y[cal]
    pos_cal = np.count_nonzero(y_cal, axis=0)
    need = _alone_min(target)
    alone = pos_cal >= need
    never = counts == 0
    pooled = ~alone & ~never

    cols_per_block = max(1, _CHUNK_BYTES // (4 * max(1, cal.size)))
    for lo in range(0, n_ff, cols_per_block):
        blk = np.arange(lo, min(lo + cols_per_block, n_ff))
        blk = blk[alone[blk]]
        if blk.size == 0:
            continue
        s = h_cal @ b[blk].T + c[blk].astype(np.float32)
        s = np.where(y_cal[:, blk], s, np.float32(np.inf))
        s.sort(axis=0)
        c[blk] -= _recall_thresholds(s, pos_cal[blk], target)

    if pooled.any():
        cols = np.flatnonzero(pooled)
        rows, h, yr, n_pos = cal, h_cal, y_cal, pos_cal
        if np.count_nonzero(pos_cal[cols]) == 0 or pos_cal[cols].sum() < 2:
            # nothing to pool on the calibration rows: fall back to the training rows
            rows = train
            h, yr = _latents(x, rows, a), y[rows]
            n_pos = np.count_nonzero(yr, axis=0)
        if n_pos[cols].sum() >= 2:
            for group in _pool_groups(n_pos, cols, min(need, max(2.0, float(n_pos[cols].sum())))):
                found = []
                for lo in range(0, group.size, cols_per_block):
                    g = group[lo:lo + cols_per_block]
                    s = h @ b[g].T + c[g].astype(np.float32)
                    found.append(s[yr[:, g]])
                found_all = np.sort(np.concatenate(found))
                if found_all.size >= 2:
                    c[group] -= _recall_thresholds(found_all[:, None], np.array([found_all.size]), target)[0]

    if never.any():
        # Predicted only above the highest score seen on any row of the fit data; the small
        # margin keeps the row that attains it off despite float32 rounding differences
        # between this product and predictor_scores'.
        cols = np.flatnonzero(never)
        top = np.full(cols.size, -np.inf, np.float32)
        h_all = _latents(x, np.arange(x.shape[0]), a)
        step = _rows_per_chunk(cols.size)
        for lo in range(0, h_all.shape[0], step):
            top = np.maximum(top, (h_all[lo:lo + step] @ b[cols].T).max(0))
        top = top.astype(np.float64)
        c[cols] = np.minimum(c[cols], -(top + 1e-5 * np.abs(top) + 1e-6))
    return c.astype(np.float32), int(alone.sum()), int(pooled.sum()), int(never.sum())


def fit_predictor(x: np.ndarray, y: np.ndarray, cfg: FitConfig) -> FitResult:
    """Fit one layer's predictor on FFN inputs x [N, n_embd] (float) and active sets y
    [N, n_ff] (bool): standardize, reduced-rank-regression start, weighted-logistic Adam,
    per-neuron bias calibration on held-out rows (module docstring). The result's A, B, c
    read raw x and are float32, ready for the pack."""
    t0 = time.perf_counter()
    x, y = np.asarray(x), np.asarray(y)
    _check_xy(x, y)
    n_tokens, n_embd = x.shape
    n_ff = y.shape[1]
    _check_config(cfg, n_tokens, n_embd, n_ff)
    backend = _resolve_backend(cfg.backend)
    rng = np.random.default_rng(cfg.seed)

    train, cal = _split(n_tokens, cfg.val_fraction, rng)
    mu, counts = _input_stats(x, y, train)
    inv_sd, a_z, b, c_z, pos_weight = _init_rrr(x, y, train, mu, int(cfg.rank), cfg.pos_weight, cfg.seed)
    a_z, b, c_z, curve, device = _adam(x, y, train, mu, inv_sd, a_z, b, c_z, cfg, pos_weight, rng, backend)

    # Fold the standardization into A and c: A_z ((x - mu) * inv_sd) = A x - A mu.
    a = np.ascontiguousarray(a_z * inv_sd[None, :], np.float32)
    c = (c_z.astype(np.float64) - b.astype(np.float64) @ (a.astype(np.float64) @ mu)).astype(np.float32)
    c, n_alone, n_pooled, n_never = _calibrate(x, y, train, cal, a, b, c, counts, float(cfg.target_recall))
    quality = evaluate_predictor(a, b, c, x, y)
    return FitResult(a, np.ascontiguousarray(b, np.float32), c, curve, quality,
                     time.perf_counter() - t0, backend, pos_weight, int(train.size),
                     int(cal.size) if cfg.val_fraction > 0 else 0, n_alone, n_pooled, n_never,
                     {"device": device})
