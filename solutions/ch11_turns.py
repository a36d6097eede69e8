"""Chapter 11, exercise 11.6: the deterministic dQ turn, in device code.

In the deterministic mode each query tile's float32 dQ accumulator has a turn counter in global
memory (zeroed by bwd_pre). The dQ warp of a key tile, at each query tile it visits, waits until
the counter shows its turn, adds its blocks, waits for the adds to complete and passes the turn
on (Note [Turns] of fa4_final/hopper/bwd.py). The learner writes that as a ``@cute.jit`` function
every lane of the dQ warp runs:

    add_in_turn(lane, counter, my_turn, add_blocks)

checked three ways:

- a simulator (``TurnSim``): the CTAs of a grid launched in order onto a few SMs, each dQ warp
  running the learner's function (as plain Python) at every query tile it visits, its bulk adds
  landing in L2 some time after they are issued. It names an add made out of turn, a turn passed
  while the adds are still in flight, a turn passed twice or never, and a deadlock: which CTAs
  wait for which turn, and whether the CTA that holds it has been launched at all (a wait for a
  CTA launched later deadlocks once the waiting CTAs fill every SM);
- compiled for sm_90a inside fa4_final's Hopper backward (``HopperTurns``, a course subclass
  whose ``store_dq`` is the kernel's own around the learner's function), and the PTX read: an
  acquire load of the counter in a loop before the first bulk add, ``cp.async.bulk.wait_group 0``
  (not ``.read``) and ``fence.acq_rel.gpu`` after the last, then a release add on the counter;
- on a GPU (``check_add_in_turn_on_gpu``): the deterministic backward with it against float64
  on awkward shapes, and two runs bitwise equal.

fa4_final keeps the turn inline in ``HopperBackward.store_dq`` (one dQ warp, one staging buffer:
the kernel checked here) and in ``dq_step_in_turn`` (its deterministic default at D = 64 and 128,
two dQ warps on alternate query tiles); the seam it would need is a method
``add_in_turn(lane, counter, my_turn, add_blocks)`` called where the deterministic branch is
(``HopperTurns.store_dq`` repeats the rest of that method).
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32, const_expr

from fa4_final.common.atomics import bulk_add_f32, pass_turn, wait_turn
from fa4_final.common.bwd_tiles import dq_turn, launch_order_reversed, q_tile_range
from fa4_final.common.constants import THREADS_PER_WARPGROUP, WARP_SIZE
from fa4_final.common.tiles import TileWindow
from fa4_final.hopper.bwd import HopperBackward, NamedBarrier
from fa4_final.hopper.config import BWD_MMA_WARPGROUPS, hopper_bwd_default

# ----------------------------------------------------------------------------------------------
# The reference


@cute.jit
def add_in_turn(lane, counter, my_turn, add_blocks):
    """Exercise 11.6's reference, run by every lane of a key tile's dQ warp at one query tile.

    ``counter``: the query tile's int32 turn counter in global memory; ``my_turn``: this key
    tile's turn there (0 adds first); ``add_blocks()``: every lane calls it once: it waits for
    each MMA warpgroup's dQ block and lane 0 issues the block's bulk add (committed)."""
    if lane == 0:  # wait for the turn: acquire, so the previous adds are seen complete
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        while seen != my_turn:
            seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    add_blocks()
    if lane == 0:  # the adds complete (not just read), then pass the turn with release
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(counter, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
    cute.arch.sync_warp()


FORBID = {wait_turn: "that is the package's wait; write the acquire loads yourself",
          pass_turn: "that is the package's release; write the red.release add yourself"}


# ----------------------------------------------------------------------------------------------
# The kernel with the learner's turn


class HopperTurns(HopperBackward):
    """fa4_final.hopper.bwd.HopperBackward whose dQ warp, in the deterministic mode, runs
    ``turn_fn`` (exercise 11.6's signature) at each step; the rest of ``store_dq`` is the
    kernel's own."""

    def __init__(self, turn_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.cfg.deterministic:
            raise ValueError("exercise 11.6's kernel is the deterministic one")
        self.turn_fn = turn_fn

    def cache_key(self) -> tuple:
        return super().cache_key() + (("exercise 11.6", self.turn_fn),)

    @cute.jit
    def add_blocks(self, gAcc, sdQ, m_pad, lane):
        """Both warpgroups' dQ blocks of this step into the accumulator: per block, the named
        barrier that says it is in shared memory, then lane 0's bulk add and commit."""
        for w in cutlass.range_constexpr(BWD_MMA_WARPGROUPS):
            cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_FULL_WG0) + w,
                              number_of_threads=THREADS_PER_WARPGROUP + WARP_SIZE)
            if lane == 0:
                offset = m_pad * (self.tile_m * self.head_dim) + w * self.dq_chunk
                bulk_add_f32(gAcc.iterator + offset, sdQ[None, w].iterator, self.dq_chunk * 4)
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_dq(self, mdQaccum, mTurn, sdQ, n_block, num_n_blocks, b, work, seqlen_q, seqlen_k,
                 window_left, window_right, seq=None):
        """HopperBackward.store_dq (deterministic) with the turn replaced by ``turn_fn``."""
        m_min, m_max, _, _, head0, group, *_ = work  # then the walk's start (Note [A rotated walk])
        m_base = None
        if const_expr(seq is not None):
            m_base = seq[2]
        lane = cute.arch.lane_idx()
        for h in cutlass.range(group, unroll=1):
            head = head0 + h
            gAcc = mdQaccum[None, head, b]  # (s_padded * D,)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                m_pad = m_block
                if const_expr(m_base is not None):
                    m_pad = m_base + m_block
                for w in cutlass.range_constexpr(BWD_MMA_WARPGROUPS):
                    cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.DQ_EMPTY_WG0) + w,
                                             number_of_threads=THREADS_PER_WARPGROUP + WARP_SIZE)
                counter = mTurn[None, head, b].iterator + m_pad
                turn = dq_turn(self.window, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k,
                               window_left, window_right)
                self.turn_fn(lane, counter, turn,
                             lambda: self.add_blocks(gAcc, sdQ, m_pad, lane))
        if lane == 0:  # shared memory must outlive the last add's reads of it
            cute.arch.cp_async_bulk_wait_group(0, read=True)


_BUILDS: dict = {}


def compile_turns(turn_fn, head_dim: int = 128, causal: bool = True):
    """The deterministic main backward kernel with ``turn_fn`` compiled for sm_90a."""
    from dataclasses import replace

    from solutions.ch11_ds_step import compile_for

    key = (turn_fn, head_dim, causal)
    if key not in _BUILDS:
        cfg = replace(hopper_bwd_default(head_dim, causal), deterministic=True)
        kernel = HopperTurns(turn_fn, cutlass.BFloat16, head_dim, causal, cfg)
        _BUILDS[key] = compile_for(kernel, "main", head_dim, "sm_90a")[1]
    return _BUILDS[key]


# ----------------------------------------------------------------------------------------------
# The grid on the CPU: CTAs launched in order, dQ warps that wait, add and pass turns


class TurnError(AssertionError):
    """What went wrong in a simulated grid, in words."""


class Deadlock(TurnError):
    pass


@dataclass(frozen=True)
class TurnGrid:
    """The key tiles of one (batch, head) of the backward and what each dQ warp does: its query
    tiles in order and its turn at each (fa4_final.common.bwd_tiles). ``turns``: "kernel" (dq_turn),
    or "reversed" (the other direction: a deliberate mistake, to show what it does)."""

    seqlen_q: int
    seqlen_k: int
    causal: bool
    tile_m: int = 64
    tile_n: int = 128
    turns: str = "kernel"

    @property
    def window(self) -> TileWindow:
        return TileWindow(self.tile_m, self.tile_n, self.causal)

    @property
    def n_blocks(self) -> int:
        return -(-self.seqlen_k // self.tile_n)

    def key_tile(self, cta: int) -> int:
        """The key tile CTA number ``cta`` (launch order) works on."""
        if launch_order_reversed(self.window):
            return self.n_blocks - 1 - cta
        return cta

    def steps(self, n_block: int) -> list[tuple[int, int]]:
        """(query tile, turn) of each step of key tile ``n_block``, in order."""
        m_min, m_max, _, _ = q_tile_range(self.window, n_block, self.seqlen_q, self.seqlen_k)
        out = []
        for m in range(m_min, m_max):
            turn = dq_turn(self.window, n_block, m, self.n_blocks, self.seqlen_q,
                           self.seqlen_k)
            if self.turns == "reversed":
                visitors = [n for n in range(self.n_blocks) if any(
                    mm == m for mm in range(*q_tile_range(self.window, n, self.seqlen_q,
                                                          self.seqlen_k)[:2]))]
                turn = len(visitors) - 1 - turn
            out.append((m, turn))
        return out

    def turn_order(self, m: int) -> list[int]:
        """The key tiles that add to query tile ``m``, in turn order."""
        got = [(t, n) for n in range(self.n_blocks) for mm, t in self.steps(n) if mm == m]
        return [n for _, n in sorted(got)]


class _Abort(BaseException):
    pass


@dataclass
class _Agent:
    cta: int
    n_block: int
    go: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    done: bool = False
    error: BaseException | None = None
    step: tuple | None = None  # (m, turn) being run
    adds: list = field(default_factory=list)  # this CTA's adds in flight: [m, "issued"/"read"]
    waiting_for: tuple | None = None  # ("adds", n, read) while in wait_group
    last_seen: tuple | None = None  # (m, value) of the last load
    reds: int = 0
    add_calls: int = 0


@dataclass
class _Counter:
    """A pointer to query tile ``m``'s turn counter."""

    m: int


class TurnSim:
    """The grid's CTAs on ``sms`` SMs, one dQ warp (lane 0) each, running ``fn``; bulk adds
    land ``latency`` scheduler steps (random in the range) after they are issued. ``run()``
    returns {query tile: key tiles in the order their adds landed} or raises TurnError."""

    def __init__(self, fn, grid: TurnGrid, sms: int = 2, seed: int = 0, latency=(1, 12)):
        from solutions.ch06_exp2 import swapped
        from solutions.ch07_rescaling import _lane_types
        from utils.host_emulation import _const_expr, _PyRange

        self.grid, self.sms, self.rng, self.latency = grid, sms, random.Random(seed), latency
        self.counters = {m: 0 for m in range(-(-grid.seqlen_q // grid.tile_m))}
        self.landed: dict[int, list[int]] = {m: [] for m in self.counters}
        self.in_flight: list = []  # [agent, m, state, ticks left]
        self.local = threading.local()
        self.back = threading.Event()
        self.changed = 0
        self.aborting = False
        self.loads: list = []  # (sem, scope)
        self.reds: list = []  # (sem, scope, value)
        self.fences = 0
        arch = cute.arch
        swap = {arch.load: self._load, arch.red: self._red, arch.sync_warp: self._nothing,
                arch.cp_async_bulk_wait_group: self._wait_group,
                arch.fence_acq_rel_gpu: self._fence, cutlass.range: _PyRange,
                cutlass.range_constexpr: _PyRange, cutlass.const_expr: _const_expr,
                **_lane_types()}
        self.fn, self.patches = swapped(fn, swap, [cute.arch, cutlass])

    # -- the stand-ins, called on an agent's thread
    def _me(self) -> _Agent:
        return self.local.agent

    def _yield(self):
        me = self._me()
        me.go.clear()
        self.back.set()
        me.go.wait()
        if self.aborting:
            raise _Abort()

    def _nothing(self, *args, **kwargs):
        self._yield()

    def _fence(self, *args, **kwargs):
        self.fences += 1
        self._yield()

    def _load(self, ptr, dtype=None, *, sem=None, scope=None, **_):
        if not isinstance(ptr, _Counter):
            raise TurnError(f"cute.arch.load reads the turn counter (counter), got {ptr!r}")
        self.loads.append((sem, scope))
        self._yield()
        value = self.counters[ptr.m]
        self._me().last_seen = (ptr.m, value)
        return np.int32(value)

    def _red(self, ptr, val, *, op=None, dtype=None, sem=None, scope=None, **_):
        me = self._me()
        if not isinstance(ptr, _Counter):
            raise TurnError(f"cute.arch.red adds to the turn counter (counter), got {ptr!r}")
        if op != "add":
            raise TurnError(f"pass the turn with op='add' (got op={op!r})")
        self.reds.append((sem, scope, int(val)))
        m, turn = me.step
        flying = [a for a in self.in_flight if a[0] is me]
        if flying:
            raise TurnError(
                f"key tile {me.n_block} passed the turn at query tile {m} while {len(flying)} "
                f"of its bulk adds were still on their way to L2 ({flying[0][2]}): the next key "
                "tile could add before them. Wait for them to complete first: "
                "cp_async_bulk_wait_group(0, read=False) (read=True only waits until shared "
                "memory has been read)")
        me.reds += 1
        self.counters[ptr.m] += int(val)
        self.changed += 1
        self._yield()

    def _wait_group(self, n, read=False, **_):
        me = self._me()
        me.waiting_for = (int(n), bool(read))
        self._yield()
        me.waiting_for = None

    def add_blocks(self):
        me = self._me()
        m, turn = me.step
        me.add_calls += 1
        for _ in range(BWD_MMA_WARPGROUPS):
            self._yield()  # the named barrier: the warpgroup's dQ is in shared memory
            if self.counters[m] != turn:
                raise TurnError(
                    f"key tile {me.n_block} added its dQ into query tile {m} while the counter "
                    f"showed {self.counters[m]}, not its turn {turn}: wait (lane 0, acquire "
                    "loads) until the counter equals my_turn before add_blocks()")
            self.in_flight.append([me, m, "issued", self.rng.randint(*self.latency)])
            self.changed += 1

    # -- the agents
    def _agent_main(self, a: _Agent):
        self.local.agent = a
        a.go.wait()
        try:
            if self.aborting:
                raise _Abort()
            for m, turn in self.grid.steps(a.n_block):
                a.step, a.reds, a.add_calls = (m, turn), 0, 0
                self.fn(np.int32(0), _Counter(m), np.int32(turn), self.add_blocks)
                if a.add_calls != 1:
                    raise TurnError(f"lane 0 of key tile {a.n_block} called add_blocks() "
                                    f"{a.add_calls} times at query tile {m}: once a step")
                if a.reds != 1:
                    raise TurnError(
                        f"key tile {a.n_block} passed the turn at query tile {m} {a.reds} "
                        f"times: once a step (one release add), after its adds completed"
                        + ("; without it the next key tile waits forever" if not a.reds
                           else ""))
            a.done = True
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001  (re-raised by run, with its words)
            a.error = exc
        self.back.set()

    def _resume(self, a: _Agent):
        self.back.clear()
        a.go.set()
        self.back.wait()
        if a.error is not None:
            raise a.error

    def _blocked(self, a: _Agent) -> bool:
        if a.waiting_for is None:
            return False
        n, read = a.waiting_for
        mine = [f for f in self.in_flight if f[0] is a and (f[2] == "issued" or not read)]
        return len(mine) > n

    def _deadlock(self, running: list, waiting_launch: list) -> Deadlock:
        lines = []
        for a in running:
            if a.step is None:
                continue
            m, turn = a.step
            holder = self.grid.turn_order(m)[self.counters[m]] if self.counters[m] < len(
                self.grid.turn_order(m)) else None
            where = "never launched: every SM holds a waiting CTA" if holder in [
                w.n_block for w in waiting_launch] else "running"
            lines.append(f"key tile {a.n_block} (CTA {a.cta}) waits at query tile {m} for turn "
                         f"{turn}; the counter shows {self.counters[m]}"
                         + (f", the turn of key tile {holder} ({where})" if holder is not None
                            else ", a turn nobody holds: someone passed a turn twice"))
        return Deadlock("deadlock on " + f"{self.sms} SMs: " + "; ".join(lines))

    def run(self) -> dict[int, list[int]]:
        queue = [_Agent(cta, self.grid.key_tile(cta)) for cta in range(self.grid.n_blocks)]
        running: list[_Agent] = []
        idle = 0
        with self.patches():
            return self._run(queue, running, idle)

    def _run(self, queue, running, idle) -> dict[int, list[int]]:
        try:
            while queue or running:
                while queue and len(running) < self.sms:  # launch in order
                    a = queue.pop(0)
                    a.thread = threading.Thread(target=self._agent_main, args=(a,), daemon=True)
                    a.thread.start()
                    running.append(a)
                    self.changed += 1
                before = self.changed
                ready = [a for a in running if not self._blocked(a)]
                if self.in_flight and (not ready or self.rng.random() < 0.3):
                    f = self.rng.choice(self.in_flight)
                    f[3] -= 1
                    if f[3] <= 0 and f[2] == "issued":
                        f[2], f[3] = "read", self.rng.randint(*self.latency)
                    elif f[3] <= 0:
                        self.in_flight.remove(f)
                        self.landed[f[1]].append(f[0].n_block)
                    self.changed += 1
                elif ready:
                    a = self.rng.choice(ready)
                    self._resume(a)
                    if a.done or a.error:
                        running.remove(a)
                        self.changed += 1
                idle = idle + 1 if self.changed == before else 0
                if idle > 400 * max(len(running), 1) and not self.in_flight:
                    raise self._deadlock(running, queue)
        finally:
            self.aborting = True
            for a in running:
                a.go.set()
        for m, got in self.landed.items():
            want = [n for n in self.grid.turn_order(m) for _ in range(BWD_MMA_WARPGROUPS)]
            if got != want:
                raise TurnError(f"at query tile {m} the adds landed in the order of key tiles "
                                f"{got}, not in turn order {want}")
        return self.landed


@dataclass
class LaneOne:
    """What lane 1 of the dQ warp did in one call (it must help with add_blocks and no more)."""

    loads: int = 0
    reds: int = 0
    add_calls: int = 0


def lane_one(fn) -> LaneOne:
    """Run ``fn`` as lane 1 once (its loads see its turn at once) and count its calls."""
    from solutions.ch06_exp2 import swapped
    from solutions.ch07_rescaling import _lane_types
    from utils.host_emulation import _const_expr, _PyRange

    got = LaneOne()

    def load(*a, **k):
        got.loads += 1
        return np.int32(0)

    def red(*a, **k):
        got.reds += 1

    def adds():
        got.add_calls += 1

    swap = {cute.arch.load: load, cute.arch.red: red,
            cute.arch.sync_warp: lambda *a, **k: None,
            cute.arch.cp_async_bulk_wait_group: lambda *a, **k: None,
            cute.arch.fence_acq_rel_gpu: lambda *a, **k: None, cutlass.range: _PyRange,
            cutlass.range_constexpr: _PyRange, cutlass.const_expr: _const_expr,
            **_lane_types()}
    clone, patches = swapped(fn, swap, [cute.arch, cutlass])
    with patches():
        clone(np.int32(1), _Counter(0), np.int32(0), adds)
    return got


# grids a checker runs: causal (turns downwards, reversed launch), a causal grid with seqlen_q >
# seqlen_k, non-causal (turns upwards: the staircase), lengths off the tiles
GRIDS = [TurnGrid(512, 512, True), TurnGrid(700, 400, True), TurnGrid(300, 520, False),
         TurnGrid(333, 640, True)]


def check_turn_rules(fn) -> None:
    """Exercise 11.6 on the CPU: lane 1's part, then ``TurnSim`` on every grid of ``GRIDS`` with
    2 and 3 SMs and several seeds; the memory orders the loads and the release add name."""
    one = lane_one(fn)
    if one.add_calls != 1:
        raise AssertionError(
            f"lane 1 called add_blocks() {one.add_calls} times: every lane of the dQ warp calls "
            "it once (it waits at named barriers counting the whole warp, 128 + 32 threads); "
            "only lane 0 waits for the turn and passes it")
    if one.reds:
        raise AssertionError("lane 1 passed the turn too: every lane's red would move the "
                             "counter by 32. Only lane 0 adds to the counter (if lane == 0)")
    for grid in GRIDS:
        for sms in (2, 3):
            for seed in range(3):
                sim = TurnSim(fn, grid, sms=sms, seed=seed)
                where = (f"seqlen_q={grid.seqlen_q}, seqlen_k={grid.seqlen_k}, "
                         f"causal={grid.causal}, {sms} SMs")
                try:
                    sim.run()
                except TurnError as exc:
                    raise AssertionError(f"{where}: {exc}") from None
                if not sim.loads:
                    raise AssertionError(f"{where}: lane 0 never read the counter: it must wait "
                                         "(acquire loads, in a loop) until the counter shows "
                                         "my_turn, then add")
                bad = sorted({f"sem={s!r}, scope={c!r}" for s, c in sim.loads
                              if (s, c) != ("acquire", "gpu")})
                if bad:
                    raise AssertionError(
                        f"the counter is read with {bad[0]}: use sem='acquire', scope='gpu', "
                        "so the previous key tile's adds (released with the turn) are visible "
                        "before this one adds")
                bad = sorted({f"sem={s!r}, scope={c!r}" for s, c, _ in sim.reds
                              if (s, c) != ("release", "gpu")})
                if bad:
                    raise AssertionError(
                        f"the turn is passed with {bad[0]}: use sem='release', scope='gpu', so "
                        "the adds before it are visible to whoever acquires the new value")
                if any(v != 1 for *_, v in sim.reds):
                    raise AssertionError("pass the turn by adding 1 to the counter")
                if sim.fences < len(sim.reds):
                    raise AssertionError(
                        "fence (cute.arch.fence_acq_rel_gpu()) between the completed adds and "
                        "the release add, as fa4_final's store_dq does")


_turn_rules = check_turn_rules  # (a private name: the workshop guide lists its messages too)


def turn_ptx_facts(ptx: str) -> dict:
    """The dQ warp's turn in a compiled deterministic kernel's PTX: for the counter (the
    address of the release add), the kinds of global load of it, whether one sits in a loop,
    and what lies between the last bulk add and the release add."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    red = [i for i, ln in enumerate(lines) if ln.startswith("red.") and "global" in ln]
    facts = {"red": [lines[i] for i in red], "loads": [], "looped": False, "between": [],
             "load_before_add": False}
    if not red:
        return facts
    addr = re.search(r"\[(%rd\d+)\]", lines[red[0]]).group(1)
    loads = [i for i, ln in enumerate(lines) if ln.startswith("ld.")
             and f"[{addr}]" in ln and "shared" not in ln]
    facts["loads"] = [lines[i].split()[0] for i in loads]
    adds = [i for i, ln in enumerate(lines) if ln.startswith("cp.reduce.async.bulk")]
    if loads and adds:
        facts["load_before_add"] = loads[0] < adds[0]
        first, last = loads[0], adds[0]
        labels = {ln[:-1] for ln in lines[first - 3:first + 1] if ln.endswith(":")}
        for ln in lines[first:last]:
            m = re.search(r"bra(?:\.uni)?\s+(\$?\w+)", ln)
            if m and m.group(1) in labels:
                facts["looped"] = True
        facts["looped"] |= sum(1 for i in loads if i < adds[0]) >= 2 and any(
            "bra" in ln for ln in lines[loads[0]:adds[0]])
        facts["between"] = [ln.split()[0].rstrip(";") for ln in lines[adds[-1] + 1:red[0]]
                            if ln and not ln.startswith(("//", "$", "mov", "add", "setp"))]
    return facts


def check_add_in_turn(fn, compile_check: bool = True) -> None:
    """Exercise 11.6: ``check_turn_rules``, then fa4_final's deterministic Hopper backward
    compiled for sm_90a with ``fn`` as the dQ warp's turn (D = 128, causal), its PTX read."""
    _turn_rules(fn)
    if not compile_check:
        return
    facts = turn_ptx_facts(compile_turns(fn).ptx)
    if not facts["red"]:
        raise AssertionError("compiled for sm_90a, the kernel has no red on the counter")
    if not facts["red"][0].startswith("red.release.gpu"):
        raise AssertionError(f"compiled for sm_90a, the turn is passed with "
                             f"{facts['red'][0].split()[0]}, not red.release.gpu")
    if not facts["loads"] or any(not ld.startswith("ld.acquire.gpu") for ld in facts["loads"]):
        raise AssertionError(f"compiled for sm_90a, the counter is read with "
                             f"{facts['loads'] or 'no load'}: every read must be ld.acquire.gpu")
    if not facts["load_before_add"] or not facts["looped"]:
        raise AssertionError("compiled for sm_90a, the acquire loads of the counter are not a "
                             "loop before the first bulk add")
    between = facts["between"]
    if "cp.async.bulk.wait_group" not in between or "fence.acq_rel.gpu" not in between:
        raise AssertionError(f"compiled for sm_90a, between the last bulk add and the release "
                             f"add the PTX has {between}: it needs cp.async.bulk.wait_group 0 "
                             "(the adds complete, not .read) and fence.acq_rel.gpu")


def check_add_in_turn_on_gpu(fn, cases=None) -> tuple[bool, list[str]]:
    """Exercise 11.6 on a Hopper GPU: the deterministic backward with ``fn`` as the dQ warp's
    turn, against float64 and run twice, bit for bit."""
    from solutions.ch11_ds_step import GPU_CASES, ExerciseBackward, gpu_case_lines

    run = ExerciseBackward(lambda dt, d, causal, cfg: HopperTurns(fn, dt, d, causal, cfg),
                           deterministic=True)
    return gpu_case_lines(run, cases or GPU_CASES, repeat=True)
