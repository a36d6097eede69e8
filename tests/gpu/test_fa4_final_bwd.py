"""fa4_final's Hopper backward on an H100/H200 against float64 torch.autograd.

The backward's inputs (out, lse) come from the float64 reference rounded as a forward would
store them, so these tests check the backward alone; test_autograd_end_to_end adds the forward.
dq, dk, dv are filled with NaN before each run: an element the kernels forget fails. The rule
is the course's: max error <= 2 x PyTorch's own error in bf16/fp16 + the rounding slack. Run
with a timeout (a broken barrier protocol hangs rather than fails), e.g.
    timeout 900 python -m pytest tests/gpu/test_fa4_final_bwd.py -m gpu -x -v
`python -m solutions.ch11_bwd_check` prints one line per small case (for compute-sanitizer).
"""

import math
from dataclasses import replace

import pytest
import torch

from fa4_final.hopper.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.runtime.prologue import backward_into
from solutions.ch11_bwd_check import check
from utils.checks import poison_, rounding_atol
from utils.hardware import missing
from utils.reference import random_qkv
from utils.window import visible_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16


def _visible(sq, sk, causal, left, right, device):
    """Where query i sees key j: FA4's reading of causal and window_size (utils.window)."""
    return visible_mask(sq, sk, causal, (left, right), device)


def _attention(q, k, v, visible, scale, dtype):
    """out, lse of attention in ``dtype`` (float64: the yardstick; bf16: PyTorch's own)."""
    h, hk = q.shape[2], k.shape[2]
    qd, kd, vd = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(h // hk, 1), vd.repeat_interleave(h // hk, 1)
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    s = (qd @ kd.transpose(-1, -2)).to(soft) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return (p.to(dtype) @ vd).transpose(1, 2), lse


def _grads(q, k, v, dout, visible, scale, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = _attention(*leaves, visible, scale, dtype)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def _run(q, k, v, dout, causal=False, window=(None, None), deterministic=False, config=None,
         softmax_scale=None):
    """The backward on reference out/lse, into NaN-filled buffers; returns (dq, dk, dv)."""
    sq, sk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    visible = _visible(sq, sk, causal, *window, q.device)
    out, lse = _attention(q, k, v, visible, scale, torch.float64)
    out, lse = out.to(q.dtype).contiguous(), lse.float().contiguous()
    dq, dk, dv = (poison_(torch.empty_like(t)) for t in (q, k, v))
    backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=causal,
                  softmax_scale=softmax_scale, window_size=window, deterministic=deterministic,
                  config=config)
    torch.cuda.synchronize()
    return dq, dk, dv, visible, scale


def _compare(grads, ref, same, dtype):
    """(ok, one line for each of dq, dk, dv): each gradient within 2 x PyTorch's own error in
    ``dtype`` (``same``) + the rounding slack of float64's (``ref``), no NaN."""
    lines, ok = [], True
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref, same):
        err = (g.double() - r).abs()
        nan = int(torch.isnan(g).sum())
        limit = 2 * (s.double() - r).abs().max().item() + rounding_atol(r, dtype) + 1e-4
        worst = tuple(int(i) for i in torch.unravel_index(err.nan_to_num(math.inf).argmax(),
                                                          err.shape))
        good = nan == 0 and err.max().item() <= limit
        ok &= good
        lines.append(f"{name} max|err| {err.max().item():.2e} (limit {limit:.2e}) at {worst}, "
                     f"NaN {nan}")
    return ok, lines


def _check(case, causal, window=(None, None), deterministic=False, config=None, seed=None):
    b, sq, sk, h, hk, d, dtype = case
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda", seed=seed)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.float32).to(dtype)
    got = _run(q, k, v, dout, causal, window, deterministic, config)
    dq, dk, dv, visible, scale = got
    ref = _grads(q, k, v, dout, visible, scale, torch.float64)
    same = _grads(q, k, v, dout, visible, scale, dtype)
    ok, lines = _compare((dq, dk, dv), ref, same, dtype)
    return ok, (f"{case} causal={causal} window={window} det={deterministic} cfg={config} "
                f"seed={seed}: " + "; ".join(lines))


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, dtype)
CASES = [
    (1, 1, 1, 1, 1, 128, BF16),
    (2, 17, 17, 2, 1, 64, FP16),
    (1, 129, 129, 4, 4, 128, BF16),
    (1, 1000, 1000, 2, 1, 64, BF16),
    (1, 100, 1000, 2, 2, 128, BF16),  # seqlen_q < seqlen_k
    (1, 1000, 100, 2, 2, 128, BF16),  # seqlen_q > seqlen_k: causal rows that see no key
    (3, 257, 513, 8, 2, 128, BF16),  # GQA, 4 query heads per kv head
    (2, 300, 77, 6, 1, 128, FP16),  # MQA
    (1, 2049, 2047, 2, 2, 128, BF16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_matches_float64_autograd(case, causal):
    ok, line = _check(case, causal)
    print(line)
    assert ok, line


CONFIGS = {  # every knob of HopperBwdConfig at D = 128
    "m64": HopperBwdConfig(tile_m=64),
    "m80_swap": HopperBwdConfig(tile_m=80, dq_swap_ab=True),
    "m64_ds1": HopperBwdConfig(tile_m=64, stages_ds=1),
    "m64_q1": HopperBwdConfig(tile_m=64, stages_q=1, stages_ds=1),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_config(name, causal):
    ok, line = _check((2, 333, 301, 4, 2, 128, BF16), causal, config=CONFIGS[name])
    print(line)
    assert ok, line


def _same_bits_and_float64(d: int, causal: bool, knob: str, seed: int) -> None:
    """The default build with HopperBwdConfig ``knob`` on: float64's answer in the default mode
    (GQA, odd lengths, a partial last tile), and in the deterministic mode dQ, dK and dV bit
    for bit the build without the knob (the knob moves reads, not arithmetic)."""
    cfg = replace(hopper_bwd_default(d, causal), **{knob: True})
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, config=cfg)
    print(line)
    assert ok, line
    q, k, v, _ = random_qkv(2, 1300, 8, d, seqlen_k=1500, heads_kv=2, dtype=BF16,
                            device="cuda", seed=seed)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    det = replace(cfg, deterministic=True)
    got = _run(q, k, v, dout, causal, deterministic=True, config=det)[:3]
    want = _run(q, k, v, dout, causal, deterministic=True,
                config=replace(det, **{knob: False}))[:3]
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name} differs in {int((a != b).sum())} elements"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_rows_early_gives_the_same_bits(d, causal):
    """HopperBwdConfig.rows_early (Note [Per-query values before the wait]): lse and delta
    read into registers earlier; D = 256 is the swapped step (dkv_swap_ab), whose default it
    is, so there the comparison is with the lazy reads."""
    _same_bits_and_float64(d, causal, "rows_early", seed=5)


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, True)])
def test_rows_shuffled_gives_the_same_bits(d, causal):
    """HopperBwdConfig.rows_shuffled (Note [Per-query values by shuffle]): lse and delta
    loaded an eighth per lane group and passed on by shuffles."""
    _same_bits_and_float64(d, causal, "rows_shuffled", seed=6)


@pytest.mark.parametrize("window", [(64, None), (32, 16), (None, 40), (200, 0), (None, -5),
                                    (-7, None), (50, -20), (-3, 30)])
def test_sliding_windows(window):
    ok, line = _check((1, 700, 900, 2, 1, 128, BF16), False, window=window)
    print(line)
    assert ok, line


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_is_correct(d, causal):
    ok, line = _check((2, 1000, 777, 8, 2, d, BF16), causal, deterministic=True)
    print(line)
    assert ok, line


@pytest.mark.parametrize("window", [(None, None), (100, None), (None, 0), (None, -4)])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_is_bitwise_reproducible(d, window):
    """20 runs, GQA: the same bits every time (dQ adds in a fixed order; dK and dV are summed
    over the group inside one CTA)."""
    q, k, v, seed = random_qkv(2, 1500, 8, d, seqlen_k=1300, heads_kv=2, dtype=BF16,
                               device="cuda", seed=7)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    first = _run(q, k, v, dout, window=window, deterministic=True)[:3]
    for run in range(19):
        again = _run(q, k, v, dout, window=window, deterministic=True)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), (f"run {run + 2}: {name} differs in "
                                       f"{int((a != b).sum())} elements (seed {seed})")


def test_rows_and_keys_nobody_sees():
    # causal, seqlen_q > seqlen_k: the first 900 rows see no key, so their dQ is exactly 0
    q, k, v, _ = random_qkv(1, 1000, 2, 128, seqlen_k=100, dtype=BF16, device="cuda")
    dout = torch.randn_like(q)
    dq, dk, dv, _, _ = _run(q, k, v, dout, causal=True)
    assert (dq[:, :900] == 0).all() and torch.isfinite(dq).all()
    # a left window with seqlen_k >> seqlen_q: keys before 1900 - 20 are seen by no query
    q, k, v, _ = random_qkv(1, 100, 2, 128, seqlen_k=2000, dtype=BF16, device="cuda")
    dout = torch.randn_like(q)
    dq, dk, dv, _, _ = _run(q, k, v, dout, window=(20, 0))
    assert (dk[:, :1800] == 0).all() and (dv[:, :1800] == 0).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_softmax_scale_and_fp16():
    q, k, v, _ = random_qkv(1, 300, 2, 64, dtype=FP16, device="cuda", scale=0.5)
    dout = torch.randn_like(q)
    dq, dk, dv, visible, scale = _run(q, k, v, dout, causal=True, softmax_scale=0.3)
    ref = _grads(q, k, v, dout, visible, 0.3, torch.float64)
    same = _grads(q, k, v, dout, visible, 0.3, FP16)
    for g, r, s in zip((dq, dk, dv), ref, same):
        limit = 2 * (s.double() - r).abs().max() + rounding_atol(r, FP16) + 1e-4
        assert (g.double() - r).abs().max() <= limit


def test_autograd_end_to_end():
    from fa4_final.api.autograd import attention_autograd

    for causal, det in ((False, False), (True, True)):
        q, k, v, seed = random_qkv(2, 333, 4, 128, seqlen_k=444, heads_kv=2, dtype=BF16,
                                   device="cuda")
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = attention_autograd(q, k, v, causal=causal, deterministic=det)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), dout)
        visible = _visible(333, 444, causal, None, None, q.device)
        ref = _grads(q, k, v, dout, visible, 128**-0.5, torch.float64)
        same = _grads(q, k, v, dout, visible, 128**-0.5, BF16)
        for g, r, s in zip(got, ref, same):
            limit = 2 * (s.double() - r).abs().max() + rounding_atol(r, BF16) + 1e-3
            assert (g.double() - r).abs().max() <= limit, (causal, det, seed)


def test_check_entry_point():
    assert check()


def test_default_configs_are_the_tested_ones():
    assert hopper_bwd_default(128, False) == replace(CONFIGS["m80_swap"])
    assert hopper_bwd_default(128, True) == CONFIGS["m64"]
