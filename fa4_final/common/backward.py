"""The backward's host side that both architectures share: the three kernels' fake arguments,
the workspace and the three launches.

Both backwards run bwd_pre (delta, lse in log2 units, the zeroed dQ accumulator and turn
counters), their main kernel (dK, dV and the dQ accumulator) and bwd_post (dQ), with the same
arguments: the Blackwell kernel writes the Hopper kernel's accumulator order (common.dq_order)
at its own tile_m.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass import Float32, Int32

from fa4_final.common.constants import CUTLASS_BY_NAME
from fa4_final.common.recipe import fake_stream, fake_tensor


def fake_backward_args(dtype_name: str, head_dim: int, has_dlse: bool = False,
                       head_dim_v: int | None = None) -> dict:
    """Fake arguments of each kernel (role -> tuple): symbolic batch, lengths and heads;
    ``has_dlse``: bwd_pre takes the lse's gradient, like lse (Note [The lse gradient folded]);
    ``head_dim_v``: v, out, dout and dv with that many columns (head_dim if None)."""
    dv_dim = head_dim if head_dim_v is None else head_dim_v
    dt = CUTLASS_BY_NAME[dtype_name]
    div = 128 // dt.width  # 16-byte strides (TMA, 128-bit loads), in elements
    b, sq, sk, h, hk, sq_pad, slab, m_blocks = (cute.sym_int() for _ in range(8))
    like_q = lambda: fake_tensor(dt, (b, sq, h, head_dim), divisibility=div)  # noqa: E731
    like_k = lambda: fake_tensor(dt, (b, sk, hk, head_dim), divisibility=div)  # noqa: E731
    like_o = lambda: fake_tensor(dt, (b, sq, h, dv_dim), divisibility=div)  # noqa: E731
    like_v = lambda: fake_tensor(dt, (b, sk, hk, dv_dim), divisibility=div)  # noqa: E731
    lse = fake_tensor(Float32, (b, h, sq), divisibility=1)
    lse2 = fake_tensor(Float32, (b, h, sq_pad), divisibility=4)
    delta = fake_tensor(Float32, (b, h, sq_pad), divisibility=4)
    accum = fake_tensor(Float32, (b, h, slab), divisibility=4)
    # its own extents: without the deterministic mode the caller passes a (1, 1, 1) dummy
    turn = fake_tensor(Int32, (cute.sym_int(), cute.sym_int(), m_blocks), divisibility=1)
    q, out, dout, dq = like_q(), like_o(), like_o(), like_q()
    k, v, dk, dv = like_k(), like_v(), like_k(), like_v()
    dlse = (fake_tensor(Float32, (b, h, sq), divisibility=1),) if has_dlse else ()
    return {
        "pre": (out, dout, lse, lse2, delta, accum, turn, fake_stream(), *dlse),
        "main": (q, k, v, dout, lse2, delta, accum, dk, dv, turn, Float32(1.0), Int32(0),
                 Int32(0), fake_stream()),
        "post": (accum, dq, Float32(1.0), fake_stream()),
    }


_TURN_DUMMIES: dict = {}


def _turn_dummy(device) -> torch.Tensor:
    """The (1, 1, 1) turn buffer of a launch outside the deterministic mode: never read or
    written, so one per device serves every call."""
    dummy = _TURN_DUMMIES.get(device)
    if dummy is None:
        dummy = _TURN_DUMMIES[device] = torch.empty((1, 1, 1), dtype=torch.int32, device=device)
    return dummy


def launch_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, causal: bool,
                    softmax_scale: float, left, right, dlse=None) -> None:
    """The three launches of a dense backward, the hosts' contract (``plan``: its compiled
    kernels by role and its config, whose tile_m pads the workspace) on checked, non-empty
    inputs; window sides None when unbounded (causal: right = 0, its mask compiled in).
    ``dlse``: the lse's gradient, like lse, float32, for a plan whose bwd_pre was built to take
    it (Note [The lse gradient folded] in fa4_final.common.bwd_pre)."""
    kernels, cfg = plan.kernels, plan.config
    b, sq, h, d = q.shape
    m_blocks = -(-sq // cfg.tile_m)
    sq_pad = m_blocks * cfg.tile_m
    lse2 = q.new_empty((b, h, sq_pad), dtype=torch.float32)
    delta = q.new_empty((b, h, sq_pad), dtype=torch.float32)
    # dq_copies accumulators and turn counters per query tile (Note [dQ copies] in
    # fa4_final.common.bwd_tiles); a config without the knob has one
    copies = getattr(cfg, "dq_copies", 1)
    accum = q.new_empty((b, h, sq_pad * d * copies), dtype=torch.float32)
    if cfg.deterministic:
        turn = torch.empty((b, h, m_blocks * copies), dtype=torch.int32, device=q.device)
    else:
        turn = _turn_dummy(q.device)
    kernels["pre"](out, dout, lse, lse2, delta, accum, turn,
                   *(() if dlse is None else (dlse.float().contiguous(),)))
    kernels["main"](q, k, v, dout, lse2, delta, accum, dk, dv, turn, softmax_scale, left or 0,
                    right or 0)
    # dq_first_store: bwd_post reads the turn counters to skip copies nobody wrote
    kernels["post"](accum, dq, softmax_scale,
                    *((turn,) if getattr(cfg, "dq_first_store", False) else ()))


def sink_gradient(learnable_sink, lse, out, dout, dlse=None):
    """d loss / d learnable_sink (heads,) in the sink's dtype, FA4's formula
    (Note [Learnable sink] in fa4_final.common.softmax): -sum over a head's rows of
    exp(sink - lse) * (rowsum(dout * out) - dlse), a row with lse = -inf counting exp(...) as
    1. Dense: lse (b, h, s_q), out and dout (b, s_q, h, D); varlen: lse (h, total_q), out and
    dout (total_q, h, D); dlse like lse or None. The kernels need no change for the sink (P =
    exp(s - lse) with the forward's lse is already right), so this runs as a few torch ops
    beside them, in float32; it reads out and dout once more than bwd_pre does."""
    delta = (out.float() * dout.float()).sum(-1).transpose(-1, -2)  # like lse
    if dlse is not None:
        delta = delta - dlse.float()
    heads = learnable_sink.shape[0]
    sink = learnable_sink.float().view(heads, 1) if lse.dim() == 2 else \
        learnable_sink.float().view(1, heads, 1)
    p_sink = torch.where(torch.isneginf(lse), torch.ones_like(lse), torch.exp(sink - lse))
    rows = (1,) if lse.dim() == 2 else (0, 2)
    return (-(p_sink * delta).sum(dim=rows)).to(learnable_sink.dtype)
