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
    from fa4_final.api.sm100 import compile_only
    from fa4_final.blackwell.config import BlackwellFwdConfig

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


# ----------------------------------------------------------------------------------------------
# the backward step (chapter 12)


def test_bwd_model_builds_on_chapter_00s_backward_tile():
    tile = roofline.tile_cycles("B200", "bwd", 128, 128, 128)
    step = M.bwd_step_cycles(128)
    assert step.mma == tile.mma == 5 * 512  # five GEMMs of 2 * 128^3 FLOPs
    assert step.mufu == tile.exp == 1024
    extra = dict(step.smem_items)
    # what this kernel adds to chapter 00's traffic: dS^T read by dK from smem, lse/delta reads
    assert step.smem * 128 == tile.smem * 128 + extra["dK += dS^T Q: read A = dS^T"] + \
        extra["lse, delta broadcasts (wavefronts x 128 B)"]
    assert step.limit == "smem" and step.mma_fraction < 1
    assert all(r["label"] == "model" for r in step.table())


def test_bwd_model_2cta_halves_the_global_adds_and_the_b_operands():
    one, two = M.bwd_step_cycles(128), M.bwd_step_cycles(128, two_cta=True)
    assert two.reduce_bytes == one.reduce_bytes / 2 == 128 * 128 * 4 / 2
    assert two.smem < one.smem and two.mma == one.mma
    assert "dS half from the peer CTA (DSMEM write)" in dict(two.smem_items)
    assert two.mma_fraction > one.mma_fraction
    # FA4's packed FP32 issues fewer compute-warp instructions for the same lane operations
    fa4 = M.bwd_step_cycles(128, mix=M.FA4_BWD_MIX)
    assert fa4.issue < one.issue and fa4.fp32 == one.fp32


@pytest.mark.parametrize("d", [64, 128])
def test_bwd_model_2cta_is_the_pair_kernel_as_built(d):
    """The 2-CTA row reads the pair kernel's own figures: the exchange is one warpgroup's dS
    (bwd_pair.DS_EXCHANGE_BYTES), dQ's B is Kt (D/2 x 256 keys, as big as 1-CTA's K), dK's A
    comes from TMEM, each CTA adds 64 x D floats of dQ (the compiled D/32 bulk adds of 8 KB)."""
    from fa4_final.blackwell.bwd_pair import DS_EXCHANGE_BYTES
    from fa4_final.blackwell.config import BlackwellBwdConfig

    one, two = M.bwd_step_cycles(d), M.bwd_step_cycles(d, two_cta=True)
    items, items1 = dict(two.smem_items), dict(one.smem_items)
    assert two.dsmem_bytes == DS_EXCHANGE_BYTES == items["dS half from the peer CTA (DSMEM write)"]
    assert items["dS store, own queries (A operand of dQ)"] == DS_EXCHANGE_BYTES
    assert items["dQ = dS K: read B = Kt (D/2 x 256 keys)"] == d // 2 * 256 * 2 == \
        items1["dQ = dS K: read B = K"]
    assert not any(w.startswith("dK += dS^T Q: read A") for w in items)
    assert two.reduce_bytes == (d // 32) * 8192 == 64 * d * 4
    assert BlackwellBwdConfig(two_cta=True).tmem_plan(d)["dS"].alias_of == "dP"
    assert two.smem < one.smem and "dS exchange into the peer (DSMEM)" in \
        {r["resource"] for r in two.table()}


def test_bwd_model_mix_is_the_compiled_compute_warps():
    """BwdMix against the stored compile (results/compile/sm100_bwd_vs_fa4.json, which
    test_blackwell_bwd_compile regenerates): two step copies of 64 scores a thread, plus the
    dK / dV epilogue (D/2 values each: a scale for dK, a 16-bit pack for both)."""
    t = ch09_compare.load_bwd_table()
    for impl, mix, copies in (("fa4_final", M.BWD_MIX, 2), ("fa4", M.FA4_BWD_MIX, 1)):
        for c in ch09_compare.BWD_CONFIGS:
            if impl == "fa4_final" and not c["ours"] or c["two_cta"]:
                continue
            got = {r["metric"].split(": ", 1)[1]: r["value"]
                   for r in t.where(impl=impl, config=c["config"])
                   if r["metric"].startswith("compute: ")}
            per, n, half_d = mix.per_score(), copies * 64, c["d"] // 2
            assert got["MUFU.EX2"] == n * per["mufu"]
            assert got["F2FP (fp32 -> 16-bit pairs)"] == n * per["f2fp"] + half_d  # 2 x D/4
            if mix.packed:
                assert got["FFMA2"] == n * per["ffma2"] and got["FADD2"] == n * per["fadd2"]
                assert got["FMUL2"] == n * per["fmul2"] + half_d // 2
            else:
                assert got["FFMA (scalar)"] == n * per["ffma"]
                assert got["FADD (scalar)"] == n * per["fadd"]
                assert got["FMUL (scalar)"] == n * per["fmul"] + half_d
                assert got["FSEL"] == n * per["fsel"]
                assert got["STS (shared store)"] == n * per["sts"]
                assert got["LDTM (tcgen05.ld)"] == n * per["ldtm"] + 2
                assert got["STTM (tcgen05.st)"] == n * per["sttm"]
                assert abs(got["LDS (shared load)"] - n * per["lds"]) <= 1
