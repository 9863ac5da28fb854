#!/usr/bin/env python3
"""Slot reload transfer methods on the GPU machine (bench/cuda/kx-reload-bench.cu).

Moves rows from page-locked host memory into device memory in runs of 1, 8 or 32 contiguous
rows picked at random (a neuron's row, or a group of neurons stored together), by
  gather  one kernel reading mapped host memory (zero-copy), its grid capped at --max-blocks
  memcpy  one cudaMemcpyAsync per run (the copy engine)
  batch   one cudaMemcpyBatchAsync for all runs
and reports, per method and run length: GB/s alone; GB/s beside a device-memory-bound kernel
stream of about the same length and that stream's slowdown; and the worst time of a 64 KiB
host-to-device copy on a third stream (a decode's activation transfer) while the reload runs,
next to the same copy's time alone.

The measurement ships in no library: it is compiled with nvcc on first use (kept under
$KAIROX_CACHE/bench, default ~/.cache/kairox/bench, by the hash of its source and the toolkit)
and drives the reload engine (cuda/kx-reload.cu) that the CUDA backend's registry hands out as
"kx_reload_iface", from the ggml libraries of KAIROX_LIB_DIR (or the installed kairox).

  python3 bench/reload.py --row-bytes 8192 --rows 8192 --out bench/results/reload
Writes <out>/reload-methods.json (raw, with the command) and .md.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
from kairox.bench import git_commit, machine_facts, write_results  # noqa: E402

METHODS = ("gather", "memcpy", "batch")
SOURCE = ROOT / "bench" / "cuda" / "kx-reload-bench.cu"
INCLUDE = ROOT / "ggml_ext" / "include"
LIB_NAME = "libkx-reload-bench.so"
# native code for the H100/H200 (the build's KAIROX_CUDA_ARCHITECTURES default, 90; the busy
# stream's grid is sized for their 132 SMs), PTX for any other GPU the toolkit supports
ARCH = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_75,code=compute_75"]


class NvccNotFound(RuntimeError):
    pass


def find_nvcc() -> str:
    """nvcc on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("nvcc")
    if found:
        return found
    for d in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if d and os.access(Path(d) / "bin" / "nvcc", os.X_OK):
            return str(Path(d) / "bin" / "nvcc")
    raise NvccNotFound(f"nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): {SOURCE.relative_to(ROOT)} "
                       "is compiled on first use; install the CUDA toolkit or put its bin/ on PATH")


def nvcc_command(nvcc: str, out: Path) -> list[str]:
    return [nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", *ARCH, "-I", str(INCLUDE),
            "-o", str(out), str(SOURCE)]


def build_bench(cache: Path | None = None) -> Path:
    """The benchmark's shared library, compiled once per source, header and toolkit under `cache`
    (default $KAIROX_CACHE/bench); NvccNotFound without nvcc, RuntimeError with nvcc's output
    when it does not compile."""
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), (INCLUDE / "kx-reload.h").read_bytes(),
                 " ".join(nvcc_command(nvcc, Path(LIB_NAME))).encode(), version.encode()):
        h.update(part)
    if cache is None:
        from kairox.default_model import cache_root
        cache = cache_root() / "bench"
    lib = Path(cache) / f"kx-reload-bench-{h.hexdigest()[:16]}" / LIB_NAME
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{LIB_NAME}.{os.getpid()}.tmp")  # renamed when whole: no half-written library
    cmd = nvcc_command(nvcc, tmp)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    os.replace(tmp, lib)
    return lib


def reload_iface() -> int:
    """The CUDA backend's reload engine (const struct kx_reload_iface *), from the ggml libraries
    kairox loads: the registry's proc "kx_reload_iface" is ggml_cuda_kx_reload_iface, a function
    returning it (kx_reload_iface_get_t, include/kx-reload.h)."""
    from kairox._native import find_lib_dir, ggml_library
    lib = ggml_library("ggml")
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    reg = lib.ggml_backend_reg_by_name(b"CUDA")
    if not reg:
        raise RuntimeError(f"the ggml libraries in {find_lib_dir()} have no CUDA backend (build with KAIROX_CUDA=ON)")
    get = lib.ggml_backend_reg_get_proc_address(reg, b"kx_reload_iface")
    io = ctypes.CFUNCTYPE(ctypes.c_void_p)(get)() if get else None
    if not io:
        raise RuntimeError(f"the CUDA backend in {find_lib_dir()} hands out no reload engine (\"kx_reload_iface\")")
    return io


def bench_fn():
    """kx_reload_bench bound to the CUDA engine: f(method, row_bytes, group_rows, n_rows,
    max_blocks, reps, out) -> rc."""
    path = build_bench()
    io = reload_iface()  # ggml first: the library's libcudart is then the one already loaded
    f = ctypes.CDLL(str(path)).kx_reload_bench
    f.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32,
                  ctypes.c_int32, ctypes.POINTER(ctypes.c_double)]
    f.restype = ctypes.c_int32
    return functools.partial(f, io)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[8192, 4608],
                    help="bytes per row (8192: an F16 row of 4096; 4608: a Q4_0 row of 8192)")
    ap.add_argument("--rows", type=int, default=8192, help="rows per reload")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 8, 32], help="contiguous rows per run")
    ap.add_argument("--max-blocks", type=int, nargs="+", default=[32, 132], help="gather grid caps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    try:
        f = bench_fn()
    except (RuntimeError, ImportError, OSError) as e:  # no nvcc, no CUDA build, no kairox library
        print(f"reload.py: {e}", file=sys.stderr)
        return 2
    rows = []
    for rb in args.row_bytes:
        for g in args.groups:
            for m, method in enumerate(METHODS):
                for mb in (args.max_blocks if method == "gather" else [0]):
                    out = (ctypes.c_double * 5)()
                    rc = f(m, rb, g, args.rows, max(mb, 1), args.reps, out)
                    r = {"method": method, "row_bytes": rb, "group_rows": g, "max_blocks": mb or None, "rc": rc,
                         "gbs": out[0], "gbs_beside_compute": out[1], "compute_slowdown": out[2],
                         "critical_wait_us": out[3], "critical_alone_us": out[4]}
                    rows.append(r)
                    print(r, flush=True)
    lines = [f"# Slot reload transfer methods ({args.rows} rows per reload, random runs)", "",
             f"commit {git_commit()[:10]}. Beside compute: a kernel stream reading device memory for about as "
             "long as the reload; slowdown = its time with / without the reload. Critical copy: 64 KiB "
             "host-to-device on a third stream while the reload runs (worst), and alone (best).", "",
             "| row bytes | rows per run | method | grid cap | GB/s | GB/s beside compute | compute slowdown | "
             "critical copy worst / alone µs |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["rc"]:
            lines.append(f"| {r['row_bytes']} | {r['group_rows']} | {r['method']} | {r['max_blocks'] or ''} | failed ({r['rc']}) | | | |")
            continue
        lines.append(f"| {r['row_bytes']} | {r['group_rows']} | {r['method']} | {r['max_blocks'] or ''} | {r['gbs']:.1f} | "
                     f"{r['gbs_beside_compute']:.1f} | {r['compute_slowdown']:.2f} | "
                     f"{r['critical_wait_us']:.0f} / {r['critical_alone_us']:.0f} |")
    write_results(Path(args.out) / "reload-methods", {"command": " ".join([sys.executable] + sys.argv),
                                                      "commit": git_commit(), "machine": machine_facts(),
                                                      "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
