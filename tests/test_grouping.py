"""Neuron grouping: co-activation graph, METIS grouping with exact sizes, over-fetch."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import kairox.grouping as kg
from kairox.grouping import (MAX_GROUPS, METHODS, Grouping, coactivation_graph, compare_groupings,
                             group_neurons, overfetch)


def planted_masks(rng: np.random.Generator, n_tokens: int, cluster_of: np.ndarray,
                  n_clusters: int) -> np.ndarray:
    """Each token fires 2-3 random clusters (each member with p = 0.9) plus 1% noise."""
    n = cluster_of.shape[0]
    n_on = rng.integers(2, 4, size=n_tokens)
    rank = np.argsort(rng.random((n_tokens, n_clusters)), axis=1)   # random cluster order
    cluster_on = np.zeros((n_tokens, n_clusters), dtype=bool)
    np.put_along_axis(cluster_on, rank, np.arange(n_clusters)[None, :] < n_on[:, None], axis=1)
    masks = cluster_on[:, cluster_of] & (rng.random((n_tokens, n)) < 0.9)
    return masks | (rng.random((n_tokens, n)) < 0.01)


@pytest.fixture(scope="module")
def planted() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    n, n_clusters = 512, 16
    hidden = rng.permutation(n)
    cluster_of = np.repeat(np.arange(n_clusters), n // n_clusters)[hidden]
    train = planted_masks(rng, 4000, cluster_of, n_clusters)
    test = planted_masks(rng, 2000, cluster_of, n_clusters)
    return train, test, cluster_of


def check_grouping(g: Grouping, n: int, group_size: int) -> None:
    assert g.perm.dtype == np.int32 and g.group.dtype == np.int32
    assert g.perm.shape == g.group.shape == (n,)
    assert np.array_equal(np.sort(g.perm), np.arange(n)), "perm is not a permutation"
    assert np.array_equal(g.group, np.arange(n) // group_size)
    assert (np.diff(g.group) >= 0).all()
    n_groups = -(-n // group_size)
    sizes = np.bincount(g.group, minlength=n_groups)
    assert (sizes[:-1] == group_size).all() and sizes[-1] == n - (n_groups - 1) * group_size
    for gi in range(n_groups):
        members = g.perm[g.group == gi]
        assert (np.diff(members) > 0).all(), "neurons within a group are not in id order"


def test_planted_clusters_are_recovered(planted):
    train, test, cluster_of = planted
    g = group_neurons(train, 32, "metis")
    check_grouping(g, 512, 32)
    purity = np.array([np.bincount(cluster_of[g.perm[g.group == gi]]).max() / 32
                       for gi in range(16)])
    assert purity.min() >= 0.9, purity
    assert purity.mean() >= 0.95, purity

    stats = compare_groupings(train, test, 32)
    assert set(stats) == {"metis", "frequency", "random", "identity"}
    metis, freq, rand = stats["metis"].ratio, stats["frequency"].ratio, stats["random"].ratio
    assert metis < 0.5 * rand, (metis, rand)
    assert metis < freq, (metis, freq)
    # Same held-out tokens for every method: the active count does not depend on grouping.
    assert len({s.active for s in stats.values()}) == 1
    assert stats["metis"].groups_per_token < 0.5 * stats["random"].groups_per_token


@pytest.mark.parametrize("n, group_size", [(512, 32), (500, 32), (100, 7), (50, 64), (50, 50),
                                           (65, 64), (33, 1)])
@pytest.mark.parametrize("method", METHODS)
def test_groups_have_exact_sizes(n, group_size, method):
    rng = np.random.default_rng(n * 1000 + group_size)
    # Correlated firing so METIS has structure to cut, and parts come out unbalanced.
    z = rng.standard_normal((600, 8))
    masks = (z @ rng.standard_normal((8, n))) > 1.0
    g = group_neurons(masks, group_size, method, seed=3)
    check_grouping(g, n, group_size)
    assert g.group_size == group_size and g.method == method
    again = group_neurons(masks, group_size, method, seed=3)
    assert np.array_equal(g.perm, again.perm) and np.array_equal(g.group, again.group)


@pytest.mark.parametrize("method", METHODS)
def test_many_dead_neurons(method):
    rng = np.random.default_rng(11)
    n, group_size = 300, 16
    dead = rng.choice(n, 170, replace=False)
    z = rng.standard_normal((800, 6))
    masks = (z @ rng.standard_normal((6, n))) > 0.8
    masks[:, dead] = False
    g = group_neurons(masks, group_size, method)
    check_grouping(g, n, group_size)
    if method == "metis":
        # Never-firing neurons fill whole groups of their own (never fetched), not
        # spread thinly over groups that are fetched.
        is_dead = np.zeros(n, dtype=bool)
        is_dead[dead] = True
        all_dead = [is_dead[g.perm[g.group == gi]].all() for gi in range(g.n_groups)]
        assert sum(all_dead) >= 170 // group_size - 1


def test_all_silent_and_single_group():
    masks = np.zeros((10, 40), dtype=bool)
    for method in METHODS:
        check_grouping(group_neurons(masks, 16, method), 40, 16)
        check_grouping(group_neurons(masks, 40, method), 40, 40)
    masks[:, 3] = True  # one neuron fires alone: no edges at all
    check_grouping(group_neurons(masks, 16, "metis"), 40, 16)


def csr(n: int, weighted_edges: list[tuple[int, int, float]]) -> tuple[np.ndarray, ...]:
    pairs = sorted([(i, j, w) for i, j, w in weighted_edges] + [(j, i, w) for i, j, w in weighted_edges])
    xadj = np.searchsorted([i for i, _, _ in pairs], np.arange(n + 1)).astype(np.int64)
    return xadj, np.array([j for _, j, _ in pairs]), np.array([w for _, _, w in pairs])


def test_rebalance_moves_least_attached_to_most_attached_part():
    # Part 0 = clique {0,1,2,3} plus 4, which hangs on 0 weakly and on 5 (part 1) strongly.
    clique = [(a, b, 0.9) for a in range(4) for b in range(a + 1, 4)]
    xadj, adjncy, sim = csr(8, clique + [(4, 0, 0.1), (4, 5, 0.5), (6, 7, 0.7)])
    part = np.array([0, 0, 0, 0, 0, 1, 2, 2])
    out = kg._rebalance(part, np.array([4, 2, 2]), xadj, adjncy, sim)
    assert out.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    # Attached to no underfull part: goes where there is most room (part 2 here).
    xadj, adjncy, sim = csr(7, clique + [(4, 0, 0.1)])
    part = np.array([0, 0, 0, 0, 0, 1, 1])
    out = kg._rebalance(part, np.array([4, 2, 1]), xadj, adjncy, sim)
    assert np.bincount(out).tolist() == [4, 2, 1]
    assert out[:4].tolist() == [0, 0, 0, 0] and out[4] == 2


def test_seed_changes_random_grouping():
    masks = np.random.default_rng(0).random((50, 256)) < 0.3
    a = group_neurons(masks, 16, "random", seed=1)
    b = group_neurons(masks, 16, "random", seed=2)
    assert not np.array_equal(a.perm, b.perm)


def dense_jaccard(masks: np.ndarray) -> np.ndarray:
    m = masks.astype(np.int64)
    co = m.T @ m
    c = np.diag(co)
    union = c[:, None] + c[None, :] - co
    sim = np.divide(co, union, out=np.zeros(co.shape), where=union > 0)
    np.fill_diagonal(sim, 0.0)
    return sim


def edges(graph) -> dict[tuple[int, int], tuple[float, int]]:
    out = {}
    for i in range(graph.n):
        for e in range(graph.xadj[i], graph.xadj[i + 1]):
            out[(i, int(graph.adjncy[e]))] = (float(graph.similarity[e]), int(graph.eweights[e]))
    return out


def test_coactivation_graph_matches_dense_reference():
    rng = np.random.default_rng(5)
    n, k = 60, 5
    density = rng.uniform(0.02, 0.6, size=n)       # hot and cold neurons
    masks = rng.random((300, n)) < density
    masks[:, 7] = False                             # a neuron that never fires
    graph = coactivation_graph(masks, k=k, block=1000)
    ref = dense_jaccard(masks)
    assert np.array_equal(graph.counts, masks.sum(axis=0))
    assert graph.xadj.shape == (n + 1,) and graph.xadj[0] == 0
    assert graph.xadj[-1] == graph.adjncy.shape[0] == graph.eweights.shape[0]
    assert graph.adjncy.dtype == np.int64 and graph.eweights.dtype == np.int64
    e = edges(graph)
    for (i, j), (s, w) in e.items():
        assert i != j, "self-loop"
        assert (j, i) in e and e[(j, i)] == (s, w), "not symmetric"
        assert s == pytest.approx(ref[i, j], rel=1e-12) and s > 0
        assert 1 <= w <= 1000
    assert max(w for _, w in e.values()) == 1000
    assert graph.degree[7] == 0

    # Top-k, tie-robust: t_i is row i's k-th largest similarity. Everything strictly
    # above t_i must be an edge; an edge (i, j) must be in i's or j's top-k.
    kth = -np.sort(-ref, axis=1)[:, k - 1]
    for i in range(n):
        nbrs = set(graph.adjncy[graph.xadj[i]:graph.xadj[i + 1]].tolist())
        must = set(np.flatnonzero((ref[i] > kth[i]) & (ref[i] > 0)).tolist())
        assert must <= nbrs
        assert len(nbrs) >= min(k, int((ref[i] > 0).sum()))
        for j in nbrs:
            assert ref[i, j] >= kth[i] or ref[j, i] >= kth[j]


def test_coactivation_graph_independent_of_block_and_chunking(monkeypatch):
    rng = np.random.default_rng(9)
    masks = rng.random((500, 90)) < rng.uniform(0.05, 0.5, size=90)
    whole = coactivation_graph(masks, k=6, block=1000)
    monkeypatch.setattr(kg, "_CHUNK_ELEMENTS", 90 * 37)   # 37-token chunks
    for block in (1, 7, 64, 90):
        g = coactivation_graph(masks, k=6, block=block)
        for name in ("xadj", "adjncy", "eweights", "similarity", "counts"):
            assert np.array_equal(getattr(g, name), getattr(whole, name)), (block, name)


def test_coactivation_graph_memory_is_not_quadratic():
    n, block = 4096, 64
    masks = np.random.default_rng(2).random((32, n)) < 0.2
    tracemalloc.start()
    try:
        coactivation_graph(masks, k=8, block=block)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    dense = n * n * 4  # the float32 n x n co-activation matrix: 64 MiB
    assert peak < dense / 4, f"peak {peak / 2**20:.1f} MiB"


def brute_overfetch(masks: np.ndarray, g: Grouping) -> tuple[int, int, int]:
    active = fetched = groups = 0
    for t in range(masks.shape[0]):
        for gi in range(g.n_groups):
            members = g.perm[g.group == gi]
            on = int(masks[t, members].sum())
            active += on
            if on:
                fetched += members.shape[0]
                groups += 1
    return active, fetched, groups


def test_overfetch_matches_brute_force(monkeypatch):
    rng = np.random.default_rng(4)
    n, group_size = 50, 8                       # last group has 2 neurons
    masks = rng.random((40, n)) < 0.1
    masks[3] = False                            # a silent token
    g = group_neurons(masks, group_size, "random", seed=1)
    active, fetched, groups = brute_overfetch(masks, g)
    monkeypatch.setattr(kg, "_CHUNK_ELEMENTS", n * 3)     # 3-token chunks
    s = overfetch(masks, g)
    assert (s.n_tokens, s.n_ff, s.n_groups) == (40, 50, 7)
    assert (s.active, s.fetched) == (active, fetched)
    assert s.ratio == pytest.approx((fetched - active) / active)
    assert s.fetched_fraction == pytest.approx(fetched / (40 * n))
    assert s.active_fraction == pytest.approx(active / (40 * n))
    assert s.groups_per_token == pytest.approx(groups / 40)


def test_overfetch_edge_cases():
    n = 20
    g = group_neurons(np.ones((1, n), dtype=bool), 5, "identity")
    s = overfetch(np.zeros((4, n), dtype=bool), g)
    assert (s.ratio, s.fetched, s.active, s.groups_per_token) == (0.0, 0, 0, 0.0)
    full = overfetch(np.ones((4, n), dtype=bool), g)
    assert full.ratio == 0.0 and full.fetched_fraction == 1.0 and full.groups_per_token == 4
    one = np.zeros((1, n), dtype=bool)
    one[0, 0] = True
    assert overfetch(one, g).ratio == 4.0   # one active neuron brings its 4 group mates


def test_bad_input():
    good = np.zeros((5, 64), dtype=bool)
    with pytest.raises(ValueError, match="bool"):
        group_neurons(good.astype(np.int8), 8)
    with pytest.raises(ValueError, match="bool"):
        coactivation_graph(good.astype(np.float32))
    with pytest.raises(ValueError, match="numpy array"):
        group_neurons(good.tolist(), 8)
    with pytest.raises(ValueError, match="2-D"):
        group_neurons(np.zeros(64, dtype=bool), 8)
    with pytest.raises(ValueError, match="2-D"):
        overfetch(np.zeros((2, 3, 4), dtype=bool), group_neurons(good, 8, "identity"))
    with pytest.raises(ValueError, match="at least one token"):
        group_neurons(np.zeros((0, 64), dtype=bool), 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="group_size must be a positive integer"):
            group_neurons(good, bad)
    with pytest.raises(ValueError, match="k must be"):
        coactivation_graph(good, k=0)
    with pytest.raises(ValueError, match="block must be"):
        coactivation_graph(good, block=0)
    with pytest.raises(ValueError, match="unknown grouping method 'spectral'"):
        group_neurons(good, 8, "spectral")
    with pytest.raises(ValueError, match="64 neurons, masks have 65"):
        overfetch(np.zeros((5, 65), dtype=bool), group_neurons(good, 8, "identity"))
    with pytest.raises(ValueError, match="train_masks have 64 neurons, test_masks 65"):
        compare_groupings(good, np.zeros((5, 65), dtype=bool), 8)


def test_too_many_groups():
    n = 2 * MAX_GROUPS
    masks = np.zeros((2, n + 1), dtype=bool)
    with pytest.raises(ValueError, match=r"1025 groups, more than the 1024 per layer.*group_size >= 3"):
        group_neurons(masks, 2, "identity")
    check_grouping(group_neurons(masks[:, :n], 2, "identity"), n, 2)   # exactly 1024: fine
