"""Helpers of labs/measuring_small_differences.ipynb: the stored runs of fa4_final's forward
read as lines (bursts with the knobs, sustained runs, predecessors, fixed clocks) and the same
two kernels timed four ways side by side. Every figure comes from a results file."""

from __future__ import annotations

from solutions.ch08_teaching import claim
from utils import bench


def knob_lines(knobs) -> list[str]:
    """Per shape of a knob file (measure.fwd_knobs): the default, the fastest peer of the same
    rounds, and each other config with the verdict of utils.bench.compare against the default."""
    lines = []
    for d, s, causal in sorted({(r["d"], r["s"], r["causal"]) for r in knobs.rows}):
        group = [r for r in knobs.rows if (r["d"], r["s"], r["causal"]) == (d, s, causal)]
        base = next(r for r in group if r["config"] == "default")
        lines.append(f"D={d} S={s} causal={causal}: default {base['tflops']:.0f} TFLOP/s; "
                     f"fastest peer {base['best_peer']} {base['best_peer_tflops']:.0f}")
        for r in group:
            if r is not base and r.get("tflops"):
                lines.append(f"    {r['config']:52s} {r['tflops']:5.0f}  default is "
                             f"{bench.compare(base, r)}")
    return lines


def energy_lines(res) -> list[str]:
    """Per shape of measure.fwd_energy's file: each implementation's speed and energy under
    sustained load, and fa4_final's ratio to the other."""
    lines = []
    for d, s, causal in sorted({(r["d"], r["s"], r["causal"]) for r in res.rows}):
        group = {r["impl"]: r for r in res.rows if (r["d"], r["s"], r["causal"]) == (d, s, causal)}
        ours = group.get("fa4_final")
        for name, r in group.items():
            power = [round(x.get("mean_power_w") or 0) for x in r["runs"]]
            clock = [x.get("sm_clock_mhz") for x in r["runs"]]
            each = [round(r["tflops"] * r["ms"] / x["ms_per_call"]) for x in r["runs"]]
            ratio = f"  fa4_final / this {ours['tflops'] / r['tflops']:.2f}x" if (
                ours and name != "fa4_final") else ""
            lines.append(f"D={d:3d} S={s} causal={causal!s:5s} {name:11s} {r['tflops']:4.0f} "
                         f"TFLOP/s (runs {each}), {r.get('tflop_per_joule', float('nan')):.2f} "
                         f"TFLOP/J, power {power} W, clock {clock} MHz{ratio}")
    return lines


def predecessor_lines(res) -> list[str]:
    """Per predecessor in measure.fwd_predecessors' file: each implementation's median burst
    over the rounds, and fa4_final's speed over the package's after that predecessor."""
    import statistics

    preds = list(dict.fromkeys(r["predecessor"] for r in res.rows))
    impls = list(dict.fromkeys(r["impl"] for r in res.rows))
    med = {(i, p): statistics.median(r["ms"] for r in res.rows
                                     if r["impl"] == i and r["predecessor"] == p)
           for i in impls for p in preds}
    lines = []
    for p in preds:
        times = ", ".join(f"{i} {med[(i, p)]:.3f} ms" for i in impls)
        ratio = med[("fa4_package", p)] / med[("fa4_final", p)]
        lines.append(f"after {p:15s} {times}; fa4_final / package {ratio:.3f}x")
    for i in impls:
        ms = [med[(i, p)] for p in preds]
        lines.append(f"{i}: slowest / fastest burst over the predecessors {max(ms) / min(ms):.3f}")
    return lines


def clocked_lines(res, base: str = "fa4_final") -> list[str]:
    """Per shape of a measure.fwd_clocked file: every variant's kernel time at ncu's clock,
    its speed over the FA4 package's, and (variants) the verdict against ``base``."""
    lines = []
    for d, s, causal in sorted({(r["d"], r["s"], r["causal"]) for r in res.rows}):
        group = {r["config"]: r for r in res.rows
                 if (r["d"], r["s"], r["causal"]) == (d, s, causal)}
        pkg, ours = group.get("fa4_package"), group.get(base)
        lines.append(f"D={d:3d} S={s:5d} causal={causal!s:5s}")
        for name, r in group.items():
            if name == "fa4_package":
                continue
            vs_pkg = f"vs package {bench.compare(r, pkg)}" if pkg else ""
            vs_base = (f"; vs {base} {bench.compare(r, ours)}" if ours and r is not ours
                       else "")
            lines.append(f"    {name:52s} {r['ms']:.4f} ms  {vs_pkg}{vs_base}")
        if pkg:
            lines.append(f"    {'fa4_package':52s} {pkg['ms']:.4f} ms")
    return lines


def instrument_rows(named: dict) -> list[dict]:
    """One row per shape: fa4_final's comparison (utils.bench.Comparison) with the fastest peer
    timed in each results file of ``named`` (label -> Results; a file of measure.fwd_clocked
    holds the package only)."""
    shapes = sorted({(r["d"], r["s"], r["causal"]) for res in named.values() for r in res.rows
                     if r["impl"] == "fa4_final"})
    out = []
    for d, s, causal in shapes:
        row = {"d": d, "s": s, "causal": causal}
        for label, res in named.items():
            ours = next((r for r in res.rows if r["impl"] == "fa4_final"
                         and r.get("config", "fa4_final") in ("fa4_final", "default")
                         and (r["d"], r["s"], r["causal"]) == (d, s, causal)), None)
            peer = bench.best_peer(res.rows, ours) if ours else None
            row[label] = bench.compare(ours, peer) if peer else None
        out.append(row)
    return out


def instrument_lines(named: dict) -> list[str]:
    """instrument_rows as a table: the ratio per way of timing, '+' faster, '-' slower, '~'
    within that file's spread."""
    mark = {"faster": "+", "slower": "-", "within noise": "~"}
    head = f"{'D':>3s} {'S':>5s} {'causal':6s} " + " ".join(f"{k:>14s}" for k in named)
    lines = [head]
    for row in instrument_rows(named):
        cells = []
        for k in named:
            c = row[k]
            cells.append(f"{'-':>14s}" if c is None else f"{c.ratio:12.3f} {mark[c.verdict]}")
        lines.append(f"{row['d']:3d} {row['s']:5d} {row['causal']!s:6s} " + " ".join(cells))
    return lines


def verdict_counts(run) -> str:
    """How the default compares with every other config of a knob file: 'faster in n, ...'."""
    verdicts = [bench.compare(next(b for b in run.rows if b["config"] == "default"
                                   and bench.same_shape(b, r)), r).verdict
                for r in run.rows if r["config"] != "default" and r.get("tflops")]
    return ", ".join(f"{v} in {verdicts.count(v)}" for v in ("faster", "within noise", "slower"))


def predecessor_medians(res) -> dict:
    """{(impl, predecessor): the median burst over the rounds (ms)}."""
    import statistics

    keys = {(r["impl"], r["predecessor"]) for r in res.rows}
    return {k: statistics.median(r["ms"] for r in res.rows
                                 if (r["impl"], r["predecessor"]) == k) for k in keys}


def predecessor_swing(res, impl: str) -> float:
    """``impl``'s slowest median burst over its fastest, across the predecessors."""
    ms = [v for (i, _), v in predecessor_medians(res).items() if i == impl]
    return max(ms) / min(ms)


def below_one(named: dict, label: str) -> int:
    """Shapes where file ``label`` of ``named`` puts fa4_final below the fastest peer."""
    return sum(1 for row in instrument_rows(named) if row[label] is not None
               and row[label].ratio < 1)


def instrument_summary(named: dict) -> list[str]:
    """Per instrument: the verdict counts and the shapes below 1.00; and how far the two
    fixed-clock runs lie apart."""
    rows = instrument_rows(named)
    out = []
    for label in named:
        verdicts = [r[label].verdict for r in rows if r[label] is not None]
        behind = [f"D={r['d']} S={r['s']}{' causal' if r['causal'] else ''}" for r in rows
                  if r[label] is not None and r[label].ratio < 1]
        out.append(f"{label:18s} faster {verdicts.count('faster')}, within noise "
                   f"{verdicts.count('within noise')}, slower {verdicts.count('slower')}; "
                   f"below 1.00 at: {', '.join(behind) or 'none'}")
    if "fixed clock" in named and "fixed clock, again" in named:
        apart = max(abs(r["fixed clock"].ratio - r["fixed clock, again"].ratio) for r in rows)
        out.append(f"the two fixed-clock runs differ by at most {apart:.3f} in any shape's ratio")
    return out


def median_power(energy) -> float:
    """The median of every sustained run's mean board power (W)."""
    import statistics

    return statistics.median(x["mean_power_w"] for r in energy.rows for x in r["runs"]
                             if x.get("mean_power_w"))


def mode_lines(bursts, sustained, impl: str = "fa4_final") -> dict:
    """``impl``'s time per call one at a time after a flush (the bursts' median) and back to
    back (the sustained run's), per shape, and the median of their ratio."""
    import statistics

    lines, ratios = [], []
    for r in sorted((r for r in sustained.rows if r["impl"] == impl),
                    key=lambda r: (r["d"], r["s"], r["causal"])):
        b = next(x for x in bursts.rows if x["impl"] == impl and bench.same_shape(x, r))
        ratios.append(b["ms"] / r["ms"])
        lines.append(f"D={r['d']:3d} S={r['s']:5d} causal={r['causal']!s:5s} one at a time "
                     f"{b['ms']:.3f} ms, back to back {r['ms']:.3f} ms: {ratios[-1]:.3f}x")
    return {"lines": lines, "median": statistics.median(ratios)}


def dynamic_against_table(run) -> tuple[int, int]:
    """(shapes where fa4_final, dynamic tiles, is faster than the 'tile table' variant, how
    many of those lie within the run's spread) in a fixed-clock file. An older run named the
    dynamic variant 'dynamic tiles' and the table 'fa4_final'."""
    names = {r["config"] for r in run.rows}
    dyn, table = (("dynamic tiles", "fa4_final") if "dynamic tiles" in names
                  else ("fa4_final", "tile table"))
    ahead = within = 0
    for r in (r for r in run.rows if r["config"] == dyn):
        t = next(x for x in run.rows if x["config"] == table and bench.same_shape(x, r))
        if r["ms"] < t["ms"]:
            ahead += 1
            within += bench.compare(r, t).verdict == "within noise"
    return ahead, within


@claim("L1.knobs_spread_wide", "fa4_final_knobs",
       "the default's rounds in the knob run spread by a tenth or more at every shape")
def _knobs_spread(res):
    spreads = [r["spread"] for r in res.rows if r["config"] == "default"]
    return min(spreads) >= 0.10, f"spreads {[round(s, 3) for s in spreads]}"


@claim("L1.predecessor_moves_more", "fa4_final_predecessors",
       "each kernel's burst moves with its predecessor by more than the two kernels differ "
       "after the same predecessor")
def _predecessor(res):
    med = predecessor_medians(res)
    preds = {p for _, p in med}
    gap = max(abs(med[("fa4_final", p)] / med[("fa4_package", p)] - 1) for p in preds)
    swing = min(predecessor_swing(res, i) - 1 for i in ("fa4_final", "fa4_package"))
    return swing > gap, f"smallest swing {swing:.3f}, largest gap between the kernels {gap:.3f}"


def _never_behind(res):
    rows = instrument_rows({"fixed": res})
    ratios = [r["fixed"].ratio for r in rows if r["fixed"] is not None]
    return bool(ratios) and min(ratios) >= 1.0, f"ratios {[round(x, 3) for x in ratios]}"


claim("L1.fixed_clock_never_behind", "fa4_final_clocked_vs_package",
      "at the fixed clock fa4_final is at or above the FA4 package at every shape (first run)"
      )(_never_behind)
claim("L1.fixed_clock_never_behind_again", "fa4_final_clocked_vs_package_2",
      "at the fixed clock fa4_final is at or above the FA4 package at every shape (second run)"
      )(_never_behind)


@claim("L1.sustained_ahead", "fa4_final_energy",
       "under sustained load fa4_final is faster than the fastest peer beyond the spread at "
       "every shape")
def _sustained(res):
    rows = instrument_rows({"run": res})
    return (all(r["run"] is not None and r["run"].verdict == "faster" for r in rows),
            "; ".join(f"D={r['d']} S={r['s']} {r['run']}" for r in rows))
