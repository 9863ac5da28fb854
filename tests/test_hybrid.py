"""Hybrid FFN layers (neuron slots): one active list split between slot buffers and the
host weights, y = y_host + y_slots.

Without a GPU the slots go to the "CPU" device: the same graph, maps and split run on the
CPU backend, so the partition itself is tested everywhere; the GPU run (CUDA kernels,
overlap) is tested on the GPU machine (bench/device/hybrid.sh).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from kairox.pack import write_pack

PROMPT = list(range(1, 9))
N_GEN = 48
N_LAYER, N_FF = 2, 256  # KB-tiny


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory: pytest.TempPathFactory, native: Path) -> Path:
    """KB-tiny with a sketch predictor and a permuted layout (down rows in a random order,
    random frequencies): the host part then reads down rows through the pack's row map."""
    from kairox.synth import PRESETS
    return permuted_tiny(tmp_path_factory.mktemp("hybrid") / "kb-tiny.gguf", PRESETS["KB-tiny"], seed=5)


def permuted_tiny(path: Path, shape, seed: int) -> Path:
    """A synthetic model of `shape` and its pack: sketch predictor, down rows in a random
    order, random frequencies, groups of 32."""
    from kairox.pack import PackLayout
    from kairox.predictor import sketch_for_model
    from kairox.synth import SparseFFN, synth
    # topics without domains, the parameters these tests were checked on (greedy equality
    # on a synthetic model's nearly flat logits is fragile to float summation order)
    model = synth(path, shape, seed=seed, quiet=True, sparse=SparseFFN(rate_spread=1.6, topic_share=0.45, domains=0))
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(shape.n_ff).astype(np.int32) for _ in range(shape.n_layer)]
    freqs = [rng.random(shape.n_ff).astype(np.float32) for _ in range(shape.n_layer)]
    layout = PackLayout(layer=lambda il: (perms[il], np.arange(shape.n_ff, dtype=np.int32) // 32, freqs[il]),
                        threshold=np.zeros(shape.n_layer, np.float32))
    write_pack(model, predictor=sketch_for_model(model), layout=layout, quiet=True)
    return model


def run(model: Path, inspect=None, **kw) -> tuple[list[int], np.ndarray, object]:
    """Greedy decode after PROMPT: tokens, every position's logits, the sparse counters;
    inspect(llm) runs after the decode, before the model closes."""
    import kairox
    from kairox._native import sparse_counters
    llm = kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       verbose=False, **kw)
    try:
        assert llm.sparse_error is None, llm.sparse_error
        sparse_counters(reset=True)
        llm.eval(PROMPT)
        toks = []
        for _ in range(N_GEN):
            toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([toks[-1]])
        out = toks, np.array(llm.scores[:llm.n_tokens]), sparse_counters(reset=True)
        if inspect:
            inspect(llm)
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["exact", "predicted"])
@pytest.mark.parametrize("slots", [1, 100, [0, 200], N_FF])
def test_split_reproduces_the_unsplit_layer(synth_model: Path, mode: str, slots) -> None:
    want_toks, want, c0 = run(synth_model, sparse=mode)
    toks, got, c = run(synth_model, sparse=mode, gpu_slots=slots, slots_device="CPU")
    assert toks == want_toks
    # the same rows with the same kernels, summed in two parts: float-order differences only
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-5 * scale
    assert c.selected == c0.selected and c.nonzero == c0.nonzero  # same lists, same activations
    # every listed neuron of a layer with slots was skipped by exactly one of the two down
    # projections (the host part if resident, else the slot part): the split really ran
    assert c0.elsewhere == 0
    assert c.rows == c0.rows  # each listed neuron computed once, by one of the two parts
    if isinstance(slots, int) and slots == N_FF and mode == "predicted":
        # every neuron resident: the layer is its device part alone, no host op ran
        assert c.elsewhere == 0 and c.ffn_calls == 0 and c0.ffn_calls > 0
    elif isinstance(slots, int):
        assert c.elsewhere == c.selected
    else:  # layer 0 has no slots: only layer 1's listed neurons are split
        assert 0 < c.elsewhere < c.selected


def test_whole_layers_split_while_a_balancer_runs(synth_model: Path) -> None:
    """Every neuron in slots: each layer is its device part alone (no host op) until a balancer
    starts, which reads every layer's list from the host part: the graphs then split again and
    its steps see the lists; stopped, the layers are whole again. The tokens stay those of the
    unsplit run throughout."""
    import kairox
    from kairox._native import balance_counters, sparse_counters
    want_toks, _, _ = run(synth_model, sparse="predicted")
    llm = kairox.Llama(str(synth_model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       verbose=False, sparse="predicted", gpu_slots=N_FF, slots_device="CPU")
    try:
        toks, calls = [], []

        def decode(ids: list[int]) -> None:
            sparse_counters(reset=True)
            llm.eval(ids)
            calls.append(sparse_counters(reset=True).ffn_calls)

        decode(PROMPT[:6])
        llm.start_balancer(True, observe=True)
        balance_counters(reset=True)
        decode(PROMPT[6:12])
        steps = balance_counters(reset=True)["steps"]
        llm.start_balancer(None)
        decode(PROMPT[12:])
        for _ in range(N_GEN):
            toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            decode([toks[-1]])
        assert calls[0] == 0 and calls[1] > 0 and sum(calls[2:]) == 0, calls
        assert steps > 0
        assert toks == want_toks
    finally:
        llm.close()


def test_residents_are_the_most_active_neurons(synth_model: Path) -> None:
    """The static split holds each layer's most frequent neurons (the pack's kx_freq, by neuron
    id; its rows are permuted), the ones the Python reference's static placement names."""
    import kairox
    from kairox.balancer import neuron_groups, static_residents
    from kairox.pack import pack_path_for, read_pack
    pk = read_pack(pack_path_for(synth_model))
    freqs = [layer.freq for layer in pk.layers]
    assert not np.array_equal(pk.layers[0].perm, np.arange(N_FF))
    llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=[10, 40], slots_device="CPU", verbose=False)
    try:
        for il, S in enumerate([10, 40]):
            res = llm.slot_residents(il)
            assert len(res) == S and len(set(res)) == S
            order = np.argsort(-freqs[il], kind="stable")
            assert sorted(res) == sorted(order[:S].tolist())
            # the reference numbers groups of one neuron by frequency rank (kairox.balancer.neuron_groups)
            g = neuron_groups(pk.layers[il].perm, pk.layers[il].group, freqs[il], 1)
            assert sorted(g[res].tolist()) == static_residents(pk, N_FF, S, 1)[il]
        assert llm.slots_bytes > 0
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["exact", "predicted"])
@pytest.mark.parametrize("gpu", [False, True])
def test_swapping_residents_between_tokens_keeps_the_output(synth_model: Path, mode: str, gpu: bool) -> None:
    """The balancer's reloads move neurons between the two sides of the split: after any
    swap each listed neuron is still computed exactly once, so outputs stay those of the
    unsplit run while the residents change every token (slots on the CPU device here, in
    GPU memory on the GPU machine)."""
    import kairox
    from kairox._native import has_gpu, sparse_counters
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    want_toks, want, c0 = run(synth_model, sparse=mode)
    rng = np.random.default_rng(3)
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    llm = kairox.Llama(str(synth_model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, type_k=0, type_v=0,
                       verbose=False, sparse=mode, gpu_slots=[60, 100], **where)
    try:
        sparse_counters(reset=True)
        llm.eval(PROMPT)
        toks, moved = [], 0
        for _ in range(N_GEN):
            toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            for il, S in enumerate([60, 100]):
                res = llm.slot_residents(il)
                out = sorted(set(range(N_FF)) - set(res))
                k = int(rng.integers(0, 12))
                ev = rng.choice(res, k, replace=False).tolist()
                ad = rng.choice(out, k + (1 if len(res) < S else 0), replace=False).tolist()
                llm.swap_slots(il, evict=ev, admit=ad)
                now = llm.slot_residents(il)
                assert sorted(now) == sorted(set(res) - set(ev) | set(ad)) and len(now) <= S
                moved += len(ad)
            llm.eval([toks[-1]])
        got, c = np.array(llm.scores[:llm.n_tokens]), sparse_counters(reset=True)
    finally:
        llm.close()
    assert moved > N_GEN * 5
    assert toks == want_toks
    if gpu:  # CUDA kernels vs the CPU's: rounding (as test_gpu_hybrid_matches_the_cpu)
        assert float(np.abs(got - want).max()) <= 1e-3 * float(np.abs(want).max())
        assert c.rows > 0 and c.elsewhere > 0
    else:
        assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())
        assert c.selected == c0.selected and c.rows == c0.rows and c.elsewhere == c.selected


def test_bad_swaps_change_nothing(synth_model: Path) -> None:
    import kairox
    llm = kairox.Llama(str(synth_model), sparse="exact", gpu_slots=[0, 8], slots_device="CPU", verbose=False)
    try:
        res = llm.slot_residents(1)
        out = [i for i in range(N_FF) if i not in res]
        for il, ev, ad, match in [(0, [], [1], "no neuron slots"), (1, [out[0]], [], "not resident"),
                                  (1, [], [res[0]], "is resident"), (1, [res[0]], [out[0], out[1]], "1 slots free"),
                                  (1, [res[0], res[0]], [], "listed twice"), (1, [], [N_FF], "out of range")]:
            with pytest.raises(ValueError, match=match):
                llm.swap_slots(il, evict=ev, admit=ad)
            assert llm.slot_residents(1) == res
        llm.swap_slots(1, evict=res[:2], admit=[])  # two empty slots ...
        llm.swap_slots(1, admit=out[:2])             # ... refilled later
        assert sorted(llm.slot_residents(1)) == sorted(res[2:] + out[:2])
    finally:
        llm.close()


def test_slots_without_a_gpu_are_an_error_or_the_fallback(synth_model: Path) -> None:
    import kairox
    from kairox._native import has_gpu
    if has_gpu():
        pytest.skip("this machine has a GPU: the slots would be made")
    with pytest.raises(kairox.SparsePackError, match="GPU"):
        kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=16, verbose=False)
    with pytest.warns(kairox.SparsePackWarning, match="GPU"):
        llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=16, verbose=False, fallback="dense")
    try:
        assert llm.sparse == "dense" and "GPU" in llm.sparse_error
        assert llm.slots_bytes == 0
    finally:
        llm.close()


@pytest.mark.parametrize("bad,match", [(-1, "gpu_slots"), ([1, 2, 3], "3 values"), ("many", "gpu_slots")])
def test_bad_slot_counts_are_refused(synth_model: Path, bad, match: str) -> None:
    import kairox
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=match):
            llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=bad, slots_device="CPU", verbose=False)
            llm.close()


def test_slots_need_a_sparse_mode(synth_model: Path) -> None:
    import kairox
    with pytest.raises(ValueError, match="sparse mode"):
        kairox.Llama(str(synth_model), sparse="dense", gpu_slots=8, verbose=False)


@pytest.mark.parametrize("mode", ["exact", "predicted"])
def test_gpu_hybrid_matches_the_cpu(synth_model: Path, mode: str) -> None:
    """On a GPU: attention and the slot part on the GPU (CUDA kernels), the host part on
    the CPU beside it; the same tokens and logits as the all-CPU sparse run."""
    from kairox._native import has_gpu
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    want_toks, want, c0 = run(synth_model, sparse=mode)
    toks, got, c = run(synth_model, sparse=mode, gpu_slots=100, n_gpu_layers=-1)
    assert toks == want_toks
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-3 * scale
    # both sides computed part of every list: the CPU its rows, the slots the rest
    assert c.rows > 0 and c.elsewhere > 0
    listed = c.rows + c.elsewhere
    assert abs(listed - c0.rows) <= 0.01 * c0.rows  # GPU vs CPU predictor rounding may flip a few


def test_gpu_whole_layers_match_the_cpu(synth_model: Path) -> None:
    """On a GPU with every neuron in slots: each layer is its device part alone (kx_layer_whole:
    no CPU split, no hand-off, no warm-up list), and gives the all-CPU sparse run's tokens and
    logits."""
    from kairox._native import has_gpu, sched_counters
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    want_toks, want, c0 = run(synth_model, sparse="predicted")
    sched_counters(reset=True)
    toks, got, c = run(synth_model, sparse="predicted", gpu_slots=N_FF, n_gpu_layers=-1)
    sc = sched_counters(reset=True)
    assert toks == want_toks
    assert float(np.abs(got - want).max()) <= 1e-3 * float(np.abs(want).max())
    assert c.ffn_calls == 0 and c0.ffn_calls > 0 and c.elsewhere == 0  # no host op ran
    assert sc["deferred"] == 0, sc  # no warm-up node either
    assert sc["cpu_splits"] <= sc["graphs"], sc  # at most the token lookup's split per graph


def test_gpu_quantized_hybrid_matches_the_cpu(tmp_path: Path) -> None:
    """On a GPU, a Q4_0 model's hybrid: attention's matvecs quantize x to q8_1 once for Q, K
    and V (patch 0020: a copy of another x, the attention output's or another layer's, would
    not give these logits), the slot rows write the zeros between their list's entries
    themselves, and the gated up rows give the GLU's output. A teacher-forced decode gives the
    all-CPU sparse run's logits within the two backends' quantization noise."""
    import kairox
    from kairox._native import has_gpu, sparse_counters
    from kairox.synth import Shape
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    model = permuted_tiny(tmp_path / "kb-q4.gguf", Shape(2, 256, 1024, 4, 2, "q4_0"), seed=5)
    seq = list(range(1, 41))

    def decode(**kw) -> tuple[np.ndarray, object]:
        llm = kairox.Llama(str(model), n_ctx=256, n_batch=1, n_ubatch=1, logits_all=True, sparse="predicted",
                           verbose=False, **kw)
        try:
            assert llm.sparse == "predicted", llm.sparse_error
            sparse_counters(reset=True)
            llm.eval(seq)
            return np.array(llm.scores[:llm.n_tokens]), sparse_counters(reset=True)
        finally:
            llm.close()
    want, _ = decode()
    got, c = decode(gpu_slots=300, n_gpu_layers=-1)
    assert c.rows > 0 and c.elsewhere > 0  # both sides computed part of every list
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 2e-2 * scale
    assert np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)) >= 0.9


def test_gpu_warm_up_keeps_the_output(synth_model: Path) -> None:
    """The warm-up on a GPU (the default; warm=False turns it off): layer 0 predicts layer 1's
    list beside its CPU part and the device writes it to the host; layer 1's CPU split starts
    before the device's results have landed, its first node reading that list's rows while
    thread 0 waits (kx-warm.cpp, patch 0012). The
    tokens and logits must be those of the run without it (up to the rounding of the axpy
    kernel's atomic adds: a split reading its inputs before they landed is off by a whole part),
    and the counters must show every layer-1 step deferred, and rows warmed from lists."""
    from kairox._native import has_gpu, sched_counters, warm_counters
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    sched_counters(reset=True)
    warm_counters(reset=True)
    want_toks, want, _ = run(synth_model, sparse="predicted", gpu_slots=100, n_gpu_layers=-1, warm=False)
    off, woff = sched_counters(reset=True), warm_counters(reset=True)
    toks, got, _ = run(synth_model, sparse="predicted", gpu_slots=100, n_gpu_layers=-1)
    on, won = sched_counters(reset=True), warm_counters(reset=True)
    assert off["deferred"] == 0 and woff["calls"] == 0
    steps = len(PROMPT) + N_GEN  # one token per decode (n_batch=1): layer 1 warms once each
    assert won["calls"] == steps and on["deferred"] == steps, (won, on)
    # the next layer's list is computed beside the CPU part, not in a split of its own
    assert on["cpu_splits"] == off["cpu_splits"], (on, off)
    # a list lands beside layer 0's CPU part; on this tiny model that part can end first
    assert won["lists"] > 0 and won["rows"] > 0 and won["bytes"] > 0, won
    assert toks == want_toks
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


def retyped_ffn_bf16(src: Path, dst: Path) -> Path:
    """A copy of the model `src` whose ffn_gate and ffn_up are BF16 (every key and other
    tensor as they are), with a pack of its own."""
    import gguf
    T = gguf.GGUFValueType
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.get_field("general.architecture").contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == T.ARRAY:
            sub = f.types[1]
            val = [bytes(f.parts[i]) for i in f.data] if sub == T.STRING else list(f.contents())
            w.add_key_value(name, val, T.ARRAY, sub_type=sub)
        elif f.types[0] == T.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]), T.STRING)
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.name.endswith(("ffn_gate.weight", "ffn_up.weight")):
            f32 = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
            bits = f32.view(np.uint32)
            bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
            w.add_tensor(t.name, bf16, raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from kairox.predictor import sketch_for_model
    write_pack(dst, predictor=sketch_for_model(dst), quiet=True)
    return dst


def test_gpu_slots_refuse_a_type_their_kernels_cannot_read(synth_model: Path, tmp_path: Path) -> None:
    """BF16 gate/up rows have a CPU kernel (the model runs sparse on the CPU) but no CUDA row
    kernel: GPU slots over them are refused with the type and what the kernels read, before
    the model loads (read from the model's and the pack's headers), instead of the scheduler
    copying the slots to the CPU each token."""
    import kairox
    from kairox._native import has_gpu
    model = retyped_ffn_bf16(synth_model, tmp_path / "kb-tiny-bf16.gguf")
    toks, _, c = run(model, sparse="predicted")  # the CPU reads BF16 rows
    assert len(toks) == N_GEN and c.rows > 0
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    with pytest.raises(ValueError, match=r"cannot hold bf16 rows \(the model's ffn_gate\).*Q4_K") as e:
        kairox.Llama(str(model), n_ctx=256, sparse="predicted", gpu_slots=100, n_gpu_layers=-1, verbose=False)
    assert not isinstance(e.value, kairox.ModelLoadError)


def test_placement_is_reported_per_tensor(synth_model: Path) -> None:
    """Hybrid placement without a GPU (slots on the CPU device): every weight in plain
    CPU buffers (mapped from the file: CPU_Mapped); the lookup names the buffer type, None
    for a tensor the model lacks."""
    import kairox
    llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=8, slots_device="CPU",
                       n_gpu_layers=0, verbose=False)
    try:
        for name in ("blk.0.ffn_gate.weight", "blk.1.ffn_down.weight", "blk.0.attn_q.weight"):
            assert llm.tensor_buffer_type(name) == "CPU_Mapped", name
        assert llm.tensor_buffer_type("blk.9.ffn_gate.weight") is None
    finally:
        llm.close()


@pytest.mark.parametrize("pinned", [True, False])
def test_gpu_host_weights_are_pinned(synth_model: Path, pinned: bool) -> None:
    """On a GPU: the FFN weights stay in host memory, page-locked (kairox's host buffer
    type, kx-host.cpp) unless pinned=False; attention on the
    GPU. A prompt of 40 tokens (a batch the scheduler offloads to the GPU, weights copied
    from host memory) gives the logits of the all-CPU sparse run."""
    import kairox
    from kairox._native import has_gpu
    if not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    prompt = list(range(1, 41))
    ref = kairox.Llama(str(synth_model), sparse="exact", n_ctx=128, n_batch=64, n_ubatch=64,
                       logits_all=True, verbose=False)
    try:
        ref.eval(prompt)
        want = np.array(ref.scores[:len(prompt)])
    finally:
        ref.close()
    llm = kairox.Llama(str(synth_model), sparse="exact", gpu_slots=100, n_gpu_layers=-1, pinned=pinned,
                       n_ctx=128, n_batch=64, n_ubatch=64, logits_all=True, verbose=False)
    try:
        host = llm.tensor_buffer_type("blk.0.ffn_up.weight")
        assert host == ("KX_Host_Pinned" if pinned else "CPU_Mapped")
        assert llm.tensor_buffer_type("blk.1.ffn_down.weight") == host
        assert llm.tensor_buffer_type("blk.0.attn_q.weight").startswith("CUDA")
        assert llm.tensor_buffer_type("blk.0.attn_q.weight") != "CUDA_Host"
        llm.eval(prompt)
        got = np.array(llm.scores[:len(prompt)])
    finally:
        llm.close()
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-2 * scale


def test_pinned_must_be_a_bool() -> None:
    from kairox.llama import KairoxOptions
    with pytest.raises(TypeError, match="pinned"):
        KairoxOptions(gpu_slots=4, pinned="yes")


def mapped_count(freq: np.ndarray, resident: list[int], share: float) -> int:
    """How many host-side neurons a mapped share takes: hottest first (ties by id) until
    their summed frequency reaches `share` of the host side's (kx_slots_set_mapped_share)."""
    cold = np.setdiff1d(np.arange(len(freq)), resident)
    f = freq[cold][np.argsort(-freq[cold], kind="stable")].astype(np.float64)
    acc, n = 0.0, 0
    for v in f:
        if acc >= share * float(f.sum()):
            break
        acc += float(v)
        n += 1
    return n


@pytest.mark.parametrize("mode", ["exact", "predicted"])
@pytest.mark.parametrize("gpu", [False, True])
def test_mapped_share_keeps_the_output(synth_model: Path, mode: str, gpu: bool) -> None:
    """The slots' device also computes a share of the host side from the host rows (mapped:
    over PCIe on a GPU, plain host memory on the CPU device): each listed neuron is still
    computed once, by one of three parts, so tokens and logits stay those of the unsplit
    run; the share takes the hottest host-side neurons; 0 gives them back."""
    import kairox
    from kairox._native import has_gpu
    from kairox.pack import pack_path_for, read_pack
    if gpu and not has_gpu():
        pytest.skip("no GPU here (the GPU machine runs this: bench/device/hybrid.sh)")
    freqs = [layer.freq for layer in read_pack(pack_path_for(synth_model)).layers]
    where = {"n_gpu_layers": -1} if gpu else {"slots_device": "CPU"}
    slots, share = [60, 100], 0.5
    want_toks, want, c0 = run(synth_model, sparse=mode)
    _, _, cs = run(synth_model, sparse=mode, gpu_slots=slots, **where)
    seen: dict = {}

    def inspect(llm) -> None:
        seen["n"] = [llm.mapped_neurons(il) for il in range(N_LAYER)]
        seen["want"] = [mapped_count(freqs[il], llm.slot_residents(il), share) for il in range(N_LAYER)]
        llm.set_mapped_share(0.0)
        seen["after"] = [llm.mapped_neurons(il) for il in range(N_LAYER)]

    toks, got, c = run(synth_model, inspect, sparse=mode, gpu_slots=slots, mapped_share=share, **where)
    assert seen["n"] == seen["want"] and min(seen["n"]) > 0
    assert seen["after"] == [0] * N_LAYER
    assert toks == want_toks
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= (1e-3 if gpu else 1e-5) * scale
    if gpu:  # the host part computed fewer rows: the device took the mapped ones
        assert 0 < c.rows < cs.rows
        assert abs(c.rows + c.elsewhere - c0.rows) <= 0.01 * c0.rows
    else:  # all three parts on the CPU backend: each listed row once, skipped by the other two
        assert c.selected == c0.selected and c.rows == c0.rows
        assert c.elsewhere == 2 * c.selected


def test_bad_mapped_shares_are_refused(synth_model: Path) -> None:
    import kairox
    for bad in (-0.1, 1.0, "half", True):
        with pytest.raises(ValueError, match="mapped_share"):
            kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=8, slots_device="CPU", mapped_share=bad,
                         verbose=False)
    with pytest.raises(ValueError, match="gpu_slots"):
        kairox.Llama(str(synth_model), sparse="predicted", mapped_share=0.5, verbose=False)
    with pytest.raises(ValueError, match="balancer"):
        kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=8, slots_device="CPU", mapped_share=0.5,
                     balancer=True, verbose=False)
    llm = kairox.Llama(str(synth_model), sparse="predicted", gpu_slots=8, slots_device="CPU", mapped_share=0.5,
                       verbose=False)
    try:
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            llm.set_mapped_share(1.5)
        n = llm.mapped_neurons(0)
        assert n > 0
        # a mapped neuron (the hottest host-side one is) cannot take a slot: it would be
        # computed twice; nothing changes
        from kairox.pack import pack_path_for, read_pack
        freq = read_pack(pack_path_for(synth_model)).layers[0].freq
        res = llm.slot_residents(0)
        hot = max(sorted(set(range(N_FF)) - set(res)), key=lambda i: freq[i])
        with pytest.raises(ValueError, match="mapped"):
            llm.swap_slots(0, evict=[res[0]], admit=[hot])
        assert llm.slot_residents(0) == res
        llm.start_balancer(True, observe=True)  # records only: the share stays
        assert llm.mapped_neurons(0) == n
        llm.start_balancer(True)  # moves neurons between slots and CPU: the share goes back
        assert llm.mapped_neurons(0) == 0
        with pytest.raises(ValueError, match="balancer"):
            llm.set_mapped_share(0.5)
    finally:
        llm.close()
