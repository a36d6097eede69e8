"""Variable-length batches: sequences packed one after another, described by offsets.

q is (total_q, heads, dim), k and v (total_k, heads_kv, dim); sequence i holds the q rows
cu_seqlens_q[i] .. cu_seqlens_q[i + 1] - 1 and the k/v rows from cu_seqlens_k[i], of which the
first seqused_k[i] are used when seqused_k is given (a KV cache allocated longer than it is
filled). lse is (heads, total_q), FlashAttention's varlen layout. Masks are bottom-right aligned
per sequence. A sequence with no query row costs nothing; one with no key gives out = 0 and
lse = -inf for its rows.

Note [Varlen kernel]
The forward is one launch of the Hopper kernel's varlen variant (``Backend.varlen_forward`` in
runtime.dispatch -> hopper.host.launch_varlen_forward): the persistent scheduler walks the
query tiles of every sequence and head (Note [Varlen order] in common.schedule), each tile finds its
sequence from cu_seqlens on the device and reaches its rows by a domain offset into the packed
tensors (common.seqlens). The value checks of the offsets copy them to the host once per call
(one device synchronisation, the only one); FA4_FINAL_VARLEN_CHECKS=0 turns them off, and then
nothing waits for the GPU.

The backward is one launch of each of the backward's three kernels in their varlen variants
(``Backend.varlen_backward`` -> hopper.host.launch_varlen_backward; Note [Varlen backward] in
hopper.bwd: one CTA per key tile of a sequence and kv head, the dQ accumulator padded per
sequence to whole query tiles, Note [Varlen dQ accumulator] in common.bwd_tiles).
``forward_loop`` and ``backward_loop`` are the per-sequence loops over the dense kernels (each
sequence a batch of one: correct for any lengths, one launch per sequence, so short sequences
leave SMs idle), kept as the references that benchmarks and the GPU tests compare with, and
used by a backend that has no varlen kernel.

``softcap`` and ``learnable_sink`` are FA4's, as in runtime.prologue (checked by
runtime.pending.check_features); a sequence with no key gets lse = the sink, lse's heads dim is 0.
"""

from __future__ import annotations

import os

import torch

from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime.checks import (
    check_grads,
    check_outputs,
    check_varlen_inputs,
    check_varlen_values,
)
from fa4_final.runtime.dispatch import used_rows
from fa4_final.runtime.pending import (
    check_features,
    check_lse_fold,
    refuse_backward_head_dims,
)
from fa4_final.runtime.prologue import features, fill_empty_rows, fold, prepare


def _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q=None):
    """The offsets on the host, in one copy (seqused_q's values after the rest, when given)."""
    parts = [cu_seqlens_q, cu_seqlens_k] + ([seqused_k] if seqused_k is not None else []) + (
        [seqused_q] if seqused_q is not None else [])
    flat = torch.cat(parts).tolist()
    n = cu_seqlens_q.shape[0]
    cu_q, cu_k = flat[:n], flat[n:2 * n]
    rest = flat[2 * n:]
    used_q = None
    if seqused_q is not None:
        rest, used_q = rest[:len(rest) - (n - 1)], rest[len(rest) - (n - 1):]
    lists = cu_q, cu_k, (rest if seqused_k is not None else None)
    return lists if seqused_q is None else (*lists, used_q)


def _spans(cu_q, cu_k, used_k):
    """(first q row, q rows, first k row, k rows used) of every sequence."""
    return [(cu_q[i], cu_q[i + 1] - cu_q[i], cu_k[i], used_k[i]) for i in range(len(cu_q) - 1)]


def _used_lengths(has_kernel: bool, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k,
                  max_seqlen_q, max_seqlen_k, seqused_q=None):
    """(cu_q, cu_k, used key lengths) on the host after their value checks, or None when the
    kernel runs with the checks off: the loop needs the host lists anyway, the kernel only for
    the checks (Note [Varlen kernel]). seqused_q's values are checked here too; the loop does
    not take it (only the varlen kernels do)."""
    if seqused_q is not None and not has_kernel:
        raise UnsupportedError("seqused_q runs in the varlen kernels only; this GPU's backend "
                               "runs varlen as a loop over the dense kernel")
    if has_kernel and os.environ.get("FA4_FINAL_VARLEN_CHECKS") == "0":
        return None
    cu_q, cu_k, used, *used_q = _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q)
    _, used_k = check_varlen_values(cu_q, cu_k, used, total_q, total_k, max_seqlen_q,
                                    max_seqlen_k, used_q[0] if used_q else None)
    return cu_q, cu_k, used_k


def varlen_forward_into(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                        max_seqlen_k, out, lse, causal=False, softmax_scale=None,
                        window_size=(None, None), config=None, *, softcap=0.0,
                        learnable_sink=None, seqused_q=None):
    """Write the varlen forward into ``out`` (like q with v's head dim) and ``lse`` ((heads,
    total_q) float32). ``seqused_q`` (int32 (batch,)): sequence b's queries are the
    first seqused_q[b] of its packed rows (0 <= seqused_q[b] <= its rows); the rest are
    padding, never written (out and lse keep what the buffers held there), and must hold
    finite values (as the keys past seqused_k)."""
    batch, total_q, total_k, h, hk, d = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, seqused_q=seqused_q)
    check_outputs(q, out, lse, (h, total_q), head_dim_v=v.shape[-1])
    cap = check_features("varlen_forward_into", softcap, learnable_sink, h, q.device)
    extra = features(cap, learnable_sink)
    p = prepare(d, causal, softmax_scale, window_size, q.device)
    has_kernel = p.backend.varlen_forward is not None
    lists = _used_lengths(has_kernel, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k,
                          max_seqlen_q, max_seqlen_k, seqused_q)
    if has_kernel:  # Note [Varlen kernel]
        if q.shape[0] == 0:
            return out, lse
        if k.shape[0] == 0:  # no key anywhere (a TMA descriptor cannot have an empty extent)
            _fill_used_rows(out, lse, learnable_sink, cu_seqlens_q, seqused_q)
            return out, lse
        p.backend.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                 max_seqlen_k, out, lse, p.causal, p.scale, p.left, p.right,
                                 config, **extra, **used_rows(seqused_q))
        return out, lse
    _loop_into(p, q, k, v, *lists, out, lse, config, extra)
    return out, lse


def _fill_used_rows(out, lse, learnable_sink, cu_seqlens_q, seqused_q) -> None:
    """No key anywhere: every used row sees none (out 0, lse -inf or the sink); padding rows
    past seqused_q stay as they were (one host copy, in this corner only)."""
    if seqused_q is None:
        fill_empty_rows(out, lse, learnable_sink, heads_dim=0)
        return
    starts, used = cu_seqlens_q.tolist(), seqused_q.tolist()
    for b, n in enumerate(used):
        rows = slice(starts[b], starts[b] + n)
        if n:
            fill_empty_rows(out[rows], lse[:, rows], learnable_sink, heads_dim=0)


def forward_loop(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, causal=False,
                 softmax_scale=None, window_size=(None, None), config=None, *, softcap=0.0,
                 learnable_sink=None):
    """The per-sequence loop over the dense forward (Note [Varlen kernel]): (out, lse), checked
    like varlen_forward_into. A reference for the benchmark and the tests, not the API."""
    batch, total_q, total_k, h, hk, d = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, None, softmax_scale)
    cap = check_features("forward_loop", softcap, learnable_sink, h, q.device)
    p = prepare(d, causal, softmax_scale, window_size, q.device)
    cu_q, cu_k, used = _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_k)
    _, used_k = check_varlen_values(cu_q, cu_k, used, total_q, total_k)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    lse = torch.empty(h, total_q, dtype=torch.float32, device=q.device)
    _loop_into(p, q, k, v, cu_q, cu_k, used_k, out, lse, config, features(cap, learnable_sink))
    return out, lse


def _loop_into(p, q, k, v, cu_q, cu_k, used_k, out, lse, config, extra=None):
    extra = extra or {}  # the backend's feature keywords (runtime.prologue.features)
    for q0, nq, k0, nk in _spans(cu_q, cu_k, used_k):
        if nq == 0:
            continue
        o = out[q0:q0 + nq].unsqueeze(0)  # (1, nq, h, d): a batch of one
        row_lse = lse[:, q0:q0 + nq].unsqueeze(0)  # (1, h, nq), row stride total_q
        if nk == 0:
            fill_empty_rows(o, row_lse, extra.get("learnable_sink"))
            continue
        p.backend.forward(q[q0:q0 + nq].unsqueeze(0), k[k0:k0 + nk].unsqueeze(0),
                          v[k0:k0 + nk].unsqueeze(0), o, row_lse, p.causal, p.scale, p.left,
                          p.right, config, **extra)


def varlen_backward_into(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                         seqused_k, max_seqlen_q, max_seqlen_k, causal=False,
                         softmax_scale=None, window_size=(None, None), deterministic=False,
                         config=None, *, softcap=0.0, dlse=None, seqused_q=None):
    """Gradients of the varlen forward into dq (like q), dk and dv (like k). Key rows no
    sequence uses (past seqused_k) get zero gradients. One launch per kernel of the backward
    (Note [Varlen kernel]); the loop where the backend has no varlen backward. ``softcap``:
    the forward's (a learnable sink needs nothing here, as in runtime.prologue); ``dlse``
    ((heads, total_q) or None): the lse's gradient folded in, as in runtime.prologue;
    ``seqused_q``: the forward's; dq's padding rows come out 0."""
    batch, total_q, total_k, h, hk, d = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, seqused_q=seqused_q)
    refuse_backward_head_dims("varlen_backward_into", d, v.shape[-1])
    check_outputs(q, out, lse, (h, total_q), head_dim_v=v.shape[-1])
    check_grads(q, k, dout, dq, dk, dv, v=v)
    extra = features(check_features("varlen_backward_into", softcap, None, h, q.device))
    check_lse_fold("varlen_backward_into", dlse, lse)
    p = prepare(d, causal, softmax_scale, window_size, q.device)
    has_kernel = p.backend.varlen_backward is not None
    lists = _used_lengths(has_kernel, cu_seqlens_q, cu_seqlens_k, seqused_k, total_q, total_k,
                          max_seqlen_q, max_seqlen_k, seqused_q)
    if has_kernel:  # Note [Varlen kernel]
        if total_q == 0 or batch == 0:  # no query row: every key's gradient is 0
            for t in (dq, dk, dv):
                t.zero_()
            return dq, dk, dv
        if total_k == 0:  # no key anywhere (a TMA descriptor cannot have an empty extent)
            dq.zero_()
            return dq, dk, dv
        p.backend.varlen_backward(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q,
                                  cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                  p.causal, p.scale, p.left, p.right, deterministic, config,
                                  **extra, **fold(dlse), **used_rows(seqused_q))
        return dq, dk, dv
    _backward_loop_into(p, q, k, v, out, lse, dout, dq, dk, dv, *lists, deterministic, config,
                        extra, dlse)
    return dq, dk, dv


def backward_loop(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, seqused_k=None,
                  causal=False, softmax_scale=None, window_size=(None, None),
                  deterministic=False, config=None, *, softcap=0.0):
    """The per-sequence loop over the dense backward (Note [Varlen kernel]): (dq, dk, dv),
    checked like varlen_backward_into. A reference for the benchmark and the tests, not the
    API."""
    batch, total_q, total_k, h, hk, d = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, None, softmax_scale)
    refuse_backward_head_dims("backward_loop", d, v.shape[-1])
    check_outputs(q, out, lse, (h, total_q), head_dim_v=v.shape[-1])
    extra = features(check_features("backward_loop", softcap, None, h, q.device))
    p = prepare(d, causal, softmax_scale, window_size, q.device)
    cu_q, cu_k, used = _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_k)
    _, used_k = check_varlen_values(cu_q, cu_k, used, total_q, total_k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    check_grads(q, k, dout, dq, dk, dv, v=v)
    _backward_loop_into(p, q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, used_k,
                        deterministic, config, extra)
    return dq, dk, dv


def _backward_loop_into(p, q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, used_k,
                        deterministic, config, extra=None, dlse=None):
    for t in (dq, dk, dv):  # rows of empty sequences and unused keys stay 0
        t.zero_()
    for q0, nq, k0, nk in _spans(cu_q, cu_k, used_k):
        if nq == 0 or nk == 0:
            continue
        rows_q, rows_k = slice(q0, q0 + nq), slice(k0, k0 + nk)
        one = [t[rows_q].unsqueeze(0) for t in (q, out, dout, dq)]
        kv = [t[rows_k].unsqueeze(0) for t in (k, v, dk, dv)]
        row_lse = lse[:, rows_q].unsqueeze(0).contiguous()  # (1, h, nq)
        row_dlse = None if dlse is None else dlse[:, rows_q].unsqueeze(0).contiguous()
        p.backend.backward(one[0], kv[0], kv[1], one[1], row_lse, one[2], one[3], kv[2],
                           kv[3], p.causal, p.scale, p.left, p.right, deterministic, config,
                           **(extra or {}), **fold(row_dlse))
