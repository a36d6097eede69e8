"""Chapter 08's teaching helpers: the exercises' solutions and checkers, the turn-barrier
simulation, the Gantt chart of the stored timeline, and what the compiled loop looks like.

The kernel itself is fa4_final.hopper.fwd (no kernel lives here); the notebook quotes it.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from dataclasses import replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_final.common.constants import THREADS_PER_WARPGROUP
from fa4_final.common.schedule import rounds, tile_coords, zigzag_tile
from fa4_final.hopper.fwd import HopperForward, NamedBarrier
from measure import features
from utils import bench
from utils.claims import claim
from utils.host_emulation import patched, plain, python_loops

# ----------------------------------------------------------------------------------------------
# The exercises' kernel: fa4_final's Hopper forward with one of its methods replaced by the
# learner's device code (as chapter 05's HopperWithProducer replaces its producer loop)


class HopperExercise(HopperForward):
    """fa4_final.hopper.fwd.HopperForward with ``turn`` (exercise 08.1: ``turn_fn(wg, num_wgs,
    first_of_cta, last_of_cta, issue_gemms)``) and/or ``walk_tiles`` (exercise 08.2:
    ``tile_loop_fn(num_tiles, cta, grid, state_q, state_k, state_v, visit)``, fixed rounds
    without a table) replaced. Everything else is the kernel's own code."""

    def __init__(self, *args, turn_fn=None, tile_loop_fn=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn_fn, self.tile_loop_fn = turn_fn, tile_loop_fn

    def cache_key(self) -> tuple:
        return super().cache_key() + (("exercise", self.turn_fn, self.tile_loop_fn),)

    @cute.jit
    def turn(self, wg: Int32, first_of_cta, last_of_cta, issue):
        if const_expr(self.turn_fn is None):
            super().turn(wg, first_of_cta, last_of_cta, issue)
        else:
            self.turn_fn(wg, self.num_wgs, first_of_cta, last_of_cta, issue)

    @cute.jit
    def walk_tiles(self, num_tiles: Int32, cta: Int32, grid: Int32, mTileTable, state_q,
                   state_k, state_v, visit):
        if const_expr(self.tile_loop_fn is None or mTileTable is not None):
            super().walk_tiles(num_tiles, cta, grid, mTileTable, state_q, state_k, state_v,
                               visit)
        else:
            self.tile_loop_fn(num_tiles, cta, grid, state_q, state_k, state_v, visit)


# exercise 08.1 compiles the kernel with the tile table (no dynamic tiles: their extra turn
# after the loop is the kernel's own, Note [Dynamic tiles]); 08.2 with fixed zigzag rounds
TURN_CONFIG = dict(schedule="table")
ZIGZAG_CONFIG = dict(schedule="zigzag", l2_sections=False)
_BUILDS: dict = {}


def exercise_config(head_dim: int, causal: bool, which: str):
    from fa4_final.hopper.config import hopper_fwd_default

    change = TURN_CONFIG if which == "turn" else ZIGZAG_CONFIG
    return replace(hopper_fwd_default(head_dim, causal), **change)


def compile_exercise(head_dim: int = 128, causal: bool = False, turn_fn=None,
                     tile_loop_fn=None):
    """The exercise kernel compiled for sm_90a with fake tensors (no GPU): its artifacts."""
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.hopper.host import forward_fake_args
    from fa4_final.runtime.compile import compile_kernel

    which = "turn" if turn_fn is not None else "tiles"
    key = (head_dim, causal, turn_fn, tile_loop_fn)
    if key not in _BUILDS:
        cfg = exercise_config(head_dim, causal, which)
        kernel = HopperExercise(CUTLASS_BY_NAME["bf16"], head_dim, causal, cfg,
                                turn_fn=turn_fn, tile_loop_fn=tile_loop_fn)
        _BUILDS[key] = compile_kernel(kernel, *forward_fake_args("bf16", head_dim, cfg),
                                      arch="sm_90a", keep=True)[1]
    return _BUILDS[key]


@contextlib.contextmanager
def exercise_kernel(**fns):
    """fa4_final's launch path builds ``HopperExercise(**fns)`` instead of its kernel for the
    ``with`` block (the compile path's per-call lookup emptied before and after)."""
    from fa4_final.hopper import host
    from fa4_final.runtime import compile as compile_path

    def build(dtype_name, head_dim, causal, has_left, has_right, config, varlen=False,
              has_seqused_k=False):
        from fa4_final.common.constants import CUTLASS_BY_NAME

        return HopperExercise(CUTLASS_BY_NAME[dtype_name], head_dim, causal, config,
                              has_window_left=has_left, has_window_right=has_right,
                              varlen=varlen, has_seqused_k=has_seqused_k, **fns)

    compile_path.forget()
    try:
        with patched(host, forward_kernel=build):
            yield
    finally:
        compile_path.forget()


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype): one tile; tiles that see no
# key (sq > sk, causal); a partial last round and tiles cut along the keys (non-causal); many
# tiles per CTA through three consumer warpgroups (D = 64); GQA
EXERCISE_GPU_CASES = [
    (1, 128, 128, 1, 1, 128, False, "bfloat16"),
    (1, 1000, 100, 2, 2, 128, True, "bfloat16"),
    (4, 4096, 4096, 16, 4, 128, False, "bfloat16"),
    (2, 8192, 8192, 16, 2, 64, True, "float16"),
    (3, 333, 555, 6, 2, 64, False, "float16"),
    (1, 2048, 2048, 4, 4, 128, True, "bfloat16"),
]


def check_on_gpu(which: str, fn, cases=EXERCISE_GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 08.1 (``which="turn"``) or 08.2 (``"tiles"``) on a Hopper GPU: the whole kernel
    with ``fn`` in it, on fresh random inputs of awkward shapes, against float64."""
    import torch

    from fa4_final.runtime.prologue import forward_into
    from utils import checks

    def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
        forward_into(q, k, v, out, lse, causal, softmax_scale, (None, None), config)
        return out, lse

    fns = {"turn_fn": fn} if which == "turn" else {"tile_loop_fn": fn}
    ok, lines = True, []
    with exercise_kernel(**fns):
        for b, sq, sk, h, hk, d, causal, dtype in cases:
            case_ok, line = checks.check_random_case(
                attention_into, b, sq, sk, h, hk, d, causal, getattr(torch, dtype),
                config=exercise_config(d, causal, which))
            ok &= case_ok
            lines.append(line)
    return ok, lines


# ----------------------------------------------------------------------------------------------
# Exercise 08.1: the ping-pong turn (Note [Turns] in fa4_final.hopper.fwd)

TURN_WG0 = int(NamedBarrier.TURN_WG0)
EPILOGUE_BARRIER = int(NamedBarrier.EPILOGUE)
PAIR = 2 * THREADS_PER_WARPGROUP  # threads on a turn barrier: 128 sync, 128 arrive


@cute.jit
def pingpong_turn(wg: Int32, num_wgs: cutlass.Constexpr[int], first_of_cta, last_of_cta,
                  issue_gemms):
    """Reference: one turn of consumer warpgroup ``wg`` (the kernel's turn_begin, the issue,
    turn_end). Warpgroup w waits on barrier TURN_WG0 + w and hands on to TURN_WG0 + w + 1."""
    if (wg > 0) | (not first_of_cta):  # warpgroup 0's very first turn: nobody came before
        cute.arch.barrier(barrier_id=int(NamedBarrier.TURN_WG0) + wg,
                          number_of_threads=2 * THREADS_PER_WARPGROUP)
    issue_gemms()
    if (wg < num_wgs - 1) | (not last_of_cta):  # the last one's very last turn: nobody follows
        next_wg = wg + 1
        if next_wg == num_wgs:
            next_wg = Int32(0)
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.TURN_WG0) + next_wg,
                                 number_of_threads=2 * THREADS_PER_WARPGROUP)


def _number(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise AssertionError(f"{what} should be a plain integer expression of wg and num_wgs; "
                             f"got {value!r}") from None


def _plain_with(fn, **names):
    """``fn``'s plain Python (host_emulation.plain) with some global names replaced."""
    import types

    raw = plain(fn)
    return types.FunctionType(raw.__code__, {**raw.__globals__, **names}, raw.__name__,
                              raw.__defaults__, raw.__closure__)


def record_turn(fn, wg: int, num_wgs: int, first: bool, last: bool) -> list[tuple]:
    """Run one turn of ``fn`` (exercise 08.1's signature) as plain Python with recording
    stand-ins: [("sync", barrier, threads) | ("issue",) | ("arrive", barrier, threads), ...]."""
    import cutlass as cutlass_module

    events: list[tuple] = []

    def barrier(*, barrier_id=None, number_of_threads=None, **_):
        if barrier_id is None or number_of_threads is None:
            raise AssertionError("give cute.arch.barrier both barrier_id= and "
                                 "number_of_threads=: without them it is __syncthreads(), "
                                 "which every thread of the CTA, the producer too, must reach")
        events.append(("sync", _number(barrier_id, "barrier_id"),
                       _number(number_of_threads, "number_of_threads")))

    def barrier_arrive(*, barrier_id=None, number_of_threads=None, **_):
        if barrier_id is None or number_of_threads is None:
            raise AssertionError("give cute.arch.barrier_arrive both barrier_id= and "
                                 "number_of_threads=")
        events.append(("arrive", _number(barrier_id, "barrier_id"),
                       _number(number_of_threads, "number_of_threads")))

    run = _plain_with(fn, Int32=int)
    with python_loops(), patched(cute.arch, barrier=barrier, barrier_arrive=barrier_arrive), \
            patched(cutlass_module, Int32=int):
        run(wg, num_wgs, first, last, lambda: events.append(("issue",)))
    return events


def _turn_shape_mistake(events: list[tuple], wg: int, num_wgs: int, first: bool,
                        last: bool) -> str | None:
    """The first slip in one recorded turn, in words (None: none found)."""
    what = f"warpgroup {wg} of {num_wgs}" + (", the CTA's first turn" if first else "") + (
        ", the CTA's last turn" if last else "")
    kinds = [e[0] for e in events]
    if kinds.count("issue") != 1:
        return (f"{what}: your turn calls issue_gemms() {kinds.count('issue')} times; a turn "
                f"issues the warpgroup's GEMMs exactly once, between waiting for the turn and "
                f"handing it on")
    at = kinds.index("issue")
    if "arrive" in kinds[:at]:
        return (f"{what}: you hand the turn on (bar.arrive) before issuing your GEMMs: the "
                f"next warpgroup may then issue before you, an unordered issue")
    if "sync" in kinds[at:]:
        return (f"{what}: you wait for your turn (bar.sync) after issuing your GEMMs: the "
                f"GEMM issue is not guarded by the turn at all")
    if kinds.count("sync") > 1 or kinds.count("arrive") > 1:
        return (f"{what}: one turn waits once (bar.sync on its own barrier) and hands on once "
                f"(bar.arrive on the next warpgroup's); you recorded {kinds}")
    for kind, barrier, threads in (e for e in events if e[0] != "issue"):
        if barrier == 0:
            return (f"{what}: barrier 0 is __syncthreads(), which every thread of the CTA must "
                    f"reach, the producer warpgroup too: the turns need barriers of their own "
                    f"(NamedBarrier.TURN_WG0 + w)")
        if barrier == EPILOGUE_BARRIER:
            return (f"{what}: barrier {barrier} is the epilogue's (NamedBarrier.EPILOGUE), which "
                    f"all consumer threads use to share the O buffer; the turns start at "
                    f"NamedBarrier.TURN_WG0 = {TURN_WG0}")
        if not 0 < barrier < 16:
            return f"{what}: barrier {barrier} does not exist: an SM has named barriers 0-15"
        if threads != PAIR:
            why = ("128 completes it as soon as this warpgroup's own threads get there, so "
                   "nobody waits for anybody" if threads == THREADS_PER_WARPGROUP else
                   "that many threads never meet there, so it never completes")
            return (f"{what}: bar.{kind} with number_of_threads={threads}: a turn barrier is "
                    f"met by two warpgroups, 128 threads that sync and 128 that arrive, so it "
                    f"counts {PAIR}; {why}")
    return None


def simulate_pingpong(behaviour: dict, num_wgs: int, turns: int, seed: int) -> dict:
    """Replay recorded turns (``behaviour[(wg, first, last)]``: record_turn's events) of
    ``num_wgs`` warpgroups that each take ``turns`` turns, the warpgroups scheduled in a random
    order (``seed``). Named barriers as the hardware counts them: a barrier completes when
    ``threads`` have arrived (128 per bar.sync or bar.arrive of a warpgroup) and releases the
    warpgroups syncing on it. Returns {"issues": [(turn, wg), ...], "stuck": {wg: (turn,
    barrier)}, "pending": {barrier: threads}, "mixed": [barrier, ...]}."""
    rng = random.Random(seed)
    count: dict[int, int] = {}
    need: dict[int, set] = {}
    waiting: dict[int, list] = {}
    pos = [0] * num_wgs  # next turn of each warpgroup
    step = [0] * num_wgs  # next event of that turn
    blocked: dict[int, int] = {}  # wg -> barrier it syncs on
    issues = []

    def events(w):
        return behaviour[(w, pos[w] == 0, pos[w] == turns - 1)]

    def arrive(barrier, threads):
        need.setdefault(barrier, set()).add(threads)
        count[barrier] = count.get(barrier, 0) + THREADS_PER_WARPGROUP
        if count[barrier] >= threads:
            count[barrier] -= threads
            for w in waiting.pop(barrier, []):
                blocked.pop(w, None)

    while True:
        ready = [w for w in range(num_wgs) if pos[w] < turns and w not in blocked]
        if not ready:
            break
        w = rng.choice(ready)
        ev = events(w)
        if step[w] == len(ev):
            pos[w], step[w] = pos[w] + 1, 0
            continue
        e = ev[step[w]]
        step[w] += 1
        if e[0] == "issue":
            issues.append((pos[w], w))
        elif e[0] == "arrive":
            arrive(e[1], e[2])
        else:
            blocked[w] = e[1]
            waiting.setdefault(e[1], []).append(w)
            arrive(e[1], e[2])
    return {"issues": issues,
            "stuck": {w: (pos[w], blocked[w]) for w in blocked if pos[w] < turns},
            "pending": {b: n for b, n in count.items() if n},
            "mixed": [b for b, ns in need.items() if len(ns) > 1]}


def _turn_hint(wg: int, first: bool) -> str:
    if wg == 0 and first:
        return (" Warpgroup 0's very first turn has nobody before it: if it waits, nobody "
                "ever arrives.")
    return (" A warpgroup that does not hand the turn on leaves the next one waiting forever: "
            "only the last warpgroup's very last turn may skip the arrive.")


def check_turn_rules(fn) -> None:
    """Exercise 08.1 without compiling: ``fn`` recorded turn by turn (plain Python), each turn's
    shape checked, then the recorded behaviour replayed by 2 and 3 warpgroups over CTAs of 1-9
    turns, in many random interleavings: no deadlock, GEMMs issued in turn order, no arrive
    pending at the CTA's exit."""
    from cutlass.base_dsl.common import DSLBaseError

    for num_wgs in (2, 3):
        behaviour = {}
        for wg in range(num_wgs):
            for first in (False, True):
                for last in (False, True):
                    try:
                        ev = record_turn(fn, wg, num_wgs, first, last)
                    except DSLBaseError as exc:
                        raise AssertionError(
                            "write the barriers in the turn itself with cute.arch.barrier and "
                            "cute.arch.barrier_arrive (a nested @cute.jit helper cannot run "
                            f"here: {type(exc).__name__})") from None
                    mistake = _turn_shape_mistake(ev, wg, num_wgs, first, last)
                    if mistake:
                        raise AssertionError(mistake + ".")
                    behaviour[(wg, first, last)] = ev
        for turns in (1, 2, 3, 5, 9):
            want = [(t, w) for t in range(turns) for w in range(num_wgs)]
            for seed in range(12):
                res = simulate_pingpong(behaviour, num_wgs, turns, seed)
                where = f"{num_wgs} warpgroups taking {turns} turns each"
                if res["mixed"]:
                    raise AssertionError(
                        f"{where}: barrier {res['mixed'][0]} is used with different thread "
                        f"counts; every bar.sync and bar.arrive on one barrier names the same")
                if res["stuck"]:
                    w, (t, b) = min(res["stuck"].items(), key=lambda kv: (kv[1][0], kv[0]))
                    raise AssertionError(
                        f"{where}: deadlock, warpgroup {w} waits forever on barrier {b} at "
                        f"its turn {t}.{_turn_hint(w, t == 0)}")
                if res["issues"] != want:
                    bad = next(i for i, (a, b) in enumerate(zip(res["issues"], want)) if a != b)
                    (t, w), (t2, w2) = res["issues"][bad], want[bad]
                    raise AssertionError(
                        f"{where}: unordered issue, warpgroup {w} issued the GEMMs of its turn "
                        f"{t} while warpgroup {w2}'s turn {t2} was due: the turns must go "
                        f"(0, wg 0), (0, wg 1), ..., (1, wg 0), ...; each warpgroup waits on its "
                        f"own barrier and hands on to the next one's, only warpgroup 0's very "
                        f"first turn skips the wait")
                if res["pending"]:
                    b, n = next(iter(res["pending"].items()))
                    raise AssertionError(
                        f"{where}: {n} threads' arrive left pending on barrier {b} when the "
                        f"CTA exits: the last warpgroup's very last turn must not hand the "
                        f"turn on, nobody will take it")


_turn_rules = check_turn_rules  # (a private name: the workshop guide lists its messages too)
_BAR = re.compile(r"\bbar\.(sync|arrive)\s+(%r\d+|\d+),\s*(\d+);")


def turn_ptx_facts(ptx: str) -> dict:
    """The PTX's named-barrier instructions whose id is a register (the turns; the epilogue's
    is the constant 1): how many of each and the thread counts they name."""
    found = {"sync": [], "arrive": []}
    for kind, barrier, threads in _BAR.findall(ptx):
        if barrier.startswith("%r"):
            found[kind].append(int(threads))
    return found


def check_turn(fn, compile_check: bool = True) -> None:
    """Exercise 08.1: ``check_turn_rules``, then the kernel compiled for sm_90a with ``fn`` as
    its turn (D = 128, two consumer warpgroups): every turn barrier in the PTX counts 256
    threads, and in the steady KV step's SASS the BAR.SYNC comes before the first HGMMA and
    the BAR.ARV after the last."""
    _turn_rules(fn)
    if not compile_check:
        return
    art = compile_exercise(128, False, turn_fn=fn)
    facts = turn_ptx_facts(art.ptx)
    if not facts["sync"] or not facts["arrive"]:
        raise AssertionError(f"compiled for sm_90a, the kernel has {len(facts['sync'])} turn "
                             f"bar.sync and {len(facts['arrive'])} bar.arrive: the turns are "
                             f"missing")
    wrong = sorted({n for n in facts["sync"] + facts["arrive"] if n != PAIR})
    if wrong:
        raise AssertionError(f"compiled for sm_90a, a turn barrier counts {wrong} threads in the "
                             f"PTX, not {PAIR}")
    ops = [op for op, _ in steady_loop(art.sass)]
    gemms = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    syncs = [i for i, op in enumerate(ops) if op.startswith("BAR.SYNC")]
    arrives = [i for i, op in enumerate(ops) if op.startswith("BAR.ARV")]
    if not (syncs and arrives and syncs[0] < gemms[0] and arrives[-1] > gemms[-1]):
        raise AssertionError("compiled for sm_90a, the steady KV step's SASS does not wait for "
                             "its turn (BAR.SYNC) before its first HGMMA and hand it on "
                             "(BAR.ARV) after its last")


# ----------------------------------------------------------------------------------------------
# Exercise 08.2: the persistent tile loop (walk_tiles in fa4_final.hopper.fwd)


@cute.jit
def tile_loop(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k, state_v, visit):
    """Reference: the kernel's walk over CTA ``cta``'s tiles in zigzag rounds (walk_tiles
    without a table)."""
    for r in cutlass.range(rounds(num_tiles, grid), unroll=1):
        tile = zigzag_tile(r, cta, grid)
        if tile < num_tiles:
            last = zigzag_tile(r + 1, cta, grid) >= num_tiles
            state_q, state_k, state_v = visit(tile, r, last, state_q, state_k, state_v)


class _States:
    """A stand-in for the three rings' states after a given tile: visit returns new ones."""

    def __init__(self, after: int):
        self.after = after


def record_tiles(fn, num_tiles: int, cta: int, grid: int) -> list[tuple]:
    """Run ``fn`` (exercise 08.2's signature) for one CTA as plain Python: the (tile, r, last)
    of every visit, in order. visit checks that it gets the states the previous visit
    returned (the loop must carry them)."""
    import cutlass as cutlass_module

    visits: list[tuple] = []
    start = tuple(_States(-1) for _ in range(3))

    def visit(tile, r, last, sq, sk, sv):
        tile, r = _number(tile, "the tile"), _number(r, "r")
        if not all(isinstance(x, _States) for x in (sq, sk, sv)):
            raise AssertionError("pass visit the three states in order: visit(tile, r, last, "
                                 "state_q, state_k, state_v)")
        before = visits[-1][0] if visits else -1
        if any(x.after != before for x in (sq, sk, sv)):
            raise AssertionError(
                f"CTA {cta}: tile {tile} got the rings' states from before the CTA's previous "
                f"tile: rebind them in the loop body, state_q, state_k, state_v = visit(...), "
                f"so the loop carries them from tile to tile (the rings' slots and phases run "
                f"on across tiles, Note [Phases])")
        visits.append((tile, r, bool(last)))
        return tuple(_States(tile) for _ in range(3))

    run = _plain_with(fn, Int32=int)
    with python_loops(), patched(cutlass_module, Int32=int):
        run(num_tiles, cta, grid, *start, visit)
    return visits


TILE_LOOP_CASES = [(1, 1), (5, 5), (7, 3), (10, 4), (9, 7), (132, 132), (133, 132),
                   (263, 132), (1376, 132), (2048, 132), (45, 7)]


def check_tile_loop_rules(fn) -> None:
    """Exercise 08.2 without compiling: every CTA of many grids run as plain Python; every
    tile computed exactly once, r = 0 on a CTA's first tile, ``last`` on its last tile only,
    the states carried, and longest-first causal tiles balanced within 1% of the ideal."""
    for num_tiles, grid in TILE_LOOP_CASES:
        owner: dict[int, int] = {}
        for cta in range(grid):
            visits = record_tiles(fn, num_tiles, cta, grid)
            where = f"{num_tiles} tiles on {grid} CTAs, CTA {cta}"
            for i, (tile, r, last) in enumerate(visits):
                if not 0 <= tile < num_tiles:
                    raise AssertionError(
                        f"{where} visited tile {tile}, but the tiles are 0..{num_tiles - 1}: the "
                        f"last round is partial, so test tile < num_tiles before visiting")
                if tile in owner:
                    raise AssertionError(f"{where}: tile {tile} is computed twice, by CTA "
                                         f"{owner[tile]} and by CTA {cta}")
                owner[tile] = cta
                if i == 0 and r != 0:
                    raise AssertionError(
                        f"{where}: its first tile came with r = {r}; the kernel takes r == 0 as "
                        f"a CTA's first tile (its first turn does not wait, Note [Turns]): pass "
                        f"the round index")
                if last != (i == len(visits) - 1):
                    raise AssertionError(
                        f"{where}: tile {tile} came with last={last} but "
                        + ("the CTA computes more tiles after it: the last warpgroup would stop "
                           "handing the turn on and the next one waits forever"
                           if last else "it is the CTA's last: its last turn would hand the "
                           "turn on to nobody and an arrive stays pending at exit")
                        + "; last is whether the next round's tile is past num_tiles")
        missing = sorted(set(range(num_tiles)) - set(owner))
        if missing:
            raise AssertionError(f"{num_tiles} tiles on {grid} CTAs: tile(s) {missing[:5]} are "
                                 f"computed by no CTA; round r hands out tiles r*grid to "
                                 f"r*grid + grid - 1, one per CTA")
    b = schedule_balance_of(fn)
    if b["imbalance"] > 0.01:
        raise AssertionError(
            f"causal tiles longest first (128 m_blocks x 16 heads on 132 CTAs): the busiest CTA "
            f"has {b['worst']} KV steps, {b['imbalance']:.1%} over the ideal {b['ideal']:.0f}. "
            f"Longest-first tiles get shorter within every round: reverse the order of every "
            f"other round, so the CTA that took the longest tile of one round takes the "
            f"shortest of the next")


_tile_rules = check_tile_loop_rules


def schedule_balance_of(fn, num_m_blocks: int = 128, heads: int = 16, grid: int = 132) -> dict:
    """The busiest CTA's KV steps against the ideal when ``fn`` (exercise 08.2) walks causal
    tiles longest first (tile t costs its m_block + 1 KV steps)."""
    n = num_m_blocks * heads
    per_cta = [sum(causal_cost(t, num_m_blocks, heads) for t, _, _ in
                   record_tiles(fn, n, cta, grid)) for cta in range(grid)]
    ideal = sum(causal_cost(t, num_m_blocks, heads) for t in range(n)) / grid
    return {"worst": max(per_cta), "ideal": ideal, "imbalance": max(per_cta) / ideal - 1.0}


def check_tile_loop(fn, compile_check: bool = True) -> None:
    """Exercise 08.2: ``check_tile_loop_rules``, then the kernel compiled for sm_90a with ``fn``
    as both roles' tile loop (D = 128, causal, zigzag rounds): it compiles (the loop carries
    the rings' states) and nothing spills to local memory."""
    _tile_rules(fn)
    if not compile_check:
        return
    try:
        art = compile_exercise(128, True, tile_loop_fn=fn)
    except Exception as exc:
        if "dominate" not in str(exc):
            raise
        raise AssertionError(
            "the loop runs right as Python but does not compile: a value made inside the loop "
            "(the states visit returns) must be rebound in the loop body itself, and nothing "
            "made inside a dynamic if may be used after it") from None
    if art.spills or "ld.local" in art.ptx:
        raise AssertionError(f"compiled for sm_90a, the kernel spills ({art.spills} spill "
                             f"instructions): keep the loop's arithmetic to the few integers "
                             f"it needs")


def causal_cost(t: int, num_m_blocks: int, heads: int) -> int:
    """KV steps of causal tile t in longest-first order (tile_coords): m_block + 1."""
    return tile_coords(t, num_m_blocks, heads, 1, True)[0] + 1


# ----------------------------------------------------------------------------------------------
# Exercise 08.3: the shared-memory budget (Note [Head dims] in fa4_final.hopper.config)


class _Budgeted:
    """A config whose own ``smem_bytes`` is not to be called: every other field is ``cfg``'s."""

    def __init__(self, cfg):
        self._cfg = cfg

    def __getattr__(self, name):
        if name == "smem_bytes":
            raise AssertionError("your code calls cfg.smem_bytes: that is the kernel's own "
                                 "answer; add up the buffers yourself")
        return getattr(self._cfg, name)

    def __repr__(self):
        return repr(self._cfg)


# the usual slips of a budget, each a flag of _budget, and what it is in words
_BUDGET_SLIPS = {
    "v_at_d": "V's tiles counted at D instead of dv (a V tile is tile_n x dv)",
    "o_at_d": "O counted at D instead of dv (O is tile_m x dv)",
    "o_over_q_counted": "O counted though it lies over Q (separate_o=False: O has no bytes of "
                        "its own)",
    "o_left_out": "O's own buffer left out (separate_o=True: tile_m x dv bytes of its own)",
    "tile_n_128": "tile_n taken as 128 (read cfg.tile_n: this config has fewer keys a stage)",
    "no_align": "the buffers not rounded up to 1 KB each (the 128 B swizzle repeats every 1 KB)",
    "no_barriers": "the barriers' own 1 KB block left out",
}
BUDGET_SLIPS = _BUDGET_SLIPS


def _budget(cfg, head_dim: int, dv: int, elem_bytes: int = 2, slips=()) -> int:
    """The budget as smem_bytes_reference counts it, with some of BUDGET_SLIPS made."""
    def align(n):
        return n if "no_align" in slips else -(-n // 1024) * 1024

    tile_n = 128 if "tile_n_128" in slips else cfg.tile_n
    barriers = 0 if "no_barriers" in slips else 8 * 2 * (1 + cfg.stages_k + cfg.stages_v)
    has_o = (cfg.separate_o or "o_over_q_counted" in slips) and "o_left_out" not in slips
    o_cols = head_dim if "o_at_d" in slips else dv
    v_cols = head_dim if "v_at_d" in slips else dv
    return (align(barriers) + align(cfg.tile_m * head_dim * elem_bytes)
            + align(cfg.stages_k * tile_n * head_dim * elem_bytes)
            + align(cfg.stages_v * tile_n * v_cols * elem_bytes)
            + align(cfg.tile_m * o_cols * elem_bytes if has_o else 0))


def active_slips(cfg, head_dim: int, dv: int) -> list[str]:
    """The BUDGET_SLIPS that change this case's budget."""
    right = _budget(cfg, head_dim, dv)
    return [s for s in BUDGET_SLIPS if _budget(cfg, head_dim, dv, slips=(s,)) != right]


def budget_slips(cfg, head_dim: int, dv: int, got: int, cleared=(), most: int = 3
                 ) -> list[tuple]:
    """The fewest BUDGET_SLIPS (up to ``most``, each one that changes this case's budget) whose
    budget comes to ``got``: every such set. Slips in ``cleared`` (cases the answer got right
    would have shown them) are tried last."""
    from itertools import combinations

    active = active_slips(cfg, head_dim, dv)
    for pool in ([s for s in active if s not in cleared], active):
        for size in range(1, most + 1):
            found = [s for s in combinations(pool, size)
                     if not {"o_over_q_counted", "o_left_out"} <= set(s)
                     and _budget(cfg, head_dim, dv, slips=s) == got]
            if found:
                return found
    return []


def describe_config(cfg) -> str:
    o = "O's own buffer" if cfg.separate_o else "O over Q"
    return (f"tile_m {cfg.tile_m} x tile_n {cfg.tile_n}, {cfg.stages_k} K + {cfg.stages_v} V "
            f"stages, {o}")


def _smem_cases():
    from fa4_final.hopper.config import HopperFwdConfig as C

    # (config, D, dv): D = dv, 128 keys and O's own buffer first (the timed defaults), then
    # the head dims of Note [Head dims]: tile_n 64 with O over Q, O over Q at dv < D, dv > D
    # with O's own buffer, and a tile of 80 keys
    return [(C(), 128, 128), (C(stages_k=3), 128, 128),
            (C(num_consumer_wgs=3, stages_k=3, stages_v=3), 64, 64),
            (C(num_consumer_wgs=1, pingpong=False, stages_k=4, stages_v=3), 128, 128),
            (C(stages_k=1, stages_v=1), 64, 64),
            (C(tile_n=64, stages_k=3, separate_o=False), 256, 256),
            (C(stages_k=2, separate_o=False), 192, 128),
            (C(stages_k=3), 64, 128),
            (C(tile_n=80, stages_k=2), 192, 64)]


def check_smem_bytes(fn) -> None:
    """Exercise 08.3: ``fn(cfg, head_dim, elem_bytes=2, head_dim_v=None) -> bytes`` equals the
    kernel's SharedStorage size (HopperFwdConfig.smem_bytes, asserted against the struct when
    the kernel is traced) for configs of every head dim, computed from the config's fields, not
    by asking the config. A wrong budget is matched against the usual slips (BUDGET_SLIPS)."""
    cleared: set[str] = set()  # slips a case already passed would have shown
    for cfg, d, dv in _smem_cases():
        want = cfg.smem_bytes(d, head_dim_v=dv)
        try:
            got = fn(_Budgeted(cfg), d) if dv == d else fn(_Budgeted(cfg), d, head_dim_v=dv)
        except TypeError as exc:
            if "head_dim_v" not in str(exc):
                raise
            raise AssertionError("smem_bytes must take head_dim_v=..., dv, the head dim of V "
                                 "and O (None: the same as D)") from None
        if got == want:
            cleared.update(active_slips(cfg, d, dv))
            continue
        where = (f"{describe_config(cfg)}, at D = {d}, dv = {dv}: got {got} B, the kernel's "
                 f"struct has {want} B")
        found = budget_slips(cfg, d, dv, got, cleared)
        if found:
            reads = " or with ".join(
                " and ".join(_BUDGET_SLIPS[s] for s in slips)
                for slips in found)
            raise AssertionError(f"{where}: your number is the budget with {reads}")
        raise AssertionError(
            f"{where}: count the barriers' block, Q (tile_m x D), the K ring (stages_k x tile_n "
            f"x D), the V ring (stages_v x tile_n x dv) and O (tile_m x dv, only with "
            f"cfg.separate_o), each rounded up to 1024 B for the 128 B swizzle")


def _smem_forbid() -> dict:
    from fa4_final.hopper.config import HopperFwdConfig

    return {HopperFwdConfig.smem_bytes: "that is the kernel's own answer; add up the buffers "
                                        "yourself"}


def smem_bytes_reference(cfg, head_dim: int, elem_bytes: int = 2, head_dim_v=None) -> int:
    """Reference for exercise 08.3: the buffers of the SharedStorage struct, each 1 KB
    aligned (the split tail's count and the tile ring sit in the barriers' block)."""
    def align(n):
        return -(-n // 1024) * 1024

    dv = head_dim if head_dim_v is None else head_dim_v
    barriers = 8 * 2 * (1 + cfg.stages_k + cfg.stages_v)
    q = cfg.tile_m * head_dim * elem_bytes
    k = cfg.tile_n * head_dim * elem_bytes
    v = cfg.tile_n * dv * elem_bytes
    o = cfg.tile_m * dv * elem_bytes if cfg.separate_o else 0  # else O lies over Q
    return align(barriers) + align(q) + align(cfg.stages_k * k) + align(cfg.stages_v * v) + align(o)


SMEM_FORBID = _smem_forbid()


# ----------------------------------------------------------------------------------------------
# Exercise 08.4: a tile for a large head dim

FIT_STAGES_K = (2, 3)
FIT_TABLE_PAIRS = [(d, dv) for d in (128, 192, 256) for dv in (64, 96, 128, 192, 256)
                   if max(d, dv) > 128]
FIT_STAGES_V = 2
# the FA4 package's sm90 forward tile_n (tile_m 128 at D >= 128), non-causal and not local, at
# the head dims where it is not 128 (flash_attn/cute/interface.py, _tile_size_fwd_sm90,
# flash-attn-4 4.0.0b36)
FA4_SM90_TILE_N = {(192, 192): 112, (192, 256): 112, (256, 64): 80, (256, 96): 80,
                   (256, 128): 80, (256, 192): 80, (256, 256): 80}


def keys_in_flight(cfg) -> int:
    """Keys the K and V rings hold at once."""
    return cfg.tile_n * (cfg.stages_k + cfg.stages_v)


def fit_rank(cfg) -> tuple:
    """Exercise 08.4's order: the most keys in flight, then the larger tile_n (fewer steps for
    the same keys), then O's own buffer."""
    return keys_in_flight(cfg), cfg.tile_n, cfg.separate_o


def over_q_allowed(head_dim: int, dv: int) -> bool:
    """O may be written over Q's buffer: its rows fit in Q's rows and share the swizzle atom."""
    return dv <= head_dim and head_dim % 64 == 0 and dv % 64 == 0


def fit_tile_reference(head_dim: int, dv: int):
    """Reference for exercise 08.4: of the configs of two consumer warpgroups with tile_n from
    FWD_TILE_NS, two or three K stages and two V stages, the first by fit_rank whose buffers fit
    227 KB."""
    from fa4_final.common.constants import SM90_SMEM_BYTES
    from fa4_final.hopper.config import FWD_TILE_NS, HopperFwdConfig

    best = None
    for tile_n in FWD_TILE_NS:
        for stages_k in FIT_STAGES_K:
            for separate_o in (True, False) if over_q_allowed(head_dim, dv) else (True,):
                cfg = HopperFwdConfig(tile_n=tile_n, stages_k=stages_k, stages_v=FIT_STAGES_V,
                                      separate_o=separate_o)
                fits = smem_bytes_reference(cfg, head_dim, head_dim_v=dv) <= SM90_SMEM_BYTES
                if fits and (best is None or fit_rank(cfg) > fit_rank(best)):
                    best = cfg
    return best


def fit_cases() -> list[tuple[int, int]]:
    """Every (D, dv) of the forward, the large and the unequal ones first."""
    from fa4_final.common.constants import FWD_HEAD_DIMS

    first = [(256, 256), (128, 256), (192, 128), (192, 192), (256, 192), (128, 128)]
    return first + [(d, dv) for d in FWD_HEAD_DIMS for dv in FWD_HEAD_DIMS
                    if (d, dv) not in first]


def _fit_mistake(cfg, d: int, dv: int) -> str | None:
    """What is wrong with ``cfg`` as exercise 08.4's answer at (d, dv), in words; None: right."""
    from fa4_final.common.constants import SM90_SMEM_BYTES
    from fa4_final.hopper.config import FWD_TILE_NS, HopperFwdConfig

    where = f"D = {d}, dv = {dv}"
    if cfg is None:
        hint = (" O written over Q (separate_o=False) frees tile_m x dv bytes here."
                if over_q_allowed(d, dv) else "")
        return (f"{where}: fit_tile returned None: none of the configs you tried fits "
                f"{SM90_SMEM_BYTES // 1024} KB.{hint}")
    if not isinstance(cfg, HopperFwdConfig):
        return (f"{where}: return a HopperFwdConfig (e.g. HopperFwdConfig(tile_n=..., "
                f"stages_k=..., separate_o=...)), not {type(cfg).__name__}")
    n = cfg.tile_n
    if isinstance(n, bool) or not isinstance(n, int) or n % 16:
        return (f"{where}: tile_n = {n!r} is not a multiple of 16: the P V wgmma takes its keys "
                f"(its K) 16 at a time")
    if n not in FWD_TILE_NS:
        return f"{where}: tile_n = {n}: the kernel takes tile_n from FWD_TILE_NS = {FWD_TILE_NS}"
    if cfg.num_consumer_wgs != 2:
        return f"{where}: keep two consumer warpgroups (tile_m = 128), as HopperFwdConfig() has"
    if cfg.stages_v != FIT_STAGES_V or cfg.stages_k not in FIT_STAGES_K:
        return (f"{where}: {cfg.stages_k} K and {cfg.stages_v} V stages: keep two V stages and "
                f"choose two or three K stages")
    if not cfg.separate_o and dv > d:
        return (f"{where}: O over Q where dv > D is not allowed: O's tile (tile_m x dv) is "
                f"larger than Q's buffer (tile_m x D); keep separate_o=True")
    if not cfg.separate_o and not over_q_allowed(d, dv):
        return (f"{where}: O over Q needs D and dv multiples of 64 (one 128 B swizzle atom, so "
                f"O's rows lie in Q's rows); keep separate_o=True")
    used = cfg.smem_bytes(d, head_dim_v=dv)
    if used > SM90_SMEM_BYTES:
        return (f"{where}: {describe_config(cfg)} takes {used / 1024:.0f} KB, over the budget "
                f"of {SM90_SMEM_BYTES // 1024} KB by {(used - SM90_SMEM_BYTES) / 1024:.0f} KB")
    best = fit_tile_reference(d, dv)
    if keys_in_flight(cfg) < keys_in_flight(best):
        levers = []
        if best.tile_n != cfg.tile_n:
            levers.append(f"{best.tile_n} keys a stage")
        if best.stages_k != cfg.stages_k:
            levers.append(f"{best.stages_k} K stages")
        if cfg.separate_o and not best.separate_o:
            levers.append("O written over Q")
        return (f"{where}: {describe_config(cfg)}: {keys_in_flight(cfg)} keys in flight, "
                f"but {keys_in_flight(best)} fit in {SM90_SMEM_BYTES // 1024} KB, with "
                + " and ".join(levers))
    if best.tile_n > cfg.tile_n:
        return (f"{where}: the same {keys_in_flight(cfg)} keys in flight fit with "
                f"{best.tile_n} keys a stage: at equal keys take the larger tile_n (fewer, "
                f"larger steps)")
    if best.separate_o and not cfg.separate_o:
        return (f"{where}: O's own buffer fits with the same keys in flight: keep it "
                f"(separate_o=True), so that the next tile's Q load need not wait for this "
                f"tile's O store")
    return None


def check_fit_tile(fn) -> None:
    """Exercise 08.4: ``fn(d, dv)`` returns, for every (D, dv) of the forward, a config that is
    allowed (tile_n, stages, O over Q), fits 227 KB by the kernel's own budget, and comes first
    by fit_rank among the exercise's configs that fit."""
    for d, dv in fit_cases():
        try:
            cfg = fn(d, dv)
        except ValueError:  # "nothing fits"
            cfg = None
        mistake = _fit_mistake(cfg, d, dv)
        if mistake:
            raise AssertionError(mistake)


def _fit_forbid() -> dict:
    from fa4_final.hopper import config

    why = "that is the package's own choice; fit the tile yourself"
    return {config.hopper_fwd_default: why, config._fit: why}


FIT_FORBID = _fit_forbid()


def fit_table(fit) -> list[str]:
    """Lines: per (D, dv) with D >= 128 and D or dv above 128 (FIT_TABLE_PAIRS), the exercise's
    fit, the package's default (hopper_fwd_default, non-causal) and the FA4 package's tile_n."""
    from fa4_final.hopper.config import hopper_fwd_default

    def cell(cfg, d, dv):
        o = "own O" if cfg.separate_o else "O on Q"
        return (f"{cfg.tile_n:3d} keys {cfg.stages_k}+{cfg.stages_v} {o:6s} "
                f"{cfg.smem_bytes(d, head_dim_v=dv) / 1024:3.0f} KB")

    lines = [f"{'D':>3s} {'dv':>3s}  {'your fit':26s}  {'package default':26s}  FA4 tile_n"]
    for d, dv in FIT_TABLE_PAIRS:
        lines.append(f"{d:3d} {dv:3d}  {cell(fit(d, dv), d, dv):26s}  "
                     f"{cell(hopper_fwd_default(d, head_dim_v=dv), d, dv):26s}  "
                     f"{FA4_SM90_TILE_N.get((d, dv), 128):6d}")
    return lines


FEATURES = "features_more"  # results/h200/features_more.json (measure.features, 24 shapes)
FA4_TILE_CASES = ("d192", "d256")  # the cases measure.features times with FA4's tile_n too


def fa4_tile_lines(res, mode: str = "flush") -> list[str]:
    """Per shape of measure.features at D = dv = 192 and 256: the kernel with the FA4
    package's tile_n (exercise 08.4's fit there) over the same kernel with 64 keys in three K
    stages (what compiling alone picks), with the verdict against the rows' spreads."""
    lines = []
    shapes = sorted({(r["case"], r["s"], bool(r["causal"])) for r in res.rows
                     if r.get("case") in FA4_TILE_CASES and r.get("mode") == mode})
    for case, s, causal in shapes:
        tile, keys64 = features.tile_pair(features.shape_rows(res, case, s, causal, mode))
        head = f"{case:5s} S={s:5d} {'causal' if causal else 'dense '}"
        cmp = bench.compare(tile, keys64) if tile and keys64 else None
        if cmp is None:
            why = next((r.get("error") for r in (tile, keys64) if r and r.get("error")),
                       "not timed")
            lines.append(f"{head}: {why}")
        else:
            lines.append(f"{head}: FA4's tile over 64 keys, 3+2 stages {cmp}")
    return lines or ["no D = 192 or 256 rows in this file"]


def fa4_tile_ratio(res, case: str = "d256", s: int = 16384, causal: bool = False):
    """The speed of FA4's tile over the 64-key tile at one shape (L2 flushed); None if either
    was not timed."""
    return features.tile_ratio(res, case, s, causal)


TILE_LOOP_FORBID = {
    zigzag_tile: "write the zigzag index yourself: it is what balances the causal tiles",
    HopperForward.walk_tiles: "that is the kernel's own loop; write yours",
}


# ----------------------------------------------------------------------------------------------
# Reading the stored timeline (results/h200/ch08_timeline.json; fa4_final.common.timeline)

PHASE_COLOURS = {"waits for K and its turn": "#d9d9d9", "issues its GEMMs": "#4c72b0",
                 "waits for S": "#b0c4de", "softmax": "#dd8452"}


def timeline_bars(rows: list[dict], impl: str, steps: range) -> dict:
    """{role: [(phase, start, length), ...]} in cycles for the consumer warpgroups of
    ``impl``'s stored timeline, KV steps ``steps``."""
    from fa4_final.common.timeline import PHASES

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
# the tile table against dynamic tiles (Note [Dynamic tiles] in fa4_final.common.schedule)


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

    from fa4_final.common.schedule import list_schedule

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
# the split tail (Note [Split tail] in fa4_final.common.schedule)


def last_work(num_tiles: int, steps: int, grid: int, split: bool) -> list[int]:
    """Key-tile steps each CTA computes, whole last round or split (the scheduler's plan, with
    SPLIT_OVERHEAD_STEPS charged per piece), sorted from the busiest CTA down."""
    from fa4_final.common.schedule import SPLIT_OVERHEAD_STEPS, split_tail_items

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


# ----------------------------------------------------------------------------------------------
# What each idea is worth (measure.fwd_knobs --ablation: results/h200/fa4_final_ablation.json)
# and where the kernel stands (measure.benchmark: results/h200/fa4_final_fwd.json)

ABLATION = "fa4_final_ablation"
STANDING = "fa4_final_fwd"
IDEAS = ("no ping-pong", "no intra-warpgroup overlap", "O rescaled after the softmax",
         "one tile per CTA", "O over Q (no separate O buffer)", "tiles not balanced")


def _shape(r) -> tuple:
    return r["d"], r["s"], r["causal"]


def shape_name(d, s, causal) -> str:
    return f"D={d} S={s} {'causal' if causal else 'non-causal'}"


def ablation_verdicts(res) -> dict:
    """{idea: {shape: Comparison of the default against the kernel with the idea off}}: the
    ratio is the default's speed over the ablated kernel's; the verdict "faster" means the idea
    is worth more than the spread of both rows."""
    out: dict = {}
    for r in res.rows:
        if r["config"] in ("default",) or not r.get("tflops"):
            continue
        base = next(b for b in res.rows if b["config"] == "default" and _shape(b) == _shape(r))
        out.setdefault(r["config"], {})[_shape(r)] = bench.compare(base, r)
    return out


def ablation_lines(res) -> list[str]:
    """The ablation as a table: per shape the default's speed and the fastest peer's, then one
    line per idea: what switching it off costs at each shape (the default's speed over the
    ablated kernel's, '+' beyond the spread, '~' within it, '-' the ablated kernel faster)."""
    shapes = sorted({_shape(r) for r in res.rows})
    lines = []
    for sh in shapes:
        base = next(r for r in res.rows if r["config"] == "default" and _shape(r) == sh)
        lines.append(f"{shape_name(*sh):28s} default {base['tflops']:4.0f} TFLOP/s (spread "
                     f"{base['spread']:.1%}); fastest peer {base.get('best_peer')} "
                     f"{base.get('best_peer_tflops') or 0:4.0f}")
    mark = {"faster": "+", "within noise": "~", "slower": "-"}
    names = [f"D={d} {'causal' if c else 'non-c.'}" for d, _, c in shapes]
    head = f"{'switched off':34s}" + "".join(f"{n:>13s}" for n in names)
    lines += ["", head]
    verdicts = ablation_verdicts(res)
    for idea in IDEAS:
        if idea not in verdicts:
            continue
        cells = []
        for sh in shapes:
            c = verdicts[idea].get(sh)
            cells.append(f"{'-':>13s}" if c is None else f"{c.ratio:11.2f}x{mark[c.verdict]}")
        lines.append(f"{idea:34s}" + "".join(cells))
    return lines


def idea_summary(res) -> list[str]:
    """One sentence per idea, counted from the file: at how many shapes switching it off cost
    more than the spread."""
    out = []
    for idea, by in ablation_verdicts(res).items():
        n = len(by)
        beyond = sum(c.verdict == "faster" for c in by.values())
        worse = sum(c.verdict == "slower" for c in by.values())
        costs = ", ".join(f"{c.ratio:.2f}x" for c in by.values())
        out.append(f"{idea}: the default is faster beyond the spread at {beyond} of {n} shapes"
                   + (f", slower beyond it at {worse}" if worse else "")
                   + f" (default / ablated: {costs})")
    return out


def standing_lines(res) -> list[str]:
    """fa4_final and chapter 05's kernel per shape, each against the fastest peer of the same
    run, and fa4_final against chapter 05's."""
    lines = []
    for r in sorted((r for r in res.rows if r["impl"] == "fa4_final"), key=_shape):
        peer = bench.best_peer(res.rows, r)
        ch05 = next((x for x in res.rows if x["impl"] == "flash_hopper"
                     and bench.same_shape(x, r)), None)
        line = (f"{shape_name(*_shape(r)):28s} {r['tflops']:4.0f} TFLOP/s; vs {peer['impl']} "
                f"({peer['tflops']:.0f}): {bench.compare(r, peer)}")
        if ch05:
            line += f"; vs chapter 05 ({ch05['tflops']:.0f}): {bench.compare(r, ch05)}"
        lines.append(line)
    return lines


@claim("08.ablation_overlap_pays", ABLATION,
       "switching intra-warpgroup overlap off is slower beyond the spread at every shape")
def _overlap_pays(res):
    by = ablation_verdicts(res)["no intra-warpgroup overlap"]
    return (all(c.verdict == "faster" for c in by.values()),
            "; ".join(f"{shape_name(*k)} {c}" for k, c in by.items()))


@claim("08.overlap_costs_most", ABLATION,
       "by the median over the shapes, switching intra-warpgroup overlap off costs more than "
       "switching off any other idea")
def _overlap_costs_most(res):
    import statistics

    med = {i: statistics.median(c.ratio for c in by.values())
           for i, by in ablation_verdicts(res).items()}
    return (max(med, key=med.get) == "no intra-warpgroup overlap",
            ", ".join(f"{i} {v:.2f}" for i, v in med.items()))


@claim("08.pingpong_within_noise", ABLATION,
       "switching ping-pong off costs no more than the spread at any shape of the ablation")
def _pingpong_within_noise(res):
    by = ablation_verdicts(res)["no ping-pong"]
    return (all(c.verdict != "faster" for c in by.values()),
            "; ".join(f"{shape_name(*k)} {c}" for k, c in by.items()))


@claim("08.fwd_beats_ch05_at_d64", STANDING,
       "fa4_final is faster than chapter 05's kernel beyond the spread at every D = 64 shape")
def _beats_ch05(res):
    found = []
    for r in (r for r in res.rows if r["impl"] == "fa4_final" and r["d"] == 64):
        ch05 = next(x for x in res.rows
                    if x["impl"] == "flash_hopper" and bench.same_shape(x, r))
        found.append((shape_name(*_shape(r)), bench.compare(r, ch05)))
    return (bool(found) and all(c.verdict == "faster" for _, c in found),
            "; ".join(f"{s} {c}" for s, c in found))


@claim("08.fwd_within_a_tenth", STANDING,
       "fa4_final reaches at least 0.9 of the fastest peer's speed at every shape")
def _within_a_tenth(res):
    ratios = [(shape_name(*_shape(r)), bench.compare(r, bench.best_peer(res.rows, r)).ratio)
              for r in res.rows if r["impl"] == "fa4_final"]
    return (bool(ratios) and min(v for _, v in ratios) >= 0.9,
            ", ".join(f"{s} {v:.2f}" for s, v in ratios))


@claim("08.timeline_softmax_longer", "ch08_timeline",
       "in the stored timeline, the softmax phase, averaged over the two warpgroups, takes "
       "longer than half of the step's GEMM cycles (the other warpgroup's share of the tensor "
       "cores, chapter 00's model)")
def _softmax_longer(res):
    from utils import roofline

    half = roofline.tile_cycles("H100", "fwd", m=128, n=128, d=128).mma / 2
    soft = {wg: p["softmax"] for wg, p in phase_medians(res.rows, "fa4_final").items()}
    mean = sum(soft.values()) / len(soft)
    return mean > half, f"softmax medians {soft} (mean {mean:.0f}), half the GEMMs {half}"


@claim("08.timeline_tensor_cores_wait", "ch08_timeline",
       "in the stored timeline, one KV step takes longer than the GEMMs need at the full rate")
def _tensor_cores_wait(res):
    from utils import roofline

    need = roofline.tile_cycles("H100", "fwd", m=128, n=128, d=128).mma
    period = step_period(res.rows, "fa4_final")
    return period > need, f"step {period} cycles, GEMMs {need}"


def costliest_idea(res) -> str:
    """The idea whose absence costs the most: the largest median of default / ablated over the
    shapes of the ablation file."""
    import statistics

    by = ablation_verdicts(res)
    return max((i for i in IDEAS if i in by),
               key=lambda i: statistics.median(c.ratio for c in by[i].values()))


@cute.jit
def round_robin_loop(num_tiles: Int32, cta: Int32, grid: Int32, state_q, state_k, state_v,
                     visit):
    """Plain round robin (tile r * grid + cta): covers every tile, balances causal tiles
    badly (the notebook sets it beside exercise 08.2)."""
    for r in cutlass.range(rounds(num_tiles, grid), unroll=1):
        tile = r * grid + cta
        if tile < num_tiles:
            state_q, state_k, state_v = visit(tile, r, tile + grid >= num_tiles, state_q,
                                              state_k, state_v)
