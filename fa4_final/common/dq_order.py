"""The order of the backward's float32 dQ accumulator, which both architectures write and
bwd_post reads back.

Note [dQ in accumulator order]
A step's dQ (tile_m x D floats) is added into global memory by one bulk instruction per
warpgroup. For that the bytes must be contiguous in shared memory and in global memory, so the
dQ accumulator is stored not row-major but in the order the Hopper backward's MMA threads hold
it: chunk w of query tile m holds warpgroup w's registers, thread t's 4 consecutive floats at
16 t + 2048 k bytes. The shared-memory writes are then 128-bit and conflict-free, the bulk add is
a straight copy, and bwd_post, which turns the accumulator into dQ, rebuilds each element's
(row, col) from the same copy (``dq_copy``) and the writer's register coordinates
(``dq_coords``). The Blackwell backward writes the same order (its Note [dQ accumulator order]),
so one bwd_post serves both. Where one warpgroup computes the whole dQ tile
(Note [dQ by one warpgroup] in fa4_final.hopper.bwd) the tile is one chunk of that warpgroup's
registers, in the same order (``dq_copy(1)``, ``dq_offset``).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from fa4_final.common.constants import THREADS_PER_WARPGROUP

DQ_WARPGROUPS = 2  # chunks per query tile: the Hopper backward's two MMA warpgroups


def dq_copy(warpgroups: int = DQ_WARPGROUPS) -> cute.TiledCopy:
    """How a writer thread's dQ registers map to the float32 staging buffer and the accumulator
    in global memory: 16 B per thread, consecutive threads adjacent. ``warpgroups``: those
    that write a chunk (1 when one warpgroup computes the whole dQ tile)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(
        atom, cute.make_layout((THREADS_PER_WARPGROUP, warpgroups)), cute.make_layout(4))


def dq_chunk_layout(dq_chunk: int, warpgroups: int = DQ_WARPGROUPS) -> cute.Layout:
    """A query tile's slab: (floats per warpgroup, warpgroups)."""
    return cute.make_layout((dq_chunk, warpgroups))


def dq_offset(tidx: int, i: int, dq_chunk: int) -> int:
    """Where register i of writer thread ``tidx`` lands in its query tile's slab (floats): chunk
    tidx // 128, then 4 consecutive floats a thread, 512 floats a round of the warpgroup. The
    arithmetic of ``dq_copy`` (a CPU test compares it with the tiled copy)."""
    w, t = divmod(tidx, THREADS_PER_WARPGROUP)
    return w * dq_chunk + 4 * THREADS_PER_WARPGROUP * (i // 4) + 4 * t + i % 4


class DqOrder:
    """The accumulator order at ``tile_m`` rows (rows split between the warpgroups, no swapped
    dQ GEMM), stated as arithmetic: what bwd_post needs of a writer that is not the Hopper
    kernel (the Blackwell backward compiles for sm_100a, where no wgmma atom can be built)."""

    dq_swap_ab = False

    def __init__(self, dtype, head_dim: int, tile_m: int):
        self.dtype, self.head_dim, self.tile_m = dtype, head_dim, tile_m
        self.num_threads = THREADS_PER_WARPGROUP * (1 + DQ_WARPGROUPS)  # as the Hopper kernel
        self.dq_threads = THREADS_PER_WARPGROUP * DQ_WARPGROUPS  # threads that wrote dQ
        self.dq_chunk = tile_m * head_dim // DQ_WARPGROUPS

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.dtype.__name__, self.head_dim, self.tile_m)

    def dq_copy(self) -> cute.TiledCopy:
        return dq_copy()

    def dq_chunk_layout(self) -> cute.Layout:
        return dq_chunk_layout(self.dq_chunk)

    def dq_tile_shape(self) -> tuple:
        return (self.tile_m, self.head_dim)

    def dq_coords(self, tidx):
        """Register i = a + 2 h + 4 j of thread t (warp t // 32 of warpgroup w = tidx // 128)
        holds row 64 w + 16 (t // 32 % 4) + (t % 32) // 4 + 8 h, column 8 j + 2 (t % 4) + a (the
        wgmma m64nNk16 accumulator, PTX ISA)."""
        t = tidx % THREADS_PER_WARPGROUP
        row0 = (tidx // THREADS_PER_WARPGROUP) * 64 + (t // 32) * 16 + (t % 32) // 4
        col0 = 2 * (t % 4)
        return [(row0 + 8 * h, col0 + 8 * j + a) for j in range(self.head_dim // 8)
                for h in range(2) for a in range(2)]
