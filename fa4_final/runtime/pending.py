"""The gate of pending features: arguments whose kernels are built but not yet trusted.

Note [Pending features]
A pending feature is one whose device code is written, compiled for its real target and checked
without a GPU (instruction and resource assertions, host-side emulation of its arithmetic),
whose GPU tests against float64 are written, and which has not yet passed those tests on a GPU.
Its argument is wired through every layer (checks, custom ops, autograd, runtime, dispatch, the
compile keys), but a call that sets it is refused with UnsupportedError, naming the argument,
its value and that fa4_final does not run it yet: the package must never compute something
other than what a call means, and code that has never run cannot promise that. The refusal
comes after the argument's own checks (a bad value is named as bad first), so a call that
would be refused for its value anyway says so.

The environment variable FA4_FINAL_PENDING, a comma-separated list of names from ``PENDING``
(read at each call, so a test can set it for itself), lets those features through: the GPU
tests and the conformance driver set it to run the unverified kernels, which is how a feature
earns its way out of this table. Once its GPU tests pass, its row is deleted and the gate no
longer asks. A feature not in the table is never gated.

A row may also name a replacement of a path that has passed its tests (lse_fold was one: one
backward call with dlse folded in, in place of a second call): the gate then chooses rather than
refuses, and without FA4_FINAL_PENDING the verified path runs exactly as before (``listed``).
A row may name a family of shapes (head_dims was one, the forward's head dims 96, 192, 256;
varlen_row_store another, the varlen forward at v head dims 96 and 192; bwd_head_dims a third,
the backward at BWD_EXTRA_HEAD_DIMS and BWD_HEAD_DIM_PAIRS). Where no kernel exists at all (a
backward at any (head_dim, dv) outside BACKWARD_HEAD_DIMS), the refusal is no row's: it does
not depend on the environment (refuse_backward_head_dims).

Rows deleted so far, each after its GPU tests passed against float64: seqused_q, head_dims and
lse_fold first; then softcap, learnable_sink and decode (tested on an H100 against float64; the
decode kernel on an H200 too); then varlen_row_store (the varlen forward at v head dims 96 and
192: 96 passed on an H100, 192 on an H200); then bwd_head_dims (the Hopper backward at head dim
96, at head dim 192 with dv = 128, and with dK and dV swapped at D = dv = 192 and 256: the full
float64 suites of the four builds passed on an H100, racecheck found no hazard there, and
synccheck no error on an H200); then softcap_head_dims (a softcap at head dims other than 64
and 128, D = 96, 192, 256 and dv != D: the dense and the varlen forward and autograd backward
passed against float64 on an H100). softcap and learnable_sink still pass through
``refuse_pending`` in check_features, which lets them by while they have no row (a row put back
gates them again); a page table, a decode shape and the backward's head dims no longer consult
the gate at all. Then repeated_decode, a replacement of the verified decode path
(Note [A repeated decode call]) that chose rather than refused, as lse_fold did: its GPU tests
(bit for bit the whole path, new values against float64, a capture in a CUDA graph) passed on
an H100 with the rest of the decode API's suite; the public functions still ask ``listed`` for
it, so a row put back gates it again.

Waiting now: det_copies, a replacement of the deterministic backward's config at D = 64 and
128 (hopper_bwd_det_copies, chosen in runtime.dispatch): without FA4_FINAL_PENDING a
deterministic call runs the verified config exactly as before.
"""

from __future__ import annotations

import os

from fa4_final.common.constants import BACKWARD_HEAD_DIMS, FWD_HEAD_DIMS
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime.checks import check_dlse, check_learnable_sink, check_softcap

ENV = "FA4_FINAL_PENDING"

# name -> why it waits (what has been checked, what has not)
PENDING: dict[str, str] = {
    "det_copies": "the deterministic backward at D = 64 and 128 with dQ accumulator copies "
                  "(hopper_bwd_det_copies): its kernels passed float64, bitwise and sanitizer "
                  "tests through config= on an H100; the deterministic suites through the "
                  "call have not run with it",
}


def allowed() -> frozenset[str]:
    """The names FA4_FINAL_PENDING lets through now (read from the environment each call)."""
    value = os.environ.get(ENV, "")
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def listed(name: str) -> bool:
    """Whether the pending feature ``name`` may run now: not pending any more, or listed in
    FA4_FINAL_PENDING. For a feature that replaces a verified path rather than adding an
    argument (lse_fold: Note [Gradient of the returned lse] in fa4_final.api.ops), the caller
    keeps the verified path when this is False."""
    return name not in PENDING or name in allowed()


def refuse_pending(func: str, name: str, value, argument: str | None = None,
                   where: str = "") -> None:
    """UnsupportedError when ``name`` is a pending feature (Note [Pending features]) that
    FA4_FINAL_PENDING does not list; ``value`` is the argument as given (a call reaches this
    only with a value that switches the feature on). ``argument``: the argument's name when it
    is not the row's; ``where``: what else of the call the row is about, shown after the value
    (" at head_dim=96, dv=96")."""
    if name not in PENDING or name in allowed():
        return
    argument = argument or name
    raise UnsupportedError(
        f"{func}: FA4's {argument}={_shown(value)}{where} is refused: fa4_final does not run "
        f"{name} yet ({PENDING[name]}). Pass {argument} at its neutral value, or set "
        f"{ENV}={name} to run the unverified kernels (tests only)")


def _shown(value) -> str:
    """A short spelling of an argument: a tensor by its shape, dtype and device."""
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"<tensor {tuple(shape)} {value.dtype} on {getattr(value, 'device', '?')}>"
    return repr(value)


def check_features(func: str, softcap, learnable_sink, heads: int, device) -> float:
    """FA4's softcap and learnable_sink of one call: their checks (runtime.checks: a value or
    tensor they cannot be is named), then the gate (Note [Pending features]). Returns the
    softcap as a float, 0.0 for none (None and 0.0 both mean none, as in FA4). Metadata only:
    it runs while torch.compile traces. ``heads`` and ``device`` (q's) are read only for a
    sink, so a caller may check the softcap before q. Neither has a row in ``PENDING`` now
    (their GPU tests passed), so the gate lets both by."""
    cap = check_softcap(softcap)
    if learnable_sink is not None:
        check_learnable_sink(learnable_sink, heads, device)
    if cap:
        refuse_pending(func, "softcap", softcap)
    if learnable_sink is not None:
        refuse_pending(func, "learnable_sink", learnable_sink)
    return cap


def check_lse_fold(func: str, dlse, lse) -> None:
    """A dlse given to a backward entry point, checked against its lse (runtime.checks). None
    passes: the backward without the lse's gradient. lse_fold has passed its GPU tests and left
    PENDING, so no gate follows; ``func`` names the entry point for a future row."""
    if dlse is None:
        return
    check_dlse(dlse, lse)


def forward_only(head_dim: int, head_dim_v: int) -> bool:
    """Whether (head_dim, head_dim_v) is one the backward does not run (Note [Head dims]: the
    forward takes FWD_HEAD_DIMS each, the backward BACKWARD_HEAD_DIMS only)."""
    return (head_dim, head_dim_v) not in BACKWARD_HEAD_DIMS


def refuse_backward_head_dims(func: str, head_dim: int, head_dim_v: int) -> None:
    """UnsupportedError where the backward is not built at (head_dim, head_dim_v), whatever
    FA4_FINAL_PENDING says: a gradient cannot be computed there. The public functions call it
    at the forward when a gradient will be needed, so backward() never meets it; the backward
    entry points call it before anything else runs."""
    if not forward_only(head_dim, head_dim_v):
        return
    pairs = ", ".join(f"({d}, {dv})" for d, dv in BACKWARD_HEAD_DIMS)
    raise UnsupportedError(
        f"{func}: the backward at head_dim={head_dim}, dv={head_dim_v} is not built (it runs "
        f"(head_dim, dv) {pairs}; the forward runs head_dim and dv each from "
        f"{FWD_HEAD_DIMS}). Run the forward alone under torch.no_grad(), or with q, k, v (and "
        f"the sink) not requiring grad")
