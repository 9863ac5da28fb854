"""kairox: run LLMs larger than GPU memory by computing only the FFN neurons that fire.

`kairox.Llama` is a drop-in `llama_cpp.Llama` bound to kairox's patched llama.cpp.
Importing kairox does not load the native library; touching `kairox.Llama` does. It
does point a later `import llama_cpp` at kairox's libllama (LLAMA_CPP_LIB_PATH).
"""
from __future__ import annotations

import os as _os
import sys as _sys

from . import _native
from ._version import __version__

if "llama_cpp.llama_cpp" not in _sys.modules:
    try:
        _os.environ["LLAMA_CPP_LIB_PATH"] = str(_native.find_lib_dir())
    except _native.NativeLibraryNotFound:
        pass  # kairox.Llama will say so; convert/synth/info work without it

_LLAMA_NAMES = ("Llama", "ModelLoadError", "SparsePackError", "SparsePackWarning", "SparseApproximationWarning",
                "SparseNoGainWarning", "HostMemoryWarning", "VramBudgetError")
__all__ = [*_LLAMA_NAMES, "__version__"]


def __getattr__(name: str):
    if name in _LLAMA_NAMES:
        from . import llama
        return getattr(llama, name)
    raise AttributeError(f"module 'kairox' has no attribute {name!r}")
