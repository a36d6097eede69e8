"""FA4's seqused_q in the Hopper varlen forward (Note [Used query rows] in
fa4_final.common.seqlens), on an H100/H200, against float64.

Packed sequences whose padding rows (past seqused_q) hold NaN in q, so a padding row that
leaked into a result would show; out and lse are filled with a sentinel first, and the padding
rows must still hold it afterwards (FA4 leaves them unwritten), the used rows must match
float64 (utils.checks.tolerance_check) with the causal diagonal placed by the used length.
Cases: a sequence with no used row, a tile wholly in padding, seqused_k beside it, D = 128 and
D = 192 with dv = 128 (O over Q), a learnable sink; and the varlen backward with seqused_q
(Note [Used query rows in the backward] in fa4_final.hopper.bwd). The API still refuses
seqused_q: these tests are what lifts that refusal. Run (about 5 minutes, most of it compiling
8 kernels):
    timeout 600 python -m pytest tests/gpu/test_seqused_q.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_softcap_sinks import _same_precision
from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

SENTINEL = 7.0
# (rows_q, used_q, rows_k, used_k) per sequence
SEQS = [(1, 1, 64, 64), (300, 0, 100, 100), (1000, 257, 1300, 900), (129, 129, 5, 5),
        (513, 500, 77, 77)]


@pytest.mark.parametrize("d, dv, causal, with_sink", [
    (128, 128, True, False), (128, 128, False, True), (192, 128, True, False),
    (192, 128, False, False)], ids=str)
def test_used_rows_match_float64_and_padding_is_untouched(d, dv, causal, with_sink):
    from fa4_final.hopper.host import forward_recipe, launch_varlen_forward
    from fa4_final.runtime.compile import compiled

    h, hk, dtype = 4, 2, torch.bfloat16
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(s[0] for s in SEQS), sum(s[2] for s in SEQS)
    q = torch.randn(total_q, h, d, generator=g).to("cuda", dtype)
    k = torch.randn(total_k, hk, d, generator=g).to("cuda", dtype)
    v = torch.randn(total_k, hk, dv, generator=g).to("cuda", dtype)
    sink = (torch.randn(h, generator=g) + 1).cuda() if with_sink else None
    cu_q, cu_k, oq, ok_ = [0], [0], 0, 0
    for rows_q, used_q, rows_k, _ in SEQS:
        q[oq + used_q:oq + rows_q] = float("nan")  # padding: must never reach a result
        oq, ok_ = oq + rows_q, ok_ + rows_k
        cu_q.append(oq), cu_k.append(ok_)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    out = torch.full((total_q, h, dv), SENTINEL, dtype=dtype, device="cuda")
    lse = torch.full((h, total_q), SENTINEL, dtype=torch.float32, device="cuda")
    plan = compiled(forward_recipe, d, "bf16", causal, None, False, False, True, True,
                    "sm_90a", 0.0, "fp32" if with_sink else None, dv, True)
    launch_varlen_forward(plan, q, k, v, as_i32(cu_q), as_i32(cu_k),
                          as_i32([s[3] for s in SEQS]), max(s[0] for s in SEQS),
                          max(s[2] for s in SEQS), out, lse, causal, d ** -0.5, None,
                          0 if causal else None, sink, as_i32([s[1] for s in SEQS]))
    label = f"d{d}/{dv} causal={causal} sink={with_sink} seed={seed}"
    checks.wait_for_gpu(label)
    for i, (rows_q, used_q, _, used_k) in enumerate(SEQS):
        oq, ok_ = cu_q[i], cu_k[i]
        pad_out, pad_lse = out[oq + used_q:oq + rows_q], lse[:, oq + used_q:oq + rows_q]
        assert bool((pad_out == SENTINEL).all()) and bool((pad_lse == SENTINEL).all()), \
            f"{label}: sequence {i}'s padding rows were written"
        if used_q == 0:
            continue
        qs = q[None, oq:oq + used_q]
        ks, vs = k[None, ok_:ok_ + used_k], v[None, ok_:ok_ + used_k]
        ref_out, ref_lse = attention_reference_features(qs, ks, vs, causal, d ** -0.5, 0.0,
                                                        sink)
        # PyTorch's own precision: S from a 16-bit matmul, softmax in float32, P in 16 bits
        same_out, same_lse = _same_precision(qs, ks, vs, causal, d ** -0.5, 0.0, sink)
        on_out = checks.tolerance_check(out[None, oq:oq + used_q], ref_out, same_out, "out")
        on_lse = checks.tolerance_check(lse[None, :, oq:oq + used_q], ref_lse, same_lse,
                                        "lse", extra_atol=checks.LSE_ATOL)
        assert on_out.passed and on_lse.passed, f"{label} sequence {i}\n{on_out}\n{on_lse}"


@pytest.mark.parametrize("causal", [True, False])
def test_backward_with_seqused_q_matches_float64_per_sequence(causal):
    """Note [Used query rows in the backward]: dq, dk, dv of the used rows against float64
    autograd sequence by sequence; the padding rows of q and dout hold finite random values
    (the Note's condition), and dq's padding rows come out 0."""
    from fa4_final.hopper.host import backward_recipe, launch_varlen_backward
    from fa4_final.runtime.compile import compiled

    h, hk, d, dtype = 4, 2, 128, torch.bfloat16
    scale = d ** -0.5
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(s[0] for s in SEQS), sum(s[2] for s in SEQS)
    q = torch.randn(total_q, h, d, generator=g).to("cuda", dtype)
    k = torch.randn(total_k, hk, d, generator=g).to("cuda", dtype)
    v = torch.randn(total_k, hk, d, generator=g).to("cuda", dtype)
    dout = torch.randn(total_q, h, d, generator=g).to("cuda", dtype)
    out = torch.zeros(total_q, h, d, dtype=dtype, device="cuda")
    lse = torch.zeros(h, total_q, dtype=torch.float32, device="cuda")
    cu_q, cu_k, wants, sames = [0], [0], [], []
    for rows_q, used_q, rows_k, used_k in SEQS:
        oq, ok_ = cu_q[-1], cu_k[-1]
        if used_q:  # out and lse of the used rows from float64, as the forward stores them
            leaves = [t.detach().double().requires_grad_(True) for t in
                      (q[None, oq:oq + used_q], k[None, ok_:ok_ + used_k],
                       v[None, ok_:ok_ + used_k])]
            o64, l64 = attention_reference_features(*leaves, causal, scale)
            wants.append(torch.autograd.grad((o64 * dout[None, oq:oq + used_q].double()).sum(),
                                             leaves))
            same_in = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
            so, _ = _same_precision(*same_in, causal, scale, 0.0, None)
            sames.append(torch.autograd.grad((so.float() * dout[None, oq:oq + used_q].float())
                                             .sum(), same_in))
            out[oq:oq + used_q] = o64[0].detach().to(dtype)
            lse[:, oq:oq + used_q] = l64[0].detach().float()
        else:
            wants.append(None), sames.append(None)
        cu_q.append(oq + rows_q), cu_k.append(ok_ + rows_k)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    dq, dk, dv = (checks.poisoned_empty(*t.shape, dtype=dtype, device="cuda") for t in (q, k, v))
    plan = compiled(backward_recipe, d, "bf16", causal, None, False, False, False, True, True,
                    "sm_90a", 0.0, False, True)
    launch_varlen_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, as_i32(cu_q),
                           as_i32(cu_k), as_i32([s[3] for s in SEQS]), max(s[0] for s in SEQS),
                           max(s[2] for s in SEQS), causal, scale, None,
                           0 if causal else None, seqused_q=as_i32([s[1] for s in SEQS]))
    label = f"seqused_q backward causal={causal} seed={seed}"
    checks.wait_for_gpu(label)
    failed = []
    for i, (rows_q, used_q, rows_k, used_k) in enumerate(SEQS):
        oq, ok_ = cu_q[i], cu_k[i]
        if not bool((dq[oq + used_q:oq + rows_q] == 0).all()):
            failed.append(f"sequence {i}: dq's padding rows are not 0")
        if bool((dk[ok_ + used_k:ok_ + rows_k] != 0).any()):
            failed.append(f"sequence {i}: dk past seqused_k is not 0")
        if wants[i] is None:
            if bool((dk[ok_:ok_ + rows_k] != 0).any()) or bool((dv[ok_:ok_ + rows_k] != 0).any()):
                failed.append(f"sequence {i} has no used query row: dk, dv must be 0")
            continue
        got = (dq[None, oq:oq + used_q], dk[None, ok_:ok_ + used_k], dv[None, ok_:ok_ + used_k])
        for n, x, r, p in zip(("dq", "dk", "dv"), got, wants[i], sames[i]):
            verdict = checks.tolerance_check(x, r, p, f"sequence {i} {n}")
            if not verdict.passed:
                failed.append(str(verdict))
    assert not failed, label + "\n" + "\n".join(failed)
