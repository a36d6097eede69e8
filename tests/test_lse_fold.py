"""The lse's gradient folded into bwd_pre (Note [The lse gradient folded] in
fa4_final.common.bwd_pre), checked with no GPU.

Fast: the Note's algebra in float64 on fresh random inputs (causal, GQA, rows that see no key):
dS = P (dP - (delta - dlse)) through the backward's formulas gives the gradients torch.autograd
takes of a loss that uses both out and lse; dropping the dlse term does not.
Slow: bwd_pre compiled for sm_90a with has_dlse, dense and varlen: its PTX subtracts one float
a row more than the plain build's and nothing else grows (no spill); a plain build given a
dlse tensor refuses it by name; the default backward's SASS is unchanged (tests/fa4_final_sass).
Nothing here runs on a GPU: tests/gpu/test_lse_fold.py does.
"""

from __future__ import annotations

import pytest
import torch

from utils.reference import (
    attention_backward_features,
    attention_reference_features,
    random_qkv,
)


@pytest.mark.parametrize("causal", [False, True])
def test_folded_delta_gives_autograds_gradients(causal):
    q, k, v, seed = random_qkv(2, 37, 4, 16, seqlen_k=29, heads_kv=2, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = attention_reference_features(q, k, v, causal)
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    finite = torch.isfinite(lse)  # causal 37 x 29: the first 8 rows see no key
    loss = (out * dout).sum() + (lse.where(finite, 0.0) * dlse).sum()
    want = torch.autograd.grad(loss, (q, k, v))
    o, lse_d = out.detach(), lse.detach()
    got = attention_backward_features(q.detach(), k.detach(), v.detach(), o, dout, lse_d,
                                      causal, dlse=dlse.where(finite, 0.0))[:3]
    for name, a, b in zip("qkv", got, want):
        assert torch.allclose(a, b, atol=1e-10, rtol=0), (name, float((a - b).abs().max()))
    plain = attention_backward_features(q.detach(), k.detach(), v.detach(), o, dout, lse_d,
                                        causal)[:3]
    assert not torch.allclose(plain[0], want[0], atol=1e-3), "dlse must change dq"


def _pre(varlen, has_dlse):
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    return artifacts(backward_recipe(128, "bf16", True, varlen=varlen, has_dlse=has_dlse),
                     roles=["pre"])["pre"]


@pytest.mark.slow
@pytest.mark.parametrize("varlen", [False, True])
def test_bwd_pre_with_dlse_compiles_and_subtracts_it(varlen):
    plain, folded = _pre(varlen, False), _pre(varlen, True)
    assert folded.spills == 0 and folded.frame_bytes == 0, folded.resources()
    assert plain.ptx.count("sub.f32") == 0 < folded.ptx.count("sub.f32")
    assert folded.registers <= plain.registers + 4


@pytest.mark.slow
def test_a_plain_bwd_pre_refuses_dlse():
    from fa4_final.common.backward import fake_backward_args
    from fa4_final.hopper.config import hopper_bwd_default
    from fa4_final.hopper.host import _backward_kernels
    from fa4_final.runtime.compile import compile_kernel

    cfg = hopper_bwd_default(128, True)
    pre = _backward_kernels("bf16", 128, True, False, False, cfg, False, False)["pre"]
    with pytest.raises(Exception, match="has_dlse"):
        compile_kernel(pre, *fake_backward_args("bf16", 128, True)["pre"], arch="sm_90a")
