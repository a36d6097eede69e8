"""Helpers of labs/the_last_three_percent.ipynb: which column of a fixed-clock run is today's
default per shape, and what ptxas made of a knob's KV step (compiled on a CPU)."""

from __future__ import annotations

from solutions.ch08_teaching import claim
from utils import bench


def default_in_run(res, column, how) -> list[str]:
    """Per shape of a measure.fwd_clocked file, the column ``column(cfg)`` names for today's
    default there (``cfg = hopper_fwd_default(d, causal)``) against the FA4 package;
    ``how(cfg)`` says in a few words what that column is. The run chose the default, which
    flatters it."""
    from fa4_final.hopper.config import hopper_fwd_default

    lines = []
    for d, s, causal in sorted({(r["d"], r["s"], r["causal"]) for r in res.rows}):
        group = {r["config"]: r for r in res.rows
                 if (r["d"], r["s"], r["causal"]) == (d, s, causal)}
        cfg = hopper_fwd_default(d, causal)
        ours = group[column(cfg)]
        c = bench.compare(ours, group["fa4_package"])
        lines.append(f"D={d:3d} S={s:5d} {'causal    ' if causal else 'non-causal'} "
                     f"({how(cfg):20s}) {ours['ms']:.4f} ms: {c.ratio:.3f}x the package "
                     f"({c.verdict}; spread {c.noise:.1%})")
    return lines


def default_in_lane_run(res) -> list[str]:
    """The lane run (variants fa4_final = lane read once and "lane read every step"): per
    shape, the column with today's default way of reading the lane, against the package."""
    return default_in_run(
        res, lambda cfg: "fa4_final" if cfg.pin_lane else "lane read every step",
        lambda cfg: "lane read once" if cfg.pin_lane else "lane read every step")


def default_in_skip_run(res) -> list[str]:
    """The skip run (fa4_final of its commit: tau = 8 at D = 64, tau = 0 at D = 128; "tau = 0,
    O multiply skipped when no max moved"): per shape, the column that is today's default
    softmax step, against the package."""
    def column_of(cfg):
        if cfg.rescale_skip_unchanged:
            return "tau = 0, O multiply skipped when no max moved"
        return "fa4_final"  # tau = 0 without the skip: the run's D = 128 default

    return default_in_run(res, column_of,
                          lambda cfg: "skip, tau = 0" if cfg.rescale_skip_unchanged
                          else "always multiply")


def compiled_step_facts(head_dim: int, causal: bool, variants: dict) -> list[str]:
    """Compile the default forward with each of ``variants`` (label -> config changes) for
    sm_90a on this machine and say, per build, how its steady KV step is scheduled: its
    instructions, how many of its exponentials ptxas placed before the wait for P V (they run
    under that GEMM), and how many reads of the thread index (S2R) its KV loops hold."""
    from dataclasses import replace

    from fa4_final.api.interface import compile_only
    from fa4_final.hopper.config import hopper_fwd_default
    from solutions import ch08_compare

    lines = []
    for label, change in variants.items():
        cfg = replace(hopper_fwd_default(head_dim, causal), **change)
        art = compile_only("sm_90a", head_dim, "bf16", causal, cfg)
        m = ch08_compare.kernel_metrics(art.ptx, art.sass, art.registers, art.spills,
                                        cfg.tile_m, cfg.tile_n)
        step, sched = m["steady step"], m["steady step schedule"]
        s2r = ch08_compare.thread_index_reads(art.sass)
        lines.append(f"{label:32s} steady step {step['instructions']} instructions, "
                     f"{sched['exps under P V']} of {step['MUFU.EX2']} exponentials before the "
                     f"P V wait; S2R of the thread index in the KV loops: {s2r}; "
                     f"{art.registers} registers, {art.spills} spills")
    return lines


def metric_at(res, impl: str, shape: tuple, metric: str):
    """One metric of one kernel at one (d, s, causal) in a profile file."""
    d, s, causal = shape
    return next(r["value"] for r in res.rows if r["impl"] == impl and r["metric"] == metric
                and (r["d"], r["s"], r["causal"]) == (d, s, causal))


def top_kind(stalls, shape: tuple, impl: str = "fa4_final") -> str:
    """The kind of consumer instruction holding the largest share of ``impl``'s samples."""
    d, s, causal = shape
    shares = {r["metric"][len("kind_samples_pct["):-1]: r["value"] for r in stalls.rows
              if r["impl"] == impl and (r["d"], r["s"], r["causal"]) == (d, s, causal)
              and r["metric"].startswith("kind_samples_pct[")}
    return max(shares, key=shares.get)


def variant_verdicts(run, name: str, d: int | None = None, against_base: bool = True,
                     base: str = "fa4_final") -> dict:
    """Counts of the verdicts of variant ``name`` against ``base`` in a fixed-clock file
    (``against_base``: the variant's speed over the base's; else the base's over the
    variant's), at head dim ``d`` or every shape."""
    counts = {"faster": 0, "within noise": 0, "slower": 0}
    for r in run.rows:
        if r["config"] != name or (d is not None and r["d"] != d):
            continue
        b = next(x for x in run.rows if x["config"] == base and bench.same_shape(x, r))
        counts[(bench.compare(r, b) if against_base else bench.compare(b, r)).verdict] += 1
    return counts


def against_base(runs, variant: str, d: int) -> list[tuple]:
    """(shape, Comparison of ``variant`` against its run's fa4_final) over fixed-clock files."""
    out = []
    for res in runs:
        for r in res.rows:
            base = next((b for b in res.rows if b["config"] == "fa4_final"
                         and bench.same_shape(b, r)), None)
            if r["config"] == variant and r["d"] == d and base:
                out.append((f"S={r['s']}{' causal' if r['causal'] else ''}",
                            bench.compare(r, base)))
    return out


def placement_line(label: str, sass: str) -> str:
    """Where the steady step's FMULs sit around its two GEMM issues (ch08_compare)."""
    from solutions import ch08_compare

    p = ch08_compare.o_multiply_placement(sass)
    return (f"{label:34s} before the turn {p['before the turn']:2d}, with S's issue "
            f"{p['with S' + chr(39) + 's issue']:2d}, between S's and P V's issue "
            f"{p['between S' + chr(39) + 's and P V' + chr(39) + 's issue']:2d}, elsewhere "
            f"{p['elsewhere']}")


@claim("L2.row_sum_chain_not_faster", "fa4_final_clocked_row_sum",
       "at no shape is the row sum in one chain faster than the tree beyond the spread")
def _row_sum(res):
    counts = variant_verdicts(res, "row sum in one chain")
    return counts["faster"] == 0, str(counts)


@claim("L2.skip_not_behind_at_d64", "fa4_final_clocked_skip",
       "at D = 64 the skip at tau = 0 is never behind the run's default (tau = 8) beyond the "
       "spread")
def _skip(res):
    counts = variant_verdicts(res, "tau = 0, O multiply skipped when no max moved", d=64)
    return counts["slower"] == 0, str(counts)
