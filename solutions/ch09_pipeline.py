"""Chapter 09: the Blackwell forward's warp roles and pipelines, simulated on the CPU.

No Blackwell GPU ran the kernel, so its synchronisation is checked here instead: every warp role
of ``fa4_final.blackwell.fwd.BlackwellForward`` replayed as a Python generator that waits on and
arrives at mbarriers exactly where the kernel does, over many tiles, causal and not, 1- and
2-CTA, with random operation times so that many interleavings occur. What comes from the kernel
itself, not from a copy:

- stage counts, arrival counts and barrier kinds: ``kernel.pipelines()`` (the table the kernel
  builds its barriers from) and ``cfg.ring_depth``;
- which key tiles each tile visits and in which order the CTA walks the tiles:
  ``fa4_final.common.tiles.kv_tile_range`` and ``fa4_final.common.schedule`` (the code the
  kernel calls);
- the phase bits: ``PipelineState``'s rule (index = count mod stages, the phase flips at each
  wrap; a producer starts at phase 1) and the explicit parities of the per-Q-stage pipelines.

The role bodies below mirror ``load``, ``mma_tile``, ``softmax_step``, ``correction`` and
``epilogue`` line for line (each cites the method). The simulator then checks what a GPU run
would get wrong silently:

- deadlock: every role waits and nothing is in flight;
- a buffer (shared-memory stage, TMEM region, the row-stats slot, the O slot) read while it is
  being written, or read holding something other than what the reader expects (stale or already
  overwritten): every buffer carries a version label and every read names the one it needs;
- an arrival on a barrier for a later phase than the one in progress (it would complete the
  current phase too early), and arrivals left pending when the kernel ends.

The MMA warp's instructions go to an in-order engine, as tcgen05 executes them; a
``tcgen05.commit`` arrives when every MMA issued before it has completed.

The backward (chapter 12, ``BackwardSim``): the roles of ``fa4_final.blackwell.bwd.
BlackwellBackward`` (load, mma, two compute warpgroups as separate agents, dQ) the same way, one
CTA (key tile) per run, over every key tile of a problem, so causal step counts from 0 upwards;
pipelines from ``kernel.pipelines()``, TMEM buffers from ``kernel.plan``, the dQ staging
buffers and ``cp.async.bulk.wait_group`` as the kernel uses them. Not simulated: the
deterministic mode's turn counters (they order CTAs, not roles; chapter 11's Hopper proof). It
found two races in the first design, both fixed in the kernel: delta in the dO stage, which dV
frees before the compute warps read delta (now delta rides with Q), and P^T stored over S^T
columns the other compute warpgroup may still be loading (now bar.sync COMPUTE first, as FA4).

The 2-CTA backward (``PairBackwardSim``, ``fa4_final.blackwell.bwd_pair``): both CTAs of a pair
at once, as the forward's pairs: the leader's barriers that count both CTAs (TMA bytes of both,
both CTAs' compute and dQ warps), commits that reach both CTAs, and the dS exchange: each CTA's
second warpgroup stores its dS into the peer's shared memory (st.async), whose bytes complete a
barrier in the peer; the follower's MMA warp relays its barrier to the leader, which waits for
both before dQ. Written before the kernel, it fixed two choices of the design: a second
bar.sync COMPUTE before dS^T is stored over dP^T's columns (dK reads it from TMEM; mutation
no_ds_sync), and lse / delta in a ring of their own in each CTA (the pair's Q ring has its FULL
barrier in the leader only, so the follower's compute warps could not wait on it for lse).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fa4_final.blackwell.config import Q_STAGES, BlackwellFwdConfig
from fa4_final.common.schedule import tile_coords, tiles_of_cta
from fa4_final.common.tiles import kv_tile_range


class PipelineError(Exception):
    pass


class Deadlock(PipelineError):
    pass


class Overwrite(PipelineError):
    pass


class StaleRead(PipelineError):
    pass


class EarlyArrival(PipelineError):
    pass


# ----------------------------------------------------------------------------------------------
# mbarriers


class Barrier:
    """An mbarrier: a phase completes when ``arrivals`` have arrived and every announced byte
    has landed. ``completed`` is the number of completed phases; a wait with parity p passes
    when the phase in progress has the other parity (p's phase is done)."""

    def __init__(self, name: str, arrivals: int, sim: Sim):
        self.name, self.arrivals, self.sim = name, arrivals, sim
        self.pending, self.tx, self.completed = arrivals, 0, 0
        self.by_agent: dict[str, int] = {}  # arrivals per agent, to find early ones

    def ready(self, parity: int) -> bool:
        return (self.completed & 1) != parity

    def arrive(self, who: str, count: int = 1, tx: int = 0) -> None:
        k = self.by_agent.get(who, 0) // count  # the phase this agent arrives for
        self.by_agent[who] = self.by_agent.get(who, 0) + count
        if k > self.completed:
            raise EarlyArrival(
                f"t={self.sim.now}: {who} arrived on {self.name} for phase {k} while phase "
                f"{self.completed} is still in progress: it would complete that phase early")
        if count > self.pending:
            raise EarlyArrival(f"t={self.sim.now}: {who}: {count} arrivals on {self.name} but "
                               f"only {self.pending} missing in phase {self.completed}")
        self.pending -= count
        self.tx += tx
        self._maybe_complete()

    def land(self, nbytes: int, phase: int, what: str) -> None:
        if phase != self.completed:
            raise EarlyArrival(f"t={self.sim.now}: bytes of {what} landed on {self.name} for "
                               f"phase {phase} during phase {self.completed}")
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.arrivals
            self.sim.log("barrier", f"{self.name} completes phase {self.completed - 1}")

    def describe(self) -> str:
        return (f"{self.name}: phase {self.completed} waits for {self.pending} of "
                f"{self.arrivals} arrivals" + (f" and {self.tx} bytes" if self.tx else ""))


@dataclass(frozen=True)
class Wait:
    barrier: Barrier
    parity: int


@dataclass
class PipelineState:
    """cutlass.pipeline.PipelineState: index = count mod stages; the phase flips at each wrap.
    A producer starts at phase 1 (its first wait on a fresh EMPTY barrier passes)."""

    stages: int
    index: int = 0
    phase: int = 0
    count: int = 0

    @classmethod
    def producer(cls, stages):
        return cls(stages, phase=1)

    def advance(self) -> None:
        self.index += 1
        self.count += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1

    def clone(self) -> PipelineState:
        return PipelineState(self.stages, self.index, self.phase, self.count)


# ----------------------------------------------------------------------------------------------
# buffers with versions


class Buffer:
    """A shared-memory stage or a TMEM region. ``version`` labels what it holds; reads and
    writes take time and must not overlap a write."""

    def __init__(self, name: str, sim: Sim):
        self.name, self.sim = name, sim
        self.version = None
        self.readers: set[str] = set()
        self.writer: str | None = None

    def start_read(self, who: str, expect) -> None:
        if self.writer is not None:
            raise Overwrite(f"t={self.sim.now}: {who} reads {self.name} while {self.writer} "
                            f"writes it")
        ok = expect(self.version) if callable(expect) else self.version == expect
        if expect is not None and not ok:
            raise StaleRead(f"t={self.sim.now}: {who} reads {self.name} expecting {expect}, "
                            f"but it holds {self.version}")
        self.readers.add(who)

    def end_read(self, who: str) -> None:
        self.readers.discard(who)

    def start_write(self, who: str) -> None:
        others = self.readers - {who}  # an MMA may read and write its own accumulator
        if others or self.writer is not None:
            busy = ", ".join(sorted(others)) or self.writer
            raise Overwrite(f"t={self.sim.now}: {who} writes {self.name} while {busy} "
                            f"still uses it (it holds {self.version})")
        self.writer = who

    def end_write(self, who: str, version) -> None:
        self.writer = None
        self.version = version


# ----------------------------------------------------------------------------------------------
# the simulator


@dataclass
class Timing:
    """Ticks of each kind of work: each operation draws uniformly from [lo, hi]."""

    tma: tuple = (3, 9)
    mma: tuple = (2, 5)
    read_s: tuple = (1, 2)
    store_p: tuple = (1, 4)
    softmax: tuple = (2, 7)
    rescale: tuple = (1, 4)
    epilogue: tuple = (1, 4)
    store: tuple = (2, 6)
    rescale_share: float = 0.5  # how often a correction warp's vote says "rescale"
    jitter: tuple = (0, 6)  # a warpgroup scheduled late after a wait (the backward's roles)
    dsmem: tuple = (4, 16)  # st.async into the peer CTA's shared memory, until its bytes land


@dataclass
class _Agent:
    name: str
    gen: object
    waiting: Wait | None = None
    wait_since: int = 0
    busy_until: int = 0
    done: bool = False


class Sim:
    """Event loop: agents (the warp roles), a TMA engine and an in-order MMA engine."""

    def __init__(self, seed: int = 0, timing: Timing | None = None, max_ticks: int = 2_000_000):
        self.rng = random.Random(seed)
        self.timing = timing or Timing()
        self.now = 0
        self.max_ticks = max_ticks
        self.agents: list[_Agent] = []
        self.tma: list[tuple] = []  # (lands_at, buffer, version, barrier, nbytes, phase)
        self.mma_queue: list[dict] = []
        self.mma_busy_until = 0
        self.mma_current = None
        self.events: list[tuple] = []
        self.spans: list[tuple] = []  # (lane, t0, t1, label) for the timeline picture
        self.keep_log = False
        self.timers: list[tuple] = []  # (fires_at, callback): other async engines (bulk adds)

    def ticks(self, kind: str) -> int:
        lo, hi = getattr(self.timing, kind)
        return self.rng.randint(lo, hi)

    def log(self, who: str, what: str) -> None:
        if self.keep_log:
            self.events.append((self.now, who, what))

    def span(self, lane: str, t0: int, t1: int, label: str) -> None:
        if self.keep_log:
            self.spans.append((lane, t0, t1, label))

    def add(self, name: str, gen) -> None:
        self.agents.append(_Agent(name, gen))

    # the engines
    def tma_copy(self, buf: Buffer, version, barrier: Barrier, nbytes: int, phase: int,
                 who: str) -> None:
        buf.start_write(f"TMA ({who})")
        self.tma.append((self.now + self.ticks("tma"), buf, version, barrier, nbytes, phase,
                         self.now))

    def mma_issue(self, op: dict) -> None:
        self.mma_queue.append(op)

    def after(self, ticks: int, callback) -> None:
        self.timers.append((self.now + ticks, callback))

    def _run_engines(self) -> None:
        for item in [x for x in self.timers if x[0] <= self.now]:
            self.timers.remove(item)
            item[1]()
        for item in [x for x in self.tma if x[0] <= self.now]:
            self.tma.remove(item)
            _, buf, version, barrier, nbytes, phase, t0 = item
            buf.end_write("TMA", version)
            self.span("TMA", t0, self.now, str(version[0]))
            barrier.land(nbytes, phase, str(version))
        while True:
            if self.mma_current is not None:
                if self.now < self.mma_busy_until:
                    return
                op = self.mma_current
                for buf, _ in op["reads"]:
                    buf.end_read("MMA")
                for buf, version in op["writes"]:
                    buf.end_write("MMA", version)
                self.span("tensor cores", op["t0"], self.now, op["label"])
                self.mma_current = None
            if not self.mma_queue:
                return
            op = self.mma_queue.pop(0)
            if op.get("commit") is not None:
                for barrier in op["commit"]:
                    barrier.arrive("MMA commit")
                continue
            for buf, expect in op["reads"]:
                buf.start_read("MMA", expect)
            for buf, _ in op["writes"]:
                buf.start_write("MMA")
            op["t0"] = self.now
            self.mma_current = op
            self.mma_busy_until = self.now + self.ticks("mma")

    def _advance(self, a: _Agent) -> None:
        while not a.done and a.busy_until <= self.now:
            if a.waiting is not None:
                if not a.waiting.barrier.ready(a.waiting.parity):
                    return
                if self.now > a.wait_since:
                    self.span(a.name, a.wait_since, self.now, "wait")
                a.waiting = None
            try:
                item = next(a.gen)
            except StopIteration:
                a.done = True
                return
            if isinstance(item, Wait):
                a.waiting, a.wait_since = item, self.now
            elif isinstance(item, tuple) and item[0] == "busy":
                _, n, label = item
                self.span(a.name, self.now, self.now + n, label)
                a.busy_until = self.now + n
            else:
                raise PipelineError(f"{a.name} yielded {item!r}")

    def run(self) -> Sim:
        while True:
            self._run_engines()
            for a in self.agents:
                self._advance(a)
            if all(a.done for a in self.agents) and not self.tma and not self.mma_queue \
                    and self.mma_current is None and not self.timers:
                return self
            live = [a for a in self.agents if not a.done]
            stuck = all(a.waiting is not None and not a.waiting.barrier.ready(a.waiting.parity)
                        and a.busy_until <= self.now for a in live)
            if stuck and not self.tma and not self.mma_queue and self.mma_current is None \
                    and not self.timers:
                lines = [f"deadlock at t={self.now}: every role waits, nothing is in flight"]
                lines += [f"  {a.name} waits for parity {a.waiting.parity} on "
                          f"{a.waiting.barrier.describe()}" for a in live]
                raise Deadlock("\n".join(lines))
            if self.now >= self.max_ticks:
                raise Deadlock(f"not finished after {self.max_ticks} ticks")
            self.now += 1


def busy(n: int, label: str):
    return ("busy", n, label)


# ----------------------------------------------------------------------------------------------
# the forward's pipelines and roles


@dataclass(frozen=True)
class Problem:
    """One attention problem and the CTA (pair) whose tiles are simulated."""

    seqlen_q: int
    seqlen_k: int
    heads: int = 1
    batch: int = 1
    causal: bool = False
    cluster: int = 0  # which CTA (pair) of the persistent grid
    grid: int = 1  # CTAs (pairs) in the persistent grid
    window_left: int | None = None
    window_right: int | None = None


def tile_steps(kernel, prob: Problem) -> list[tuple[int, int, int]]:
    """(tile, n_min, n_max) of every tile the CTA (pair) computes, in its order: the
    scheduler's zigzag over tile_coords and kv_tile_range, as every role of the kernel."""
    cfg = kernel.cfg
    num_m = -(-prob.seqlen_q // cfg.cluster_tile_m)
    num_tiles = num_m * prob.heads * prob.batch
    out = []
    for t in tiles_of_cta(prob.cluster, prob.grid, num_tiles):
        m_block, _, _ = tile_coords(t, num_m, prob.heads, prob.batch, longest_first=prob.causal)
        n_min, n_max, _, _ = kv_tile_range(kernel.window, m_block, prob.seqlen_q,
                                           prob.seqlen_k, prob.window_left, prob.window_right)
        out.append((t, n_min, n_max))
    return out


class _KernelSim:
    """What both simulations set up alike: the kernel, the problem, the event loop and the
    kernel's own pipeline table; ``mutate`` names one of the subclass's BUGS."""

    BUGS: dict[str, str] = {}

    def __init__(self, kernel, prob, seed: int, timing: Timing | None, mutate: str | None,
                 log: bool):
        if mutate is not None and mutate not in self.BUGS:
            raise ValueError(f"mutate must be one of {sorted(self.BUGS)}, got {mutate!r}")
        self.k, self.prob, self.mutate = kernel, prob, mutate
        self.sim = Sim(seed, timing)
        self.sim.keep_log = log
        self.specs = {p.name: p for p in kernel.pipelines()}

    def load_and_combine(self, me, columns, tag, row, row_tag, label, work_label,
                         work_share=1):
        """A backward compute step's tcgen05.ld of its TMEM ``columns`` (S^T or dP^T, read as
        ``tag``) and the math that combines them with a row in shared memory (lse or delta,
        read as ``row_tag``): the columns are free once loaded, the row once the math is done.
        The math takes 1 / ``work_share`` of a softmax's ticks (drawn after the load's)."""
        for b in columns:
            b.start_read(me, tag)
        row.start_read(me, row_tag)
        yield busy(self.sim.ticks("read_s"), label)
        for b in columns:
            b.end_read(me)
        yield busy(self.sim.ticks("softmax") // work_share, work_label)
        row.end_read(me)


class ForwardSim(_KernelSim):
    """The barriers and buffers of one CTA (or pair) of ``kernel`` and its roles as agents.

    ``mutate`` names a deliberate bug (BUGS) to show what the checks catch."""

    BUGS = {
        "s_before_pv": "the MMA warp issues S_i = Q_i K_j before O_i += P_i V_{j-1}",
        "no_initial_release": "the correction does not announce at start-up that O_i is free",
        "softmax_releases_before_store": "the softmax says P_i is ready before storing it",
        "one_kv_stage": "a K/V ring of one stage",
        "correction_skips_o_wait": "the correction reads the final O_i without waiting for o[i]",
    }

    def __init__(self, kernel, prob: Problem, seed: int = 0, timing: Timing | None = None,
                 mutate: str | None = None, log: bool = False):
        super().__init__(kernel, prob, seed, timing, mutate, log)
        self.ctas = kernel.cfg.cta_group
        if mutate == "one_kv_stage":
            from dataclasses import replace

            self.specs["kv"] = replace(self.specs["kv"], stages=1)
        self.steps = tile_steps(kernel, prob)
        self.bar = {}  # (cta, pipe, side, stage) -> Barrier
        for name, spec in self.specs.items():
            for cta in range(self.ctas):
                for s in range(spec.stages):
                    for side, n in (("full", spec.full_arrivals), ("empty", spec.empty_arrivals)):
                        self.bar[cta, name, side, s] = Barrier(
                            f"{name}.{side}[{s}]" + (f"@cta{cta}" if self.ctas > 1 else ""), n,
                            self.sim)
        self.buf = {}
        for cta in range(self.ctas):
            for i in range(Q_STAGES):
                for name in ("Q", "SP", "O", "stats", "sO"):
                    self.buf[cta, name, i] = Buffer(f"{name}{i}@cta{cta}", self.sim)
            for s in range(self.specs["kv"].stages):
                self.buf[cta, "KV", s] = Buffer(f"KV stage {s}@cta{cta}", self.sim)
        for cta in range(self.ctas):
            for i in range(Q_STAGES):
                self.buf[cta, "O", i].version = ("O", None, "read")  # free at start-up
        self.tx = {"q": 1, "kv": 1}  # bytes counted abstractly: one unit per CTA's copy
        self._add_roles()

    # routing of arrivals (Note [Pipelines] and [Pair masks] in fwd.py)
    def full(self, cta, name, s):
        kind = self.specs[name].kind
        return self.bar[0 if kind == "tma_umma" else cta, name, "full", s]

    def empty(self, cta, name, s):
        kind = self.specs[name].kind
        return self.bar[0 if kind == "umma_async" else cta, name, "empty", s]

    def commit_targets(self, name, s):
        """tcgen05.commit from the leader: the pipeline's barrier in every CTA of the pair."""
        side = "empty" if self.specs[name].kind == "tma_umma" else "full"
        return [self.bar[c, name, side, s] for c in range(self.ctas)]

    def _add_roles(self):
        for cta in range(self.ctas):
            self.sim.add(f"load@{cta}", self.load(cta))
        self.sim.add("mma", self.mma())
        for cta in range(self.ctas):
            for i in range(Q_STAGES):
                self.sim.add(f"softmax{i}@{cta}", self.softmax(cta, i))
            self.sim.add(f"correction@{cta}", self.correction(cta))
            self.sim.add(f"epilogue@{cta}", self.epilogue(cta))

    def n_block(self, n_max, j):
        return n_max - 1 - j

    # ---- load (BlackwellForward.load / load_one)
    def load(self, cta):
        me = f"load@{cta}"
        sq = PipelineState.producer(self.specs["q"].stages)
        skv = PipelineState.producer(self.specs["kv"].stages)

        def one(pipe, state, buf, version):
            yield Wait(self.bar[cta, pipe, "empty", state.index], state.phase)
            full = self.full(cta, pipe, state.index)
            if cta == 0:  # the leader announces the pair's bytes (arrive_expect_tx)
                full.arrive(me, 1, tx=self.ctas * self.tx[pipe])
            # the copy completes the phase of this stage's fill number
            self.sim.tma_copy(buf, version, full, self.tx[pipe], state.count // state.stages, me)
            yield busy(1, f"issue {version[0]}")
            state.advance()

        for tile, n_min, n_max in self.steps:
            if n_max <= n_min:
                continue
            yield from one("kv", skv, self.buf[cta, "KV", skv.index], ("K", tile, n_max - 1))
            for i in range(Q_STAGES):
                yield from one("q", sq, self.buf[cta, "Q", sq.index], ("Q", tile, i))
            yield from one("kv", skv, self.buf[cta, "KV", skv.index], ("V", tile, n_max - 1))
            for j in range(1, n_max - n_min):
                nb = self.n_block(n_max, j)
                yield from one("kv", skv, self.buf[cta, "KV", skv.index], ("K", tile, nb))
                yield from one("kv", skv, self.buf[cta, "KV", skv.index], ("V", tile, nb))
        for pipe, state in (("kv", skv), ("q", sq)):  # producer_tail: the last empties land
            for _ in range(self.specs[pipe].stages):
                yield Wait(self.bar[cta, pipe, "empty", state.index], state.phase)
                state.advance()

    # ---- mma warp (BlackwellForward.mma / mma_tile), the leader only
    def mma(self):
        sq = PipelineState(self.specs["q"].stages)
        skv = PipelineState(self.specs["kv"].stages)
        p_phase = 0
        for tile, n_min, n_max in self.steps:
            if n_max <= n_min:
                continue
            n = n_max - n_min
            for _ in range(Q_STAGES):
                yield Wait(self.bar[0, "q", "full", sq.index], sq.phase)
                sq.advance()
            yield Wait(self.bar[0, "kv", "full", skv.index], skv.phase)
            for i in range(Q_STAGES):
                self.issue_s(tile, i, 0, skv.index, n_max)
                self.commit("s", i)
            self.commit("kv", skv.index)
            skv.advance()
            sv = skv.clone()
            for t in range(Q_STAGES * (n - 1)):
                i, j = t % Q_STAGES, t // Q_STAGES + 1
                if i == 0:
                    yield Wait(self.bar[0, "kv", "full", skv.index], skv.phase)
                    sv = skv.clone()
                    skv.advance()
                    yield Wait(self.bar[0, "kv", "full", skv.index], skv.phase)
                yield Wait(self.empty(0, "s", i), p_phase)
                if self.mutate == "s_before_pv":
                    self.issue_s(tile, i, j, skv.index, n_max)
                    self.issue_pv(tile, i, j - 1, sv.index, n_max)
                else:
                    self.issue_pv(tile, i, j - 1, sv.index, n_max)
                    self.issue_s(tile, i, j, skv.index, n_max)
                self.commit("s", i)
                if i == Q_STAGES - 1:
                    p_phase ^= 1
                    self.commit("kv", sv.index)
                    self.commit("kv", skv.index)
                    skv.advance()
                yield busy(1, "issue")
            for i in range(Q_STAGES):
                self.commit("q", i)
            yield Wait(self.bar[0, "kv", "full", skv.index], skv.phase)
            for i in range(Q_STAGES):
                yield Wait(self.empty(0, "s", i), p_phase)
                self.issue_pv(tile, i, n - 1, skv.index, n_max)
                self.commit("o", i)
            p_phase ^= 1
            self.commit("kv", skv.index)
            skv.advance()
            yield busy(1, "issue")

    def commit(self, pipe, s):
        self.sim.mma_issue({"commit": self.commit_targets(pipe, s)})

    def issue_s(self, tile, i, j, kv_stage, n_max):
        reads, writes = [], []
        for c in range(self.ctas):  # a pair's MMA reads both CTAs' Q rows and K halves
            reads += [(self.buf[c, "Q", i], ("Q", tile, i)),
                      (self.buf[c, "KV", kv_stage], ("K", tile, self.n_block(n_max, j)))]
            writes.append((self.buf[c, "SP", i], ("S", tile, j)))
        self.sim.mma_issue({"reads": reads, "writes": writes, "label": f"S{i}"})

    def issue_pv(self, tile, i, j, kv_stage, n_max):
        reads, writes = [], []
        for c in range(self.ctas):
            # accumulate onto O rescaled for this step; the tile's first P V overwrites O, so
            # the previous tile's final O must have been read out by then
            o_expect = ("O", tile, "scaled", j) if j > 0 else (lambda v: v[2] == "read")
            reads += [(self.buf[c, "SP", i], ("P", tile, j)),
                      (self.buf[c, "KV", kv_stage], ("V", tile, self.n_block(n_max, j))),
                      (self.buf[c, "O", i], o_expect)]
            writes.append((self.buf[c, "O", i], ("O", tile, "acc", j)))
        self.sim.mma_issue({"reads": reads, "writes": writes, "label": f"PV{i}"})

    # ---- softmax warpgroups (BlackwellForward.softmax / softmax_step)
    def softmax(self, cta, i):
        me = f"softmax{i}@{cta}"
        wg = self.specs["stats"].full_arrivals  # 128 threads arrive, one per row
        s_phase, stats_phase = 0, 1
        sp = self.buf[cta, "SP", i]
        for tile, n_min, n_max in self.steps:
            if n_max <= n_min:
                continue
            for j in range(n_max - n_min):
                yield Wait(self.bar[cta, "s", "full", i], s_phase)
                s_phase ^= 1
                sp.start_read(me, ("S", tile, j))
                yield busy(self.sim.ticks("read_s"), "tcgen05.ld S")
                sp.end_read(me)
                yield busy(self.sim.ticks("softmax") // 2, "max")
                if j > 0:
                    stats_phase = yield from self.send(cta, i, me, stats_phase,
                                                       ("alpha", tile, j))
                yield busy(self.sim.ticks("softmax"), "exp2")
                if self.mutate == "softmax_releases_before_store":
                    self.empty(cta, "s", i).arrive(me, wg)
                sp.start_write(me)
                yield busy(self.sim.ticks("store_p"), "tcgen05.st P")
                sp.end_write(me, ("P", tile, j))
                if self.mutate != "softmax_releases_before_store":
                    self.empty(cta, "s", i).arrive(me, wg)
            stats_phase = yield from self.send(cta, i, me, stats_phase, ("inv", tile))

    def send(self, cta, i, me, phase, version):
        """send_stat: wait for a free slot, write one float per row, arrive (128 threads)."""
        yield Wait(self.bar[cta, "stats", "empty", i], phase)
        st = self.buf[cta, "stats", i]
        st.start_write(me)
        yield busy(1, "stat")
        st.end_write(me, version)
        self.bar[cta, "stats", "full", i].arrive(me, self.specs["stats"].full_arrivals)
        return phase ^ 1

    # ---- correction warpgroup (BlackwellForward.correction / rescale_o / store_o)
    def correction(self, cta):
        me = f"correction@{cta}"
        wg = self.specs["stats"].empty_arrivals
        if self.mutate != "no_initial_release":
            for i in range(Q_STAGES):
                self.empty(cta, "s", i).arrive(me, wg)
        stats_phase, o_phase = 0, 0
        epi = PipelineState.producer(self.specs["epi"].stages)
        for tile, n_min, n_max in self.steps:
            if n_max > n_min:
                for j in range(1, n_max - n_min):
                    for i in range(Q_STAGES):
                        yield from self.receive(cta, i, me, stats_phase, ("alpha", tile, j))
                        o = self.buf[cta, "O", i]
                        if self.sim.rng.random() < self.sim.timing.rescale_share:
                            o.start_read(me, ("O", tile, "acc", j - 1))
                            o.end_read(me)
                            o.start_write(me)
                            yield busy(self.sim.ticks("rescale"), "rescale O")
                            o.end_write(me, ("O", tile, "scaled", j))
                        else:  # the warp's vote: no row grew by more than tau
                            if o.version != ("O", tile, "acc", j - 1):
                                raise StaleRead(f"t={self.sim.now}: {me} skips rescaling O{i} "
                                                f"at step {j}, but it holds {o.version}")
                            o.version = ("O", tile, "scaled", j)
                        self.empty(cta, "s", i).arrive(me, wg)
                    stats_phase ^= 1
                for i in range(Q_STAGES):
                    yield from self.receive(cta, i, me, stats_phase, ("inv", tile))
                    if self.mutate != "correction_skips_o_wait":
                        yield Wait(self.bar[cta, "o", "full", i], o_phase)
                    epi = yield from self.store_o(cta, i, me, epi, tile,
                                                  ("O", tile, "acc", n_max - n_min - 1))
                    o = self.buf[cta, "O", i]
                    o.version = ("O", tile, "read")
                    self.empty(cta, "s", i).arrive(me, wg)
                stats_phase ^= 1
                o_phase ^= 1
            else:  # no key visible: zeros
                for i in range(Q_STAGES):
                    epi = yield from self.store_o(cta, i, me, epi, tile, None)
        for _ in range(self.specs["epi"].stages):  # producer_tail
            yield Wait(self.bar[cta, "epi", "empty", epi.index], epi.phase)
            epi.advance()

    def receive(self, cta, i, me, phase, version):
        yield Wait(self.bar[cta, "stats", "full", i], phase)
        st = self.buf[cta, "stats", i]
        st.start_read(me, version)
        st.end_read(me)
        self.bar[cta, "stats", "empty", i].arrive(me, self.specs["stats"].empty_arrivals)

    def store_o(self, cta, i, me, epi, tile, o_expect):
        yield Wait(self.bar[cta, "epi", "empty", epi.index], epi.phase)
        so = self.buf[cta, "sO", epi.index]
        o = self.buf[cta, "O", i]
        if o_expect is not None:
            o.start_read(me, o_expect)
        so.start_write(me)
        yield busy(self.sim.ticks("epilogue"), "O / l -> sO")
        so.end_write(me, ("O", tile, i))
        if o_expect is not None:
            o.end_read(me)
        self.bar[cta, "epi", "full", epi.index].arrive(me, self.specs["epi"].full_arrivals)
        epi.advance()
        return epi

    # ---- epilogue warp (BlackwellForward.epilogue)
    def epilogue(self, cta):
        me = f"epilogue@{cta}"
        state = PipelineState(self.specs["epi"].stages)
        for tile, _, _ in self.steps:
            held = []
            for i in range(Q_STAGES):
                yield Wait(self.bar[cta, "epi", "full", state.index], state.phase)
                so = self.buf[cta, "sO", state.index]
                so.start_read(me, ("O", tile, i))
                held.append((state.index, so))
                state.advance()
            yield busy(self.sim.ticks("store"), "TMA store O")
            for idx, so in held:
                so.end_read(me)
                self.bar[cta, "epi", "empty", idx].arrive(me, self.specs["epi"].empty_arrivals)

    def run(self) -> ForwardSim:
        self.sim.run()
        for (cta, name, side, _), b in self.bar.items():
            # Note [The correction runs one phase ahead]: its start-up release leaves one
            # warpgroup's arrivals pending on each s[i] EMPTY barrier (the leader's) at exit
            ahead = self.specs["stats"].empty_arrivals * self.ctas \
                if (name, side, cta) == ("s", "empty", 0) else 0
            if b.pending != b.arrivals - ahead or b.tx:
                raise PipelineError(f"the kernel ended with {b.describe()}: arrivals of a "
                                    f"phase that never completed")
        return self


def simulate(kernel, prob: Problem, seeds=range(3), **kw) -> list[ForwardSim]:
    return [ForwardSim(kernel, prob, seed=s, **kw).run() for s in seeds]


def make_kernel(head_dim=128, causal=False, cfg: BlackwellFwdConfig | None = None,
                dtype="bf16", **window):
    """The kernel object (no compile): its config, roles and pipeline table."""
    from fa4_final.blackwell.fwd import BlackwellForward
    from fa4_final.common.constants import CUTLASS_BY_NAME

    return BlackwellForward(CUTLASS_BY_NAME[dtype], head_dim, causal,
                            cfg or BlackwellFwdConfig(), **window)


def draw_timeline(fs: ForwardSim, t_max: int | None = None, ax=None, title=None):
    """Gantt chart of a logged ForwardSim: the tensor cores, each role's work and waits."""
    import matplotlib.pyplot as plt

    spans = fs.sim.spans
    lanes = ["TMA", "tensor cores"] + [a.name for a in fs.sim.agents]
    y = {lane: i for i, lane in enumerate(lanes)}
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.2))
    colors = {"S0": "#1f77b4", "S1": "#aec7e8", "PV0": "#ff7f0e", "PV1": "#ffbb78",
              "wait": "white", "exp2": "#2ca02c", "max": "#98df8a", "rescale O": "#d62728",
              "O / l -> sO": "#9467bd", "TMA store O": "#8c564b", "K": "#7f7f7f",
              "V": "#bcbd22", "Q": "#17becf"}
    for lane, t0, t1, label in spans:
        if t_max is not None and t0 > t_max:
            continue
        if lane not in y:
            continue
        c = colors.get(label, "#cccccc")
        ax.barh(y[lane], t1 - t0, left=t0, color=c, edgecolor="#999999" if label == "wait"
                else c, hatch="..." if label == "wait" else None, height=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if t_max is not None:
        ax.set_xlim(0, t_max)
    ax.set_xlabel("tick (random operation times)")
    from matplotlib.patches import Patch

    shown = ["S0", "S1", "PV0", "PV1", "max", "exp2", "rescale O", "O / l -> sO", "wait"]
    ax.legend(handles=[Patch(facecolor=colors[k], edgecolor="#999999",
                             hatch="..." if k == "wait" else None, label=k) for k in shown],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "one CTA's roles, simulated")
    ax.grid(axis="y", visible=False)
    return ax


@dataclass
class Sweep:
    """Outcome of simulating many problems: how many ran clean, and the first failure."""

    runs: int = 0
    tiles: int = 0
    kv_steps: int = 0
    failures: list = field(default_factory=list)


def sweep(kernel, problems, seeds=range(4), **kw) -> Sweep:
    out = Sweep()
    for prob in problems:
        for s in seeds:
            try:
                fs = ForwardSim(kernel, prob, seed=s, **kw).run()
            except PipelineError as exc:
                out.failures.append((prob, s, exc))
                continue
            out.runs += 1
            out.tiles += len(fs.steps)
            out.kv_steps += sum(max(b - a, 0) for _, a, b in fs.steps)
    return out


# ----------------------------------------------------------------------------------------------
# the backward (chapter 12): fa4_final.blackwell.bwd.BlackwellBackward, one CTA = one key tile


class Cond:
    """A wait on something that is not an mbarrier (``cp.async.bulk.wait_group``): ready when
    ``test()`` holds; waited on with any parity."""

    def __init__(self, name: str, test):
        self.name, self.test = name, test

    def ready(self, parity: int) -> bool:
        return self.test()

    def describe(self) -> str:
        return f"{self.name} (not yet)"


@dataclass(frozen=True)
class BwdProblem:
    """One backward problem and the key tile (CTA) simulated."""

    seqlen_q: int
    seqlen_k: int
    heads: int = 1
    heads_kv: int = 1
    causal: bool = False
    n_block: int = 0
    window_left: int | None = None
    window_right: int | None = None


def bwd_steps(kernel, prob: BwdProblem) -> int:
    """Steps of the CTA's inner loop: the query tiles that see its keys
    (``bwd_tiles.q_tile_range``, what ``cta_work`` calls) times the heads of the kv head's
    group."""
    from fa4_final.common.bwd_tiles import q_tile_range

    m_min, m_max, _, _ = q_tile_range(kernel.window, prob.n_block, prob.seqlen_q, prob.seqlen_k,
                                      prob.window_left, prob.window_right)
    return (m_max - m_min) * (prob.heads // prob.heads_kv)


class BackwardSim(_KernelSim):
    """The barriers and buffers of one CTA of ``kernel`` (a ``BlackwellBackward``) and its
    roles as agents: load, mma, compute0, compute1 (separate agents: nothing orders their
    threads but the barriers), dq. Pipelines from ``kernel.pipelines()``; the TMEM buffers from
    ``kernel.plan``: S^T in units of the columns one warpgroup's P^T takes, so that the columns
    P^T shares with S^T are their own buffers; dP^T and dQ (which lives in dP^T's columns) one
    buffer; dV, dK. Shared memory: K, V, the Q (+ lse) and dO (+ delta) rings, the two halves of
    dS (one per warpgroup), the dQ staging buffers.

    ``mutate`` names a deliberate bug (BUGS) to show what the checks catch. One is no bug:
    ``ds_without_dq_wait`` runs clean, because S^T(i+1), whose completion the compute warps
    wait for before they compute dS(i+1), is issued after dK(i) and dQ(i) and tcgen05 MMAs of
    one thread complete in order; the kernel's wait on dq's FULL barrier is a second guarantee
    of the same fact (REDUNDANT)."""

    REDUNDANT = ("ds_without_dq_wait",)
    BUGS = {
        "no_compute_sync": "the compute warpgroups store P^T without first waiting for each "
                           "other to have loaded S^T (NamedBarrier.COMPUTE)",
        "dp_without_dq_read": "the MMA warp issues dP^T(i+1) without waiting for the dQ warps "
                              "to have read dQ(i) out of the same columns",
        "ds_without_dq_wait": "the compute warps store dS(i+1) without waiting for dQ(i) (so "
                              "for dK(i) and dQ(i) to have read dS(i)): REDUNDANT, see above",
        "release_do_before_dv": "the MMA warp frees the dO stage before issuing dV += P^T dO",
        "one_dq_buffer_wait": "the dQ warps reuse a staging buffer while a bulk add reads it",
        "delta_with_do": "delta rides in the dO stage (the first design), which dV frees",
    }

    def __init__(self, kernel, prob: BwdProblem, seed: int = 0, timing: Timing | None = None,
                 mutate: str | None = None, log: bool = False):
        from fa4_final.blackwell.bwd import GROUP_THREADS, NamedBarrier
        from fa4_final.blackwell.config import BWD_DQ_BUFFERS, BWD_DQ_CHUNK

        super().__init__(kernel, prob, seed, timing, mutate, log)
        self.steps = bwd_steps(kernel, prob)
        self.group_threads = GROUP_THREADS
        self.dq_buffers, self.dq_chunks = BWD_DQ_BUFFERS, kernel.head_dim // BWD_DQ_CHUNK
        self.bar = {}  # (pipe, side, stage) -> Barrier
        for name, spec in self.specs.items():
            for st in range(spec.stages):
                for side, n in (("full", spec.full_arrivals), ("empty", spec.empty_arrivals)):
                    self.bar[name, side, st] = Barrier(f"{name}.{side}[{st}]", n, self.sim)
        # bar.sync NamedBarrier.COMPUTE: both compute warpgroups (a hardware barrier's phases)
        self.compute_sync = Barrier(f"bar.sync {int(NamedBarrier.COMPUTE)}", 2 * GROUP_THREADS,
                                    self.sim) if hasattr(NamedBarrier, "COMPUTE") else None
        # TMEM: S^T in units of one warpgroup's P^T columns (Note [The backward's plan])
        plan = kernel.plan
        self.unit = plan["P"].columns // 2
        s_units = plan["S"].columns // self.unit
        half = kernel.tile_m // 2
        self.s_read = {g: [(g * half + c) // self.unit for c in range(0, half, self.unit)]
                       for g in (0, 1)}  # the S^T units warpgroup g loads
        self.p_units = {g: (plan["P"].start - plan["S"].start) // self.unit + g for g in (0, 1)}
        self.buf = {("S", u): Buffer(f"TMEM S^T cols {u * self.unit}..", self.sim)
                    for u in range(s_units)}
        for name in ("dPdQ", "dV", "dK", "K", "V", "dS0", "dS1"):
            self.buf[name, 0] = Buffer(name, self.sim)
        for i in range(self.dq_buffers):
            self.buf["sdQ", i] = Buffer(f"dQ staging {i}", self.sim)
        for pipe, what in (("q", "Q"), ("do", "dO")):
            for st in range(self.specs[pipe].stages):
                self.buf[what, st] = Buffer(f"{what} stage {st}", self.sim)
        self.bulk_groups: list[int] = []  # committed bulk-add groups still reading smem
        self._add_roles()

    def _add_roles(self):
        self.sim.add("load", self.load())
        self.sim.add("mma", self.mma())
        for g in (0, 1):
            self.sim.add(f"compute{g}", self.compute(g))
        self.sim.add("dq", self.store_dq())

    def full(self, name, st=0):
        return self.bar[name, "full", st]

    def empty(self, name, st=0):
        return self.bar[name, "empty", st]

    # ---- load warp (BlackwellBackward.load / load_one)
    def load(self):
        if self.steps == 0:
            return
        me = "load"
        kv = PipelineState.producer(1)
        yield Wait(self.empty("kv"), kv.phase)
        self.full("kv").arrive(me, 1, tx=2)
        for what in ("K", "V"):
            self.sim.tma_copy(self.buf[what, 0], (what,), self.full("kv"), 1, 0, me)
        yield busy(1, "issue K, V")
        sq = PipelineState.producer(self.specs["q"].stages)
        sdo = PipelineState.producer(self.specs["do"].stages)
        for t in range(self.steps):
            for pipe, what, state in (("q", "Q", sq), ("do", "dO", sdo)):
                yield Wait(self.empty(pipe, state.index), state.phase)
                full = self.full(pipe, state.index)
                full.arrive(me, 1, tx=1)
                self.sim.tma_copy(self.buf[what, state.index], (what, t), full, 1,
                                  state.count // state.stages, me)
                yield busy(1, f"issue {what}")
                state.advance()
        for pipe, state in (("q", sq), ("do", sdo)):  # producer_tail
            for _ in range(self.specs[pipe].stages):
                yield Wait(self.empty(pipe, state.index), state.phase)
                state.advance()

    # ---- MMA warp (BlackwellBackward.mma): S^T, dP^T, dV, dK, dQ in issue order
    def commit(self, *barriers):
        self.sim.mma_issue({"commit": list(barriers)})

    def gemm(self, label, reads, writes):
        self.sim.mma_issue({"reads": reads, "writes": writes, "label": label})

    def mma(self):
        sq = PipelineState(self.specs["q"].stages)
        sdo = PipelineState(self.specs["do"].stages)
        phase = 0
        s_all = [self.buf[k] for k in self.buf if k[0] == "S"]
        p_bufs = [self.buf["S", self.p_units[g]] for g in (0, 1)]
        ds = [self.buf["dS0", 0], self.buf["dS1", 0]]
        if self.steps > 0:
            yield Wait(self.full("kv"), 0)
        for t in range(self.steps):
            yield Wait(self.full("q", sq.index), sq.phase)
            q = self.buf["Q", sq.index]
            self.gemm("S^T", [(self.buf["K", 0], ("K",)), (q, ("Q", t))],
                      [(b, ("S", t)) for b in s_all])
            self.commit(self.full("s"))
            yield Wait(self.full("do", sdo.index), sdo.phase)
            do = self.buf["dO", sdo.index]
            if self.mutate != "dp_without_dq_read":
                yield Wait(self.empty("dq"), phase ^ 1)
            self.gemm("dP^T", [(self.buf["V", 0], ("V",)), (do, ("dO", t))],
                      [(self.buf["dPdQ", 0], ("dP", t))])
            self.commit(self.full("dp"))
            yield Wait(self.empty("s"), phase)
            dv = self.buf["dV", 0]
            if self.mutate == "release_do_before_dv":
                self.commit(self.empty("do", sdo.index))
            self.gemm("dV", [(b, ("P", t)) for b in p_bufs] + [(do, ("dO", t))]
                      + ([(dv, ("dV", t - 1))] if t else []), [(dv, ("dV", t))])
            if self.mutate != "release_do_before_dv":
                self.commit(self.empty("do", sdo.index))
            sdo.advance()
            yield Wait(self.empty("dp"), phase)
            dk = self.buf["dK", 0]
            self.gemm("dK", [(b, ("dS", t)) for b in ds] + [(q, ("Q", t))]
                      + ([(dk, ("dK", t - 1))] if t else []), [(dk, ("dK", t))])
            self.gemm("dQ", [(b, ("dS", t)) for b in ds] + [(self.buf["K", 0], ("K",))],
                      [(self.buf["dPdQ", 0], ("dQ", t))])
            self.commit(self.full("dq"))
            self.commit(self.empty("q", sq.index))
            sq.advance()
            phase ^= 1
            yield busy(1, "issue")
        if self.steps > 0:
            self.commit(self.full("dkv"))

    # ---- compute warpgroups (BlackwellBackward.compute / compute_step / epilogue)
    def compute(self, g):
        me = f"compute{g}"
        n = self.group_threads
        sq = PipelineState(self.specs["q"].stages)
        sdo = PipelineState(self.specs["do"].stages)
        phase, syncs = 0, 0
        s_mine = [self.buf["S", u] for u in self.s_read[g]]
        p_mine = self.buf["S", self.p_units[g]]
        ds_mine = self.buf[f"dS{g}", 0]
        for t in range(self.steps):
            yield Wait(self.full("q", sq.index), sq.phase)
            yield Wait(self.full("s"), phase)
            yield busy(self.sim.ticks("jitter"), "scheduled")
            q = self.buf["Q", sq.index]
            rows = self.buf["dO", sdo.index] if self.mutate == "delta_with_do" else q
            yield from self.load_and_combine(me, s_mine, ("S", t), q, ("Q", t),  # Q's lse
                                             "tcgen05.ld S^T", "exp2")
            if self.compute_sync is not None and self.mutate != "no_compute_sync":
                self.compute_sync.arrive(me, n)  # every S^T column loaded before P^T is stored
                yield Wait(self.compute_sync, syncs & 1)
                syncs += 1
            p_mine.start_write(me)
            yield busy(self.sim.ticks("store_p"), "tcgen05.st P^T")
            p_mine.end_write(me, ("P", t))
            self.empty("s").arrive(me, n)
            if self.mutate == "delta_with_do":
                yield Wait(self.full("do", sdo.index), sdo.phase)
            yield Wait(self.full("dp"), phase)
            yield from self.load_and_combine(  # delta
                me, [self.buf["dPdQ", 0]], ("dP", t), rows, lambda v: v is not None and v[1] == t,
                "tcgen05.ld dP^T", "dS^T", 2)
            if self.mutate != "ds_without_dq_wait":
                yield Wait(self.full("dq"), phase ^ 1)
            ds_mine.start_write(me)
            yield busy(self.sim.ticks("store_p"), "dS^T -> smem")
            ds_mine.end_write(me, ("dS", t))
            self.empty("dp").arrive(me, n)
            sq.advance()
            sdo.advance()  # only the mutation reads the dO ring
            phase ^= 1
        if self.steps > 0:  # epilogue: dK, dV once the last MMA completed
            yield Wait(self.full("dkv"), 0)
            for name in ("dV", "dK"):
                b = self.buf[name, 0]
                b.start_read(me, (name, self.steps - 1))
                yield busy(self.sim.ticks("epilogue"), f"{name} -> global")
                b.end_read(me)

    # ---- dQ warpgroup (BlackwellBackward.store_dq)
    def store_dq(self):
        me = "dq"
        phase, buf = 0, 0
        dpdq = self.buf["dPdQ", 0]
        for t in range(self.steps):
            yield Wait(self.full("dq"), phase)
            for c in range(self.dq_chunks):
                dpdq.start_read(me, ("dQ", t))
                yield busy(self.sim.ticks("read_s"), "tcgen05.ld dQ")
                dpdq.end_read(me)
                if c == self.dq_chunks - 1:
                    self.empty("dq").arrive(me, self.specs["dq"].empty_arrivals)
                keep = self.dq_buffers - 1 if self.mutate != "one_dq_buffer_wait" \
                    else self.dq_buffers
                yield Wait(Cond("cp.async.bulk.wait_group.read",  # all but the newest keep
                                lambda keep=keep: not any(self.bulk_groups[:len(
                                    self.bulk_groups) - keep])), 0)
                stage = self.buf["sdQ", buf]
                stage.start_write(me)
                yield busy(self.sim.ticks("epilogue"), "dQ -> staging")
                stage.end_write(me, ("dQ", t, c))
                stage.start_read("bulk add", ("dQ", t, c))
                self.bulk_groups.append(True)  # in flight, in commit order
                slot = len(self.bulk_groups) - 1

                def done(stage=stage, slot=slot):
                    stage.end_read("bulk add")
                    self.bulk_groups[slot] = False

                self.sim.after(self.sim.ticks("store"), done)
                buf ^= 1
            phase ^= 1
        yield Wait(Cond("cp.async.bulk.wait_group.read 0", lambda: not any(self.bulk_groups)),
                   0)

    def run(self) -> BackwardSim:
        self.sim.run()
        for b in list(self.bar.values()) + [self.compute_sync] * (self.compute_sync is not None):
            if b.pending != b.arrivals or b.tx:
                raise PipelineError(f"the kernel ended with {b.describe()}: arrivals of a "
                                    f"phase that never completed")
        return self


class PairBackwardSim(_KernelSim):
    """The 2-CTA backward (``fa4_final.blackwell.bwd_pair.BlackwellBackwardPair``): both CTAs of
    one pair (256 keys) and their roles as agents: load@r, compute0@r, compute1@r, dq@r for
    r = 0 (leader), 1; the leader's MMA warp, which issues every pair GEMM (each reads both
    CTAs' shared memory and TMEM and writes both CTAs' TMEM); the follower's MMA warp, which
    relays its dS-exchange barrier to the leader. Barriers from ``kernel.pipelines()``, placed
    by kind (``full`` / ``empty``): a tma_umma FULL barrier lives in the leader and counts both
    CTAs' bytes; an umma_async EMPTY barrier lives in the leader and counts both CTAs' warps;
    the leader's tcgen05.commit arrives on the barrier in both CTAs. TMEM in 32-column units
    (one warpgroup's P^T or dS^T): S^T, dP^T; dQ and dS^T in dP^T's units (``kernel.plan``).
    Shared memory per CTA: K, V, Kt; the Q, Qt, dO, dOt stages; lse, delta (the rows ring);
    the two 128-key blocks of dS (block r written by CTA r's warpgroup r, block 1 - r by the
    peer's warpgroup r, through DSMEM: st.async, which completes bytes on the receiving CTA's
    dsx barrier); the dQ staging buffers.

    ``mutate`` names a deliberate bug (BUGS). ``REDUNDANT`` as in BackwardSim: the dq FULL wait
    before dS is stored is a second guarantee of what in-order MMAs already give."""

    REDUNDANT = ("ds_without_dq_wait",)
    BUGS = {
        "dq_without_relay": "the leader issues dQ = dS K without waiting for the follower's "
                            "dS-exchange barrier (relayed by the follower's MMA warp)",
        "dq_without_own_dsx": "the leader issues dQ without waiting for the peer's 16 KB of dS "
                              "to land in its own shared memory",
        "no_ds_sync": "the compute warpgroups store dS^T over dP^T's upper columns without first "
                      "waiting for each other to have loaded dP^T (NamedBarrier.COMPUTE)",
        "empty_counts_one_cta": "the leader's EMPTY barriers of s, dp, dq count one CTA's "
                                "warps, not both CTAs'",
        "leader_counts_own_bytes": "the leader arms its FULL barriers with its own TMA bytes "
                                   "only, not the follower's too",
        "commit_to_leader_only": "tcgen05.commit arrives on the leader's barriers only, not "
                                 "multicast to both CTAs",
        "ds_without_dq_wait": "the compute warps store dS(i+1) (locally and into the peer) "
                              "without waiting for dQ(i): REDUNDANT, see above",
    }

    def __init__(self, kernel, prob: BwdProblem, seed: int = 0, timing: Timing | None = None,
                 mutate: str | None = None, log: bool = False):
        from fa4_final.blackwell.bwd import GROUP_THREADS, WARPS_PER_GROUP
        from fa4_final.blackwell.config import BWD_DQ_BUFFERS, BWD_DQ_CHUNK

        super().__init__(kernel, prob, seed, timing, mutate, log)
        if mutate == "empty_counts_one_cta":
            from dataclasses import replace

            for name in ("s", "dp", "dq"):
                spec = self.specs[name]
                self.specs[name] = replace(spec, empty_arrivals=spec.empty_arrivals // 2)
        self.steps = bwd_steps(kernel, prob)
        self.group_threads, self.warps = GROUP_THREADS, WARPS_PER_GROUP
        self.dq_buffers = BWD_DQ_BUFFERS
        self.dq_chunks = kernel.head_dim // 2 // BWD_DQ_CHUNK  # each CTA: D/2 columns a lane
        self.bulk_adds = [0, 0]  # 8 KB bulk adds of dQ issued by each CTA
        self.bar = {}  # (cta, pipe, side, stage) -> Barrier
        for name, spec in self.specs.items():
            for cta in (0, 1):
                for st in range(spec.stages):
                    for side, n in (("full", spec.full_arrivals), ("empty", spec.empty_arrivals)):
                        if n:
                            self.bar[cta, name, side, st] = Barrier(
                                f"{name}.{side}[{st}]@cta{cta}", n, self.sim)
        # bar.sync NamedBarrier.COMPUTE of each CTA: both of its compute warpgroups
        self.compute_sync = [Barrier(f"bar.sync COMPUTE@cta{c}", 2 * GROUP_THREADS, self.sim)
                             for c in (0, 1)]
        plan = kernel.plan
        self.unit = plan["P"].columns // 2  # columns of one warpgroup's P^T or dS^T
        half = kernel.tile_m // 2

        def units(region, host):
            first = (plan[region].start - plan[host].start) // self.unit
            return list(range(first, first + plan[region].columns // self.unit))

        self.read_units = {g: [(g * half + c) // self.unit for c in range(0, half, self.unit)]
                           for g in (0, 1)}  # the S^T / dP^T units warpgroup g loads
        self.p_unit = {g: units("P", "S")[g] for g in (0, 1)}
        self.ds_unit = {g: units("dS", "dP")[g] for g in (0, 1)}
        self.dq_units = units("dQ", "dP")
        self.buf = {}
        for c in (0, 1):
            for host in ("S", "dP"):
                for u in range(plan[host].columns // self.unit):
                    self.buf[c, host, u] = Buffer(f"TMEM {host} unit {u}@cta{c}", self.sim)
            for name in ("dV", "dK", "K", "V", "Kt", "sdS0", "sdS1"):
                self.buf[c, name, 0] = Buffer(f"{name}@cta{c}", self.sim)
            for i in range(self.dq_buffers):
                self.buf[c, "sdQ", i] = Buffer(f"dQ staging {i}@cta{c}", self.sim)
            for pipe, whats in (("q", ("Q", "Qt")), ("do", ("dO", "dOt")),
                                ("rows", ("LSE", "Delta"))):
                for st in range(self.specs[pipe].stages):
                    for what in whats:
                        self.buf[c, what, st] = Buffer(f"{what} stage {st}@cta{c}", self.sim)
        self.bulk_groups = {0: [], 1: []}
        self._add_roles()

    def _add_roles(self):
        for c in (0, 1):
            self.sim.add(f"load@{c}", self.load(c))
        self.sim.add("mma@0", self.mma())
        self.sim.add("relay@1", self.relay())
        for c in (0, 1):
            for g in (0, 1):
                self.sim.add(f"compute{g}@{c}", self.compute(c, g))
            self.sim.add(f"dq@{c}", self.store_dq(c))

    # where each barrier lives (PairBackwardSim docstring; bwd_pair Note [The pair's handshakes])
    def full(self, name, cta, st=0):
        kind = self.specs[name].kind
        return self.bar[0 if kind in ("tma_umma", "relay") else cta, name, "full", st]

    def empty(self, name, cta, st=0):
        kind = self.specs[name].kind
        return self.bar[0 if kind == "umma_async" else cta, name, "empty", st]

    def commit(self, name, st=0):
        """The leader's tcgen05.commit: FULL of an umma_async pipeline, EMPTY of a tma_umma one,
        in both CTAs (in the leader's only, for the mutation)."""
        side = "empty" if self.specs[name].kind == "tma_umma" else "full"
        ctas = (0,) if self.mutate == "commit_to_leader_only" else (0, 1)
        self.sim.mma_issue({"commit": [self.bar[c, name, side, st] for c in ctas]})

    def gemm(self, label, reads, writes):
        self.sim.mma_issue({"reads": reads, "writes": writes, "label": label})

    def both(self, name, st=0):
        return [self.buf[c, name, st] for c in (0, 1)]

    # ---- load warp of CTA r (BlackwellBackwardPair.load)
    def load(self, r):
        if self.steps == 0:
            return
        me = f"load@{r}"
        pair_bytes = 1 if self.mutate == "leader_counts_own_bytes" else 2

        def stage(pipe, whats, state, version):
            yield Wait(self.empty(pipe, r, state.index), state.phase)
            full = self.full(pipe, r, state.index)
            local = self.specs[pipe].kind == "local"
            if r == 0 or local:  # the leader arms the pair's barrier with both CTAs' bytes
                full.arrive(me, 1, tx=len(whats) * (1 if local else pair_bytes))
            for what in whats:
                self.sim.tma_copy(self.buf[r, what, state.index], (what,) + version, full, 1,
                                  state.count // state.stages, me)
            yield busy(1, f"issue {'/'.join(whats)}")
            state.advance()

        yield from stage("kv", ("K", "V", "Kt"), PipelineState.producer(1), ())
        states = {p: PipelineState.producer(self.specs[p].stages) for p in ("q", "rows", "do")}
        for t in range(self.steps):
            for pipe, whats in (("q", ("Q", "Qt")), ("rows", ("LSE", "Delta")),
                                ("do", ("dO", "dOt"))):
                yield from stage(pipe, whats, states[pipe], (t,))
        for pipe, state in states.items():  # producer_tail
            for _ in range(self.specs[pipe].stages):
                yield Wait(self.empty(pipe, r, state.index), state.phase)
                state.advance()

    # ---- the leader's MMA warp (BlackwellBackwardPair.mma): five pair GEMMs per step
    def mma(self):
        sq = PipelineState(self.specs["q"].stages)
        sdo = PipelineState(self.specs["do"].stages)
        phase = 0
        plan = self.k.plan
        s_all = [self.buf[c, "S", u] for c in (0, 1) for u in range(plan["S"].columns
                                                                     // self.unit)]
        dp_all = [self.buf[c, "dP", u] for c in (0, 1) for u in range(plan["dP"].columns
                                                                       // self.unit)]
        if self.steps > 0:
            yield Wait(self.full("kv", 0), 0)
        for t in range(self.steps):
            yield Wait(self.full("q", 0, sq.index), sq.phase)
            kq = [(b, ("K",)) for b in self.both("K")] + [(b, ("Q", t))
                                                          for b in self.both("Q", sq.index)]
            self.gemm("S^T", kq, [(b, ("S", t)) for b in s_all])
            self.commit("s")
            yield Wait(self.full("do", 0, sdo.index), sdo.phase)
            yield Wait(self.empty("dq", 0), phase ^ 1)  # dQ(t - 1) read out of dP^T's units
            vdo = [(b, ("V",)) for b in self.both("V")] + [(b, ("dO", t))
                                                           for b in self.both("dO", sdo.index)]
            self.gemm("dP^T", vdo, [(b, ("dP", t)) for b in dp_all])
            self.commit("dp")
            yield Wait(self.empty("s", 0), phase)  # P^T in both CTAs' TMEM
            p = [(self.buf[c, "S", self.p_unit[g]], ("P", t)) for c in (0, 1) for g in (0, 1)]
            dv = self.both("dV")
            self.gemm("dV", p + [(b, ("dOt", t)) for b in self.both("dOt", sdo.index)]
                      + ([(b, ("dV", t - 1)) for b in dv] if t else []),
                      [(b, ("dV", t)) for b in dv])
            self.commit("do", sdo.index)
            sdo.advance()
            yield Wait(self.empty("dp", 0), phase)  # dS^T in TMEM, own dS blocks stored
            ds_t = [(self.buf[c, "dP", self.ds_unit[g]], ("dS^T", t)) for c in (0, 1)
                    for g in (0, 1)]
            dk = self.both("dK")
            self.gemm("dK", ds_t + [(b, ("Qt", t)) for b in self.both("Qt", sq.index)]
                      + ([(b, ("dK", t - 1)) for b in dk] if t else []),
                      [(b, ("dK", t)) for b in dk])
            if self.mutate != "dq_without_own_dsx":
                yield Wait(self.full("dsx", 0), phase)  # the follower's dS block landed here
            if self.mutate != "dq_without_relay":
                yield Wait(self.full("dsx_relay", 0), phase)  # ours landed in the follower
            ds = [(self.buf[c, f"sdS{blk}", 0], ("dS", t)) for c in (0, 1) for blk in (0, 1)]
            self.gemm("dQ", ds + [(b, ("Kt",)) for b in self.both("Kt")],
                      [(self.buf[c, "dP", u], ("dQ", t)) for c in (0, 1) for u in self.dq_units])
            self.commit("dq")
            self.commit("q", sq.index)
            sq.advance()
            phase ^= 1
            yield busy(1, "issue")
        if self.steps > 0:
            self.commit("dkv")
            # the last dQ read by both CTAs' dQ warps: no remote arrival still in flight
            yield Wait(self.empty("dq", 0), phase ^ 1)

    # ---- the follower's MMA warp (BlackwellBackwardPair.relay)
    def relay(self):
        for t in range(self.steps):
            yield Wait(self.full("dsx", 1), t & 1)
            self.full("dsx_relay", 1).arrive("relay@1", 1)

    # ---- compute warpgroup g of CTA r (BlackwellBackwardPair.compute_step / epilogue)
    def sync(self, r, me, count):
        b = self.compute_sync[r]
        b.arrive(me, self.group_threads)
        yield Wait(b, count & 1)

    def compute(self, r, g):
        me = f"compute{g}@{r}"
        w = self.warps  # per-warp arrivals on the pair's barriers
        sr = PipelineState(self.specs["rows"].stages)
        phase, syncs = 0, 0
        s_mine = [self.buf[r, "S", u] for u in self.read_units[g]]
        dp_mine = [self.buf[r, "dP", u] for u in self.read_units[g]]
        peer = 1 - r if g != r else r  # whose sdS block r this warpgroup's dS goes to
        ds_dst = self.buf[peer, f"sdS{r}", 0]
        for t in range(self.steps):
            yield Wait(self.full("rows", r, sr.index), sr.phase)
            yield Wait(self.full("s", r), phase)
            yield busy(self.sim.ticks("jitter"), "scheduled")
            yield from self.load_and_combine(me, s_mine, ("S", t), self.buf[r, "LSE", sr.index],
                                             ("LSE", t), "tcgen05.ld S^T", "exp2")
            yield from self.sync(r, me, syncs)  # Note [P^T over S^T]
            syncs += 1
            p = self.buf[r, "S", self.p_unit[g]]
            p.start_write(me)
            yield busy(self.sim.ticks("store_p"), "tcgen05.st P^T")
            p.end_write(me, ("P", t))
            self.empty("s", r).arrive(me, w)
            yield Wait(self.full("dp", r), phase)
            yield from self.load_and_combine(me, dp_mine, ("dP", t),
                                             self.buf[r, "Delta", sr.index], ("Delta", t),
                                             "tcgen05.ld dP^T", "dS^T", 2)
            if self.mutate != "no_ds_sync":
                yield from self.sync(r, me, syncs)  # Note [dS^T over dP^T]
                syncs += 1
            dst = self.buf[r, "dP", self.ds_unit[g]]
            dst.start_write(me)
            yield busy(self.sim.ticks("store_p"), "tcgen05.st dS^T")
            dst.end_write(me, ("dS^T", t))
            if self.mutate != "ds_without_dq_wait":
                yield Wait(self.full("dq", r), phase ^ 1)  # dQ(t - 1) read both CTAs' dS
            ds_dst.start_write(me)
            if peer == r:
                yield busy(self.sim.ticks("store_p"), "dS -> own smem")
                ds_dst.end_write(me, ("dS", t))
            else:  # st.async into the peer; its bytes complete the peer's dsx barrier
                bar = self.full("dsx", peer)
                bar.arrive(me, 1, tx=1)  # one elected thread: mbarrier.expect_tx, remote
                yield busy(self.sim.ticks("store_p"), "st.async dS -> peer")

                def landed(buf=ds_dst, bar=bar, t=t):
                    buf.end_write("st.async", ("dS", t))
                    bar.land(1, t, f"dS {t} from {me}")

                self.sim.after(self.sim.ticks("dsmem"), landed)
            self.empty("dp", r).arrive(me, w)
            self.empty("rows", r, sr.index).arrive(me, w)
            sr.advance()
            phase ^= 1
        if self.steps > 0:  # epilogue: dK, dV of the CTA's keys once the last MMA completed
            yield Wait(self.full("dkv", r), 0)
            for name in ("dV", "dK"):
                b = self.buf[r, name, 0]
                b.start_read(me, (name, self.steps - 1))
                yield busy(self.sim.ticks("epilogue"), f"{name} -> global")
                b.end_read(me)

    # ---- dQ warpgroup of CTA r (BlackwellBackwardPair.store_dq): its 64 queries' dQ
    def store_dq(self, r):
        me = f"dq@{r}"
        phase, buf = 0, 0
        groups = self.bulk_groups[r]
        mine = [self.buf[r, "dP", u] for u in self.dq_units]
        for t in range(self.steps):
            yield Wait(self.full("dq", r), phase)
            for c in range(self.dq_chunks):
                for b in mine:
                    b.start_read(me, ("dQ", t))
                yield busy(self.sim.ticks("read_s"), "tcgen05.ld dQ")
                for b in mine:
                    b.end_read(me)
                if c == self.dq_chunks - 1:
                    self.empty("dq", r).arrive(me, self.warps)
                yield Wait(Cond("cp.async.bulk.wait_group.read", lambda: not any(
                    groups[:len(groups) - (self.dq_buffers - 1)])), 0)
                stage = self.buf[r, "sdQ", buf]
                stage.start_write(me)
                yield busy(self.sim.ticks("epilogue"), "dQ -> staging")
                stage.end_write(me, ("dQ", t, c))
                stage.start_read("bulk add", ("dQ", t, c))
                self.bulk_adds[r] += 2  # the chunk's two 64-row x 32-column blocks of 8 KB
                groups.append(True)
                slot = len(groups) - 1

                def done(stage=stage, slot=slot):
                    stage.end_read("bulk add")
                    groups[slot] = False

                self.sim.after(self.sim.ticks("store"), done)
                buf ^= 1
            phase ^= 1
        yield Wait(Cond("cp.async.bulk.wait_group.read 0", lambda: not any(groups)), 0)

    def run(self) -> PairBackwardSim:
        self.sim.run()
        for b in list(self.bar.values()) + self.compute_sync:
            if b.pending != b.arrivals or b.tx:
                raise PipelineError(f"the kernel ended with {b.describe()}: arrivals of a "
                                    f"phase that never completed")
        return self


def make_bwd_kernel(head_dim=128, causal=False, cfg=None, dtype="bf16", **window):
    """The backward kernel object (no compile): its config, roles, pipelines and TMEM plan."""
    from fa4_final.blackwell.bwd import BlackwellBackward
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair
    from fa4_final.blackwell.config import BlackwellBwdConfig
    from fa4_final.common.constants import CUTLASS_BY_NAME

    cfg = cfg or BlackwellBwdConfig()
    cls = BlackwellBackwardPair if cfg.two_cta else BlackwellBackward
    return cls(CUTLASS_BY_NAME[dtype], head_dim, causal, cfg, **window)


def bwd_problems(prob: BwdProblem, tile_n: int = 128) -> list[BwdProblem]:
    """Every key tile (CTA, or pair with ``tile_n`` = 256) of ``prob``: step counts from 0
    (keys no query sees) upwards."""
    from dataclasses import replace

    return [replace(prob, n_block=n) for n in range(-(-prob.seqlen_k // tile_n))]


def bwd_sweep(kernel, problems, seeds=range(3), **kw) -> Sweep:
    """Simulate every key tile of every problem; ``tiles`` counts CTAs, ``kv_steps`` steps."""
    out = Sweep()
    sim = PairBackwardSim if kernel.cfg.two_cta else BackwardSim
    for prob in problems:
        for cta in bwd_problems(prob, kernel.window.tile_n):
            for s in seeds:
                try:
                    bs = sim(kernel, cta, seed=s, **kw).run()
                except PipelineError as exc:
                    out.failures.append((cta, s, exc))
                    continue
                out.runs += 1
                out.tiles += 1
                out.kv_steps += bs.steps
    return out


# ----------------------------------------------------------------------------------------------
# chapters 09-10's primer: one tile on one CTA (OneTileAttention) or on a pair
# (PairTileAttention), replayed call by call from what each role's code did


class Uninitialised(PipelineError):
    pass


@dataclass(frozen=True)
class Op:
    """One call a role of the primer made, as the exercises' checkers record it.

    kind: "wait" (mbarrier_wait on ``bar`` of CTA ``cta`` with ``parity``), "arrive" (``count``
    arrivals on ``bar`` of CTA ``cta``), "gemm" (one tcgen05.mma of GEMM ``what``, "S" or "O",
    K-block ``k``, ``accumulate``), "commit" (tcgen05.commit onto ``bar``; ``mask`` 0b11 for
    both CTAs of a pair, None for the issuing CTA only; ``count`` commits: 32 when the whole
    warp issued it), "ld" / "st" (tcgen05.ld of ``what`` / tcgen05.st of ``what``), "wait_st"
    (tcgen05.wait::st), "init" (mbarrier_init of ``bar`` with ``count`` arrivals),
    "fence_init", "cluster_arrive", "cluster_wait"."""

    kind: str
    bar: str | None = None
    cta: int = 0
    parity: int = 0
    count: int = 1
    what: str = ""
    k: int = 0
    accumulate: bool = False
    mask: int | None = None
    relaxed: bool = True


PRIMER_BARS = ("load", "s", "p", "o")
PRIMER_ROWS = 128


def primer_mma_ops(head_dim: int = 128, pair: bool = False) -> list[Op]:
    """The MMA warp of the reference primer (of the leader CTA for a pair)."""
    ops = [Op("wait", "load")]
    ops += [Op("gemm", what="S", k=k, accumulate=k != 0) for k in range(head_dim // 16)]
    ops += [Op("commit", "s", mask=0b11 if pair else None), Op("wait", "p")]
    ops += [Op("gemm", what="O", k=k, accumulate=k != 0) for k in range(PRIMER_ROWS // 16)]
    return ops + [Op("commit", "o", mask=0b11 if pair else None)]


def primer_softmax_ops(pair: bool = False) -> list[Op]:
    """One softmax thread of the reference primer, up to its arrive (each CTA's, for a pair:
    the arrive goes to the leader's mbar_p)."""
    return [Op("wait", "s"), Op("ld", what="S"), Op("st", what="P"), Op("wait_st"),
            Op("arrive", "p", cta=0)]


def primer_init_ops(pair: bool = True) -> list[Op]:
    """The reference barrier set-up of one CTA of the pair (PairTileAttention)."""
    counts = {"load": 1, "s": 1, "p": 2 * PRIMER_ROWS if pair else PRIMER_ROWS, "o": 1}
    return [Op("init", b, count=counts[b]) for b in PRIMER_BARS] + [
        Op("fence_init"), Op("cluster_arrive"), Op("cluster_wait")]


@dataclass(frozen=True)
class AccVersion:
    """What an accumulator in TMEM (S or O) holds: the K-blocks summed into it and whether the
    sum started from zero (the first MMA overwrote what was there)."""

    name: str
    blocks: frozenset
    clean: bool
    total: int

    def __repr__(self) -> str:
        if not self.blocks:
            return f"what the previous tile left in {self.name}'s columns"
        if self.clean and len(self.blocks) == self.total:
            return f"the complete {self.name}"
        return (f"{self.name} after {len(self.blocks)} of its {self.total} K-blocks"
                + ("" if self.clean else ", added to what was there before"))

    def add(self, k: int, accumulate: bool) -> AccVersion:
        if accumulate:
            return AccVersion(self.name, self.blocks | {k}, self.clean, self.total)
        return AccVersion(self.name, frozenset({k}), True, self.total)


class PrimerBarrier(Barrier):
    """A primer barrier that knows whether it has been initialised, and whether its init is
    visible to the other CTA of a pair (published by a fence and a cluster arrive)."""

    def __init__(self, name: str, arrivals: int, sim: Sim, cta: int, initialised: bool):
        super().__init__(name, arrivals, sim)
        self.cta, self.initialised, self.published = cta, initialised, initialised

    def touch(self, who_cta: int, what: str) -> None:
        if not self.initialised:
            raise Uninitialised(
                f"t={self.sim.now}: {what} {self.name} before CTA {self.cta} initialised it: an "
                "mbarrier holds garbage until mbarrier_init, so the arrival or the wait is lost")
        if who_cta != self.cta and not self.published:
            raise Uninitialised(
                f"t={self.sim.now}: {what} {self.name} from CTA {who_cta} before CTA {self.cta}'s "
                "init was published to the cluster (fence.mbarrier_init, then the cluster "
                "barrier's arrive)")

    def ready(self, parity: int) -> bool:
        return self.initialised and super().ready(parity)


class PrimerSim:
    """The primer's roles as agents: the load warp (given), the MMA warp (``mma``: per CTA, a
    list of ``Op``), the softmax warpgroup (``softmax``: per CTA, a list of (threads, ops)
    groups: threads that made the same calls) and, for a pair, each CTA's barrier set-up
    (``init``: per CTA, ops; None: initialised before anything runs, as the one-CTA primer's
    inits followed by __syncthreads).

    Buffers carry versions: shared memory ("loaded"), S (the K-blocks summed into it and
    whether it started from zero), P, O. The tensor cores run MMAs in issue order; a commit
    arrives when every MMA before it has completed. tcgen05.st completes some ticks after it is
    issued; tcgen05.wait::st waits for that. CTA start times differ by up to ``skew`` ticks.
    Raises Deadlock, Overwrite, StaleRead, EarlyArrival or Uninitialised, in words."""

    def __init__(self, mma: dict, softmax: dict, init: dict | None = None, pair: bool = False,
                 head_dim: int = 128, seed: int = 0, skew: int = 30, log: bool = False):
        self.pair, self.d = pair, head_dim
        self.ctas = 2 if pair else 1
        self.sim = Sim(seed)
        self.sim.keep_log = log
        rng = random.Random(seed + 1000)
        self.start = [rng.randint(0, skew) if pair else 0 for _ in range(self.ctas)]
        default = primer_init_ops(pair)
        counts = {op.bar: op.count for op in default if op.kind == "init"}
        self.bar = {(c, b): PrimerBarrier(self._bar_name(c, b), counts[b], self.sim, c,
                                          initialised=init is None)
                    for c in range(self.ctas) for b in PRIMER_BARS}
        self.smem = [Buffer(f"CTA {c}'s shared memory (Q, K, V)", self.sim)
                     for c in range(self.ctas)]
        self.S = [Buffer(self._name(c, "S in TMEM"), self.sim) for c in range(self.ctas)]
        # P: one buffer per group of softmax threads (each group writes its own rows)
        self.P = [[Buffer(self._name(c, "P in TMEM" if len(softmax[c]) == 1 else
                                     f"P in TMEM (rows of group {g})"), self.sim)
                   for g in range(len(softmax[c]))] for c in range(self.ctas)]
        self.O = [Buffer(self._name(c, "O in TMEM"), self.sim) for c in range(self.ctas)]
        s0 = AccVersion("S", frozenset(), False, head_dim // 16)
        o0 = AccVersion("O", frozenset(), False, PRIMER_ROWS // 16)
        for c in range(self.ctas):
            self.S[c].version = s0  # what the last kernel left
            self.O[c].version = o0
        self.full_s = AccVersion("S", frozenset(range(s0.total)), True, s0.total)
        self.full_o = AccVersion("O", frozenset(range(o0.total)), True, o0.total)
        self.setup_done = [init is None] * self.ctas
        self.cluster_arrived = [0] * self.ctas
        self.s_version = [s0] * self.ctas
        self.o_version = [o0] * self.ctas
        for c in range(self.ctas):
            if init is not None:
                self.sim.add(f"CTA {c} set-up", self.setup(c, init[c]))
            self.sim.add(self._name(c, "load warp"), self.load(c))
            self.sim.add(self._name(c, "MMA warp"), self.mma(c, mma.get(c, [])))
            for g, (threads, ops) in enumerate(softmax[c]):
                label = "softmax warpgroup" if len(softmax[c]) == 1 else \
                    f"softmax threads of group {g} ({threads} thread(s))"
                self.sim.add(self._name(c, label), self.softmax(c, g, threads, ops, label))

    def _name(self, c: int, what: str) -> str:
        return f"CTA {c}'s {what}" if self.pair else what

    def _bar_name(self, c: int, b: str) -> str:
        return f"CTA {c}'s mbar_{b}" if self.pair else f"mbar_{b}"

    def _gate(self, c: int):
        """Wait for the CTA's start and, in a pair, for its set-up."""
        if self.start[c]:
            yield busy(self.start[c], "start")
        while not self.setup_done[c]:
            yield Wait(Cond(f"CTA {c}'s set-up", lambda c=c: self.setup_done[c]), 0)

    def _wait(self, who_cta: int, op: Op):
        b = self.bar[(op.cta, op.bar)]
        b.touch(who_cta, "a wait on")
        return Wait(b, op.parity)

    def _arrive(self, who: str, who_cta: int, b: PrimerBarrier, count: int, tx: int = 0):
        b.touch(who_cta, "an arrive on")
        b.arrive(who, count, tx)

    # roles -----------------------------------------------------------------------------------
    def setup(self, c: int, ops: list[Op]):
        if self.start[c]:
            yield busy(self.start[c], "start")
        fenced = False
        for op in ops:
            if op.kind == "init":
                b = self.bar[(c, op.bar)]
                b.initialised, b.arrivals, b.pending = True, op.count, op.count
            elif op.kind == "fence_init":
                fenced = True
            elif op.kind == "cluster_arrive":
                if fenced:  # the pattern of CUTLASS and FA4: fence, then the arrive
                    for b in PRIMER_BARS:
                        self.bar[(c, b)].published = self.bar[(c, b)].initialised
                self.cluster_arrived[c] += 1
            elif op.kind == "cluster_wait":
                n = self.cluster_arrived[c]
                yield Wait(Cond("the cluster barrier", lambda n=n: min(self.cluster_arrived)
                                >= n), 0)
            yield busy(1, op.kind)
        self.setup_done[c] = True

    def load(self, c: int):
        """Q, K, V (a pair: this CTA's share) into shared memory; the bytes count on the
        leader's mbar_load, armed by the leader's expect_tx."""
        yield from self._gate(c)
        lead = self.bar[(0, "load")]
        nbytes = 3 * PRIMER_ROWS * self.d * 2
        if c == 0:
            self._arrive(self._name(c, "load warp"), c, lead, 1, tx=nbytes * self.ctas)
        lead.touch(c, f"the TMA bytes of CTA {c} land on" if self.pair else "TMA bytes land on")
        self.sim.tma_copy(self.smem[c], "Q, K, V", lead, nbytes, 0, self._name(c, "load warp"))
        yield busy(1, "TMA")

    def mma(self, c: int, ops: list[Op]):
        me = self._name(c, "MMA warp")
        yield from self._gate(c)
        for op in ops:
            if op.kind == "wait":
                yield self._wait(c, op)
            elif op.kind == "gemm":
                self._gemm(c, op)
                yield busy(1, f"issue {op.what}")
            elif op.kind == "commit":
                targets = [self.bar[(t, op.bar)] for t in range(self.ctas)
                           if op.mask is not None and op.mask >> t & 1] \
                    if op.mask is not None else [self.bar[(c, op.bar)]]
                for b in targets:
                    b.touch(c, "a tcgen05.commit onto")
                # a commit by every thread of the warp arrives once per thread
                self.sim.mma_issue({"commit": targets * op.count})
                yield busy(1, "commit")
            elif op.kind == "arrive":
                self._arrive(me, c, self.bar[(op.cta, op.bar)], op.count)
            else:
                raise PipelineError(f"the MMA warp made a call the primer has no model of: "
                                    f"{op.kind}")

    def _gemm(self, c: int, op: Op):
        ctas = range(self.ctas) if self.pair else [c]
        if op.what == "S":
            reads = [(self.smem[t], "Q, K, V") for t in ctas]
            writes = []
            for t in ctas:
                self.s_version[t] = self.s_version[t].add(op.k, op.accumulate)
                writes.append((self.S[t], self.s_version[t]))
            label = "S"
        else:
            reads = [(self.smem[t], "Q, K, V") for t in ctas] + [
                (p, "P") for t in ctas for p in self.P[t]]
            writes = []
            for t in ctas:
                self.o_version[t] = self.o_version[t].add(op.k, op.accumulate)
                writes.append((self.O[t], self.o_version[t]))
            label = "PV"
        self.sim.mma_issue({"reads": reads, "writes": writes, "label": label})

    def softmax(self, c: int, g: int, threads: int, ops: list[Op], label: str):
        me = self._name(c, label)
        yield from self._gate(c)
        in_flight = []
        for op in ops:
            if op.kind == "wait":
                yield self._wait(c, op)
            elif op.kind == "ld":
                buf, want = (self.S[c], self.full_s) if op.what == "S" else \
                    (self.O[c], self.full_o)
                buf.start_read(me, want)
                yield busy(self.sim.ticks("read_s"), f"tcgen05.ld {op.what}")
                buf.end_read(me)
                yield busy(self.sim.ticks("softmax"), "max, exp2")
            elif op.kind == "st":
                self.P[c][g].start_write(me)
                in_flight.append(1)

                def done(c=c):
                    self.P[c][g].end_write(me, "P")
                    in_flight.pop()

                self.sim.after(self.sim.ticks("store_p") + 1, done)
                yield busy(1, "tcgen05.st P")
            elif op.kind == "wait_st":
                yield Wait(Cond("tcgen05.wait::st", lambda f=in_flight: not f), 0)
            elif op.kind == "arrive":
                self._arrive(me, c, self.bar[(op.cta, op.bar)], threads * op.count)
            else:
                raise PipelineError(f"the softmax made a call the primer has no model of: "
                                    f"{op.kind}")
        # the given epilogue: wait for O (its own CTA's barrier), load it
        yield self._wait(c, Op("wait", "o", cta=c))
        self.O[c].start_read(me, self.full_o)
        yield busy(self.sim.ticks("read_s"), "tcgen05.ld O")
        self.O[c].end_read(me)

    def run(self) -> PrimerSim:
        self.sim.run()
        for b in self.bar.values():
            if b.initialised and (b.pending != b.arrivals or b.tx):
                raise EarlyArrival(f"the kernel ended with {b.describe()}: arrivals of a phase "
                                   "that never completed (more arrivals than one phase counts)")
        return self


def primer_run(mma: dict, softmax: dict, init: dict | None = None, pair: bool = False,
               head_dim: int = 128, seeds=range(8)) -> list[PrimerSim]:
    """The primer simulated with several seeds (interleavings); raises on the first failure."""
    return [PrimerSim(mma, softmax, init, pair, head_dim, seed=s).run() for s in seeds]
