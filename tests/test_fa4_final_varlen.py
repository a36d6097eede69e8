"""The varlen kernel's host-side pieces on a CPU: the work index -> (sequence, head, m_block)
mapping (scheduler.varlen_locate_host, the plain-Python mirror of the device's warp scan)
against brute force on random length lists with zeros, and the launch glue with a recording
backend (no GPU)."""

import math
import random
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from fa4_final.common.schedule import (
    tile_coords,
    varlen_locate_host,
    varlen_tile_coords_host,
    varlen_tiles,
)
from fa4_final.runtime import dispatch, prologue, varlen
from utils.host_emulation import patched, plain, python_loops


def brute_locate(t, lens_q, tile_m, heads):
    """(b, tiles before b): walk the sequences one by one."""
    before = 0
    for b, n in enumerate(lens_q):
        tiles = math.ceil(n / tile_m) * heads
        if t < before + tiles:
            return b, before
        before += tiles
    raise AssertionError("t past the last tile")


def random_lens(rng, batch):
    """Lengths with zeros, ones, exact tile multiples and long ones."""
    pool = [0, 0, 1, 2, 127, 128, 129, 255, 256, 1000]
    return [rng.choice(pool) if rng.random() < 0.5 else rng.randint(0, 3000)
            for _ in range(batch)]


@pytest.mark.parametrize("seed", range(40))
def test_locate_matches_brute_force(seed):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 5, 31, 32, 33, 64, 70, 100])  # around the 32-lane chunks
    lens = random_lens(rng, batch)
    tile_m, heads = rng.choice([128, 192]), rng.choice([1, 3, 16])
    total = sum(varlen_tiles(n, tile_m, heads) for n in lens)
    ts = range(total) if total <= 3000 else rng.sample(range(total), 3000)
    for t in ts:
        b, before, got_total = varlen_locate_host(t, lens, tile_m, heads)
        assert (b, before) == brute_locate(t, lens, tile_m, heads), (t, lens)
        assert got_total == total
        assert lens[b] > 0  # an empty sequence never owns a tile
    assert varlen_locate_host(total, lens, tile_m, heads)[2] == total  # past the end: total


def test_all_empty_and_no_sequences():
    assert varlen_locate_host(0, [0, 0, 0], 128, 4)[2] == 0
    assert varlen_locate_host(0, [], 128, 4)[2] == 0


@pytest.mark.parametrize("longest_first, l2_group", [(False, None), (True, None), (True, 2),
                                                     (True, 3)])
@pytest.mark.parametrize("seed", range(8))
def test_every_tile_once_in_the_dense_order_per_sequence(seed, longest_first, l2_group):
    rng = random.Random(100 + seed)
    lens = random_lens(rng, rng.choice([3, 33, 40]))
    tile_m, heads = 128, rng.choice([1, 4, 6])
    total = sum(varlen_tiles(n, tile_m, heads) for n in lens)
    got = [varlen_tile_coords_host(t, lens, tile_m, heads, longest_first, l2_group)
           for t in range(total)]
    want = [(b, m, h) for b, n in enumerate(lens) for m in range(math.ceil(n / tile_m))
            for h in range(heads)]
    assert sorted(got) == sorted(want)  # every (sequence, m_block, head) exactly once
    assert [b for b, _, _ in got] == sorted(b for b, _, _ in got)  # sequences in order
    for b, n in enumerate(lens):  # inside a sequence: the dense order with a batch of one
        mine = [(m, h) for bb, m, h in got if bb == b]
        nm = math.ceil(n / tile_m)
        dense = [tile_coords(r, nm, heads, 1, longest_first, l2_group)[:2]
                 for r in range(nm * heads)]
        assert mine == dense
        if longest_first and l2_group is None:  # causal: the tile with the most keys first
            assert [m for m, _ in mine] == sorted((m for m, _ in mine), reverse=True)


@pytest.mark.parametrize("seed", range(20))
def test_grid_bound_covers_every_tile(seed):
    """The launch sizes the grid from shapes alone: (ceil(total_q / tile_m) + batch) * heads
    tiles at most (each sequence adds at most one partial tile per head)."""
    rng = random.Random(200 + seed)
    lens = random_lens(rng, rng.randint(1, 80))
    for tile_m in (128, 192):
        exact = sum(varlen_tiles(n, tile_m, 1) for n in lens)
        assert exact <= math.ceil(sum(lens) / tile_m) + len(lens)


# ----------------------------------------------------------------------------------------------
# the launch glue, with a recording backend


class Recorder:
    def __init__(self):
        self.calls = []

    def forward(self, q, *args):
        self.calls.append(("dense", tuple(q.shape)))

    def varlen_forward(self, q, k, v, cu_q, cu_k, used, max_q, max_k, out, lse, causal, scale,
                       left, right, config):
        self.calls.append(("varlen", tuple(q.shape), tuple(lse.shape), causal, scale, left,
                           right, max_q, max_k, used is not None))


def packed(lens_q, lens_k, h=4, hk=2, d=64):
    q = torch.randn(sum(lens_q), h, d).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), hk, d).to(torch.bfloat16) for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
          for x in (lens_q, lens_k)]
    return q, k, v, *cu


def test_the_hopper_row_has_the_varlen_kernel():
    assert dispatch.HOPPER.varlen_forward is not None
    assert dispatch.BLACKWELL.varlen_forward is None


def test_one_kernel_call_for_the_whole_batch(monkeypatch):
    rec = Recorder()
    backend = replace(dispatch.BACKENDS[0], forward=rec.forward,
                      varlen_forward=rec.varlen_forward)
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    q, k, v, cu_q, cu_k = packed([5, 0, 33, 1], [9, 12, 0, 3])
    out, lse = torch.empty_like(q), torch.empty(4, q.shape[0])
    used = torch.tensor([9, 2, 0, 3], dtype=torch.int32)
    varlen.varlen_forward_into(q, k, v, cu_q, cu_k, used, 33, 12, out, lse, causal=True,
                               window_size=(7, None))
    assert rec.calls == [("varlen", (39, 4, 64), (4, 39), True, 64**-0.5, 7, 0, 33, 12, True)]
    with pytest.raises(ValueError, match="seqused_k"):  # the value checks still run first
        varlen.varlen_forward_into(q, k, v, cu_q, cu_k, used + 20, None, None, out, lse)
    assert len(rec.calls) == 1


# ----------------------------------------------------------------------------------------------
# the device source itself, run on the CPU: one Python thread per lane, in lockstep at every
# warp-collective call (utils.host_emulation turns the DSL's loops back into Python loops)


class Warp:
    """32 threads running one function; shuffles and ballots meet at a barrier, as a warp's
    lanes do at shfl.sync / vote.sync."""

    LANES = 32

    def __init__(self):
        self.barrier = threading.Barrier(self.LANES)
        self.slots = [None] * self.LANES
        self.local = threading.local()

    def _exchange(self, value):
        self.slots[self.local.lane] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()
        return seen

    def lane_idx(self):
        return self.local.lane

    def shuffle_sync(self, value, src, mask_and_clamp=31):
        return self._exchange(value)[src]

    def shuffle_sync_up(self, value, offset):  # shfl.sync.up with c = 0: low lanes keep theirs
        lane = self.local.lane
        seen = self._exchange(value)
        return seen[lane - offset] if lane >= offset else value

    def vote_ballot_sync(self, pred):
        return sum(1 << i for i, p in enumerate(self._exchange(bool(pred))) if p)

    def run(self, fn, *args):
        results, errors = [None] * self.LANES, []

        def lane(i):
            self.local.lane = i
            try:
                results[i] = fn(*args)
            except Exception as exc:  # a lane that fails would hang the others: abort them
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=lane, args=(i,)) for i in range(self.LANES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def device_locate(t, lens_q, tile_m, heads):
    """scheduler.varlen_locate's own source on 32 emulated lanes; every lane's answer."""
    import cutlass.cute as cute

    from fa4_final.common import schedule as scheduler

    warp = Warp()
    cu = np.array([0, *np.cumsum(lens_q, dtype=np.int64)], dtype=np.int64)
    arch = dict(lane_idx=warp.lane_idx, shuffle_sync=warp.shuffle_sync,
                shuffle_sync_up=warp.shuffle_sync_up, vote_ballot_sync=warp.vote_ballot_sync,
                popc=lambda x: bin(x).count("1"))
    ceil_div = lambda a, b: -(-int(a) // b)  # noqa: E731
    with python_loops(), patched(cute.arch, **arch), patched(cute, ceil_div=ceil_div), \
            patched(scheduler, Int32=int, lane_here=warp.lane_idx, _warp_inclusive_sum=plain(
                scheduler._warp_inclusive_sum)):
        return warp.run(plain(scheduler.varlen_locate), t, cu, tile_m, heads)


@pytest.mark.parametrize("seed", range(6))
def test_the_device_source_agrees_with_brute_force(seed):
    rng = random.Random(300 + seed)
    lens = random_lens(rng, rng.choice([1, 5, 32, 33, 70]))
    tile_m, heads = 128, rng.choice([1, 4])
    total = sum(varlen_tiles(n, tile_m, heads) for n in lens)
    for t in [-1, total] + rng.sample(range(total), min(total, 12)):
        lanes = device_locate(t, lens, tile_m, heads)
        assert all(lane == lanes[0] for lane in lanes), "lanes disagree"
        b, before, got_total = lanes[0]
        assert got_total == total
        if 0 <= t < total:
            assert (b, before) == brute_locate(t, lens, tile_m, heads), (t, lens)
