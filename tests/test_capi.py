"""The C API's mirror (kairox.capi) against the headers, and the budget's C arithmetic
against its Python reference (kairox.budget).

The header check compiles a C program that prints the compiler's sizeof, offsetof and enum
values, so a C struct changed without its mirror fails here instead of corrupting memory.
"""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kairox import capi

ROOT = Path(__file__).resolve().parent.parent
INCLUDES = [ROOT / "ggml_ext" / "include", ROOT / "vendor" / "llama.cpp" / "include",
            ROOT / "vendor" / "llama.cpp" / "ggml" / "include"]


def _fields(st: type[ctypes.Structure]) -> list[str]:
    return [f for f, _ in st._fields_]


def _compiler_view(tmp: Path) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.fail("no C compiler: the header check needs one (the build needs one too)")
    missing = [str(d) for d in INCLUDES if not d.is_dir()]
    if missing:
        pytest.skip(f"headers not laid out yet ({', '.join(missing)}): run scripts/vendor.py")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kairox.h"', '#include "kx-reload.h"', "int main(void) {",
             '    printf("{\\"structs\\": {");']
    for i, (cname, st) in enumerate(capi.STRUCTS.items()):
        sep = "," if i else ""
        lines.append(f'    printf("{sep}\\"{cname}\\": {{\\"size\\": %zu, \\"offsets\\": {{", sizeof(struct {cname}));')
        for j, f in enumerate(_fields(st)):
            fsep = "," if j else ""
            lines.append(f'    printf("{fsep}\\"{f}\\": %zu", offsetof(struct {cname}, {f}));')
        lines.append('    printf("}}");')
    lines.append('    printf("}, \\"enums\\": {");')
    for i, name in enumerate(capi.ENUMS):
        sep = "," if i else ""
        lines.append(f'    printf("{sep}\\"{name}\\": %lld", (long long) ({name}));')
    lines += ['    printf("}}\\n");', "    return 0;", "}"]
    src = tmp / "abi.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp / "abi"
    r = subprocess.run([cc, "-std=c11", *[f"-I{d}" for d in INCLUDES], str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout)


def test_structs_and_enums_match_the_headers(tmp_path: Path) -> None:
    view = _compiler_view(tmp_path)
    for cname, st in capi.STRUCTS.items():
        c = view["structs"][cname]
        assert ctypes.sizeof(st) == c["size"], f"struct {cname}: ctypes {ctypes.sizeof(st)} bytes, C {c['size']}"
        for f in _fields(st):
            assert getattr(st, f).offset == c["offsets"][f], f"struct {cname}.{f}: offset differs"
    for name, value in capi.ENUMS.items():
        assert view["enums"][name] == int(value), f"{name}: Python {int(value)}, C {view['enums'][name]}"


def test_a_drifted_mirror_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a mirror missing a field disagrees with the compiler."""
    class Short(ctypes.Structure):
        _fields_ = [f for f in capi.VramReport._fields_ if f[0] != "slots"]
    monkeypatch.setattr(capi, "STRUCTS", {"kx_vram_report": Short})
    view = _compiler_view(tmp_path)
    assert ctypes.sizeof(Short) != view["structs"]["kx_vram_report"]["size"]


def test_defaults_match_the_python_defaults(native: Path) -> None:
    from kairox.balancer import BalancerConfig
    from kairox.llama import _lib
    kp = _lib.kx_params_default()
    assert kp.sparse == capi.SPARSE_AUTO and kp.gpu_slots < 0 and kp.vram_budget == 0
    assert kp.pinned and kp.warm and kp.balancer == 0 and not _lib.kx_params_hybrid(ctypes.byref(kp))
    cfg = BalancerConfig()
    for f in ("lam", "eps", "alpha", "alpha_min", "lam_min", "lam_max"):
        assert getattr(kp.balance.tam, f) == pytest.approx(getattr(cfg, f), rel=1e-6), f
    assert kp.balance.tam.max_admit == -1 and kp.balance.max_blocks == 32


# ------------------------------------------------------------------ the budget, C against Python


def test_budget_arithmetic_equals_the_reference(native: Path) -> None:
    from kairox import budget
    from kairox.llama import _lib
    from kairox.plan import SlotCosts
    MiB = 1 << 20
    rng = np.random.default_rng(7)
    err = ctypes.create_string_buffer(1024)
    n_refused = 0
    for _ in range(400):
        n_layer = int(rng.integers(1, 90))
        costs = SlotCosts(n_layer=n_layer, n_ff=int(rng.integers(1, 30000)), per_neuron=int(rng.integers(256, 40000)),
                          pred=int(rng.integers(0, 800)) * MiB, gate_row=0)
        b = int(rng.integers(64, 24 * 1024)) * MiB
        base = int(rng.integers(0, 24 * 1024)) * MiB
        assert _lib.kx_budget_margin(b) == budget.margin_for(b)
        try:
            want, why = budget.auto_slots(b, base, costs), ""
        except budget.VramBudgetError as e:
            want, why = -1, str(e)
        got = _lib.kx_budget_auto_slots(b, base, costs.per_neuron, costs.pred, n_layer, costs.n_ff, err, len(err))
        assert got == want and (want >= 0 or err.value.decode() == why), (b, base, costs)
        n_refused += want < 0
        counts = [int(c) for c in rng.integers(0, costs.n_ff + 1, n_layer)]
        arr = (ctypes.c_int64 * n_layer)(*counts)
        try:
            budget.check_slots(b, base, costs, counts)
            want, why = 0, ""
        except budget.VramBudgetError as e:
            want, why = 1, str(e)
        got = _lib.kx_budget_check_slots(b, base, costs.per_neuron, costs.pred, costs.n_ff, arr, n_layer, err, len(err))
        assert got == want and (not want or err.value.decode() == why)
        over = int(rng.integers(1, 4 << 30))
        _lib.kx_budget_shrink(arr, n_layer, over, costs.per_neuron)
        assert list(arr) == budget.shrink(counts, over, costs)
    assert 0 < n_refused < 400  # both paths were taken


def test_budget_slot_counts_equal_the_reference(native: Path) -> None:
    """kx_budget_auto_counts, the runtime's per-layer counts under a budget, against
    budget.auto_slot_counts: measured frequencies that differ between layers (the solve gives
    them different counts), unknown ones (all 1: the same count everywhere), budgets from
    refused to more than the whole FFN."""
    from kairox import budget
    from kairox.llama import _lib
    from kairox.plan import HwProfile, SlotCosts
    MiB = 1 << 20
    rng = np.random.default_rng(11)
    err = ctypes.create_string_buffer(1024)
    seen = set()
    for case in range(80):
        n_layer, n_ff = int(rng.integers(1, 12)), int(rng.integers(1, 3000))
        costs = SlotCosts(n_layer=n_layer, n_ff=n_ff, per_neuron=int(rng.integers(256, 40000)),
                          pred=int(rng.integers(0, 64)) * MiB, gate_row=0)
        # layers of different density: a few hot neurons in some, a flat tail in others
        freqs = [np.clip(rng.exponential(rng.uniform(0.01, 0.4), n_ff), 0, 1).astype(np.float32) for _ in range(n_layer)]
        if case % 5 == 0:
            freqs = [np.ones(n_ff, np.float32) for _ in range(n_layer)]
        hw = HwProfile() if case % 2 else HwProfile(cpu_gbs=60.0, gpu_gbs=900.0)
        base = int(rng.integers(0, 2048)) * MiB
        whole = costs.pred + n_layer * n_ff * costs.per_neuron
        b = base + int(rng.uniform(-0.05, 1.2) * whole) + budget.margin_for(base + whole)
        try:
            want, why = budget.auto_slot_counts(b, base, costs, freqs, hw), ""
        except budget.VramBudgetError as e:
            want, why = None, str(e)
        out = (ctypes.c_int64 * n_layer)()
        flat = np.concatenate(freqs).astype(np.float32)
        got = _lib.kx_budget_auto_counts(b, base, costs.per_neuron, costs.pred, n_layer, n_ff,
                                         flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), hw.cpu_gbs, hw.gpu_gbs,
                                         out, err, len(err))
        if want is None:
            assert got == 1 and err.value.decode() == why
            seen.add("refused")
            continue
        assert got == 0 and list(out) == want, (case, b, base, costs)
        assert sum(want) * costs.per_neuron + costs.pred + base + budget.margin_for(b) <= b or not any(want)
        seen.add("equal" if len(set(want)) == 1 else "solved")
    assert seen == {"refused", "equal", "solved"}
