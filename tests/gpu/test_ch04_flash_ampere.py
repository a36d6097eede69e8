"""Chapter 04's FlashAttention-2 kernel (sm_80 and later) against the float64 reference.

    pytest -m gpu -s tests/gpu/test_ch04_flash_ampere.py               # all, about a minute
    pytest -m gpu -s tests/gpu/test_ch04_flash_ampere.py -k "not sweep"  # default tiles only

Most of the time goes into compiling (a few seconds per dtype, head dim, mask and tile); speed
is measured by ``python -m measure.ch04_sweep``, not here.

Every comparison uses fresh random inputs (the seed is in the message), outputs filled with NaN
before the kernel runs (a forgotten element cannot pass) and the course's tolerance rule
(utils.checks via ch04.compare: max error <= 2 x PyTorch's error in the same precision + rounding
slack; lse within 1e-3 of float64; rows that see no key exactly 0 and -inf). A failure message
names the case, config, max error and where, and the NaN count. A kernel that hangs ends the
run after a deadline (wait_for_gpu) instead of blocking forever.
"""

from dataclasses import replace

import pytest
import torch

from solutions import ch04_flash_ampere as ch04
from utils.checks import poison_, wait_for_gpu
from utils.hardware import missing
from utils.reference import random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_80") is not None, reason=str(missing("sm_80"))),
]

BF16, FP16 = torch.bfloat16, torch.float16


def _run(q, k, v, causal, softmax_scale=None, config=None, what=""):
    """One launch into NaN-filled buffers, synchronised with a deadline."""
    b, sq, h, d = q.shape
    out = poison_(torch.empty(b, sq, h, d, dtype=q.dtype, device=q.device))
    lse = poison_(torch.empty(b, h, sq, dtype=torch.float32, device=q.device))
    ch04.attention_into(q, k, v, out, lse, causal, softmax_scale, config)
    wait_for_gpu(what)
    return out, lse


def _case_id(c):
    b, sq, sk, h, hk, d, causal, dtype = c
    return f"b{b}-q{sq}-k{sk}-h{h}/{hk}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


# ----------------------------------------------------------------------------------------------
# The default tiles: every dtype, head dim and mask, on awkward shapes

SHAPES = [
    # (batch, seqlen_q, seqlen_k, heads, heads_kv)
    (1, 1, 1, 2, 2),
    (2, 17, 17, 3, 1),
    (1, 128, 128, 4, 4),
    (1, 1000, 1000, 2, 1),
    (1, 4097, 4097, 1, 1),
    (2, 17, 1000, 2, 2),  # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 1000, 17, 2, 2),  # seqlen_q > seqlen_k: causal rows 0..982 see no key
    (1, 1, 4097, 4, 2),
    (1, 4097, 128, 1, 1),
]
# Every shape with both head dims and both masks; the dtype alternates from shape to shape, so
# each of the 8 (dtype, head dim, mask) kernels meets at least four shapes in 36 runs, not 72.
CASES = [
    (*shape, d, causal, (BF16, FP16)[i % 2])
    for i, shape in enumerate(SHAPES)
    for d in ch04.SUPPORTED_HEAD_DIMS
    for causal in (False, True)
]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    ok, line = ch04.check_case(*case)
    print(line)
    assert ok, line


def test_small_cases_of_the_command_line():
    """What ``python -m solutions.ch04_flash_ampere --small`` (and compute-sanitizer) runs."""
    for case in ch04.SMALL_CASES:
        ok, line = ch04.check_case(*case)
        print(line)
        assert ok, line


def test_rows_that_see_no_key_give_zero_and_minus_inf():
    q, k, v, seed = random_qkv(1, 300, 2, 128, seqlen_k=77, dtype=BF16, device="cuda")
    out, lse = _run(q, k, v, causal=True, what="empty rows")
    empty = 300 - 77  # query i sees keys j <= i - 223
    assert torch.isneginf(lse[:, :, :empty]).all(), f"seed {seed}: lse {lse[0, 0, :8]}"
    assert (out[:, :empty] == 0).all(), f"seed {seed}: max |out| {out[:, :empty].abs().max()}"
    assert torch.isfinite(lse[:, :, empty:]).all(), f"seed {seed}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale, input_scale", [(0.05, 1.0), (1.0, 1.0), (None, 6.0)])
def test_softmax_scale_and_large_scores(scale, input_scale, causal):
    """Scores up to ~hundreds: exp2 overflows unless the running max is subtracted."""
    q, k, v, seed = random_qkv(1, 333, 4, 128, seqlen_k=555, heads_kv=2, dtype=BF16,
                               device="cuda", scale=input_scale)
    label = f"scale={scale} inputs x{input_scale} causal={causal} seed={seed}"
    ok, line = ch04.run_and_compare(q, k, v, causal, scale, label=label)
    print(line)
    assert ok, line


@pytest.mark.parametrize("d", ch04.SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_mqa_and_strided_views(d):
    """heads_kv = 1 (MQA); q, k, v stored (batch, heads, seqlen, dim) and passed as
    (batch, seqlen, heads, dim) views, whose strides are not a contiguous tensor's."""
    q, k, v, seed = random_qkv(2, 300, 8, d, seqlen_k=411, heads_kv=1, dtype=BF16, device="cuda")
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    for causal in (False, True):
        ok, line = ch04.run_and_compare(q, k, v, causal, label=f"MQA strided d={d} seed={seed}")
        print(line)
        assert ok, line


def test_strided_views_of_a_packed_qkv_tensor():
    b, s, h, d = 2, 333, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(BF16)
    q, k, v = qkv.unbind(dim=2)  # strides (3*h*d*s, 3*h*d, d, 1): not contiguous, 16 B aligned
    ok, line = ch04.run_and_compare(q, k, v, True, label="packed qkv views")
    assert ok, line


def test_runs_on_the_current_stream():
    q, k, v, seed = random_qkv(1, 700, 4, 128, seqlen_k=900, dtype=BF16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = ch04.attention(q, k, v, causal=True)
        wait_for_gpu("attention on a side stream")
    ok, line = ch04.compare(q, k, v, out, lse, True, label=f"side stream seed={seed}")
    assert ok, line


def test_attention_allocates_its_outputs():
    q, k, v, seed = random_qkv(3, 65, 2, 64, seqlen_k=97, dtype=FP16, device="cuda")
    out, lse = ch04.attention(q, k, v)
    wait_for_gpu("attention()")
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (3, 2, 65) and lse.dtype == torch.float32
    ok, line = ch04.compare(q, k, v, out, lse, False, label=f"attention() seed={seed}")
    assert ok, line


@pytest.mark.parametrize("d", ch04.SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bitwise_identical_over_20_runs(d, causal):
    """A result that moves between runs means a race (a buffer refilled before every warp is
    done reading it, O staged over Q too early, ...), even if each run is within tolerance."""
    q, k, v, seed = random_qkv(2, 1000, 4, d, seqlen_k=1029, heads_kv=2, dtype=BF16,
                               device="cuda")
    first_out, first_lse = _run(q, k, v, causal, what=f"determinism d={d} run 0")
    for run in range(1, 20):
        out, lse = _run(q, k, v, causal, what=f"determinism d={d} run {run}")
        n_out, n_lse = int((out != first_out).sum()), int((lse != first_lse).sum())
        diff = (out.float() - first_out.float()).abs()
        assert n_out == 0 and n_lse == 0, (
            f"d={d} causal={causal} seed {seed} run {run}: {n_out} out / {n_lse} lse elements "
            f"differ from run 0, max diff {diff.max().item():.3e}"
        )
    ok, line = ch04.compare(q, k, v, first_out, first_lse, causal, label=f"seed={seed}")
    assert ok, line


@pytest.mark.parametrize("case", [(2, 1000, 1029, 4, 2, 128, False, BF16),
                                  (1, 4097, 1000, 2, 2, 128, True, FP16),  # rows see no key
                                  (1, 300, 4097, 2, 1, 128, True, BF16)], ids=_case_id)
def test_skipping_the_rescale_changes_no_bit(case):
    """Note [Skipping the rescale]: when the warp vote says no row grew, every factor is exactly
    1, so out and lse must equal the always-rescale kernel's bit for bit."""
    b, sq, sk, h, hk, d, causal, dtype = case
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype, device="cuda")
    always = ch04.SM90_D128_TILE
    skip = replace(always, skip_rescale=True)
    out, lse = _run(q, k, v, causal, config=always, what="always rescale")
    out_s, lse_s = _run(q, k, v, causal, config=skip, what="skip rescale")
    assert torch.equal(out, out_s) and torch.equal(lse, lse_s), (
        f"seed {seed}: {int((out != out_s).sum())} out elements differ")
    ok, line = ch04.compare(q, k, v, out_s, lse_s, causal, label=f"seed={seed}")
    assert ok, line


@pytest.mark.parametrize("d", ch04.SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
def test_many_ctas_and_long_kv_loop(d):
    """8192 keys: 128-256 KV steps per CTA; 64 query tiles x 4 heads = 256 CTAs, more than one
    wave on 132 SMs."""
    for causal in (False, True):
        ok, line = ch04.check_case(1, 8192, 8192, 4, 2, d, causal, BF16)
        print(line)
        assert ok, line


@pytest.mark.parametrize("d", ch04.SUPPORTED_HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_default_kernel_spills_nothing_on_this_gpu(d, causal):
    """tests/test_ch04_compile.py checks sm_80 and sm_90a with no GPU; this reads the cubin of
    the kernel that actually ran here (compiled for this GPU's own architecture)."""
    q, k, v, _ = random_qkv(1, 70, 2, d, dtype=BF16, device="cuda")
    _run(q, k, v, causal, what=f"resources d={d}")
    config = ch04.default_config(d, causal, ch04.device_arch("cuda"), "bf16")  # attention()'s
    res = ch04.launched_resources(d, causal, config)
    assert res is not None and 0 < res.registers <= 255, res
    assert res.frame_bytes == 0, f"d={d} causal={causal}: {res.frame_bytes} B of stack: {res}"


# ----------------------------------------------------------------------------------------------
# Every tile the chapter sweeps


SWEEP = [(d, c) for d, configs in ch04.SWEEP_CONFIGS.items() for c in configs
         if c != ch04.default_config(d)]


def _tile_id(item):
    d, c = item
    return f"d{d}-" + ch04.config_label(c).replace(" ", "-")


@pytest.mark.parametrize("item", SWEEP, ids=_tile_id)
def test_sweep_tile_is_correct(item):
    """The other tiles of the sweep, once each: causal (every mask path, a partial last KV tile,
    GQA) on one moderate shape; measure.ch04_sweep checks each tile again, non-causal, before
    timing."""
    d, config = item
    ok, line = ch04.check_case(2, 300, 517, 4, 2, d, True, BF16, config=config)
    print(line)
    assert ok, line
