"""The varlen backward's host side: the three kernels' varlen variants compiled once, the padded
workspace, three launches. Chapter 13.

    varlen_backward_launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                           seqused_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left, window_right, deterministic)

Inputs arrive checked (fa4_final.varlen.varlen_backward_into). Like the dense backward
(fa4_final.backward): bwd_pre (delta, lse_log2, zeroed dQ accumulator and turn counters), the
main kernel (dK, dV, the dQ accumulator), bwd_post (dQ), each a compile-time varlen variant of
the dense kernel (Note [Varlen backward] in fa4_final.hopper.bwd), over the packed tensors given
as a batch of one. The workspace is padded per sequence to whole query tiles (Note [Varlen dQ
accumulator] in fa4_final.common.bwd_tiles): sized from shapes alone, so nothing waits for the GPU.
"""

from __future__ import annotations

import torch

from fa4_final.common.bwd_tiles import dq_accum_tiles
from fa4_final.common.constants import CUTLASS_BY_NAME, DTYPE_NAMES
from fa4_final.common.errors import UnsupportedError
from fa4_final.compile import compile_roles, fake_tensor
from fa4_final.config import HopperBwdConfig

ARCH = "sm_90a"
_COMPILED: dict = {}  # compile_varlen_backward's arguments -> the three compiled kernels


def _kernels(dtype_name, head_dim, causal, has_left, has_right, has_seqused_k, cfg):
    from fa4_final.common.bwd_post import VarlenBackwardPost
    from fa4_final.common.bwd_pre import VarlenBackwardPre
    from fa4_final.hopper.bwd import HopperVarlenBackward

    dt = CUTLASS_BY_NAME[dtype_name]
    main = HopperVarlenBackward(dt, head_dim, causal, cfg, has_window_left=has_left,
                                has_window_right=has_right, has_seqused_k=has_seqused_k)
    pre = VarlenBackwardPre(dt, head_dim, cfg.tile_m, cfg.deterministic)
    return {"pre": pre, "main": main, "post": VarlenBackwardPost(main)}


def _fake_args(dtype_name: str, head_dim: int, has_seqused_k: bool):
    """The dense kernels' fake arguments (fa4_final.backward: their batch entry 0 is the packed
    batch of one) plus the offsets, int32."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from fa4_final.backward import _fake_args as dense_fake_args

    dense = dense_fake_args(dtype_name, head_dim)
    cu_q, cu_k = (fake_tensor(Int32, (cute.sym_int(),)) for _ in range(2))
    used_k = fake_tensor(Int32, (cute.sym_int(),)) if has_seqused_k else None
    out, dout, lse, lse2, delta, accum, turn, stream = dense["pre"]
    q, k, v, _, _, _, _, dk, dv, _, _, _, _, _ = dense["main"]
    _, dq, _, _ = dense["post"]
    return {
        "pre": (out, dout, lse, lse2, delta, accum, turn, cu_q, stream),
        "main": (q, k, v, dout, lse2, delta, accum, dk, dv, turn, cu_q, cu_k, used_k,
                 Float32(1.0), Int32(0), Int32(0), stream),
        "post": (accum, dq, cu_q, Float32(1.0), stream),
    }


def compile_varlen_backward(arch: str = ARCH, head_dim: int = 128, dtype: str = "bf16",
                            causal: bool = False, config: HopperBwdConfig | None = None,
                            deterministic: bool = False, has_window_left: bool = False,
                            has_window_right: bool = False, has_seqused_k: bool = False,
                            keep: bool = False):
    """Compile the varlen backward's three kernels for ``arch`` with fake tensors (no GPU).
    Returns ({"pre", "main", "post"} -> compiled, {...} -> artifacts or None), as
    fa4_final.backward.compile_backward."""
    from fa4_final.backward import _config

    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != ARCH:
        raise UnsupportedError(f"the Hopper varlen backward compiles for arch='{ARCH}' only, "
                               f"got {arch!r}")
    cfg = _config(head_dim, causal, deterministic, config)
    memo = (arch, head_dim, dtype, bool(causal), cfg, bool(has_window_left),
            bool(has_window_right), bool(has_seqused_k))
    if not keep and memo in _COMPILED:
        return _COMPILED[memo], dict.fromkeys(_COMPILED[memo])
    kernels = _kernels(dtype, head_dim, causal, has_window_left, has_window_right,
                       has_seqused_k, cfg)
    compiled, artifacts = compile_roles(
        kernels, lambda role: _fake_args(dtype, head_dim, has_seqused_k)[role], "varlen_bwd",
        arch, keep)
    if not keep:
        _COMPILED[memo] = compiled
    return compiled, artifacts


def compile_only(arch: str = ARCH, head_dim: int = 128, dtype: str = "bf16",
                 causal: bool = False, config: HopperBwdConfig | None = None,
                 deterministic: bool = False, **flags) -> dict:
    """The compiled varlen backward's artifacts (PTX, SASS, resources) per kernel."""
    return compile_varlen_backward(arch, head_dim, dtype, causal, config, deterministic,
                                   keep=True, **flags)[1]


def workspace_shapes(total_q: int, batch: int, heads: int, head_dim: int, tile_m: int,
                     deterministic: bool) -> dict:
    """Shapes of lse_log2, delta, the dQ accumulator and the turn counters: one slab per padded
    query tile and head (Note [Varlen dQ accumulator]); a (1, 1, 1) dummy of turns when not
    deterministic."""
    tiles = dq_accum_tiles(total_q, batch, tile_m)
    rows = tiles * tile_m
    return {"lse2": (1, heads, rows), "delta": (1, heads, rows),
            "accum": (1, heads, rows * head_dim),
            "turn": (1, heads, tiles) if deterministic else (1, 1, 1)}


def varlen_backward_launch(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                           seqused_k, max_seqlen_q, max_seqlen_k, causal: bool,
                           softmax_scale: float, window_left, window_right,
                           deterministic: bool = False, config: HopperBwdConfig | None = None):
    """The varlen backward in three launches on checked inputs (window sides None when
    unbounded): q, out, dout, dq (total_q, h, d), k, v, dk, dv (total_k, h_kv, d), lse (h,
    total_q). ``max_seqlen_*`` are not needed (the grids are counted from shapes)."""
    from fa4_final.backward import _config

    total_q, h, d = q.shape
    total_k = k.shape[0]
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:  # no query row: every key's gradient is 0
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    if total_k == 0:  # no key anywhere (a TMA descriptor cannot have an empty extent)
        dq.zero_()
        return
    if seqused_k is not None:  # keys past seqused_k belong to no key tile (Note [Varlen bwd.])
        dk.zero_()
        dv.zero_()
    cfg = _config(d, causal, deterministic, config)
    cfg.check(d)
    has_right = window_right is not None and not causal
    kernels, _ = compile_varlen_backward(ARCH, d, DTYPE_NAMES[q.dtype], causal, cfg,
                                         has_window_left=window_left is not None,
                                         has_window_right=has_right,
                                         has_seqused_k=seqused_k is not None)
    shapes = workspace_shapes(total_q, batch, h, d, cfg.tile_m, cfg.deterministic)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse2, delta, accum = (torch.empty(shapes[n], **f32) for n in ("lse2", "delta", "accum"))
    turn = torch.empty(shapes["turn"], dtype=torch.int32, device=q.device)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    used = None if seqused_k is None else seqused_k.contiguous()
    kernels["pre"](out.unsqueeze(0), dout.unsqueeze(0), lse.unsqueeze(0), lse2, delta, accum,
                   turn, cu_q)
    kernels["main"](q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dout.unsqueeze(0), lse2,
                    delta, accum, dk.unsqueeze(0), dv.unsqueeze(0), turn, cu_q, cu_k, used,
                    softmax_scale, window_left or 0, window_right or 0)
    kernels["post"](accum, dq.unsqueeze(0), cu_q, softmax_scale)

