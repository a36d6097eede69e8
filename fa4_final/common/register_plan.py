"""Register plans of warp-specialised kernels: the ``setmaxnreg`` arithmetic no compiler checks.

An SM's 64 K 32-bit registers are four register files, one per sub-partition (the four
schedulers of the SM); warp w of a CTA runs on sub-partition w % 4. ``setmaxnreg`` moves registers
between a warp and its sub-partition's pool (PTX ISA: "a pool of available registers is
maintained per CTA"), so the budgets of the warps that share a sub-partition must fit that
sub-partition's file: 16 K registers = 512 per thread slot (64 K / 4 sub-partitions / 32 lanes),
and no more than its warps held at launch. A plan whose CTA total fits the SM can still ask one
sub-partition for more: its ``setmaxnreg.inc`` then never returns, and the kernel hangs at its
first barrier. The PTX ISA also asks every warp of a warpgroup to run the same ``setmaxnreg``.

A kernel's role table gives each role its warps (Blackwell: ``"warps"``) or warpgroups (Hopper:
``"warpgroups"``) and its budget (``"registers"``, per thread). ``check_role_registers`` holds a
table to these rules when the kernel object is built, before anything compiles; the Blackwell
and Hopper kernels both call it, and probe kernels run the same plans on a GPU.

This module is plain Python: it imports no DSL.
"""

from __future__ import annotations

from fa4_final.common.constants import WARP_SIZE

REGISTER_FILE = 64 * 1024  # 32-bit registers per SM (sm_90, sm_100)
SUB_PARTITIONS = 4
SLOT_REGISTERS = REGISTER_FILE // SUB_PARTITIONS // WARP_SIZE  # 512 per thread slot
WARPS_PER_WARPGROUP = 4
SETMAXNREG_RANGE = (24, 256)  # setmaxnreg's operand: a multiple of 8 in this range
MAX_THREAD_REGISTERS = 256  # a thread's allocation at launch, in steps of 8 (255 usable)


class RegisterPlanError(ValueError):
    """A register plan a GPU cannot run: the message names the rule, the warps and the sums."""


def launch_registers(threads: int) -> int:
    """Registers per thread a CTA of ``threads`` threads is launched with when it asks for one
    CTA per SM (launch bounds, ``min_blocks_per_mp=1``): its share of the register file, in
    steps of 8. 512 threads: 128; 384: 168; 256: 256."""
    return min(REGISTER_FILE // threads // 8 * 8, MAX_THREAD_REGISTERS)


def sub_partition(warp: int) -> int:
    """The SM sub-partition warp ``warp`` of a CTA runs on."""
    return warp % SUB_PARTITIONS


def warp_budgets(roles: dict) -> dict[int, int]:
    """warp -> setmaxnreg budget (registers per thread) of a role table. A role names its warps
    (``"warps"``) or its warpgroups (``"warpgroups"``, four warps each)."""
    out: dict[int, int] = {}
    for name, role in roles.items():
        if "warps" in role:
            warps = tuple(role["warps"])
        else:
            warps = tuple(WARPS_PER_WARPGROUP * g + w for g in role["warpgroups"]
                          for w in range(WARPS_PER_WARPGROUP))
        for w in warps:
            if w in out:
                raise RegisterPlanError(f"warp {w} has two roles (the second: {name!r})")
            out[w] = role["registers"]
    return dict(sorted(out.items()))


def sub_partition_sums(budgets: dict[int, int]) -> list[tuple[int, tuple[int, ...], int]]:
    """(sub-partition, its warps, the sum of their budgets) for each sub-partition in use."""
    rows = []
    for k in range(SUB_PARTITIONS):
        warps = tuple(w for w in sorted(budgets) if sub_partition(w) == k)
        if warps:
            rows.append((k, warps, sum(budgets[w] for w in warps)))
    return rows


def capacity(warps_here: int, threads: int | None) -> int:
    """Registers per thread slot a sub-partition can give the ``warps_here`` warps it holds:
    512, and no more than those warps held at launch (the pool setmaxnreg draws on)."""
    if threads is None:
        return SLOT_REGISTERS
    return min(SLOT_REGISTERS, warps_here * launch_registers(threads))


def problems(budgets: dict[int, int], threads: int | None = None) -> list[str]:
    """What keeps a plan (warp -> budget) from running, in words; empty when it can run."""
    found = []
    for k, warps, total in sub_partition_sums(budgets):
        room = capacity(len(warps), threads)
        if total > room:
            why = "" if room == SLOT_REGISTERS else \
                f" ({len(warps)} warps x {launch_registers(threads)} registers at launch)"
            found.append(f"sub-partition {k} (warps {', '.join(map(str, warps))}) needs {total} "
                         f"registers per thread slot, more than {room}{why}")
    groups: dict[int, list[int]] = {}
    for w in budgets:
        groups.setdefault(w // WARPS_PER_WARPGROUP, []).append(w)
    for g, warps in sorted(groups.items()):
        values = [budgets[w] for w in warps]
        if len(set(values)) > 1:
            found.append(f"warpgroup {g} (warps {', '.join(map(str, warps))}) runs setmaxnreg "
                         f"{', '.join(map(str, values))}: the PTX ISA asks every warp of a "
                         f"warpgroup to run the same setmaxnreg")
    lo, hi = SETMAXNREG_RANGE
    bad = sorted({r for r in budgets.values() if r % 8 or not lo <= r <= hi})
    if bad:
        found.append(f"setmaxnreg takes a multiple of 8 in [{lo}, {hi}], not {bad}")
    return found


def check_budgets(budgets: dict[int, int], threads: int | None = None) -> None:
    """Raise RegisterPlanError naming every rule the plan (warp -> budget) breaks."""
    found = problems(budgets, threads)
    if found:
        raise RegisterPlanError("register plan cannot run: " + "; ".join(found))


def check_role_registers(roles: dict, threads: int) -> dict[int, int]:
    """``check_budgets`` for a kernel's role table of ``threads`` threads; every warp must have
    a role. Returns the plan, warp -> budget."""
    budgets = warp_budgets(roles)
    if sorted(budgets) != list(range(threads // WARP_SIZE)):
        raise RegisterPlanError(f"the roles cover warps {sorted(budgets)}, the CTA has "
                                f"{threads // WARP_SIZE}")
    check_budgets(budgets, threads)
    return budgets


def plan_lines(budgets: dict[int, int], threads: int | None = None) -> list[str]:
    """One line per sub-partition: its warps, their budgets, the sum and the room."""
    return [f"sub-partition {k}: warps {', '.join(map(str, warps))}: "
            f"{' + '.join(str(budgets[w]) for w in warps)} = {total} "
            f"(room {capacity(len(warps), threads)})"
            for k, warps, total in sub_partition_sums(budgets)]
