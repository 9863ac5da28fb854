"""Run test code in a fresh Python process (test helper): a probe of the process's own memory
(/proc/self/smaps) then sees only what it allocated, and an environment set for it stays
out of the test process. The child sees this process's import path plus the tests folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_fresh_process(native: Path, code: str, *args: str,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -c code args...` with the library at `native` and env added; it must exit 0."""
    path = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    r = subprocess.run([sys.executable, "-c", code, *args],
                       env=dict(os.environ, KAIROX_LIB_DIR=str(native), PYTHONPATH=path, **(env or {})),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def run_fresh(native: Path, code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """run_fresh_process's stdout."""
    return run_fresh_process(native, code, *args, env=env).stdout
