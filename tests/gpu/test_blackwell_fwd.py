"""fa4_final's Blackwell forward (chapters 09-10) and chapter 09's primer on a B200/B300 against
the float64 reference.

No Blackwell GPU was available when this kernel was written: these tests are the first time it
runs. They are skipped, saying so, on every other machine. Run them in a subprocess with a
timeout, since a broken mbarrier protocol hangs instead of failing:

    timeout 900 python -m pytest tests/gpu/test_blackwell_fwd.py -m sm100 -x -v

Outputs are filled with NaN before each launch, so an element the kernel forgets to write fails.
"""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from fa4_final.blackwell.config import BlackwellFwdConfig, blackwell_fwd_default
from utils.checks import AWKWARD_CASES, poison_, tolerance_check
from utils.hardware import missing
from utils.reference import attention_reference, random_qkv

_WHY = missing("sm_100")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sm100,
    pytest.mark.skipif(_WHY is not None, reason=f"{_WHY}. No Blackwell GPU here: the kernel is "
                       "verified by tests/test_blackwell_compile.py (compile-only), "
                       "test_ch09_pipeline.py (simulation) and test_ch09_model.py (cycle model)"),
]

BF16, FP16 = torch.bfloat16, torch.float16
ONE_CTA, TWO_CTA = BlackwellFwdConfig(), BlackwellFwdConfig(two_cta=True)


def _run(q, k, v, causal, softmax_scale=None, config=None, window=(None, None)):
    from fa4_final.runtime.prologue import forward_into

    b, sq, h, _ = q.shape
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(b, h, sq, dtype=torch.float32, device=q.device))
    forward_into(q, k, v, out, lse, causal, softmax_scale, window, config=config,
                 target="sm_100a")
    torch.cuda.synchronize()
    return out, lse


def check_case(batch, sq, sk, heads, heads_kv, dim, causal, dtype, config=None,
               softmax_scale=None, window=(None, None), scale=1.0):
    q, k, v, seed = random_qkv(batch, sq, heads, dim, seqlen_k=sk, heads_kv=heads_kv,
                               dtype=dtype, device="cuda", scale=scale)
    out, lse = _run(q, k, v, causal, softmax_scale, config, window)
    ref = attention_reference(q, k, v, causal, softmax_scale, dtype=torch.float64,
                              window_size=window)
    same = attention_reference(q, k, v, causal, softmax_scale, dtype=dtype, window_size=window)
    verdicts = [tolerance_check(out, ref[0], same[0], "out"),
                tolerance_check(lse, ref[1], same[1], "lse", extra_atol=1e-5)]
    ok = all(v.ok for v in verdicts)
    line = (f"b={batch} sq={sq} sk={sk} h={heads}/{heads_kv} d={dim} causal={causal} "
            f"{dtype} {config} window={window} seed={seed}: "
            + "; ".join(str(v).splitlines()[0] for v in verdicts))
    return ok, line


CASES = AWKWARD_CASES + [
    (1, 600, 600, 3, 3, 64, True, BF16),
]


@pytest.mark.parametrize("cfg", [ONE_CTA, TWO_CTA], ids=["1cta", "2cta"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_sm100_fwd_matches_float64_reference(case, cfg):
    ok, line = check_case(*case, config=cfg)
    print(line)
    assert ok, line


def test_sm100_fwd_default_configs():
    for d in (64, 128):
        for causal in (False, True):
            ok, line = check_case(2, 1500, 1500, 4, 2, d, causal, BF16,
                                  config=blackwell_fwd_default(d, causal))
            print(line)
            assert ok, line


def test_sm100_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v, seed = random_qkv(1, 300, 2, 128, seqlen_k=77, dtype=BF16, device="cuda")
    out, lse = _run(q, k, v, causal=True)
    empty = 300 - 77
    assert torch.isneginf(lse[:, :, :empty]).all(), f"seed {seed}: lse {lse[0, 0, :8]}"
    assert (out[:, :empty] == 0).all(), f"seed {seed}"
    assert torch.isfinite(lse[:, :, empty:]).all(), f"seed {seed}"


@pytest.mark.parametrize("cfg", [ONE_CTA, TWO_CTA], ids=["1cta", "2cta"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm100_bitwise_identical_over_20_runs(causal, cfg):
    """A result that moves between runs is a race (a stage or TMEM region reused too early)."""
    q, k, v, seed = random_qkv(2, 1000, 4, 128, seqlen_k=1100, heads_kv=2, dtype=BF16,
                               device="cuda")
    first = _run(q, k, v, causal, config=cfg)
    for run in range(1, 20):
        again = _run(q, k, v, causal, config=cfg)
        for name, a, b in (("out", first[0], again[0]), ("lse", first[1], again[1])):
            n = int((a != b).sum())
            assert n == 0, f"seed {seed} run {run}: {n} {name} elements differ from run 0"


@pytest.mark.parametrize("cfg", [ONE_CTA, TWO_CTA], ids=["1cta", "2cta"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm100_many_tiles_and_phase_wraparound(causal, cfg):
    """8192 keys = 64 K/V tiles per tile (every ring wraps many times); more tiles than SMs
    (the persistent loop walks several per CTA)."""
    ok, line = check_case(2, 8192, 8192, 8, 2, 128, causal, BF16, config=cfg)
    print(line)
    assert ok, line


KNOBS = {
    "no_emulation": dict(exp2_emulation_fraction=0.0),
    "emulate_quarter": dict(exp2_emulation_fraction=0.25),
    "emulate_all": dict(exp2_emulation_fraction=1.0),
    "always_rescale": dict(rescale_threshold=0.0),
    "two_kv_stages": dict(kv_stages=2),
    "not_persistent": dict(persistent=False),
}


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_sm100_every_knob_is_correct(knob):
    cfg = replace(ONE_CTA, **KNOBS[knob])
    for case in [(1, 1000, 1500, 4, 2, 128, True, BF16), (1, 700, 700, 2, 2, 64, False, FP16)]:
        ok, line = check_case(*case, config=cfg)
        print(knob, line)
        assert ok, f"{knob}: {line}"


@pytest.mark.parametrize("window", [(128, 0), (300, 50), (None, 64), (0, 0)])
def test_sm100_sliding_window(window):
    ok, line = check_case(1, 1000, 1200, 2, 1, 128, False, BF16, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("scale,input_scale", [(0.05, 1.0), (1.0, 1.0), (None, 4.0)])
def test_sm100_softmax_scale_and_large_scores(scale, input_scale):
    for causal in (False, True):
        ok, line = check_case(1, 513, 700, 2, 2, 128, causal, BF16, softmax_scale=scale,
                              scale=input_scale)
        print(line)
        assert ok, line


def test_sm100_strided_views_of_a_packed_qkv_tensor():
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(BF16)
    q, k, v = qkv.unbind(dim=2)
    out, lse = _run(q, k, v, causal=True)
    ref = attention_reference(q, k, v, True, dtype=torch.float64)
    same = attention_reference(q, k, v, True, dtype=BF16)
    assert tolerance_check(out, ref[0], same[0], "out").ok


def test_sm100_runs_on_the_current_stream():
    from fa4_final.api.sm100 import attention

    q, k, v, seed = random_qkv(1, 2048, 4, 128, dtype=BF16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = attention(q, k, v, causal=True)
    side.synchronize()
    ref = attention_reference(q, k, v, True, dtype=torch.float64)
    same = attention_reference(q, k, v, True, dtype=BF16)
    assert tolerance_check(out, ref[0], same[0], "out").ok, f"seed {seed}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_tcgen05_primer_one_tile_is_correct(head_dim):
    """Chapter 09's primer: one 128 x 128 tile, every tcgen05 step once."""
    from solutions.ch09_primer import compile_one_tile

    compiled, _ = compile_one_tile(head_dim, keep=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(128, head_dim, generator=g).to(BF16).cuda() for _ in range(3))
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(128, dtype=torch.float32, device="cuda"))
    compiled(q, k, v, out, lse, head_dim**-0.5)
    torch.cuda.synchronize()
    q4, k4, v4 = (t[None, :, None] for t in (q, k, v))
    ref = attention_reference(q4, k4, v4, dtype=torch.float64)
    same = attention_reference(q4, k4, v4, dtype=BF16)
    assert tolerance_check(out[None, :, None], ref[0], same[0], "out").ok
    assert torch.allclose(lse.double(), ref[1][0, 0], atol=1e-3)


def test_sm100_benchmark_script_small():
    proc = subprocess.run([sys.executable, "-m", "measure.blackwell_fwd", "--small"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout, proc.stdout


# --- chapters 09-10's device-code exercises: the primers with the reference pieces -----------
def test_primer_device_exercise_references_on_gpu():
    """09.3 and 09.4's references inside the primer, four tiles against float64 (one whose
    scores overflow exp2 unless the row max is subtracted)."""
    from solutions import ch09_primer as primer
    from solutions import ch09_teaching as T

    ok, lines = T.check_primer_on_gpu(primer.issue_qk, primer.softmax_to_p)
    assert ok, "\n".join(lines)


def test_primer_softmax_without_the_max_fails_on_gpu():
    """The GPU check catches what the CPU check names: exp2 of raw scores overflows."""
    from solutions import ch09_teaching as T
    from tests.exercise_mutations import ch09 as wrong

    ok, lines = T.check_primer_on_gpu(softmax_fn=wrong.softmax_without_max,
                                      cases=[(64, 30.0, 3)])
    assert not ok and "WRONG" in lines[0], lines


def test_pair_primer_device_exercise_references_on_gpu():
    """10.3 and 10.4's references inside the pair primer (a cluster of two, 256 query rows)."""
    from solutions import ch09_primer as primer
    from solutions import ch10_teaching as T10

    ok, lines = T10.check_pair_on_gpu(primer.pair_mma, primer.init_pair_barriers)
    assert ok, "\n".join(lines)
