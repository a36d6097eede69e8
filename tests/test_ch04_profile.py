"""solutions.ch04_profile reads ncu's CSV exports (no GPU, no ncu): small hand-made tables in
ncu's format, and the stored profile when there is one."""

import pytest

from labs import ch04_tuning_helpers as lab
from measure import _ncu as ncu
from solutions import ch04_profile as prof
from utils.results import load

RAW = "\n".join([
    '"ID","Kernel Name","gpu__time_duration.sum","gpc__cycles_elapsed.avg.per_second",'
    '"launch__registers_per_thread","sm__warps_active.avg.per_cycle_active",'
    '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",'
    '"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",'
    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
    '"","","usecond","cycle/nsecond","register/thread","warp","","","",""',
    '"0","kernel","7,440.00","1.38","255","7.91","1,600","640,000","1.96","0.17"',
])


def _source(rows):
    """A --page source --csv export: a title line, the header, one line per instruction (its
    samples counted both as "wait" and as "short_sb": a fixture, not a real split)."""
    head = ('"Address","Source","Warp Stall Sampling (All Samples)",'
            '"Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed",'
            '"stall_short_sb","stall_wait","stall_wait (Not Issued)"')
    lines = ['"Kernel Name","kernel"', head]
    for i, (sass, samples, executed) in enumerate(rows):
        lines.append(f'"0x{i:04x}","{sass}","{samples}","0","{samples}","{executed}",'
                     f'"{samples}","{samples}","0"')
    return "\n".join(lines)


STEPS = 100  # KV steps per warp in the fake loop; 10 warps
LOOP = [
    ("S2R R2, SR_TID.X", 0, 10),  # prologue: once per warp
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 5, 10 * STEPS),  # loop head
    ("@!P0 LDGSTS.E.128 [R1], desc[UR4][R2.64]", 3, 10 * STEPS - 10),  # conditional load
    ("LDSM.16.M88.4 R68, [R109]", 4, 20 * STEPS),  # QK^T k-loop: two trips per step
    ("HMMA.16816.F32.BF16 R4, R68, R72, R4", 30, 20 * STEPS),
    ("FMNMX.NAN R73, R32, R33, !PT", 6, 10 * STEPS),  # softmax
    ("MUFU.EX2 R4, R4", 9, 10 * STEPS),
    ("LDSM.16.MT88.4 R8, [R68]", 2, 10 * STEPS),  # PV
    ("HMMA.16816.F32.BF16 R204, R64, R8, R204", 25, 10 * STEPS),
    ("BRA 0x100", 1, 10 * STEPS),  # back edge: counted with the loop head
    ("STG.E.128 [R2.64], R4", 15, 10),  # epilogue
]


def test_raw_counters_become_rows_in_the_course_units():
    rows = {r["metric"]: r for r in prof.raw_rows(prof.parse_raw(RAW))}
    assert rows["duration_ms"]["value"] == pytest.approx(7.44)
    assert rows["sm_clock_ghz"]["value"] == pytest.approx(1.38)
    assert rows["registers_per_thread"]["value"] == 255
    assert rows["achieved_warps_per_scheduler"]["value"] == pytest.approx(7.91 / 4)
    assert rows["smem_load_bank_conflicts_pct"]["value"] == pytest.approx(0.25)
    assert rows["stall_wait"]["value"] == pytest.approx(1.96)
    assert rows["stall_barrier"]["unit"] == "cycles per issued instruction"
    assert "tensor_pipe_active_pct" not in rows  # absent from the export: left out, not 0


def test_an_unknown_time_unit_is_refused_not_guessed():
    raw = RAW.replace('"usecond"', '"fortnight"')
    with pytest.raises(ValueError, match="fortnight"):
        prof.raw_rows(prof.parse_raw(raw))


def test_raw_export_needs_its_three_rows():
    with pytest.raises(ValueError, match="unit row"):
        prof.parse_raw('"ID","gpu__time_duration.sum"\n"","usecond"')


def test_loop_phases_split_the_samples_by_code_position():
    rows = {r["metric"]: r["value"] for r in prof.loop_phases(prof.parse_source(_source(LOOP)))}
    total = sum(s for _, s, _ in LOOP)
    assert rows["warp_time_loop_head_pct"] == pytest.approx(100 * (5 + 3 + 1) / total)
    assert rows["warp_time_qk_pct"] == pytest.approx(100 * (4 + 30) / total)
    assert rows["warp_time_softmax_pct"] == pytest.approx(100 * (6 + 9) / total)
    assert rows["warp_time_pv_pct"] == pytest.approx(100 * (2 + 25) / total)
    assert rows["warp_time_outside_kv_loop_pct"] == pytest.approx(100 * 15 / total)
    assert rows["warp_time_at_mma_sync_pct"] == pytest.approx(100 * (30 + 25) / total)
    assert rows["stall_wait_samples_at_mma_sync_pct"] == pytest.approx(100 * (30 + 25) / total)
    assert rows["mma_sync_per_warp_per_step"] == pytest.approx(3)  # 2 QK^T trips + 1 PV
    # BAR, LDGSTS (a little less than once per step), FMNMX, MUFU, LDSM.MT, BRA, 2 LDSM
    assert rows["other_instructions_per_warp_per_step"] == pytest.approx(8 - 0.01)


def test_a_kernel_without_mma_is_refused():
    with pytest.raises(ValueError, match="no HMMA"):
        prof.loop_phases(prof.parse_source(_source([("FADD R1, R2, R3", 1, 10)])))


def test_build_rows_carry_shape_and_tile():
    rows = prof.build_rows(RAW, _source(LOOP), "128x64 t128 s2 swizzled u4")
    assert all(r["impl"] == "flash_ampere" and r["d"] == 128 and r["s"] == 16384
               and r["config"].startswith("128x64") for r in rows)


def test_profile_lines_read_the_stored_profile():
    try:
        res = load(prof.RESULTS)
    except FileNotFoundError:
        pytest.skip("no stored ch04_profile on the H200 yet")
    lines = lab.profile_lines(res)
    text = "\n".join(lines)
    assert "tensor pipe busy" in text and "warp time: softmax" in text and "stall" not in lines[0]
    by = {r["metric"]: r["value"] for r in res.rows}
    # What the chapter claims from it: 255 registers, two CTAs of 4 warps per SM, so at most 2
    # warps per scheduler; no bank conflicts to speak of; the four parts cover the loop.
    assert by["registers_per_thread"] == 255
    assert min(by["ctas_per_sm_limit_registers"], by["ctas_per_sm_limit_shared_mem"]) == 2
    assert by["achieved_warps_per_scheduler"] <= 2.0
    assert by["smem_load_bank_conflicts_pct"] < 5
    assert sum(by[f"warp_time_{p}_pct"] for p in prof.PHASES) > 90
    assert by["mma_sync_per_warp_per_step"] == 256  # (128/4/16) x (64/8) x (128/16) x 2 GEMMs


def test_metrics_this_ncu_does_not_know_are_left_out(tmp_path, capsys):
    names = [f"metric_{i}" for i in range(60)] + ["sm__issue_active"]
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{n}  Counter  something'\n" for n in names))
    fake.chmod(0o755)
    keep = ncu._available(str(fake), ["sm__issue_active.avg.pct_of_peak_sustained_elapsed",
                                       "sm__pipe_tensor_op_gmma_cycles_active.avg.pct"])
    assert keep == ["sm__issue_active.avg.pct_of_peak_sustained_elapsed"]
    assert "no metric sm__pipe_tensor_op_gmma_cycles_active" in capsys.readouterr().out


def test_an_unreadable_metric_list_filters_nothing(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho usage\n")
    fake.chmod(0o755)
    assert ncu._available(str(fake), ["a.b", "c.d"]) == ["a.b", "c.d"]


def test_both_chapters_profiles_share_one_command_line():
    from measure import profile_ch04, profile_ch05

    assert profile_ch04.SPEC.results == "ch04_profile"
    assert profile_ch05.SPEC.results == "ch05_profile"
    assert profile_ch05.SPEC.build is not profile_ch04.SPEC.build
