"""Shared fixtures: tiny random llama checkpoints, their GGUF conversions, the native library."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

try:
    import kairox  # noqa: F401
except ImportError:  # running from a source checkout without PYTHONPATH=python
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from kairox.convert import convert
from kairox.tiny import default_vocab_gguf, make_tiny_checkpoint


@pytest.fixture(scope="session")
def vocab_gguf() -> Path:
    try:
        return default_vocab_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"no llama vocabulary GGUF: {e}")


@pytest.fixture(scope="session")
def vocab_of_size(tmp_path_factory: pytest.TempPathFactory, vocab_gguf: Path) -> Callable[[int], Path]:
    """n -> a GGUF vocabulary of the default vocabulary's first n tokens.

    Reading a 32000-token vocabulary back with GGUFReader takes about a second, so tests
    that do not need the full vocabulary use small models with a truncated one.
    """
    made: dict[int, Path] = {}

    def make(n: int) -> Path:
        if n not in made:
            import gguf
            from kairox.convert import tokenizer_kvs
            path = tmp_path_factory.mktemp("vocab") / f"vocab-{n}.gguf"
            w = gguf.GGUFWriter(path, "llama")
            for kv in tokenizer_kvs(vocab_gguf):
                value = kv.value
                if kv.vtype == gguf.GGUFValueType.ARRAY:
                    value = value[:n]  # per-token arrays: tokens, scores, token types
                w.add_key_value(kv.name, value, kv.vtype, sub_type=kv.sub_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            made[n] = path
        return made[n]

    return make


def _vocab_for(kwargs: dict, vocab_gguf: Path, vocab_of_size: Callable[[int], Path]) -> Path:
    n = kwargs.get("vocab_size")
    return vocab_gguf if n is None else vocab_of_size(n)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory, vocab_gguf: Path) -> Callable[..., Path]:
    """make(**kwargs) -> HF dir of make_tiny_checkpoint(**kwargs), built once per kwargs.

    Tests must not modify the returned folder: it is shared by the whole session.
    """
    made: dict[tuple, Path] = {}

    def make(**kwargs) -> Path:
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("hf"), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Callable[..., Path],
              vocab_gguf: Path, vocab_of_size: Callable[[int], Path]) -> Callable[..., Path]:
    """make(outtype="f32", **checkpoint_kwargs) -> that checkpoint as GGUF, converted with
    the default vocabulary or, when vocab_size is given, its first vocab_size tokens."""
    made: dict[tuple, Path] = {}

    def make(outtype: str = "f32", **kwargs) -> Path:
        key = (outtype, *sorted(kwargs.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("gguf") / f"tiny-{outtype}.gguf"
            made[key] = convert(tiny_hf(**kwargs), out, outtype=outtype, quiet=True,
                                vocab_gguf=_vocab_for(kwargs, vocab_gguf, vocab_of_size))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_relu_hf(tiny_hf: Callable[..., Path]) -> Path:
    return tiny_hf(hidden_act="relu")


@pytest.fixture(scope="session")
def tiny_silu_hf(tiny_hf: Callable[..., Path]) -> Path:
    return tiny_hf(hidden_act="silu")


@pytest.fixture(scope="session")
def tiny_relu_gguf(tiny_gguf: Callable[..., Path]) -> Path:
    return tiny_gguf("f32", hidden_act="relu")


@pytest.fixture(scope="session")
def tiny_silu_gguf(tiny_gguf: Callable[..., Path]) -> Path:
    return tiny_gguf("f32", hidden_act="silu")


@pytest.fixture(scope="session")
def native() -> Path:
    """The native library folder; skips the test when kairox's libllama is not built."""
    try:
        from kairox._native import NativeLibraryNotFound, find_lib_dir
    except ImportError as e:
        pytest.skip(f"kairox._native is unavailable: {e}")
    try:
        return find_lib_dir()
    except NativeLibraryNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The embedded default model (Gemma 3 270M Q4_K_M), assembled and sha256-checked.

    scripts/setup.sh --test installs its package; without it the tests that need it skip.
    """
    from kairox.default_model import DefaultModelError, default_model_path
    try:
        return default_model_path(install=False)
    except DefaultModelError as e:
        pytest.skip(str(e))
