"""Hopper building blocks of the wgmma kernels: the swizzled shared-memory layout of a tile, the
two tiled MMAs of attention and one warpgroup's operands of them, issuing one asynchronous wgmma
group, and reordering a tensor's modes."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from fa4_final.common.constants import WGMMA_M


def smem_tile_layout(dtype, head_dim: int, rows: int, stages: int | None = None):
    """128 B-swizzled K-major layout of a (rows, head_dim) tile (or a ring of ``stages`` of
    them): rows of D contiguous elements, what TMA writes and wgmma reads without bank
    conflicts."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, head_dim), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, head_dim), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, head_dim, stages), order=(0, 1, 2))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """A view of a shared-memory tensor with its first two modes swapped: an operand read
    transposed by wgmma (Q^T from Q, K^T from K, V^T from a V ring, P^T's (keys, rows) view)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def attention_tiled_mmas(dtype, num_warpgroups: int, tile_n: int, head_dim: int,
                         head_dim_v: int | None = None):
    """(S = Q K^T, O = P V) tiled MMAs. S: A = Q and B = K, both K-major in shared memory.
    O: A = P from registers, B = V read through a transposed view, so its contiguous dimension
    (dv: ``head_dim_v``, head_dim if None) is the N mode: MN-major. Atoms (n, 1, 1): each
    warpgroup owns its own 64 rows."""
    dv = head_dim if head_dim_v is None else head_dim_v
    atoms = (num_warpgroups, 1, 1)
    major = cute.nvgpu.OperandMajorMode
    mma_qk = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, major.K, major.K, Float32, atoms, (WGMMA_M, tile_n))
    mma_pv = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, major.K, major.MN, Float32, atoms, (WGMMA_M, dv),
        warpgroup.OperandSource.RMEM)
    return mma_qk, mma_pv


class AttentionFragments(NamedTuple):
    """One warpgroup's view of S = Q K^T and O += P V (attention_fragments)."""

    thr_mma_qk: object  # this thread's slice of the S MMA (C fragments, coordinates)
    thr_mma_pv: object  # this thread's slice of the O MMA
    tSrQ: cute.Tensor  # Q as S's A operand, a descriptor over shared memory: (MMA, 1, D/16)
    tSrK: cute.Tensor  # K as S's B operand: (MMA, 1, D/16, STAGE)
    tOrVt: cute.Tensor  # V^T as O's B operand: (MMA, 1, tile_n/16, STAGE)
    acc_s: cute.Tensor  # S in float32 registers: ((2, 2, tile_n/8), 1, 1)
    acc_o: cute.Tensor  # O in float32 registers: ((2, 2, D/8), 1, 1)
    tOrP: cute.Tensor  # P in the input dtype, O's register A operand: ((2, 2, 2), 1, tile_n/16)


def attention_fragments(tiled_mma_qk, tiled_mma_pv, first_thread, tidx, sQ, sK, sV,
                        tile_m: int, tile_n: int, head_dim: int, v_stages: int,
                        dtype) -> AttentionFragments:
    """The operands and accumulators of one warpgroup's two GEMMs: A and B descriptors are per
    warpgroup (sliced at its ``first_thread``), C fragments per thread (``tidx``). V is read
    through a transposed view (D, tile_n, STAGE), the B operand of O = P V with N = D,
    K = tile_n. ``head_dim`` here is V's and O's (dv)."""
    wg_qk = tiled_mma_qk.get_slice(first_thread)
    wg_pv = tiled_mma_pv.get_slice(first_thread)
    thr_qk = tiled_mma_qk.get_slice(tidx)
    thr_pv = tiled_mma_pv.get_slice(tidx)
    sVt = cute.composition(sV, cute.make_ordered_layout(
        (head_dim, tile_n, v_stages), order=(1, 0, 2)))
    return AttentionFragments(
        thr_qk, thr_pv,
        wg_qk.make_fragment_A(wg_qk.partition_A(sQ)),
        wg_qk.make_fragment_B(wg_qk.partition_B(sK)),
        wg_pv.make_fragment_B(wg_pv.partition_B(sVt)),
        cute.make_rmem_tensor(thr_qk.partition_shape_C((tile_m, tile_n)), Float32),
        cute.make_rmem_tensor(thr_pv.partition_shape_C((tile_m, head_dim)), Float32),
        cute.make_rmem_tensor(thr_pv.partition_shape_A((tile_m, tile_n)), dtype))


@cute.jit
def issue_wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                accumulate):
    """Issue acc (+)= A B over the K blocks as one async group; the caller waits on it.
    ``accumulate`` False overwrites acc (a Python bool, or a run-time Boolean: wgmma's scale-d
    is a predicate operand). wgmma.fence orders earlier register writes (P, a rescaled O)
    before wgmma reads them."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
