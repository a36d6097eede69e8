"""A quick self-check of fa4_final's Hopper backward on an H100/H200, small enough for
compute-sanitizer: this backward on the out and lse of a float64 torch forward (so the backward is
checked alone), against float64 torch.autograd, one line per case.

    python -m solutions.ch11_bwd_check [--small]

Chapter 11 runs it in a GPU cell; tests/gpu/h200_session.sh's bwd-check step runs it under
compute-sanitizer; tests/gpu/test_fa4_final_bwd.py holds it to passing.
"""

from __future__ import annotations

import math
import sys

import torch

from fa4_final.runtime.prologue import backward

# (batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, causal)
SMALL_CASES = [(1, 100, 130, 2, 1, 64, True), (1, 129, 129, 2, 2, 128, False)]
CHECK_CASES = SMALL_CASES + [(2, 200, 333, 4, 2, 128, True), (1, 300, 77, 2, 1, 128, True),
                             (1, 257, 513, 4, 4, 64, False)]


def check(cases=None, deterministic=(False, True), seed: int = 0) -> bool:
    """Each case, with and without the deterministic mode: one line each; whether all passed
    (max |error| <= 2e-2 of the largest gradient, at least 2e-2, and no NaN)."""
    ok_all = True
    for b, sq, sk, h, hk, d, causal in cases or CHECK_CASES:
        g = torch.Generator(device="cpu").manual_seed(seed)
        q, k, v, dout = (torch.randn(b, s, n, d, generator=g).to("cuda", torch.bfloat16)
                         for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
        out, lse, ref = _reference(q, k, v, dout, causal)
        for det in deterministic:
            grads = backward(q, k, v, out, lse, dout, causal=causal, deterministic=det)
            torch.cuda.synchronize()
            errs = [(g_.double() - r).abs().max().item() for g_, r in zip(grads, ref)]
            scales = [r.abs().max().item() for r in ref]
            nan = any(torch.isnan(g_).any().item() for g_ in grads)
            ok = not nan and all(e <= 2e-2 * max(s, 1.0) for e, s in zip(errs, scales))
            ok_all &= ok
            print(f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} "
                  f"causal={causal} deterministic={det}: max|err| dq {errs[0]:.2e} dk "
                  f"{errs[1]:.2e} dv {errs[2]:.2e} (max |grad| {max(scales):.2e})", flush=True)
    return ok_all


def _reference(q, k, v, dout, causal):
    """(out in q's dtype, lse float32, float64 autograd (dq, dk, dv)) of plain attention."""
    h, hk = q.shape[2], k.shape[2]
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    qd, kd, vd = (t.transpose(1, 2) for t in leaves)
    kd, vd = kd.repeat_interleave(h // hk, 1), vd.repeat_interleave(h // hk, 1)
    s = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    o = (p @ vd).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, dout.double())
    return o.detach().to(q.dtype).contiguous(), lse.detach().float().contiguous(), grads


if __name__ == "__main__":
    sys.exit(0 if check(SMALL_CASES if "--small" in sys.argv else None) else 1)
