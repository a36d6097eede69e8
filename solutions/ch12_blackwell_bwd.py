"""Chapter 12: the backward on Blackwell. Its exercises and the helpers the notebook reads.

No Blackwell GPU exists here: every check below compiles for sm_100a, simulates, or runs on the
CPU. The kernels are fa4_final's (``fa4_final/blackwell/bwd.py``, ``bwd_pair.py``); nothing of
them is copied here.

- 12.1 ``own_dq_plan(head_dim)``: a TMEM plan in which dQ has columns of its own, held to the
  allocation rules by ``TmemPlan.check`` (D = 64 fits; D = 128 must not).
- 12.2 ``split_registers(warp)``: the setmaxnreg calls every warp of the backward runs at its role
  split. Run for each of the 16 warps on the CPU (which call, which budget), held to the rules of
  ``fa4_final.common.register_plan`` (per SM sub-partition, per warpgroup) and to the direction
  of each call (a warp starts with 128 registers), then compiled into the real kernel for
  sm_100a in place of its own three calls (``compile_with_split``): ptxas must fit every role,
  with no spill.
- 12.3 ``send_ds(words, unit_addr, dsx, peer, tidx, nbytes)``: the writer's side of the pair's
  dS exchange (Note [The dS exchange] in bwd_pair.py). Recorded thread by thread on the CPU (the
  proxy fence, one remote expect-tx, the st.async stores with their barrier and rank, what lands
  where), replayed in the pair simulator (``ExchangeSim``: solutions/ch09_pipeline.py's
  PairBackwardSim with the exchange as the learner wrote it), then compiled into the pair kernel
  (``PairExchange``, whose ``store_ds`` calls it) and its PTX read.

fa4_final keeps the role split inline in ``BlackwellBackward.kernel``: ``compile_with_split``
swaps the module's ``set_registers`` for a function that runs the learner's split, so the seam it
would need is a method ``split_registers(warp)`` called at the top of each role's branch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32

from fa4_final.blackwell import peer as peer_steps
from fa4_final.blackwell.bwd_pair import DS_EXCHANGE_BYTES, BlackwellBackwardPair
from fa4_final.blackwell.config import BWD_REGISTERS, BlackwellBwdConfig
from fa4_final.blackwell.tmem import Region, TmemPlan, columns_for
from fa4_final.common import register_plan as rp

THREADS = 512  # the backward's CTA: 16 warps
LAUNCH_REGISTERS = rp.launch_registers(THREADS)  # 128: what each thread holds at launch


# ================================================================================================
# Exercise 12.1: dQ with columns of its own
# ================================================================================================
def own_dq_plan(head_dim: int, tile_m: int = 128) -> TmemPlan:
    """Exercise 12.1's reference: the backward's plan with dQ in its own columns, after dK. It
    fits at D = 64 (448 of 512 columns) and not at D = 128 (640): ``check`` raises."""
    regions = (
        Region("S", 0, tile_m, "S^T = K Q^T, fp32"),
        Region("dP", tile_m, tile_m, "dP^T = V dO^T, fp32"),
        Region("dV", 2 * tile_m, head_dim, "dV accumulator, fp32"),
        Region("dK", 2 * tile_m + head_dim, head_dim, "dK accumulator, fp32"),
        Region("dQ", 2 * tile_m + 2 * head_dim, head_dim, "dQ = dS K, fp32, its own columns"),
        Region("P", tile_m - columns_for(tile_m, 16), columns_for(tile_m, 16),
               "P^T, 16-bit pairs", alias_of="S"),
    )
    return TmemPlan(regions).check()


SIZES = {"S": "tile_m = 128 columns (one per query of the step)",
         "dP": "tile_m = 128 columns", "dV": "D columns", "dK": "D columns",
         "dQ": "D columns (one query per lane, D float32 each)",
         "P": "64 columns: 128 16-bit values in pairs"}


def check_own_dq_plan(fn) -> None:
    """Exercise 12.1: ``fn(head_dim) -> TmemPlan`` with dQ in columns of its own."""
    try:
        plan = fn(64)
    except ValueError as exc:
        raise AssertionError(f"at D = 64 the plan should fit, but TmemPlan.check says: {exc}"
                             ) from None
    if not isinstance(plan, TmemPlan):
        raise AssertionError(f"return a TmemPlan (of Regions), got {type(plan).__name__}")
    plan.check()
    want = {"S": 128, "dP": 128, "dV": 64, "dK": 64, "dQ": 64, "P": 64}
    names = [r.name for r in plan.regions]
    missing = sorted(set(want) - set(names))
    if missing:
        raise AssertionError(f"the plan has no region {missing[0]!r}: it needs {sorted(want)}")
    for name, cols in want.items():
        if plan[name].columns != cols:
            raise AssertionError(f"{name} takes {plan[name].columns} columns; it needs "
                                 f"{SIZES[name]}")
    dq = plan["dQ"]
    if dq.alias_of is not None:
        raise AssertionError(f"dQ still lives inside {dq.alias_of}: give it columns of its own "
                             "(alias_of=None), so the next dP^T need not wait for the dQ warps")
    if plan["P"].alias_of != "S":
        raise AssertionError("P^T lives inside S^T's columns (alias_of='S'), as in the kernel's "
                             "plan: once a column of S^T is read, its P^T may replace it")
    if plan.columns_allocated > 512:
        raise AssertionError(f"the plan allocates {plan.columns_allocated} columns: TMEM has 512")
    try:
        big = fn(128)
    except ValueError:
        return
    raise AssertionError(f"at D = 128 your plan fits in {big.columns_used} columns: S^T, dP^T, "
                         "dV, dK and a dQ of its own need 128 + 128 + 128 + 128 + 128 = 640, "
                         "more than TMEM's 512. Build it the same way for every D and let "
                         "TmemPlan.check refuse it")


# ================================================================================================
# Exercise 12.2: the register plan per SM sub-partition
# ================================================================================================
@cute.jit
def split_registers(warp):
    """Exercise 12.2's reference: the setmaxnreg of warp ``warp`` (0-15) at the role split
    (Note [Register plan] in fa4_final/blackwell/bwd.py). Warpgroup 3 (the MMA, load and two
    spare warps) lowers once, all four warps to one budget; the dQ warpgroup lowers to what it
    needs for 32 TMEM columns at a time; the two compute warpgroups take the rest."""
    if warp >= 12:  # warpgroup 3: MMA, load, spare, spare
        cute.arch.setmaxregister_decrease(112)
    elif warp >= 8:  # the dQ warpgroup
        cute.arch.setmaxregister_decrease(48)
    else:  # compute0, compute1: one key row each, 64 scores and 64 dP values at once
        cute.arch.setmaxregister_increase(176)


@dataclass(frozen=True)
class SetMaxNReg:
    kind: str  # "inc" or "dec"
    registers: int


def record_split(fn) -> dict[int, list[SetMaxNReg]]:
    """``fn`` run as plain Python for each of the 16 warps: the setmaxnreg calls each made."""
    from solutions.ch06_exp2 import swapped
    from solutions.ch07_rescaling import _lane_types
    from utils.host_emulation import _const_expr, _PyRange

    calls: dict[int, list[SetMaxNReg]] = {}
    me = {"warp": 0}

    def inc(n, **_):
        calls[me["warp"]].append(SetMaxNReg("inc", int(n)))

    def dec(n, **_):
        calls[me["warp"]].append(SetMaxNReg("dec", int(n)))

    swap = {cute.arch.setmaxregister_increase: inc, cute.arch.setmaxregister_decrease: dec,
            cutlass.range: _PyRange, cutlass.range_constexpr: _PyRange,
            cutlass.const_expr: _const_expr, **_lane_types()}
    clone, patches = swapped(fn, swap, [cute.arch, cutlass])
    with patches():
        for w in range(THREADS // 32):
            me["warp"] = w
            calls[w] = []
            clone(np.int32(w))
    return calls


def plan_of(calls: dict[int, list[SetMaxNReg]]) -> dict[int, int]:
    """warp -> its budget (each warp made exactly one call)."""
    return {w: c[0].registers for w, c in calls.items()}


def check_split_rules(fn) -> dict[int, int]:
    """Exercise 12.2 on the CPU: one setmaxnreg per warp, in the right direction, and a plan
    fa4_final.common.register_plan accepts (sub-partition sums, one budget per warpgroup).
    Returns the plan, warp -> budget."""
    calls = record_split(fn)
    for w, c in calls.items():
        if not c:
            raise AssertionError(f"warp {w} runs no setmaxnreg: every warp of the CTA takes its "
                                 "budget at the role split (a warp that keeps 128 holds "
                                 "registers the others need)")
        if len(c) > 1:
            raise AssertionError(f"warp {w} runs setmaxnreg {len(c)} times "
                                 f"({', '.join(f'{x.kind} {x.registers}' for x in c)}): once, "
                                 "at the top of its role's branch")
        x = c[0]
        if x.kind == "inc" and x.registers <= LAUNCH_REGISTERS:
            raise AssertionError(
                f"warp {w}: setmaxnreg.inc to {x.registers}, but a warp starts with "
                f"{LAUNCH_REGISTERS} registers a thread (64 K / {THREADS} threads): .inc asks "
                "for more than it holds, .dec gives some back. Use setmaxregister_decrease")
        if x.kind == "dec" and x.registers > LAUNCH_REGISTERS:
            raise AssertionError(
                f"warp {w}: setmaxnreg.dec to {x.registers}, above the {LAUNCH_REGISTERS} it "
                "holds at launch: raising a budget is setmaxregister_increase")
    plan = plan_of(calls)
    found = rp.problems(plan, THREADS)
    if found:
        raise AssertionError("; ".join(found))
    return plan


def compile_with_split(fn, head_dim: int = 128, causal: bool = False,
                       config: BlackwellBwdConfig | None = None):
    """The Blackwell backward's main kernel compiled for sm_100a with ``fn`` run at each role
    split in place of the kernel's own setmaxnreg (fa4_final.blackwell.bwd's ``set_registers``
    swapped for the length of the compile). Returns the artifacts; raises AssertionError with
    ptxas's words when ptxas cannot fit a role in its budget."""
    import fa4_final.blackwell.bwd as bwd
    from utils.host_emulation import patched

    def run_split(registers, threads):
        fn(cute.arch.make_warp_uniform(cute.arch.warp_idx()))

    from solutions.ch11_ds_step import compile_for

    kernel = bwd.BlackwellBackward(cutlass.BFloat16, head_dim, causal,
                                   config or BlackwellBwdConfig())
    try:
        with patched(bwd, set_registers=run_split):
            return compile_for(kernel, "main", head_dim, "sm_100a")[1]
    except Exception as exc:  # noqa: BLE001  (ptxas's refusal, said in words below)
        text = str(exc)
        if "Register allocation failed" in text:
            import re

            m = re.search(r"register count of '(\d+)'", text)
            raise AssertionError(
                "compiled for sm_100a, ptxas cannot fit one role in its budget"
                + (f" ({m.group(1)} registers)" if m else "") + ": Register allocation "
                "failed. A role needs at least what its longest live range holds (the dQ warps "
                "a 32-column chunk of TMEM, the MMA warp its descriptors)") from None
        raise


def check_split_registers(fn, compile_check: bool = True) -> None:
    """Exercise 12.2: ``check_split_rules``, then the backward (D = 128, 1-CTA) compiled for
    sm_100a with ``fn`` at its role split: ptxas fits every role with no spill, and the PTX's
    setmaxnreg instructions are the calls the CPU run recorded."""
    import re

    plan = _split_rules(fn)
    if not compile_check:
        return
    art = _compile_split(fn)
    if art.spills:
        raise AssertionError(
            f"compiled for sm_100a, the kernel spills ({art.spills} local-memory instructions) "
            f"with the plan {budget_line(plan)}: a role got fewer registers than its work "
            "needs. The compute warps hold a key's 64 scores and 64 dP values, the MMA warp its "
            "descriptors")
    seen = {(k, int(n)) for k, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+"
                                               r"(\d+);", art.ptx)}
    want = {(("inc" if r > LAUNCH_REGISTERS else "dec"), r) for r in plan.values()}
    if not want <= seen:
        raise AssertionError(f"compiled for sm_100a, the PTX's setmaxnreg are {sorted(seen)}, "
                             f"not the plan's {sorted(want)}")


_split_rules = check_split_rules  # (private names: the workshop guide lists their messages too)
_compile_split = compile_with_split


def budget_line(plan: dict[int, int]) -> str:
    """'compute 176, dQ 48, warpgroup 3 112' for a backward plan (warp -> budget)."""
    return (f"compute {plan[0]}/{plan[4]}, dQ {plan[8]}, MMA {plan[12]}, load {plan[13]}, "
            f"spare {plan[14]}")


def kernel_plan() -> dict[int, int]:
    """The backward's own plan (fa4_final.blackwell.config.BWD_REGISTERS), warp -> budget."""
    from fa4_final.blackwell.config import backward_warp_budgets

    return backward_warp_budgets(BWD_REGISTERS)


# ================================================================================================
# Exercise 12.3: the writer's side of the dS exchange
# ================================================================================================
@cute.jit
def send_ds(words, unit_addr, dsx, peer, tidx, nbytes):
    """Exercise 12.3's reference: this thread's 128 bytes of dS (``words``: 32 Int32, 64 16-bit
    values) into the peer CTA's shared memory (Note [The dS exchange] in bwd_pair.py).

    ``unit_addr(j)``: the shared byte address of this thread's 16-byte unit j (the same offset
    in the peer); ``dsx``: the dS-exchange mbarrier (the peer's is at the same offset);
    ``peer``: the peer's rank in the cluster; ``tidx``: this thread (0-127) of the sending
    warpgroup; ``nbytes``: what the whole warpgroup sends (16 KB)."""
    # the peer's async proxy (its dQ MMA of the step before) read this buffer: order that read
    # before these generic writes
    cute.arch.fence_proxy("async.shared", space="cluster")
    if tidx == 0:  # one arrival on the peer's barrier, announcing every byte that will land
        cute.arch.mbarrier_arrive_and_expect_tx(dsx, nbytes, peer_cta_rank_in_cluster=peer)
    for j in cutlass.range_constexpr(cute.size(words) // 4):
        dst = cute.make_ptr(Int32, unit_addr(j), cute.AddressSpace.smem, assumed_align=16)
        cute.arch.store_async_dsmem(dst, (words[4 * j], words[4 * j + 1], words[4 * j + 2],
                                          words[4 * j + 3]), dsx, peer)


FORBID_SEND = {
    peer_steps.fence_before_peer_store: "that is the package's step; write the fence yourself",
    peer_steps.arm_peer: "that is the package's step; write the remote expect-tx yourself",
    peer_steps.store_peer_v4: "that is the package's step; write the st.async yourself",
    BlackwellBackwardPair.store_ds: "that is the package's exchange; write the writer's side",
}

SEND_THREADS = 128
WORDS = 32  # 128 bytes of dS a thread


@dataclass
class _Bar:
    name: str


@dataclass
class _Ptr:
    addr: int
    space: object
    align: int


@dataclass
class SendTrace:
    """What the sending warpgroup of CTA ``rank`` did: per thread its calls in order, and the
    totals the peer's barrier sees."""

    rank: int
    calls: dict  # tidx -> [(kind, details)]

    def arms(self) -> list:
        return [(t, d) for t, cs in self.calls.items() for k, d in cs if k == "arm"]

    def stores(self) -> list:
        return [(t, d) for t, cs in self.calls.items() for k, d in cs if k == "st.async"]


def unit_address(tidx: int, j: int) -> int:
    """A model of the exchange's addresses: thread t's 16-byte unit j of a 128-byte row,
    swizzled as the kernel does (Note [The swizzle in bytes]), from a 1 KB-aligned base."""
    a = 4096 + 128 * tidx + 16 * j
    return a ^ ((a >> 3) & 0x70)


def record_send(fn, rank: int) -> SendTrace:
    """``fn`` run as plain Python by each of the 128 threads of CTA ``rank``'s sending
    warpgroup, with recording stand-ins for the fence, the arm and the st.async."""
    from solutions.ch06_exp2 import swapped
    from solutions.ch07_rescaling import _lane_types, _size
    from utils.host_emulation import _const_expr, _PyRange

    calls: dict = {}
    me = {"t": 0}

    def rec(kind, details):
        calls[me["t"]].append((kind, details))

    def fence_proxy(kind, space=None, **_):
        rec("fence", (kind, space))

    def fence_view(*a, **_):
        rec("fence", ("async.shared", "cta"))

    def arm(bar, nbytes, peer_cta_rank_in_cluster=None, **_):
        rec("arm", (bar, int(nbytes), peer_cta_rank_in_cluster))

    def arrive(bar, peer_cta_rank_in_cluster=None, **_):
        rec("arrive", (bar, peer_cta_rank_in_cluster))

    def make_ptr(dtype, addr, space=None, assumed_align=None, **_):
        return _Ptr(int(addr), space, assumed_align or 0)

    def st_async(ptr, value, bar, rank_, **_):
        values = value if isinstance(value, tuple) else (value,)
        rec("st.async", (ptr, tuple(int(v) for v in values), bar, rank_))

    def plain_store(*a, **_):
        rec("store", a)

    swap = {cute.arch.fence_proxy: fence_proxy, cute.arch.fence_view_async_shared: fence_view,
            cute.arch.mbarrier_arrive_and_expect_tx: arm, cute.arch.mbarrier_arrive: arrive,
            cute.make_ptr: make_ptr, cute.arch.store_async_dsmem: st_async,
            cute.size: _size, cutlass.range: _PyRange, cutlass.range_constexpr: _PyRange,
            cutlass.const_expr: _const_expr, **_lane_types()}
    clone, patches = swapped(fn, swap, [cute, cute.arch, cutlass])
    dsx = _Bar("dsx")
    with patches():
        for t in range(SEND_THREADS):
            me["t"] = t
            calls[t] = []
            words = np.arange(WORDS, dtype=np.int32) + np.int32(1000 * (t + 1))
            clone(words, lambda j, t=t: unit_address(t, j), dsx, np.int32(1 - rank),
                  np.int32(t), np.int32(DS_EXCHANGE_BYTES))
    return SendTrace(rank, calls)


@dataclass(frozen=True)
class Exchange:
    """How the learner's writer behaves, in the terms the pair simulator needs: whose dsx
    barrier the arm reaches and with how many arrivals and announced bytes, whose barrier the
    stores' bytes complete and how many bytes land (each per step and warpgroup)."""

    arm_to_peer: bool = True
    arrivals: int = 1
    expect_bytes: int = DS_EXCHANGE_BYTES
    store_to_peer: bool = True
    land_bytes: int = DS_EXCHANGE_BYTES


def exchange_of(tr: SendTrace) -> Exchange:
    peer = 1 - tr.rank
    arms = tr.arms()
    stores = tr.stores()
    return Exchange(
        arm_to_peer=all(d[2] == peer for _, d in arms) if arms else True,
        arrivals=len(arms), expect_bytes=sum(d[1] for _, d in arms),
        store_to_peer=all(d[3] == peer for _, d in stores) if stores else True,
        land_bytes=sum(4 * len(d[1]) for _, d in stores))


class _DsxProxy:
    """The dsx barrier of one CTA as the pair simulator's compute warps use it, with the arm and
    the landing bytes of ``Exchange``: the simulator's one arrival announcing one block becomes
    the learner's arrivals and bytes (in 16-byte units), on the CTA the learner addressed."""

    def __init__(self, sim, cta: int):
        self.sim, self.cta = sim, cta
        self.real = sim.bar[cta, "dsx", "full", 0]

    def ready(self, parity):
        return self.real.ready(parity)

    def describe(self):
        return self.real.describe()

    def arrive(self, who, count=1, tx=0):
        ex = self.sim.exchange
        target = self.cta if ex.arm_to_peer else 1 - self.cta
        if ex.arrivals:
            self.sim.bar[target, "dsx", "full", 0].arrive(who, ex.arrivals,
                                                          tx=ex.expect_bytes // 16)

    def land(self, nbytes, phase, what):
        ex = self.sim.exchange
        target = self.cta if ex.store_to_peer else 1 - self.cta
        if ex.land_bytes:
            self.sim.bar[target, "dsx", "full", 0].land(ex.land_bytes // 16, phase, what)


def exchange_sim_class():
    """ExchangeSim: PairBackwardSim whose dS exchange follows an ``Exchange``."""
    from solutions.ch09_pipeline import PairBackwardSim

    class ExchangeSim(PairBackwardSim):
        def __init__(self, kernel, prob, exchange: Exchange, seed: int = 0, **kw):
            self.exchange = exchange
            super().__init__(kernel, prob, seed=seed, **kw)

        def full(self, name, cta, st=0):
            if name == "dsx":
                return _DsxProxy(self, cta)
            return super().full(name, cta, st)

    return ExchangeSim


def simulate_exchange(exchange: Exchange, seeds=range(2)) -> str | None:
    """Run the pair backward's pipelines with ``exchange``; the first failure in words, or None."""
    from solutions.ch09_pipeline import BwdProblem, PipelineError, make_bwd_kernel

    sim_cls = exchange_sim_class()
    kernel = make_bwd_kernel(128, True, BlackwellBwdConfig(two_cta=True))
    prob = BwdProblem(1000, 1000, heads=2, causal=True, n_block=1)
    for seed in seeds:
        try:
            sim_cls(kernel, prob, exchange, seed=seed).run()
        except PipelineError as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0]}" + (
                "\n" + "\n".join(str(exc).splitlines()[1:4]) if "\n" in str(exc) else "")
    return None


def check_send_rules(fn) -> None:
    """Exercise 12.3 on the CPU: each thread's fence before its stores; then the exchange as
    the peer's barrier sees it, in the pair simulator; then every byte in its place."""
    for rank in (0, 1):
        tr = record_send(fn, rank)
        peer = 1 - rank
        who = f"CTA {rank} (the {'leader' if rank == 0 else 'follower'}) sending to CTA {peer}"
        for t, cs in tr.calls.items():
            kinds = [k for k, _ in cs]
            if "store" in kinds or "arrive" in kinds:
                raise AssertionError(
                    f"{who}: thread {t} used a plain arrive or store: the peer's barrier counts "
                    "bytes only from mbarrier_arrive_and_expect_tx (announced) and "
                    "store_async_dsmem (st.async ... complete_tx)")
            if "st.async" not in kinds:
                raise AssertionError(f"{who}: thread {t} stored nothing: each thread sends its "
                                     "128 bytes, 8 st.async of 16 bytes")
            first = kinds.index("st.async")
            fences = [d for k, d in cs[:first] if k == "fence"]
            if not fences:
                raise AssertionError(
                    f"{who}: thread {t} stores into the peer with no proxy fence before: the "
                    "peer's dQ MMA of the step before (async proxy) read this buffer. Order "
                    "that read before your generic writes with "
                    "cute.arch.fence_proxy('async.shared', space='cluster')")
            if not any(d == ("async.shared", "cluster") for d in fences):
                raise AssertionError(
                    f"{who}: thread {t} fences with {fences[0]}: the buffer is in the peer "
                    "CTA, so the fence is fence.proxy.async.shared::cluster "
                    "(kind 'async.shared', space 'cluster')")
        bad = [(t, d) for t, d in tr.stores() if d[3] != peer]
        if bad:
            raise AssertionError(f"{who}: thread {bad[0][0]}'s st.async goes to rank "
                                 f"{int(bad[0][1][3])}, its own CTA: the block belongs to the "
                                 f"peer (rank {peer})")
        bad = [(t, d) for t, d in tr.stores() if not isinstance(d[2], _Bar)]
        if bad:
            raise AssertionError(f"{who}: a st.async counts its bytes on {bad[0][1][2]!r}, "
                                 "not on the dS-exchange barrier dsx")
        ex = exchange_of(tr)
        if ex.arrivals and ex != Exchange():
            hint = []
            if not ex.arm_to_peer:
                hint.append("the arm reached your own CTA's barrier, not the peer's: it would "
                            "count the bytes the peer sends you, right only because both CTAs "
                            "send the same amount. The writer announces its own bytes on the "
                            "barrier they land on (peer_cta_rank_in_cluster=peer)")
            if ex.arrivals != 1:
                hint.append(f"{ex.arrivals} threads armed the barrier, which expects one "
                            "arrival a step: one thread arms (if tidx == 0)")
            if ex.expect_bytes != ex.land_bytes:
                hint.append(f"the arm announces {ex.expect_bytes} bytes but the stores bring "
                            f"{ex.land_bytes}")
            problem = simulate_exchange(ex)
            raise AssertionError(f"{who}: " + "; ".join(hint or ["the exchange is off"])
                                 + (f". In the pair simulator: {problem}" if problem else ""))
        if not ex.arrivals:
            problem = simulate_exchange(ex)
            raise AssertionError(f"{who}: no thread arms the peer's barrier "
                                 "(mbarrier_arrive_and_expect_tx, remote): its phase waits for "
                                 "an arrival that never comes"
                                 + (f". In the pair simulator: {problem}" if problem else ""))
        landed = {}
        for _t, d in tr.stores():
            ptr, values = d[0], d[1]
            if ptr.align % 16 and len(values) == 4:
                raise AssertionError("a 16-byte st.async needs a 16-byte-aligned pointer "
                                     "(assumed_align=16)")
            for i, v in enumerate(values):
                landed[ptr.addr + 4 * i] = v
        for t in range(SEND_THREADS):
            for j in range(WORDS // 4):
                for i in range(4):
                    got = landed.get(unit_address(t, j) + 4 * i)
                    want = 1000 * (t + 1) + 4 * j + i
                    if got != want:
                        raise AssertionError(
                            f"{who}: the peer's byte {unit_address(t, j) + 4 * i} should hold "
                            f"word {4 * j + i} of thread {t} and holds "
                            f"{'nothing' if got is None else got}: unit j gets words 4j .. "
                            "4j + 3, at unit_addr(j)")


_send_rules = check_send_rules  # (a private name: the workshop guide lists its messages too)


class PairExchange(BlackwellBackwardPair):
    """fa4_final.blackwell.bwd_pair.BlackwellBackwardPair whose dS exchange (the writer's side of
    ``store_ds``) is ``send_fn`` (exercise 12.3's signature); the rest is the kernel's own."""

    def __init__(self, send_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.send_fn = send_fn

    def cache_key(self) -> tuple:
        return super().cache_key() + (("exercise 12.3", self.send_fn),)

    @cute.jit
    def unit_address(self, base, key_in_pair, j, smem):
        """Shared byte address of 16-byte unit j of this key's row of dS (Note [The swizzle in
        bytes])."""
        addr = base + 2 * cute.crd2idx((key_in_pair, 8 * j), smem["dS_rows"].layout)
        return addr ^ ((addr >> 3) & 0x70)

    @cute.jit
    def store_ds(self, rdS, rdS32, key_in_pair, g, r, tidx, smem, bars):
        if g == r:
            cute.autovec_copy(rdS, smem["dS_rows"][key_in_pair, None])
            cute.arch.fence_view_async_shared()
        else:
            words = cute.make_tensor(cute.recast_ptr(rdS32.iterator, dtype=Int32),
                                     cute.make_layout(cute.size(rdS32)))
            base = smem["dS_base"].toint()
            self.send_fn(words, lambda j: self.unit_address(base, key_in_pair, j, smem),
                         bars["dsx"], 1 - r, tidx, DS_EXCHANGE_BYTES)


_BUILDS: dict = {}


def compile_exchange(send_fn, head_dim: int = 128, causal: bool = False):
    """The pair backward's main kernel with ``send_fn`` compiled for sm_100a."""
    from solutions.ch11_ds_step import compile_for

    key = (send_fn, head_dim, causal)
    if key not in _BUILDS:
        kernel = PairExchange(send_fn, cutlass.BFloat16, head_dim, causal,
                              BlackwellBwdConfig(two_cta=True))
        _BUILDS[key] = compile_for(kernel, "main", head_dim, "sm_100a")[1]
    return _BUILDS[key]


def exchange_ptx_facts(ptx: str) -> dict:
    """The writer's side in the pair kernel's PTX: st.async count and form, remote arms, and
    what ch09_hardware_rules.peer_stores_fenced finds (every st.async fenced at cluster scope)."""
    from solutions.ch09_hardware_rules import peer_stores_fenced

    lines = [ln.strip() for ln in ptx.splitlines()]
    stores = [ln for ln in lines if ln.startswith("st.async")]
    return {
        "st.async": len(stores),
        "complete_tx": sum("mbarrier::complete_tx::bytes" in ln for ln in stores),
        "v4": sum(".v4." in ln for ln in stores),
        "remote arms": sum(ln.startswith("mbarrier.arrive.expect_tx") and "shared::cluster" in ln
                           for ln in lines),
        "unfenced": peer_stores_fenced(ptx),
    }


def check_send_ds(fn, compile_check: bool = True) -> None:
    """Exercise 12.3: ``check_send_rules``, then the pair backward (D = 128) compiled for
    sm_100a with ``fn`` as its writer, its PTX read: 8 st.async.v4 with complete_tx, a remote
    expect-tx, each st.async after a fence.proxy.async.shared::cluster."""
    _send_rules(fn)
    if not compile_check:
        return
    facts = exchange_ptx_facts(compile_exchange(fn).ptx)
    if facts["unfenced"]:
        raise AssertionError("compiled for sm_100a: " + facts["unfenced"][0])
    per_copy = WORDS // 4  # the kernel has a copy of the step per mask variant
    if not facts["st.async"] or facts["st.async"] % per_copy or facts["v4"] != facts["st.async"]:
        raise AssertionError(f"compiled for sm_100a, the exchange has {facts['st.async']} "
                             f"st.async ({facts['v4']} of 16 bytes): {per_copy} of 16 bytes a "
                             "thread in each copy of the step")
    if facts["complete_tx"] != facts["st.async"] or not facts["remote arms"]:
        raise AssertionError("compiled for sm_100a, the stores do not complete bytes on a "
                             "barrier armed in the peer")


# ================================================================================================
# Helpers the notebook reads
# ================================================================================================
def step_gemms(kernel) -> list[dict]:
    """The five GEMMs of a 1-CTA step: shape, accumulator columns in TMEM, where A and B come
    from, and the tcgen05.mma instructions each takes (K / 16)."""
    d, m, n = kernel.head_dim, kernel.tile_m, kernel.tile_n
    rows = [("S^T = K Q^T", "S", "K (smem)", "Q (smem)", n, m, d),
            ("dP^T = V dO^T", "dP", "V (smem)", "dO (smem)", n, m, d),
            ("dV += P^T dO", "dV", "P^T (TMEM)", "dO (smem, MN-major)", n, d, m),
            ("dK += dS^T Q", "dK", "dS^T (smem)", "Q (smem, MN-major)", n, d, m),
            ("dQ = dS K", "dQ", "dS (smem, MN-major)", "K (smem, MN-major)", m, d, n)]
    out = []
    for name, acc, a, b, gm, gn, gk in rows:
        r = kernel.plan[acc]
        out.append({"gemm": name, "M": gm, "N": gn, "K": gk,
                    "accumulator": f"TMEM {r.start}..{r.end - 1}", "A": a, "B": b,
                    "tcgen05.mma": gk // 16})
    return out


def backward_rules() -> list:
    """The rows of chapter 09's table of hardware rules no compiler checks that the backward
    kernels keep (their ``where`` names bwd.py or bwd_pair.py)."""
    from solutions.ch09_hardware_rules import RULES

    return [r for r in RULES if "bwd" in r.where.lower()]


def probe_tests() -> list[str]:
    """The tests of tests/gpu/test_protocol_probes.py (what its 'protocol_probes' rows count)."""
    import ast
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tests/gpu/test_protocol_probes.py"
    tree = ast.parse(path.read_text())
    names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)
             and f.name.startswith("test_")]
    plans = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "PLAN_NAMES"), [])
    out = []
    for name in names:
        if name == "test_setmaxnreg_plan_finishes_within_each_sub_partition":
            out += [f"{name}[{p}]" for p in plans]
        else:
            out.append(name)
    return out


def probe_counts(res) -> dict:
    """{'passed': n, 'skipped': n, 'commit': ..., 'date': ...} of the 'protocol_probes' rows of
    results/h200/gpu_checks.json."""
    rows = [r for r in res.rows if r.get("impl") == "protocol_probes"]
    out = Counter()
    meta = {}
    for r in rows:
        out[r["metric"]] += r["value"]
        meta = {"commit": str(r.get("commit", ""))[:7], "date": r.get("date", "")}
    return {**out, **meta}
