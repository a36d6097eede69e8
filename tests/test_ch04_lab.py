"""labs/ch04_tuning.ipynb's helpers (labs/ch04_tuning_helpers.py): ptxas's view of the swept
tiles, bank conflicts, the instruction mix of the compiled loop, and the stored runs read as
lines, on made-up rows where the verdicts must come out of the numbers."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from labs import ch04_tuning_helpers as lab  # noqa: E402
from solutions import ch04_flash_ampere as fa  # noqa: E402
from solutions import ch04_teaching as t4  # noqa: E402
from utils.results import Results  # noqa: E402

TileConfig = fa.TileConfig

def test_register_budget_picture_from_rows():
    rows = [{"config": TileConfig(128, 32, 128), "registers": 255, "stack_bytes": 0},
            {"config": TileConfig(128, 128, 128), "registers": 255, "stack_bytes": 800}]
    ax = lab.draw_register_budget(rows)
    assert any("spills" in t.get_text() for t in ax.texts)
    plt.close("all")


@pytest.mark.parametrize("d", [64, 128])
def test_bank_summary(d):
    rows = {r["layout"]: r for r in lab.bank_summary(d)}
    assert rows["row-major"]["ldmatrix_cycles"] == 8
    assert rows["padded"]["ldmatrix_cycles"] == rows["swizzled"]["ldmatrix_cycles"] == 1
    assert all(r["cp_async_cycles"] == 1 for r in rows.values())
    assert rows["padded"]["bytes_per_row"] == 2 * d + 16
    assert rows["swizzled"]["bytes_per_row"] == 2 * d


def test_swizzled_offsets_are_a_permutation_of_16_byte_chunks():
    off = lab.smem_offsets("swizzled", 128, rows=16)
    assert sorted(off.ravel().tolist()) == list(range(16 * 128))
    assert ((off[:, 1:8] - off[:, :1]) == np.arange(1, 8)).all()  # chunks stay whole
    padded = lab.smem_offsets("padded", 128, rows=4)
    assert padded[1, 0] == 136 and padded[3, 5] == 3 * 136 + 5


# ---------------------------------------------------------------------------------------------
# Causal tiles
# ---------------------------------------------------------------------------------------------
FAKE_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0040*/                   MUFU.EX2 R3, R3 ;
        /*0050*/              @!PT LDS RZ, [RZ] ;
        /*0060*/                   FMUL R9, R9, R3 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0080*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0090*/                   BRA `(.L_x_2);
"""


def test_loop_body_picks_the_loop_with_most_hmma():
    ops = lab.loop_body(FAKE_SASS)
    assert ops == ["LDSM", "HMMA", "HMMA", "MUFU", "FMUL", "BRA"]  # never-executed LDS left out


def test_hopper_ceilings_arithmetic():
    cfg = TileConfig(128, 32, 128)
    mix = dict.fromkeys(list(lab.INSTRUCTION_CLASSES) + [lab.OTHER], 0.0)
    mix.update({"mma.sync (HMMA)": 128.0, "exp2 (MUFU)": 36.0, lab.OTHER: 376.0})
    rows = {what.split(" (")[0]: (cycles, tflops) for what, cycles, tflops in
            lab.hopper_ceilings(cfg, 128, mix)}
    flops = 4 * 128 * 32 * 128
    assert rows["tensor cores at the wgmma rate"][0] == flops / 4096
    assert rows["tensor cores at the mma.sync rate"][0] == flops / 4096 / t4.MMA_SYNC_SHARE
    assert rows["exp2 on MUFU"][0] == 36 * 32 * 4 / 16
    assert rows["issuing the loop's instructions"][0] == 540 * 4 / 4
    peak = rows["tensor cores at the wgmma rate"][1]
    assert peak == pytest.approx(4096 * 132 * 1.98e9 / 1e12)
    exp = t4.expected_tflops(128)
    assert exp["overlapped"] == pytest.approx(exp["peak"] * t4.MMA_SYNC_SHARE)
    assert exp["serial"] < exp["overlapped"]


def _results(rows, name="fake"):
    prov = dict.fromkeys(("gpu", "driver", "cuda", "torch", "cutlass_dsl", "commit", "date",
                          "command"), "x")
    return Results(name, None, prov, rows)


def _row(impl, tflops, **kw):
    return {"impl": impl, "pass": "fwd", "dtype": "bf16", "b": 1, "s": 16384, "h": 16, "d": 128,
            "causal": False, "ms": 1.0, "tflops": tflops, **kw}


def test_peer_lines_take_medians_and_say_level():
    rows = [_row(impl, t, data="randn", round=r) for r, (a, b, c) in
            enumerate([(100.0, 101.0, 90.0), (104.0, 99.0, 91.0), (102.0, 150.0, 92.0)])
            for impl, t in (("flash_ampere", a), ("cutlass_example_128x64", b),
                            ("flash_ampere_portable", c))]
    (line,) = lab.peer_lines(_results(rows))
    assert "= 1.010 (level)" in line and "the portable tile = 1.121" in line
    ahead = [r if r["impl"] != "cutlass_example_128x64" else {**r, "tflops": 50.0} for r in rows]
    assert "(ours ahead)" in lab.peer_lines(_results(ahead))[0]


def test_run_spread_and_sweep_findings():
    tile = {"m_block": 128, "n_block": 64, "num_threads": 128, "smem_layout": "swizzled",
            "skip_rescale": False, "spill_instructions": 0}
    sweep = _results([
        _row("flash_ampere", 100.0, **tile, num_stages=1, qk_unroll=2, default=False),
        _row("flash_ampere", 102.0, **tile, num_stages=1, qk_unroll=4, default=False),
        _row("flash_ampere", 110.0, **tile, num_stages=2, qk_unroll=4, default=True,
             sdpa_flash_tflops=100.0),
    ], name="ch04_sweep")
    fwd = _results([_row("flash_ampere", 106.0)], name="ch04_fwd")
    spread = lab.run_spread(fwd, sweep)
    assert spread["lo"] == 106.0 and spread["hi"] == 110.0 and spread["timings"] == 2
    assert "a spread of 3.8%" in lab.spread_line(spread)
    text = "\n".join(lab.sweep_findings(sweep, spread["spread"]))
    assert "4 slices per trip vs 2: 102 vs 100 TFLOP/s = 1.02x (within noise)" in text
    assert "2 stages vs 1, 4 slices per trip: 110 vs 102 TFLOP/s = 1.08x; spill-free" in text
    assert "vs SDPA's flash backend in the same sweep: 1.10x" in text
    assert lab.run_spread(fwd) is None


def test_profile_reading_computes_its_verdicts():
    def res(busy, issue):
        return _results([{"metric": "tensor_pipe_active_pct", "value": busy},
                         {"metric": "issue_slots_busy_pct", "value": issue}])
    assert lab.profile_reading(res(61.0, 40.0))[0].endswith("neither is saturated")
    assert lab.profile_reading(res(95.0, 40.0))[0].endswith("close to its limit")


def test_sweep_lines_use_stored_resources_and_ratios():
    tile = {"m_block": 128, "n_block": 64, "num_threads": 128, "num_stages": 1,
            "smem_layout": "swizzled", "acc_O": 128, "acc_S": 64}
    rows = [
        _row("flash_ampere", 100.0, **{**tile, "n_block": 32, "acc_S": 32}, default=True,
             registers=255, stack_bytes=0, spill_instructions=0),
        _row("flash_ampere", 110.0, **tile, default=False, registers=255, stack_bytes=88,
             spill_instructions=68),
        _row("flash_ampere", None, **tile, default=False, causal=True),
    ]
    lines = lab.sweep_lines(_results(rows), compile_groups=())
    text = "\n".join(lines)
    assert "1.10x" in text and "88" in text and "128x32 t128 s1 swizzled u1 *" in text
    assert "not timed" in text



@pytest.mark.slow
def test_resource_rows_and_the_instruction_mix_compile_for_sm90a():
    """The model's verdict on two tiles against sm_90a compiles: fits -> no stack frame; the
    compiled loop of the default tile has the mma.sync, exp2, shuffles and barriers of a step."""
    for cfg, should_fit in ((fa.default_config(128), True), (TileConfig(128, 128, 128), False)):
        assert t4.register_estimate(cfg, 128)["fits"] is should_fit
        res = lab.resources("sm_90a", 128, cfg)
        assert (res["stack_bytes"] == 0) is should_fit, (cfg, res)
    rows = lab.resource_rows([fa.default_config(128)], 128)
    assert rows[0]["ctas"] >= 1 and "yes" in lab.format_resource_rows(rows)
    mix = lab.instruction_mix(fa.default_config(128), 128)
    c = fa.default_config(128)
    assert mix["mma.sync (HMMA)"] == 2 * (c.m_block // (16 * c.num_warps)) * (c.n_block // 8) * 8
    assert mix["exp2 (MUFU)"] >= c.m_block * c.n_block // c.num_threads
    assert mix["quad shuffles (SHFL)"] > 0 and mix["barriers (BAR)"] >= 2


def test_the_stored_lab_files_read():
    from utils.results import load

    peer = lab.cutlass_peer_lines(load("ch04_cutlass_peer"))
    assert any(line.startswith("non-causal, randn: sdpa_flash") for line in peer)
    assert all("(level)" in line for line in lab.peer_lines(load("ch04_cutlass_peer")))
    prof = load("ch04_profile")
    assert lab.profile_lines(prof)[0].startswith("128x64") and lab.profile_reading(prof)
    spread = lab.run_spread(load("ch04_fwd"), load("ch04_sweep"), load("ch04_cutlass_peer"))
    assert spread and spread["timings"] >= 3 and 0 < spread["spread"] < 0.2
