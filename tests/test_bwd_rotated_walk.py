"""The deterministic backward's rotated walk (HopperBwdConfig.dq_rotated, Note [A rotated walk]
in fa4_final.common.bwd_tiles): the tile and turn arithmetic on Python ints, a simulation of the
turn protocol with CTAs launched in order onto a limited number of SMs (it finishes, and in
step with each other no walk waits), the config's refusals, and the kernel compiled for sm_90a
from fake tensors (slow)."""

import re
from dataclasses import replace

import pytest

from fa4_final.common.bwd_tiles import (
    ROTATED_MAX_KEY_TILES,
    rotated_on,
    rotated_start,
    rotated_tile,
    rotated_turn,
)
from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default

SIZES = [(m, n) for m in (1, 2, 3, 5, 8, 13, 32, 64) for n in (1, 2, 3, 4, 7, 16, 32, 64)]


def walk(n, m_count, n_count):
    start = rotated_start(n, m_count, n_count)
    return [rotated_tile(i, start, m_count) for i in range(m_count)]


@pytest.mark.parametrize("m_count,n_count", SIZES)
def test_every_walk_visits_every_query_tile_once_and_turns_are_a_permutation(m_count, n_count):
    for n in range(n_count):
        assert sorted(walk(n, m_count, n_count)) == list(range(m_count))
    for m in range(m_count):
        turns = [rotated_turn(n, m, m_count, n_count) for n in range(n_count)]
        assert sorted(turns) == list(range(n_count)), (m, turns)


@pytest.mark.parametrize("m_count,n_count", SIZES)
def test_turns_follow_the_order_of_arrival(m_count, n_count):
    """At every query tile a key tile's turn comes after every key tile that reaches it at an
    earlier step of its walk: no turn makes a walk wait for one that arrives later."""
    arrival = {n: {m: i for i, m in enumerate(walk(n, m_count, n_count))}
               for n in range(n_count)}
    for m in range(m_count):
        by_turn = sorted(range(n_count), key=lambda n: rotated_turn(n, m, m_count, n_count))
        steps = [arrival[n][m] for n in by_turn]
        assert steps == sorted(steps), (m, by_turn, steps)


def simulate(m_count, n_count, sms, rotate=True, heads=1):
    """Unit-time steps, CTAs launched in order (key tile 0 of head 0 first, each head's key
    tiles after the previous head's) onto ``sms`` SMs, one CTA an SM; a CTA takes its next step
    when its head's query tile's turn counter equals its turn. Returns the number of time steps
    until every walk is done, or None on a deadlock."""
    def tile(n, i):
        return walk(n, m_count, n_count)[i] if rotate else i

    def turn(n, m):
        return rotated_turn(n, m, m_count, n_count) if rotate else n

    order = [(g, n) for g in range(heads) for n in range(n_count)]
    counter = {}  # (head, query tile) -> adds so far
    done_steps = dict.fromkeys(order, 0)
    launched, resident, t = 0, [], 0
    while True:
        while launched < len(order) and len(resident) < sms:
            resident.append(order[launched])
            launched += 1
        if not resident:
            return t
        moved = []
        for g, n in resident:
            m = tile(n, done_steps[(g, n)])
            if counter.get((g, m), 0) == turn(n, m):
                moved.append((g, n, m))
        if not moved:
            return None
        for g, n, m in moved:  # a step's add completes before the next time step reads one
            counter[(g, m)] = counter.get((g, m), 0) + 1
            done_steps[(g, n)] += 1
        resident = [k for k in resident if done_steps[k] < m_count]
        t += 1


@pytest.mark.parametrize("m_count,n_count", [(32, 32), (64, 32), (8, 32), (64, 64), (5, 7)])
def test_the_rotated_walks_finish_in_step_when_all_key_tiles_are_resident(m_count, n_count):
    plain = simulate(m_count, n_count, sms=n_count, rotate=False)
    rotated = simulate(m_count, n_count, sms=n_count)
    assert plain == m_count + n_count - 1  # the staircase
    # the least any order can take: M steps a walk, N adds a query tile, one add a time step
    assert rotated == max(m_count, n_count), (rotated, plain)


@pytest.mark.parametrize("m_count,n_count,sms", [(32, 32, 5), (16, 40, 33), (64, 64, 64)])
def test_no_deadlock_with_fewer_sms_than_heads_need_when_one_head_fits(m_count, n_count, sms):
    """Several heads in one grid (key tiles of head g launched after head g - 1's), SMs fewer
    than the grid but at least one head's key tiles: every walk finishes. A head larger than
    the GPU may block (the kernel then keeps the plain order)."""
    if sms >= n_count:
        assert simulate(m_count, n_count, sms, heads=3) is not None


def test_a_head_larger_than_the_gpu_can_block_so_the_kernel_keeps_the_plain_order_there():
    assert simulate(8, 40, sms=33) is None  # 40 key tiles on 33 SMs: the rotation can block
    assert simulate(8, 40, sms=33, rotate=False) is not None
    assert rotated_on(ROTATED_MAX_KEY_TILES) == 1 and rotated_on(ROTATED_MAX_KEY_TILES + 1) == 0
    assert rotated_on(1) == 1 and rotated_start(0, 4, 0) == 0  # a CTA with no key tile


@pytest.mark.parametrize("bad,match", [
    ({"deterministic": False}, "deterministic=True"),
    ({"dq_copies": 2}, "dq_copies=1"),
    ({"dq_first_store": True}, "dq_first_store"),
    ({"dq_rotated": 1}, "dq_rotated"),
])
def test_the_rotated_walk_refuses_what_it_is_not_built_for(bad, match):
    cfg = replace(HopperBwdConfig(tile_m=64, deterministic=True, dq_rotated=True), **bad)
    with pytest.raises(ValueError, match=match):
        cfg.check(128)


def test_no_default_rotates_before_a_gpu_has_timed_it():
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            for det in (False, True):
                assert not hopper_bwd_default(d, causal, det).dq_rotated


def rotated(head_dim, causal=False, on=True):
    """The candidate a GPU visit times (measure.bwd_phases' fa4_final_det_rotated at D = 64,
    _det_rotated64 at D = 128): the deterministic default with the rotated walk (``on``), or
    without it. tests/gpu/test_bwd_rotated_walk.py runs the same configs."""
    return replace(hopper_bwd_default(head_dim, causal, deterministic=True), dq_rotated=on)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,varlen", [(64, False), (128, False), (128, True)])
def test_rotated_walk_compiles_clean_beside_the_plain_walk(head_dim, varlen):
    """No spill (the producer warpgroup gets 40 registers, each MMA warpgroup 224:
    SM90_BWD_REGISTERS_ROTATED); the MMA code the plain walk's (same HGMMA, STS.128, LDS
    counts); the turn protocol unchanged; the walk's arithmetic added (integer divisions in the
    PTX). A causal build with dq_rotated keeps the plain walk (a mask window): no division
    added there."""
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    def build(causal, cfg):
        return compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                                 varlen=varlen and not causal))

    def divisions(art):
        return len(re.findall(r"\b(?:div|rem)\.(?:s|u)32", art.ptx))

    cfg = rotated(head_dim)
    main = build(False, cfg)
    plain = build(False, replace(cfg, dq_rotated=False))["main"]
    for art in main.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    for op in ("HGMMA", "STS.128", "LDS", "SYNCS"):
        assert main["main"].count(op, where="sass") == plain.count(op, where="sass"), op
    for op in ("ld.acquire.gpu", "red.release.gpu", "cp.reduce.async.bulk"):
        assert main["main"].count(op) == plain.count(op), op
    assert divisions(main["main"]) > divisions(plain)
    if not varlen:
        det = hopper_bwd_default(head_dim, True, True)
        causal = build(True, replace(det, dq_rotated=True))["main"]
        assert causal.spills == 0
        assert divisions(causal) == divisions(build(True, det)["main"])


def test_a_gpu_too_small_for_a_head_is_refused_by_name(monkeypatch):
    """A MIG slice of 16 SMs cannot hold 64 key tiles of a head: the rotated plan is refused
    before any launch, naming dq_rotated and the SM count; other plans are not looked at."""
    from types import SimpleNamespace

    from fa4_final.common.bwd_tiles import check_rotated_walk
    from fa4_final.hopper import host
    from fa4_final.runtime import dispatch

    check_rotated_walk(ROTATED_MAX_KEY_TILES)  # enough
    monkeypatch.setattr(host, "num_sms", lambda device: 16)
    with pytest.raises(ValueError, match=r"dq_rotated=True needs .* this one has 16"):
        dispatch._check_rotated(SimpleNamespace(config=rotated(128)), "cuda:0")
    dispatch._check_rotated(SimpleNamespace(config=replace(rotated(128), dq_rotated=False)),
                            "cuda:0")
    monkeypatch.setattr(host, "num_sms", lambda device: 132)
    dispatch._check_rotated(SimpleNamespace(config=rotated(128)), "cuda:0")
