"""The decode kernel behind the API: FA4's ``page_table`` and ``num_splits`` reach the Hopper
decode forward (fa4_final.hopper.decode) here.

Note [Decode through the API]
Two kinds of call reach the decode kernel:
  - a paged KV cache: flash_attn_varlen_func(..., page_table=...) and api.sdpa's
    _flash_attn_fwd. No other kernel of the package reads pages, so such a call always runs
    here. q is packed (total_q, heads, d) with cu_seqlens_q, or dense (batch, seqlen_q, heads,
    d), as FA4 takes it; k and v are (num_pages, page_size, heads_kv, d) with a page table
    (batch, max_pages) and seqused_k (Note [Paged KV checks] in runtime.decode says what is
    checked).
  - a decode shape: a call of flash_attn_func that needs no gradient and whose shape the kernel
    takes (``decode_takes``: at most DECODE_MAX_TOKENS query tokens and DECODE_MAX_PACKED_ROWS
    packed rows per (batch entry, kv head), head dim 64 or 128 with dv equal, no softcap or
    learnable sink, causal (bottom-right) and a left window only) runs here, split into FA4's
    ``num_splits`` (< 1: the heuristic of Note [Split count], 1: none, n: n). Any other call
    runs the forward, and num_splits stays a speed knob it ignores. Both kernels compute the
    same attention; they differ in rounding (the split partials are float32 and merged by the
    combine).
The limits of the decode shape are the range the kernel was written and tested for (1-16 query
tokens, up to four 64-row m-blocks of packed rows: 16 tokens at GQA 16; a left window side
>= 0), not a measured crossover with the forward. Measured on an H100 at batch 32, D = 128,
1, 4 and 16 tokens at GQA 4 and 8, with 8k keys or more, a call routed here reached 0.97-1.00x
the speed of the fastest peer (93-103% of the copy rate); the forward, timed at the same shapes
before they were routed here, 0.23-0.52x: routing these shapes to it is what the measurement
says. The kernel and its split combine are tested against float64 on an H100 and an H200,
directly and through the API (a paged call captured in a CUDA graph among them), and
compute-sanitizer's memcheck and synccheck found no error in them (H100). They have left the
gate of Note [Pending features] (fa4_final.runtime.pending): no call asks FA4_FINAL_PENDING.

num_splits keeps FA4's meaning and default: 1 is one split, however few CTAs that leaves (at
batch 1 a step then has heads_kv CTAs and reads its cache at a tenth of the copy rate); < 1 asks
for Note [Split count]'s heuristic. A serving engine that wants the heuristic passes 0.

Where this differs from FA4: a page size must be a multiple of 16 (Note [Paged KV checks]).

Forward only. The decode kernel has no backward, and FA4 (4.0.0b36) has none with a page table
either (its backward is given no page table). A paged call that will need a gradient (grad mode
on and an input that requires grad) is refused at the forward, naming the page table; a decode
shape that will need one takes the verified forward, whose backward exists.

No host synchronisation on the launch path: the split count comes from shapes and the SM count
(choose_num_splits over the page table's capacity or the cache's length), the float32
partials are allocated (partials_like), the kernel and the combine are launched on the current
stream, and varlen queries size the grid by max_seqlen_q, a host int (None: the packed count, a
bound). A dense q with a page table reads nothing back: a page table or seqused_k out of range
gives NaN rows, found by the kernel itself (Note [Paged KV checks]); FA4_FINAL_PAGED_CHECKS=1
adds the host check that names the bad value, one copy of four numbers after the kernel's
launch. Packed queries copy cu_seqlens_q to the host once per call before the launch, as the
varlen checks do (the kernel's q and out addresses trust its offsets). Every host check is
skipped while a CUDA graph is captured, under torch.compile's tracing and with
FA4_FINAL_VARLEN_CHECKS=0. A warm-up call compiles the kernels, so a captured call compiles
nothing.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from fa4_final.common.combine import combine_choice, combine_recipe
from fa4_final.common.constants import DTYPE_NAMES, HEAD_DIMS, TORCH_TO_CUTLASS, WGMMA_M
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper import host as hopper_host
from fa4_final.hopper.config import (
    hopper_decode_contiguous,
    hopper_decode_default,
    hopper_decode_for_page,
    hopper_decode_for_rows,
)
from fa4_final.hopper.host import decode_recipe, launch_decode
from fa4_final.runtime.checks import (
    ACCEPTED_DTYPES,
    _check_heads_and_dim,
    _check_index_vector,
    check_addresses,
    check_inputs,
    check_max_seqlen,
    check_outputs,
    check_scale,
    check_tma_operand,
    check_varlen_values,
    normalise_window,
)
from fa4_final.runtime.compile import compiled
from fa4_final.runtime.decode import (
    DeferredPagedCheck,
    _values_readable,
    check_num_splits,
    check_paged_kv,
    choose_num_splits,
    combine_own_partials,
    partials_like,
    start_paged_kv_check,
)
from fa4_final.runtime.prologue import cached_backend, fill_empty_rows, resolve_scale

DECODE_MAX_TOKENS = 16  # query tokens per sequence the decode kernel is written for
DECODE_MAX_PACKED_ROWS = 4 * WGMMA_M  # packed rows per (batch entry, kv head): 4 m-blocks


# ----------------------------------------------------------------------------------------------
# which calls


def needs_grad(*inputs) -> bool:
    """Whether a gradient will be asked of a call on ``inputs``: grad mode on and one of them
    requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def decode_takes(q, k, v, causal: bool, right, softcap: float = 0.0,
                 learnable_sink=None, left=None) -> bool:
    """Whether the decode kernel takes a dense call (q (b, sq, h, d), k and v (b, sk, hk, d)),
    its window already normalised (runtime.checks.normalise_window): the decode shape of
    Note [Decode through the API]. A negative left side (a bound right of the diagonal) stays
    on the forward: the decode kernel's tests use windows that reach left."""
    sq, h, d = q.shape[1], q.shape[2], q.shape[3]
    hk = k.shape[2]
    return (d in HEAD_DIMS and v.shape[-1] == d and not softcap and learnable_sink is None
            and (right is None or causal) and (left is None or left >= 0)
            and sq <= DECODE_MAX_TOKENS
            and sq * (h // hk) <= DECODE_MAX_PACKED_ROWS)


def routes_to_decode(q, k, v, causal: bool, right, softcap: float = 0.0,
                     learnable_sink=None, left=None) -> bool:
    """Whether a dense call runs the decode kernel in place of the forward: no gradient will be
    needed, and the shape is one it takes (Note [Decode through the API]). False leaves the
    call on the forward."""
    sink = () if learnable_sink is None else (learnable_sink,)
    return (not needs_grad(q, k, v, *sink)
            and decode_takes(q, k, v, causal, right, softcap, learnable_sink, left))


# ----------------------------------------------------------------------------------------------
# a paged call: checks, limits, forward only


def _check_cu_seqlens_q_values(cu_seqlens_q, total_q: int, max_seqlen_q) -> None:
    """cu_seqlens_q's values (start 0, non-decreasing, last = total_q, max_seqlen_q no less
    than the longest sequence): one host copy, skipped as Note [Paged KV checks] says."""
    if os.environ.get("FA4_FINAL_VARLEN_CHECKS") == "0" or not _values_readable(cu_seqlens_q):
        return
    cu = cu_seqlens_q.tolist()
    # cu_seqlens_q given for both sides: any problem of it is named as cu_seqlens_q's first
    check_varlen_values(cu, cu, None, total_q, total_q, max_seqlen_q, None)


def check_paged_call(q, k, v, page_table, seqused_k, cu_seqlens_q=None, max_seqlen_q=None,
                     softmax_scale=None, check_address: bool = True,
                     check_values: bool | None = None, cu_seqlens_k=None):
    """Validate a paged call: q (total_q, heads, d) with cu_seqlens_q or (batch, seqlen_q,
    heads, d); the cache, table and seqused_k by runtime.decode.check_paged_kv
    (Note [Paged KV checks]); returns (batch, q rows per sequence bound, heads, heads_kv, d,
    PagedKV, values): ``values``, a runtime.decode.DeferredPagedCheck, has the page table's
    and seqused_k's value checks launched on the device; the caller calls its finish() after
    launching the kernel (cu_seqlens_q's values, which the kernel's q and out addresses trust,
    are checked here, before).
    ``check_values``: None checks the page table's and seqused_k's values where
    wants_value_checks says (off a GPU, or with FA4_FINAL_PAGED_CHECKS=1) and cu_seqlens_q's
    by the varlen checks' rule (unless FA4_FINAL_VARLEN_CHECKS=0 or unreadable); False checks
    neither, True both.
    ``cu_seqlens_k``: refused with a page table (FA4 takes one or the other)."""
    varlen = cu_seqlens_q is not None
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    layout = ("3-D (total_q, heads, head_dim) with cu_seqlens_q" if varlen else
              "4-D (batch, seqlen_q, heads, head_dim) without cu_seqlens_q")
    if q.dim() != (3 if varlen else 4):
        raise ValueError(f"with a page_table, q must be {layout}, got shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype not in TORCH_TO_CUTLASS:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: {ACCEPTED_DTYPES}")
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(f"q, k, v must share a dtype and a device, got q {q.dtype} on "
                             f"{q.device}, {name} {t.dtype} on {t.device}")
    if varlen:
        _check_index_vector("cu_seqlens_q", cu_seqlens_q, None, q.device)
        if cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q must have batch + 1 >= 1 entries, got none")
        batch = cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    paged = check_paged_kv(k, v, page_table, seqused_k, batch, cu_seqlens_k, check_values=False)
    h, hk, d = _check_heads_and_dim(q, k)
    check_scale(softmax_scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_operand(name, t, check_address)
    values = start_paged_kv_check(page_table, seqused_k, paged, check_values)
    if varlen and check_values is not False:  # the varlen checks' rule, not the page table's
        _check_cu_seqlens_q_values(cu_seqlens_q, q.shape[0], max_seqlen_q)
    rows = (q.shape[0] if max_seqlen_q is None else max_seqlen_q) if varlen else q.shape[1]
    return batch, rows, h, hk, d, paged, values


def refuse_decode_limits(func: str, head_dim: int, head_dim_v: int, causal: bool, right,
                         softcap: float = 0.0, learnable_sink=None, seqused_q=None,
                         paged: bool = True, left=None) -> None:
    """UnsupportedError naming what a call asks of the decode kernel that it does not have:
    head dims other than 64/128 or dv != d, a softcap, a learnable sink, a right window bound
    other than causal's, a negative left bound (a window the kernel was not built to place),
    seqused_q. ``paged``: the call has a page table (the message says so: no other kernel
    reads one)."""
    what = "the decode kernel, the only one that reads a paged cache," if paged else \
        "the decode kernel"
    given = " with a page_table" if paged else ""
    if head_dim not in HEAD_DIMS or head_dim_v != head_dim:
        raise UnsupportedError(f"{func}: head_dim={head_dim}, dv={head_dim_v}{given} is "
                               f"refused: {what} is built for head dims {HEAD_DIMS} with dv == "
                               f"head_dim")
    for name, on in (("softcap", bool(softcap)), ("learnable_sink", learnable_sink is not None),
                     ("seqused_q", seqused_q is not None)):
        if on:
            raise UnsupportedError(f"{func}: {name}{given} is refused: {what} has no {name}")
    if right is not None and not causal:
        raise UnsupportedError(f"{func}: window_size's right side {right}{given} is refused: "
                               f"{what} takes causal (bottom-right) and a left window only")
    if left is not None and left < 0:
        raise UnsupportedError(f"{func}: window_size's left side {left}{given} is refused: "
                               f"{what} takes a left window side >= 0 (or None)")


def refuse_paged_gradient(func: str, *inputs) -> None:
    """UnsupportedError when a paged call will need a gradient: there is no paged backward
    (nor in FA4)."""
    if needs_grad(*inputs):
        raise UnsupportedError(
            f"{func}: a call with a page_table is forward only (the decode kernel has no "
            f"backward, and FA4 has no paged backward either). Run it under torch.no_grad(), or "
            f"with q, k, v not requiring grad")


# ----------------------------------------------------------------------------------------------
# the runtime entry


def decode_forward_into(q, k, v, out, lse, causal=False, softmax_scale=None,
                        window_size=(None, None), *, page_table=None, seqused_k=None,
                        cu_seqlens_q=None, max_seqlen_q=None, num_splits: int = 1,
                        softcap=0.0, learnable_sink=None, check_values: bool | None = None):
    """Run the decode kernel into ``out`` (like q) and ``lse`` ((b, h, sq), or (h, total_q)
    with cu_seqlens_q), float32. Dense: q (b, sq, h, d), k and v (b, sk, hk, d). Paged
    (``page_table``): as check_paged_call. ``num_splits``: FA4's (< 1 the heuristic, 1 none, n
    splits). Checked, forward only (Note [Decode through the API])."""
    func = "decode_forward_into"
    num_splits = check_num_splits(num_splits)
    paged = page_table is not None
    values = DeferredPagedCheck()  # Note [Paged KV checks]: read after the launch
    if paged:
        batch, rows, h, hk, d, _, values = check_paged_call(
            q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, softmax_scale,
            check_values=check_values)
        lse_shape = (h, q.shape[0]) if cu_seqlens_q is not None else (batch, h, rows)
    else:
        if seqused_k is not None or cu_seqlens_q is not None:
            raise UnsupportedError(f"{func}: seqused_k and cu_seqlens_q are taken with a "
                                   f"page_table only")
        batch, rows, _, h, hk, d = check_inputs(q, k, v, softmax_scale)
        lse_shape = (batch, h, rows)
    check_outputs(q, out, lse, lse_shape, head_dim_v=v.shape[-1])
    causal, left, right = normalise_window(causal, window_size)
    refuse_decode_limits(func, d, v.shape[-1], causal, right, softcap, learnable_sink,
                         paged=paged, left=left)
    refuse_paged_gradient(func, q, k, v)
    _launch_checked(func, q, k, v, out, lse, batch, page_table, seqused_k, cu_seqlens_q,
                    max_seqlen_q, causal, resolve_scale(d, softmax_scale), left, num_splits)
    values.finish()
    return out, lse


def _launch_checked(func: str, q, k, v, out, lse, batch: int, page_table, seqused_k,
                    cu_seqlens_q, max_seqlen_q, causal: bool, scale: float, left,
                    num_splits: int) -> None:
    """What follows the checks: the device's family (a CPU tensor is named here), empty
    problems answered without a launch, else the kernel (and the combine)."""
    backend = cached_backend(q.device)
    if backend.family != "Hopper":
        raise UnsupportedError(f"{func}: the decode kernel is built for Hopper (sm_90a) only; "
                               f"this GPU's row is {backend.label}")
    if q.numel() == 0 or batch == 0:
        return
    if page_table is None and k.shape[1] == 0:  # no key (a TMA box cannot have an empty extent)
        fill_empty_rows(out, lse)
        return
    run_decode(q, k, v, out, lse, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, causal,
               scale, left, num_splits, backend.target)


def fresh_outputs(q, v, varlen: bool):
    """out like q with v's head dim, lse float32 ((b, h, sq), or (h, total_q) when varlen)."""
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if varlen:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def decode_forward(q, k, v, causal=False, softmax_scale=None, window_size=(None, None), *,
                   page_table=None, seqused_k=None, cu_seqlens_q=None, max_seqlen_q=None,
                   num_splits: int = 1, check_values: bool | None = None):
    """(out, lse) of decode_forward_into in fresh tensors (out like q, lse float32)."""
    out, lse = fresh_outputs(q, v, cu_seqlens_q is not None)
    return decode_forward_into(q, k, v, out, lse, causal, softmax_scale, window_size,
                               page_table=page_table, seqused_k=seqused_k,
                               cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                               num_splits=num_splits, check_values=check_values)


def decode_checked(func: str, q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q,
                   scale: float, causal: bool, left, num_splits: int):
    """(out, lse) of a public call whose function has already checked everything
    decode_forward_into checks but the operands' TMA addresses (q, k, v were checked with
    check_address=False; fa4_final.api.ops's Note [The eager path]): those here, then the
    launch, without a second pass of the shape checks. ``scale`` resolved, ``causal`` and
    ``left`` normalised; the page table's values are the caller's to finish."""
    check_addresses(("q", q), ("k", k), ("v", v))
    varlen = cu_seqlens_q is not None
    out, lse = fresh_outputs(q, v, varlen)
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    _launch_checked(func, q, k, v, out, lse, batch, page_table, seqused_k, cu_seqlens_q,
                    max_seqlen_q, causal, scale, left, num_splits)
    return out, lse


def num_sms(device) -> int:
    """The device's SM count (read once per device: no synchronisation)."""
    return hopper_host.num_sms(device)


def decode_plan_args(q, k, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, causal: bool,
                     left, num_splits: int, sms: int) -> tuple[int, tuple]:
    """(splits, decode_recipe's arguments) of one call, from shapes and the SM count only: the
    config for the page size (hopper_decode_for_page; hopper_decode_contiguous without one) and
    the packed rows (hopper_decode_for_rows: two consumer warpgroups above 64), the split count
    of choose_num_splits over the keys a sequence can hold."""
    d, h, hk = q.shape[-1], q.shape[-2], k.shape[2]
    paged, varlen = page_table is not None, cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    tokens = (q.shape[0] if max_seqlen_q is None else max_seqlen_q) if varlen else q.shape[1]
    keys = k.shape[1] * page_table.shape[1] if paged else k.shape[1]
    return _plan(d, DTYPE_NAMES[q.dtype], h, hk, batch, tokens, k.shape[1], keys, paged,
                 varlen, bool(causal), seqused_k is not None, left is not None, num_splits, sms)


@functools.lru_cache(maxsize=1024)
def _plan(d: int, dtype: str, h: int, hk: int, batch: int, tokens: int, page_size: int,
          keys: int, paged: bool, varlen: bool, causal: bool, has_seqused_k: bool,
          has_left: bool, num_splits: int, sms: int) -> tuple[int, tuple]:
    """decode_plan_args from ints alone, remembered: a decoding loop asks the same shape every
    step, and this is host time on every call."""
    default = hopper_decode_default(d)
    rows = tokens * (h // hk)  # packed query rows of a (batch entry, KV head)
    cfg = hopper_decode_for_rows(hopper_decode_for_page(d, page_size) if paged
                                 else hopper_decode_contiguous(d), rows)
    splits = choose_num_splits(num_splits, batch=batch, heads_kv=hk, packed_rows=rows,
                               key_tiles=-(-keys // cfg.tile_n), num_sms=sms,
                               tile_m=cfg.tile_m, tile_n=cfg.tile_n)
    args = (d, dtype, causal, paged, has_seqused_k, splits > 1,
            None if cfg == default else cfg, varlen, has_left)
    return splits, args


def run_decode(q, k, v, out, lse, page_table, seqused_k, cu_seqlens_q, max_seqlen_q,
               causal: bool, scale: float, left, num_splits: int, target: str = "sm_90a"):
    """Compile (once per key) and launch the decode kernel, then the combine when split: on
    checked, non-empty inputs; nothing here waits for the GPU."""
    splits, args = decode_plan_args(q, k, page_table, seqused_k, cu_seqlens_q, max_seqlen_q,
                                    causal, left, num_splits, num_sms(q.device))
    plan = compiled(decode_recipe, *args)
    varlen = cu_seqlens_q is not None
    page_table, used = _launch_tables(page_table, seqused_k)
    cu = cu_seqlens_q.contiguous() if varlen else None
    max_q = (q.shape[0] if max_seqlen_q is None else max_seqlen_q) if varlen else None
    launch_planned(Planned(plan, splits, scale, left, target, None), q, k, v, out, lse,
                   page_table, used, cu, max_q)
    return out, lse


def _launch_tables(page_table, seqused_k) -> tuple:
    """The page table (contiguous along the pages, as FA4) and seqused_k as the kernel reads
    them."""
    if page_table is not None and page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    return page_table, None if seqused_k is None else seqused_k.contiguous()


class Planned(NamedTuple):
    """What a decode call resolved before its launch: the compiled kernel, the split count,
    the scale, the left window side, the combine's target and, for outputs made by
    fresh_outputs (contiguous, aligned), the combine's compiled plan (None: combine_splits'
    checks first)."""

    plan: object
    splits: int
    scale: float
    left: int | None
    target: str
    combine: object


def launch_planned(p: Planned, q, k, v, out, lse, page_table=None, used=None, cu=None,
                   max_q=None) -> None:
    """The launches of a resolved call: the kernel into out and lse (one split) or into float32
    partials merged by the combine."""
    if p.splits == 1:
        launch_decode(p.plan, q, k, v, out, lse, page_table, used, p.scale, cu, max_q, p.left)
        return
    out_p, lse_p = partials_like(out, p.splits)
    launch_decode(p.plan, q, k, v, out_p, lse_p, page_table, used, p.scale, cu, max_q, p.left)
    if p.combine is None:
        combine_own_partials(out_p, lse_p, out, lse, p.target)
    else:  # fresh outputs: nothing of the combine's layout rule left to check
        p.combine.kernels["main"](out_p, lse_p, out, lse)


# ----------------------------------------------------------------------------------------------
# a repeated decode call

# Note [A repeated decode call]
# A decoding loop calls flash_attn_func (or flash_attn_varlen_func with a page table) on
# tensors of the same shapes, strides, dtypes and devices with the same arguments at every
# step, and at batch 1 the host's work for the call (the checks, the route, the plan's
# lookups) takes longer than its kernels. The public functions keep, per signature of a call
# that went the whole way here eagerly, what that call resolved (``resolve``: the plan, the
# split count, the scale, the window); a later call with the same signature redoes only what
# depends on the tensors themselves (no gradient needed, nothing observing the call, the TMA
# base addresses, and for a page table whether its values are to be checked now, which sends
# the call the whole way) and launches. The signature (fa4_final.api.interface) holds every
# tensor's shape, strides, dtype and device (the page table's and seqused_k's too), and every
# other argument with its type, of plain scalars only (None, bool, int, float, and tuples or
# lists of them), so True and 1, or 1 and 1.0, are different signatures: a call whose first
# form was refused or took another route never finds an entry. Packed queries (cu_seqlens_q,
# whose values are checked on every call), a learnable sink and empty problems keep the whole
# path. The functions a resolution asked (the SM count, the compile path) are in the
# signature, so a replaced one is asked again. It waited in Note [Pending features] as
# repeated_decode until its GPU tests passed (an H100: bit for bit the whole path, new values
# against float64, captured in a CUDA graph); a row put back there turns it off.


def resolve(q, k, page_table, seqused_k, scale: float, causal: bool, left,
            num_splits: int) -> Planned | None:
    """The Planned of a checked dense-q call that decode_checked launches, contiguous cache or
    paged, for Note [A repeated decode call]; None for a call that launches nothing (empty) or
    not on a Hopper row."""
    backend = cached_backend(q.device)
    empty = page_table is None and k.shape[1] == 0
    if backend.family != "Hopper" or q.numel() == 0 or q.shape[0] == 0 or empty:
        return None
    splits, args = decode_plan_args(q, k, page_table, seqused_k, None, None, causal, left,
                                    num_splits, num_sms(q.device))
    combine = None
    if splits > 1:
        combine = compiled(combine_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], backend.target,
                           False, *combine_choice(splits))
    return Planned(compiled(decode_recipe, *args), splits, scale, left, backend.target, combine)


def launch_resolved(p: Planned, q, k, v, page_table=None, seqused_k=None):
    """(out, lse) of a dense-q call resolved before (Note [A repeated decode call]): the TMA
    base addresses checked, fresh outputs, the page table and seqused_k as run_decode passes
    them, the launches."""
    check_addresses(("q", q), ("k", k), ("v", v))
    out, lse = fresh_outputs(q, v, False)
    launch_planned(p, q, k, v, out, lse, *_launch_tables(page_table, seqused_k))
    return out, lse
