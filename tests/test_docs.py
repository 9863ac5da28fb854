"""The architecture page names the tree as it is: its source map (scripts/source_map.py) is
current, so every source file is named, and every repository path the page names exists."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "ARCHITECTURE.md"


def test_source_map_is_current() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "source_map.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_path_named_exists() -> None:
    text = PAGE.read_text()
    named = set(re.findall(r"(?<![\w/.-])((?:python|ggml_ext|patches|scripts|bench|tests|docs|\.ci)/[\w./-]*\w)", text))
    # a name may stand for its files (patches/0003, kx-slots.*), and the ggml_ext table names
    # its files from ggml_ext/
    missing = sorted(p for p in named if not any(base.glob(p + "*") for base in (ROOT, ROOT / "ggml_ext")))
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_no_commit_hash_in_a_source_comment() -> None:
    """Comments say why, not when: a measured reason points at its results file, never at the
    commit of the day (scripts/source_map.py's source files; hex words that name a commit of
    this repository)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from source_map import sources
    words: dict[str, list[str]] = {}
    for f in sources():
        for ln in (ROOT / f).read_text(errors="replace").splitlines():
            c = ln.find("//") if not f.endswith((".py", ".sh", ".txt", "run")) else ln.find("#")
            if c >= 0 and not f.endswith(".patch"):
                for w in re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", ln[c:]):
                    words.setdefault(w, []).append(f)
    if not words:
        return
    r = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="\n".join(words) + "\n",
                       capture_output=True, text=True)
    if r.returncode != 0:
        import pytest
        pytest.skip("not a git checkout")
    commits = [ln.split()[0] for ln in r.stdout.splitlines() if ln.endswith(("commit", "tag")) or " commit " in ln]
    named = {w: words[w] for w in words if any(c.startswith(w) for c in commits)}
    assert not named, f"commit hashes in source comments: {named}"


def test_results_index_and_readme_table_are_current() -> None:
    """bench/results/INDEX.md and README.md's results table are what the JSON files say."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "summarize.py"), "--check"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_is_short() -> None:
    """The README is for users: at most 8 KB (history: CHANGELOG.md, docs/results-log.md)."""
    assert len((ROOT / "README.md").read_bytes()) <= 8192
