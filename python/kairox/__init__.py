"""kairox: run LLMs larger than GPU memory by computing only the FFN neurons that fire.

`kairox.Llama` is a drop-in `llama_cpp.Llama` bound to kairox's patched llama.cpp.
Importing kairox does not load the native library; touching `kairox.Llama` does.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Llama", "ModelLoadError", "__version__"]


def __getattr__(name: str):
    if name in ("Llama", "ModelLoadError"):
        from . import llama
        return getattr(llama, name)
    raise AttributeError(f"module 'kairox' has no attribute {name!r}")
