"""Chapter 11's device-code exercises on a CPU: 11.5 the pointwise step (solutions/ch11_ds_step.py)
and 11.6 the deterministic turn (solutions/ch11_turns.py). The references pass their checkers,
the emulation's fragment layout is CuTe's, the simulator finds a launch-order deadlock, and
the course subclasses compile into fa4_final's Hopper backward (with the references, the
unmasked step is the kernel's own). The planted mistakes are in tests/exercise_mutations/ch11.py."""

import os
import subprocess
import sys
from pathlib import Path

import cutlass
import pytest

from solutions import ch11_ds_step as ds
from solutions import ch11_teaching as ch11t
from solutions import ch11_turns as turns

ROOT = Path(__file__).resolve().parent.parent


def test_fragment_layout_is_cutes_wgmma_accumulator():
    code = ("from solutions.ch11_ds_step import fragment_layout_mismatches\n"
            "print('bad', len(fragment_layout_mismatches()))\n")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "bad 0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_ds_step_reference_passes_on_the_cpu():
    ds.check_ds_step_rules(ds.ds_step)


def test_step_cases_cover_the_masks():
    cases = ds.step_cases()
    assert any(not c.masked for c in cases)
    assert any(c.masked and not c.causal for c in cases)  # keys past seqlen_k only
    assert any((~c.visible()).all(axis=0).any() for c in cases if c.causal)  # queries see none
    assert any(c.seqlen_q != c.seqlen_k for c in cases)


@pytest.mark.slow
def test_ds_step_reference_compiles_to_the_kernels_unmasked_step():
    from fa4_final.hopper.bwd import HopperBackward
    from fa4_final.hopper.config import hopper_bwd_default

    ds.check_ds_step(ds.ds_step)
    cfg = hopper_bwd_default(128, True)
    sass = ds.compile_ds_step(ds.ds_step).sass
    ours = ds.step_facts(sass, cfg, 128)
    own = ds.compile_for(HopperBackward(cutlass.BFloat16, 128, True, cfg), "main", 128,
                         "sm_90a")[1]
    theirs = ds.step_facts(own.sass, cfg, 128)

    def work(mix):  # the step's floating point, GEMMs, shared memory and synchronisation; the
        # integer and predicate bookkeeping around the loop's branch moves with ptxas' schedule
        return {op: n for op, n in mix.items() if op.startswith(
            ("F", "MUFU", "HGMMA", "LDS", "STS", "BAR", "SYNCS", "WARPGROUP"))}

    assert work(ours[1]) == work(theirs[1])  # the unmasked step
    assert ours[0]["FSEL"] == theirs[0]["FSEL"]
    # the stages are released as the kernel's pipelines count them (EMPTY's arrivals: every
    # MMA thread under release_every_thread), else a GPU run would wait for ever
    from tests.test_fa4_final_bwd_compile import mbarrier_arrives

    assert mbarrier_arrives(sass) == mbarrier_arrives(own.sass)


def test_turn_reference_passes_in_the_simulator():
    turns.check_turn_rules(turns.add_in_turn)


def test_turns_against_launch_order_deadlock_and_say_why():
    grid = turns.TurnGrid(512, 512, causal=True, turns="reversed")
    with pytest.raises(turns.Deadlock, match="never launched"):
        turns.TurnSim(turns.add_in_turn, grid, sms=2).run()
    # with an SM for every CTA nobody waits for an unlaunched CTA: it finishes, out of order
    # of the kernel's turns but in its own
    turns.TurnSim(turns.add_in_turn, grid, sms=grid.n_blocks).run()


@pytest.mark.slow
def test_turn_reference_compiles_with_the_kernels_ptx():
    turns.check_add_in_turn(turns.add_in_turn)


@pytest.mark.slow
def test_the_gpu_runner_builds_its_three_kernels():
    run = ds.ExerciseBackward(lambda dt, d, causal, cfg: ds.HopperDsStep(ds.ds_step, dt, d,
                                                                         causal, cfg))
    cfg, kernels = run.plan(cutlass.BFloat16, 64, True)
    assert sorted(kernels) == ["main", "post", "pre"] and cfg.tile_m == 128


def test_stored_benchmark_reading():
    res = ch11t.stored_results("ch11_bwd")
    lines = ch11t.verdict_lines(res)
    assert len(lines) == 4 and all("deterministic / default" in ln for ln in lines)
    assert 0.5 < ch11t.deterministic_ratio(res, 4096, False) < 1.0
