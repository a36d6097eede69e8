"""Which GPU runs which kernels: the dispatch table, and the support table built from it.

Each GPU family is one ``Backend``: the compute capabilities it answers for, the target its
kernels are compiled for, and its host module (recipes and launches, fa4_final.hopper.host or
fa4_final.blackwell.host). Its ``forward``, ``backward``, ``varlen_forward`` and
``varlen_backward`` keep one contract for every family: inputs checked and not empty, window
sides None when unbounded, the scale resolved (the runtime's prologue does that); each finds its
compiled kernels through the one compile path (runtime.compile) and calls the host's launch.
``backend_for(device)`` picks the row or raises UnsupportedError naming what is supported, so no
setup falls through to a kernel that would compute garbage. A README's table of what each GPU
supports is printed from these rows (``python -m fa4_final support-table --write README.md``).

The Blackwell row is compiled and checked but not wired: its entries raise UnsupportedError
saying so, unless a caller asks for its target by name (the runtime's ``target=``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import torch

from fa4_final.blackwell import host as blackwell_host
from fa4_final.common.bwd_tiles import check_rotated_walk
from fa4_final.common.constants import (
    BACKWARD_HEAD_DIMS,
    DTYPE_NAMES,
    FWD_HEAD_DIMS,
    HEAD_DIMS,
    SINK_DTYPE_NAMES,
)
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper import host as hopper_host
from fa4_final.runtime.compile import compiled
from fa4_final.runtime.pending import listed

START, END = "<!-- support:start -->", "<!-- support:end -->"


@dataclass(frozen=True)
class Backend:
    family: str  # "Hopper"
    gpus: str  # the GPUs people know it by
    arch: str  # "sm_90": what torch's compute capability says
    capabilities: tuple[tuple[int, int], ...]
    target: str  # what the kernels are compiled for
    host: ModuleType  # recipes and launches
    forward: Callable  # (q, k, v, out, lse, causal, scale, left, right, config=None)
    backward: Callable  # (q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
    #                      deterministic, config=None)
    forward_module: str
    backward_module: str
    wired: bool = True  # False: compiled and checked, not yet called from torch
    head_dims: tuple[int, ...] = HEAD_DIMS
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    # One launch over packed sequences: (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
    # max_seqlen_q, max_seqlen_k, out, lse, causal, scale, left, right, config=None). None:
    # runtime.varlen loops over the sequences with the dense kernel.
    varlen_forward: Callable | None = None
    # (q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k,
    # max_seqlen_q, max_seqlen_k, causal, scale, left, right, deterministic, config=None)
    varlen_backward: Callable | None = None
    # FA4's softcap and learnable_sink, where the family's kernels have the variants
    # (Note [Softcap], Note [Learnable sink]); each entry point takes them as keywords, passed
    # only when set: softcap (float, 0.0: none) and learnable_sink ((heads,) tensor or None);
    # "lse_fold": the backward entry points take dlse (Note [The lse gradient folded]);
    # "head_dims": the forward takes FWD_HEAD_DIMS and dv != head_dim (Note [Head dims]);
    # "seqused_q": the varlen entry points take seqused_q (Note [Used query rows])
    features: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.family} ({self.gpus}, {self.arch})"

    def state(self, module: str) -> str:
        """'yes', 'compiled, not yet run on a GPU' or 'not in this build', for the README."""
        if not module_present(module):
            return "not in this build"
        if not self.wired:
            return "compiled, not yet run on a GPU"
        return "yes"


def _check_rotated(plan, device) -> None:
    """A backward plan built with dq_rotated runs only on a GPU that holds a head's key tiles
    at once (bwd_tiles.check_rotated_walk); other plans pay nothing."""
    if getattr(plan.config, "dq_rotated", False):
        check_rotated_walk(hopper_host.num_sms(device))


def runners(host: ModuleType, features: tuple[str, ...] = ()) -> dict:
    """The contract's functions for ``host``: each finds its compiled kernels through the one
    compile path and calls the host's launch. Varlen ones only where the host launches one.
    ``features``: which of softcap and learnable_sink the host's kernels have; the others are
    refused by name. A softcap value and the sink's dtype go into the recipe's arguments, and
    so into the compile key, only when set: the default builds keep their keys."""
    family = getattr(host, "ARCH", host.__name__)

    def fwd_extra(softcap, learnable_sink, q, v, seqused_q=None) -> tuple:
        refuse_missing(family, features, softcap, learnable_sink, None, seqused_q)
        dv = v.shape[-1]
        if dv != q.shape[-1] or q.shape[-1] not in HEAD_DIMS:
            refuse_head_dims(family, features, q.shape[-1], dv)
        extra = ()
        if softcap or learnable_sink is not None or dv != q.shape[-1] or seqused_q is not None:
            extra = (host.ARCH, float(softcap),
                     None if learnable_sink is None else SINK_DTYPE_NAMES[learnable_sink.dtype])
        if dv != q.shape[-1] or seqused_q is not None:  # head_dim_v only when it differs
            extra += (dv if dv != q.shape[-1] else None,)
        if seqused_q is not None:  # has_seqused_q (Note [Used query rows])
            extra += (True,)
        return extra

    def bwd_extra(softcap, dlse=None, seqused_q=None, q=None, v=None) -> tuple:
        refuse_missing(family, features, softcap, None, dlse, seqused_q)
        if v is not None and v.shape[-1] != q.shape[-1]:  # head_dim_v, last, only when it differs
            refuse_head_dims(family, features, q.shape[-1], v.shape[-1])
            return (host.ARCH, float(softcap), dlse is not None, seqused_q is not None,
                    v.shape[-1])
        if seqused_q is not None:  # has_dlse, then has_seqused_q
            return (host.ARCH, float(softcap), dlse is not None, True)
        if dlse is not None:  # has_dlse after the softcap (Note [The lse gradient folded])
            return (host.ARCH, float(softcap), True)
        return (host.ARCH, float(softcap)) if softcap else ()

    def forward(q, k, v, out, lse, causal, scale, left, right, config=None, softcap=0.0,
                learnable_sink=None):
        extra = fwd_extra(softcap, learnable_sink, q, v)
        plan = compiled(host.forward_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], causal, config,
                        left is not None, right is not None and not causal, False, False, *extra)
        sink = () if learnable_sink is None else (launch_sink(learnable_sink),)
        host.launch_forward(plan, q, k, v, out, lse, causal, scale, left, right, *sink)

    def backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
                 deterministic=False, config=None, softcap=0.0, dlse=None):
        extra = bwd_extra(softcap, dlse, None, q, v)
        config = det_copies(host, q, v, causal, left, right, deterministic, config, softcap)
        plan = compiled(host.backward_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], causal, config,
                        deterministic, left is not None, right is not None and not causal,
                        False, False, *extra)
        _check_rotated(plan, q.device)
        host.launch_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left,
                             right, *(() if dlse is None else (dlse,)))

    def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                       max_seqlen_k, out, lse, causal, scale, left, right, config=None,
                       softcap=0.0, learnable_sink=None, seqused_q=None):
        extra = fwd_extra(softcap, learnable_sink, q, v, seqused_q)
        plan = compiled(host.forward_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], causal, config,
                        left is not None, right is not None and not causal, True,
                        seqused_k is not None, *extra)
        sink = () if learnable_sink is None else (launch_sink(learnable_sink),)
        host.launch_varlen_forward(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                   max_seqlen_q, max_seqlen_k, out, lse, causal, scale, left,
                                   right, *sink, **used_rows(seqused_q))

    def varlen_backward(q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        seqused_k, max_seqlen_q, max_seqlen_k, causal, scale, left, right,
                        deterministic=False, config=None, softcap=0.0, dlse=None,
                        seqused_q=None):
        extra = bwd_extra(softcap, dlse, seqused_q, q, v)
        config = det_copies(host, q, v, causal, left, right, deterministic, config, softcap)
        plan = compiled(host.backward_recipe, q.shape[-1], DTYPE_NAMES[q.dtype], causal, config,
                        deterministic, left is not None, right is not None and not causal,
                        True, seqused_k is not None, *extra)
        _check_rotated(plan, q.device)
        host.launch_varlen_backward(plan, q, k, v, out, lse, dout, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                    causal, scale, left, right,
                                    *(() if dlse is None else (dlse,)), **used_rows(seqused_q))

    return {"forward": forward, "backward": backward,
            "varlen_forward": varlen_forward if hasattr(host, "launch_varlen_forward") else None,
            "varlen_backward": varlen_backward if hasattr(host, "launch_varlen_backward")
            else None}


def det_copies(host, q, v, causal, left, right, deterministic, config, softcap):
    """``config``, or for a deterministic call with none (and no softcap: its builds have a
    config of their own) the host's config with accumulator copies where it has one, once
    the gate lets det_copies through (Note [Pending features]; Note [dQ copies] in
    fa4_final.common.bwd_tiles). A walk with any window side or a causal diagonal counts as
    masked."""
    if config is not None or not deterministic or softcap or not listed("det_copies"):
        return config
    choose = getattr(host, "det_copies_config", None)
    if choose is None:
        return None
    masked = bool(causal) or left is not None or right is not None
    return choose(q.shape[-1], masked, v.shape[-1])


def used_rows(seqused_q=None) -> dict:
    """The varlen entries' seqused_q keyword, only when given (a call without it passes none)."""
    return {} if seqused_q is None else {"seqused_q": seqused_q}


def launch_sink(learnable_sink: torch.Tensor) -> torch.Tensor:
    """The sink as the kernel reads it: (heads,) with stride 1 (its fake tensor's layout)."""
    return learnable_sink if learnable_sink.stride(0) == 1 else learnable_sink.contiguous()


def refuse_missing(family: str, features: tuple[str, ...], softcap, learnable_sink,
                   dlse=None, seqused_q=None) -> None:
    """UnsupportedError naming softcap, learnable_sink, dlse (the feature lse_fold) or
    seqused_q when set and not in ``features``."""
    asked = [(name, value) for name, value, on in (
        ("softcap", softcap, bool(softcap)),
        ("learnable_sink", learnable_sink, learnable_sink is not None),
        ("lse_fold", dlse, dlse is not None),
        ("seqused_q", seqused_q, seqused_q is not None)) if on]
    for name, value in asked:
        if name not in features:
            shown = value if name == "softcap" else f"<tensor {tuple(value.shape)}>"
            if name == "lse_fold":
                raise UnsupportedError(
                    f"dlse={shown}: the {family} backward has no build that folds the lse's "
                    f"gradient in (lse_fold); fa4_final folds it on "
                    f"{', '.join(b.label for b in BACKENDS if name in b.features)} only")
            raise UnsupportedError(
                f"{name}={shown}: the {family} kernels have no {name} variant; fa4_final runs "
                f"{name} on {', '.join(b.label for b in BACKENDS if name in b.features)} only")


def refuse_head_dims(family: str, features: tuple[str, ...], head_dim: int, dv: int) -> None:
    """UnsupportedError naming the head dims when the family's forward lacks builds outside
    HEAD_DIMS or with dv != head_dim ("head_dims" not in ``features``)."""
    if "head_dims" in features:
        return
    raise UnsupportedError(
        f"head_dim={head_dim}, dv={dv}: the {family} kernels are built for head dims "
        f"{HEAD_DIMS} with dv == head_dim only; fa4_final runs {FWD_HEAD_DIMS} and dv != "
        f"head_dim (forward) on "
        f"{', '.join(b.label for b in BACKENDS if 'head_dims' in b.features)} only")


def _not_wired(family: str, what: str, modules: str) -> Callable:
    def run(*args, **kwargs):
        raise UnsupportedError(
            f"{family} kernels are compiled ({modules}) and checked without a GPU, but have "
            f"never run on one, so fa4_final's torch entry points do not use them yet: the "
            f"{what} cannot run on this GPU. Supported now: {supported_list()}")

    return run


def wired(backend: Backend) -> Backend:
    """``backend`` with its kernels called, wired or not (the runtime's ``target=``)."""
    if backend.wired:
        return backend
    return replace(backend, wired=True, **runners(backend.host, backend.features))


def module_present(module: str) -> bool:
    """Whether this build holds ``module`` (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing too
        return False


HOPPER = Backend("Hopper", "H100, H200", "sm_90", ((9, 0),), hopper_host.ARCH, hopper_host,
                 forward_module="fa4_final.hopper.fwd", backward_module="fa4_final.hopper.bwd",
                 features=("softcap", "learnable_sink", "lse_fold", "head_dims", "seqused_q"),
                 **runners(hopper_host, ("softcap", "learnable_sink", "lse_fold", "head_dims",
                                         "seqused_q")))
BLACKWELL = Backend("Blackwell", "B200, GB200", "sm_100", ((10, 0),), blackwell_host.ARCH,
                    blackwell_host,
                    forward=_not_wired("Blackwell (sm_100)", "forward", "fa4_final.blackwell"),
                    backward=_not_wired("Blackwell (sm_100)", "backward", "fa4_final.blackwell"),
                    forward_module="fa4_final.blackwell.fwd",
                    backward_module="fa4_final.blackwell.bwd", wired=False)
BACKENDS: tuple[Backend, ...] = (HOPPER, BLACKWELL)


def supported_list() -> str:
    """The families that run today, e.g. 'Hopper (H100, H200, sm_90)'."""
    ready = [b.label for b in BACKENDS if b.wired] or ["none"]
    return ", ".join(ready)


def backend_for(device: torch.device) -> Backend:
    """The row for ``device``, or an UnsupportedError naming what is supported."""
    device = torch.device(device)
    if device.type != "cuda":
        raise UnsupportedError(f"fa4_final runs on CUDA GPUs: {supported_list()}; got a tensor "
                               f"on {device}")
    cap = tuple(torch.cuda.get_device_capability(device))
    for backend in BACKENDS:
        if cap in backend.capabilities:
            return backend
    raise UnsupportedError(
        f"fa4_final has no kernels for {torch.cuda.get_device_name(device)} (compute capability "
        f"{cap[0]}.{cap[1]}, sm_{cap[0]}{cap[1]}); it runs on {supported_list()}")


def backend_for_target(target: str) -> Backend:
    """The row whose kernels compile for ``target`` ("sm_90a", "sm_100a"), wired or not."""
    for backend in BACKENDS:
        if backend.target == target:
            return backend
    raise UnsupportedError(f"fa4_final compiles for {[b.target for b in BACKENDS]}, not "
                           f"{target!r}")


# ----------------------------------------------------------------------------------------------
# the support table


def support_table() -> str:
    """Markdown: one row per GPU family, read off BACKENDS and the modules this build holds."""
    head = ("| GPU | arch (compiled for) | forward | backward | head dims | dtypes | varlen |\n"
            "|---|---|---|---|---|---|---|")
    rows = []
    for b in BACKENDS:
        runs = b.state(b.forward_module) == "yes"
        varlen = "per-sequence loop over the dense kernel"
        if b.varlen_forward:
            varlen = ("forward and backward: one kernel over the packed batch"
                      if b.varlen_backward else "forward: one kernel over the packed "
                      "batch; backward: per-sequence loop")
        dims = ", ".join(map(str, b.head_dims))
        if "head_dims" in b.features:  # Note [Head dims]: the forward's and the backward's
            dims = (f"forward: D and dv each {', '.join(map(str, FWD_HEAD_DIMS))}; backward "
                    f"(D, dv): {', '.join(f'({d}, {dv})' for d, dv in BACKWARD_HEAD_DIMS)}")
        varlen, dims, dtypes = (varlen, dims, ", ".join(b.dtypes)) if runs else ("-", "-", "-")
        rows.append(f"| {b.family} ({b.gpus}) | {b.arch} ({b.target}) | "
                    f"{b.state(b.forward_module)} | {b.state(b.backward_module)} | {dims} | "
                    f"{dtypes} | {varlen} |")
    rows.append("| any other GPU, or a CPU tensor | - | UnsupportedError naming the above | - | - "
                "| - | - |")
    notes = ("\nEvery row that runs takes causal and sliding-window masks (`window_size`), "
             "GQA/MQA\n(heads divisible by the k/v heads) and sequences of length 0. Generated "
             "from the\ndispatch table in `fa4_final/runtime/dispatch.py` by\n`python -m "
             "fa4_final support-table --write README.md`.")
    return "\n".join([head, *rows]) + "\n" + notes


def render(readme_text: str) -> str:
    """``readme_text`` with the table between the support markers replaced."""
    if START not in readme_text or END not in readme_text:
        raise ValueError(f"the README lacks the markers {START} ... {END}")
    head, rest = readme_text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{support_table()}\n{END}{tail}"
