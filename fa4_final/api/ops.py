"""The kernels as torch custom operators: torch.compile sees each as one node.

    torch.ops.fa4_final.fwd          (q, k, v, ...)                   -> (out, lse)
    torch.ops.fa4_final.bwd          (dout, q, k, v, out, lse, ...)   -> (dq, dk, dv)
    torch.ops.fa4_final.varlen_fwd   (q, k, v, cu_seqlens_q, ...)     -> (out, lse)
    torch.ops.fa4_final.varlen_bwd   (dout, q, k, v, out, lse, ...)   -> (dq, dk, dv)

A compiled graph cannot trace into a CuTe DSL kernel, and must not try: the custom op is opaque,
and its fake implementation tells the compiler the shapes, dtypes and strides of what the kernel
returns (all outputs freshly allocated and contiguous, in the real implementation too), so
``torch.compile(fullgraph=True)`` of a model that calls flash_attn_func has no graph break. The
forward ops carry ``deterministic`` and ``return_lse`` only for their autograd formula
(``register_autograd``), which calls the backward op.

FA4's softcap (float, 0.0: none) and learnable_sink ((heads,) or None) are the forward ops' last
two arguments (defaults: off), the backward ops' softcap the last; the public functions check
them before calling (they have left the gate of Note [Pending features] in
fa4_final.runtime.pending). The forward's autograd returns the sink's gradient from
common.backward.sink_gradient when the sink requires grad (Note [Learnable sink]); a softcap
build's backward kernel applies the cap's derivative itself (Note [Softcap]). The backward ops
take dlse after the softcap (Note [The lse gradient folded]), the varlen ops seqused_q last (its
padding rows come back 0 in out, lse and dq), and the forward ops' out has v's head dim (the
backward runs the (head dim, dv) of common.constants.BACKWARD_HEAD_DIMS; elsewhere, forward only).

Window sides arrive normalised (runtime.checks.normalise_window: None for an unbounded side, any
int, negative ones included, a bound); the public functions (api.interface) resolve them, causal
and the default scale before calling (the runtime's prologue, runtime.prologue.prepare).

Note [Gradient of the returned lse]
With return_lse=True the lse is an output that a loss may use; its gradient dlse joins the
backward through the softmax: dS = P * (dP - D + dlse), with dP = dO V^T and D = rowsum(dO * O).
The backward kernel computes D itself and uses O for nothing else, so a second call of the same
kernel with V = 0 (so dP = 0), dO = 1 in three columns and O = -dlse split over those columns
(three bf16/fp16 pieces that sum to the float32 value) gets D = -dlse and hence dS = P * dlse:
exactly the extra dq and dk (dv of that call is P^T dO: thrown away). It costs one more backward,
only when return_lse=True and a gradient is needed; a row that sees no key has P = 0 and gets
nothing, as it should. The backward builds that fold dlse into bwd_pre instead, in one call
(Note [The lse gradient folded] in fa4_final.common.bwd_pre), replace this second call: they
passed their GPU tests, so ``listed("lse_fold")`` is True (Note [Pending features]); the probe
path stays for a build where the lse_fold row is back in the gate, which the tests use to
compare the two.

Note [The eager path]
A custom op is what torch.compile, FakeTensorMode, opcheck and dispatch modes must see, but a
plain eager call pays for it every time: the dispatcher, the op's autograd wrapper, its guard
against being traced, and the checks of each layer below, tens of microseconds per call, as
much as a short kernel runs. So ``fwd_eager`` makes the same call without the op when nothing
could observe the difference (``eager``: real CUDA tensors, no tracing, compiling, dispatch or
function mode, no functorch transform): the same checks, once, by the public function; the same
kernels through the same layers (runtime.prologue.forward_prepared, the device's backend); the
autograd formula (``_backward_fwd``) in a torch.autograd.Function. Everything else, and a double
backward, goes through the ops. A decode call (``decode_call``) does the same: eager, it goes to
runtime.decode_entry.decode_checked, which adds only the TMA addresses to the public function's
checks before the launch.
"""


import torch
from torch import Tensor

from fa4_final.common.backward import sink_gradient
from fa4_final.runtime import decode_entry, prologue
from fa4_final.runtime.checks import (
    check_addresses,
    check_inputs,
    check_learnable_sink,
    check_softcap,
    check_tma_operand,
    check_varlen_inputs,
)
from fa4_final.runtime.pending import listed
from fa4_final.runtime.prologue import backward_into, forward_into
from fa4_final.runtime.varlen import used_rows, varlen_backward_into, varlen_forward_into


def _side(n: int):
    """max_seqlen_q/k: -1 in the op's schema stands for None (not given)."""
    return None if n < 0 else n


# ----------------------------------------------------------------------------------------------
# dense


def fwd_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
             window_left: int | None, window_right: int | None, deterministic: bool,
             return_lse: bool, softcap: float = 0.0,
             learnable_sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    forward_into(q, k, v, out, lse, causal, softmax_scale, (window_left, window_right),
                 softcap=softcap, learnable_sink=learnable_sink)
    return out, lse


fwd = torch.library.custom_op("fa4_final::fwd", fwd_impl, mutates_args=())


def _check_features_meta(softcap, learnable_sink, heads, device) -> None:
    """The features' metadata checks on fake tensors."""
    check_softcap(softcap)
    check_learnable_sink(learnable_sink, heads, device)


def _out_meta(q, v) -> Tensor:
    """A fake out: q's shape with v's head dim."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, deterministic, return_lse,
      softcap=0.0, learnable_sink=None):
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale, check_address=False)
    _check_features_meta(softcap, learnable_sink, h, q.device)
    return _out_meta(q, v), q.new_empty((b, h, sq), dtype=torch.float32)


def bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             softmax_scale: float, causal: bool, window_left: int | None,
             window_right: int | None, deterministic: bool, softcap: float = 0.0,
             dlse: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale,
                  (window_left, window_right), deterministic, softcap=softcap, dlse=dlse)
    return dq, dk, dv


bwd = torch.library.custom_op("fa4_final::bwd", bwd_impl, mutates_args=())


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, deterministic,
      softcap=0.0, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _lse_probe(dlse_rows: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
    """(dout, out) whose rowsum(dout * out) is -dlse (Note [Gradient of the returned lse]).
    ``dlse_rows`` is dlse laid out like like[..., 0]."""
    x = -dlse_rows.float()
    pieces = []
    for _ in range(3):
        piece = x.to(like.dtype)
        pieces.append(piece)
        x = x - piece.float()
    probe_out = like.new_zeros(like.shape)
    probe_dout = like.new_zeros(like.shape)
    probe_out[..., :3] = torch.stack(pieces, dim=-1)
    probe_dout[..., :3] = 1
    return probe_dout, probe_out


def _setup_fwd(ctx, inputs, output):
    q, k, v, scale, causal, wl, wr, deterministic, return_lse, *features = inputs
    softcap, sink = (features + [0.0, None])[:2]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sink)
    ctx.options = (scale, causal, wl, wr, deterministic) + ((softcap,) if softcap else ())
    ctx.return_lse = return_lse
    # An output the loss does not use arrives as None, not as a tensor of zeros: a zero dlse
    # would cost the second backward of Note [Gradient of the returned lse] for nothing.
    ctx.set_materialize_grads(False)


SINK_INPUT = 10  # learnable_sink's place among fwd's inputs


def _sink_grad(ctx, sink, lse, out, dout, dlse, sink_input: int = SINK_INPUT):
    """d learnable_sink when the sink needs one (Note [Learnable sink]), else None."""
    if sink is None or not ctx.needs_input_grad[sink_input]:
        return None
    return sink_gradient(sink, lse, out, dout, dlse if ctx.return_lse else None)


def _bwd_options(ctx) -> tuple:
    """ctx.options with the softcap always in place (the backward ops' argument before dlse)."""
    return ctx.options if len(ctx.options) == 6 else ctx.options + (0.0,)


def _backward_fwd(ctx, dout, dlse, bwd_op=None, sink_input: int = SINK_INPUT):
    bwd_op = bwd if bwd_op is None else bwd_op  # the op, or _eager_bwd (Note [The eager path])
    q, k, v, out, lse, sink = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    folded = ctx.return_lse and dlse is not None and listed("lse_fold")  # one call (the Note)
    options = _bwd_options(ctx) + (dlse.contiguous(),) if folded else ctx.options
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, *options)
    if ctx.return_lse and dlse is not None and not folded:
        probe_dout, probe_out = _lse_probe(dlse.transpose(1, 2), out)  # (b, sq, h)
        dq_lse, dk_lse, _ = bwd_op(probe_dout, q, k, torch.zeros_like(v), probe_out, lse,
                                   *ctx.options)
        dq, dk = dq + dq_lse, dk + dk_lse
    dsink = _sink_grad(ctx, sink, lse, out, dout, dlse, sink_input)
    return dq, dk, dv, None, None, None, None, None, None, None, dsink


fwd.register_autograd(_backward_fwd, setup_context=_setup_fwd)


# the eager path (Note [The eager path])

EAGER_DEVICE_TYPES = ("cuda",)  # where the kernels run (a host-cost profile may add "cpu")


def _unobserved() -> bool:
    """Nothing that must see the ops is active: torch.compile (compiled autograd too), a
    tracer, a dispatch or function mode, a functorch transform."""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._len_torch_function_stack()
            and not torch._C._are_functorch_transforms_active())


def eager(q, k, v) -> bool:
    """Whether a call on q, k, v may skip the custom op: plain tensors on a GPU, and nothing
    (torch.compile, a tracer, a dispatch or function mode, a functorch transform) that must
    see the op."""
    return (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and q.device.type in EAGER_DEVICE_TYPES and _unobserved())


def fwd_eager(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
              window_left: int | None, window_right: int | None, deterministic: bool,
              return_lse: bool, softcap: float = 0.0,
              learnable_sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``fwd(...)`` for a call that ``eager`` admits, on inputs checked by check_inputs with
    ``check_address=False`` and resolved by the public function (flash_attn_func), which also
    checked softcap and learnable_sink."""
    check_addresses(("q", q), ("k", k), ("v", v))  # what fwd_impl's forward_into adds
    options = (softmax_scale, causal, window_left, window_right, deterministic, return_lse,
               softcap)
    if torch.autograd._profiler_enabled():  # a trace shows the call as it shows the op
        with torch.profiler.record_function("fa4_final::fwd"):
            return _eager_call(q, k, v, learnable_sink, options)
    return _eager_call(q, k, v, learnable_sink, options)


def _eager_call(q, k, v, sink, options):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sink is not None and sink.requires_grad)):
        return _EagerAttention.apply(q, k, v, sink, options)
    return _eager_fwd(q, k, v, *options[:4], options[6], sink)


def _eager_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap=0.0,
               learnable_sink=None):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))  # as fwd_impl
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return prologue.forward_prepared(prologue.cached_backend(q.device), q, k, v, out, lse,
                                     causal, softmax_scale, window_left, window_right,
                                     softcap=softcap, learnable_sink=learnable_sink)


def _eager_bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
               deterministic, softcap=0.0, dlse=None):
    """``bwd(...)`` on the forward's checked tensors; autograd gives dout out's shape, dtype
    and device, so what bwd_impl's checks add is dout's TMA rule (after .contiguous())."""
    check_tma_operand("dout", dout)
    like = dict(memory_format=torch.contiguous_format)  # as bwd_impl's new_empty
    dq, dk, dv = (torch.empty_like(t, **like) for t in (q, k, v))
    args = (prologue.cached_backend(q.device), q, k, v, out, lse, dout, dq, dk, dv, causal,
            softmax_scale, window_left, window_right, deterministic)
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function("fa4_final::bwd"):
            return prologue.backward_prepared(*args, softcap=softcap, dlse=dlse)
    return prologue.backward_prepared(*args, softcap=softcap, dlse=dlse)


class _EagerAttention(torch.autograd.Function):
    """fwd's registered autograd (_setup_fwd, _backward_fwd) without the op."""

    @staticmethod
    def forward(ctx, q, k, v, sink, options):  # options: fwd's arguments after v but the sink
        out, lse = _eager_fwd(q, k, v, *options[:4], options[6], sink)
        _setup_fwd(ctx, (q, k, v, *options, sink), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # the op where something watches the backward, and for create_graph=True (the op's
        # missing double backward says so)
        direct = not torch.is_grad_enabled() and _unobserved()
        grads = _backward_fwd(ctx, dout, dlse, _eager_bwd if direct else bwd, sink_input=3)
        return (*grads[:3], grads[10], None)


# ----------------------------------------------------------------------------------------------
# varlen


def varlen_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, seqused_k: Tensor | None, max_seqlen_q: int,
                    max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int | None,
                    window_right: int | None, deterministic: bool, return_lse: bool,
                    softcap: float = 0.0, learnable_sink: Tensor | None = None,
                    seqused_q: Tensor | None = None) -> tuple[Tensor, Tensor]:
    total_q, h, _ = q.shape
    # padding rows past seqused_q are never written by the kernel: they come back 0 here (FA4
    # leaves them unspecified), so no stale memory reaches a loss or dout
    new = q.new_empty if seqused_q is None else q.new_zeros
    out = new((total_q, h, v.shape[-1]))
    lse = new((h, total_q), dtype=torch.float32)
    varlen_forward_into(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, _side(max_seqlen_q),
                        _side(max_seqlen_k), out, lse, causal, softmax_scale,
                        (window_left, window_right), softcap=softcap,
                        learnable_sink=learnable_sink, **used_rows(seqused_q))
    return out, lse


varlen_fwd = torch.library.custom_op("fa4_final::varlen_fwd", varlen_fwd_impl,
                                     mutates_args=())


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, deterministic, return_lse, softcap=0.0,
      learnable_sink=None, seqused_q=None):
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, None,
                        softmax_scale, check_address=False, seqused_q=seqused_q)
    total_q, h, _ = q.shape
    _check_features_meta(softcap, learnable_sink, h, q.device)
    return _out_meta(q, v), q.new_empty((h, total_q),
                                                                  dtype=torch.float32)


def varlen_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Tensor | None,
                    max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
                    window_left: int | None, window_right: int | None, deterministic: bool,
                    softcap: float = 0.0, dlse: Tensor | None = None,
                    seqused_q: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    varlen_backward_into(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                         seqused_k, _side(max_seqlen_q), _side(max_seqlen_k), causal,
                         softmax_scale, (window_left, window_right),
                         deterministic, softcap=softcap, dlse=dlse, **used_rows(seqused_q))
    return dq, dk, dv


varlen_bwd = torch.library.custom_op("fa4_final::varlen_bwd", varlen_bwd_impl,
                                     mutates_args=())


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic,
      softcap=0.0, dlse=None, seqused_q=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen_fwd(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, causal, wl, wr, deterministic,
     return_lse, *features) = inputs
    softcap, sink, seqused_q = (features + [0.0, None, None])[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k, sink, seqused_q)
    ctx.options = (max_q, max_k, scale, causal, wl, wr, deterministic) + (
        (softcap,) if softcap or seqused_q is not None else ())
    ctx.return_lse = return_lse
    ctx.set_materialize_grads(False)  # as _setup_fwd


def _backward_varlen_fwd(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, sink, seqused_q = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    # seqused_q after dlse's place (None there when not folded); nothing when not given
    used_q = () if seqused_q is None else (seqused_q,)
    tail = (None, *used_q) if used_q else ()
    folded = ctx.return_lse and dlse is not None and listed("lse_fold")  # as _backward_fwd
    options = ctx.options + tail
    if folded:
        options = (ctx.options if len(ctx.options) == 8 else ctx.options + (0.0,)) + (
            dlse.contiguous(), *used_q)
    dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, seqused_k, *options)
    if ctx.return_lse and dlse is not None and not folded:
        probe_dout, probe_out = _lse_probe(dlse.transpose(0, 1), out)  # (total_q, h)
        dq_lse, dk_lse, _ = varlen_bwd(probe_dout, q, k, torch.zeros_like(v), probe_out, lse,
                                       cu_q, cu_k, seqused_k, *ctx.options, *tail)
        dq, dk = dq + dq_lse, dk + dk_lse
    dsink = _sink_grad(ctx, sink, lse, out, dout, dlse, VARLEN_SINK_INPUT)
    return (dq, dk, dv) + (None,) * 12 + (dsink, None)  # None: seqused_q


VARLEN_SINK_INPUT = 15  # learnable_sink's place among varlen_fwd's inputs


varlen_fwd.register_autograd(_backward_varlen_fwd, setup_context=_setup_varlen_fwd)


# ----------------------------------------------------------------------------------------------
# decode (Note [Decode through the API] in fa4_final.runtime.decode_entry): forward only


def decode_fwd_impl(q: Tensor, k: Tensor, v: Tensor, page_table: Tensor | None,
                    seqused_k: Tensor | None, cu_seqlens_q: Tensor | None, max_seqlen_q: int,
                    softmax_scale: float, causal: bool, window_left: int | None,
                    num_splits: int) -> tuple[Tensor, Tensor]:
    return decode_entry.decode_forward(q, k, v, causal, softmax_scale, (window_left, None),
                                       page_table=page_table, seqused_k=seqused_k,
                                       cu_seqlens_q=cu_seqlens_q,
                                       max_seqlen_q=_side(max_seqlen_q), num_splits=num_splits)


decode_fwd = torch.library.custom_op("fa4_final::decode_fwd", decode_fwd_impl, mutates_args=())


@decode_fwd.register_fake
def _(q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, softmax_scale, causal,
      window_left, num_splits):
    """The metadata checks, as the eager call makes them (no values read)."""
    decode_entry.check_num_splits(num_splits)
    if page_table is not None:
        decode_entry.check_paged_call(q, k, v, page_table, seqused_k, cu_seqlens_q,
                                      _side(max_seqlen_q), softmax_scale, check_address=False,
                                      check_values=False)
    else:
        check_inputs(q, k, v, softmax_scale, check_address=False)
    return decode_entry.fresh_outputs(q, v, cu_seqlens_q is not None)


def decode_call(q, k, v, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, softmax_scale: float,
                causal: bool, window_left, num_splits: int,
                func: str = "flash_attn_func") -> tuple[Tensor, Tensor]:
    """The decode forward of a checked public call: the runtime entry directly where
    nothing observes the call (Note [The eager path]; its value checks already ran in the
    public function), the op otherwise."""
    if eager(q, k, v):  # checked by the public function: only the TMA addresses are left
        return decode_entry.decode_checked(func, q, k, v, page_table, seqused_k, cu_seqlens_q,
                                           max_seqlen_q, softmax_scale, causal, window_left,
                                           num_splits)
    return decode_fwd(q, k, v, page_table, seqused_k, cu_seqlens_q,
                      -1 if max_seqlen_q is None else max_seqlen_q, softmax_scale, causal,
                      window_left, num_splits)
