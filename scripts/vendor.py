#!/usr/bin/env python3
"""Fetch the pinned llama.cpp, trim it and apply kairox's patches.

llama.cpp comes from the llama-cpp-python sdist on PyPI named in vendor/lock.toml.
This script downloads it with pip (cached outside the repository, reused offline),
verifies its sha256, extracts the part of vendor/llama.cpp the build needs into
vendor/llama.cpp/ (git-ignored) and applies patches/*.patch in order.

It is idempotent: a tree whose stamp matches the lock and the patches is left alone.
A tree with local edits is never overwritten (save them with scripts/mkpatches.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "vendor" / "lock.toml"
TREE = ROOT / "vendor" / "llama.cpp"
PATCHES = ROOT / "patches"
STAMP_NAME = ".kairox-vendor.json"

# What the build needs, as paths relative to the llama.cpp root. A folder ends in "/".
# ~30 MB instead of the sdist's 176 MB; tools not listed here are not built
# (patch 0001 makes tools/CMakeLists.txt skip absent tool folders).
KEEP = (
    "CMakeLists.txt", "LICENSE", "licenses/", "cmake/", "include/", "src/", "common/",
    "vendor/", "ggml/CMakeLists.txt", "ggml/cmake/", "ggml/include/",
    "ggml/src/ggml-cpu/", "ggml/src/ggml-cuda/",
    "tools/CMakeLists.txt", "tools/llama-bench/", "tools/completion/", "tools/perplexity/",
    "tools/quantize/", "tools/cli/", "tools/server/", "tools/ui/", "tools/mtmd/",
    "ggml/src/ggml-rpc/", "tools/rpc/",     # ggml's RPC backend and its server: a model over machines
    "scripts/ui-assets.cmake",
    "tests/",                               # test-backend-ops for the GPU kernels
    "models/ggml-vocab-llama-spm.gguf",     # vocab of the tiny test models
)
DROP = (
    "tools/server/tests/", "tools/server/bench/", "tools/ui/src/", "tools/ui/tests/",
    "tools/mtmd/tests/", "tools/mtmd/test-",
)


class VendorError(RuntimeError):
    pass


def load_lock() -> dict:
    with open(LOCK, "rb") as f:
        return tomllib.load(f)


def cache_dir() -> Path:
    base = os.environ.get("KAIROX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kairox")
    return Path(base) / "sdist"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(lock: dict, quiet: bool = False) -> Path:
    """Return the verified sdist, downloading it with pip when it is not cached."""
    pkg = lock["llama_cpp_python"]
    cdir = cache_dir()
    path = cdir / pkg["sdist"]
    if path.exists():
        if sha256_file(path) == pkg["sha256"]:
            return path
        bad = path.with_suffix(".corrupt")
        print(f"vendor: cached {path} has the wrong sha256; moved to {bad}, fetching again",
              file=sys.stderr)
        path.replace(bad)
    cdir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"vendor: downloading llama-cpp-python=={pkg['version']} sdist with pip ...",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cdir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
               # only the target as an sdist: ":all:" would also force its build
               # dependencies (cmake) to compile from source for the metadata step
               "--no-binary", "llama-cpp-python",
               "--disable-pip-version-check", "-q", "-d", tmp,
               f"llama-cpp-python=={pkg['version']}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / pkg["sdist"]
        if r.returncode != 0 or not got.exists():
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
            raise VendorError(
                f"cannot download llama-cpp-python=={pkg['version']} and no cached copy at {path}.\n"
                f"Connect to PyPI once (the sdist is then reused offline), or place the file there.\n"
                f"pip said:\n{tail}")
        digest = sha256_file(got)
        if digest != pkg["sha256"]:
            raise VendorError(
                f"sha256 mismatch for {pkg['sdist']}: expected {pkg['sha256']}, got {digest}.\n"
                f"The file on the index differs from the pinned one; refusing to build from it.")
        got.replace(path)
    return path


def _wanted(rel: str) -> bool:
    if any(rel.startswith(d) for d in DROP):
        return False
    for k in KEEP:
        if rel == k or (k.endswith("/") and rel.startswith(k)):
            return True
    # top-level ggml/src files (ggml.c, ggml-backend.cpp, ...), not other backends' folders
    return rel.startswith("ggml/src/") and "/" not in rel[len("ggml/src/"):]


def extract_trimmed(sdist: Path, lock: dict, dest: Path) -> None:
    """Extract the kept part of the sdist's llama.cpp into dest (which must not exist)."""
    prefix = f"llama_cpp_python-{lock['llama_cpp_python']['version']}/{lock['llama_cpp']['subdir']}/"
    dest.mkdir(parents=True)
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            if not m.name.startswith(prefix) or not (m.isfile() or m.issym()):
                continue
            rel = m.name[len(prefix):]
            if not _wanted(rel):
                continue
            m.name = rel
            tar.extract(m, dest, filter="data")
            n += 1
    if n == 0:
        raise VendorError(f"{sdist} holds no {prefix}: not the expected sdist layout")


def patch_list() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def apply_patch(tree: Path, patch: Path) -> None:
    # --fuzz=0: the tree is pinned, so a patch must match it exactly; with patch's default
    # fuzz a hunk whose context lines differ would still "apply", maybe in the wrong place.
    base = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
            "-d", str(tree), "-i", str(patch)]
    dry = subprocess.run(base + ["--dry-run"], capture_output=True, text=True)
    if dry.returncode != 0:
        raise VendorError(f"patch {patch.name} does not apply to the pinned tree:\n"
                          f"{dry.stdout.strip()}\n{dry.stderr.strip()}")
    subprocess.run(base + ["--silent"], check=True)


def tree_digest(tree: Path) -> str:
    """Hash of every file's path and bytes, to notice local edits."""
    h = hashlib.sha256()
    for p in sorted(tree.rglob("*")):
        if p.is_file() and p.name != STAMP_NAME:
            h.update(str(p.relative_to(tree)).encode() + b"\0")
            h.update(p.read_bytes())
    return h.hexdigest()


def wanted_stamp(lock: dict) -> dict:
    return {
        "sdist_sha256": lock["llama_cpp_python"]["sha256"],
        "patches": [[p.name, sha256_file(p)] for p in patch_list()],
        "keep": [*KEEP, "-", *DROP],  # a tree trimmed otherwise is laid out again
    }


def read_stamp(tree: Path) -> dict | None:
    try:
        return json.loads((tree / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def build_tree(dest: Path, lock: dict, patches: list[Path] | None = None) -> None:
    """Pristine trimmed tree plus the given patches (all of patches/ by default)."""
    sdist = fetch_sdist(lock)
    extract_trimmed(sdist, lock, dest)
    for p in patch_list() if patches is None else patches:
        apply_patch(dest, p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true",
                    help="rebuild the tree even if it holds local edits (they are lost)")
    ap.add_argument("--print-sdist", action="store_true",
                    help="fetch and verify the sdist only, and print its path")
    ap.add_argument("--check", action="store_true",
                    help="only report whether the tree is up to date (exit 1 if not)")
    args = ap.parse_args(argv)

    lock = load_lock()
    if args.print_sdist:
        print(fetch_sdist(lock))
        return 0
    want = wanted_stamp(lock)
    have = read_stamp(TREE)
    if have is not None and {k: have.get(k) for k in want} == want:
        if have.get("tree") == tree_digest(TREE):
            print(f"vendor: {TREE.relative_to(ROOT)} is up to date ({len(want['patches'])} patches)")
            return 0
        if not args.force:
            print(f"vendor: {TREE.relative_to(ROOT)} has local edits; save them with "
                  f"scripts/mkpatches.py (or --force to discard)")
            return 0 if not args.check else 1
    if args.check:
        print("vendor: tree missing or out of date")
        return 1
    if TREE.exists():
        if have is not None and have.get("tree") != tree_digest(TREE) and not args.force:
            raise VendorError(
                f"{TREE} holds local edits and the patches changed. Save the edits with "
                f"scripts/mkpatches.py, or rerun with --force to discard them.")
        if have is None and not args.force and any(TREE.iterdir()):
            raise VendorError(f"{TREE} exists without a stamp; move it away or rerun with --force")
    tmp = TREE.with_name(TREE.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build_tree(tmp, lock)
        stamp = dict(want, tree=tree_digest(tmp), commit=lock["llama_cpp"]["commit"])
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(TREE, ignore_errors=True)
    tmp.rename(TREE)
    print(f"vendor: llama.cpp {lock['llama_cpp']['commit']} ready in {TREE.relative_to(ROOT)} "
          f"({len(want['patches'])} patches applied)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except VendorError as e:
        print(f"vendor: error: {e}", file=sys.stderr)
        sys.exit(2)
