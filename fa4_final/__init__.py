"""fa4_final: a FlashAttention-4 style attention kernel in CuTe DSL with a PyTorch API.

    from fa4_final import flash_attn_func, flash_attn_varlen_func

is a drop-in for ``flash_attn.cute``'s functions of the same names (see fa4_final.interface for
what is supported). It stands alone (it imports neither the course's ``utils`` nor
``solutions``). Each module is taught in a chapter of the course:

    interface    flash_attn_func, flash_attn_varlen_func: the public API         chapter 13
    ops          the torch custom ops: fake shapes for torch.compile, autograd   chapter 13
    checks       input checks with errors that say what is accepted              chapter 13
    run, varlen  eager calls of the kernels; varlen's per-sequence loop (ref)  chapter 13
    seqlens      a tile's sequence and rows: dense batch or packed varlen       chapter 13
    dispatch     which GPU runs which kernel; the support table                  chapter 13
    cache        the compile cache in memory and on disk                         chapter 13
    compile      one compile path from fake tensors; artifacts for compile-only  chapters 03, 08
    config       frozen per-kernel configurations and tuned defaults            chapter 08
    constants    LOG2_E, LN_2, warp sizes, dtype maps                           chapter 03
    tiles        which key tiles a query tile visits; which need a mask         chapters 04, 08
    mask         masking scores in registers                                    chapter 04
    fragments    views of mma.sync / wgmma register fragments                   chapters 04, 05
    softmax      the online softmax; exp2 emulation and rescale-threshold knobs  chapters 05-07
    fast_math    2^x on the FMA units                                           chapter 06
    scheduler    tile order; static, tabled and dynamic schedules; varlen's map  chapters 08, 12
    timeline     in-kernel phase stamps for a Gantt chart (a debug build)        chapter 08
    hopper.wgmma smem tile layouts, the attention tiled MMAs, one wgmma group     chapters 05, 08
    hopper.fwd   the warp-specialised ping-pong persistent forward (sm_90a)     chapter 08
    hopper.launch  compile through the cache and launch the Hopper kernels      chapter 13
    hopper.bwd   the backward: K, V stationary, five wgmma per step (sm_90a)     chapter 11
    bwd_pre      delta = rowsum(dO * O), lse in log2 units, zeroed dQ accumulator chapter 11
    bwd_post     dQ from its float32 accumulator                                chapter 11
    bwd_tiles    which query tiles a key tile visits; deterministic turn order  chapter 11
    atomics      bulk float32 adds into global memory; turn counters            chapter 11
    backward     the backward's torch entry points (backward_into, backward)     chapter 11
    autograd     attention_autograd: flash_attn_func's output, differentiable    chapter 11
    blackwell    sm_100a: TMEM plan, tcgen05, roles; the forward (1- and 2-CTA)  chapters 09-12
                 and the backward, 1- and 2-CTA (compiled and checked, never run on a GPU)
"""

from fa4_final.common.errors import UnsupportedError
from fa4_final.dispatch import support_table
from fa4_final.interface import (
    attention,
    compile_only,
    flash_attn_func,
    flash_attn_varlen_func,
    forward,
    forward_into,
)

__all__ = ["UnsupportedError", "attention", "compile_only", "flash_attn_func",
           "flash_attn_varlen_func", "forward", "forward_into", "support_table"]
