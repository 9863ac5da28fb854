#!/usr/bin/env python3
"""Regenerate patches/ from an edited vendor/llama.cpp.

Edit files in vendor/llama.cpp, then run this script. Each changed file's edits go to
the last patch that already touches that file, so a patch keeps its one concern; a
file no patch touches yet needs --new NNNN-short-name, which starts a new patch (and
--take FILE gives it a touched file's new edits when they are a concern of their own).
Patches are plain unified diffs (a/ and b/ prefixes, applied with patch -p1).
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vendor  # noqa: E402

# A file's "--- "/"+++ " header pair; a deleted file is named only on its "--- a/" line.
FILE_RE = re.compile(r"^--- (?:a/(\S+)|/dev/null)[^\n]*\n\+\+\+ (?:b/(\S+)|/dev/null)", re.M)


def text_of(path: Path) -> str:
    # Bytes as they are: no newline translation, and no failure on non-UTF-8 bytes.
    return path.read_bytes().decode("utf-8", "surrogateescape")


def patch_files(patch: Path) -> list[str]:
    return [a or b for a, b in FILE_RE.findall(text_of(patch))]


def read(tree: Path, rel: str) -> list[str] | None:
    p = tree / rel
    # Lines end at "\n" only, as patch reads them: splitlines() would also split at \r, \f,
    # \x1c-\x1e, U+2028 ... and write hunks patch cannot parse.
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text_of(p)) if p.exists() else None


def file_diff(rel: str, before: list[str] | None, after: list[str] | None) -> str:
    a = f"a/{rel}" if before is not None else "/dev/null"
    b = f"b/{rel}" if after is not None else "/dev/null"
    lines = list(difflib.unified_diff(before or [], after or [], a, b, n=3))
    out = []
    for ln in lines:
        out.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return "".join(out)


def changed_files(expected: Path, edited: Path) -> list[str]:
    names = set()
    for root in (expected, edited):
        names |= {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    names.discard(vendor.STAMP_NAME)
    def raw(root: Path, n: str) -> bytes | None:
        p = root / n
        return p.read_bytes() if p.exists() else None
    return sorted(n for n in names if raw(expected, n) != raw(edited, n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", metavar="NNNN-name",
                    help="name of a new patch for edited files no existing patch touches")
    ap.add_argument("--take", nargs="+", metavar="FILE", default=[],
                    help="with --new: files an earlier patch touches whose new edits are a new concern "
                         "(they go to the new patch instead of the last patch touching them)")
    ap.add_argument("-m", "--message", default="",
                    help="description written at the top of the new patch (its one concern)")
    ap.add_argument("--dry-run", action="store_true", help="say what would change, write nothing")
    args = ap.parse_args(argv)

    lock = vendor.load_lock()
    patches = vendor.patch_list()
    owners: dict[str, Path] = {}
    for p in patches:
        for f in patch_files(p):
            owners[f] = p   # the last patch touching a file owns its new edits

    with tempfile.TemporaryDirectory() as tmp:
        expected = Path(tmp) / "expected"
        vendor.build_tree(expected, lock)
        changed = changed_files(expected, vendor.TREE)
        if not changed:
            print("mkpatches: vendor/llama.cpp matches patches/; nothing to do")
            return 0
        if args.take and not args.new:
            print("mkpatches: --take needs --new NNNN-name (the patch taking those files' edits)")
            return 2
        orphans = [f for f in changed if f not in owners or f in args.take]
        new_patch = None
        if orphans:
            if not args.new:
                print("mkpatches: these files are edited but no patch touches them; "
                      "name a new patch with --new NNNN-name:\n  " + "\n  ".join(orphans))
                return 2
            name = args.new if args.new.endswith(".patch") else args.new + ".patch"
            new_patch = vendor.PATCHES / name
            for f in orphans:
                owners[f] = new_patch
        # Replay the series; a patch's owned+changed files take their edited content.
        state = Path(tmp) / "state"
        vendor.extract_trimmed(vendor.fetch_sdist(lock), lock, state)
        series = patches + ([new_patch] if new_patch and new_patch not in patches else [])
        for p in series:
            files = patch_files(p) if p.exists() else []
            files += [f for f in changed if owners[f] == p and f not in files]
            before = {f: read(state, f) for f in files}
            if p.exists():
                vendor.apply_patch(state, p)
            for f in files:
                if f in changed and owners[f] == p:
                    src = vendor.TREE / f
                    dst = state / f
                    if src.exists():
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        dst.write_bytes(src.read_bytes())
                    elif dst.exists():
                        dst.unlink()
            body = "".join(file_diff(f, before[f], read(state, f)) for f in files)
            old = text_of(p) if p.exists() else None
            header = (args.message.strip() + "\n\n") if (p == new_patch and not old and args.message) else ""
            if old:
                # The description ends at the first file header (it may itself hold "--- ").
                first = FILE_RE.search(old)
                header = old[: first.start()] if first else old
            text = header + body
            if text != old:
                print(f"mkpatches: {'would write' if args.dry_run else 'wrote'} {p.relative_to(vendor.ROOT)}")
                if not args.dry_run:
                    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    if not args.dry_run:
        # The tree now equals pristine + patches: refresh the stamp so vendor.py sees no edits.
        want = vendor.wanted_stamp(lock)
        stamp = dict(want, tree=vendor.tree_digest(vendor.TREE), commit=lock["llama_cpp"]["commit"])
        (vendor.TREE / vendor.STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except vendor.VendorError as e:
        print(f"mkpatches: error: {e}", file=sys.stderr)
        sys.exit(2)
