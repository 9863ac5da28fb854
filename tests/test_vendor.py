"""scripts/vendor.py and scripts/mkpatches.py against a fake repository and a fake sdist.

Nothing here reaches the network or the real vendor/llama.cpp: every test builds its own
repository layout under tmp_path, points the scripts' module globals at it and answers
pip itself. `patch` runs for real, since applying patches is what is under test.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import mkpatches  # noqa: E402
import vendor  # noqa: E402

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"

# llama.cpp files in the fake sdist: those the trimmed tree keeps, and those it drops.
KEPT = {
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.14)\nproject(llama C)\nadd_subdirectory(src)\n",
    "src/x.c": "".join(f"int f{i}(void) {{ return {i}; }}\n" for i in range(12)),
    "tools/CMakeLists.txt": "add_subdirectory(cli)\nadd_subdirectory(server)\n",
    "ggml/src/ggml.c": "/* ggml */\nint ggml(void) { return 0; }\n",
}
DROPPED = {
    "docs/big.md": "# big docs\n" * 50,
    "ggml/src/ggml-vulkan/v.c": "int vulkan;\n",
    "tools/server/tests/t.py": "def test(): pass\n",
}

# 0002 rewrites a line that 0001 adds, so it applies only after 0001.
P0001 = """\
tools: build only present folders

--- a/tools/CMakeLists.txt
+++ b/tools/CMakeLists.txt
@@ -1,2 +1,3 @@
+# patched by 0001
 add_subdirectory(cli)
 add_subdirectory(server)
"""
P0002 = """\
src: f3 returns 33

--- a/tools/CMakeLists.txt
+++ b/tools/CMakeLists.txt
@@ -1,3 +1,3 @@
-# patched by 0001
+# patched by 0001, then 0002
 add_subdirectory(cli)
 add_subdirectory(server)
--- a/src/x.c
+++ b/src/x.c
@@ -1,7 +1,7 @@
 int f0(void) { return 0; }
 int f1(void) { return 1; }
 int f2(void) { return 2; }
-int f3(void) { return 3; }
+int f3(void) { return 33; }
 int f4(void) { return 4; }
 int f5(void) { return 5; }
 int f6(void) { return 6; }
"""
PATCHED = dict(
    KEPT,
    **{"tools/CMakeLists.txt": "# patched by 0001, then 0002\n" + KEPT["tools/CMakeLists.txt"],
       "src/x.c": KEPT["src/x.c"].replace("return 3;", "return 33;")},
)


def make_sdist(path: Path, files: dict[str, str]) -> bytes:
    """A gzipped tar like the real sdist (reproducible bytes), written to path."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
        add(f"llama_cpp_python-{VERSION}/PKG-INFO", b"Name: llama_cpp_python\n")
        d = tarfile.TarInfo(PREFIX.rstrip("/"))
        d.type, d.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(d)
        for rel, text in files.items():
            add(PREFIX + rel, text.encode())
    data = gzip.compress(raw.getvalue(), mtime=0)
    path.write_bytes(data)
    return data


def files_of(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*"))
            if p.is_file() and p.name != vendor.STAMP_NAME}


def mtimes(tree: Path) -> dict[str, int]:
    return {str(p.relative_to(tree)): p.stat().st_mtime_ns for p in tree.rglob("*")}


def patch_p1(tree: Path, patch: Path) -> None:
    subprocess.run(["patch", "-p1", "--batch", "--silent", "-d", str(tree), "-i", str(patch)],
                   check=True)


class Repo:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch):
        self.root = tmp / "repo"
        (self.root / "vendor").mkdir(parents=True)
        self.patches = self.root / "patches"
        self.patches.mkdir()
        self.tree = self.root / "vendor" / "llama.cpp"
        self.dist = tmp / "dist"
        self.dist.mkdir()
        self.sdist_bytes = make_sdist(self.dist / SDIST, {**KEPT, **DROPPED})
        self.sha256 = hashlib.sha256(self.sdist_bytes).hexdigest()
        (self.root / "vendor" / "lock.toml").write_text(
            f'[llama_cpp_python]\nversion = "{VERSION}"\nsdist = "{SDIST}"\n'
            f'sha256 = "{self.sha256}"\n\n'
            f'[llama_cpp]\ncommit = "abc1234"\nsubdir = "vendor/llama.cpp"\n')
        self.cache = tmp / "cache" / "sdist"
        self.cache.mkdir(parents=True)
        (self.cache / SDIST).write_bytes(self.sdist_bytes)

        monkeypatch.setattr(vendor, "ROOT", self.root)
        monkeypatch.setattr(vendor, "LOCK", self.root / "vendor" / "lock.toml")
        monkeypatch.setattr(vendor, "TREE", self.tree)
        monkeypatch.setattr(vendor, "PATCHES", self.patches)
        monkeypatch.setenv("KAIROX_CACHE", str(tmp / "cache"))

        # pip is answered by self.pip (None: any download fails the test); the rest,
        # `patch` above all, runs for real.
        self.pip = None
        self.pip_calls: list[list[str]] = []
        real_run = subprocess.run

        def run(cmd, *args, **kwargs):
            if list(cmd[1:4]) == ["-m", "pip", "download"]:
                self.pip_calls.append(list(cmd))
                if self.pip is None:
                    raise AssertionError(f"unexpected download: {cmd}")
                return self.pip(cmd)
            return real_run(cmd, *args, **kwargs)

        monkeypatch.setattr(vendor.subprocess, "run", run)

    def add_patch(self, name: str, text: str) -> Path:
        p = self.patches / name
        p.write_text(text)
        return p

    def pip_writes(self, data: bytes):
        """A pip that 'downloads' data as the sdist into its -d folder."""
        def pip(cmd):
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / SDIST).write_bytes(data)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return pip

    def state(self) -> tuple[dict[str, bytes], dict[str, int], bytes]:
        return files_of(self.tree), mtimes(self.tree), (self.tree / vendor.STAMP_NAME).read_bytes()

    def pristine(self, dest: Path) -> Path:
        """The kept files of the sdist, written by the test itself (not by vendor.py)."""
        for rel, text in KEPT.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text)
        return dest


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repo:
    r = Repo(tmp_path, monkeypatch)
    r.add_patch("0001-tools.patch", P0001)
    r.add_patch("0002-src.patch", P0002)
    return r


# ---------------------------------------------------------------- vendor.py


def test_first_run_extracts_kept_files_and_applies_patches_in_order(repo, capsys):
    assert vendor.main([]) == 0
    assert "2 patches applied" in capsys.readouterr().out
    assert {k: v.decode() for k, v in files_of(repo.tree).items()} == PATCHED
    for rel in DROPPED:
        assert not (repo.tree / rel).exists()
    assert not (repo.tree / "PKG-INFO").exists()
    assert (repo.tree / vendor.STAMP_NAME).is_file()
    assert not repo.tree.with_name("llama.cpp.new").exists()
    assert repo.pip_calls == []

    before = repo.state()
    assert vendor.main([]) == 0
    assert "up to date" in capsys.readouterr().out
    assert repo.state() == before
    assert vendor.main(["--check"]) == 0


def test_patches_out_of_order_do_not_apply(repo):
    # 0002 depends on 0001: named to sort first, it cannot apply.
    (repo.patches / "0002-src.patch").rename(repo.patches / "0000-src.patch")
    with pytest.raises(vendor.VendorError, match="0000-src.patch"):
        vendor.main([])
    assert not repo.tree.exists()


def test_check_reports_missing_tree(repo):
    assert vendor.main(["--check"]) == 1
    assert not repo.tree.exists()


def test_corrupt_cache_and_download_fails(repo, capsys):
    cached = repo.cache / SDIST
    cached.write_bytes(b"not the sdist")
    repo.pip = lambda cmd: subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable\n")
    with pytest.raises(vendor.VendorError) as e:
        vendor.main([])
    msg = str(e.value)
    assert "cannot download" in msg and "no cached copy" in msg
    assert "network is unreachable" in msg
    assert "wrong sha256" in capsys.readouterr().err
    assert len(repo.pip_calls) == 1
    assert not cached.exists()
    corrupt = [p for p in repo.cache.iterdir() if p.name.endswith(".corrupt")]
    assert [p.read_bytes() for p in corrupt] == [b"not the sdist"]
    assert not repo.tree.exists()
    assert sorted(p.name for p in repo.cache.iterdir()) == [corrupt[0].name]  # no temp folder


def test_corrupt_cache_and_download_has_other_bytes(repo):
    (repo.cache / SDIST).write_bytes(b"not the sdist")
    repo.pip = repo.pip_writes(b"other bytes")
    with pytest.raises(vendor.VendorError, match="sha256 mismatch"):
        vendor.main([])
    assert len(repo.pip_calls) == 1
    assert not (repo.cache / SDIST).exists()
    assert not repo.tree.exists()


def test_corrupt_cache_and_download_succeeds(repo, capsys):
    (repo.cache / SDIST).write_bytes(b"not the sdist")
    repo.pip = repo.pip_writes(repo.sdist_bytes)
    assert vendor.main([]) == 0
    assert len(repo.pip_calls) == 1
    assert (repo.cache / SDIST).read_bytes() == repo.sdist_bytes
    assert {k: v.decode() for k, v in files_of(repo.tree).items()} == PATCHED
    # The verified copy is reused: no second download.
    assert vendor.main(["--force"]) == 0
    assert len(repo.pip_calls) == 1


def test_no_cache_and_no_network(repo):
    (repo.cache / SDIST).unlink()
    repo.pip = lambda cmd: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")
    with pytest.raises(vendor.VendorError, match="cannot download"):
        vendor.main([])


def test_cli_exit_code_2_on_error(tmp_path):
    # The real script in a subprocess: no cached sdist and pip pointed at nowhere.
    env = dict(os.environ, KAIROX_CACHE=str(tmp_path / "empty-cache"), PIP_INDEX_URL="http://127.0.0.1:9/",
               PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "no-links"),
               PIP_CONFIG_FILE=os.devnull)
    r = subprocess.run([sys.executable, str(SCRIPTS / "vendor.py"), "--print-sdist"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "vendor: error: cannot download" in r.stderr


# Removes a line the tree does not have.
BAD = """\
--- a/tools/CMakeLists.txt
+++ b/tools/CMakeLists.txt
@@ -1,3 +1,2 @@
 # patched by 0001, then 0002
-add_subdirectory(nope)
 add_subdirectory(server)
"""


def test_patch_that_does_not_apply_leaves_no_tree(repo):
    repo.add_patch("0003-bad.patch", BAD)
    with pytest.raises(vendor.VendorError, match="0003-bad.patch"):
        vendor.main([])
    assert not repo.tree.exists()
    assert not repo.tree.with_name("llama.cpp.new").exists()


def test_patch_that_does_not_apply_keeps_previous_tree(repo):
    assert vendor.main([]) == 0
    before = repo.state()
    # Only a context line differs: patch's default fuzz would apply it; the pinned tree must not.
    repo.add_patch("0003-bad.patch", P0001.replace("add_subdirectory(cli)", "add_subdirectory(nope)"))
    with pytest.raises(vendor.VendorError, match="0003-bad.patch") as e:
        vendor.main([])
    assert "does not apply" in str(e.value)
    assert repo.state() == before
    assert not repo.tree.with_name("llama.cpp.new").exists()
    assert vendor.main(["--check"]) == 1


def test_changed_patch_set_rebuilds_clean_tree(repo, capsys):
    assert vendor.main([]) == 0
    (repo.patches / "0002-src.patch").unlink()
    assert vendor.main(["--check"]) == 1
    assert vendor.main([]) == 0
    assert (repo.tree / "src/x.c").read_text() == KEPT["src/x.c"]
    assert (repo.tree / "tools/CMakeLists.txt").read_text().startswith("# patched by 0001\n")


def test_local_edits_are_never_overwritten(repo, capsys):
    assert vendor.main([]) == 0
    edited = repo.tree / "ggml/src/ggml.c"
    edited.write_text("/* my edit */\n")
    before = repo.state()

    # Same patch set: the edit stays, with a hint.
    capsys.readouterr()
    assert vendor.main([]) == 0
    assert "local edits" in capsys.readouterr().out
    assert repo.state() == before
    assert vendor.main(["--check"]) == 1

    # Patch set changed: refused unless --force.
    repo.add_patch("0003-more.patch", P0001.replace("@@ -1,2 +1,3 @@\n+# patched by 0001\n",
                                                      "@@ -1,3 +1,4 @@\n+# 0003\n # patched by 0001, then 0002\n"))
    with pytest.raises(vendor.VendorError, match="local edits"):
        vendor.main([])
    assert repo.state() == before
    assert vendor.main(["--force"]) == 0
    assert edited.read_text() == KEPT["ggml/src/ggml.c"]
    assert (repo.tree / "tools/CMakeLists.txt").read_text().startswith("# 0003\n# patched by 0001, then 0002\n")


def test_force_discards_edits_with_same_patch_set(repo):
    assert vendor.main([]) == 0
    (repo.tree / "src/x.c").write_text("edited\n")
    assert vendor.main(["--force"]) == 0
    assert {k: v.decode() for k, v in files_of(repo.tree).items()} == PATCHED


def test_unstamped_tree_is_not_overwritten(repo):
    repo.tree.mkdir(parents=True)
    (repo.tree / "mine.c").write_text("keep me\n")
    with pytest.raises(vendor.VendorError, match="without a stamp"):
        vendor.main([])
    assert (repo.tree / "mine.c").read_text() == "keep me\n"


def test_cli_help():
    r = subprocess.run([sys.executable, str(SCRIPTS / "vendor.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--force" in r.stdout
    r = subprocess.run([sys.executable, str(SCRIPTS / "mkpatches.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--new" in r.stdout


# ---------------------------------------------------------------- mkpatches.py


def rebuilt(repo: Repo, tmp: Path) -> dict[str, bytes]:
    """Pristine kept files plus every patch of patches/, applied with patch -p1 by the test."""
    tree = repo.pristine(tmp)
    for p in sorted(repo.patches.glob("*.patch")):
        patch_p1(tree, p)
    return files_of(tree)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_mkpatches_new_then_owner(repo, tmp_path, capsys):
    assert vendor.main([]) == 0
    ggml = repo.tree / "ggml/src/ggml.c"
    ggml.write_text(KEPT["ggml/src/ggml.c"] + "int added(void) { return 7; }\n")
    untouched = {n: b for n, b in snapshot(repo.patches).items()}

    assert mkpatches.main(["--new", "0009-x", "-m", "why"]) == 0
    new = repo.patches / "0009-x.patch"
    assert new.is_file()
    text = new.read_text()
    assert text.startswith("why\n\n--- a/ggml/src/ggml.c\n+++ b/ggml/src/ggml.c\n")
    assert {n: b for n, b in snapshot(repo.patches).items() if n != new.name} == untouched
    assert rebuilt(repo, tmp_path / "r1") == files_of(repo.tree)

    capsys.readouterr()
    assert vendor.main([]) == 0
    assert "up to date" in capsys.readouterr().out

    # Edit the same file again, and a file 0002 owns: each edit goes to its owner.
    ggml.write_text(ggml.read_text().replace("return 7;", "return 8;"))
    x = repo.tree / "src/x.c"
    x.write_text(x.read_text().replace("return 10;", "return 1010;"))
    assert mkpatches.main([]) == 0
    names = sorted(p.name for p in repo.patches.iterdir())
    assert names == ["0001-tools.patch", "0002-src.patch", "0009-x.patch"]
    assert new.read_text().startswith("why\n\n")
    assert "return 8;" in new.read_text() and "return 7;" not in new.read_text()
    assert "return 1010;" in (repo.patches / "0002-src.patch").read_text()
    assert (repo.patches / "0002-src.patch").read_text().startswith("src: f3 returns 33\n\n")
    assert (repo.patches / "0001-tools.patch").read_bytes() == untouched["0001-tools.patch"]
    assert rebuilt(repo, tmp_path / "r2") == files_of(repo.tree)
    assert vendor.main(["--check"]) == 0

    # A rebuild from scratch gives the edited tree back.
    edited = files_of(repo.tree)
    assert vendor.main(["--force"]) == 0
    assert files_of(repo.tree) == edited


def test_mkpatches_orphan_without_new(repo, capsys):
    assert vendor.main([]) == 0
    (repo.tree / "CMakeLists.txt").write_text("# mine\n")
    before_patches = snapshot(repo.patches)
    before_tree = repo.state()
    capsys.readouterr()
    assert mkpatches.main([]) == 2
    assert "CMakeLists.txt" in capsys.readouterr().out
    assert snapshot(repo.patches) == before_patches
    assert repo.state() == before_tree


def test_mkpatches_nothing_to_do_and_dry_run(repo, capsys):
    assert vendor.main([]) == 0
    before = snapshot(repo.patches)
    assert mkpatches.main([]) == 0
    assert "nothing to do" in capsys.readouterr().out
    (repo.tree / "src/x.c").write_text(PATCHED["src/x.c"] + "int g(void);\n")
    stamp = (repo.tree / vendor.STAMP_NAME).read_bytes()
    assert mkpatches.main(["--dry-run"]) == 0
    assert "would write patches/0002-src.patch" in capsys.readouterr().out
    assert snapshot(repo.patches) == before
    assert (repo.tree / vendor.STAMP_NAME).read_bytes() == stamp


def test_mkpatches_new_and_deleted_files_survive_later_runs(repo, tmp_path):
    assert vendor.main([]) == 0
    (repo.tree / "ggml/src/ggml.c").unlink()
    (repo.tree / "src/extra").mkdir()
    (repo.tree / "src/extra/new.c").write_text("int new_file;\n")
    assert mkpatches.main(["--new", "0003-files", "-m", "remove ggml.c, add new.c"]) == 0
    assert rebuilt(repo, tmp_path / "r1") == files_of(repo.tree)
    assert vendor.main(["--check"]) == 0

    # A later, unrelated edit must not lose the deletion nor the addition.
    x = repo.tree / "src/x.c"
    x.write_text(x.read_text().replace("return 0;", "return -1;"))
    assert mkpatches.main([]) == 0
    assert rebuilt(repo, tmp_path / "r2") == files_of(repo.tree)
    assert not (repo.tree / "ggml/src/ggml.c").exists()
    edited = files_of(repo.tree)
    assert vendor.main(["--force"]) == 0
    assert files_of(repo.tree) == edited


def test_mkpatches_header_with_dashes_is_kept(repo, tmp_path):
    header = "src: f3 returns 33 --- see the notes\n\nA second paragraph.\n\n"
    repo.add_patch("0002-src.patch", header + P0002.split("\n\n", 1)[1])
    assert vendor.main([]) == 0
    x = repo.tree / "src/x.c"
    x.write_text(x.read_text().replace("return 5;", "return 55;"))
    assert mkpatches.main([]) == 0
    text = (repo.patches / "0002-src.patch").read_text()
    assert text.startswith(header + "--- a/tools/CMakeLists.txt\n")
    assert rebuilt(repo, tmp_path / "r") == files_of(repo.tree)


def test_mkpatches_lines_with_form_feed_and_crlf(repo, tmp_path):
    assert vendor.main([]) == 0
    ggml = repo.tree / "ggml/src/ggml.c"
    ggml.write_bytes(b"/* ggml */\n\x0c\nint a;\x0cint b;\nint c;\r\nint ggml(void) { return 0; }\n")
    assert mkpatches.main(["--new", "0003-ff", "-m", "form feeds"]) == 0
    assert rebuilt(repo, tmp_path / "r") == files_of(repo.tree)
