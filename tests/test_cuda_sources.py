"""CUDA sources compile where nvcc exists (CI has nvcc but no GPU: compile, don't run).

Each ggml_ext/*.cu is compiled alone for sm_90 against the vendored ggml headers, so a
CUDA change that breaks the build fails here, long before it reaches the GPU machine.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "ggml_ext").rglob("*.cu"))
GGML = ROOT / "vendor" / "llama.cpp" / "ggml"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.skipif(not SOURCES, reason="ggml_ext has no CUDA sources yet")
@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_cuda_source_compiles(src: Path, tmp_path: Path):
    if not (GGML / "include" / "ggml.h").exists():
        pytest.skip("vendor/llama.cpp is not laid out (run scripts/vendor.py)")
    cmd = ["nvcc", "-std=c++17", "-O2", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "x.o"),
           "-I", str(ROOT / "ggml_ext" / "include"), "-I", str(ROOT / "ggml_ext" / "cuda"), "-I", str(GGML / "include"), "-I", str(GGML / "src")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
