"""The eager calls under the custom ops: one prologue, then the backend of the GPU.

Every entry point (dense and varlen, forward and backward) checks its tensors and then runs the
one prologue, ``prepare``: the window normalised (FA4's reading of ``causal`` and
``window_size``: sides None when unbounded, causal with right = 0), the softmax scale resolved
(its default written here once), and the backend picked once per device. What follows is the
backend's contract (fa4_final.runtime.dispatch): checked, non-empty inputs, sides, a scale.

``forward_into`` and ``backward_into`` write into buffers the caller owns (tests pass NaN-filled
ones to prove every element is written). Empty problems never reach a kernel: no query rows is
nothing to do, no key gives out = 0 and lse = -inf (a row that sees no key), dq = 0.
``target="sm_100a"`` runs the Blackwell kernels on a B200 although the dispatch table does not
choose them yet (the GPU tests and the benchmark of those kernels).

FA4's ``softcap`` (a float, 0.0: none) and ``learnable_sink`` ((heads,) or None) are keywords of
every entry point here, checked before anything runs (runtime.pending.check_features; both
have left the gate of Note [Pending features]); the forward's rows that see no key get lse =
the sink, as FA4. The sink's gradient needs no kernel: common.backward.sink_gradient, which the
autograd formula calls (api.ops), so the backward entry points take the softcap only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fa4_final.runtime.checks import check_grads, check_inputs, check_outputs, normalise_window
from fa4_final.runtime.dispatch import Backend, backend_for, backend_for_target, wired
from fa4_final.runtime.pending import (
    check_features,
    check_lse_fold,
    refuse_backward_head_dims,
)


def resolve_scale(head_dim: int, softmax_scale) -> float:
    """The softmax scale a call means: ``softmax_scale``, or 1 / sqrt(head_dim) when None."""
    return head_dim**-0.5 if softmax_scale is None else float(softmax_scale)


@dataclass(frozen=True)
class Prepared:
    """What the prologue resolved for one call."""

    backend: Backend | None  # None: no device asked (a trace, or the checks alone)
    causal: bool
    left: int | None
    right: int | None
    scale: float


_BACKENDS: dict = {}


def cached_backend(device) -> Backend:
    """``backend_for(device)``, looked up once per device (it reads the device's compute
    capability); the function is in the key, so a replaced backend_for is asked again."""
    key = (backend_for, device)
    backend = _BACKENDS.get(key)
    if backend is None:
        backend = _BACKENDS[key] = backend_for(device)
    return backend


def prepare(head_dim: int, causal, softmax_scale, window_size, device=None,
            target: str | None = None) -> Prepared:
    """The prologue: the window normalised, the scale resolved, and for a ``device`` its
    backend (``target``: that target's row, wired or not)."""
    causal, left, right = normalise_window(causal, window_size)
    backend = None
    if target is not None:
        backend = wired(backend_for_target(target))
    elif device is not None:
        backend = cached_backend(device)
    return Prepared(backend, causal, left, right, resolve_scale(head_dim, softmax_scale))


def device_arch(device) -> str:
    """The kernel target for ``device`` ("sm_90a"), or UnsupportedError naming what runs."""
    return backend_for(device).target


# ----------------------------------------------------------------------------------------------
# dense


def forward_into(q, k, v, out, lse, causal=False, softmax_scale=None, window_size=(None, None),
                 config=None, target: str | None = None, *, softcap=0.0, learnable_sink=None):
    """Run the forward writing into ``out`` (like q with v's head dim) and ``lse`` ((b, h, sq)
    float32). At a (head dim, dv) outside common.constants.BACKWARD_HEAD_DIMS the forward runs
    alone: the backward is not built there (Note [Head dims])."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    check_outputs(q, out, lse, (b, h, sq), head_dim_v=v.shape[-1])
    cap = check_features("forward_into", softcap, learnable_sink, h, q.device)
    p = prepare(d, causal, softmax_scale, window_size, q.device, target)
    return forward_prepared(p.backend, q, k, v, out, lse, p.causal, p.scale, p.left, p.right,
                            config, softcap=cap, learnable_sink=learnable_sink)


def features(softcap: float = 0.0, learnable_sink=None) -> dict:
    """The backend's feature keywords, only those set (a default call passes none)."""
    extra = {}
    if softcap:
        extra["softcap"] = softcap
    if learnable_sink is not None:
        extra["learnable_sink"] = learnable_sink
    return extra


def fold(dlse=None) -> dict:
    """The backward's dlse keyword, only when given (a call without it passes none)."""
    return {} if dlse is None else {"dlse": dlse}


def fill_empty_rows(out, lse, learnable_sink=None, heads_dim: int = -2):
    """out = 0 and lse = -inf for rows that see no key; with a learnable sink lse = the sink
    (its only column, Note [Learnable sink]). ``heads_dim``: lse's heads dimension."""
    out.zero_()
    if learnable_sink is None:
        lse.fill_(-math.inf)
        return
    shape = [1] * lse.dim()
    shape[heads_dim] = learnable_sink.shape[0]
    lse.copy_(learnable_sink.float().view(shape).expand(lse.shape))


def forward_prepared(backend: Backend, q, k, v, out, lse, causal: bool, scale: float, left,
                     right, config=None, *, softcap: float = 0.0, learnable_sink=None):
    """forward_into after its checks and prologue; empty problems end here."""
    b, sq, h, _ = q.shape
    if sq == 0 or b == 0 or h == 0:
        return out, lse
    if k.shape[1] == 0:  # no key at all: every row is empty
        fill_empty_rows(out, lse, learnable_sink)
        return out, lse
    backend.forward(q, k, v, out, lse, causal, scale, left, right, config,
                    **features(softcap, learnable_sink))
    return out, lse


def forward(q, k, v, causal=False, softmax_scale=None, window_size=(None, None), config=None,
            target: str | None = None, *, softcap=0.0, learnable_sink=None):
    """(out, lse) of attention, eagerly, with no autograd (the course's kernel signature)."""
    check_inputs(q, k, v, softmax_scale)
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return forward_into(q, k, v, out, lse, causal, softmax_scale, window_size, config, target,
                        softcap=softcap, learnable_sink=learnable_sink)


def backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=False, softmax_scale=None,
                  window_size=(None, None), deterministic=False, config=None,
                  target: str | None = None, *, softcap=0.0, dlse=None):
    """Gradients of attention into ``dq`` (like q), ``dk`` and ``dv`` (like k): ``out``, ``lse``
    from the forward, ``dout`` the gradient of out. GQA: dk, dv are summed over each group.
    ``deterministic``: bitwise the same gradients every run (a fixed order of dQ adds).
    ``softcap``: the forward's. A learnable sink needs nothing here (its lse is the forward's;
    its own gradient is common.backward.sink_gradient). ``dlse`` (like lse, or None): the
    lse's gradient, folded into the same backward (Note [The lse gradient folded])."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    refuse_backward_head_dims("backward_into", d, v.shape[-1])
    check_outputs(q, out, lse, (b, h, sq), head_dim_v=v.shape[-1])
    check_grads(q, k, dout, dq, dk, dv, v=v)
    cap = check_features("backward_into", softcap, None, h, q.device)
    check_lse_fold("backward_into", dlse, lse)
    p = prepare(d, causal, softmax_scale, window_size, q.device, target)
    return backward_prepared(p.backend, q, k, v, out, lse, dout, dq, dk, dv, p.causal, p.scale,
                             p.left, p.right, deterministic, config, softcap=cap, dlse=dlse)


def backward_prepared(backend: Backend, q, k, v, out, lse, dout, dq, dk, dv, causal: bool,
                      scale: float, left, right, deterministic: bool = False, config=None, *,
                      softcap: float = 0.0, dlse=None):
    """backward_into after its checks and prologue (as forward_prepared)."""
    if min(q.shape[0], q.shape[1], k.shape[1], q.shape[2]) == 0:
        for t in (dq, dk, dv):  # nothing attends: q, k, v have no influence on the output
            t.zero_()
        return dq, dk, dv
    backend.backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
                     deterministic, config, **features(softcap), **fold(dlse))
    return dq, dk, dv


def backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
             window_size=(None, None), deterministic=False, config=None,
             target: str | None = None, *, softcap=0.0, dlse=None):
    """(dq, dk, dv); see backward_into."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale,
                         window_size, deterministic, config, target, softcap=softcap, dlse=dlse)


def forward_timeline(q, k, v, causal=False, config=None):
    """One run of the Hopper forward built with ``timeline=True``; returns the recorded (roles,
    MAX_STEPS, MARKS) cycle stamps of CTA 0's first tile as a CPU int64 tensor (0 = not
    reached). Role 0 is the producer (one stamp per K tile issued), role w + 1 consumer
    warpgroup w (Note [Timeline])."""
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import timeline_buffer

    cfg = replace(config or hopper_fwd_default(q.shape[-1], causal), timeline=True)
    buf = timeline_buffer(q.device, cfg)
    buf.zero_()
    forward(q, k, v, causal, config=cfg)
    torch.cuda.synchronize(q.device)
    return buf.cpu().clone()
