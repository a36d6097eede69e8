"""The Blackwell backward (sm_100a): K and V stationary per CTA, five tcgen05 GEMMs per step, the
accumulators in tensor memory.

One CTA per (key tile of 128 keys, kv head, batch), as on Hopper (``fa4_final.hopper.bwd``); the
inner loop walks every 128-query tile that sees these keys, for every query head of the kv
head's group (GQA: dK and dV sum over the group in TMEM). Per step, with one key per TMEM lane:

    S^T  = K Q^T           tcgen05.mma SS -> TMEM "S"   (M = 128 keys, N = 128 queries, K = D)
    dP^T = V dO^T          tcgen05.mma SS -> TMEM "dP"
    P^T  = 2^(S^T * scale * log2 e - lse_log2)    compute warps, one key row per thread -> "P"
    dS^T = P^T * (dP^T - delta)                   compute warps -> shared memory (16-bit)
    dV  += P^T dO          tcgen05.mma TS: A = P^T straight from TMEM, B = dO (MN-major)
    dK  += dS^T Q          tcgen05.mma SS: A = dS^T (K-major), B = Q (MN-major)
    dQ   = dS K            tcgen05.mma SS -> TMEM "dQ" (one query per lane): A = the same dS
                           buffer read MN-major, B = K (MN-major); the dQ warpgroup adds it into
                           the float32 dQ accumulator in global memory with bulk reductions

What changes from Hopper and why: on Hopper the two MMA warpgroups held S^T, dP^T, dV and dK in
registers (dV and dK alone: 2 x 64 x D / 128 = 128 registers a thread at D = 128) and issued
their own wgmma. Here every accumulator lives in TMEM (``tmem.backward_plan``: 512 columns at
D = 128), one thread issues every MMA, and the compute warps spend their registers on one key row
each; the dQ epilogue (TMEM -> shared -> bulk add) has its own warpgroup, so it overlaps the
next step's GEMMs. A cycle model of one step (M = N = D = 128, B200, 1-CTA): 5 GEMMs of
2 * 128^3 FLOPs = 2560 tensor-core cycles against 3328 cycles of shared-memory traffic, plus what
this kernel reads on top (dS^T for dK from shared memory, the lse / delta broadcasts): bound by
shared memory (model), which is what the 2-CTA mode (``bwd_pair``, below) attacks.

Deterministic mode: the dQ warpgroup adds a step's dQ only in its turn, with the Hopper kernel's
turn counters (``common.bwd_tiles.dq_turn``, ``common.atomics``, Note [dQ turns] in hopper.bwd):
the same scheme, so the same proof of deadlock freedom.

Shared with the Hopper backward, and therefore run on the H200 for real: the preprocess and
postprocess kernels (``bwd_pre``, ``bwd_post``: this kernel writes its dQ into the Hopper kernel's
accumulator order, Note [dQ accumulator order]), the query-tile ranges, masked-step counts and turn
order (``bwd_tiles``), and the tcgen05 issue helpers of the forward (``blackwell.umma``). The
per-key visibility rule is ``bwd_tiles.visible_queries``; the Hopper mask keeps its own inline form
of it (its select is two instructions per row cheaper, which its per-step instruction-count test
holds it to). It has never run on a GPU: it is verified by compiling it for sm_100a (its
instructions, resources and per-step counts, beside FA4's flash_bwd_sm100 compiled the same way)
and by a CPU simulation that replays every role's waits and arrivals with these pipelines; that
found two races of a first design, fixed here (delta rides with Q, Note [Handshakes]; bar.sync
COMPUTE before P^T, Note [P^T over S^T]). GPU tests compare its gradients with float64 the moment
a B200 is present.

The 2-CTA mode (``BlackwellBwdConfig(two_cta=True)``, default off) is its own kernel,
``fa4_final.blackwell.bwd_pair.BlackwellBackwardPair``, a subclass of this one: a CTA pair per 256
keys, every GEMM a pair MMA, dS exchanged through distributed shared memory, half the dQ adds
per CTA. Its docstring has the design, the shared-memory table and the handshakes; this kernel's
code and SASS are untouched by it.
"""

from __future__ import annotations

from enum import IntEnum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator

from fa4_final.blackwell import umma
from fa4_final.blackwell.config import (
    BWD_DQ_BUFFERS,
    BWD_DQ_CHUNK,
    BWD_REGISTERS,
    BlackwellBwdConfig,
)
from fa4_final.blackwell.roles import WarpRoles, check_roles, set_registers
from fa4_final.common.atomics import bulk_add_f32, pass_turn, wait_turn
from fa4_final.common.bwd_tiles import dq_turn, launch_order_reversed, q_tile_range, visible_queries
from fa4_final.common.constants import LOG2_E, WARP_SIZE
from fa4_final.common.dq_order import DqOrder
from fa4_final.common.fragments import select_modes
from fa4_final.common.pipelines import PipelineSpec, pipeline_args
from fa4_final.common.tiles import TileWindow

THREADS = 512  # 16 warps (roles below)
WARPS_PER_GROUP = 4
GROUP_THREADS = WARPS_PER_GROUP * WARP_SIZE


def at(phase) -> pipeline.PipelineState:
    """Stage 0 of a one-stage handshake at barrier parity ``phase`` (Note [Handshakes])."""
    return pipeline.PipelineState(1, Int32(0), Int32(0), Int32(phase))


class NamedBarrier(IntEnum):
    """Hardware named barriers (bar.sync id); id 0 is __syncthreads."""

    TMEM = 1  # MMA, compute and dQ warps: the TMEM address is written / TMEM is free
    DQ_STAGE = 2  # the dQ warpgroup: a staging buffer is free / written
    COMPUTE = 3  # both compute warpgroups: every S^T column loaded (Note [P^T over S^T])


class BlackwellBackward(WarpRoles):
    """dK, dV and the float32 dQ accumulator of attention on sm_100a, one key tile per CTA."""

    TMEM_ROLES = ("compute0", "compute1", "dq")  # one TMEM lane (row) per thread

    def __init__(self, dtype, head_dim: int, causal: bool, config: BlackwellBwdConfig,
                 has_window_left: bool = False, has_window_right: bool = False):
        if config.two_cta and type(self) is BlackwellBackward:
            raise ValueError("BlackwellBwdConfig(two_cta=True) is the pair kernel, "
                             "fa4_final.blackwell.bwd_pair.BlackwellBackwardPair")
        config.check(head_dim)
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.cfg = config
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.q_stages = config.q_depth(head_dim)
        self.do_stages = config.do_depth(head_dim)
        self.window = TileWindow(self.tile_m, self.tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        self.plan = config.tmem_plan(head_dim)
        regs = BWD_REGISTERS
        self.roles = {
            "compute0": {"warps": (0, 1, 2, 3), "registers": regs["compute"],
                         "does": "P^T, dS^T for queries 0-63 of the step; dK, dV epilogue"},
            "compute1": {"warps": (4, 5, 6, 7), "registers": regs["compute"],
                         "does": "the same for queries 64-127"},
            "dq": {"warps": (8, 9, 10, 11), "registers": regs["dq"],
                   "does": "dQ: TMEM -> shared memory -> bulk float32 adds (in turn)"},
            "mma": {"warps": (12,), "registers": regs["mma"],
                    "does": "TMEM alloc/free; one thread issues every tcgen05.mma"},
            "load": {"warps": (13,), "registers": regs["load"],
                     "does": "TMA: K, V once; Q + lse + delta, dO per step"},
            "spare": {"warps": (14, 15), "registers": regs["spare"], "does": "give registers away"},
        }
        check_roles(self.roles, THREADS, self.TMEM_ROLES)

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The pipelines (Note [Handshakes]); arrivals per barrier phase."""
        comp = 2 * GROUP_THREADS
        return (
            PipelineSpec("kv", "K and V of the CTA's key tile, once", "tma_umma", 1, "load",
                         "mma", 1, 1),
            PipelineSpec("q", "Q, its lse (log2 units) and delta per step", "tma_umma",
                         self.q_stages, "load", "mma (+ compute read lse, delta)", 1, 1),
            PipelineSpec("do", "dO per step", "tma_umma", self.do_stages, "load", "mma", 1, 1),
            PipelineSpec("s", "full: S^T in TMEM; empty: P^T in TMEM", "umma_async", 1, "mma",
                         "compute", 1, comp),
            PipelineSpec("dp", "full: dP^T in TMEM; empty: dS in smem, dP^T read",
                         "umma_async", 1, "mma", "compute", 1, comp),
            PipelineSpec("dq", "full: dQ in TMEM, dS read; empty: dQ read", "umma_async", 1,
                         "mma", "dq (+ compute: dS free)", 1, GROUP_THREADS),
            PipelineSpec("dkv", "full: the CTA's last dK, dV MMA done", "umma_async", 1, "mma",
                         "compute", 1, comp),
        )

    # Note [Handshakes]
    # Producer -> consumer, arrivals per phase (one stage each, except the TMA rings):
    #   kv    load -> mma       full: 1 + K, V bytes
    #   q     load -> mma       full: 1 + Q, lse, delta bytes   empty: commit after dK += dS^T Q
    #   do    load -> mma       full: 1 + dO bytes              empty: commit after dV += P^T dO
    #   s     mma -> compute    full: commit after S^T   empty: 256 (P^T stored in TMEM)
    #   dp    mma -> compute    full: commit after dP^T  empty: 256 (dS stored, dP^T read)
    #   dq    mma -> dq warps   full: commit after dQ    empty: 128 (dQ read out of TMEM)
    #   dkv   mma -> compute    full: commit after the CTA's last step
    # The compute warps also wait on q's FULL barrier (for lse and delta) without arriving on its
    # EMPTY one: the MMA warp's commit that frees a Q stage comes after it has waited for dS of that
    # step, which the compute warps write after reading lse and delta. Delta rides with Q, not with
    # dO: dO's stage is freed after dV, which waits only for P^T, so a delta there could be
    # overwritten by the next dO while the compute warps still read it (a simulation of the
    # backward's pipelines found this in a first design). They wait on dq's
    # FULL barrier too, one step late: dQ(i) done means dK(i) and dQ(i) have read dS(i), so the dS
    # buffer may take dS(i + 1). Region reuse in TMEM (Note [The backward's plan]) follows from the
    # same order: S^T(i + 1) is issued after P^T(i) is stored (s empty) and after dV(i) that reads
    # P^T(i) (tcgen05 MMAs of one thread run in issue order); dP^T(i + 1) overwrites dQ(i), so it
    # waits for dq's EMPTY side.
    #
    # Note [The backward's plan]
    # D = 128: S^T 128 + dP^T 128 + dV 128 + dK 128 = 512 columns, all of them, so dQ (128 x D,
    # one query per lane) cannot have its own: it lives in dP^T's columns. dP^T(i) is dead once
    # the compute warps have read it (before dS is stored, before dQ(i) is issued), and the next
    # dP^T waits until the dQ warps have read dQ(i). P^T (16-bit pairs: 64 columns) lives in the
    # upper half of S^T, as P in the forward. D = 64: 384 columns used, 512 allocated.
    #
    # Note [P^T over S^T]
    # Warpgroup g loads S^T columns 64 g .. 64 g + 63 and stores its P^T (16-bit pairs) into
    # columns 64 + 32 g .. 64 + 32 g + 31: warpgroup 0's P^T lands on S^T columns warpgroup 1
    # loads. Nothing else orders the two warpgroups inside a step, so each waits for its loads
    # (tcgen05.wait::ld) and then for the other warpgroup at bar.sync COMPUTE before storing P^T,
    # as FA4's compute warps do (flash_bwd_sm100: "P overwrites S lanes another warp may still be
    # loading"). The pipeline simulation catches the race without it (mutation no_compute_sync).
    #
    # Note [Register plan]
    # The CTA starts with 128 registers a thread (64 K / 512 threads, one CTA an SM); each role's
    # setmaxnreg then moves registers between its warps and the pool of the SM sub-partition
    # they run on: warp w on sub-partition w % 4, 512 registers per thread slot there. Each
    # sub-partition holds one warp of every warpgroup (warps k, 4 + k, 8 + k, 12 + k), so what
    # must fit is compute0 + compute1 + dQ + warpgroup 3, not the CTA's total:
    #     176 + 176 + 48 + 112 = 512       (config.BWD_REGISTERS; fa4_final.common.register_plan)
    # A plan over 512 on one sub-partition leaves a setmaxnreg.inc waiting for registers no warp
    # there will release: the kernel hangs before its first barrier completes (a 16-warp plan
    # of 176, 176, 80 and an MMA warp raised to 160 needs 592 on sub-partition 0; the H200,
    # which has the same rule, hangs on it). check_roles refuses such a table when the kernel
    # object is built. Warpgroup 3 lowers once, at the top of its branch, to one budget for its
    # four warps (the PTX ISA asks every warp of a warpgroup to run the same setmaxnreg): the
    # MMA warp needs the most of them, the load and spare warps keep what it needs. The compute
    # warps hold a key's 64 scores and 64 dP values at once (176); the dQ warps 32 TMEM columns
    # at a time (48). FA4's backward keeps the same sum (its compute, reduce and the larger of
    # load and MMA at most 512) and also only lowers in warpgroup 3.

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def tiled_mmas(self):
        """(S^T and dP^T; dV; dK; dQ), all M = 128, cta_group::1. Operand majors: K and V are
        stored (key, D) D-contiguous, Q and dO (query, D), dS^T (key, query): K-major where
        the GEMM's K is their contiguous dimension, MN-major where it is not."""
        major = cute.nvgpu.OperandMajorMode
        one = tcgen05.CtaGroup.ONE
        dt, d, m, n = self.dtype, self.head_dim, self.tile_m, self.tile_n
        sdp = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.K, Float32, one, (n, m))
        dv = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, one, (n, d),
                                                tcgen05.OperandSource.TMEM)
        dk = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, one, (n, d))
        dq = sm100_utils.make_trivial_tiled_mma(dt, dt, major.MN, major.MN, Float32, one,
                                                (m, d))
        return sdp, dv, dk, dq

    def smem_layouts(self, mmas) -> dict:
        """Shared-memory layouts, two per buffer that two GEMMs read in different majors: the
        same bytes, seen K-major by one GEMM and MN-major by the other (CuTe's canonical
        128 B-swizzled layouts of a tile agree on every element's address)."""
        return self.operand_layouts(mmas, self.tile_n)

    def operand_layouts(self, mmas, n: int) -> dict:
        """The operand layouts of ``mmas`` for a tile of ``n`` keys: tile_n here, the pair's
        256 in BlackwellBackwardPair (each CTA's share: CuTe's pair layouts are per CTA)."""
        sdp, dv, dk, dq = mmas
        dt, d, m = self.dtype, self.head_dim, self.tile_m
        first = lambda lay: cute.slice_(lay, (None, None, None, 0))  # noqa: E731
        return {
            "K": first(sm100_utils.make_smem_layout_a(sdp, (n, m, d), dt, 1)),
            "V": first(sm100_utils.make_smem_layout_a(sdp, (n, m, d), dt, 1)),
            "Q": sm100_utils.make_smem_layout_b(sdp, (n, m, d), dt, self.q_stages),
            "dO": sm100_utils.make_smem_layout_b(sdp, (n, m, d), dt, self.do_stages),
            "dOt": sm100_utils.make_smem_layout_b(dv, (n, d, m), dt, self.do_stages),
            "Qt": sm100_utils.make_smem_layout_b(dk, (n, d, m), dt, self.q_stages),
            "dSt": first(sm100_utils.make_smem_layout_a(dk, (n, d, m), dt, 1)),  # pair: TMEM
            "dS": first(sm100_utils.make_smem_layout_a(dq, (m, d, n), dt, 1)),
            "Kt": first(sm100_utils.make_smem_layout_b(dq, (m, d, n), dt, 1)),
            "P": first(sm100_utils.make_smem_layout_a(dv, (n, d, m), dt, 1)),  # in TMEM
        }

    def dq_layout_owner(self) -> DqOrder:
        """The dQ accumulator order at tile_m = 128, which this kernel writes
        (Note [dQ in accumulator order] in common.dq_order), so that one bwd_post serves both
        backwards."""
        return DqOrder(self.dtype, self.head_dim, self.tile_m)

    # Note [dQ accumulator order]
    # The Hopper kernel stores a query tile's float32 dQ in its wgmma register order
    # (Note [dQ in accumulator order] there) and bwd_post reads it back. At tile_m = 128 that order
    # puts element (row R, column C) at
    #     64 D (R // 64) + 512 (C // 8) + 128 ((R % 64) // 16) + 16 (R % 8) + 2 ((R % 16) // 8)
    #     + 4 ((C % 8) // 2) + C % 2
    # (warpgroup R // 64 owns a chunk of 64 D floats; in it thread t of the warpgroup, row
    # 16 warp + lane / 4 (+ 8), holds 4 floats per 8 columns at 4 t + 512 j). Two facts make it
    # cheap here: columns 8 j .. 8 j + 7 of 64 rows are one contiguous 2 KB run, so a 32-column
    # chunk of a 64-row half is one contiguous 8 KB block (one bulk add), and columns 2 c, 2 c + 1
    # are adjacent (one 8-byte shared-memory store). ``dq_stage_layout`` is the formula for one
    # 32-column chunk: ((8, 2, 4, 2), (2, 4, 4)) : ((16, 2, 128, 2048), (1, 4, 512)).
    # The package's compile tests check it against the Hopper kernel's own layouts.

    DQ_STAGE = (((8, 2, 4, 2), (2, 4, 4)), ((16, 2, 128, 2048), (1, 4, 512)))  # shape, stride

    def dq_stage_layout(self) -> cute.Layout:
        """(128 rows, BWD_DQ_CHUNK columns) -> offset in one staging buffer
        (Note [dQ accumulator order])."""
        assert BWD_DQ_CHUNK == 32 and self.tile_m == 128
        shape, stride = self.DQ_STAGE
        return cute.make_layout(shape, stride=stride)

    def dq_stage_layout_plain(self):
        """The same layout as a plain-int function (row, col) -> offset, for the CPU tests."""
        (row_shape, col_shape), (row_stride, col_stride) = self.DQ_STAGE

        def one(coord, shape, stride):  # colexicographic, as CuTe reads a flat coordinate
            total = 0
            for s, d in zip(shape, stride):
                total += (coord % s) * d
                coord //= s
            return total

        return lambda row, col: one(row, row_shape, row_stride) + one(col, col_shape, col_stride)

    def check_dtypes(self, *tensors) -> None:
        """q, k, v, dout, dk, dv of the launch all in the kernel's dtype (a trace-time check)."""
        if any(t.element_type != self.dtype for t in tensors):
            raise TypeError(f"q, k, v, dout, dk, dv must all be {self.dtype}")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, D)
        mLSE2: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32, log2 units (bwd_pre)
        mDelta: cute.Tensor,  # (batch, heads, seqlen_q_padded) float32 (bwd_pre)
        mdQaccum: cute.Tensor,  # (batch, heads, seqlen_q_padded * D) float32, zeroed (bwd_pre)
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, D) out
        mdV: cute.Tensor,
        mTurn: cute.Tensor,  # (batch, heads, num_m_blocks) int32 (deterministic), zeroed
        softmax_scale: Float32,
        window_left: Int32,
        window_right: Int32,
        stream,
    ):
        self.check_dtypes(mQ, mK, mV, mdO, mdK, mdV)
        d, m, n = self.head_dim, self.tile_m, self.tile_n
        # (b, s, h, d) -> (s, d, h, b): TMA boxes tile modes 0 and 1
        mQ, mK, mV, mdO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO)]
        mLSE2, mDelta, mdQaccum, mTurn = [select_modes(t, [2, 1, 0])
                                          for t in (mLSE2, mDelta, mdQaccum, mTurn)]
        mmas = self.tiled_mmas()
        mma_sdp = mmas[0]
        lay = self.smem_layouts(mmas)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)),
                                            (mma_sdp.thr_id.shape,))
        load = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tiler = (n, m, d)
        one_q = cute.select(lay["Q"], mode=[0, 1, 2])
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_B(load, mQ, one_q, tiler, mma_sdp,
                                                     cta_layout_vmnk.shape)
        tma_do, tdO = cute.nvgpu.make_tiled_tma_atom_B(load, mdO, one_q, tiler, mma_sdp,
                                                       cta_layout_vmnk.shape)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_A(load, mK, lay["K"], tiler, mma_sdp,
                                                     cta_layout_vmnk.shape)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_A(load, mV, lay["V"], tiler, mma_sdp,
                                                     cta_layout_vmnk.shape)
        bytes_row = 4 * m  # one float per query: lse or delta of a tile
        bytes_q = cute.size_in_bytes(self.dtype, one_q) + 2 * bytes_row  # Q, lse, delta
        bytes_do = cute.size_in_bytes(self.dtype, one_q)
        bytes_kv = 2 * cute.size_in_bytes(self.dtype, lay["K"])

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dp: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dq: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_dkv: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: Int32
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, m * self.q_stages], 16]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, m * self.q_stages], 16]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["K"])], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["V"])], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["Q"])], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["dO"])],
                                   1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(lay["dSt"])],
                                   1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, m * BWD_DQ_CHUNK
                                                        * BWD_DQ_BUFFERS], 1024]

        # the budget arithmetic of BlackwellBwdConfig.smem_bytes() is the struct's real size
        assert SharedStorage.size_in_bytes() == self.cfg.smem_bytes(d, self.dtype.width // 8)
        num_n_blocks = cute.ceil_div(mK.shape[0], n)
        self.kernel(
            tQ, tK, tV, tdO, mLSE2, mDelta, mdQaccum, mdK, mdV, mTurn, tma_q, tma_k, tma_v,
            tma_do, softmax_scale, softmax_scale * LOG2_E, window_left, window_right,
            mQ.shape[2], bytes_q, bytes_do, bytes_kv, SharedStorage,
        ).launch(grid=(num_n_blocks, mK.shape[2], mK.shape[3]), block=[THREADS, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # device side: set-up and role dispatch
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinate tensors: (s, D, h, b)
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,  # (s_padded, h, b)
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,  # (s_padded * D, h, b)
        mdK: cute.Tensor,  # (b, s, h_kv, D)
        mdV: cute.Tensor,
        mTurn: cute.Tensor,  # (num_m_blocks, h, b)
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        softmax_scale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        heads: Int32,
        bytes_q: cutlass.Constexpr[int],
        bytes_do: cutlass.Constexpr[int],
        bytes_kv: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == self.warp("load"):
            for atom in (tma_q, tma_k, tma_v, tma_do):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        mmas = self.tiled_mmas()  # pure functions of the configuration: rebuilt, not passed
        lay = self.smem_layouts(mmas)
        pipes = self.make_pipelines(storage, mmas[0], bytes_q, bytes_do, bytes_kv)
        pipeline.pipeline_init_arrive(is_relaxed=True)
        smem = self.smem_tensors(storage, lay)
        tmem_users = self.tmem_threads()
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=pipeline.NamedBarrier(int(NamedBarrier.TMEM),
                                                                        tmem_users),
                             allocator_warp_id=self.warp("mma"))
        pipeline.pipeline_init_wait()

        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        work_of = lambda: self.cta_work(seqlen_q, seqlen_k, heads, mK.shape[2],  # noqa: E731
                                        window_left, window_right)
        regs = {name: r["registers"] for name, r in self.roles.items()}
        if warp >= self.warp("mma"):  # warpgroup 3: one budget (Note [Register plan])
            set_registers(regs["mma"], THREADS)
            if warp == self.warp("load"):
                n_block, head_kv, b, _, work = work_of()
                self.load(mQ, mK, mV, mdO, mLSE2, mDelta, smem, tma_q, tma_k, tma_v, tma_do,
                          mmas[0], pipes, n_block, head_kv, b, work)
            if warp == self.warp("mma"):
                tmem.allocate(self.plan.columns_allocated)
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.mma(mmas, lay, smem, tmem_ptr, pipes, work_of()[4])
                # every compute and dQ thread has arrived: nobody reads TMEM any more
                cute.arch.barrier(barrier_id=int(NamedBarrier.TMEM),
                                  number_of_threads=tmem_users)
                tmem.relinquish_alloc_permit()
                tmem.free(tmem_ptr)
        if warp < self.warp("dq"):
            set_registers(regs["compute0"], THREADS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            n_block, head_kv, b, _, work = work_of()
            self.compute(mmas, tmem_ptr, smem, pipes, mdK, mdV, softmax_scale, scale_log2,
                         window_left, window_right, n_block, head_kv, b, seqlen_q, seqlen_k,
                         work)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)
        if warp >= self.warp("dq") and warp < self.warp("mma"):
            set_registers(regs["dq"], THREADS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            n_block, head_kv, b, num_n_blocks, work = work_of()
            self.store_dq(mmas, tmem_ptr, smem, pipes, mdQaccum, mTurn, n_block, num_n_blocks,
                          b, seqlen_q, seqlen_k, window_left, window_right, work)
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TMEM),
                                     number_of_threads=tmem_users, aligned=False)

    @cute.jit
    def cta_work(self, seqlen_q, seqlen_k, heads, heads_kv, window_left, window_right):
        """(n_block, kv head, batch, key tiles, work) of this CTA: one key tile, the query tiles
        that see it (bwd_tiles.q_tile_range) for every head of the group. Each role calls it
        after its setmaxnreg, so no value of the prologue lives across the role split (ptxas
        spilled one there)."""
        n_block, head_kv, b = cute.arch.block_idx()
        num_n_blocks = (seqlen_k + self.tile_n - 1) // self.tile_n
        if const_expr(self.cfg.deterministic and launch_order_reversed(self.window)):
            n_block = num_n_blocks - 1 - n_block  # turns go downwards (bwd_tiles Note [Turn order])
        return n_block, head_kv, b, num_n_blocks, self.key_tile_work(
            n_block, self.tile_n, head_kv, heads, heads_kv, seqlen_q, seqlen_k, window_left,
            window_right)

    @cute.jit
    def key_tile_work(self, n_block, keys: int, head_kv, heads, heads_kv, seqlen_q, seqlen_k,
                      window_left, window_right):
        """``work`` of the key tile n_block (``keys`` keys: tile_n, or the pair's 256), what
        every role walks: (m_min, m_max, n_first, n_last, first head, heads of the group), the
        query tiles that see the tile (bwd_tiles.q_tile_range, by self.window), of which the
        first n_first and the last n_last are masked."""
        m_min, m_max, n_first, n_last = q_tile_range(self.window, n_block, seqlen_q, seqlen_k,
                                                     window_left, window_right)
        if (n_block + 1) * keys > seqlen_k:  # keys past seqlen_k: mask every step
            n_first = m_max - m_min
        group = heads // heads_kv
        return (m_min, m_max, n_first, n_last, head_kv * group, group)

    def make_pipelines(self, storage, mma_sdp, bytes_q: int, bytes_do: int,
                       bytes_kv: int) -> dict:
        """The cutlass pipelines of ``self.pipelines()``, by name."""
        mbar = {"kv": storage.mbar_kv, "q": storage.mbar_q, "do": storage.mbar_do,
                "s": storage.mbar_s, "dp": storage.mbar_dp, "dq": storage.mbar_dq,
                "dkv": storage.mbar_dkv}
        tx = {"kv": bytes_kv, "q": bytes_q, "do": bytes_do}
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)),
                                            (mma_sdp.thr_id.shape,))
        out = {}
        for spec in self.pipelines():
            common = dict(pipeline_args(spec, mbar[spec.name]), cta_layout_vmnk=cta_layout_vmnk)
            if spec.kind == "tma_umma":
                out[spec.name] = pipeline.PipelineTmaUmma.create(tx_count=tx[spec.name],
                                                                 **common)
            else:
                out[spec.name] = pipeline.PipelineUmmaAsync.create(**common)
        return out

    def smem_tensors(self, storage, lay) -> dict:
        """Every shared-memory view, by name; the second view of a buffer reuses its bytes."""
        def view(field, layout):
            return field.get_tensor(layout.outer, swizzle=layout.inner)

        def alias(t, layout):
            return cute.make_tensor(cute.recast_ptr(t.iterator, layout.inner), layout.outer)

        s = {"K": view(storage.sK, lay["K"]), "V": view(storage.sV, lay["V"]),
             "Q": view(storage.sQ, lay["Q"]), "dO": view(storage.sdO, lay["dO"]),
             "dSt": view(storage.sdS, lay["dSt"])}
        s["Kt"] = alias(s["K"], lay["Kt"])
        s["Qt"] = alias(s["Q"], lay["Qt"])
        s["dOt"] = alias(s["dO"], lay["dOt"])
        s["dS"] = alias(s["dSt"], lay["dS"])
        # dS^T as a plain (key, query) tensor for the compute warps' stores: the K-major
        # operand layout ((128, 16), 1, m/16) regrouped as (128, (16, m/16)), same swizzle
        outer = lay["dSt"].outer
        rows = cute.make_layout((outer.shape[0][0], (outer.shape[0][1], outer.shape[2])),
                                stride=(outer.stride[0][0], (outer.stride[0][1],
                                                             outer.stride[2])))
        s["dSt_rows"] = storage.sdS.get_tensor(rows, swizzle=lay["dSt"].inner)
        s.update(self.row_and_staging_tensors(storage))
        return s

    def row_and_staging_tensors(self, storage) -> dict:
        """The float32 buffers both kernels' storage has: lse and delta of each Q stage's
        tile_m queries, and the dQ warps' BWD_DQ_BUFFERS staging buffers."""
        return {
            "LSE": storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
            "Delta": storage.sDelta.get_tensor(cute.make_layout((self.tile_m, self.q_stages))),
            "dQ": storage.sdQ.get_tensor(cute.make_layout((self.tile_m * BWD_DQ_CHUNK,
                                                          BWD_DQ_BUFFERS))),
        }

    def tmem_view(self, tmem_ptr, tiled_mma, mn, region: str, col0=0, cols=None):
        """(128, cols) fp32 view of TMEM region ``region`` (columns col0 .. col0 + cols of the
        accumulator ``tiled_mma`` writes for an ``mn`` tile), one row per lane."""
        thr = tiled_mma.get_slice(0)
        acc = thr.make_fragment_C(thr.partition_shape_C(mn)).layout
        full = cute.make_tensor(tmem_ptr + self.plan.offset(region), acc)[(None, None), 0, 0]
        cols = mn[1] if cols is None else cols
        return cute.make_tensor(full.iterator + col0,
                                cute.composition(full.layout, cute.make_layout((mn[0], cols))))

    # ------------------------------------------------------------------------------------------
    # load warp
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mDelta, smem, tma_q, tma_k, tma_v, tma_do, mma_sdp,
             pipes, n_block, head_kv, b, work):
        """K and V once, then per step Q + lse + delta and dO (Note [Handshakes])."""
        m_min, m_max, _, _, head0, group = work
        d, m, n = self.head_dim, self.tile_m, self.tile_n
        thr = mma_sdp.get_slice(0)
        state_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.q_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.do_stages)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        if m_max > m_min:
            gK = cute.local_tile(mK[None, None, head_kv, b], (n, d), (None, 0))  # (n, D, blk)
            gV = cute.local_tile(mV[None, None, head_kv, b], (n, d), (None, 0))
            pipes["kv"].producer_acquire(state_kv)
            bar = pipes["kv"].producer_get_barrier(state_kv)
            for atom, g, s in ((tma_k, gK, smem["K"]), (tma_v, gV, smem["V"])):
                tXsX, tXgX = self._tma_partition(atom, s, thr.partition_A(g))
                cute.copy(atom, tXgX[None, n_block], tXsX, tma_bar_ptr=bar)
            for h in cutlass.range(group, unroll=1):
                head = head0 + h
                gQ = cute.local_tile(mQ[None, None, head, b], (m, d), (None, 0))  # (m, D, blk)
                gdO = cute.local_tile(mdO[None, None, head, b], (m, d), (None, 0))
                gLSE = cute.local_tile(mLSE2[None, head, b], (m,), (None,))  # (m, blk)
                gDelta = cute.local_tile(mDelta[None, head, b], (m,), (None,))
                tQsQ, tQgQ = self._tma_partition(tma_q, smem["Q"], thr.partition_B(gQ))
                tdOsdO, tdOgdO = self._tma_partition(tma_do, smem["dO"], thr.partition_B(gdO))
                for m_block in cutlass.range(m_min, m_max, unroll=1):
                    state_q = self.load_one(tma_q, tQgQ, tQsQ, bulk,
                                            ((gLSE, smem["LSE"]), (gDelta, smem["Delta"])),
                                            m_block, pipes["q"], state_q)
                    state_do = self.load_one(tma_do, tdOgdO, tdOsdO, bulk, (), m_block,
                                             pipes["do"], state_do)
            pipes["q"].producer_tail(state_q)
            pipes["do"].producer_tail(state_do)

    def _tma_partition(self, atom, sX, tXgX_mma):
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 3),
                                     cute.group_modes(tXgX_mma, 0, 3))

    @cute.jit
    def load_one(self, atom, tXgX, tXsX, bulk, rows, block, pipe, state):
        """A tile (TMA) and its per-query floats (``rows``: (global, shared) pairs, one bulk
        copy each) into the next free stage, all counted by its FULL barrier."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(atom, tXgX[None, block], tXsX[None, state.index], tma_bar_ptr=bar)
        for gRow, sRow in rows:
            with cute.arch.elect_one():
                cute.copy(bulk, gRow[None, block], sRow[None, state.index], mbar_ptr=bar)
        state.advance()
        return state

    # ------------------------------------------------------------------------------------------
    # MMA warp
    # ------------------------------------------------------------------------------------------
    def desc(self, tiled, frag_b: bool, smem_t, blocks: int) -> tuple:
        """(low word, high word, K-block offsets, stage stride) of an smem operand's descriptor
        (blackwell.umma); stride 0 for an operand without stages."""
        f = tiled.make_fragment_B(smem_t) if frag_b else tiled.make_fragment_A(smem_t)
        stride = 0
        if cute.rank(f.layout) == 4:
            stride = cute.crd2idx((0, 0, 0, 1), f.layout)
        return umma.smem_desc_words(f) + (umma.block_offsets(f.layout, blocks), stride)

    @cute.jit
    def mma(self, mmas, lay, smem, tmem_ptr, pipes, work):
        """One thread issues the five GEMMs of every step (module docstring) in the order
        S^T, dP^T, dV, dK, dQ; it waits only where an operand or a TMEM region is not yet
        ready (Note [Handshakes]). Operands are descriptors (blackwell.umma): one 64-bit word
        per operand tile, whose low half moves by constants per K block and stage."""
        mma_sdp, mma_dv, mma_dk, mma_dq = mmas
        m_min, m_max, _, _, _, group = work
        d16, m16, n16 = self.head_dim // 16, self.tile_m // 16, self.tile_n // 16

        # (operand, tiled MMA, B?, K blocks): the descriptor of each smem operand view
        which = (("K", mma_sdp, False, d16), ("V", mma_sdp, False, d16),
                 ("Q", mma_sdp, True, d16), ("dO", mma_sdp, True, d16),
                 ("dOt", mma_dv, True, m16), ("Qt", mma_dk, True, m16),
                 ("dSt", mma_dk, False, m16), ("dS", mma_dq, False, n16),
                 ("Kt", mma_dq, True, n16))
        ops = {name: self.desc(t, is_b, smem[name], blocks) for name, t, is_b, blocks in which}
        tP = mma_dv.get_slice(0).make_fragment_A(lay["P"].outer)  # (MMA, 1, m/16) in TMEM
        p_offsets = umma.block_offsets(tP.layout, m16, 32, self.dtype.width)
        base = tmem_ptr.toint()  # TMEM address: lane << 16 | column
        idesc = {name: umma.op_instr_desc(t.op) for name, t in
                 (("sdp", mma_sdp), ("dv", mma_dv), ("dk", mma_dk), ("dq", mma_dq))}
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.q_stages)
        state_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.do_stages)
        phase = Int32(0)  # parity of the one-stage handshakes' current phase
        n_steps = (m_max - m_min) * group
        if n_steps > 0:
            pipes["kv"].consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))
        for t in cutlass.range(n_steps, unroll=1):
            q_lo, q_hi, q_off, q_st = ops["Q"]
            k_lo, k_hi, k_off, _ = ops["K"]
            pipes["q"].consumer_wait(state_q)
            umma.mma(base + self.plan.offset("S"), k_lo, k_hi, k_off,
                     q_lo + state_q.index * q_st, q_hi, q_off, idesc["sdp"], False)
            pipes["s"].producer_commit(at(0))  # S^T -> compute
            o_lo, o_hi, o_off, o_st = ops["dO"]
            v_lo, v_hi, v_off, _ = ops["V"]
            pipes["do"].consumer_wait(state_do)
            pipes["dq"].producer_acquire(at(phase ^ 1))  # dQ(t - 1) read out of dP's columns
            umma.mma(base + self.plan.offset("dP"), v_lo, v_hi, v_off,
                     o_lo + state_do.index * o_st, o_hi, o_off, idesc["sdp"], False)
            pipes["dp"].producer_commit(at(0))  # dP^T -> compute
            pipes["s"].producer_acquire(at(phase))  # P^T stored
            t_lo, t_hi, t_off, t_st = ops["dOt"]
            umma.mma(base + self.plan.offset("dV"), base + self.plan.offset("P"), None,
                     p_offsets, t_lo + state_do.index * t_st, t_hi, t_off, idesc["dv"], t > 0)
            pipes["do"].consumer_release(state_do)  # after dV: the last reader of dO
            state_do.advance()
            pipes["dp"].producer_acquire(at(phase))  # dS in shared memory
            s_lo, s_hi, s_off, _ = ops["dSt"]
            r_lo, r_hi, r_off, r_st = ops["Qt"]
            umma.mma(base + self.plan.offset("dK"), s_lo, s_hi, s_off,
                     r_lo + state_q.index * r_st, r_hi, r_off, idesc["dk"], t > 0)
            a_lo, a_hi, a_off, _ = ops["dS"]
            b_lo, b_hi, b_off, _ = ops["Kt"]
            umma.mma(base + self.plan.offset("dQ"), a_lo, a_hi, a_off, b_lo, b_hi, b_off,
                     idesc["dq"], False)
            pipes["dq"].producer_commit(at(0))  # dQ -> dQ warps; dS free
            pipes["q"].consumer_release(state_q)  # after dK: the last reader of Q
            state_q.advance()
            phase ^= 1
        if n_steps > 0:
            pipes["dkv"].producer_commit(at(0))  # dK, dV final once every MMA completed

    # ------------------------------------------------------------------------------------------
    # compute warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def compute(self, mmas, tmem_ptr, smem, pipes, mdK, mdV, softmax_scale, scale_log2,
                window_left, window_right, n_block, head_kv, b, seqlen_q, seqlen_k, work):
        """Thread t of warpgroup g owns key t of the tile and queries 64 g .. 64 g + 63 of each
        step: P^T and dS^T of that piece of the key's row, then its half of dK and dV."""
        mma_sdp, mma_dv, _, _ = mmas
        m_min, m_max = work[0], work[1]
        tidx = cute.arch.thread_idx()[0] % GROUP_THREADS
        g = cute.arch.make_warp_uniform(cute.arch.warp_idx() // WARPS_PER_GROUP)
        half = self.tile_m // 2
        v = self.step_views(tmem_ptr, mma_sdp, (self.tile_n, self.tile_m), tidx, g)
        # this thread's 64 dS^T values in shared memory: key tidx, queries 64 g ..
        sdS_row = cute.local_tile(smem["dSt_rows"][tidx, None], (half,), (g,))
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.q_stages)
        phase = Int32(0)
        key = n_block * self.tile_n + tidx
        self.compute_steps(work, state_q, phase, (
            key, g, v, sdS_row, smem, pipes, scale_log2, seqlen_q, seqlen_k, window_left,
            window_right))
        self.epilogue(mma_dv, tmem_ptr, pipes, mdK, mdV, softmax_scale, tidx, g, key,
                      head_kv, b, seqlen_k, m_max > m_min)

    def step_views(self, tmem_ptr, mma_sdp, mn, tidx, g) -> dict:
        """Thread tidx of warpgroup g in a step: loads of its key's row of S^T and dP^T over the
        warpgroup's 64 query columns (tStS, tdPtdP by load_s, load_dp, from tS, tdP), the
        (key, query) of each loaded value (tScS; thread 0's, t0ScS, for the mask), and the
        store of P^T's 16-bit pairs over S^T (tPtP by store_p, from registers shaped p_regs)."""
        half = self.tile_m // 2
        ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(half)),
                                 Float32)
        tS = self.tmem_view(tmem_ptr, mma_sdp, mn, "S", g * half, half)  # (128, 64)
        tdP = self.tmem_view(tmem_ptr, mma_sdp, mn, "dP", g * half, half)
        load_s = tcgen05.make_tmem_copy(ld, tS).get_slice(tidx)
        load_dp = tcgen05.make_tmem_copy(ld, tdP).get_slice(tidx)
        cS = cute.make_identity_tensor((self.tile_n, half))
        tP32 = self.packed_columns(tS, "P", "S", g)
        store_p = tcgen05.make_tmem_copy(self.store_16bit_pairs(), tP32).get_slice(tidx)
        p_cols = self.plan["P"].columns // 2
        return dict(tS=tS, tdP=tdP, load_s=load_s, load_dp=load_dp,
                    tStS=load_s.partition_S(tS), tdPtdP=load_dp.partition_S(tdP),
                    tScS=load_s.partition_D(cS),
                    t0ScS=tcgen05.make_tmem_copy(ld, tS).get_slice(0).partition_D(cS),
                    store_p=store_p, tPtP=store_p.partition_D(tP32),
                    p_regs=store_p.partition_S(cute.make_identity_tensor((self.tile_n,
                                                                          p_cols))).shape)

    def store_16bit_pairs(self):
        """tcgen05.st of one warpgroup's 64 queries as 16-bit pairs: 32 columns of a region."""
        return cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(self.plan["P"].columns // 2)),
            Float32)

    def packed_columns(self, t, region: str, host: str, g):
        """The (128, 32) columns of TMEM ``region`` that warpgroup g's 64 queries fill with
        16-bit pairs, from ``t``, its 64 columns of region ``host`` (P^T over S^T:
        Note [P^T over S^T])."""
        half, p_cols = self.tile_m // 2, self.plan["P"].columns // 2
        return cute.make_tensor(t.iterator + (self.plan.offset(region) - self.plan.offset(host))
                                - g * half + g * p_cols,
                                cute.composition(t.layout, cute.make_layout((self.tile_n,
                                                                             p_cols))))

    @cute.jit
    def compute_steps(self, work, state_q, phase, step_args: tuple):
        """The compute warps' walk over the key tile's query tiles m_min .. m_max - 1 (``work``),
        once per head of the group: the first n_first tiles masked, then the unmasked ones,
        then, with a left window, the last n_last masked again; each tile one
        ``self.compute_step(m_block, masked, state_q, phase, *step_args)``. The 2-CTA kernel
        (bwd_pair) walks the same way with its own compute_step and ``step_args``."""
        m_min, m_max, n_first, n_last, _, group = work
        first_end = m_min + n_first
        last_start = cutlass.max(m_max - n_last, first_end)
        for _h in cutlass.range(group, unroll=1):
            for m_block in cutlass.range(m_min, first_end, unroll=1):
                state_q, phase = self.compute_step(m_block, True, state_q, phase, *step_args)
            for m_block in cutlass.range(first_end, last_start, unroll=1):
                state_q, phase = self.compute_step(m_block, False, state_q, phase, *step_args)
            if const_expr(self.window.has_left):
                for m_block in cutlass.range(last_start, m_max, unroll=1):
                    state_q, phase = self.compute_step(m_block, True, state_q, phase,
                                                       *step_args)

    @cute.jit
    def compute_step(self, m_block, masked: cutlass.Constexpr[bool], state_q, phase, key, g, v,
                     sdS_row, smem, pipes, scale_log2, seqlen_q, seqlen_k, window_left,
                     window_right):
        """One step for 64 queries of one key: S^T row -> P^T (TMEM), dP^T row -> dS^T (smem);
        ``v``: the TMEM views and copies of ``step_views``."""
        half = self.tile_m // 2
        pipes["q"].consumer_wait(state_q)  # lse, delta of the step (Q: only the MMA reads it)
        pipes["s"].consumer_wait(at(phase))
        s = cute.make_rmem_tensor(v["tScS"].shape, Float32)  # this key's 64 scores
        cute.copy(v["load_s"], v["tStS"], s)
        self.probabilities(s, masked, m_block, key, g, v["t0ScS"], smem["LSE"][None, state_q.index],
                           scale_log2, seqlen_q, seqlen_k, window_left, window_right)
        rP32, _ = self.packed_16bit(s, v["p_regs"])
        cute.arch.fence_view_async_tmem_load()  # this warpgroup's S^T loads have landed
        cute.arch.barrier(barrier_id=int(NamedBarrier.COMPUTE),  # Note [P^T over S^T]
                          number_of_threads=2 * GROUP_THREADS)
        cute.copy(v["store_p"], rP32, v["tPtP"])
        cute.arch.fence_view_async_tmem_store()  # P^T visible to the MMA before we say so
        pipes["s"].consumer_release(at(phase))
        pipes["dp"].consumer_wait(at(phase))
        dp = cute.make_rmem_tensor(v["tScS"].shape, Float32)
        cute.copy(v["load_dp"], v["tdPtdP"], dp)
        delta = smem["Delta"][None, state_q.index]
        for c in cutlass.range_constexpr(cute.size(dp)):
            dp[c] = s[c] * (dp[c] - delta[g * half + c])
        rdS = cute.make_rmem_tensor(dp.layout, self.dtype)
        rdS.store(dp.load().to(self.dtype))
        cute.arch.fence_view_async_tmem_load()  # dP^T read: dQ may take its columns
        pipes["dq"].consumer_wait(at(phase ^ 1))  # dK(t - 1), dQ(t - 1) have read dS
        cute.autovec_copy(rdS, sdS_row)
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> visible to tcgen05.mma
        pipes["dp"].consumer_release(at(phase))
        state_q.advance()
        return state_q, phase ^ 1

    @cute.jit
    def probabilities(self, s, masked: cutlass.Constexpr[bool], m_block, key, g, t0ScS, lse,
                      scale_log2, seqlen_q, seqlen_k, window_left, window_right):
        """S^T row -> P^T row in place, for warpgroup g's 64 queries of tile m_block: the
        queries ``key`` does not see at -inf (masked steps), then exp2(s * scale_log2 - lse)."""
        half = self.tile_m // 2
        if const_expr(masked):
            lo, hi = visible_queries(self.window, key, seqlen_q, seqlen_k, window_left,
                                     window_right, Int32(1 << 30))
            col0 = m_block * self.tile_m + g * half
            lo, hi = lo - col0, hi - col0
            for c in cutlass.range_constexpr(cute.size(s)):
                col = t0ScS[c][1]
                s[c] = -Float32.inf if (col < lo) | (col >= hi) else s[c]
        for c in cutlass.range_constexpr(cute.size(s)):
            s[c] = cute.math.exp2(s[c] * scale_log2 - lse[g * half + c], fastmath=True)

    @cute.jit
    def packed_16bit(self, x, regs):
        """``x`` (float32) rounded to the kernel's 16-bit type, two values to each 32-bit
        register of a tensor shaped ``regs`` (the source of a tcgen05.st 32x32b); that tensor
        and its 16-bit view, laid out as ``x``."""
        x32 = cute.make_rmem_tensor(regs, Float32)
        x16 = cute.make_tensor(cute.recast_ptr(x32.iterator, dtype=self.dtype), x.layout)
        x16.store(x.load().to(self.dtype))
        return x32, x16

    @cute.jit
    def epilogue(self, mma_dv, tmem_ptr, pipes, mdK, mdV, softmax_scale, tidx, g, key, head_kv,
                 b, seqlen_k, has_steps):
        """dK = scale * (sum of dS^T Q) and dV: this thread's key row, half of D, straight from
        TMEM to global memory (16-byte stores; keys past seqlen_k are not written)."""
        d2 = self.head_dim // 2
        mn = (self.tile_n * self.cfg.cta_group, self.head_dim)  # the pair's MMA: 256 keys
        if has_steps:
            pipes["dkv"].consumer_wait(at(0))
        for region, m_out, scale in (("dV", mdV, None), ("dK", mdK, softmax_scale)):
            t = self.tmem_view(tmem_ptr, mma_dv, mn, region, g * d2, d2)
            load = tcgen05.make_tmem_copy(cute.make_copy_atom(
                tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(d2)), Float32), t
            ).get_slice(tidx)
            r = cute.make_rmem_tensor(load.partition_D(cute.make_identity_tensor(
                (self.tile_n, d2))).shape, Float32)
            if has_steps:
                cute.copy(load, load.partition_S(t), r)
            else:  # keys no query sees: zero gradients
                r.fill(0.0)
            if const_expr(scale is not None):
                for c in cutlass.range_constexpr(cute.size(r)):
                    r[c] = r[c] * scale
            out = cute.make_rmem_tensor(r.layout, self.dtype)
            out.store(r.load().to(self.dtype))
            if key < seqlen_k:
                row = cute.local_tile(m_out[b, key, head_kv, None], (d2,), (g,))
                cute.autovec_copy(out, row)
        cute.arch.fence_view_async_tmem_load()

    # ------------------------------------------------------------------------------------------
    # dQ warpgroup
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def store_dq(self, mmas, tmem_ptr, smem, pipes, mdQaccum, mTurn, n_block, num_n_blocks, b,
                 seqlen_q, seqlen_k, window_left, window_right, work):
        """Per step: dQ out of TMEM 32 columns at a time (thread t = query t), into a staging
        buffer in the Hopper accumulator order (Note [dQ accumulator order]), two 8 KB bulk
        adds per chunk by one thread; in turn when deterministic (Note [dQ turns] in hopper.bwd)."""
        mma_dq = mmas[3]
        m_min, m_max, _, _, head0, group = work
        tidx = cute.arch.thread_idx()[0] % GROUP_THREADS
        mn = (self.tile_m, self.head_dim)
        chunks = self.head_dim // BWD_DQ_CHUNK
        stage_layout = self.dq_stage_layout()
        half_rows = self.tile_m // 2 * BWD_DQ_CHUNK  # floats of one 64-row half of a chunk
        tdQ = self.tmem_view(tmem_ptr, mma_dq, mn, "dQ", 0, BWD_DQ_CHUNK)  # (128, 32)
        load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(BWD_DQ_CHUNK)), Float32), tdQ
        ).get_slice(tidx)
        tdQtdQ = load.partition_S(tdQ)
        regs = load.partition_D(cute.make_identity_tensor((self.tile_m, BWD_DQ_CHUNK))).shape
        phase = Int32(0)
        buf = Int32(0)
        for h in cutlass.range(group, unroll=1):
            head = head0 + h
            gAcc = mdQaccum[None, head, b]  # (s_padded * D,)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                pipes["dq"].consumer_wait(at(phase))
                turn_ptr = None
                if const_expr(self.cfg.deterministic):
                    turn_ptr = mTurn[None, head, b].iterator + m_block
                    if tidx == 0:
                        wait_turn(turn_ptr, dq_turn(self.window, n_block, m_block, num_n_blocks,
                                                    seqlen_q, seqlen_k, window_left,
                                                    window_right))
                for c in cutlass.range_constexpr(chunks):
                    r = cute.make_rmem_tensor(regs, Float32)
                    cute.copy(load, cute.make_tensor(tdQtdQ.iterator + c * BWD_DQ_CHUNK,
                                                     tdQtdQ.layout), r)
                    if const_expr(c == chunks - 1):  # dQ read: dP^T may take the columns
                        cute.arch.fence_view_async_tmem_load()
                        pipes["dq"].consumer_release(at(phase))
                    self.stage_dq_chunk(r, smem, buf, stage_layout, tidx)
                    if tidx == 0:
                        for w in cutlass.range_constexpr(2):
                            offset = (m_block * (self.tile_m * self.head_dim)
                                      + w * (self.tile_m // 2 * self.head_dim)
                                      + c * half_rows)
                            bulk_add_f32(gAcc.iterator + offset,
                                         smem["dQ"][None, buf].iterator + w * half_rows,
                                         half_rows * 4)
                        cute.arch.cp_async_bulk_commit_group()
                    buf = buf ^ 1
                if const_expr(self.cfg.deterministic):
                    if tidx == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=False)
                        cute.arch.fence_acq_rel_gpu()
                        pass_turn(turn_ptr)
                phase ^= 1
        if tidx == 0:  # shared memory must outlive the last add's reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def stage_dq_chunk(self, r, smem, buf, stage_layout, tidx):
        """This lane's 32 floats of dQ (registers ``r``) into staging buffer ``buf``
        (Note [dQ accumulator order]) once the bulk add that read it two chunks ago has finished,
        and visible to the next bulk add (async proxy) when this returns: every dQ thread calls it.
        """
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(BWD_DQ_BUFFERS - 1, read=True)
        cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_STAGE), number_of_threads=GROUP_THREADS)
        sStage = cute.make_tensor(smem["dQ"][None, buf].iterator, stage_layout)
        cute.autovec_copy(cute.make_tensor(r.iterator, cute.make_layout(BWD_DQ_CHUNK)),
                          sStage[tidx, None])
        cute.arch.fence_view_async_shared()  # for the bulk add (async proxy)
        cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_STAGE), number_of_threads=GROUP_THREADS)
