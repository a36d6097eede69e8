"""In-kernel timestamps for drawing a kernel's schedule (a debug build, off by default).

Note [Timeline]
With ``timeline=True`` a kernel records, for the first tile of CTA 0, when each warpgroup reaches
each phase of each KV step: one thread per warpgroup writes the SM's cycle counter (clock64) into
an int64 tensor ``(roles, MAX_STEPS, MARKS)``. All warpgroups of a CTA run on one SM, so their
cycle counts share one clock: that is what a Gantt chart of the overlap needs. (The global
nanosecond timer, %globaltimer, is common to all SMs but ticks far too coarsely for phases that
last a few hundred cycles.) The stores sit behind compile-time ``if``s: the normal build has none.

Marks of a consumer warpgroup's KV step (the slots of the last axis):
  WAIT   before it waits for its K tile and its turn
  ISSUE  its turn has come (ping-pong barrier passed): it issues S = Q K^T and O += P V
  ISSUED both GEMMs issued, the turn handed on
  S_READY S is in registers (wgmma wait_group 1)
  P_READY the softmax is done and P is converted: ready for the next turn
Producer role: one mark per K tile, when its TMA copy is issued (slot WAIT).
"""

from enum import IntEnum

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

MAX_STEPS = 64


class Mark(IntEnum):
    WAIT = 0
    ISSUE = 1
    ISSUED = 2
    S_READY = 3
    P_READY = 4


MARKS = len(Mark)
PHASES = {  # (from, to) -> what the warpgroup does in between
    "waits for K and its turn": (Mark.WAIT, Mark.ISSUE),
    "issues its GEMMs": (Mark.ISSUE, Mark.ISSUED),
    "waits for S": (Mark.ISSUED, Mark.S_READY),
    "softmax": (Mark.S_READY, Mark.P_READY),
}


@cute.jit
def mark(enabled: cutlass.Constexpr[bool], tl: cute.Tensor, record, role, step, slot: int):
    """tl[role, step, slot] = clock64() where ``record`` (a run-time Boolean: CTA 0's first
    tile, one thread of the role) and ``step < MAX_STEPS``."""
    if const_expr(enabled):
        if record & (step < MAX_STEPS):
            tl[role, step, slot] = cute.arch.clock64()
