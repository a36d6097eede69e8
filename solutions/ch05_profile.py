"""Reading an Nsight Compute profile of chapter 05's kernel (measured by
``python -m measure.profile_ch05`` on a GPU, stored as results/<gpu>/ch05_profile.json).

The same reading as chapter 04's profile (``solutions.ch04_profile``: ncu on the second launch,
its raw and SASS-source exports, the stall reasons), for the kernel ``ch05.attention()`` launches
at the chapter's headline shape (D = 128, 16 heads of 16384 queries and keys, bf16, non-causal,
the default 128 x 128 tile). What is new is what a warp-specialised wgmma kernel needs:

- the tensor pipe's busy share as wgmma drives it (the GMMA pipe) next to the issue slots used;
- each warp role's share of the sampled warp time, split by where the program counter sat: the
  SASS after ``setmaxnreg.dec`` is the producer's, after ``setmaxnreg.inc`` the consumers'
  (the out-of-line retry loops of mbarrier waits go to the role whose code jumps there);
- for the producer, the share at its mbarrier waits (a free slot) and at its TMA issues;
- for the consumers, the share at each kind of wait (mbarrier: a tile to land; wgmma's
  ``wait_group``; named barriers: ping-pong turns and the epilogue), and the share of each part
  of the steady-state KV turn, by SASS position between its two ``wait_group``s: the K/V waits
  and loop head, issuing S and P V, waiting for S, the softmax while P V may run, waiting for
  P V, and what comes after (P to bf16, the O rescale);
- the stall reasons of the consumers' samples, and the instructions a consumer warp issues per
  KV step.

ncu locks the SM clock to its base while it measures, so the figures are shares and ratios;
speeds come from the benchmarks. Saved as results/<gpu>/ch05_profile.json (rows: impl, metric,
value, unit).

fa4_final's Hopper forward is read by the same functions (``solutions.ch08_profile`` sets only its
kernel and its results name): its SASS has the same landmarks (see ``roles`` and
``consumer_turn``).
"""

from __future__ import annotations

import re

from solutions import ch04_profile as core

RESULTS = "ch05_profile"
SHAPE = dict(core.SHAPE)  # the same headline shape as chapter 04's profile
KERNEL_REGEX = "regex:FlashAttentionHopper"
SECTIONS = (*core.SECTIONS, "SchedulerStats")
# The GMMA pipe is the one wgmma uses; the hmma counter reads it too on sm_90 and is kept for
# comparison with chapter 04. An ncu without one of these simply leaves its row out.
EXTRA_METRICS = (
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
)
RAW_METRICS = (
    ("sm_clock_ghz", "gpc__cycles_elapsed.avg.per_second", "GHz"),
    ("duration_ms", "gpu__time_duration.sum", "ms"),
    ("tensor_pipe_gmma_active_pct",
     "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%"),
    ("tensor_pipe_active_pct",
     "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "%"),
    ("wgmma_instructions", "sm__inst_executed_pipe_tensor_op_gmma.sum", "warp instructions"),
    ("issue_slots_busy_pct", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", "%"),
    ("registers_per_thread", "launch__registers_per_thread", "registers"),
    ("ctas_per_sm_limit_registers", "launch__occupancy_limit_registers", "CTAs"),
    ("ctas_per_sm_limit_shared_mem", "launch__occupancy_limit_shared_mem", "CTAs"),
    ("achieved_warps_per_sm", "sm__warps_active.avg.per_cycle_active", "warps"),
)
ROLES = ("setup", "producer", "consumer")
# The parts of a consumer's steady-state turn, in SASS order (turn_part says where each starts).
TURN_PARTS = ("turn_head", "issue_gemms", "wait_s", "softmax_under_pv", "wait_pv", "after_pv")
# Consumer instructions that wait, by kind (opcode prefixes).
WAIT_KINDS = {
    "mbarrier": ("SYNCS.PHASECHK", "NANOSLEEP"),
    "wgmma": ("WARPGROUP.DEPBAR",),
    "named_barrier": ("BAR.SYNC", "BAR.ARV", "BAR.RED"),
}


def _is(op: str, prefixes) -> bool:
    return any(op.startswith(p) for p in prefixes)


def _target(sass: str, addresses: dict, base: int | None) -> int | None:
    """The index of the instruction a branch jumps to: its hex target as an absolute address,
    else as an offset from the kernel's first instruction (ncu may print either)."""
    m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-fA-F]+)", sass)
    if not m:
        return None
    target = int(m.group(1), 16)
    if target in addresses:
        return addresses[target]
    if base is not None and base + target in addresses:
        return addresses[base + target]
    return None


def roles(records: list[dict]) -> list[str]:
    """Each instruction's warp role: "setup" before the roles split, then "producer" from
    setmaxnreg.dec (USETMAXREG.DEALLOC) and "consumer" from setmaxnreg.inc (USETMAXREG.*ALLOC),
    each up to the other's start or the kernel's last EXIT. After that EXIT sit the
    out-of-line retry loops of mbarrier waits: each goes to the role whose code branches into
    it, or that it branches back to; "retry" if neither can be told.

    This holds for fa4_final's kernel too: all its consumer warpgroups (two or three, in
    ping-pong) run one copy of the consumer code, told apart by registers (their named-barrier
    ids), not by SASS position; its persistent tile loops sit inside each role's span, and the
    producer warps that give their registers away and leave exit inside the producer's."""
    ops = [r["opcode"] for r in records]
    sass = [r["sass"] for r in records]
    try:
        producer = next(i for i, op in enumerate(ops)
                        if op.startswith("USETMAXREG") and "DEALLOC" in op)
        consumer = next(i for i, op in enumerate(ops)
                        if op.startswith("USETMAXREG") and "DEALLOC" not in op)
    except StopIteration:
        raise ValueError("no setmaxnreg (USETMAXREG) in the SASS: is this a warp-specialised "
                         "kernel?") from None
    last_exit = max(i for i, op in enumerate(ops) if op == "EXIT")
    out = ["setup"] * len(records)
    starts = sorted([(producer, "producer"), (consumer, "consumer")])
    for k, (start, role) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else last_exit + 1
        out[start:end] = [role] * (end - start)
    addresses = {r["address"]: i for i, r in enumerate(records) if r["address"] is not None}
    base = records[0]["address"] if records and records[0]["address"] is not None else None
    tail = list(range(last_exit + 1, len(records)))
    out[last_exit + 1:] = ["retry"] * len(tail)
    # blocks of the tail: each ends with an unconditional branch back into the main code
    blocks, start = [], last_exit + 1
    for i in tail:
        if ops[i] == "BRA" and not sass[i].startswith("@"):
            blocks.append((start, i))
            start = i + 1
    entry = {}  # tail index -> role of a main-code branch that jumps there
    for i in range(last_exit + 1):
        if ops[i] == "BRA":
            t = _target(sass[i], addresses, base)
            if t is not None and t > last_exit:
                entry[t] = out[i]
    for a, b in blocks:
        back = _target(sass[b], addresses, base)
        role = next((entry[i] for i in range(a, b + 1) if i in entry), None)
        if role is None and back is not None and back <= last_exit:
            role = out[back]
        if role in ("producer", "consumer"):
            out[a:b + 1] = [role] * (b + 1 - a)
    return out


def consumer_turn(records: list[dict], role: list[str]) -> tuple[int, int] | None:
    """The consumers' steady-state KV loop as a span of instruction indices, found from its
    ``wait_group(1)`` (``WARPGROUP.DEPBAR.LE gsb0, 0x1``, which only the steady turns have):
    the loop's back edge, a branch after it to a point before it, gives the span; if ncu's
    branch targets cannot be read, the run of instructions around it that execute at least
    half as often. None without such a wait.

    In fa4_final the steady turn is the same shape, inside its persistent tile loop: the loop
    found is the innermost one around that wait (the first back edge after it), the tile loop's
    back edge comes later. Its ping-pong turn (``bar.sync`` before S, ``bar.arrive`` after P V)
    sits in the turn's head and its GEMM issue; ``consumer_turn_named_barrier_pct`` says how
    much of the turn that is."""
    idx = [i for i, r in enumerate(records)
           if role[i] == "consumer" and "DEPBAR.LE gsb0, 0x1" in r["sass"]]
    if not idx:
        return None
    s_ready = idx[0]
    addresses = {r["address"]: i for i, r in enumerate(records) if r["address"] is not None}
    base = records[0]["address"]
    start = next((i for i, x in enumerate(role) if x == "consumer"), 0)
    for i in range(s_ready + 1, len(records)):
        if role[i] != "consumer":
            break
        if records[i]["opcode"] == "BRA":
            t = _target(records[i]["sass"], addresses, base)
            if t is not None and start <= t < s_ready:
                return t, i
    cut = records[s_ready]["executed"] / 2
    a = b = s_ready
    while a - 1 >= start and role[a - 1] == "consumer" and records[a - 1]["executed"] >= cut:
        a -= 1
    while b + 1 < len(records) and role[b + 1] == "consumer" and records[b + 1]["executed"] >= cut:
        b += 1
    return a, b


def turn_part(records: list[dict], span: tuple[int, int]) -> dict[int, str]:
    """Each instruction of the steady turn -> its part (TURN_PARTS), by position: up to the
    first HGMMA the K/V waits and loop head; then issuing the GEMMs; the wait for S
    (wait_group 1); the softmax while P V may run; the wait for P V (wait_group 0); the rest
    (P to bf16, the O rescale, the loop's branch). In fa4_final the O rescale is issued between
    the GEMMs (at the next P V, Note [Where O is rescaled]), so its multiplies count as issuing
    the GEMMs."""
    a, b = span
    sass = {i: records[i]["sass"] for i in range(a, b + 1)}
    first_mma = next((i for i in range(a, b + 1) if records[i]["opcode"].startswith("HGMMA")), a)
    s_ready = next(i for i in range(a, b + 1) if "DEPBAR.LE gsb0, 0x1" in sass[i])
    pv_done = next((i for i in range(s_ready, b + 1) if "DEPBAR.LE gsb0, 0x0" in sass[i]), b)
    parts = {}
    for i in range(a, b + 1):
        if i < first_mma:
            parts[i] = "turn_head"
        elif i < s_ready:
            parts[i] = "issue_gemms"
        elif i == s_ready:
            parts[i] = "wait_s"
        elif i < pv_done:
            parts[i] = "softmax_under_pv"
        elif i == pv_done:
            parts[i] = "wait_pv"
        else:
            parts[i] = "after_pv"
    return parts


def role_rows(records: list[dict]) -> list[dict]:
    """Result rows from the SASS source export of the warp-specialised kernel (see roles,
    consumer_turn, turn_part): shares of sampled warp time per role, per kind of wait, per part
    of the consumers' steady turn, the consumers' stall reasons, and instructions per step."""
    role = roles(records)
    total = sum(r["samples"] for r in records) or 1
    rows = []

    def pct(metric, part, whole):
        rows.append({"metric": metric, "value": 100.0 * part / (whole or 1), "unit": "%"})

    by_role = {k: sum(r["samples"] for r, x in zip(records, role) if x == k)
               for k in (*ROLES, "retry")}
    for k, v in by_role.items():
        if k != "retry" or v:
            pct(f"warp_time_{k}_pct", v, total)
    producer = [r for r, x in zip(records, role) if x == "producer"]
    prod = by_role["producer"]
    pct("producer_time_mbarrier_wait_pct",
        sum(r["samples"] for r in producer if _is(r["opcode"], WAIT_KINDS["mbarrier"])), prod)
    pct("producer_time_tma_issue_pct",
        sum(r["samples"] for r in producer if r["opcode"].startswith("UTMALDG")), prod)
    consumer = [r for r, x in zip(records, role) if x == "consumer"]
    cons = by_role["consumer"]
    for kind, prefixes in WAIT_KINDS.items():
        pct(f"consumer_time_{kind}_wait_pct",
            sum(r["samples"] for r in consumer if _is(r["opcode"], prefixes)), cons)
    pct("consumer_time_wgmma_issue_pct",
        sum(r["samples"] for r in consumer if r["opcode"].startswith("HGMMA")), cons)
    pct("consumer_time_exp2_pct",
        sum(r["samples"] for r in consumer if r["opcode"].startswith("MUFU.EX2")), cons)
    reasons = sorted({k for r in consumer for k in r["stalls"]})
    for reason in reasons:
        pct(f"consumer_stall_{reason}_samples_pct",
            sum(r["stalls"].get(reason, 0) for r in consumer), cons)
    span = consumer_turn(records, role)
    if span is not None:
        parts = turn_part(records, span)
        in_turn = dict.fromkeys(TURN_PARTS, 0)
        for i, part in parts.items():
            in_turn[part] += records[i]["samples"]
        for part in TURN_PARTS:
            pct(f"consumer_turn_{part}_pct", in_turn[part], cons)
        # the ping-pong turns: bar.sync (wait for mine) and bar.arrive (pass it on)
        pct("consumer_turn_named_barrier_pct",
            sum(records[i]["samples"] for i in parts
                if _is(records[i]["opcode"], WAIT_KINDS["named_barrier"])), cons)
        pct("consumer_time_outside_steady_turn_pct", cons - sum(in_turn.values()), cons)
        a, b = span
        steps = max(r["executed"] for r in records[a:b + 1]
                    if "DEPBAR.LE gsb0, 0x1" in r["sass"])
        loop = records[a:b + 1]
        wgmma = sum(r["executed"] for r in loop if r["opcode"].startswith("HGMMA")) / steps
        rows += [{"metric": "wgmma_per_consumer_warp_per_step", "value": wgmma,
                  "unit": "instructions"},
                 {"metric": "other_instructions_per_consumer_warp_per_step",
                  "value": sum(r["executed"] for r in loop) / steps - wgmma,
                  "unit": "instructions"}]
    return rows


def build_rows(raw_text: str, source_text: str, config_label: str,
               impl: str = "flash_hopper") -> list[dict]:
    rows = (core.raw_rows(core.parse_raw(raw_text), RAW_METRICS)
            + role_rows(core.parse_source_rows(source_text)))
    return [{"impl": impl, "config": config_label, **SHAPE, **r} for r in rows]


def config_label(cfg) -> str:
    """'128x128 wg2 s2 overlap' (+ ' pingpong'): the tile a profile row was measured with."""
    return (f"{cfg.tile_m}x{cfg.tile_n} wg{cfg.num_consumer_wgs} s{cfg.num_stages}"
            f"{' overlap' if cfg.intra_wg_overlap else ''}{' pingpong' if cfg.pingpong else ''}")
