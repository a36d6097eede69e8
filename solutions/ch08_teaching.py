"""Chapter 08's teaching helpers: the exercises' solutions and checkers, the turn-barrier
simulation, the Gantt chart of the stored timeline, and what the compiled loop looks like.

The kernel itself is fa4_final.hopper.fwd (no kernel lives here); the notebook quotes it.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from fa4_final.scheduler import rounds, tile_coords
from utils import bench

# ----------------------------------------------------------------------------------------------
# Exercise 08.1: the ping-pong turn rule (Note [Turns] in fa4_final.hopper.fwd)


def turn_waits(wg: int, first_of_cta: bool) -> bool:
    """Does warpgroup ``wg`` wait on its barrier before this turn? Everyone but warpgroup 0's
    very first turn of the CTA: nobody before that one will ever arrive."""
    return wg > 0 or not first_of_cta


def turn_passes(wg: int, last_of_cta: bool, num_wgs: int) -> bool:
    """Does warpgroup ``wg`` arrive on the next warpgroup's barrier after this turn? Everyone
    but the last warpgroup's very last turn: nobody after that one will ever wait."""
    return wg < num_wgs - 1 or not last_of_cta


def simulate_turns(waits, passes, num_wgs: int, turns_per_tile: list[int]) -> dict:
    """Run the turn protocol of ``num_wgs`` consumer warpgroups over a CTA's tiles.

    Each named barrier b_w (one per warpgroup) completes a phase when 128 threads sync on it and
    128 arrive on it; we count in halves. A tile with 0 turns takes one empty turn (the kernel
    does that so the count never depends on the data). The warpgroups run as fast as the
    barriers let them, in any order: the simulation repeatedly lets any warpgroup that can make
    progress do so. Returns {"deadlock": bool, "order": [(turn, wg), ...],
    "pending_arrives": {w: n}, "stuck": {w: turn}}."""
    turns = [max(t, 1) for t in turns_per_tile]
    total = sum(turns)
    flags = []  # (first_of_cta, last_of_cta) of each global turn
    for g in range(total):
        flags.append((g == 0, g == total - 1))
    arrived = [0] * num_wgs  # arrive-halves not yet matched by a sync
    pos = [0] * num_wgs  # next global turn of each warpgroup
    order = []
    progress = True
    while progress:
        progress = False
        for w in range(num_wgs):  # each warpgroup runs ahead as far as its barrier lets it
            while pos[w] < total:
                first, last = flags[pos[w]]
                if waits(w, first):
                    if arrived[w] == 0:
                        break  # blocked at bar.sync
                    arrived[w] -= 1
                order.append((pos[w], w))
                if passes(w, last, num_wgs):
                    arrived[(w + 1) % num_wgs] += 1
                pos[w] += 1
                progress = True
    stuck = {w: pos[w] for w in range(num_wgs) if pos[w] < total}
    return {"deadlock": bool(stuck), "order": order, "stuck": stuck,
            "pending_arrives": {w: n for w, n in enumerate(arrived) if n}}


def check_turn_rule(pair) -> None:
    """Exercise 08.1: ``pair`` = (waits, passes). Many CTAs, 2 and 3 warpgroups, tiles with no
    key among them: no deadlock, turns strictly alternate, no arrive left pending at exit."""
    waits, passes = pair
    rng = random.Random(8)
    plans = [[3], [1], [0], [0, 0], [2, 0, 5], [0, 4], [4, 0]]
    plans += [[rng.choice([0, 1, 2, 7]) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    for num_wgs in (2, 3):
        for plan in plans:
            res = simulate_turns(waits, passes, num_wgs, plan)
            if res["deadlock"]:
                w, g = next(iter(res["stuck"].items()))
                hint = (" Warpgroup 0's first turn has nobody before it: if it waits, nobody "
                        "ever arrives." if g == 0 and w == 0 else
                        " A warpgroup that does not arrive after a turn leaves the next one "
                        "waiting forever: only the very last turn of the CTA may skip it.")
                raise AssertionError(
                    f"{num_wgs} warpgroups, turns per tile {plan}: warpgroup {w} waits forever "
                    f"at its turn {g}.{hint}")
            expected = [(g, w) for g in range(sum(max(t, 1) for t in plan))
                        for w in range(num_wgs)]
            if res["order"] != expected:
                raise AssertionError(
                    f"{num_wgs} warpgroups, turns {plan}: the turns ran out of order "
                    f"({res['order'][:6]}...): a warpgroup that skips its wait can run ahead "
                    f"of the one before it; only warpgroup 0's first turn may skip it")
            if res["pending_arrives"]:
                raise AssertionError(
                    f"{num_wgs} warpgroups, turns {plan}: arrives left pending at the end on "
                    f"the barriers of warpgroups {sorted(res['pending_arrives'])}: the last "
                    f"warpgroup's last turn must not hand the turn on (nobody will take it)")


# ----------------------------------------------------------------------------------------------
# Exercise 08.2: the persistent tile order


def zigzag(r: int, cta: int, grid: int) -> int:
    """Reference: CTA ``cta``'s tile in round ``r`` (fa4_final.scheduler.zigzag_tile)."""
    return r * grid + (cta if r % 2 == 0 else grid - 1 - cta)


def causal_cost(t: int, num_m_blocks: int, heads: int) -> int:
    """KV steps of causal tile t in longest-first order (tile_coords): m_block + 1."""
    return tile_coords(t, num_m_blocks, heads, 1, True)[0] + 1


def schedule_balance(tile_of, num_m_blocks=128, heads=16, grid=132) -> dict:
    """The busiest CTA's KV steps against the ideal (total / grid) when CTA c computes tiles
    ``tile_of(r, c, grid)`` for r = 0, 1, ... (those below num_tiles)."""
    n = num_m_blocks * heads
    per_cta = []
    seen = []
    for c in range(grid):
        tiles = [tile_of(r, c, grid) for r in range(rounds(n, grid))]
        tiles = [t for t in tiles if t < n]
        seen += tiles
        per_cta.append(sum(causal_cost(t, num_m_blocks, heads) for t in tiles))
    ideal = sum(causal_cost(t, num_m_blocks, heads) for t in range(n)) / grid
    return {"seen": sorted(seen) == list(range(n)), "worst": max(per_cta), "ideal": ideal,
            "imbalance": max(per_cta) / ideal - 1.0}


def check_tile_order(tile_of) -> None:
    """Exercise 08.2: every tile exactly once, and the busiest CTA within 1% of the ideal."""
    for grid, m, h in ((132, 128, 16), (132, 32, 64), (7, 9, 5)):
        b = schedule_balance(tile_of, m, h, grid)
        small = grid * 8 > m * h  # few rounds: whole tiles cannot even out; coverage only
        if not b["seen"]:
            raise AssertionError(
                f"grid {grid}, {m * h} tiles: some tile is computed twice or never; in every "
                f"round the {grid} CTAs must take the {grid} tiles r*grid .. r*grid + grid - 1")
        if not small and b["imbalance"] > 0.01:
            rr = schedule_balance(lambda r, c, g: r * g + c, m, h, grid)["imbalance"]
            raise AssertionError(
                f"grid {grid}: the busiest CTA has {b['worst']} KV steps, "
                f"{b['imbalance']:.1%} over the ideal {b['ideal']:.0f} (plain round robin: "
                f"{rr:.1%}). Longest-first tiles get shorter within every round: reverse the "
                f"order of every other round so the CTA that took the longest tile of one round "
                f"takes the shortest of the next")


# ----------------------------------------------------------------------------------------------
# Exercise 08.3: the shared-memory budget


def check_smem_bytes(fn) -> None:
    """Exercise 08.3: ``fn(cfg, head_dim) -> bytes`` equals the kernel's SharedStorage size
    (HopperFwdConfig.smem_bytes, asserted against the struct when the kernel is traced)."""
    from dataclasses import replace

    from fa4_final.config import HopperFwdConfig

    cases = [(HopperFwdConfig(), 128), (HopperFwdConfig(stages_k=3), 128),
             (HopperFwdConfig(num_consumer_wgs=3, stages_k=3, stages_v=3), 64),
             (replace(HopperFwdConfig(), separate_o=False, stages_k=3, stages_v=3), 128),
             (HopperFwdConfig(tile_n=176, stages_k=1, stages_v=1), 128)]
    for cfg, d in cases:
        want, got = cfg.smem_bytes(d), fn(cfg, d)
        if got != want:
            diff = got - want
            hint = ""
            if diff % 1024 == 0 and abs(diff) <= 1024:
                hint = " (1 KB: the barriers sit in their own 1 KB-aligned block)"
            elif cfg.separate_o and diff == -cfg.tile_m * d * 2:
                hint = " (the separate O buffer: tile_m x D, like Q)"
            raise AssertionError(
                f"{cfg} at D={d}: got {got} B, the kernel's struct has {want} B{hint}; each "
                f"buffer is rounded up to 1024 B for the 128 B swizzle")


# ----------------------------------------------------------------------------------------------
# Reading the stored timeline (results/h200/ch08_timeline.json; fa4_final.timeline)

PHASE_COLOURS = {"waits for K and its turn": "#d9d9d9", "issues its GEMMs": "#4c72b0",
                 "waits for S": "#b0c4de", "softmax": "#dd8452"}


def timeline_bars(rows: list[dict], impl: str, steps: range) -> dict:
    """{role: [(phase, start, length), ...]} in cycles for the consumer warpgroups of
    ``impl``'s stored timeline, KV steps ``steps``."""
    from fa4_final.timeline import PHASES

    out: dict[int, list] = {}
    for r in rows:
        if r["impl"] != impl or r["role"] == 0 or r["step"] not in steps:
            continue
        marks = r["value"]
        for phase, (a, b) in PHASES.items():
            t0, t1 = marks.get(a.name), marks.get(b.name)
            if t0 is not None and t1 is not None:
                out.setdefault(r["role"], []).append((phase, t0, t1 - t0))
    return out


def step_period(rows: list[dict], impl: str, role: int = 1, skip: int = 2) -> float:
    """Median cycles between the starts of consecutive KV steps of one warpgroup (after the
    first ``skip`` steps, which fill the pipeline)."""
    import statistics

    starts = sorted((r["step"], r["value"]["WAIT"]) for r in rows
                    if r["impl"] == impl and r["role"] == role and r["value"].get("WAIT"))
    gaps = [b[1] - a[1] for a, b in zip(starts[skip:], starts[skip + 1:])]
    return statistics.median(gaps)


def phase_medians(rows: list[dict], impl: str, skip: int = 2) -> dict:
    """Median cycles of each phase over the steady steps, per consumer warpgroup."""
    import statistics

    bars = timeline_bars(rows, impl, range(skip, 10**6))
    return {role: {phase: statistics.median([n for p, _, n in b if p == phase])
                   for phase in PHASE_COLOURS if any(p == phase for p, _, _ in b)}
            for role, b in sorted(bars.items())}


def plot_timeline(ax, rows, impl: str, steps: range, title: str = "") -> None:
    bars = timeline_bars(rows, impl, steps)
    t0 = min(s for b in bars.values() for _, s, _ in b)
    for role, segs in sorted(bars.items()):
        for phase, start, length in segs:
            ax.broken_barh([(start - t0, length)], (role - 0.4, 0.8),
                           facecolors=PHASE_COLOURS[phase])
    ax.set_yticks(sorted(bars), [f"consumer warpgroup {r - 1}" for r in sorted(bars)])
    ax.set_xlabel("SM cycles (clock64), CTA 0")
    ax.set_title(title)


# ----------------------------------------------------------------------------------------------
# What ptxas made of the loop (compile-only; no GPU)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def steady_loop(sass: str) -> list[str]:
    """The opcodes of the kernel's innermost loop that issues HGMMA (the steady KV step): the
    first backward branch whose body holds HGMMA and no inner loop of its own."""
    lines = sass.splitlines()
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"\s*\.(L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = i
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            if any("HGMMA" in b for b in body) and (best is None or len(body) < len(best)):
                best = body
    return [(m.group(1), b) for b in best or [] if (m := _OP.search(b))]


def loop_census(sass: str) -> Counter:
    """Instruction classes (opcode before the first dot) of one steady KV step."""
    return Counter(op.split(".")[0] for op, _ in steady_loop(sass))


def loop_outline(sass: str) -> str:
    """The steady step as a run-length outline of the instructions that tell the schedule:
    barrier (turn) sync/arrive, HGMMA, the two wgmma waits, MUFU.EX2, the O rescale FMULs."""
    keep = {"BAR.SYNC": "turn", "BAR.ARV": "pass turn", "HGMMA": "HGMMA", "MUFU.EX2": "EX2",
            "FMUL": "FMUL"}
    seq = []
    for op, text in steady_loop(sass):
        name = next((v for k, v in keep.items() if op.startswith(k)), None)
        if op.startswith("WARPGROUP.DEPBAR"):  # wgmma.wait_group(n): n groups may stay in flight
            name = "wait(S)" if "0x1" in text else "wait(all)"
        if name is None:
            continue
        if seq and seq[-1][0] == name:
            seq[-1][1] += 1
        else:
            seq.append([name, 1])
    return " ".join(f"{n}x{c}" if c > 1 else n for n, c in seq)


# ----------------------------------------------------------------------------------------------
# The Nsight Compute profile next to chapter 05's (solutions.ch08_profile, solutions.ch05_profile)

# (metric, what it is), printed side by side; a row neither file has is skipped. The busy share
# of the tensor pipe is read from whichever counter both files have (profile_busy).
PROFILE_SIDE_BY_SIDE = (
    ("issue_slots_busy_pct", "issue slots used (%)"),
    ("achieved_warps_per_scheduler", "warps per scheduler (achieved)"),
    ("registers_per_thread", "registers per thread at launch"),
    ("warp_time_setup_pct", "warp time: setup, before the roles split (%)"),
    ("warp_time_producer_pct", "warp time: producer (%)"),
    ("warp_time_consumer_pct", "warp time: consumers (%)"),
    ("producer_time_mbarrier_wait_pct", "producer: at its empty-slot waits (%)"),
    ("consumer_time_mbarrier_wait_pct", "consumers: at mbarrier waits (a tile to land) (%)"),
    ("consumer_time_wgmma_wait_pct", "consumers: at wgmma waits (wait_group) (%)"),
    ("consumer_time_named_barrier_wait_pct", "consumers: at named barriers (%)"),
    ("consumer_time_exp2_pct", "consumers: exponentials (MUFU.EX2) (%)"),
    ("consumer_turn_turn_head_pct", "steady turn: K/V waits, its turn, loop head (%)"),
    ("consumer_turn_named_barrier_pct", "  of which at the ping-pong barriers (%)"),
    ("consumer_turn_issue_gemms_pct", "steady turn: issue S and P V (%)"),
    ("consumer_turn_wait_s_pct", "steady turn: wait for S (wait_group 1) (%)"),
    ("consumer_turn_softmax_under_pv_pct", "steady turn: between the waits, P V in flight (%)"),
    ("consumer_turn_wait_pv_pct", "steady turn: wait for P V (wait_group 0) (%)"),
    ("consumer_turn_after_pv_pct", "steady turn: after P V (%)"),
    ("consumer_time_outside_steady_turn_pct", "consumers: outside the steady turns (%)"),
    ("wgmma_per_consumer_warp_per_step", "wgmma per consumer warp per KV step"),
    ("other_instructions_per_consumer_warp_per_step", "other instructions per warp per KV step"),
)
_BUSY = (("tensor_pipe_gmma_active_pct", "tensor pipe busy, GMMA counter (%)"),
         ("tensor_pipe_active_pct", "tensor pipe busy, HMMA counter (%)"))


def knob_lines(knobs) -> list[str]:
    """Per shape of a knob file (solutions.ch08_knobs): the default, the fastest peer of the same
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


def _by(res) -> dict:
    return {r["metric"]: r["value"] for r in res.rows}


def profile_busy(profiles: dict) -> tuple[str, str] | None:
    """(metric, what it is) of the tensor-pipe counter every stored profile has, GMMA first."""
    have = [set(_by(res)) for res in profiles.values() if res is not None]
    return next((m for m in _BUSY if all(m[0] in h for h in have)), None) if have else None


def profile_table(profiles: dict, stalls: int = 6) -> list[str]:
    """Stored profiles side by side: {column name: Results or None}. A None column says it is
    not measured yet and the table shows the others. Then the consumers' largest stall reasons
    (share of their samples), largest in any column first."""
    here = {name: res for name, res in profiles.items() if res is not None}
    lines = [f"{name}: not measured yet, so it is left out of the table"
             for name, res in profiles.items() if res is None]
    if not here:
        return lines
    for name, res in here.items():
        first = res.rows[0]
        lines.append(f"{name}: {first['impl']} {first['config']} at D={first['d']}, "
                     f"S={first['s']}; {res.label}")
    by = {name: _by(res) for name, res in here.items()}
    busy = profile_busy(here)
    head = f"{'':52s}" + "".join(f"{name:>14s}" for name in here)
    lines.append(head)
    for metric, what in ((busy,) if busy else ()) + PROFILE_SIDE_BY_SIDE:
        if not any(metric in b for b in by.values()):
            continue
        cells = "".join(f"{b[metric]:14.1f}" if metric in b else f"{'-':>14s}"
                        for b in by.values())
        lines.append(f"{what:52s}{cells}")
    share = {m: max(b.get(m, 0.0) for b in by.values())
             for b in by.values() for m in b if m.startswith("consumer_stall_")}
    reasons = sorted(share, key=lambda m: -share[m])[:stalls]
    if reasons:
        lines.append("consumers' samples by stall reason (%), largest first:")
        for m in reasons:
            name = m[len("consumer_stall_"):-len("_samples_pct")]
            cells = "".join(f"{b[m]:14.1f}" if m in b else f"{'-':>14s}" for b in by.values())
            lines.append(f"  {name:50s}{cells}")
    return lines


def _more(a: float, b: float, rel: float = 0.05) -> str:
    """'more', 'less' or 'about as much': a against b, 5 % either way counted as equal."""
    if abs(a - b) <= rel * max(abs(a), abs(b), 1e-9):
        return "about as much"
    return "more" if a > b else "less"


def profile_comparison(new, old, new_name: str = "fa4_final",
                       old_name: str = "chapter 05") -> list[str]:
    """Sentences comparing two stored profiles, every number and verdict computed from them."""
    a, b = _by(new), _by(old)
    out = []
    busy = profile_busy({new_name: new, old_name: old})
    if busy and "issue_slots_busy_pct" in a and "issue_slots_busy_pct" in b:
        m = busy[0]
        out.append(f"{new_name} keeps the tensor pipe busy {a[m]:.0f}% of the cycles, "
                   f"{_more(a[m], b[m])} than {old_name}'s {b[m]:.0f}%; its issue slots are used "
                   f"{a['issue_slots_busy_pct']:.0f}% against {b['issue_slots_busy_pct']:.0f}%")
    key = "other_instructions_per_consumer_warp_per_step"
    if key in a and key in b:
        out.append(f"a consumer warp issues {a[key]:.0f} instructions besides its wgmma per KV "
                   f"step in {new_name}, {b[key]:.0f} in {old_name}: "
                   f"{_more(a[key], b[key])} work per step")
    parts = ("turn_head", "issue_gemms", "wait_s", "softmax_under_pv", "wait_pv", "after_pv")
    names = {"turn_head": "the loop head (K/V waits, its turn)", "issue_gemms": "issuing the GEMMs",
             "wait_s": "waiting for S", "softmax_under_pv": "the work between the two waits",
             "wait_pv": "waiting for P V", "after_pv": "the work after P V"}
    for name, by in ((new_name, a), (old_name, b)):
        turn = {p: by[f"consumer_turn_{p}_pct"] for p in parts if f"consumer_turn_{p}_pct" in by}
        if len(turn) == len(parts):
            top = max(turn, key=turn.get)
            waits = turn["wait_s"] + turn["wait_pv"]
            out.append(f"{name}: the largest part of a consumer's steady turn is {names[top]} "
                       f"({turn[top]:.0f}% of the consumers' samples); its two wgmma waits take "
                       f"{waits:.0f}%")
    key = "consumer_turn_named_barrier_pct"
    if key in a:
        out.append(f"{new_name}'s ping-pong barriers hold {a[key]:.1f}% of the consumers' "
                   f"samples inside the steady turn")
    tops = {}
    for name, by in ((new_name, a), (old_name, b)):
        stall = {m: v for m, v in by.items() if m.startswith("consumer_stall_")
                 and m != "consumer_stall_selected_samples_pct"}
        if stall:
            top = max(stall, key=stall.get)
            tops[name] = top[len("consumer_stall_"):-len("_samples_pct")]
            out.append(f"{name}: the consumers' most common stall, besides issuing, is "
                       f"{tops[name]} ({stall[top]:.0f}% of their samples)")
    if len(tops) == 2:
        out.append("the same stall leads in both" if len(set(tops.values())) == 1
                   else "a different stall leads in each")
    return out


# ----------------------------------------------------------------------------------------------
# the tile table against dynamic tiles (Note [Dynamic tiles] in fa4_final.scheduler)


def dispatch_model(costs: list[int], grid: int, scatter: float, seeds: int = 20,
                   lead: float = 2.0) -> dict:
    """When the tiles' real costs scatter around the model's, what each way of handing them
    out costs. Each tile really costs cost * (1 + scatter * g), g standard normal (fresh per
    seed, clipped at -0.9). ``table``: the host's list schedule, planned on the model's costs,
    run with the real ones; ``dynamic``: each CTA takes the next tile in order when it asks,
    ``lead`` key-tile steps before it finishes its current one (the producer asks once it has
    issued the current tile's loads). Returns the mean over seeds of each one's end (its
    busiest CTA) over the ideal (the real total / grid), minus 1."""
    import heapq

    import numpy as np

    from fa4_final.scheduler import list_schedule

    plan = list_schedule(costs, grid)
    over = {"table": [], "dynamic": []}
    for seed in range(seeds):
        g = np.random.default_rng(seed).standard_normal(len(costs))
        real = np.asarray(costs, dtype=np.float64) * (1.0 + scatter * np.maximum(g, -0.9))
        ideal = real.sum() / grid
        over["table"].append(max(real[ts].sum() for ts in plan) / ideal - 1.0)
        # (time the CTA asks, its end so far, cta); its first tile is taken at time 0
        ends = [real[c] for c in range(min(grid, len(costs)))]
        asks = [(max(e - lead, 0.0), e, c) for c, e in enumerate(ends)]
        heapq.heapify(asks)
        for t in range(len(ends), len(costs)):
            _, end, c = heapq.heappop(asks)
            end += real[t]  # the next tile starts when the current one ends
            heapq.heappush(asks, (max(end - lead, 0.0), end, c))
        over["dynamic"].append(max(e for _, e, _ in asks) / ideal - 1.0)
    return {k: float(np.mean(v)) for k, v in over.items()}


# ----------------------------------------------------------------------------------------------
# the split tail (Note [Split tail] in fa4_final.scheduler)


def last_work(num_tiles: int, steps: int, grid: int, split: bool) -> list[int]:
    """Key-tile steps each CTA computes, whole last round or split (the scheduler's plan, with
    SPLIT_OVERHEAD_STEPS charged per piece), sorted from the busiest CTA down."""
    from fa4_final.scheduler import SPLIT_OVERHEAD_STEPS, split_tail_items

    if split:
        items, _ = split_tail_items(num_tiles, steps, grid)
    else:
        items = [[(t, 0, steps, -1, 0, 0) for t in range(cta, num_tiles, grid)]
                 for cta in range(grid)]
    work = [sum(min(hi, steps) - lo + (SPLIT_OVERHEAD_STEPS if slot >= 0 else 0)
                for _, lo, hi, slot, _, _ in its) for its in items]
    return sorted(work, reverse=True)


def merge_pieces_numpy(scores, values, cuts, scale_log2: float = 1.0):
    """The kernel's split-tail arithmetic on one block of rows, in float64: each piece of the
    keys (``cuts``: boundaries) leaves (O unnormalised, row max, row sum) as the online softmax
    ends it; the last piece merges the others into its own, one at a time, as
    HopperForward.merge_pieces does; out = O / l. Returns (out, lse in log2 units)."""
    import numpy as np

    pieces = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        s = scores[:, lo:hi]
        m = s.max(axis=1)
        p = np.exp2((s - m[:, None]) * scale_log2)
        pieces.append((p @ values[lo:hi], m, p.sum(axis=1)))
    o, m, l_sum = pieces[-1]
    for o2, m2, l2 in pieces[:-1]:
        m_new = np.maximum(m, m2)
        keep, take = np.exp2((m - m_new) * scale_log2), np.exp2((m2 - m_new) * scale_log2)
        o = o * keep[:, None] + o2 * take[:, None]
        l_sum = l_sum * keep + l2 * take
        m = m_new
    return o / l_sum[:, None], m * scale_log2 + np.log2(l_sum)


def energy_lines(res) -> list[str]:
    """Per shape of solutions.ch08_energy's file: each implementation's speed and energy under
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


# ----------------------------------------------------------------------------------------------
# Four ways to time the same two kernels (section 8)


def predecessor_lines(res) -> list[str]:
    """Per predecessor in solutions.ch08_predecessors' file: each implementation's median burst
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
    """Per shape of a solutions.ch08_clocked file: every variant's kernel time at ncu's clock,
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
    timed in each results file of ``named`` (label -> Results; a file of solutions.ch08_clocked
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


def default_in_run(res, column, how) -> list[str]:
    """Per shape of a solutions.ch08_clocked file, the column ``column(cfg)`` names for today's
    default there (``cfg = hopper_fwd_default(d, causal)``) against the FA4 package;
    ``how(cfg)`` says in a few words what that column is. The run chose the default, which
    flatters it."""
    from fa4_final.config import hopper_fwd_default

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

    from fa4_final import interface
    from fa4_final.config import hopper_fwd_default
    from solutions import ch08_compare

    lines = []
    for label, change in variants.items():
        cfg = replace(hopper_fwd_default(head_dim, causal), **change)
        art = interface.compile_only("sm_90a", head_dim, "bf16", causal, cfg)
        m = ch08_compare.kernel_metrics(art.ptx, art.sass, art.registers, art.spills,
                                        cfg.tile_m, cfg.tile_n)
        step, sched = m["steady step"], m["steady step schedule"]
        s2r = ch08_compare.thread_index_reads(art.sass)
        lines.append(f"{label:32s} steady step {step['instructions']} instructions, "
                     f"{sched['exps under P V']} of {step['MUFU.EX2']} exponentials before the "
                     f"P V wait; S2R of the thread index in the KV loops: {s2r}; "
                     f"{art.registers} registers, {art.spills} spills")
    return lines
