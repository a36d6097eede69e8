"""The microbenchmark kernels compiled for sm_90a with no GPU, and the result rows' format
(the driver is measure/microbench.py)."""

import pytest

from measure import microbench as driver
from solutions import microbench as mb
from utils import results

EMULATED = (0, 2, 4, 8)


@pytest.fixture(scope="module")
def exp_kernels():
    return {e: mb.ExpThroughput(e).compile_only("sm_90a") for e in EMULATED}


@pytest.fixture(scope="module")
def smem_kernels():
    return {w: mb.SmemBandwidth(w).compile_only("sm_90a") for w in (4, 16)}


def test_exp_kernels_trade_ex2_for_fma_as_the_fraction_grows(exp_kernels):
    ex2 = [exp_kernels[e].count("ex2.approx.ftz.f32") for e in EMULATED]
    assert ex2 == [mb.UNROLL * (mb.CHAINS - e) for e in EMULATED]  # strictly fewer each time
    for e in EMULATED:
        art = exp_kernels[e]
        assert art.count("fma.rn.f32") == 3 * mb.UNROLL * e
        assert art.count("MUFU.EX2", where="sass") == mb.UNROLL * (mb.CHAINS - e)
        assert art.count("FFMA", where="sass") >= 3 * mb.UNROLL * e
    exp_kernels[0].forbid("fma.rn.f32")
    exp_kernels[mb.CHAINS].forbid("ex2.approx")


def test_exp_kernels_read_clocks_and_fit_two_blocks_per_sm(exp_kernels):
    for art in exp_kernels.values():
        art.require("%clock64", "%smid", "bar.sync")
        assert art.spills == 0
        # Two 1024-thread blocks per SM need <= 32 registers (65536 per SM); more would
        # serialise the blocks (still measured right per SM, but the chip rate would suffer).
        assert art.registers <= 32, art.resources()


def test_naive_variant_uses_the_conversion_unit():
    art = mb.ExpThroughput(mb.CHAINS, floor="cvt").compile_only("sm_90a")
    art.require("FRND.FLOOR", "F2I", where="sass")
    art.forbid("FADD.RM", where="sass")


def test_smem_kernels_issue_the_intended_loads(smem_kernels):
    wide, narrow = smem_kernels[16], smem_kernels[4]
    assert wide.count("LDS.128", where="sass") == mb.SMEM_LOADS_IN_FLIGHT
    assert narrow.count("LDS ", where="sass") == mb.SMEM_LOADS_IN_FLIGHT
    assert narrow.count("LDS.128", where="sass") == 0
    for art in (wide, narrow):
        assert art.count("ld.volatile.shared") == mb.SMEM_LOADS_IN_FLIGHT
        assert art.spills == 0
    per_sm = mb.BLOCKS_PER_SM * mb.SmemBandwidth(16).buffer_words * 4
    assert per_sm <= 227 * 1024


def test_expected_smem_checksum_counts_every_word_once_per_trip():
    bench = mb.SmemBandwidth(16)
    words_per_thread = mb.SMEM_LOADS_IN_FLIGHT * 4
    assert bench.expected_sum(0, 1) == sum(r * bench.row_bytes // 4 + c for r in range(4)
                                           for c in range(4))
    all_threads = sum(bench.expected_sum(t, 1) for t in range(bench.threads))
    assert all_threads == sum(range(bench.threads * words_per_thread))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="emulated must be"):
        mb.ExpThroughput(9)
    with pytest.raises(ValueError, match="floor must be"):
        mb.ExpThroughput(4, floor="round")
    with pytest.raises(ValueError, match="degree must be"):
        mb.ExpThroughput(4, degree=6)
    with pytest.raises(ValueError, match="width must be 4 or 16"):
        mb.SmemBandwidth(8)


def test_variant_labels_are_unique():
    labels = [v.label for v in mb.exp_variants()]
    assert len(labels) == len(set(labels))


def _fake_figures(exp: bool) -> dict:
    fig = {"per_s": 3.9e12, "per_clk_sm": 15.9, "per_clk_sm_min": 15.8, "per_clk_sm_max": 16.0,
           "median_cycles": 1.2e7, "sms_used": 132, "sms_expected": 132, "ms": 6.4,
           "sm_clock_ghz": 1.9}
    if exp:
        fig.update(fixed_point_min=0.6411, fixed_point_max=0.6413)
    else:
        fig.update(checksum_ok=True)
    return fig


def test_mma_kernel_is_independent_hmma_from_registers():
    """The mma.sync ceiling: HMMA only (no LDSM/LDS feeding it), MMA_CHAINS independent
    accumulators per unrolled trip, distinct B operands, spill-free at 4 blocks x 8 warps/SM."""
    art = mb.MmaSyncThroughput().compile_only("sm_90a")
    art.require("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    art.forbid("ldmatrix", "wgmma")
    assert art.count("HMMA.16816.F32.BF16", "sass") == mb.MMA_CHAINS * mb.UNROLL
    assert art.spills == 0 and art.frame_bytes == 0
    bench = mb.MmaSyncThroughput()
    assert art.registers * bench.threads * bench.blocks_per_sm <= 65536, art.registers
    assert bench.mmas_per_thread(10) * 32 == mb.MMA_CHAINS * mb.UNROLL * 10


def test_rows_pass_the_results_validation():
    rows = driver.exp_rows(mb.ExpThroughput(3), _fake_figures(True))
    rows += driver.smem_rows(mb.SmemBandwidth(16), _fake_figures(False))
    rows += driver.matmul_rows({"n": 8192, "ms": 1.5, "tflops": 733.0})
    rows += driver.copy_rows(_fake_copy())
    rows += driver.mma_rows(mb.MmaSyncThroughput(), _fake_figures(False) | {"per_s": 6.4e14})
    rows += driver.launch_rows(_fake_launches())
    results.validate({"provenance": {k: "x" for k in results.PROVENANCE_KEYS}, "rows": rows})
    assert {r["metric"] for r in rows} >= {"exp2_rate", "exp2_per_clk_sm", "smem_bytes_per_clk_sm",
                                          "matmul_tflops", "hbm_copy_bandwidth",
                                          "eager_launch_us"}


def _fake_launches():
    one = {"us": 6.0, "min": 5.8, "max": 6.3, "rounds": 3, "sm_clock_mhz": None}
    return {"adds": one | {"launches": driver.EAGER_OPS}, "loop": one | {"launches": 1300}}


def _fake_copy():
    return {"bytes_per_s": 4.0e12, "min": 3.9e12, "max": 4.1e12, "rounds": 3, "ms": 0.54,
            "nbytes": 2**30, "sm_clock_mhz": None, "sensors": None}


def test_problems_are_reported_in_words():
    fig = _fake_figures(True)
    assert driver.problems(fig, exp=True) == []
    fig.update(sms_used=100, fixed_point_min=0.2)
    said = " ".join(driver.problems(fig, exp=True))
    assert "100 SMs" in said and "wrong thing" in said
    bad = _fake_figures(False) | {"checksum_ok": False}
    assert "wrong addresses" in driver.problems(bad, exp=False)[0]


def test_script_says_why_it_measures_nothing_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would measure")
    assert driver.main([]) == 1
    assert "no CUDA GPU" in capsys.readouterr().out


def test_script_control_flow_with_fake_measurements(monkeypatch, capsys):
    """main() on a pretend GPU: every variant measured, one crash reported, rows saved."""
    import torch

    saved = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200 (pretend)")

    def exp_measure(self, steps, **kw):
        if self.floor == "cvt":
            raise RuntimeError("pretend compile failure")
        return _fake_figures(True)

    monkeypatch.setattr(mb.ExpThroughput, "measure", exp_measure)
    monkeypatch.setattr(mb.SmemBandwidth, "measure", lambda self, steps, **kw: _fake_figures(False))
    monkeypatch.setattr(mb.MmaSyncThroughput, "measure",
                        lambda self, steps, **kw: _fake_figures(False) | {"finite": True})
    monkeypatch.setattr(driver, "matmul_tflops", lambda: {"n": 8192, "ms": 1.5, "tflops": 733.0})
    monkeypatch.setattr(driver, "copy_bandwidth", _fake_copy)
    monkeypatch.setattr(driver, "eager_launch_cost", _fake_launches)
    monkeypatch.setattr(results, "save", lambda name, rows, command: saved.update(
        name=name, rows=rows, command=command) or "results/h200/microbench.json")
    assert driver.main(["--quick"]) == 1  # the crash makes the exit status 1
    out = capsys.readouterr().out
    assert "FAIL poly deg 3 (cvt floor): raised RuntimeError: pretend compile failure" in out
    assert saved["name"] == "microbench" and "--quick" in saved["command"]
    measured = len(mb.exp_variants()) - 1
    assert len(saved["rows"]) == 3 * measured + 2 * 2 + 3 + 1 + 1 + 2
