"""Reading where the warps of fa4_final's Hopper forward and of the FA4 package's wait,
instruction by instruction: ncu's warp-state sampling per SASS instruction, both kernels at one
shape (measured by ``python -m measure.fwd_stalls``; labs/the_last_three_percent.ipynb).

``solutions.ch08_versus`` compares the two kernels by whole-kernel counters: time, tensor pipe,
issue slots, stall reasons averaged over every warp. Those say *that* one kernel's warps wait
longer for a fixed-latency result ("wait") or for the shared-memory pipe ("mio_throttle"), not
*where*. Here every (kernel, shape) is profiled once more with ncu's SourceCounters section: the
SM samples each warp's state every few hundred cycles and ncu charges the sample to the
instruction the warp sits at, with the reason it is not issuing. Grouping the samples by warp
role (the SASS after ``setmaxnreg.dec`` is the producer's, after ``setmaxnreg.inc`` the
consumers', as in chapter 05's profile) and by kind of instruction shows where each kernel's
consumer warps spend their time; both kernels run three consumer warpgroups of 64 rows at
D = 64, with one 192 x 128 tile, so the shares compare like for like.

Saved rows (impl, shape, metric, value, unit): the counters of ch08_versus, the role and turn
shares of chapter 05's profile (``ch05_profile.role_rows``), and per kind of consumer
instruction (``KINDS``) its share of the consumers' samples, its share of their issued
instructions, and the stall reason most of its samples carry; the consumers' sample count and,
per kind, the steady KV loop's samples and their reasons (``steady_rows``; ``steady_difference``
sets two kernels against each other); the consumer instructions that hold the most samples
(``hot_rows``). ncu holds the SM clock at its base.

Reading the attribution: a warp waiting at a named barrier is charged to the instruction after
the ``BAR.SYNC``, a warp polling an mbarrier to the branch of its retry loop.
"""

from __future__ import annotations

from collections import Counter

from solutions import ch04_profile as core
from solutions import ch05_profile as ch05p
from solutions import ch08_versus as versus

RESULTS = "fa4_final_stalls"
# (head_dim, seqlen, causal): the shape where the package stays ahead at the fixed clock, and the
# same shape without the mask, where fa4_final leads
SHAPES = ((64, 16384, True), (64, 16384, False))
IMPLS = ("fa4_final", "fa4_package")
SECTIONS = (*versus.SECTIONS, "SourceCounters")
# Kinds of consumer instruction, in the order the table prints them: (kind, opcode prefixes).
# An instruction falls in the first kind whose prefix its opcode starts with.
KINDS = (
    ("wgmma issue (HGMMA)", ("HGMMA",)),
    ("wgmma wait (WARPGROUP.DEPBAR)", ("WARPGROUP.DEPBAR",)),
    ("wgmma fence (WARPGROUP.ARRIVE)", ("WARPGROUP.ARRIVE",)),
    ("mbarrier wait (SYNCS, NANOSLEEP)", ("SYNCS", "NANOSLEEP")),
    ("named barrier (BAR)", ("BAR.",)),
    ("exp2 (MUFU.EX2)", ("MUFU.EX2",)),
    ("row max (FMNMX)", ("FMNMX",)),
    ("scale and subtract (FFMA)", ("FFMA",)),
    ("row sum (FADD)", ("FADD",)),
    ("multiply (FMUL)", ("FMUL",)),
    ("to 16-bit (F2FP)", ("F2FP",)),
    ("shuffle (SHFL)", ("SHFL",)),
    ("select (FSEL)", ("FSEL",)),
    ("uniform datapath (U*)", ("U",)),
    ("branch (BRA)", ("BRA",)),
)
OTHER = "other"


def kind_of(opcode: str) -> str:
    return next((k for k, prefixes in KINDS if any(opcode.startswith(p) for p in prefixes)),
                OTHER)


def consumer_records(records: list[dict]) -> list[dict]:
    """The consumer warps' instructions of a source page (chapter 05's role split)."""
    return [r for r, x in zip(records, ch05p.roles(records)) if x == "consumer"]


def kind_rows(consumer: list[dict]) -> list[dict]:
    """Per kind of consumer instruction: its share of the consumers' warp samples, of their
    executed instructions, and the reason most of its stalled samples carry ("selected" is a
    sample taken while the warp issued)."""
    samples = sum(r["samples"] for r in consumer) or 1
    executed = sum(r["executed"] for r in consumer) or 1
    by_kind: dict[str, list[dict]] = {}
    for r in consumer:
        by_kind.setdefault(kind_of(r["opcode"]), []).append(r)
    rows = []
    for kind in (*(k for k, _ in KINDS), OTHER):
        group = by_kind.get(kind, [])
        if not group:
            continue
        reasons = Counter()
        for r in group:
            reasons.update(r["stalls"])
        top = reasons.most_common(1)
        rows += [
            {"metric": f"kind_samples_pct[{kind}]", "unit": "%",
             "value": 100.0 * sum(r["samples"] for r in group) / samples},
            {"metric": f"kind_executed_pct[{kind}]", "unit": "%",
             "value": 100.0 * sum(r["executed"] for r in group) / executed},
        ]
        if top and top[0][1]:
            rows.append({"metric": f"kind_top_reason[{kind}]", "unit": "reason",
                         "value": top[0][0]})
    return rows


def steady_rows(consumer: list[dict]) -> list[dict]:
    """The consumers' sample count, and per kind the samples of the steady KV loop: the
    instructions executed exactly as often as the most frequent MUFU.EX2 (once per step and
    consumer warp; the first, masked and last steps run other copies). Samples are counts at
    one sampling interval, so two kernels' counts compare as time spent."""
    steps = Counter(r["executed"] for r in consumer if r["opcode"].startswith("MUFU.EX2"))
    if not steps:
        return []
    per_step = max(steps)
    loop = [r for r in consumer if r["executed"] == per_step]
    rows = [{"metric": "consumer_samples", "unit": "samples",
             "value": sum(r["samples"] for r in consumer)},
            {"metric": "steady_loop_instructions", "unit": "instructions", "value": len(loop)},
            {"metric": "steady_loop_steps", "unit": "warp steps", "value": per_step}]
    by_kind, reasons = Counter(), {}
    for r in loop:
        by_kind[kind_of(r["opcode"])] += r["samples"]
        reasons.setdefault(kind_of(r["opcode"]), Counter()).update(r["stalls"])
    rows += [{"metric": f"steady_samples[{k}]", "unit": "samples", "value": v}
             for k, v in by_kind.items()]
    rows += [{"metric": f"steady_reasons[{k}]", "unit": "samples per reason",
              "value": dict(v)} for k, v in reasons.items()]
    return rows


def steady_difference(res, shape=(64, 16384, True), ours="fa4_final",
                      theirs="fa4_package") -> list[str]:
    """Per kind, the steady KV loop's samples of ``ours`` minus ``theirs``, in per cent of
    ``theirs``' consumer samples, largest first: where the one kernel's consumers spend the
    time the other's do not."""
    d, s, causal = shape
    by = {impl: {r["metric"]: r["value"] for r in res.rows
                 if (r["d"], r["s"], r["causal"], r["impl"]) == (d, s, causal, impl)}
          for impl in (ours, theirs)}
    total = by[theirs].get("consumer_samples")
    if not total or "consumer_samples" not in by[ours]:
        return [f"no steady-loop samples stored for D={d} S={s} causal={causal}"]
    kinds = {m for b in by.values() for m in b if m.startswith("steady_samples[")}
    diff = sorted(((by[ours].get(m, 0) - by[theirs].get(m, 0), m[15:-1]) for m in kinds),
                  reverse=True)
    lines = [f"D={d} S={s} {'causal' if causal else 'non-causal'}: consumer samples {ours} "
             f"{by[ours]['consumer_samples']:.0f}, {theirs} {total:.0f} "
             f"({100 * (by[ours]['consumer_samples'] / total - 1):+.1f}%); steady loop, "
             f"{ours} minus {theirs}, in % of {theirs}'s consumer samples:"]
    for v, kind in diff:
        if abs(v) < 0.002 * total:
            continue
        mine, other = (by[x].get(f"steady_reasons[{kind}]", {}) for x in (ours, theirs))
        moved = {r: mine.get(r, 0) - other.get(r, 0) for r in {*mine, *other}}
        why = max(moved, key=lambda r: moved[r] if v > 0 else -moved[r], default=None)
        reason = f"  (largest reason: {why} {100 * moved[why] / total:+.1f}%)" if why else ""
        lines.append(f"  {kind:34s} {100 * v / total:+5.1f}%{reason}")
    return lines


def hot_rows(consumer: list[dict], n: int = 12) -> list[dict]:
    """The ``n`` consumer instructions that hold the most samples, in order: their SASS, share of
    the consumers' samples and the reasons of those samples (``{reason: share}``)."""
    samples = sum(r["samples"] for r in consumer) or 1
    rows = []
    for rank, r in enumerate(sorted(consumer, key=lambda r: -r["samples"])[:n]):
        st = {k: round(100.0 * v / (r["samples"] or 1), 1)
              for k, v in sorted(r["stalls"].items(), key=lambda kv: -kv[1]) if v}
        rows.append({"metric": f"hot[{rank}]", "unit": "instruction",
                     "value": {"sass": r["sass"], "samples_pct": 100.0 * r["samples"] / samples,
                               "executed": r["executed"], "reasons_pct": st}})
    return rows


def build_rows(raw_text: str, source_text: str, impl: str, head_dim: int, seqlen: int,
               causal: bool) -> list[dict]:
    records = core.parse_source_rows(source_text)
    rows = versus.rows_of(raw_text, impl, head_dim, seqlen, causal)
    shape = {k: rows[0][k] for k in ("b", "s", "h", "d", "causal")} if rows else {}
    extra = []
    try:
        consumer = consumer_records(records)
        extra = (ch05p.role_rows(records) + kind_rows(consumer) + steady_rows(consumer)
                 + hot_rows(consumer))
    except (ValueError, StopIteration) as e:  # a SASS without the landmarks: counters only
        extra = [{"metric": "role_split", "value": f"not found: {e}", "unit": "note"}]
    return rows + [{"impl": impl, **shape, **r} for r in extra]


def table(res, shape=None) -> list[str]:
    """Per shape, the consumers' samples and issued instructions by kind, the two kernels side by
    side (percent of each kernel's own consumer samples / instructions)."""
    lines = []
    shapes = sorted({(r["d"], r["s"], r["causal"]) for r in res.rows})
    for d, s, causal in shapes if shape is None else [shape]:
        by = {impl: {r["metric"]: r["value"] for r in res.rows
                     if (r["d"], r["s"], r["causal"], r["impl"]) == (d, s, causal, impl)}
              for impl in IMPLS}
        head = f"D={d} S={s} {'causal' if causal else 'non-causal'}"
        lines.append(f"{head:34s}" + "".join(f"{impl + ' samples':>22s}{'instr.':>8s}"
                                              for impl in IMPLS))
        for kind in (*(k for k, _ in KINDS), OTHER):
            cells = []
            for impl in IMPLS:
                b = by[impl]
                smp = b.get(f"kind_samples_pct[{kind}]")
                ex = b.get(f"kind_executed_pct[{kind}]")
                why = b.get(f"kind_top_reason[{kind}]", "")
                cells.append(f"{'' if smp is None else f'{smp:5.1f}% ({why})':>22s}"
                             f"{'' if ex is None else f'{ex:7.1f}%':>8s}")
            if any(c.strip() for c in cells):
                lines.append(f"  {kind:32s}" + "".join(cells))
    return lines
