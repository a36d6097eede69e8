"""A discrete-event model of the Hopper backward's dQ accumulation orders (issue 34): what the
deterministic mode's turns cost, and what replicated accumulators or a rotated start would save.
CPU only, pure Python; a few milliseconds per shape.

    python -m measure.dq_turns_model            # calibrate on results/h200/bwd_phases.json, predict

The machine: R resident slots (132 SMs x 1 CTA of the backward). CTAs launch in grid order (key
tile fastest, then kv head, then batch), each onto the first free slot, and hold it to the end.
A CTA is a list of steps (query head h of its group, query tile m); a step's compute takes T (x
(1 + jitter * N(0, 1)), seeded) and ends with its dQ part staged in shared memory (one buffer:
the MMA warpgroups may compute the next step but must wait for the buffer before its last
``tail`` x T, the dQ GEMM and what follows it). The dQ warp then adds the part into the float32
accumulator: the add takes L. Orders:

- ``none``   the default: the add starts at once; the buffer is free after ``read`` x L (the
             bulk add has read shared memory; completion is not waited for).
- ``turns``  today's deterministic mode: one counter per (batch, head, m); the add waits for its
             turn (bwd_tiles.dq_turn), the buffer is free, and the turn passes, only after the
             add has completed (L).
- ``copies`` (``copies=C``) C accumulators; key tile n adds into copy n % C and takes turns only
             among key tiles of its copy (bwd_tiles.dq_copy_turn), bwd_post sums the copies in a
             fixed order. C = 1 is ``turns``.
- ``rotated`` hypothesis 7: key tile n starts at query tile n * num_m // N and wraps; at each m
             the turns follow arrival order (steps since the start, ties by n). ``chunk=K``:
             key tiles in chunks of K, each rotated over its own K starts, turns chunk by chunk;
             with ``copies=C`` chunk g adds into copy g % C (turns chunk by chunk within a copy).

``buffers=2`` (HopperBwdConfig.dq_buffers) gives the turns two staging buffers: step i + 2 may
be staged once step i's buffer is free, while the dQ warp still adds in step order; with
``overlap`` (dq_adds_overlap) two dQ warps take alternate steps, so step i + 1's add may run
while step i's completes.

A waiting CTA holds its slot; when nothing can run while work remains the model reports a
deadlock (never hangs). Returns the makespan (model time units, T = 1 unless given).

Calibration (``calibrate``): T from the default's measured main-kernel time (makespan(none) =
measured), then L as the one value (per head dim) that reproduces the deterministic price at
the dense S = 4096 shape; the other shapes are then a check of the model, not a fit. Assumed,
not measured: jitter 0.05 (a step's time varies by 5 %), tail 0.1 (after the dQ buffer frees,
a tenth of a step remains before the next dQ is staged; 0.3 and 0.6 fit the measured causal
prices far worse), read 0.3 (the bulk add has read shared memory after 30 % of its latency),
the default tiles of hopper_bwd_default (tile_m 128 at D = 64; 80 at D = 128, 64 causal),
one CTA per SM. On results/h200/bwd_phases.json (2026-12-05) that gives L = 0.87 steps at
D = 64 and 0.96 at D = 128 (about 2 us and 2.4 us), and the model then reproduces the six
measured prices it was not fitted to within 0.06 (CALIBRATED; ``python -m
measure.dq_turns_model`` prints the table and the predictions).
"""

from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from utils.bench import Shape as BenchShape

PRODUCES = [
    ("results/cpu/dq_turns_model.json", "python -m measure.dq_turns_model --save",
     "a discrete-event model of the Hopper backward's dQ turns, calibrated on "
     "results/h200/bwd_phases.json: its price of today's deterministic mode beside the measured "
     "one per shape, and its predicted prices (makespan over the default's) of accumulator "
     "copies, early release, the rotated start and two staging buffers (in turn and with adds "
     "in flight across turns); predictions, not measurements"),
]
SLOTS = 132
# L per head dim (in steps) fitted by ``calibrate`` on results/h200/bwd_phases.json (2026-12-05)
CALIBRATED = {64: 0.871, 128: 0.963}


@dataclass(frozen=True)
class Shape(BenchShape):
    """utils.bench's shape (b, s, h, d, causal, h_kv) with the backward's tile sizes."""

    tile_m: int = 64
    tile_n: int = 128

    @property
    def num_m(self) -> int:
        return -(-self.s // self.tile_m)

    @property
    def num_n(self) -> int:
        return -(-self.s // self.tile_n)

    @property
    def kv_heads(self) -> int:
        return self.h_kv or self.h


@dataclass
class Result:
    makespan: float
    deadlock: bool = False
    waiting: int = 0  # CTAs stuck when a deadlock was found
    adds: dict = field(default_factory=dict)  # (b, head, m, copy) -> key tiles in add order


def _m_range(shape: Shape, n: int) -> tuple[int, int]:
    """Query tiles key tile n visits (bwd_tiles.q_tile_range, equal lengths, no window)."""
    if not shape.causal:
        return 0, shape.num_m
    return min(n * shape.tile_n // shape.tile_m, shape.num_m), shape.num_m


def cta_plan(shape: Shape, order: str, copies: int = 1, chunk: int | None = None):
    """Per CTA in launch order: (b, kv head, n, [(head, m, counter key, turn), ...])."""
    N, M, group = shape.num_n, shape.num_m, shape.h // shape.kv_heads
    ctas = []
    for b in range(shape.b):
        for hk in range(shape.kv_heads):
            tiles = list(range(N))
            if order in ("turns", "copies") and shape.causal:
                tiles = tiles[::-1]  # launch_order_reversed: turns go downwards
            for n in tiles:
                lo, hi = _m_range(shape, n)
                ms = list(range(lo, hi))
                if order == "rotated":
                    k = chunk or N
                    c0 = (n // k) * k
                    size = min(k, N - c0)
                    start = (n - c0) * M // size
                    ms = ms[start:] + ms[:start] if not shape.causal else ms
                steps = []
                for g in range(group):
                    head = hk * group + g
                    for m in ms:
                        steps.append((head, m))
                ctas.append((b, hk, n, steps))
    return ctas


def turn_of(shape: Shape, order: str, n: int, m: int, copies: int = 1,
            chunk: int | None = None):
    """(copy, turn) of key tile n at query tile m; None for ``none``."""
    N, M = shape.num_n, shape.num_m
    if order == "none":
        return None
    if order in ("turns", "copies"):
        c = copies if order == "copies" else 1
        if shape.causal:
            last = N - 1  # every key tile with m_min <= m, i.e. n * tile_n // tile_m <= m
            last = min(N - 1, ((m + 1) * shape.tile_m - 1) // shape.tile_n)
            return n % c, (last - n) // c
        return n % c, n // c
    # rotated: arrival order = steps since the start, ties by n; chunk by chunk
    k = chunk or N
    c0 = (n // k) * k
    size = min(k, N - c0)

    def dist(j):
        return (m - (j - c0) * M // size) % M

    rank = sum(1 for j in range(c0, c0 + size) if (dist(j), j) < (dist(n), n))
    # with copies, chunk g adds into copy g % copies: only the earlier chunks of its copy (all
    # full, k key tiles each) come first
    g = n // k
    return g % copies, (g // copies) * k + rank


def simulate(shape: Shape, order: str = "none", T: float = 1.0, L: float = 0.3,
             jitter: float = 0.0, copies: int = 1, chunk: int | None = None,
             slots: int = SLOTS, tail: float = 0.1, read: float = 0.3, seed: int = 0,
             keep_adds: bool = False, early: bool = False, buffers: int = 1,
             overlap: bool = False) -> Result:
    """The makespan of one backward's main kernel under ``order`` (module docstring).
    ``buffers``: dQ staging buffers (HopperBwdConfig.dq_buffers); with two, step i + 2 may be
    staged once step i's buffer is free, while the dQ warp still adds in step order.
    ``overlap`` (two buffers, HopperBwdConfig.dq_adds_overlap): two dQ warps, step i on warp
    i % 2, each adding in turn and passing the turn at completion as the one warp does; the
    CTA ends when every step's add has completed."""
    if buffers not in (1, 2) or (buffers == 2 and early):
        raise ValueError(f"buffers must be 1, or 2 without early release, got {buffers}, "
                         f"early={early}")
    if overlap and (buffers != 2 or order == "none"):
        raise ValueError(f"overlap needs buffers=2 and turns, got buffers={buffers}, "
                         f"order={order!r}")
    rng = random.Random(seed)
    plan = cta_plan(shape, order, copies, chunk)
    turns = {}  # (n, m) -> (copy, turn), memoised: every head and batch shares them
    counter: dict = {}
    waiting: dict = {}  # (key, turn) -> (cta, ready time)
    adds: dict = {}
    heap: list = []
    seq = 0
    state = {}  # cta -> [compute end of its latest scheduled step, its dQ warp free from]
    next_add: dict = {}  # cta -> the step its dQ warp adds next (buffers = 2)
    parked: dict = {}  # cta -> a staged step that waits for the one before it to be added
    next_cta = 0
    free = slots
    now = 0.0
    done = 0

    def step_time():
        if not jitter:
            return T
        return max(0.05 * T, T * (1.0 + jitter * rng.gauss(0.0, 1.0)))

    def push(t, kind, cta, i):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, cta, i))
        seq += 1

    def launch(t):
        nonlocal next_cta, free
        while free > 0 and next_cta < len(plan):
            cta = next_cta
            next_cta += 1
            free -= 1
            if not plan[cta][3]:
                push(t, "finish", cta, 0)
                continue
            c = t
            for j in range(min(buffers, len(plan[cta][3]))):  # one step a free buffer
                c += step_time()
                push(c, "ready", cta, j)
            state[cta] = [c, t]  # compute end of the latest step, the dQ warp free from
            next_add[cta] = 0

    def key_turn(cta, i):
        b, hk, n, steps = plan[cta]
        head, m = steps[i]
        if order == "none":
            return None, None
        if (n, m) not in turns:
            turns[(n, m)] = turn_of(shape, order, n, m, copies, chunk)
        copy, turn = turns[(n, m)]
        return (b, head, m, copy), turn

    warp_free: dict = {}  # overlap: (cta, warp) -> when that dQ warp may add again
    added: dict = {}  # overlap: cta -> steps added (the CTA ends when all are)

    def start_add(cta, i, t):
        if order == "none":
            push(t + read * L, "release", cta, i)  # the buffer is free once read
            return
        push(t + L, "added", cta, i)
        if overlap:  # two dQ warps, step i on warp i % 2
            warp_free[(cta, i % 2)] = t + L
        else:
            state[cta][1] = t + L  # the dQ warp waits for completion, then passes the turn
        if early:  # the buffer is free once read; the turn still passes at completion
            push(t + read * L, "release", cta, i)
        if keep_adds:
            adds.setdefault(key_turn(cta, i)[0], []).append(plan[cta][2])

    def release(cta, i, t):
        last = i + 1 == len(plan[cta][3])
        if last:
            if overlap:
                return  # the CTA ends when every step's add has completed ("added")
            if order == "none" or not early:
                push(t, "finish", cta, i)
            return  # early: the CTA ends with its last add's completion ("added")
        if i + buffers >= len(plan[cta][3]):  # the steps after i are already scheduled
            return
        st = state[cta]
        st[0] = max(st[0] + step_time(), t + tail * T)
        push(st[0], "ready", cta, i + buffers)

    launch(0.0)
    while heap:
        now, _, kind, cta, i = heapq.heappop(heap)
        if kind == "finish":
            free += 1
            done += 1
            launch(now)
        elif kind == "ready":
            busy = warp_free.get((cta, i % 2), 0.0) if overlap else state[cta][1]
            if busy > now:  # the dQ warp still waits for its previous add
                push(busy, "ready", cta, i)
                continue
            if buffers > 1 and order != "none" and not overlap and i != next_add[cta]:
                parked[cta] = i  # the warp adds in step order: after step i - 1's add
                continue
            key, turn = key_turn(cta, i)
            if key is None or counter.get(key, 0) == turn:
                start_add(cta, i, now)
            else:
                waiting[(key, turn)] = (cta, i)
        elif kind == "release":
            release(cta, i, now)
        elif kind == "added":
            key, turn = key_turn(cta, i)
            counter[key] = counter.get(key, 0) + 1
            if overlap:
                added[cta] = added.get(cta, 0) + 1
                if added[cta] == len(plan[cta][3]):
                    push(now, "finish", cta, i)
            next_add[cta] = i + 1
            if parked.get(cta) == i + 1:
                push(now, "ready", cta, parked.pop(cta))
            nxt = waiting.pop((key, counter[key]), None)
            if nxt is not None:
                start_add(nxt[0], nxt[1], now)
            if not early:
                release(cta, i, now)
            elif i + 1 == len(plan[cta][3]):
                push(now, "finish", cta, i)
    if done < len(plan):
        return Result(now, True, len(waiting))
    return Result(now, False, 0, adds)


# ----------------------------------------------------------------------------------------------
# calibration against results/h200/bwd_phases.json

MEASURED = str(Path(__file__).resolve().parent.parent / "results" / "h200" / "bwd_phases.json")


def measured_main(path: str = MEASURED) -> dict:
    """{(d, s, causal): (default main ms, deterministic main ms, b, h)} back to back."""
    rows = json.load(open(path))["rows"]
    got = {}
    for r in rows:
        if r["phase"] != "main" or r["mode"] != "back_to_back":
            continue
        got.setdefault((r["d"], r["s"], r["causal"], r["b"], r["h"]), {})[r["impl"]] = r["value"]
    return {(d, s, c): (v["fa4_final"], v["fa4_final_deterministic"], b, h)
            for (d, s, c, b, h), v in got.items()
            if "fa4_final" in v and "fa4_final_deterministic" in v}


def measured_phases(path: str = MEASURED) -> dict:
    """{(d, s, causal): {phase: ms}} of the default build (fa4_final), back to back."""
    got: dict = {}
    for r in json.load(open(path))["rows"]:
        if r["impl"] == "fa4_final" and r["mode"] == "back_to_back" and r.get("value"):
            got.setdefault((r["d"], r["s"], r["causal"]), {})[r["phase"]] = r["value"]
    return got


def total_price(phases: dict, main_price: float, copies: int = 1,
                first_store: bool = False, visited: float | None = None) -> float:
    """The whole backward's time over the default's when the main kernel takes ``main_price``
    times its time and the accumulator has ``copies`` copies. Assumed: bwd_pre and bwd_post
    are bound by memory traffic (as their measured times say: about 4 TB/s) and scale with
    their bytes per dQ element: bwd_pre reads O and dO (2 + 2 B) and zeroes 4 B per copy,
    bwd_post reads 4 B per copy and writes 2 B. ``first_store`` (HopperBwdConfig.
    dq_first_store): bwd_pre zeroes nothing and bwd_post reads only ``visited`` copies per
    query tile on average (visited_copies; the counters it reads first are 4 B per copy per
    tile, not per element: left out); the main kernel's price is taken as given (a plain bulk
    store assumed to cost what the bulk add it replaces costs)."""
    if first_store:
        pre = phases["pre"] * 4 / 8
        post = phases["post"] * (4 * (copies if visited is None else visited) + 2) / 6
    else:
        pre = phases["pre"] * (4 + 4 * copies) / 8
        post = phases["post"] * (4 * copies + 2) / 6
    return (pre + phases["main"] * main_price + post) / phases["total"]


def visited_copies(shape: Shape, copies: int) -> float:
    """Copies per query tile that some key tile writes, averaged over the query tiles (what
    bwd_post reads with dq_first_store), by the kernel's own rule
    (fa4_final.common.bwd_tiles.copy_visited): min(C, N) everywhere without a causal
    diagonal, fewer on the first query tiles with one."""
    from fa4_final.common.bwd_tiles import copy_visited
    from fa4_final.common.tiles import TileWindow

    w = TileWindow(shape.tile_m, shape.tile_n, shape.causal, has_left=False, has_right=False)
    seen = sum(copy_visited(w, m, c, shape.num_n, shape.s, shape.s, None, None, copies)
               for m in range(shape.num_m) for c in range(copies))
    return seen / shape.num_m


def copies_of(order: str) -> int:
    """Accumulator copies of a predict() key ("copies=4 early" -> 4; others 1)."""
    return int(order.split("=")[1].split()[0]) if order.startswith("copies=") else 1


def default_shape(b: int, s: int, h: int, d: int, causal: bool) -> Shape:
    """A shape with the default config's tiles (hopper_bwd_default: tile_m 128 at D = 64, 80
    at D = 128 without a causal diagonal, 64 with one; tile_n 128)."""
    from fa4_final.hopper.config import hopper_bwd_default

    cfg = hopper_bwd_default(d, causal)
    return Shape(b, s, h, d, causal, tile_m=cfg.tile_m, tile_n=cfg.tile_n)


def price(shape: Shape, L: float, **kw) -> float:
    """Model: the deterministic (turns) makespan over the default's, T = 1."""
    base = simulate(shape, "none", L=L, **kw).makespan
    det = simulate(shape, "turns", L=L, **kw).makespan
    return det / base


def fit_L(shape: Shape, target: float, lo: float = 0.0, hi: float = 2.0, **kw) -> float:
    """The add latency L (in steps) at which the model's deterministic price equals
    ``target`` (bisection; the price is monotone in L)."""
    for _ in range(14):
        mid = 0.5 * (lo + hi)
        if price(shape, mid, **kw) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def calibrate(path: str = MEASURED, jitter: float = 0.05) -> dict:
    """L per head dim, fitted at the dense S = 4096 shape; the model's price at every measured
    shape beside the measured one."""
    meas = measured_main(path)
    out = {"L": {}, "rows": []}
    for d in sorted({k[0] for k in meas}):
        key = (d, 4096, False)
        if key not in meas:
            continue
        base, det, b, h = meas[key]
        out["L"][d] = fit_L(default_shape(b, 4096, h, d, False), det / base, jitter=jitter)
    for (d, s, causal), (base, det, b, h) in sorted(meas.items()):
        if d not in out["L"]:
            continue
        shape = default_shape(b, s, h, d, causal)
        L = out["L"][d]
        t0 = simulate(shape, "none", L=L, jitter=jitter).makespan
        step_us = 1000.0 * base / t0  # T in microseconds
        out["rows"].append({"d": d, "s": s, "causal": causal, "measured": det / base,
                            "model": price(shape, L, jitter=jitter), "T_us": step_us,
                            "L_us": L * step_us})
    return out


FIRST_STORE_COPIES = (2, 4)  # the first_store candidates (C = 1 is "turns early")


def predict(shape: Shape, L: float, jitter: float = 0.05, copies=(2, 4, 8),
            chunks=(None,), early=(False, True)) -> dict:
    """Model prices (makespan over the default's) of each order at ``shape``; ``early``: also
    with the staging buffer handed back once read (HopperBwdConfig.dq_early_release)."""
    base = simulate(shape, "none", L=L, jitter=jitter).makespan
    out = {}
    for e in early:
        tag = " early" if e else ""
        out["turns" + tag] = simulate(shape, "turns", L=L, jitter=jitter,
                                      early=e).makespan / base
        for c in copies:
            out[f"copies={c}{tag}"] = simulate(shape, "copies", L=L, jitter=jitter, copies=c,
                                               early=e).makespan / base
        if shape.causal:
            continue
        for k in chunks:  # chunks in copies of their own: no chunk waits on another
            n_copies = 1 if k is None else -(-shape.num_n // k)
            r = simulate(shape, "rotated", L=L, jitter=jitter, chunk=k, copies=n_copies,
                         early=e)
            out[f"rotated chunk={k}{tag}"] = ("deadlock" if r.deadlock
                                              else r.makespan / base)
    return out


def _two_buffer_tile(shape: Shape) -> tuple[Shape, float]:
    """(the shape at the tile where two dQ buffers fit, its step time in the default's steps):
    the default's, except at D = 128 without a causal diagonal, where 80 query rows leave no
    room and the deterministic mode takes 64 (a step's time assumed to scale with its rows)."""
    from dataclasses import replace

    if shape.d == 128 and not shape.causal and shape.tile_m != 64:
        return replace(shape, tile_m=64), 64 / shape.tile_m
    return shape, 1.0


def predict_two_buffers(shape: Shape, L: float, jitter: float = 0.05) -> dict:
    """Model prices (makespan over the default's) of the deterministic mode with one and two
    dQ staging buffers (HopperBwdConfig.dq_buffers), and two with adds in flight across turns
    (dq_adds_overlap), at the tile where two fit: the default's,
    except at D = 128 without a causal diagonal, where 80 query rows leave no room and the
    candidate takes 64 (measure.bwd_phases' fa4_final_det_64 and _det_db64). Assumed there:
    a step's time scales with its query rows (T = 64 / 80 of the default's step)."""
    base = simulate(shape, "none", L=L, jitter=jitter).makespan
    own, T = _two_buffer_tile(shape)
    out = {f"turns {n} buffer{'s' if n > 1 else ''} tile {own.tile_m}": simulate(
        own, "turns", T=T, L=L * T, jitter=jitter, buffers=n).makespan / base for n in (1, 2)}
    out[f"turns 2 buffers overlap tile {own.tile_m}"] = simulate(
        own, "turns", T=T, L=L * T, jitter=jitter, buffers=2, overlap=True).makespan / base
    return out


def predict_rotated(shape: Shape, L: float, jitter: float = 0.05) -> dict:
    """Model prices (makespan over the default's) of the deterministic default (two buffers, a
    dQ warp each) with its plain walk and with the rotated walk (HopperBwdConfig.dq_rotated,
    Note [A rotated walk]), at the deterministic tile (_two_buffer_tile: 64 query rows at D = 128, T
    scaled with them). The model rotates at any number of key tiles; the kernel only up to
    64 a head, so at more the kernel's price is the plain walk's."""
    base = simulate(shape, "none", L=L, jitter=jitter).makespan
    own, T = _two_buffer_tile(shape)
    return {order: simulate(own, order, T=T, L=L * T, jitter=jitter, buffers=2,
                            overlap=True).makespan / base for order in ("turns", "rotated")}


def predict_copies_overlap(shape: Shape, L: float, jitter: float = 0.05,
                           copies=(1, 2, 4)) -> dict:
    """Model prices (makespan over the default's) of the overlapped two-buffer kernel (two dQ
    warps, the deterministic default at D = 64 and 128) with ``copies`` accumulators each
    (dq_copies, Note [dQ copies]), at the deterministic tile (_two_buffer_tile)."""
    base = simulate(shape, "none", L=L, jitter=jitter).makespan
    own, T = _two_buffer_tile(shape)
    return {f"overlap copies={c}": simulate(own, "copies", T=T, L=L * T, jitter=jitter,
                                            copies=c, buffers=2, overlap=True).makespan / base
            for c in copies}


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", action="store_true",
                    help="store the calibration and the predictions in " + PRODUCES[0][0])
    args = ap.parse_args(argv)
    cal = calibrate()
    print("L fitted at the dense S = 4096 shape (steps of T):",
          {d: round(v, 3) for d, v in cal["L"].items()})
    print(f"{'shape':24s} {'measured':>9s} {'model':>7s} {'T us':>6s} {'L us':>6s}")
    rows = []
    note = "a model's output (measure.dq_turns_model), not a measurement"
    for r in cal["rows"]:
        name = f"D{r['d']} S{r['s']} {'causal' if r['causal'] else 'dense'}"
        print(f"{name:24s} {r['measured']:9.3f} {r['model']:7.3f} {r['T_us']:6.2f} "
              f"{r['L_us']:6.2f}")
        measured = "measured on the H200, read from results/h200/bwd_phases.json"
        for impl, value, says in (("measured", r["measured"], measured),
                                  ("model", r["model"], note)):
            rows.append({"impl": impl, "metric": "turns_price", "value": value, "unit": "x",
                         "d": r["d"], "s": r["s"], "causal": r["causal"],
                         "L_steps": cal["L"][r["d"]], "T_us": r["T_us"], "note": says})
    print("predictions, main kernel (makespan / default's) and in brackets the whole backward "
          "with bwd_pre and bwd_post scaled by their bytes (total_price); to be measured:")
    phases = measured_phases()
    for (d, s, causal), (_, _, b, h) in sorted(measured_main().items()):
        shape = default_shape(b, s, h, d, causal)
        pred = predict(shape, cal["L"][d], chunks=(None, 64))
        name = f"D{d} S{s} {'causal' if causal else 'dense'}"
        total = {k: None if isinstance(v, str) else
                 total_price(phases[(d, s, causal)], v, copies_of(k)) for k, v in pred.items()}
        print(f"  {name:22s} " + "  ".join(
            f"{k} {v}" if isinstance(v, str) else f"{k} {v:.3f} ({total[k]:.3f})"
            for k, v in pred.items()))
        for order, value in pred.items():
            rows.append({"impl": order, "metric": "predicted_price",
                         "value": None if isinstance(value, str) else value, "unit": "x",
                         "d": d, "s": s, "causal": causal, "L_steps": cal["L"][d],
                         "deadlock": value == "deadlock", "note": note})
            rows.append({"impl": order, "metric": "predicted_total_price", "value": total[order],
                         "unit": "x", "d": d, "s": s, "causal": causal, "copies":
                         copies_of(order), "note": note + "; bwd_pre and bwd_post scaled by "
                         "their bytes per element"})
    print("predictions with dq_first_store (no zeroing in bwd_pre, bwd_post reads the visited "
          "copies only), the whole backward; the main kernel's price as above; to be measured:")
    for (d, s, causal), (_, _, b, h) in sorted(measured_main().items()):
        shape = default_shape(b, s, h, d, causal)
        pred = predict(shape, cal["L"][d], copies=FIRST_STORE_COPIES, early=(True,))
        name = f"D{d} S{s} {'causal' if causal else 'dense'}"
        cells = []
        for order, main_price in pred.items():
            c = copies_of(order)
            if order.startswith("rotated") or isinstance(main_price, str):
                continue
            v = visited_copies(shape, c)
            tot = total_price(phases[(d, s, causal)], main_price, c, first_store=True,
                              visited=v)
            old_tot = total_price(phases[(d, s, causal)], main_price, c)
            cells.append(f"{order} first_store {tot:.3f} (zeroing {old_tot:.3f})")
            rows.append({"impl": order + " first_store", "metric": "predicted_total_price",
                         "value": tot, "unit": "x", "d": d, "s": s, "causal": causal,
                         "copies": c, "visited_copies": v, "main_price": main_price,
                         "note": note + "; dq_first_store: bwd_pre without zeroing, bwd_post "
                         "reading the visited copies only, scaled by their bytes per element"})
        print(f"  {name:22s} " + "  ".join(cells))
    print("predictions with two dQ staging buffers (dq_buffers = 2, in turn and with "
          "dq_adds_overlap), main kernel, beside one buffer at the same tile; to be measured:")
    for (d, s, causal), (_, _, b, h) in sorted(measured_main().items()):
        shape = default_shape(b, s, h, d, causal)
        pred = predict_two_buffers(shape, cal["L"][d])
        name = f"D{d} S{s} {'causal' if causal else 'dense'}"
        print(f"  {name:22s} " + "  ".join(f"{k} {v:.3f}" for k, v in pred.items()))
        for order, value in pred.items():
            rows.append({"impl": order, "metric": "predicted_price", "value": value,
                         "unit": "x", "d": d, "s": s, "causal": causal,
                         "L_steps": cal["L"][d], "note": note + "; at a 64-row tile a step "
                         "is assumed to take 64/80 of the default's"})
    print("predictions with accumulator copies on the overlapped two-buffer kernel (dq_copies "
          "with dq_buffers = 2, dq_adds_overlap, dq_first_store), main kernel and in brackets "
          "the whole backward; to be measured:")
    for (d, s, causal), (_, _, b, h) in sorted(measured_main().items()):
        shape = default_shape(b, s, h, d, causal)
        own, _T = _two_buffer_tile(shape)
        pred = predict_copies_overlap(shape, cal["L"][d])
        name = f"D{d} S{s} {'causal' if causal else 'dense'}"
        cells = []
        for order, main_price in pred.items():
            c = int(order.split("=")[1])
            v = visited_copies(own, c)
            tot = total_price(phases[(d, s, causal)], main_price, c, first_store=c > 1,
                              visited=v if c > 1 else None)
            cells.append(f"{order} {main_price:.3f} ({tot:.3f})")
            rows.append({"impl": order, "metric": "predicted_total_price", "value": tot,
                         "unit": "x", "d": d, "s": s, "causal": causal, "copies": c,
                         "main_price": main_price, "L_steps": cal["L"][d],
                         "note": note + "; two dQ buffers, a dQ warp each, first stores with "
                         "more than one copy; at a 64-row tile a step is assumed to take 64/80 "
                         "of the default's"})
        print(f"  {name:22s} " + "  ".join(cells))
    if args.save:
        from utils import results

        path = results.save("dq_turns_model", rows, PRODUCES[0][1], gpu="cpu")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
