"""Tables of labs/hopper_head_dims_compiled.ipynb, from the package's configs and from
results/compile/hopper_fwd_head_dims.json (measure.fwd_head_dims_compiled)."""

from __future__ import annotations

from fa4_final.common.constants import FWD_HEAD_DIMS, SM90_SMEM_BYTES
from fa4_final.hopper.config import hopper_fwd_default
from measure import features
from measure.fwd_head_dims_compiled import DEFAULTS


def budget_table(pairs=None) -> str:
    """Every (D, dv) pair's default forward config (dense, not causal) and its shared memory."""
    pairs = pairs or [(d, dv) for d in FWD_HEAD_DIMS for dv in FWD_HEAD_DIMS if dv <= d]
    lines = [f"{'D':>4} {'dv':>4}  {'tile':>9}  {'K,V stages':>10}  {'O buffer':>8}  "
             f"{'KB of 227':>9}"]
    for d, dv in pairs:
        c = hopper_fwd_default(d, head_dim_v=dv)
        lines.append(f"{d:>4} {dv:>4}  {c.tile_m:>3} x {c.tile_n:<3}  "
                     f"{c.stages_k:>5},{c.stages_v:<4}  {'own' if c.separate_o else 'over Q':>8}"
                     f"  {c.smem_bytes(d, head_dim_v=dv) / 1024:>9.0f}")
    lines.append(f"(a CTA may use {SM90_SMEM_BYTES // 1024} KB)")
    return "\n".join(lines)


def what_d256_gave_up() -> str:
    """The answer to the section's prediction, from the D = dv = 256 default against D = 128's."""
    big, base = hopper_fwd_default(256, head_dim_v=256), hopper_fwd_default(128)
    given = []
    if big.tile_n < base.tile_n:
        given.append("fewer keys per stage")
    if (big.stages_k, big.stages_v) < (base.stages_k, base.stages_v):
        given.append("fewer stages")
    if not big.separate_o and base.separate_o:
        given.append("O over Q")
    return given[0] if len(given) == 1 else "all of them" if len(given) == 3 else \
        " and ".join(given)


METRICS = ("wgmma shapes", "O buffer", "setmaxnreg inc (consumers)", "spill instructions",
           "injected arrives", "MUFU.EX2 (static)")


def side_by_side(table) -> str:
    """Ours and the FA4 package's compiled forward per (D, dv, causal)."""
    cell = {(r["impl"], r["config"], r["metric"]): r["value"] for r in table.rows
            if r["group"] == "default"}
    lines = []
    for d, dv, causal in DEFAULTS:
        name = f"d{d} dv{dv} {'causal' if causal else 'non-causal'}"
        lines.append(name)
        for metric in METRICS:
            ours = cell.get(("fa4_final", name, metric), "-")
            theirs = cell.get(("fa4_package", name, metric), "-")
            lines.append(f"  {metric:28s} ours {str(ours):24s} FA4 {theirs}")
    return "\n".join(lines)


def fa4_injected_at_d256(table) -> str:
    cell = [r["value"] for r in table.rows if r["impl"] == "fa4_package"
            and r["config"] == "d256 dv256 non-causal" and r["metric"] == "injected arrives"]
    return "yes" if cell and cell[0] > 0 else "no"


def sweep_table(table) -> str:
    """injected arrives per tile_n, P converted pair by pair (the kernel) and as one vector."""
    got = {(r["group"], r["config"]): r["value"] for r in table.rows
           if r["metric"] == "injected arrives" and r["group"].startswith("tile_n")}
    configs = sorted({c for _, c in got}, key=lambda c: (int(c.split()[0][1:]),
                                                          int(c.rsplit(" ", 1)[1])))
    lines = [f"{'build':24s} {'pairwise':>9} {'one vector':>11}"]
    for c in configs:
        lines.append(f"{c:24s} {got.get(('tile_n', c), '-'):>9} "
                     f"{got.get(('tile_n, P as one vector', c), '-'):>11}")
    return "\n".join(lines)


def vector_injects_where(table) -> str:
    """Which tiles get arrives injected with P as one vector: the section's answer."""
    hit = [int(r["config"].rsplit(" ", 1)[1]) for r in table.rows
           if r["group"] == "tile_n, P as one vector" and r["metric"] == "injected arrives"
           and r["value"] > 0]
    if not hit:
        return "none"
    return "those not multiples of 64" if all(t % 64 for t in hit) else "all"


# ----------------------------------------------------------------------------------------------
# Section 4: the H200 run (results/h200/features_more.json, measure.features)

TIMED_CASES = ("d192", "d256")


def tile_ratio(feats, case: str = "d192", s: int = 16384, causal: bool = False,
               mode: str = "flush"):
    """FA4's tile over the 64-key tile at one shape, None if either was not timed."""
    return features.tile_ratio(feats, case, s, causal, mode)


def tile_lines(feats) -> str:
    """Per timed shape at D = dv = 192 and 256 and mode: FA4's tile over the 64-key tile, with
    the verdict against the rows' spreads."""
    from utils import bench

    shapes = sorted({(r["case"], r["s"], bool(r["causal"]), r["mode"]) for r in feats.rows
                     if r.get("case") in TIMED_CASES})
    lines = []
    for case, s, causal, mode in shapes:
        tile, keys64 = features.tile_pair(features.shape_rows(feats, case, s, causal, mode))
        cmp = bench.compare(tile, keys64) if tile and keys64 else None
        head = f"{case} S={s:5d} {'causal' if causal else 'dense '} {mode:12s}"
        lines.append(f"{head} FA4's tile over 64 keys: {cmp if cmp else 'not timed'}")
    return "\n".join(lines)


def correctness_lines(feats) -> str:
    """The largest |out - float64| per case and implementation over the run (every row is
    checked on a slice of its batch before it is timed)."""
    worst: dict = {}
    for r in feats.rows:
        if r.get("max_diff") is not None:
            key = (r["case"], r["impl"])
            worst[key] = max(worst.get(key, 0.0), r["max_diff"])
    return "\n".join(f"{case:12s} {impl:20s} max |out - float64| {v:.2e}"
                     for (case, impl), v in sorted(worst.items()))
