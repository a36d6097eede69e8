"""Every attention version of the course, in chapter order.

Each entry names a module exposing ``attention(q, k, v, causal=False, softmax_scale=None)
-> (out, lse)`` (CONTRIBUTING.md). Tests and the benchmark walk this list; a learner finds any
version's source from its ``module``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Version:
    chapter: int
    name: str
    module: str
    needs: str  # "cpu", "sm_80", "sm_90" or "sm_100" (utils.hardware.Machine.can_run)
    idea: str
    results: str | None = None  # results/h200/<results>.json holds its benchmark rows
    backward: bool = False  # differentiable with torch.autograd (benchmarked for bwd too)

    def load(self):
        """The version's ``attention`` function (imports its module on first use)."""
        return importlib.import_module(self.module).attention


VERSIONS = [
    Version(1, "naive", "solutions.ch01_naive", "cpu",
            "PyTorch: S and P materialised in memory", "ch01_ch02_fwd", backward=True),
    Version(2, "tiled_fa2", "solutions.ch02_online_softmax", "cpu",
            "online softmax over KV tiles, FlashAttention-2 loop order (PyTorch)",
            "ch01_ch02_fwd"),
    Version(4, "flash_ampere", "solutions.ch04_flash_ampere", "sm_80",
            "CuTe DSL: cp.async + ldmatrix + mma.sync, softmax in registers", "ch04_fwd"),
    Version(5, "flash_hopper", "solutions.ch05_flash_hopper", "sm_90",
            "CuTe DSL: TMA + WGMMA + mbarrier pipeline, warp specialisation", "ch05_fwd"),
    Version(8, "fa4_final", "fa4_final.api.interface", "sm_90",
            "fa4_final: ping-pong warpgroups, persistent tiles with the last round split along "
            "the keys, O rescaled under the S GEMM",
            "fa4_final_fwd"),
    Version(9, "fa4_final_sm100", "fa4_final.api.sm100", "sm_100",
            "fa4_final on Blackwell: TMEM accumulators, tcgen05 MMA, 2-CTA pairs (compiled; no "
            "B200 run)"),
]


def by_name(name: str) -> Version:
    for v in VERSIONS:
        if v.name == name:
            return v
    raise KeyError(f"no attention version {name!r}; known: {[v.name for v in VERSIONS]}")
