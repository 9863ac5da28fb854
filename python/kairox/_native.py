"""Where kairox's native build lives, and loading llama-cpp-python on top of it.

llama-cpp-python is installed without its own native build; it loads whatever
libllama `LLAMA_CPP_LIB_PATH` names, read once when `llama_cpp` is first imported.
So kairox sets that variable to its patched build before importing llama_cpp.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import sys
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent
LIB_NAME = "libllama.so"


class NativeLibraryNotFound(ImportError):
    pass


def _candidates() -> list[Path]:
    env = os.environ.get("KAIROX_LIB_DIR")
    if env:
        return [Path(env)]
    return [PKG_DIR / "lib"]


def find_lib_dir() -> Path:
    """Folder holding kairox's libllama.so and the ggml libraries next to it."""
    for d in _candidates():
        if (d / LIB_NAME).exists():
            return d.resolve()
    where = ", ".join(str(d) for d in _candidates())
    raise NativeLibraryNotFound(
        f"kairox's native library ({LIB_NAME}) was not found in {where}. Install kairox with "
        f"`bash scripts/setup.sh` (or `pip install .`), or point KAIROX_LIB_DIR at a build's lib folder.")


def find_bin_dir() -> Path:
    """Folder holding the patched llama.cpp tools (llama-cli, llama-server, ...)."""
    env = os.environ.get("KAIROX_BIN_DIR")
    if env:
        return Path(env)
    return find_lib_dir().parent / "bin"


def load_llama_cpp():
    """Import llama_cpp bound to kairox's libllama; refuse a llama_cpp bound elsewhere."""
    lib_dir = find_lib_dir()
    mod = sys.modules.get("llama_cpp.llama_cpp")
    if mod is not None:
        bound = Path(getattr(mod, "_lib")._name).resolve().parent
        if bound != lib_dir:
            raise ImportError(
                f"llama_cpp was imported before kairox and is bound to {bound}, not kairox's "
                f"{lib_dir}. Import kairox first (or set LLAMA_CPP_LIB_PATH={lib_dir}).")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    import llama_cpp
    return llama_cpp


_ext: ctypes.CDLL | None = None


def ext() -> ctypes.CDLL:
    """kairox's own extension library (kx_* functions)."""
    global _ext
    if _ext is None:
        lib = ctypes.CDLL(str(find_lib_dir() / "libkairox-ext.so"))
        lib.kx_version.restype = ctypes.c_char_p
        lib.kx_version.argtypes = []
        _ext = lib
    return _ext


@dataclasses.dataclass(frozen=True)
class SparseCounters:
    """What the CPU sparse kernels did since the last reset (all contexts of the process).

    selected/total: rows listed by kx_select over rows possible (density = selected/total);
    calls: selections (one per sparse layer per decode); fallbacks: selections that went
    dense; nonzero: (row, token) pairs with a nonzero activation among the listed rows
    (ReLU: exact mode counts the truly active neurons, predicted mode the ones it got right);
    rows: listed rows the CPU down projections computed (once per call, not per token);
    elsewhere: listed rows a down projection skipped because its row map sends them to the
    other side of a hybrid layer (each listed neuron of a hybrid layer computed on the CPU
    backend is skipped exactly once: by the host part if resident, else by the slots');
    up_skipped: listed rows of ReLU layers whose up row the fused FFN op did not read (its
    gate <= 0 for every token of the call); ffn_calls, ffn_op_ns, ffn_work_max_ns,
    ffn_work_mean_ns: that op's calls, its time (thread 0, entry to exit), and its slowest and
    mean thread's neuron loop, ns summed over calls; ffn_rows_max, ffn_rows_mean: the weight
    rows its busiest and its mean thread read, summed over calls; ffn_stolen: chunks a thread
    took from another thread's share (own shares, after the warm-up) (kx-ops.h).
    """
    selected: int
    total: int
    calls: int
    fallbacks: int
    nonzero: int
    rows: int = 0
    elsewhere: int = 0
    up_skipped: int = 0
    ffn_calls: int = 0
    ffn_op_ns: int = 0
    ffn_work_max_ns: int = 0
    ffn_work_mean_ns: int = 0
    ffn_rows_max: int = 0
    ffn_rows_mean: int = 0
    ffn_stolen: int = 0

    @property
    def density(self) -> float:
        return self.selected / self.total if self.total else 0.0


@functools.lru_cache(maxsize=None)
def ggml_library(name: str) -> ctypes.CDLL:
    """The ggml library `name` ("ggml-cpu", "ggml-base") as this process uses it.

    Installed wheels hold real files, not symlinks, so libggml-cpu.so and libggml-cpu.so.0
    are two copies, and loading the wrong one gives a second instance with its own
    state. Prefer the copy already mapped (loaded as libllama's dependency), else the
    soname (.so.0) that libllama's dependencies name."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if f"/lib{name}.so" in path and Path(path).is_file():
                    return ctypes.CDLL(path)
    except OSError:
        pass
    lib_dir = find_lib_dir()
    for cand in (lib_dir / f"lib{name}.so.0", lib_dir / f"lib{name}.so"):
        if cand.exists():
            return ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
    raise NativeLibraryNotFound(f"lib{name}.so is not in {lib_dir}")


def ggml_quantize(w: "np.ndarray", type_id: int) -> "np.ndarray":
    """Rows of float32 `w` [n, k] quantized by ggml itself (ggml_quantize_chunk, no importance
    matrix) to ggml type `type_id`, as uint8 [n, row bytes]: the K-quants, which gguf.quants
    cannot write. The same function llama-quantize calls, so the same bytes."""
    import numpy as np
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    b = ggml_library("ggml-base")
    b.ggml_row_size.argtypes, b.ggml_row_size.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_size_t
    b.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p]
    b.ggml_quantize_chunk.restype = ctypes.c_size_t
    out = np.empty((n, b.ggml_row_size(type_id, k)), np.uint8)
    got = b.ggml_quantize_chunk(type_id, w.ctypes.data, out.ctypes.data, 0, n, k, None)
    if got != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {out.nbytes}")
    return out


def _first_gpu() -> tuple[ctypes.CDLL, int | None]:
    lib = ggml_library("ggml")
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    return lib, lib.ggml_backend_dev_by_type(1)  # GGML_BACKEND_DEVICE_TYPE_GPU


def has_gpu() -> bool:
    """Whether ggml sees a GPU device (a CUDA build on a machine with a GPU)."""
    return bool(_first_gpu()[1])


def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the first GPU as its driver reports them (cudaMemGetInfo: the
    whole device, every process), or None without a GPU."""
    lib, dev = _first_gpu()
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    if not dev:
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value), int(total.value)


def _read_stats(lib: ctypes.CDLL, fn: str, names: tuple[str, ...], reset: bool) -> dict[str, int]:
    """A kx_*_stats(int64_t * out, bool reset) call: len(names) counters by name."""
    vals = (ctypes.c_int64 * len(names))()
    getattr(lib, fn)(vals, ctypes.c_bool(reset))
    return dict(zip(names, (int(v) for v in vals)))


SCHED_STATS = ("graphs", "splits_ns", "cpu_splits", "cpu_ns", "launches", "launch_ns", "copy_ns", "drain_ns",
               "deferred")


def sched_counters(reset: bool = False) -> dict[str, int]:
    """The scheduler's host time per phase since the last reset (kx_sched_stats, kx-trace.h):
    graphs computed, ns in the split loop, CPU splits and ns computing them, device split
    launches and ns queueing them, ns issuing input copies, ns a CPU split waited for the
    device's read-backs (the device still computing what it needs)."""
    return _read_stats(ggml_library("ggml-base"), "kx_sched_stats", SCHED_STATS, reset)


WARM_STATS = ("calls", "lists", "rows", "bytes")


def warm_counters(reset: bool = False) -> dict[str, int]:
    """The host-cache warm-up's counters since the last reset (kx_warm_stats, kairox.h): warm
    nodes run, those that found a predicted list, rows and bytes read ahead."""
    return _read_stats(load_llama_cpp().llama_cpp._lib, "kx_warm_stats", WARM_STATS, reset)


BALANCE_STATS = ("steps", "ns", "sync_ns", "snap_ns", "wait_ns", "fetch_ns", "apply_ns", "launch_ns", "store_ns",
                 "queue_ns", "held", "homes", "home_loads", "home_ns",
                 "home_late")


def balance_counters(reset: bool = False) -> dict[str, int]:
    """The live balancer's boundary (kx_context_balance) by phase since the last reset
    (kx_balance_stats, kairox.h): boundaries, ns in all, and ns synchronizing the context,
    taking the decode's lists and hits, waiting for the reload stream (or the host decision),
    reading the device decision, applying the last one (host maps), starting the next, and
    applying's device calls: storing slot-map entries, queueing copies; boundaries the back-off
    held the balancer at (kairox.backoff), its returns to the static split (each switch to
    held), the neurons those loaded and the ns they took, and the checks at which a return's
    loads had not yet landed (they enter the slots once they have)."""
    return _read_stats(load_llama_cpp().llama_cpp._lib, "kx_balance_stats", BALANCE_STATS, reset)


FFN_PHASES = ("x_ns", "wait1_ns", "a_ns", "wait2_ns", "b_ns", "wait3_ns", "sums_ns", "skew_ns")


def ffn_phase_counters(reset: bool = False) -> dict[str, int]:
    """Where the fused FFN op's time goes since the last reset (kx_cpu_ffn_phases, kx-ops.h), ns
    summed over calls, each the mean thread's: x conversion, the first barrier's wait, pass a
    (one pass: the whole loop), the second wait, pass b, the last wait, then thread 0's column
    sums, and the spread of the threads' entry times."""
    return _read_stats(ggml_library("ggml-cpu"), "kx_cpu_ffn_phases", FFN_PHASES, reset)


PIPE_STATS = ("steps", "list_ns", "begin_ns", "scan_ns", "end_ns", "queue_ns", "publish_ns")


def pipe_counters(reset: bool = False) -> dict[str, int]:
    """The balancer's pipeline within each decode by phase since the last reset
    (kx_pipe_stats, kairox.h): prefetch steps, ns waiting for the predicted lists, in begin,
    in the scan (thread 0's slice), in end, queueing the copies, in publish."""
    return _read_stats(load_llama_cpp().llama_cpp._lib, "kx_pipe_stats", PIPE_STATS, reset)


def sparse_counters(reset: bool = False) -> SparseCounters:
    lib = ggml_library("ggml-cpu")
    vals = [ctypes.c_int64() for _ in dataclasses.fields(SparseCounters)]
    lib.kx_cpu_select_stats(*[ctypes.byref(v) for v in vals[:4]], ctypes.c_bool(reset))
    lib.kx_cpu_axpy_stats(*[ctypes.byref(v) for v in vals[4:7]], ctypes.c_bool(reset))
    lib.kx_cpu_ffn_stats(*[ctypes.byref(v) for v in vals[7:]], ctypes.c_bool(reset))
    return SparseCounters(*(int(v.value) for v in vals))
