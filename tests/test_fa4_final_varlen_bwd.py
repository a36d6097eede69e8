"""The varlen backward's host-side pieces on a CPU, against brute force: the padded dQ
accumulator's slabs (bwd_tiles.dq_accum_tile: no two sequences share one, all fit), the list of
key tiles one CTA each (bwd_tiles.varlen_key_tile_host: every (sequence, key tile, kv head)
once, the grid bound covers it), the deterministic turns in launch order (no CTA waits for one
launched after it), the device source of the lookups run on emulated lanes, and the launch glue
with recording kernels (no GPU)."""

import math
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from fa4_final.common.bwd_tiles import (
    dq_accum_tile,
    dq_accum_tiles,
    dq_turn,
    launch_order_reversed,
    q_tile_range,
    varlen_grid_bound,
    varlen_key_tile_host,
)
from fa4_final.common.tiles import TileWindow
from fa4_final.hopper import host
from fa4_final.hopper.config import hopper_bwd_default
from fa4_final.runtime import dispatch, prologue, varlen
from fa4_final.runtime.compile import Plan
from tests.test_fa4_final_varlen import Warp, random_lens
from utils.host_emulation import patched, plain, python_loops


def cu_of(lens):
    return [0, *np.cumsum(lens, dtype=np.int64).tolist()]


# ----------------------------------------------------------------------------------------------
# the padded dQ accumulator (Note [Varlen dQ accumulator])


@pytest.mark.parametrize("seed", range(30))
def test_accumulator_slabs_never_overlap_and_fit(seed):
    rng = random.Random(seed)
    lens = random_lens(rng, rng.choice([1, 2, 7, 33, 100]))
    cu = cu_of(lens)
    for tile_m in (16, 64, 80, 128):
        owner = {}
        for b, n in enumerate(lens):
            first = dq_accum_tile(cu[b], b, tile_m)
            for m in range(math.ceil(n / tile_m)):
                slab = first + m
                assert slab not in owner, (tile_m, lens, b, m, owner.get(slab))
                owner[slab] = (b, m)
        size = dq_accum_tiles(cu[-1], len(lens), tile_m)
        assert all(0 <= s < size for s in owner)
        # the padding costs at most one slab per sequence over the packed rows
        assert size <= math.ceil(cu[-1] / tile_m) + len(lens)


def test_workspace_shapes_follow_the_slabs():
    shapes = host.workspace_shapes(1000, 7, 4, 128, 64, True)
    tiles = 1000 // 64 + 7
    assert shapes == {"lse2": (1, 4, tiles * 64), "delta": (1, 4, tiles * 64),
                      "accum": (1, 4, tiles * 64 * 128), "turn": (1, 4, tiles)}
    assert host.workspace_shapes(1000, 7, 4, 128, 64, False)["turn"] == (1, 1, 1)


# ----------------------------------------------------------------------------------------------
# one CTA per (key tile of a sequence, kv head) (Note [Varlen backward])


@pytest.mark.parametrize("seed", range(30))
def test_key_tile_list_holds_every_tile_once(seed):
    rng = random.Random(100 + seed)
    lens_k = random_lens(rng, rng.choice([1, 3, 32, 33, 70]))
    heads_kv, tile_n = rng.choice([1, 2, 8]), 128
    for reversed_order in (False, True):
        bound = varlen_grid_bound(sum(lens_k), len(lens_k), tile_n, heads_kv)
        got = [varlen_key_tile_host(t, lens_k, tile_n, heads_kv, reversed_order)
               for t in range(bound)]
        tiles = [g for g in got if g is not None]
        want = {(b, n, h) for b, lk in enumerate(lens_k) for n in range(math.ceil(lk / tile_n))
                for h in range(heads_kv)}
        assert len(tiles) == len(want) and set(tiles) == want
        first_none = next((i for i, g in enumerate(got) if g is None), len(got))
        assert all(g is None for g in got[first_none:])  # the valid CTAs come first
        assert [b for b, _, _ in tiles] == sorted(b for b, _, _ in tiles)  # sequences in order


@pytest.mark.parametrize("seed", range(12))
def test_deterministic_turns_wait_only_for_earlier_ctas(seed):
    """For every (sequence, query head's kv head, query tile): the key tiles that add to its dQ
    take turns 0, 1, ... (a permutation) and a CTA's turn grows with its index in the grid, so
    every CTA waits only for CTAs launched before it (no deadlock, in any sequence)."""
    rng = random.Random(200 + seed)
    batch = rng.choice([2, 5, 33])
    lens_q = random_lens(rng, batch)
    lens_k = [rng.choice([n, rng.randint(0, 700)]) for n in lens_q]
    tm, tn = rng.choice([64, 80]), 128
    heads_kv = rng.choice([1, 2])
    for causal, left, right in ((False, None, None), (True, None, None), (False, 50, 7),
                                (True, 200, None), (False, None, 0)):
        w = TileWindow(tm, tn, causal, has_left=left is not None,
                       has_right=right is not None and not causal)
        reversed_order = launch_order_reversed(w)
        turns = {}  # (b, head_kv, m) -> [(turn, cta)]
        for t in range(varlen_grid_bound(sum(lens_k), batch, tn, heads_kv)):
            tile = varlen_key_tile_host(t, lens_k, tn, heads_kv, reversed_order)
            if tile is None:
                continue
            b, n, h = tile
            sq, sk = lens_q[b], lens_k[b]
            m_min, m_max, _, _ = q_tile_range(w, n, sq, sk, left, right)
            for m in range(m_min, m_max):
                turn = dq_turn(w, n, m, math.ceil(sk / tn), sq, sk, left, right)
                turns.setdefault((b, h, m), []).append((turn, t))
        for key, pairs in turns.items():
            assert sorted(p[0] for p in pairs) == list(range(len(pairs))), (key, pairs)
            assert [p[1] for p in sorted(pairs)] == sorted(p[1] for p in pairs), (key, pairs)


# ----------------------------------------------------------------------------------------------
# the device source, run on 32 emulated lanes (tests.test_fa4_final_varlen.Warp)


def _on_lanes(fn, *args, modules=()):
    import cutlass
    import cutlass.cute as cute

    from fa4_final.common import schedule as scheduler

    warp = Warp()
    arch = dict(lane_idx=warp.lane_idx, shuffle_sync=warp.shuffle_sync,
                shuffle_sync_up=warp.shuffle_sync_up, vote_ballot_sync=warp.vote_ballot_sync,
                popc=lambda x: bin(x).count("1"))
    ceil_div = lambda a, b: -(-int(a) // b)  # noqa: E731
    with python_loops(), patched(cute.arch, **arch), patched(cute, ceil_div=ceil_div), \
            patched(cutlass, max=max), \
            patched(scheduler, Int32=int, const_expr=bool, varlen_locate=plain(
                scheduler.varlen_locate), lane_here=warp.lane_idx, _warp_inclusive_sum=plain(
                scheduler._warp_inclusive_sum)):
        stack = [patched(m, Int32=int, const_expr=bool,
                         varlen_locate=plain(scheduler.varlen_locate)) for m in modules]
        for s in stack:
            s.__enter__()
        try:
            return warp.run(fn, *args)
        finally:
            for s in reversed(stack):
                s.__exit__(None, None, None)


@pytest.mark.parametrize("seed", range(4))
def test_the_device_key_tile_lookup_agrees_with_its_mirror(seed):
    """HopperVarlenBackward.varlen_key_tile's own source (seqused_k or not) against
    varlen_key_tile_host; past the last tile both lengths are 0."""
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.hopper import bwd as hbwd
    from fa4_final.hopper.config import hopper_bwd_default

    rng = random.Random(300 + seed)
    batch = rng.choice([1, 5, 33])
    lens_q, lens_k = random_lens(rng, batch), random_lens(rng, batch)
    used = [rng.randint(0, n) for n in lens_k] if seed % 2 else None
    heads_kv = rng.choice([1, 3])
    kernel = hbwd.HopperVarlenBackward(CUTLASS_BY_NAME["bf16"], 128, False,
                                       hopper_bwd_default(128), has_seqused_k=used is not None)
    cu_q, cu_k = np.array(cu_of(lens_q)), np.array(cu_of(lens_k))
    used_arr = None if used is None else np.array(used)
    lens_used = used or lens_k
    bound = varlen_grid_bound(sum(lens_k), batch, 128, heads_kv)
    fn = plain(hbwd.HopperBackward.varlen_key_tile)
    for t in [0, bound - 1] + rng.sample(range(bound), min(bound, 10)):
        lanes = _on_lanes(fn, kernel, t, heads_kv, cu_q, cu_k, used_arr, modules=(hbwd,))
        assert all(lane == lanes[0] for lane in lanes)
        n_block, head_kv, sq, sk, (off_q, off_k, m_base) = lanes[0]
        want = varlen_key_tile_host(t, lens_used, 128, heads_kv)
        if want is None:
            assert sq == sk == 0
            continue
        b = want[0]
        assert (n_block, head_kv) == want[1:]
        assert (sq, sk, off_q, off_k) == (lens_q[b], lens_used[b], cu_q[b], cu_k[b])
        assert m_base == dq_accum_tile(cu_q[b], b, kernel.tile_m)


@pytest.mark.parametrize("seed", range(3))
def test_the_device_query_tile_lookup_lists_every_tile_once(seed):
    """seqlens.varlen_query_tile (bwd_pre and bwd_post) over the grid: every (sequence, head,
    query tile) once, with its sequence's rows and padded slabs; the rest invalid."""
    from fa4_final.common import seqlens

    rng = random.Random(400 + seed)
    lens_q = random_lens(rng, rng.choice([2, 33]))
    heads, tile_m = rng.choice([1, 4]), 64
    cu_q = np.array(cu_of(lens_q))
    bound = varlen_grid_bound(sum(lens_q), len(lens_q), tile_m, heads)
    seen = set()
    fn = plain(seqlens.varlen_query_tile)
    for t in range(0, bound, max(1, bound // 40)):
        lanes = _on_lanes(fn, t, cu_q, tile_m, heads, modules=(seqlens,))
        m, at = lanes[0]
        if not at.valid:
            continue
        b = int(np.searchsorted(cu_q, at.offset_q, side="right")) - 1
        while lens_q[b] == 0:  # empty sequences share their offset with the next one
            b += 1
        assert (at.seqlen_q, at.offset_q) == (lens_q[b], cu_q[b])
        assert at.m_base == dq_accum_tile(cu_q[b], b, tile_m)
        assert 0 <= m < math.ceil(lens_q[b] / tile_m) and 0 <= at.head < heads
        assert (b, m, at.head) not in seen
        seen.add((b, m, at.head))


# ----------------------------------------------------------------------------------------------
# the launch glue


def packed(lens_q, lens_k, h=4, hk=2, d=64):
    q = torch.randn(sum(lens_q), h, d).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), hk, d).to(torch.bfloat16) for _ in range(2))
    cu = [torch.tensor(cu_of(x), dtype=torch.int32) for x in (lens_q, lens_k)]
    return q, k, v, *cu


def _grads_args(lens_q, lens_k):
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(q.shape[1], q.shape[0])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k


def test_the_hopper_row_has_the_varlen_backward():
    assert dispatch.HOPPER.varlen_backward is not None
    assert dispatch.BLACKWELL.varlen_backward is None


def test_one_call_of_the_varlen_backward(monkeypatch):
    calls = []
    backend = replace(dispatch.BACKENDS[0], varlen_backward=lambda *a: calls.append(a),
                      backward=lambda *a: calls.append(("dense",) + a))
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    args = _grads_args([5, 0, 33, 1], [9, 12, 0, 3])
    used = torch.tensor([9, 2, 0, 3], dtype=torch.int32)
    varlen.varlen_backward_into(*args, used, 33, 12, causal=True, window_size=(7, None),
                                deterministic=True)
    assert len(calls) == 1
    got = calls[0]
    assert got[11] is used and got[12:] == (33, 12, True, 64**-0.5, 7, 0, True, None)
    with pytest.raises(ValueError, match="seqused_k"):  # the value checks still run first
        varlen.varlen_backward_into(*args, used + 20, None, None)
    assert len(calls) == 1


def test_without_the_kernel_the_loop_runs(monkeypatch):
    calls = []
    backend = replace(dispatch.BACKENDS[0], varlen_backward=None,
                      backward=lambda q, k, *a: calls.append((q.shape[1], k.shape[1])))
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    args = _grads_args([5, 0, 33, 1], [9, 12, 0, 3])
    varlen.varlen_backward_into(*args, None, None, None)
    assert calls == [(5, 9), (1, 3)]  # the sequences with queries and keys, one launch each
    for g in args[6:9]:
        assert torch.all(g == 0)  # nothing launched wrote them: zeros from the loop itself
    calls.clear()
    dq, dk, dv = varlen.backward_loop(*args[:6], args[9], args[10])
    assert calls == [(5, 9), (1, 3)] and dq.shape == args[0].shape


class FakeKernels:
    """Stands in for the compiled kernels: records the shapes it was called with."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, role):
        def run(*args):
            self.calls.append((role, [tuple(a.shape) if isinstance(a, torch.Tensor) else a
                                      for a in args]))
        return run


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_launch_passes_the_packed_batch_of_one(deterministic):
    fake = FakeKernels()
    plan = Plan(fake, hopper_bwd_default(64, False, deterministic))
    lens_q, lens_k = [5, 0, 130, 1], [9, 12, 0, 3]
    q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k = _grads_args(lens_q, lens_k)
    used = torch.tensor([9, 2, 0, 3], dtype=torch.int32)
    dk.fill_(7.0)
    dv.fill_(7.0)
    host.launch_varlen_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, used,
                                130, 12, False, 0.125, None, None)
    assert torch.all(dk == 0) and torch.all(dv == 0)  # seqused_k: rows past it stay 0
    roles = [r for r, _ in fake.calls]
    assert roles == ["pre", "main", "post"]
    tile_m = hopper_bwd_default(64, False).tile_m
    tiles = dq_accum_tiles(136, 4, tile_m)
    pre, main, post = (a for _, a in fake.calls)
    assert pre[:4] == [(1, 136, 4, 64), (1, 136, 4, 64), (1, 4, 136), (1, 4, tiles * tile_m)]
    assert pre[5] == (1, 4, tiles * tile_m * 64)
    assert pre[6] == ((1, 4, tiles) if deterministic else (1, 1, 1))
    assert main[0] == (1, 136, 4, 64) and main[1] == (1, 24, 2, 64) and main[7] == main[1]
    assert main[12] == (4,) and main[13:] == [0.125, 0, 0]
    assert post[1] == (1, 136, 4, 64) and post[3] == 0.125


def test_empty_batches_never_reach_the_kernel(monkeypatch):
    backend = replace(dispatch.HOPPER,
                      varlen_backward=lambda *a: pytest.fail("nothing to launch for"))
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k = _grads_args([0, 0], [3, 4])
    dk.fill_(1.0)
    varlen.varlen_backward_into(q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, None, 0, 4,
                                causal=True)
    assert torch.all(dk == 0) and torch.all(dv == 0)
    q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k = _grads_args([3, 4], [0, 0])
    dq.fill_(1.0)
    varlen.varlen_backward_into(q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, None, 4, 0)
    assert torch.all(dq == 0)


# ----------------------------------------------------------------------------------------------
# the GPU tests' own checks, on a CPU stand-in for the kernel


@pytest.fixture
def gpu_tests_on_cpu(monkeypatch):
    """tests/gpu/test_fa4_final_varlen_bwd.py with DEVICE = "cpu" and the kernel (and the
    loop) replaced by the CPU reference (tests.fa4_cpu_reference.varlen_backward)."""
    from tests import fa4_cpu_reference as ref
    from tests.gpu import test_fa4_final_varlen_bwd as gpu

    def stand_in(q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, used, max_q, max_k,
                 causal=False, softmax_scale=None, window_size=(None, None),
                 deterministic=False):
        left, right = window_size
        right = 0 if causal else right
        grads = ref.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, used,
                                    q.shape[-1] ** -0.5, causal, left, right)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
        return dq, dk, dv

    def loop(q, k, v, out, lse, dout, cu_q, cu_k, used=None, **kw):
        grads = [torch.empty_like(t) for t in (q, k, v)]
        return stand_in(q, k, v, out, lse, dout, *grads, cu_q, cu_k, used, None, None, **kw)

    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(varlen, "varlen_backward_into", stand_in)
    monkeypatch.setattr(varlen, "backward_loop", loop)
    return gpu


@pytest.mark.parametrize("name", ["mixed-causal-used", "mixed-mqa-window-d64-fp16",
                                  "skewed-causal"])
def test_the_gpu_checks_pass_a_right_answer_and_fail_wrong_ones(gpu_tests_on_cpu, name):
    gpu = gpu_tests_on_cpu
    p = gpu.Problem(gpu.CASES[name])
    right = p.run()
    p.check(right, name)
    gpu.test_varlen_backward_deterministic_is_bitwise_repeatable_and_the_loop(
        lambda _: p, name)
    # an element nobody wrote, a gradient leaking into unused keys, a wrong value
    for spoil in ("nan", "unused", "scale"):
        grads = [g.clone() for g in right]
        if spoil == "nan":
            grads[0][p.rows[2].start + 5, 1, 3] = float("nan")
        elif spoil == "unused":
            b = next(i for i, n in enumerate(p.lens_k) if p.used_k[i] < n) if p.used else None
            if b is None:
                continue
            grads[1][p.keys[b].stop] = 1e-3
        else:
            grads[2] *= 1.05
        with pytest.raises(AssertionError):
            p.check(grads, f"{name} spoiled by {spoil}")


def test_the_gpu_guard_rows_catch_writes_outside(gpu_tests_on_cpu, monkeypatch):
    gpu = gpu_tests_on_cpu
    p = gpu.Problem(gpu.CASES["mixed-gqa-d128"])
    real = varlen.varlen_backward_into

    def spills(q, k, v, out, lse, dout, dq, dk, dv, *rest, **kw):
        real(q, k, v, out, lse, dout, dq, dk, dv, *rest, **kw)
        dk.as_strided((1,), (1,), dk.storage_offset() + dk.numel()).fill_(0.0)  # one past

    monkeypatch.setattr(varlen, "varlen_backward_into", spills)
    with pytest.raises(AssertionError, match="outside"):
        p.run()
