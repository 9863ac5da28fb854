"""`kairox pack`: the identity pack with the sketch predictor, its options and its errors."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kairox.checkpoint import Checkpoint
from kairox.cli import main
from kairox.pack import read_pack
from kairox.predictor import sketch_predictor

SMALL = 300  # small vocabulary: the packs here are read back with GGUFReader


@pytest.fixture(scope="module")
def small_relu(tiny_gguf: Callable[..., Path]) -> Path:
    return tiny_gguf("f32", hidden_act="relu", vocab_size=SMALL)


@pytest.fixture
def model(tmp_path: Path, small_relu: Path) -> Path:
    """A private copy, so that the default pack path lands in this test's folder."""
    return Path(shutil.copy(small_relu, tmp_path / "m.gguf"))


def run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = main(["pack", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_default_pack_has_the_sketch(capsys: pytest.CaptureFixture, model: Path,
                                     tiny_hf: Callable[..., Path]) -> None:
    rc, out, err = run(capsys, str(model), "-q")
    assert rc == 0, err
    path = model.with_name("m.kxpack.gguf")
    assert f"wrote {path} (" in out
    assert "2 layers x 256 neurons (llama, relu), groups of 32, down rows f32, " \
           "sketch predictor rank 8, margin 3 (f32)" in out
    pack = read_pack(path, model)
    assert pack.method == {"kind": "identity",
                           "predictor": {"kind": "sketch", "rank": 8, "margin": 3.0, "type": "f32"}}
    hf = Checkpoint(tiny_hf(hidden_act="relu", vocab_size=SMALL))
    for il, layer in enumerate(pack.layers):
        assert layer.down_type == "f32" and layer.has_predictor
        # the factors are sketch_predictor's on the model's own gate and norm weights
        gate = np.asarray(hf.tensor(f"model.layers.{il}.mlp.gate_proj.weight"), np.float32)
        norm = np.asarray(hf.tensor(f"model.layers.{il}.post_attention_layernorm.weight"), np.float32)
        a, b, c = sketch_predictor(gate, norm, 8, 3.0, seed=il)
        np.testing.assert_allclose(layer.pred_a, a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.pred_b, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(layer.pred_c, c, rtol=1e-4, atol=1e-6)


def test_options(capsys: pytest.CaptureFixture, model: Path, tmp_path: Path) -> None:
    out_path = tmp_path / "custom.gguf"
    rc, out, err = run(capsys, str(model), "-o", str(out_path), "--down-type", "q8_0",
                       "--group-size", "48", "--rank", "5", "--margin", "1.5", "--pred-type", "f16")
    assert rc == 0, err
    assert "pack custom.gguf" in err  # the progress bar goes to stderr
    pack = read_pack(out_path, model)
    assert pack.group_size == 48 and pack.layers[0].down_type == "q8_0"
    assert pack.method["predictor"] == {"kind": "sketch", "rank": 5, "margin": 1.5, "type": "f16"}
    assert pack.layers[1].pred_a.shape == (5, 64) and pack.layers[1].pred_a.dtype == np.float16
    assert not model.with_name("m.kxpack.gguf").exists()


def test_no_predictor(capsys: pytest.CaptureFixture, model: Path) -> None:
    rc, out, err = run(capsys, str(model), "--predictor", "none", "-q")
    assert rc == 0, err
    assert "no predictor" in out
    pack = read_pack(model.with_name("m.kxpack.gguf"), model)
    assert pack.method == {"kind": "identity"}
    assert not any(layer.has_predictor for layer in pack.layers)


@pytest.mark.parametrize("outtype,down,pred", [("f16", "f16", "f16"), ("q8_0", "q8_0", "q8_0")])
def test_defaults_follow_the_model_types(capsys: pytest.CaptureFixture, tmp_path: Path,
                                         tiny_gguf: Callable[..., Path], outtype: str, down: str,
                                         pred: str) -> None:
    src = tiny_gguf(outtype, hidden_act="relu", vocab_size=SMALL)
    out_path = tmp_path / "p.kxpack.gguf"
    rc, out, err = run(capsys, str(src), "-o", str(out_path), "-q")
    assert rc == 0, err
    pack = read_pack(out_path, src)
    assert pack.layers[0].down_type == down and pack.method["predictor"]["type"] == pred
    assert np.all(np.isfinite(pack.layers[0].pred_c))


@pytest.mark.parametrize("args,message", [
    (["{tmp}/missing.gguf"], "model file not found: "),
    (["{model}", "--rank", "65"],
     r"predictor rank must be in 1\.\.64 \(min of n_ff 256 and n_embd 64\), got 65"),
    (["{model}", "--predictor", "none", "--rank", "4"], "apply only to --predictor sketch"),
    (["{bad}"], "is not a GGUF file"),
    (["{pack}"], "has no dense FFN kairox can pack"),
    (["{model}", "-o", "{tmp}/no/such/dir/p.gguf"], "output directory"),
])
def test_errors(capsys: pytest.CaptureFixture, model: Path, tmp_path: Path, args: list[str],
                message: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just some bytes")
    pack = tmp_path / "a.kxpack.gguf"
    assert main(["pack", str(model), "-o", str(pack), "-q", "--predictor", "none"]) == 0
    capsys.readouterr()
    fmt = {"tmp": tmp_path, "model": model, "bad": bad, "pack": pack}
    rc, out, err = run(capsys, *[a.format(**fmt) for a in args], "-q")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kairox pack: error: "), err
    assert re.search(message, lines[0]), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kxpack.gguf", "bad.gguf", "m.gguf"]


@pytest.mark.parametrize("args,message", [
    (["--group-size", "0"], "argument --group-size: must be a positive integer"),
    (["--rank", "x"], "argument --rank: must be a positive integer"),
    (["--margin", "-1"], "argument --margin: must be in [0, inf), got -1"),
    (["--margin", "nan"], "argument --margin: must be in [0, inf), got nan"),
    (["--down-type", "q4_0"], "argument --down-type: invalid choice"),
])
def test_bad_option_values(capsys: pytest.CaptureFixture, model: Path, args: list[str],
                           message: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["pack", str(model), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kairox pack: error: " + message in err


def test_help_explains_the_pack() -> None:
    r = subprocess.run([sys.executable, "-m", "kairox", "pack", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0
    for word in ("sidecar GGUF", "kxpack.gguf", "--rank", "--margin", "--down-type", "--group-size",
                 "--predictor", "over-predicts"):
        assert word in r.stdout
    top = subprocess.run([sys.executable, "-m", "kairox", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert "pack" in top.stdout


def test_an_existing_output_is_replaced_only_with_force(capsys: pytest.CaptureFixture, model: Path,
                                                        tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"somebody else's file")
    rc, out, err = run(capsys, str(model), "-o", str(other), "-q")
    assert rc == 2 and f"{other} exists; give --force" in err
    assert other.read_bytes() == b"somebody else's file"
    rc, out, err = run(capsys, str(model), "-o", str(other), "-q", "--force")
    assert rc == 0, err
    assert read_pack(other, model).base.n_layer == 2


def test_gated_model_pack_runs_dense(capsys: pytest.CaptureFixture, tmp_path: Path,
                                     tiny_gguf: Callable[..., Path]) -> None:
    """At threshold 0 every neuron of a SiLU model fires: the pack says its lists hold every
    neuron, and a sparse run keeps the model dense (llama.cpp's own FFN) and says so."""
    import kairox
    model = Path(shutil.copy(tiny_gguf("f32", hidden_act="silu", vocab_size=SMALL), tmp_path / "s.gguf"))
    rc, out, err = run(capsys, str(model), "-q")
    assert rc == 0, err
    assert "every neuron of a silu model fires at threshold 0" in out and "kairox prepare" in out
    pack = read_pack(model.with_name("s.kxpack.gguf"), model)
    assert pack.listed_density == [1.0, 1.0]
    with pytest.warns(kairox.SparseNoGainWarning):
        llm = kairox.Llama(str(model), sparse="predicted", n_ctx=64, verbose=False)
    try:
        assert llm.sparse == "dense" and llm.sparse_layers == 0
    finally:
        llm.close()
