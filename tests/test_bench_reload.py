"""The reload benchmark (bench/reload.py) builds where nvcc exists: bench/cuda/kx-reload-bench.cu
compiled by the script's own nvcc command into a library exporting kx_reload_bench and using the
shared CUDA runtime (the one libggml-cuda loads), and the shipped engine keeps no benchmark.
The measurement itself needs a GPU (bench/device/hybrid.sh, KX_RELOAD=1)."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("reload_bench", ROOT / "bench" / "reload.py")
reload_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reload_bench)


@pytest.fixture
def nvcc() -> str:
    try:
        return reload_bench.find_nvcc()
    except reload_bench.NvccNotFound as e:
        pytest.skip(str(e))


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.skip(f"{name} (binutils) not installed")
    return path


def test_bench_library_builds_and_exports_the_bench(nvcc: str, tmp_path: Path) -> None:
    lib = reload_bench.build_bench(tmp_path)
    assert lib.is_file() and lib.parent.parent == tmp_path
    syms = subprocess.run([_tool("nm"), "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"^\S+ T kx_reload_bench$", syms, re.M), syms
    # the engine comes in through its table: the library defines none of it
    assert "kx_reload_create" not in syms and "ggml_cuda_kx_reload_iface" not in syms
    needed = subprocess.run([_tool("readelf"), "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"NEEDED.*\[libcudart\.so", needed), needed
    # built once: a second call finds it
    mtime = lib.stat().st_mtime_ns
    assert reload_bench.build_bench(tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    assert not list(lib.parent.glob("*.tmp"))


def test_a_source_that_does_not_compile_is_an_error_with_nvccs_output(nvcc: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('#include "kx-reload.h"\nextern "C" int kx_reload_bench(void) { return undeclared_name; }\n')
    monkeypatch.setattr(reload_bench, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="undeclared_name"):
        reload_bench.build_bench(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.so*"))


def test_the_shipped_engine_holds_no_benchmark() -> None:
    src = (ROOT / "ggml_ext" / "cuda" / "kx-reload.cu").read_text()
    assert "reload_bench" not in src.replace("bench/cuda/kx-reload-bench.cu", "")
    assert "busy_kernel" not in src
