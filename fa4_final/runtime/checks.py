"""Input checks: every setup the kernels cannot take is refused here, saying what was wrong and
what is accepted.

Two kinds. Checks of metadata (dtype, device, shapes, strides) cost nothing and run everywhere,
also while torch.compile traces (on fake tensors, so they never read an address or a value).
Checks of values (cu_seqlens monotone, their last entry, seqused_k within the lengths) need the
numbers on the host: they run when the kernel runs (runtime.varlen).
"""

from __future__ import annotations

import math
import numbers

import torch

from fa4_final.common.constants import BACKWARD_HEAD_DIMS, FWD_HEAD_DIMS, TORCH_TO_CUTLASS
from fa4_final.common.errors import UnsupportedError

ACCEPTED_DTYPES = "torch.bfloat16, torch.float16"
# BACKWARD_HEAD_DIMS split for the messages: its head dims with dv == head_dim, its other pairs
_BWD_DIMS = tuple(d for d, dv in BACKWARD_HEAD_DIMS if d == dv)
_BWD_DV_PAIRS = tuple((d, dv) for d, dv in BACKWARD_HEAD_DIMS if d != dv)


def normalise_window(causal: bool, window_size) -> tuple[bool, int | None, int | None]:
    """(causal, left, right) as the FA4 package (4.0.0b36) reads ``causal`` and ``window_size``,
    with None for an unbounded side.

    Query row i sees key j when i + offset - left <= j <= i + offset + right (offset =
    seqlen_k - seqlen_q). A negative side is a bound like any other: ``(None, -w)`` keeps the
    keys at least w before the diagonal, ``(-w, None)`` those at least w after it. Only a window
    whose two sides are both negative means "no window" (FlashAttention-2 spelled that (-1, -1)).
    ``causal=True`` sets the right side to 0, whatever was given (as FA4 does). A window of
    (None, 0) is causal; a right side of 0 with a left bound is returned as causal with that
    left bound (the same mask)."""
    if window_size is None:
        window_size = (None, None)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"window_size must be a pair (left, right) of ints or None, got "
                         f"{window_size!r}")
    sides = []
    for name, w in zip(("left", "right"), window_size):
        if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral)):
            raise ValueError(f"window_size's {name} side must be an int or None, got {w!r}")
        sides.append(None if w is None else int(w))
    left, right = sides
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    return bool(causal or right == 0), left, right


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0 or None, got "
                         f"{softmax_scale!r}")


def _check_qkv(q, k, v, dims: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in TORCH_TO_CUTLASS:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: {ACCEPTED_DTYPES}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:-1] == v.shape[:-1] and k.shape[-1] != v.shape[-1] \
            and v.shape[-1] not in FWD_HEAD_DIMS:
        raise UnsupportedError(
            f"v's head dim {v.shape[-1]} differs from q and k's {k.shape[-1]}: fa4_final's "
            f"Hopper forward takes dv != d with each of {FWD_HEAD_DIMS} (its backward dv == d, "
            f"and (d, dv) in {_BWD_DV_PAIRS})")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape (but v's head dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")


def _check_heads_and_dim(q, k) -> tuple[int, int, int]:
    h, d = q.shape[-2:]
    hk, dk = k.shape[-2:]
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k and v have head_dim {dk}")
    if d not in FWD_HEAD_DIMS:
        raise UnsupportedError(f"head_dim must be one of {FWD_HEAD_DIMS} (the Hopper forward; "
                               f"the backward {_BWD_DIMS} with dv == head_dim), got {d}")
    if hk == 0 or h % hk:
        raise ValueError(f"q's {h} heads must be a multiple of k/v's {hk} heads (GQA/MQA)")
    return h, hk, d


def check_inputs(q, k, v, softmax_scale=None, check_address: bool = True):
    """Validate dense q, k, v; return (batch, seqlen_q, seqlen_k, heads, heads_kv, dim).
    ``check_address=False`` skips the base-address test (fake tensors have no address)."""
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq = q.shape[:2]
    bk, sk = k.shape[:2]
    if bk != b:
        raise ValueError(f"q has batch {b} but k and v have batch {bk}")
    h, hk, d = _check_heads_and_dim(q, k)
    check_scale(softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_operand(name, t, check_address)
    return b, sq, sk, h, hk, d


def check_tma_operand(name: str, t: torch.Tensor, check_address: bool = True) -> None:
    """TMA reads tensors through a descriptor: the last dim contiguous, the other strides
    multiples of 16 bytes, a 16-byte aligned base."""
    if t.numel() == 0:
        return
    strides, size = t.stride(), t.element_size()
    if strides[-1] != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides "
                         f"{strides}; call .contiguous() first")
    bad = [st for st in strides[:-1] if (st * size) % 16]
    misaligned = check_address and t.data_ptr() % 16
    if bad or misaligned:
        where = f", address % 16 = {t.data_ptr() % 16}" if check_address else ""
        raise ValueError(
            f"{name} needs strides that are multiples of 16 bytes and a 16-byte aligned base "
            f"address (TMA): strides {t.stride()} of {t.element_size()}-byte elements{where}; "
            f"call .contiguous() first")


def check_addresses(*named) -> None:
    """The base-address part of check_tma_operand for (name, tensor) pairs whose strides
    passed it already (check_inputs with ``check_address=False``): the same error."""
    for name, t in named:
        if t.data_ptr() % 16 and t.numel():
            check_tma_operand(name, t)


def check_outputs(q, out, lse, lse_shape: tuple, check_address: bool = True,
                  head_dim_v: int | None = None) -> None:
    """``out`` like q (its last dim ``head_dim_v`` when given: v's); ``lse`` float32 of
    ``lse_shape`` with a unit last stride."""
    shape = (*q.shape[:-1], q.shape[-1] if head_dim_v is None else head_dim_v)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be like q with v's head dim {shape} {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_tma_operand("out", out, check_address)
    if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != torch.float32 \
            or lse.device != q.device or (lse.numel() and lse.stride(-1) != 1):
        raise ValueError(f"lse must be float32 {tuple(lse_shape)} with stride 1 last, on "
                         f"{q.device}, got {lse.dtype} {tuple(lse.shape)} strides {lse.stride()} "
                         f"on {lse.device}")


def check_grads(q, k, dout, dq, dk, dv, check_address: bool = True, v=None) -> None:
    """dout and dq like q, dk and dv like k, all readable by TMA. With ``v`` of another head
    dim than q's (dv != head_dim): dout like q with v's head dim (out's shape), dv like v."""
    if v is not None and v.shape[-1] != q.shape[-1]:
        for name, t, like, what in (("dout", dout, q, "q with v's head dim"), ("dv", dv, v, "v")):
            shape = (*like.shape[:-1], v.shape[-1])
            if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device:
                raise ValueError(f"{name} must have the shape, dtype and device of {what} "
                                 f"({shape} {like.dtype} {like.device}), got {tuple(t.shape)} "
                                 f"{t.dtype} {t.device}")
            check_tma_operand(name, t, check_address)
        pairs = (("dq", dq, q), ("dk", dk, k))
    else:
        pairs = (("dout", dout, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, k))
    for name, t, like in pairs:
        if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{name} must have the shape, dtype and device of "
                             f"{'q' if like is q else 'k'} ({tuple(like.shape)} {like.dtype} "
                             f"{like.device}), got {tuple(t.shape)} {t.dtype} {t.device}")
        check_tma_operand(name, t, check_address)


def check_dlse(dlse, lse) -> None:
    """The lse's gradient: a floating tensor of lse's shape on lse's device (the kernel reads it
    as float32)."""
    if not isinstance(dlse, torch.Tensor) or not dlse.is_floating_point() \
            or tuple(dlse.shape) != tuple(lse.shape) or dlse.device != lse.device:
        got = (f"{dlse.dtype} {tuple(dlse.shape)} on {dlse.device}"
               if isinstance(dlse, torch.Tensor) else type(dlse).__name__)
        raise ValueError(f"dlse must be a floating tensor of lse's shape {tuple(lse.shape)} on "
                         f"{lse.device}, got {got}")


# ----------------------------------------------------------------------------------------------
# varlen


def _check_index_vector(name: str, t, length, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries (one per sequence), got "
                         f"{t.shape[0]}")


def check_seqused_q(seqused_q, cu_seqlens_q, device) -> None:
    """seqused_q's metadata: int32 (batch,) on q's device, batch read off cu_seqlens_q when it
    is a tensor (check_varlen_inputs checks it again with the rest; its values:
    check_varlen_values)."""
    batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) \
        and cu_seqlens_q.dim() == 1 else None
    _check_index_vector("seqused_q", seqused_q, batch, device)


def check_max_seqlen(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                        check_address: bool = True, seqused_q=None):
    """Validate packed q (total_q, heads, dim), k and v (total_k, heads_kv, dim) and the int32
    cu_seqlens (batch + 1 entries each), seqused_k and seqused_q (batch); return (batch,
    total_q, total_k, heads, heads_kv, dim). The values are checked by check_varlen_values."""
    _check_qkv(q, k, v, 3, "(total_tokens, heads, head_dim) (sequences packed one after another)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{name} is required: the int32 offsets of each sequence, batch + 1 "
                             f"entries starting at 0")
        _check_index_vector(name, cu, None, q.device)
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must have batch + 1 >= 1 entries, got none")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k "
                         f"{cu_seqlens_k.shape[0]}: both are batch + 1 long")
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k is not None:
        _check_index_vector("seqused_k", seqused_k, batch, q.device)
    if seqused_q is not None:
        _check_index_vector("seqused_q", seqused_q, batch, q.device)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    h, hk, d = _check_heads_and_dim(q, k)
    check_scale(softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_operand(name, t, check_address)
    return batch, q.shape[0], k.shape[0], h, hk, d


def _used_lengths(name: str, used: list[int] | None, lengths: list[int], cu_name: str
                  ) -> list[int]:
    """The lengths a call uses: ``used`` (seqused_k or seqused_q's values) when given, each
    checked to lie in [0, its sequence's length in ``cu_name``], else ``lengths``."""
    if used is None:
        return lengths
    bad = [i for i, (u, n) in enumerate(zip(used, lengths)) if not 0 <= u <= n]
    if bad:
        i = bad[0]
        raise ValueError(f"{name}[{i}] = {used[i]} must be in [0, {lengths[i]}] (the length of "
                         f"sequence {i} in {cu_name})")
    return list(used)


def check_varlen_values(cu_q: list[int], cu_k: list[int], seqused_k: list[int] | None,
                        total_q: int, total_k: int, max_seqlen_q=None, max_seqlen_k=None,
                        seqused_q: list[int] | None = None):
    """The checks that need the offsets' values (host lists); returns the per-sequence (q
    lengths used, k lengths used)."""
    for name, cu, total, what in (("cu_seqlens_q", cu_q, total_q, "q"),
                                  ("cu_seqlens_k", cu_k, total_k, "k and v")):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        drops = [i for i in range(len(cu) - 1) if cu[i + 1] < cu[i]]
        if drops:
            i = drops[0]
            raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), but entry "
                             f"{i + 1} = {cu[i + 1]} < entry {i} = {cu[i]}")
        if cu[-1] != total:
            raise ValueError(f"{name}'s last entry must equal the {total} rows of {what}, got "
                             f"{cu[-1]}")
    len_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    len_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    used_k = _used_lengths("seqused_k", seqused_k, len_k, "cu_seqlens_k")
    # Note [Used query rows]: a sequence's first seqused_q[b] rows
    len_q = _used_lengths("seqused_q", seqused_q, len_q, "cu_seqlens_q")
    for name, given, lengths in (("max_seqlen_q", max_seqlen_q, len_q),
                                 ("max_seqlen_k", max_seqlen_k, used_k)):
        longest = max(lengths, default=0)
        if given is not None and given < longest:
            raise ValueError(f"{name} = {given} is less than the longest sequence, {longest}")
    return len_q, used_k


# FA4's softcap and learnable_sink (Note [Softcap], Note [Learnable sink] in
# fa4_final.common.softmax). Every entry point runs these checks (runtime.pending.check_features:
# the kernels that compute both passed their GPU tests, and the gate of Note [Pending features]
# lets them by).
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # FA4's _LEARNABLE_SINK_DTYPES


def check_softcap(softcap) -> float:
    """FA4's ``softcap`` as a float: None or 0.0 mean no cap (FA4 reads both so); otherwise a
    finite number > 0 (the scores become softcap * tanh(scale * q.k / softcap)). A negative,
    NaN or infinite softcap, a bool or a tensor is refused, naming the value."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a Python float (0.0 or None: no cap; > 0: the cap), "
                        f"got {softcap!r} of type {type(softcap).__name__}")
    value = float(softcap)
    if not 0.0 <= value < math.inf:  # NaN fails both comparisons (no math.isnan: traceable)
        raise ValueError(f"softcap must be 0.0 (no cap) or a finite number > 0, got {softcap!r}"
                         f": the scores become softcap * tanh(scale * q.k / softcap)")
    return value


def check_learnable_sink(learnable_sink, heads: int, device) -> None:
    """FA4's ``learnable_sink``: None, or a tensor of shape (heads,) (one logit per query head,
    natural-log units), float32, bfloat16 or float16, on the device of q. Metadata only (it
    runs while torch.compile traces)."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor of shape ({heads},) or None, "
                        f"got {type(learnable_sink).__name__}")
    if tuple(learnable_sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape ({heads},): one logit per query head "
                         f"(q has {heads} heads), got shape {tuple(learnable_sink.shape)}")
    if learnable_sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink has dtype {learnable_sink.dtype}; accepted: "
                        f"torch.float32, torch.bfloat16, torch.float16")
    if learnable_sink.device != torch.device(device):
        raise ValueError(f"learnable_sink must be on q's device {device}, got "
                         f"{learnable_sink.device}")
