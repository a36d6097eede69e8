"""fa4_final: a FlashAttention-4 style attention kernel in CuTe DSL with a PyTorch API.

    from fa4_final import flash_attn_func, flash_attn_varlen_func

is a drop-in for ``flash_attn.cute``'s functions of the same names (fa4_final.api.interface says
what is supported); ``fa4_final.register_sdpa()`` puts the same kernels behind PyTorch's
``scaled_dot_product_attention`` (fa4_final.api.sdpa). Four layers, each importing only the
layers below it (hopper/ and blackwell/ are one layer, the architectures, and never import each
other):

    api/        flash_attn_func, flash_attn_varlen_func, the torch custom ops, attention_autograd,
                FA4's _flash_attn_fwd/_bwd for PyTorch's SDPA registration
    runtime/    input checks; one prologue per call (checks, window, scale, backend); dispatch
                (which GPU runs which kernel); one compile path and its cache in memory and on disk;
                decoding's split count, paged-KV checks and the split combine's launch
    hopper/     sm_90a: configs, the forward, the backward and the decode forward (packed GQA
                rows, split-KV, paged KV), host.py (recipes and launches)
    blackwell/  sm_100a: configs, TMEM plan, tcgen05, the forward (1- and 2-CTA) and backward
                (1-CTA and pair), host.py (compiled and checked; never run on a GPU)
    common/     the device code both share: constants, tiles, masks, fragments, the online
                softmax, fast exp2, the schedule, sequence lengths, pipelines as data, register
                plans, timeline, atomics, the backward's pre, post, tiles and dQ order, the
                split-KV combine and the decode's index arithmetic

It stands alone: it imports nothing of the course around it.
"""

from fa4_final.api.interface import flash_attn_func, flash_attn_varlen_func
from fa4_final.api.sdpa import register_sdpa
from fa4_final.common.errors import UnsupportedError

__all__ = ["UnsupportedError", "flash_attn_func", "flash_attn_varlen_func", "register_sdpa"]
