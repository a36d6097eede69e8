"""The evidence behind fa4_final's Hopper forward defaults: a table the package carries,
generated here from the stored runs that compared each default with its alternative.

    python -m measure.defaults_table            print the table
    python -m measure.defaults_table --write    write fa4_final/hopper/defaults.py

The package cites no course file, so the table says in words what was compared, how (bursts of
calls, or kernel time at ncu's fixed SM clock), at which shapes and with which verdict
(utils.bench.compare: a difference counts only beyond the run-to-run spread), and the margin
over the spread. SPEC below is where each row's results file is named. Each row's claimed
value is checked against hopper_fwd_default at a shape of its class, so a default that moves
without new evidence makes the table stale (tests/test_fa4_final_defaults.py).

Note [The deleted experiments]
The knobs that lost their experiment were deleted from the package; their rows here keep what
was measured, with the file that holds it:
- where O is rescaled (after the softmax, between the maxima and the exponentials, at the next
  P V's issue): results/h200/fa4_final_knobs.json, fa4_final_knobs_only.json,
  fa4_final_clocked.json, fa4_final_clocked_d64_causal.json;
- O written over Q's buffer: fa4_final_knobs.json, fa4_final_ablation.json;
- the right-edge mask as bit words: fa4_final_knobs_only.json;
- the row reductions in 1, 2 or 4 chains: fa4_final_clocked_row_sum.json,
  fa4_final_clocked_row_max.json (labs/the_last_three_percent.ipynb, section 5).
"""

from __future__ import annotations

import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "fa4_final" / "hopper" / "defaults.py"
COMMAND = "python -m measure.defaults_table --write"

PRODUCES = [
    ("fa4_final/hopper/defaults.py", COMMAND,
     "not a results file: the package's table of the evidence behind the Hopper forward's "
     "defaults, generated from the stored knob, schedule and clocked runs"),
]

BURSTS = "bursts of calls"
CLOCKED = "kernel time at ncu's fixed SM clock"


@dataclass(frozen=True)
class Row:
    knob: str  # a HopperFwdConfig field, or what a deleted knob chose (in words)
    value: object  # the default (checked against hopper_fwd_default when knob is a field)
    shapes: str  # the shape class, in words
    files: tuple[str, ...]  # results/h200/<name>.json holding the comparison
    ours: str  # the config of the row that ran the default
    other: str  # the config it is compared with
    alternative: str  # the alternative, in words
    d: int | None = None  # shape filter: head dim
    causal: bool | None = None  # shape filter: causal
    representative: tuple | None = None  # (head_dim, causal, varlen) to check the value at
    metric: str | None = None  # a profile file's metric compared instead of the speed


# the run's default is "default" in the knob runs and "fa4_final" in the clocked ones
SPEC = [
    Row("num_consumer_wgs", 3, "D = 64", ("fa4_final_d64_causal",), "default",
        "128 x 128 tiles, two consumer warpgroups", "two consumer warpgroups, 128 x 128 tiles",
        representative=(64, True, False)),
    Row("num_consumer_wgs", 2, "D = 128", (), "", "", "no stored comparison",
        representative=(128, False, False)),
    Row("stages_k, stages_v", (2, 2), "D = 64, causal",
        ("fa4_final_clocked_d64_causal", "fa4_final_clocked_d64_causal_stages"),
        "K/V stages 2/2", "fa4_final", "three K and three V stages", d=64, causal=True,
        representative=(64, True, False)),
    Row("stages_k, stages_v", (3, 2), "D = 128", (), "", "", "no stored comparison",
        representative=(128, False, False)),
    Row("schedule", "split_tail", "dense, not causal", ("fa4_final_split",), "default",
        "last round of whole tiles", "the table with its last round of whole tiles",
        representative=(128, False, False)),
    Row("schedule", "dynamic", "dense, causal",
        ("fa4_final_clocked_dynamic", "fa4_final_clocked_dynamic_first"), "fa4_final",
        "tile table", "the host's table (list schedule) in L2 sections",
        representative=(128, True, False)),
    Row("l2_sections", True, "causal", ("fa4_final_versus",), "fa4_final", "fa4_final_zigzag",
        "longest first over every head at once", causal=True, metric="l2_hit_rate_pct",
        representative=(128, True, False)),
    Row("persistent (schedule != 'grid')", True, "every shape", ("fa4_final_sched",), "default",
        "one tile per CTA", "one CTA per tile"),
    Row("intra_wg_overlap", True, "every shape", ("fa4_final_ablation",), "default",
        "no intra-warpgroup overlap", "S, softmax and P V one after another",
        representative=(128, False, False)),
    Row("pingpong", True, "every shape", ("fa4_final_ablation",), "default", "no ping-pong",
        "warpgroups issuing without turns", representative=(128, False, False)),
    Row("exp2_emulation_fraction", 0.0, "D = 64", ("fa4_final_d64_softmax",), "default",
        "exp2 emulation 1/8", "one exponential in eight on the FMA units",
        representative=(64, False, False)),
    Row("rescale_threshold", 0.0, "D = 128", ("fa4_final_clocked_skip",), "fa4_final",
        "tau = 8", "tau = 8 (a warp keeps stale maxima)", d=128,
        representative=(128, False, False)),
    Row("rescale_skip_unchanged", True, "D = 64, dense", ("fa4_final_clocked_skip",),
        "tau = 0, O multiply skipped when no max moved", "fa4_final",
        "tau = 8 with the vote before the exponentials", d=64,
        representative=(64, False, False)),
    Row("pin_lane", True, "D = 64, causal, dense", ("fa4_final_clocked_lane",), "fa4_final",
        "lane read every step", "the lane read every KV step", d=64, causal=True,
        representative=(64, True, False)),
    Row("pin_lane", False, "D = 128", ("fa4_final_clocked_lane",), "lane read every step",
        "fa4_final", "the lane read once", d=128, representative=(128, True, False)),
    # choices of deleted knobs (Note [The deleted experiments])
    Row("O rescale (fixed)", "at the next P V's issue", "every shape",
        ("fa4_final_clocked", "fa4_final_knobs_only"), "fa4_final",
        "O rescaled after the softmax", "after the softmax"),
    Row("O rescale (fixed)", "at the next P V's issue", "causal",
        ("fa4_final_knobs_only",), "default", "O rescaled between max and exp",
        "between the row maxima and the exponentials"),
    Row("O buffer (fixed)", "its own", "every shape", ("fa4_final_ablation",), "default",
        "O over Q (no separate O buffer)", "O written over Q's buffer"),
    Row("right-edge mask (fixed)", "compare and select", "causal", ("fa4_final_knobs_only",),
        "default", "mask as bit words", "one bit word per row"),
    Row("row sum (fixed)", "a pairwise tree", "every shape", ("fa4_final_clocked_row_sum",),
        "fa4_final", "row sum in one chain", "one running chain"),
    Row("row max (fixed)", "a pairwise tree", "D = 64, causal", ("fa4_final_clocked_row_max",),
        "fa4_final", "row max in four chains", "four running chains"),
]


def _pairs(row: Row):
    """(ours, other, method) per shape of every file of ``row``."""
    from utils import results

    for name in row.files:
        res = results.load(name)
        method = CLOCKED if "clocked" in name else BURSTS
        for r in res.rows:
            if r.get("config", r.get("impl")) != row.other:
                continue
            if (row.d is not None and r["d"] != row.d) or (
                    row.causal is not None and r["causal"] != row.causal):
                continue
            ours = next((o for o in res.rows if o.get("config", o.get("impl")) == row.ours
                         and (o["d"], o["s"], o["causal"]) == (r["d"], r["s"], r["causal"])),
                        None)
            if ours is not None:
                yield ours, r, method


def _metric_evidence(row: Row) -> str:
    """A profile's metric of the default against the alternative, per shape."""
    from utils import results

    parts = []
    for name in row.files:
        res = results.load(name)
        got = {(r["impl"], r["d"], r["s"], r["causal"]): r["value"] for r in res.rows
               if r["metric"] == row.metric}
        for (impl, d, s, causal), value in sorted(got.items()):
            other = got.get((row.other, d, s, causal))
            if impl != row.ours or other is None or (row.causal is not None
                                                     and causal != row.causal):
                continue
            parts.append(f"{value:.0f} against {other:.0f} at D {d}, S {s}"
                         f"{', causal' if causal else ''}")
    what = row.metric.replace("_pct", " (%)").replace("_", " ")
    return f"against {row.alternative}: {what} under ncu " + "; ".join(parts)


def evidence(row: Row) -> tuple[str, float | None]:
    """(the comparison in words, the median margin over the spread) of one row."""
    from utils import bench

    if row.metric:
        return _metric_evidence(row), None
    found = [(bench.compare(o, r), o, r, m) for o, r, m in _pairs(row)]
    found = [f for f in found if f[0] is not None]
    if not found:
        return row.alternative, None
    verdicts = [c.verdict for c, *_ in found]
    ratios = [c.ratio for c, *_ in found]
    methods = sorted({m for *_, m in found})
    ds = sorted({o["d"] for _, o, _, _ in found})
    ss = sorted({o["s"] for _, o, _, _ in found})
    causal = sorted({o["causal"] for _, o, _, _ in found})
    where = (f"D {'/'.join(map(str, ds))}, S {'/'.join(map(str, ss))}, "
             f"{'/'.join('causal' if c else 'not causal' for c in causal)}")
    counts = ", ".join(f"{v} at {verdicts.count(v)}" for v in ("faster", "within noise",
                                                                  "slower")
                       if verdicts.count(v))
    words = (f"against {row.alternative}: the default {counts} of {len(found)} shapes "
             f"({where}; {' and '.join(methods)}), its speed {min(ratios):.3f}x to "
             f"{max(ratios):.3f}x the alternative's")
    margin = statistics.median(c.ratio - 1 - c.noise for c, *_ in found)
    return words, round(margin, 3)


def check_values() -> list[str]:
    """Rows whose claimed value is not hopper_fwd_default's at their representative shape."""
    from fa4_final.hopper.config import hopper_fwd_default

    wrong = []
    for row in SPEC:
        if row.representative is None:
            continue
        cfg = hopper_fwd_default(*row.representative)
        names = [n.strip() for n in row.knob.split(",")]
        got = tuple(getattr(cfg, n) for n in names)
        want = row.value if isinstance(row.value, tuple) else (row.value,)
        if got != want:
            wrong.append(f"{row.knob} at {row.representative}: default {got}, table {want}")
    return wrong


def render() -> str:
    wrong = check_values()
    if wrong:
        raise ValueError("the table's values are not the defaults: " + "; ".join(wrong))
    lines = [
        '"""Why each Hopper forward default is what it is: the stored measurements that compared',
        "it with its alternative, on an H200, in words. GENERATED by the course from its results",
        "files; do not edit. A row: (knob, value, shape class, evidence, margin over the",
        "spread), the margin being the median over the shapes of the default's speed over the",
        "alternative's, minus 1, minus the run-to-run spread (> 0: ahead beyond the noise; None:",
        "no stored speed comparison). Knobs in words are choices whose knob was deleted after",
        "its experiment lost.",
        '"""',
        "",
        "DEFAULTS_EVIDENCE = [",
    ]
    for row in SPEC:
        words, margin = evidence(row)
        lines.append(f"    ({row.knob!r}, {row.value!r}, {row.shapes!r},")
        chunks = textwrap.wrap(words, 84, drop_whitespace=False)
        lines.append("     (" + "\n      ".join(repr(c) for c in chunks) + "),")
        lines.append(f"     {margin!r}),")
    lines.append("]")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--write" in argv:
        TABLE.write_text(text)
        print(f"wrote {TABLE.relative_to(ROOT)}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
