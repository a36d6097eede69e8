"""Warp roles as data: what every warp-specialised Blackwell kernel declares and checks. Ch 09.

A kernel names its roles in ``self.roles``: {name: {"warps": (...), "registers": n, "does": ...}}
(registers: the setmaxnreg budget of each of the role's threads). ``check_roles`` holds the rules
every such table must keep, asserted when the kernel object is built, before anything compiles.
"""

from __future__ import annotations

import cutlass.cute as cute

from fa4_final.blackwell.tmem import lane_quarter
from fa4_final.common.constants import WARP_SIZE
from fa4_final.common.register_plan import check_role_registers, launch_registers


def check_roles(roles: dict, threads: int, tmem_roles: tuple[str, ...]) -> None:
    """Every warp of the CTA has exactly one role; each role that reads or writes TMEM one row a
    thread (``tmem_roles``) is a whole warpgroup covering the four lane quarters (tmem.py, rule
    2); the roles' register budgets fit each SM sub-partition and are uniform within each
    warpgroup (common.register_plan: a plan over a sub-partition's 512 registers per thread
    slot hangs in setmaxnreg.inc)."""
    warps = sorted(w for r in roles.values() for w in r["warps"])
    assert warps == list(range(threads // WARP_SIZE)), warps
    for name in tmem_roles:
        quarters = sorted(lane_quarter(w).start for w in roles[name]["warps"])
        assert quarters == [0, 32, 64, 96], name
    check_role_registers(roles, threads)


def set_registers(registers: int, threads: int) -> None:
    """``setmaxnreg`` to ``registers``: .inc above what a thread holds at launch
    (``register_plan.launch_registers``: ``threads`` threads a CTA, one CTA an SM), .dec at
    or below it."""
    if registers > launch_registers(threads):
        cute.arch.setmaxregister_increase(registers)
    else:
        cute.arch.setmaxregister_decrease(registers)


class WarpRoles:
    """The host-side face both Blackwell kernels share: their cache key, role lookup and the
    roles that work on TMEM (``TMEM_ROLES``, set by each kernel: checked by check_roles, counted
    by tmem_threads)."""

    TMEM_ROLES: tuple[str, ...] = ()

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.dtype.__name__, self.head_dim, self.causal,
                self.window, self.cfg)

    def warp(self, role: str) -> int:
        """The first warp of ``role`` (a single-warp role's only warp)."""
        return self.roles[role]["warps"][0]

    def tmem_threads(self) -> int:
        """Threads that meet at the TMEM barrier: the TMEM roles and the allocating MMA warp."""
        return WARP_SIZE * (1 + sum(len(self.roles[r]["warps"]) for r in self.TMEM_ROLES))
