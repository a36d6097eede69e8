"""Chapter 12's exercises and helpers on a CPU (solutions/ch12_blackwell_bwd.py): the references
pass their checkers; compiled for sm_100a with the references, the kernels are fa4_final's own
(the same SASS, the kernel's name aside); the pair simulator catches a broken exchange; the
notebook's tables read what they say. Planted mistakes: tests/exercise_mutations/ch12.py."""

import cutlass
import pytest

from fa4_final.blackwell.bwd import BlackwellBackward
from fa4_final.blackwell.bwd_pair import DS_EXCHANGE_BYTES, BlackwellBackwardPair
from fa4_final.blackwell.config import BlackwellBwdConfig
from fa4_final.common import register_plan as rp
from solutions import ch11_ds_step as ds
from solutions import ch11_teaching as ch11t
from solutions import ch12_blackwell_bwd as c12
from utils import results


def _instructions(sass: str) -> list[str]:
    """SASS instructions with the kernel's own name (in its RET targets) taken out."""
    return [i.split("`")[0] for i in ch11t.sass_instructions(sass)]


def test_own_dq_plan_fits_at_d64_only():
    c12.check_own_dq_plan(c12.own_dq_plan)
    assert c12.own_dq_plan(64).columns_used == 448
    with pytest.raises(ValueError):
        c12.own_dq_plan(128)


def test_split_reference_is_the_kernels_plan():
    assert c12.check_split_rules(c12.split_registers) == c12.kernel_plan()
    assert not rp.problems(c12.kernel_plan(), c12.THREADS)


@pytest.mark.slow
def test_split_reference_compiles_to_the_kernel_itself():
    ours = c12.compile_with_split(c12.split_registers)
    own = ds.compile_for(BlackwellBackward(cutlass.BFloat16, 128, False, BlackwellBwdConfig()),
                         "main", 128, "sm_100a")[1]
    assert ours.spills == 0
    assert _instructions(ours.sass) == _instructions(own.sass)


def test_send_reference_passes_and_the_exchange_simulates_clean():
    c12.check_send_rules(c12.send_ds)
    assert c12.simulate_exchange(c12.Exchange()) is None
    assert "Deadlock" in c12.simulate_exchange(c12.Exchange(land_bytes=DS_EXCHANGE_BYTES // 2))
    assert "EarlyArrival" in c12.simulate_exchange(c12.Exchange(arrivals=128))


@pytest.mark.slow
def test_send_reference_compiles_to_the_pair_kernel_itself():
    c12.check_send_ds(c12.send_ds)
    ours = c12.compile_exchange(c12.send_ds)
    own = ds.compile_for(BlackwellBackwardPair(cutlass.BFloat16, 128, False,
                                               BlackwellBwdConfig(two_cta=True)),
                         "main", 128, "sm_100a")[1]
    assert _instructions(ours.sass) == _instructions(own.sass)


def test_step_gemms_count_the_kernels_mmas():
    bw = BlackwellBackward(cutlass.BFloat16, 128, False, BlackwellBwdConfig())
    gemms = c12.step_gemms(bw)
    assert [g["tcgen05.mma"] for g in gemms] == [8] * 5
    assert [g["A"] for g in gemms].count("P^T (TMEM)") == 1


def test_probe_names_match_the_stored_counts():
    counts = c12.probe_counts(results.load("gpu_checks", gpu="h200"))
    names = c12.probe_tests()
    assert counts["passed"] + counts.get("skipped", 0) == len(names)
    assert any("ds_exchange" in n for n in names)


def test_backward_rules_include_the_sub_partition_rule():
    rules = c12.backward_rules()
    assert any("sub-partition" in r.rule for r in rules)
    assert any("dS exchange" in r.rule for r in rules)
