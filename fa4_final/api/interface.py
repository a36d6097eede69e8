"""The PyTorch entry points: ``flash_attn_func`` and ``flash_attn_varlen_func``.

A drop-in for the FlashAttention-4 package (``flash_attn.cute``) where it overlaps: change the
import and keep the call. The same keyword names, and the same return: a pair ``(out, lse)``,
lse None unless ``return_lse=True`` or an input requires grad (as FA4 returns it). FA4 then
drops the lse's gradient without a sign; here that lse comes back detached (requires_grad
False), so the missing gradient shows. With ``return_lse=True`` the gradient flows.
Arguments after q, k, v are keyword-only, for varlen too: FA4 has qv in the fourth place and FA2
dropout_p (or cu_seqlens_q for varlen), so a positional call from either would mean something
else here; it is refused with a TypeError that says so.
FA4 keywords for features this package lacks are accepted at their neutral value (qv=None,
score_mod=None, ...) and refused with UnsupportedError otherwise; ``num_splits`` and
``pack_gqa`` only tune FA4's speed and are ignored.

Supported: softmax_scale, causal, window_size, deterministic, return_lse, GQA/MQA, varlen with
seqused_k and seqused_q, FA4's ``softcap`` (a float; 0.0 or None: no cap; > 0: scores become
softcap * tanh(scale * q.k / softcap)) and ``learnable_sink`` ((heads,) float32, bfloat16 or
float16 on q's device: one extra logit per query head in every row's softmax denominator,
differentiable). Both are checked (a negative softcap, a sink of the wrong shape, dtype or
device is refused by name). With a sink the returned lse includes it, and a row that sees no
key gets out = 0 and lse = the sink, as FA4. On Hopper the forward takes q's head dim and v's
(dv, out then has it) each from 64, 96, 128, 192, 256, dense and varlen; the backward runs
D = dv = 64, 96, 128, 192 and 256 and D = 192 with dv = 128 (common.constants'
BACKWARD_HEAD_DIMS). Elsewhere a call that will need a gradient is refused at the forward,
naming the backward that is not built (torch.no_grad(), or inputs that do not require grad, run
the forward). The backward at D = dv = 96, at D = 192 with dv = 128 and at D = dv = 192 and 256
passed its GPU tests against float64 and racecheck on an H100, synccheck on an H200. The lse's
gradient is folded into one backward call
(Note [Gradient of the returned lse] in api.ops). The decode kernel
(Note [Decode through the API] in fa4_final.runtime.decode_entry): flash_attn_varlen_func's
``page_table`` (k and v as (num_pages, page_size, heads_kv, dim), seqused_k or none, q packed
with cu_seqlens_q or dense), checked (Note [Paged KV checks]), then run by the decode kernel,
forward only; and a flash_attn_func call that needs no gradient at a decode shape (few query
rows) runs that kernel with FA4's ``num_splits``. The softcap, the sink and the varlen forward at
dv 96 passed their GPU tests against float64 on an H100, the varlen forward at dv 192 and the
decode kernel on an H200.

Layout (FlashAttention's): q (batch, seqlen_q, heads, dim), k and v (batch, seqlen_k, heads_kv,
dim) with heads % heads_kv == 0 (GQA/MQA); out like q; lse float32 (batch, heads, seqlen_q), the
natural log of each row's sum of exp(scale * q.k). Varlen: runtime.varlen. Causal and window
masks are bottom-right aligned when seqlen_q != seqlen_k; a row that sees no key gets out = 0,
lse = -inf.

Layers, top to bottom: these functions (argument checks that also run under torch.compile) ->
the custom ops (api.ops: what torch.compile and autograd see) -> the runtime (checked eager
calls through one prologue, runtime.prologue and runtime.varlen; which GPU runs which kernel,
runtime.dispatch; one compile path, runtime.compile) -> each architecture's host module
(hopper.host: recipes and launches) -> the kernels. A dense eager call on GPU tensors that
nothing traces skips the op and the second checks (Note [The eager path] in api.ops).
"""

from __future__ import annotations

import torch

from fa4_final.api import ops
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime import compile as compile_path
from fa4_final.runtime import decode_entry
from fa4_final.runtime.checks import (
    check_flag,
    check_inputs,
    check_max_seqlen,
    check_varlen_inputs,
)
from fa4_final.runtime.compile import artifacts
from fa4_final.runtime.decode import check_num_splits, wants_value_checks
from fa4_final.runtime.dispatch import backend_for_target
from fa4_final.runtime.pending import (
    check_features,
    forward_only,
    listed,
    refuse_backward_head_dims,
)
from fa4_final.runtime.prologue import forward, prepare

# FA4 keywords of features fa4_final does not run, with the value that means "not used": any
# other value is refused. (softcap, learnable_sink and page_table, which it runs, are the public
# functions' and api.sdpa's own keywords.)
_FA4_NEUTRAL = {
    "qv": None, "gather_kv_indices": None,
    "score_mod": None, "score_mod_bwd": None, "mask_mod": None, "aux_tensors": None,
    "aux_scalars": None, "block_sparse_tensors": None, "block_sparse_tensors_bwd": None,
    "gather_bwd_recompute_p": False, "gather_bwd_token_chunk": None,
}
_FA4_VARLEN_NEUTRAL = {
    **_FA4_NEUTRAL, "min_seqlen_k": None,
    "scheduler_metadata": None, "seqlen_k_per_split": None, "disable_scheduler_metadata": False,
}
_FA4_SPEED_ONLY = ("num_splits", "pack_gqa")  # change how FA4 runs, never what it returns


def _refuse_fa4_options(func: str, options: dict, neutral: dict) -> None:
    for name, value in options.items():
        if name in _FA4_SPEED_ONLY:
            continue
        if name not in neutral:
            raise TypeError(f"{func}() got an unexpected keyword argument {name!r}")
        default = neutral[name]
        unused = value is None or (default is not None and not isinstance(value, torch.Tensor)
                                   and value == default)
        if not unused:
            raise UnsupportedError(
                f"{func}: fa4_final does not implement FA4's {name} (got {value!r}); it supports "
                f"softmax_scale, causal, window_size, deterministic, return_lse, GQA/MQA, "
                f"softcap, learnable_sink, and varlen with seqused_k, seqused_q and page_table")


def _returned_lse(lse, return_lse: bool, inputs):
    if return_lse:
        return lse
    if any(t.requires_grad for t in inputs):
        return lse.detach()
    return None


def _refuse_positional(func: str, extra: tuple) -> None:
    if extra:
        raise TypeError(
            f"{func}() takes q, k, v positionally and everything after them by keyword, got "
            f"{len(extra)} more positional argument(s): FA4's fourth positional argument is qv "
            f"(FlashAttention-2's is dropout_p or cu_seqlens_q), so a positional call from "
            f"either would mean something else here. Name them, e.g. cu_seqlens_q=..., "
            f"causal=True")


def _feature_args(softcap: float, learnable_sink, seqused_q=None) -> tuple:
    """The ops' trailing feature arguments, only when set (a default call is unchanged)."""
    if seqused_q is not None:  # varlen_fwd's last
        return softcap, learnable_sink, seqused_q
    if learnable_sink is not None:
        return softcap, learnable_sink
    return (softcap,) if softcap else ()


def _grad_inputs(q, k, v, learnable_sink) -> tuple:
    return (q, k, v) if learnable_sink is None else (q, k, v, learnable_sink)


def _check_head_dims(func: str, q, k, v, learnable_sink) -> None:
    """At a head dim the backward lacks, a refusal now when a gradient will be asked for (grad
    mode on and an input that requires grad), so that backward() never meets a backward that
    is not built."""
    d, dv = q.shape[-1], v.shape[-1]
    if forward_only(d, dv) and torch.is_grad_enabled() and any(
            t.requires_grad for t in _grad_inputs(q, k, v, learnable_sink)):
        refuse_backward_head_dims(func, d, dv)


# Note [A repeated decode call] (fa4_final.runtime.decode_entry): signature -> Planned, for
# decode calls (flash_attn_func's, and flash_attn_varlen_func's with a page table and a dense
# q) that went the whole way once; at most _REPEATED_KEPT kept
_REPEATED: dict = {}
_REPEATED_KEPT = 64
_PLAIN = frozenset((type(None), bool, int, float))


def _signature(q, k, v, extra: tuple, options: dict, scalars: tuple, window_size,
               tensors: tuple = ()):
    """The signature of a call that may repeat a decode call (Note [A repeated decode call]):
    every tensor's shape, strides, dtype and device (q, k, v and ``tensors``, each a tensor or
    None), every other argument (``scalars``, the window, num_splits) with its type; or None
    where the call must take the whole path (a positional extra, an FA4 option but num_splits,
    a tensor subclass, an argument that is no plain scalar, a traced call)."""
    if torch.compiler.is_compiling():  # a traced call keeps the op (Note [The eager path])
        return None
    if (extra or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or (options and options.keys() - {"num_splits"})):
        return None
    scalars = (*scalars, options.get("num_splits", 1) if options else 1)
    types = tuple(map(type, scalars))
    if type(window_size) not in (tuple, list):
        return None
    window_types = tuple(map(type, window_size))
    if not (_PLAIN.issuperset(types) and _PLAIN.issuperset(window_types)):
        return None
    more = []
    for t in tensors:
        if t is None:
            more.append(None)
        elif type(t) is torch.Tensor:
            more.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, scalars, types, type(window_size),
            tuple(window_size), window_types, *more, decode_entry.num_sms, compile_path.cached)


def _remember(key, planned) -> None:
    """Keep a resolved decode call under its signature (Note [A repeated decode call])."""
    if key is not None and planned is not None:
        if len(_REPEATED) >= _REPEATED_KEPT:
            _REPEATED.clear()
        _REPEATED[key] = planned


def flash_attn_func(q, k, v, *extra, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=None,
                    deterministic=False, return_lse=False, **fa4_options):
    """Attention of q (batch, seqlen_q, heads, dim) over k, v (batch, seqlen_k, heads_kv, dim).

    Returns ``(out, lse)``: out like q (with v's head dim); lse (batch, heads, seqlen_q)
    float32 when ``return_lse`` (its gradient flows) or an input requires grad (detached),
    else None.
    ``window_size=(left, right)`` keeps keys j with i + sk - sq - left <= j <= i + sk - sq +
    right: None is an unbounded side, a negative side a bound like any other, and only both
    sides negative mean no window (FA4's reading, runtime.checks.normalise_window);
    ``causal=True`` sets the right side to 0. ``deterministic`` asks the backward for a fixed
    accumulation order. ``softcap`` and ``learnable_sink``: FA4's (the module's docstring);
    softcap's default is None, which means what FA4's default 0.0 means (no cap), so that
    torch.compile(dynamic=True) does not make a float default a symbolic input and specialise
    it. Differentiable in q, k, v and the
    sink; traceable by torch.compile(fullgraph=True).
    """
    key = None
    if learnable_sink is None and listed("repeated_decode"):  # Note [A repeated decode call]
        key = _signature(q, k, v, extra, fa4_options, (softmax_scale, causal, softcap,
                         deterministic, return_lse), window_size)
        planned = _REPEATED.get(key) if key is not None else None
        if (planned is not None and not decode_entry.needs_grad(q, k, v)
                and ops.eager(q, k, v)):
            out, lse = decode_entry.launch_resolved(planned, q, k, v)
            return out, _returned_lse(lse, return_lse, (q, k, v))
    _refuse_positional("flash_attn_func", extra)
    if fa4_options:
        _refuse_fa4_options("flash_attn_func", fa4_options, _FA4_NEUTRAL)
    num_splits = check_num_splits(fa4_options.get("num_splits", 1))
    cap = check_features("flash_attn_func", softcap, None, 0, None)  # a scalar: first
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale, check_address=False)
    check_features("flash_attn_func", None, learnable_sink, h, q.device)
    _check_head_dims("flash_attn_func", q, k, v, learnable_sink)
    p = prepare(d, check_flag("causal", causal), softmax_scale, window_size)
    check_flag("deterministic", deterministic)
    if decode_entry.routes_to_decode(q, k, v, p.causal, p.right, cap, learnable_sink, p.left):
        # Note [Decode through the API]: forward only, FA4's num_splits
        out, lse = ops.decode_call(q, k, v, None, None, None, None, p.scale, p.causal, p.left,
                                   num_splits)
        returned = _returned_lse(lse, check_flag("return_lse", return_lse), (q, k, v))
        if key is not None and ops.eager(q, k, v):  # went the whole way eagerly: remember it
            _remember(key, decode_entry.resolve(q, k, None, None, p.scale, p.causal, p.left,
                                                num_splits))
        return out, returned
    plain = learnable_sink is None or type(learnable_sink) is torch.Tensor
    fwd = ops.fwd_eager if plain and ops.eager(q, k, v) else ops.fwd  # Note [The eager path]
    out, lse = fwd(q, k, v, p.scale, p.causal, p.left, p.right,
                   check_flag("deterministic", deterministic), check_flag("return_lse", return_lse),
                   *_feature_args(cap, learnable_sink))
    return out, _returned_lse(lse, return_lse, _grad_inputs(q, k, v, learnable_sink))


def flash_attn_varlen_func(q, k, v, *extra, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=None,
                           deterministic=False, return_lse=False, **fa4_options):
    """Attention over sequences packed along the first dim (see runtime.varlen).

    q (total_q, heads, dim), k and v (total_k, heads_kv, dim); cu_seqlens_q and cu_seqlens_k:
    int32 (batch + 1,) offsets from 0 to the totals; seqused_k: int32 (batch,), the k rows used
    per sequence; max_seqlen_q/k: upper bounds of the lengths (checked; None: not given).
    ``softcap``, ``learnable_sink``: as in flash_attn_func. ``seqused_q``: int32 (batch,),
    sequence b's queries are the first seqused_q[b] of its packed rows (0 <= seqused_q[b] <=
    its rows); the rest are padding: never attended, their out and lse rows
    come back 0 and their dq rows 0. Padding rows of q (and of dout) must hold finite values.
    ``page_table`` (the decode kernel, Note [Decode through the API]): int32 (batch, max_pages)
    with k and v (num_pages, page_size, heads_kv, dim), page_size a multiple of 16, seqused_k
    required (sequence b's keys are the first seqused_k[b] rows of pages page_table[b, 0],
    page_table[b, 1], ...), no cu_seqlens_k; q packed with cu_seqlens_q (max_seqlen_q a host
    int or None) or dense (batch, seqlen_q, heads, dim), out and lse then dense too. Forward
    only; split into FA4's ``num_splits``. Without a page table num_splits is ignored.
    Returns ``(out, lse)``: out like q (with v's head dim), lse (heads, total_q) float32 or
    None as in flash_attn_func.
    """
    page_table = fa4_options.pop("page_table", None)
    key = None
    if (page_table is not None and learnable_sink is None and cu_seqlens_q is None
            and cu_seqlens_k is None and seqused_q is None
            and listed("repeated_decode")):  # Note [A repeated decode call]
        key = _signature(q, k, v, extra, fa4_options, (
            softmax_scale, causal, softcap, deterministic, return_lse, max_seqlen_q,
            max_seqlen_k), window_size, (page_table, seqused_k))
        planned = _REPEATED.get(key) if key is not None else None
        if (planned is not None and not decode_entry.needs_grad(q, k, v) and ops.eager(q, k, v)
                and not wants_value_checks(None, page_table, seqused_k)):
            out, lse = decode_entry.launch_resolved(planned, q, k, v, page_table, seqused_k)
            return out, _returned_lse(lse, return_lse, (q, k, v))
    _refuse_positional("flash_attn_varlen_func", extra)
    _refuse_fa4_options("flash_attn_varlen_func", fa4_options, _FA4_VARLEN_NEUTRAL)
    num_splits = check_num_splits(fa4_options.get("num_splits", 1))
    cap = check_features("flash_attn_varlen_func", softcap, None, 0, None)  # a scalar: first
    if page_table is not None:
        return _paged_varlen(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal,
                             window_size, learnable_sink, cap, deterministic, return_lse,
                             num_splits, key)
    batch, total_q, total_k, h, hk, d = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, check_address=False, seqused_q=seqused_q)
    check_features("flash_attn_varlen_func", None, learnable_sink, h, q.device)
    _check_head_dims("flash_attn_varlen_func", q, k, v, learnable_sink)
    p = prepare(d, check_flag("causal", causal), softmax_scale, window_size)
    out, lse = ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                              -1 if max_seqlen_q is None else max_seqlen_q,
                              -1 if max_seqlen_k is None else max_seqlen_k, p.scale, p.causal,
                              p.left, p.right, check_flag("deterministic", deterministic),
                              check_flag("return_lse", return_lse),
                              *_feature_args(cap, learnable_sink, seqused_q))
    return out, _returned_lse(lse, return_lse, _grad_inputs(q, k, v, learnable_sink))


def _paged_varlen(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  seqused_q, seqused_k, softmax_scale, causal, window_size, learnable_sink,
                  cap: float, deterministic, return_lse, num_splits: int, key=None):
    """flash_attn_varlen_func with a page_table (Note [Decode through the API]): the paged
    cache checked (Note [Paged KV checks], values included where they can be read), what the
    decode kernel lacks refused by name, forward only."""
    func = "flash_attn_varlen_func"
    check_max_seqlen("max_seqlen_k", max_seqlen_k)  # a bound FA4 schedules by: not needed here
    batch, rows, h, hk, d, _, values = decode_entry.check_paged_call(
        q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, softmax_scale,
        check_address=False, cu_seqlens_k=cu_seqlens_k)
    check_features(func, None, learnable_sink, h, q.device)
    p = prepare(d, check_flag("causal", causal), softmax_scale, window_size)
    check_flag("deterministic", deterministic)
    decode_entry.refuse_decode_limits(func, d, v.shape[-1], p.causal, p.right, cap,
                                      learnable_sink, seqused_q, left=p.left)
    decode_entry.refuse_paged_gradient(func, q, k, v)
    out, lse = ops.decode_call(q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q,
                               p.scale, p.causal, p.left, num_splits, func)
    values.finish()  # Note [Paged KV checks]: read after the launch, raises on a bad value
    returned = _returned_lse(lse, check_flag("return_lse", return_lse), (q, k, v))
    if key is not None and ops.eager(q, k, v):  # went the whole way eagerly: remember it
        _remember(key, decode_entry.resolve(q, k, page_table, seqused_k, p.scale, p.causal,
                                            p.left, num_splits))
    return out, returned


def attention(q, k, v, causal=False, softmax_scale=None, config=None, target=None):
    """The course's common signature (every chapter's kernel has it): (out, lse), eager.
    ``target="sm_100a"``: the Blackwell kernels, on a B200 (not dispatched to yet)."""
    return forward(q, k, v, causal, softmax_scale, config=config, target=target)


def compile_only(arch: str = "sm_90a", head_dim: int = 128, dtype: str = "bf16",
                 causal: bool = False, config=None, **flags):
    """The compiled forward's artifacts (PTX, SASS, resources) for ``arch``, built on any
    machine; ``flags``: has_window_left, has_window_right, varlen, has_seqused_k."""
    recipe = backend_for_target(arch).host.forward_recipe(head_dim, dtype, causal, config,
                                                          arch=arch, **flags)
    return artifacts(recipe)["main"]
