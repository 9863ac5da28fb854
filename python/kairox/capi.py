"""kairox's C API as ctypes types: every struct and enum of include/kairox.h and kx-tam.h that
Python hands to or reads from the runtime, in one module.

tests/test_capi.py compiles a C program against the headers and compares every size,
field offset and enum value below with the compiler's, so a change of a C struct that is
not made here fails the tests instead of corrupting memory.
"""
from __future__ import annotations

import ctypes
import enum

# enum kx_sparse_mode (and KX_SPARSE_AUTO)
SPARSE_MODES = ("dense", "exact", "predicted", "threshold")
SPARSE_AUTO = -1
# enum kx_balancer_mode
BALANCER_MODES = ("off", "fixed", "adaptive")
# enum kx_balance_decide
DECIDE = ("auto", "worker", "inline")
# enum kx_reload_method (kx-reload.h)
RELOAD_METHODS = ("gather", "memcpy", "batch")
# enum kx_tam_stall (kx-tam.h)
STALLS = ("none", "io", "cpu")
# enum kx_fault (bits of kx_params.faults; tests)
FAULTS = {"slots": 1, "host_lock": 2, "host_map": 4}


class Status(enum.IntEnum):
    """enum kx_status: what kx_model_params_apply / kx_context_apply returned."""
    OK = 0
    PARAMS = 1   # a bad or contradictory parameter
    PACK = 2     # the pack or its mode cannot be used: the model runs dense
    BUDGET = 3   # the model cannot run within the VRAM budget
    FAILED = 4   # the runtime failed


# C enum constant -> value, as this module uses them (the header test checks each)
ENUMS = {
    **{f"KX_SPARSE_{m.upper()}": i for i, m in enumerate(SPARSE_MODES)},
    "KX_SPARSE_AUTO": SPARSE_AUTO,
    **{f"KX_BALANCER_{m.upper()}": i for i, m in enumerate(BALANCER_MODES)},
    **{f"KX_DECIDE_{m.upper()}": i for i, m in enumerate(DECIDE)},
    **{f"KX_RELOAD_{m.upper()}": i for i, m in enumerate(RELOAD_METHODS)},
    **{f"KX_TAM_STALL_{m.upper()}": i for i, m in enumerate(STALLS)},
    **{f"KX_FAULT_{k.upper()}": v for k, v in FAULTS.items()},
    "KX_OK": Status.OK, "KX_ERR_PARAMS": Status.PARAMS, "KX_ERR_PACK": Status.PACK,
    "KX_ERR_BUDGET": Status.BUDGET, "KX_ERR_FAILED": Status.FAILED,
}


class TamConfig(ctypes.Structure):  # struct kx_tam_config
    _fields_ = [("lam", ctypes.c_float), ("eps", ctypes.c_float), ("alpha", ctypes.c_float),
                ("alpha_min", ctypes.c_float), ("lam_min", ctypes.c_float), ("lam_max", ctypes.c_float),
                ("adaptive", ctypes.c_int32), ("max_admit", ctypes.c_int32)]


class BackoffParams(ctypes.Structure):  # struct kx_backoff_config
    _fields_ = [("window", ctypes.c_int32), ("settle", ctypes.c_int32), ("margin", ctypes.c_float),
                ("max_doubling", ctypes.c_int32), ("drift", ctypes.c_float)]


class ThreadsParams(ctypes.Structure):  # struct kx_threads_config
    _fields_ = [("window", ctypes.c_int32), ("drift", ctypes.c_double), ("recheck", ctypes.c_int32)]


class BalanceParams(ctypes.Structure):  # struct kx_balance_params
    _fields_ = [("tam", TamConfig), ("cpu_gbs", ctypes.c_double), ("gpu_gbs", ctypes.c_double),
                ("method", ctypes.c_int32), ("max_blocks", ctypes.c_int32), ("decide", ctypes.c_int32),
                ("record", ctypes.c_int32), ("observe", ctypes.c_int32), ("pipeline", ctypes.c_int32),
                ("late_every", ctypes.c_int32), ("wait_limit_ms", ctypes.c_int32), ("fail_at", ctypes.c_int32),
                ("hang_at", ctypes.c_int32), ("trace_keep", ctypes.c_int32), ("backoff", BackoffParams)]


class BalanceRecord(ctypes.Structure):  # struct kx_balance_record
    _fields_ = [("step", ctypes.c_int32), ("layer", ctypes.c_int32), ("n_active", ctypes.c_int32),
                ("n_hit", ctypes.c_int32), ("n_load", ctypes.c_int32), ("n_evict", ctypes.c_int32),
                ("stall", ctypes.c_int32), ("lam", ctypes.c_float), ("wait_us", ctypes.c_float),
                ("decide_us", ctypes.c_float), ("reload_bytes", ctypes.c_int64), ("late", ctypes.c_int32),
                ("decided", ctypes.c_int32), ("hold_us", ctypes.c_float), ("pad", ctypes.c_int32)]


class Params(ctypes.Structure):  # struct kx_params
    _fields_ = [("sparse", ctypes.c_int32), ("sparse_pack", ctypes.c_char_p), ("vram_budget", ctypes.c_int64),
                ("gpu_slots", ctypes.c_int64), ("gpu_slots_layers", ctypes.POINTER(ctypes.c_int64)),
                ("n_gpu_slots_layers", ctypes.c_int32), ("plan", ctypes.c_char_p), ("slots_device", ctypes.c_char_p),
                ("pinned", ctypes.c_bool), ("warm", ctypes.c_bool), ("stream", ctypes.c_bool), ("migrate", ctypes.c_bool),
                ("mapped_share", ctypes.c_float),
                ("balancer", ctypes.c_int32), ("balance", BalanceParams), ("trace", ctypes.c_char_p),
                ("sched_trace", ctypes.c_char_p), ("sched_trace_max", ctypes.c_int64),
                ("error_budget", ctypes.c_float), ("fallback_dense", ctypes.c_bool), ("faults", ctypes.c_int32),
                ("vram_free_at_load", ctypes.c_int64), ("measure_gain", ctypes.c_bool),
                ("whole_fits", ctypes.c_bool), ("hw_profile", ctypes.c_char_p),
                ("threads", ThreadsParams)]


class ThrInfo(ctypes.Structure):  # struct kx_thr_info
    _fields_ = [("theta_g", ctypes.c_float), ("theta_c", ctypes.c_float), ("kg", ctypes.c_int32),
                ("kc", ctypes.c_int32), ("err_added", ctypes.c_float), ("n_gpu", ctypes.c_float),
                ("n_cpu", ctypes.c_float), ("n_cpu_static", ctypes.c_float), ("t_cpu_ns", ctypes.c_float),
                ("o_cpu_ns", ctypes.c_float), ("solves", ctypes.c_int32)]


class VramReport(ctypes.Structure):  # struct kx_vram_report
    _fields_ = [("budget", ctypes.c_int64), ("base", ctypes.c_int64), ("slots", ctypes.c_int64),
                ("used", ctypes.c_int64), ("n_slots", ctypes.c_int64)]


# C struct name -> its mirror (the header test walks this)
STRUCTS = {
    "kx_tam_config": TamConfig,
    "kx_balance_params": BalanceParams,
    "kx_balance_record": BalanceRecord,
    "kx_params": Params,
    "kx_vram_report": VramReport,
    "kx_thr_info": ThrInfo,
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the argument and result types of libllama's kx_* functions that Python calls."""
    vp, i32, i64, cp, sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t
    P = ctypes.POINTER
    sigs = {
        "kx_params_default": ([], Params),
        "kx_params_read_hw_profile": ([P(Params), ctypes.c_char_p, cp, sz], i32),
        "kx_params_hybrid": ([P(Params)], ctypes.c_bool),
        "kx_model_params_apply": ([P(Params), vp, cp, sz], i32),
        "kx_model_params_apply_model": ([P(Params), vp, cp, cp, sz], i32),
        "kx_model_params_apply_ctx": ([P(Params), vp, vp, cp, cp, sz], i32),
        "kx_place_order": ([P(ctypes.c_char_p), i32, P(i32)], i32),
        "kx_stream_place": ([P(ctypes.c_char_p), P(i64), P(ctypes.c_double), P(ctypes.c_char_p), i32, i64, i64,
                             ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_char_p,
                             ctypes.c_bool, P(ctypes.c_int8), P(i64)], i32),
        "kx_threads_run": ([P(ThreadsParams), i32, P(ctypes.c_double), i64, P(i32)], i32),
        "kx_backoff_run": ([P(BackoffParams), P(ctypes.c_double), P(ctypes.c_double), i64, P(ctypes.c_uint8)], i32),
        "kx_migrate_new": ([P(i64), P(i64), P(ctypes.c_double), i32, i64, i64, ctypes.c_double, ctypes.c_double,
                            ctypes.c_double, ctypes.c_double, i32, i32, ctypes.c_double], vp),
        "kx_migrate_step": ([vp] + [ctypes.c_double] * 6, i32),
        "kx_migrate_streamed": ([vp, P(ctypes.c_bool), i32], i32),
        "kx_migrate_free": ([vp], None),
        "kx_plan_dense": ([P(i64), P(ctypes.c_double), P(ctypes.c_double), i32, i64, i64, ctypes.c_double,
                           P(ctypes.c_bool)], ctypes.c_double),
        "kx_plan_slots": ([P(ctypes.c_double), P(i64), P(i64), P(i64), P(ctypes.c_double), P(ctypes.c_double), i32,
                           i64, P(i64)], ctypes.c_double),
        "kx_model_sparse_layers": ([vp], i32),
        "kx_sparse_cost": ([cp, cp, i32, i32, P(ctypes.c_float), i32, cp, sz], i32),
        "kx_context_apply": ([vp, cp, P(Params), cp, sz], i32),
        "kx_context_vram": ([vp, P(VramReport)], ctypes.c_bool),
        "kx_budget_margin": ([i64], i64),
        "kx_budget_auto_slots": ([i64, i64, i64, i64, i64, i64, cp, sz], i64),
        "kx_budget_auto_counts": ([i64, i64, i64, i64, i32, i64, P(ctypes.c_float), ctypes.c_double, ctypes.c_double,
                                   P(i64), cp, sz], i32),
        "kx_budget_check_slots": ([i64, i64, i64, i64, i64, P(i64), i32, cp, sz], i32),
        "kx_budget_shrink": ([P(i64), i32, i64, i64], None),
        "kx_model_load_pack": ([vp, cp, cp, cp, sz], i32),
        "kx_model_has_pack": ([vp], ctypes.c_bool),
        "kx_model_pack_has_predictor": ([vp], ctypes.c_bool),
        "kx_model_pack_activation": ([vp], cp),
        "kx_context_set_sparse": ([vp, i32, cp, sz], i32),
        "kx_context_get_sparse": ([vp], i32),
        "kx_model_set_slots": ([vp, P(i64), i32, cp, cp, sz], i32),
        "kx_model_slots_bytes": ([vp], i64),
        "kx_model_slots_device": ([vp], cp),
        "kx_model_slots_resident": ([vp, i32, P(i32), i64], i64),
        "kx_context_set_mapped_share": ([vp, ctypes.c_float, cp, sz], i32),
        "kx_model_slots_mapped": ([vp, i32], i64),
        "kx_model_slots_swap": ([vp, i32, P(i32), i32, P(i32), i32, cp, sz], i32),
        "kx_model_balancer_start": ([vp, P(BalanceParams), cp, sz], i32),
        "kx_context_balance": ([vp, cp, sz], i32),
        "kx_model_balance_drain": ([vp, cp, sz], i32),
        "kx_model_balance_trace": ([vp, P(BalanceRecord), i64], i64),
        "kx_model_balance_activity": ([vp, i64, i32, P(i32), i64], i64),
        "kx_model_backoff_trace": ([vp, P(ctypes.c_double), P(ctypes.c_double), P(ctypes.c_uint8), i64], i64),
        "kx_model_tensor_buffer_type": ([vp, cp], cp),
        "kx_context_stream_stats": ([vp, P(i64)], i32),
        "kx_context_set_error_budget": ([vp, ctypes.c_float, cp, sz], i32),
        "kx_model_thresholds": ([vp, i32, P(ThrInfo)], i32),
        "kx_thresholds_solve": ([P(ctypes.c_float), P(ctypes.c_float), i64, P(ctypes.c_uint8), ctypes.c_float,
                                 ctypes.c_float, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, P(i32), P(i32)],
                                None),
        "kx_host_buffer_type": ([ctypes.c_bool, i32], vp),
        "kx_host_pageable_bytes": ([], i64),
    }
    for name, (args, res) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    return lib
