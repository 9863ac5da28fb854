"""`kairox.Llama`: llama_cpp.Llama on kairox's patched llama.cpp, with validated options.

Without kairox options it is llama_cpp.Llama, call for call: same model and context
parameters, same sampling, chat, streaming and tokenizer. It differs in two ways a user
can only gain from: keyword arguments neither class knows raise TypeError (the base
class silently swallows them, so a typo would go unnoticed), and a model that fails to
load raises ModelLoadError (a ValueError, as before) that carries llama.cpp's reason.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import inspect
import threading
from typing import Any

from ._native import load_llama_cpp

llama_cpp = load_llama_cpp()
_C = llama_cpp.llama_cpp

_BASE_KWARGS = frozenset(
    p.name for p in inspect.signature(llama_cpp.Llama.__init__).parameters.values()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclasses.dataclass(frozen=True)
class KairoxOptions:
    """Options kairox adds to llama_cpp.Llama. Each field is a keyword of kairox.Llama;
    the defaults reproduce llama.cpp exactly."""

    def __post_init__(self) -> None:
        pass


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


class Llama(llama_cpp.Llama):
    __doc__ = (llama_cpp.Llama.__doc__ or "") + __doc__

    def __init__(self, model_path: str, *args: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _BASE_KWARGS - _KX_KWARGS)
        if unknown:
            raise TypeError(
                f"kairox.Llama got unknown keyword argument(s) {', '.join(unknown)}; "
                f"kairox adds {sorted(_KX_KWARGS) or 'none'} to llama_cpp.Llama's own")
        self.kx_options = KairoxOptions(**{k: kwargs.pop(k) for k in _KX_KWARGS if k in kwargs})
        _errors.take()
        try:
            super().__init__(model_path, *args, **kwargs)
        except ValueError as e:
            why = _errors.take()
            if why and "Failed to load model" in str(e):
                raise ModelLoadError(f"{e}: " + " | ".join(why)) from None
            raise

    def close(self) -> None:
        # A constructor that raised before the base class set up its resources leaves
        # nothing to close; the base class would raise AttributeError from __del__.
        if hasattr(self, "_stack"):
            super().close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(dataclasses.asdict(self.kx_options))
        return state
