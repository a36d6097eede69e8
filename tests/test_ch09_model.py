"""Chapters 09-10's cycle model: its figures against the paper's statements and chapter 00's
tile model, and its instruction mix against the compiled sm_100a SASS of the forward."""

import math
from fractions import Fraction

import pytest

from solutions import ch09_compare
from solutions import ch09_model as M
from utils import roofline


def test_model_reproduces_chapter_00s_blackwell_tile():
    tile = roofline.tile_cycles("B200", "fwd", 128, 128, 128)
    step = M.step_cycles(128, False, 0.0, 0.0)
    # one KV step of one CTA is two of chapter 00's tiles (two Q tiles against one K/V tile)
    assert step.mma == 2 * tile.mma == 2048
    assert math.isclose(step.mufu, 2 * tile.exp + 2 * 128 / 16)  # + one alpha per row
    assert step.smem == 2 * tile.smem


def test_model_agrees_with_the_papers_statements():
    for check in M.paper_checks(128):
        assert check["agrees"], check


def test_model_emulation_window_contains_paper_and_fa4_choices():
    win = M.emulation_window(128)
    assert win["binding_at_0"] == ("mufu",)  # without emulation the exp unit binds (barely)
    lo, hi = M.PAPER["emulated share of a row"]
    assert win["f_min"] <= lo < hi <= win["f_max"]
    for share in M.FA4_EMULATED_SHARE.values():
        assert win["f_min"] <= share <= win["f_max"]
        assert M.step_cycles(128, False, float(share), 0.0).binding == ("mma",)


def test_model_d64_stays_exp_bound():
    # D = 64 halves the MMA but not the exponentials: no share makes MUFU and the FMA pipe
    # both fit under the MMA (the model's statement, not a measurement)
    assert M.emulation_window(64)["f_min"] is None
    assert M.step_cycles(64, False, 0.125, 0.0).binding == ("mufu",)


def test_model_conditional_rescaling_cuts_tmem_traffic_and_issue():
    always = M.step_cycles(128, False, 0.125, 1.0)
    never = M.step_cycles(128, False, 0.125, 0.0)
    assert never.tmem_bytes < always.tmem_bytes / 2
    assert never.issue < always.issue and never.fp32 < always.fp32
    shares = M.rescale_shares(seqlen_k=2048)
    assert shares["tau=8"] < 0.05 < 0.5 < shares["tau=0 (every growth)"]


def test_2cta_model_halves_smem_and_loses_on_short_causal():
    for d in (64, 128):
        s = M.smem_per_step(d)
        assert s["smem 2-CTA"] == pytest.approx(s["smem 1-CTA"] * 2 / 3)  # B halves, A stays
    assert M.pair_verdict(1024, 128, causal=True)["verdict"] == "loses"
    for s in (1024, 16384):
        assert M.pair_verdict(s, 128, causal=False)["verdict"] == "ties"


@pytest.mark.slow
def test_model_instruction_mix_matches_the_compiled_sass():
    """Each softmax step copy in the compiled kernel (3 at causal D = 128: the first step, the
    masked loop, the unmasked loop) holds what InstructionMix says, per class."""
    from fa4_final.blackwell.config import BlackwellFwdConfig
    from fa4_final.blackwell.fwd import compile_only

    copies, cols = 3, 128
    for f in (Fraction(0), Fraction(1, 4)):
        art = compile_only(128, "bf16", True, BlackwellFwdConfig(exp2_emulation_fraction=float(f)))
        got = ch09_compare.sass_by_role(art.sass)["softmax"]
        per = M.MIX.per_score(float(f))
        # MUFU: the exponentials left on it, plus one alpha in every copy but the first
        assert got["MUFU.EX2"] == copies * round(per["mufu"] * cols) + copies - 1
        assert got["FFMA2"] == copies * round(per["ffma2"] * cols)
        assert got["F2FP (fp32 -> 16-bit pairs)"] == copies * round(per["f2fp"] * cols)
        assert got["LDTM (tcgen05.ld)"] == copies * round(per["ldtm"] * cols)
        assert got["STTM (tcgen05.st)"] == copies * round(per["sttm"] * cols)
        assert got["FADD2"] == pytest.approx(copies * per["fadd2"] * cols, rel=0.03)
        assert got["FMNMX (2- and 3-input)"] == pytest.approx(copies * per["fmnmx"] * cols,
                                                               rel=0.06)
