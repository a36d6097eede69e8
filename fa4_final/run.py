"""Checked tensors in, the kernel of this GPU run: the eager layer under the custom ops.

``forward_into`` and ``backward_into`` write into buffers the caller owns (tests pass NaN-filled
ones to prove every element is written). Empty problems never reach a kernel: no query rows is
nothing to do, no key gives out = 0 and lse = -inf (a row that sees no key), dq = 0.
"""

from __future__ import annotations

import math

from fa4_final.checks import _normalise_window, check_grads, check_inputs, check_outputs
from fa4_final.config import HopperFwdConfig
from fa4_final.dispatch import backend_for


def device_arch(device) -> str:
    """The kernel target for ``device`` ("sm_90a"), or UnsupportedError naming what runs."""
    return backend_for(device).target


def forward_into(q, k, v, out, lse, causal=False, softmax_scale=None, window_size=(None, None),
                 config: HopperFwdConfig | None = None):
    """Run the forward writing into ``out`` (like q) and ``lse`` ((b, h, sq) float32)."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    causal, left, right = _normalise_window(causal, window_size)
    backend = backend_for(q.device)
    check_outputs(q, out, lse, (b, h, sq))
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    return forward_checked(backend, q, k, v, out, lse, causal, scale, left, right, config)


def forward_checked(backend, q, k, v, out, lse, causal: bool, scale: float, left, right,
                    config=None):
    """forward_into after its checks: the window normalised, the scale resolved, ``out`` and
    ``lse`` as forward_into wants them. Empty problems end here."""
    b, sq, h, _ = q.shape
    if sq == 0 or b == 0 or h == 0:
        return out, lse
    if k.shape[1] == 0:  # no key at all: every row is empty
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    backend.forward(q, k, v, out, lse, causal, scale, left, right, config)
    return out, lse


def backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=False, softmax_scale=None,
                  window_size=(None, None), deterministic=False):
    """Gradients of the forward into dq (like q), dk and dv (like k)."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    causal, left, right = _normalise_window(causal, window_size)
    backend = backend_for(q.device)
    check_outputs(q, out, lse, (b, h, sq))
    check_grads(q, k, dout, dq, dk, dv)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    return backward_checked(backend, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left,
                            right, deterministic)


def backward_checked(backend, q, k, v, out, lse, dout, dq, dk, dv, causal: bool, scale: float,
                     left, right, deterministic: bool = False):
    """backward_into after its checks (as forward_checked)."""
    if min(q.shape[0], q.shape[1], k.shape[1], q.shape[2]) == 0:
        for t in (dq, dk, dv):  # nothing attends: q, k, v have no influence on the output
            t.zero_()
        return dq, dk, dv
    backend.backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
                     deterministic)
    return dq, dk, dv


_BACKENDS: dict = {}


def cached_backend(device):
    """``backend_for(device)``, looked up once per device (it reads the device's compute
    capability); the function is in the key, so a replaced backend_for is asked again."""
    key = (backend_for, device)
    backend = _BACKENDS.get(key)
    if backend is None:
        backend = _BACKENDS[key] = backend_for(device)
    return backend


def forward(q, k, v, causal=False, softmax_scale=None, window_size=(None, None), config=None):
    """(out, lse) of attention, eagerly, with no autograd (the course's kernel signature)."""
    import torch

    check_inputs(q, k, v, softmax_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    return forward_into(q, k, v, out, lse, causal, softmax_scale, window_size, config)
