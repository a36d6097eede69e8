"""A minimal torch.autograd.Function over fa4_final's forward and backward, so gradients can be
tested end to end. The package interface wires the full one (custom op, torch.compile).

    out = attention_autograd(q, k, v, causal=False, softmax_scale=None, deterministic=False)

The forward saves q, k, v, out and lse (float32, (batch, heads, seqlen_q)); the backward runs
fa4_final.backward on them. ``deterministic`` makes the gradients bitwise reproducible.
"""

from __future__ import annotations

import torch

from fa4_final.backward import backward
from fa4_final.interface import forward


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic):
        out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # the kernels read dO through TMA: last dim contiguous, 16-byte strides
        dout = dout.contiguous()
        dq, dk, dv = backward(q, k, v, out, lse, dout, causal=ctx.causal,
                              softmax_scale=ctx.softmax_scale,
                              deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None


def attention_autograd(q, k, v, causal=False, softmax_scale=None, deterministic=False):
    """Attention's output, differentiable in q, k, v through fa4_final's kernels."""
    return _Attention.apply(q, k, v, bool(causal), softmax_scale, bool(deterministic))
