"""The Hopper backward's named barriers, compiled for sm_90a (Note [Barriers of two builds] in
fa4_final.hopper.bwd).

Each build's main kernel is compiled with the barrier calls recorded by role: the TMA warp, the
dQ warp, and the MMA warpgroups' loop, one build for both ("mma", 256 threads) or one of its
own for each ("mma0", "mma1", 128 threads each: the D = 96, (192, 128) and swapped builds).
Per named barrier with an id known at compile time:

- its thread count is the threads of the roles that reach it (each role's warps all do), and
  every call names the same count;
- a barrier waited at (bar.sync) by more than one role is waited at from more than one
  instruction, so it must be the unaligned barrier.cta.sync; waited at by one role it may be
  bar.sync (both warpgroups of one build reach the same instruction);

and the cubin agrees: a BAR.SYNC of a barrier the trace calls unaligned is listed in the kernel's
cooperative-group instruction offsets (.nv.info attribute 0x28) and a BAR.SYNC of an aligned one
is not. compute-sanitizer's synccheck found the first rule broken at D = 96, 192 and 256 (the
two MMA builds waited at two bar.sync instructions of one id); the default builds keep it, with
their SASS. Slow: one compile a build.
"""

from __future__ import annotations

import re
import struct
from collections import defaultdict

import pytest

from fa4_final.hopper.config import HopperBwdConfig

EIATTR_COOP_GROUP_INSTR_OFFSETS = 0x28
# dq0, dq1: the even and odd steps' dQ warps (Note [Adds in flight across turns])
ROLE_THREADS = {"tma": 32, "dq": 32, "dq0": 32, "dq1": 32, "mma": 256, "mma0": 128, "mma1": 128}

BUILDS = [  # (id, head_dim, dtype, causal, keywords of backward_recipe), the defaults first
    ("d128_dense", 128, "bf16", False, {}),
    ("d64_causal_det", 64, "bf16", True, dict(deterministic=True)),
    ("d96", 96, "fp16", False, {}),
    ("d192", 192, "fp16", False, dict(head_dim_v=128)),
    ("d192v192", 192, "fp16", False, {}),
    ("d256", 256, "fp16", False, {}),
    # two dQ staging buffers (Note [Two dQ buffers]): the second buffer's EMPTY and FULL
    ("d128_causal_det_db", 128, "bf16", True, dict(deterministic=True, config=HopperBwdConfig(
        tile_m=64, deterministic=True, dq_buffers=2))),
    # ... with a dQ warp per buffer (Note [Adds in flight across turns]): each reaches its own
    ("d128_causal_det_overlap", 128, "bf16", True, dict(deterministic=True,
                                                        config=HopperBwdConfig(
        tile_m=64, deterministic=True, dq_buffers=2, dq_adds_overlap=True))),
    # ... and the rotated walk (Note [A rotated walk]): the same barriers, other registers
    ("d128_dense_det_rotated", 128, "bf16", False, dict(deterministic=True,
                                                       config=HopperBwdConfig(
        tile_m=64, deterministic=True, dq_buffers=2, dq_adds_overlap=True, dq_rotated=True))),
]
SPLIT = {"d96", "d192", "d192v192", "d256"}  # the builds with a loop per MMA warpgroup
# a dQ warp per buffer: the deterministic default at D = 64 and 128, and the explicit build
OVERLAP = {"d64_causal_det", "d128_causal_det_overlap", "d128_dense_det_rotated"}


def coop_offsets(cubin: bytes) -> set[int]:
    """Instruction offsets listed under EIATTR_COOP_GROUP_INSTR_OFFSETS in the cubin's
    per-kernel .nv.info sections. Each entry there is a 4-byte header (format, attribute, a
    16-bit value or, for format 4, the payload's size) and the payload."""
    from fa4_final.runtime.compile import _elf_sections

    found = set()
    for name, _, off, size, _, _ in _elf_sections(cubin):
        if not name.startswith(".nv.info."):
            continue
        p, end = off, off + size
        while p + 4 <= end:
            fmt, attr, value = cubin[p], cubin[p + 1], struct.unpack_from("<H", cubin, p + 2)[0]
            p += 4
            if fmt == 4:
                if attr == EIATTR_COOP_GROUP_INSTR_OFFSETS:
                    found.update(struct.unpack_from(f"<{value // 4}I", cubin, p))
                p += value
    return found


_BAR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?"
                  r"BAR\.(SYNC|ARV)\S*\s+(\w+),\s*(\w+)\s*;")


def sass_barriers(sass: str) -> list[tuple[int, str, int | None, int]]:
    """(offset, SYNC or ARV, id or None for a register, thread count) of each BAR of a
    named barrier (BAR.SYNC 0x0 of all threads, without a count, is left out)."""
    out = []
    for m in map(_BAR.search, sass.splitlines()):
        if m:
            bid = int(m.group(3), 16) if m.group(3).startswith("0x") else None
            out.append((int(m.group(1), 16), m.group(2), bid, int(m.group(4), 16)))
    return out


def _role_of(method: str, self, kw) -> str:
    if method == "load":
        return "tma"
    if method.startswith("store_dq"):  # store_dq, store_dq_two_buffers
        return "dq" if kw.get("parity") is None else f"dq{kw['parity']}"
    if kw.get("dq_part") is not None:  # Note [dQ split unevenly], Note [dK and dV swapped]
        return f"mma{kw['dq_part']}"
    if not self.split_builds():
        return "mma"
    return "mma0" if kw.get("dq_wg", True) else "mma1"  # Note [dQ by one warpgroup]


def traced_build(monkeypatch, head_dim, dtype, causal, kw):
    """(main kernel Artifacts, records (role, wait or arrive, id or None, count, aligned)) of
    one build, its barrier calls recorded while it is traced."""
    import cutlass.cute as cute

    from fa4_final.hopper import bwd
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    records, role = [], ["kernel"]

    def static(bid):
        return bid if isinstance(bid, int) else None

    for method in ("load", "store_dq", "store_dq_two_buffers", "mma", "mma_swapped"):
        original = getattr(bwd.HopperBackward, method)

        def wrapped(self, *args, _method=method, _original=original, **kwargs):
            before, role[0] = role[0], _role_of(_method, self, kwargs)
            try:
                return _original(self, *args, **kwargs)
            finally:
                role[0] = before

        monkeypatch.setattr(bwd.HopperBackward, method, wrapped)

    barrier, arrive, unaligned = cute.arch.barrier, cute.arch.barrier_arrive, bwd._sync_unaligned

    def rec_barrier(*, barrier_id=None, number_of_threads=None, **k):
        if barrier_id is not None:
            records.append((role[0], "wait", static(barrier_id), number_of_threads, True))
        return barrier(barrier_id=barrier_id, number_of_threads=number_of_threads, **k)

    def rec_arrive(*, barrier_id=None, number_of_threads=None, aligned=True, **k):
        records.append((role[0], "arrive", static(barrier_id), number_of_threads, aligned))
        return arrive(barrier_id=barrier_id, number_of_threads=number_of_threads,
                      aligned=aligned, **k)

    def rec_unaligned(barrier_id, number_of_threads, **k):
        records.append((role[0], "wait", static(barrier_id), number_of_threads, False))
        return unaligned(barrier_id, number_of_threads, **k)

    monkeypatch.setattr(cute.arch, "barrier", rec_barrier)
    monkeypatch.setattr(cute.arch, "barrier_arrive", rec_arrive)
    monkeypatch.setattr(bwd, "_sync_unaligned", rec_unaligned)
    main = artifacts(backward_recipe(head_dim, dtype, causal, **kw), roles=["main"])["main"]
    return main, records


def barrier_rule_breaks(records) -> list[str]:
    """What the records break of the two rules of the module docstring (empty: none). A
    record without a compile-time id is a warpgroup's dQ hand-off whose id holds the
    warpgroup index (one build for both, or Note [dQ by one warpgroup]'s dQ build): it adds
    a warpgroup's 128 threads to each barrier of its count."""
    by_id, handoff_counts, broken = defaultdict(list), set(), []
    for r in records:
        if r[2] is not None:
            by_id[r[2]].append(r)
        elif r[0].startswith("mma"):
            handoff_counts.add(r[3])
        else:
            broken.append(f"{r[0]}: a barrier id known only at run time")
    for bid, rs in sorted(by_id.items()):
        counts = {r[3] for r in rs}
        roles = {r[0] for r in rs}
        threads = sum(ROLE_THREADS[r] for r in roles)
        if len(counts) == 1 and counts <= handoff_counts:
            threads += ROLE_THREADS["mma0"]
        if counts != {threads}:
            broken.append(f"barrier {bid}: counts {sorted(counts)}, reached by {sorted(roles)} "
                          f"= {threads} threads")
        waits = [r for r in rs if r[1] == "wait"]
        waiting_roles = {r[0] for r in waits}
        if len(waiting_roles) > 1 and any(r[4] for r in waits):
            broken.append(f"barrier {bid}: bar.sync (aligned) waited at by {sorted(waiting_roles)},"
                          " each from an instruction of its own")
    return broken


@pytest.mark.slow
@pytest.mark.parametrize("name, head_dim, dtype, causal, kw", BUILDS, ids=[b[0] for b in BUILDS])
def test_named_barriers_are_reached_as_they_promise(monkeypatch, name, head_dim, dtype, causal,
                                                    kw):
    main, records = traced_build(monkeypatch, head_dim, dtype, causal, kw)
    roles = {r[0] for r in records}
    dq = {"dq0", "dq1"} if name in OVERLAP else {"dq"}
    assert roles == (dq | {"mma0", "mma1"} if name in SPLIT else dq | {"mma"})  # TMA: none
    assert not barrier_rule_breaks(records)
    dq_ids = {r[2] for r in records if r[0] in dq}  # EMPTY arrives, FULL waits per buffer
    assert dq_ids == (set(range(4, 12)) if name.endswith("_db") or name in OVERLAP else
                      {4, 6} if name == "d96" else {4, 5, 6, 7}), sorted(dq_ids)
    if name in OVERLAP:  # buffer 0's barriers for the even steps' warp, 1's for odd
        for warp, ids in (("dq0", {4, 5, 6, 7}), ("dq1", {8, 9, 10, 11})):
            assert {r[2] for r in records if r[0] == warp} == ids, warp
    unaligned_ids = {r[2] for r in records if r[1] == "wait" and not r[4]}
    aligned_ids = {r[2] for r in records if r[1] == "wait" and r[4]}
    assert not unaligned_ids & aligned_ids
    # both MMA warpgroups' blocking barriers: DS_READY, EPILOGUE (DS_FREE with one dS buffer)
    mma_ids = {r[2] for r in records if r[3] == ROLE_THREADS["mma"]}
    assert mma_ids >= {1, 3}
    assert unaligned_ids == (mma_ids if name in SPLIT else set())
    # the cubin: unaligned waits listed among the cooperative-group instructions, aligned not
    listed = coop_offsets(main.cubin)
    waits = [b for b in sass_barriers(main.sass) if b[1] == "SYNC"]
    assert {b[2] for b in waits if b[3] == ROLE_THREADS["mma"]} == mma_ids
    for offset, _, bid, count in waits:
        if bid in unaligned_ids:
            assert offset in listed, f"BAR.SYNC {bid}, {count} at {offset:#x} is not listed"
        elif bid is not None:
            assert offset not in listed, f"BAR.SYNC {bid}, {count} at {offset:#x} is listed"


def test_the_rules_catch_two_builds_at_one_aligned_barrier():
    """The trace of the builds before the fix (Note [Barriers of two builds]): DS_READY and
    EPILOGUE waited at with bar.sync by both MMA builds; and a count that is not the threads."""
    before = [("mma0", "wait", 1, 256, True), ("mma1", "wait", 1, 256, True),
              ("mma0", "wait", 3, 256, True), ("mma1", "wait", 3, 256, True),
              ("mma0", "wait", 4, 160, True), ("dq", "arrive", 4, 160, True)]
    assert len(barrier_rule_breaks(before)) == 2
    after = [(r[0], r[1], r[2], r[3], r[2] == 4) for r in before]
    assert not barrier_rule_breaks(after)
    one_build = [("mma", "wait", 1, 256, True), ("mma", "wait", 3, 256, True)]
    assert not barrier_rule_breaks(one_build)
    assert barrier_rule_breaks([("mma0", "wait", 4, 256, True), ("dq", "arrive", 4, 256, True)])
    # one build's hand-off, its id holding the warpgroup index: 128 + the dQ warp's 32
    handoff = [("mma", "wait", None, 160, True), ("dq", "arrive", 4, 160, True),
               ("dq", "wait", 6, 160, True), ("mma", "arrive", None, 160, True)]
    assert not barrier_rule_breaks(handoff)
