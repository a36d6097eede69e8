"""Chapter 10's pair primer (solutions/ch09_primer.py: PairTileAttention) and its exercises, with
no GPU: the reference pieces pass their checkers, the references of 10.1 and 10.2 agree with
chapter 09's model, and the pair primer compiled for sm_100a shows in its PTX what the checkers
read (with the references: nothing wrong; with planted mistakes: the words that name them).
Compiles are marked slow: select with -k pair."""

import math

import pytest

from solutions import ch09_model
from solutions import ch09_primer as primer
from solutions import ch10_teaching as T10
from tests.exercise_mutations import ch10 as wrong


def test_pair_reference_pieces_pass_their_checkers_on_the_cpu():
    T10.check_pair_mma(primer.pair_mma, compile_check=False)
    T10.check_init_pair_barriers(primer.init_pair_barriers, compile_check=False)
    T10.check_smem_cycles_per_step(T10.smem_cycles_per_step)
    T10.check_schedule_efficiency(T10.schedule_efficiency)


def test_pair_mma_emulation_issues_in_the_leader_only():
    calls = T10.run_pair_mma(primer.pair_mma)
    assert not calls[1]
    assert [op.kind for op in calls[0]].count("gemm") == 128 // 16 + 128 // 16
    assert {op.mask for op in calls[0] if op.kind == "commit"} == {0b11}


def test_pair_schedule_efficiency_is_wave_quantisation_non_causal():
    for seqlen, heads, batch in T10.EFFICIENCY_CASES:
        for two in (False, True):
            units = 148 // (2 if two else 1)
            tiles = seqlen // (256 * (2 if two else 1)) * heads * batch
            want = tiles / (units * math.ceil(tiles / units))
            got = ch09_model.schedule(seqlen, heads, batch, False, two)["efficiency"]
            assert math.isclose(got, want), (seqlen, heads, batch, two)


@pytest.mark.slow
def test_pair_primer_with_reference_pieces_shows_nothing_wrong_in_its_ptx():
    art = T10.compile_pair_with()
    assert T10.pair_mma_ptx_problems(art.ptx, 128) == []
    assert T10.init_ptx_problems(art.ptx) == []
    assert art.spills == 0
    art.require("tcgen05.alloc.cta_group::2", "tcgen05.dealloc.cta_group::2", "mapa",
                "barrier.cluster.arrive", "barrier.cluster.wait")


@pytest.mark.slow
def test_pair_ptx_check_names_an_issue_without_the_rank_test():
    art = T10.compile_pair_with(mma_fn=wrong.pair_both_issue)
    assert any("no branch on the CTA's rank" in p
               for p in T10.pair_mma_ptx_problems(art.ptx, 128))


@pytest.mark.slow
def test_pair_ptx_check_names_a_commit_without_multicast():
    art = T10.compile_pair_with(mma_fn=wrong.pair_commit_no_mask)
    assert any("not cta_group::2 multicast" in p
               for p in T10.pair_mma_ptx_problems(art.ptx, 128))


@pytest.mark.slow
def test_pair_ptx_check_names_missing_fence_and_wrong_counts():
    art = T10.compile_pair_with(init_fn=wrong.init_without_fence)
    assert any("no fence.mbarrier_init" in p for p in T10.init_ptx_problems(art.ptx))
    art = T10.compile_pair_with(init_fn=wrong.init_p_counts_one_cta)
    assert any("mbar_p initialised ['128']" in p for p in T10.init_ptx_problems(art.ptx))
