"""``attention_autograd``: attention's output, differentiable in q, k, v, for benchmarks and
tests. It is ``flash_attn_func`` (the custom ops of api.ops, whose registered autograd runs the
backward) returning the output alone.

    out = attention_autograd(q, k, v, causal=False, softmax_scale=None, deterministic=False)
"""

from __future__ import annotations

from fa4_final.api.interface import flash_attn_func


def attention_autograd(q, k, v, causal=False, softmax_scale=None, deterministic=False):
    """Attention's output; ``deterministic`` makes the gradients bitwise reproducible."""
    out, _ = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=bool(causal),
                             deterministic=bool(deterministic))
    return out
