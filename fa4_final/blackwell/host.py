"""The Blackwell kernels' host side: recipes and launches, with the contract of
fa4_final.hopper.host (checked, non-empty inputs; window sides None when unbounded; the scale
resolved; ``plan`` the compiled kernels and the config).

They are compiled and checked on any machine and have never run on a GPU: the dispatch table
does not send a call here yet (fa4_final.runtime.dispatch); the runtime runs them on a B200 when
asked by target (the GPU tests, the course's benchmark).
"""

from __future__ import annotations

from dataclasses import replace

from cutlass import Float32, Int32

from fa4_final.blackwell.config import (
    BlackwellBwdConfig,
    BlackwellFwdConfig,
    blackwell_fwd_default,
)
from fa4_final.common import backward as shared_backward
from fa4_final.common.backward import launch_backward  # noqa: F401  (the contract's backward)
from fa4_final.common.constants import CUTLASS_BY_NAME
from fa4_final.common.errors import UnsupportedError
from fa4_final.common.recipe import Recipe, fake_attention_tensors, fake_stream

ARCH = "sm_100a"


def _check_target(dtype: str, arch: str, varlen: bool, what: str) -> None:
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != ARCH:
        raise UnsupportedError(f"the Blackwell {what} uses tcgen05 and tensor memory: it "
                               f"compiles for arch='{ARCH}' only, got {arch!r}")
    if varlen:
        raise UnsupportedError(f"the Blackwell {what} has no varlen variant")


def fake_forward_args(dtype_name: str, head_dim: int) -> tuple:
    """Fake arguments in the runtime order (q, k, v, out, lse, softmax_scale, window_left,
    window_right, l2_group, max_ctas, stream): symbolic batch, lengths and heads, strides of
    16-byte multiples (TMA), lse float32 (batch, heads, seqlen_q)."""
    q, k, v, o, lse = fake_attention_tensors(CUTLASS_BY_NAME[dtype_name], head_dim)
    return (q, k, v, o, lse, Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1),
            fake_stream())


def forward_recipe(head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                   config: BlackwellFwdConfig | None = None, has_window_left: bool = False,
                   has_window_right: bool = False, varlen: bool = False,
                   has_seqused_k: bool = False, arch: str = ARCH) -> Recipe:
    """BlackwellForward for one (head dim, dtype, masks, config); 1- or 2-CTA by the config."""
    from fa4_final.blackwell.fwd import BlackwellForward

    _check_target(dtype, arch, varlen, "forward")
    cfg = config or blackwell_fwd_default(head_dim, causal)
    if not isinstance(cfg, BlackwellFwdConfig):
        raise TypeError(f"config must be a BlackwellFwdConfig or None, got {type(cfg).__name__}")
    kernel = BlackwellForward(CUTLASS_BY_NAME[dtype], head_dim, causal, cfg,
                              has_window_left=has_window_left,
                              has_window_right=has_window_right)
    return Recipe("fwd", ARCH, {"main": kernel}, lambda role: fake_forward_args(dtype, head_dim),
                  cfg)


def launch_forward(plan, q, k, v, out, lse, causal: bool, softmax_scale: float, window_left,
                   window_right) -> None:
    """One launch of the forward (the module's contract), on the current stream."""
    import torch

    b, _, h, _ = q.shape
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    plan.kernels["main"](q, k, v, out, lse, softmax_scale, window_left or 0, window_right or 0,
                         h * b, sms)


def backward_config(deterministic: bool, config: BlackwellBwdConfig | None):
    cfg = config or BlackwellBwdConfig()
    if not isinstance(cfg, BlackwellBwdConfig):
        raise TypeError(f"config must be a BlackwellBwdConfig or None, got {type(cfg).__name__}")
    return replace(cfg, deterministic=True) if deterministic and not cfg.deterministic else cfg


def backward_recipe(head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                    config: BlackwellBwdConfig | None = None, deterministic: bool = False,
                    has_window_left: bool = False, has_window_right: bool = False,
                    varlen: bool = False, has_seqused_k: bool = False,
                    arch: str = ARCH) -> Recipe:
    """{"pre", "main", "post"}: the shared bwd_pre and bwd_post around the 1-CTA kernel, or the
    pair's (``config.two_cta``), at its tile_m in the shared dQ accumulator order."""
    from fa4_final.blackwell.bwd import BlackwellBackward
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair
    from fa4_final.common.bwd_post import BackwardPost
    from fa4_final.common.bwd_pre import BackwardPre

    _check_target(dtype, arch, varlen, "backward")
    cfg = backward_config(deterministic, config)
    dt = CUTLASS_BY_NAME[dtype]
    cls = BlackwellBackwardPair if cfg.two_cta else BlackwellBackward
    main = cls(dt, head_dim, causal, cfg, has_window_left=has_window_left,
               has_window_right=has_window_right)
    kernels = {"pre": BackwardPre(dt, head_dim, main.tile_m, cfg.deterministic), "main": main,
               "post": BackwardPost(main.dq_layout_owner())}
    return Recipe("bwd", ARCH, kernels,
                  lambda role: shared_backward.fake_backward_args(dtype, head_dim)[role], cfg)
