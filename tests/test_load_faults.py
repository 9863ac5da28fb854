"""Memory refused at load (kx_params.faults, fault injection): the slots' buffer, the
page-locking of the host weights, their mapping. Each ends in a clear error or in the right
output, never in a run that silently differs. The slots' buffer on the CPU device here; the
CUDA slots and the page-locked host weights on the GPU machine (bench/device/hybrid.sh)."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from test_hybrid import N_GEN, PROMPT, run, synth_model  # noqa: F401 (fixture)

SLOTS = 100


def _gpu_or_skip(gpu: bool) -> None:
    from kairox._native import has_gpu
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")


def _where(gpu: bool) -> dict:
    return {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}


def _decode(llm) -> tuple[list[int], np.ndarray]:
    llm.eval(PROMPT)
    toks = []
    for _ in range(N_GEN):
        toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([toks[-1]])
    return toks, np.array(llm.scores[:llm.n_tokens])


def _open(model: Path, **kw):
    import kairox
    return kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                        verbose=False, **kw)


@pytest.mark.parametrize("gpu", [False, True])
def test_slots_that_cannot_be_allocated_are_an_error(synth_model: Path, gpu: bool) -> None:
    """The slots' buffer refused: SparsePackError naming the memory, nothing half-placed."""
    import kairox
    _gpu_or_skip(gpu)
    with pytest.raises(kairox.SparsePackError, match="cannot allocate .* memory for the neuron slots"):
        _open(synth_model, sparse="exact", gpu_slots=SLOTS, faults=("slots",), **_where(gpu))


@pytest.mark.parametrize("gpu", [False, True])
def test_slots_that_cannot_be_allocated_fall_back_to_dense(synth_model: Path, gpu: bool) -> None:
    """With fallback="dense" the model runs dense (the reason as a warning) and decodes
    what the dense model decodes."""
    import kairox
    _gpu_or_skip(gpu)
    want_toks, want, _ = run(synth_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = _open(synth_model, sparse="exact", gpu_slots=SLOTS, faults=("slots",), fallback="dense", **_where(gpu))
    try:
        assert any(issubclass(w.category, kairox.SparsePackWarning) and "neuron slots" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        toks, got = _decode(llm)
    finally:
        llm.close()
    assert toks == want_toks
    tol = 1e-3 if gpu else 1e-6
    assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max())


def test_slots_refused_under_a_budget_are_a_budget_error(synth_model: Path) -> None:
    """Under a VRAM budget the same refusal is the budget's error (VramBudgetError)."""
    import kairox
    _gpu_or_skip(True)
    with pytest.raises(kairox.VramBudgetError, match="neuron slots"):
        _open(synth_model, sparse="exact", vram_budget="2GiB", n_gpu_layers=-1, faults=("slots",))


def test_refused_page_locking_leaves_the_weights_pageable(synth_model: Path) -> None:
    """Page-locking refused: a HostMemoryWarning without verbose (the runtime's own line goes
    where llama_cpp.Llama hides the load's output), the hybrid runs from pageable host memory
    and decodes the unsplit run's tokens."""
    import kairox
    _gpu_or_skip(True)
    want_toks, want, _ = run(synth_model, sparse="exact")
    with pytest.warns(kairox.HostMemoryWarning, match="MiB of host weights stay pageable"):
        llm = _open(synth_model, sparse="exact", gpu_slots=SLOTS, n_gpu_layers=-1, faults=("host_lock",))
    try:
        toks, got = _decode(llm)
    finally:
        llm.close()
    assert toks == want_toks
    assert float(np.abs(got - want).max()) <= 1e-3 * float(np.abs(want).max())


def test_host_weights_that_cannot_be_mapped_stop_the_load(synth_model: Path) -> None:
    """No memory for the host weights: ModelLoadError carrying llama.cpp's reason."""
    import kairox
    _gpu_or_skip(True)
    with pytest.raises(kairox.ModelLoadError, match="KX_Host_Pinned"):
        _open(synth_model, sparse="exact", gpu_slots=SLOTS, n_gpu_layers=-1, faults=("host_map",))


def test_fault_names_are_checked(synth_model: Path) -> None:
    with pytest.raises(ValueError, match="faults must be names among slots, host_lock, host_map"):
        _open(synth_model, sparse="exact", gpu_slots=SLOTS, slots_device="CPU", faults=("disk",))
