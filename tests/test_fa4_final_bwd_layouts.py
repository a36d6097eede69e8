"""The Hopper backward's index arithmetic, run for real on the CPU (host-side CuTe): the same
tiled MMAs, partitions and masks the kernel traces, evaluated for every thread of the two MMA
warpgroups and compared with what they must mean. No GPU: what cannot run here (wgmma, stmatrix,
TMA) is left to the GPU tests; everything that decides *which* element goes where is checked.
"""

import cutlass
import cutlass.cute as cute
import numpy as np
import pytest
from cutlass import Float32, Int32
from cutlass.cute.runtime import from_dlpack

from fa4_final.common.bwd_tiles import dq_turn, q_tile_range
from fa4_final.common.fragments import acc_as_a_operand, acc_rows_cols
from fa4_final.common.mask import fragment_coords
from fa4_final.hopper.bwd import HopperBackward
from fa4_final.hopper.config import HopperBwdConfig

THREADS = 256


def host(fn, *args):
    """Run a @cute.jit function that launches no kernel on the CPU, traced for sm_90a (wgmma
    atoms check the target; the process's default target may be another one)."""
    cute.compile(fn, *args, options="--gpu-arch sm_90a")(*args)
CONFIGS = [(128, HopperBwdConfig(tile_m=64)), (128, HopperBwdConfig(tile_m=80, dq_swap_ab=True)),
           (64, HopperBwdConfig(tile_m=128))]


def _kernel(d, cfg, causal=False, left=False, right=False):
    return HopperBackward(cutlass.BFloat16, d, causal, cfg, has_window_left=left,
                          has_window_right=right)


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=["m64", "m80_swap", "d64"])
def test_p_transpose_is_the_a_operand_of_dv(d, cfg):
    """The S^T accumulator of each thread, seen as an A fragment (acc_as_a_operand), holds
    exactly the (key, query) elements the dV / dK wgmma expects from that thread."""
    k = _kernel(d, cfg)
    n = cfg.tile_m * cfg.tile_n // THREADS  # values per thread

    @cute.jit
    def coords(out_s: cute.Tensor, out_a: cute.Tensor):
        mma_sdp, mma_dkv, _ = k.tiled_mmas()
        ident = cute.make_identity_tensor((k.tile_n, k.tile_m))
        for t in cutlass.range(THREADS, unroll=1):
            s = acc_as_a_operand(mma_sdp.get_slice(t).partition_C(ident))
            a = mma_dkv.get_slice(t).partition_A(ident)
            for i in cutlass.range_constexpr(cute.size(s)):
                out_s[t, i, 0], out_s[t, i, 1] = s[i][0], s[i][1]
                out_a[t, i, 0], out_a[t, i, 1] = a[i][0], a[i][1]

    s = np.zeros((THREADS, n, 2), np.int32)
    a = np.zeros_like(s)
    host(coords, from_dlpack(s), from_dlpack(a))
    assert (s == a).all()
    # and together the threads cover the tile once
    flat = s[..., 0] * cfg.tile_m + s[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(cfg.tile_n * cfg.tile_m))


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=["m64", "m80_swap", "d64"])
def test_dq_accumulator_order_is_a_bijection(d, cfg):
    """Where each MMA thread's dQ registers land in the staging buffer (and so in global
    memory), and which (row, col) bwd_post gives each position: every position of the tile's
    slab once, every (row, col) of dQ once."""
    k = _kernel(d, cfg)
    slab = cfg.tile_m * d
    n = slab // THREADS

    @cute.jit
    def where(rc: cute.Tensor, buf: cute.Tensor):
        _, _, mma_dq = k.tiled_mmas()
        sdq = cute.make_tensor(buf.iterator, k.dq_chunk_layout())
        for t in cutlass.range(THREADS, unroll=1):
            # the kernel copies accumulator register i to the i-th element of this partition
            dst = k.dq_copy().get_slice(t).partition_D(sdq)
            c = mma_dq.get_slice(t).partition_C(cute.make_identity_tensor(k.dq_tile_shape()))
            for i in cutlass.range_constexpr(cute.size(c)):
                rc[t, i, 0], rc[t, i, 1] = c[i][0], c[i][1]
                dst[i] = Float32(t * 1000 + i)

    rc = np.zeros((THREADS, n, 2), np.int32)
    buf = np.full(slab, -1.0, np.float32)
    host(where, from_dlpack(rc), from_dlpack(buf))
    owner = buf.astype(np.int64)
    assert (owner >= 0).all(), "a position of the slab is written by no thread"
    t_of, i_of = owner // 1000, owner % 1000
    assert len(set(zip(t_of.tolist(), i_of.tolist()))) == slab  # each (thread, value) once
    coords = rc[t_of, i_of]  # the (row, col) bwd_post assigns to each slab position
    if cfg.dq_swap_ab:
        coords = coords[:, ::-1]
    flat = coords[:, 0] * d + coords[:, 1]
    assert np.array_equal(np.sort(flat), np.arange(slab))


@pytest.mark.parametrize("d,cfg", CONFIGS, ids=["m64", "m80_swap", "d64"])
def test_lse_and_delta_columns(d, cfg):
    """column_values: the lse (or delta) each thread pairs with its accumulator column c is the
    one of that column's query, from the right stage."""
    k = _kernel(d, cfg)
    m = cfg.tile_m

    @cute.jit
    def read(vec: cute.Tensor, out: cute.Tensor, want: cute.Tensor):
        mma_sdp, _, _ = k.tiled_mmas()
        for t in cutlass.range(THREADS, unroll=1):
            thr = mma_sdp.get_slice(t)
            cols = k.column_values(thr, vec, 1)
            rc = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((k.tile_n, k.tile_m))))
            for c in cutlass.range_constexpr(cute.size(cols, mode=[1])):
                out[t, c] = cols[0, c]
                want[t, c] = Float32(1000 + rc[0, c][1])

    vec = np.stack([np.arange(m), 1000 + np.arange(m)], axis=1).astype(np.float32)  # (m, 2)
    vec = np.asfortranarray(vec)
    out = np.zeros((THREADS, m // 4), np.float32)
    want = np.zeros_like(out)
    host(read, from_dlpack(vec).mark_layout_dynamic(leading_dim=0), from_dlpack(out),
         from_dlpack(want))
    assert (out == want).all()


def _visible(i, j, sq, sk, causal, left, right):
    off = sk - sq
    ok = (j < sk) & (i >= 0)
    if causal:
        right = 0
    if right is not None:
        ok &= j <= i + off + right
    if left is not None:
        ok &= j >= i + off - left
    return ok


@pytest.mark.parametrize("causal,left,right", [(True, None, None), (False, 40, None),
                                                (False, 17, 5), (False, None, 30),
                                                (True, 70, None)])
def test_mask_of_s_transpose(causal, left, right):
    """The kernel's mask (rows = keys, columns = queries) on a fragment of ones, for every thread,
    against the visibility rule, on key tiles that straddle the diagonal, the window edges and
    seqlen_k."""
    cfg = HopperBwdConfig(tile_m=64)
    k = _kernel(128, cfg, causal, left is not None, right is not None)
    sq, sk = 333, 301

    @cute.jit
    def run(out: cute.Tensor, n_block: Int32, m_block: Int32, wl: Int32, wr: Int32):
        mma_sdp, _, _ = k.tiled_mmas()
        shape = mma_sdp.get_slice(0).partition_shape_C((k.tile_n, k.tile_m))
        for t in cutlass.range(THREADS, unroll=1):
            thr = mma_sdp.get_slice(t)
            tScS, t0ScS = fragment_coords(thr, (k.tile_n, k.tile_m))
            acc = cute.make_tensor(out[t, None].iterator, cute.make_layout(shape))
            k.mask(acc, tScS, t0ScS, n_block, m_block, Int32(sq), Int32(sk), wl, wr)

    @cute.jit
    def coords(rc: cute.Tensor):
        mma_sdp, _, _ = k.tiled_mmas()
        for t in cutlass.range(THREADS, unroll=1):
            c = mma_sdp.get_slice(t).partition_C(cute.make_identity_tensor((k.tile_n, k.tile_m)))
            for i in cutlass.range_constexpr(cute.size(c)):
                rc[t, i, 0], rc[t, i, 1] = c[i][0], c[i][1]

    n = cfg.tile_m * cfg.tile_n // THREADS
    rc = np.zeros((THREADS, n, 2), np.int32)
    host(coords, from_dlpack(rc))
    checked = 0
    for n_block in range(-(-sk // 128)):
        m_min, m_max, _, _ = q_tile_range(k.window, n_block, sq, sk, left, right)
        for m_block in range(m_min, m_max):
            vals = np.ones((THREADS, n), np.float32)
            host(run, from_dlpack(vals), Int32(n_block), Int32(m_block), Int32(left or 0),
                 Int32(right or 0))
            keys = n_block * 128 + rc[..., 0]
            queries = m_block * 64 + rc[..., 1]
            want = _visible(queries, keys, sq, sk, causal, left, right)
            got = np.isfinite(vals)
            assert (got == want).all(), (n_block, m_block)
            checked += 1
    assert checked > 3


def test_device_integer_ranges_match_python():
    """q_tile_range and dq_turn traced on Int32 (as in the kernel) give the Python answers."""
    from fa4_final.common.tiles import TileWindow

    w = TileWindow(64, 128, True, has_left=True)

    @cute.jit
    def ranges(out: cute.Tensor, sq: Int32, sk: Int32, wl: Int32):
        for n in cutlass.range(out.shape[0], unroll=1):
            a, b, c, d = q_tile_range(w, n, sq, sk, wl, Int32(0))
            out[n, 0], out[n, 1], out[n, 2], out[n, 3] = a, b, c, d
            out[n, 4] = dq_turn(w, n, a, out.shape[0], sq, sk, wl, Int32(0))

    for sq, sk, wl in ((300, 1000, 100), (1000, 300, 7), (129, 129, 0)):
        n_k = -(-sk // 128)
        got = np.zeros((n_k, 5), np.int32)
        host(ranges, from_dlpack(got), Int32(sq), Int32(sk), Int32(wl))
        for n in range(n_k):
            r = q_tile_range(w, n, sq, sk, wl, 0)
            assert tuple(got[n, :4]) == r
            assert got[n, 4] == dq_turn(w, n, r[0], n_k, sq, sk, wl, 0)
