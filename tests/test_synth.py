"""`kairox synth`: the ReLU models are as sparse as asked and the sketch predictor sees it."""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kairox.checkpoint import HFConfig
from kairox.cli import main
from kairox.gguf_header import GGUFHeader, scan_header
from kairox.pack import read_model_tensor, read_pack
from kairox.pack import predictor_scores
from kairox.predictor import default_rank, recall_and_overprediction, sketch_predictor
from kairox.reference import LlamaReference, rms_norm
from kairox.synth import PRESETS, Shape, SparseFFN, SynthError, firing_rates, synth, token_topics, topic_prompts

SPARSITY = 0.89
N_TOKENS = 256  # the zero fraction of a rank-3 gate (KB-tiny) varies from token to token

_HF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, vocab_gguf: Path) -> Path:
    """KB-tiny (2 x 64 x 256, F32) with the full default vocabulary, written by the CLI."""
    out = tmp_path_factory.mktemp("synth") / "kb-tiny.gguf"
    assert main(["synth", "--preset", "KB-tiny", "--sparsity", str(SPARSITY), "-o", str(out), "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def hdr(tiny: Path) -> GGUFHeader:
    # scan_header + memmap: GGUFReader would parse all 32000 vocabulary strings first
    return scan_header(tiny)


def reference(hdr: GGUFHeader) -> LlamaReference:
    """The numpy reference model over the GGUF's tensors. Q and K rows are in llama.cpp's
    order, so RoPE pairs other dimensions than llama.cpp does; for random weights that
    changes no statistic, and the FFN inputs are what these tests look at."""
    weights = {"model.embed_tokens.weight": read_model_tensor(hdr, "token_embd.weight"),
               "model.norm.weight": read_model_tensor(hdr, "output_norm.weight"),
               "lm_head.weight": read_model_tensor(hdr, "output.weight")}
    kv = hdr.kv
    for il in range(kv["llama.block_count"]):
        for short, hf in _HF_NAMES.items():
            weights[f"model.layers.{il}.{hf}.weight"] = read_model_tensor(hdr, f"blk.{il}.{short}.weight")
    cfg = HFConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": kv["llama.embedding_length"],
        "intermediate_size": kv["llama.feed_forward_length"], "num_hidden_layers": kv["llama.block_count"],
        "num_attention_heads": kv["llama.attention.head_count"],
        "num_key_value_heads": kv["llama.attention.head_count_kv"], "hidden_act": "relu",
        "rms_norm_eps": kv["llama.attention.layer_norm_rms_epsilon"],
        "vocab_size": weights["model.embed_tokens.weight"].shape[0]}, source="test")
    return LlamaReference(cfg, weights)


def ffn_inputs(hdr: GGUFHeader, tokens: np.ndarray) -> list[np.ndarray]:
    """Each layer's FFN input (after ffn_norm) on a forward pass over `tokens`."""
    got: dict[int, np.ndarray] = {}
    reference(hdr)._forward(tokens, ffn_input_hook=lambda il, h, lw: got.__setitem__(il, h.copy()))
    return [got[il] for il in sorted(got)]


def tokens(n: int = N_TOKENS) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 32000, n)


def test_layer0_sparsity_from_the_embedding(hdr: GGUFHeader) -> None:
    # The FFN input of layer 0 is ~ RMSNorm(embedding) x ffn_norm: the attention update is
    # a percent of the embedding by design, so it is left out here.
    embd = read_model_tensor(hdr, "token_embd.weight")[tokens()]
    x = rms_norm(embd, read_model_tensor(hdr, "blk.0.ffn_norm.weight"), 1e-5)
    gate = read_model_tensor(hdr, "blk.0.ffn_gate.weight")
    zeros = float(np.mean(x @ gate.T <= 0))
    assert abs(zeros - SPARSITY) <= 0.04, zeros
    a, b, c = sketch_predictor(gate, read_model_tensor(hdr, "blk.0.ffn_norm.weight"), default_rank(64, 256))
    recall, over = recall_and_overprediction(predictor_scores(a, b, c, x) > 0, x @ gate.T > 0)
    assert recall >= 0.98 and over <= 2.0, (recall, over)


def test_every_layer_is_sparse_and_predicted(tmp_path: Path, tiny: Path, hdr: GGUFHeader) -> None:
    """A real forward pass, attention included; the predictor is the one `kairox pack` stores."""
    pack_path = tmp_path / "tiny.kxpack.gguf"
    assert main(["pack", str(tiny), "-o", str(pack_path), "-q"]) == 0
    pack = read_pack(pack_path, tiny)
    for il, x in enumerate(ffn_inputs(hdr, tokens())):
        active = x @ read_model_tensor(hdr, f"blk.{il}.ffn_gate.weight").T > 0
        assert abs(1 - active.mean() - SPARSITY) <= 0.04, (il, 1 - active.mean())
        recall, over = recall_and_overprediction(pack.layers[il].predictor_scores(x) > 0, active)
        assert recall >= 0.98 and over <= 2.0, (il, recall, over)


def test_bias_channel_and_quiet_layers(hdr: GGUFHeader) -> None:
    n = 64
    embd = read_model_tensor(hdr, "token_embd.weight")
    np.testing.assert_allclose(embd[:, 0], 0.02 * math.sqrt((n - 1) / 3))
    assert abs(float(embd[:, 1:].std()) - 0.02) < 0.001
    for il in range(2):
        for name in ("attn_output", "ffn_down"):
            w = read_model_tensor(hdr, f"blk.{il}.{name}.weight")
            assert np.all(w[0] == 0), name  # nothing is written into the bias channel
            assert 0 < np.abs(w[1:]).max() < 0.02, name
        for name in ("attn_norm", "ffn_norm"):
            assert np.all(read_model_tensor(hdr, f"blk.{il}.{name}.weight") == 1)
    # the residual stream stays ~ the embedding: x̂ hardly moves between layers
    x = ffn_inputs(hdr, tokens(32))
    assert np.abs(x[1] - x[0]).max() < 0.1
    # x̂₀ = sqrt(n)/2 on average (over 63 token channels a row's RMS varies by ~10%)
    assert abs(float(x[1][:, 0].mean()) - math.sqrt(n) / 2) < 0.1


SMALL_SHAPE = Shape(2, 128, 384, 4, 2, "f16")


@pytest.fixture(scope="module")
def small_vocab(vocab_of_size: Callable[[int], Path]) -> Path:
    return vocab_of_size(300)


def test_gate_rank_and_sparsity_options(tmp_path: Path, small_vocab: Path) -> None:
    out = synth(tmp_path / "m.gguf", SMALL_SHAPE, vocab_gguf=small_vocab, quiet=True,
                sparse=SparseFFN(sparsity=0.7, gate_rank=6))
    hdr = scan_header(out)
    assert "sparsity 0.7 gate rank 6" in hdr.kv["general.name"]
    gate = read_model_tensor(hdr, "blk.1.ffn_gate.weight")
    s = np.linalg.svd(gate, compute_uv=False)
    assert s[5] > 5 * s[6]  # rank 6 (5 token directions and the bias) plus small noise
    x = rms_norm(read_model_tensor(hdr, "token_embd.weight")[np.arange(300)], 1.0, 1e-5)
    assert abs(float(np.mean(x @ gate.T <= 0)) - 0.7) <= 0.04


def test_same_seed_same_bytes(tmp_path: Path, small_vocab: Path) -> None:
    a = synth(tmp_path / "a.gguf", SMALL_SHAPE, seed=3, vocab_gguf=small_vocab, quiet=True)
    b = synth(tmp_path / "b.gguf", SMALL_SHAPE, seed=3, vocab_gguf=small_vocab, quiet=True)
    c = synth(tmp_path / "c.gguf", SMALL_SHAPE, seed=4, vocab_gguf=small_vocab, quiet=True)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_silu_stays_dense_random(tmp_path: Path, small_vocab: Path) -> None:
    hdr = scan_header(synth(tmp_path / "s.gguf", SMALL_SHAPE, act="silu", vocab_gguf=small_vocab,
                            quiet=True))
    assert hdr.kv["llama.hidden_activation"] == "silu"
    assert read_model_tensor(hdr, "token_embd.weight")[:, 0].std() > 0.01  # no bias channel
    with pytest.raises(SynthError, match="only to ReLU"):
        synth(tmp_path / "t.gguf", SMALL_SHAPE, act="silu", sparse=SparseFFN(), vocab_gguf=small_vocab)


@pytest.mark.parametrize("sparse,message", [
    (SparseFFN(gate_rank=1), r"gate rank must be an integer in 2\.\.128"),
    (SparseFFN(gate_rank=129), r"gate rank must be an integer in 2\.\.128"),
    (SparseFFN(sparsity=1.0), "strictly between 0 and 1"),
    (SparseFFN(sparsity=0.0), "strictly between 0 and 1"),
])
def test_refusals(tmp_path: Path, small_vocab: Path, sparse: SparseFFN, message: str) -> None:
    with pytest.raises(SynthError, match=message):
        synth(tmp_path / "x.gguf", SMALL_SHAPE, sparse=sparse, vocab_gguf=small_vocab)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["--act", "silu", "--sparsity", "0.8"], "apply only to --act relu"),
    (["--gate-rank", "1"], r"gate rank must be an integer in 2\.\.64"),
    (["--sparsity", "1.5"], r"argument --sparsity: must be in \(0, 1\), got 1.5"),
    (["--sparsity", "x"], "argument --sparsity: must be a number"),
    (["--topics", "300"], r"topics must be an integer in 0\.\.255"),
    (["--topic-share", "1"], r"topic share must be in \[0, 1\)"),
    (["--rate-spread", "-2"], r"rate spread must be in 0\.\.4"),
    (["--act", "silu", "--topics", "3"], "apply only to --act relu"),
    (["--layers", "0"], "argument --layers"),
])
def test_cli_errors(capsys: pytest.CaptureFixture, tmp_path: Path, args: list[str], message: str) -> None:
    argv = ["synth", "--preset", "KB-tiny", "-o", str(tmp_path / "x.gguf"), "-q", *args]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "kairox synth: error: " in err and re.search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_on_stderr(capsys: pytest.CaptureFixture, tmp_path: Path, small_vocab: Path) -> None:
    synth(tmp_path / "p.gguf", SMALL_SHAPE, vocab_gguf=small_vocab)
    out, err = capsys.readouterr()
    assert "synth p.gguf" in err and "tensor" in err and out == ""
    synth(tmp_path / "q.gguf", SMALL_SHAPE, vocab_gguf=small_vocab, quiet=True)
    assert capsys.readouterr() == ("", "")


def test_presets_are_kept() -> None:
    assert PRESETS["KB-350M"] == Shape(24, 1024, 2816, 16, 16, "f16")
    assert PRESETS["KB-7B"] == Shape(32, 4096, 11008, 32, 32, "f16")


def test_firing_rates_mean_and_spread() -> None:
    rng = np.random.default_rng(0)
    flat = firing_rates(rng, 4096, 0.11, 0.0)
    assert np.all(flat == 0.11)
    r = firing_rates(rng, 4096, 0.11, 1.6)
    assert abs(r.mean() - 0.11) < 1e-6 and r.min() >= 1e-4 and r.max() <= 0.95
    # uneven: a quarter of the neurons carries most of the expected activations
    top = np.sort(r)[::-1]
    assert top[:1024].sum() / top.sum() > 0.7
    with pytest.raises(SynthError, match="rate spread"):
        SparseFFN(rate_spread=-1).check()
    with pytest.raises(SynthError, match="topics must be"):
        SparseFFN(topics=300).check()


def test_topics_shape_the_embedding(tmp_path: Path, small_vocab: Path) -> None:
    m = synth(tmp_path / "t.gguf", SMALL_SHAPE, vocab_gguf=small_vocab, quiet=True, seed=5,
              sparse=SparseFFN(topics=4, topic_share=0.5, domains=0))
    hdr = scan_header(m)
    assert hdr.kv["kairox.synth.topics"] == 4 and hdr.kv["kairox.synth.seed"] == 5
    e = read_model_tensor(hdr, "token_embd.weight")[:, 1:]
    topic = token_topics(5, 300, 4)
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    cos = e @ e.T
    same = topic[:, None] == topic[None, :]
    off = ~np.eye(300, dtype=bool)
    # cos of two tokens of one topic ≈ ρ = 0.5, of different topics ≈ 0
    assert abs(cos[same & off].mean() - 0.5) < 0.05, cos[same & off].mean()
    assert abs(cos[~same].mean()) < 0.02
    flat = synth(tmp_path / "f.gguf", SMALL_SHAPE, vocab_gguf=small_vocab, quiet=True, seed=5,
                 sparse=SparseFFN(topics=0))
    ef = read_model_tensor(scan_header(flat), "token_embd.weight")[:, 1:]
    ef = ef / np.linalg.norm(ef, axis=1, keepdims=True)
    assert abs((ef @ ef.T)[off].mean()) < 0.02
    # domains: topics 1, 3 in domain 0, topics 2, 4 in domain 1; a token's cos with another
    # token of its domain ≈ ρ_d (+ ρ_t when the topic is the same), 0 across domains
    dm = synth(tmp_path / "d.gguf", SMALL_SHAPE, vocab_gguf=small_vocab, quiet=True, seed=5,
               sparse=SparseFFN(topics=4, topic_share=0.1, domains=2, domain_share=0.4))
    assert scan_header(dm).kv["kairox.synth.domains"] == 2
    ed = read_model_tensor(scan_header(dm), "token_embd.weight")[:, 1:]
    ed = ed / np.linalg.norm(ed, axis=1, keepdims=True)
    cd = ed @ ed.T
    dom = np.where(topic > 0, (topic - 1) % 2, -1)
    same_dom = (dom[:, None] == dom[None, :]) & (dom[:, None] >= 0)
    assert abs(cd[same & off & (topic[:, None] > 0)].mean() - 0.5) < 0.05
    assert abs(cd[same_dom & ~same].mean() - 0.4) < 0.05, cd[same_dom & ~same].mean()
    assert abs(cd[~same_dom & ~same].mean()) < 0.02
    with pytest.raises(SynthError, match="domains must be"):
        SparseFFN(topics=4, domains=3).check()
    with pytest.raises(SynthError, match="domain share"):
        SparseFFN(topic_share=0.5, domain_share=0.5).check()


def test_topic_prompts(tmp_path: Path, vocab_gguf: Path) -> None:
    m = synth(tmp_path / "m.gguf", Shape(1, 64, 128, 4, 4, "f32"), quiet=True, seed=2,
              sparse=SparseFFN(domains=0))
    topic = token_topics(2, 32000, 32)
    p = topic_prompts(m, 3, 400, seed=1, common=0.3)
    assert len(p) == 3 and all(len(x) == 400 for x in p)
    for toks in p:
        t = topic[np.array(toks)]
        assert min(toks) >= 3  # no control tokens
        main_topic = np.bincount(t[t > 0]).argmax()
        assert set(t) == {0, main_topic}  # common words and one topic
        assert abs(np.mean(t == 0) - 0.3) < 0.07
    assert topic_prompts(m, 3, 400, seed=1, common=0.3) == p != topic_prompts(m, 3, 400, seed=2, common=0.3)
    drift = topic_prompts(m, 1, 400, switch_every=100, seed=3)[0]
    stretches = [set(topic[np.array(drift[i:i + 100])]) - {0} for i in range(0, 400, 100)]
    assert all(len(s) == 1 for s in stretches) and len(set().union(*stretches)) > 1
    with pytest.raises(SynthError, match="not a kairox synthetic model"):
        topic_prompts(vocab_gguf, 1, 10)
    with pytest.raises(SynthError, match="no domains"):
        topic_prompts(m, 1, 10, domains=["code"])


def test_session_prompts_change_domain(tmp_path: Path) -> None:
    """The default model has 4 domains: a session's requests use their domain's common
    words and topics only, in the order asked."""
    from kairox.synth import DOMAIN_NAMES, topic_domains
    m = synth(tmp_path / "m.gguf", Shape(1, 64, 128, 4, 4, "f32"), quiet=True, seed=2)
    topic = token_topics(2, 32000, 32)
    order = ["code", "prose", "dialogue", "code", 3]
    p = topic_prompts(m, 5, 300, seed=1, domains=order)
    for toks, d in zip(p, order):
        want = DOMAIN_NAMES.index(d) if isinstance(d, str) else d
        t = topic[np.array(toks)]
        assert 0 not in t  # the shared common words stay out: each domain has its own
        assert set(topic_domains(t, 4)) == {want}
        assert abs(np.mean(t == want + 1) - 0.5) < 0.08  # half the words: the domain's common words
    drift = topic_prompts(m, 1, 400, seed=3, domains=[1], switch_every=100)[0]
    t = topic[np.array(drift)]
    assert set(topic_domains(t, 4)) == {1} and len(set(t)) > 2  # topics change, the domain stays
    with pytest.raises(SynthError, match="unknown domain"):
        topic_prompts(m, 1, 10, domains=["poetry"])
    with pytest.raises(SynthError, match="domains for"):
        topic_prompts(m, 2, 10, domains=["code"])


def test_q4_0_model(tmp_path: Path, small_vocab: Path) -> None:
    import gguf
    m = synth(tmp_path / "q.gguf", Shape(2, 128, 384, 4, 2, "q4_0"), vocab_gguf=small_vocab, quiet=True)
    hdr = scan_header(m)
    Q = gguf.GGMLQuantizationType
    types = {t.name: Q(t.type_id) for t in hdr.tensors}
    assert types["blk.0.ffn_gate.weight"] == Q.Q4_0 and types["token_embd.weight"] == Q.Q4_0
    assert types["blk.0.ffn_norm.weight"] == Q.F32
    assert hdr.kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    for il in range(2):
        assert np.all(read_model_tensor(hdr, f"blk.{il}.ffn_down.weight")[0] == 0)
    # the dequantized model is sparse as asked (quantization moves the gate by ~1/16 of a row's max)
    x = rms_norm(read_model_tensor(hdr, "token_embd.weight"), 1.0, 1e-5)
    zeros = float(np.mean(x @ read_model_tensor(hdr, "blk.1.ffn_gate.weight").T <= 0))
    assert abs(zeros - 0.89) < 0.04, zeros
    with pytest.raises(SynthError, match="multiples of 32"):
        synth(tmp_path / "bad.gguf", Shape(1, 48, 96, 4, 4, "q4_0"), vocab_gguf=small_vocab, quiet=True)


def test_locality_comes_from_topics(tmp_path: Path) -> None:
    """On the real forward pass (llama.cpp with the collector): topic text reuses neurons
    from token to token and differs between prompts; random tokens show neither."""
    from kairox.profile import stats_on_prompts
    m = synth(tmp_path / "m.gguf", Shape(2, 256, 1024, 4, 4, "f32"), quiet=True, seed=1)
    topical = stats_on_prompts(m, topic_prompts(m, 8, 256, seed=4), threads=2)
    rng = np.random.default_rng(4)
    rand = stats_on_prompts(m, [list(rng.integers(300, 32000, 256)) for _ in range(8)], threads=2)
    for lt, lr in zip(topical.layers, rand.layers):
        assert abs(lt.density - 0.11) < 0.02 and abs(lr.density - 0.11) < 0.02
        assert lt.adjacent_jaccard < lr.adjacent_jaccard - 0.03, (lt.adjacent_jaccard, lr.adjacent_jaccard)
        assert lt.cross_prompt_jaccard > lr.cross_prompt_jaccard + 0.1, (lt.cross_prompt_jaccard, lr.cross_prompt_jaccard)
        assert lt.hot_fraction_80 < 0.4  # uneven rates
        assert lt.hidden_cosine is None or lt.hidden_cosine > 0.9


def test_cli_writes_the_pack(tmp_path: Path) -> None:
    out = tmp_path / "t.gguf"
    assert main(["synth", "--preset", "KB-tiny", "-o", str(out), "--pack", "-q"]) == 0
    pack = read_pack(tmp_path / "t.kxpack.gguf", out)
    assert len(pack.layers) == 2 and pack.layers[0].predictor_scores(np.ones(64, np.float32)).shape == (256,)
    # frequencies measured on the real forward pass (default --profile): uneven, ~11% mean
    for layer in pack.layers:
        assert abs(float(layer.freq.mean()) - 0.11) < 0.04 and layer.freq.std() > 0.02
    assert pack.method["kind"] == "synth" and pack.method["profile_tokens"] == 2048
    # --profile 0: unknown (1.0 everywhere)
    assert main(["synth", "--preset", "KB-tiny", "-o", str(tmp_path / "u.gguf"), "--pack", "--profile", "0", "-q"]) == 0
    assert all(np.all(la.freq == 1.0) for la in read_pack(tmp_path / "u.kxpack.gguf").layers)


def test_cli_pack_only_packs_an_earlier_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Model and pack in two runs (the model needs no GPU, the profile does) give the pack
    of one run; --pack-only never rewrites the model and needs it to exist."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    assert main(["synth", "--preset", "KB-tiny", "-o", str(one / "m.gguf"), "--pack", "--profile", "64", "-q"]) == 0
    assert main(["synth", "--preset", "KB-tiny", "-o", str(two / "m.gguf"), "-q"]) == 0
    model_bytes = (two / "m.gguf").read_bytes()
    assert not (two / "m.kxpack.gguf").exists()
    assert main(["synth", "--preset", "KB-tiny", "-o", str(two / "m.gguf"), "--pack-only", "--profile", "64", "-q"]) == 0
    assert (two / "m.gguf").read_bytes() == model_bytes == (one / "m.gguf").read_bytes()
    assert (two / "m.kxpack.gguf").read_bytes() == (one / "m.kxpack.gguf").read_bytes()
    # another predictor storage for the same model (a second pack beside it, as the benchmarks do)
    (two / "q.gguf").hardlink_to(two / "m.gguf")
    assert main(["synth", "--preset", "KB-tiny", "-o", str(two / "q.gguf"), "--pack-only", "--profile", "64",
                 "--pred-type", "q8_0", "-q"]) == 0
    assert read_pack(two / "m.kxpack.gguf").layers[0].stored["pred_b"][1] != "q8_0"
    assert read_pack(two / "q.kxpack.gguf").layers[0].stored["pred_b"][1] == "q8_0"
    capsys.readouterr()
    assert main(["synth", "--preset", "KB-tiny", "-o", str(tmp_path / "none.gguf"), "--pack-only", "-q"]) == 2
    assert "no model at" in capsys.readouterr().err


def test_cli_never_overwrites_a_model_without_force(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"another model")
    assert main(["synth", "--preset", "KB-tiny", "-o", str(out), "-q"]) == 2
    assert f"{out} exists; give --force" in capsys.readouterr().err
    assert out.read_bytes() == b"another model"
    assert main(["synth", "--preset", "KB-tiny", "-o", str(out), "-q", "--force"]) == 0
    assert out.stat().st_size > 1000


def _moe_logits_of_one_token(hdr: GGUFHeader, tok: int) -> np.ndarray:
    """Qwen3-MoE's logits for a lone token at position 0, in numpy: attention over one key is
    its value (RoPE and the q/k norms change nothing there); the router's softmax picks the
    top n_expert_used experts, their weights renormalized, each a SwiGLU FFN."""
    kv = hdr.kv
    eps, k = kv["qwen3moe.attention.layer_norm_rms_epsilon"], kv["qwen3moe.expert_used_count"]
    w = lambda name: read_model_tensor(hdr, name).astype(np.float64)  # noqa: E731
    h = w("token_embd.weight")[tok]
    for il in range(kv["qwen3moe.block_count"]):
        p = f"blk.{il}."
        x = rms_norm(h, w(p + "attn_norm.weight"), eps)
        v = (w(p + "attn_v.weight") @ x).reshape(kv["qwen3moe.attention.head_count_kv"], -1)
        # query head j reads KV head j // (n_head / n_head_kv)
        v = np.repeat(v, kv["qwen3moe.attention.head_count"] // kv["qwen3moe.attention.head_count_kv"], axis=0)
        h = h + w(p + "attn_output.weight") @ v.ravel()
        x = rms_norm(h, w(p + "ffn_norm.weight"), eps)
        z = w(p + "ffn_gate_inp.weight") @ x
        prob = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        top = np.argsort(-prob)[:k]
        gate, up, down = (w(p + f"ffn_{t}_exps.weight") for t in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for e in top:
            g = gate[e] @ x
            out += prob[e] / prob[top].sum() * (down[e] @ (g / (1 + np.exp(-g)) * (up[e] @ x)))
        h = h + out
    return w("output.weight") @ rms_norm(h, w("output_norm.weight"), eps)


@pytest.mark.parametrize("ftype", ["f32", "q4_0"])
def test_moe_model_is_qwen3_moe(tmp_path: Path, ftype: str, native: Path) -> None:
    """KB-MoE-tiny loads in llama.cpp as Qwen3-MoE and computes what its tensors say."""
    import kairox
    import gguf
    shape = dataclasses.replace(PRESETS["KB-MoE-tiny"], ftype=ftype)
    assert main(["synth", "--preset", "KB-MoE-tiny", "--type", ftype, "-o", str(tmp_path / "m.gguf"), "-q"]) == 0
    hdr = scan_header(tmp_path / "m.gguf")
    assert hdr.kv["general.architecture"] == "qwen3moe" and hdr.kv["qwen3moe.expert_count"] == 8
    assert hdr.kv["qwen3moe.expert_used_count"] == 2 and hdr.kv["qwen3moe.attention.key_length"] == 32
    assert not any(k.endswith("hidden_activation") for k in hdr.kv)
    t = {t.name: t for t in hdr.tensors}
    assert t["blk.1.ffn_down_exps.weight"].ne == (shape.n_ff, shape.n_embd, 8)
    assert t["blk.0.attn_q.weight"].ne == (shape.n_embd, 4 * 32)
    Q = gguf.GGMLQuantizationType
    assert Q(t["blk.0.ffn_gate_inp.weight"].type_id) == Q.F32
    assert Q(t["blk.0.ffn_up_exps.weight"].type_id) == (Q.Q4_0 if ftype == "q4_0" else Q.F32)
    ups = read_model_tensor(hdr, "blk.0.ffn_up_exps.weight")
    assert ups.shape == (8, shape.n_ff, shape.n_embd) and not np.allclose(ups[0], ups[1])

    llm = kairox.Llama(str(tmp_path / "m.gguf"), n_ctx=64, n_batch=8, logits_all=True, type_k=0, type_v=0,
                       verbose=False)
    try:
        for tok in (1, 523, 31999):
            llm.reset()
            llm.eval([tok])
            got = np.asarray(llm.scores[0], np.float64)
            want = _moe_logits_of_one_token(hdr, tok)
            # Q4_0: llama.cpp quantizes the activations to Q8_0 for the matmuls
            tol = 2e-3 if ftype == "f32" else 5e-2
            assert np.abs(got - want).max() < tol * np.abs(want).max(), tok
    finally:
        llm.close()


def test_moe_refusals(tmp_path: Path, capsys: pytest.CaptureFixture, small_vocab: Path) -> None:
    for extra in (["--act", "relu"], ["--pack"]):
        assert main(["synth", "--preset", "KB-MoE-tiny", "-o", str(tmp_path / "x.gguf"), "-q", *extra]) == 2
        assert "mixture of experts" in capsys.readouterr().err
    with pytest.raises(SynthError, match="experts used per token"):
        synth(tmp_path / "y.gguf", dataclasses.replace(PRESETS["KB-MoE-tiny"], n_expert_used=9), act="silu",
              vocab_gguf=small_vocab)
    assert list(tmp_path.iterdir()) == []


def test_cli_layers_shortens_the_preset(tmp_path: Path) -> None:
    """--layers N: the preset's shape with N layers, nothing else changed."""
    from kairox.gguf_header import scan_header
    out = tmp_path / "l1.gguf"
    assert main(["synth", "--preset", "KB-tiny", "--layers", "1", "-o", str(out), "-q"]) == 0
    names = [t.name for t in scan_header(out).tensors]
    assert any(n.startswith("blk.0.") for n in names) and not any(n.startswith("blk.1.") for n in names)
    tiny = PRESETS["KB-tiny"]
    gate = next(t for t in scan_header(out).tensors if t.name == "blk.0.ffn_gate.weight")
    assert list(gate.ne[:2]) == [tiny.n_embd, tiny.n_ff]
