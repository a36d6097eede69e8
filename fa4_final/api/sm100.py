"""The Blackwell kernels behind the course's common signature, on a B200: compiled and checked
on any machine, never run on a GPU yet, so the dispatch table does not choose them; these
functions ask for their target by name.

    attention(q, k, v, causal=False, softmax_scale=None, config=None) -> (out, lse)
    compile_only(head_dim=128, dtype="bf16", causal=False, config=None, **flags) -> Artifacts
"""

from __future__ import annotations

from fa4_final.api.interface import compile_only as _compile_only
from fa4_final.blackwell.host import ARCH
from fa4_final.runtime.prologue import forward


def attention(q, k, v, causal=False, softmax_scale=None, config=None):
    """(out, lse) of the sm_100a forward, eagerly."""
    return forward(q, k, v, causal, softmax_scale, config=config, target=ARCH)


def compile_only(head_dim: int = 128, dtype: str = "bf16", causal: bool = False, config=None,
                 **flags):
    """The compiled sm_100a forward's artifacts (PTX, cubin, SASS, resources)."""
    return _compile_only(ARCH, head_dim, dtype, causal, config, **flags)
