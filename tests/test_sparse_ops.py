"""The kairox ggml ops on the CPU backend against numpy references.

Every op runs through ggml's own graph executor (tests/ggml_ops.py) with 1-4 threads,
both fast (AVX2/AVX-512 + ggml vec_dot) and reference (cplan.use_ref) kernels.
References: numpy in float64 on weights dequantized by gguf.quants (not by ggml).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggml_ops import GGML

THREADS = (1, 2, 3)


@pytest.fixture(scope="module")
def g(native: Path) -> GGML:  # native: skips without a build
    return GGML()


def dequant(raw: bytes, type_name: str, n: int, k: int) -> np.ndarray:
    if type_name == "f32":
        return np.frombuffer(raw, dtype=np.float32).reshape(n, k).astype(np.float64)
    q = gguf.GGMLQuantizationType[type_name.upper()]
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(n, -1)
    return np.asarray(gguf.quants.dequantize(rows, q), dtype=np.float64).reshape(n, k)


def ref_select(scores: np.ndarray, thr: float, max_density: float, act: str) -> np.ndarray:
    s = scores.astype(np.float64)
    if act == "score":
        on = s > thr
    else:
        a = {"relu": np.maximum(s, 0),
             "silu": s / (1 + np.exp(-s)),
             "gelu": 0.5 * s * (1 + np.tanh(math.sqrt(2 / math.pi) * (s + 0.044715 * s ** 3)))}[act]
        on = np.abs(a) > thr
    ids = np.flatnonzero(on.any(axis=0))
    if len(ids) > max_density * scores.shape[1]:
        ids = np.arange(scores.shape[1])
    return ids


# ------------------------------------------------------------------------ kx_select


@pytest.mark.parametrize("act", ["score", "relu", "silu", "gelu"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("use_ref", [False, True])
def test_select_matches_numpy(g: GGML, act: str, T: int, use_ref: bool):
    rng = np.random.default_rng(1)
    n = 1037  # not a multiple of the 8/16-lane vectors
    scores = (rng.standard_normal((T, n)) - 1.2).astype(np.float32)
    for thr in (0.0, 0.05, 0.7):
        out = g.select(scores, thr, 1.0, act, use_ref=use_ref)
        want = ref_select(scores, thr, 1.0, act)
        assert out[0] == len(want)
        np.testing.assert_array_equal(out[1:1 + out[0]], want)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("use_ref", [False, True])
def test_select_split_applies_each_sides_threshold(g: GGML, T: int, use_ref: bool):
    """ggml_kx_select_split: resident neurons (rowmap >= 0) against threshold + off[0], the
    others against threshold + off[1]; off = (0, 0) is the plain select's list."""
    rng = np.random.default_rng(2)
    n = 1037
    scores = (rng.standard_normal((T, n)) - 0.8).astype(np.float32)
    rowmap = np.where(rng.random(n) < 0.4, np.arange(n), -1).astype(np.int32)
    for thr, off in ((0.0, (0.0, 0.0)), (0.0, (-0.5, 0.7)), (0.3, (0.2, -0.4)), (0.0, (-9.0, 9.0))):
        out = g.select_split(scores, thr, 1.0, rowmap, off, use_ref=use_ref)
        t = np.where(rowmap >= 0, thr + np.float32(off[0]), thr + np.float32(off[1])).astype(np.float32)
        want = np.flatnonzero((scores > t).any(axis=0))
        assert out[0] == len(want), (thr, off)
        np.testing.assert_array_equal(out[1:1 + out[0]], want)
        if off == (0.0, 0.0):  # the count and the list; the tensor's entries past them are unspecified
            plain = g.select(scores, thr, 1.0, "score", use_ref=use_ref)
            np.testing.assert_array_equal(out[:1 + out[0]], plain[:1 + plain[0]])
    # the list also to host memory (the host-cache warm-up's copy): list, then the flag
    buf = np.zeros(n + 2 + 4, np.int32)
    host = buf[(-buf.ctypes.data % 16) // 4:][:n + 2]
    out = g.select_split(scores, 0.0, 1.0, rowmap, (-0.5, 0.7), use_ref=use_ref, host=host)
    assert host[0] == 1
    np.testing.assert_array_equal(host[1:2 + out[0]], out[:1 + out[0]])


def test_select_empty_full_and_density_fallback(g: GGML):
    n = 300
    neg = np.full((1, n), -1.0, np.float32)
    assert g.select(neg, 0.0, 1.0, "relu")[0] == 0
    pos = np.ones((2, n), np.float32)
    out = g.select(pos, 0.0, 1.0, "score")
    assert out[0] == n and np.array_equal(out[1:], np.arange(n))
    # 40% active with max density 0.25: everything is listed, in order
    rng = np.random.default_rng(2)
    s = np.where(rng.random((1, n)) < 0.4, 1.0, -1.0).astype(np.float32)
    g.select_stats(reset=True)
    out = g.select(s, 0.0, 0.25, "score")
    assert out[0] == n and np.array_equal(out[1:], np.arange(n))
    sel, total, calls, fallbacks = g.select_stats(reset=True)
    assert (sel, total, calls, fallbacks) == (n, n, 1, 1)
    # under the density limit the union is kept
    out = g.select(s, 0.0, 0.5, "score")
    assert out[0] == int((s > 0).sum())
    assert g.select_stats()[3] == 0


def _aligned_i32(n: int) -> np.ndarray:
    raw = np.zeros(n + 16, np.int32)
    off = (-raw.ctypes.data % 16) // 4
    return raw[off:off + n]


@pytest.mark.parametrize("density", [1.0, 0.25])
def test_select_to_host_copies_the_list_then_the_flag(g: GGML, density: float):
    """ggml_kx_select_to_host: host = [1, count, ids...] equal to the result (the layer
    before's prediction for the warm-up, kx-warm.cpp); the words after the list untouched."""
    rng = np.random.default_rng(3)
    n = 517
    s = (rng.standard_normal((1, n)) - 0.3).astype(np.float32)
    host = _aligned_i32(n + 2)
    host[:] = -7
    out = g.select(s, 0.0, density, "score", host=host)
    count = int(out[0])
    want = ref_select(s, 0.0, 1.0, "score")
    if len(want) > density * n:
        want = np.arange(n)  # the density fallback lists every neuron, and so does the copy
    assert count == len(want) and host[0] == 1 and host[1] == count
    np.testing.assert_array_equal(host[2:2 + count], want)
    assert (host[2 + count:] == -7).all()
    host[0] = 0  # the reader's reset; the next select sets it again
    g.select(s, 0.0, density, "score", host=host)
    assert host[0] == 1


# ------------------------------------------------------------------ kx_mul_mat_rows

# (type, k): K-quants need k % 256 == 0, the others k % 32
MM_TYPES = [("f32", 96), ("f16", 96), ("bf16", 96), ("q8_0", 128), ("q4_0", 128), ("q5_0", 640), ("q4_k", 256), ("q6_k", 256)]
# the fast path converts x to the weight's vec_dot type (F16, BF16, Q8_0, Q8_K): its error
# relative to sum|w||x| is about that type's rounding
FAST_RTOL = {"f32": 1e-6, "f16": 2e-3, "bf16": 1e-2, "q8_0": 1e-2, "q4_0": 1e-2, "q5_0": 1e-2, "q4_k": 1e-2, "q6_k": 1e-2}


def selections(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"empty": np.array([], dtype=np.int32),
            "one": np.array([n - 1], dtype=np.int32),
            "sparse": np.sort(rng.choice(n, size=n // 9, replace=False)).astype(np.int32),
            "full": np.arange(n, dtype=np.int32)}


@pytest.mark.parametrize("wtype,k", MM_TYPES, ids=[t for t, _ in MM_TYPES])
@pytest.mark.parametrize("T", [1, 4])
def test_mul_mat_rows(g: GGML, wtype: str, k: int, T: int):
    rng = np.random.default_rng(3)
    n = 200
    w_raw = g.quantize(rng.standard_normal((n, k)).astype(np.float32), wtype)
    w = dequant(w_raw, wtype, n, k)
    x = rng.standard_normal((T, k)).astype(np.float32)
    dense = x.astype(np.float64) @ w.T                 # [T, n]
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # error scale per entry
    for name, sel in selections(n, rng).items():
        off = np.setdiff1d(np.arange(n), sel)
        for nt in THREADS:
            for use_ref in (False, True):
                out = g.mul_mat_rows(w_raw, wtype, n, k, x, sel, n_threads=nt, use_ref=use_ref)
                assert np.all(out[:, off] == 0), f"{name}: rows outside the selection must be 0"
                err = np.abs(out[:, sel] - dense[:, sel]) / np.maximum(scale[:, sel], 1e-30)
                tol = 1e-6 if use_ref else FAST_RTOL[wtype]
                assert err.size == 0 or err.max() <= tol, (name, nt, use_ref, float(err.max()))


@pytest.mark.parametrize("T", [1, 3])
def test_mul_mat_rows_without_a_list_is_the_matvec(g: GGML, T: int):
    """No list (the predictor's B on the device): every neuron, through the row map where
    one is given (neurons it sends to -1 read 0), gated rows skipped as with a list (and the
    others times relu(gate))."""
    rng = np.random.default_rng(11)
    n, k = 300, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((T, k)).astype(np.float32)
    dense = (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
    rowmap = np.full(n, -1, dtype=np.int32)
    held = np.sort(rng.choice(n, 100, replace=False))
    rowmap[held] = np.arange(100, dtype=np.int32)
    gate = rng.standard_normal((T, n)).astype(np.float32)
    fires = np.any(gate > 0, axis=0)
    for nt in THREADS:
        for use_ref in (False, True):
            got = g.mul_mat_rows(g.quantize(w, "f32"), "f32", n, k, x, None, n_threads=nt, use_ref=use_ref)
            np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4)
            got = g.mul_mat_rows(g.quantize(w[held], "f32"), "f32", n, k, x, None, rowmap=rowmap, n_threads=nt,
                                 use_ref=use_ref)
            np.testing.assert_allclose(got[:, held], dense[:, held], rtol=1e-4, atol=1e-4)
            assert np.all(got[:, rowmap < 0] == 0)
            got = g.mul_mat_rows(g.quantize(w, "f32"), "f32", n, k, x, None, gate=gate, n_threads=nt,
                                 use_ref=use_ref)
            glu = np.where(gate > 0, gate * dense, np.float32(0))  # the gated op gives relu(g) * u
            np.testing.assert_allclose(got[:, fires], glu[:, fires], rtol=1e-4, atol=1e-4)
            assert np.all(got[:, ~fires] == 0)


@pytest.mark.parametrize("wtype,k", [("f32", 256), ("f16", 256), ("q8_0", 256)], ids=["f32", "f16", "q8_0"])
@pytest.mark.parametrize("T", [1, 3])
def test_mul_mat_rows_with_a_bias_is_the_matvec_plus_the_bias(g: GGML, wtype: str, k: int, T: int):
    """ggml_kx_mul_mat_rows_bias (the predictor's B·t + c in one op): every row's w·x with
    b[i] added for each token, the same bits as the matvec followed by the add."""
    rng = np.random.default_rng(5)
    n = 301
    w_raw = g.quantize(rng.standard_normal((n, k)).astype(np.float32), wtype)
    x = rng.standard_normal((T, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for nt in THREADS:
        for use_ref in (False, True):
            plain = g.mul_mat_rows(w_raw, wtype, n, k, x, None, n_threads=nt, use_ref=use_ref)
            got = g.mul_mat_rows(w_raw, wtype, n, k, x, None, n_threads=nt, use_ref=use_ref, bias=b)
            np.testing.assert_array_equal(got, plain + b[None, :])


@pytest.mark.parametrize("T", [1, 3])
def test_mul_mat_rows_gated_skips_rows_whose_gate_never_fires(g: GGML, T: int):
    """The gated op (ReLU up rows and their GLU): a listed neuron whose gate is <= 0 for every
    token reads 0 (its row, NaN here, is never touched); the others read relu(g) times what the
    ungated op reads, bit for bit what ggml's reglu gives after it."""
    rng = np.random.default_rng(7)
    n, k = 300, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    gate = rng.standard_normal((T, n)).astype(np.float32)
    off = np.all(gate <= 0, axis=0)
    w[off] = np.nan
    w_raw = g.quantize(w, "f32")
    x = rng.standard_normal((T, k)).astype(np.float32)
    sel = np.sort(rng.choice(n, 120, replace=False)).astype(np.int32)
    for nt in THREADS:
        got = g.mul_mat_rows(w_raw, "f32", n, k, x, sel, n_threads=nt, gate=gate)
        plain = g.mul_mat_rows(np.where(off[:, None], 0, w).astype(np.float32).tobytes(), "f32", n, k, x, sel,
                               n_threads=nt)
        assert not np.isnan(got).any()
        assert np.all(got[:, off] == 0) and off[sel].any() and (~off[sel]).any()
        np.testing.assert_array_equal(got, np.where(gate > 0, gate * plain, np.float32(0)))
        assert (got[:, sel] != plain[:, sel]).any()  # the product, not the up value


# --------------------------------------------------------------------- kx_axpy_rows


@pytest.mark.parametrize("wtype,m", [("f32", 100), ("f32", 1024), ("f16", 100), ("f16", 1056),
                                     ("q8_0", 96), ("q8_0", 2048), ("q4_k", 256), ("q4_k", 2048),
                                     ("q6_k", 512), ("q6_k", 4096)])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("permuted", [False, True])
def test_axpy_rows(g: GGML, wtype: str, m: int, T: int, permuted: bool):
    rng = np.random.default_rng(4)
    n = 150
    wt_raw = g.quantize(rng.standard_normal((n, m)).astype(np.float32), wtype)
    wt = dequant(wt_raw, wtype, n, m)
    rowmap = rng.permutation(n).astype(np.int32) if permuted else None
    rows = wt[rowmap] if permuted else wt            # rows[i] = the row neuron i uses
    for name, sel in selections(n, rng).items():
        h = np.zeros((T, n), np.float32)
        h[:, sel] = rng.standard_normal((T, len(sel)))
        h[0, sel[::3]] = 0.0                          # zeros inside the selection are skipped
        # values outside the selection must be ignored, even if nonzero
        outside = np.setdiff1d(np.arange(n), sel)
        h_in = h.copy()
        h_in[:, outside] = 1e6
        want = h.astype(np.float64) @ rows            # [T, m]
        scale = np.abs(h).astype(np.float64) @ np.abs(rows)
        for nt in THREADS:
            for use_ref in (False, True):
                out = g.axpy_rows(wt_raw, wtype, n, m, h_in, sel, rowmap, n_threads=nt, use_ref=use_ref)
                err = np.abs(out - want) / np.maximum(scale, 1e-30)
                assert err.max() <= 1e-5, (name, nt, use_ref, float(err.max()))


@pytest.mark.parametrize("wtype", ["q4_k", "q6_k"])
@pytest.mark.parametrize("use_ref", [False, True])
def test_axpy_rows_k_quants_read_ggml_values(g: GGML, wtype: str, use_ref: bool):
    """A K-quant down row read by the axpy kernel is ggml's own dequantization of it, bit for
    bit: with one listed neuron at h = 1 the output is the row itself. Scales from large to
    tiny blocks (the 6-bit scales and mins of every sub-block, both nibbles, every quarter)."""
    rng = np.random.default_rng(12)
    n, m = 8, 1024
    w = (rng.standard_normal((n, m)) * np.exp(rng.uniform(-6, 3, (n, 1)))).astype(np.float32)
    w[3, :300] += 5.0  # a block with a large min (Q4_K's dmin)
    raw = g.quantize(w, wtype)
    want = dequant(raw, wtype, n, m).astype(np.float32)
    for r in (0, 3, 7):
        h = np.zeros((1, n), np.float32)
        h[0, r] = 1.0
        out = g.axpy_rows(raw, wtype, n, m, h, np.array([r], np.int32), n_threads=3, use_ref=use_ref)
        np.testing.assert_array_equal(out[0], want[r])


def slot_map(n: int, n_slots: int, rng: np.random.Generator) -> np.ndarray:
    """A GPU-slot style row map: n_slots random neurons in random slots, the rest -1."""
    rowmap = np.full(n, -1, np.int32)
    rowmap[rng.choice(n, size=n_slots, replace=False)] = rng.permutation(n_slots)
    return rowmap


@pytest.mark.parametrize("wtype,k", [("f16", 256), ("q4_0", 256), ("q8_0", 256)])
def test_mul_mat_rows_slot_map(g: GGML, wtype: str, k: int):
    """Through a row map, w holds only some neurons (in any order); listed neurons that
    are missing (-1) stay 0, so a slot buffer and its complement split one list exactly."""
    rng = np.random.default_rng(7)
    n, n_slots, T = 120, 50, 2
    full = rng.standard_normal((n, k)).astype(np.float32)
    rowmap = slot_map(n, n_slots, rng)
    slots = np.zeros((n_slots, k), np.float32)
    slots[rowmap[rowmap >= 0]] = full[rowmap >= 0]
    cold = np.where(rowmap < 0, np.arange(n), -1).astype(np.int32)   # the host side's map
    x = rng.standard_normal((T, k)).astype(np.float32)
    sel = np.sort(rng.choice(n, size=40, replace=False)).astype(np.int32)
    full_raw, slots_raw = g.quantize(full, wtype), g.quantize(slots, wtype)
    whole = g.mul_mat_rows(full_raw, wtype, n, k, x, sel, n_threads=2)
    hot = g.mul_mat_rows(slots_raw, wtype, n, k, x, sel, rowmap=rowmap, n_threads=2)
    rest = g.mul_mat_rows(full_raw, wtype, n, k, x, sel, rowmap=cold, n_threads=2)
    assert np.all(hot[:, rowmap < 0] == 0) and np.all(rest[:, rowmap >= 0] == 0)
    np.testing.assert_array_equal(hot + rest, whole)   # same rows, same kernel: bit-exact


def test_axpy_rows_slot_map(g: GGML):
    rng = np.random.default_rng(8)
    n, n_slots, m, T = 120, 50, 256, 2
    full = rng.standard_normal((n, m)).astype(np.float32)
    rowmap = slot_map(n, n_slots, rng)
    slots = np.zeros((n_slots, m), np.float32)
    slots[rowmap[rowmap >= 0]] = full[rowmap >= 0]
    sel = np.sort(rng.choice(n, size=60, replace=False)).astype(np.int32)
    h = np.zeros((T, n), np.float32)
    h[:, sel] = rng.standard_normal((T, len(sel)))
    raw_full, raw_slots = g.quantize(full, "f16"), g.quantize(slots, "f16")
    whole = dequant(raw_full, "f16", n, m)
    hot = g.axpy_rows(raw_slots, "f16", n_slots, m, h, sel, rowmap, n_threads=2)
    want_hot = h[:, rowmap >= 0].astype(np.float64) @ whole[rowmap >= 0]
    np.testing.assert_allclose(hot, want_hot, rtol=1e-5, atol=1e-4)
    cold = np.where(rowmap < 0, np.arange(n), -1).astype(np.int32)
    rest = g.axpy_rows(raw_full, "f16", n, m, h, sel, cold, n_threads=2)
    np.testing.assert_allclose(hot + rest, h.astype(np.float64) @ whole, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------- kx_ffn_rows

def ref_act(g: np.ndarray, act: str) -> np.ndarray:
    return {"relu": np.maximum(g, 0),
            "silu": g / (1 + np.exp(-g)),
            "gelu": 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))}[act]


@pytest.mark.parametrize("wtype,dtype,k,m", [("f16", "f16", 256, 160), ("q4_0", "q8_0", 256, 96),
                                             ("f32", "f32", 96, 100), ("q8_0", "f16", 128, 64),
                                             ("q4_k", "q8_0", 512, 96), ("q6_k", "f16", 256, 100),
                                             ("q4_k", "q4_k", 256, 512), ("q4_k", "q6_k", 256, 256)])
@pytest.mark.parametrize("act", ["relu", "silu", "gelu"])
@pytest.mark.parametrize("T", [1, 3])
def test_ffn_rows_equals_the_four_ops(g: GGML, wtype: str, dtype: str, k: int, m: int, act: str, T: int):
    """The fused op against the composition it replaces (gate rows, up rows, ggml's GLU, axpy
    rows) on the same weights: the same dot kernels and activation, only the order of the
    final sums differs, so they agree to float32 rounding of the output; and against numpy in
    float64 within the weight type's rounding. Host-side maps of a hybrid layer (resident
    neurons at -1, down rows permuted), every thread count up to more threads than neurons."""
    rng = np.random.default_rng(11)
    n = 90
    gate = rng.standard_normal((n, k)).astype(np.float32) / math.sqrt(k)
    up = rng.standard_normal((n, k)).astype(np.float32) / math.sqrt(k)
    down = rng.standard_normal((n, m)).astype(np.float32)
    graw, uraw, draw = g.quantize(gate, wtype), g.quantize(up, wtype), g.quantize(down, dtype)
    gq, uq, dq = dequant(graw, wtype, n, k), dequant(uraw, wtype, n, k), dequant(draw, dtype, n, m)
    x = rng.standard_normal((T, k)).astype(np.float32)
    perm = rng.permutation(n).astype(np.int32)
    down_perm = g.quantize(down[np.argsort(perm)], dtype)   # neuron i's down row at row perm[i]
    resident = rng.random(n) < 0.4
    coldmap = np.where(resident, -1, np.arange(n)).astype(np.int32)
    colddown = np.where(resident, -1, perm).astype(np.int32)
    for name, sel in selections(n, rng).items():
        present = sel[~resident[sel]] if len(sel) else sel
        gv = x.astype(np.float64) @ gq.T
        h = ref_act(gv, act) * (x.astype(np.float64) @ uq.T)
        want = h[:, present] @ dq[present]
        scale = (np.abs(h[:, present]) @ np.abs(dq[present])
                 + (np.abs(x) @ (np.abs(gq) + np.abs(uq)).T)[:, present] @ np.abs(dq[present]))
        for nt in (1, 2, 3, 7, 64):
            for use_ref in (False, True):
                kw = dict(act=act, n_threads=nt, use_ref=use_ref)
                split = g.ffn_rows(graw, uraw, wtype, n, k, down_perm, dtype, n, m, x, sel, n,
                                   rowmap=coldmap, downmap=colddown, split=True, **kw)
                fused = g.ffn_rows(graw, uraw, wtype, n, k, down_perm, dtype, n, m, x, sel, n,
                                   rowmap=coldmap, downmap=colddown, **kw)
                again = g.ffn_rows(graw, uraw, wtype, n, k, down_perm, dtype, n, m, x, sel, n,
                                   rowmap=coldmap, downmap=colddown, **kw)
                np.testing.assert_array_equal(fused, again)   # deterministic for a thread count
                ymax = max(float(np.abs(split).max()), 1e-30)
                assert float(np.abs(fused - split).max()) <= 2e-5 * ymax + 1e-6, (name, nt, use_ref)
                if act == "gelu":
                    tol = 4e-2       # ggml's GELU reads an F16 table
                elif wtype == "f32" and dtype == "f32" and use_ref:
                    tol = 1e-5
                else:
                    tol = 2e-2       # x rounded to the weight's vec_dot type
                err = np.abs(fused - want) / np.maximum(scale, 1e-30)
                assert err.size == 0 or err.max() <= tol, (name, nt, use_ref, float(err.max()))


def test_ffn_rows_relu_reads_up_rows_only_of_firing_neurons(g: GGML):
    """ReLU: a neuron whose gate is <= 0 for every token adds exactly 0, so the fused op does
    not read its up row (counted: up_skipped). Up rows of NaN for exactly those neurons leave
    the output equal to the dense result without them (computed gate and given gate); a
    neuron that fires for one token of two still reads its row. SiLU never gives 0: the same
    weights give NaN there and no row is skipped."""
    rng = np.random.default_rng(13)
    n, k, m, T = 48, 64, 32, 2
    x = rng.uniform(0.5, 1.5, (T, k)).astype(np.float32)           # all positive
    sign = np.where(np.arange(n) % 3 == 0, 1.0, -1.0)                # every third neuron fires
    gate = (rng.uniform(0.5, 1.5, (n, k)) * sign[:, None] / k).astype(np.float32)
    half = 7                                                        # fires for token 1 only
    gate[half] = 0
    gate[half, :k // 2] = 1.0 / k
    x[0, :k // 2] = 0
    up = rng.standard_normal((n, k)).astype(np.float32)
    down = rng.standard_normal((n, m)).astype(np.float32)
    gv = x.astype(np.float64) @ gate.T.astype(np.float64)
    silent = (gv <= 0).all(axis=0)
    assert silent.sum() > n // 2 and not silent[half] and gv[0, half] == 0
    up_nan = up.copy()
    up_nan[silent] = np.nan
    graw, uraw, draw = g.quantize(gate, "f32"), g.quantize(up_nan, "f32"), g.quantize(down, "f32")
    sel = np.arange(n, dtype=np.int32)
    h = np.maximum(gv, 0) * (x.astype(np.float64) @ np.where(silent[:, None], 0, up).T)
    want = h @ down.astype(np.float64)
    from kairox._native import sparse_counters
    sparse_counters(reset=True)
    for gate_pre in (None, gv.astype(np.float32)):
        for nt in (1, 4):
            out = g.ffn_rows(graw, uraw, "f32", n, k, draw, "f32", n, m, x, sel, n, act="relu",
                             gate_pre=gate_pre, n_threads=nt)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
            assert sparse_counters(reset=True).up_skipped == int(silent.sum())
    out = g.ffn_rows(graw, uraw, "f32", n, k, draw, "f32", n, m, x, sel, n, act="silu", n_threads=2)
    assert np.isnan(out).all() and sparse_counters(reset=True).up_skipped == 0


@dataclasses.dataclass
class ReluRows:
    rows_max: int    # weight rows the busiest thread read
    rows_mean: int   # ... the mean thread
    err: float       # the output's largest error against numpy
    miss: int        # the nonzero counter's miss (counted minus true nonzero activations)
    stolen: int      # chunks a thread took from another's share (own shares)
    digest: str      # the output's bytes, hashed: equal digests are equal bits


def hot_first_relu_rows(g: GGML, n_threads: int, sel: np.ndarray | None = None, own_shares: bool = False) -> ReluRows:
    """The ReLU op over a list in hotness order (the first quarter fires, the rest does not),
    with n_threads. sel: the list (default: all 64); own_shares: each thread starts on its own
    chunks (ggml_kx_ffn_rows_own_shares)."""
    rng = np.random.default_rng(17)
    n, k, m = 64, 64, 32
    x = rng.uniform(0.5, 1.5, (1, k)).astype(np.float32)
    sign = np.where(np.arange(n) < n // 4, 1.0, -1.0)
    gate = (rng.uniform(0.5, 1.5, (n, k)) * sign[:, None] / k).astype(np.float32)
    up = rng.standard_normal((n, k)).astype(np.float32)
    down = rng.standard_normal((n, m)).astype(np.float32)
    gv = x.astype(np.float64) @ gate.T.astype(np.float64)
    sel = np.arange(n, dtype=np.int32) if sel is None else np.asarray(sel, np.int32)
    h = np.maximum(gv, 0) * (x.astype(np.float64) @ up.T.astype(np.float64))
    want = h[:, sel] @ down[sel].astype(np.float64)
    from kairox._native import sparse_counters
    sparse_counters(reset=True)
    out = g.ffn_rows(g.quantize(gate, "f32"), g.quantize(up, "f32"), "f32", n, k, g.quantize(down, "f32"), "f32",
                     n, m, x, sel, n, act="relu", n_threads=n_threads, own_shares=own_shares)
    c = sparse_counters(reset=True)
    nonzero = int((h[:, sel] != 0).sum())
    return ReluRows(c.ffn_rows_max, c.ffn_rows_mean, float(np.abs(out - want).max()), c.nonzero - nonzero,
                    c.ffn_stolen, hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest())


def test_ffn_rows_relu_splits_rows_not_neurons(g: GGML):
    """ReLU runs in two passes (gates over the listed neurons, then up and down rows over those
    that fired), each in 4 chunks per thread. On a hot-first list (64 neurons, 16 fire: 96
    rows) with 4 threads on their own shares (as after the warm-up), a run in which no thread
    took another's chunk gives every thread 16 gate + 4 up + 4 down rows (with fewer free cores
    than threads every run may steal); an even split of the neurons would give the first thread
    all 16 firing neurons, 48 rows against a mean of 24.
    By default a free thread takes the next chunk, so the rows follow each thread's speed: the
    total is the same and so is the output."""
    runs = [hot_first_relu_rows(g, 4, own_shares=True) for _ in range(20)]
    for r in runs:
        assert r.rows_mean == 24 and r.miss == 0 and r.err < 1e-4, r
        assert r.rows_max == 24 or r.stolen > 0, r
    # uneven splits, more threads than firing neurons, more threads than listed neurons (80:
    # a thread may compute no gate and still take fired neurons, and count them)
    for nt in (1, 3, 4, 7, 16, 80):
        r = hot_first_relu_rows(g, nt)
        assert r.err < 1e-4 and r.miss == 0 and r.rows_mean == 96 // nt and r.rows_max >= r.rows_mean, (nt, r)
        assert r.stolen == 0  # shared chunks: nothing is anyone's own
    # 6 listed, 4 fire, 16 threads
    r = hot_first_relu_rows(g, 16, sel=np.r_[0:4, 40:42])
    assert r.err < 1e-4 and r.miss == 0, r


def test_ffn_rows_own_shares_steal_and_keep_the_bits(g: GGML):
    """Own shares (ggml_kx_ffn_rows_own_shares, as after the warm-up): a thread whose share is
    done takes another's chunks from the back. Over 80 threads (64 of them own no pass-b chunk)
    chunks are stolen, every chunk is still computed exactly once (the error, the rows read,
    the nonzero count) and the output has the same bits as with chunks taken from the shared
    counter (the same chunks, each into its own accumulator), run after run."""
    for nt in (4, 80):
        shared = hot_first_relu_rows(g, nt)
        runs = [hot_first_relu_rows(g, nt, own_shares=True) for _ in range(20)]
        for r in runs:
            assert r.err < 1e-4 and r.miss == 0 and r.rows_mean == 96 // nt, (nt, r)
            assert r.digest == shared.digest, (nt, r)
        if nt == 80:
            assert sum(r.stolen for r in runs) > 0, runs


def rows4_outputs(g: GGML, n_threads: int, wtype: str = "q4_0", dtype: str = "q8_0", act: str = "relu",
                  tokens: int = 1) -> np.ndarray:
    """The fused op (act: ReLU's two passes, or SiLU/GELU's one) on wtype gate/up and dtype
    down rows over lists of 1-90 neurons (every remainder of groups of four), stacked: [list,
    token, m]. Every token is the same x (tokens > 1: the op goes row by row). F16 rows are 296
    wide (past ggml's 64-wide steps: its double-precision tail), F16 down rows 101 (past the
    16-wide vectors), K-quant down rows two super-blocks."""
    rng = np.random.default_rng(29)
    n = 90
    k = {"q4_0": 256, "q4_k": 512, "q5_k": 512, "q6_k": 512}.get(wtype, 296)
    m = rows4_width(dtype)
    gate, up = (rng.standard_normal((2, n, k)) / math.sqrt(k)).astype(np.float32)
    down = rng.standard_normal((n, m)).astype(np.float32)
    x = np.repeat(rng.standard_normal((1, k)).astype(np.float32), tokens, axis=0)
    graw, uraw, draw = g.quantize(gate, wtype), g.quantize(up, wtype), g.quantize(down, dtype)
    outs = []
    for size in (1, 2, 3, 5, 6, 7, 33, 90):
        sel = np.sort(rng.choice(n, size, replace=False)).astype(np.int32)
        outs.append(g.ffn_rows(graw, uraw, wtype, n, k, draw, dtype, n, m, x, sel, n, act=act,
                               n_threads=n_threads))
    return np.stack(outs)


def rows4_width(dtype: str) -> int:
    return {"q8_0": 96, "q4_k": 512, "q6_k": 512}.get(dtype, 101)


@pytest.mark.parametrize("act", ["relu", "silu", "gelu"])
@pytest.mark.parametrize("wtype,dtype", [("q4_0", "q8_0"), ("f16", "f16"), ("q4_k", "q8_0"), ("q6_k", "f16"),
                                         ("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q5_k", "q8_0")])
def test_ffn_rows_four_rows_at_once_are_ggml_bit_for_bit(g: GGML, wtype: str, dtype: str, act: str):
    """Gate and up rows four at a time (kx-dot.h: Q4_0, Q4_K, Q5_K, Q6_K, F16; ReLU in pass a and at pass b's
    flush, SiLU/GELU both at the block's flush) and down rows four at a time (kx_axpy_rows:
    Q8_0, F16, Q4_K, Q6_K: a Q4_K_M model's pack), which one token takes, give the very bits of
    ggml's vec_dot and the row-by-row axpy, which several tokens take: one token against the
    same token twice, at every group remainder and thread count."""
    m = rows4_width(dtype)
    for t in (1, 3, 8):
        one = rows4_outputs(g, t, wtype, dtype, act)
        two = rows4_outputs(g, t, wtype, dtype, act, tokens=2)
        assert one.shape == (8, 1, m) and two.shape == (8, 2, m) and np.abs(one).max() > 0
        for tok in range(2):
            np.testing.assert_array_equal(one[:, 0], two[:, tok], err_msg=f"threads {t}, token {tok}")


def test_ffn_rows_exact_gate_and_counters(g: GGML):
    """With the gate given (the exact path computed every gate), only up and down rows are
    read: a gate weight of garbage changes nothing. The axpy counters count the fused op's
    rows, the listed neurons it skipped (resident elsewhere) and its nonzero activations."""
    rng = np.random.default_rng(12)
    n, k, m, T = 70, 64, 32, 2
    up = rng.standard_normal((n, k)).astype(np.float32)
    down = rng.standard_normal((n, m)).astype(np.float32)
    gate_pre = rng.standard_normal((T, n)).astype(np.float32)
    uraw, draw = g.quantize(up, "f32"), g.quantize(down, "f32")
    junk = g.quantize(np.full((n, k), np.nan, np.float32), "f32")
    x = rng.standard_normal((T, k)).astype(np.float32)
    sel = np.sort(rng.choice(n, 40, replace=False)).astype(np.int32)
    coldmap = np.where(np.arange(n) % 4 == 0, -1, np.arange(n)).astype(np.int32)
    present = sel[coldmap[sel] >= 0]
    h = np.maximum(gate_pre.astype(np.float64), 0) * (x.astype(np.float64) @ up.T.astype(np.float64))
    want = h[:, present] @ down[present].astype(np.float64)
    g.select_stats(reset=True)
    out = g.ffn_rows(junk, uraw, "f32", n, k, draw, "f32", n, m, x, sel, n, act="relu",
                     rowmap=coldmap, downmap=coldmap, gate_pre=gate_pre, n_threads=3)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    from kairox._native import sparse_counters
    c = sparse_counters(reset=True)
    assert c.rows == len(present) and c.elsewhere == len(sel) - len(present)
    assert c.nonzero == int((h[:, present] != 0).sum())
    # one call, its time: the op's span holds its slowest thread's loop, which holds the mean
    assert c.ffn_calls == 1 and c.ffn_op_ns >= c.ffn_work_max_ns >= c.ffn_work_mean_ns > 0


@pytest.mark.parametrize("act,threads", [("relu", 1), ("relu", 2), ("silu", 1), ("silu", 2)])
def test_ffn_rows_phases_cover_the_op(g: GGML, act: str, threads: int):
    """The op's phase counters (kx_cpu_ffn_phases) split its span: on one thread they add up to
    it; on several the mean thread's phases stay within it and the threads' entry spread (a
    sum over threads instead of their mean would not).
    Two passes (ReLU) time both; one pass (SiLU) has no second barrier and no pass b."""
    from kairox._native import ffn_phase_counters, sparse_counters
    rng = np.random.default_rng(31)
    n, k, m = 512, 256, 128
    graw = g.quantize(rng.standard_normal((n, k)).astype(np.float32), "f32")
    uraw = g.quantize(rng.standard_normal((n, k)).astype(np.float32), "f32")
    draw = g.quantize(rng.standard_normal((n, m)).astype(np.float32), "f32")
    x = rng.standard_normal((1, k)).astype(np.float32)
    sel = np.sort(rng.choice(n, 300, replace=False)).astype(np.int32)
    sparse_counters(reset=True)
    ffn_phase_counters(reset=True)
    g.ffn_rows(graw, uraw, "f32", n, k, draw, "f32", n, m, x, sel, n, act=act, n_threads=threads)
    c = sparse_counters(reset=True)
    ph = ffn_phase_counters(reset=True)
    assert c.ffn_calls == 1 and min(ph.values()) >= 0 and ph["a_ns"] > 0
    span = sum(v for key, v in ph.items() if key != "skew_ns")
    if threads == 1:
        assert ph["skew_ns"] == 0 and ph["wait3_ns"] == 0
        assert 0.9 * c.ffn_op_ns <= span <= c.ffn_op_ns
    else:  # the mean thread's phases never outlast thread 0's span by more than the entry spread
        assert 0 < span <= c.ffn_op_ns + ph["skew_ns"] + 1000
    if act == "relu":
        assert ph["b_ns"] > 0
    else:
        assert ph["b_ns"] == 0 and ph["wait2_ns"] == 0
