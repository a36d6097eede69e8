"""The Hopper backward (sm_90a): K and V stationary, Q and dO streamed, five wgmma per step.

One CTA per (KV tile of tile_n = 128 keys, kv head, batch). Two MMA warpgroups own 64 keys each;
K, V and the dK, dV accumulators stay on chip for the whole CTA, and the inner loop walks every
query tile that sees these keys, for every query head of the kv head's group (GQA: dK and dV sum
over the group in registers, no float32 dK/dV buffers and no atomics for them). Per step, for a
warpgroup's 64 keys and a query tile of tile_m rows:

    S^T  = K Q^T               wgmma SS  (64 x tile_m, K = D)
    dP^T = V dO^T              wgmma SS  (K = dv: V and dO have dv columns, Note [dV head dim])
    P^T  = 2^(S^T * scale * log2 e - lse_log2)       registers (FFMA + MUFU.EX2)
    dS^T = P^T * (dP^T - delta)                      registers
    dV  += P^T dO              wgmma RS: P^T is the A operand straight from registers
    dK  += dS^T Q              wgmma RS
    dQ   = dS K                wgmma SS: dS goes through shared memory (both warpgroups' keys
                                form its K dimension), dQ leaves through shared memory and one
                                bulk float32 add into the dQ accumulator

Why S^T and not S (FA3's SdP_swapAB): with keys on the wgmma M axis the accumulator of S^T is
already laid out as the A operand of dV += P^T dO and dK += dS^T Q, so two of the five GEMMs
read their A from registers and P never touches shared memory; only dS is stored, once, for dQ.
Per step at tile_m = 64, D = 128 that is 5 GEMMs of 2 * 128 * 64 * 128 FLOPs = 10.5 MFLOP, 2560
tensor-core cycles of an SM; the shared-memory traffic of the same step (operands re-read by
each warpgroup, dS stored, dQ staged and read by the bulk add) is about as many cycles again
(a cycle model), so the step overlaps its GEMMs with everything else or loses time: that is
why both warpgroups issue their GEMMs back to back and wait only where a result is needed.

At D = dv = 192 and D = 256 the dK, dV GEMMs are swapped instead (dK^T += Q^T dS, dV^T +=
dO^T P with the head dim on M, S = Q K^T with the queries on M, P and dS through shared memory,
96 or 48 keys a CTA): Note [dK and dV swapped], mma_swapped and step_swapped.

Varlen is a compile-time variant, HopperVarlenBackward: packed sequences in one
launch, one CTA per key tile of a sequence and kv head (Note [Varlen backward]). Only the CTA's
lookup, the offsets of its rows and slabs and the store of a partial last key tile differ; the
dense variant's code is what it was without it (its SASS is unchanged).
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from fa4_final.common.atomics import bulk_add_f32, bulk_store_f32, pass_turn, wait_turn
from fa4_final.common.bwd_tiles import (
    dq_accum_tile,
    dq_turn,
    launch_order_reversed,
    q_tile_range,
    rotated_on,
    rotated_start,
    rotated_tile,
    rotated_turn,
)
from fa4_final.common.constants import LOG2_E, THREADS_PER_WARPGROUP, WARP_SIZE, WGMMA_M
from fa4_final.common.dq_order import dq_chunk_layout, dq_copy
from fa4_final.common.fragments import acc_as_a_operand, acc_rows_cols, select_modes
from fa4_final.common.mask import apply_mask, fragment_coords
from fa4_final.common.pipelines import PipelineSpec, tma_async_pipeline
from fa4_final.common.register_plan import check_role_registers
from fa4_final.common.schedule import lane_here, varlen_locate
from fa4_final.common.seqlens import sequence_slab, store_rows
from fa4_final.common.softmax import check_softcap, softcap_scores
from fa4_final.common.tiles import TileWindow
from fa4_final.hopper.config import BWD_MMA_WARPGROUPS, HopperBwdConfig
from fa4_final.hopper.wgmma import issue_wgmma, transposed

MMA_THREADS = THREADS_PER_WARPGROUP * BWD_MMA_WARPGROUPS


class NamedBarrier(IntEnum):
    """Hardware named barriers (bar.sync id); id 0 is __syncthreads."""

    DS_READY = 1  # both MMA warpgroups: this step's dS is in shared memory
    DS_FREE = 2  # both MMA warpgroups: the last dQ GEMM has read dS (stages_ds = 1 only)
    EPILOGUE = 3  # both MMA warpgroups: K and V are free to stage dK and dV
    DQ_EMPTY_WG0 = 4  # + w: the dQ warp has read warpgroup w's dQ buffer (128 + 32 threads)
    DQ_FULL_WG0 = 6  # + w: warpgroup w's dQ is in its buffer
    # dq_buffers = 2: the second buffer's pair (Note [Two dQ buffers])
    DQ_EMPTY_B1_WG0 = 8
    DQ_FULL_B1_WG0 = 10


def dq_barrier_ids(buf: int) -> tuple[int, int]:
    """(EMPTY, FULL) of warpgroup 0 for dQ staging buffer ``buf`` (0 or 1); + w for warpgroup w."""
    if buf == 0:
        return int(NamedBarrier.DQ_EMPTY_WG0), int(NamedBarrier.DQ_FULL_WG0)
    return int(NamedBarrier.DQ_EMPTY_B1_WG0), int(NamedBarrier.DQ_FULL_B1_WG0)


@dsl_user_op
def _pack2(a, b, dtype, *, loc=None, ip=None) -> Int32:
    """Two float32 -> one register of two 16-bit values (cvt.rn.bf16x2.f32 / .f16x2): as inline
    PTX the conversion happens once; as a plain cast LLVM rematerialises it for each of the two
    consumers of dS (its stmatrix and the dK wgmma), 16 extra F2FP per step."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _sync_unaligned(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """barrier.cta.sync without .aligned: a blocking named barrier whose warps may reach it from
    different instructions (Note [Barriers of two builds])."""
    nvvm.barrier_cta_sync(Int32(barrier_id).ir_value(loc=loc, ip=ip),
                          thread_count=Int32(number_of_threads).ir_value(loc=loc, ip=ip),
                          aligned=False, loc=loc, ip=ip)


@cute.jit
def _convert(src: cute.Tensor, dst: cute.Tensor):
    """dst (16-bit, same size) <- src (float32), two elements per instruction."""
    dst_pairs = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(dst_pairs)):
        dst_pairs[i] = _pack2(src[2 * i], src[2 * i + 1], dst.element_type)


# The pointwise part of a step, shared by both steps: step's S^T fragment holds the keys on its
# rows and the queries on its columns, step_swapped's S fragment the queries on its rows
# (Note [dK and dV swapped]). ``query_mode`` says which (1 or 0); the element work is the same.


def _at(query_mode: int, q: int, k: int) -> tuple:
    """(row, col) of a fragment's query q and key k when its mode ``query_mode`` holds the
    queries; ``_at(query_mode, q, 0)`` reads a per-query vector (row_values, column_values)."""
    return (k, q) if query_mode == 1 else (q, k)


def _p(x, lse_q, scale_log2):
    """P = 2^(x scale_log2 - lse) of one score x (t with a softcap), its query's lse in log2
    units: one FFMA and one MUFU.EX2."""
    return cute.math.exp2(x * scale_log2 - lse_q, fastmath=True)


@cute.jit
def _p_from_scores(s: cute.Tensor, lse: cute.Tensor, scale_log2,
                   query_mode: cutlass.Constexpr[int]):
    """In place: s <- P, element by element (no softcap); lse read once per query."""
    for q in cutlass.range_constexpr(cute.size(s, mode=[query_mode])):
        lse_q = lse[_at(query_mode, q, 0)]
        for k in cutlass.range_constexpr(cute.size(s, mode=[1 - query_mode])):
            s[_at(query_mode, q, k)] = _p(s[_at(query_mode, q, k)], lse_q, scale_log2)


@cute.jit
def _in_registers(vec: cute.Tensor, query_mode: cutlass.Constexpr[int]) -> cute.Tensor:
    """A per-query vector seen through a fragment (row_values, column_values: shared memory,
    read where it is used) read into registers now, one float a query of the fragment, indexed
    as ``vec`` is (Note [Per-query values before the wait])."""
    n = cute.size(vec, mode=[query_mode])
    other = cute.size(vec, mode=[1 - query_mode])
    if const_expr(query_mode == 1):
        layout = cute.make_layout((other, n), stride=(0, 1))
    else:
        layout = cute.make_layout((n, other), stride=(1, 0))
    out = cute.make_rmem_tensor(layout, Float32)
    for q in cutlass.range_constexpr(n):
        out[_at(query_mode, q, 0)] = vec[_at(query_mode, q, 0)]
    return out


def shuffled_column_loaded(lane, reg: int):
    """The query column that ``lane`` loads into its register ``reg`` of a _ShuffledColumns
    (Note [Per-query values by shuffle]); ``lane`` a Python int or the kernel's lane index."""
    return 8 * (lane // 4 + 8 * (reg // 2)) + 2 * (lane % 4) + reg % 2


def shuffled_column_source(col0: int, lane) -> tuple:
    """(lane, register) holding, for ``lane``, the value of its fragment column whose thread-0
    column is ``col0`` (Note [Per-query values by shuffle])."""
    j, e = col0 // 8, col0 % 8
    return (j % 8) * 4 + lane % 4, 2 * (j // 8) + e


class _ShuffledColumns:
    """A per-query vector of one stage (lse or delta) for this thread's S^T fragment, indexed as
    column_values' view is (``[0, c]``: the value of the thread's column c), read from shared
    memory in an eighth of the loads and passed around the warp by shuffles
    (Note [Per-query values by shuffle])."""

    def __init__(self, s_vec: cute.Tensor, stage, t0ScS: cute.Tensor, tile_m: int):
        self.t0ScS = t0ScS
        self.lane = cute.arch.lane_idx()
        self.regs = cute.make_rmem_tensor(2 * (tile_m // 64), Float32)
        for reg in range(2 * (tile_m // 64)):  # plain Python: __init__ is traced, not preprocessed
            self.regs[reg] = s_vec[shuffled_column_loaded(self.lane, reg), stage]

    def __getitem__(self, index):
        col = self.t0ScS[0, index[1]][1]  # thread 0's column: a compile-time int
        assert isinstance(col, int) and col % 8 < 2, f"not a wgmma accumulator column: {col!r}"
        src, reg = shuffled_column_source(col, self.lane)
        return cute.arch.shuffle_sync(self.regs[reg], offset=src)


@cute.jit
def _ds_element(s: cute.Tensor, dp: cute.Tensor, i, delta_q, lse_q, scale_log2,
                capped: cutlass.Constexpr[bool]):
    """dP -> dS of element i (row, col) of this thread's S and dP fragments, in place. Without a
    softcap s[i] is P already: dS = P (dP - delta). With one s[i] is t: P, its dS term and the
    factor 1 - t^2 at once, and s[i] <- P (Note [Softcap in the backward])."""
    if const_expr(not capped):
        dp[i] = s[i] * (dp[i] - delta_q)
    else:
        t = s[i]
        p = _p(t, lse_q, scale_log2)
        s[i] = p
        dp[i] = p * (dp[i] - delta_q) * (Float32(1.0) - cute.arch.fmin(t * t, Float32(1.0)))


@cute.jit
def _ds_from_dp(s: cute.Tensor, dp: cute.Tensor, lse, delta: cute.Tensor, scale_log2,
                query_mode: cutlass.Constexpr[int], capped: cutlass.Constexpr[bool]):
    """dp <- dS over the fragment, query by query (_ds_element); delta, and lse with a softcap
    (``lse`` is read only then), read once per query."""
    for q in cutlass.range_constexpr(cute.size(dp, mode=[query_mode])):
        delta_q = delta[_at(query_mode, q, 0)]
        lse_q = None
        if const_expr(capped):
            lse_q = lse[_at(query_mode, q, 0)]
        for k in cutlass.range_constexpr(cute.size(dp, mode=[1 - query_mode])):
            _ds_element(s, dp, _at(query_mode, q, k), delta_q, lse_q, scale_log2, capped)


class HopperBackward:
    """dK, dV (and dQ's float32 accumulator) of attention, one KV tile per CTA.

    Roles (data, ``self.roles``):
      warpgroup 0   warp 0: TMA loads (K, V once; Q + lse and dO + delta per step)
                    warp 1: dQ stores (bulk float32 adds; the turn counters when deterministic)
                    warp 2: under dq_adds_overlap the odd steps' dQ stores
      warpgroups 1-2  MMA: the five GEMMs and the pointwise work for 64 keys each; epilogue

    Pipelines: ``pipelines()``, data (common.pipelines.PipelineSpec). dS and dQ pass through
    shared memory under named barriers (NamedBarrier).
    """

    varlen = False  # HopperVarlenBackward: packed sequences (Note [Varlen backward])
    has_seqused_k = False

    def __init__(self, dtype, head_dim: int, causal: bool, config: HopperBwdConfig,
                 has_window_left: bool = False, has_window_right: bool = False,
                 softcap: float = 0.0, head_dim_v: int | None = None):
        # dv of V, dO (and O) and dV; D of Q, K, dQ and dK (Note [dV head dim])
        dv = head_dim if head_dim_v is None else head_dim_v
        config.check(head_dim, dv)
        # Note [Softcap] (fa4_final.common.softmax): a compile-time variant; 0.0 compiles exactly
        # the kernel without it. A learnable sink needs nothing here: P = exp(s - lse) with the
        # forward's lse is already right (Note [Learnable sink]); its gradient is the host's.
        # named so that no subclass's own softcap attribute switches this build on
        self.logit_softcap = check_softcap(softcap)
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = dv
        self.causal = bool(causal)
        self.cfg = config
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.window = TileWindow(self.tile_m, self.tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        self.producer_regs, self.mma_regs = config.registers
        self.num_threads = THREADS_PER_WARPGROUP + MMA_THREADS
        self.dq_warpgroups = config.dq_warpgroups  # Note [dQ by one warpgroup]
        self.dq_threads = THREADS_PER_WARPGROUP * self.dq_warpgroups  # what bwd_post reads back
        self.dq_chunk = self.tile_m * head_dim // self.dq_warpgroups  # floats per warpgroup
        if config.dq_uneven:  # Note [dQ split unevenly]: read back as one warpgroup's tile
            self.dq_threads = THREADS_PER_WARPGROUP
            self.dq_chunk = self.tile_m * head_dim
        self.dq_swap_ab = config.dq_swap_ab  # what bwd_post asks of a dQ writer
        self.roles = {
            "producer": {"warpgroups": (0,), "tma_warp": 0, "dq_warp": 1,
                         # dq_adds_overlap: the odd steps' dQ warp
                         # (Note [Adds in flight across turns])
                         "dq_warp_odd": 2, "registers": self.producer_regs},
            "mma": {"warpgroups": (1, 2), "keys_per_warpgroup": self.mma_keys(),
                    "registers": self.mma_regs},
        }
        check_role_registers(self.roles, self.num_threads)  # per SM sub-partition

    def mma_keys(self) -> int:
        """Keys an MMA warpgroup's dK and dV accumulators cover: 64 on the wgmma M, or under
        dkv_swap_ab its share of the tile on the N (Note [dK and dV swapped])."""
        if not self.cfg.dkv_swap_ab:
            return WGMMA_M
        return self.tile_n // BWD_MMA_WARPGROUPS if self.dkv_splits_keys() else self.tile_n

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The TMA warp -> MMA warpgroups rings: FULL completes with the TMA warp's arrive and
        the byte count, EMPTY with one arrive per MMA thread (release_every_thread, the
        default, and always in the builds of two loops) or per MMA warp
        (Note [Release after the warp's reads])."""
        warps = MMA_THREADS // WARP_SIZE
        empty = MMA_THREADS if self.every_thread_releases() else warps
        return (
            PipelineSpec("q", "Q and its lse (log2 units) per query tile", "tma_async",
                         self.cfg.stages_q, "producer", "mma", 1, empty),
            PipelineSpec("do", "dO and its delta per query tile", "tma_async",
                         self.cfg.do_stages, "producer", "mma", 1, empty),
            PipelineSpec("kv", "K and V of the CTA's KV tile, loaded once", "tma_async", 1,
                         "producer", "mma", 1, warps),
        )

    def cache_key(self) -> tuple:
        key = (type(self).__name__, self.dtype.__name__, self.head_dim, self.causal,
               self.window, self.cfg)
        if self.head_dim_v != self.head_dim:  # only when it differs: the other keys unchanged
            key = key + (("head_dim_v", self.head_dim_v),)
        return key + (("softcap", self.logit_softcap),) if self.logit_softcap else key

    # ------------------------------------------------------------------------------------------
    # layouts and MMAs (also used by fa4_final.common.bwd_post to read the dQ accumulator back)
    # ------------------------------------------------------------------------------------------
    def _smem_layout(self, rows: int, cols: int, stages: int | None = None,
                     major: int | None = None):
        """128 B-swizzled row-major (rows, cols) tile, optionally staged: what TMA writes and
        wgmma reads, K-major along cols and, through a transposed view, MN-major too.
        ``major``: the swizzle chosen for rows of that many columns instead of ``cols`` (a
        narrower atom, so that slices of ``major`` columns are whole atoms)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype,
                                            cols if major is None else major), self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def tiled_mmas(self):
        """(S^T and dP^T; dV and dK; dQ). Atoms (2, 1, 1): each MMA warpgroup owns 64 keys.
        dQ = dS K splits D between the warpgroups when tile_m = 64, rows when tile_m = 128; with
        dq_swap_ab it is dQ^T = K^T dS^T, D on M."""
        major = cute.nvgpu.OperandMajorMode
        keys = (BWD_MMA_WARPGROUPS, 1, 1)
        mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.K, major.K, Float32, keys, (WGMMA_M, self.tile_m))
        mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.K, major.MN, Float32, keys, (WGMMA_M, self.head_dim),
            warpgroup.OperandSource.RMEM)
        if const_expr(self.cfg.dq_uneven):  # Note [dQ split unevenly]: one warpgroup's MMA
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, major.MN, major.K, Float32, (1, 1, 1),
                (WGMMA_M, self.tile_m))
        elif const_expr(self.cfg.dq_swap_ab):
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, major.MN, major.K, Float32, keys,
                (WGMMA_M, self.tile_m))
        elif const_expr(self.cfg.dq_single_wg):  # Note [dQ by one warpgroup]
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, major.K, major.MN, Float32, (1, 1, 1),
                (WGMMA_M, self.head_dim))
        else:
            rows = self.tile_m // WGMMA_M
            cols = BWD_MMA_WARPGROUPS // rows
            mma_dq = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, major.K, major.MN, Float32, (rows, cols, 1),
                (WGMMA_M, self.head_dim // cols))
        return mma_sdp, mma_dkv, mma_dq

    def mma_dv(self, mma_dkv):
        """The tiled MMA of dV += P^T dO: ``mma_dkv`` itself when dv == D, else the same atoms
        with N = dv (Note [dV head dim])."""
        if const_expr(self.head_dim_v == self.head_dim):
            return mma_dkv
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.MN, Float32, (BWD_MMA_WARPGROUPS, 1, 1),
            (WGMMA_M, self.head_dim_v), warpgroup.OperandSource.RMEM)

    def dq_part(self, wg: int) -> tuple[int, int]:
        """(first row, rows) of D in MMA warpgroup ``wg``'s part of dQ^T under dq_uneven
        (Note [dQ split unevenly]): warpgroup 0 takes the larger half of the 64-row blocks."""
        first = -(-self.head_dim // (2 * WGMMA_M)) * WGMMA_M
        return (0, first) if wg == 0 else (first, self.head_dim - first)

    def dq_part_view(self, slab: cute.Tensor, wg: int) -> cute.Tensor:
        """Warpgroup ``wg``'s run of a query tile's slab under dq_uneven: (rows x tile_m, 1)
        floats from dq_at(wg) (Note [dQ split unevenly])."""
        return cute.make_tensor(slab.iterator + self.dq_at(wg),
                                cute.make_layout((self.dq_part(wg)[1] * self.tile_m, 1)))

    def dq_tile_shape(self, wg=None) -> tuple:
        """(M, N) of the dQ GEMM's accumulator tile; under dq_uneven with ``wg`` (a Python
        int), that warpgroup's part of it."""
        if const_expr(self.cfg.dq_uneven and wg is not None):
            return (self.dq_part(wg)[1], self.tile_m)
        if const_expr(self.cfg.dq_swap_ab):
            return (self.head_dim, self.tile_m)
        return (self.tile_m, self.head_dim)

    def dq_copy(self) -> cute.TiledCopy:
        """Registers -> the dQ staging buffer and accumulator (Note [dQ in accumulator order])."""
        if const_expr(self.dq_warpgroups != BWD_MMA_WARPGROUPS or self.cfg.dq_uneven):
            return dq_copy(self.dq_warpgroups)
        return dq_copy()

    def dq_coords(self, tidx):
        """(row, col) in the dQ tile of each of MMA thread ``tidx``'s dQ registers, in order."""
        _, _, mma_dq = self.tiled_mmas()
        tile = cute.make_identity_tensor(self.dq_tile_shape())
        return mma_dq.get_slice(tidx).partition_C(tile)

    def dq_chunk_layout(self) -> cute.Layout:
        if const_expr(self.dq_warpgroups != BWD_MMA_WARPGROUPS or self.cfg.dq_uneven):
            return dq_chunk_layout(self.dq_chunk, self.dq_warpgroups)
        return dq_chunk_layout(self.dq_chunk)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, dv)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, dv)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32, log2 units (bwd_pre)
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 (bwd_pre)
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32, zeroed (bwd_pre)
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mdV: cute.Tensor,  # (batch, seqlen_k, heads_kv, dv)
        mTurn: cute.Tensor,  # (batch, heads, num_m_blocks) int32, zeroed (deterministic only)
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        self.launch(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, mTurn, softmax_scale,
                    window_left, window_right, None, None, None, stream)

    @cute.jit
    def launch(self, mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, mTurn, softmax_scale,
               window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, stream,
               mSeqUsedQ=None):
        """The host side of both variants: layouts, TMA descriptors, grid. The varlen tensors
        are None in the dense one (HopperVarlenBackward's arguments)."""
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type
                           == mdO.element_type == mdK.element_type == mdV.element_type
                           == self.dtype)):
            raise TypeError(f"q, k, v, dout, dk, dv must all be {self.dtype}")
        if const_expr(not (mLSE2.element_type == mDelta.element_type == mdQaccum.element_type
                           == Float32)):
            raise TypeError("lse_log2, delta and the dQ accumulator must be float32")
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1; head, batch pick the slab
        mQ, mK, mV, mdO, mdK, mdV = [select_modes(t, [1, 3, 2, 0])
                                     for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mDelta, mdQaccum, mTurn = [select_modes(t, [2, 1, 0])
                                          for t in (mLSE2, mDelta, mdQaccum, mTurn)]
        D, Dv, stages = self.head_dim, self.head_dim_v, self.cfg.stages_q
        sQ_layout = self._smem_layout(self.tile_m, D, stages)  # also dO's when dv == D
        sK_layout = self._smem_layout(self.tile_n, D)  # also dK's (and V's, dV's when dv == D)
        sdO_layout, sV_layout = sQ_layout, sK_layout
        if const_expr(Dv != D):  # Note [dV head dim]
            sdO_layout = self._smem_layout(self.tile_m, Dv, stages)
            sV_layout = self._smem_layout(self.tile_n, Dv)
        if const_expr(self.cfg.do_stages != stages):  # Note [dK and dV swapped]
            sdO_layout = self._smem_layout(self.tile_m, Dv, self.cfg.do_stages)
        sdS_layout = self._smem_layout(self.tile_m, self.tile_n, self.cfg.stages_ds)
        if const_expr(self.cfg.dkv_swap_ab):  # P and dS read by keys too (Note [dK and dV swapped])
            sdS_layout = self._smem_layout(self.tile_m, self.tile_n, self.cfg.stages_ds,
                                           self.pds_major())
        sQ_one = cute.select(sQ_layout, mode=[0, 1])
        sdO_one = cute.select(sdO_layout, mode=[0, 1])
        bytes_row = self.tile_m * 4  # a tile's lse or delta
        bytes_q = cute.size_in_bytes(self.dtype, sQ_one) + bytes_row
        bytes_do = cute.size_in_bytes(self.dtype, sdO_one) + bytes_row
        bytes_kv = (cute.size_in_bytes(self.dtype, sK_layout)
                    + cute.size_in_bytes(self.dtype, sV_layout))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * stages], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * stages], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)],
                                   1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)],
                                   1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[
                Float32, self.tile_m * D * self.cfg.dq_buffers], 1024]

        if const_expr(self.cfg.dkv_swap_ab):  # P beside dS (Note [dK and dV swapped])
            SharedStorage = self.swapped_storage(sQ_layout, sdO_layout, sK_layout, sV_layout,
                                                 sdS_layout)
        # the budget arithmetic of HopperBwdConfig.smem_bytes() is the struct's real size
        need = self.cfg.smem_bytes(D, self.dtype.width // 8, Dv)
        assert SharedStorage.size_in_bytes() == need, (SharedStorage.size_in_bytes(), need)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load, mQ, sQ_one, (self.tile_m, D))
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(load, mdO, sdO_one,
                                                          (self.tile_m, Dv))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, sK_layout, (self.tile_n, D))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, sV_layout, (self.tile_n, Dv))
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(store, mdK, sK_layout,
                                                          (self.tile_n, D))
        tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(store, mdV, sV_layout,
                                                          (self.tile_n, Dv))
        mma_sdp, mma_dkv, mma_dq = self.tiled_mmas()
        if const_expr(self.cfg.dkv_swap_ab):  # Note [dK and dV swapped]
            mma_sdp, mma_dkv, mma_dq = self.swapped_mmas()
        num_n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        grid = (num_n_blocks, mK.shape[2], mK.shape[3])
        mdK_rows, mdV_rows = None, None
        if const_expr(self.varlen):
            # one CTA per (key tile of a sequence, kv head), counted from shapes alone
            # (bwd_tiles.varlen_grid_bound): CTAs past the last key tile exit
            grid = ((num_n_blocks + mCuSeqlensK.shape[0] - 1) * mK.shape[2], 1, 1)
            mdK_rows, mdV_rows = mdK, mdV  # a sequence's partial last key tile: no TMA store
        self.kernel(
            tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, mLSE2, mDelta, mdQaccum, mTurn,
            tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_dk, tma_atom_dv,
            softmax_scale, self.score_scale(softmax_scale), window_left, window_right, mQ.shape[2],
            sQ_layout, sK_layout, sdS_layout, mma_sdp, mma_dkv, mma_dq,
            bytes_q, bytes_kv, SharedStorage, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
            mdK_rows, mdV_rows, mSeqUsedQ, sdO_layout, sV_layout, bytes_do,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def score_scale(self, softmax_scale):
        """The kernel's scale_log2 argument: scale * log2 e, or with a softcap the multiplier
        of q.k before tanh, scale / softcap (Note [Softcap])."""
        if const_expr(self.logit_softcap):
            return softmax_scale * Float32(1.0 / self.logit_softcap)
        return softmax_scale * LOG2_E

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b)
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE2: cute.Tensor,  # (s_padded, h, b)
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,  # (s_padded * D, h, b)
        mTurn: cute.Tensor,  # (num_m_blocks, h, b)
        tma_atom_q: cute.CopyAtom,
        tma_atom_k: cute.CopyAtom,
        tma_atom_v: cute.CopyAtom,
        tma_atom_do: cute.CopyAtom,
        tma_atom_dk: cute.CopyAtom,
        tma_atom_dv: cute.CopyAtom,
        softmax_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        heads: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        bytes_q: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; dense: None
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,  # varlen with seqused_k: (batch,) int32
        mdK_rows: cute.Tensor | None,  # varlen: dk and dv themselves (s, D, h, b)
        mdV_rows: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,  # varlen with seqused_q: (batch,) int32
        sdO_layout: cute.ComposedLayout,  # (tile_m, dv, STAGE): sQ_layout when dv == D
        sV_layout: cute.ComposedLayout,  # (tile_n, dv): sK_layout when dv == D
        bytes_do: cutlass.Constexpr[int],
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, tma_atom_dk,
                         tma_atom_dv):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # the signalling lane read once (pin_lane; Note [Signalling lane] in hopper.fwd)
        lane = lane_here() if const_expr(self.cfg.pin_lane) else None
        mbar = {"q": storage.mbar_q, "do": storage.mbar_do, "kv": storage.mbar_kv}
        tx = {"q": bytes_q, "do": bytes_do, "kv": bytes_kv}
        pipes = {spec.name: tma_async_pipeline(spec, mbar[spec.name], tx[spec.name], lane)
                 for spec in self.pipelines()}
        pipeline_q, pipeline_do, pipeline_kv = pipes["q"], pipes["do"], pipes["kv"]
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (m, D, STAGE)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)  # (m, dv, ST)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (n, D)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (n, dv)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)  # (m, n, ST)
        sP = None  # Note [dK and dV swapped]: P through shared memory, laid out as dS
        if const_expr(self.cfg.dkv_swap_ab):
            sP = storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        row_layout = cute.make_layout((self.tile_m, self.cfg.stages_q))
        sLSE = storage.sLSE.get_tensor(row_layout)  # (m, STAGE)
        if const_expr(self.cfg.do_stages != self.cfg.stages_q):  # delta rides with dO
            sDelta = storage.sDelta.get_tensor(
                cute.make_layout((self.tile_m, self.cfg.do_stages)))
        else:
            sDelta = storage.sDelta.get_tensor(row_layout)
        sdQ = storage.sdQ.get_tensor(self.dq_chunk_layout())  # (tile_m * D / 2, 2) float32
        pipeline.pipeline_init_arrive()
        pipeline.pipeline_init_wait()

        n_block, head_kv, b = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        seq = None  # dense; varlen: where this CTA's sequence lies (Note [Varlen backward])
        if const_expr(self.varlen):
            n_block, head_kv, seqlen_q, seqlen_k, seq = self.varlen_key_tile(
                n_block, mK.shape[2], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ)
            b = Int32(0)  # the packed batch of one
        num_n_blocks = (seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.cfg.deterministic and launch_order_reversed(self.window)):
            n_block = num_n_blocks - 1 - n_block  # turns go downwards (bwd_tiles Note [Turn order])
        m_min, m_max, n_first, n_last = q_tile_range(self.window, n_block, seqlen_q, seqlen_k,
                                                     window_left, window_right)
        if (n_block + 1) * self.tile_n > seqlen_k:  # keys past seqlen_k: mask every step
            n_first = m_max - m_min
        group = heads // mK.shape[2]
        rot = 0  # where the walk starts (Note [A rotated walk]; 0 where it does not rotate)
        if const_expr(self.rotated_walk()):
            rot = rotated_on(num_n_blocks) * rotated_start(n_block, m_max - m_min, num_n_blocks)
        work = (m_min, m_max, n_first, n_last, head_kv * group, group, rot)

        if warp_idx < THREADS_PER_WARPGROUP // WARP_SIZE:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == self.roles["producer"]["tma_warp"]:
                self.load(mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                          tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_do, pipeline_q,
                          pipeline_do, pipeline_kv, n_block, head_kv, b, work, seq)
            if warp_idx == self.roles["producer"]["dq_warp"]:
                if const_expr(self.cfg.dq_adds_overlap):  # Note [Adds in flight across turns]
                    self.store_dq_two_buffers(mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b,
                                              work, seqlen_q, seqlen_k, window_left,
                                              window_right, seq, parity=0)
                elif const_expr(self.cfg.dq_buffers == 2):  # Note [Two dQ buffers]
                    self.store_dq_two_buffers(mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b,
                                              work, seqlen_q, seqlen_k, window_left,
                                              window_right, seq)
                else:
                    self.store_dq(mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b, work,
                                  seqlen_q, seqlen_k, window_left, window_right, seq)
            if const_expr(self.cfg.dq_adds_overlap):
                if warp_idx == self.roles["producer"]["dq_warp_odd"]:
                    self.store_dq_two_buffers(mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b,
                                              work, seqlen_q, seqlen_k, window_left,
                                              window_right, seq, parity=1)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            args = (mdK, mdV, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, tma_atom_dk, tma_atom_dv,
                    mma_sdp, mma_dkv, mma_dq, pipeline_q, pipeline_do, pipeline_kv,
                    softmax_scale, scale_log2, window_left, window_right, n_block, head_kv, b,
                    seqlen_q, seqlen_k, work, seq, mdK_rows, mdV_rows)
            if const_expr(self.cfg.dkv_swap_ab):  # Note [dK and dV swapped]: a build per part
                if warp_idx < 2 * THREADS_PER_WARPGROUP // WARP_SIZE:
                    self.mma_swapped(*args, sP=sP, dq_part=0)
                else:
                    self.mma_swapped(*args, sP=sP, dq_part=1)
            elif const_expr(self.cfg.dq_uneven):  # Note [dQ split unevenly]: a build per part
                if warp_idx < 2 * THREADS_PER_WARPGROUP // WARP_SIZE:
                    self.mma(*args, dq_part=0)
                else:
                    self.mma(*args, dq_part=1)
            elif const_expr(self.dq_warpgroups == BWD_MMA_WARPGROUPS):
                self.mma(*args)
            else:  # Note [dQ by one warpgroup]: each warpgroup's own build of the loop
                if warp_idx < 2 * THREADS_PER_WARPGROUP // WARP_SIZE:
                    self.mma(*args, dq_wg=True)
                else:
                    self.mma(*args, dq_wg=False)

    # Note [Varlen backward]
    # HopperVarlenBackward: the packed sequences of runtime.varlen in one launch. A CTA is still
    # one (key tile, kv head), now of one sequence: CTA t is the t-th of the list "sequence 0's kv
    # head 0's key tiles, its kv head 1's, ..., sequence 1's, ..." (key tiles fastest, so the CTAs
    # running together walk the same query heads' Q and dO out of L2). Each warp finds its CTA's
    # sequence by itself with the forward's warp scan (schedule.varlen_locate, over cu_seqlens_k,
    # or seqused_k where given): ceil(batch / 32) steps of two L2 loads and five shuffles, a few
    # hundred cycles against a CTA's ceil(len_q / tile_m) * group steps of 2.5k+ tensor cycles. The
    # grid is counted from shapes alone, (ceil(total_k / tile_n) + batch) * heads_kv
    # (bwd_tiles.varlen_grid_bound): no device sync, and at most batch * heads_kv CTAs find no tile
    # and exit at once. The alternative, a (max key tiles, heads_kv, batch) grid with early exit,
    # needs max_seqlen_k on the host and launches max_tiles * batch CTAs: for one 8k sequence among
    # 100 short ones that is 64 * 101 CTAs per kv head of which about 165 work, each empty one still
    # paying its launch, shared-memory carve-out and exit on an SM (one CTA per SM fits), where the
    # list grid's empty CTAs are at most batch per kv head. Inside its sequence a CTA runs the dense
    # code with the sequence's own seqlen_q and seqlen_k (masks, tile ranges, deterministic turns,
    # the reversed launch order of Note [dQ turns] all per sequence): Q, dO, K and V are reached by
    # a domain offset to the sequence's first row; lse_log2, delta, the dQ accumulator and the turn
    # counters by the sequence's padded tile (Note [Varlen dQ accumulator] in
    # fa4_final.common.bwd_tiles). Reading past a sequence's end is harmless as in the forward
    # (common.seqlens): those keys are masked, those query rows have P = 0. Writing is not: a
    # partial last key tile stores its dK and dV rows from shared memory with one predicate per row
    # (seqlens.store_rows, as the forward's partial O tile) instead of a TMA store that would clip
    # only at total_k. A sequence with keys but no query row gets dK = dV = 0 from its CTAs (no
    # step); one with no key owns no CTA, and its dQ is the zeroed accumulator. Rows past seqused_k
    # belong to no key tile: the launch zeroes dk and dv first.

    # Note [Used query rows in the backward]
    # With seqused_q (Note [Used query rows] in fa4_final.common.seqlens) the backward takes a
    # sequence's length as its used rows in bwd_pre and here: the causal diagonal and the query
    # tiles a key tile visits follow the used length, and bwd_pre gives the padding rows of a
    # partial last tile lse_log2 = +inf and delta = 0, so their P and dS are exactly 0 and they
    # add nothing to dK, dV or dQ (bwd_post then writes zeros into dq's padding rows, from the
    # zeroed accumulator). That needs the padding rows of q and dout to hold finite values, as
    # the forward's Note asks of keys past seqused_k: 0 * NaN is NaN.

    @cute.jit
    def varlen_key_tile(self, t, heads_kv, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                        mSeqUsedQ=None):
        """(n_block, head_kv, seqlen_q, seqlen_k, (first q row, first k row, first padded
        tile)) of CTA ``t`` (Note [Varlen backward]); past the last tile both lengths are 0, so
        the CTA has no step and stores nothing. With seqused_q, seqlen_q is the sequence's used
        rows (Note [Used query rows] in fa4_final.common.seqlens). Warp-collective. Host
        mirror: bwd_tiles.varlen_key_tile_host."""
        b, before, total = varlen_locate(t, mCuSeqlensK, self.tile_n, heads_kv, mSeqUsedK)
        offset_q, offset_k = mCuSeqlensQ[b], mCuSeqlensK[b]
        seqlen_q = mCuSeqlensQ[b + 1] - offset_q
        if const_expr(mSeqUsedQ is not None):
            seqlen_q = mSeqUsedQ[b]
        if const_expr(mSeqUsedK is not None):
            seqlen_k = mSeqUsedK[b]
        else:
            seqlen_k = mCuSeqlensK[b + 1] - offset_k
        valid = t < total
        seqlen_q = seqlen_q if valid else Int32(0)
        seqlen_k = seqlen_k if valid else Int32(0)
        n_blocks = cutlass.max(cute.ceil_div(seqlen_k, self.tile_n), 1)
        r = t - before
        seq = (offset_q, offset_k, dq_accum_tile(offset_q, b, self.tile_m))
        return r % n_blocks, r // n_blocks, seqlen_q, seqlen_k, seq

    # Note [Backward phases]
    # The three roles walk the same steps in the same order: for each query head of the group,
    # for m_block in [m_min, m_max). Per step the producer fills one Q stage (Q + lse) and one
    # dO stage (dO + delta); the MMA warpgroups release Q after their last GEMM that reads it
    # (dK += dS^T Q) and dO after dV += P^T dO. K and V come once, before the first step; a CTA
    # with no step (keys no query sees) loads nothing and writes dK = dV = 0. The dQ warp takes
    # each step's two dQ chunks in the same order; its buffers are handed over with named
    # barriers: DQ_EMPTY (the bulk add has read the buffer) before a warpgroup writes, DQ_FULL
    # after.

    def rotated_walk(self) -> bool:
        """Whether this build rotates the deterministic walk over query tiles
        (HopperBwdConfig.dq_rotated and no mask window; Note [A rotated walk] in
        fa4_final.common.bwd_tiles); a build with a window keeps the plain order."""
        return bool(self.cfg.dq_rotated and not self.window.masks_right
                    and not self.window.has_left)

    def walk_tile(self, i, work):
        """The query tile of the walk's step at ``i`` (m_min <= i < m_max): ``i`` itself, or,
        rotated, from the key tile's start ``work[6]`` around (Note [A rotated walk]). Every
        role maps its steps through this, so all walk the same tiles in the same order."""
        if const_expr(self.rotated_walk()):
            m_min, m_max = work[0], work[1]
            return m_min + rotated_tile(i - m_min, work[6], m_max - m_min)
        return i

    def turn(self, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k, window_left,
             window_right, work):
        """Key tile ``n_block``'s dQ turn at ``m_block``: dq_turn's, or the rotated walk's when
        it rotates (rotated_on, recomputed here rather than kept live through the walk: the
        dQ warps run on the producer's registers; Note [A rotated walk])."""
        plain = dq_turn(self.window, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k,
                        window_left, window_right)
        if const_expr(self.rotated_walk()):
            m_min, m_max = work[0], work[1]
            return plain + rotated_on(num_n_blocks) * (
                rotated_turn(n_block, m_block - m_min, m_max - m_min, num_n_blocks) - plain)
        return plain

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mDelta, sQ, sK, sV, sdO, sLSE, sDelta, tma_atom_q,
             tma_atom_k, tma_atom_v, tma_atom_do, pipeline_q, pipeline_do, pipeline_kv,
             n_block, head_kv, b, work, seq=None):
        """TMA warp: K and V once, then per step Q + lse and dO + delta (Note [Backward phases])."""
        m_min, m_max, _, _, head0, group, *_ = work
        offset_q = offset_k = m_base = None  # dense; varlen: Note [Varlen backward]
        if const_expr(seq is not None):
            offset_q, offset_k, m_base = seq
        D, Dv = self.head_dim, self.head_dim_v
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.cfg.stages_q)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        split_do = const_expr(self.cfg.do_stages != self.cfg.stages_q)
        state_do = None  # a ring of its own depth (Note [dK and dV swapped])
        if const_expr(split_do):
            state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                    self.cfg.do_stages)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        if m_max > m_min:
            gK = cute.local_tile(sequence_slab(mK, head_kv, b, offset_k), (self.tile_n, D),
                                 (n_block, 0))
            gV = cute.local_tile(sequence_slab(mV, head_kv, b, offset_k), (self.tile_n, Dv),
                                 (n_block, 0))
            pipeline_kv.producer_acquire(state_kv)
            for atom, g, s in ((tma_atom_k, gK, sK), (tma_atom_v, gV, sV)):
                tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(s, 0, 2),
                                                   cute.group_modes(g, 0, 2))
                cute.copy(atom, tXgX, tXsX,
                          tma_bar_ptr=pipeline_kv.producer_get_barrier(state_kv))
        for h in cutlass.range(group, unroll=1):
            head = head0 + h
            # (m, D, m_blocks) of this head; (m, m_blocks) of its lse and delta
            gQ = cute.local_tile(sequence_slab(mQ, head, b, offset_q), (self.tile_m, D),
                                 (None, 0))
            gdO = cute.local_tile(sequence_slab(mdO, head, b, offset_q), (self.tile_m, Dv),
                                  (None, 0))
            gLSE = cute.local_tile(mLSE2[None, head, b], (self.tile_m,), (None,))
            gDelta = cute.local_tile(mDelta[None, head, b], (self.tile_m,), (None,))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_do, 0, cute.make_layout(1),
                                                   cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            for i in cutlass.range(m_min, m_max, unroll=1):
                m_block = self.walk_tile(i, work)
                m_pad = m_block  # its tile of lse_log2, delta, dQ accumulator, turns
                if const_expr(m_base is not None):
                    m_pad = m_base + m_block
                pipeline_q.producer_acquire(state_q)
                bar = pipeline_q.producer_get_barrier(state_q)
                cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, state_q.index],
                          tma_bar_ptr=bar)
                with cute.arch.elect_one():
                    cute.copy(bulk, gLSE[None, m_pad], sLSE[None, state_q.index],
                              mbar_ptr=bar)
                if const_expr(split_do):
                    pipeline_do.producer_acquire(state_do)
                    bar = pipeline_do.producer_get_barrier(state_do)
                    cute.copy(tma_atom_do, tdOgdO[None, m_block], tdOsdO[None, state_do.index],
                              tma_bar_ptr=bar)
                    with cute.arch.elect_one():
                        cute.copy(bulk, gDelta[None, m_pad], sDelta[None, state_do.index],
                                  mbar_ptr=bar)
                    state_do.advance()
                else:
                    pipeline_do.producer_acquire(state_q)
                    bar = pipeline_do.producer_get_barrier(state_q)
                    cute.copy(tma_atom_do, tdOgdO[None, m_block], tdOsdO[None, state_q.index],
                              tma_bar_ptr=bar)
                    with cute.arch.elect_one():
                        cute.copy(bulk, gDelta[None, m_pad], sDelta[None, state_q.index],
                                  mbar_ptr=bar)
                state_q.advance()

    # Note [dQ turns]
    # Deterministic mode. Query tile m of a head receives dQ parts from every key tile that
    # visits it; each adds one block per MMA warpgroup. The turn counter of (batch, head, m) in
    # global memory starts at 0 (bwd_pre); key tile n waits until it reads its turn
    # (bwd_tiles.dq_turn: downwards from the last visitor with a causal diagonal, upwards from
    # the first otherwise), adds both its blocks, waits for the adds to complete (wait_group 0,
    # not just .read) and increments the counter with release semantics. Every run then adds the
    # same float32 values in the same order. No deadlock: a CTA waits only for CTAs of its
    # (head, batch) that come earlier in its turn order, which the grid launches first (CTA x is
    # key tile n_blocks - 1 - x when turns go downwards), and each of those waits only on earlier
    # ones in turn. The cost: a CTA whose turn comes before its data is ready waits; without a
    # causal diagonal all key tiles reach query tile 0 together and the turns form a staircase.
    # HopperBwdConfig.dq_copies and dq_early_release shorten the staircase and free the dQ
    # buffer before the turn passes, and dq_first_store makes turn 0 a plain store so nothing
    # is zeroed (Note [dQ copies] in fa4_final.common.bwd_tiles); checked and timed on an H100,
    # they were no faster at D = 128 and are reached through config= only.

    # Note [dQ by one warpgroup]
    # At D = 96 dQ = dS K cannot be split between the MMA warpgroups by columns as at D = 128:
    # a 96-element row of K takes the 64 B swizzle, whose atom is 32 columns wide, and 48
    # columns a warpgroup would cut one (HopperBwdConfig.check refuses it). dq_single_wg gives
    # warpgroup 0 the whole tile_m x D tile (one m64nDk16 chain over all 128 keys, reading both
    # warpgroups' dS from shared memory as before) and warpgroup 1 none: it issues dK += dS^T
    # Q right behind dV += P^T dO and releases dO when dV is done. mma() is compiled twice
    # (dq_wg, a compile-time flag): the warpgroups branch once, before their loops, never
    # inside a step. A step's dQ leaves as one chunk (tile_m x D floats, one bulk add), in
    # the order of Note [dQ in accumulator order] with one writer warpgroup, and bwd_post
    # reads it back with that warpgroup's 128 threads (dq_threads). The cost is balance:
    # warpgroup 0 runs 28 wgmma K-steps a step (S^T 6, dP^T 6, dV 4, dK 4, dQ 8 at tile_m =
    # 64), warpgroup 1 runs 20; both keep the 240-register budget (warpgroup 0 holds dQ's 48
    # floats a thread beside dV's and dK's 48 each). The FA4 package's Hopper backward makes
    # the same choice at D = 96. Its GPU tests against float64 and the three sanitizers are
    # in Note [Barriers of two builds].

    # Note [dV head dim]
    # Q, K, dQ and dK have D columns; V, dO (and O, read by bwd_pre for delta) and dV have dv.
    # D enters S^T = K Q^T (its K), dK += dS^T Q (its N) and dQ; dv enters dP^T = V dO^T (its
    # K) and dV += P^T dO (its N), so with dv != D the dV GEMM takes a tiled MMA of its own
    # (mma_dv: the same atoms with N = dv) and the dO ring, V, the dV store and the TMA boxes
    # of V, dO and dV take dv, as does HopperBwdConfig.smem_bytes(head_dim, head_dim_v). With
    # dv == D every one of these is the object it was (the same layouts, the same tiled MMA),
    # so those builds are the kernels they were. Registers: dV holds 64 x dv / 128 floats a
    # thread and dK 64 x D / 128: 64 + 96 at D = 192, dv = 128.

    # Note [dQ split unevenly]
    # At D = 192, dv = 128 the dK and dV accumulators take 160 of a thread's 240 registers, so
    # a step can hold little more: at tile_m = 64 S^T and dP^T (32 each) and dQ (48) spill,
    # and with this split tile_m = 48 still spills (16 instructions when compiled for sm_90a).
    # tile_m = 32 halves S^T and dP^T; dQ^T = K^T dS^T (dq_swap_ab: D on the wgmma M, tile_m
    # = 32 its N) then has three 64-row blocks of D, which the two MMA warpgroups cannot share
    # evenly: dq_uneven gives warpgroup 0 rows 0-127 (two m64n32k16 chains over 128 keys, 32
    # floats a thread) and warpgroup 1 rows 128-191 (one chain, 16 floats). mma() is compiled
    # once per part (dq_part, a compile-time 0 or 1, which also stands for the warpgroup
    # index in its barriers), the warpgroups branching once before their loops. Each part
    # reads its own rows of K^T (a 64-row-aligned slice of the 128 B swizzled K, so the
    # descriptors are those of a whole tile) and both read all of dS. The slab order is that
    # of one warpgroup holding the whole D x tile_m tile (register i = v + 16 m of m64n32's
    # 16 per M-block, dq_copy(1)): warpgroup 0's 32 registers are its first 4096 floats and
    # warpgroup 1's 16 the 2048 after, because M-block 2 of that one warpgroup's tile is
    # exactly warpgroup 1's. So the dQ warp adds two chunks a step, of 16 KB and 8 KB, at
    # offsets 0 and 4096 floats (dq_at, dq_bytes), and bwd_post reads the slab as one
    # warpgroup's (dq_threads = 128, the one-warpgroup tiled MMA's coordinates). The FA4
    # package runs this shape as 64 x 96 with dK and dV swapped instead; this split keeps the
    # kernel's structure (keys on M for S^T, P in registers) and compiled clean for sm_90a
    # (161 KB of shared memory, no spill); its GPU checks are in
    # Note [Barriers of two builds]. D = dv = 192 does not fit
    # this structure: dK and dV alone take 96 + 96 of the 240 registers (64 keys a warpgroup,
    # on the wgmma M), and compiled for sm_90a the same split spills at tile_m = 32 (144 B of
    # stack, 155 spill instructions, 185 KB of shared memory; 163 with one Q/dO stage) and
    # at tile_m = 16 ptxas serialises 132 wgmma instead. Fewer keys a thread needs the keys
    # on the wgmma N axis, dK^T and dV^T with the head dim on M: Note [dK and dV swapped].

    # Note [dK and dV swapped]
    # D = dv = 192 and D = 256 (HopperBwdConfig.dkv_swap_ab, mma_swapped/step_swapped). With
    # 64 keys a warpgroup on the wgmma M, dK and dV hold 2 x 64 x D / 128 floats a thread: 192
    # of 240 registers at D = 192, 256 at D = 256, before S, dP and dQ. Swapped, the head dim is
    # the M of dK^T += Q^T dS and dV^T += dO^T P and the keys their N, so the key tile can shrink
    # below 128 without the M's 64-row granule: swap_tile_n = 96 at D = 192 (the warpgroups
    # split the keys, 48 each: dK^T and dV^T are 192 x 48, 72 floats a thread each) and 48 at
    # D = 256 (the warpgroups split D, 128 rows each: 128 x 48, 48 floats each). S = Q K^T and
    # dP = dO V^T keep the queries on M (tile_m = 64) with the warpgroups splitting the keys
    # (64 x 48, or 64 x 24 at D = 256), so lse and delta are row values and the forward's mask
    # (common.mask.apply_mask) applies as it is. Neither GEMM's accumulator is an A operand of
    # the dK/dV GEMMs any more: P and dS both go to shared memory (stmatrix, queries on the rows;
    # one buffer each, stages_ds = 1, a DS_FREE barrier before they are overwritten), swizzled
    # for an atom of pds_major() keys, so that each warpgroup's keys of S and of dK^T, dV^T are
    # whole atoms (48 keys: the 32 B swizzle; 24: none). dQ is Note [dQ split unevenly]'s
    # dQ^T = K^T dS^T by rows of D (128 + 64 at D = 192, 128 + 128 at 256), K = the tile's keys,
    # in the same accumulator order, so bwd_pre and bwd_post are unchanged. The epilogue stores
    # dK^T and dV^T with a transposing stmatrix into (D, n) views of the K and V tiles, then
    # the same TMA or row-by-row store. Shared memory: two Q stages and one dO stage (the dO
    # ring has its own depth here, HopperBwdConfig.stages_do, with a pipeline state of its own
    # in the TMA warp and the MMA warpgroups), 217 KB at D = 192 and 221 KB at 256, as the FA4
    # package keeps them; two dO stages too would take 241 KB and 252 KB.
    # Compiled for sm_90a: no spill, no stack, no wgmma serialised; per step a warpgroup issues
    # 12 + 12 + 12 + 12 m64n48k16 at D = 192 (S, dP, dV^T, dK^T) and 12 or 6 m64n64k16 (dQ^T).
    # A softcap build computes P and dS as Note [Softcap in the backward] says (S and dP are
    # 24 floats a thread here, so lse is read once, before S is ready). Its GPU checks are in
    # Note [Barriers of two builds].

    # Note [Barriers of two builds]
    # DS_FREE, DS_READY and EPILOGUE are blocking named barriers of both MMA warpgroups (256
    # threads). With one build of the MMA loop (D = 64, 128) both warpgroups wait at the same
    # instruction, and cute.arch.barrier's bar.sync is right; bar.sync is implicitly .aligned,
    # a promise that every thread waiting at one generation of the barrier executes that same
    # instruction. Under Note [dQ by one warpgroup], Note [dQ split unevenly] and
    # Note [dK and dV swapped] each warpgroup runs a build of its own, so the two wait at two
    # bar.sync instructions of one id: undefined in PTX. The results were right on an H100, but
    # compute-sanitizer's synccheck reported "Divergent thread(s) in block" at warpgroup 0's
    # first such barrier (DS_READY at D = 96, DS_FREE at D = dv = 192 and 256) and the launch
    # failed. These builds wait with barrier.cta.sync without .aligned (sync_mma): in SASS the
    # same BAR.SYNC, but ptxas lists its offset among the cubin's cooperative-group instruction
    # offsets (.nv.info attribute 0x28, beside the shuffles'), where no bar.sync is listed, and
    # schedules a few instructions around it differently. The default builds keep bar.sync and
    # their SASS. The dQ warp's hand-offs (DQ_EMPTY, DQ_FULL) are legal in every build: in each
    # generation one side waits, at one instruction, and the other only arrives. On an H200
    # synccheck accepts the unaligned barrier: 0 errors in each of the four builds (the fp16
    # 2 x 77 x 77 cases, which passed against float64 under it). racecheck then found the
    # stage releases of these builds unordered after some threads' reads,
    # Note [Release after the warp's reads]; with that fixed, on an H100, racecheck reports
    # 0 hazards in each of the four builds and their float64 suites pass (lengths 1 to 4097,
    # seqlen_q != seqlen_k both ways, GQA and MQA, windows, varlen, fp16, deterministic
    # bitwise over 5 runs, and through the API's autograd), memcheck 0 errors in the swapped
    # two. D = 64 and 128 keep one build and bar.sync, and since every MMA thread releases
    # its stages there too, racecheck reports 0 hazards in them
    # (Note [Release after the warp's reads]).

    # Note [Release after the warp's reads]
    # A Q or dO stage carries the tile's lse or delta, which each MMA thread reads from shared
    # memory (ld.shared, a few floats a step) before the stage is released. A release is an
    # arrive on the stage's EMPTY mbarrier with release semantics: it orders the arriving
    # thread's own earlier accesses before the TMA warp's refill, nobody else's. With one lane
    # a warp arriving (the usual pattern, eight arrivals for the eight MMA warps), the other 31
    # lanes' reads are ordered before that arrive only through a barrier all of them pass in
    # between: in the one-build kernels (D = 64, 128) the bar.sync of DS_READY and of the dQ
    # hand-off does that. In the builds of two loops those barriers are barrier.cta.sync without
    # .aligned (Note [Barriers of two builds]), and compute-sanitizer's racecheck, on an H100,
    # reported the TMA warp's bulk copies of lse and delta racing with the MMA threads' reads
    # of them in all four builds. Whether the sanitizer simply does not count an unaligned
    # barrier as ordering, or the hardware could let a lane read late, we did not establish; a
    # bar.warp.sync before the arrive would state the order, but ptxas removes it from the SASS
    # of a converged warp, where the sanitizer looks. So in these builds every MMA thread
    # arrives (EMPTY counts 256 arrivals, release()), each arrive ordering its own thread's
    # reads: no assumption about lanes left, 0 hazards under racecheck. The cost is 32 arrives
    # a warp instead of one, twice a step.
    # The one-build kernels (D = 64, 128) had the same kind of report with one lane a warp
    # arriving and bar.sync between: on an H100 (2026-12-06) racecheck found 2 hazards in the
    # D = 128 build, causal and dense alike, 2 in the deterministic causal one and 6 over
    # three D = 64 runs (causal, dense, deterministic causal), each a write in the producer's
    # code against reads in the MMA steps. With every thread arriving
    # (HopperBwdConfig.release_every_thread, the default) racecheck reports 0 at both head
    # dims in all three, synccheck and memcheck 0 errors, the float64 suites pass, and the
    # gradients are bitwise the one-lane build's (dK, dV in the default mode; all three in
    # the deterministic one). Over eight shapes (D = 64 and 128, S = 4096 and 16384, causal or
    # not), calls back to back and after an L2 flush, nine rounds: in the default mode the
    # every-thread build was nowhere slower beyond the run-to-run spread and 1% faster at
    # D = 64, S = 4096 causal; in the deterministic mode 0.5-0.7% slower at S = 4096 causal
    # with calls back to back (beyond a spread of 0.4-0.6%), within the spread elsewhere.
    # Whether the hardware could ever let a lane's read land after its warp's one-lane arrive
    # we did not establish; the every-thread release needs no answer to that.

    @cute.jit
    def store_dq(self, mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b, work, seqlen_q, seqlen_k,
                 window_left, window_right, seq=None):
        """dQ warp: per step, both warpgroups' float32 dQ blocks into the accumulator, each
        with one bulk add (Note [dQ in accumulator order]); in turn when deterministic."""
        m_min, m_max, _, _, head0, group, *_ = work
        m_base = None  # varlen: the sequence's first padded tile (Note [Varlen backward])
        if const_expr(seq is not None):
            m_base = seq[2]
        lane = cute.arch.lane_idx()
        wgs = self.dq_warpgroups  # chunks a step (Note [dQ by one warpgroup])
        handshake = THREADS_PER_WARPGROUP + WARP_SIZE
        # Note [dQ copies] (fa4_final.common.bwd_tiles): this key tile's accumulator copy
        copies, early = self.cfg.dq_copies, self.cfg.dq_early_release
        copy = None
        if const_expr(copies > 1):
            copy = n_block % copies
        for h in cutlass.range(group, unroll=1):
            head = head0 + h
            gAcc = mdQaccum[None, head, b]  # (s_padded * D,)
            for i in cutlass.range(m_min, m_max, unroll=1):
                m_block = self.walk_tile(i, work)
                m_pad = m_block  # its tile of lse_log2, delta, dQ accumulator, turns
                if const_expr(m_base is not None):
                    m_pad = m_base + m_block
                for w in cutlass.range_constexpr(wgs):
                    # the previous step's add of buffer w must have read it (groups retire in
                    # order: w = 0 was committed first)
                    if const_expr(not self.cfg.deterministic):
                        if lane == 0:
                            cute.arch.cp_async_bulk_wait_group(wgs - 1 - w, read=True)
                        cute.arch.sync_warp()
                    if const_expr(early):  # the previous step handed the buffers back
                        if h + i - m_min == 0:  # the CTA's first step
                            cute.arch.barrier_arrive(
                                barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + w,
                                number_of_threads=handshake)
                    else:
                        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + w,
                                                 number_of_threads=handshake)
                turn_ptr = None
                if const_expr(self.cfg.deterministic and copies > 1):
                    turn_ptr = mTurn[None, head, b].iterator + (m_pad * copies + copy)
                    if lane == 0:
                        wait_turn(turn_ptr, dq_turn(self.window, n_block, m_block, num_n_blocks,
                                                    seqlen_q, seqlen_k, window_left,
                                                    window_right) // copies)
                    cute.arch.sync_warp()
                elif const_expr(self.cfg.deterministic):
                    turn_ptr = mTurn[None, head, b].iterator + m_pad
                    if lane == 0:
                        wait_turn(turn_ptr, self.turn(n_block, m_block, num_n_blocks, seqlen_q,
                                                      seqlen_k, window_left, window_right, work))
                    cute.arch.sync_warp()
                for w in cutlass.range_constexpr(wgs):
                    cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_FULL_WG0) + w,
                                      number_of_threads=handshake)
                    if lane == 0:
                        offset = m_pad * (self.tile_m * self.head_dim) + self.dq_at(w)
                        if const_expr(copies > 1):
                            offset = ((m_pad * copies + copy) * (self.tile_m * self.head_dim)
                                      + self.dq_at(w))
                        first = None
                        if const_expr(self.cfg.dq_first_store):  # its turn at its copy
                            first = dq_turn(self.window, n_block, m_block, num_n_blocks,
                                            seqlen_q, seqlen_k, window_left, window_right)
                            if const_expr(copies > 1):
                                first = first // copies
                        self.issue_dq_chunk(gAcc, offset, self.dq_src(sdQ, w), w, first)
                if const_expr(self.cfg.deterministic):
                    if const_expr(early):  # the buffers back once read, before the turn passes
                        if lane == 0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.sync_warp()
                        if (group - 1 - h) + (m_max - 1 - i) != 0:  # a next step follows
                            for w in cutlass.range_constexpr(wgs):
                                cute.arch.barrier_arrive(
                                    barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + w,
                                    number_of_threads=handshake)
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        cute.arch.fence_acq_rel_gpu()
                        pass_turn(turn_ptr)
                    cute.arch.sync_warp()
        if lane == 0:  # shared memory must outlive the last add's reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    # Note [Two dQ buffers]
    # In the deterministic mode the dQ warp waits for a query tile's turn before its bulk add
    # and for the add to complete before it passes the turn on; with one staging buffer the MMA
    # warpgroups cannot store the next step's dQ until then, so a CTA whose turn comes late
    # stalls its tensor cores on the hand-off. With dq_buffers = 2, step s (counted over the
    # CTA's heads and query tiles, the order all three roles walk) uses buffer s % 2, which is
    # the parity of its Q stage (stages_q even, one stage a step): the warpgroups store step
    # s + 1's dQ while the warp waits for step s's turn. Each buffer keeps its own EMPTY and
    # FULL barriers (dq_barrier_ids); the warp arrives on a buffer's EMPTY once before its
    # first step and again after each of its steps that a later step of that buffer follows,
    # so the arrivals equal the warpgroups' waits and none is left at the CTA's end. The adds
    # and their order are the one-buffer kernel's: only when a warpgroup may store changes.
    # On an H100 (2026-12-06) every gradient equalled the one-buffer kernel's bit for bit
    # (float64 suites, 20 runs, varlen; memcheck and synccheck clean, racecheck the one-buffer
    # kernel's two hazards of one lane a warp releasing, before release_every_thread,
    # Note [Release after the warp's reads]), but the backward was no
    # faster at any of eight shapes (D = 64 and 128, S = 4096 and 16384, causal or not) and
    # 3-4% slower at S = 4096 causal. A hypothesis, not profiled: the dQ warp's own cycle
    # (turn, add, completion, pass) sets the pace, so the warpgroups only move their wait to
    # the next hand-off. Note [Adds in flight across turns] gives each buffer its own dQ warp,
    # and with it the two buffers are faster.

    # Note [Adds in flight across turns]
    # With two buffers one dQ warp still runs one step at a time: wait for the turn, add, wait
    # for the add to complete, pass the turn. Its cycle holds the add's whole round trip to L2,
    # and the next step's add cannot start inside it even when that step's turn has come.
    # Under dq_adds_overlap two warps of the producer warpgroup share the steps: warp 1 takes
    # the even steps and buffer 0, warp 2 (otherwise idle) the odd steps and buffer 1, each
    # running the one-warp cycle on its own steps (dq_step_in_turn). So step s + 1's add can be
    # in flight while step s's completes, and each turn still passes as soon as its own add has
    # completed. Bulk groups are counted per thread, so each warp's lane 0 waits for its own
    # adds only; each buffer's EMPTY and FULL barriers keep their 128 + 32 threads (one MMA
    # warpgroup, one dQ warp). Each query tile receives the same adds in the same order (a turn
    # passes only after its add has completed), so every gradient must equal the one-warp
    # kernel's bit for bit. No new wait: a warp waits for turns (CTAs launched before,
    # Note [Turn order] in fa4_final.common.bwd_tiles) and for its buffer, which the MMA warpgroups
    # fill in step order. Passing a turn only after the next step's add had been issued, with
    # one warp, would have chained the key tiles instead: key tile n could then pass query tile
    # m only once key tile n - 1 had passed query tile m + 1.
    # On an H100 (2026-12-07, five interleaved rounds, calls back to back, S = 4096 and 16384,
    # causal or not) the deterministic backward took 1.02-1.17x the default's time at D = 128
    # (64 query rows) and 1.09-1.34x at D = 64 with it, against 1.13-1.28x and 1.13-1.37x with
    # one buffer and one warp; every gradient bitwise the one-warp kernel's, memcheck, racecheck
    # and synccheck clean. It is the deterministic default at D = 64 and 128.

    @cute.jit
    def store_dq_two_buffers(self, mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b, work,
                             seqlen_q, seqlen_k, window_left, window_right, seq=None,
                             parity: cutlass.Constexpr = None):
        """dQ warp under dq_buffers = 2 (Note [Two dQ buffers]): store_dq's deterministic path
        with step s's chunks read from buffer s % 2. ``parity`` (dq_adds_overlap,
        Note [Adds in flight across turns]): this warp takes only the steps with
        s % 2 == parity, and buffer ``parity``; another dQ warp takes the others."""
        m_min, m_max, _, _, head0, group, *_ = work
        m_base = None  # varlen: the sequence's first padded tile (Note [Varlen backward])
        if const_expr(seq is not None):
            m_base = seq[2]
        wgs = self.dq_warpgroups
        handshake = THREADS_PER_WARPGROUP + WARP_SIZE
        per_head = m_max - m_min
        steps = group * per_head
        for buf in cutlass.range_constexpr(2):  # both buffers start empty
            if const_expr(parity is None or parity == buf):
                if steps > buf:
                    for w in cutlass.range_constexpr(wgs):
                        cute.arch.barrier_arrive(barrier_id=dq_barrier_ids(buf)[0] + w,
                                                 number_of_threads=handshake)
        for h in cutlass.range(group, unroll=1):
            head = head0 + h
            gAcc = mdQaccum[None, head, b]  # (s_padded * D,)
            for i in cutlass.range(m_min, m_max, unroll=1):
                m_block = self.walk_tile(i, work)
                m_pad = m_block  # its tile of lse_log2, delta, dQ accumulator, turns
                if const_expr(m_base is not None):
                    m_pad = m_base + m_block
                s = h * per_head + (i - m_min)
                if const_expr(parity is None):
                    self.dq_step_in_turn(gAcc, mTurn, sdQ, s % 2, s, steps, head, m_block,
                                         m_pad, n_block, num_n_blocks, b, seqlen_q, seqlen_k,
                                         window_left, window_right, work)
                else:
                    if s % 2 == parity:
                        self.dq_step_in_turn(gAcc, mTurn, sdQ, parity, s, steps, head,
                                             m_block, m_pad, n_block, num_n_blocks, b,
                                             seqlen_q, seqlen_k, window_left, window_right,
                                             work)

    @cute.jit
    def dq_step_in_turn(self, gAcc, mTurn, sdQ, buf, s, steps, head, m_block, m_pad, n_block,
                        num_n_blocks, b, seqlen_q, seqlen_k, window_left, window_right, work):
        """One step of a dQ warp under dq_buffers = 2: wait for the query tile's turn and for
        buffer ``buf`` (0 or 1) to be full, add its chunks, wait for the adds to complete, pass
        the turn, and hand the buffer back if step s + 2 writes it. With dq_copies the step
        adds into its key tile's copy and takes turns among that copy's visitors only
        (Note [dQ copies] in fa4_final.common.bwd_tiles), as store_dq does."""
        lane = cute.arch.lane_idx()
        wgs = self.dq_warpgroups
        handshake = THREADS_PER_WARPGROUP + WARP_SIZE
        slab = self.tile_m * self.head_dim  # floats of one buffer and of one query tile
        turn = self.turn(n_block, m_block, num_n_blocks, seqlen_q, seqlen_k, window_left,
                         window_right, work)
        at = m_pad  # the accumulator slab and turn counter of this step
        if const_expr(self.cfg.dq_copies > 1):
            at = m_pad * self.cfg.dq_copies + n_block % self.cfg.dq_copies
            turn = turn // self.cfg.dq_copies
        turn_ptr = mTurn[None, head, b].iterator + at
        if lane == 0:
            wait_turn(turn_ptr, turn)
        cute.arch.sync_warp()
        for w in cutlass.range_constexpr(wgs):
            self.dq_buffer_barrier(buf, True, w, handshake)
            if lane == 0:
                self.issue_dq_chunk(gAcc, at * slab + self.dq_at(w),
                                    self.dq_src(sdQ, w) + buf * slab, w, turn)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.fence_acq_rel_gpu()
            pass_turn(turn_ptr)
        cute.arch.sync_warp()
        if s + 2 < steps:  # a later step writes this buffer: hand it back
            self.dq_buffer_empty(buf, wgs, handshake)

    @cute.jit
    def dq_buffer_empty(self, buf, wgs: int, handshake: int) -> None:
        """The dQ warp hands staging buffer ``buf`` back to the MMA warpgroups: one arrive on
        each chunk's EMPTY barrier (Note [Two dQ buffers])."""
        for w in cutlass.range_constexpr(wgs):
            self.dq_buffer_barrier(buf, False, w, handshake)

    @cute.jit
    def dq_buffer_barrier(self, buf, full: cutlass.Constexpr[bool], w: cutlass.Constexpr[int],
                          handshake: int) -> None:
        """The dQ warp at chunk ``w``'s barrier of staging buffer ``buf`` (0 or 1; a Python
        int when the warp owns one buffer, Note [Adds in flight across turns], so only that
        buffer's barrier is traced): FULL waits, EMPTY arrives."""
        op = cute.arch.barrier if const_expr(full) else cute.arch.barrier_arrive
        which = 1 if const_expr(full) else 0
        if const_expr(isinstance(buf, int)):
            op(barrier_id=dq_barrier_ids(buf)[which] + w, number_of_threads=handshake)
        elif buf == 0:
            op(barrier_id=dq_barrier_ids(0)[which] + w, number_of_threads=handshake)
        else:
            op(barrier_id=dq_barrier_ids(1)[which] + w, number_of_threads=handshake)

    @cute.jit
    def issue_dq_chunk(self, gAcc, offset, src, w: int, first_turn) -> None:
        """One lane of the dQ warp: chunk ``w`` of a step from shared memory ``src`` into the
        accumulator ``gAcc`` at ``offset``, a bulk add committed as its own bulk group; under
        dq_first_store a plain bulk store when ``first_turn`` (the step's turn at its
        accumulator copy) is 0, writing over the unzeroed slab (Note [dQ copies])."""
        if const_expr(self.cfg.dq_first_store):
            if first_turn == 0:  # the address formed in each branch: the SASS the inline code had
                bulk_store_f32(gAcc.iterator + offset, src, self.dq_bytes(w))
            else:
                bulk_add_f32(gAcc.iterator + offset, src, self.dq_bytes(w))
        else:
            bulk_add_f32(gAcc.iterator + offset, src, self.dq_bytes(w))
        cute.arch.cp_async_bulk_commit_group()

    def dq_at(self, w: int) -> int:
        """Where chunk ``w`` of a step's dQ starts in its query tile's slab (floats)."""
        if self.cfg.dq_uneven:  # Note [dQ split unevenly]
            return self.dq_part(w)[0] * self.tile_m
        return w * self.dq_chunk

    def dq_bytes(self, w: int) -> int:
        """Bytes of chunk ``w`` of a step's dQ (one bulk add)."""
        if self.cfg.dq_uneven:
            return self.dq_part(w)[1] * self.tile_m * 4
        return self.dq_chunk * 4

    def dq_src(self, sdQ: cute.Tensor, w: int):
        """Chunk ``w`` of the dQ staging buffer, the bulk add's source."""
        if self.cfg.dq_uneven:
            return sdQ.iterator + self.dq_at(w)
        return sdQ[None, w].iterator

    def wgmma(self, tiled_mma, acc, tA, tB, accumulate):
        """Issue acc (+)= A B as one async group (fa4_final.hopper.wgmma.issue_wgmma)."""
        issue_wgmma(tiled_mma, acc, tA, tB, accumulate)

    @cute.jit
    def mma(self, mdK, mdV, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, tma_atom_dk, tma_atom_dv,
            mma_sdp, mma_dkv, mma_dq, pipeline_q, pipeline_do, pipeline_kv, softmax_scale,
            scale_log2, window_left, window_right, n_block, head_kv, b, seqlen_q, seqlen_k,
            work, seq=None, mdK_rows=None, mdV_rows=None, dq_wg: cutlass.Constexpr[bool] = True,
            dq_part: cutlass.Constexpr = None):
        """MMA warpgroups: every step of the CTA, then the dK, dV epilogue. With a softcap,
        ``scale_log2`` carries scale / softcap (Note [Softcap]). ``dq_wg``: this warpgroup
        issues the dQ GEMM (False only for warpgroup 1 under Note [dQ by one warpgroup]).
        ``dq_part``: under dq_uneven, this build's warpgroup (0 or 1), whose part of dQ^T it
        computes (Note [dQ split unevenly])."""
        m_min, m_max, n_first, n_last, _, group, *_ = work
        cap = ()  # passed only to a softcap build: a subclass's step keeps its signature
        if const_expr(self.logit_softcap):
            cap, scale_log2 = (scale_log2,), Float32(self.logit_softcap * LOG2_E)
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. 255
        if const_expr(dq_part is not None):  # Note [dQ split unevenly]: known at compile time
            wg = dq_part
        else:
            wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_sdp = mma_sdp.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_dkv = mma_dkv.get_slice(wg * THREADS_PER_WARPGROUP)
        single = const_expr(self.dq_warpgroups != BWD_MMA_WARPGROUPS or dq_part is not None)
        if const_expr(single):  # Note [dQ by one warpgroup]: one warpgroup's tiled MMA
            wg_dq = mma_dq.get_slice(0)
        else:
            wg_dq = mma_dq.get_slice(wg * THREADS_PER_WARPGROUP)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        if const_expr(dq_part is not None):
            thr_dq = mma_dq.get_slice(tidx - dq_part * THREADS_PER_WARPGROUP)
        else:
            thr_dq = mma_dq.get_slice(tidx)
        wg_dv, thr_dv = wg_dkv, thr_dkv
        if const_expr(self.head_dim_v != self.head_dim):  # Note [dV head dim]
            mma_dv = self.mma_dv(mma_dkv)
            wg_dv = mma_dv.get_slice(wg * THREADS_PER_WARPGROUP)
            thr_dv = mma_dv.get_slice(tidx)
        # operands: A and B descriptors per warpgroup, accumulators per thread
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))  # (MMA, 1, D/16)
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))  # (MMA, 1, D/16, STAGE)
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdO = wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sdO)))  # (.., m/16, ST)
        tdKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sQ)))
        if const_expr(not dq_wg):  # Note [dQ by one warpgroup]: warpgroup 1 has no dQ GEMM
            tdQrA = tdQrB = thr_dq = None
        elif const_expr(dq_part is not None):  # dQ^T = K^T dS^T, this warpgroup's rows of D
            first, rows = self.dq_part(dq_part)
            kT = cute.local_tile(transposed(sK), (rows, self.tile_n), (first // rows, 0))
            tdQrA = wg_dq.make_fragment_A(wg_dq.partition_A(kT))  # (.., rows/64, n/16)
            tdQrB = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))  # (.., n/16, STAGE)
        elif const_expr(self.cfg.dq_swap_ab):  # dQ^T = K^T dS^T
            tdQrA = wg_dq.make_fragment_A(wg_dq.partition_A(transposed(sK)))  # (.., n/16)
            tdQrB = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))  # (.., n/16, STAGE)
        else:  # dQ = dS K
            tdQrA = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))  # (.., n/16, STAGE)
            tdQrB = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))  # (.., n/16)
        shape_st = thr_sdp.partition_shape_C((self.tile_n, self.tile_m))  # ((2,2,m/8),1,1)
        shape_a = thr_dkv.partition_shape_A((self.tile_n, self.tile_m))  # ((2,2,2),1,m/16)
        acc_dv = cute.make_rmem_tensor(thr_dv.partition_shape_C((self.tile_n, self.head_dim_v)),
                                       Float32)
        if const_expr(self.head_dim_v == self.head_dim):
            acc_dk = cute.make_rmem_tensor_like(acc_dv)
        else:
            acc_dk = cute.make_rmem_tensor(
                thr_dkv.partition_shape_C((self.tile_n, self.head_dim)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        # dS^T registers -> dS in shared memory: stmatrix, transposed
        st_t = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        thr_st_t = cute.make_tiled_copy_C(st_t, mma_sdp).get_slice(tidx)
        tdSsdS = thr_st_t.partition_D(transposed(sdS))  # (CPY, .., STAGE)
        # dQ registers -> its float32 staging buffer, 16 B per thread
        # (Note [dQ in accumulator order])
        tdQsdQ = None
        if const_expr(dq_part is not None):  # this part's run of the slab
            t_part = tidx - dq_part * THREADS_PER_WARPGROUP
            tdQsdQ = self.dq_copy().get_slice(t_part).partition_D(self.dq_part_view(sdQ, dq_part))
        elif const_expr(dq_wg):
            tdQsdQ = self.dq_copy().get_slice(tidx).partition_D(sdQ)
            if const_expr(self.cfg.dq_buffers == 2):  # Note [Two dQ buffers]: both buffers
                sdQ1 = cute.make_tensor(sdQ.iterator + self.tile_m * self.head_dim, sdQ.layout)
                tdQsdQ = (tdQsdQ, self.dq_copy().get_slice(tidx).partition_D(sdQ1))
        # (key, query) of each accumulator element, this thread and thread 0: the mask
        tScS, t0ScS = fragment_coords(thr_sdp, (self.tile_n, self.tile_m))
        ops = (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrA, tdQrB, st_t, thr_st_t, tdSsdS,
               tdQsdQ, thr_dq)
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages_q)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        n_steps = m_max - m_min
        if n_steps > 0:
            pipeline_kv.consumer_wait(state_kv)
        step = lambda m_block, masked, sq_: self.step(  # noqa: E731
            m_block, masked, wg, sq_, ops, acc_dv, acc_dk, shape_st, shape_a, sLSE,
            sDelta, thr_sdp, tScS, t0ScS, mma_sdp, mma_dkv, mma_dq, pipeline_q, pipeline_do,
            scale_log2, window_left, window_right, n_block, seqlen_q, seqlen_k, *cap)
        # Split the range, not the body: masked steps, unmasked steps, masked steps
        first_end = m_min + n_first
        last_start = cutlass.max(m_max - n_last, first_end)
        for _h in cutlass.range(group, unroll=1):
            for i in cutlass.range(m_min, first_end, unroll=1):
                state_q = step(self.walk_tile(i, work), True, state_q)
            for i in cutlass.range(first_end, last_start, unroll=1):
                state_q = step(self.walk_tile(i, work), False, state_q)
            if const_expr(self.window.has_left):
                for i in cutlass.range(last_start, m_max, unroll=1):
                    state_q = step(self.walk_tile(i, work), True, state_q)
        self.epilogue(acc_dk, acc_dv, mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, mma_dkv,
                      softmax_scale, tidx, n_block, head_kv, b, seq, seqlen_k, mdK_rows,
                      mdV_rows)

    # ------------------------------------------------------------------------------------------
    # dK and dV swapped (HopperBwdConfig.dkv_swap_ab)
    # ------------------------------------------------------------------------------------------
    def dkv_splits_keys(self) -> bool:
        """Under dkv_swap_ab: the MMA warpgroups split dK^T, dV^T by keys (an odd number of
        64-row blocks of D: 192) or by rows of D (256), Note [dK and dV swapped]."""
        return self.head_dim // WGMMA_M % 2 == 1

    def pds_major(self) -> int:
        """Columns (keys) of the P and dS swizzle atom: a whole number of atoms in each
        warpgroup's keys of S and of dK^T, dV^T (Note [dK and dV swapped])."""
        import math

        keys_s = self.tile_n // BWD_MMA_WARPGROUPS
        keys_dkv = keys_s if self.dkv_splits_keys() else self.tile_n
        return math.gcd(keys_s, keys_dkv)

    def swapped_mmas(self):
        """(S and dP; dK^T and dV^T; dQ^T's part) under dkv_swap_ab: S = Q K^T with the queries
        on M and the warpgroups splitting the keys; dK^T += Q^T dS, dV^T += dO^T P with D on M,
        both operands from shared memory; dQ^T one warpgroup's MMA (Note [dQ split unevenly])."""
        major = cute.nvgpu.OperandMajorMode
        W = BWD_MMA_WARPGROUPS
        mma_s = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.K, major.K, Float32, (1, W, 1),
            (WGMMA_M, self.tile_n // W))
        if const_expr(self.dkv_splits_keys()):
            atoms, tiler = (1, W, 1), (WGMMA_M, self.tile_n // W)
        else:
            atoms, tiler = (W, 1, 1), (WGMMA_M, self.tile_n)
        mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.MN, major.MN, Float32, atoms, tiler)
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major.MN, major.K, Float32, (1, 1, 1),
            (WGMMA_M, self.tile_m))
        return mma_s, mma_dkv, mma_dq

    def swapped_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout):
        """The SharedStorage of dkv_swap_ab: the dense one with P after dS
        (HopperBwdConfig.smem_bytes counts it)."""
        stages, dt = self.cfg.stages_q, self.dtype
        do_stages = self.cfg.do_stages

        R, A = cute.struct.MemRange, cute.struct.Align
        fields = {  # an annotations dict: this module's annotations are strings
            "mbar_q": R[cutlass.Int64, 2 * stages],
            "mbar_do": R[cutlass.Int64, 2 * do_stages],
            "mbar_kv": R[cutlass.Int64, 2],
            "sLSE": A[R[Float32, self.tile_m * stages], 128],
            "sDelta": A[R[Float32, self.tile_m * do_stages], 128],
            "sQ": A[R[dt, cute.cosize(sQ_layout)], 1024],
            "sdO": A[R[dt, cute.cosize(sdO_layout)], 1024],
            "sK": A[R[dt, cute.cosize(sK_layout)], 1024],
            "sV": A[R[dt, cute.cosize(sV_layout)], 1024],
            "sdS": A[R[dt, cute.cosize(sdS_layout)], 1024],
            "sP": A[R[dt, cute.cosize(sdS_layout)], 1024],
            "sdQ": A[R[Float32, self.tile_m * self.head_dim], 1024],
        }
        SwappedStorage = cute.struct(type("SwappedStorage", (), {"__annotations__": fields}))
        return SwappedStorage

    def row_values(self, thr_s, s_vec: cute.Tensor, stage) -> cute.Tensor:
        """A per-query vector of one stage seen through this thread's S fragment (queries on
        the rows): ``[r, 0]`` is the value of the thread's row r."""
        bcast = cute.make_tensor(s_vec[None, stage].iterator, cute.make_layout(
            (self.tile_m, self.tile_n), stride=(1, 0)))
        return acc_rows_cols(thr_s.partition_C(bcast))

    @cute.jit
    def mma_swapped(self, mdK, mdV, sQ, sK, sV, sdO, sdS, sLSE, sDelta, sdQ, tma_atom_dk,
                    tma_atom_dv, mma_sdp, mma_dkv, mma_dq, pipeline_q, pipeline_do,
                    pipeline_kv, softmax_scale, scale_log2, window_left, window_right,
                    n_block, head_kv, b, seqlen_q, seqlen_k, work, seq=None, mdK_rows=None,
                    mdV_rows=None, sP=None, dq_part: cutlass.Constexpr = 0):
        """MMA warpgroup ``dq_part`` (0 or 1) under dkv_swap_ab: every step of the CTA, then the
        dK, dV epilogue (Note [dK and dV swapped]). ``mma_sdp``, ``mma_dkv``, ``mma_dq`` are
        swapped_mmas()'s. With a softcap, ``scale_log2`` carries scale / softcap
        (Note [Softcap in the backward])."""
        m_min, m_max, n_first, n_last, _, group, *_ = work
        cap = ()  # passed only to a softcap build
        if const_expr(self.logit_softcap):
            cap, scale_log2 = (scale_log2,), Float32(self.logit_softcap * LOG2_E)
        wg = dq_part
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - THREADS_PER_WARPGROUP  # 0 .. 255
        wg_s = mma_sdp.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_dkv = mma_dkv.get_slice(wg * THREADS_PER_WARPGROUP)
        wg_dq = mma_dq.get_slice(0)
        thr_s = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx - wg * THREADS_PER_WARPGROUP)
        # S = Q K^T, dP = dO V^T: A the queries' rows, B this warpgroup's keys
        tSrQ = wg_s.make_fragment_A(wg_s.partition_A(sQ))  # (MMA, 1, D/16, STAGE)
        tSrK = wg_s.make_fragment_B(wg_s.partition_B(sK))  # (MMA, 1, D/16)
        tdPrdO = wg_s.make_fragment_A(wg_s.partition_A(sdO))
        tdPrV = wg_s.make_fragment_B(wg_s.partition_B(sV))
        # dV^T += dO^T P, dK^T += Q^T dS: A (D, m) and B (n, m), both MN-major views
        tdVrdO = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed(sdO)))
        tdVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sP)))
        tdKrQ = wg_dkv.make_fragment_A(wg_dkv.partition_A(transposed(sQ)))
        tdKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(transposed(sdS)))
        # dQ^T = K^T dS^T, this warpgroup's rows of D (Note [dQ split unevenly])
        first, rows = self.dq_part(dq_part)
        kT = cute.local_tile(transposed(sK), (rows, self.tile_n), (first // rows, 0))
        tdQrA = wg_dq.make_fragment_A(wg_dq.partition_A(kT))
        tdQrB = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
        shape_s = thr_s.partition_shape_C((self.tile_m, self.tile_n))
        acc_dv = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.head_dim, self.tile_n)),
                                       Float32)
        acc_dk = cute.make_rmem_tensor_like(acc_dv)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        # P and dS registers -> shared memory (queries on the rows, as S)
        keys_wg = self.tile_n // BWD_MMA_WARPGROUPS
        st = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(
            transpose=False, num_matrices=4 if keys_wg % 16 == 0 else 2), self.dtype)
        thr_st = cute.make_tiled_copy_C(st, mma_sdp).get_slice(tidx)
        tPsP = thr_st.partition_D(sP)  # (CPY, .., STAGE)
        tdSsdS = thr_st.partition_D(sdS)
        t_part = tidx - dq_part * THREADS_PER_WARPGROUP
        tdQsdQ = self.dq_copy().get_slice(t_part).partition_D(self.dq_part_view(sdQ, dq_part))
        tScS, t0ScS = fragment_coords(thr_s, (self.tile_m, self.tile_n))
        ops = (tSrQ, tSrK, tdPrdO, tdPrV, tdVrdO, tdVrP, tdKrQ, tdKrdS, tdQrA, tdQrB, st,
               thr_st, tPsP, tdSsdS, tdQsdQ, thr_dq, thr_s, tScS, t0ScS)
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.cfg.stages_q)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.cfg.do_stages)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        n_steps = m_max - m_min
        if n_steps > 0:
            pipeline_kv.consumer_wait(state_kv)
        step = lambda m_block, masked, sq_, sdo_: self.step_swapped(  # noqa: E731
            m_block, masked, wg, sq_, sdo_, ops, acc_dv, acc_dk, shape_s, sLSE, sDelta,
            mma_sdp, mma_dkv, mma_dq, pipeline_q, pipeline_do, scale_log2, window_left,
            window_right, n_block, seqlen_q, seqlen_k, *cap)
        first_end = m_min + n_first
        last_start = cutlass.max(m_max - n_last, first_end)
        for _h in cutlass.range(group, unroll=1):
            for m_block in cutlass.range(m_min, first_end, unroll=1):
                state_q, state_do = step(m_block, True, state_q, state_do)
            for m_block in cutlass.range(first_end, last_start, unroll=1):
                state_q, state_do = step(m_block, False, state_q, state_do)
            if const_expr(self.window.has_left):
                for m_block in cutlass.range(last_start, m_max, unroll=1):
                    state_q, state_do = step(m_block, True, state_q, state_do)
        self.epilogue(acc_dk, acc_dv, mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, mma_dkv,
                      softmax_scale, tidx, n_block, head_kv, b, seq, seqlen_k, mdK_rows,
                      mdV_rows)

    @cute.jit
    def step_swapped(self, m_block, masked: cutlass.Constexpr[bool], wg, state_q, state_do, ops,
                     acc_dv, acc_dk, shape_s, sLSE, sDelta, mma_s, mma_dkv, mma_dq, pipeline_q,
                     pipeline_do, scale_log2, window_left, window_right, n_block, seqlen_q,
                     seqlen_k, cap_scale=None):
        """One query tile against this warpgroup's keys under dkv_swap_ab
        (Note [dK and dV swapped]); fresh S, dP and dQ accumulators
        (Note [Fresh accumulators])."""
        (tSrQ, tSrK, tdPrdO, tdPrV, tdVrdO, tdVrP, tdKrQ, tdKrdS, tdQrA, tdQrB, st, thr_st,
         tPsP, tdSsdS, tdQsdQ, thr_dq, thr_s, tScS, t0ScS) = ops
        stage, do_stage = state_q.index, state_do.index
        pipeline_q.consumer_wait(state_q)
        acc_s = cute.make_rmem_tensor(shape_s, Float32)
        self.wgmma(mma_s, acc_s, tSrQ[None, None, None, stage], tSrK, False)  # S = Q K^T
        pipeline_do.consumer_wait(state_do)
        acc_dp = cute.make_rmem_tensor(shape_s, Float32)
        self.wgmma(mma_s, acc_dp, tdPrdO[None, None, None, do_stage], tdPrV,
                   False)  # dP = dO V^T
        capped = const_expr(cap_scale is not None)
        early = const_expr(self.cfg.rows_early and not capped)
        lse = self.row_values(thr_s, sLSE, stage)
        if const_expr(early):  # Note [Per-query values before the wait]
            lse = _in_registers(lse, 0)
        warpgroup.wait_group(1)  # S is ready; dP may still run
        if const_expr(capped):  # Note [Softcap]: S <- t = tanh(q.k scale / softcap)
            softcap_scores(acc_s, cap_scale)
        if const_expr(masked):
            apply_mask(acc_s, tScS, t0ScS, self.window, m_block, n_block, seqlen_q, seqlen_k,
                       window_left, window_right, mask_left=self.window.has_left)
        s = acc_rows_cols(acc_s)
        rP = cute.make_rmem_tensor_like(acc_s, self.dtype)
        if const_expr(not capped):
            _p_from_scores(s, lse, scale_log2, 0)
            _convert(acc_s, rP)
        delta = self.row_values(thr_s, sDelta, do_stage)
        if const_expr(early):
            delta = _in_registers(delta, 0)
        warpgroup.wait_group(0)  # dP is ready
        _ds_from_dp(s, acc_rows_cols(acc_dp), lse, delta, scale_log2, 0, capped)
        if const_expr(capped):
            _convert(acc_s, rP)
        rdS = cute.make_rmem_tensor_like(acc_dp, self.dtype)
        _convert(acc_dp, rdS)
        # one P and one dS buffer: the other warpgroup's last GEMMs have read them
        self.sync_mma(NamedBarrier.DS_FREE)
        cute.copy(st, thr_st.retile(rP), tPsP[None, None, None, 0])
        cute.copy(st, thr_st.retile(rdS), tdSsdS[None, None, None, 0])
        cute.arch.fence_view_async_shared()  # stmatrix -> wgmma (async proxy)
        self.sync_mma(NamedBarrier.DS_READY)
        self.wgmma(mma_dkv, acc_dv, tdVrdO[None, None, None, do_stage],
                   tdVrP[None, None, None, 0], True)  # dV^T += dO^T P
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_tile_shape(wg)),
                                       Float32)
        self.wgmma(mma_dq, acc_dq, tdQrA, tdQrB[None, None, None, 0], False)  # dQ^T part
        warpgroup.wait_group(1)  # dV done: dO's stage is free
        self.release(pipeline_do, state_do)
        state_do.advance()
        self.wgmma(mma_dkv, acc_dk, tdKrQ[None, None, None, stage],
                   tdKrdS[None, None, None, 0], True)  # dK^T += Q^T dS
        warpgroup.wait_group(1)  # dQ done
        self.dq_to_warp(acc_dq, tdQsdQ, wg)
        warpgroup.wait_group(0)  # dK done: Q's stage is free
        self.release(pipeline_q, state_q)
        state_q.advance()
        return state_q, state_do

    # Note [Softcap in the backward]
    # With a softcap (Note [Softcap] in fa4_final.common.softmax) the score is c t, t = tanh(q.k
    # scale / c), and dS needs the chain rule's factor 1 - t^2 next to P = 2^(t c log2 e - lse):
    # dS = P (dP - delta) (1 - t^2); the dK epilogue and bwd_post then multiply by the scale as
    # they do without a cap. Keeping 1 - t^2 for the whole tile beside P and dP costs a register
    # tile (32 more per thread at D = 128) and spilled; so this build keeps t in S^T until dP^T
    # is done and then computes P, its dS term and the factor element by element: no tile more,
    # but the exponentials no longer run under the dP^T GEMM. The mask writes -inf over t; its
    # t^2 is clamped to 1, so 1 - t^2 = 0 and P = 0 give 0, never 0 * -inf = NaN (tanh keeps
    # every other t^2 <= 1). Nothing is stored by the forward for it.

    # Note [Per-query values before the wait]
    # column_values and row_values are views of shared memory: the LDS that read lse and delta
    # are emitted where P and dS first use them, after the wgmma wait for S (or dP), so each
    # step's first FFMA waits for a shared-memory load that started only once S was ready.
    # ncu on an H100 (D = 128, S = 4096 dense and 16384 causal, beside the FA4 package's
    # main kernel): at 16384 causal that first FFMA, stalled on the short scoreboard, held
    # 7.2% of our kernel's warp samples, its second-most sampled instruction; the two
    # kernels' stall profiles differ most there (short scoreboard 15% and 17% of our samples,
    # 9% and 5% of the package's), and our tensor pipe was busy 75% and 74% of the time
    # against its 77% and 78%. With rows_early the step reads its lse into registers
    # (_in_registers) before the wait for S and its delta before the wait for dP, so the loads
    # run under the GEMMs: the same values, the same arithmetic, the same bits out. Compiled
    # for sm_90a at D = 64 and 128, causal or not: no spill, no LDS left between the wait for S
    # and the first FFMA; at D = 96 and at D = 192 with dv = 128 no spill either. The swapped
    # step (Note [dK and dV swapped], D = 192 and 256) takes the same two reads (query_mode
    # 0): no spill, and no first FFMA after the S wait reads a register loaded after it (ptxas
    # still sinks a delta load past the wait, where nothing waits on it yet). Timed on an H100
    # against the build without it, 5 to 9 interleaved rounds: at D = 256 causal 2-3% less
    # time in each of three runs (rounds' spread under 1%), elsewhere at 192 and 256 within
    # the spread; at D = 128 within the spread; at D = 64 3-9% more time, with the same
    # registers and, but for a few integer instructions, the same SASS instruction mix: ptxas
    # orders the same work differently (a hypothesis, not profiled: the LDS now issue while
    # the GEMMs read their operands from shared memory, and D = 64's shorter GEMMs hide less
    # of that). So it is the swapped builds' default only (hopper_bwd_default); the
    # short-scoreboard wait at D = 128 is not where that build loses its time to the FA4
    # package's. A softcap build reads lse where it did (Note [Softcap in the backward]).

    # Note [Per-query values by shuffle]
    # In the S^T fragment of a wgmma accumulator a thread holds tile_m / 4 query columns, and
    # the eight lane groups of a warp (lane // 4) hold the same ones: column_values makes each
    # thread load all of them, so a warp reads every lse and delta of its columns eight times.
    # With rows_shuffled (tile_m a multiple of 64, the step of D = 64 and 128) the lane group g
    # loads only the columns 8 (g + 8 i) + 2 (lane % 4) + {0, 1}, i < tile_m / 64 (4 values at
    # tile_m = 128; lse once the S GEMM is issued, delta before the wait for dP), and the
    # value of column 8 j + 2 (lane % 4) + e comes by one shuffle from lane 4 (j % 8) + lane %
    # 4, its register 2 (j // 8) + e: an eighth of the loads and a shuffle at each use
    # instead. This is how the FA4 package's Hopper backward reads lse and dPsum at head dims
    # up to 64. The mapping rests on the accumulator's layout (thread 0's columns are 8 j +
    # {0, 1}), which _ShuffledColumns asserts when it traces; a CPU test checks it against the
    # kernel's own S^T partition for all 256 MMA threads. On an H100 (2026-12-07, seven
    # interleaved rounds) the D = 64 backward with it took 0.96-0.98 of the lazy read's time at
    # S = 4096 and 16384, causal or not (beyond the rounds' spread at S = 4096), with the same
    # gradients bit for bit: the D = 64 default. At D = 128, causal (the dense tile has 80 rows),
    # 1.00 and 1.01 of it, within the spread, so off there. The release is unchanged
    # (Note [Release after the warp's reads]): a thread's own loads end before it arrives, and
    # shuffles read registers.

    @cute.jit
    def step(self, m_block, masked: cutlass.Constexpr[bool], wg, state_q, ops, acc_dv, acc_dk,
             shape_st, shape_a, sLSE, sDelta, thr_sdp, tScS, t0ScS, mma_sdp, mma_dkv,
             mma_dq, pipeline_q, pipeline_do, scale_log2, window_left, window_right, n_block,
             seqlen_q, seqlen_k, cap_scale=None):
        """One query tile against this warpgroup's 64 keys: the five GEMMs of the module
        docstring. A fresh accumulator for S, dP and dQ each step: their registers die within
        the step, so ptxas never serialises a wgmma to keep them (Note [Fresh accumulators])."""
        (tSrK, tSrQ, tdPrV, tdPrdO, tdVrdO, tdKrQ, tdQrA, tdQrB, st_t, thr_st_t, tdSsdS, tdQsdQ,
         thr_dq) = ops
        stage = state_q.index
        ds_stage = stage if const_expr(self.cfg.stages_ds > 1) else 0
        pipeline_q.consumer_wait(state_q)
        acc_s = cute.make_rmem_tensor(shape_st, Float32)
        self.wgmma(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, stage], False)  # S^T = K Q^T
        pipeline_do.consumer_wait(state_q)
        acc_dp = cute.make_rmem_tensor(shape_st, Float32)
        self.wgmma(mma_sdp, acc_dp, tdPrV, tdPrdO[None, None, None, stage], False)  # dP^T
        capped = const_expr(cap_scale is not None)
        early = const_expr(self.cfg.rows_early and not capped)
        shuffled = const_expr(self.cfg.rows_shuffled and not capped)
        if const_expr(shuffled):  # Note [Per-query values by shuffle]
            lse = _ShuffledColumns(sLSE, stage, t0ScS, self.tile_m)
        elif const_expr(not capped):
            lse = self.column_values(thr_sdp, sLSE, stage)
            if const_expr(early):  # Note [Per-query values before the wait]
                lse = _in_registers(lse, 1)
        warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
        if const_expr(capped):  # Note [Softcap]: S^T <- t = tanh(q.k scale / softcap)
            softcap_scores(acc_s, cap_scale)
        if const_expr(masked):
            self.mask(acc_s, tScS, t0ScS, n_block, m_block, seqlen_q, seqlen_k, window_left,
                      window_right)
        s = acc_rows_cols(acc_s)
        rP = cute.make_rmem_tensor(shape_a, self.dtype)
        if const_expr(not capped):
            _p_from_scores(s, lse, scale_log2, 1)
            # P^T and dS^T as the A operands of dV += P^T dO, dK += dS^T Q: the same registers
            # in A-fragment order (fragments.acc_as_a_operand), converted to the input dtype
            _convert(acc_as_a_operand(acc_s), rP)
        if const_expr(shuffled):
            delta = _ShuffledColumns(sDelta, stage, t0ScS, self.tile_m)
        else:
            delta = self.column_values(thr_sdp, sDelta, stage)
            if const_expr(early):
                delta = _in_registers(delta, 1)
        warpgroup.wait_group(0)  # dP^T is ready
        if const_expr(capped):  # read here, not across the tanh pass (register pressure)
            lse = self.column_values(thr_sdp, sLSE, stage)
        _ds_from_dp(s, acc_rows_cols(acc_dp), lse, delta, scale_log2, 1, capped)
        if const_expr(capped):
            _convert(acc_as_a_operand(acc_s), rP)
        rdS = cute.make_rmem_tensor(shape_a, self.dtype)
        _convert(acc_as_a_operand(acc_dp), rdS)
        if const_expr(self.cfg.stages_ds == 1):  # the other warpgroup's last dQ GEMM read dS
            self.sync_mma(NamedBarrier.DS_FREE)
        cute.copy(st_t, thr_st_t.retile(rdS), tdSsdS[None, None, None, ds_stage])
        self.wgmma(self.mma_dv(mma_dkv), acc_dv, rP, tdVrdO[None, None, None, stage],
                   True)  # dV += P^T dO
        # generic-proxy smem writes (stmatrix) -> visible to wgmma (async proxy); then both
        # warpgroups' halves of dS are in place
        cute.arch.fence_view_async_shared()
        self.sync_mma(NamedBarrier.DS_READY)
        if const_expr(tdQsdQ is None):  # Note [dQ by one warpgroup]: no dQ GEMM here
            self.wgmma(mma_dkv, acc_dk, rdS, tdKrQ[None, None, None, stage],
                       True)  # dK += dS^T Q
            warpgroup.wait_group(1)  # dV done: dO's stage is free
            self.release(pipeline_do, state_q)
        else:
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_tile_shape(wg)),
                                           Float32)
            if const_expr(self.cfg.dq_swap_ab):
                self.wgmma(mma_dq, acc_dq, tdQrA, tdQrB[None, None, None, ds_stage], False)
            else:
                self.wgmma(mma_dq, acc_dq, tdQrA[None, None, None, ds_stage], tdQrB, False)
            warpgroup.wait_group(1)  # dV done: dO's stage is free
            self.release(pipeline_do, state_q)
            self.wgmma(mma_dkv, acc_dk, rdS, tdKrQ[None, None, None, stage],
                       True)  # dK += dS^T Q
            warpgroup.wait_group(1)  # dQ done
            if const_expr(self.cfg.dq_buffers == 2):  # Note [Two dQ buffers]: Q's parity
                if stage % 2 == 0:
                    self.dq_to_warp(acc_dq, tdQsdQ[0], wg, 0)
                else:
                    self.dq_to_warp(acc_dq, tdQsdQ[1], wg, 1)
            else:
                self.dq_to_warp(acc_dq, tdQsdQ, wg)
        warpgroup.wait_group(0)  # dK done: Q's stage is free
        self.release(pipeline_q, state_q)
        state_q.advance()
        return state_q

    def split_builds(self) -> bool:
        """The two MMA warpgroups run builds of their loop of their own, not one build:
        Note [dQ by one warpgroup], Note [dQ split unevenly], Note [dK and dV swapped]."""
        return bool(self.cfg.dkv_swap_ab or self.cfg.dq_uneven
                    or self.dq_warpgroups != BWD_MMA_WARPGROUPS)

    def sync_mma(self, barrier: NamedBarrier) -> None:
        """Both MMA warpgroups (256 threads) wait at ``barrier``: bar.sync when they run one
        build, barrier.cta.sync without .aligned when each runs its own
        (Note [Barriers of two builds])."""
        if self.split_builds():
            _sync_unaligned(int(barrier), MMA_THREADS)
        else:
            cute.arch.barrier(barrier_id=int(barrier), number_of_threads=MMA_THREADS)

    def release(self, pipe, state) -> None:
        """This MMA thread's release of ``state``'s stage of ``pipe``: in the builds of two loops
        (split_builds) and under release_every_thread (the default) every thread arrives on
        EMPTY, after its own reads of the stage's lse or delta
        (Note [Release after the warp's reads]); with release_every_thread=False the one-build
        kernels release one lane a warp."""
        if const_expr(self.every_thread_releases()):
            pipe.sync_object_empty.arrive(state.index, pipe.consumer_mask)
        else:
            pipe.consumer_release(state)

    def every_thread_releases(self) -> bool:
        """Every MMA thread arrives on a Q or dO stage's EMPTY (256 arrivals), not one lane a
        warp: the builds of two loops, and any build under release_every_thread
        (Note [Release after the warp's reads])."""
        return bool(self.split_builds() or self.cfg.release_every_thread)

    @cute.jit
    def dq_to_warp(self, acc_dq, tdQsdQ, wg, buf: cutlass.Constexpr[int] = 0):
        """Both steps' hand-off of this warpgroup's dQ (its finished accumulator) to the dQ warp:
        wait until the warp has read the buffer's last dQ, store the accumulator there in
        accumulator order (Note [dQ in accumulator order]), fence it for the bulk add (async
        proxy) and say it is there. ``buf``: which staging buffer (Note [Two dQ buffers])."""
        empty, full = dq_barrier_ids(buf)
        cute.arch.barrier(barrier_id=empty + wg,
                          number_of_threads=THREADS_PER_WARPGROUP + WARP_SIZE)
        flat = cute.make_tensor(acc_dq.iterator, cute.make_layout(tdQsdQ.shape))
        cute.autovec_copy(flat, tdQsdQ)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=full + wg,
                                 number_of_threads=THREADS_PER_WARPGROUP + WARP_SIZE)

    def column_values(self, thr_sdp, s_vec: cute.Tensor, stage) -> cute.Tensor:
        """A per-query vector in shared memory (lse or delta of one stage) seen through this
        thread's S^T fragment: broadcast over the 128 key rows with stride 0, partitioned like
        the accumulator; ``[0, c]`` is the value of the thread's column c."""
        bcast = cute.make_tensor(s_vec[None, stage].iterator, cute.make_layout(
            (self.tile_n, self.tile_m), stride=(0, 1)))
        return acc_rows_cols(thr_sdp.partition_C(bcast))  # (rows, cols)

    @cute.jit
    def mask(self, acc_s, tScS, t0ScS, n_block, m_block, seqlen_q, seqlen_k, window_left,
             window_right):
        """S^T entries of invisible (key, query) pairs -> -inf. Rows are keys here: per row the
        visible queries are lo <= i < hi (fa4_final.common.bwd_tiles), compared with the column's
        compile-time index (Note [Mask with constants] of fa4_final.common.mask)."""
        w = self.window
        s = acc_rows_cols(acc_s)
        col_offset = m_block * self.tile_m + tScS[0, 0][1]
        offset = seqlen_k - seqlen_q
        big = Int32(1 << 30)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            key = n_block * self.tile_n + tScS[r, 0][0]
            lo = -big
            hi = big
            if const_expr(w.masks_right):
                lo = key - offset - w.right_bound(window_right) - col_offset
            if const_expr(w.has_left):
                hi = key - offset + window_left + 1 - col_offset
            if key >= seqlen_k:
                lo = big
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = t0ScS[0, c][1]
                s[r, c] = -Float32.inf if (col < lo) | (col >= hi) else s[r, c]

    @cute.jit
    def epilogue(self, acc_dk, acc_dv, mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, mma_dkv,
                 softmax_scale, tidx, n_block, head_kv, b, seq=None, seqlen_k=None,
                 mdK_rows=None, mdV_rows=None):
        """dK = scale * (sum of dS^T Q) and dV to global memory: registers -> shared (stmatrix,
        over the K and V buffers) -> TMA stores, which clip rows past seqlen_k. Varlen: a
        sequence's partial last key tile goes out row by row (Note [Varlen backward])."""
        dk = acc_rows_cols(acc_dk)
        for r in cutlass.range_constexpr(cute.size(dk, mode=[0])):
            for c in cutlass.range(cute.size(dk, mode=[1]), unroll_full=True):
                dk[r, c] = dk[r, c] * softmax_scale
        rdK = cute.make_rmem_tensor_like(acc_dk, self.dtype)
        rdK.store(acc_dk.load().to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dv, self.dtype)
        rdV.store(acc_dv.load().to(self.dtype))
        # every GEMM of both warpgroups that reads K or V has retired
        self.sync_mma(NamedBarrier.EPILOGUE)
        swapped = const_expr(self.cfg.dkv_swap_ab)  # dK^T, dV^T: stored transposed
        st = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=swapped, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st, mma_dkv).get_slice(tidx)
        sdK, sdV = sK, sV
        if const_expr(swapped):  # Note [dK and dV swapped]: (D, n) views of the (n, D) tiles
            sdK, sdV = transposed(sK), transposed(sV)
        cute.copy(st, thr_st.retile(rdK), thr_st.partition_D(sdK))
        if const_expr(self.head_dim_v != self.head_dim):  # Note [dV head dim]
            thr_st = cute.make_tiled_copy_C(st, self.mma_dv(mma_dkv)).get_slice(tidx)
        cute.copy(st, thr_st.retile(rdV), thr_st.partition_D(sdV))
        cute.arch.fence_view_async_shared()
        self.sync_mma(NamedBarrier.EPILOGUE)
        if const_expr(seq is None):
            self.store_tma(mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, tidx, n_block, head_kv,
                           b, None)
        else:
            # a CTA past the last key tile has seqlen_k = 0 (and, reversed, n_block = -1): no
            # row is stored
            keys_left = cutlass.min(seqlen_k - n_block * self.tile_n, seqlen_k)
            if keys_left >= self.tile_n:
                self.store_tma(mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, tidx, n_block,
                               head_kv, b, seq[1])
            else:
                for m, s, d in ((mdK_rows, sK, self.head_dim), (mdV_rows, sV, self.head_dim_v)):
                    g = cute.local_tile(sequence_slab(m, head_kv, b, seq[1]),
                                        (self.tile_n, d), (n_block, 0))
                    store_rows(s, g, tidx, keys_left, MMA_THREADS)

    @cute.jit
    def store_tma(self, mdK, mdV, sK, sV, tma_atom_dk, tma_atom_dv, tidx, n_block, head_kv, b,
                  offset_k):
        """dK and dV of the tile (in sK, sV) with one TMA store each, by the first MMA warp."""
        if tidx // WARP_SIZE == 0:
            for atom, m, s, d in ((tma_atom_dk, mdK, sK, self.head_dim),
                                  (tma_atom_dv, mdV, sV, self.head_dim_v)):
                g = cute.local_tile(sequence_slab(m, head_kv, b, offset_k), (self.tile_n, d),
                                    (n_block, 0))
                tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(s, 0, 2),
                                                   cute.group_modes(g, 0, 2))
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    # Note [Fresh accumulators]
    # ptxas keeps every register a wgmma writes live from its issue to its wait_group. An
    # accumulator that lives across steps (zeroed and reused) makes the S^T of step i+1 share
    # registers with step i's P^T, still read by dV += P^T dO; ptxas then inserts a wait before
    # the next wgmma ("wgmma serialized", warning C7512) and the GEMMs stop overlapping. A
    # tensor made inside the step has no such history. The compile tests count the fences
    # ptxas added.


class HopperVarlenBackward(HopperBackward):
    """The backward over packed varlen sequences in one launch (Note [Varlen backward]): the
    dense kernel with a compile-time flag, so the dense variant's code is what it was. Tensors
    as runtime.varlen packs them, each given as a batch of one: q (1, total_q, heads, D), dout
    (1, total_q, heads, dv), k, dk (1, total_k, heads_kv, D), v, dv (1, total_k, heads_kv,
    dv) (Note [dV head dim]); lse_log2, delta (1, heads, padded rows), the dQ
    accumulator (1, heads, padded rows * D) and the turn counters (1, heads, padded tiles) in
    the padded layout of Note [Varlen dQ accumulator] (fa4_final.common.bwd_tiles)."""

    varlen = True

    def __init__(self, dtype, head_dim: int, causal: bool, config: HopperBwdConfig,
                 has_window_left: bool = False, has_window_right: bool = False,
                 has_seqused_k: bool = False, softcap: float = 0.0,
                 has_seqused_q: bool = False, head_dim_v: int | None = None):
        super().__init__(dtype, head_dim, causal, config, has_window_left, has_window_right,
                         softcap, head_dim_v)
        self.has_seqused_k = bool(has_seqused_k)
        self.has_seqused_q = bool(has_seqused_q)  # Note [Used query rows in the backward]

    def cache_key(self) -> tuple:
        key = super().cache_key() + (("varlen", self.has_seqused_k),)
        return key + (("seqused_q",),) if self.has_seqused_q else key

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (1, total_q, heads, D)
        mK: cute.Tensor,  # (1, total_k, heads_kv, D)
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,  # (1, heads, padded rows) float32 (bwd_pre)
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,  # (1, heads, padded rows * D) float32, zeroed
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mTurn: cute.Tensor,  # (1, heads, padded tiles) int32 (deterministic only)
        mCuSeqlensQ: cute.Tensor,  # (batch + 1,) int32
        mCuSeqlensK: cute.Tensor,  # (batch + 1,) int32
        mSeqUsedK: cute.Tensor | None,  # (batch,) int32 or None (has_seqused_k)
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
        mSeqUsedQ: cute.Tensor | None = None,  # (batch,) int32 or None (has_seqused_q)
    ):
        if const_expr(self.has_seqused_k != (mSeqUsedK is not None)):
            raise TypeError("seqused_k is given exactly to the has_seqused_k variant")
        if const_expr(self.has_seqused_q != (mSeqUsedQ is not None)):
            raise TypeError("seqused_q is given exactly to the has_seqused_q variant")
        self.launch(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, mTurn, softmax_scale,
                    window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, stream,
                    mSeqUsedQ)
