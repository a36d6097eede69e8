"""The tolerance rule must pass a correct low-precision kernel and fail wrong ones."""

import torch

from utils.checks import check_attention, error_report, poison_, tolerance_check
from utils.reference import attention_reference, random_qkv


def good_kernel(q, k, v, causal=False, softmax_scale=None):
    """What a correct bf16 kernel does: float32 accumulation, bf16 output."""
    out, lse = attention_reference(q, k, v, causal, softmax_scale, dtype=torch.float32)
    return out.to(q.dtype), lse.float()


def no_rescale_kernel(q, k, v, causal=False, softmax_scale=None):
    """A classic bug: tiles of 16 keys summed without rescaling by exp(m_old - m_new)."""
    d = q.shape[-1]
    scale = softmax_scale or d**-0.5
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = qf @ kf.transpose(-1, -2) * scale
    out = torch.zeros_like(qf)
    denom = torch.zeros(*s.shape[:-1], 1)
    for j in range(0, s.shape[-1], 16):
        blk = s[..., j : j + 16]
        p = torch.exp(blk - blk.amax(-1, keepdim=True))  # local max only: the bug
        out += p @ vf[:, :, j : j + 16]
        denom += p.sum(-1, keepdim=True)
    out = (out / denom).transpose(1, 2).to(q.dtype)
    return out, torch.logsumexp(s, -1)


def test_correct_kernel_passes():
    q, k, v, seed = random_qkv(2, 100, 2, 64)
    verdicts = check_attention(good_kernel, q, k, v, causal=True)
    assert all(v_.passed for v_ in verdicts), seed


def test_wrong_kernel_fails_with_a_report():
    q, k, v, _ = random_qkv(1, 64, 2, 32, scale=2.0)
    try:
        check_attention(no_rescale_kernel, q, k, v)
    except AssertionError as exc:
        assert "FAIL" in str(exc) and "max |err|" in str(exc)
    else:
        raise AssertionError("the tolerance rule accepted a kernel that skips the rescale")


def test_nan_never_passes():
    ref = torch.randn(4, 4, dtype=torch.float64)
    val = ref.to(torch.bfloat16)
    val[1, 2] = float("nan")
    verdict = tolerance_check(val, ref, ref.to(torch.bfloat16), "out", factor=1e9)
    assert not verdict.passed and verdict.kernel.nan_count == 1


def test_error_report_finds_worst_position():
    ref = torch.zeros(3, 5, dtype=torch.float64)
    val = ref.clone()
    val[2, 3] = 0.5
    rep = error_report(val, ref)
    assert rep.worst_index == (2, 3) and rep.max_abs == 0.5 and rep.nan_count == 0


def test_infinities_must_match():
    ref = torch.tensor([float("-inf"), 1.0], dtype=torch.float64)
    assert error_report(ref.float(), ref).inf_mismatch == 0
    assert error_report(torch.tensor([0.0, 1.0]), ref).inf_mismatch == 1


def test_poison_fills_nan():
    t = poison_(torch.empty(3, 3))
    assert torch.isnan(t).all()


def _into(fn):
    def attention_into(q, k, v, out, lse, causal, softmax_scale, config):
        o, l_ = fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
        out.copy_(o)
        lse.copy_(l_)

    return attention_into


def test_one_line_verdicts_for_kernel_buffers():
    from utils.checks import check_random_case, run_into_poisoned

    no_wait = lambda label: None  # noqa: E731 (CPU: nothing to wait for)
    ok, line = check_random_case(_into(good_kernel), 1, 70, 30, 4, 2, 32, True, torch.bfloat16,
                                 wait=no_wait, device="cpu")
    assert ok and line.startswith("ok") and "empty rows 0/-inf True" in line

    def forgets_last_row(q, k, v, causal=False, softmax_scale=None):
        out, lse = good_kernel(q, k, v, causal, softmax_scale)
        out[:, -1] = float("nan")
        return out, lse

    q, k, v, _ = random_qkv(1, 40, 2, 32)
    ok, line = run_into_poisoned(_into(forgets_last_row), q, k, v, label="nan row", wait=no_wait)
    assert not ok and line.startswith("FAIL nan row") and "NaN 64" in line


def test_run_cases_counts_failures_and_prints_each(capsys):
    from utils.checks import run_cases

    seen = []

    def check(a, b, config=None):
        seen.append((a, b, config))
        return a < b, f"case {a} {b}"

    assert run_cases(check, [((1, 2), None), ((3, 2), "cfg")]) == 1
    out = capsys.readouterr().out
    assert "case 1 2 [" in out and "1/2 cases passed" in out
    assert seen == [(1, 2, None), (3, 2, "cfg")]
