"""kairox.stats: each measure on synthetic masks with a known answer, JSON, table, plots, CLI."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import kairox.pack as pack
from kairox.cli.stats import cmd_stats, register
from kairox.stats import (LayerStats, ModelStats, adjacent_jaccard, cold_mask,
                          compute_layer_stats, cross_prompt_jaccard, format_table, hot_fraction,
                          plot_stats, prompt_segments, reactivation_after_gap,
                          reactivation_curve, working_set)

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def rows(n: int, *sets: list[int]) -> np.ndarray:
    """Masks [len(sets), n] with row t active exactly on sets[t]."""
    m = np.zeros((len(sets), n), dtype=bool)
    for t, s in enumerate(sets):
        m[t, list(s)] = True
    return m


# --- hot_fraction ---------------------------------------------------------------------

def test_hot_fraction_exact_split() -> None:
    # 20 of 100 neurons hold 320 of 400 activations: exactly 80%
    counts = np.array([16] * 20 + [1] * 80)
    np.random.default_rng(0).shuffle(counts)  # order must not matter
    assert hot_fraction(counts) == pytest.approx(0.20)
    assert hot_fraction(counts, mass=0.8025) == pytest.approx(0.21)  # one more neuron needed
    assert hot_fraction(counts, mass=0.5) == pytest.approx(0.13)    # ceil(200 / 16) = 13
    assert hot_fraction(counts, mass=1.0) == pytest.approx(1.0)


def test_hot_fraction_edge_cases() -> None:
    assert math.isnan(hot_fraction(np.zeros(10)))
    assert math.isnan(hot_fraction(np.array([])))
    assert hot_fraction(np.array([0, 0, 5, 0])) == pytest.approx(0.25)
    # uniform counts: 80% of the mass needs 80% of the neurons
    assert hot_fraction(np.full(50, 7)) == pytest.approx(0.8)


# --- adjacent_jaccard -----------------------------------------------------------------

def test_adjacent_jaccard_half_swap() -> None:
    # each step keeps 2 of 4 neurons and swaps in 2 new: 1 - 2/6
    seq = rows(64, *[range(2 * t, 2 * t + 4) for t in range(20)])
    assert adjacent_jaccard(seq) == pytest.approx(2 / 3)
    # identical tokens: 0; disjoint tokens: 1
    assert adjacent_jaccard(rows(8, [1, 2], [1, 2], [1, 2])) == pytest.approx(0.0)
    assert adjacent_jaccard(rows(8, [1, 2], [3], [4, 5])) == pytest.approx(1.0)


def test_adjacent_jaccard_skips_boundaries_and_empty_pairs() -> None:
    # doc 0: {0,1} -> {0,1,2,3} (distance 0.5); boundary to a disjoint set (skipped);
    # doc 1: {8} -> {} (distance 1), {} -> {} (skipped), {} -> {8} (distance 1)
    m = rows(10, [0, 1], [0, 1, 2, 3], [8], [], [], [8])
    doc = np.array([0, 0, 1, 1, 1, 1])
    assert adjacent_jaccard(m, doc) == pytest.approx((0.5 + 1 + 1) / 3)
    # without doc ids the boundary pair (distance 1) counts
    assert adjacent_jaccard(m) == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    assert math.isnan(adjacent_jaccard(rows(4, [], [])))
    assert math.isnan(adjacent_jaccard(rows(4, [0], [1]), np.array([0, 1])))


def test_adjacent_jaccard_matches_direct_formula_on_random_masks() -> None:
    rng = np.random.default_rng(1)
    m = rng.random((300, 40)) < 0.2
    doc = np.repeat([3, 5, 3], 100)
    want = []
    for t in range(299):
        if doc[t] != doc[t + 1]:
            continue
        a, b = set(np.flatnonzero(m[t])), set(np.flatnonzero(m[t + 1]))
        if a | b:
            want.append(1 - len(a & b) / len(a | b))
    assert adjacent_jaccard(m, doc) == pytest.approx(np.mean(want))


# --- segments, working sets, cross_prompt_jaccard -------------------------------------

def test_prompt_segments() -> None:
    doc = np.array([0] * 300 + [1] * 100 + [2] * 40)
    seg = prompt_segments(doc, 128)
    # doc 0: 128 + 128 + 44 (44 < 64: dropped); doc 1: 100 (kept); doc 2: 40 (dropped)
    assert list(np.unique(seg)) == [-1, 0, 1, 2]
    assert (seg[:128] == 0).all() and (seg[128:256] == 1).all() and (seg[256:300] == -1).all()
    assert (seg[300:400] == 2).all() and (seg[400:] == -1).all()
    loose = prompt_segments(doc, 128, min_len=1)
    assert (loose[256:300] == 2).all() and (loose[300:400] == 3).all() and (loose[400:] == 4).all()


def test_working_set_top_k_with_ties_by_id() -> None:
    # counts: 0 and 1 always, 2 and 3 half the time, mean 3 active -> k = 3, tie 2/3 -> 2
    m = rows(6, [0, 1, 2], [0, 1, 3]).repeat(5, axis=0)
    assert list(working_set(m)) == [0, 1, 2]
    # mean 2.5 active rounds half up to 3
    assert list(working_set(rows(6, [4, 5], [3, 4, 5]))) == [3, 4, 5]
    assert list(working_set(rows(6, [], []))) == []


def test_cross_prompt_disjoint_and_identical() -> None:
    n, L = 64, 128
    doc = np.repeat([0, 1, 2], 2 * L)
    seg = prompt_segments(doc, L)
    same = np.zeros((doc.size, n), dtype=bool)
    same[:, 10:20] = True
    assert cross_prompt_jaccard(same, seg, doc) == pytest.approx(0.0)
    disjoint = np.zeros_like(same)
    for d in range(3):
        disjoint[doc == d, 10 * d:10 * d + 8] = True
    assert cross_prompt_jaccard(disjoint, seg, doc) == pytest.approx(1.0)


def test_cross_prompt_uses_working_sets_and_only_different_documents() -> None:
    n, L = 32, 100
    rng = np.random.default_rng(2)
    X, Y = [0, 1, 2, 3], [2, 3, 4, 5]          # d(X, Y) = 1 - 2/6
    noise = lambda: rng.random((L, n)) < 0.01  # rare extra neurons: the union would hold them all
    a1 = rows(n, *[X] * L) | noise()
    a2 = rows(n, *[Y] * L) | noise()
    b1 = rows(n, *[X] * L) | noise()
    m = np.concatenate([a1, a2, b1])
    doc = np.repeat([0, 0, 1], L)
    seg = np.repeat([0, 1, 2], L)
    # pairs (a1, b1) = 0 and (a2, b1) = 2/3; (a1, a2) is within document 0 and not used
    assert cross_prompt_jaccard(m, seg, doc) == pytest.approx((0 + 2 / 3) / 2)
    # a segment spanning two documents is refused
    with pytest.raises(ValueError, match="more than one document"):
        cross_prompt_jaccard(m, np.zeros(3 * L, int), doc)
    # one document only: no pair
    assert math.isnan(cross_prompt_jaccard(m, seg, np.zeros(3 * L, int)))


def test_cross_prompt_sampling_is_seeded() -> None:
    rng = np.random.default_rng(3)
    m = rng.random((40 * 20, 50)) < 0.1
    doc = np.repeat(np.arange(40), 20)
    seg = prompt_segments(doc, 20)
    full = cross_prompt_jaccard(m, seg, doc, max_pairs=None)  # 780 pairs
    s1 = cross_prompt_jaccard(m, seg, doc, max_pairs=100, seed=7)
    assert s1 == cross_prompt_jaccard(m, seg, doc, max_pairs=100, seed=7)
    assert s1 != cross_prompt_jaccard(m, seg, doc, max_pairs=100, seed=8)
    assert s1 == pytest.approx(full, abs=0.05)
    assert cross_prompt_jaccard(m, seg, doc, max_pairs=2000) == full


# --- reactivation ---------------------------------------------------------------------

def brute_reactivation(m: np.ndarray, doc: np.ndarray, cold: np.ndarray, max_gap: int) -> dict:
    """The definition, token by token, with a 'last fired' array."""
    T, n = m.shape
    fired = np.zeros((2, max_gap + 1))
    risk = np.zeros((2, max_gap + 1))
    last = np.full(n, -10**9)
    cls = (~cold).astype(int)
    for t in range(T):
        if t and doc[t] != doc[t - 1]:
            last[:] = -10**9
        g = t - last
        at = g <= max_gap
        np.add.at(risk, (cls[at], g[at]), 1)
        f = at & m[t]
        np.add.at(fired, (cls[f], g[f]), 1)
        last[m[t]] = t
    with np.errstate(invalid="ignore"):
        h = fired / risk
    return {"cold": h[0, 1:], "hot": h[1, 1:], "cold_at_risk": risk[0, 1:], "hot_at_risk": risk[1, 1:]}


def test_reactivation_periodic_neuron() -> None:
    T, n = 300, 10
    m = np.zeros((T, n), dtype=bool)
    for i in range(n):
        m[i % 3::3, i] = True  # every neuron fires every 3 tokens, phases differ
    r = reactivation_curve(m, max_gap=6)
    assert r["gap"] == [1, 2, 3, 4, 5, 6]
    for cls in ("cold", "hot"):
        h = r[cls]
        assert h[0] == 0.0 and h[1] == 0.0 and h[2] == 1.0
        assert all(math.isnan(x) for x in h[3:])  # never silent for 4+ tokens: no one at risk
        assert r[f"{cls}_at_risk"][3:] == [0, 0, 0]
    # equal counts: neurons 0-6 are cold (ties by id), each with 99 intervals of length 3
    assert list(cold_mask(m.sum(0))) == [True] * 7 + [False] * 3
    assert r["cold_at_risk"][2] == 7 * 99 and r["hot_at_risk"][2] == 3 * 99


def test_reactivation_bernoulli_hazard_is_p() -> None:
    rng = np.random.default_rng(4)
    T = 4000
    p = np.array([0.1] * 70 + [0.5] * 30)  # the 70 rare neurons are the cold class
    m = rng.random((T, p.size)) < p
    r = reactivation_curve(m, m.sum(0), max_gap=8, cold_fraction=0.7)
    np.testing.assert_allclose(r["cold"], 0.1, atol=0.01)
    np.testing.assert_allclose(r["hot"][:5], 0.5, atol=0.02)  # long silences are rare at p=0.5
    assert reactivation_after_gap(r, "cold") == pytest.approx(0.1, abs=0.005)
    assert reactivation_after_gap(r, "hot") == pytest.approx(0.5, abs=0.01)


def test_reactivation_equals_token_loop_with_documents() -> None:
    rng = np.random.default_rng(5)
    T, n = 500, 37
    p = rng.uniform(0.02, 0.6, n)
    m = rng.random((T, n)) < p
    doc = np.repeat([0, 1, 0, 2, 3], [120, 80, 150, 3, 147])  # the id 0 comes back: a new document
    counts = m.sum(0)
    import kairox.stats as st
    old = st._BLOCK_CELLS
    try:
        st._BLOCK_CELLS = 5 * T  # several neuron blocks
        r = reactivation_curve(m, counts, max_gap=10, cold_fraction=0.6, doc_id=doc)
    finally:
        st._BLOCK_CELLS = old
    want = brute_reactivation(m, doc, cold_mask(counts, 0.6), 10)
    for k in ("cold", "hot", "cold_at_risk", "hot_at_risk"):
        np.testing.assert_allclose(r[k], want[k], rtol=1e-12, equal_nan=True, err_msg=k)


def test_reactivation_after_gap_pools_by_risk() -> None:
    curve = {"gap": [1, 2, 3, 4], "cold": [0.9, 0.9, 0.1, 0.4], "cold_at_risk": [5, 5, 30, 10]}
    assert reactivation_after_gap(curve) == pytest.approx((3 + 4) / 40)
    assert reactivation_after_gap({"cold": [0.9, 0.9, 0.1, 0.3]}) == pytest.approx(0.2)
    assert math.isnan(reactivation_after_gap({"cold": [0.5, math.nan, math.nan]}))


# --- LayerStats / ModelStats ----------------------------------------------------------

def sample_stats(with_extra: bool = True) -> ModelStats:
    rng = np.random.default_rng(6)
    layers = []
    for il in range(3):
        m = rng.random((400, 64)) < np.linspace(0.02, 0.5, 64)
        doc = np.repeat([0, 1, 2, 3], 100)
        layers.append(compute_layer_stats(
            m, doc, segment_len=50, layer=il, max_gap=6,
            hidden_cosine=None if il == 0 else 0.97 + 0.005 * il,
            recall=0.99, precision=0.5 + 0.1 * il, threshold=0.0,
            overfetch={"metis": 1.2 + 0.1 * il, "frequency": 1.5, "random": 2.5} if with_extra else None))
    extra = {}
    if with_extra:
        extra = {"ppl_curve": [{"target_sparsity": 0.5, "measured_sparsity": 0.52, "ppl": 10.5},
                               {"target_sparsity": 0.8, "measured_sparsity": 0.79, "ppl": 12.25},
                               {"target_sparsity": 0.9, "measured_sparsity": None, "ppl": 19.0}],
                 "dense_ppl": 10.0}
    return ModelStats(model="tiny-relu", n_layer=3, n_ff=64, tokens=400, layers=layers, extra=extra)


def test_compute_layer_stats_uses_the_measures() -> None:
    rng = np.random.default_rng(7)
    m = rng.random((300, 20)) < 0.3
    doc = np.repeat([0, 1, 2], 100)
    s = compute_layer_stats(m, doc, segment_len=50, layer=4, max_gap=5, recall=0.9,
                            overfetch={"metis": np.float32(1.5)})
    assert s.layer == 4
    assert s.density == pytest.approx(m.mean())
    assert s.hot_fraction_80 == hot_fraction(m.sum(0))
    assert s.adjacent_jaccard == adjacent_jaccard(m, doc)
    assert s.cross_prompt_jaccard == cross_prompt_jaccard(m, prompt_segments(doc, 50), doc)
    assert s.reactivation == reactivation_curve(m, None, max_gap=5, doc_id=doc)
    assert s.recall == 0.9 and s.precision is None and s.hidden_cosine is None
    assert s.overfetch == {"metis": 1.5} and type(s.overfetch["metis"]) is float


def test_json_round_trip_with_nan() -> None:
    st = sample_stats()
    st.layers[1].cross_prompt_jaccard = math.nan
    text = st.to_json()
    o = json.loads(text)  # plain JSON: no NaN tokens
    assert "NaN" not in text
    assert o["layers"][1]["cross_prompt_jaccard"] is None
    assert o["layers"][0]["hidden_cosine"] is None
    assert o["extra"]["ppl_curve"][2]["measured_sparsity"] is None
    back = ModelStats.from_json(text)
    assert back.to_json() == text
    assert math.isnan(back.layers[1].cross_prompt_jaccard)
    assert back.layers[0].hidden_cosine is None
    assert back.layers[2].hidden_cosine == pytest.approx(0.98)
    for il in range(3):
        for k, v in st.layers[il].reactivation.items():
            np.testing.assert_array_equal(back.layers[il].reactivation[k], v)  # NaN == NaN here
    assert back.layers[0].overfetch == st.layers[0].overfetch
    assert (back.model, back.n_layer, back.n_ff, back.tokens) == ("tiny-relu", 3, 64, 400)
    assert back.extra["dense_ppl"] == 10.0
    assert isinstance(back.layers[0], LayerStats)


@pytest.mark.parametrize("bad", ["not json", "[]", '{"model": "x"}', '{"model": "x", "n_layer": 1, '
                                 '"n_ff": 2, "tokens": 3, "layers": [{"density": 0.1}]}'])
def test_from_json_rejects_bad_input(bad: str) -> None:
    with pytest.raises(ValueError):
        ModelStats.from_json(bad)


def test_format_table() -> None:
    st = sample_stats()
    text = format_table(st)
    lines = text.splitlines()
    assert lines[0] == "tiny-relu: 3 layers x 64 neurons, 400 tokens"
    head = next(ln for ln in lines if ln.startswith("| layer"))
    for col in ("density", "hot 80%", "adj J", "prompt J", "cold re-fire g>2", "cos", "recall",
                "precision", "over-fetch metis", "over-fetch frequency", "over-fetch random"):
        assert col in head
    body = [ln for ln in lines
            if ln.startswith("|") and ln.split("|")[1].strip() in ("0", "1", "2", "mean")]
    assert [ln.split("|")[1].strip() for ln in body] == ["0", "1", "2", "mean"]
    mean_hot = np.mean([s.hot_fraction_80 for s in st.layers])
    assert f"{100 * mean_hot:.1f}%" in body[-1]
    assert "1.300" in body[-1]  # mean metis over-fetch 1.2, 1.3, 1.4
    assert body[0].split("|")[8].strip() == "-"  # layer 0 has no hidden cosine
    assert body[-1].split("|")[8].strip() == f"{np.mean([0.975, 0.98]):.3f}"
    assert "17-26%" in text and "0.70-0.75" in text and "0.53-0.57" in text and "< 0.20" in text
    assert "≈0.98" in text and "PowerInfer" in text and "DynamicInfer" in text and "KAIROX" in text
    assert "dense perplexity: 10" in text and "12.25" in text
    # optional columns vanish when no layer has them
    plain = format_table(sample_stats(with_extra=False))
    assert "over-fetch" not in plain and "perplexity" not in plain


def _is_png(p: Path) -> bool:
    data = p.read_bytes()
    return len(data) > 1000 and data[:8] == PNG_SIG


def test_plot_stats(tmp_path: Path) -> None:
    paths = plot_stats(sample_stats(), tmp_path / "png")
    assert [p.name for p in paths] == ["stats-locality.png", "stats-reactivation.png",
                                       "stats-perplexity.png", "stats-overfetch.png"]
    assert all(_is_png(p) for p in paths)
    few = plot_stats(sample_stats(with_extra=False), tmp_path / "few")
    assert [p.name for p in few] == ["stats-locality.png", "stats-reactivation.png"]
    assert all(_is_png(p) for p in few)


def test_plot_stats_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        plot_stats(sample_stats(), tmp_path)


# --- CLI ------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kairox")
    register(ap.add_subparsers())
    return ap.parse_args(["stats", *argv])


@pytest.fixture
def pack_file(tmp_path: Path) -> Path:
    p = tmp_path / "m.kxpack.gguf"
    p.write_bytes(b"GGUF")
    return p


def fake_reader(result: str | None | Exception, seen: list | None = None):
    def read(path):
        if seen is not None:
            seen.append(Path(path))
        if isinstance(result, Exception):
            raise result
        return result
    return read


def test_cmd_stats_prints_table(pack_file: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    seen: list[Path] = []
    monkeypatch.setattr(pack, "read_pack_stats", fake_reader(sample_stats().to_json(), seen), raising=False)
    args = parse(str(pack_file))
    assert args.func is cmd_stats
    assert cmd_stats(args) == 0
    out, err = capsys.readouterr()
    assert seen == [pack_file]
    assert out.startswith("tiny-relu: 3 layers x 64 neurons") and "17-26%" in out
    assert any(ln.split("|")[1].strip() == "mean" for ln in out.splitlines() if ln.startswith("|"))
    assert err == ""


def test_cmd_stats_json_and_png(pack_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    st = sample_stats(with_extra=False)
    monkeypatch.setattr(pack, "read_pack_stats", fake_reader(st.to_json()), raising=False)
    assert cmd_stats(parse(str(pack_file), "--json", "--png", str(tmp_path / "out"))) == 0
    out, err = capsys.readouterr()
    assert ModelStats.from_json(out).to_json() == st.to_json()  # stdout is only JSON
    assert "stats-locality.png" in err
    assert _is_png(tmp_path / "out" / "stats-reactivation.png")


def test_cmd_stats_without_statistics(pack_file: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(pack, "read_pack_stats", fake_reader(None), raising=False)
    assert cmd_stats(parse(str(pack_file))) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "no activation statistics" in err and "kairox prepare" in err and str(pack_file) in err


@pytest.mark.parametrize("result, msg", [(pack.PackError("not a kairox pack"), "not a kairox pack"),
                                         ("{broken", "unreadable statistics")])
def test_cmd_stats_bad_pack(pack_file: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture, result, msg: str) -> None:
    monkeypatch.setattr(pack, "read_pack_stats", fake_reader(result), raising=False)
    assert cmd_stats(parse(str(pack_file))) == 2
    out, err = capsys.readouterr()
    assert out == "" and msg in err and err.startswith("kairox stats: error:")


def test_cmd_stats_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(pack, "read_pack_stats", fake_reader(AssertionError("not called")), raising=False)
    assert cmd_stats(parse(str(tmp_path / "none.gguf"))) == 2
    assert "not found" in capsys.readouterr().err


def test_request_distances_by_domain() -> None:
    from kairox.stats import request_distances
    n = 8
    rows = []
    # request 0 and 2 (domain a) use neurons {0, 1}; request 1 (domain b) {4, 5}; request 3 (b) {4, 6}
    for ids in ([0, 1], [4, 5], [0, 1], [4, 6]):
        m = np.zeros((2, n), bool)
        m[:, ids] = True
        rows.append(m)
    masks = np.concatenate(rows)
    rid = np.repeat(np.arange(4), 2)
    same, other = request_distances(masks, rid, ["a", "b", "a", "b"])
    assert same == pytest.approx((0.0 + 2 / 3) / 2)   # (0,2) identical; (1,3) share 4 of {4,5,6}
    assert other == pytest.approx(1.0)                  # a and b never overlap
    assert np.isnan(request_distances(masks, rid, ["a", "b", "c", "d"])[0])
    with pytest.raises(ValueError):
        request_distances(masks, rid[:-1], ["a", "b", "a", "b"])
