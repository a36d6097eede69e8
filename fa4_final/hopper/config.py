"""The Hopper kernels' frozen configurations, their checks, and the defaults per (head dim,
causal, varlen).

Each knob is a compile-time constant of the kernel. ``check()`` raises ValueError naming the knob
that cannot work and why. Why each default is what it is: fa4_final.hopper.defaults, a table the
course generates from its measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from fa4_final.common.constants import (
    BWD_EXTRA_HEAD_DIMS,
    BWD_HEAD_DIM_PAIRS,
    FWD_HEAD_DIMS,
    HEAD_DIMS,
    SM90_REGISTERS,
    SM90_SMEM_BYTES,
    THREADS_PER_WARPGROUP,
    WGMMA_M,
)
from fa4_final.common.decode_index import page_box_for
from fa4_final.common.dq_order import DQ_WARPGROUPS
from fa4_final.common.schedule import TILE_SLOTS
from fa4_final.common.softmax import check_softmax_knobs

# setmaxnreg budgets (producer, consumer) per number of consumer warpgroups: the CTA's total,
# 128 * (producer + n * consumer), must stay within the SM's 64 K registers.
SM90_REGISTER_BUDGETS = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
FWD_TILE_N = 128  # keys per K/V tile (one pipeline stage) at D <= 128
DQ_COPIES_MAX = 16  # dQ accumulator copies of the deterministic backward (HopperBwdConfig)

# Which CTA computes which tile (fa4_final.common.schedule):
#   "grid"        one CTA per tile, the hardware hands them out
#   "zigzag"      one CTA per SM, tiles in fixed rounds, every other one reversed (zigzag_tile)
#   "table"       one CTA per SM, tiles from a list schedule the host builds (Note [Tile table])
#   "split_tail"  the table, its last partial round cut along the keys (Note [Split tail])
#   "dynamic"     one CTA per SM, each taking its next tile at run time (Note [Dynamic tiles])
# A table needs the tile costs before the launch: a varlen kernel cannot take one.
SCHEDULES = ("grid", "zigzag", "table", "split_tail", "dynamic")


def _align(n: int, to: int = 1024) -> int:
    return -(-n // to) * to


# Note [Head dims]
# The forward takes D (Q, K) and dv (V, O) from FWD_HEAD_DIMS. What grows with them is shared
# memory and the O accumulator. Shared memory holds Q (tile_m x D), stages_k K tiles (tile_n x
# D), stages_v V tiles (tile_n x dv) and O (tile_m x dv) within 227 KB: at D = 128 that is 32 +
# 3 x 32 + 2 x 32 + 32 KB, but at D = 256 Q and O alone take 128 KB. Two knobs make room:
# tile_n, fewer keys per stage, and separate_o=False, O written over Q's buffer (a warpgroup's
# O rows lie in the bytes of its own Q rows when dv <= D and both tiles share the 128 B swizzle
# atom, D and dv multiples of 64), which costs the next tile's Q load a wait for this tile's O
# store. The O accumulator takes 64 x dv / 128 = dv / 2 float32 registers per consumer thread
# and S tile_n / 2: 128 + 40 at dv = 256 and tile_n = 80, within the 240 of two consumer
# warpgroups; three warpgroups (160 each) serve D = 64 and D = dv = 96 (below). The defaults
# (hopper_fwd_default) are chosen by compiling (no spill, no wgmma serialised, the struct
# within 227 KB): tile_n 128 where two K and two V stages fit, else 64; and, at the two pairs
# a timed run has spoken for, by timing. Converting P as one vector, every tile_n that is no
# multiple of 64 made ptxas inject warpgroup.arrive before the P V wgmma; the kernel converts
# those tiles pair by pair (Note [Pairwise conversion] in fa4_final.common.fragments) and they
# compile clean too. The FA4 package's sm90 tiles at D = dv = 192 and 256 take 112 and 80 keys
# in two K and two V stages; timed on an H200 beside the compile-only choice (64 keys, three K
# stages) at S = 4096 and 16384, causal and not, L2 flushed and back to back, three rounds,
# 112 keys were faster at D = dv = 192 (1.06-1.13x: beyond the spread at two of the four
# shapes flushed and all four back to back) and 80 keys about level at D = dv = 256
# (0.99-1.12x, beyond the spread at one of the eight), so those two pairs default to FA4's
# tiles (MEASURED_TILE_N) in the dense forward; the varlen forward,
# neither timed nor tested on a GPU with them, keeps the compile-only choice. At D = dv = 96
# the FA4 package runs three consumer warpgroups (192-row tiles); with 96 keys in three K and
# two V stages (P converted pair by pair) they compile clean at 160 registers, and timed on an
# H100 beside two warpgroups of 128 keys (S = 4096 and 16384, causal and not, L2 flushed and
# back to back, three rounds) they were faster at all eight, 1.02-1.17x, beyond the spread at
# three, so the dense forward at D = dv = 96 takes them (MEASURED_THREE_WG); varlen keeps two.
# The other large pairs are untimed.

FWD_TILE_NS = (48, 64, 80, 96, 112, 128)  # a multiple of 16 (the K of P V); at most 128
# (D, dv) -> tile_n chosen by timing, two K and two V stages (Note [Head dims])
MEASURED_TILE_N = {(192, 192): 112, (256, 256): 80}
# (D, dv) -> (tile_n, stages_k, stages_v) of three consumer warpgroups chosen by timing
MEASURED_THREE_WG = {(96, 96): (96, 3, 2)}


@dataclass(frozen=True)
class HopperFwdConfig:
    """Knobs of fa4_final.hopper.fwd.HopperForward. tile_m is derived: 64 rows per consumer
    warpgroup."""

    num_consumer_wgs: int = 2  # MMA + softmax warpgroups, each owning 64 query rows
    stages_k: int = 2  # depth of the K ring
    stages_v: int = 2  # depth of the V ring
    intra_wg_overlap: bool = True  # softmax(S_j) while wgmma S_{j+1} and P_j V_j run
    pingpong: bool = True  # consumer warpgroups take turns issuing wgmma (Note [Turns])
    schedule: str = "zigzag"  # one of SCHEDULES: which CTA computes which tile
    l2_sections: bool = False  # causal order in sections of heads that fit L2 (Note [Causal order])
    timeline: bool = False  # debug build: record phase timestamps (Note [Timeline])
    exp2_emulation_fraction: float = 0.0  # share of exponentials on the FMA units
    rescale_threshold: float = 0.0  # tau, log2 units; 0 = always rescale (Note [Warp vote])
    rescale_skip_unchanged: bool = False  # rows keep/move maxima alone; the vote gates O only
    pin_lane: bool = False  # the EMPTY arrives' lane read once (Note [Signalling lane])
    tile_n: int = FWD_TILE_N  # keys per K/V stage (Note [Head dims])
    separate_o: bool = True  # False: O written over Q's buffer (Note [Head dims])

    @property
    def tile_m(self) -> int:
        return WGMMA_M * self.num_consumer_wgs

    @property
    def registers(self) -> tuple[int, int]:
        return SM90_REGISTER_BUDGETS[self.num_consumer_wgs]

    @property
    def persistent(self) -> bool:
        """One CTA per SM walks many tiles (every schedule but "grid")."""
        return self.schedule != "grid"

    @property
    def uses_table(self) -> bool:
        """Tiles handed out by the host's table (Note [Tile table])."""
        return self.schedule in ("table", "split_tail")

    @property
    def splits_tail(self) -> bool:
        return self.schedule == "split_tail"

    @property
    def schedules_dynamically(self) -> bool:
        """CTAs take their tiles at run time (Note [Dynamic tiles])."""
        return self.schedule == "dynamic"

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2, head_dim_v: int | None = None
                   ) -> int:
        """Bytes of the kernel's SharedStorage: mbarriers (8 B each, full + empty per stage of
        Q, K and V) and the split tail's count, Q, the K and V rings, and O's own buffer (none
        with separate_o=False); each tile 1 KB aligned for the swizzle. ``head_dim_v``: dv of
        V and O, head_dim if None. The kernel asserts its struct has exactly this size."""
        dv = head_dim if head_dim_v is None else head_dim_v
        barriers = 8 * 2 * (1 + self.stages_k + self.stages_v) + 8  # + the split-tail count
        barriers += (8 * 2 + 4) * TILE_SLOTS  # Note [Dynamic tiles]: FULL, EMPTY, the tile
        q = self.tile_m * head_dim * elem_bytes
        o = self.tile_m * dv * elem_bytes if self.separate_o else 0
        k = self.tile_n * head_dim * elem_bytes
        v = self.tile_n * dv * elem_bytes
        return (_align(barriers) + _align(q) + _align(self.stages_k * k)
                + _align(self.stages_v * v) + _align(o))

    def check(self, head_dim: int, head_dim_v: int | None = None) -> None:
        dv = head_dim if head_dim_v is None else head_dim_v
        for name, value in (("head_dim", head_dim), ("head_dim_v", dv)):
            if isinstance(value, bool) or value not in FWD_HEAD_DIMS:
                raise ValueError(f"{name} must be one of {FWD_HEAD_DIMS}, got {value!r}")
        n = self.tile_n
        if isinstance(n, bool) or n not in FWD_TILE_NS:
            raise ValueError(f"tile_n must be one of {FWD_TILE_NS} (keys per K/V stage: the N "
                             f"of S = Q K^T and a multiple of 16, the K of P V), got {n!r}")
        if not self.separate_o and (dv > head_dim or head_dim % 64 or dv % 64):
            raise ValueError(
                f"separate_o=False writes O over Q's buffer: it needs dv <= D and both "
                f"multiples of 64 (one swizzle atom, so a warpgroup's O rows lie in its own Q "
                f"rows), got D = {head_dim}, dv = {dv}: keep separate_o=True")
        if self.num_consumer_wgs not in SM90_REGISTER_BUDGETS:
            raise ValueError(f"num_consumer_wgs must be one of {sorted(SM90_REGISTER_BUDGETS)}, "
                             f"got {self.num_consumer_wgs}")
        producer, consumer = self.registers
        assert THREADS_PER_WARPGROUP * (producer + self.num_consumer_wgs * consumer) \
            <= SM90_REGISTERS
        for name in ("stages_k", "stages_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        need = self.smem_bytes(head_dim, head_dim_v=dv)
        if need > SM90_SMEM_BYTES:
            o = f"O {self.tile_m}x{dv}" if self.separate_o else "O over Q"
            raise ValueError(
                f"config needs {need} B of shared memory (Q {self.tile_m}x{head_dim}, {o}, "
                f"{self.stages_k} K stages of {self.tile_n}x{head_dim} and {self.stages_v} V "
                f"stages of {self.tile_n}x{dv}; 16-bit), more than the {SM90_SMEM_BYTES} B a "
                f"CTA may use: fewer stages_k or stages_v, a smaller tile_n, or "
                f"separate_o=False")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.pingpong and self.num_consumer_wgs < 2:
            raise ValueError("pingpong needs at least 2 consumer warpgroups to take turns")
        check_softmax_knobs(self.exp2_emulation_fraction, self.rescale_threshold)


def hopper_fwd_default(head_dim: int, causal: bool = False, varlen: bool = False,
                       head_dim_v: int | None = None) -> HopperFwdConfig:
    """The forward config for sm_90 (fa4_final.hopper.defaults says why, from measurements).
    D = 64: 192 x 128 with three consumer warpgroups (160 registers each; spill-free only
    because every step takes a fresh S accumulator), O multiplied only in steps where some row
    of the warp moved its max, two K and two V stages when causal (dense), the signalling lane
    read once when causal (dense); D = 128: 128 x 128 with two. Causal or varlen: tiles longest
    first in L2 sections, taken at run time; dense and not causal: the host's table, its last
    round cut along the keys. Other head dims and dv != D (Note [Head dims]): at D = dv = 96
    when dense, 192 x 96 with three (MEASURED_THREE_WG); 128-row tiles of
    the timed tile_n at D = dv = 192 and 256 when dense (MEASURED_TILE_N), else 128 keys where
    two K and two V stages fit (O over Q where O's own buffer does not), else 64 keys in three
    K stages; those compiled, not timed."""
    dv = head_dim if head_dim_v is None else head_dim_v
    schedule = dict(schedule="dynamic", l2_sections=True)
    if not causal and not varlen:
        schedule = dict(schedule="split_tail")
    if head_dim <= 64 and dv <= 64:
        stages = 2 if causal and not varlen else 3
        return HopperFwdConfig(num_consumer_wgs=3, stages_k=stages, stages_v=stages,
                               rescale_skip_unchanged=not varlen,
                               pin_lane=causal and not varlen, **schedule)
    base = HopperFwdConfig(num_consumer_wgs=2, stages_k=3, stages_v=2, **schedule)
    three = None if varlen else MEASURED_THREE_WG.get((head_dim, dv))  # timed dense only
    if three is not None:
        tile_n, stages_k, stages_v = three
        return _fit(head_dim, dv, replace(base, num_consumer_wgs=3, tile_n=tile_n,
                                          stages_k=stages_k, stages_v=stages_v), base)
    if head_dim <= 128 and dv <= 128:
        return _fit(head_dim, dv, base)
    # the timed tile where there is one; else 128 keys a stage, two of K and two of V (the FA4
    # package's tile at D = 192, dv = 128); else 64 keys, three K stages
    timed = None if varlen else MEASURED_TILE_N.get((head_dim, dv))  # timed dense only
    first = () if timed is None else (replace(base, tile_n=timed, stages_k=2),)
    return _fit(head_dim, dv, *first, replace(base, stages_k=2), replace(base, tile_n=64),
                replace(base, tile_n=64, stages_k=2))


def _fit(head_dim: int, dv: int, *candidates: HopperFwdConfig) -> HopperFwdConfig:
    """The first candidate whose buffers fit 227 KB, each tried with O's own buffer and then
    with O over Q (where Note [Head dims] allows it)."""
    over_q_allowed = dv <= head_dim and head_dim % 64 == 0 and dv % 64 == 0
    for cfg in candidates:
        for c in (cfg, replace(cfg, separate_o=False)) if over_q_allowed else (cfg,):
            if c.smem_bytes(head_dim, head_dim_v=dv) <= SM90_SMEM_BYTES:
                return c
    raise AssertionError(f"no forward config fits D = {head_dim}, dv = {dv}")


# ----------------------------------------------------------------------------------------------
# The Hopper backward (fa4_final.hopper.bwd)

# head dims (dv == D) of the backward with dK, dV swapped (HopperBwdConfig.dkv_swap_ab)
SWAPPED_HEAD_DIMS = (192, 256)
BWD_MMA_WARPGROUPS = DQ_WARPGROUPS  # each owns 64 keys of the CTA's KV tile: tile_n = 128
SM90_BWD_REGISTERS = (24, 240)  # setmaxnreg (producer, each MMA warpgroup): 128*(24+2*240) <= 64K
# dq_rotated (Note [A rotated walk]): 16 more a producer thread, 16 fewer an MMA thread
SM90_BWD_REGISTERS_ROTATED = (40, 224)


@dataclass(frozen=True)
class HopperBwdConfig:
    """Knobs of fa4_final.hopper.bwd.HopperBackward. One CTA per (KV tile, kv head, batch); two
    MMA warpgroups own 64 keys each, so tile_n = 128 is derived; the inner loop walks the query
    tiles of every query head of the group."""

    tile_m: int = 64  # query rows per step of the inner loop
    stages_q: int = 2  # depth of the Q (+ lse) and dO (+ delta) rings
    stages_ds: int = 2  # dS buffers (1 or stages_q; 1: the warpgroups sync once more a step)
    dq_swap_ab: bool = False  # dQ^T = K^T dS^T: wgmma M = D, so tile_m need not be 64k
    deterministic: bool = False  # dQ accumulated in a fixed order of KV tiles (Note [dQ turns])
    # deterministic only (Note [dQ copies] in fa4_final.common.bwd_tiles): key tile n adds
    # into dQ accumulator copy n % dq_copies, turns only among the key tiles of one copy,
    # bwd_post sums the copies in a fixed order; 1 = one accumulator, the default. Checked
    # on an H100 (float64, bitwise over runs) and timed there: at D = 128 no faster than one
    # accumulator (Note [dQ copies]); with dq_buffers = 2 and dq_adds_overlap (checked and
    # timed on an H100) the deterministic price falls below a tenth where one accumulator's
    # does not: hopper_bwd_det_copies, behind the gate det_copies (Note [Pending features])
    dq_copies: int = 1
    # deterministic only: the dQ warp hands its staging buffer back once the bulk add has read
    # it, and passes the turn when the add has completed (Note [dQ copies])
    dq_early_release: bool = False
    # deterministic only: the visitor whose turn is 0 at (query tile, copy) writes its dQ part
    # with a plain bulk copy instead of adding, so bwd_pre zeroes no accumulator and bwd_post
    # reads only the copies that had a visitor (Note [dQ copies]). Checked and timed on an
    # H100 with the copies; reachable through config= only
    dq_first_store: bool = False
    # deterministic only: two dQ staging buffers, step s's dQ in buffer s % 2, so the MMA
    # warpgroups write a step's dQ while the dQ warp still waits for the previous step's turn
    # (Note [Two dQ buffers] in fa4_final.hopper.bwd). Checked on an H100 (float64, bitwise the
    # one-buffer kernel's); no faster with one dQ warp, so the deterministic default at D = 64
    # and 128 pairs it with dq_adds_overlap
    dq_buffers: int = 1
    # dq_buffers = 2 only: two dQ warps take alternate steps (and buffers), so one step's bulk
    # add can be in flight while the previous step's completes and its turn passes
    # (Note [Adds in flight across turns] in fa4_final.hopper.bwd). The deterministic default
    # at D = 64 and 128: faster than one buffer at every shape timed on an H100
    dq_adds_overlap: bool = False
    # deterministic only, walks without a mask window: key tile n starts its walk at query tile
    # n x M / N and wraps around, and the turns at each query tile follow the order the key
    # tiles arrive in (Note [A rotated walk] in fa4_final.common.bwd_tiles), up to
    # ROTATED_MAX_KEY_TILES key tiles a head (the plain order above). Compiled and checked on
    # the CPU; not yet run on a GPU, so reachable through config= only
    dq_rotated: bool = False
    # the EMPTY arrives' lane read once (Note [Signalling lane]); without it the KV-tile loop
    # reads the thread index every step. Not timed, so off
    pin_lane: bool = False
    # every MMA thread arrives on a Q or dO stage's EMPTY barrier after its own reads of the
    # stage's lse or delta, as the builds of two loops always do
    # (Note [Release after the warp's reads] in fa4_final.hopper.bwd), instead of one lane a
    # warp (False): racecheck clean where one lane a warp was not, no slower on an H100 in the
    # default mode
    release_every_thread: bool = True
    # dQ = dS K by MMA warpgroup 0 alone, the whole tile_m x D (Note [dQ by one warpgroup] in
    # fa4_final.hopper.bwd): what D = 96 needs
    dq_single_wg: bool = False
    # dQ^T = K^T dS^T (dq_swap_ab) split by rows of D into 64-row blocks, warpgroup 0 taking
    # the larger half (128 + 64 at D = 192; Note [dQ split unevenly] in fa4_final.hopper.bwd):
    # what D = 192 with dv = 128 needs at tile_m = 32
    dq_uneven: bool = False
    # dK^T += Q^T dS and dV^T += dO^T P with the head dim on the wgmma M
    # (Note [dK and dV swapped] in fa4_final.hopper.bwd): S = Q K^T with the queries on M, P
    # and dS through shared memory, and swap_tile_n keys a CTA (explicit on this path only, 0
    # elsewhere): what D = dv = 192 (96 keys) and D = 256 (48 keys) need
    dkv_swap_ab: bool = False
    swap_tile_n: int = 0
    # dkv_swap_ab only: the dO (+ delta) ring's depth when it differs from stages_q (0: the
    # same), so that Q keeps two stages where two of dO do not fit (Note [dK and dV swapped])
    stages_do: int = 0
    # lse read from shared memory into registers before the wait for S, delta before the wait
    # for dP (Note [Per-query values before the wait] in fa4_final.hopper.bwd), instead of
    # where P and dS use them; every build, a softcap build excepted. The swapped builds'
    # default (D = 192, 256); slower at D = 64, no faster at 128, so off there
    rows_early: bool = False
    # lse and delta loaded an eighth per lane group and passed on by shuffles
    # (Note [Per-query values by shuffle] in fa4_final.hopper.bwd): the step of tile_m a
    # multiple of 64 without dkv_swap_ab. The D = 64 default (faster than the lazy read on an
    # H100); at D = 128, causal, within the rounds' spread of it there, so off
    rows_shuffled: bool = False

    @property
    def do_stages(self) -> int:
        """Depth of the dO (+ delta) ring: stages_do, or stages_q when it is 0."""
        return self.stages_do or self.stages_q

    @property
    def dq_warpgroups(self) -> int:
        """MMA warpgroups that issue the dQ GEMM, each writing one chunk of a step's dQ."""
        return 1 if self.dq_single_wg else BWD_MMA_WARPGROUPS

    @property
    def tile_n(self) -> int:
        if self.dkv_swap_ab:
            return self.swap_tile_n
        return WGMMA_M * BWD_MMA_WARPGROUPS

    @property
    def registers(self) -> tuple[int, int]:
        if self.dq_rotated:  # the walk's start and length live in the dQ warps too
            return SM90_BWD_REGISTERS_ROTATED
        return SM90_BWD_REGISTERS

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2, head_dim_v: int | None = None
                   ) -> int:
        """Bytes of the kernel's SharedStorage, field by field in its order (the kernel asserts
        its struct has this size): the mbarriers (full + empty per stage of Q and dO, and K/V's
        one), lse and delta per stage (float32), the Q and dO rings, K, V, the dS buffers and
        the float32 dQ staging tile; tiles 1 KB aligned for the 128 B swizzle. ``head_dim_v``:
        dv of dO and V, head_dim if None."""
        dv = head_dim if head_dim_v is None else head_dim_v
        fields = [  # (bytes, alignment)
            (8 * 2 * (self.stages_q + self.do_stages + 1), 8),
            (4 * self.tile_m * self.stages_q, 128),  # lse (log2 units)
            (4 * self.tile_m * self.do_stages, 128),  # delta
            (self.tile_m * head_dim * elem_bytes * self.stages_q, 1024),  # Q
            (self.tile_m * dv * elem_bytes * self.do_stages, 1024),  # dO
            (self.tile_n * head_dim * elem_bytes, 1024),  # K
            (self.tile_n * dv * elem_bytes, 1024),  # V
            (self.tile_m * self.tile_n * elem_bytes * self.stages_ds, 1024),  # dS
        ]
        if self.dkv_swap_ab:  # P beside dS (Note [dK and dV swapped])
            fields.append((self.tile_m * self.tile_n * elem_bytes * self.stages_ds, 1024))
        fields.append((self.tile_m * head_dim * 4 * self.dq_buffers, 1024))  # dQ (float32)
        offset = 0
        for size, align in fields:
            offset = _align(offset, align) + size
        return _align(offset, 1024)

    def check_swapped(self, head_dim: int, dv: int) -> None:
        """What dkv_swap_ab needs (Note [dK and dV swapped] in fa4_final.hopper.bwd)."""
        if (head_dim, dv) not in ((d, d) for d in SWAPPED_HEAD_DIMS):
            raise ValueError(f"dkv_swap_ab=True is built for (head_dim, head_dim_v) in "
                             f"{tuple((d, d) for d in SWAPPED_HEAD_DIMS)}, got ({head_dim}, {dv})")
        n = self.swap_tile_n
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % 16:
            raise ValueError(f"swap_tile_n must be a positive multiple of 16 (the K of the dQ "
                             f"wgmma, split between the warpgroups), got {n!r}")
        if self.tile_m != WGMMA_M or not (self.dq_swap_ab and self.dq_uneven):
            raise ValueError(f"dkv_swap_ab=True runs S = Q K^T with tile_m = {WGMMA_M} query "
                             f"rows on the wgmma M and dQ^T split by rows of head_dim "
                             f"(dq_swap_ab=True, dq_uneven=True), got tile_m={self.tile_m}, "
                             f"dq_swap_ab={self.dq_swap_ab}, dq_uneven={self.dq_uneven}")
        s = self.stages_do
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"stages_do must be an int >= 0 (0: stages_q), got {s!r}")
        if self.stages_ds != 1 or self.dq_single_wg:
            raise ValueError(f"dkv_swap_ab=True keeps one P and one dS buffer and dQ in two "
                             f"parts: it needs stages_ds=1, dq_single_wg=False, got "
                             f"stages_ds={self.stages_ds}, dq_single_wg={self.dq_single_wg}")

    def check(self, head_dim: int, head_dim_v: int | None = None) -> None:
        dv = head_dim if head_dim_v is None else head_dim_v
        dims = HEAD_DIMS + BWD_EXTRA_HEAD_DIMS
        if self.dkv_swap_ab:
            self.check_swapped(head_dim, dv)
            dims = dims + SWAPPED_HEAD_DIMS
        elif self.swap_tile_n or self.stages_do:
            raise ValueError(f"swap_tile_n and stages_do are knobs of dkv_swap_ab=True only "
                             f"(tile_n is {self.tile_n} otherwise, dO as deep as Q), got "
                             f"swap_tile_n={self.swap_tile_n}, stages_do={self.stages_do}")
        if dv != head_dim and (head_dim, dv) not in BWD_HEAD_DIM_PAIRS:
            raise ValueError(f"(head_dim, head_dim_v) must be one of {BWD_HEAD_DIM_PAIRS} "
                             f"when they differ, got ({head_dim}, {dv}); with dv == head_dim "
                             f"the backward takes head dims {dims}")
        if dv == head_dim and head_dim not in dims:
            raise ValueError(f"head_dim must be one of {dims}, got {head_dim}")
        m = self.tile_m
        if isinstance(m, bool) or not isinstance(m, int) or m % 16 or not 16 <= m <= 128:
            raise ValueError(f"tile_m must be a multiple of 16 in [16, 128] (it is the K of the "
                             f"dV and dK wgmma), got {m!r}")
        if not self.dq_swap_ab and m % WGMMA_M:
            raise ValueError(f"tile_m={m} is not a multiple of {WGMMA_M}, the M of a wgmma: "
                             f"dQ = dS K needs dq_swap_ab=True (dQ^T = K^T dS^T, M = head_dim)")
        if self.dq_uneven and (not self.dq_swap_ab or head_dim % WGMMA_M
                               or (head_dim // WGMMA_M % 2 == 0 and not self.dkv_swap_ab)):
            raise ValueError(f"dq_uneven splits dQ^T = K^T dS^T (dq_swap_ab=True) into an odd "
                             f"number of {WGMMA_M}-row blocks of head_dim, got "
                             f"dq_swap_ab={self.dq_swap_ab}, head_dim={head_dim}")
        if self.dq_swap_ab and not self.dq_uneven and head_dim != WGMMA_M * BWD_MMA_WARPGROUPS:
            raise ValueError(f"dq_swap_ab puts head_dim on the wgmma M of both warpgroups: it "
                             f"needs head_dim = {WGMMA_M * BWD_MMA_WARPGROUPS}, got {head_dim}")
        if self.dq_single_wg and (self.dq_swap_ab or m != WGMMA_M):
            raise ValueError(f"dq_single_wg runs dQ = dS K as one {WGMMA_M} x head_dim wgmma "
                             f"tile of warpgroup 0: it needs tile_m = {WGMMA_M} and "
                             f"dq_swap_ab=False, got tile_m={m}, dq_swap_ab={self.dq_swap_ab}")
        if head_dim % 64 and m == WGMMA_M and not (self.dq_single_wg or self.dq_swap_ab):
            raise ValueError(f"at tile_m={m} the two MMA warpgroups split dQ's head_dim "
                             f"columns, and {head_dim // 2} columns each cut K's shared-memory "
                             f"swizzle atom at head_dim={head_dim}: it needs dq_single_wg=True")
        if self.stages_q < 1:
            raise ValueError(f"stages_q must be >= 1, got {self.stages_q}")
        if self.stages_ds not in (1, self.stages_q):
            raise ValueError(f"stages_ds must be 1 or stages_q ({self.stages_q}): a dS buffer "
                             f"follows its step's Q stage, got {self.stages_ds}")
        c = self.dq_copies
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= DQ_COPIES_MAX:
            raise ValueError(f"dq_copies must be an int in [1, {DQ_COPIES_MAX}] (dQ "
                             f"accumulators of the deterministic mode), got {c!r}")
        if (c > 1 or self.dq_early_release) and not self.deterministic:
            raise ValueError(f"dq_copies={c} and dq_early_release={self.dq_early_release} "
                             f"change the deterministic mode's dQ turns only: they need "
                             f"deterministic=True (or dq_copies=1, dq_early_release=False)")
        if self.dq_first_store and not self.deterministic:
            raise ValueError("dq_first_store=True changes the deterministic mode's first dQ add "
                             "into a store (the turn order says which is first): it needs "
                             "deterministic=True (or dq_first_store=False)")
        if self.rows_shuffled and (self.dkv_swap_ab or self.tile_m % 64):
            raise ValueError(f"rows_shuffled=True loads lse and delta for tile_m a multiple of 64 "
                             f"in the step without dkv_swap_ab; got tile_m={self.tile_m}, "
                             f"dkv_swap_ab={self.dkv_swap_ab}: it needs rows_shuffled=False")
        nb = self.dq_buffers
        if isinstance(nb, bool) or nb not in (1, 2):
            raise ValueError(f"dq_buffers must be 1 or 2 (dQ staging buffers), got {nb!r}")
        if nb == 2 and not (self.deterministic and self.stages_q % 2 == 0
                            and not self.dq_early_release
                            and not self.dq_uneven and not self.dkv_swap_ab
                            and not self.dq_single_wg):
            raise ValueError(
                f"dq_buffers=2 is built for the deterministic mode's dQ turns, a step's buffer "
                f"being its Q stage's parity: it needs deterministic=True, an even stages_q, "
                f"dq_early_release=False and dq_uneven, dkv_swap_ab, dq_single_wg False, got "
                f"deterministic={self.deterministic}, stages_q={self.stages_q}, "
                f"dq_early_release={self.dq_early_release}, dq_uneven={self.dq_uneven}, "
                f"dkv_swap_ab={self.dkv_swap_ab}, dq_single_wg={self.dq_single_wg}")
        if self.dq_adds_overlap is not False and (self.dq_adds_overlap is not True or nb != 2):
            raise ValueError(f"dq_adds_overlap=True gives each of the two dQ staging buffers "
                             f"its own dQ warp: it needs "
                             f"dq_buffers=2 (and a bool), got dq_adds_overlap="
                             f"{self.dq_adds_overlap!r}, dq_buffers={nb}")
        if self.dq_rotated is not False and (
                self.dq_rotated is not True or not self.deterministic or self.dq_copies != 1
                or self.dq_first_store or self.dq_early_release or self.dkv_swap_ab):
            raise ValueError(f"dq_rotated=True rotates the deterministic mode's walk over query "
                             f"tiles with one dQ accumulator (Note [A rotated walk]): it needs "
                             f"deterministic=True, dq_copies=1, dq_first_store, "
                             f"dq_early_release and dkv_swap_ab False (and a bool), got "
                             f"dq_rotated={self.dq_rotated!r}, "
                             f"deterministic={self.deterministic}, dq_copies={self.dq_copies}, "
                             f"dq_first_store={self.dq_first_store}, "
                             f"dq_early_release={self.dq_early_release}, "
                             f"dkv_swap_ab={self.dkv_swap_ab}")
        need = self.smem_bytes(head_dim, head_dim_v=dv)
        if need > SM90_SMEM_BYTES:
            raise ValueError(
                f"config needs {need} B of shared memory ({self.stages_q} stages of Q of "
                f"{m}x{head_dim} and {self.do_stages} of dO of {m}x{dv}, K of "
                f"{self.tile_n}x{head_dim} and V of "
                f"{self.tile_n}x{dv}, {self.stages_ds} dS of "
                f"{m}x{self.tile_n}, {self.dq_buffers} float32 dQ of {m}x{head_dim}), more "
                f"than the "
                f"{SM90_SMEM_BYTES} B a CTA may use: a smaller tile_m or fewer stages")


def hopper_bwd_default(head_dim: int, causal: bool = False,
                       deterministic: bool = False,
                       head_dim_v: int | None = None) -> HopperBwdConfig:
    """The backward's starting configs, FA3's on H100 (FA4 package's _tile_size_bwd_sm90):
    D = 64: 128 x 128 with lse and delta by shuffles
    (rows_shuffled: Note [Per-query values by shuffle]); D = 96: 64 x 128 with dQ by one
    warpgroup; D = 128: 64 x 128 (80 x 128 with dQ swapped when not causal and not
    deterministic). Deterministic at D = 64 and 128: two dQ staging buffers with a dQ warp
    each (Note [Adds in flight across turns] in fa4_final.hopper.bwd). D = 192 with dv = 128:
    32 x 128 with dQ^T split 128 + 64 rows of D (Note [dQ split unevenly]). D = dv = 192:
    64 x 96 and D = 256: 64 x 48, dK and dV swapped, two Q stages and one dO stage, as the
    FA4 package (Note [dK and dV swapped]), lse and delta read before the GEMM waits
    (rows_early: Note [Per-query values before the wait])."""
    if head_dim in SWAPPED_HEAD_DIMS and head_dim_v in (None, head_dim):
        return HopperBwdConfig(tile_m=64, stages_q=2, stages_do=1, stages_ds=1,
                               dq_swap_ab=True, dq_uneven=True, dkv_swap_ab=True,
                               swap_tile_n=96 if head_dim == 192 else 48, rows_early=True,
                               deterministic=deterministic)
    if head_dim_v is not None and head_dim_v != head_dim:
        return HopperBwdConfig(tile_m=32, dq_swap_ab=True, dq_uneven=True,
                               deterministic=deterministic)
    # the deterministic mode: two dQ staging buffers, each with its own dQ warp
    # (Note [Adds in flight across turns] in fa4_final.hopper.bwd), at 64 query rows at
    # D = 128 (80 leave no room for the second buffer)
    turns = dict(deterministic=True, dq_buffers=2, dq_adds_overlap=True) if deterministic else {}
    if head_dim <= 64:  # lse and delta by shuffles (Note [Per-query values by shuffle])
        return HopperBwdConfig(tile_m=128, rows_shuffled=True, **turns)
    if head_dim == 96:
        return HopperBwdConfig(tile_m=64, dq_single_wg=True, deterministic=deterministic)
    if causal or deterministic:
        return HopperBwdConfig(tile_m=64, **turns)
    return HopperBwdConfig(tile_m=80, dq_swap_ab=True)


def hopper_bwd_det_copies(head_dim: int, masked: bool,
                          head_dim_v: int | None = None) -> HopperBwdConfig | None:
    """The deterministic backward with accumulator copies on the overlapped two-buffer kernel
    (Note [dQ copies] in fa4_final.common.bwd_tiles), first stores: D = 64 four copies on a
    walk without a mask window, two with one; D = 128 two without a mask window. None where
    the deterministic default stays (D = 128 with a mask window, other head dims, dv != D).
    Chosen by one H100 run of the candidates (calls back to back and after an L2 flush); a
    call reaches it only past the gate (det_copies, Note [Pending features])."""
    if head_dim not in (64, 128) or head_dim_v not in (None, head_dim):
        return None
    if head_dim == 128 and masked:
        return None
    copies = 4 if head_dim == 64 and not masked else 2
    return replace(hopper_bwd_default(head_dim, masked, True), dq_copies=copies,
                   dq_first_store=True)


# ----------------------------------------------------------------------------------------------
# The Hopper decode forward (fa4_final.hopper.decode)

# keys per K/V tile: wgmma N of S = Q K^T, K of O += P V; a page must hold whole tiles, so the
# smaller ones serve smaller pages (hopper_decode_for_page)
DECODE_TILE_NS = (16, 32, 64, 128)
# keys per TMA box of a key tile gathered from pages smaller than it (Note [Gathered key tiles])
DECODE_PAGE_BOXES = (16, 32, 64)
# swap_ab (Note [Keys on M] in fa4_final.hopper.decode): packed query rows a CTA, the wgmma N of
# S^T = K Q^T and of O^T = V^T P^T; key tiles of whole 64-key M blocks
DECODE_ROWS_NS = (8, 16, 32)
DECODE_SWAP_TILE_NS = (64, 128)
# the consumer warpgroup's warps, each writing its column maxima (and at the end its column
# sums) into shared memory for the other three (Note [Keys on M])
DECODE_EXCHANGE_WARPS = 4
# The register plan of each number of consumer warpgroups (Note [Two consumer warpgroups] in
# fa4_final.hopper.decode): the launch bound in CTAs an SM, the registers a thread starts with at
# that bound (64 K registers / CTAs / threads), and setmaxnreg (producer warpgroup, each consumer
# warpgroup); the producer gives all but 24 of its registers to the consumers.
#  1 consumer:  256 threads, two CTAs an SM: 65536 / 2 / 256 = 128; 24 + 232 = 2 x 128
#  2 consumers: 384 threads, one CTA an SM (two would leave 85 registers a thread):
#               65536 / 384 = 168; 24 + 240 + 240 = 3 x 168 per thread slot of a sub-partition
class DecodeRegisterPlan(NamedTuple):
    ctas_per_sm: int
    launch_registers: int
    setmaxnreg: tuple[int, int]


DECODE_REGISTER_PLANS = {
    1: DecodeRegisterPlan(ctas_per_sm=2, launch_registers=128, setmaxnreg=(24, 232)),
    2: DecodeRegisterPlan(ctas_per_sm=1, launch_registers=168, setmaxnreg=(24, 240)),
}
DECODE_CONSUMERS = tuple(DECODE_REGISTER_PLANS)
DECODE_CLUSTERS = (1, 2)  # CTAs a cluster of the decode kernel (HopperDecodeConfig.cluster)
SM90_DECODE_REGISTERS = DECODE_REGISTER_PLANS[1].setmaxnreg
DECODE_LAUNCH_REGISTERS = DECODE_REGISTER_PLANS[1].launch_registers
DECODE_CTAS_PER_SM_BOUND = DECODE_REGISTER_PLANS[1].ctas_per_sm
SM90_DECODE_WG2_REGISTERS = DECODE_REGISTER_PLANS[2].setmaxnreg
DECODE_WG2_LAUNCH_REGISTERS = DECODE_REGISTER_PLANS[2].launch_registers
DECODE_WG2_CTAS_PER_SM_BOUND = DECODE_REGISTER_PLANS[2].ctas_per_sm


@dataclass(frozen=True)
class HopperDecodeConfig:
    """Knobs of fa4_final.hopper.decode.HopperDecode: one consumer warpgroup of tile_m = 64
    packed query rows (wgmma's smallest M; with ``swap_ab`` rows_n of them on the wgmma N
    instead, Note [Keys on M]; with ``consumers`` = 2 two warpgroups of 64, tile_m = 128,
    Note [Two consumer warpgroups]), a producer warp issuing TMA, ``stages`` K tiles and as
    many V tiles in flight (Note [Decode bytes in flight])."""

    tile_n: int = 128  # keys per K/V tile; a page must hold whole tiles (Note [Key tile pages])
    stages: int = 3  # depth of the K ring and of the V ring
    # keys per TMA box when a page is smaller than the tile: the tile is gathered from
    # tile_n / page_box boxes (Note [Gathered key tiles]); None: one box a tile
    page_box: int | None = None
    # keys on the wgmma M, packed query rows on N (Note [Keys on M] in fa4_final.hopper.decode):
    # S^T = K Q^T and O^T = V^T P^T with rows_n packed rows a CTA (one of DECODE_ROWS_NS);
    # False: the 64-row tile (rows_n must then stay None)
    swap_ab: bool = False
    rows_n: int | None = None
    # consumer warpgroups, each owning 64 packed rows of the CTA and reading the same K and V
    # stages (Note [Two consumer warpgroups] in fa4_final.hopper.decode); 2 only without swap_ab
    consumers: int = 1
    # CTAs of a cluster along the m-blocks (Note [A pair of CTAs shares the cache] in
    # fa4_final.hopper.decode): 2 walks the key tiles of both CTAs' rows and multicasts each
    # K/V tile into both, half a tile loaded by each; one box a tile only (page_box None)
    cluster: int = 1

    @property
    def tile_m(self) -> int:
        """Packed query rows a CTA (an m-block): 64 a consumer warpgroup, or rows_n with
        swap_ab."""
        return self.rows_n if self.swap_ab else WGMMA_M * self.consumers

    @property
    def block_m(self) -> int:
        """Packed query rows whose key tiles a CTA walks: its own tile_m, or with a cluster the
        rows of all its CTAs (they read the same tiles, Note [A pair of CTAs shares the cache])."""
        return self.tile_m * self.cluster

    @property
    def register_plan(self) -> DecodeRegisterPlan:
        """The launch bound, launch registers and setmaxnreg of ``consumers`` warpgroups."""
        self._check_consumers()
        return DECODE_REGISTER_PLANS[self.consumers]

    @property
    def registers(self) -> tuple[int, int]:
        """setmaxnreg (producer warpgroup, each consumer warpgroup)."""
        return self.register_plan.setmaxnreg

    @property
    def ctas_per_sm_bound(self) -> int:
        """The launch bound (min_blocks_per_mp): two CTAs an SM, one with two consumers."""
        return self.register_plan.ctas_per_sm

    @property
    def launch_registers(self) -> int:
        """Registers a thread is launched with at ``ctas_per_sm_bound``."""
        return self.register_plan.launch_registers

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Bytes of the kernel's SharedStorage: the mbarriers (full + empty per stage of K and
        of V), Q (tile_m rows: 64 a consumer warpgroup), the K ring and the V ring, each tile 1 KB
        aligned for the 128 B swizzle. The kernel asserts its struct has exactly this size."""
        barriers = 8 * 2 * 2 * self.stages
        q = self.tile_m * head_dim * elem_bytes
        kv = self.tile_n * head_dim * elem_bytes * self.stages
        if self.swap_ab:  # the warps' column exchange beside the barriers, P^T after V
            exchange = 4 * DECODE_EXCHANGE_WARPS * self.rows_n
            p = self.rows_n * self.tile_n * elem_bytes
            return _align(barriers + exchange) + _align(q) + 2 * _align(kv) + _align(p)
        return _align(barriers) + _align(q) + 2 * _align(kv)

    def kv_bytes_in_flight(self, head_dim: int, elem_bytes: int = 2) -> int:
        """K and V bytes the producer can have requested ahead of the consumer."""
        return 2 * self.stages * self.tile_n * head_dim * elem_bytes

    def check(self, head_dim: int) -> None:
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
        if isinstance(self.tile_n, bool) or self.tile_n not in DECODE_TILE_NS:
            raise ValueError(f"tile_n must be one of {DECODE_TILE_NS} (keys per K/V tile: the N "
                             f"of S = Q K^T and the K of O += P V), got {self.tile_n!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1 (K and V tiles in flight), got "
                             f"{self.stages!r}")
        box = self.page_box
        if box is not None and (isinstance(box, bool) or box not in DECODE_PAGE_BOXES
                                or box >= self.tile_n or self.tile_n % box):
            raise ValueError(f"page_box must be None or one of {DECODE_PAGE_BOXES} below and "
                             f"dividing tile_n={self.tile_n} (keys per TMA box of a gathered "
                             f"key tile), got {box!r}")
        self._check_swap_ab()
        self._check_consumers()
        self._check_cluster()
        producer, consumer = self.registers
        # per thread slot of a sub-partition: one producer warp and `consumers` consumer warps
        assert producer + self.consumers * consumer <= (1 + self.consumers) * self.launch_registers
        need = self.smem_bytes(head_dim)
        if need > SM90_SMEM_BYTES:
            raise ValueError(
                f"config needs {need} B of shared memory (Q {self.tile_m}x{head_dim}, "
                f"{self.stages} K + {self.stages} V stages of {self.tile_n}x{head_dim}"
                f"{f', P^T {self.tile_n}x{self.rows_n}' if self.swap_ab else ''}; 16-bit), "
                f"more than the {SM90_SMEM_BYTES} B a CTA may use: fewer stages or a smaller "
                f"tile_n")


    def _check_consumers(self) -> None:
        """consumers (Note [Two consumer warpgroups] in fa4_final.hopper.decode)."""
        n = self.consumers
        if isinstance(n, bool) or not isinstance(n, int) or n not in DECODE_CONSUMERS:
            raise ValueError(f"consumers must be one of {DECODE_CONSUMERS} (consumer warpgroups "
                             f"of 64 packed rows each), got {n!r}")
        if n == 2 and self.swap_ab:
            raise ValueError("consumers=2 gives each of two warpgroups 64 packed rows of the "
                             "64-row tile; swap_ab=True (keys on M, rows_n on N) takes "
                             "consumers=1")

    def _check_cluster(self) -> None:
        """cluster (Note [A pair of CTAs shares the cache] in fa4_final.hopper.decode)."""
        n = self.cluster
        if isinstance(n, bool) or not isinstance(n, int) or n not in DECODE_CLUSTERS:
            raise ValueError(f"cluster must be one of {DECODE_CLUSTERS} (CTAs along the m-blocks "
                             f"that share each K/V tile by multicast), got {n!r}")
        if n > 1 and self.swap_ab:
            raise ValueError(f"cluster={n} shares the 64-row tile's K/V stages; swap_ab=True "
                             f"(keys on M) takes cluster=1")
        if n > 1 and self.page_box is not None:
            raise ValueError(f"cluster={n} multicasts one TMA box a tile, half from each CTA; "
                             f"page_box={self.page_box} gathers a tile from several boxes: "
                             f"cluster=1 there")

    def _check_swap_ab(self) -> None:
        """swap_ab and rows_n (Note [Keys on M] in fa4_final.hopper.decode)."""
        if not isinstance(self.swap_ab, bool):
            raise TypeError(f"swap_ab must be a bool (True: keys on the wgmma M, packed rows on "
                            f"N), got {self.swap_ab!r}")
        rows = self.rows_n
        if not self.swap_ab:
            if rows is not None:
                raise ValueError(f"rows_n={rows!r} is the N of the swapped GEMMs: it needs "
                                 f"swap_ab=True (the 64-row tile takes rows_n=None)")
            return
        if isinstance(rows, bool) or rows not in DECODE_ROWS_NS:
            raise ValueError(f"swap_ab=True needs rows_n, the packed query rows a CTA (the wgmma "
                             f"N), one of {DECODE_ROWS_NS}, got {rows!r}")
        if self.tile_n not in DECODE_SWAP_TILE_NS:
            raise ValueError(f"swap_ab=True puts each key tile on the wgmma M in blocks of 64 "
                             f"keys: tile_n must be one of {DECODE_SWAP_TILE_NS}, got "
                             f"{self.tile_n}")


def hopper_decode_keys_on_m(head_dim: int, packed_rows: int,
                            page_size: int | None = None) -> HopperDecodeConfig:
    """The swapped decode config (Note [Keys on M] in fa4_final.hopper.decode) for
    ``packed_rows`` query rows of a KV head (tokens x GQA group): the default's tile, stages and
    page box with rows_n the smallest of DECODE_ROWS_NS that holds them (32 when more, several
    m-blocks then). A candidate for measurement, reached by no call of the package."""
    if isinstance(packed_rows, bool) or not isinstance(packed_rows, int) or packed_rows < 1:
        raise ValueError(f"packed_rows must be an int >= 1 (query tokens x heads per KV head), "
                         f"got {packed_rows!r}")
    base = (hopper_decode_default(head_dim) if page_size is None
            else hopper_decode_for_page(head_dim, page_size))
    rows = next((n for n in DECODE_ROWS_NS if n >= packed_rows), DECODE_ROWS_NS[-1])
    return replace(base, swap_ab=True, rows_n=rows)


def hopper_decode_default(head_dim: int) -> HopperDecodeConfig:
    """The decode config for sm_90 (Note [Decode bytes in flight] in fa4_final.hopper.decode):
    128-key tiles; D = 128: three K and three V stages (192 KB of K/V in flight, one CTA an SM);
    D = 64: three stages (96 KB, 105 KB of shared memory, so two CTAs fit an SM). A paged cache
    of 128-key pages reads it (a contiguous one: hopper_decode_contiguous); timed so on an
    H100 at batch 32, D = 128, with 8k keys or more: 86-100% of the copy rate, 0.85-0.97x the
    fastest peer; other tiles and stages are candidates of the decode benchmark."""
    return HopperDecodeConfig(tile_n=128, stages=3)


def hopper_decode_contiguous(head_dim: int) -> HopperDecodeConfig:
    """The decode config for a contiguous cache: the default, with each key tile filled from
    boxes of 32 keys at D = 128 (Note [Boxes of a contiguous cache] in fa4_final.hopper.decode,
    where its measurement is). At D = 64 one copy holds whole 128-byte key rows already, and
    boxes of 32 were not faster there: one box a tile."""
    default = hopper_decode_default(head_dim)
    return replace(default, page_box=32) if head_dim == 128 else default


def hopper_decode_for_rows(config: HopperDecodeConfig, packed_rows: int) -> HopperDecodeConfig:
    """``config`` with two consumer warpgroups (a 128-row m-block) when a KV head has more than
    64 packed query rows (tokens x heads per KV head), else ``config`` itself: one CTA then reads
    each K/V tile for 128 rows where one consumer takes two m-blocks, each streaming the cache
    (Note [Two consumer warpgroups] in fa4_final.hopper.decode, where its measurement is).
    A swapped config (keys on M) is returned as it is."""
    if packed_rows > WGMMA_M and config.consumers == 1 and not config.swap_ab:
        return replace(config, consumers=2)
    return config


def hopper_decode_for_page(head_dim: int, page_size: int) -> HopperDecodeConfig:
    """The decode config for a paged cache of ``page_size`` keys a page: the default when a page
    holds whole 128-key tiles; else the default's tile and stages gathered from boxes of the
    largest of 64, 32, 16 keys that divides the page (Note [Gathered key tiles]), so every step
    is the same 64 x 128 GEMM pair whatever the page size. A page size that is no multiple of 16
    gets the default, which refuses it by name at launch. Compiled and checked, not timed.
    (A smaller key tile, ``HopperDecodeConfig(tile_n=16, ...)``, also takes small pages with one
    box a tile; each of its steps does the same fixed softmax work for fewer keys.)"""
    default = hopper_decode_default(head_dim)
    box = page_box_for(page_size)
    if box is None or page_size % default.tile_n == 0:
        return default
    return replace(default, page_box=box)


def hopper_bwd_softcap(config: HopperBwdConfig, head_dim: int, causal: bool) -> HopperBwdConfig:
    """The backward's default config for a softcap build (Note [Softcap in the backward],
    fa4_final.hopper.bwd): the plain default, except at D = 64 causal, where 128 x 128 spills
    (16 B of stack, 13 spill instructions when compiled for sm_90a) with the cap's per-step
    work and 64 x 128 does not. Chosen by that compile, not timed."""
    if head_dim <= 64 and causal:
        return replace(config, tile_m=64)
    return config
