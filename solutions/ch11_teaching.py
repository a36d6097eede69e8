"""Chapter 11's helpers for reading the Hopper backward kernel: its shared-memory plan, the
instruction mix of one step from the compiled SASS, the stored benchmark (results/h200/
ch11_bwd.json, written by measure.bwd_benchmark) with its verdicts and claims, the picture of
the deterministic turn order. (A step's cycles come from chapter 00's model,
utils.roofline.tile_cycles(gpu, "bwd", ...).) The device-code exercises are in ch11_ds_step.py
and ch11_turns.py.

The kernel itself lives in fa4_final (hopper/bwd.py, common/bwd_pre.py, common/bwd_post.py,
common/bwd_tiles.py): the notebook quotes it from there, so no kernel exists twice.
"""

from __future__ import annotations

import re
from collections import Counter

from fa4_final.hopper.config import HopperBwdConfig

# ---------------------------------------------------------------------------------------------
# 1. The shared-memory plan and the work of one step


def smem_plan(cfg: HopperBwdConfig, head_dim: int, elem_bytes: int = 2) -> list[tuple]:
    """(buffer, bytes, what it holds) of the kernel's SharedStorage; the sum (with alignment)
    is ``cfg.smem_bytes(head_dim)``, which the kernel asserts against its struct."""
    m, n, d, st = cfg.tile_m, cfg.tile_n, head_dim, cfg.stages_q
    return [
        ("Q", m * d * elem_bytes * st, f"{st} stages of a {m} x {d} query tile"),
        ("dO", m * d * elem_bytes * st, f"{st} stages, with the Q tile of the same step"),
        ("lse, delta", 2 * 4 * m * st, "float32 per query row, per stage"),
        ("K", n * d * elem_bytes, "the CTA's keys, loaded once (later dK's staging)"),
        ("V", n * d * elem_bytes, "the CTA's values, loaded once (later dV's staging)"),
        ("dS", m * n * elem_bytes * cfg.stages_ds,
         f"{cfg.stages_ds} x {m} x {n}: the A (or B) operand of the dQ GEMM"),
        ("dQ", m * d * 4, f"float32 {m} x {d}: one step's dQ, on its way to the bulk add"),
    ]


# ---------------------------------------------------------------------------------------------
# 2. The instruction mix of one step, from the SASS

_INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")
KEEP_SUFFIX = ("HGMMA", "LDS", "STS", "STSM", "F2FP", "MUFU")


def sass_instructions(sass: str) -> list[str]:
    """The instructions of a SASS listing in order, predicates stripped."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            out.append(_PRED.sub("", m.group(1).strip()))
    return out


def _opcode(instr: str) -> str:
    op = instr.split()[0]
    base = op.split(".")[0]
    return op if base in KEEP_SUFFIX else base


def step_mixes(sass: str, gemms_per_step: int) -> list[Counter]:
    """Opcode counts of each copy of the step in the SASS (the masked and unmasked variants):
    from the first wgmma's WARPGROUP.ARRIVE through the last wait_group(0) to the loop's branch.
    ``gemms_per_step``: HGMMA instructions of one step (2 D/16 + 2 tile_m/16 + tile_n/16)."""
    ins = sass_instructions(sass)
    idx = [i for i, t in enumerate(ins) if t.startswith("HGMMA")]
    mixes = []
    for g in range(0, len(idx) - gemms_per_step + 1, gemms_per_step):
        a, b = idx[g], idx[g + gemms_per_step - 1]
        while a > 0 and not ins[a].startswith("WARPGROUP.ARRIVE"):
            a -= 1
        while b < len(ins) and not ins[b].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"):
            b += 1
        while b < len(ins) and not ins[b].startswith("BRA"):
            b += 1
        mixes.append(Counter(_opcode(t) for t in ins[a:b + 1]))
    return mixes


def gemms_per_step(cfg: HopperBwdConfig, head_dim: int) -> int:
    """HGMMA instructions (k = 16 each) of one step: S^T and dP^T over D, dV and dK over
    tile_m, dQ over tile_n."""
    return 2 * head_dim // 16 + 2 * cfg.tile_m // 16 + cfg.tile_n // 16


def mix_table(mixes: dict[str, Counter], top: int = 14) -> str:
    """Side-by-side opcode counts of several step mixes ({label: Counter})."""
    ops = Counter()
    for c in mixes.values():
        ops.update(c)
    names = [op for op, _ in ops.most_common(top)]
    width = max(len(n) for n in names) + 2
    head = f"{'instruction':<{width}}" + "".join(f"{k:>14}" for k in mixes)
    rows = [head]
    for op in names:
        rows.append(f"{op:<{width}}" + "".join(f"{c.get(op, 0):>14}" for c in mixes.values()))
    rows.append(f"{'total':<{width}}" + "".join(f"{sum(c.values()):>14}" for c in mixes.values()))
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# 3. Stored results


def stored_results(name: str = "ch11_bwd", gpu: str = "h200"):
    """results/<gpu>/<name>.json, or None with a printed "not measured yet"."""
    from utils.results import load_stored

    return load_stored(name, gpu)


def ratio_rows(res, impls=("fa4_final", "fa4_final_deterministic"), peers=None) -> str:
    """Each shape's backward TFLOP/s per implementation, ours over the best peer, and the
    deterministic mode's speed over the default's (what the fixed order of dQ adds costs)."""
    if res is None:
        return "not measured yet"
    rows = [r for r in res.rows if r.get("pass") == "bwd"]
    peers = peers or sorted({r["impl"] for r in rows} - set(impls))
    names = list(impls) + list(peers)
    shapes = sorted({(r["d"], r["s"], r["causal"]) for r in rows})
    lines = [f"{'D':>4} {'S':>6} {'causal':>6}" + "".join(f"{n:>25}" for n in names)
             + f"{'ours / best peer':>18}" + f"{'determ. / default':>19}"]
    for d, s, causal in shapes:
        got = {r["impl"]: r.get("tflops") for r in rows
               if (r["d"], r["s"], r["causal"]) == (d, s, causal)}
        best = max((got.get(p) or 0 for p in peers), default=0)
        ours = got.get(impls[0])
        cells = "".join(f"{got[n]:>25.0f}" if got.get(n) else f"{'-':>25}" for n in names)
        ratio = f"{ours / best:>18.2f}" if ours and best else f"{'-':>18}"
        det = got.get(impls[1]) if len(impls) > 1 else None
        cost = f"{det / ours:>19.2f}" if ours and det else f"{'-':>19}"
        lines.append(f"{d:>4} {s:>6} {causal!s:>6}{cells}{ratio}{cost}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 4. Pictures


def plot_turns(seqlen_q: int, seqlen_k: int, cfg: HopperBwdConfig, causal: bool,
               window_left=None, ax=None):
    """The (query tile, key tile) grid of the backward: each visited pair numbered with the
    key tile's turn in the deterministic dQ accumulation of that query tile
    (fa4_final.common.bwd_tiles: 0 adds first), columns in launch order."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from fa4_final.common.bwd_tiles import dq_turn, launch_order_reversed, q_tile_range
    from fa4_final.common.tiles import TileWindow

    w = TileWindow(cfg.tile_m, cfg.tile_n, causal, has_left=window_left is not None)
    n_q, n_k = -(-seqlen_q // cfg.tile_m), -(-seqlen_k // cfg.tile_n)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * n_k + 2, 0.35 * n_q + 1.5))
    for x in range(n_k):
        n = n_k - 1 - x if launch_order_reversed(w) else x
        m_min, m_max, _, _ = q_tile_range(w, n, seqlen_q, seqlen_k, window_left, 0)
        for m in range(n_q):
            inside = m_min <= m < m_max
            ax.add_patch(Rectangle((x, m), 1, 1, ec="black", lw=0.4,
                                   fc="#9ecae1" if inside else "white"))
            if inside:
                turn = dq_turn(w, n, m, n_k, seqlen_q, seqlen_k, window_left, 0)
                ax.text(x + 0.5, m + 0.5, str(turn), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, n_k)
    ax.set_ylim(n_q, 0)
    ax.set_aspect("equal")
    ax.grid(False)
    ax.set_xticks([x + 0.5 for x in range(n_k)])
    ax.set_xticklabels([str(n_k - 1 - x if launch_order_reversed(w) else x) for x in range(n_k)],
                       fontsize=7)
    ax.set_xlabel(f"key tile n (one CTA each, {cfg.tile_n} keys), in launch order")
    ax.set_ylabel(f"query tile m ({cfg.tile_m} rows)")
    ax.set_title(f"{'causal' if causal else 'no mask'}: each CTA's turn at each query tile")
    return ax


# ---------------------------------------------------------------------------------------------
# 5. Reading the stored benchmark (results/h200/ch11_bwd.json, measure.bwd_benchmark)

RESULTS_NAME = "ch11_bwd"
SHAPES = [(4096, False), (4096, True), (16384, False), (16384, True)]


def _by(res) -> dict:
    return {(r["impl"], r["s"], r["causal"]): r for r in res.rows if r.get("pass") == "bwd"}


def comparisons(res) -> dict:
    """{(S, causal): {"deterministic": its speed over the default's, "fa4_package": the
    default's over the FA4 package's}} as utils.bench.Comparison (ratio, spread, verdict)."""
    from utils import bench

    by = _by(res)
    out = {}
    for s, causal in SHAPES:
        ours = by.get(("fa4_final", s, causal))
        if ours is None:
            continue
        out[(s, causal)] = {
            "deterministic": bench.compare(by[("fa4_final_deterministic", s, causal)], ours),
            "fa4_package": bench.compare(ours, by[("fa4_package", s, causal)]),
        }
    return out


def verdict_lines(res) -> list[str]:
    """One line per shape: the deterministic mode against the default, the default against the
    FA4 package, each with its spread and whether the difference exceeds it."""
    lines = []
    for (s, causal), c in comparisons(res).items():
        lines.append(f"S = {s:>5}, causal={causal!s:<5}: deterministic / default "
                     f"{c['deterministic']}; default / FA4 package {c['fa4_package']}")
    return lines


def deterministic_ratio(res, s: int, causal: bool) -> float:
    """The deterministic backward's speed over the default's at one shape (median of rounds)."""
    return comparisons(res)[(s, causal)]["deterministic"].ratio


def claim(cid: str, text: str):
    from utils import claims

    return claims.claim(cid, RESULTS_NAME, text)


@claim("11.deterministic_costs", "the fixed order of dQ adds costs speed beyond the spread at "
        "three of the four shapes and is within the spread at S = 16384 without a mask")
def _deterministic_costs(res):
    c = comparisons(res)
    real = {k for k, v in c.items() if v["deterministic"].real and v["deterministic"].ratio < 1}
    want = {(4096, False), (4096, True), (16384, True)}
    noise = not c[(16384, False)]["deterministic"].real
    return real == want and noise, "; ".join(verdict_lines(res))


@claim("11.default_near_fa4_package", "the default backward is within the spread of the FA4 "
        "package at three shapes and behind it beyond the spread at S = 16384 without a mask")
def _default_near_package(res):
    c = comparisons(res)
    behind = {k for k, v in c.items() if v["fa4_package"].real and v["fa4_package"].ratio < 1}
    ahead = {k for k, v in c.items() if v["fa4_package"].real and v["fa4_package"].ratio > 1}
    return behind == {(16384, False)} and not ahead, "; ".join(
        f"S={s} causal={cz}: {v['fa4_package']}" for (s, cz), v in c.items())
