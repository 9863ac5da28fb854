"""kairox.Llama is llama_cpp.Llama on kairox's libllama: same answers, stricter keywords.

Each behaviour is checked against llama_cpp.Llama itself, loaded from the same file in the
same process, so any divergence the subclass introduced shows up as a difference.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def kx(native: Path):
    import kairox
    return kairox


@pytest.fixture(scope="module", params=["tiny", "gemma"])
def pair(request: pytest.FixtureRequest, kx):
    """(kairox.Llama, llama_cpp.Llama) on the same model with the same arguments."""
    import llama_cpp
    path = request.getfixturevalue("tiny_relu_gguf" if request.param == "tiny" else "gemma_gguf")
    kw = dict(n_ctx=256, n_batch=64, seed=1, verbose=False, logits_all=True)
    a = kx.Llama(str(path), **kw)
    b = llama_cpp.Llama(str(path), **kw)
    yield a, b
    a.close()
    b.close()


def test_is_a_llama_cpp_llama(kx):
    import llama_cpp
    assert issubclass(kx.Llama, llama_cpp.Llama)


def test_bound_to_kairox_library(kx, native):
    import llama_cpp
    assert Path(llama_cpp.llama_cpp._lib._name).resolve().parent == native


def test_tokenize_detokenize_same(pair):
    a, b = pair
    text = "Hello, world! Ünïcödé 123"
    ta, tb = a.tokenize(text.encode()), b.tokenize(text.encode())
    assert ta == tb and len(ta) > 3
    assert a.detokenize(ta) == b.detokenize(tb)


def test_logits_identical(pair):
    a, b = pair
    toks = a.tokenize(PROMPT.encode())
    for m in (a, b):
        m.reset()
        m.eval(toks)
    la = np.asarray(a.scores[:len(toks)])
    lb = np.asarray(b.scores[:len(toks)])
    assert la.shape == lb.shape and np.isfinite(la).all()
    np.testing.assert_array_equal(la, lb)


def test_greedy_completion_and_streaming_same(pair):
    a, b = pair
    kw = dict(max_tokens=12, temperature=0.0, seed=3)
    ra = a.create_completion(PROMPT, **kw)
    rb = b.create_completion(PROMPT, **kw)
    assert ra["choices"][0]["text"] == rb["choices"][0]["text"]
    assert ra["usage"] == rb["usage"] and ra["usage"]["completion_tokens"] > 0
    streamed = "".join(c["choices"][0]["text"] for c in a.create_completion(PROMPT, stream=True, **kw))
    assert streamed == ra["choices"][0]["text"]


def test_chat_completion_same(pair):
    a, b = pair
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = dict(max_tokens=8, temperature=0.0, seed=3)
    ca = a.create_chat_completion(messages=msgs, **kw)
    cb = b.create_chat_completion(messages=msgs, **kw)
    assert ca["choices"][0]["message"] == cb["choices"][0]["message"]
    assert ca["choices"][0]["message"]["role"] == "assistant"
    chunks = list(a.create_chat_completion(messages=msgs, stream=True, **kw))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == ca["choices"][0]["message"]["content"]


def test_unknown_keyword_raises(kx, tiny_relu_gguf):
    import llama_cpp
    # The base class swallows the typo silently ...
    llama_cpp.Llama(str(tiny_relu_gguf), n_gpu_layer=1, verbose=False).close()
    # ... kairox names it.
    with pytest.raises(TypeError, match="n_gpu_layer"):
        kx.Llama(str(tiny_relu_gguf), n_gpu_layer=1, verbose=False)


def test_pickle_round_trip(kx, tiny_relu_gguf):
    a = kx.Llama(str(tiny_relu_gguf), n_ctx=128, verbose=False)
    b = pickle.loads(pickle.dumps(a))
    assert type(b) is kx.Llama and b.n_ctx() == a.n_ctx()
    assert a.tokenize(b"abc") == b.tokenize(b"abc")


def test_missing_file(kx, tmp_path):
    with pytest.raises(kx.ModelLoadError, match="nope.gguf is missing, not a model file"):
        kx.Llama(str(tmp_path / "nope.gguf"), verbose=False)
    with pytest.raises(kx.ModelLoadError, match="is a directory, not a model file"):
        kx.Llama(str(tmp_path), verbose=False)


def test_truncated_gguf_says_why(kx, tiny_relu_gguf, tmp_path):
    data = tiny_relu_gguf.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(kx.ModelLoadError) as e:
        kx.Llama(str(bad), verbose=False)
    assert isinstance(e.value, ValueError)
    assert "file bounds" in str(e.value) or "corrupt" in str(e.value) or "incomplete" in str(e.value)


def test_not_a_gguf(kx, tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    with pytest.raises(kx.ModelLoadError, match="(?i)magic|gguf"):
        kx.Llama(str(bad), verbose=False)


def test_unsupported_architecture(kx, tmp_path):
    import gguf
    path = tmp_path / "alien.gguf"
    w = gguf.GGUFWriter(path, "alien-arch")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(kx.ModelLoadError, match="alien-arch"):
        kx.Llama(str(path), verbose=False)


def test_nothing_printed_at_interpreter_exit(tiny_relu_gguf: Path) -> None:
    """Models left open at exit (the interpreter tears down while libllama still logs) end
    without "Exception ignored" noise, and a run's own errors are printed without verbose."""
    import subprocess
    import sys
    code = (f"import kairox\nllm = kairox.Llama({str(tiny_relu_gguf)!r}, n_ctx=64, verbose=False)\n"
            "llm('Hello', max_tokens=4)\nprint('done')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
