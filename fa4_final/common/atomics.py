"""Global-memory reductions and turn counters: how CTAs that share an output add into it.

The backward's dQ gets a contribution from every KV tile, i.e. from many CTAs. Each CTA stages
its float32 contribution in shared memory and one thread hands it to the TMA unit:

    cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [gmem], [smem], bytes

one instruction adds a whole contiguous block (the TMA unit does the read-modify-write in L2),
where per-element atomics (``red.global.add.f32``) would need one instruction per 4 or 16
bytes from the MMA warps themselves. Completion is tracked with bulk groups
(``cp.async.bulk.commit_group`` / ``wait_group``), like TMA stores.

Atomic adds commute only in exact arithmetic: in float32, (a + b) + c and (a + c) + b can
differ in the last bit, and CTAs finish in a different order each run. The deterministic mode
gives every output block a turn counter in global memory: a CTA waits until the counter shows its
turn (``wait_turn``: ``ld.acquire.gpu``), adds, waits for its add to complete, then passes the
turn on (``pass_turn``: ``red.release.gpu.add``). Acquire and release make the previous CTA's
add visible before this one's starts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def bulk_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, nbytes: int) -> None:
    """Add ``nbytes`` of float32 from shared memory into global memory, asynchronously (one
    thread issues it; a multiple of 16 bytes, both addresses 16-byte aligned). Commit it to a
    bulk group and wait for that group before the shared memory is reused."""
    assert nbytes % 16 == 0, f"a bulk copy moves multiples of 16 bytes, got {nbytes}"
    cute.arch.inline_ptx(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{$r0}], [{$r1}], {$r2};",
        read_only_args=[gmem_ptr, smem_ptr, Int32(nbytes)],
    )


def bulk_store_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, nbytes: int) -> None:
    """Write ``nbytes`` of float32 from shared memory over global memory (a plain bulk copy, no
    read of the destination): bulk_add_f32's counterpart for the first writer of a block, so
    the block needs no zeroing before (HopperBwdConfig.dq_first_store, Note [dQ copies]).
    Same rules: one thread, multiples of 16 bytes, 16-byte aligned, tracked by bulk groups."""
    assert nbytes % 16 == 0, f"a bulk copy moves multiples of 16 bytes, got {nbytes}"
    cute.arch.inline_ptx(
        "cp.async.bulk.global.shared::cta.bulk_group [{$r0}], [{$r1}], {$r2};",
        read_only_args=[gmem_ptr, smem_ptr, Int32(nbytes)],
    )


@cute.jit
def wait_turn(counter: cute.Pointer, turn: Int32) -> None:
    """Spin (one thread) until the int32 counter in global memory equals ``turn``."""
    seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    while seen != turn:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")


def pass_turn(counter: cute.Pointer) -> None:
    """Increment the counter with release semantics: everything this thread's CTA wrote (and
    waited for) before is visible to whoever acquires the new value."""
    cute.arch.red(counter, Int32(1), op="add", dtype=cutlass.Int32, sem="release", scope="gpu")
