"""The lse's gradient folded into bwd_pre (Note [The lse gradient folded] in
fa4_final.common.bwd_pre), on an H100/H200: one backward call with dlse against torch.autograd
of a float64 loss that uses both out and lse.

dq, dk, dv are filled with NaN first; the rule is the course's (utils.checks.tolerance_check)
against PyTorch's own precision. Dense (causal with rows that see no key, GQA, non-causal at
D = 64 and 128, deterministic) and varlen. The API still runs the lse's gradient as a second
backward call; these tests are what lets it take the folded one. Run (about 3 minutes):
    timeout 600 python -m pytest tests/gpu/test_lse_fold.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_softcap_sinks import _same_precision
from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

# (batch, seqlen_q, seqlen_k, heads, heads_kv, D, causal, deterministic)
CASES = [(2, 300, 77, 4, 2, 128, True, False), (2, 257, 513, 8, 2, 128, False, False),
         (1, 1000, 1000, 2, 1, 64, True, False), (2, 129, 200, 4, 4, 64, False, True)]


def _loss_grads(q, k, v, causal, scale, dout, dlse):
    """float64 autograd of (out * dout).sum() + (lse * dlse).sum() (rows with lse = -inf left
    out), and the same in PyTorch's own precision."""
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out64, lse64 = attention_reference_features(*leaves64, causal, scale)
    fin = torch.isfinite(lse64)
    want = torch.autograd.grad((out64 * dout.double()).sum()
                               + (lse64.where(fin, 0.0) * dlse.double()).sum(), leaves64)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    same_out, same_lse = _same_precision(*leaves, causal, scale, 0.0, None)
    same = torch.autograd.grad((same_out.float() * dout.float()).sum()
                               + (same_lse.where(fin, 0.0) * dlse).sum(), leaves)
    return out64, lse64, want, same


@pytest.mark.parametrize("case", CASES, ids=str)
def test_folded_backward_matches_float64(case):
    from fa4_final.hopper.host import backward_recipe, launch_backward
    from fa4_final.runtime.compile import compiled

    b, sq, sk, h, hk, d, causal, det = case
    dtype, scale = torch.bfloat16, d ** -0.5
    q, k, v, seed = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype,
                               device="cuda")
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
    dlse = torch.randn(b, h, sq, generator=g).cuda()
    out64, lse64, want, same = _loss_grads(q, k, v, causal, scale, dout, dlse)
    out, lse = out64.detach().to(dtype), lse64.detach().float()
    dq, dk, dv = (checks.poisoned_empty(*t.shape, dtype=dtype, device="cuda") for t in (q, k, v))
    plan = compiled(backward_recipe, d, "bf16", causal, None, det, False, False, False, False,
                    "sm_90a", 0.0, True)
    launch_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, None,
                    0 if causal else None, dlse=dlse)
    label = f"{case} seed={seed}"
    checks.wait_for_gpu(label)
    failed = [str(v_) for v_ in (checks.tolerance_check(x, r, p, n) for n, x, r, p in
                                 zip(("dq", "dk", "dv"), (dq, dk, dv), want, same))
              if not v_.passed]
    assert not failed, f"{label}\n" + "\n".join(failed)


def test_folded_varlen_backward_matches_float64_per_sequence():
    from fa4_final.hopper.host import backward_recipe, launch_varlen_backward
    from fa4_final.runtime.compile import compiled

    lens_q, lens_k, h, hk, d = [37, 300, 1], [300, 77, 5], 4, 2, 128
    dtype, scale = torch.bfloat16, d ** -0.5
    parts = [random_qkv(1, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=dtype, device="cuda")
             for sq, sk in zip(lens_q, lens_k)]
    g = torch.Generator().manual_seed(parts[0][3] + 1)
    wants, sames, outs, lses, douts, dlses = [], [], [], [], [], []
    for (q, k, v, _), sq in zip(parts, lens_q):
        dout = torch.randn(1, sq, h, d, generator=g).to("cuda", dtype)
        dlse = torch.randn(1, h, sq, generator=g).cuda()
        out64, lse64, want, same = _loss_grads(q, k, v, True, scale, dout, dlse)
        wants.append(want), sames.append(same), douts.append(dout[0]), dlses.append(dlse[0])
        outs.append(out64.detach().to(dtype)[0]), lses.append(lse64.detach().float()[0])
    q, k, v = (torch.cat([p[i][0] for p in parts]) for i in range(3))
    out, dout = torch.cat(outs), torch.cat(douts)
    lse, dlse = torch.cat(lses, dim=1), torch.cat(dlses, dim=1)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    dq, dk, dv = (checks.poisoned_empty(*t.shape, dtype=dtype, device="cuda") for t in (q, k, v))
    plan = compiled(backward_recipe, d, "bf16", True, None, False, False, False, True, False,
                    "sm_90a", 0.0, True)
    launch_varlen_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, cu(lens_q), cu(lens_k),
                           None, max(lens_q), max(lens_k), True, scale, None, 0, dlse=dlse)
    checks.wait_for_gpu("varlen lse fold")
    oq = ok_ = 0
    failed = []
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        got = (dq[oq:oq + sq][None], dk[ok_:ok_ + sk][None], dv[ok_:ok_ + sk][None])
        for n, x, r, p in zip(("dq", "dk", "dv"), got, wants[i], sames[i]):
            verdict = checks.tolerance_check(x, r, p, f"sequence {i} {n}")
            if not verdict.passed:
                failed.append(str(verdict))
        oq, ok_ = oq + sq, ok_ + sk
    assert not failed, "\n".join(failed)
