"""The cycle model must reproduce the FA4 paper's figures from its operand bookkeeping."""

import ast
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from utils import roofline  # noqa: E402
from utils.roofline import tile_cycles, what_if  # noqa: E402

TILE_BYTES = 128 * 128 * 2  # one 128 x 128 bf16 tile


def test_forward_paper_figures():
    b200 = tile_cycles("B200", "fwd", 128, 128, 128)
    assert (b200.mma, b200.exp, b200.smem) == (1024, 1024, 768)
    assert tile_cycles("H100", "fwd", 128, 128, 128).mma == 2048
    assert tile_cycles("H200", "fwd").mma == 2048  # same SM as H100


def test_backward_paper_figures():
    one = tile_cycles("B200", "bwd", 128, 128, 128)
    assert (one.mma, one.smem) == (2560, 3328)
    assert one.binding == ("smem",)
    two = tile_cycles("B200", "bwd", 256, 128, 128, ctas=2)
    assert (two.mma, two.smem) == (2560, 2688)


def test_figures_fall_out_of_the_operand_list():
    """768 = Q + K + V read by the MMAs; P comes from TMEM. 3328 = 13 tiles."""
    fwd = tile_cycles("B200", "fwd")
    assert [b / TILE_BYTES for _, b in fwd.traffic] == [1, 1, 1]
    assert not any("read A = P" in what for what, _ in fwd.traffic)
    bwd = tile_cycles("B200", "bwd")
    assert sum(b for _, b in bwd.traffic) == 13 * TILE_BYTES
    reads_from_tmem = [mm.a for mm in roofline.tile_matmuls("bwd", 128, 128, 128) if mm.a_on_chip]
    assert reads_from_tmem == ["P^T", "dS^T"]
    # 2-CTA halves exactly the five B operands: 2.5 tiles.
    two = tile_cycles("B200", "bwd", 256, ctas=2)
    saved = sum(b for _, b in bwd.traffic) - sum(b for _, b in two.traffic)
    assert saved == 2.5 * TILE_BYTES


def test_hopper_reads_b_once_per_warpgroup():
    """wgmma is M=64 per warpgroup: a 128-row tile reads K and V twice; P sits in registers."""
    h100 = tile_cycles("H100", "fwd")
    assert h100.smem == (1 + 2 + 2) * TILE_BYTES / 128
    assert h100.binding == ("mma",)
    with pytest.raises(ValueError, match="2-CTA"):
        tile_cycles("H100", "fwd", 256, ctas=2)


@pytest.mark.parametrize("d, mma, smem, binding", [
    (64, 512, 384, ("exp",)),
    (128, 1024, 768, ("mma", "exp")),
    (256, 2048, 1536, ("mma",)),
])
def test_head_dims_on_b200(d, mma, smem, binding):
    t = tile_cycles("B200", "fwd", d=d)
    assert (t.mma, t.exp, t.smem) == (mma, 1024, smem)
    assert t.binding == binding


def test_b300_doubles_the_exp_unit():
    assert tile_cycles("B300", "fwd").exp == 512
    d64 = tile_cycles("B200", "fwd", d=64).bound_cycles / tile_cycles("B300", "fwd", d=64)\
        .bound_cycles
    d128 = tile_cycles("B200", "fwd").bound_cycles / tile_cycles("B300", "fwd").bound_cycles
    assert (d64, d128) == (2.0, 1.0)


def test_what_if_exp_x2_on_b200():
    w = what_if("B200", {"exp": 2})
    assert w.after.exp == w.before.exp / 2 == 512
    assert w.before.binding == ("mma", "exp") and w.after.binding == ("mma",)
    assert w.speedup == 1.0  # the MMA was tied with exp: nothing gained
    w64 = what_if("B200", {"exp": 2}, d=64)
    assert w64.before.binding == ("exp",) and w64.speedup == 2.0


def test_what_if_all_units():
    w = what_if("B200", {"mma": 2, "exp": 2, "smem": 1.5})
    assert (w.after.mma, w.after.exp, w.after.smem) == (512, 512, 512)
    assert w.after.binding == ("mma", "exp", "smem") and w.speedup == 2.0
    w = what_if("B200", {"smem": 2}, pass_="bwd")
    assert w.after.smem == 1664 and w.after.binding == ("mma",)
    assert math.isclose(w.speedup, 3328 / 2560)
    assert "exp x2" in str(what_if("B200", {"exp": 2}))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(arch="A100"), ValueError, "accepted"),
    (dict(arch=100), TypeError, "string"),
    (dict(pass_="both"), ValueError, "fwd"),
    (dict(d=0), ValueError, "positive"),
    (dict(m=128.0), ValueError, "positive integer"),
    (dict(ctas=3), ValueError, "1 or 2"),
    (dict(m=255, ctas=2), ValueError, "split"),
])
def test_bad_input_says_what_is_accepted(kwargs, error, words):
    with pytest.raises(error, match=words):
        tile_cycles(**kwargs)


@pytest.mark.parametrize("scale", [{"tensor": 2}, {"exp": 0}, {"exp": -1}, {"mma": "2"},
                                   {"smem": float("nan")}])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale|unit"):
        what_if("B200", scale)


def test_arch_aliases():
    assert tile_cycles("sm_100a").gpu == "B200"
    assert tile_cycles("sm_90").gpu == "H100"
    assert tile_cycles("b300").gpu == "B300"


def test_plots_headless():
    tiles = [tile_cycles(g, p) for g in ("H100", "B200") for p in ("fwd", "bwd")]
    for ax in (roofline.plot_per_sm_table(), roofline.plot_tile_cycles(tiles),
               roofline.plot_what_if(what_if("B200", {"exp": 2})),
               roofline.interactive_explorer()):
        assert ax.get_title()
    plt.close("all")


def test_utils_imports_no_lesson():
    tree = ast.parse(Path(roofline.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("solutions")
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("solutions") for a in node.names)


# ---------------------------------------------------------------------------------------------
# Chapter 00's exercises: the checkers accept the solutions and the hand-made counts; the planted
# mistakes live in tests/exercise_mutations/ch00.py

from solutions import ch00_hardware as ch00  # noqa: E402
from tests.exercise_mutations import ch00 as wrong0  # noqa: E402


def test_chapter00_checkers_accept_solutions():
    ch00.check_forward_tile_cycles(ch00.forward_tile_cycles)
    ch00.check_forward_tile_cycles(wrong0._by_hand)
    ch00.check_tie_head_dim(ch00.tie_head_dim)
    ch00.check_narrowest_kv_tile(ch00.narrowest_kv_tile)
    ch00.check_narrowest_kv_tile(lambda arch, m, d: wrong0._narrowest(arch, m, d))


def test_tie_head_dim_is_where_the_model_ties():
    for name, sm in (("H100", "sm_90"), ("B200", "sm_100"), ("B300", "sm_103")):
        d = ch00.tie_head_dim(roofline.PER_SM[sm])
        t = tile_cycles(name, "fwd", m=96, n=80, d=int(d))
        assert t.mma == t.exp, (name, d, t)


def test_narrowest_kv_tile_does_not_depend_on_d_and_fails_for_a_64_row_blackwell_tile():
    assert {ch00.narrowest_kv_tile("H100", 128, d) for d in (64, 128, 256)} == {32}
    assert {ch00.narrowest_kv_tile("B200", 128, d) for d in (64, 128, 256)} == {64}
    assert ch00.narrowest_kv_tile("B200", 64, 128) is None


def test_peak_lines_say_which_clock_each_figure_assumes():
    lines = ch00.peak_lines()
    assert "989 TFLOP/s" in lines[0] and "1.83 GHz" in lines[0]
    assert "1.98 GHz" in lines[1] and "(model)" in lines[1]
    assert abs(ch00.datasheet_clock_ghz() - 1.83) < 0.01
