"""Run single ggml ops on the CPU backend from numpy, through ctypes (test helper).

Each call builds a one-op graph in a fresh ggml context, computes it with n threads
(optionally with ggml's reference kernels, cplan.use_ref) and returns the result as a
numpy array. Weights are quantized with ggml_quantize_chunk; tests dequantize them with
gguf.quants (numpy, independent of ggml) for their references.
"""
from __future__ import annotations

import ctypes as C

import numpy as np

GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "i32": 26,
             "bf16": 30}
KX_SELECT_ACT = {"score": 0, "relu": 1, "silu": 2, "gelu": 3}


class _InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class _CPlan(C.Structure):
    _fields_ = [("work_size", C.c_size_t), ("work_data", C.c_void_p), ("n_threads", C.c_int),
                ("threadpool", C.c_void_p), ("abort_callback", C.c_void_p),
                ("abort_callback_data", C.c_void_p), ("use_ref", C.c_bool)]


class GGML:
    def __init__(self) -> None:
        # the same library instances libllama uses (an installed wheel has copies, not
        # symlinks, of libggml-*.so and .so.0): kernel counters are then shared
        from kairox._native import ggml_library
        self.base = ggml_library("ggml-base")
        self.cpu = ggml_library("ggml-cpu")
        b, c, P = self.base, self.cpu, C.c_void_p
        b.ggml_init.argtypes, b.ggml_init.restype = [_InitParams], P
        b.ggml_free.argtypes = [P]
        b.ggml_new_tensor_1d.argtypes, b.ggml_new_tensor_1d.restype = [P, C.c_int, C.c_int64], P
        b.ggml_new_tensor_2d.argtypes, b.ggml_new_tensor_2d.restype = [P, C.c_int, C.c_int64, C.c_int64], P
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [P], P
        b.ggml_nbytes.argtypes, b.ggml_nbytes.restype = [P], C.c_size_t
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [P], P
        b.ggml_build_forward_expand.argtypes = [P, P]
        b.ggml_row_size.argtypes, b.ggml_row_size.restype = [C.c_int, C.c_int64], C.c_size_t
        b.ggml_kx_select.argtypes = [P, P, C.c_float, C.c_float, C.c_int]
        b.ggml_kx_select.restype = P
        b.ggml_kx_select_split.argtypes = [P, P, C.c_float, C.c_float, P, P]
        b.ggml_kx_select_split.restype = P
        b.ggml_kx_select_set_host.argtypes, b.ggml_kx_select_set_host.restype = [P, P], P
        b.ggml_kx_select_to_host.argtypes = [P, P, C.c_float, C.c_float, C.c_int, P]
        b.ggml_kx_select_to_host.restype = P
        b.ggml_kx_mul_mat_rows.argtypes, b.ggml_kx_mul_mat_rows.restype = [P, P, P, P, P], P
        b.ggml_kx_mul_mat_rows_gated.argtypes, b.ggml_kx_mul_mat_rows_gated.restype = [P, P, P, P, P, P], P
        b.ggml_kx_mul_mat_rows_bias.argtypes, b.ggml_kx_mul_mat_rows_bias.restype = [P, P, P, P], P
        b.ggml_kx_axpy_rows.argtypes, b.ggml_kx_axpy_rows.restype = [P, P, P, P, P], P
        b.ggml_kx_ffn_rows.argtypes, b.ggml_kx_ffn_rows.restype = [P, P, P, P, P, P, P, P, P, C.c_int], P
        b.ggml_kx_ffn_rows_own_shares.argtypes = [P]
        for glu in ("ggml_reglu_split", "ggml_swiglu_split", "ggml_geglu_split"):
            getattr(b, glu).argtypes, getattr(b, glu).restype = [P, P, P], P
        c.ggml_graph_plan.argtypes, c.ggml_graph_plan.restype = [P, C.c_int, P], _CPlan
        c.ggml_graph_compute.argtypes, c.ggml_graph_compute.restype = [P, C.POINTER(_CPlan)], C.c_int

    # ------------------------------------------------------------------ tensors

    def quantize(self, w: np.ndarray, type_name: str) -> bytes:
        """float rows [n, k] -> ggml bytes of type_name (row-major, k per row)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        t = GGML_TYPE[type_name]
        if type_name == "f32":
            return w.tobytes()
        from kairox._native import ggml_quantize
        return ggml_quantize(w, t).tobytes()

    def _tensor(self, ctx, type_name: str, ne: tuple[int, ...], data: bytes | np.ndarray):
        t = GGML_TYPE[type_name]
        if len(ne) == 1:
            p = self.base.ggml_new_tensor_1d(ctx, t, ne[0])
        else:
            p = self.base.ggml_new_tensor_2d(ctx, t, ne[0], ne[1])
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
        assert len(raw) == self.base.ggml_nbytes(p), (len(raw), self.base.ggml_nbytes(p))
        C.memmove(self.base.ggml_get_data(p), raw, len(raw))
        return p

    def _run(self, ctx, out, n_threads: int, use_ref: bool, shape: tuple[int, ...], dtype) -> np.ndarray:
        gf = self.base.ggml_new_graph(ctx)
        self.base.ggml_build_forward_expand(gf, out)
        plan = self.cpu.ggml_graph_plan(gf, n_threads, None)
        work = C.create_string_buffer(max(plan.work_size, 1))
        plan.work_data = C.cast(work, C.c_void_p)
        plan.use_ref = use_ref
        rc = self.cpu.ggml_graph_compute(gf, C.byref(plan))
        assert rc == 0, f"ggml_graph_compute returned {rc}"
        n = int(np.prod(shape))
        buf = (C.c_char * (n * np.dtype(dtype).itemsize)).from_address(self.base.ggml_get_data(out))
        return np.frombuffer(bytes(buf), dtype=dtype).reshape(shape)

    def _ctx(self, nbytes: int):
        return self.base.ggml_init(_InitParams(nbytes + (64 << 20), None, False))

    # ------------------------------------------------------------------ ops

    def select(self, scores: np.ndarray, threshold: float, max_density: float, act: str,
               n_threads: int = 1, use_ref: bool = False, host: np.ndarray | None = None) -> np.ndarray:
        """scores [T, n] (numpy rows = tokens) -> int32 [n + 1] (count, ids...). host: an int32
        [n + 2] array, 16-byte aligned, that also receives the list (ggml_kx_select_to_host)."""
        T, n = scores.shape
        ctx = self._ctx(scores.nbytes)
        try:
            s = self._tensor(ctx, "f32", (n, T), scores.astype(np.float32))
            if host is None:
                out = self.base.ggml_kx_select(ctx, s, threshold, max_density, KX_SELECT_ACT[act])
            else:
                assert host.dtype == np.int32 and host.size >= n + 2 and host.ctypes.data % 16 == 0
                out = self.base.ggml_kx_select_to_host(ctx, s, threshold, max_density, KX_SELECT_ACT[act],
                                                       host.ctypes.data)
            return self._run(ctx, out, n_threads, use_ref, (n + 1,), np.int32).copy()
        finally:
            self.base.ggml_free(ctx)

    def select_split(self, scores: np.ndarray, threshold: float, max_density: float, rowmap: np.ndarray,
                     off: tuple[float, float], n_threads: int = 1, use_ref: bool = False,
                     host: np.ndarray | None = None) -> np.ndarray:
        """ggml_kx_select_split: scores [T, n], rowmap int32 [n], off (resident, others); host:
        as select()'s (ggml_kx_select_set_host)."""
        T, n = scores.shape
        ctx = self._ctx(scores.nbytes + 8 * n)
        try:
            s = self._tensor(ctx, "f32", (n, T), scores.astype(np.float32))
            rm = self._tensor(ctx, "i32", (n,), rowmap.astype(np.int32))
            ot = self._tensor(ctx, "f32", (2,), np.asarray(off, np.float32))
            out = self.base.ggml_kx_select_split(ctx, s, threshold, max_density, rm, ot)
            if host is not None:
                assert host.dtype == np.int32 and host.size >= n + 2 and host.ctypes.data % 16 == 0
                self.base.ggml_kx_select_set_host(out, host.ctypes.data)
            return self._run(ctx, out, n_threads, use_ref, (n + 1,), np.int32).copy()
        finally:
            self.base.ggml_free(ctx)

    def _sel(self, ctx, sel: np.ndarray, n: int):
        ids = np.asarray(sel, dtype=np.int32)
        full = np.zeros(n + 1, dtype=np.int32)
        full[0] = len(ids)
        full[1:1 + len(ids)] = ids
        return self._tensor(ctx, "i32", (n + 1,), full)

    def mul_mat_rows(self, w_bytes: bytes, w_type: str, n: int, k: int, x: np.ndarray, sel: np.ndarray | None,
                     rowmap: np.ndarray | None = None, n_threads: int = 1, use_ref: bool = False,
                     gate: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
        """w [n_rows, k] (as ggml bytes, n_rows = n without a row map), x [T, k] -> [T, n];
        sel None: no list (every neuron); gate [T, n]: the gated op (relu(gate) * w·x; rows whose
        gate is <= 0 for every token are skipped); bias [n] (no list, no map): w·x + bias."""
        T = x.shape[0]
        ctx = self._ctx(len(w_bytes) + x.nbytes + 4 * n * (2 + T))
        try:
            wt = self._tensor(ctx, w_type, (k, len(w_bytes) // self.base.ggml_row_size(GGML_TYPE[w_type], k)), w_bytes)
            xt = self._tensor(ctx, "f32", (k, T), x.astype(np.float32))
            rm = None if rowmap is None else self._tensor(ctx, "i32", (n,), rowmap.astype(np.int32))
            st = None if sel is None else self._sel(ctx, sel, n)
            if bias is not None:
                out = self.base.ggml_kx_mul_mat_rows_bias(ctx, wt, xt, self._tensor(ctx, "f32", (n,), bias.astype(np.float32)))
            elif gate is None:
                out = self.base.ggml_kx_mul_mat_rows(ctx, wt, xt, st, rm)
            else:
                gt = self._tensor(ctx, "f32", (n, T), gate.astype(np.float32))
                out = self.base.ggml_kx_mul_mat_rows_gated(ctx, wt, xt, st, rm, gt)
            return self._run(ctx, out, n_threads, use_ref, (T, n), np.float32).copy()
        finally:
            self.base.ggml_free(ctx)

    def axpy_rows(self, wt_bytes: bytes, wt_type: str, n_rows: int, m: int, h: np.ndarray, sel: np.ndarray,
                  rowmap: np.ndarray | None = None, n_threads: int = 1, use_ref: bool = False) -> np.ndarray:
        """wt [n_rows, m] (as ggml bytes), h [T, n] -> [T, m]."""
        T, n = h.shape
        ctx = self._ctx(len(wt_bytes) + h.nbytes)
        try:
            w = self._tensor(ctx, wt_type, (m, n_rows), wt_bytes)
            ht = self._tensor(ctx, "f32", (n, T), h.astype(np.float32))
            rm = None if rowmap is None else self._tensor(ctx, "i32", (n,), rowmap.astype(np.int32))
            out = self.base.ggml_kx_axpy_rows(ctx, w, ht, self._sel(ctx, sel, n), rm)
            return self._run(ctx, out, n_threads, use_ref, (T, m), np.float32).copy()
        finally:
            self.base.ggml_free(ctx)

    def ffn_rows(self, gate_raw: bytes, up_raw: bytes, w_type: str, n_rows: int, k: int,
                 down_raw: bytes, down_type: str, n_down: int, m: int, x: np.ndarray, sel: np.ndarray, n: int,
                 act: str, rowmap: np.ndarray | None = None, downmap: np.ndarray | None = None,
                 gate_pre: np.ndarray | None = None, split: bool = False, n_threads: int = 1,
                 use_ref: bool = False, own_shares: bool = False) -> np.ndarray:
        """A sparse FFN over sel: gate/up [n_rows, k], down_t [n_down, m] (ggml bytes), x [T, k]
        -> [T, m]. split=True runs the four-node form instead of ggml_kx_ffn_rows (gate rows,
        up rows, the stock GLU, axpy rows): the composition the fused op replaces. own_shares:
        ReLU's chunks by each thread's own share first (ggml_kx_ffn_rows_own_shares, as after
        the host-cache warm-up) instead of by a shared counter."""
        T = x.shape[0]
        ctx = self._ctx(len(gate_raw) + len(up_raw) + len(down_raw) + x.nbytes + 16 * n * T)
        try:
            gw = self._tensor(ctx, w_type, (k, n_rows), gate_raw)
            uw = self._tensor(ctx, w_type, (k, n_rows), up_raw)
            dw = self._tensor(ctx, down_type, (m, n_down), down_raw)
            xt = self._tensor(ctx, "f32", (k, T), x.astype(np.float32))
            st = self._sel(ctx, sel, n)
            rm = None if rowmap is None else self._tensor(ctx, "i32", (n,), rowmap.astype(np.int32))
            dm = None if downmap is None else self._tensor(ctx, "i32", (n,), downmap.astype(np.int32))
            gp = None if gate_pre is None else self._tensor(ctx, "f32", (n, T), gate_pre.astype(np.float32))
            if split:
                b = self.base
                gv = gp if gp is not None else b.ggml_kx_mul_mat_rows(ctx, gw, xt, st, rm)
                uv = b.ggml_kx_mul_mat_rows(ctx, uw, xt, st, rm)
                h = getattr(b, {"relu": "ggml_reglu_split", "silu": "ggml_swiglu_split",
                                "gelu": "ggml_geglu_split"}[act])(ctx, gv, uv)
                out = b.ggml_kx_axpy_rows(ctx, dw, h, st, dm)
            else:
                out = self.base.ggml_kx_ffn_rows(ctx, gw, uw, dw, xt, st, rm, dm, gp, KX_SELECT_ACT[act])
                if own_shares:
                    self.base.ggml_kx_ffn_rows_own_shares(out)
            return self._run(ctx, out, n_threads, use_ref, (T, m), np.float32).copy()
        finally:
            self.base.ggml_free(ctx)

    def select_stats(self, reset: bool = False) -> tuple[int, int, int, int]:
        from kairox._native import sparse_counters
        c = sparse_counters(reset)
        return c.selected, c.total, c.calls, c.fallbacks
