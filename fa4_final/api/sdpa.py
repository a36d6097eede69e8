"""fa4_final behind PyTorch's own ``scaled_dot_product_attention``: FA4's private contract.

PyTorch can run SDPA's flash backend through any module that exposes ``_flash_attn_fwd`` and
``_flash_attn_bwd`` as the FA4 package (flash-attn-4 4.0.0b36, ``flash_attn.cute.interface``)
defines them. This module is that module for fa4_final: both functions take FA4's parameters by
the same names, in the same order, with the same defaults, and run the package's checked eager
paths (runtime.prologue for dense calls, runtime.varlen for packed ones). ``register_sdpa``
hands it to PyTorch; nothing is registered on import.

    import fa4_final
    fa4_final.register_sdpa()          # SDPA's flash backend now runs fa4_final's kernels
    torch.nn.attention.restore_flash_attention_impl()   # and back to PyTorch's own (2.11+)

Every parameter means what it means in FA4, or is refused: a feature fa4_final lacks (qv,
score_mod, FP8 scales, ...) at any value other than the one that switches it off raises
UnsupportedError naming it (api.interface's tables, plus the few keywords only these private
functions take). A ``page_table`` is checked and run by the decode kernel, forward only
(Note [Decode through the API] in fa4_final.runtime.decode_entry); ``num_splits`` is checked
and sets that kernel's split count there. ``softcap`` and ``learnable_sink`` run as FA4
defines them (the backward then returns (dq, dk, dv, dsink), as FA4's does), checked first
(runtime.pending.check_features). FA4's kernel knobs (tile_mn, num_threads, num_splits, the
backward's block sizes, stages and atom layouts) change how FA4 runs, never what it returns,
and are ignored here: fa4_final picks its own tiles.
Note [SDPA registration] says what PyTorch passes and what it refuses before calling.
"""

from __future__ import annotations

import torch

from fa4_final.api.interface import _FA4_SPEED_ONLY, _FA4_VARLEN_NEUTRAL, _refuse_fa4_options
from fa4_final.api.ops import _lse_probe
from fa4_final.common.backward import sink_gradient
from fa4_final.common.constants import FWD_HEAD_DIMS
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime import decode_entry
from fa4_final.runtime.checks import (
    check_flag,
    check_seqused_q,
    check_tma_operand,
    normalise_window,
)
from fa4_final.runtime.decode import check_num_splits
from fa4_final.runtime.pending import (
    check_features,
    listed,
    refuse_backward_head_dims,
)
from fa4_final.runtime.prologue import backward_into, fold, forward_into
from fa4_final.runtime.varlen import varlen_backward_into, varlen_forward_into

# Note [SDPA registration]
# Who calls. torch.nn.attention._fa4 (torch 2.10 and later) registers Python kernels under the
# CUDA key for aten's _scaled_dot_product_flash_attention and its backward, and for
# _flash_attention_forward / _flash_attention_backward (the varlen ops behind
# torch.nn.attention.varlen.varlen_attn; 2.12 adds _flash_attention_forward_no_dropout_inplace).
# Those kernels call ``module._flash_attn_fwd(q, k, v, **kw)`` and
# ``module._flash_attn_bwd(q, k, v, out, dout, lse, **kw)`` of the module registered with
# ``register_flash_attention_fa4(module_path)``; ``register_sdpa`` registers this one.
#
# What arrives, and how. SDPA's (batch, heads, seqlen, dim) tensors come transposed to FA4's
# (batch, seqlen, heads, dim) as views, not copies (the head stride larger than the row
# stride); GQA keeps its fewer k/v heads (enable_gqa=True). Packed sequences come as (total,
# heads, dim) with int32 cu_seqlens. Keywords of the forward: softmax_scale (None: 1/sqrt(d)),
# causal, window_size_left/right, return_lse=True, cu_seqlens_q/k, seqused_k, and ``out`` (a
# (b, s, h, d) view of a buffer shaped like SDPA's query, whenever torch allocates one: written
# into here, torch returns the buffer); 2.12 adds max_seqlen_q/k, page_table (None on sm_90) and
# num_splits (1 on sm_90). Keywords of the backward: softmax_scale, causal, cu_seqlens_q/k,
# deterministic (torch.are_deterministic_algorithms_enabled(), 2.11 on), window sides (2.12 on).
# Returned: (out, lse) with lse float32 (b, h, seqlen_q), or (h, total_q) packed, which torch
# makes contiguous; (dq, dk, dv) like q, k, v, which torch transposes back.
#
# Two differences from FA4's functions, both forced by PyTorch's side. The forward returns the
# pair PyTorch unpacks (``out, lse = module._flash_attn_fwd(...)`` in every version from 2.10 to
# 2.13), not the five values of FA4 4.0.0b36 (out, lse and three tensors of its sparse-gather
# backward, None otherwise): FA4 4.0.0b36 itself fails there with "too many values to unpack".
# And a window side below 0 next to one that is not is refused: aten reads -1 as "unbounded",
# FA4 as a bound, and torch before 2.12 passes aten's -1 unchanged (varlen_attn's causal
# window, (-1, 0), would be a window that sees no key); 2.12 turns -1 into None first. Both
# sides below 0 mean "no window" in either reading and are accepted.
#
# What torch refuses before calling (a RuntimeError from torch, not from here): dropout_p != 0,
# return_debug_mask, alibi_slopes, tensors not on one CUDA device, dtypes other than fp16/bf16,
# a backward's lse not float32, GPUs other than compute capability 9.x and 10.x; 2.12 on,
# page_table and num_splits > 1 on sm_90; before 2.12, a backward with any window
# (varlen_attn's backward included). And SDPA's own backend choice happens first: an
# attn_mask, is_causal with seqlen_q != seqlen_k, fp32 inputs or a head dim over 256 never pick
# the flash backend (another backend runs, or under sdpa_kernel(FLASH_ATTENTION) torch says no
# kernel is available). What fa4_final does not run (a head dim it has no kernel for, the
# features above) raises UnsupportedError out of the SDPA call; torch does not fall back.
# Torch's backward ops carry no seqused_k, so a forward with seqused_k is for inference only;
# dlse is never passed by torch (SDPA's lse has no gradient), but direct callers get its
# gradient as in FA4.

# The keywords only FA4's private functions take, each at the value that switches it off.
_PRIVATE_NEUTRAL = {**_FA4_VARLEN_NEUTRAL, "q_descale": None, "k_descale": None,
                    "v_descale": None, "_arch": None}
# FA4's kernel knobs: how it tiles and schedules, never what it returns (its Hopper backward
# overwrites its own block sizes, stages and layouts from its tile table).
_FA4_KNOBS = (*_FA4_SPEED_ONLY, "tile_mn", "mma_pv_is_rs", "intra_wg_overlap", "num_threads",
              "m_block_size", "n_block_size", "num_stages_Q", "num_stages_dO", "SdP_swapAB",
              "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP", "AtomLayoutNdKV", "AtomLayoutMdQ",
              "V_in_regs")
# What these two functions run: the rest of FA4's parameters are knobs or refused.
SUPPORTED_FWD = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
                 "max_seqlen_q", "max_seqlen_k", "page_table", "softmax_scale", "causal",
                 "softcap", "window_size_left", "window_size_right", "learnable_sink",
                 "return_lse", "out", "lse")
SUPPORTED_BWD = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap",
                 "window_size_left", "window_size_right", "cu_seqlens_q", "cu_seqlens_k",
                 "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "deterministic", "dq",
                 "dk", "dv", "dlse", "learnable_sink")
SDPA_IMPL = "fa4_final"  # the name PyTorch's registry knows fa4_final by
SDPA_MODULE = __name__  # "fa4_final.api.sdpa"


def _refuse(func: str, options: dict) -> None:
    """UnsupportedError naming the first of ``options`` (FA4 parameters fa4_final does not
    run) set to anything but its neutral value."""
    _refuse_fa4_options(func, options, _PRIVATE_NEUTRAL)


def _window(func: str, left, right) -> tuple:
    """FA4's (window_size_left, window_size_right), refused where aten's reading of a negative
    side differs from FA4's (Note [SDPA registration])."""
    sides = {"window_size_left": left, "window_size_right": right}
    negative = [n for n, w in sides.items() if isinstance(w, int) and w < 0]
    if len(negative) == 1:
        name = negative[0]
        other = "window_size_right" if name == "window_size_left" else "window_size_left"
        raise UnsupportedError(
            f"{func}: {name}={sides[name]} beside {other}={sides[other]!r} is ambiguous: FA4 "
            f"reads a negative side as a bound, aten as 'unbounded' (torch before 2.12 passes "
            f"aten's -1 unchanged). Pass None for an unbounded side, or both sides negative for "
            f"no window")
    return left, right


def _host_int(value):
    """A max_seqlen hint as a host int: FA4 also takes a 0-d tensor, read here as no hint
    (reading it would wait for the GPU)."""
    return None if isinstance(value, torch.Tensor) else value


def _readable(t):
    """An input as the kernels read it (TMA: the last dim contiguous, 16-byte strides and
    base); anything else is copied first, as FA4 copies what its kernels cannot read."""
    try:
        check_tma_operand("input", t)
        return t
    except ValueError:
        return t.clone(memory_format=torch.contiguous_format)


def _writable(t, tma: bool = True):
    """(buffer the kernels can write, whether to copy it into ``t`` after)."""
    try:
        if tma:
            check_tma_operand("output", t)
        elif t.numel() and t.stride(-1) != 1:
            raise ValueError
        return t, False
    except ValueError:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device), True


def _flash_attn_fwd(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None,
    softmax_scale=None, causal=False, softcap=None, window_size_left=None,
    window_size_right=None, learnable_sink=None, tile_mn=None, mma_pv_is_rs=None,
    intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, _arch=None,
    score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
    lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None,
    v_descale=None, gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None,
    disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
):
    """FA4's forward: returns ``(out, lse)``.

    Dense: q (batch, seqlen_q, heads, dim), k and v (batch, seqlen_k, heads_kv, dim). Packed:
    q (total_q, heads, dim), k and v (total_k, heads_kv, dim) with int32 cu_seqlens_q and
    cu_seqlens_k (batch + 1 offsets) and optionally seqused_k (batch,). out like q, written into
    when given; lse float32 (batch, heads, seqlen_q) or (heads, total_q), written into when
    given, else allocated when ``return_lse`` or an input requires grad, and None otherwise.
    Window sides as FA4 reads them: None unbounded, an int a bound (i + sk - sq - left <= j <=
    i + sk - sq + right), both negative no window, causal sets the right side to 0.
    ``softcap`` (None or 0.0: none) and ``learnable_sink`` ((heads,)): FA4's (the module's
    docstring); with a sink lse includes it and rows that see no key get lse = sink.
    ``page_table`` (the decode kernel): k and v (num_pages, page_size, heads_kv, dim), seqused_k,
    q packed with cu_seqlens_q (no cu_seqlens_k) or dense; the decode kernel, forward only,
    split into ``num_splits`` (_paged_fwd).
    """
    _refuse("_flash_attn_fwd", {
        "qv": qv, "min_seqlen_k": min_seqlen_k, "_arch": _arch,
        "score_mod": score_mod, "mask_mod": mask_mod, "block_sparse_tensors": block_sparse_tensors,
        "aux_tensors": aux_tensors, "aux_scalars": aux_scalars, "q_descale": q_descale,
        "k_descale": k_descale, "v_descale": v_descale, "gather_kv_indices": gather_kv_indices,
        "scheduler_metadata": scheduler_metadata, "seqlen_k_per_split": seqlen_k_per_split,
        "disable_scheduler_metadata": disable_scheduler_metadata,
        "gather_bwd_recompute_p": gather_bwd_recompute_p})
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    window = _window("_flash_attn_fwd", window_size_left, window_size_right)
    num_splits = check_num_splits(num_splits)  # a speed knob, but on the paged path
    if page_table is not None:
        return _paged_fwd(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                          max_seqlen_q, softmax_scale, causal, window, softcap, learnable_sink,
                          return_lse, out, lse, num_splits)
    packed = _packed("_flash_attn_fwd", cu_seqlens_q, cu_seqlens_k, seqused_k)
    _check_layout(q, packed)
    used_q = _seqused_q("_flash_attn_fwd", seqused_q, packed, cu_seqlens_q, q)
    features = _features("_flash_attn_fwd", q, softcap, learnable_sink)
    wants_lse = lse is not None or return_lse or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, learnable_sink))
    q, k, v = (_readable(t) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    lse_shape = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
    if out is None:  # v's head dim (Note [Head dims])
        dv = v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() else q.shape[-1]
        out = torch.empty((*q.shape[:-1], dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    out_buf, copy_out = _writable(out)
    lse_buf, copy_lse = _writable(lse, tma=False)
    if packed:
        varlen_forward_into(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                            _host_int(max_seqlen_q), _host_int(max_seqlen_k), out_buf, lse_buf,
                            causal, softmax_scale, window, **features, **used_q)
    else:
        forward_into(q, k, v, out_buf, lse_buf, causal, softmax_scale, window, **features)
    if copy_out:
        out.copy_(out_buf)
    if copy_lse:
        lse.copy_(lse_buf)
    return out, (lse if wants_lse else None)


def _paged_fwd(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
               max_seqlen_q, softmax_scale, causal: bool, window, softcap, learnable_sink,
               return_lse: bool, out, lse, num_splits: int):
    """_flash_attn_fwd with a page_table (Note [Decode through the API] in
    fa4_final.runtime.decode_entry): the decode kernel, forward only; q packed with
    cu_seqlens_q or dense, k and v (num_pages, page_size, heads_kv, d), seqused_k."""
    func = "_flash_attn_fwd"
    _check_layout(q, cu_seqlens_q is not None)
    features = _features(func, q, softcap, learnable_sink)
    q, k, v = (_readable(t) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    max_q = _host_int(max_seqlen_q)
    batch, rows, h, hk, d, _, values = decode_entry.check_paged_call(
        q, k, v, page_table, seqused_k, cu_seqlens_q, max_q, softmax_scale,
        cu_seqlens_k=cu_seqlens_k)
    c, left, right = normalise_window(causal, window)
    decode_entry.refuse_decode_limits(func, d, v.shape[-1], c, right,
                                      features.get("softcap", 0.0), learnable_sink, seqused_q,
                                      left=left)
    decode_entry.refuse_paged_gradient(func, q, k, v)
    wants_lse = lse is not None or return_lse
    lse_shape = (h, q.shape[0]) if cu_seqlens_q is not None else (batch, h, rows)
    if out is None:
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    out_buf, copy_out = _writable(out)
    lse_buf, copy_lse = _writable(lse, tma=False)
    decode_entry.decode_forward_into(q, k, v, out_buf, lse_buf, causal, softmax_scale, window,
                                     page_table=page_table, seqused_k=seqused_k,
                                     cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q,
                                     num_splits=num_splits, check_values=False)
    values.finish()  # Note [Paged KV checks]: read after the launch, raises on a bad value
    if copy_out:
        out.copy_(out_buf)
    if copy_lse:
        lse.copy_(lse_buf)
    return out, (lse if wants_lse else None)


def _features(func: str, q, softcap, learnable_sink) -> dict:
    """softcap and learnable_sink checked (runtime.pending.check_features), as the
    runtime's keywords; q's heads are its second-to-last dim in both layouts."""
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        return {}  # the runtime's checks name q's problem
    cap = check_features(func, softcap, learnable_sink, q.shape[-2], q.device)
    return {"softcap": cap, "learnable_sink": learnable_sink}


def _seqused_q(func: str, seqused_q, packed: bool, cu_seqlens_q, q) -> dict:
    """FA4's seqused_q as the varlen runtime's keyword, only when given: checked; with dense q
    (which FA4 also takes) refused by name: varlen only here."""
    if seqused_q is None:
        return {}
    if packed and isinstance(q, torch.Tensor):
        check_seqused_q(seqused_q, cu_seqlens_q, q.device)
    if not packed:
        shown = (f"<tensor {tuple(seqused_q.shape)}>" if isinstance(seqused_q, torch.Tensor)
                 else repr(seqused_q))
        raise UnsupportedError(
            f"{func}: seqused_q={shown} with dense q is refused: fa4_final takes seqused_q "
            f"with packed q, k, v (cu_seqlens_q and cu_seqlens_k) only")
    return {"seqused_q": seqused_q}


def _dims_known(q, k, v) -> bool:
    """Whether q's and v's head dims can be read (else the runtime's checks name the problem):
    tensors of the same rank, q's and k's head dims equal, both built for the forward (a bad
    value is named by those checks first, Note [Pending features])."""
    return (all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (q, k, v))
            and q.dim() == k.dim() == v.dim() and q.shape[-1] == k.shape[-1]
            and q.shape[-1] in FWD_HEAD_DIMS and v.shape[-1] in FWD_HEAD_DIMS)


def _check_layout(q, packed: bool) -> None:
    """q's type and rank, before its shape is read (the runtime checks the rest)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dims, layout = (3, "(total_q, heads, head_dim) with cu_seqlens") if packed else \
        (4, "(batch, seqlen_q, heads, head_dim)")
    if q.dim() != dims:
        raise ValueError(f"q must be {dims}-D {layout}, got shape {tuple(q.shape)}")


def _packed(func: str, cu_seqlens_q, cu_seqlens_k, seqused_k) -> bool:
    """Whether the call is packed (varlen); FA4's mixed layouts are refused by name."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if seqused_k is not None:
            raise UnsupportedError(
                f"{func}: seqused_k on a dense (batch, seqlen_k, ...) cache is not run by "
                f"fa4_final; it takes seqused_k with cu_seqlens_q and cu_seqlens_k (packed)")
        return False
    if cu_seqlens_q is None or cu_seqlens_k is None:
        given, missing = (("cu_seqlens_q", "cu_seqlens_k") if cu_seqlens_k is None
                          else ("cu_seqlens_k", "cu_seqlens_q"))
        raise UnsupportedError(
            f"{func}: {given} without {missing} (one side packed, the other a dense batch) is "
            f"not run by fa4_final; it takes packed q, k and v with both offsets")
    return True


def _flash_attn_bwd(
    q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
    window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
    num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
    dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
    V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
    max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
    score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
    block_sparse_tensors=None, dlse=None, learnable_sink=None,
):
    """FA4's backward: returns ``(dq, dk, dv)`` (like q, k, v; written into when given).

    q, k, v, out and lse as the forward took and returned them, dout the gradient of out, dlse
    (like lse, optional) the gradient of lse. GQA: dk and dv summed over each group of heads.
    ``deterministic``: the same bits every run (a fixed order of dQ adds). ``softcap`` and
    ``learnable_sink``: the forward's; with a sink it returns ``(dq, dk,
    dv, dsink)``, dsink in the sink's dtype (common.backward.sink_gradient), as FA4.
    """
    _refuse("_flash_attn_bwd", {
        "score_mod": score_mod,
        "score_mod_bwd": score_mod_bwd, "mask_mod": mask_mod, "aux_tensors": aux_tensors,
        "aux_scalars": aux_scalars, "block_sparse_tensors": block_sparse_tensors})
    causal = check_flag("causal", causal)
    deterministic = check_flag("deterministic", deterministic)
    window = _window("_flash_attn_bwd", window_size_left, window_size_right)
    packed = _packed("_flash_attn_bwd", cu_seqlens_q, cu_seqlens_k, seqused_k)
    used_q = _seqused_q("_flash_attn_bwd", seqused_q, packed, cu_seqlens_q, q)
    cap = _features("_flash_attn_bwd", q, softcap, learnable_sink).get("softcap", 0.0)
    if _dims_known(q, k, v):  # the backward's head dims (common.constants.BACKWARD_HEAD_DIMS)
        refuse_backward_head_dims("_flash_attn_bwd", q.shape[-1], v.shape[-1])
    q, k, v, out, dout = (_readable(t) if isinstance(t, torch.Tensor) else t
                          for t in (q, k, v, out, dout))
    if isinstance(lse, torch.Tensor) and lse.numel() and lse.stride(-1) != 1:
        lse = lse.contiguous()
    grads = [torch.empty(like.shape, dtype=like.dtype, device=like.device) if g is None else g
             for g, like in ((dq, q), (dk, k), (dv, v))]
    bufs = [_writable(g) for g in grads]

    def run(v_, out_, dout_, dq_, dk_, dv_, dlse_=None):
        if packed:
            varlen_backward_into(q, k, v_, out_, lse, dout_, dq_, dk_, dv_, cu_seqlens_q,
                                 cu_seqlens_k, seqused_k, _host_int(max_seqlen_q),
                                 _host_int(max_seqlen_k), causal, softmax_scale, window,
                                 deterministic, softcap=cap, **fold(dlse_), **used_q)
        else:
            backward_into(q, k, v_, out_, lse, dout_, dq_, dk_, dv_, causal, softmax_scale,
                          window, deterministic, softcap=cap, **fold(dlse_))

    folded = dlse is not None and listed("lse_fold")  # one call (Note [Pending features])
    run(v, out, dout, *(b for b, _ in bufs), dlse if folded else None)
    if dlse is not None and not folded:  # Note [Gradient of the returned lse]: one more backward
        rows = dlse.transpose(0, 1) if packed else dlse.transpose(1, 2)
        probe_dout, probe_out = _lse_probe(rows, out)
        extra = [torch.empty_like(b, memory_format=torch.contiguous_format) for b, _ in bufs]
        run(torch.zeros_like(v), probe_out, probe_dout, *extra)
        bufs[0][0].add_(extra[0])
        bufs[1][0].add_(extra[1])
    for g, (buf, copy) in zip(grads, bufs):
        if copy:
            g.copy_(buf)
    if learnable_sink is not None:  # Note [Learnable sink]: no kernel, a few torch ops
        return (*grads, sink_gradient(learnable_sink, lse, out, dout, dlse))
    return tuple(grads)


def _register_fa4_module():
    """The register_fn PyTorch's registry calls on activation: FA4's registration with this
    module's path; returns torch's handle (its removal restores PyTorch's kernels)."""
    from torch.nn.attention._fa4 import register_flash_attention_fa4

    return register_flash_attention_fa4(SDPA_MODULE)


def register_sdpa(activate: bool = True) -> str:
    """Make fa4_final the kernel behind ``torch.nn.functional.scaled_dot_product_attention``.

    PyTorch (2.10 and later) lets a package take over SDPA's flash backend. This registers
    fa4_final in ``torch.nn.attention``'s registry under the name ``"fa4_final"``, with
    fa4_final.api.sdpa as the module PyTorch calls (FA4's ``_flash_attn_fwd`` and
    ``_flash_attn_bwd``, same parameters), and with ``activate=True`` (the default) makes it
    the active implementation. From then on every SDPA call that PyTorch sends to its flash
    backend runs fa4_final's kernels, forward and backward, with no change to the model; so does
    ``torch.nn.attention.varlen.varlen_attn`` (its causal calls from torch 2.12 on). Nothing
    happens on import: call it once per process.

        import fa4_final, torch
        fa4_final.register_sdpa()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.nn.attention.restore_flash_attention_impl()  # PyTorch's kernels again (2.11+)

    ``register_sdpa(activate=False)`` only registers, for
    ``torch.nn.attention.activate_flash_attention_impl("fa4_final")`` later. A setup fa4_final
    has no kernels for (a head dim, a GPU) raises UnsupportedError out of the SDPA call: torch
    does not fall back. What PyTorch refuses before calling (dropout, ALiBi) and what never
    reaches the flash backend (an attention mask) is in Note [SDPA registration]. Returns the
    registered name; raises UnsupportedError, naming the torch versions that have the
    registry, where this torch lacks it.
    """
    try:
        from torch.nn.attention import (
            activate_flash_attention_impl,
            register_flash_attention_impl,
        )
        from torch.nn.attention._fa4 import register_flash_attention_fa4  # noqa: F401
    except ImportError as error:
        raise UnsupportedError(
            f"fa4_final.register_sdpa needs torch.nn.attention's register_flash_attention_impl "
            f"and activate_flash_attention_impl and torch.nn.attention._fa4's "
            f"register_flash_attention_fa4, which torch 2.10 and later have (checked with 2.10 "
            f"to 2.13); this torch is {torch.__version__} ({error})") from error
    register_flash_attention_impl(SDPA_IMPL, register_fn=_register_fa4_module)
    if activate:
        activate_flash_attention_impl(SDPA_IMPL)
    return SDPA_IMPL
