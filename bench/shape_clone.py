#!/usr/bin/env python3
"""A layout clone of a GGUF model: same header, same tensor bytes count, tiled data.

The GPU machine receives at most 64 MiB per call, so a real model larger than that cannot
be benchmarked there. Dense llama.cpp speed depends on tensor shapes and types, not on
values, so a clone whose header is byte-identical (metadata, tokenizer, tensor names,
shapes, types and offsets) and whose data is made of real blocks of each type runs at the
same speed. `extract` keeps the header, every F32 tensor whole (norms: small) and the
first MiB of one tensor per quantized type; `expand` writes the clone, tiling each
quantized tensor from its type's sample (whole blocks, so every block stays valid).
The clone's outputs are meaningless; use it for speed only.

  python3 bench/shape_clone.py extract model.gguf model.kxshape
  python3 bench/shape_clone.py expand model.kxshape clone.gguf
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

MAGIC = b"KXSHAPE1"
SAMPLE = 1 << 20


def extract(src: Path, dst: Path) -> None:
    import gguf

    from kairox.gguf_header import scan_header

    hdr = scan_header(src)
    start = min(t.offset for t in hdr.tensors)
    data = src.read_bytes()
    samples: dict[int, bytes] = {}
    whole: dict[str, bytes] = {}
    for t in hdr.tensors:
        qt = gguf.GGMLQuantizationType(t.type_id)
        if qt == gguf.GGMLQuantizationType.F32:
            whole[t.name] = data[t.offset:t.offset + t.nbytes]
        elif t.type_id not in samples:
            tsize = gguf.GGML_QUANT_SIZES[qt][1]
            n = min(t.nbytes, SAMPLE) // tsize * tsize
            samples[t.type_id] = data[t.offset:t.offset + n]
    index = {"file_size": hdr.file_size, "header": start,
             "tensors": [[t.name, t.type_id, t.offset, t.nbytes] for t in hdr.tensors],
             "samples": {str(k): len(v) for k, v in samples.items()}, "whole": {k: len(v) for k, v in whole.items()}}
    meta = json.dumps(index).encode()
    with open(dst, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(meta)) + meta + data[:start])
        for k in index["samples"]:
            f.write(samples[int(k)])
        for k in index["whole"]:
            f.write(whole[k])
    print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB for a {hdr.file_size / 2**20:.0f} MiB model")


def expand(src: Path, dst: Path) -> None:
    raw = src.read_bytes()
    if raw[:8] != MAGIC:
        raise SystemExit(f"{src} is not a shape file")
    (n,) = struct.unpack("<Q", raw[8:16])
    index = json.loads(raw[16:16 + n])
    pos = 16 + n
    header = raw[pos:pos + index["header"]]
    pos += index["header"]
    samples = {}
    for k, size in index["samples"].items():
        samples[int(k)] = raw[pos:pos + size]
        pos += size
    whole = {}
    for k, size in index["whole"].items():
        whole[k] = raw[pos:pos + size]
        pos += size
    tmp = dst.with_name(dst.name + ".part")
    with open(tmp, "wb") as f:
        f.write(header)
        for name, type_id, offset, nbytes in sorted(index["tensors"], key=lambda t: t[2]):
            f.write(b"\0" * (offset - f.tell()))  # alignment padding, as in the original
            if name in whole:
                f.write(whole[name])
                continue
            s = samples[type_id]
            reps, rest = divmod(nbytes, len(s))
            for _ in range(reps):
                f.write(s)
            f.write(s[:rest])  # rest is whole blocks: nbytes and len(s) are multiples of the block size
        f.write(b"\0" * (index["file_size"] - f.tell()))
    tmp.replace(dst)
    print(f"{dst}: {dst.stat().st_size / 2**20:.0f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["extract", "expand"])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    a = ap.parse_args()
    (extract if a.action == "extract" else expand)(a.src, a.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
