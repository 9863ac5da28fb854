"""`kairox.Llama`: llama_cpp.Llama on kairox's patched llama.cpp, with validated options.

Without kairox options it is llama_cpp.Llama, call for call: same model and context
parameters, same sampling, chat, streaming and tokenizer. It differs in two ways a user
can only gain from: keyword arguments neither class knows raise TypeError (the base
class silently swallows them, so a typo would go unnoticed), and a model that fails to
load raises ModelLoadError (a ValueError, as before) that carries llama.cpp's reason.

Sparse FFN: `Llama(path, sparse="exact" | "predicted" | "dense", sparse_pack=PACK)`.
The pack defaults to MODEL.kxpack.gguf next to the model; naming a pack without a mode
picks "predicted" when the pack has a predictor, else "exact". A pack that cannot be used
(missing, corrupt, made for another model) emits a SparsePackWarning saying why, and the
model runs dense; `llm.sparse` always tells the mode in force. `llm.set_sparse(mode)`
switches later (the next decode rebuilds its graph).
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import inspect
import os
import threading
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from ._native import load_llama_cpp

llama_cpp = load_llama_cpp()
_C = llama_cpp.llama_cpp

_BASE_KWARGS = frozenset(
    p.name for p in inspect.signature(llama_cpp.Llama.__init__).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


SPARSE_MODES = ("dense", "exact", "predicted")


@dataclasses.dataclass(frozen=True)
class KairoxOptions:
    """Options kairox adds to llama_cpp.Llama. Each field is a keyword of kairox.Llama;
    the defaults reproduce llama.cpp exactly."""
    sparse: str | None = None        # dense | exact | predicted; None: auto if a pack is named
    sparse_pack: str | None = None   # the pack; None: MODEL.kxpack.gguf next to the model
    # hybrid FFN: neurons per layer kept on the GPU (an int for every layer, or one per
    # layer); the rest run on the CPU from host weights, at the same time. None: no slots.
    gpu_slots: int | Sequence[int] | None = None
    slots_device: str | None = None  # ggml device for the slots (None: first GPU; "CPU": tests)

    def __post_init__(self) -> None:
        if self.sparse is not None and self.sparse not in SPARSE_MODES:
            raise ValueError(f"sparse must be one of {', '.join(SPARSE_MODES)}, not {self.sparse!r}")
        if self.sparse_pack is not None and not isinstance(self.sparse_pack, (str, os.PathLike)):
            raise TypeError(f"sparse_pack must be a path, not {type(self.sparse_pack).__name__}")
        if self.gpu_slots is not None:
            vals = [self.gpu_slots] if isinstance(self.gpu_slots, int) else list(self.gpu_slots)
            if not vals or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in vals):
                raise ValueError(f"gpu_slots must be a count >= 0 or one count per layer, not {self.gpu_slots!r}")
            if self.sparse == "dense":
                raise ValueError("gpu_slots needs a sparse mode (exact or predicted), not dense")

    @property
    def wants_sparse(self) -> bool:
        return (self.sparse not in (None, "dense") or (self.sparse is None and self.sparse_pack is not None)
                or self.gpu_slots is not None)

    def slots_for(self, n_layer: int) -> list[int]:
        if isinstance(self.gpu_slots, int):
            return [self.gpu_slots] * n_layer
        vals = list(self.gpu_slots or [])
        if len(vals) != n_layer:
            raise ValueError(f"gpu_slots has {len(vals)} values, the model has {n_layer} layers")
        return vals


class SparsePackWarning(UserWarning):
    """A sparse pack could not be used; the model runs dense."""


_KX_KWARGS = frozenset(f.name for f in dataclasses.fields(KairoxOptions))


class ModelLoadError(ValueError):
    """The model file could not be loaded; the message holds llama.cpp's own errors."""


class _ErrorLog:
    """Keeps llama.cpp's recent error lines while forwarding every line to
    llama-cpp-python's own log callback, so what is printed does not change."""

    def __init__(self, maxlen: int = 16) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=maxlen)
        self.lock = threading.Lock()
        from llama_cpp import _logger
        self._forward = _logger.llama_log_callback

        self._in_error = False

        @_C.llama_log_callback
        def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            # ggml.h: GGML_LOG_LEVEL_ERROR = 4, GGML_LOG_LEVEL_CONT = 5 (continues a line)
            if level == 4 or (level == 5 and self._in_error):
                with self.lock:
                    self.lines.append(text.decode("utf-8", "replace").strip())
            if level != 5:
                self._in_error = level == 4
            # llama-cpp-python's own callback maps ggml's levels off by one (it prints
            # warnings as errors even when verbose=False); pass it only real errors then.
            if self._verbose() or self._in_error:
                self._forward(level, text, user_data)

        self._callback = callback  # keep the ctypes thunk alive
        _C.llama_log_set(callback, ctypes.c_void_p(0))

    @staticmethod
    def _verbose() -> bool:
        import logging
        from llama_cpp import _logger
        return _logger.logger.level <= logging.INFO

    def take(self) -> list[str]:
        with self.lock:
            out = [ln for ln in self.lines if ln]
            self.lines.clear()
        return out


_errors = _ErrorLog()

_lib = _C._lib
_lib.kx_model_load_pack.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.c_char_p, ctypes.c_size_t]
_lib.kx_model_load_pack.restype = ctypes.c_int32
_lib.kx_model_has_pack.argtypes = [ctypes.c_void_p]
_lib.kx_model_has_pack.restype = ctypes.c_bool
_lib.kx_model_pack_has_predictor.argtypes = [ctypes.c_void_p]
_lib.kx_model_pack_has_predictor.restype = ctypes.c_bool
_lib.kx_context_set_sparse.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
_lib.kx_context_set_sparse.restype = ctypes.c_int32
_lib.kx_context_get_sparse.argtypes = [ctypes.c_void_p]
_lib.kx_context_get_sparse.restype = ctypes.c_int32
_lib.kx_model_set_slots.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32,
                                    ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
_lib.kx_model_set_slots.restype = ctypes.c_int32
_lib.kx_model_slots_bytes.argtypes = [ctypes.c_void_p]
_lib.kx_model_slots_bytes.restype = ctypes.c_int64
_lib.kx_model_slots_resident.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int64]
_lib.kx_model_slots_resident.restype = ctypes.c_int64


class _BuftOverride(ctypes.Structure):
    # llama.h: struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; }
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# hybrid layers compute their FFN on the CPU from host weights (and copy the hot rows to
# the GPU slots): the FFN tensors stay in host memory whatever -ngl offloads
_FFN_ON_CPU = rb"blk\.\d+\.ffn_(gate|up|down)\.weight"


def _ffn_on_cpu_overrides() -> ctypes.Array:
    from ._native import ggml_library
    base = ggml_library("ggml-base")
    base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    arr = (_BuftOverride * 2)()
    arr[0].pattern, arr[0].buft = _FFN_ON_CPU, base.ggml_backend_cpu_buffer_type()
    arr[1].pattern, arr[1].buft = None, None
    return arr

# llama.cpp reads model params once, inside the base constructor; sparse mode needs CPU
# weights without repacking (repacked rows are interleaved; row gathers cannot read them)
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
        _errors.take()
        with _params_lock:
            default_params = _C.llama_model_default_params
            if self.kx_options.wants_sparse:
                overrides = _ffn_on_cpu_overrides() if self.kx_options.gpu_slots is not None else None
                self._kx_overrides = overrides  # the struct must outlive the load

                def no_repack():
                    p = default_params()
                    p.use_extra_bufts = False
                    if overrides is not None:
                        p.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
                    return p
                _C.llama_model_default_params = no_repack
            try:
                super().__init__(model_path, *args, **kwargs)
            except ValueError as e:
                why = _errors.take()
                if why and "Failed to load model" in str(e):
                    raise ModelLoadError(f"{e}: " + " | ".join(why)) from None
                raise
            finally:
                _C.llama_model_default_params = default_params
        if self.kx_options.wants_sparse:
            self._kx_attach(model_path)

    def _kx_attach(self, model_path: str) -> None:
        from .pack import pack_path_for
        pack = Path(self.kx_options.sparse_pack or pack_path_for(model_path))
        err = ctypes.create_string_buffer(1024)
        if _lib.kx_model_load_pack(self._model.model, os.fsencode(model_path), os.fsencode(pack), err, 1024):
            self._kx_refuse(err.value.decode("utf-8", "replace"))
            return
        mode = self.kx_options.sparse or ("predicted" if self.pack_has_predictor else "exact")
        if self.kx_options.gpu_slots is not None:
            n_layer = _C.llama_model_n_layer(self._model.model)
            slots = self.kx_options.slots_for(n_layer)
            arr = (ctypes.c_int64 * n_layer)(*slots)
            dev = self.kx_options.slots_device
            if _lib.kx_model_set_slots(self._model.model, arr, n_layer, dev and dev.encode(), err, 1024):
                self._kx_refuse("neuron slots: " + err.value.decode("utf-8", "replace"))
                return
        try:
            self.set_sparse(mode)
        except ValueError as e:
            self._kx_refuse(str(e))

    def _kx_refuse(self, why: str) -> None:
        self.sparse_error = why
        warnings.warn(SparsePackWarning(f"kairox: sparse mode unavailable, running dense: {why}"),
                      stacklevel=3)
        _errors.take()

    @property
    def slots_bytes(self) -> int:
        """Device memory held by the neuron slots (0 without slots)."""
        return int(_lib.kx_model_slots_bytes(self._model.model))

    def slot_residents(self, il: int) -> list[int]:
        """Neuron ids resident in layer il's slots, in slot order ([] without slots)."""
        n = _lib.kx_model_slots_resident(self._model.model, il, None, 0)
        if n < 0:
            raise IndexError(f"layer {il} is out of range")
        buf = (ctypes.c_int32 * max(n, 1))()
        _lib.kx_model_slots_resident(self._model.model, il, buf, n)
        return list(buf[:n])

    @property
    def pack_has_predictor(self) -> bool:
        return bool(_lib.kx_model_pack_has_predictor(self._model.model))

    def set_sparse(self, mode: str) -> None:
        """Switch the FFN mode (dense, exact, predicted) for the following decodes.

        Raises ValueError when the mode needs a pack (or a predictor) that is not loaded."""
        if mode not in SPARSE_MODES:
            raise ValueError(f"sparse mode must be one of {', '.join(SPARSE_MODES)}, not {mode!r}")
        err = ctypes.create_string_buffer(1024)
        if _lib.kx_context_set_sparse(self._ctx.ctx, SPARSE_MODES.index(mode), err, 1024):
            raise ValueError(err.value.decode("utf-8", "replace"))
        self.sparse = mode

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
