"""The cost model, in one place: bytes a step reads or moves, and the machine's rates, turned
into seconds. The planner (kairox.plan.HwProfile), the balancer's simulator
(kairox.balancer.SimCosts), the benchmarks' physical bounds (bench/offload.py,
bench/balance_live.py) and the runtime's stall model (ggml_ext/llama/kx-balance.cpp, fed
kx_balance_params.cpu_gbs / gpu_gbs, with the same defaults) all read these rates; measured
ones come from `kairox profile-hw` (read by kairox.plan.HwProfile.from_json). tests/test_balance_live.py checks the runtime's stall
types against stall_type() here.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """GB/s of the three resources a decode step uses. The defaults are the runtime's when no
    rate is given (kx_balance_params: 0 means these)."""
    cpu_gbs: float = 100.0   # the CPU's matvec over host weight rows (weight bytes per second)
    gpu_gbs: float = 2000.0  # the GPU's matvec over its memory
    pcie_gbs: float = 50.0   # host-to-device copies

    def __post_init__(self) -> None:
        if not all(isinstance(v, (int, float)) and v > 0 for v in (self.cpu_gbs, self.gpu_gbs, self.pcie_gbs)):
            raise ValueError(f"rates must be positive GB/s, got {self}")

    @classmethod
    def from_bandwidths(cls, bw: Mapping[str, Any]) -> "Rates":
        """From kairox.hw.measure_bandwidths's cpu_read / gpu_hbm / pcie_h2d (absent: the default)."""
        base = cls()
        return cls(float(bw.get("cpu_read") or base.cpu_gbs), float(bw.get("gpu_hbm") or base.gpu_gbs),
                   float(bw.get("pcie_h2d") or base.pcie_gbs))

    def cpu_s(self, nbytes: float) -> float:
        return nbytes / (self.cpu_gbs * GB)

    def gpu_s(self, nbytes: float) -> float:
        return nbytes / (self.gpu_gbs * GB)

    def pcie_s(self, nbytes: float) -> float:
        return nbytes / (self.pcie_gbs * GB)


def stall_type(cpu_bytes: float, gpu_bytes: float, rates: Rates, waited: bool = False) -> str:
    """What a hybrid layer's step waited on (the balancer's adaptive λ reads it): "io" when the
    step waited for reloads, "cpu" when its CPU part (the active rows not resident) takes
    longer than its GPU part (those resident), else "none"."""
    if waited:
        return "io"
    return "cpu" if rates.cpu_s(cpu_bytes) > rates.gpu_s(gpu_bytes) else "none"
