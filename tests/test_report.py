"""`kairox report`'s reader on known balancer records: a gzip-compressed trace reads as the plain one."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kairox.report import TraceError, read_trace, summary, write_trace


def records(steps: int = 6, layers: int = 2) -> list[dict]:
    """Balancer records (struct kx_balance_record's fields) that differ from step to step."""
    stalls = ("none", "io", "cpu")
    return [{"step": s, "layer": l, "n_active": 100 + s, "n_hit": 60 + s + l, "n_load": 3 * s, "n_evict": s,
             "stall": stalls[(s + l) % 3], "lam": 0.5 + 0.01 * s, "wait_us": 10.0 * s, "decide_us": 5.0 + l,
             "reload_bytes": 4096 * s, "late": s % 2}
            for s in range(steps) for l in range(layers)]


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Told by the gzip magic bytes, so a compressed file without the .gz suffix reads too."""
    from kairox.cli import main
    plain = tmp_path / "t.jsonl"
    write_trace(plain, records())
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    bare = tmp_path / "t-compressed"
    bare.write_bytes(gz.read_bytes())
    want = read_trace(plain)
    assert want == records()
    assert read_trace(gz) == want and read_trace(bare) == want
    assert summary(read_trace(gz)) == summary(want)
    outs = []
    for f in (plain, gz):
        assert main(["report", str(f), "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0]["steps"] == 6 and outs[0]["layers"] == 2


def test_a_broken_archive_is_a_reading_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kairox.cli import main
    plain = tmp_path / "t.jsonl"
    write_trace(plain, records())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(plain.read_bytes())[:-12])
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(cut)
    assert main(["report", str(cut)]) == 2
    assert "cannot read" in capsys.readouterr().err
