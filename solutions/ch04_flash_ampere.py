"""Chapter 04: FlashAttention-2 forward in CuTe DSL, Ampere style (cp.async + ldmatrix + mma.sync).

What this adds over chapter 02's tiled PyTorch loop: the same online softmax over K/V tiles, but
one CTA per (query tile, head, batch) keeps everything between the loads of Q, K, V and the
store of O on chip. Chapter 02 ran a few PyTorch kernels per KV tile and sent S, P and the
running O through HBM each time; here S and P live only in registers and O is written once.

Why it is fast (D = 128, bf16, one trip of the KV loop for a 128-row Q tile and n_block keys):
- FLOPs: S = QK^T is 2 * 128 * n_block * 128 and O += PV the same again, on tensor cores
  (mma.sync m16n8k16, fp32 accumulate); the softmax adds 128 * n_block exp2 on the MUFU unit.
- Global memory: only the K and V tiles, 2 * n_block * 128 * 2 B, i.e. 128 FLOPs per byte; all
  query tiles of a head read the same K/V, so most of it comes from L2. Q is read once and O
  written once per CTA.
- Loads are asynchronous (cp.async, 16 B per thread, global -> shared without passing through
  registers): V is fetched during S = QK^T and the softmax, the next K during PV
  (Note [Pipeline]).
- ldmatrix moves 8x8 blocks of 16-bit values from shared memory straight into the register
  layout mma.sync wants; the shared-memory layout (padded or swizzled, Note [Bank conflicts])
  keeps both the cp.async writes and the ldmatrix reads free of bank conflicts.
- P never leaves registers: the fp32 accumulator layout of S, cast to bf16/fp16, is exactly the
  A-operand layout of the next mma.sync (Note [P as an A operand]).
- Causal: KV tiles above the diagonal are never loaded; only tiles that cross it pay for a
  per-element mask.
- Tiles of 128 queries x 64 keys for 4 warps of 32 rows: every K and V value read from shared
  memory feeds 32 rows of MMAs (Note [Work split]), and the O rescale, acc_O FMULs per tile,
  costs 2 per score (4 with 32-key tiles). Fitting this in 255 registers without spills takes
  some care (Note [Registers]).
Measured speed and accuracy on the H200: see results/h200/ch04_*.json (the notebook prints them).

Entry points: ``attention(q, k, v, causal=False, softmax_scale=None, config=None) -> (out, lse)``
(CUDA tensors, layout (batch, seqlen, heads, dim)); ``compile_only(arch, ...)`` and
``config_report`` for CI with no GPU; ``launched_resources`` for the registers and stack of a
kernel compiled on the GPU. On a GPU, ``python -m solutions.ch04_flash_ampere`` with
``--small`` (two cases; also run under compute-sanitizer) or ``--check`` (CHECK_CASES). The tile
sweep that times SWEEP_CONFIGS is ``python -m measure.ch04_sweep``.

Note [Work split]. A CTA has num_threads // 32 warps stacked along the query rows: warp w owns
rows 16w .. 16w + 15 of every block of 16 * warps rows, for S and for O, so a row's softmax
never leaves its warp. With 4 warps and m_block = 128 each warp owns 32 rows: every K and V
value it reads from shared memory feeds 32 rows of MMAs (16 with 8 warps, which halves the
FLOPs per shared-memory byte).

Note [Registers]. mma.sync keeps its accumulators in registers, so a thread holds
m_block * head_dim / num_threads fp32 values of O and m_block * n_block / num_threads of S: at
D = 128, 128 x 64 and 4 warps that is 128 + 64 of the 255 registers a thread may have. The other
63 hold the operand fragments, the softmax state (a max and a sum for each of the thread's 4
rows) and some 20 addresses and indices. That fits only if ptxas does not spend registers on
loading ahead, and it does: to hide ldmatrix latency it hoists each load as early as its
dependences allow. With the k-loop of S = QK^T fully unrolled it issues the loads of later
k-slices several mma.sync ahead, and with nothing to stop it, it hoists V's fragments into the
softmax while the fp32 scores are still live (up to 9 ldmatrix.x4 of V, 36 registers, in
flight at the peak). At 255 that ends in spills, 12-92 instructions' worth at 128 x 64
(CUTLASS's and FA4's Ampere-style kernels spill there too). Two choices bound the look-ahead
instead of shrinking the tile. (1) S = QK^T is a run-time loop over its 16-wide
k-slices, unrolled only qk_unroll times (gemm_from_smem): ptxas does not move loads from one
trip of a loop into an earlier one, so at most qk_unroll slices of Q and K fragments (8 + 16
registers per slice at 32 rows x 64 keys) sit on top of S. (2) The barrier that says "V has
landed" comes after the softmax, just before O += PV: shared-memory loads cannot move above a
barrier, so V's fragments arrive once S has become P (32 registers of bf16, not 64 of fp32).
With both, 128 x 64 compiles with no spills for sm_80 and sm_90a, causal or not. At D = 128 the
fully unrolled loop (qk_unroll = D / 16) still spills, and the sweep keeps it to measure the
cost; at D = 64, with 64 fewer accumulator registers, it fits and is the default.
config_report() lists registers, stack bytes and spill instructions of every swept tile.
"""

import argparse
import sys
import tempfile
from dataclasses import dataclass, replace
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import from_dlpack

from fa4_final.common import tiles
from fa4_final.common.constants import LN_2, LOG2_E
from fa4_final.common.fragments import acc_as_a_operand
from fa4_final.common.fragments import acc_rows_cols as rows_cols_view
from utils import checks
from utils.hardware import device_arch
from utils.reference import check_attention_inputs

SUPPORTED_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
SUPPORTED_HEAD_DIMS = (64, 128)
SMEM_LAYOUTS = ("padded", "swizzled")
# Shared memory one CTA may use on the smallest target (A100: 163 KB; H100/H200 allow 227 KB).
SMEM_LIMIT_BYTES = 163 * 1024
# Offsets inside one (batch, head) slice and across the batch are 32-bit (fewer registers).
MAX_ELEMENTS = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# Tuning knobs


@dataclass(frozen=True)
class TileConfig:
    """The knobs of one compiled kernel.

    m_block:     query rows per CTA (one Q tile, loaded once).
    n_block:     key/value rows per step of the KV loop.
    num_threads: threads per CTA; num_threads // 32 warps split the m_block rows (Note [Work
                 split]).
    num_stages:  shared-memory buffers for K and for V: 1 interleaves the loads of a single
                 buffer each (FlashAttention-2); 2 or 3 fetch S - 1 steps further ahead (Note
                 [Pipeline]); each buffer costs shared memory, and with it CTAs per SM.
    smem_layout: "padded" (8 spare elements per row) or "swizzled" (XOR of the 16-byte chunk
                 index with the row): two ways to avoid bank conflicts (Note [Bank conflicts]).
    qk_unroll:   16-wide k-slices of S = QK^T per trip of its loop: 1 keeps one slice of Q and
                 K fragments live, head_dim // 16 unrolls the loop fully and lets ptxas load
                 ahead as far as it likes (Note [Registers]).
    skip_rescale: a warp vote skips the O rescale of a step in which no row of the warp found a
                 larger max (Note [Skipping the rescale]); exact: the factor is then 1.
    """

    m_block: int = 128
    n_block: int = 64
    num_threads: int = 128
    num_stages: int = 1
    smem_layout: str = "padded"
    qk_unroll: int = 1
    skip_rescale: bool = False

    @property
    def num_warps(self) -> int:
        return self.num_threads // 32

    def smem_row(self, head_dim: int) -> int:
        """Elements from one row of a shared-memory tile to the next."""
        return head_dim + 8 if self.smem_layout == "padded" else head_dim

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Q tile + num_stages K tiles + num_stages V tiles (the O tile reuses Q's)."""
        rows = self.m_block + 2 * self.num_stages * self.n_block
        return rows * self.smem_row(head_dim) * elem_bytes

    def accumulator_registers(self, head_dim: int) -> dict[str, int]:
        """fp32 accumulator registers per thread (Note [Registers])."""
        return {
            "acc_O": self.m_block * head_dim // self.num_threads,
            "acc_S": self.m_block * self.n_block // self.num_threads,
        }

    def check(self, head_dim: int) -> None:
        """Raise ValueError naming the first knob this kernel cannot run with."""
        if self.num_threads % 32 or not 1 <= self.num_warps <= 16:
            raise ValueError(f"num_threads must be 32..512 in steps of 32, got {self.num_threads}")
        if self.m_block % (16 * self.num_warps):
            raise ValueError(
                f"m_block must be a multiple of 16 * warps = {16 * self.num_warps} (each warp "
                f"owns 16-row slices of the Q tile), got m_block={self.m_block}"
            )
        if self.n_block < 16 or self.n_block % 16:
            raise ValueError(
                f"n_block must be a positive multiple of 16 (P is reused as the 16-wide A "
                f"operand of the PV mma), got {self.n_block}"
            )
        rows_per_copy = self.num_threads // 8  # 8 threads x 16 B cover a 128-byte row chunk
        if self.m_block % rows_per_copy or self.n_block % rows_per_copy:
            raise ValueError(
                f"m_block and n_block must be multiples of num_threads // 8 = {rows_per_copy} "
                f"(rows covered by one pass of the 16-byte copies), got "
                f"m_block={self.m_block}, n_block={self.n_block}"
            )
        if self.num_stages not in (1, 2, 3):
            raise ValueError(f"num_stages must be 1, 2 or 3, got {self.num_stages}")
        if self.smem_layout not in SMEM_LAYOUTS:
            raise ValueError(f"smem_layout must be one of {SMEM_LAYOUTS}, got {self.smem_layout!r}")
        k_slices = head_dim // 16
        if self.qk_unroll < 1 or k_slices % self.qk_unroll:
            raise ValueError(
                f"qk_unroll must divide head_dim // 16 = {k_slices} (the k-slices of QK^T), got "
                f"{self.qk_unroll}"
            )
        if self.smem_bytes(head_dim) > SMEM_LIMIT_BYTES:
            raise ValueError(
                f"{self} needs {self.smem_bytes(head_dim)} B of shared memory at head_dim "
                f"{head_dim}; the limit is {SMEM_LIMIT_BYTES} B"
            )


# The defaults: 4 warps of 32 rows (the best FLOPs per shared-memory byte, Note [Work split]),
# 64-key tiles (the O rescale costs acc_O FMULs per tile: 2 per score at n_block 64, 4 at 32),
# the swizzled layout (faster than padded in every measured pair) and, among the qk_unroll that
# compile with no spills for sm_80 and sm_90a, bf16 and fp16, causal or not, the fastest (Note
# [Registers]; tests/test_ch04_compile.py checks the spills, results/h200/ch04_sweep the speed):
#   D=128: acc_O 128 + acc_S 64 registers; qk_unroll 2 (1 spills 3 instructions for fp16 on
#          sm_80; 4 spills 66-71 on sm_80; 8, fully unrolled, spills 22-78).
#   D=64:  acc_O 64 + acc_S 64; qk_unroll 4, the loop fully unrolled: 64 fewer accumulator
#          registers leave room for it (it measured 1.11x the single-slice loop on the H200).
DEFAULT_CONFIGS = {
    64: TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=4),
    128: TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=2),
}

# Where one machine does better with another tile that still spills nothing there, in that
# dtype: (arch, head dim, causal, dtype) -> tile. On sm_90 (H100/H200) at D = 128, measured on the
# H200 (results/h200/ch04_sweep.json):
# - non-causal: two stages (K and V fetched a whole step ahead) and 4 k-slices per trip of QK^T's
#   loop were faster than the default in every run; spill-free on sm_90a in bf16 and fp16 (on
#   sm_80 they spill 39-79 instructions).
# - causal: 4 k-slices per trip with one stage, 1.05x the default; spill-free on sm_90a in bf16
#   only (fp16 spills 2 instructions there), so fp16 keeps the portable default.
# tests/test_ch04_compile.py checks every entry on its own arch and dtype.
SM90_D128_TILE = TileConfig(128, 64, 128, num_stages=2, smem_layout="swizzled", qk_unroll=4)
TUNED_CONFIGS = {
    ("sm_90", 128, False, "bf16"): SM90_D128_TILE,
    ("sm_90", 128, False, "fp16"): SM90_D128_TILE,
    ("sm_90", 128, True, "bf16"): TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=4),
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}

# What the chapter sweeps (measure.ch04_sweep checks each tile, then times it): the default and one
# knob changed at a time, including tiles that spill, to measure what a spill costs.
SWEEP_CONFIGS = {
    64: (
        DEFAULT_CONFIGS[64],
        TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=1),  # one k-slice per trip
        # 128-key tiles (acc_S 128): half the O rescales per score; fits padded, spills swizzled
        TileConfig(128, 128, 128, qk_unroll=2),
        TileConfig(128, 64, 128, num_stages=2, smem_layout="swizzled", qk_unroll=4),
    ),
    128: (
        DEFAULT_CONFIGS[128],
        SM90_D128_TILE,  # 2 stages, 4 k-slices per trip
        # the same, with the O rescale skipped when no row's max grew (exact)
        replace(SM90_D128_TILE, skip_rescale=True),
        TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=1),
        TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=4),
        TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=8),  # fully unrolled: spills
        TileConfig(128, 64, 128, smem_layout="padded", qk_unroll=2),
        TileConfig(128, 64, 128, num_stages=2, smem_layout="swizzled", qk_unroll=2),
        # 3 stages: 128 KB of shared memory, so one CTA per SM instead of two
        TileConfig(128, 64, 128, num_stages=3, smem_layout="swizzled", qk_unroll=4),
        TileConfig(128, 32, 128, smem_layout="swizzled", qk_unroll=2),
        TileConfig(256, 64, 256, smem_layout="swizzled", qk_unroll=2),  # 8 warps x 32 rows
    ),
}


def default_config(head_dim: int, causal: bool = False, arch: str | None = None,
                   dtype: str = "bf16") -> TileConfig:
    """The tile ``attention`` uses when given none: TUNED_CONFIGS[(arch, head_dim, causal,
    dtype)] if there is one (arch as "sm_90", None: any GPU; dtype "bf16" or "fp16"), else
    DEFAULT_CONFIGS[head_dim]."""
    if head_dim not in DEFAULT_CONFIGS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return TUNED_CONFIGS.get((arch, head_dim, bool(causal), dtype), DEFAULT_CONFIGS[head_dim])


# ----------------------------------------------------------------------------------------------
# Register-fragment views of the mma.sync m16n8k16 accumulator
#
# Each warp computes 16 x 8 blocks of C; lane l holds rows (l // 4, l // 4 + 8) and columns
# (2 * (l % 4), 2 * (l % 4) + 1) of each block: 4 fp32 values, the "(2, 2)" mode of a fragment
# of shape ((2, 2), MMA_M, MMA_N), whose first 2 walks the column pair and second the row pair.
# The 4 lanes of a quad (same l // 4) share rows, so a row reduction is a thread-local one
# followed by two butterfly shuffles (lane offsets 2 and 1) inside the quad.


# rows_cols_view and acc_as_a_operand (Note [P as an A operand]: for m16n8k16 the A fragment of
# lane l is rows (l // 4, +8) at k = (2 * (l % 4), +1) and (2 * (l % 4) + 8, +1), exactly the C
# fragments of two neighbouring 8-column blocks, so pairing the n-blocks is the whole conversion)
# are fa4_final.common.fragments' views, written once for mma.sync and wgmma fragments alike.


@cute.jit
def quad_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    """Combine ``x`` over the 4 lanes of a quad (they hold the same rows): after the shuffle at
    offset 2, lanes {0, 2} and {1, 3} agree; after offset 1 all four do."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return op(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def fmax(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b)


@cute.jit
def fadd(a: Float32, b: Float32) -> Float32:
    return a + b


# ----------------------------------------------------------------------------------------------
# Which KV tiles a query tile visits


@cute.jit
def kv_tile_range(
    m_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):
    """Return (n_block_max, n_block_masked_min) for query tile ``m_block``.

    KV tiles 0 .. n_block_max - 1 are visited; tiles at or above n_block_masked_min need a
    per-element mask. Causal, bottom-right aligned: query i sees key j <= i + seqlen_k -
    seqlen_q. The tile's last row sees keys up to (m_block + 1) * tile_m - 1 + seqlen_k -
    seqlen_q, so tiles past that are skipped without being loaded; its first row sees keys up
    to m_block * tile_m + seqlen_k - seqlen_q, so tiles ending at or before that key need no
    mask. Non-causal: only the last tile can stick out past seqlen_k.
    """
    # fa4_final.common.tiles does the arithmetic (shared with chapters 05 and 08); this kernel's
    # loop always peels its first visited tile as a masked one, hence the n_block_max - 1.
    _, n_block_max, n_top, _ = tiles.kv_tile_range(tiles.TileWindow(tile_m, tile_n, causal),
                                                   m_block, seqlen_q, seqlen_k)
    n_block_masked_min = cutlass.min(n_block_max - n_top, n_block_max - 1)
    return n_block_max, n_block_masked_min


# ----------------------------------------------------------------------------------------------
# The kernel


class FlashAttentionAmpere:
    """FlashAttention-2 forward for sm_80 and later (sm_90 and sm_100 run the same instructions).

    One CTA computes m_block rows of O for one (head, batch); see Note [Work split].
    """

    def __init__(self, dtype, head_dim: int, causal: bool, config: TileConfig):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be cutlass.BFloat16 or cutlass.Float16, got {dtype}")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
        config.check(head_dim)
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.config = config
        self.m_block = config.m_block
        self.n_block = config.n_block
        self.num_threads = config.num_threads
        self.num_stages = config.num_stages

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, copies, MMA, grid, launch

    def make_tiled_mma(self) -> cute.TiledMma:
        """Warps stacked along M (Note [Work split]). The (16 * warps, 16, 16) permutation makes
        one tile of the tiled MMA two 8-column atoms wide: what one ldmatrix.x4 of the B operand
        feeds, and the pairs Note [P as an A operand] relies on."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.num_warps * 16, 16, 16),
        )

    @property
    def num_warps(self) -> int:
        return self.num_threads // 32

    def smem_layout(self, rows: int, stages: int | None = None):
        """A (rows, head_dim[, stages]) tile of 16-bit values in shared memory.

        Note [Bank conflicts]. Shared memory has 32 banks of 4 B; a warp's access is split into
        phases of 128 B and is conflict-free when each phase touches every bank once. ldmatrix
        reads 8 rows x 16 B per 8x8 matrix; with rows 128 or 256 B apart all 8 would hit the
        same 4 banks (8-way conflict). Two cures:
        - padded: rows (head_dim + 8) elements apart, i.e. shifted by 16 B = 4 banks per row,
          so 8 consecutive rows cover all 32 banks. Costs 6% (D = 128) or 12% (D = 64) more
          shared memory; every address is a base plus a constant, which keeps registers free.
        - swizzled: 8 x 64 atoms with Swizzle(3, 3, 3), which XORs the 16-byte chunk index
          (address bits 4-6) with the row within the atom (bits 7-9). No wasted bytes, and the
          layout family TMA and WGMMA use (the Hopper chapters). But an XOR is not a constant
          offset: each 16-wide k-slice of an atom needs its own address register (4 per
          operand), enough to make some tiles that fit padded spill swizzled.
        """
        shape = (rows, self.head_dim) if stages is None else (rows, self.head_dim, stages)
        if self.config.smem_layout == "padded":
            row = self.config.smem_row(self.head_dim)
            stride = (row, 1) if stages is None else (row, 1, rows * row)
            return cute.make_layout(shape, stride=stride)
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        order = (0, 1) if stages is None else (0, 1, 2)
        return cute.tile_to_shape(atom, shape, order)

    def with_static_head_dim(self, t: cute.Tensor) -> cute.Tensor:
        """(b, s, h, d) with d fixed at compile time and 32-bit strides promised to be multiples
        of 8 elements (16 B). The host checks both; they let every copy be 16 B wide."""
        strides = tuple(
            s if isinstance(s, int) else cute.assume(Int32(s), divby=8) for s in t.stride[:3]
        )
        return cute.make_tensor(
            t.iterator, cute.make_layout((*t.shape[:3], self.head_dim), stride=(*strides, 1))
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        if const_expr(
            not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type
                 == self.dtype)
        ):
            raise TypeError(f"q, k, v and out must all be {self.dtype}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("lse must be float32")
        mQ, mK, mV, mO = [self.with_static_head_dim(t) for t in (mQ, mK, mV, mO)]

        # Shared memory: Q (m_block, D); K and V (n_block, D, stages); O reuses Q's bytes.
        sQ_layout = self.smem_layout(self.m_block)
        sKV_layout = self.smem_layout(self.n_block, self.num_stages)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        # Global <-> shared copies: 16 B (8 elements) per thread per instruction; 8 threads
        # cover one 64-element (128 B) row chunk, so a warp moves 4 whole 128-byte lines.
        elems_per_copy = 128 // self.dtype.width
        threads_per_row = 64 // elems_per_copy
        thread_layout = cute.make_layout(
            (self.num_threads // threads_per_row, threads_per_row), stride=(threads_per_row, 1)
        )
        value_layout = cute.make_layout((1, elems_per_copy))
        gmem_copy_QKV = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                # .cg: cache in L2 only; K/V are reused by other CTAs, not by this SM's L1.
                cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                self.dtype,
                num_bits_per_copy=128,
            ),
            thread_layout,
            value_layout,
        )
        gmem_copy_O = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            thread_layout,
            value_layout,
        )

        # One CTA per (query tile, head, batch).
        grid = (cute.ceil_div(mQ.shape[1], self.m_block), mQ.shape[2], mQ.shape[0])
        self.kernel(
            mQ,
            mK,
            mV,
            mO,
            mLSE,
            softmax_scale * LOG2_E,
            sQ_layout,
            sKV_layout,
            gmem_copy_QKV,
            gmem_copy_O,
            self.make_tiled_mma(),
            SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: Float32,  # softmax_scale * log2(e): exp(scale * s) = exp2(scale_log2 * s)
        sQ_layout,  # cute.Layout (padded) or cute.ComposedLayout (swizzled)
        sKV_layout,
        gmem_copy_QKV: cute.TiledCopy,
        gmem_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        M, N, D, S = self.m_block, self.n_block, self.head_dim, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
        if const_expr(self.causal):
            # Causal tiles near the end of the sequence do the most work; start them first so
            # that short tiles fill the gaps at the end of the grid.
            m_block = cute.ceil_div(seqlen_q, M) - 1 - m_block
        # GQA: heads // heads_kv consecutive query heads share one K/V head.
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        # 1. Which KV tiles this query tile visits ------------------------------------------
        n_block_max, n_block_masked_min = kv_tile_range(
            m_block, seqlen_q, seqlen_k, M, N, self.causal
        )
        # A tile whose rows see no key at all (causal, seqlen_q > seqlen_k) still runs one fully
        # masked step on tile 0; that leaves row_sum = 0, hence out 0 and lse -inf.
        n_block_first = cutlass.max(n_block_max - 1, 0)

        # 2. Global-memory tiles ----------------------------------------------------------------
        gQ = cute.local_tile(mQ[batch, None, head, None], (M, D), (m_block, 0))  # (M, D)
        gK = cute.local_tile(mK[batch, None, head_kv, None], (N, D), (None, 0))  # (N, D, n)
        gV = cute.local_tile(mV[batch, None, head_kv, None], (N, D), (None, 0))  # (N, D, n)

        # 3. Shared memory ----------------------------------------------------------------------
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)  # (M, D)
        sK = storage.sK.get_tensor(sKV_layout)  # (N, D, S)
        sV = storage.sV.get_tensor(sKV_layout)  # (N, D, S)
        # V is the B operand of O = P V, indexed (D, N): a transposed view of the same bytes.
        sVt = cute.composition(sV, cute.make_layout((D, N, S), stride=(N, 1, N * D)))  # (D, N, S)

        # 4. Global -> shared copy partitions (cp.async) -----------------------------------------
        gmem_thr_copy = gmem_copy_QKV.get_slice(tidx)
        tQgQ = gmem_thr_copy.partition_S(gQ)  # (CPY, CPY_M, CPY_D)
        tQsQ = gmem_thr_copy.partition_D(sQ)  # (CPY, CPY_M, CPY_D)
        tKgK = gmem_thr_copy.partition_S(gK)  # (CPY, CPY_N, CPY_D, n)
        tKsK = gmem_thr_copy.partition_D(sK)  # (CPY, CPY_N, CPY_D, S)
        tVgV = gmem_thr_copy.partition_S(gV)  # (CPY, CPY_N, CPY_D, n)
        tVsV = gmem_thr_copy.partition_D(sV)  # (CPY, CPY_N, CPY_D, S)
        # (row, col) in the tile of each element this thread copies, for the row bounds.
        tQcQ = gmem_thr_copy.partition_S(cute.make_identity_tensor((M, D)))  # (CPY, CPY_M, CPY_D)
        tKcK = gmem_thr_copy.partition_S(cute.make_identity_tensor((N, D)))  # (CPY, CPY_N, CPY_D)

        # 5. MMA partitions and shared -> register copies (ldmatrix) -----------------------------
        thr_mma = tiled_mma.get_slice(tidx)
        # Register fragments of the operands, filled one k-slice at a time by ldmatrix.
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))  # (MMA, MMA_M, MMA_D)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        # tSrK: (MMA, MMA_N, MMA_D); tOrVt: (MMA, MMA_D, MMA_N)
        # The O accumulator: fp32, in registers for the whole KV loop.
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, D)), Float32)
        acc_O.fill(0.0)  # (MMA, MMA_M, MMA_D)

        ldmatrix = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype)
        # V is stored (N, D) but consumed as (D, N): ldmatrix.trans transposes each 8x8 block.
        ldmatrix_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), self.dtype)
        smem_copy_Q = cute.make_tiled_copy_A(ldmatrix, tiled_mma).get_slice(tidx)
        smem_copy_K = cute.make_tiled_copy_B(ldmatrix, tiled_mma).get_slice(tidx)
        smem_copy_V = cute.make_tiled_copy_B(ldmatrix_t, tiled_mma).get_slice(tidx)
        tSsQ = smem_copy_Q.partition_S(sQ)  # (CPY, MMA_M, MMA_D)
        tSsK = smem_copy_K.partition_S(sK)  # (CPY, MMA_N, MMA_D, S)
        tOsVt = smem_copy_V.partition_S(sVt)  # (CPY, MMA_D, MMA_N, S)

        # (row, col) of this thread's S elements: rows for the softmax state and the LSE, columns
        # for the mask. Thread 0's columns are compile-time constants and every thread's columns
        # are thread 0's plus one offset (Note [Mask with constants]).
        cS = cute.make_identity_tensor((M, N))
        tScS = rows_cols_view(thr_mma.partition_C(cS))  # ((2, MMA_M), (2, MMA_N)) -> (row, col)
        t0ScS = rows_cols_view(tiled_mma.get_slice(0).partition_C(cS))  # the same for thread 0

        # Online-softmax state: a running max and a partial row sum per row this thread holds.
        row_max = cute.make_rmem_tensor(cute.size(tScS, mode=[0]), Float32)  # (2 * MMA_M,)
        row_sum = cute.make_rmem_tensor(cute.size(tScS, mode=[0]), Float32)  # (2 * MMA_M,)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # 6. Prologue: Q and the first K tile (and, double-buffered, the first V and next K) ----
        rows_left_q = seqlen_q - m_block * M
        for r in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            if tQcQ[0, r, 0][0] < rows_left_q:
                cute.copy(gmem_copy_QKV, tQgQ[None, r, None], tQsQ[None, r, None])
            else:
                tQsQ[None, r, None].fill(0)  # rows past seqlen_q: finite, never stored
        self.load_kv(gmem_copy_QKV, tKgK, tKsK, tKcK, n_block_first, 0, seqlen_k, True)
        cute.arch.cp_async_commit_group()
        for j in cutlass.range_constexpr(S - 1):  # V j and K j + 1 steps ahead, buffer by buffer
            if n_block_first - j >= 0:
                self.load_kv(gmem_copy_QKV, tVgV, tVsV, tKcK, n_block_first - j, j, seqlen_k,
                             j == 0)
            cute.arch.cp_async_commit_group()  # committed even when empty: keeps the count fixed
            if n_block_first - j - 1 >= 0:
                self.load_kv(gmem_copy_QKV, tKgK, tKsK, tKcK, n_block_first - j - 1, j + 1,
                             seqlen_k, False)
            cute.arch.cp_async_commit_group()

        # 7. The KV loop, from the last tile down to tile 0. The first trip is peeled off: its
        #    tile is the only one that can stick out past seqlen_k (so it loads with row checks
        #    and is always masked) and it has no earlier O to rescale.
        thr = SimpleNamespace(
            gmem_copy=gmem_copy_QKV, tKgK=tKgK, tKsK=tKsK, tVgV=tVgV, tVsV=tVsV, tKcK=tKcK,
            tiled_mma=tiled_mma, thr_mma=thr_mma, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt,
            smem_copy_Q=smem_copy_Q, smem_copy_K=smem_copy_K, smem_copy_V=smem_copy_V,
            tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt, tScS=tScS, t0ScS=t0ScS,
            acc_O=acc_O, row_max=row_max, row_sum=row_sum,
        )
        bounds = SimpleNamespace(
            m_block=m_block, n_block_first=n_block_first, n_block_masked_min=n_block_masked_min,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        )
        self.kv_step(n_block_first, bounds, thr, scale_log2, is_first=True)
        for i in cutlass.range(n_block_first, unroll=1):
            self.kv_step(n_block_first - 1 - i, bounds, thr, scale_log2, is_first=False)

        # 8. Epilogue: O / row_sum and the LSE; O through shared memory to global ---------------
        lse = self.finalize(acc_O, row_max, row_sum, scale_log2)
        # The four lanes of a quad hold the same rows; the one holding column 0 writes the LSE.
        if tScS[0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tScS[r, 0][0]
                if row < rows_left_q:
                    mLSE[batch, head, m_block * M + row] = lse[r]

        # Straight from the accumulators, O would leave as 4-byte stores (2 values per row per
        # 8-column block) scattered over 8 rows per instruction. Staging it in shared memory
        # (Q's buffer, free now) turns that into 16-byte stores of whole 128-byte lines.
        rO = cute.make_fragment_like(acc_O, self.dtype)  # (MMA, MMA_M, MMA_D)
        rO.store(acc_O.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, sQ_layout)  # (M, D)
        smem_store_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width
        )
        smem_thr_store = cute.make_tiled_copy_C(smem_store_atom, tiled_mma).get_slice(tidx)
        # Each warp overwrites only Q rows it read itself (Note [Work split]); the first barrier
        # still makes that independent of the MMA layout, for the cost of one bar.sync per CTA.
        # The second orders these stores before other threads read the rows back.
        cute.arch.barrier()
        cute.copy(smem_store_atom, smem_thr_store.retile(rO), smem_thr_store.partition_D(sO))
        cute.arch.barrier()

        gO = cute.local_tile(mO[batch, None, head, None], (M, D), (m_block, 0))  # (M, D)
        gmem_thr_store = gmem_copy_O.get_slice(tidx)
        tOsO = gmem_thr_store.partition_S(sO)  # (CPY, CPY_M, CPY_D)
        tOgO = gmem_thr_store.partition_D(gO)  # (CPY, CPY_M, CPY_D)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)  # (CPY, CPY_M, CPY_D)
        cute.autovec_copy(tOsO, tOrO)
        for r in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if tQcQ[0, r, 0][0] < rows_left_q:
                cute.copy(gmem_copy_O, tOrO[None, r, None], tOgO[None, r, None])

    # ------------------------------------------------------------------------------------------
    # The KV loop

    @cute.jit
    def load_kv(
        self,
        gmem_copy: cute.TiledCopy,
        tXgX: cute.Tensor,  # (CPY, CPY_N, CPY_D, n) this thread's share of every K (or V) tile
        tXsX: cute.Tensor,  # (CPY, CPY_N, CPY_D, S) its share of the shared-memory buffers
        tXcX: cute.Tensor,  # (CPY, CPY_N, CPY_D) -> (row, col) in the tile
        n_block: Int32,
        stage: Int32,
        seqlen_k: Int32,
        check_rows: cutlass.Constexpr,
    ):
        """Issue the cp.async copies of K or V tile ``n_block`` into buffer ``stage``. Only the
        last tile can stick out past seqlen_k; its missing rows are zero-filled. K's would be
        masked anyway, but V's rows meet P = 0, and 0 * (stale NaN bits) = NaN."""
        if const_expr(check_rows):
            rows_left = seqlen_k - n_block * self.n_block
            for r in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                if tXcX[0, r, 0][0] < rows_left:
                    cute.copy(gmem_copy, tXgX[None, r, None, n_block], tXsX[None, r, None, stage])
                else:
                    tXsX[None, r, None, stage].fill(0)
        else:
            cute.copy(gmem_copy, tXgX[None, None, None, n_block], tXsX[None, None, None, stage])

    @cute.jit
    def kv_step(
        self,
        n_block: Int32,
        bounds: SimpleNamespace,
        thr: SimpleNamespace,
        scale_log2: Float32,
        is_first: cutlass.Constexpr,
    ):
        """One KV tile: S = QK^T, mask, online softmax, O += PV, with the loads of later tiles
        issued in between.

        Note [Pipeline]. cp.async copies are grouped with commit_group; wait_group(n) returns
        once at most the n newest groups are still in flight; the CTA barrier after it makes
        every thread's copies visible to all. The prologue commits 2 * S - 1 groups and every
        step exactly two (a V load, then a K load, either possibly empty), so the group holding
        the tile about to be read is always the (2 * S - 1)-th newest: wait_group(2 * S - 2).
        S = 1: V[n] is fetched while QK^T[n] and the softmax run, K[n - 1] while PV[n] runs.
        S = 2 or 3: each load is issued S - 1 whole steps earlier, into buffer (step mod S).
        A buffer is refilled only after the barrier that follows its last reader. The second
        barrier of a step waits until after the softmax (Note [Registers]).
        """
        M, N, S = self.m_block, self.n_block, self.num_stages
        # Tiles are visited from n_block_first down to 0; the step number mod S picks the buffer.
        stage = 0
        if const_expr(S > 1):
            stage = (bounds.n_block_first - n_block) % S

        # (a) K[n_block] has landed; every warp is past the previous PV, so a V buffer is free.
        cute.arch.cp_async_wait_group(2 * S - 2)
        cute.arch.barrier()
        # (b) Fetch the V tile S - 1 steps ahead (this step's own when single-buffered).
        if n_block - (S - 1) >= 0:
            self.load_kv(thr.gmem_copy, thr.tVgV, thr.tVsV, thr.tKcK, n_block - (S - 1),
                         (stage + S - 1) % S, bounds.seqlen_k, is_first and S == 1)
        cute.arch.cp_async_commit_group()

        # (c) S = Q K^T: (M, N) in fp32, 2 * M * N * D FLOPs on the tensor cores.
        acc_S = cute.make_rmem_tensor(thr.thr_mma.partition_shape_C((M, N)), Float32)
        acc_S.fill(0.0)  # (MMA, MMA_M, MMA_N)
        self.gemm_qk(acc_S, thr, stage)

        # (d) Mask, online softmax, rescale O; P = exp2(...) rounded to bf16/fp16.
        if const_expr(is_first):
            self.apply_mask(acc_S, thr.tScS, thr.t0ScS, bounds.m_block, n_block,
                            bounds.seqlen_q, bounds.seqlen_k)
        elif const_expr(self.causal):
            # The branch is uniform across the CTA. One loop with it keeps fewer values live
            # than separate masked and unmasked loops (measured: up to 20 registers).
            if n_block >= bounds.n_block_masked_min:
                self.apply_mask(acc_S, thr.tScS, thr.t0ScS, bounds.m_block, n_block,
                                bounds.seqlen_q, bounds.seqlen_k)
        self.online_softmax(acc_S, thr.acc_O, thr.row_max, thr.row_sum, scale_log2, is_first)
        rP = cute.make_fragment_like(acc_S, self.dtype)  # (MMA, MMA_M, MMA_N)
        rP.store(acc_S.load().to(self.dtype))

        # (e) V[n_block] has landed; every warp is done reading K[n_block]: refill that buffer
        #     with the K tile S steps ahead. Waiting here rather than right after QK^T keeps
        #     V's ldmatrix loads from being hoisted into the softmax (Note [Registers]).
        cute.arch.cp_async_wait_group(2 * S - 2)
        cute.arch.barrier()
        if n_block - S >= 0:
            self.load_kv(thr.gmem_copy, thr.tKgK, thr.tKsK, thr.tKcK, n_block - S, stage,
                         bounds.seqlen_k, False)
        cute.arch.cp_async_commit_group()

        # (f) O += P V: the A operand straight from registers, B from shared memory.
        self.gemm_pv(rP, thr, stage)

    # ------------------------------------------------------------------------------------------
    # The two GEMMs of a step, as methods: a course subclass swaps in other code here

    @cute.jit
    def gemm_qk(self, acc_S: cute.Tensor, thr: SimpleNamespace, stage):
        """S += Q K^T for K buffer ``stage``: ``gemm_from_smem`` over the head dim."""
        gemm_from_smem(thr.tiled_mma, acc_S, thr.tSrQ, thr.tSrK, thr.tSsQ,
                       thr.tSsK[None, None, None, stage], thr.smem_copy_Q, thr.smem_copy_K,
                       self.config.qk_unroll)

    @cute.jit
    def gemm_pv(self, rP: cute.Tensor, thr: SimpleNamespace, stage):
        """O += P V for V buffer ``stage``, P (``rP``, 16-bit) straight from registers:
        ``gemm_from_regs`` over the keys of the tile."""
        gemm_from_regs(thr.tiled_mma, thr.acc_O, acc_as_a_operand(rP), thr.tOrVt,
                       thr.tOsVt[None, None, None, stage], thr.smem_copy_V)

    # ------------------------------------------------------------------------------------------
    # Softmax pieces

    @cute.jit
    def apply_mask(
        self,
        acc_S: cute.Tensor,  # (MMA, MMA_M, MMA_N)
        tScS: cute.Tensor,  # ((2, MMA_M), (2, MMA_N)) -> (row, col) in the tile
        t0ScS: cute.Tensor,  # the same for thread 0
        m_block: Int32,
        n_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
    ):
        """Set to -inf the scores of keys past seqlen_k and, if causal, of keys j > i + seqlen_k
        - seqlen_q. Note [Mask with constants]: this thread's column c is thread 0's column c (a
        compile-time constant) plus one offset, so the offset moves into the limit once per row
        and each element costs one compare with a constant and one select."""
        s = rows_cols_view(acc_S)
        col_offset = tScS[0][1]
        col_limit_k = seqlen_k - n_block * self.n_block - col_offset
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            col_limit = col_limit_k
            if const_expr(self.causal):
                row = m_block * self.m_block + tScS[r, 0][0]
                causal_end = row + 1 + seqlen_k - seqlen_q - n_block * self.n_block - col_offset
                col_limit = cutlass.min(col_limit, causal_end)
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, c] = -Float32.inf if t0ScS[0, c][1] >= col_limit else s[r, c]

    @cute.jit
    def online_softmax(
        self,
        acc_S: cute.Tensor,  # (MMA, MMA_M, MMA_N) scores in, unnormalised probabilities out
        acc_O: cute.Tensor,  # (MMA, MMA_M, MMA_D)
        row_max: cute.Tensor,  # (2 * MMA_M,) running max of the unscaled scores
        row_sum: cute.Tensor,  # (2 * MMA_M,) this thread's share of sum(exp2(...))
        scale_log2: Float32,
        is_first: cutlass.Constexpr,
    ):
        """One tile of the online softmax, in registers (c = softmax_scale * log2(e)):

        m_new = max(m_old, max_j s_j)              quad shuffles: the row's 4 lanes agree
        p_j   = exp2(s_j * c - m_new * c)          one FFMA + one MUFU.EX2 per score
        l     = l * exp2((m_old - m_new) * c) + sum_j p_j    per thread; quad-summed at the end
        O     = O * exp2((m_old - m_new) * c)
        The max is taken on unscaled scores: valid because scale > 0 (checked on the host).
        """
        s = rows_cols_view(acc_S)
        o = rows_cols_view(acc_O)
        correction = cute.make_fragment_like(row_max, Float32)  # (2 * MMA_M,)
        grew = cutlass.Boolean(False)  # did any row of this thread find a larger max?
        for r in cutlass.range_constexpr(cute.size(row_max)):
            s_row = s[r, None].load()
            m_tile = quad_allreduce(s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), fmax)
            m_old = row_max[r]
            m_new = m_tile if const_expr(is_first) else cute.arch.fmax(m_old, m_tile)
            row_max[r] = m_new
            # A row that has seen only masked keys has m_new = -inf; subtracting 0 instead keeps
            # exp2(-inf - (-inf)) = NaN out: its p_j are exp2(-inf) = 0 and the row stays empty.
            m_safe = 0.0 if m_new == -Float32.inf else m_new
            p_row = cute.math.exp2(s_row * scale_log2 - m_safe * scale_log2, fastmath=True)
            s[r, None].store(p_row)
            p_sum = p_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(is_first):
                row_sum[r] = p_sum
            else:
                correction[r] = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
                row_sum[r] = row_sum[r] * correction[r] + p_sum
                grew = grew | (m_new > m_old)
        if const_expr(not is_first):
            if const_expr(self.config.skip_rescale):
                # Note [Skipping the rescale]
                if cute.arch.vote_any_sync(grew):
                    self.rescale_o(o, correction)
            else:
                self.rescale_o(o, correction)

    # Note [Skipping the rescale]
    # ---------------------------
    # O is multiplied by exp2((m_old - m_new) * c) every step: D multiplies per row, 128 FMULs
    # per thread per step at D = 128, as many as the exp2s and FFMAs of the scores together. Once
    # a row has seen a few hundred keys its max rarely grows (random scores: tile j holds a new
    # maximum with probability about 1 / j), and then the factor is exactly 1 (exp2(0) = 1) and
    # the multiply changes nothing. vote.sync.any asks the 32 lanes whether any of the warp's
    # 32 rows grew; if none did, the whole warp branches around the multiply. The branch is
    # uniform across the warp, so nothing diverges, and the result is bit for bit the same.
    # Chapter 07 goes further: it keeps a stale max on purpose, which is exact for another reason.

    @cute.jit
    def rescale_o(self, o: cute.Tensor, correction: cute.Tensor):
        """O_row *= correction_row, for the rows this thread holds (``o``: rows x columns)."""
        for r in cutlass.range_constexpr(cute.size(correction)):
            o[r, None].store(o[r, None].load() * correction[r])

    @cute.jit
    def finalize(
        self,
        acc_O: cute.Tensor,  # (MMA, MMA_M, MMA_D)
        row_max: cute.Tensor,  # (2 * MMA_M,)
        row_sum: cute.Tensor,  # (2 * MMA_M,)
        scale_log2: Float32,
    ) -> cute.Tensor:
        """O /= l and lse = scale * m + ln(l) = (m * c + log2(l)) * ln(2). A row that saw no key
        has l = 0: its O stays 0 and its lse is -inf."""
        o = rows_cols_view(acc_O)
        lse = cute.make_fragment_like(row_sum, Float32)  # (2 * MMA_M,)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = quad_allreduce(row_sum[r], fadd)
            seen = total > 0.0
            o[r, None].store(o[r, None].load() * cute.arch.rcp_approx(total if seen else 1.0))
            lse[r] = (
                (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
                if seen
                else -Float32.inf
            )
        return lse


# ----------------------------------------------------------------------------------------------
# The two GEMMs of a KV step


@cute.jit
def gemm_from_smem(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,  # (MMA, MMA_M, MMA_N)
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K) registers
    tCrB: cute.Tensor,  # (MMA, MMA_N, MMA_K) registers
    tCsA: cute.Tensor,  # (CPY, MMA_M, MMA_K) shared
    tCsB: cute.Tensor,  # (CPY, MMA_N, MMA_K) shared
    smem_copy_A: cute.ThrCopy,
    smem_copy_B: cute.ThrCopy,
    unroll: cutlass.Constexpr,
):
    """acc += A B^T with both operands read from shared memory by ldmatrix: a run-time loop over
    the 16-wide k-slices, unrolled ``unroll`` times (Note [Registers]). Every slice is loaded into
    the registers of slice 0 (k is a run-time value and registers cannot be indexed at run
    time), so at most ``unroll`` slices of A and B are live (8 + 16 registers per slice at 32
    rows x 64 keys), where the fully unrolled loop let ptxas keep many in flight. The price: the
    first mma.sync of a trip waits for its ldmatrix; the other warps of the SM fill that gap."""
    tCrA_copy = smem_copy_A.retile(tCrA)  # (CPY, MMA_M, MMA_K) view of the same registers
    tCrB_copy = smem_copy_B.retile(tCrB)  # (CPY, MMA_N, MMA_K)
    for k in cutlass.range(cute.size(tCsA, mode=[2]), unroll=unroll):
        cute.copy(smem_copy_A, tCsA[None, None, k], tCrA_copy[None, None, 0])
        cute.copy(smem_copy_B, tCsB[None, None, k], tCrB_copy[None, None, 0])
        cute.gemm(tiled_mma, acc, tCrA[None, None, 0], tCrB[None, None, 0], acc)


@cute.jit
def gemm_from_regs(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,  # (MMA, MMA_M, MMA_N)
    tCrA: cute.Tensor,  # (MMA, MMA_M, MMA_K) already in registers (P)
    tCrB: cute.Tensor,  # (MMA, MMA_N, MMA_K) registers
    tCsB: cute.Tensor,  # (CPY, MMA_N, MMA_K) shared
    smem_copy_B: cute.ThrCopy,
):
    """acc += A B^T with A already in registers (P) and B read from shared memory by ldmatrix,
    fully unrolled: slice k + 1 of B is requested before the mma.sync of slice k. Unlike S = QK^T
    this needs no rolled loop: A indexes registers (it must be unrolled) and, coming after the
    barrier that follows the softmax, it runs when S has already shrunk to P (Note [Registers])."""
    tCrB_copy = smem_copy_B.retile(tCrB)  # (CPY, MMA_N, MMA_K)
    num_k = cute.size(tCrA, mode=[2])
    cute.copy(smem_copy_B, tCsB[None, None, 0], tCrB_copy[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            cute.copy(smem_copy_B, tCsB[None, None, k + 1], tCrB_copy[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


# ----------------------------------------------------------------------------------------------
# Torch entry point

_COMPILED: dict = {}
_CUBINS: dict = {}  # (kernel class, cutlass dtype, head_dim, causal, config) -> cubin bytes


def check_kernel_inputs(q, k, v, softmax_scale=None, config=None, causal=False) -> TileConfig:
    """What this kernel accepts beyond utils.reference.check_attention_inputs; returns the tile
    config to use. Every check that needs no GPU comes first, so bad input fails the same way on
    a laptop."""
    config = _check_host_side(q, k, v, softmax_scale, config, causal)
    _check_device(q)
    return config


def _check_host_side(q, k, v, softmax_scale, config, causal=False) -> TileConfig:
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"this kernel takes torch.bfloat16 or torch.float16 inputs, got {q.dtype} "
            "(mma.sync multiplies 16-bit operands)"
        )
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(
            f"softmax_scale must be > 0, got {softmax_scale!r}: the kernel takes the row max of "
            "the unscaled scores, which is the max of the scaled ones only for a positive scale"
        )
    if config is None:
        config = default_config(d, causal, device_arch(q.device), DTYPE_NAMES[q.dtype])
    if not isinstance(config, TileConfig):
        raise TypeError(f"config must be a TileConfig or None, got {type(config).__name__}")
    config.check(d)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last (head) dim, got strides {t.stride()}; "
                "call .contiguous() first"
            )
        strides = [s for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1]
        if any(s % 8 for s in strides) or t.data_ptr() % 16:
            raise ValueError(
                f"{name} must start on a 16-byte boundary with strides that are multiples of 8 "
                f"elements (the kernel copies 16 B at a time), got strides {t.stride()} and "
                f"address {t.data_ptr():#x}; call .contiguous() first"
            )
        if sum((n - 1) * s for n, s in zip(t.shape, t.stride())) >= MAX_ELEMENTS:
            raise ValueError(
                f"{name} spans more than 2**31 - 1 elements ({tuple(t.shape)}); this kernel "
                "computes offsets in 32 bits. Split the batch"
            )
    if b * h * sq >= MAX_ELEMENTS:
        raise ValueError(f"batch * heads * seqlen_q = {b * h * sq} is too large for 32-bit LSE")
    return config


def _check_device(q) -> None:
    if q.device.type != "cuda":
        raise ValueError(f"this kernel runs on CUDA tensors, got device {q.device}")
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 8:
        raise ValueError(
            f"this kernel needs compute capability 8.0 or newer (cp.async, bf16 mma.sync), "
            f"got {major}.{minor}"
        )


def _to_cute(t: torch.Tensor, leading_dim: int, align: int):
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=leading_dim)


def attention(q, k, v, causal=False, softmax_scale=None, config=None):
    """FlashAttention-2 forward. q: (batch, seqlen_q, heads, dim); k, v: (batch, seqlen_k,
    heads_kv, dim); CUDA tensors on a GPU with compute capability >= 8.0, bf16 or fp16, dim 64 or
    128. Returns out (like q) and lse (float32, (batch, heads, seqlen_q)). One compile per
    (dtype, dim, causal, config) serves every batch size, sequence length and head count."""
    config = check_kernel_inputs(q, k, v, softmax_scale, config, causal)
    b, sq, h, d = q.shape
    out = torch.empty(b, sq, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    _launch(q, k, v, out, lse, causal, softmax_scale, config)
    return out, lse


def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
    """``attention`` writing into the caller's ``out`` (like q, contiguous) and ``lse`` (float32
    (batch, heads, seqlen_q), contiguous). Tests fill them with NaN first, so an element the
    kernel forgets to write cannot pass."""
    config = _check_host_side(q, k, v, softmax_scale, config, causal)
    b, sq, h, d = q.shape
    for name, t, shape, dtype in (("out", out, (b, sq, h, d), q.dtype),
                                  ("lse", lse, (b, h, sq), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {shape}, got "
                f"{t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    _check_device(q)
    _launch(q, k, v, out, lse, causal, softmax_scale, config)
    return out, lse


def _launch(q, k, v, out, lse, causal, softmax_scale, config, kernel_class=None):
    d = q.shape[-1]
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    args = [_to_cute(t, 3, 16) for t in (q, k, v, out)] + [_to_cute(lse, 2, 4)]
    kernel_class = kernel_class or FlashAttentionAmpere
    with torch.cuda.device(q.device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        key = (kernel_class, q.dtype, d, bool(causal), config)
        if key not in _COMPILED:
            kernel = kernel_class(SUPPORTED_DTYPES[q.dtype], d, bool(causal), config)
            _COMPILED[key] = _compile_keeping_cubin(kernel, *args, Float32(scale), stream)
        _COMPILED[key](*args, Float32(scale), stream)


def _compile_keeping_cubin(kernel, *args):
    """cute.compile for this GPU, keeping the cubin so that ``launched_resources`` can report
    on the kernel that actually runs (the DSL writes it to a dump folder: a temporary one)."""
    from cutlass.base_dsl.compiler import DumpDir

    with tempfile.TemporaryDirectory(prefix="ch04_cubin_") as dump:
        compiled = cute.compile[cute.KeepCUBIN, DumpDir(dump)](kernel, *args)
    key = (type(kernel), kernel.dtype, kernel.head_dim, kernel.causal, kernel.config)
    _CUBINS[key] = compiled.__cubin__
    return compiled


def launched_resources(head_dim: int, causal: bool, config: TileConfig, dtype=torch.bfloat16,
                       sass: bool = False):
    """utils.compile_only.KernelResources of the kernel ``attention`` compiled on this GPU:
    registers and frame_bytes (the per-thread stack, where spills land); with ``sass`` also the
    spill instructions (needs nvdisasm). None if that kernel has not been compiled yet."""
    from utils.compile_only import disassemble, kernel_resources

    cubin = _CUBINS.get((FlashAttentionAmpere, SUPPORTED_DTYPES[dtype], head_dim, bool(causal),
                         config))
    if not cubin:
        return None
    text = disassemble(cubin) if sass else ""
    res = kernel_resources(cubin, text)[0]
    if not text:
        res.spill_instructions = None  # unknown without the SASS, not zero
    return res


# ----------------------------------------------------------------------------------------------
# Compile with no GPU


def compile_only(arch="sm_90a", head_dim=128, dtype="bf16", causal=False, config=None):
    """Compile for ``arch`` on any machine, no GPU needed: PTX, SASS, registers, spills.

    The fake tensors have the type ``attention`` passes at run time (dynamic extents, 64-bit
    strides, 16-byte aligned Q/K/V/O), so this is the kernel that runs."""
    from utils.compile_only import compile_for, fake_stream

    dtypes = {DTYPE_NAMES[t]: c for t, c in SUPPORTED_DTYPES.items()}  # "bf16" -> BFloat16
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {list(dtypes)}, got {dtype!r}")
    config = default_config(head_dim) if config is None else config
    kernel = FlashAttentionAmpere(dtypes[dtype], head_dim, causal, config)

    def fake(dt, rank, align):
        shape = tuple(cute.sym_int32() for _ in range(rank))
        stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dt, shape, stride, assumed_align=align)

    q, k, v, o = (fake(dtypes[dtype], 4, 16) for _ in range(4))
    lse = fake(Float32, 3, 4)
    return compile_for(arch, kernel, q, k, v, o, lse, Float32(1.0), fake_stream())


def config_report(arch="sm_90a", head_dim=128, causal=False) -> list[dict]:
    """Registers, stack frame and spill instructions of every swept tile for ``arch``."""
    rows = []
    for config in SWEEP_CONFIGS[head_dim]:
        art = compile_only(arch, head_dim, causal=causal, config=config)
        rows.append(
            {
                "config": config,
                "registers": art.registers,
                "stack_bytes": art.frame_bytes,
                "spill_instructions": art.spills,
                "smem_bytes": config.smem_bytes(head_dim),
                **config.accumulator_registers(head_dim),
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------
# On a GPU: --small (also run under compute-sanitizer), --check

# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype)
SMALL_CASES = [
    # Lengths that are no multiple of any tile, GQA, both default tiles; causal with
    # seqlen_q < seqlen_k (bottom-right diagonal) and full with a partial last KV tile.
    (1, 77, 131, 4, 2, 64, True, torch.bfloat16),
    (1, 150, 67, 4, 2, 128, False, torch.bfloat16),
]
CHECK_CASES = [
    (1, 1, 1, 2, 2, 64, False, torch.bfloat16),
    (2, 17, 17, 3, 1, 128, True, torch.float16),
    (1, 128, 128, 4, 4, 64, True, torch.bfloat16),
    (1, 1000, 1000, 2, 1, 128, False, torch.bfloat16),
    (1, 1000, 4097, 2, 1, 128, True, torch.bfloat16),  # seqlen_q < seqlen_k
    (1, 4097, 1000, 2, 2, 64, True, torch.float16),  # 3097 query rows see no key
    (1, 300, 77, 2, 2, 128, True, torch.bfloat16),
    (3, 257, 513, 8, 2, 128, False, torch.float16),  # GQA, 4 query heads per K/V head
    (1, 8192, 8192, 2, 2, 128, False, torch.bfloat16),  # 256 KV tiles per CTA at n_block 32
    (1, 8192, 8192, 2, 2, 64, True, torch.bfloat16),
]
def compare(q, k, v, out, lse, causal=False, softmax_scale=None, label=""):
    """Kernel output vs the float64 reference: ``utils.checks.compare_outputs``."""
    return checks.compare_outputs(q, k, v, out, lse, causal, softmax_scale, label=label)


def run_and_compare(q, k, v, causal=False, softmax_scale=None, config=None, label=""):
    """One launch into NaN-poisoned out and lse, then compare(). Returns (ok, one line)."""
    return checks.run_into_poisoned(attention_into, q, k, v, causal, softmax_scale, config,
                                    label=label)


def check_case(batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype, config=None):
    """Fresh random inputs, one run, compare(). Returns (ok, report)."""
    return checks.check_random_case(attention_into, batch, seqlen_q, seqlen_k, heads, heads_kv,
                                    dim, causal, dtype, config=config)


ABLATION_IMPL = "flash_ampere_no_softmax"  # the sweep's rows for SoftmaxLeftOut
# Tiles also timed as SoftmaxLeftOut (Note [What the softmax costs]), at D = 128 non-causal.
ABLATION_CONFIGS = (DEFAULT_CONFIGS[128], SM90_D128_TILE)


class SoftmaxLeftOut(FlashAttentionAmpere):
    """A timing ablation, not attention (Note [What the softmax costs]): the same kernel with
    the online softmax cut down to what keeps its input alive (each row's first score goes into
    the row sum), so the loads, barriers, S = QK^T and O += PV run as before with P = S rounded
    to 16 bits. Its output means nothing; only measure.ch04_sweep runs it, to time it.

    Note [What the softmax costs]. Timed next to the full kernel on the same inputs, the
    difference is what the softmax adds on top of the two GEMMs (max, exp2, sum, O rescale and
    the waiting they cause); compared with the mma.sync ceiling of results/<gpu>/microbench.json
    it shows how far the GEMMs themselves are from the tensor cores' rate."""

    @cute.jit
    def online_softmax(self, acc_S, acc_O, row_max, row_sum, scale_log2, is_first):
        s = rows_cols_view(acc_S)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            row_sum[r] = row_sum[r] + s[r, 0]
            row_max[r] = Float32(0.0)


def config_label(config: TileConfig) -> str:
    """'128x64 t128 s1 swizzled u2': M x N tile, threads, K/V stages, shared-memory layout,
    k-slices per trip of the QK^T loop; ' skip' when a warp vote skips the O rescale."""
    return (f"{config.m_block}x{config.n_block} t{config.num_threads} s{config.num_stages} "
            f"{config.smem_layout} u{config.qk_unroll}" + (" skip" if config.skip_rescale else ""))


def config_from_row(row: dict) -> TileConfig:
    """The TileConfig a sweep row was measured with (rows from before a knob existed have its
    default)."""
    return TileConfig(row["m_block"], row["n_block"], row["num_threads"], row["num_stages"],
                      row["smem_layout"], row.get("qk_unroll", 1), row.get("skip_rescale", False))


def tile_name(row: dict) -> str:
    """config_label of a sweep row."""
    return config_label(config_from_row(row))


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="two small cases (the default)")
    parser.add_argument("--check", action="store_true", help="every CHECK_CASES entry")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here; compile_only() and tests/test_ch04_compile.py need none")
        return 0
    cases = CHECK_CASES if args.check else SMALL_CASES
    failures = checks.run_cases(check_case, [(case, None) for case in cases])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
