"""kairox's llama.cpp on converted tiny models vs the numpy reference on the HF checkpoints.

This closes the loop: checkpoint reading, conversion (Q/K permutation, tensor mapping,
hyperparameters, llama.hidden_activation) and the patched llama.cpp's forward pass.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kairox.reference import ACTIVATIONS, LlamaReference

# Same prompt as the reference tests: BOS then arbitrary ids of the 32000-token vocabulary.
TOKENS = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 3575, 338]

# llama.cpp computes in float32 (F32 weights and KV cache here), the reference in float64.
# Measured max |logit difference| over the 16 positions x 32000 tokens: 6.0e-6 (relu) and
# 4.8e-6 (silu), for logits of magnitude up to ~15. The tolerance leaves a ~16x margin
# for other CPUs / thread counts; a wrong activation or RoPE layout is off by > 0.1.
ATOL = 1e-4


@pytest.fixture(scope="module", params=["relu", "silu"])
def model(request: pytest.FixtureRequest, native: Path) -> Iterator[tuple[str, Path, Path]]:
    act = request.param
    yield act, request.getfixturevalue(f"tiny_{act}_hf"), request.getfixturevalue(f"tiny_{act}_gguf")


@pytest.fixture(scope="module")
def llm_and_ref(model: tuple[str, Path, Path]) -> Iterator[tuple[object, LlamaReference, str]]:
    import kairox
    act, hf, gguf_path = model
    # type_k/type_v 0 = F32 KV cache, so the comparison can be tight
    llm = kairox.Llama(str(gguf_path), n_ctx=64, n_batch=64, logits_all=True, type_k=0, type_v=0,
                       verbose=False, seed=0)
    try:
        yield llm, LlamaReference.from_checkpoint(hf), act
    finally:
        llm.close()


def test_logits_match_reference(llm_and_ref) -> None:
    llm, ref, act = llm_and_ref
    llm.reset()
    llm.eval(TOKENS)
    got = np.asarray(llm.scores[: len(TOKENS)], dtype=np.float64)
    want = ref.logits(TOKENS)
    assert got.shape == want.shape == (len(TOKENS), 32000)
    err = np.abs(got - want).max()
    assert err < ATOL, f"{act}: max |dlogit| {err:.3g}"
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))

    # The comparison is discriminative: the same weights with the other activation
    # (what stock llama.cpp would compute for a ReLU model) are far off.
    other = "silu" if act == "relu" else "relu"
    wrong = copy.copy(ref)  # shares the weights
    wrong.config = dataclasses.replace(ref.config, hidden_act=other)
    wrong.act = ACTIVATIONS[other]
    assert np.abs(wrong.logits(TOKENS) - want).max() > 1000 * ATOL


def test_greedy_matches_reference(llm_and_ref) -> None:
    llm, ref, act = llm_and_ref
    prompt, n = TOKENS[:4], 16
    llm.reset()
    got: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        got.append(int(tok))
        if len(got) == n:
            break
    want = ref.greedy(prompt, n)
    # Greedy paths may part only after a near-tie; with this spread of logits the first
    # 8 must agree (all 16 do, as measured).
    assert got[:8] == want[:8], f"{act}: {got} != {want}"
