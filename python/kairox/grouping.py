"""Neuron grouping: which FFN neurons share a group of G consecutive pack rows.

The runtime never fetches or computes a single FFN neuron: it works on groups of G
consecutive rows of the pack (one transfer, one kernel tile). A group is fetched as soon
as one of its neurons is predicted active, and then all G of its neurons come along. With
10-50% of neurons active per token and neurons laid out in their original order, almost
every group holds some active neuron, so nearly the whole layer is fetched and sparsity
buys nothing. Neurons that fire together should therefore share a group: then a token
touches few groups, and those groups are mostly active.

That is a graph partitioning problem. The co-activation graph has one vertex per neuron
and an edge weighted by how strongly two neurons fire together; cutting it into
ceil(n_ff / G) parts of G vertices with the least edge weight between parts keeps
co-firing neurons together. `group_neurons` does this with METIS on a sparse top-k
co-activation graph (`coactivation_graph`), then repairs METIS's approximate balance so
every group has exactly G neurons. Three baselines (activation frequency, random,
original order) show what the partition buys, measured by `overfetch` on held-out tokens
as the number of inactive neurons fetched per active neuron.

Memory. The dense n_ff x n_ff co-activation matrix is 3.3 GB in float32 at n_ff = 28672,
so it is never formed: it is computed `block` rows at a time and only each neuron's k
strongest partners are kept, O(block * n_ff + n_ff * k) beyond the masks themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# KAIROX's runtime caps the groups per layer (its per-layer group tables are fixed-size).
MAX_GROUPS = 1024
METHODS = ("metis", "frequency", "random", "identity")
# METIS edge weights are positive integers; similarities in (0, 1] become 1..WEIGHT_SCALE.
WEIGHT_SCALE = 1000
# Tokens converted to float32 at once while computing co-activation counts, and tokens
# per chunk in `overfetch`, are bounded by this many mask elements (2**24 elements:
# 64 MiB as float32, 16 MiB as bool).
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class CoactGraph:
    """A symmetric, sparse co-activation graph in CSR form, as METIS reads it.

    Neuron i's neighbours are adjncy[xadj[i]:xadj[i+1]] (ascending ids), with Jaccard
    similarities `similarity` and METIS edge weights `eweights` at the same positions.
    """
    n: int                   # vertices = n_ff
    xadj: np.ndarray         # int64 [n + 1]
    adjncy: np.ndarray       # int64 [2m], both directions of every edge
    eweights: np.ndarray     # int64 [2m], 1..WEIGHT_SCALE, proportional to similarity
    similarity: np.ndarray   # float64 [2m], Jaccard similarity in (0, 1]
    counts: np.ndarray       # int64 [n], tokens in which each neuron fired
    n_tokens: int
    k: int

    @property
    def degree(self) -> np.ndarray:
        return np.diff(self.xadj)


@dataclass(frozen=True)
class Grouping:
    """A neuron order for the pack: pack position p holds neuron perm[p], in group group[p].

    Groups are runs of `group_size` consecutive positions (group[p] == p // group_size);
    only the last may be shorter. Within a group neurons are in ascending id order.
    """
    perm: np.ndarray   # int32 [n_ff], a permutation of 0..n_ff-1
    group: np.ndarray  # int32 [n_ff], non-decreasing
    group_size: int
    method: str

    @property
    def n_ff(self) -> int:
        return int(self.perm.shape[0])

    @property
    def n_groups(self) -> int:
        return -(-self.n_ff // self.group_size)


@dataclass(frozen=True)
class OverfetchStats:
    """What a grouping costs on a set of tokens (totals are summed over tokens)."""
    n_tokens: int
    n_ff: int
    n_groups: int
    active: int               # active neurons
    fetched: int              # neurons in fetched groups (active or not)
    ratio: float              # (fetched - active) / active: inactive neurons per active one
    fetched_fraction: float   # fetched / (n_tokens * n_ff)
    active_fraction: float    # active / (n_tokens * n_ff)
    groups_per_token: float   # fetched groups per token, averaged over all tokens


def _check_masks(masks: object, what: str = "masks") -> np.ndarray:
    if not isinstance(masks, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, not {type(masks).__name__}")
    if masks.dtype != np.bool_:
        raise ValueError(f"{what} must be a bool array [tokens, n_ff], not dtype {masks.dtype}")
    if masks.ndim != 2:
        raise ValueError(f"{what} must be 2-D [tokens, n_ff], not shape {masks.shape}")
    if masks.shape[0] < 1 or masks.shape[1] < 1:
        raise ValueError(f"{what} needs at least one token and one neuron, got shape {masks.shape}")
    return masks


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def _token_chunks(n_tokens: int, n_ff: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // n_ff)
    return [slice(t, min(t + step, n_tokens)) for t in range(0, n_tokens, step)]


def coactivation_graph(masks: np.ndarray, k: int = 32, block: int = 1024) -> CoactGraph:
    """The top-k co-activation graph of the neurons in `masks` (bool [T, n_ff]).

    Similarity is Jaccard: J(i, j) = C_ij / (c_i + c_j - C_ij), where C_ij counts tokens
    in which both fire and c_i tokens in which i fires. Raw counts would tie every neuron
    to the hottest ones, which co-fire with everything. Jaccard is chosen over cosine
    because it is the quantity grouping pays for: of the tokens in which i or j fires
    (the group is fetched), a fraction 1 - J fetches one of the two in vain.

    Each neuron keeps its k most similar partners (ties broken arbitrarily but
    deterministically); self-loops and zero similarities are dropped, and the graph is
    the union of both directions (weight = max, which for a symmetric measure is the
    common value). C is computed `block` rows at a time, so memory is
    O(block * n_ff + n_ff * k) beyond the masks, never n_ff².
    """
    masks = _check_masks(masks)
    k = _check_positive_int(k, "k")
    block = _check_positive_int(block, "block")
    n_tokens, n = masks.shape
    counts = masks.sum(axis=0, dtype=np.int64)
    kk = min(k, n - 1)
    chunks = _token_chunks(n_tokens, n)
    # With one token chunk the float32 copy is made once and reused by every block;
    # otherwise each block re-converts chunk by chunk (T*n_ff element copies per block,
    # against T*block*n_ff multiply-adds, so negligible).
    whole = masks.astype(np.float32) if len(chunks) == 1 else None

    src_parts: list[np.ndarray] = []
    dst_parts: list[np.ndarray] = []
    sim_parts: list[np.ndarray] = []
    for b0 in range(0, n if kk > 0 else 0, block):
        b1 = min(b0 + block, n)
        # co[i - b0, j] = tokens in which both i and j fire. Sums of 0/1 in float32 are
        # exact up to 2**24 tokens.
        if whole is not None:
            co = whole[:, b0:b1].T @ whole
        else:
            co = np.zeros((b1 - b0, n), dtype=np.float32)
            for sl in chunks:
                m = masks[sl].astype(np.float32)
                co += m[:, b0:b1].T @ m
        co64 = co.astype(np.float64)
        union = counts[b0:b1, None] + counts[None, :] - co64
        sim = np.divide(co64, union, out=np.zeros_like(co64), where=union > 0)
        rows = np.arange(b1 - b0)
        sim[rows, rows + b0] = 0.0                                 # no self-loops
        top = np.argpartition(-sim, kk - 1, axis=1)[:, :kk]        # k largest per row
        top_sim = np.take_along_axis(sim, top, axis=1)
        keep = top_sim > 0
        src_parts.append(np.broadcast_to((rows + b0)[:, None], top.shape)[keep])
        dst_parts.append(top[keep])
        sim_parts.append(top_sim[keep])
        del co, co64, union, sim

    if src_parts:
        src = np.concatenate(src_parts).astype(np.int64)
        dst = np.concatenate(dst_parts).astype(np.int64)
        val = np.concatenate(sim_parts)
    else:
        src = dst = np.zeros(0, dtype=np.int64)
        val = np.zeros(0, dtype=np.float64)
    # Union of both directions: each directed pick is added as (i, j) and (j, i); a pair
    # picked from both sides appears twice and keeps its largest weight.
    rows_all = np.concatenate([src, dst])
    cols_all = np.concatenate([dst, src])
    vals_all = np.concatenate([val, val])
    order = np.lexsort((-vals_all, cols_all, rows_all))
    rows_all, cols_all, vals_all = rows_all[order], cols_all[order], vals_all[order]
    first = np.ones(rows_all.shape[0], dtype=bool)
    first[1:] = (rows_all[1:] != rows_all[:-1]) | (cols_all[1:] != cols_all[:-1])
    rows_all, adjncy, similarity = rows_all[first], cols_all[first], vals_all[first]

    xadj = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows_all, minlength=n), out=xadj[1:])
    if similarity.size:
        # Relative to the strongest edge, so small similarities keep their resolution;
        # METIS only compares weights with each other.
        scaled = np.rint(similarity / similarity.max() * WEIGHT_SCALE)
        eweights = np.clip(scaled, 1, WEIGHT_SCALE).astype(np.int64)
    else:
        eweights = np.zeros(0, dtype=np.int64)
    return CoactGraph(n=n, xadj=xadj, adjncy=adjncy.astype(np.int64), eweights=eweights,
                      similarity=similarity, counts=counts, n_tokens=n_tokens, k=k)


def _chunk_order(order: np.ndarray, group_size: int) -> np.ndarray:
    """Cut `order` into consecutive groups of group_size and sort ids inside each group."""
    group = np.arange(order.shape[0]) // group_size
    return order[np.lexsort((order, group))]


def _rebalance(part: np.ndarray, caps: np.ndarray, xadj: np.ndarray, adjncy: np.ndarray,
               sim: np.ndarray) -> np.ndarray:
    """Move vertices until part p holds exactly caps[p] of them (sum(caps) == len(part)).

    METIS keeps parts only within a few percent of balance. While some part is overfull,
    its member least connected to its own part (summed similarity) leaves first, for the
    underfull part it is most connected to, or, connected to none, the one with the most
    room. Ties go to the lowest vertex / part id, so the result is deterministic.
    """
    part = part.astype(np.int64).copy()
    nparts = caps.shape[0]
    n = part.shape[0]
    size = np.bincount(part, minlength=nparts)
    src = np.repeat(np.arange(n), np.diff(xadj))
    own = np.bincount(src, weights=sim * (part[src] == part[adjncy]), minlength=n)
    while True:
        over = np.flatnonzero(size > caps)
        if over.size == 0:
            return part
        p = int(over[0])
        members = np.flatnonzero(part == p)
        v = int(members[np.argmin(own[members])])
        nb = adjncy[xadj[v]:xadj[v + 1]]
        w = sim[xadj[v]:xadj[v + 1]]
        conn = np.bincount(part[nb], weights=w, minlength=nparts)
        room = caps - size
        under = room > 0
        if (conn[under] > 0).any():
            q = int(np.argmax(np.where(under, conn, -1.0)))
        else:
            q = int(np.argmax(room))
        # Keep `own` exact: v's neighbours lose (in p) or gain (in q) v's similarity.
        own[nb[part[nb] == p]] -= w[part[nb] == p]
        own[nb[part[nb] == q]] += w[part[nb] == q]
        own[v] = conn[q]
        part[v] = q
        size[p] -= 1
        size[q] += 1


def _metis_order(masks: np.ndarray, group_size: int, seed: int, k: int) -> np.ndarray:
    import pymetis

    n = masks.shape[1]
    graph = coactivation_graph(masks, k=k)
    deg = graph.degree
    connected = np.flatnonzero(deg > 0)
    # Vertices without edges (above all, neurons that never fire) carry no co-activation
    # information; they are left out of the partition and fill the leftover room, hottest
    # first, then whole groups of their own, which a token then rarely or never fetches.
    free = np.flatnonzero(deg == 0)
    free = free[np.lexsort((free, -graph.counts[free]))]
    n_c = connected.shape[0]
    parts_c = -(-n_c // group_size)

    if parts_c <= 1:
        groups = [connected] if n_c else []
    else:
        # Only vertices of positive degree are kept, so every edge survives; renumber.
        new_id = np.full(n, -1, dtype=np.int64)
        new_id[connected] = np.arange(n_c)
        xadj = np.concatenate([[0], np.cumsum(deg[connected])]).astype(np.int64)
        adjncy = new_id[graph.adjncy]
        ew, sim = graph.eweights, graph.similarity
        opts = pymetis.Options(seed=seed)
        _, membership = pymetis.part_graph(parts_c, pymetis.CSRAdjacency(xadj, adjncy),
                                           eweights=ew, options=opts)
        part = np.asarray(membership, dtype=np.int64)
        # Every part gets group_size except the smallest METIS part, which takes the
        # remainder (and is later topped up with free vertices).
        size = np.bincount(part, minlength=parts_c)
        short = int(np.argmin(size))
        caps = np.full(parts_c, group_size, dtype=np.int64)
        caps[short] = n_c - (parts_c - 1) * group_size
        part = _rebalance(part, caps, xadj, adjncy, sim)
        full = [connected[part == p] for p in range(parts_c) if p != short]
        full.sort(key=lambda g: int(g[0]))  # deterministic order: by lowest neuron id
        groups = full + [connected[part == short]]

    # Top up the last (partial) connected group with free vertices, then chunk the rest.
    if groups and groups[-1].shape[0] < group_size:
        take = group_size - groups[-1].shape[0]
        groups[-1] = np.concatenate([groups[-1], free[:take]])
        free = free[take:]
    for f0 in range(0, free.shape[0], group_size):
        groups.append(free[f0:f0 + group_size])
    # Only the last group can be short: a topped-up group still short used up every free
    # vertex, so nothing follows it.
    order = np.concatenate([np.sort(g) for g in groups])
    assert order.shape[0] == n
    return order


def group_neurons(masks: np.ndarray, group_size: int, method: str = "metis", seed: int = 0,
                  k: int = 32) -> Grouping:
    """Group the n_ff neurons of one FFN layer into groups of exactly `group_size`.

    masks: bool [T, n_ff], which neurons fired on each of T sample tokens.
    method: "metis" (partition the co-activation graph, see the module docstring),
    "frequency" (hottest neurons first), "random" (seeded permutation) or "identity"
    (original order). All groups have group_size neurons except the last, which has
    n_ff - (n_groups - 1) * group_size. The same inputs and seed give the same result.
    """
    masks = _check_masks(masks)
    group_size = _check_positive_int(group_size, "group_size")
    k = _check_positive_int(k, "k")
    if method not in METHODS:
        raise ValueError(f"unknown grouping method {method!r}; expected one of {', '.join(METHODS)}")
    n = masks.shape[1]
    n_groups = -(-n // group_size)
    if n_groups > MAX_GROUPS:
        raise ValueError(f"{n} neurons in groups of {group_size} make {n_groups} groups, more "
                         f"than the {MAX_GROUPS} per layer KAIROX supports; use group_size >= "
                         f"{-(-n // MAX_GROUPS)}")

    if method == "identity":
        order = np.arange(n)
    elif method == "random":
        order = _chunk_order(np.random.default_rng(seed).permutation(n), group_size)
    elif method == "frequency":
        counts = masks.sum(axis=0, dtype=np.int64)
        order = _chunk_order(np.argsort(-counts, kind="stable"), group_size)
    else:
        order = _metis_order(masks, group_size, seed, k)
    perm = order.astype(np.int32)
    group = (np.arange(n) // group_size).astype(np.int32)
    return Grouping(perm=perm, group=group, group_size=group_size, method=method)


def overfetch(masks: np.ndarray, grouping: Grouping) -> OverfetchStats:
    """How many inactive neurons `grouping` fetches along with the active ones in `masks`.

    Per token, a group is fetched iff any of its neurons is active, and brings all its
    neurons. ratio = (fetched - active) / active over all tokens (0 is perfect; 0 too when
    nothing is active). Tokens are processed in chunks, so memory stays bounded for any T.
    """
    masks = _check_masks(masks)
    n_tokens, n = masks.shape
    if grouping.perm.shape != (n,):
        raise ValueError(f"grouping is for {grouping.perm.shape[0]} neurons, masks have {n}")
    g = grouping.group_size
    starts = np.arange(0, n, g)
    sizes = np.diff(np.append(starts, n)).astype(np.int64)
    perm = grouping.perm.astype(np.intp)
    active = fetched = n_fetched_groups = 0
    for sl in _token_chunks(n_tokens, n):
        packed = masks[sl][:, perm]                                # [tc, n] in pack order
        hit = np.logical_or.reduceat(packed, starts, axis=1)       # [tc, n_groups]
        active += int(packed.sum(dtype=np.int64))
        fetched += int((hit.astype(np.int64) @ sizes).sum())
        n_fetched_groups += int(hit.sum(dtype=np.int64))
    total = n_tokens * n
    return OverfetchStats(
        n_tokens=n_tokens, n_ff=n, n_groups=starts.shape[0], active=active, fetched=fetched,
        ratio=(fetched - active) / active if active else 0.0,
        fetched_fraction=fetched / total, active_fraction=active / total,
        groups_per_token=n_fetched_groups / n_tokens)


def compare_groupings(train_masks: np.ndarray, test_masks: np.ndarray, group_size: int,
                      seed: int = 0) -> dict[str, OverfetchStats]:
    """Fit every method on `train_masks` and measure its over-fetch on `test_masks`."""
    train_masks = _check_masks(train_masks, "train_masks")
    test_masks = _check_masks(test_masks, "test_masks")
    if train_masks.shape[1] != test_masks.shape[1]:
        raise ValueError(f"train_masks have {train_masks.shape[1]} neurons, test_masks "
                         f"{test_masks.shape[1]}")
    return {m: overfetch(test_masks, group_neurons(train_masks, group_size, m, seed=seed))
            for m in ("metis", "frequency", "random", "identity")}
