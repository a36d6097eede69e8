"""Chapter 09's primer (solutions/ch09_primer.py) and its two device-code exercises, with no GPU:
the reference pieces pass their checkers (NumPy emulation against float64, the primer's
simulation), the simulation runs the reference roles clean and names each planted bug, and the
primer compiled for sm_100a with a piece inside shows in its PTX what the checkers read (with
the references: nothing wrong; with a planted mistake: the words that name it). Compiles are
marked slow: select with -k primer."""

import pytest

from solutions import ch09_pipeline as P
from solutions import ch09_primer as primer
from solutions import ch09_teaching as T
from solutions.ch09_pipeline import Op
from tests.exercise_mutations import ch09 as wrong


# --- emulation and simulation (fast) -----------------------------------------------------------
def test_primer_reference_pieces_pass_their_checkers_on_the_cpu():
    T.check_issue_qk(primer.issue_qk, compile_check=False)
    T.check_softmax_to_p(primer.softmax_to_p, compile_check=False)


def test_primer_softmax_emulation_is_the_float64_softmax():
    import numpy as np

    S = T.softmax_cases()
    c = 128**-0.5 * float(np.log2(np.e))
    P_, stats, calls = T.run_softmax_to_p(primer.softmax_to_p, S, c)
    want = np.exp2(c * (S - S.max(axis=1, keepdims=True)))
    assert np.allclose(P_, want, rtol=2**-8, atol=1e-6)
    assert [op.kind for op in calls[0]] == ["wait", "ld", "st", "wait_st", "arrive"]
    assert len({tuple(ops) for ops in calls}) == 1  # every thread makes the same calls


def test_primer_issue_emulation_overwrites_then_adds():
    import numpy as np

    Q, K, leftover = T.issue_cases(128)
    S, ops = T.run_issue_qk(primer.issue_qk, Q, K, leftover)
    assert np.allclose(S, Q @ K.T)
    gemms = [op for op in ops if op.kind == "gemm"]
    assert [op.accumulate for op in gemms] == [False] + [True] * 7
    assert ops[-1] == Op("commit", "s", count=1)


def test_primer_simulation_runs_the_reference_clean_one_cta_and_pair():
    P.primer_run({0: P.primer_mma_ops()}, {0: [(128, P.primer_softmax_ops())]})
    P.primer_run({0: P.primer_mma_ops(64)}, {0: [(128, P.primer_softmax_ops())]}, head_dim=64)
    ps = P.primer_softmax_ops(pair=True)
    softmax = {c: [(128, [Op(o.kind, o.bar, cta=c if o.kind == "wait" else o.cta,
                             what=o.what) for o in ps])] for c in (0, 1)}
    P.primer_run({0: P.primer_mma_ops(pair=True), 1: []}, softmax,
                 {c: P.primer_init_ops() for c in (0, 1)}, pair=True)


@pytest.mark.parametrize("ops, error, words", [
    ([Op("wait", "s"), Op("ld", what="S"), Op("st", what="P"), Op("arrive", "p"),
      Op("wait_st")], P.Overwrite, "MMA reads P in TMEM while"),
    ([Op("ld", what="S"), Op("st", what="P"), Op("wait_st"), Op("arrive", "p")], P.StaleRead,
     "the previous tile left"),
    ([Op("wait", "p"), Op("ld", what="S"), Op("st", what="P"), Op("wait_st"), Op("arrive", "p")],
     P.Deadlock, "waits for parity 0 on mbar_p"),
    ([Op("wait", "s"), Op("ld", what="S"), Op("st", what="P"), Op("wait_st"), Op("arrive", "s")],
     P.EarlyArrival, "arrivals on mbar_s"),
])
def test_primer_simulation_names_each_softmax_bug(ops, error, words):
    with pytest.raises(error, match=words):
        P.primer_run({0: P.primer_mma_ops()}, {0: [(128, ops)]})


def test_primer_simulation_names_a_commit_before_the_last_mma():
    ops = P.primer_mma_ops()
    early = ops[:2] + [Op("commit", "s")] + ops[2:9] + ops[10:]
    with pytest.raises(P.PipelineError, match="S in TMEM"):
        P.primer_run({0: early}, {0: [(128, P.primer_softmax_ops())]})


# --- compiled for sm_100a (slow) ---------------------------------------------------------------
@pytest.mark.slow
def test_primer_with_reference_pieces_shows_nothing_wrong_in_its_ptx():
    art = T.compile_with_pieces()
    assert T.softmax_ptx_problems(art.ptx) == []
    assert T.issue_ptx_problems(art.ptx, 128) == []
    assert art.spills == 0
    bars = T.barrier_registers(art.ptx)
    assert set(bars) == {"load", "s", "p", "o"} and len(set(bars.values())) == 4


@pytest.mark.slow
def test_primer_ptx_check_names_an_arrive_before_the_wait_st():
    art = T.compile_with_pieces(softmax_fn=wrong.softmax_arrives_before_fence)
    assert any("before tcgen05.wait::st" in p for p in T.softmax_ptx_problems(art.ptx))


@pytest.mark.slow
def test_primer_ptx_check_names_the_wrong_barrier_and_parity():
    art = T.compile_with_pieces(softmax_fn=wrong.softmax_arrives_on_s)
    assert any("not on mbar_p" in p for p in T.softmax_ptx_problems(art.ptx))
    art = T.compile_with_pieces(softmax_fn=wrong.softmax_wrong_parity)
    assert any("parity 1" in p for p in T.softmax_ptx_problems(art.ptx))


@pytest.mark.slow
def test_primer_ptx_check_names_a_commit_ahead_of_the_mmas():
    art = T.compile_with_pieces(issue_qk_fn=wrong.issue_commits_first)
    assert any("before the first commit" in p for p in T.issue_ptx_problems(art.ptx, 128))
    art = T.compile_with_pieces(issue_qk_fn=wrong.issue_whole_warp_commits)
    assert any("elected" in p for p in T.issue_ptx_problems(art.ptx, 128))


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
def test_primer_compiles_for_both_head_dims(head_dim):
    _, art = primer.compile_one_tile(head_dim)
    assert art.count("tcgen05.mma") == head_dim // 16 + 128 // 16
    assert art.spills == 0
