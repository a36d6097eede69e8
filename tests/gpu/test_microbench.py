"""On a GPU: chapter 06's exp2 against its float32 model, and the microbenchmark kernels' outputs.

    python -m pytest -q -m gpu tests/gpu/test_microbench.py      (about 20 s on an H200)
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from solutions import ch06_exp2 as ch06  # noqa: E402
from solutions import microbench as mb  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run on the H200: make gpu-test)"),
]

F32 = np.float32


def sweep() -> np.ndarray:
    """Everything a softmax can hand to exp2 and the edges around it (x <= 127)."""
    rng = np.random.default_rng(2026)
    ints = np.arange(-130, 128).astype(F32)
    special = [0.0, -0.0, -np.inf, np.nan, -127.0, -127.5, -126.5, -126.0, -200.0, -1e30,
               1e-45, -1e-45, 1e-40, -1e-40, 1e-38, -1e-38, 127.0, 127.99, 8.0, -8.0]
    return np.concatenate([
        np.array(special, dtype=F32), ints,
        np.nextafter(ints, F32(np.inf)), np.nextafter(ints, F32(-np.inf)),
        rng.uniform(-130, 10, 1_000_000).astype(F32),
        rng.uniform(-1, 0, 200_000).astype(F32),
        rng.uniform(-1e-6, 1e-6, 50_000).astype(F32),
    ])


def describe_mismatches(x, got, want, limit=8) -> str:
    bad = np.flatnonzero(ch06.f32_bits(got) != ch06.f32_bits(want))
    lines = [f"{bad.size} of {x.size} differ; first ones (x, device, model):"]
    for i in bad[:limit]:
        lines.append(f"  x={x[i]!r:>16} ({ch06.f32_bits(x[i]):#010x})  device {got[i]!r} "
                     f"({ch06.f32_bits(got[i]):#010x})  model {want[i]!r} "
                     f"({ch06.f32_bits(want[i]):#010x})")
    ulps = np.abs(ch06.f32_bits(got[bad]).astype(np.int64) - ch06.f32_bits(want[bad]))
    if bad.size:
        lines.append(f"  largest difference {ulps.max()} ulp; NaN on device where model is not: "
                     f"{int(np.sum(np.isnan(got[bad]) & ~np.isnan(want[bad])))}")
    return "\n".join(lines)


def on_device(x: np.ndarray, **knobs) -> np.ndarray:
    y = ch06.apply_exp2(torch.from_numpy(x).cuda(), **knobs)
    torch.cuda.synchronize()
    return y.cpu().numpy()


@pytest.mark.parametrize("degree,nan_safe", [(3, True), (3, False), (5, True), (2, True)])
def test_exp2_poly_is_bit_identical_to_the_float32_model(degree, nan_safe):
    x = sweep()
    got = on_device(x, fraction=1.0, degree=degree, nan_safe=nan_safe)
    want = ch06.exp2_f32_model(x, degree, nan_safe)
    same = ch06.f32_bits(got) == ch06.f32_bits(want)
    assert same.all(), describe_mismatches(x, got, want)


def test_out_of_domain_inputs_also_follow_the_model():
    """x >= 128 and +inf are outside exp2_poly's contract (wrong results by design); the model
    still predicts them bit for bit if it models the GPU's canonical NaN and integer wrap-around.
    A failure here alone does not affect the softmax."""
    x = np.array([128.0, 128.5, 200.0, 255.9, 256.0, 1e30, np.inf], dtype=F32)
    got = on_device(x, fraction=1.0)
    want = ch06.exp2_f32_model(x)
    assert (ch06.f32_bits(got) == ch06.f32_bits(want)).all(), describe_mismatches(x, got, want)


def test_mixed_fragment_uses_mufu_where_told():
    size, fraction = 16, 0.25
    rng = np.random.default_rng(7)
    x = rng.uniform(-126, 8, 16 * 4096).astype(F32)
    x[:8] = [-np.inf, np.nan, 0.0, -126.5, -130.0, 1.0, -1.0, 0.5]
    got = on_device(x, fraction=fraction, size=size)
    emulated = np.array([ch06.is_emulated(i % size, fraction, 8) for i in range(x.size)])
    want = ch06.exp2_f32_model(x)
    poly_same = ch06.f32_bits(got[emulated]) == ch06.f32_bits(want[emulated])
    assert poly_same.all(), describe_mismatches(x[emulated], got[emulated], want[emulated])
    # MUFU ex2.approx.ftz: a few ulp (relative 2^-21 here), results below 2^-126 flushed to 0.
    xm, gm = x[~emulated], got[~emulated]
    ref = np.exp2(xm.astype(np.float64))
    normal = ref >= 2.0**-126
    rel = np.abs(gm[normal] / ref[normal] - 1.0)
    worst = xm[normal][rel.argmax()]
    assert rel.max() <= 2.0**-21, f"MUFU relative error {rel.max():.3e} at x = {worst!r}"
    tiny = (ref < 2.0**-126) & ~np.isnan(xm)
    assert np.all(gm[tiny] == 0.0), f"MUFU did not flush: {gm[tiny][gm[tiny] != 0][:4]}"
    assert np.isnan(gm[np.isnan(xm)]).all()


def test_exp_throughput_kernel_runs_and_its_chains_converge():
    for bench in (mb.ExpThroughput(0), mb.ExpThroughput(3), mb.ExpThroughput(mb.CHAINS)):
        fig = bench.measure(steps=40, warmup=1, reps=3)
        where = f"{bench.label}: {fig}"
        assert fig["sms_used"] == fig["sms_expected"], where
        assert 0.63 < fig["fixed_point_min"] <= fig["fixed_point_max"] < 0.65, where
        assert 1.0 < fig["per_clk_sm"] < 64.0, where
        assert 0.3 < fig["sm_clock_ghz"] < 3.0, where


@pytest.mark.parametrize("width", [16, 4])
def test_smem_kernel_reads_every_word_it_should(width):
    fig = mb.SmemBandwidth(width).measure(steps=40, warmup=1, reps=3)
    assert fig["checksum_ok"], fig
    assert fig["sms_used"] == fig["sms_expected"], fig
    assert 8.0 < fig["per_clk_sm"] <= 160.0, fig  # ANCHORS: 128 B/clk/SM peak


def test_mma_sync_ceiling_is_plausible():
    """mma.sync from registers: every SM busy, finite sums, a rate between the A100's per-SM
    figure (1024 dense bf16 FLOP/clk) and Hopper's wgmma peak (4096)."""
    fig = mb.MmaSyncThroughput().measure(steps=2000)
    print(fig)
    assert fig["finite"] and fig["sms_used"] == fig["sms_expected"]
    assert 1024 < fig["per_clk_sm"] <= 4096, fig


def test_eager_launch_cost_runs_and_is_microseconds():
    """measure.microbench's cost of one eager operator: both rows in microseconds, the tile
    loop's per launch no less than a bare add's (it does an add's work and more per launch)."""
    from measure import microbench as driver

    fig = driver.eager_launch_cost(rounds=1)
    rows = driver.launch_rows(fig)
    print(rows)
    assert {r["metric"] for r in rows} == {"eager_launch_us"}
    assert 0.5 < fig["adds"]["us"] < 200 and 0.5 < fig["loop"]["us"] < 500, fig
    assert fig["loop"]["us"] > 0.5 * fig["adds"]["us"], fig
