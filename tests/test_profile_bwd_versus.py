"""measure.profile_bwd_versus's rows from ncu's two exports, on hand-made tables (no GPU)."""

import pytest

from measure import profile_bwd_versus as prof
from tests.ncu_tables import raw_page


def test_rows_carry_the_shape_and_both_exports():
    raw = raw_page({"Kernel Name": ("", "kernel_HopperBackward_0"),
                "gpu__time_duration.sum": ("usecond", "1500.0"),
                "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active":
                    ("%", "61.0")})
    source = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
              '"0x10","HGMMA.64x128x16.F32.BF16 R0","30","8"\n'
              '"0x20","SYNCS.PHASECHK.TRANS64 P0","10","8"\n')
    shape = prof.SHAPES[1]
    rows = {r["metric"]: r for r in prof.build_rows(raw, source, "fa4_package", shape)}
    assert rows["duration_ms"]["value"] == pytest.approx(1.5)
    assert rows["gmma_pipe_active_pct"]["value"] == pytest.approx(61.0)
    assert all(r["impl"] == "fa4_package" and r["s"] == 16384 and r["causal"]
               for r in rows.values())
    assert prof.case_name("fa4_final", prof.SHAPES[0]) == "fa4_final_s4096_dense"


def test_an_unknown_target_is_refused_by_name():
    with pytest.raises(SystemExit):
        prof.main(["--target", "flash_attn_2", "4096"])
    with pytest.raises(SystemExit):
        prof.main(["--target", "fa4_final", "1000"])
