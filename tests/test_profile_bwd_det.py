"""measure.profile_bwd_det's reading of ncu's SASS export, on hand-made records, and the stored
H100 profile it wrote (results/h100/bwd_det_profile.json)."""

from measure import profile_bwd_det as prof
from utils import results


def _rec(opcode, samples, **stalls):
    return {"address": None, "sass": opcode + " R0", "opcode": opcode, "samples": samples,
            "executed": 1, "stalls": stalls}


def test_source_rows_count_the_turn_wait_and_the_dq_reductions():
    records = [_rec("HGMMA.64x128x16.F32.BF16", 50, mio=50),
               _rec("LDG.E.STRONG.GPU", 5, long_sb=5), _rec("CCTL.IVALL", 15, long_sb=15),
               _rec("UBLKRED.G.S.ADD.F32.RN", 10, wait=10), _rec("STS.128", 20, barrier=20)]
    rows = {r["metric"]: r for r in prof.source_rows(records, top=2)}
    assert rows["turn_wait_samples_pct"]["value"] == 20.0
    assert rows["dq_update_samples_pct"]["value"] == 10.0
    assert rows["samples_barrier_pct"]["value"] == 20.0
    assert rows["top1_samples_pct"]["sass"].startswith("HGMMA")
    assert rows["top2_samples_pct"]["stall"] == "barrier"


def test_the_stored_profile_has_both_calls():
    res = results.load(prof.RESULTS, gpu="h100")
    got = {(r["impl"], r["metric"]): r["value"] for r in res.rows}
    for impl in prof.VARIANTS.values():
        assert (impl, "duration_ms") in got and (impl, "turn_wait_samples_pct") in got
    plain, det = (got[(i, "duration_ms")] for i in prof.VARIANTS.values())
    assert det > plain  # the row the issue is about: the deterministic main kernel is slower
