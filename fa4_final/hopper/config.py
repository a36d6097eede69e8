"""Frozen per-kernel configurations, their checks, and the defaults per (arch, head dim, causal).

Each knob is a compile-time constant of the kernel. ``check()`` raises ValueError naming the knob
that cannot work and why; the defaults cite the measurement they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_final.common.constants import (
    HEAD_DIMS,
    SM90_REGISTERS,
    SM90_SMEM_BYTES,
    THREADS_PER_WARPGROUP,
    WGMMA_M,
)
from fa4_final.common.dq_order import DQ_WARPGROUPS
from fa4_final.common.schedule import TILE_SLOTS
from fa4_final.common.softmax import check_softmax_knobs

O_RESCALE_PLACES = ("end", "early", "next_pv")
REDUCTION_WAYS = (0, 1, 2, 4)  # row max / row sum: chains per row (0 = a pairwise tree)

# setmaxnreg budgets (producer, consumer) per number of consumer warpgroups: the CTA's total,
# 128 * (producer + n * consumer), must stay within the SM's 64 K registers.
SM90_REGISTER_BUDGETS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}


def _align(n: int, to: int = 1024) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class HopperFwdConfig:
    """Knobs of fa4_final.hopper.fwd.HopperForward. tile_m is derived: 64 rows per consumer
    warpgroup."""

    num_consumer_wgs: int = 2  # MMA + softmax warpgroups, each owning 64 query rows
    tile_n: int = 128  # keys per K/V tile (one pipeline stage)
    stages_k: int = 2  # depth of the K ring
    stages_v: int = 2  # depth of the V ring
    intra_wg_overlap: bool = True  # softmax(S_j) while wgmma S_{j+1} and P_j V_j run
    pingpong: bool = True  # consumer warpgroups take turns issuing wgmma (Note [Turns])
    persistent: bool = True  # one CTA per SM walks tiles (fa4_final.common.schedule)
    l2_sections: bool = False  # causal order in sections of heads that fit L2 (Note [Causal..])
    tile_table: bool = False  # tiles to CTAs by a host-built list schedule (Note [Tile table])
    split_tail: bool = False  # the table's last round cut along the keys (Note [Split tail])
    dynamic_tiles: bool = False  # next tile from a counter at run time (Note [Dynamic tiles])
    separate_o: bool = True  # O staged in its own buffer: the next Q loads during the epilogue
    o_rescale: str = "next_pv"  # where O *= alpha: "end", "early", "next_pv" (Note [Where O..])
    mask_bits: bool = False  # right-edge mask as one bit word per row (mask, Note [Mask as bits])
    timeline: bool = False  # debug build: record phase timestamps (fa4_final.common.timeline)
    exp2_emulation_fraction: float = 0.0  # chapter 06
    rescale_threshold: float = 0.0  # chapter 07 (tau, log2 units; 0 = always rescale)
    row_max_ways: int = 0  # running chains per row max; 0 = a pairwise tree (Note [Reduction..])
    row_sum_ways: int = 0  # the same for the row sum, its first chain starting from alpha * l
    rescale_skip_unchanged: bool = False  # rows keep/move maxima alone; the vote gates O only
    pin_lane: bool = False  # the EMPTY arrives' lane read once, not every step (Note [Signall..])

    @property
    def tile_m(self) -> int:
        return WGMMA_M * self.num_consumer_wgs

    @property
    def registers(self) -> tuple[int, int]:
        return SM90_REGISTER_BUDGETS[self.num_consumer_wgs]

    @property
    def splits_tail(self) -> bool:
        """Whether tiles may be cut along the keys: split_tail cuts the tile table's last
        round, so without a table (tile_table=False) it does nothing, as l2_sections does
        nothing without a causal diagonal."""
        return self.split_tail and self.tile_table

    @property
    def schedules_dynamically(self) -> bool:
        """Whether CTAs take their tiles at run time (Note [Dynamic tiles]): only a persistent
        kernel has CTAs that take more than one, and a tile table (tile_table=True) hands
        them out before the launch, so either of those leaves dynamic_tiles without effect."""
        return self.dynamic_tiles and self.persistent and not self.tile_table

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Bytes of the kernel's SharedStorage: mbarriers (8 B each, full + empty per stage of
        Q, K and V) and the split tail's count, Q, the K and V rings, and O when it has its own
        buffer; each tile 1 KB aligned for the 128 B swizzle. The kernel asserts its struct
        has exactly this size."""
        barriers = 8 * 2 * (1 + self.stages_k + self.stages_v) + 8  # + the split-tail count
        barriers += (8 * 2 + 4) * TILE_SLOTS  # Note [Dynamic tiles]: FULL, EMPTY, the tile
        q = self.tile_m * head_dim * elem_bytes
        kv = self.tile_n * head_dim * elem_bytes
        o = q if self.separate_o else 0
        return (_align(barriers) + _align(q) + _align(self.stages_k * kv)
                + _align(self.stages_v * kv) + _align(o))

    def check(self, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if self.num_consumer_wgs not in SM90_REGISTER_BUDGETS:
            raise ValueError(f"num_consumer_wgs must be one of {sorted(SM90_REGISTER_BUDGETS)}, "
                             f"got {self.num_consumer_wgs}")
        producer, consumer = self.registers
        assert THREADS_PER_WARPGROUP * (producer + self.num_consumer_wgs * consumer) \
            <= SM90_REGISTERS
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256] (wgmma N and K), "
                             f"got {self.tile_n}")
        for name in ("stages_k", "stages_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        need = self.smem_bytes(head_dim)
        if need > SM90_SMEM_BYTES:
            raise ValueError(
                f"config needs {need} B of shared memory (Q {self.tile_m}x{head_dim}, "
                f"{self.stages_k} K + {self.stages_v} V stages of {self.tile_n}x{head_dim}"
                f"{', a separate O' if self.separate_o else ''}; 16-bit), more than the "
                f"{SM90_SMEM_BYTES} B a CTA may use: fewer stages, a smaller tile_n, or "
                f"separate_o=False")
        if self.o_rescale not in O_RESCALE_PLACES:
            raise ValueError(f"o_rescale must be one of {O_RESCALE_PLACES}, got {self.o_rescale!r}")
        if self.tile_table and not self.persistent:
            raise ValueError("tile_table assigns tiles to persistent CTAs: it needs "
                             "persistent=True (one CTA per tile leaves the assignment to the "
                             "hardware)")
        if self.pingpong and self.num_consumer_wgs < 2:
            raise ValueError("pingpong needs at least 2 consumer warpgroups to take turns")
        check_softmax_knobs(self.exp2_emulation_fraction, self.rescale_threshold)
        for name in ("row_max_ways", "row_sum_ways"):
            ways = getattr(self, name)
            if ways not in REDUCTION_WAYS:
                raise ValueError(f"{name} must be one of {REDUCTION_WAYS} (0 = a pairwise "
                                 f"tree), got {ways!r}")


# The causal schedule before the tile table and the dynamic hand-out: fixed zigzag rounds,
# longest first over every head (fa4_final.common.schedule.zigzag_tile); benchmarks and profiles
# time it beside the default (replace(hopper_fwd_default(...), **ZIGZAG_ROUNDS)).
ZIGZAG_ROUNDS = dict(l2_sections=False, tile_table=False, dynamic_tiles=False)


def hopper_fwd_default(head_dim: int, causal: bool = False,
                       varlen: bool = False) -> HopperFwdConfig:
    """The forward config for sm_90. D = 64: 192 x 128 with three consumer warpgroups (160
    registers each; spill-free only because every step takes a fresh S accumulator); D = 128:
    128 x 128 with two. O rescaled at the next P V's issue: of the three places it was the one
    the H200 runs favoured, and results/h200/fa4_final_knobs.json holds the comparison with the
    run-to-run spread (notebook 08 prints the verdicts).

    D = 64 (dense) skips the O multiply in a step where no row of the warp moved its max
    (rescale_skip_unchanged with tau = 0, Note [Warp vote]: exact maxima, the vote off the
    exponentials' path), and its causal shapes keep two K and two V stages, not three. Both
    were chosen at ncu's fixed SM clock, free of the power limit and of what ran before
    (results/h200/fa4_final_clocked*.json; fa4_final_clocked_skip.json compares the skip with
    tau = 8, whose vote the exponentials wait for, and shows both slower at D = 128); the
    bursts' spread is larger than either difference. Varlen, not measured so, keeps three
    stages and multiplies O every step. D = 64 causal also reads the signalling lane once
    (pin_lane, Note [Signalling lane]): at the fixed clock 0.6% faster at S = 16384 and a tie
    at 4096, within the spread; elsewhere ptxas schedules the step worse with it (D = 128,
    S = 16384 causal: 3% slower; results/h200/fa4_final_clocked_lane.json).

    Causal (dense): tiles longest first in sections of heads whose K and V fit in L2, each
    persistent CTA taking its next one at run time (Note [Dynamic tiles]): at the fixed clock
    ahead of the host's list schedule (Note [Tile table]) at the four causal shapes of the
    benchmark in two runs, each time by less than the run's spread (results/h200/
    fa4_final_clocked_dynamic*.json). Longest first over every head reads 3-5x more from DRAM
    at S = 4096 and 16384 (results/h200/fa4_final_versus.json: L2 hit rate 39% against 84% at
    D = 128, S = 4096); results/h200/fa4_final_sched.json times the older schedules. Not
    causal (dense): the tile table, its last partial round cut along the keys (Note [Split
    tail]; results/h200/fa4_final_split.json and fa4_final_energy.json compare it with whole
    tiles). Varlen takes its tiles at run time too, causal or not, causal ones in L2 sections
    of a sequence's heads (Note [Varlen order]): the table needs the tile costs before the
    launch, and varlen's lengths are on the device; results/h200/ch12_varlen.json times it
    beside the fixed zigzag rounds it replaced."""
    # causal or varlen: sectioned (causal only), taken at run time; equal dense tiles: the
    # table, its last round cut
    schedule = dict(l2_sections=True, dynamic_tiles=True)
    if not causal and not varlen:
        schedule = dict(tile_table=True, split_tail=True)
    if head_dim <= 64:  # dense: O multiplied only in steps where some row's max moved
        stages = 2 if causal and not varlen else 3
        return HopperFwdConfig(num_consumer_wgs=3, tile_n=128, stages_k=stages,
                               stages_v=stages, o_rescale="next_pv",
                               rescale_skip_unchanged=not varlen,
                               pin_lane=causal and not varlen, **schedule)
    return HopperFwdConfig(num_consumer_wgs=2, tile_n=128, stages_k=3, stages_v=2,
                           o_rescale="next_pv", **schedule)


# ----------------------------------------------------------------------------------------------
# The Hopper backward (fa4_final.hopper.bwd): chapter 11

BWD_MMA_WARPGROUPS = DQ_WARPGROUPS  # each owns 64 keys of the CTA's KV tile: tile_n = 128
SM90_BWD_REGISTERS = (24, 240)  # setmaxnreg (producer, each MMA warpgroup): 128*(24+2*240) <= 64K


@dataclass(frozen=True)
class HopperBwdConfig:
    """Knobs of fa4_final.hopper.bwd.HopperBackward. One CTA per (KV tile, kv head, batch); two
    MMA warpgroups own 64 keys each, so tile_n = 128 is derived; the inner loop walks the query
    tiles of every query head of the group."""

    tile_m: int = 64  # query rows per step of the inner loop
    stages_q: int = 2  # depth of the Q (+ lse) and dO (+ delta) rings
    stages_ds: int = 2  # dS buffers (1 or stages_q; 1: the warpgroups sync once more a step)
    dq_swap_ab: bool = False  # dQ^T = K^T dS^T: wgmma M = D, so tile_m need not be 64k
    deterministic: bool = False  # dQ accumulated in a fixed order of KV tiles (Note [Turns])
    pin_lane: bool = False  # the EMPTY arrives' lane read once (fa4_final.hopper.fwd Note
    # [Signalling lane]); its KV-tile loop reads the thread index every step without it. Not
    # timed yet, so off

    @property
    def tile_n(self) -> int:
        return WGMMA_M * BWD_MMA_WARPGROUPS

    @property
    def registers(self) -> tuple[int, int]:
        return SM90_BWD_REGISTERS

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Bytes of the kernel's SharedStorage, field by field in its order (the kernel asserts
        its struct has this size): the mbarriers (full + empty per stage of Q and dO, and K/V's
        one), lse and delta per stage (float32), the Q and dO rings, K, V, the dS buffers and
        the float32 dQ staging tile; tiles 1 KB aligned for the 128 B swizzle."""
        fields = [  # (bytes, alignment)
            (8 * 2 * (2 * self.stages_q + 1), 8),
            (4 * self.tile_m * self.stages_q, 128),  # lse (log2 units)
            (4 * self.tile_m * self.stages_q, 128),  # delta
            (self.tile_m * head_dim * elem_bytes * self.stages_q, 1024),  # Q
            (self.tile_m * head_dim * elem_bytes * self.stages_q, 1024),  # dO
            (self.tile_n * head_dim * elem_bytes, 1024),  # K
            (self.tile_n * head_dim * elem_bytes, 1024),  # V
            (self.tile_m * self.tile_n * elem_bytes * self.stages_ds, 1024),  # dS
            (self.tile_m * head_dim * 4, 1024),  # dQ (float32)
        ]
        offset = 0
        for size, align in fields:
            offset = _align(offset, align) + size
        return _align(offset, 1024)

    def check(self, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        m = self.tile_m
        if isinstance(m, bool) or not isinstance(m, int) or m % 16 or not 16 <= m <= 128:
            raise ValueError(f"tile_m must be a multiple of 16 in [16, 128] (it is the K of the "
                             f"dV and dK wgmma), got {m!r}")
        if not self.dq_swap_ab and m % WGMMA_M:
            raise ValueError(f"tile_m={m} is not a multiple of {WGMMA_M}, the M of a wgmma: "
                             f"dQ = dS K needs dq_swap_ab=True (dQ^T = K^T dS^T, M = head_dim)")
        if self.dq_swap_ab and head_dim != WGMMA_M * BWD_MMA_WARPGROUPS:
            raise ValueError(f"dq_swap_ab puts head_dim on the wgmma M of both warpgroups: it "
                             f"needs head_dim = {WGMMA_M * BWD_MMA_WARPGROUPS}, got {head_dim}")
        if self.stages_q < 1:
            raise ValueError(f"stages_q must be >= 1, got {self.stages_q}")
        if self.stages_ds not in (1, self.stages_q):
            raise ValueError(f"stages_ds must be 1 or stages_q ({self.stages_q}): a dS buffer "
                             f"follows its step's Q stage, got {self.stages_ds}")
        need = self.smem_bytes(head_dim)
        if need > SM90_SMEM_BYTES:
            raise ValueError(
                f"config needs {need} B of shared memory ({self.stages_q} stages of Q and dO of "
                f"{m}x{head_dim}, K and V of {self.tile_n}x{head_dim}, {self.stages_ds} dS of "
                f"{m}x{self.tile_n}, a float32 dQ of {m}x{head_dim}), more than the "
                f"{SM90_SMEM_BYTES} B a CTA may use: a smaller tile_m or fewer stages")


def hopper_bwd_default(head_dim: int, causal: bool = False,
                       deterministic: bool = False) -> HopperBwdConfig:
    """The backward's starting configs, FA3's on H100 (FA4 package's _tile_size_bwd_sm90):
    D = 64: 128 x 128; D = 128: 64 x 128 (80 x 128 with dQ swapped when not causal)."""
    if head_dim <= 64:
        return HopperBwdConfig(tile_m=128, deterministic=deterministic)
    if causal:
        return HopperBwdConfig(tile_m=64, deterministic=deterministic)
    return HopperBwdConfig(tile_m=80, dq_swap_ab=True, deterministic=deterministic)
