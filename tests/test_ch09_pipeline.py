"""Chapter 09: the Blackwell forward's pipelines simulated on the CPU with the kernel's own stage
counts, arrival counts and phase rules: no deadlock, no buffer overwritten while read, no stale
read, no early arrival, over many tiles, causal and not, 1- and 2-CTA; and each deliberate bug
is caught."""

from dataclasses import replace

import pytest

from fa4_final.blackwell.config import BlackwellFwdConfig
from solutions import ch09_pipeline as P

PROBLEMS = [
    # (seqlen_q, seqlen_k, heads, grid, which CTA): lengths that are not tile multiples, more
    # tiles than CTAs (persistent), seqlen_q > seqlen_k (causal tiles that see no key)
    (1000, 1000, 2, 1, 0), (777, 2049, 3, 2, 1), (3000, 300, 1, 1, 0), (129, 129, 1, 1, 0),
    (512, 4096, 2, 3, 2), (2048, 2048, 4, 3, 0),
]


def problems(causal, **window):
    return [P.Problem(sq, sk, heads=h, causal=causal, grid=g, cluster=c, **window)
            for sq, sk, h, g, c in PROBLEMS]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_blackwell_pipeline_sim_runs_clean_1cta(head_dim, causal):
    k = P.make_kernel(head_dim, causal)
    out = P.sweep(k, problems(causal), seeds=range(3))
    assert not out.failures, out.failures[0]
    assert out.tiles > 30 and out.kv_steps > 200


@pytest.mark.parametrize("causal", [False, True])
def test_2cta_pipeline_sim_runs_clean(causal):
    k = P.make_kernel(128, causal, BlackwellFwdConfig(two_cta=True))
    out = P.sweep(k, problems(causal), seeds=range(3))
    assert not out.failures, out.failures[0]


def test_blackwell_pipeline_sim_sliding_window():
    k = P.make_kernel(128, False, has_window_left=True, has_window_right=True)
    out = P.sweep(k, problems(False, window_left=300, window_right=50), seeds=range(3))
    assert not out.failures, out.failures[0]
    assert out.kv_steps > 0


def test_blackwell_pipeline_sim_uses_the_kernels_own_tables():
    k = P.make_kernel(128, True)
    fs = P.ForwardSim(k, P.Problem(600, 600, causal=True))
    specs = {p.name: p for p in k.pipelines()}
    assert fs.specs == specs
    assert specs["kv"].stages == k.cfg.ring_depth(128) == k.kv_stages
    # every barrier the simulator made has the kernel's arrival count
    for (_, name, side, _), bar in fs.bar.items():
        want = specs[name].full_arrivals if side == "full" else specs[name].empty_arrivals
        assert bar.arrivals == want
    # s EMPTY: both warpgroups that release it (softmax_i, correction), every CTA of a pair
    two = P.make_kernel(128, False, BlackwellFwdConfig(two_cta=True))
    assert {p.name: p for p in two.pipelines()}["s"].empty_arrivals == 2 * 2 * 128


@pytest.mark.parametrize("bug", sorted(P.ForwardSim.BUGS))
def test_blackwell_pipeline_sim_catches_each_bug(bug):
    k = P.make_kernel(128, True)
    caught = 0
    for s in range(4):
        try:
            P.ForwardSim(k, P.Problem(1000, 1000, heads=2, causal=True), seed=s, mutate=bug).run()
        except P.PipelineError:
            caught += 1
    assert caught == 4, f"{P.ForwardSim.BUGS[bug]}: caught in {caught} of 4 runs"


def test_blackwell_pipeline_phase_bits_follow_pipeline_state():
    st = P.PipelineState.producer(3)
    seen = []
    for _ in range(7):
        seen.append((st.index, st.phase))
        st.advance()
    assert seen == [(0, 1), (1, 1), (2, 1), (0, 0), (1, 0), (2, 0), (0, 1)]
    # a fresh barrier: waiting for parity 1 passes, parity 0 waits for the first phase
    sim = P.Sim()
    b = P.Barrier("b", 2, sim)
    assert b.ready(1) and not b.ready(0)
    b.arrive("x")
    with pytest.raises(P.EarlyArrival):
        b.arrive("x")  # x's second arrival belongs to phase 1; phase 0 still waits for y


def test_blackwell_pipeline_sim_ring_of_two_is_enough_but_not_one():
    k = P.make_kernel(128, False, BlackwellFwdConfig(kv_stages=2))
    assert not P.sweep(k, problems(False)[:3], seeds=range(2)).failures
    with pytest.raises(ValueError, match="kv_stages"):
        replace(BlackwellFwdConfig(), kv_stages=1).check(128)


# ----------------------------------------------------------------------------------------------
# the backward (fa4_final.blackwell.bwd): one CTA per key tile, every key tile of a problem

BWD_PROBLEMS = [
    # (seqlen_q, seqlen_k, heads, heads_kv): not tile multiples, GQA (steps = tiles x group),
    # seqlen_q > seqlen_k and <
    (1000, 1000, 2, 1), (700, 1500, 4, 2), (3000, 300, 1, 1), (129, 129, 1, 1),
]


def bwd_problems(causal, **window):
    return [P.BwdProblem(sq, sk, heads=h, heads_kv=hk, causal=causal, **window)
            for sq, sk, h, hk in BWD_PROBLEMS]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_blackwell_bwd_pipeline_sim_runs_clean(head_dim, causal):
    k = P.make_bwd_kernel(head_dim, causal)
    out = P.bwd_sweep(k, bwd_problems(causal), seeds=range(3))
    assert not out.failures, out.failures[0]
    assert out.tiles > 40 and out.kv_steps > 300
    steps = {P.bwd_steps(k, cta) for prob in bwd_problems(causal) for cta in P.bwd_problems(prob)}
    assert len(steps) > (6 if causal else 3)  # causal: step counts vary with the key tile


def test_blackwell_bwd_pipeline_sim_window_and_deterministic_config():
    k = P.make_bwd_kernel(64, False, has_window_left=True, has_window_right=True)
    probs = bwd_problems(False, window_left=300, window_right=50)
    out = P.bwd_sweep(k, probs, seeds=range(2))
    assert not out.failures, out.failures[0]
    # key tiles no query sees (zero steps: no MMA, zero dK and dV) are among them
    assert 0 in {P.bwd_steps(k, cta) for prob in probs for cta in P.bwd_problems(prob)}
    from fa4_final.blackwell.config import BlackwellBwdConfig

    for cfg in (BlackwellBwdConfig(q_stages=1), BlackwellBwdConfig(deterministic=True)):
        out = P.bwd_sweep(P.make_bwd_kernel(128, True, cfg), bwd_problems(True)[:2],
                          seeds=range(2))
        assert not out.failures, (cfg, out.failures[0])


def test_blackwell_bwd_pipeline_sim_uses_the_kernels_own_tables():
    from fa4_final.blackwell.bwd import GROUP_THREADS, NamedBarrier

    k = P.make_bwd_kernel(128, False)
    bs = P.BackwardSim(k, P.BwdProblem(600, 600))
    specs = {p.name: p for p in k.pipelines()}
    assert bs.specs == specs
    assert specs["q"].stages == k.cfg.q_depth(128) and specs["do"].stages == k.cfg.do_depth(128)
    for (name, side, _), bar in bs.bar.items():
        want = specs[name].full_arrivals if side == "full" else specs[name].empty_arrivals
        assert bar.arrivals == want
    assert specs["s"].empty_arrivals == specs["dp"].empty_arrivals == 2 * GROUP_THREADS
    assert bs.compute_sync.arrivals == 2 * GROUP_THREADS and NamedBarrier.COMPUTE
    # TMEM from the plan: warpgroup 0 stores P^T onto S^T columns warpgroup 1 loads
    assert bs.p_units[0] in bs.s_read[1] and bs.p_units[1] in bs.s_read[1]
    assert bs.unit * len([b for b in bs.buf if b[0] == "S"]) == k.plan["S"].columns


@pytest.mark.parametrize("bug", sorted(P.BackwardSim.BUGS))
def test_blackwell_bwd_pipeline_sim_catches_each_bug(bug):
    k = P.make_bwd_kernel(128, True)
    caught = 0
    for s in range(4):
        try:
            P.BackwardSim(k, P.BwdProblem(2000, 2000, heads=2, causal=True), seed=s,
                          mutate=bug).run()
        except P.PipelineError:
            caught += 1
    if bug in P.BackwardSim.REDUNDANT:  # a second guarantee of what in-order MMAs already give
        assert caught == 0
    else:
        assert caught == 4, f"{P.BackwardSim.BUGS[bug]}: caught in {caught} of 4 runs"


# the 2-CTA backward (fa4_final.blackwell.bwd_pair): both CTAs of a pair, every pair of a problem

def pair_kernel(head_dim=128, causal=False, **window):
    from fa4_final.blackwell.config import BlackwellBwdConfig

    return P.make_bwd_kernel(head_dim, causal, BlackwellBwdConfig(two_cta=True), **window)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_blackwell_bwd_pair_pipeline_sim_runs_clean(head_dim, causal):
    k = pair_kernel(head_dim, causal)
    out = P.bwd_sweep(k, bwd_problems(causal), seeds=range(3))
    assert not out.failures, out.failures[0]
    assert out.tiles > 30 and out.kv_steps > 300
    pairs = [cta for prob in bwd_problems(causal) for cta in P.bwd_problems(prob, 256)]
    steps = {P.bwd_steps(k, cta) for cta in pairs}
    assert len(steps) > (5 if causal else 3)  # causal: step counts vary with the key pair
    # each CTA adds half of the 1-CTA kernel's dQ: D/2 columns of its 64 queries, 8 KB blocks
    bs = P.PairBackwardSim(k, P.BwdProblem(1000, 1000, heads=2)).run()
    one = P.BackwardSim(P.make_bwd_kernel(head_dim, causal), P.BwdProblem(1000, 1000, heads=2))
    assert bs.bulk_adds == [bs.steps * head_dim // 32] * 2
    assert 2 * bs.dq_chunks == one.dq_chunks


def test_blackwell_bwd_pair_pipeline_sim_window_and_tables():
    k = pair_kernel(64, False, has_window_left=True, has_window_right=True)
    probs = bwd_problems(False, window_left=300, window_right=50)
    out = P.bwd_sweep(k, probs, seeds=range(2))
    assert not out.failures, out.failures[0]
    assert 0 in {P.bwd_steps(k, cta) for prob in probs for cta in P.bwd_problems(prob, 256)}
    k = pair_kernel(128, True)
    bs = P.PairBackwardSim(k, P.BwdProblem(600, 600))
    specs = {p.name: p for p in k.pipelines()}
    assert bs.specs == specs and k.window.tile_n == 256
    for (_, name, side, _), bar in bs.bar.items():
        want = specs[name].full_arrivals if side == "full" else specs[name].empty_arrivals
        assert bar.arrivals == want
    # the leader's EMPTY barriers count both CTAs' warps; tma FULL barriers live in the leader
    assert specs["s"].empty_arrivals == specs["dp"].empty_arrivals == 16
    assert specs["dq"].empty_arrivals == 8 and specs["rows"].empty_arrivals == 8
    assert bs.full("q", 1) is bs.bar[0, "q", "full", 0] and bs.full("s", 1) is not bs.full("s", 0)
    # TMEM from the plan: dS^T (dK's A) over dP^T's upper units, dQ over its lower ones
    assert set(bs.ds_unit.values()).isdisjoint(bs.dq_units)
    assert bs.ds_unit[0] in bs.read_units[1]  # why the second bar.sync COMPUTE is needed


@pytest.mark.parametrize("bug", sorted(P.PairBackwardSim.BUGS))
def test_blackwell_bwd_pair_pipeline_sim_catches_each_bug(bug):
    k = pair_kernel(128, True)
    caught = 0
    for s in range(4):
        try:
            P.PairBackwardSim(k, P.BwdProblem(2000, 2000, heads=2, causal=True, n_block=3),
                              seed=s, mutate=bug).run()
        except P.PipelineError:
            caught += 1
    if bug in P.PairBackwardSim.REDUNDANT:
        assert caught == 0
    else:
        assert caught == 4, f"{P.PairBackwardSim.BUGS[bug]}: caught in {caught} of 4 runs"
