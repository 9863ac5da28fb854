"""The sparse FFN end to end: kairox.Llama and the llama.cpp tools with a pack.

Exact mode must reproduce dense on ReLU models (every neuron that fires is computed);
a pack that cannot be used must leave the model running dense, with a clear reason.
Each sparse run also checks, through the CPU kernels' counters, that the sparse path
really ran (a silently dense run would pass any equality test).
"""
from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kairox.pack import pack_path_for, write_pack

N_GREEDY = 256
PROMPT = list(range(1, 9))


@pytest.fixture(scope="module")
def relu_model(tmp_path_factory: pytest.TempPathFactory, tiny_relu_gguf: Path) -> Path:
    """The tiny ReLU model in its own folder, with an identity pack next to it."""
    d = tmp_path_factory.mktemp("sparse")
    model = d / "tiny-relu.gguf"
    shutil.copy(tiny_relu_gguf, model)
    write_pack(model, quiet=True)
    return model


@pytest.fixture(scope="module")
def ops(native: Path):
    from ggml_ops import GGML
    return GGML(native)


def make_llm(model: Path, **kw):
    import kairox
    # single-token decodes (prefill above 8 tokens stays dense) and an F32 KV cache (F16
    # rounding of K/V would turn float-order differences into 1e-3 logit differences)
    base = dict(n_ctx=512, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    base.update(kw)
    return kairox.Llama(str(model), **base)


def greedy(llm, n: int) -> tuple[list[int], np.ndarray]:
    llm.reset()
    llm.eval(PROMPT)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out, np.array(llm.scores[:llm.n_tokens])


@pytest.fixture(scope="module")
def dense_run(relu_model: Path) -> tuple[list[int], np.ndarray]:
    llm = make_llm(relu_model)
    try:
        assert llm.sparse == "dense"
        return greedy(llm, N_GREEDY)
    finally:
        llm.close()


def test_exact_mode_reproduces_dense(relu_model: Path, dense_run, ops) -> None:
    llm = make_llm(relu_model, sparse="exact")
    try:
        assert llm.sparse == "exact" and llm.sparse_error is None
        ops.select_stats(reset=True)
        toks, logits = greedy(llm, N_GREEDY)
        selected, total, calls, fallbacks = ops.select_stats(reset=True)
    finally:
        llm.close()
    want_toks, want_logits = dense_run
    assert toks == want_toks
    delta = float(np.abs(logits - want_logits).max())
    assert delta <= 1e-3, delta
    # the sparse path ran for every layer of every decode, and it was sparse
    n_layer = 2
    assert calls == n_layer * (len(PROMPT) + N_GREEDY)
    assert fallbacks == 0
    density = selected / total
    print(f"exact mode: max |dlogit| {delta:.2e}, density {density:.3f} over {calls} layer-steps")
    assert 0.02 < density < 0.4


def test_exact_mode_small_batches_take_the_union(relu_model: Path, dense_run, ops) -> None:
    want_toks, want_logits = dense_run
    seq = PROMPT + want_toks[:40]
    for n_batch in (3, 8):
        dense = make_llm(relu_model, n_batch=n_batch, n_ubatch=n_batch)
        exact = make_llm(relu_model, n_batch=n_batch, n_ubatch=n_batch, sparse="exact")
        try:
            dense.eval(seq)
            ops.select_stats(reset=True)
            exact.eval(seq)
            selected, total, calls, _ = ops.select_stats(reset=True)
            a = np.array(dense.scores[:len(seq)])
            b = np.array(exact.scores[:len(seq)])
        finally:
            dense.close()
            exact.close()
        assert calls == 2 * -(-len(seq) // n_batch)
        assert np.abs(a - b).max() <= 1e-3
        assert np.array_equal(a.argmax(1), b.argmax(1))
        # a union over several tokens is denser than one token's set, still far from all
        assert selected < total


def test_large_batches_stay_dense(relu_model: Path, ops) -> None:
    llm = make_llm(relu_model, n_batch=64, n_ubatch=64, sparse="exact")
    try:
        ops.select_stats(reset=True)
        llm.eval(list(range(1, 33)))
        assert ops.select_stats(reset=True)[2] == 0  # prefill of 32 tokens: dense
        llm.eval([5])
        assert ops.select_stats(reset=True)[2] == 2  # one decode step: sparse, 2 layers
    finally:
        llm.close()


def test_no_pack_means_dense(relu_model: Path, tmp_path: Path) -> None:
    alone = tmp_path / "alone.gguf"
    shutil.copy(relu_model, alone)
    llm = make_llm(alone)
    try:
        assert llm.sparse == "dense" and llm.sparse_error is None
    finally:
        llm.close()


# --------------------------------------------------------------- refused packs


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[:len(data) // 2])


def _garble(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[8:64] = b"\xff" * 56  # tensor count, KV count and the first key
    p.write_bytes(bytes(data))


BROKEN = {
    "missing": (lambda p: p.unlink(), "no pack at"),
    "truncated": (_truncate, "truncated"),
    "corrupt": (_garble, "not a readable GGUF"),
    "not-gguf": (lambda p: p.write_bytes(b"hello, world\n" * 100), "not a readable GGUF"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_pack_is_refused_and_dense_runs(case: str, relu_model: Path, tmp_path: Path,
                                               dense_run) -> None:
    pack = tmp_path / "p.kxpack.gguf"
    shutil.copy(pack_path_for(relu_model), pack)
    damage, words = BROKEN[case]
    damage(pack)
    with pytest.warns(Warning, match=words):
        llm = make_llm(relu_model, sparse="exact", sparse_pack=str(pack))
    try:
        assert llm.sparse == "dense" and words in llm.sparse_error
        toks, _ = greedy(llm, 16)
        assert toks == dense_run[0][:16]
    finally:
        llm.close()


def test_pack_of_another_model_is_refused(relu_model: Path, tiny_gguf: Callable[..., Path],
                                          tmp_path: Path) -> None:
    other = tiny_gguf("f32", hidden_act="relu", seed=7)
    pack = write_pack(other, tmp_path / "other.kxpack.gguf", quiet=True)
    with pytest.warns(Warning, match="made for a different model"):
        llm = make_llm(relu_model, sparse="exact", sparse_pack=str(pack))
    try:
        assert llm.sparse == "dense"
    finally:
        llm.close()


def test_predicted_mode_needs_a_predictor(relu_model: Path) -> None:
    with pytest.warns(Warning, match="no predictor"):
        llm = make_llm(relu_model, sparse="predicted")
    try:
        assert llm.sparse == "dense"
        with pytest.raises(ValueError, match="no predictor"):
            llm.set_sparse("predicted")
        llm.set_sparse("exact")  # the pack itself was loaded
        assert llm.sparse == "exact"
    finally:
        llm.close()


def test_bad_options() -> None:
    import kairox
    with pytest.raises(ValueError, match="sparse must be one of"):
        kairox.Llama("/nonexistent.gguf", sparse="fast")


# ----------------------------------------------------------------------- tools


def run_tool(native: Path, tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = native.parent / "bin" / tool
    if not exe.exists():
        pytest.skip(f"{exe} is not built")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300)


def same_text(a: str, b: str) -> bool:
    """llama-completion prints through an asynchronous logger that can lose the last piece
    of text at exit, so two runs agree when one output is a prefix of the other (and both
    are long: 64 tokens of a random model are hundreds of characters)."""
    n = min(len(a), len(b))
    return n > 100 and a[:n] == b[:n] and abs(len(a) - len(b)) < 40


def completion(native: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_tool(native, "llama-completion", "-m", str(model), "-p", "Once upon a time", "-n", "64",
                    "--temp", "0", "-no-cnv", "-t", "2", *extra)


def test_completion_tool_exact_matches_dense(native: Path, relu_model: Path) -> None:
    dense = completion(native, relu_model)
    exact = completion(native, relu_model, "--sparse", "exact")
    assert dense.returncode == 0 and exact.returncode == 0, exact.stderr[-2000:]
    assert "FFN mode exact" in exact.stderr
    assert same_text(exact.stdout, dense.stdout), (exact.stdout, dense.stdout)


def test_completion_tool_refuses_bad_pack(native: Path, relu_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.kxpack.gguf"
    bad.write_bytes(b"not a pack")
    dense = completion(native, relu_model)
    r = completion(native, relu_model, "--sparse", "exact", "--sparse-pack", str(bad))
    assert r.returncode == 0
    assert "sparse pack refused" in r.stderr and "running dense" in r.stderr
    assert same_text(r.stdout, dense.stdout), (r.stdout, dense.stdout)


def test_completion_tool_rejects_unknown_mode(native: Path, relu_model: Path) -> None:
    r = completion(native, relu_model, "--sparse", "fast")
    assert r.returncode != 0
    assert "--sparse must be dense, exact or predicted" in r.stderr
