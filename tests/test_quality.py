"""kairox.quality: the in-process sparsity emulator against references. A callback that only
watches changes nothing (bit-identical logits); CATS emulated at thresholds t equals
kairox's own runtime running t; TEAL changes the logits at the sparsity it was calibrated
for; calibrated thresholds give the target sparsity on their calibration data."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from kairox.quality import CATS_MODE, KINDS, TEAL_INPUTS, Emulator, QualityError, Rule, WeightBytes

pytestmark = pytest.mark.usefixtures("native")

RNG = np.random.default_rng(3)
TOKENS = RNG.integers(2, 32000, 48).astype(np.int32)
CALIB = [RNG.integers(2, 32000, 64).astype(np.int32) for _ in range(4)]


# flash attention off and an F32 KV cache, as kairox.Llama runs in the runtime comparison
@pytest.fixture(scope="module")
def emu(tiny_silu_gguf: Path):
    with Emulator(tiny_silu_gguf, n_ctx=64, n_batch=64, threads=2, f32_kv=True, flash_attn=False) as em:
        yield em


@pytest.fixture(scope="module")
def calib(emu: Emulator):
    return emu.calibrate(CALIB)


def test_watching_changes_nothing(tiny_silu_gguf: Path, emu: Emulator) -> None:
    with Emulator(tiny_silu_gguf, n_ctx=64, n_batch=64, threads=2, f32_kv=True, flash_attn=False,
                  callback=False) as plain:
        want, _ = plain.logits(TOKENS)
    got, sp = emu.logits(TOKENS, Rule.none())
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(got, want)
    n_layer, b = emu.base.n_layer, emu.base
    # every watched tensor was read, whole, once per layer
    assert sp.seen["gate"].tolist() == [len(TOKENS) * b.n_ff] * n_layer
    assert sp.seen["ffn_in"].tolist() == [len(TOKENS) * b.n_embd] * n_layer
    assert all(sp.zeroed[k].sum() == 0 for k in KINDS)


def test_cats_equals_the_runtime_at_the_same_thresholds(tiny_silu_gguf: Path, emu: Emulator, calib,
                                                        tmp_path: Path) -> None:
    import kairox
    from kairox.pack import PackLayout, write_pack

    b = emu.base
    # the 0.8 quantile: active density ~0.2, well under kx_max_density (0.6), above which the
    # runtime computes every row
    thr = calib.thresholds("gate", 0.8)
    assert np.all(thr > 0)
    ident = (np.arange(b.n_ff), np.arange(b.n_ff) // 32, np.zeros(b.n_ff))
    pack = write_pack(tiny_silu_gguf, tmp_path / "t.kxpack.gguf", layout=PackLayout(lambda il: ident, thr),
                      quiet=True)
    kw = dict(n_ctx=64, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kairox.SparseApproximationWarning)
        llm = kairox.Llama(str(tiny_silu_gguf), sparse=CATS_MODE, sparse_pack=str(pack), **kw)
    try:
        assert llm.sparse == CATS_MODE
        llm.eval(TOKENS.tolist())
        runtime = np.array(llm.scores[:len(TOKENS)])
    finally:
        llm.close()
    dense, _ = emu.logits(TOKENS)
    got, sp = emu.logits(TOKENS, Rule.of_cats(thr))
    assert 0.7 < sp.fraction("gate") < 0.9
    assert all(sp.zeroed[k].sum() == 0 for k in TEAL_INPUTS)
    scale = float(np.abs(dense).max())
    # sparsity moves the logits far more than the tolerance: the comparison can fail
    assert np.abs(runtime - dense).max() > 1000 * 1e-5 * scale
    np.testing.assert_allclose(got, runtime, rtol=0, atol=1e-5 * scale)


def test_teal_changes_logits_at_the_calibrated_sparsity(emu: Emulator, calib) -> None:
    dense, _ = emu.logits(CALIB[0])
    rule = calib.rule("teal", 0.4)
    got, sp = emu.logits(CALIB[0], rule)
    assert np.abs(got - dense).max() > 1e-2 * np.abs(dense).max()
    # layer 0's attention input comes before any rewritten tensor: its sparsity is the
    # calibrated one on this calibration segment (sampled quantile: a few % off)
    assert abs(sp.per_layer("attn_in")[0] - 0.4) < 0.1
    for k in TEAL_INPUTS:
        assert abs(sp.fraction(k) - 0.4) < 0.15, (k, sp.fraction(k))
    assert sp.zeroed["gate"].sum() == 0
    # an input left out of the rule stays dense
    only, sp1 = emu.logits(CALIB[0], Rule.of_teal({"down_in": calib.thresholds("down_in", 0.4)}))
    assert sp1.zeroed["attn_in"].sum() == 0 and sp1.fraction("down_in") > 0.2
    assert not np.array_equal(only, dense)


@pytest.mark.parametrize("target", [0.25, 0.5, 0.75])
def test_calibrated_thresholds_hit_the_target_on_calibration_data(emu: Emulator, calib, target: float) -> None:
    for k in KINDS:
        for il, s in enumerate(calib.samples[k]):
            assert abs(np.mean(s <= calib.threshold(k, il, target)) - target) < 0.01
    # one layer at a time, so no earlier rewrite shifts its distribution: realized sparsity
    # over all calibration tokens is the target
    n_layer = emu.base.n_layer
    for il in range(n_layer):
        for kind in KINDS:
            t = np.zeros(n_layer, np.float32)
            t[il] = calib.threshold(kind, il, target)
            rule = Rule.of_cats(t) if kind == "gate" else Rule.of_teal({kind: t})
            res = emu.perplexity(CALIB, rule)
            assert abs(res.sparsity.per_layer(kind)[il] - target) < 0.02, (kind, il)


def test_perplexity_matches_numpy(emu: Emulator) -> None:
    res = emu.perplexity(CALIB[:2])
    nll = []
    for seg in CALIB[:2]:
        lg, _ = emu.logits(seg)
        lg = lg.astype(np.float64)
        first = len(seg) // 2
        for i in range(first, len(seg) - 1):
            z = lg[i] - lg[i].max()
            nll.append(np.log(np.exp(z).sum()) - z[seg[i + 1]])
    assert res.scored == len(nll)
    assert res.ppl == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-9)


def test_bad_rules_are_refused(emu: Emulator) -> None:
    with pytest.raises(ValueError):
        emu.logits(TOKENS, Rule.of_cats([0.1]))
    with pytest.raises(ValueError):
        Rule.of_teal({"q_proj": [0.1, 0.1]})
    with pytest.raises(ValueError):
        emu.logits(TOKENS, Rule.of_cats([0.1, float("nan")]))
    assert issubclass(QualityError, RuntimeError)


def test_weight_bytes(tiny_silu_gguf: Path) -> None:
    wb = WeightBytes.of_model(tiny_silu_gguf)
    n_embd, n_ff = 64, 256
    assert len(wb.layers) == 2
    assert wb.layers[0]["ffn_down"] == 4 * n_embd * n_ff
    assert wb.read(lambda il, p: 1.0) == (1.0, 1.0)
    half = np.full(2, 0.5)
    m = 4 * n_embd * n_ff  # one F32 FFN matrix
    lay = wb.dense_layers
    # threshold mode skips half the rows of up and down in both layers, predicted mode the gate's too
    assert wb.cats(half, predicted=False)[1] == pytest.approx((lay - 2 * 2 * m * 0.5) / lay)
    assert wb.cats(half, predicted=True)[1] == pytest.approx((lay - 2 * 3 * m * 0.5) / lay)
    assert wb.teal({k: half for k in TEAL_INPUTS})[1] == pytest.approx(0.5)
    assert wb.teal_layout_bytes() == lay - 2 * m
    assert wb.dense > lay  # the output head is read whole
