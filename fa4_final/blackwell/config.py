"""The Blackwell forward's knobs (``BlackwellFwdConfig``), their checks and the defaults.

Everything a kernel needs to size its on-chip memory is derived here, in plain Python, so the CPU
tests, the pipeline simulation and the cycle model read the same numbers the kernel is built
from: the TMEM plan (``tmem.forward_plan``), the shared-memory sum (asserted against the kernel's
struct), the K/V ring depth and the register budget of each warp role.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fa4_final.blackwell.tmem import TMEM_LANES, backward_pair_plan, backward_plan, forward_plan
from fa4_final.common.constants import HEAD_DIMS, SM100_SMEM_BYTES
from fa4_final.common.register_plan import check_budgets, problems
from fa4_final.common.softmax import check_softmax_knobs

TILE_M = TMEM_LANES  # rows of one Q tile: one per TMEM lane, one per softmax thread
Q_STAGES = 2  # Q tiles per CTA: the two softmax warpgroups ping-pong on them
THREADS = 512  # 16 warps (ROLES in fwd.py)
# FA4's rule for the K/V ring: stages of what 224 KB leaves after Q and O (the rest of the 227 KB
# holds the barriers and the row statistics), at most this many.
KV_BUDGET_BYTES = 224 * 1024
MAX_KV_STAGES = 32

# setmaxnreg budget (softmax, correction, the rest). Warp w runs on SM sub-partition w % 4, whose
# register file gives each of its 32 thread slots 512 registers (common.register_plan): each
# sub-partition holds one warp of each warpgroup, softmax0, softmax1, correction and one of the
# four one-warp roles, so 2 * 192 + 80 + 48 = 512 per sub-partition (64 K registers for the
# CTA). The same at D = 64 and 128, 1- and 2-CTA: every role compiles spill-free with it (the
# package's compile tests). FA4 gives its 2-CTA kernel (184, 80, 64); here that made
# ptxas spill the pair's shared-memory base address across the setmaxnreg of three roles.
DEFAULT_REGISTERS = (192, 80, 48)


def _align(n: int, to: int = 1024) -> int:
    return -(-n // to) * to


def forward_warp_budgets(soft: int, corr: int, rest: int) -> dict[int, int]:
    """warp -> setmaxnreg budget of the forward's roles (fwd.py): softmax warps 0-7,
    correction 8-11, the four one-warp roles 12-15."""
    return {w: soft if w < 8 else corr if w < 12 else rest for w in range(THREADS // 32)}


def backward_warp_budgets(regs: dict) -> dict[int, int]:
    """warp -> setmaxnreg budget of the backward's roles (bwd.py; the pair's are the same):
    compute warps 0-7, dQ 8-11, MMA 12, load 13, spare 14-15."""
    role = ["compute"] * 8 + ["dq"] * 4 + ["mma", "load", "spare", "spare"]
    return {w: regs[r] for w, r in enumerate(role)}


@dataclass(frozen=True)
class BlackwellFwdConfig:
    """Knobs of fa4_final.blackwell.fwd.BlackwellForward."""

    two_cta: bool = False  # a CTA pair shares one 256-row tcgen05.mma (cta_group::2)
    tile_n: int = 128  # keys per K/V tile
    kv_stages: int = 0  # depth of the K/V ring; 0 = as many as fit (KV_BUDGET_BYTES)
    persistent: bool = True  # one CTA (pair) per SM (pair) walks tiles (fa4_final.common.schedule)
    exp2_emulation_fraction: float = 0.125  # share of exponentials on the FMA units
    rescale_threshold: float = 8.0  # tau, log2 units; 0 = rescale at every growth
    registers: tuple[int, int, int] | None = None  # (softmax, correction, rest); None = default

    @property
    def cta_group(self) -> int:
        return 2 if self.two_cta else 1

    @property
    def mma_m(self) -> int:
        """Rows of one tcgen05.mma: 128 per CTA, 256 for a pair."""
        return TILE_M * self.cta_group

    @property
    def cluster_tile_m(self) -> int:
        """Query rows one scheduled tile covers: two Q stages of mma_m rows."""
        return Q_STAGES * self.mma_m

    def register_budget(self, head_dim: int) -> tuple[int, int, int]:
        return DEFAULT_REGISTERS if self.registers is None else tuple(self.registers)

    def tmem_plan(self, head_dim: int):
        return forward_plan(self.tile_n, head_dim, Q_STAGES)

    def _fixed_smem(self, head_dim: int, elem_bytes: int) -> tuple[int, int, int]:
        """(small fields, Q, O) bytes: mbarriers (8 B each: full + empty for Q, K/V, S, O,
        stats and the O epilogue), the TMEM address, the 2-CTA dealloc barrier, the row stats
        (one float per row and Q stage), then Q and O, 1 KB aligned."""
        kv = self.ring_depth(head_dim, elem_bytes)
        barriers = 8 * 2 * (Q_STAGES + kv + 4 * Q_STAGES)
        small = barriers + 8 + 4 + 4 * Q_STAGES * TILE_M
        tile = TILE_M * head_dim * elem_bytes
        return small, Q_STAGES * tile, Q_STAGES * tile

    def kv_stage_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """One K or V tile in one CTA's shared memory: half of it when two CTAs share it."""
        return self.tile_n * head_dim * elem_bytes // self.cta_group

    def ring_depth(self, head_dim: int, elem_bytes: int = 2) -> int:
        if self.kv_stages:
            return self.kv_stages
        q_and_o = 2 * Q_STAGES * TILE_M * head_dim * elem_bytes
        return min((KV_BUDGET_BYTES - q_and_o) // self.kv_stage_bytes(head_dim, elem_bytes),
                   MAX_KV_STAGES)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Bytes of the kernel's SharedStorage (the kernel asserts its struct has this size)."""
        small, q, o = self._fixed_smem(head_dim, elem_bytes)
        kv = self.ring_depth(head_dim, elem_bytes) * self.kv_stage_bytes(head_dim, elem_bytes)
        return _align(small) + _align(o) + _align(q) + _align(kv)

    def check(self, head_dim: int) -> BlackwellFwdConfig:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if self.tile_n != 128:
            raise ValueError(f"tile_n must be 128 (one S tile = 128 TMEM columns), got "
                             f"{self.tile_n}")
        self.tmem_plan(head_dim)  # raises when the columns do not fit
        soft, corr, rest = self.register_budget(head_dim)
        for name, r in (("softmax", soft), ("correction", corr), ("rest", rest)):
            if r % 8 or not 24 <= r <= 256:
                raise ValueError(f"{name} registers must be a multiple of 8 in [24, 256] "
                                 f"(setmaxnreg), got {r}")
        plan = forward_warp_budgets(soft, corr, rest)
        if problems(plan, THREADS):
            raise ValueError(f"register budget {self.register_budget(head_dim)} cannot run: "
                             f"{'; '.join(problems(plan, THREADS))}")
        if self.ring_depth(head_dim) < 2:
            raise ValueError(f"kv_stages must be >= 2 (K and V of one step), got "
                             f"{self.ring_depth(head_dim)}")
        need = self.smem_bytes(head_dim)
        if need > SM100_SMEM_BYTES:
            raise ValueError(f"config needs {need} B of shared memory, more than the "
                             f"{SM100_SMEM_BYTES} B a CTA may use: fewer kv_stages")
        check_softmax_knobs(self.exp2_emulation_fraction, self.rescale_threshold)
        return self


def blackwell_fwd_default(head_dim: int, causal: bool = False) -> BlackwellFwdConfig:
    """The default sm_100 forward config: 2-CTA where FA4's package uses it (non-causal,
    D = 128: the pair halves the K and V each SM reads from shared memory per step), 1-CTA
    elsewhere. Emulation share and rescale threshold as FA4's defaults for bf16: one exponential
    in eight on the FMA units, tau = 8."""
    return BlackwellFwdConfig(two_cta=(head_dim == 128 and not causal))


def with_knobs(cfg: BlackwellFwdConfig, **knobs) -> BlackwellFwdConfig:
    return replace(cfg, **knobs)


# ----------------------------------------------------------------------------------------------
# the backward (fa4_final.blackwell.bwd)
# ----------------------------------------------------------------------------------------------
BWD_TILE_M = 128  # queries per step: the N of S^T = K Q^T and the M of dQ = dS K
BWD_TILE_N = TMEM_LANES  # keys per CTA: one per TMEM lane
BWD_DQ_CHUNK = 32  # dQ columns per staging buffer (128 x 32 float32 = 16 KB)
BWD_DQ_BUFFERS = 2
# setmaxnreg budget per role (Note [Register plan] of bwd.py). Each SM sub-partition holds one warp
# of each warpgroup (warp w runs on w % 4) and gives its 32 thread slots 512 registers each:
# compute0 + compute1 + dQ + warpgroup 3 = 176 + 176 + 48 + 112 = 512. Warpgroup 3 (MMA, load, two
# spare warps) lowers to one budget, as the PTX ISA asks of a warpgroup's setmaxnreg; the dQ warps
# hold 32 TMEM columns at a time and need few. Every role compiles spill-free with it at D = 64 and
# 128, 1-CTA and pair (the package's compile tests); the pair's MMA warp only because it
# re-reads its descriptors' base words each step (bwd_pair Note [Descriptors read each step]): ptxas
# hoisted all 80 of its per-block descriptors out of the step loop otherwise, 160 registers.
BWD_REGISTERS = {"compute": 176, "dq": 48, "mma": 112, "load": 112, "spare": 112}


@dataclass(frozen=True)
class BlackwellBwdConfig:
    """Knobs of fa4_final.blackwell.bwd.BlackwellBackward. One CTA per (128-key
    tile, kv head, batch), or with ``two_cta`` one CTA pair per 256 keys
    (fa4_final.blackwell.bwd_pair); the inner loop walks 128-query tiles."""

    q_stages: int = 0  # depth of the Q (+ lse) ring; 0 = 2 (1-CTA), pair: 2 at D = 64, else 1
    do_stages: int = 0  # depth of the dO (+ delta) ring; 0 = 2 where it fits (D = 64), else 1
    deterministic: bool = False  # dQ added in a fixed key-tile order (Note [dQ turns])
    two_cta: bool = False  # a CTA pair shares every GEMM (cta_group::2), dS exchanged via DSMEM

    tile_m = BWD_TILE_M
    tile_n = BWD_TILE_N

    @property
    def cta_group(self) -> int:
        return 2 if self.two_cta else 1

    def q_depth(self, head_dim: int) -> int:
        if self.q_stages:
            return self.q_stages
        return 1 if self.two_cta and head_dim > 64 else 2

    def do_depth(self, head_dim: int) -> int:
        if self.do_stages:
            return self.do_stages
        return 2 if head_dim <= 64 else 1

    def tmem_plan(self, head_dim: int):
        if self.two_cta:
            return backward_pair_plan(self.tile_m, head_dim)
        return backward_plan(self.tile_n, self.tile_m, head_dim)

    def smem_fields(self, head_dim: int, elem_bytes: int = 2) -> list[tuple[str, int, int]]:
        """(name, bytes, alignment) of the kernel's SharedStorage in its order: full + empty
        mbarriers of kv (1 stage), q, do and of the four one-stage MMA handshakes (s, dp, dq,
        dkv), the TMEM address, lse and delta per Q stage, then the tiles (1 KB aligned for the
        128 B swizzle): K, V, the Q and dO rings, dS (16-bit) and the float32 dQ staging."""
        if self.two_cta:
            return self.pair_smem_fields(head_dim, elem_bytes)
        q, do = self.q_depth(head_dim), self.do_depth(head_dim)
        tile_q = self.tile_m * head_dim * elem_bytes
        tile_k = self.tile_n * head_dim * elem_bytes
        return [
            ("barriers", 8 * 2 * (1 + q + do + 4), 8),
            ("tmem_addr", 4, 4),
            ("sLSE", 4 * self.tile_m * q, 16),
            ("sDelta", 4 * self.tile_m * q, 16),  # delta rides with Q (bwd Note [Handshakes])
            ("sK", tile_k, 1024),
            ("sV", tile_k, 1024),
            ("sQ", tile_q * q, 1024),
            ("sdO", tile_q * do, 1024),
            ("sdS", self.tile_n * self.tile_m * elem_bytes, 1024),
            ("sdQ", 4 * self.tile_m * BWD_DQ_CHUNK * BWD_DQ_BUFFERS, 1024),
        ]

    def pair_smem_fields(self, head_dim: int, elem_bytes: int = 2) -> list[tuple[str, int, int]]:
        """The pair's SharedStorage, per CTA (bwd_pair Note [The pair's shared memory]): the
        mbarriers (full + empty of kv, q, do, rows and the four MMA handshakes; dS-exchange full,
        its relay to the leader, the pair's TMEM-free handshake), the TMEM address, the MMA
        warp's descriptor base words (bwd_pair Note [Descriptors read each step]), lse and delta
        per Q stage; the CTA's own K and V (A of S^T, dP^T); Kt (B of dQ: D/2 x 256
        keys); Q, Qt, dO, dOt halves per stage (64 queries x D for S^T, dP^T; D/2 x 128 queries
        for dK, dV); dS (A of dQ: 64 queries x 256 keys); the dQ staging. dS^T, dK's A, lives
        in TMEM."""
        q, do = self.q_depth(head_dim), self.do_depth(head_dim)
        half_q = self.tile_m // 2 * head_dim * elem_bytes  # = head_dim / 2 x tile_m
        tile_k = self.tile_n * head_dim * elem_bytes  # = Kt: head_dim / 2 x 2 tile_n
        return [
            ("barriers", 8 * (2 * (1 + q + do + q + 4) + 3), 8),
            ("tmem_addr", 4, 4),
            ("desc_lo", 32, 16),
            ("sLSE", 4 * self.tile_m * q, 16),
            ("sDelta", 4 * self.tile_m * q, 16),
            ("sK", tile_k, 1024),
            ("sV", tile_k, 1024),
            ("sKt", tile_k, 1024),
            ("sQ", half_q * q, 1024),
            ("sQt", half_q * q, 1024),
            ("sdO", half_q * do, 1024),
            ("sdOt", half_q * do, 1024),
            ("sdS", self.tile_m // 2 * 2 * self.tile_n * elem_bytes, 1024),
            ("sdQ", 4 * self.tile_m * BWD_DQ_CHUNK * BWD_DQ_BUFFERS, 1024),
        ]

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        offset = 0
        for _, size, align in self.smem_fields(head_dim, elem_bytes):
            offset = _align(offset, align) + size
        return _align(offset, 1024)

    def check(self, head_dim: int) -> BlackwellBwdConfig:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if self.q_depth(head_dim) < 1 or self.do_depth(head_dim) < 1:
            raise ValueError(f"q_stages and do_stages must be >= 1, got {self.q_stages}, "
                             f"{self.do_stages}")
        self.tmem_plan(head_dim)  # raises when the columns do not fit
        need = self.smem_bytes(head_dim)
        if need > SM100_SMEM_BYTES:
            raise ValueError(f"config needs {need} B of shared memory, more than the "
                             f"{SM100_SMEM_BYTES} B a CTA may use: fewer q_stages / do_stages")
        check_budgets(backward_warp_budgets(BWD_REGISTERS), THREADS)
        return self
