"""The sparse FFN end to end: kairox.Llama and the llama.cpp tools with a pack.

Exact mode must reproduce dense on ReLU models (every neuron that fires is computed);
a pack that cannot be used is an error with a clear reason, or with fallback="dense" leaves the
model running dense, with that reason as a warning.
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
    return GGML()


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
        from kairox._native import sched_counters, sparse_counters
        sparse_counters(reset=True)
        sched_counters(reset=True)
        toks, logits = greedy(llm, N_GREEDY)
        c = sparse_counters(reset=True)
        sc = sched_counters(reset=True)
        selected, total, calls, fallbacks = c.selected, c.total, c.calls, c.fallbacks
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
    # exact mode lists only neurons whose ReLU fires: every listed activation is nonzero
    assert c.nonzero == selected
    # every layer-step ran the fused host op once; the scheduler counted one graph per decode,
    # its CPU splits' time inside its split loop's
    assert c.ffn_calls == calls and c.ffn_op_ns > 0
    assert sc["graphs"] == len(PROMPT) + N_GREEDY and sc["cpu_splits"] >= sc["graphs"]
    assert sc["splits_ns"] >= sc["cpu_ns"] + sc["drain_ns"] and sc["cpu_ns"] >= c.ffn_op_ns


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
    import kairox
    pack = tmp_path / "p.kxpack.gguf"
    shutil.copy(pack_path_for(relu_model), pack)
    damage, words = BROKEN[case]
    damage(pack)
    with pytest.raises(kairox.SparsePackError, match=words):  # asked for exact: no silent dense run
        make_llm(relu_model, sparse="exact", sparse_pack=str(pack))
    with pytest.warns(kairox.SparsePackWarning, match=words):
        llm = make_llm(relu_model, sparse="exact", sparse_pack=str(pack), fallback="dense")
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
    with pytest.raises(ValueError, match="made for a different model"):
        make_llm(relu_model, sparse="exact", sparse_pack=str(pack))
    with pytest.warns(Warning, match="made for a different model"):
        llm = make_llm(relu_model, sparse="exact", sparse_pack=str(pack), fallback="dense")
    try:
        assert llm.sparse == "dense"
    finally:
        llm.close()


def test_predicted_mode_needs_a_predictor(relu_model: Path) -> None:
    with pytest.warns(Warning, match="no predictor"):
        llm = make_llm(relu_model, sparse="predicted", fallback="dense")
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
    with pytest.raises(ValueError, match="fallback must be"):
        kairox.Llama("/nonexistent.gguf", fallback="cpu")


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
    assert r.returncode != 0 and not r.stdout.strip()  # stops before any text
    assert "not a readable GGUF" in r.stderr and "--kx-fallback dense" in r.stderr
    assert r.stderr.count("not a readable GGUF") == 1  # said once
    r = completion(native, relu_model, "--sparse", "exact", "--sparse-pack", str(bad), "--kx-fallback", "dense")
    assert r.returncode == 0
    assert "sparse mode unavailable, running dense" in r.stderr and r.stderr.count("not a readable GGUF") == 1
    assert same_text(r.stdout, dense.stdout), (r.stdout, dense.stdout)


def test_completion_tool_rejects_unknown_mode(native: Path, relu_model: Path) -> None:
    r = completion(native, relu_model, "--sparse", "fast")
    assert r.returncode != 0
    assert "--sparse must be dense, exact, predicted or threshold" in r.stderr


# --------------------------------------------------------------- architectures


def _as_qwen2(src: Path, dst: Path) -> Path:
    """The tiny silu llama GGUF relabelled as qwen2 (same tensors; qwen2 rotates with NEOX
    RoPE, so its output differs from the llama's, but dense and sparse must agree)."""
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "qwen2")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.endswith("hidden_activation"):
            continue
        w.add_key_value(name.replace("llama.", "qwen2.", 1), f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module", params=["qwen2", "gemma3"])
def arch_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tiny_gguf: Callable[..., Path]) -> tuple[str, Path, int]:
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2":
        model = _as_qwen2(tiny_gguf("f32", hidden_act="silu", vocab_size=300), d / "tiny-qwen2.gguf")
        n_layer = 2
    else:
        model = d / "gemma.gguf"
        model.symlink_to(request.getfixturevalue("gemma_gguf"))
        n_layer = 18
    write_pack(model, down_type="f32", quiet=True)
    return request.param, model, n_layer


def test_exact_and_threshold_modes_other_architectures(arch_model: tuple[str, Path, int]) -> None:
    """qwen2 (silu) and gemma3 (gelu) through the same sparse FFN helper.

    Exact mode lists the neurons that fire, and every neuron of a smooth activation fires:
    its FFN is llama.cpp's own, on the weights as llama.cpp loads them, so the logits are
    dense's bit for bit and no sparse op runs. Threshold mode with the pack's thresholds (0
    here) computes the same neurons through the sparse kernels: the selection falls back to
    all rows, and the kernels must agree with dense.

    Gemma 3's activations are large and its dense path rounds every FFN activation to
    8 bits (Q8_K/Q8_0 dot products) where the sparse down projection sums them in F32, so
    logits differ by over a logit there; dense with and without weight repacking already
    differs by 0.12 in relative (Frobenius) logit error, threshold vs dense by 0.28. The
    check: the same greedy tokens, and a relative error within 4x that noise, against
    dense loaded the same way as the sparse run (without repacking). A wrong FFN gives ~1.
    """
    import kairox
    from kairox._native import sparse_counters
    arch, model, n_layer = arch_model
    kw = dict(n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    llm = kairox.Llama(str(model), **kw)
    try:
        t_rp, l_rp = greedy(llm, 24)                  # dense, weights repacked where possible
    finally:
        llm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # exact is exact: nothing to warn about
        llm = kairox.Llama(str(model), sparse="exact", **kw)
    try:
        assert llm.sparse == "exact" and llm.sparse_layers == 0, llm.sparse_error
        sparse_counters(reset=True)
        t_x, l_x = greedy(llm, 24)
        assert sparse_counters(reset=True).calls == 0
    finally:
        llm.close()
    assert t_x == t_rp and np.array_equal(l_x, l_rp)
    with pytest.warns(kairox.SparseApproximationWarning, match="threshold mode on a (silu|gelu) model"):
        llm = kairox.Llama(str(model), sparse="threshold", **kw)
    try:
        assert llm.sparse == "threshold" and llm.sparse_layers == n_layer, llm.sparse_error
        llm.set_sparse("dense")
        t_d, l_d = greedy(llm, 24)                    # dense, same weights as the sparse run
        with pytest.warns(kairox.SparseApproximationWarning):
            llm.set_sparse("threshold")
        sparse_counters(reset=True)
        t_e, l_e = greedy(llm, 24)
        c = sparse_counters(reset=True)
    finally:
        llm.close()
    assert c.calls == n_layer * (len(PROMPT) + 24)   # every layer went through the sparse ops
    assert t_e == t_d
    centred = l_d - l_d.mean(axis=1, keepdims=True)
    rel = float(np.linalg.norm(l_e - l_d) / np.linalg.norm(centred))
    noise = float(np.linalg.norm(l_rp - l_d) / np.linalg.norm(centred))
    print(f"{arch}: threshold (0) vs dense relative logit error {rel:.3g} (dense repacked vs not {noise:.3g})")
    assert rel <= max(4 * noise, 1e-5), (arch, rel, noise)


# ------------------------------------------------------------------ predicted mode


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A KB-tiny synthetic ReLU model (89% zeros, low-rank gate) with a sketch-predictor
    pack: the predicted-mode test model (the tiny HF models' gates are full-rank noise,
    which no low-rank sketch can predict)."""
    from kairox.predictor import sketch_for_model
    from kairox.synth import PRESETS, synth
    model = synth(tmp_path_factory.mktemp("synth") / "kb-tiny.gguf", PRESETS["KB-tiny"], seed=3, quiet=True)
    write_pack(model, predictor=sketch_for_model(model), quiet=True)
    return model


@pytest.mark.parametrize("pred_type", ["f16", "q8_0"])
def test_predicted_mode_same_tokens_with_recall(synth_model: Path, tmp_path: Path, pred_type: str) -> None:
    """Predicted mode against exact and dense, with the sketch stored as F16 (the default for
    this F16 model) and as Q8_0 (the default for quantized models; its rank padded to 32)."""
    from kairox._native import sparse_counters
    from kairox.predictor import sketch_for_model
    pack = None
    if pred_type != "f16":
        pack = str(write_pack(synth_model, tmp_path / "q.kxpack.gguf", quiet=True,
                              predictor=sketch_for_model(synth_model, dtype=pred_type)))
    runs = {}
    for mode in ("dense", "exact", "predicted"):
        llm = make_llm(synth_model, sparse=mode, **({"sparse_pack": pack} if pack and mode == "predicted" else {}))
        try:
            assert llm.sparse == mode, llm.sparse_error
            sparse_counters(reset=True)
            runs[mode] = (*greedy(llm, N_GREEDY), sparse_counters(reset=True))
        finally:
            llm.close()
    (t_d, l_d, _), (t_x, l_x, cx), (t_p, l_p, cp) = runs["dense"], runs["exact"], runs["predicted"]
    assert t_x == t_d and t_p == t_d
    # synth FFNs add small updates to the residual (that keeps its bias channel calibrated),
    # so equal tokens alone prove little: the logits must match dense far more closely than
    # the same model without FFNs does (a pack whose predictor never fires, same tokens)
    blind = make_llm(synth_model, sparse="predicted", sparse_pack=str(_blind_pack(synth_model, tmp_path / "b.gguf")))
    try:
        blind.eval(PROMPT + t_d[:-1])
        l_b = np.array(blind.scores[:blind.n_tokens])
    finally:
        blind.close()
    no_ffn = float(np.abs(l_b - l_d[:len(l_b)]).max())
    err = float(np.abs(l_p - l_d).max())
    # the same token sequence in all modes, so the kernels' counters compare directly:
    # exact computes exactly the firing neurons, predicted the ones it listed
    recall = cp.nonzero / cx.nonzero
    over = cp.selected / cx.nonzero
    print(f"predicted mode: recall {recall:.4f}, over-prediction {over:.2f}, density "
          f"{cp.density:.3f} (exact {cx.density:.3f}), fallbacks {cp.fallbacks}, max |dlogit| "
          f"{err:.3g} (without FFNs: {no_ffn:.3g})")
    assert no_ffn > 1e-5 and err <= 0.05 * no_ffn
    assert cp.calls == cx.calls == 2 * (len(PROMPT) + N_GREEDY)
    assert cp.fallbacks == 0 and cp.density < 0.5
    assert recall >= 0.98
    assert 1.0 <= over < 3.0


def _blind_pack(model: Path, out: Path) -> Path:
    """A pack whose predictor never fires: predicted mode drops the FFN."""
    from kairox.predictor import never_fires
    return write_pack(model, out, predictor=never_fires(model), quiet=True)


def test_switching_modes_rebuilds_the_graph(synth_model: Path, tmp_path: Path) -> None:
    """One context, single-token decodes (whose graphs llama.cpp reuses): each switch must
    take effect at the next decode."""
    pack = _blind_pack(synth_model, tmp_path / "blind.kxpack.gguf")
    llm = make_llm(synth_model, sparse="exact", sparse_pack=str(pack))
    try:
        def step() -> np.ndarray:
            llm.reset()
            for tok in PROMPT:
                llm.eval([tok])
            return np.array(llm.scores[llm.n_tokens - 1])
        runs = []
        for mode in ("dense", "predicted", "dense", "exact", "predicted"):
            llm.set_sparse(mode)
            assert llm.sparse == mode
            runs.append(step())
    finally:
        llm.close()
    dense, blind, dense2, exact, blind2 = runs
    no_ffn = float(np.abs(blind - dense).max())  # what dropping every FFN changes
    print(f"dropping the FFNs changes the logits by {no_ffn:.3g}; exact mode by "
          f"{float(np.abs(exact - dense).max()):.3g}")
    assert np.array_equal(dense, dense2)
    assert np.array_equal(blind, blind2)
    assert no_ffn > 1e-5
    assert np.abs(exact - dense).max() <= 0.01 * no_ffn


def test_cli_tool_modes_generate_the_same_text(native: Path, synth_model: Path) -> None:
    """kairox-cli (llama-cli) single-turn: exact and predicted print what dense prints."""
    def cli(*extra: str) -> str:
        r = run_tool(native, "llama-cli", "-m", str(synth_model), "-p", "Once upon a time", "-n", "48",
                     "--temp", "0", "-st", "--simple-io", "-t", "2", "-lv", "3", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        assert ("kairox: FFN mode" in r.stderr) == bool(extra)
        return "\n".join(ln for ln in r.stdout.splitlines() if "t/s" not in ln)  # drop timings
    dense = cli()
    assert len(dense) > 100
    for mode in ("exact", "predicted"):
        assert cli("--sparse", mode) == dense, mode


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic ReLU model 256 wide: its down rows split into whole K-quant super-blocks."""
    from kairox.synth import Shape, synth
    return synth(tmp_path_factory.mktemp("wide") / "kb-wide.gguf", Shape(2, 256, 1024, 4, 2, "f32"), seed=3,
                 quiet=True)


def _teacher_forced(model: Path, seq: list[int], **kw) -> np.ndarray:
    llm = make_llm(model, **kw)
    try:
        assert llm.sparse == kw.get("sparse", "dense"), llm.sparse_error
        llm.eval(seq)
        return np.array(llm.scores[:llm.n_tokens])
    finally:
        llm.close()


def test_exact_mode_k_quant_down_rows(wide_model: Path, tmp_path: Path) -> None:
    """Packs whose down rows are Q4_K or Q6_K (half and three quarters of Q8_0's bytes) run
    exact mode through the host kernels: on one token sequence their logits stay close to
    dense, far closer than the same model without FFNs, and each type's error sits in the
    order its rounding predicts (Q6_K below Q4_K; Q8_0 below both)."""
    from kairox._native import sparse_counters
    from kairox.pack import read_pack
    seq = PROMPT + list(range(20, 60))
    dense = _teacher_forced(wide_model, seq)
    errs = {}
    for dt in ("q8_0", "q6_k", "q4_k"):
        pk = write_pack(wide_model, tmp_path / f"{dt}.kxpack.gguf", down_type=dt, quiet=True)
        assert all(layer.down_type == dt for layer in read_pack(pk, wide_model).layers)
        sparse_counters(reset=True)
        got = _teacher_forced(wide_model, seq, sparse="exact", sparse_pack=str(pk))
        c = sparse_counters(reset=True)
        assert c.calls == 2 * len(seq) and c.density < 0.5  # the sparse path ran, sparsely
        errs[dt] = float(np.abs(got - dense).max())
    blind = _teacher_forced(wide_model, seq, sparse="predicted",
                            sparse_pack=str(_blind_pack(wide_model, tmp_path / "b.kxpack.gguf")))
    no_ffn = float(np.abs(blind - dense).max())
    print(f"max |dlogit| by down type: {errs}; without FFNs {no_ffn:.3g}")
    assert no_ffn > 1e-4
    assert errs["q8_0"] < errs["q6_k"] < errs["q4_k"] <= 0.1 * no_ffn
