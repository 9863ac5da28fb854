"""The host kernels' headers (ggml_ext/cpu) built into small programs of their own at chosen
vector widths: what the library, built for the machine at hand, cannot show. Kept out of the
sanitizer run's files (scripts/sanitize.sh): these link to the library with a plain compiler."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("march", ["native", "haswell"])
def test_down_rows_at_once_match_row_by_row_at_each_vector_width(native: Path, tmp_path: Path, march: str):
    """The rows-at-once down-row kernels (kx_axpy_rows: Q8_0, F16, Q4_K, Q6_K) give the row-by-row
    bits at the width the build machine has (AVX-512 here) and at AVX2's (-march=haswell, what
    an AVX2-only machine builds), 1-4 rows: ggml_ext/tests/kx-axpy-isa.c."""
    import platform
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86 C compiler")
    root = Path(__file__).resolve().parent.parent
    v = root / "vendor/llama.cpp/ggml"
    exe = tmp_path / "axpy-isa"
    subprocess.run([cc, "-O2", f"-march={march}", str(root / "ggml_ext/tests/kx-axpy-isa.c"), "-I", str(v / "include"),
                    "-I", str(v / "src"), "-I", str(v / "src/ggml-cpu"), "-I", str(root / "ggml_ext/cpu"),
                    "-L", str(native), "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{native}", "-o", str(exe)],
                   check=True, capture_output=True)
    p = subprocess.run([str(exe)], capture_output=True, text=True)
    lines = p.stdout.split("\n")
    assert p.returncode == 0, p.stdout
    want_width = 8 if march == "haswell" else int(lines[0].split()[1])
    assert lines[0] == f"width {want_width}" and want_width in (8, 16), lines
    assert lines[1:5] == ["q8_0 ok", "f16 ok", "q4_K ok", "q6_K ok"], lines
