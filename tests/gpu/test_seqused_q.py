"""FA4's seqused_q in the Hopper varlen forward (Note [Used query rows] in
fa4_final.common.seqlens), on an H100/H200, against float64.

Packed sequences whose padding rows (past seqused_q) hold NaN in q, so a padding row that
leaked into a result would show; out and lse are filled with a sentinel first, and the padding
rows must still hold it afterwards (FA4 leaves them unwritten), the used rows must match
float64 (utils.checks.tolerance_check) with the causal diagonal placed by the used length.
Cases: a sequence with no used row, a tile wholly in padding, seqused_k beside it, D = 128 and
D = 192 with dv = 128 (O over Q), a learnable sink. The API still refuses seqused_q: these tests
are what lifts that refusal. Run (about 3 minutes, most of it compiling 4 kernels):
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
