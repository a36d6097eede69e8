"""Chapter 04 on a CPU: the FlashAttention-2 kernel's indexing and softmax, run host-side in CuTe.

The kernel (solutions/ch04_flash_ampere.py) needs a GPU; its index arithmetic does not. A
``@cute.jit`` function that launches nothing runs on the CPU, so this module walks, with the
kernel's own pieces, exactly what one CTA and each of its threads do:

- the CTA tiles: ``local_tile`` of Q, K, V by (m_block, n_block), as in the kernel's section 2;
- the thread partition: the kernel's TiledMma (``make_tiled_mma``), ``partition_C`` of an
  identity tensor, i.e. the real mma.sync thread-value layout: which thread holds which (row,
  col) of S and of O;
- ``kv_tile_range`` (which KV tiles a query tile visits; causal tiles above the diagonal are
  skipped), the kernel's ``apply_mask`` method on one thread's fragment, ``rows_cols_view``;
- the online softmax with the same formulas, one thread at a time. The kernel's two butterfly
  shuffles inside a quad (``quad_allreduce``) become two passes over a NumPy "register file"
  that holds one row per thread.

What stays on the GPU side: shared memory, cp.async, ldmatrix, mma.sync and barriers. Here the
MMA is a dot product per fragment element, and P V reads P from an (m_block, n_block) array that
stands for the A operand the MMA would assemble from the four lanes of each quad. Rows past the
end of Q, K, V contribute zeros, as the kernel's zero-filled shared memory does.

    out, lse = forward(q, k, v, causal=True)          # NumPy float32 (batch, seqlen, heads, dim)
    thread_s_elements(5)                              # [(1, 2), (1, 3), (9, 2), ...]
"""

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass import Float32, Int32
from cutlass.cute.runtime import from_dlpack

from solutions.ch04_flash_ampere import (
    LN_2,
    LOG2_E,
    SUPPORTED_HEAD_DIMS,
    FlashAttentionAmpere,
    TileConfig,
    acc_as_a_operand,
    default_config,
    kv_tile_range,
    rows_cols_view,
)
from utils.reference import check_attention_inputs

P_ROUNDINGS = (None, "fp16", "bf16")


def _kernel(head_dim: int, causal: bool, config: TileConfig | None) -> FlashAttentionAmpere:
    config = default_config(head_dim) if config is None else config
    return FlashAttentionAmpere(cutlass.BFloat16, head_dim, causal, config)


# ----------------------------------------------------------------------------------------------
# Who holds what: the real thread-value layout of the kernel's MMA


@cute.jit
def _s_coordinates(coords: cute.Tensor, tidx: Int32, kernel: cutlass.Constexpr):
    """coords[i] = (row, col) in the S tile of fragment element i of thread ``tidx``."""
    thr_mma = kernel.make_tiled_mma().get_slice(tidx)
    tScS = thr_mma.partition_C(cute.make_identity_tensor((kernel.m_block, kernel.n_block)))
    for i in cutlass.range(cute.size(tScS)):  # ((2, 2), MMA_M, MMA_N), register order
        coords[i, 0] = tScS[i][0]
        coords[i, 1] = tScS[i][1]


@cute.jit
def _s_owners(owner: cute.Tensor, kernel: cutlass.Constexpr):
    """owner[row, col] = the thread whose accumulator holds S[row, col]."""
    tiled_mma = kernel.make_tiled_mma()
    cS = cute.make_identity_tensor((kernel.m_block, kernel.n_block))
    for t in cutlass.range(kernel.num_threads):
        tScS = tiled_mma.get_slice(t).partition_C(cS)  # ((2, 2), MMA_M, MMA_N) -> (row, col)
        for i in cutlass.range(cute.size(tScS)):
            owner[tScS[i][0], tScS[i][1]] = t


def thread_s_elements(tidx: int, config: TileConfig | None = None, head_dim: int = 128):
    """The (row, col) elements of the S tile that thread ``tidx`` holds, in register order.

    Built from the kernel's own TiledMma on the CPU (``partition_C`` of an identity tensor), so
    this is the mma.sync layout itself: lane l of warp w holds rows 16w + l // 4 (+ 8, + 16 *
    warps ...) and columns 2 * (l % 4) (+ 1, + 8 ...)."""
    kernel = _kernel(head_dim, False, config)
    if not 0 <= tidx < kernel.num_threads:
        raise ValueError(f"tidx must be in [0, {kernel.num_threads}), got {tidx}")
    n = kernel.m_block * kernel.n_block // kernel.num_threads
    coords = np.zeros((n, 2), dtype=np.int32)
    _s_coordinates(from_dlpack(coords), Int32(tidx), kernel)
    return [(int(r), int(c)) for r, c in coords]


def s_owner_map(config: TileConfig | None = None, head_dim: int = 128) -> np.ndarray:
    """(m_block, n_block) int array: which thread holds each element of S (for a picture)."""
    kernel = _kernel(head_dim, False, config)
    owner = np.full((kernel.m_block, kernel.n_block), -1, dtype=np.int32)
    _s_owners(from_dlpack(owner), kernel)
    return owner


class _OperandCheck:
    def __init__(self, kernel: FlashAttentionAmpere):
        self.kernel = kernel

    @cute.jit
    def run(self, mismatches: cute.Tensor):
        tiled_mma = self.kernel.make_tiled_mma()
        cP = cute.make_identity_tensor((self.kernel.m_block, self.kernel.n_block))
        for t in cutlass.range(self.kernel.num_threads):
            thr_mma = tiled_mma.get_slice(t)
            wanted = thr_mma.partition_A(cP)  # (MMA, MMA_M, MMA_K) -> (row, k) the mma expects
            held = acc_as_a_operand(thr_mma.partition_C(cP))  # (row, col) of P's registers
            for i in cutlass.range(cute.size(wanted)):
                if wanted[i][0] != held[i][0] or wanted[i][1] != held[i][1]:
                    mismatches[0] = mismatches[0] + 1


def p_as_a_operand_mismatches(config: TileConfig | None = None, head_dim: int = 128) -> int:
    """Note [P as an A operand], checked on the layouts themselves: for every thread and every
    register, the (row, col) of P that ``acc_as_a_operand`` puts there against the (row, k) the
    PV mma.sync expects there (``partition_A``). Returns the number of disagreements (0)."""
    mismatches = np.zeros(1, dtype=np.int32)
    _OperandCheck(_kernel(head_dim, False, config)).run(from_dlpack(mismatches))
    return int(mismatches[0])


# ----------------------------------------------------------------------------------------------
# The forward pass, thread by thread


@cute.jit
def _max(a: Float32, b: Float32) -> Float32:
    """The kernel's cute.arch.fmax is a GPU instruction; on the CPU a compare and select."""
    return a if a > b else b


@cute.jit
def _round_p(p: Float32, p_round: cutlass.Constexpr) -> Float32:
    """P as the PV mma sees it: rounded to the input type. bf16 keeps 8 significant bits and
    the CPU JIT has no bf16 conversion, so Veltkamp's split does it in float32: with
    c = p * (2^16 + 1), c - (c - p) is p rounded to the nearest 24 - 16 = 8-bit significand."""
    if cutlass.const_expr(p_round == "fp16"):
        return p.to(cutlass.Float16).to(Float32)
    elif cutlass.const_expr(p_round == "bf16"):
        c = p * Float32(65537.0)
        return c - (c - p)
    else:
        return p


class ThreadByThread:
    """One CTA of the kernel, stepped thread by thread on the CPU.

    The state a GPU thread keeps in registers lives here in small NumPy arrays with one row per
    thread (a "register file"): ``reg_S`` (its S / P fragment), ``reg_O`` (its O fragment),
    ``reg_max`` and ``reg_sum`` (its softmax state). Each phase of a KV step loops over all
    threads before the next phase starts, which is what the kernel's warps do between barriers.
    The methods are ``@cute.jit`` methods (not functions with a Constexpr argument) so that the
    kernel object can be used inside run-time loops.
    """

    def __init__(self, kernel: FlashAttentionAmpere, p_round=None):
        self.kernel = kernel
        self.p_round = p_round

    @cute.jit
    def run(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, dim) float32
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, dim)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q)
        reg_S: cute.Tensor,  # (threads, S fragment)
        reg_O: cute.Tensor,  # (threads, O fragment)
        reg_max: cute.Tensor,  # (threads, rows per thread)
        reg_sum: cute.Tensor,  # (threads, rows per thread)
        quad: cute.Tensor,  # (2, threads, rows per thread): the two steps of a quad shuffle
        tile_P: cute.Tensor,  # (m_block, n_block): P as the PV mma's A operand
        scale_log2: Float32,
    ):
        """The grid: one CTA per (query tile, head, batch), here one after another."""
        M = self.kernel.m_block
        regs = SimpleNamespace(S=reg_S, O=reg_O, max=reg_max, sum=reg_sum, quad=quad, P=tile_P)
        for batch in cutlass.range(mQ.shape[0]):
            for head in cutlass.range(mQ.shape[2]):
                for m_block in cutlass.range(cute.ceil_div(mQ.shape[1], M)):
                    self.cta(mQ, mK, mV, mO, mLSE, regs, scale_log2, m_block, head, batch)

    @cute.jit
    def cta(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        regs: SimpleNamespace,
        scale_log2: Float32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
    ):
        """The kernel's sections 1, 2, 7 and 8 for one CTA."""
        M, N, D = self.kernel.m_block, self.kernel.n_block, self.kernel.head_dim
        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        n_block_max, n_block_masked_min = kv_tile_range(
            m_block, seqlen_q, seqlen_k, M, N, self.kernel.causal
        )
        n_block_first = cutlass.max(n_block_max - 1, 0)
        gQ = cute.local_tile(mQ[batch, None, head, None], (M, D), (m_block, 0))  # (M, D)
        gK = cute.local_tile(mK[batch, None, head_kv, None], (N, D), (None, 0))  # (N, D, n)
        gV = cute.local_tile(mV[batch, None, head_kv, None], (N, D), (None, 0))  # (N, D, n)
        rows_left_q = seqlen_q - m_block * M

        for t in cutlass.range(self.kernel.num_threads):
            for r in cutlass.range(cute.size(regs.max, mode=[1])):
                regs.max[t, r] = -Float32.inf
                regs.sum[t, r] = Float32(0.0)
            for i in cutlass.range(cute.size(regs.O, mode=[1])):
                regs.O[t, i] = Float32(0.0)

        # The KV loop, last tile first, as in the kernel.
        for step in cutlass.range(n_block_first + 1):
            n_block = n_block_first - step
            rows_left_k = seqlen_k - n_block * N
            masked = step == 0  # the first tile may stick out past seqlen_k
            if cutlass.const_expr(self.kernel.causal):
                masked = masked | (n_block >= n_block_masked_min)  # it crosses the diagonal
            self.scores(gQ, gK, regs, m_block, n_block, rows_left_q, rows_left_k, masked,
                        seqlen_q, seqlen_k)
            self.quad_reduce(regs, is_max=True)
            self.softmax(regs, scale_log2)
            self.pv(gV, regs, n_block, rows_left_k)

        self.quad_reduce(regs, is_max=False)
        self.epilogue(mO, mLSE, regs, scale_log2, m_block, head, batch, rows_left_q)

    @cute.jit
    def scores(
        self,
        gQ: cute.Tensor,  # (M, D)
        gK: cute.Tensor,  # (N, D, n)
        regs: SimpleNamespace,
        m_block: Int32,
        n_block: Int32,
        rows_left_q: Int32,
        rows_left_k: Int32,
        masked: cutlass.Boolean,
        seqlen_q: Int32,
        seqlen_k: Int32,
    ):
        """Kernel step (c) and the start of (e): each thread's S fragment (a dot product where
        the kernel has mma.sync; rows past the end are the kernel's zero-filled rows), the
        kernel's own apply_mask, and the thread-local part of each row max."""
        tiled_mma = self.kernel.make_tiled_mma()
        cS = cute.make_identity_tensor((self.kernel.m_block, self.kernel.n_block))
        t0ScS = rows_cols_view(tiled_mma.get_slice(0).partition_C(cS))
        for t in cutlass.range(self.kernel.num_threads):
            tScS = tiled_mma.get_slice(t).partition_C(cS)  # ((2, 2), MMA_M, MMA_N) -> (row, col)
            acc_S = cute.make_rmem_tensor(tScS.shape, Float32)  # (MMA, MMA_M, MMA_N)
            for i in cutlass.range(cute.size(acc_S)):
                row, col = tScS[i]
                dot = Float32(0.0)
                if row < rows_left_q and col < rows_left_k:
                    for d in cutlass.range(self.kernel.head_dim):
                        dot = dot + gQ[row, d] * gK[col, d, n_block]
                acc_S[i] = dot
            if masked:
                self.kernel.apply_mask(acc_S, rows_cols_view(tScS), t0ScS, m_block, n_block,
                                       seqlen_q, seqlen_k)
            s = rows_cols_view(acc_S)  # ((2, MMA_M), (2, MMA_N))
            for r in cutlass.range(cute.size(s, mode=[0])):
                regs.quad[0, t, r] = s[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            for i in cutlass.range(cute.size(acc_S)):
                regs.S[t, i] = acc_S[i]

    @cute.jit
    def quad_reduce(self, regs: SimpleNamespace, is_max: cutlass.Constexpr):
        """The kernel's quad_allreduce: lane t combines with lane t ^ 2, then with t ^ 1, so the
        4 lanes of a quad (t // 4 equal) end with the same value. In: regs.quad[0] (row max
        candidates, is_max) or regs.sum. Out: regs.quad[0]."""
        T = self.kernel.num_threads
        rows = cute.size(regs.max, mode=[1])
        for t in cutlass.range(T):
            for r in cutlass.range(rows):
                if cutlass.const_expr(is_max):
                    regs.quad[1, t, r] = _max(regs.quad[0, t, r], regs.quad[0, t ^ 2, r])
                else:
                    regs.quad[1, t, r] = regs.sum[t, r] + regs.sum[t ^ 2, r]
        for t in cutlass.range(T):
            for r in cutlass.range(rows):
                if cutlass.const_expr(is_max):
                    regs.quad[0, t, r] = _max(regs.quad[1, t, r], regs.quad[1, t ^ 1, r])
                else:
                    regs.quad[0, t, r] = regs.quad[1, t, r] + regs.quad[1, t ^ 1, r]

    @cute.jit
    def softmax(self, regs: SimpleNamespace, scale_log2: Float32):
        """Kernel step (e), the kernel's online_softmax formulas, per thread; P also goes to the
        A-operand tile, rounded as the PV mma would see it."""
        M, N, D = self.kernel.m_block, self.kernel.n_block, self.kernel.head_dim
        tiled_mma = self.kernel.make_tiled_mma()
        cS = cute.make_identity_tensor((M, N))
        for t in cutlass.range(self.kernel.num_threads):
            thr_mma = tiled_mma.get_slice(t)
            tScS = thr_mma.partition_C(cS)  # ((2, 2), MMA_M, MMA_N) -> (row, col)
            acc_S = cute.make_rmem_tensor(tScS.shape, Float32)  # (MMA, MMA_M, MMA_N)
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, D)), Float32)
            for i in cutlass.range(cute.size(acc_S)):
                acc_S[i] = regs.S[t, i]
            for i in cutlass.range(cute.size(acc_O)):
                acc_O[i] = regs.O[t, i]
            s = rows_cols_view(acc_S)  # ((2, MMA_M), (2, MMA_N))
            o = rows_cols_view(acc_O)  # ((2, MMA_M), (2, MMA_D))
            for r in cutlass.range(cute.size(s, mode=[0])):
                m_old = regs.max[t, r]
                m_new = _max(m_old, regs.quad[0, t, r])
                regs.max[t, r] = m_new
                m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
                correction = cute.math.exp2((m_old - m_safe) * scale_log2)
                p_row = cute.math.exp2(s[r, None].load() * scale_log2 - m_safe * scale_log2)
                s[r, None].store(p_row)
                p_sum = p_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                regs.sum[t, r] = regs.sum[t, r] * correction + p_sum
                o[r, None].store(o[r, None].load() * correction)
            for i in cutlass.range(cute.size(acc_S)):
                regs.S[t, i] = acc_S[i]
                regs.P[tScS[i][0], tScS[i][1]] = _round_p(acc_S[i], self.p_round)
            for i in cutlass.range(cute.size(acc_O)):
                regs.O[t, i] = acc_O[i]

    @cute.jit
    def pv(self, gV: cute.Tensor, regs: SimpleNamespace, n_block: Int32, rows_left_k: Int32):
        """Kernel step (f): O += P V for each thread's O elements (gV: (N, D, n))."""
        M, N, D = self.kernel.m_block, self.kernel.n_block, self.kernel.head_dim
        tiled_mma = self.kernel.make_tiled_mma()
        cO = cute.make_identity_tensor((M, D))
        for t in cutlass.range(self.kernel.num_threads):
            tOcO = tiled_mma.get_slice(t).partition_C(cO)  # ((2, 2), MMA_M, MMA_D) -> (row, col)
            for i in cutlass.range(cute.size(tOcO)):
                row, col = tOcO[i]
                acc = regs.O[t, i]
                for j in cutlass.range(cutlass.min(rows_left_k, N)):
                    acc = acc + regs.P[row, j] * gV[j, col, n_block]
                regs.O[t, i] = acc

    @cute.jit
    def epilogue(
        self,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        regs: SimpleNamespace,
        scale_log2: Float32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        rows_left_q: Int32,
    ):
        """The kernel's finalize and section 8: O / l, lse = (m * c + log2(l)) * ln 2, stores of
        the rows that exist. regs.quad[0] holds the quad-summed row sums l."""
        M, D = self.kernel.m_block, self.kernel.head_dim
        tiled_mma = self.kernel.make_tiled_mma()
        cO = cute.make_identity_tensor((M, D))
        for t in cutlass.range(self.kernel.num_threads):
            thr_mma = tiled_mma.get_slice(t)
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, D)), Float32)
            for i in cutlass.range(cute.size(acc_O)):
                acc_O[i] = regs.O[t, i]
            o = rows_cols_view(acc_O)  # ((2, MMA_M), (2, MMA_D))
            tOcO = rows_cols_view(thr_mma.partition_C(cO))  # the same -> (row, col)
            for r in cutlass.range(cute.size(o, mode=[0])):
                row = tOcO[r, 0][0]
                total = regs.quad[0, t, r]
                seen = total > Float32(0.0)
                if row < rows_left_q:
                    inv = Float32(1.0) / (total if seen else Float32(1.0))
                    gO = mO[batch, m_block * M + row, head, None]  # (D,)
                    for c in cutlass.range(cute.size(o, mode=[1])):
                        gO[tOcO[r, c][1]] = o[r, c] * inv
                    if tOcO[0][1] == 0:  # the lane holding column 0 writes the LSE
                        lse = -Float32.inf
                        if seen:
                            lse = (regs.max[t, r] * scale_log2 + cute.math.log2(total)) * LN_2
                        mLSE[batch, head, m_block * M + row] = lse


def forward(q, k, v, causal=False, softmax_scale=None, config=None, p_dtype=None):
    """The kernel's computation on the CPU: NumPy float32 q (batch, seqlen_q, heads, dim), k, v
    (batch, seqlen_k, heads_kv, dim) -> (out float32 like q, lse float32 (batch, heads,
    seqlen_q)). ``p_dtype`` ("bf16", "fp16" or None) rounds P as the kernel's PV mma sees it.
    Small inputs only: every thread of every CTA is stepped through one after another."""
    arrays = []
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
        if a.dtype != np.float32:
            raise TypeError(f"{name} must be float32 (the CPU model's storage type), got {a.dtype}")
        arrays.append(np.ascontiguousarray(a))
    q, k, v = arrays
    b, sq, sk, h, hk, d = check_attention_inputs(*(torch.from_numpy(a) for a in arrays),
                                                 softmax_scale)
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0 (as in the kernel), got {softmax_scale!r}")
    if p_dtype not in P_ROUNDINGS:
        raise ValueError(f"p_dtype must be one of {P_ROUNDINGS}, got {p_dtype!r}")
    kernel = _kernel(d, bool(causal), config)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)

    T = kernel.num_threads
    frag_S = kernel.m_block * kernel.n_block // T
    frag_O = kernel.m_block * d // T
    rows = 2 * kernel.m_block // (16 * kernel.num_warps)  # 2 rows per 16-row MMA atom
    out = np.zeros((b, sq, h, d), dtype=np.float32)
    lse = np.zeros((b, h, sq), dtype=np.float32)
    register_file = [
        np.zeros((T, frag_S), np.float32),
        np.zeros((T, frag_O), np.float32),
        np.zeros((T, rows), np.float32),
        np.zeros((T, rows), np.float32),
        np.zeros((2, T, rows), np.float32),
        np.zeros((kernel.m_block, kernel.n_block), np.float32),
    ]
    tensors = [from_dlpack(a).mark_layout_dynamic() for a in (q, k, v, out, lse)]
    ThreadByThread(kernel, p_dtype).run(
        *tensors, *(from_dlpack(a) for a in register_file), Float32(scale * LOG2_E)
    )
    return out, lse


__all__ = [
    "P_ROUNDINGS",
    "ThreadByThread",
    "forward",
    "p_as_a_operand_mismatches",
    "s_owner_map",
    "thread_s_elements",
]
