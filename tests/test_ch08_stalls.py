"""solutions.ch08_stalls on the CPU: the kinds of consumer instruction, the steady loop's rows
and the two-kernel difference, on hand-made SASS source pages and on the stored H200 file; the
fixed-clock helpers of labs/the_last_three_percent that read the runs these led to. The ncu runs
themselves are on the H200."""

from types import SimpleNamespace

import pytest

from labs import the_last_three_percent_helpers as t08
from solutions import ch08_stalls as st
from utils import results


def test_kinds_follow_the_opcode_prefixes():
    assert st.kind_of("HGMMA.64x128x16.F32.BF16") == "wgmma issue (HGMMA)"
    assert st.kind_of("WARPGROUP.DEPBAR.LE") == "wgmma wait (WARPGROUP.DEPBAR)"
    assert st.kind_of("MUFU.EX2") == "exp2 (MUFU.EX2)"
    assert st.kind_of("SYNCS.PHASECHK.TRANS64.TRYWAIT") == "mbarrier wait (SYNCS, NANOSLEEP)"
    assert st.kind_of("UMOV") == "uniform datapath (U*)"
    assert st.kind_of("S2R") == st.OTHER


def _record(i, sass, executed, samples, **stalls):
    return {"address": 16 * i, "sass": sass, "opcode": sass.split()[0], "samples": samples,
            "executed": executed, "stalls": stalls}


def _kernel(fadd_wait: int):
    """A warp-specialised kernel in miniature: setup, the producer after setmaxnreg.dec, the
    consumers after setmaxnreg.inc with a 100-step loop (and a first step run 4 times)."""
    sass = [("S2R R0, SR_TID.X", 8, 1, {}),
            ("USETMAXREG.DEALLOC.CTAPOOL 0x18", 4, 1, {}),
            ("UTMALDG.2D [UR8], [UR4]", 400, 9, {"selected": 9}),
            ("EXIT", 4, 1, {}),
            ("USETMAXREG.TRYALLOC.CTAPOOL 0xa0", 12, 1, {}),
            ("MUFU.EX2 R1, R1", 4, 3, {"selected": 3}),  # the first step
            ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", 400, 20, {"wait": 15}),
            ("MUFU.EX2 R2, R2", 400, 30, {"mio": 20, "selected": 10}),
            ("FADD R3, R2, R3", 400, 10 + fadd_wait, {"wait": fadd_wait, "selected": 10}),
            ("EXIT", 12, 1, {})]
    return [_record(i, *row[:3], **row[3]) for i, row in enumerate(sass)]


def test_steady_rows_count_the_loop_at_its_step_count():
    consumer = st.consumer_records(_kernel(fadd_wait=5))
    rows = {r["metric"]: r["value"] for r in st.steady_rows(consumer)}
    assert rows["steady_loop_steps"] == 400 and rows["steady_loop_instructions"] == 3
    assert rows["consumer_samples"] == 1 + 3 + 20 + 30 + 15 + 1
    assert rows["steady_samples[row sum (FADD)]"] == 15
    assert rows["steady_reasons[row sum (FADD)]"] == {"wait": 5, "selected": 10}
    assert "steady_samples[exp2 (MUFU.EX2)]" in rows  # the loop's MUFU, not the first step's


def test_difference_is_in_the_second_kernels_samples_and_names_the_reason():
    def rows(impl, fadd_wait):
        return [{"impl": impl, "d": 64, "s": 16384, "causal": True, **r}
                for r in st.steady_rows(st.consumer_records(_kernel(fadd_wait)))]

    res = SimpleNamespace(rows=rows("fa4_final", 40) + rows("fa4_package", 0))
    lines = st.steady_difference(res)
    theirs = 1 + 3 + 20 + 30 + 10 + 1
    assert f"fa4_package {theirs}" in lines[0]
    fadd = next(line for line in lines if "row sum" in line)
    assert f"{100 * 40 / theirs:+5.1f}%" in fadd and "largest reason: wait" in fadd
    assert not any("HGMMA" in line for line in lines[1:])  # equal: left out


def test_kind_rows_share_the_consumers_samples():
    consumer = st.consumer_records(_kernel(fadd_wait=0))
    rows = {r["metric"]: r["value"] for r in st.kind_rows(consumer)}
    assert sum(v for m, v in rows.items() if m.startswith("kind_samples_pct")) == \
        pytest.approx(100.0)
    assert rows["kind_top_reason[exp2 (MUFU.EX2)]"] == "mio"


def test_the_stored_profile_reads_and_compares():
    res = results.load("fa4_final_stalls")
    table = st.table(res)
    assert any(line.startswith("D=64 S=16384 causal") for line in table)
    assert any("exp2 (MUFU.EX2)" in line for line in table)
    diff = st.steady_difference(res)
    assert "consumer samples" in diff[0] and len(diff) > 3


def test_the_lane_run_picks_each_shapes_default_column():
    res = results.load("fa4_final_clocked_lane")
    lines = t08.default_in_lane_run(res)
    assert len(lines) == 8
    assert all("the package" in line for line in lines)
    d64_causal = [line for line in lines if line.startswith("D= 64") and "non-causal" not in line]
    assert d64_causal and all("lane read once" in line for line in d64_causal)
    assert all("lane read every step" in line for line in lines if line.startswith("D=128"))


def test_the_skip_run_picks_each_shapes_default_column():
    res = results.load("fa4_final_clocked_skip")
    lines = t08.default_in_skip_run(res)
    assert len(lines) == 8 and all("the package" in line for line in lines)
    assert all(("skip, tau = 0" in line) == line.startswith("D= 64") for line in lines)
