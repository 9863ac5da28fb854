"""`kairox.Llama`: llama_cpp.Llama on kairox's patched llama.cpp, with validated options.

Without kairox options it is llama_cpp.Llama, call for call: same model and context
parameters, same sampling, chat, streaming and tokenizer. It differs in two ways a user
can only gain from: keyword arguments neither class knows raise TypeError (the base
class silently swallows them, so a typo would go unnoticed), and a model that fails to
load raises ModelLoadError (a ValueError, as before) that carries llama.cpp's reason.

Sparse FFN: `Llama(path, sparse="exact" | "predicted" | "threshold" | "dense", sparse_pack=PACK)`.
The pack defaults to MODEL.kxpack.gguf next to the model; naming a pack without a mode
picks "predicted" when the pack has a predictor, else "exact" (ReLU) or "threshold" (gated
models). A sparse mode or hybrid
that cannot run (pack missing, corrupt or made for another model; slots without a GPU)
raises SparsePackError saying why; with `fallback="dense"` the model runs dense instead and
a SparsePackWarning says why. `llm.sparse` always tells the mode in force.
`llm.set_sparse(mode)` switches later (the next decode rebuilds its graph). Exact mode
computes every neuron that fires, so a gated (SiLU/GELU) model's FFN runs dense; threshold
mode on such a model emits a SparseApproximationWarning: it skips the activations at or below
the pack's per-layer thresholds, so its output is close to dense, not equal.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import inspect
import multiprocessing
import os
import sys
import threading
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from . import capi
from ._native import load_llama_cpp
from .backoff import BackoffConfig
from .balancer import BalancerConfig
from .budget import VramBudgetError, VramReport
from .capi import DECIDE, RELOAD_METHODS, SPARSE_MODES, STALLS, BalanceRecord
from .costs import Rates
from .plan import HwProfile, Plan, parse_size
from .threads import ThreadsConfig

llama_cpp = load_llama_cpp()
_C = llama_cpp.llama_cpp

# the base constructor's parameters, read at import (the server puts kairox.Llama in its place)
_BASE_PARAMS = inspect.signature(llama_cpp.Llama.__init__).parameters
_BASE_KWARGS = frozenset(p.name for p in _BASE_PARAMS.values() if p.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class KairoxOptions:
    """Options kairox adds to llama_cpp.Llama. Each field is a keyword of kairox.Llama;
    the defaults reproduce llama.cpp exactly."""
    sparse: str | None = None        # dense | exact | predicted | threshold; None: auto if a pack is named
    sparse_pack: str | None = None   # the pack; None: MODEL.kxpack.gguf next to the model
    # hybrid FFN: neurons per layer kept on the GPU (an int for every layer, or one per
    # layer); the rest run on the CPU from host weights, at the same time. None: no slots.
    gpu_slots: int | Sequence[int] | None = None
    slots_device: str | None = None  # ggml device for the slots (None: first GPU; "CPU": tests)
    # GPU memory (bytes, or a size such as "7GiB") that everything kairox and llama.cpp
    # allocate on the GPU must stay under: weights, slots, predictors, KV cache, compute
    # buffers. Measured on the device around load and a warm-up batch; without gpu_slots or
    # a plan, the slots fill what the rest leaves. Implies the hybrid placement.
    vram_budget: int | str | None = None
    plan: str | None = None          # a `kairox plan` file: dense tensors on the GPU, slots per layer
    # hybrid: host-side weights in page-locked memory (the GPU's host buffer type; the model
    # is then read, not mapped, unless use_mmap=True is given), so prefill batches offloaded
    # to the GPU copy them at PCIe speed. False: pages mapped from the file (no pinned RAM).
    pinned: bool = True
    # hybrid: the GPU also computes this share of the host-side neurons (by activation
    # frequency, hottest first), reading their rows from the page-locked host weights over
    # PCIe while the CPU computes the rest: PCIe adds its bandwidth to the CPU's. 0: the CPU
    # computes the whole host side. Needs pinned host weights; not with the balancer.
    mapped_share: float = 0.0
    # live balancer (hybrid only): after every decode, neurons move between the two sides by
    # the TAM policy, reloads behind the next decode. A kairox.balancer.BalancerConfig, or
    # True for its defaults. None / False: the static split.
    balancer: Any = None
    reload_method: str = "gather"    # gather (zero-copy kernel) | memcpy | batch: how reloads move rows
    balancer_record: bool = False    # keep every step's active lists (balance_activity; tests)
    # the balancer decides one layer ahead within each decode (loads land before their layer)
    # instead of between decodes; needs the pack's predictor
    balancer_pipeline: bool = False
    # who decides: auto; worker (a host thread; with the pipeline it makes each layer's
    # prefetch while the CPU part of the layer before computes, and wants a core of its own);
    # inline (the calling thread, or with the pipeline the compute threads)
    balancer_decide: str = "auto"
    # the balancer backs off to the split as it stands wherever it does not measurably pay
    # (a kairox.backoff.BackoffConfig; None: it always runs)
    balancer_backoff: Any = dataclasses.field(default_factory=BackoffConfig)
    # hybrid: warm the host caches with the next layer's predicted rows while the GPU works
    warm: bool = True
    # a VRAM budget of whole tensors (no pack): host tensors the placement picks are copied into
    # a GPU scratch ahead of their use and multiplied there, beside the CPU's own work
    stream: bool = True
    # ... and which of them stream follows the CPU, GPU and PCIe rates measured over the last
    # decode steps (runtime migration: a CPU under load leaves more to the GPU, a busy PCIe less;
    # off by default until it measures faster, docs/ARCHITECTURE.md)
    migrate: bool = False
    # sparse without the hybrid: time each layer's sparse FFN against the dense one on this CPU
    # before the model loads and run sparse only where it is faster (False: wherever the pack's
    # lists hold under 60% of a layer's neurons)
    measure_gain: bool = True
    # the balancer's records, appended as JSON lines while running (`kairox report FILE`)
    trace: str | None = None
    # the scheduler's split trace for the whole process, written at exit (`kairox trace FILE`),
    # and how many records it keeps (0: 131072)
    sched_trace: str | None = None
    sched_trace_max: int = 0
    # hybrid, predicted: load-aware thresholds (kairox.thresholds) adding at most this relative
    # error of the FFN output to the static threshold's (0: none, DynamicInfer's bound); None: off
    error_budget: float | None = None
    # a sparse mode or hybrid asked for that cannot run: None raises SparsePackError; "dense"
    # runs the model dense with a SparsePackWarning
    fallback: str | None = None
    # a `kairox profile-hw` file: the balancer's stall model uses its measured CPU and GPU
    # rates (kairox.costs) instead of the defaults, and the VRAM budget's placement prices each
    # tensor at its weight type's measured rates
    hw_profile: str | None = None
    # load-aware decode threads (kairox.threads): each single-token decode's CPU thread count
    # follows its measured time, so a machine whose cores other processes take decodes with
    # fewer threads. A kairox.threads.ThreadsConfig, or True for its defaults; None / False: off
    adapt_threads: Any = None
    # tests, fault injection at load: names of kairox.capi.FAULTS (memory refused for the
    # slots, the page-locking or the mapping of the host weights)
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_sparse()
        if self.fallback not in (None, "dense"):
            raise ValueError(f"fallback must be None or 'dense', not {self.fallback!r}")
        if self.hw_profile is not None:
            object.__setattr__(self, "_rates", _read_rates(self.hw_profile))  # a readable error before loading
        if isinstance(self.faults, str) or any(f not in capi.FAULTS for f in self.faults):
            raise ValueError(f"faults must be names among {', '.join(capi.FAULTS)}, not {self.faults!r}")
        # a pickled Llama's state holds its configurations as dicts (dataclasses.asdict)
        for name, cls in (("balancer", BalancerConfig), ("balancer_backoff", BackoffConfig),
                          ("adapt_threads", ThreadsConfig)):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, cls(**getattr(self, name)))
        if self.adapt_threads is True:
            object.__setattr__(self, "adapt_threads", ThreadsConfig())
        elif self.adapt_threads is not None and self.adapt_threads is not False and \
                not isinstance(self.adapt_threads, ThreadsConfig):
            raise TypeError(f"adapt_threads must be a kairox.threads.ThreadsConfig or True, not {self.adapt_threads!r}")
        if self.balancer is not None and self.balancer is not False:
            if self.balancer is True:
                object.__setattr__(self, "balancer", BalancerConfig())
            elif not isinstance(self.balancer, BalancerConfig):
                raise TypeError(f"balancer must be a kairox.balancer.BalancerConfig or True, not {self.balancer!r}")
            if not self.wants_slots:
                raise ValueError("the balancer moves neurons between GPU slots and the CPU: give gpu_slots, "
                                 "vram_budget or a plan")
        if self.balancer_pipeline and not self.balancer:
            raise ValueError("balancer_pipeline is a mode of the live balancer: give balancer= too")
        if self.balancer_backoff is not None and not isinstance(self.balancer_backoff, BackoffConfig):
            raise TypeError(f"balancer_backoff must be a kairox.backoff.BackoffConfig or None, "
                            f"not {type(self.balancer_backoff).__name__}")
        if self.balancer_decide not in DECIDE:
            raise ValueError(f"balancer_decide must be one of {', '.join(DECIDE)}, not {self.balancer_decide!r}")
        if self.reload_method not in RELOAD_METHODS:
            raise ValueError(f"reload_method must be one of {', '.join(RELOAD_METHODS)}, not {self.reload_method!r}")
        if self.vram_budget is not None:
            b = self.vram_budget
            try:
                b = parse_size(b) if isinstance(b, str) else b
            except Exception as e:  # parse_size raises argparse.ArgumentTypeError
                raise ValueError(f"vram_budget: {e}") from None
            if not isinstance(b, int) or isinstance(b, bool) or b <= 0:
                raise ValueError(f"vram_budget must be a size in bytes > 0 or a string like '7GiB', not {self.vram_budget!r}")
            object.__setattr__(self, "vram_budget", b)
        if isinstance(self.mapped_share, bool) or not isinstance(self.mapped_share, (int, float)) or \
                not 0.0 <= self.mapped_share < 1.0:
            raise ValueError(f"mapped_share must be a number in [0, 1), not {self.mapped_share!r}")
        if self.mapped_share > 0 and not self.wants_slots:
            raise ValueError("mapped_share splits the host side of the hybrid FFN: give gpu_slots, vram_budget or a plan")
        if self.mapped_share > 0 and self.balancer:
            raise ValueError("mapped_share and the balancer do not mix: the balancer moves neurons between the "
                             "GPU slots and the CPU only")
        if self.error_budget is not None and (isinstance(self.error_budget, bool) or
                                              not isinstance(self.error_budget, (int, float)) or
                                              not 0.0 <= self.error_budget <= 1.0):
            raise ValueError(f"error_budget must be a number in [0, 1] or None (off), not {self.error_budget!r}")
        if self.error_budget is not None and not self.wants_slots:
            raise ValueError("error_budget (load-aware thresholds) splits the hybrid FFN: give gpu_slots, "
                             "vram_budget or a plan")
        if self.error_budget is not None and self.sparse in ("exact", "threshold"):
            raise ValueError("error_budget moves the predictor's thresholds: it needs the predicted mode")
        for name in ("pinned", "warm", "stream", "migrate", "measure_gain"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.trace is not None and not self.balancer:
            raise ValueError("trace records the live balancer's steps: give balancer= too")
        if self.plan is not None and not isinstance(self.plan, (str, os.PathLike)):
            raise TypeError(f"plan must be a path, not {type(self.plan).__name__}")
        if self.plan is not None and self.gpu_slots is not None:
            raise ValueError("give either gpu_slots or a plan (the plan holds the slot counts), not both")
        if (self.gpu_slots is not None or self.plan is not None) and self.sparse == "dense":
            raise ValueError("gpu_slots and plan place FFN neurons on the GPU: they need a sparse mode (exact, "
                             "predicted or threshold), not dense (vram_budget with sparse='dense' places whole "
                             "tensors)")

    @property
    def rates(self) -> Rates:
        """The stall model's rates: the hw_profile's measured ones, else kairox.costs' defaults."""
        return getattr(self, "_rates", None) or Rates()

    @property
    def wants_slots(self) -> bool:
        return self.gpu_slots is not None or self.vram_budget is not None or self.plan is not None

    def _check_sparse(self) -> None:
        if self.sparse is not None and self.sparse not in SPARSE_MODES:
            raise ValueError(f"sparse must be one of {', '.join(SPARSE_MODES)}, not {self.sparse!r}")
        if self.sparse_pack is not None and not isinstance(self.sparse_pack, (str, os.PathLike)):
            raise TypeError(f"sparse_pack must be a path, not {type(self.sparse_pack).__name__}")
        if self.gpu_slots is not None:
            vals = [self.gpu_slots] if isinstance(self.gpu_slots, int) else list(self.gpu_slots)
            if not vals or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in vals):
                raise ValueError(f"gpu_slots must be a count >= 0 or one count per layer, not {self.gpu_slots!r}")

    @property
    def wants_sparse(self) -> bool:
        return (self.sparse not in (None, "dense") or (self.sparse is None and self.sparse_pack is not None)
                or self.wants_slots)

    def to_params(self) -> tuple[capi.Params, list[Any]]:
        """The struct kx_params these options make, and the buffers its pointers point into
        (keep them alive as long as the struct)."""
        kp = _lib.kx_params_default()
        keep: list[Any] = []

        def text(v: Any) -> bytes | None:
            if v is None:
                return None
            b = os.fsencode(v)
            keep.append(b)
            return b
        if self.sparse is not None:
            kp.sparse = SPARSE_MODES.index(self.sparse)
        kp.sparse_pack = text(self.sparse_pack)
        kp.vram_budget = self.vram_budget or 0
        if isinstance(self.gpu_slots, int):
            kp.gpu_slots = self.gpu_slots
        elif self.gpu_slots is not None:
            arr = (ctypes.c_int64 * len(self.gpu_slots))(*self.gpu_slots)
            keep.append(arr)
            kp.gpu_slots_layers, kp.n_gpu_slots_layers = arr, len(self.gpu_slots)
        kp.plan = text(self.plan)
        kp.slots_device = text(self.slots_device)
        kp.pinned, kp.warm, kp.stream, kp.migrate = self.pinned, self.warm, self.stream, self.migrate
        kp.measure_gain = self.measure_gain
        kp.mapped_share = float(self.mapped_share)
        if self.balancer:
            kp.balancer = capi.BALANCER_MODES.index("adaptive" if self.balancer.adaptive else "fixed")
            kp.balance.tam = self.balancer.native()
            kp.balance.method = RELOAD_METHODS.index(self.reload_method)
            kp.balance.decide = DECIDE.index(self.balancer_decide)
            kp.balance.record = int(self.balancer_record)
            kp.balance.pipeline = int(self.balancer_pipeline)
            kp.balance.backoff = (self.balancer_backoff or BackoffConfig(window=0)).native()
        kp.trace = text(self.trace)
        kp.sched_trace, kp.sched_trace_max = text(self.sched_trace), self.sched_trace_max
        kp.error_budget = -1.0 if self.error_budget is None else float(self.error_budget)
        kp.fallback_dense = self.fallback == "dense"
        kp.faults = sum(capi.FAULTS[f] for f in set(self.faults))
        kp.balance.cpu_gbs, kp.balance.gpu_gbs = self.rates.cpu_gbs, self.rates.gpu_gbs
        kp.hw_profile = text(self.hw_profile)
        if self.adapt_threads:
            kp.threads = self.adapt_threads.native()
        return kp, keep


def _read_rates(path: str) -> Rates:
    import json
    try:
        return HwProfile.from_json(json.loads(Path(path).read_text())).rates
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"hw_profile {path}: not a `kairox profile-hw` file ({e})") from None


class SparsePackWarning(UserWarning):
    """A sparse pack could not be used; the model runs dense (fallback="dense")."""


class SparseApproximationWarning(UserWarning):
    """Exact mode on a model whose activation is not ReLU: close to dense, not equal."""


class _ParamsRefused(ValueError):
    """kx_model_params_apply_ctx refused kairox's options (a ValueError with its sentence)."""


class SparseNoGainWarning(UserWarning):
    """Predicted mode asked for, but the pack measured lists too dense to gain in every layer:
    the model runs dense, with llama.cpp's repacked weights."""


class HostMemoryWarning(UserWarning):
    """Page-locking the hybrid's host weights was refused: they stay pageable (the run is
    right; GPU copies of them go through the driver's staging, prefill is slower)."""


class SparsePackError(ValueError):
    """The sparse mode or hybrid asked for cannot run; `reason` is the runtime's sentence."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason} (fallback='dense' runs the model dense instead)")
        self.reason = reason


_KX_KWARGS = frozenset(f.name for f in dataclasses.fields(KairoxOptions))


class ModelLoadError(ValueError):
    """The model file could not be loaded; the message holds llama.cpp's own errors."""




class _ErrorLog:
    """Keeps llama.cpp's recent error lines and prints what llama.cpp logs as llama-cpp-python
    would, except that errors are always printed: llama-cpp-python's own callback maps ggml's
    levels off by one, so it drops real errors (ERROR taken for DEBUG) unless verbose, and
    prints warnings as errors. A runtime error (a balancer that stops, say) is never silent."""

    def __init__(self, maxlen: int = 16) -> None:
        import logging
        self.lines: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.lock = threading.Lock()
        from llama_cpp import _logger
        self._forward = _logger.llama_log_callback
        # read in the callback by attribute only: it can run during interpreter teardown,
        # when imports fail
        self._logger, self._info, self._sys = _logger.logger, logging.INFO, sys
        self._in_error = False

        @_C.llama_log_callback
        def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            try:
                # ggml.h: GGML_LOG_LEVEL_ERROR = 4, GGML_LOG_LEVEL_CONT = 5 (continues a line)
                if level != 5:
                    self._in_error = level == 4
                if self._in_error:
                    with self.lock:
                        self.lines.append(text.decode("utf-8", "replace").strip())
                if self._logger.level <= self._info:  # verbose: everything, as llama-cpp-python prints it
                    self._forward(level, text, user_data)
                elif self._in_error:
                    self._sys.stderr.write(text.decode("utf-8", "replace"))  # the stderr of now
                    self._sys.stderr.flush()
            except Exception:  # noqa: BLE001 - a log line must never raise into C (or at exit)
                pass

        self._callback = callback  # keep the ctypes thunk alive
        _C.llama_log_set(callback, ctypes.c_void_p(0))

    def take(self) -> list[str]:
        with self.lock:
            out = [ln for ln in self.lines if ln]
            self.lines.clear()
        return out


_errors = _ErrorLog()

_lib = capi.declare(_C._lib)


def sparse_cost(model: str | os.PathLike, pack: str | os.PathLike | None = None, mode: str = "predicted",
                n_threads: int | None = None) -> list[float | None]:
    """Per layer, the sparse FFN's time over the dense FFN's on this CPU with n_threads (default:
    all cores) at the share of neurons the pack's predicted lists held (kx_sparse_cost): a layer
    under pack.TIMED_GAINS_BELOW (0.95) runs sparse, as a load with measure_gain decides. None where the pack lists no
    share, or one of 60% or more (such a layer runs dense without timing)."""
    from .pack import K_N_LAYER, _kv, _open_gguf, pack_path_for
    pack = Path(pack) if pack is not None else pack_path_for(Path(model))
    n_layer = _kv(_open_gguf(pack), K_N_LAYER)
    if not isinstance(n_layer, int):
        raise ValueError(f"{pack} is not a sparse pack (no {K_N_LAYER})")
    ratio = (ctypes.c_float * n_layer)()
    err = ctypes.create_string_buffer(1024)
    if mode not in ("predicted", "threshold"):
        raise ValueError(f"the sparse FFN is timed in predicted or threshold mode, not {mode!r}")
    mode_id = SPARSE_MODES.index(mode)
    rc = _lib.kx_sparse_cost(os.fsencode(model), os.fsencode(pack), mode_id, n_threads or os.cpu_count() or 1,
                             ratio, n_layer, err, len(err))
    if rc != capi.Status.OK:
        raise ValueError(err.value.decode(errors="replace"))
    return [None if r < 0 else float(r) for r in ratio]

def _context_params(kwargs: dict[str, Any]) -> Any:
    """The context parameters the base class will make of kwargs: a VRAM budget's dry run
    measures the KV cache and compute buffers with them before the model loads."""
    def get(k: str) -> Any:
        return kwargs.get(k, _BASE_PARAMS[k].default)
    cp = _C.llama_context_default_params()
    n_ctx = int(get("n_ctx"))
    n_batch = min(n_ctx, int(get("n_batch"))) if n_ctx else int(get("n_batch"))
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(n_batch, int(get("n_ubatch")))
    # the threads the base class will give the context (its defaults): the load times the
    # sparse FFN with them (measure_gain), and a timing with other threads decides wrongly
    cores = multiprocessing.cpu_count()
    cp.n_threads = int(get("n_threads") or max(cores // 2, 1))
    cp.n_threads_batch = int(get("n_threads_batch") or cores)
    cp.offload_kqv = bool(get("offload_kqv"))
    cp.flash_attn_type = _C.LLAMA_FLASH_ATTN_TYPE_ENABLED if get("flash_attn") else _C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    for k in ("op_offload", "swa_full", "type_k", "type_v"):
        if get(k) is not None:
            setattr(cp, k, get(k))
    return cp


# llama.cpp reads model params once, inside the base constructor; kairox's placement adjusts
# them there (kx_model_params_apply), so the base class's params come from a patched default
_params_lock = threading.Lock()


class Llama(llama_cpp.Llama):
    __doc__ = (llama_cpp.Llama.__doc__ or "") + __doc__

    def __init__(self, model_path: str, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _BASE_KWARGS - _KX_KWARGS)
        if unknown:
            raise TypeError(
                f"kairox.Llama got unknown keyword argument(s) {', '.join(unknown)}; "
                f"kairox adds {sorted(_KX_KWARGS) or 'none'} to llama_cpp.Llama's own")
        self.kx_options = KairoxOptions(**{k: kwargs.pop(k) for k in _KX_KWARGS if k in kwargs})
        self.sparse = "dense"
        self.sparse_error: str | None = None
        self.vram: VramReport | None = None
        _errors.take()
        opts = self.kx_options
        if opts.plan is not None:
            plan = Plan.read(opts.plan)  # a readable error before anything loads
            if plan.model != Path(model_path).name:
                raise ValueError(f"the plan {opts.plan} was made for {plan.model}, not {Path(model_path).name}")
        self._kx_params, self._kx_keep = opts.to_params()
        pinned = opts.wants_slots and opts.pinned and (opts.slots_device or "").upper() != "CPU"
        if opts.wants_slots:
            # hybrid placement: every layer's dense part on the GPU unless the caller says
            kwargs.setdefault("n_gpu_layers", -1)
            if pinned and kwargs.get("type_k") in (None, 1) and kwargs.get("type_v") in (None, 1):
                # Flash attention for the GPU's attention (llama.cpp's own default; llama_cpp.Llama
                # turns it off): a decode step then runs one attention kernel instead of KQ,
                # softmax and KQV (~23 µs of ~120 µs per layer of the GPU's serial part on the
                # H200, KB-7B). F16 KV cache only, which the CUDA kernel reads.
                kwargs.setdefault("flash_attn", True)
            if pinned:
                # the base class sets the load mode from use_mmap after the default params:
                # page-locked host weights are read, not mapped (an explicit use_mmap=True keeps
                # them mapped, pageable)
                kwargs.setdefault("use_mmap", False)
        err = ctypes.create_string_buffer(1024)
        cparams = _context_params(kwargs)
        with _params_lock:
            default_params = _C.llama_model_default_params

            def kx_default_params():
                p = default_params()
                rc = _lib.kx_model_params_apply_ctx(ctypes.byref(self._kx_params), ctypes.addressof(p),
                                                    ctypes.addressof(cparams), os.fsencode(model_path), err, len(err))
                if rc:
                    # raised inside the base class's constructor: the model is not loaded
                    why = err.value.decode("utf-8", "replace")
                    raise VramBudgetError(why) if rc == capi.Status.BUDGET else _ParamsRefused(why)
                return p
            _C.llama_model_default_params = kx_default_params
            try:
                if not os.path.isfile(model_path):
                    # the base class says "Model path does not exist" as a plain ValueError, and
                    # tries to load a directory
                    raise ModelLoadError(f"{model_path} is {'a directory' if os.path.isdir(model_path) else 'missing'}"
                                         f", not a model file")
                pageable = _lib.kx_host_pageable_bytes()
                super().__init__(model_path, *args, **kwargs)
                pageable = _lib.kx_host_pageable_bytes() - pageable
            except (ModelLoadError, _ParamsRefused, VramBudgetError):
                raise
            except ValueError as e:
                why = _errors.take()
                if why and "Failed to load model" in str(e):
                    raise ModelLoadError(f"{e}: " + " | ".join(why)) from None
                raise
            finally:
                _C.llama_model_default_params = default_params
        if pageable > 0:
            # the runtime's own line went where the base class sends the load's output
            warnings.warn(HostMemoryWarning(f"kairox: {pageable / 2**20:.2f} MiB of host weights stay pageable "
                                            "(page-locking was refused)"), stacklevel=2)
        self._kx_apply(model_path)

    def _kx_apply(self, model_path: str) -> None:
        """Pack, slots, sparse mode, mapped share, balancer and trace, by the runtime
        (kx_context_apply): what every llama.cpp tool does with the same options."""
        err = ctypes.create_string_buffer(1024)
        rc = capi.Status(_lib.kx_context_apply(self._ctx.ctx, os.fsencode(model_path), ctypes.byref(self._kx_params),
                                               err, len(err)))
        why = err.value.decode("utf-8", "replace")
        _errors.take()  # the runtime's error lines, now in `why`
        if rc == capi.Status.PACK:
            if self.kx_options.fallback != "dense":
                self.close()
                raise SparsePackError(why)
            self.sparse_error = why
            warnings.warn(SparsePackWarning(f"kairox: sparse mode unavailable, running dense: {why}"), stacklevel=3)
        elif rc != capi.Status.OK:
            self.close()
            raise (VramBudgetError if rc == capi.Status.BUDGET else RuntimeError if rc == capi.Status.FAILED
                   else ValueError)(why)
        self.sparse = SPARSE_MODES[_lib.kx_context_get_sparse(self._ctx.ctx)]
        if (rc == capi.Status.OK and self.sparse == "dense" and self.kx_options.wants_sparse
                and _lib.kx_model_pack_activation(self._model.model)):
            # no layer gains: lists of 60% of the neurons or more, or a sparse FFN timed slower than
            # the dense one on this CPU (measure_gain; the runtime's warning says which)
            warnings.warn(SparseNoGainWarning("kairox: the sparse FFN would not gain on this model here (its "
                                              "pack's lists hold 60% of each layer's neurons or more, or its "
                                              "sparse FFN timed slower than the dense one on this CPU): "
                                              "running dense"),
                          stacklevel=4)
        self._warn_if_approximate(stacklevel=4)
        v = capi.VramReport()
        if _lib.kx_context_vram(self._ctx.ctx, ctypes.byref(v)):
            counts = [len(self.slot_residents(il)) for il in range(self.n_layer)]
            self.vram = VramReport(v.budget, v.base, v.slots, v.used, counts)

    def vram_used(self) -> int | None:
        """GPU memory this model took so far (bytes, measured now), when it runs under a budget."""
        free0 = self._kx_params.vram_free_at_load
        if free0 < 0:
            return None
        from ._native import gpu_memory
        return free0 - gpu_memory()[0]


    @property
    def whole_fits(self) -> bool:
        """True when the VRAM budget held the whole model dense and the automatic sparse mode
        therefore runs it on the GPU unsplit, as llama.cpp does with every layer offloaded."""
        return bool(self._kx_params.whole_fits)

    @property
    def slots_bytes(self) -> int:
        """Device memory held by the neuron slots (0 without slots)."""
        return int(_lib.kx_model_slots_bytes(self._model.model))

    def tensor_buffer_type(self, name: str) -> str | None:
        """The buffer type holding model tensor `name` ("CPU", "CUDA0", "CUDA_Host", ...), or
        None without such a tensor: where the placement put it."""
        r = _lib.kx_model_tensor_buffer_type(self._model.model, name.encode())
        return None if r is None else r.decode()

    def stream_stats(self) -> dict[str, int]:
        """The streamed weights of a budget of whole tensors (stream=True): tensors streamed now,
        the device scratch's bytes, the copies queued and their bytes so far, the tensors a slot
        holds (those migration may stream), the migrations made (another set streamed), the
        decode steps measured and the choices made again because the measured rates moved (all 0
        when the context streams none)."""
        out = (ctypes.c_int64 * 8)()
        _lib.kx_context_stream_stats(self._ctx.ctx, out)
        return dict(zip(("tensors", "scratch_bytes", "copies", "copy_bytes", "slotted", "migrations", "steps",
                         "choices"), out))

    def slot_residents(self, il: int) -> list[int]:
        """Neuron ids resident in layer il's slots, in slot order ([] without slots)."""
        n = _lib.kx_model_slots_resident(self._model.model, il, None, 0)
        if n < 0:
            raise IndexError(f"layer {il} is out of range")
        buf = (ctypes.c_int32 * max(n, 1))()
        _lib.kx_model_slots_resident(self._model.model, il, buf, n)
        return list(buf[:n])

    def set_mapped_share(self, share: float) -> None:
        """Between decodes: the GPU computes `share` (0 <= share < 1) of every hybrid layer's
        host-side neurons (by activation frequency, hottest first) from the page-locked host
        rows over PCIe, the CPU the rest; 0 gives them all back to the CPU. Outputs do not
        change, only which side computes each neuron. ValueError for a bad share, a model
        without slots, a running balancer or weights the GPU's row kernels cannot read."""
        err = ctypes.create_string_buffer(512)
        if _lib.kx_context_set_mapped_share(self._ctx.ctx, float(share), err, len(err)):
            raise ValueError(err.value.decode())

    def set_error_budget(self, budget: float | None) -> None:
        """Between decodes: load-aware thresholds adding at most `budget` of the FFN output's
        norm to the static threshold's calibrated error (kairox.thresholds; None turns them
        off). ValueError without slots, the predicted mode or a pack calibration."""
        err = ctypes.create_string_buffer(512)
        if _lib.kx_context_set_error_budget(self._ctx.ctx, -1.0 if budget is None else float(budget), err, len(err)):
            raise ValueError(err.value.decode())

    def thresholds(self, il: int) -> dict[str, float] | None:
        """Layer il's load-aware thresholds in force (kx_thr_info as a dict), None when off."""
        info = capi.ThrInfo()
        if _lib.kx_model_thresholds(self._model.model, il, ctypes.byref(info)):
            return None
        return {name: getattr(info, name) for name, _ in capi.ThrInfo._fields_}

    def mapped_neurons(self, il: int) -> int:
        """How many of layer il's neurons the GPU computes from mapped host rows."""
        n = _lib.kx_model_slots_mapped(self._model.model, il)
        if n < 0:
            raise IndexError(f"layer {il} is out of range")
        return int(n)

    def swap_slots(self, il: int, evict: Sequence[int] = (), admit: Sequence[int] = ()) -> None:
        """Between decodes: neurons `evict` leave layer il's slots, neurons `admit` take the
        freed (or empty) slots, their rows copied from the host weights. Outputs do not
        change, only which side computes each neuron. ValueError (nothing changed) for a
        neuron that is not resident / already resident, or more loads than free slots."""
        ev = (ctypes.c_int32 * max(len(evict), 1))(*evict)
        ad = (ctypes.c_int32 * max(len(admit), 1))(*admit)
        err = ctypes.create_string_buffer(512)
        if _lib.kx_model_slots_swap(self._model.model, il, ev, len(evict), ad, len(admit), err, len(err)):
            raise ValueError(err.value.decode())

    def start_balancer(self, config: Any = True, *, decide: str = "auto", observe: bool = False,
                       max_blocks: int = 32, cpu_gbs: float = 0.0, gpu_gbs: float = 0.0,
                       pipeline: bool = False, late_every: int = 0, wait_limit_ms: int = 0, fail_at: int = 0,
                       hang_at: int = 0, trace_keep: int = 0, backoff: Any = None) -> None:
        """Starts the live balancer on this model's slots (a BalancerConfig, True for the
        defaults, None to stop it): from the next decode on, the runtime ends every decode
        with a balancing step. ValueError without slots or with a bad configuration.
        decide: where the TAM step runs: auto (one kernel for every layer on the slots' GPU,
        else a host worker thread), worker, inline (the calling thread); observe: record what
        ran (hits) and move nothing, the static split's figures; cpu_gbs / gpu_gbs: matvec
        rates of the stall model (0: the hw_profile's, else kairox.costs.Rates' defaults);
        max_blocks: the gather kernel's share of the GPU; pipeline: decide one layer ahead within each decode (the pack's
        predictor forecasts layer i+1 from layer i's input; its loads land before it runs;
        decide then: auto / inline on the compute threads, worker on the balancer's thread);
        late_every (tests): every n-th reload batch of a layer is treated as landing late;
        wait_limit_ms: how long a boundary waits for reloads before the balancer stops (0:
        10 s); fail_at / hang_at (tests, fault injection): the n-th reload batch fails to
        queue / never finishes; trace_keep: records kept in memory for balance_trace(), the
        newest (0: 262144; a trace file gets every one); backoff: a kairox.backoff.BackoffConfig
        (the balancer holds itself wherever it does not measurably pay; None: it always runs)."""
        if decide not in DECIDE:
            raise ValueError(f"decide must be one of {', '.join(DECIDE)}, not {decide!r}")
        err = ctypes.create_string_buffer(1024)
        if config is None or config is False:
            _lib.kx_model_balancer_start(self._model.model, None, err, 1024)
            self._kx_refresh_graph()
            return
        cfg = BalancerConfig() if config is True else config
        rates = self.kx_options.rates
        p = capi.BalanceParams(cfg.native(), cpu_gbs or rates.cpu_gbs, gpu_gbs or rates.gpu_gbs,
                               RELOAD_METHODS.index(self.kx_options.reload_method), max_blocks, DECIDE.index(decide),
                               int(self.kx_options.balancer_record), int(observe), int(pipeline), late_every,
                               wait_limit_ms, fail_at, hang_at, trace_keep)
        if backoff is not None:
            p.backoff = backoff.native()
        if _lib.kx_model_balancer_start(self._model.model, ctypes.byref(p), err, 1024):
            raise ValueError(err.value.decode("utf-8", "replace"))
        self._kx_refresh_graph()

    def _kx_refresh_graph(self) -> None:
        # the pipeline's graph nodes come and go with it: the next decode builds its graph anew
        err = ctypes.create_string_buffer(256)
        _lib.kx_context_set_sparse(self._ctx.ctx, _lib.kx_context_get_sparse(self._ctx.ctx), err, 256)

    def balance(self) -> None:
        """One more balancing step (the runtime makes one after every decode by itself)."""
        err = self._kx_err = getattr(self, "_kx_err", None) or ctypes.create_string_buffer(1024)  # per token: reused
        if _lib.kx_context_balance(self._ctx.ctx, err, 1024):
            raise RuntimeError(err.value.decode("utf-8", "replace"))

    def drain_balancer(self) -> None:
        """Applies every decision made so far and waits for its reloads."""
        err = ctypes.create_string_buffer(1024)
        if _lib.kx_model_balance_drain(self._model.model, err, 1024):
            raise ValueError(err.value.decode("utf-8", "replace"))

    def balance_trace(self) -> list[dict[str, Any]]:
        """Every balancing step so far, one dict per step and hybrid layer (struct
        kx_balance_record: active and hit counts, loads, evictions, stall, λ, waits)."""
        n = _lib.kx_model_balance_trace(self._model.model, None, 0)
        arr = (BalanceRecord * max(n, 1))()
        n = min(n, _lib.kx_model_balance_trace(self._model.model, arr, n))
        out = []
        for r in arr[:n]:
            d = {f: getattr(r, f) for f, _ in BalanceRecord._fields_ if f != "pad"}
            d["stall"] = STALLS[d["stall"]]
            out.append(d)
        return out

    def backoff_trace(self) -> list[tuple[float, float | None, bool]]:
        """The back-off's measured tokens, oldest first: seconds, the static split's hit rate
        where it counted one (else None), and whether the balancer ran after it."""
        n = _lib.kx_model_backoff_trace(self._model.model, None, None, None, 0)
        s, h, on = (ctypes.c_double * max(n, 1))(), (ctypes.c_double * max(n, 1))(), (ctypes.c_uint8 * max(n, 1))()
        n = min(n, _lib.kx_model_backoff_trace(self._model.model, s, h, on, n))
        return [(s[i], h[i] if h[i] >= 0 else None, bool(on[i])) for i in range(n)]

    def balance_activity(self, step: int, il: int) -> list[int]:
        """Record mode: the active neurons of layer il that step `step` was decided from."""
        n = _lib.kx_model_balance_activity(self._model.model, step, il, None, 0)
        if n < 0:
            raise ValueError(f"no activity kept for step {step}, layer {il} (balancer_record=True keeps it)")
        arr = (ctypes.c_int32 * max(n, 1))()
        _lib.kx_model_balance_activity(self._model.model, step, il, arr, n)
        return list(arr[:n])

    @property
    def pack_has_predictor(self) -> bool:
        return bool(_lib.kx_model_pack_has_predictor(self._model.model))

    def set_sparse(self, mode: str) -> None:
        """Switch the FFN mode (dense, exact, predicted, threshold) for the following decodes.

        Raises ValueError when the mode needs a pack (or a predictor) that is not loaded."""
        if mode not in SPARSE_MODES:
            raise ValueError(f"sparse mode must be one of {', '.join(SPARSE_MODES)}, not {mode!r}")
        err = ctypes.create_string_buffer(1024)
        if _lib.kx_context_set_sparse(self._ctx.ctx, SPARSE_MODES.index(mode), err, 1024):
            raise ValueError(err.value.decode("utf-8", "replace"))
        self.sparse = mode
        self._warn_if_approximate(stacklevel=3)

    @property
    def n_layer(self) -> int:
        return int(_C.llama_model_n_layer(self._model.model))

    @property
    def sparse_layers(self) -> int:
        """Layers whose FFN runs sparse outside the hybrid: in predicted and threshold mode those
        whose pack-measured lists are sparse enough to gain (every layer when the pack has no
        such measure); in exact mode every layer of a ReLU model and none of a gated one."""
        if self.sparse in ("predicted", "threshold"):
            return int(_lib.kx_model_sparse_layers(self._model.model))
        if self.sparse == "exact" and _lib.kx_model_pack_activation(self._model.model) == b"relu":
            return self.n_layer
        return 0

    def _warn_if_approximate(self, stacklevel: int) -> None:
        act = _lib.kx_model_pack_activation(self._model.model)
        if self.sparse == "threshold" and act is not None and act != b"relu":
            warnings.warn(SparseApproximationWarning(
                f"kairox: threshold mode on a {act.decode()} model skips the activations at or below the pack's "
                "per-layer thresholds: the output is close to dense, not equal"),
                stacklevel=stacklevel)

    def close(self) -> None:
        # A constructor that raised before the base class set up its resources leaves
        # nothing to close; the base class would raise AttributeError from __del__.
        if hasattr(self, "_stack"):
            super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(dataclasses.asdict(self.kx_options))
        if self.kx_options.wants_sparse:
            state["sparse"] = self.sparse  # the mode in force, not the one asked for
        return state
