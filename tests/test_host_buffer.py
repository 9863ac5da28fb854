"""kairox's host buffer type (ggml_ext/llama/kx-host.cpp): weights the CPU reads row by row in
2 MiB pages, freed with their mapping. The pack's tensors live in it (every sparse test reads
them); the pinned form is checked on the GPU machine
(tests/test_hybrid.py::test_gpu_host_weights_are_pinned)."""
from __future__ import annotations

from pathlib import Path

import pytest
from fresh import run_fresh, run_fresh_process

HUGE = 2 << 20

# the probes' ctypes declarations of ggml-base
_GGML = r"""
import ctypes as C, mmap, sys
from kairox.llama import _lib
from kairox._native import ggml_library
b = ggml_library("ggml-base")
P = C.c_void_p
b.ggml_backend_buft_alloc_buffer.argtypes, b.ggml_backend_buft_alloc_buffer.restype = [P, C.c_size_t], P
b.ggml_backend_buft_name.argtypes, b.ggml_backend_buft_name.restype = [P], C.c_char_p
"""
# allocates SIZE bytes of the buffer type, writes every byte, prints the base's offset in
# its 2 MiB page, the type's name, the mapping's Rss and AnonHugePages (kB), the first and
# last byte read back, whether the mapping is gone after the free, and the AnonHugePages of
# a plain anonymous mapping of the same size, written the same way (not advised: the control)
_PROBE = _GGML + r"""
b.ggml_backend_buffer_get_base.argtypes, b.ggml_backend_buffer_get_base.restype = [P], P
b.ggml_backend_buffer_is_host.argtypes, b.ggml_backend_buffer_is_host.restype = [P], C.c_bool
b.ggml_backend_buffer_free.argtypes = [P]
size = int(sys.argv[1])
t = _lib.kx_host_buffer_type(sys.argv[2] == "1", 0)
buf = b.ggml_backend_buft_alloc_buffer(t, size)
assert buf and b.ggml_backend_buffer_is_host(buf)
p = b.ggml_backend_buffer_get_base(buf)
C.memset(p, 7, size)
data = (C.c_uint8 * size).from_address(p)
first, last = data[0], data[size - 1]
def mapping(p):
    lines = open("/proc/self/smaps").read().split("\n")
    for i, ln in enumerate(lines):
        lo, _, hi = ln.split(" ")[0].partition("-")
        if hi and int(lo, 16) <= p < int(hi, 16):
            kv = {}
            for x in lines[i + 1:]:
                if x.startswith("VmFlags"):  # the entry's last line
                    break
                k, _, v = x.partition(":")
                kv[k] = v
            return int(kv["Rss"].split()[0]), int(kv["AnonHugePages"].split()[0])
    return None
rss, huge = mapping(p)
b.ggml_backend_buffer_free(buf)
gone = mapping(p) is None
plain = mmap.mmap(-1, size)
q = C.addressof(C.c_char.from_buffer(plain))
C.memset(q, 7, size)
_, plain_huge = mapping(q)
print(p % (2 << 20), b.ggml_backend_buft_name(t).decode(), rss, huge, first, last, gone, plain_huge)
"""


def probe(native: Path, size: int, pinned: bool) -> tuple[int, str, int, int, int, int, bool, int]:
    off, name, rss, huge, first, last, gone, plain_huge = run_fresh(native, _PROBE, str(size),
                                                                    "1" if pinned else "0").split()
    return int(off), name, int(rss), int(huge), int(first), int(last), gone == "True", int(plain_huge)


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.parametrize("pinned", [False, True])
def test_host_buffer_is_aligned_host_memory_freed_with_its_mapping(native: Path, pinned: bool):
    """Base on a 2 MiB boundary, host memory, every byte writable and read back, the whole
    mapping gone after the free. Pinned without a GPU is the same memory, left pageable."""
    size = 5 * HUGE + 12345  # not a whole number of huge pages: the tail is mapped too
    off, name, rss, _, first, last, gone, _ = probe(native, size, pinned)
    assert off == 0
    assert name == ("KX_Host_Pinned" if pinned else "KX_Host")
    assert rss * 1024 >= size
    assert (first, last) == (7, 7)
    assert gone


def test_host_buffer_pages_are_huge(native: Path):
    """Where the kernel gives transparent huge pages on request (enabled: madvise or always),
    the buffer's pages are huge. Under madvise a plain anonymous mapping of the same size,
    which does not ask, gets none: the pages come from the buffer type's advice."""
    mode = thp_mode()
    if mode == "never":
        pytest.skip("transparent huge pages are off on this machine")
    size = 16 * HUGE
    *_, huge, _, _, _, plain_huge = probe(native, size, False)
    # most of it: the kernel may fall back to small pages where it finds no free 2 MiB page
    assert huge * 1024 >= size // 2, huge
    if mode == "madvise":
        assert plain_huge == 0, plain_huge


_REFUSED = _GGML + r"""
plain, refused = _lib.kx_host_buffer_type(True, 0), _lib.kx_host_buffer_type(True, int(sys.argv[1]))
print(plain != refused, b.ggml_backend_buft_name(refused).decode(),
      bool(b.ggml_backend_buft_alloc_buffer(refused, 1 << 20)))
"""


def test_refused_host_memory_is_no_buffer(native: Path):
    """Fault injection (KX_FAULT_HOST_MAP): the buffer type with the fault is a type of its
    own (ggml compares types by address) and its allocation returns no buffer, with a line
    saying how much host memory could not be mapped; the model load then fails
    (tests/test_load_faults.py on the GPU machine)."""
    from kairox import capi
    r = run_fresh_process(native, _REFUSED, str(capi.FAULTS["host_map"]))
    assert r.stdout.split() == ["True", "KX_Host_Pinned", "False"]
    assert "cannot map 1.00 MiB of host memory" in r.stderr
