"""Chapter 05's Hopper kernel on an H100/H200 against the float64 reference.

Every failure message carries the case, the seed, the max error against its tolerance, the worst
position and the NaN count. Outputs are filled with NaN before each run, so an element the kernel
forgets to write fails the test. Run in a subprocess with a timeout: a broken mbarrier protocol
hangs instead of failing, e.g.
    timeout 600 python -m pytest tests/gpu/test_ch05_flash_hopper.py -m gpu -x -v
(`python -m solutions.ch05_flash_hopper --check` prints one line per case as it goes.)
"""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from solutions import ch05_flash_hopper as ch05
from utils.reference import random_qkv


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs compute capability 9.0 (H100/H200), found {major}.{minor}"
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]

BF16, FP16 = torch.bfloat16, torch.float16


def _run(q, k, v, causal, softmax_scale=None, config=None):
    """One launch into NaN-filled buffers."""
    b, sq, h, _ = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=q.device)
    ch05.attention_into(q, k, v, out, lse, causal, softmax_scale, config)
    torch.cuda.synchronize()
    return out, lse


def test_small_causal_case():
    ok, line = ch05.check_case(*ch05.SMALL_CASE)
    print(line)
    assert ok, line


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype)
CASES = [
    (1, 1, 1, 1, 1, 128, False, BF16),
    (2, 17, 17, 2, 1, 64, True, FP16),
    (1, 129, 129, 4, 4, 128, True, BF16),
    (1, 1000, 1000, 2, 1, 64, False, BF16),
    (1, 4097, 4097, 1, 1, 128, True, FP16),
    (1, 100, 1000, 2, 2, 128, True, BF16),  # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 1000, 100, 2, 2, 128, True, BF16),  # seqlen_q > seqlen_k: 900 rows see no key
    (1, 1000, 100, 2, 2, 64, False, FP16),
    (3, 257, 513, 8, 2, 128, False, BF16),  # GQA, 4 query heads per kv head
    (2, 300, 77, 6, 1, 128, True, BF16),  # MQA
    (1, 1024, 1024, 2, 1, 256, True, BF16),
    (1, 77, 300, 2, 2, 256, False, FP16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_matches_float64_reference(case):
    ok, line = ch05.check_case(*case)
    print(line)
    assert ok, line


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v, seed = random_qkv(1, 300, 2, 128, seqlen_k=77, dtype=BF16, device="cuda")
    out, lse = _run(q, k, v, causal=True)
    empty = 300 - 77  # query i sees keys j <= i - 223
    assert torch.isneginf(lse[:, :, :empty]).all(), f"seed {seed}: lse {lse[0, 0, :8]}"
    assert (out[:, :empty] == 0).all(), f"seed {seed}: max |out| {out[:, :empty].abs().max()}"
    assert torch.isfinite(lse[:, :, empty:]).all(), f"seed {seed}"


@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_identical_over_20_runs(causal):
    """A result that moves between runs means a race (a stage reused too early, O written
    before Q's TMA finished, ...), even if each run is within tolerance."""
    q, k, v, seed = random_qkv(2, 1000, 4, 128, seqlen_k=1100, heads_kv=2, dtype=BF16,
                               device="cuda")
    first_out, first_lse = _run(q, k, v, causal)
    for run in range(1, 20):
        out, lse = _run(q, k, v, causal)
        diff = (out.float() - first_out.float()).abs()
        n_out = int((out != first_out).sum())
        n_lse = int((lse != first_lse).sum())
        assert n_out == 0 and n_lse == 0, (
            f"seed {seed} run {run}: {n_out} out / {n_lse} lse elements differ from run 0, "
            f"max diff {diff.max().item():.3e} at {tuple(torch.nonzero(diff == diff.max())[0])}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_many_ctas_and_phase_wraparound(causal):
    """8192 keys = 64 K/V tiles per CTA: each 2-stage ring wraps 32 times, so every phase bit
    flips many times; 64 query tiles x 4 heads = 256 CTAs, more than one wave on 132 SMs."""
    ok, line = ch05.check_case(1, 8192, 8192, 4, 2, 128, causal, BF16)
    print(line)
    assert ok, line


KNOBS = {
    "no_overlap": dict(intra_wg_overlap=False),
    "no_pingpong": dict(pingpong=False),
    "no_overlap_no_pingpong": dict(intra_wg_overlap=False, pingpong=False),
    "one_stage": dict(num_stages=1),
    "three_stages": dict(num_stages=3),
    "one_consumer_wg": dict(num_consumer_wgs=1),
}


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_every_knob_is_correct(knob):
    cfg = replace(ch05.default_config(128), **KNOBS[knob])
    for case in [(1, 1000, 1500, 4, 2, 128, True, BF16), (1, 700, 700, 2, 2, 128, False, BF16)]:
        ok, line = ch05.check_case(*case, config=cfg)
        print(knob, line)
        assert ok, f"{knob}: {line}"


def test_three_consumer_warpgroups():
    cfg = ch05.HopperConfig(tile_n=96, num_consumer_wgs=3)  # 192 x 96 tiles, D = 64
    for causal in (False, True):
        ok, line = ch05.check_case(1, 1000, 1234, 2, 1, 64, causal, BF16, config=cfg)
        print(line)
        assert ok, line


@pytest.mark.parametrize("scale,input_scale", [(0.05, 1.0), (1.0, 1.0), (None, 4.0)])
def test_softmax_scale_and_large_scores(scale, input_scale):
    q, k, v, seed = random_qkv(1, 513, 2, 128, seqlen_k=700, dtype=BF16, device="cuda",
                               scale=input_scale)
    for causal in (False, True):
        out, lse = _run(q, k, v, causal, softmax_scale=scale)
        ok, line = ch05.compare(q, k, v, out, lse, causal, scale,
                                label=f"scale={scale} inputs x{input_scale} seed={seed}")
        print(line)
        assert ok, line


def test_strided_views_of_a_packed_qkv_tensor():
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(BF16)
    q, k, v = qkv.unbind(dim=2)  # strides (3*h*d*s, 3*h*d, d, 1): not contiguous, 16 B aligned
    assert not q.is_contiguous()
    out, lse = _run(q, k, v, causal=True)
    ok, line = ch05.compare(q, k, v, out, lse, True, label="packed qkv views")
    assert ok, line


def test_runs_on_the_current_stream():
    q, k, v, seed = random_qkv(1, 2048, 4, 128, dtype=BF16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = ch05.attention(q, k, v, causal=True)
    side.synchronize()
    ok, line = ch05.compare(q, k, v, out, lse, True, label=f"side stream seed={seed}")
    assert ok, line


def test_command_line_small():
    proc = subprocess.run(
        [sys.executable, "-m", "solutions.ch05_flash_hopper", "--small"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1/1 cases passed" in proc.stdout, proc.stdout
