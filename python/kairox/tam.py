"""The balancer's decision in the runtime's native code (include/kx-tam.h), from Python.

`kairox.balancer.LayerBalancer` is the reference. The same per-layer step exists on the
host (libllama: kx_tam_step / kx_tam_replay) and on the GPU (libggml-cuda:
kx_cuda_tam_replay, one kernel per step: score update, λ, top-k target, loads and
evictions). `replay_native` runs a recorded layer trace through either, and the tests
check that every step's loads, evictions and λ equal the reference's.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from .balancer import STALLS, BalancerConfig
from .capi import TamConfig


@dataclass
class NativeReplay:
    admit: np.ndarray   # bool [steps, n_groups]
    evict: np.ndarray   # bool [steps, n_groups]
    lam: np.ndarray     # float32 [steps], λ after each step
    step_us: float | None = None  # GPU: mean time of one step's kernel


def _replay_fn(device: str):
    u8p, i32 = ctypes.POINTER(ctypes.c_uint8), ctypes.c_int32
    args = [ctypes.POINTER(TamConfig), i32, i32, u8p, i32, u8p, ctypes.POINTER(i32), u8p, u8p,
            ctypes.POINTER(ctypes.c_float)]
    if device == "cpu":
        from .llama import _C
        f = _C._lib.kx_tam_replay
    elif device == "cuda":
        from ._native import ggml_library
        try:
            f = ggml_library("ggml-cuda").kx_cuda_tam_replay
        except (OSError, AttributeError) as e:
            raise RuntimeError(f"no CUDA build of kairox here ({e})") from None
        args.append(ctypes.POINTER(ctypes.c_float))
    else:
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    f.argtypes, f.restype = args, i32
    return f


def replay_native(config: BalancerConfig, capacity: int, initial: np.ndarray, active: np.ndarray,
                  stalls: list[str], device: str = "cpu") -> NativeReplay:
    """One layer's recorded steps (active: bool [steps, n_groups]; stalls: one per step;
    initial: bool [n_groups] residents at start) through the native decision."""
    active = np.ascontiguousarray(active, np.uint8)
    steps, n = active.shape
    init = np.ascontiguousarray(initial, np.uint8)
    if init.shape != (n,) or len(stalls) != steps:
        raise ValueError("initial needs one flag per group and stalls one entry per step")
    st = np.array([STALLS.index(s) for s in stalls], np.int32)  # enum kx_tam_stall: none, io, cpu
    admit = np.zeros((steps, n), np.uint8)
    evict = np.zeros((steps, n), np.uint8)
    lam = np.zeros(steps, np.float32)
    u8 = ctypes.POINTER(ctypes.c_uint8)
    args = [ctypes.byref(config.native()), n, capacity, init.ctypes.data_as(u8), steps,
            active.ctypes.data_as(u8), st.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            admit.ctypes.data_as(u8), evict.ctypes.data_as(u8), lam.ctypes.data_as(ctypes.POINTER(ctypes.c_float))]
    us = ctypes.c_float()
    if device == "cuda":
        args.append(ctypes.byref(us))
    rc = _replay_fn(device)(*args)
    if rc:
        raise RuntimeError(f"native TAM replay on {device} failed (code {rc}): capacity {capacity} of {n} groups")
    return NativeReplay(admit.astype(bool), evict.astype(bool), lam, us.value if device == "cuda" else None)
