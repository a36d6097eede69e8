"""Chapter 05's consumer-side exercises in device code: the GEMMs of a steady turn (05.5) and the
epilogue's hand-over from the threads to the TMA (05.6).

Each exercise is a seam of the real kernel (``ch05_flash_hopper.FlashAttentionHopper``):
``gemm_turn`` and ``store_o`` are methods there, and ``HopperWithTurn`` / ``HopperWithEpilogue``
swap the learner's function in, as ``ch05_teaching.HopperWithProducer`` does for the producer's
loop. With the references below the compiled kernel is the kernel itself, byte for byte
(tests/test_ch05_consumer.py compares the SASS).

Each answer is checked three ways, cheapest first:

1. run as plain Python with recording stand-ins for the DSL's wgmma, copy, fence and barrier
   calls (``record_turn``, ``record_epilogue``), so a checker can say in words which group, which
   k-block or which thread went wrong;
2. compiled into the kernel for sm_90a, the PTX asserted (the wait depth, the fence before the
   barrier, the TMA store after it);
3. on a Hopper GPU, the whole kernel against the float64 reference on awkward shapes
   (``check_*_on_gpu``).

Some mistakes no run can be sure to catch (a missing proxy fence: the TMA may or may not read
stale bytes, depending on timing). The first two checks read the code instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from solutions import ch05_flash_hopper as ch05

EPILOGUE_BARRIER = int(ch05.NamedBarrier.EPILOGUE)


# ================================================================================================
# 05.5: the GEMMs of a steady turn
# ================================================================================================
@cute.jit
def gemm_turn(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP, tOrVt):
    """Exercise 05.5's reference: S = Q K^T into a fresh accumulator and O += P V, committed as
    two wgmma groups in that order, then wait until only the newest (P V) may still run."""
    warpgroup.fence()  # P (converted) and O (rescaled) were written by ordinary instructions
    mma_qk = cute.make_mma_atom(tiled_mma_qk.op)
    mma_qk.set(warpgroup.Field.ACCUMULATE, False)  # S is a new product: overwrite acc_s
    for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
        cute.gemm(mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
        mma_qk.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()  # the older group: S
    warpgroup.fence()
    mma_pv = cute.make_mma_atom(tiled_mma_pv.op)
    mma_pv.set(warpgroup.Field.ACCUMULATE, True)  # O accumulates over the tiles
    for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
        cute.gemm(mma_pv, acc_o, tOrP[None, None, k], tOrVt[None, None, k], acc_o)
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()  # the newest group: P V
    warpgroup.wait_group(1)  # S is complete; P V may still run under the softmax


class HopperWithTurn(ch05.FlashAttentionHopper):
    """Chapter 05's kernel with its steady turn's GEMMs replaced by ``turn_fn`` (the learner's,
    or ``gemm_turn``). With ping-pong, the kernel hands the turn on between issuing and waiting;
    here the hand-over comes after ``turn_fn`` returns (still correct, it only waits longer)."""

    def __init__(self, turn_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turn_fn = turn_fn

    @cute.jit
    def gemm_turn(self, wg, turn, num_turns, tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ,
                  tSrK, tOrP, tOrVt):
        self.turn_fn(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP, tOrVt)
        self.turn_end(wg, turn, num_turns)


# --- recording stand-ins ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Op:
    gemm: str  # "S" or "PV": which tiled MMA's op this is


class _TiledMma:
    """tiled_mma_qk / tiled_mma_pv: ``.op`` for make_mma_atom; ``.set`` for learners who set the
    ACCUMULATE field on the tiled MMA itself and pass it to cute.gemm."""

    def __init__(self, gemm: str, events: list):
        self.op, self.events, self.accumulate = _Op(gemm), events, None

    def set(self, field, value):
        _set_field(self, field, value)


class _Atom(_TiledMma):
    pass


def _set_field(atom, field, value):
    if field is not warpgroup.Field.ACCUMULATE:
        raise AssertionError(f"set({field!r}, ...): the field that says whether a wgmma adds "
                             "into its accumulator is warpgroup.Field.ACCUMULATE")
    if not isinstance(value, bool):
        raise AssertionError(f"set ACCUMULATE to True or False (a Python bool here), got "
                             f"{value!r}")
    atom.accumulate = value


@dataclass(frozen=True)
class _Block:
    frag: str  # "Q", "K", "P", "Vt"
    k: int


class _Frag:
    """tSrQ, tSrK, tOrP, tOrVt: ``frag[None, None, k]`` is k-block k; cute.size(frag, mode=[2])
    is the number of k-blocks."""

    def __init__(self, name: str, blocks: int):
        self.name, self.blocks = name, blocks

    def __getitem__(self, key):
        if not (isinstance(key, tuple) and len(key) == 3 and key[0] is None and key[1] is None):
            raise AssertionError(f"take k-block k of {self.arg} as {self.arg}[None, None, k]")
        k = key[2]
        if not isinstance(k, int) or not 0 <= k < self.blocks:
            raise AssertionError(f"{self.arg} has k-blocks 0..{self.blocks - 1}; you asked for "
                                 f"{k!r}")
        return _Block(self.name, k)

    @property
    def arg(self):
        return {"Q": "tSrQ", "K": "tSrK", "P": "tOrP", "Vt": "tOrVt"}[self.name]


@dataclass(frozen=True)
class _Acc:
    name: str  # "acc_s" or "acc_o"


@dataclass(frozen=True)
class TurnEvent:
    """One call of the turn: "fence", "commit", "wait" (``n``) or "gemm" (``gemm`` S or PV,
    k-block ``k``, ``accumulate``, and what went wrong with its operands in ``problem``)."""

    kind: str
    n: int = -1
    gemm: str = ""
    k: int = -1
    accumulate: bool | None = None
    problem: str = ""


_GEMMS = {"S": ("acc_s", "Q", "K"), "PV": ("acc_o", "P", "Vt")}
_WRITE = {"S": "S = Q K^T: cute.gemm(atom, acc_s, tSrQ[None, None, k], tSrK[None, None, k], "
               "acc_s)",
          "PV": "O += P V: cute.gemm(atom, acc_o, tOrP[None, None, k], tOrVt[None, None, k], "
                "acc_o)"}


def _gemm_event(atom, d, a, b, c) -> TurnEvent:
    if not isinstance(atom, _TiledMma):
        raise AssertionError("cute.gemm's first argument is the MMA atom made from a tiled MMA's "
                             f"op (cute.make_mma_atom(tiled_mma_qk.op)); got {atom!r}")
    which = next((g for g, (_, fa, fb) in _GEMMS.items()
                  if isinstance(a, _Block) and isinstance(b, _Block)
                  and (a.frag, b.frag) == (fa, fb)), None)
    if which is None:
        return TurnEvent("gemm", problem=(
            f"cute.gemm got A = {_name(a)} and B = {_name(b)}: the two products are "
            f"{_WRITE['S']} and {_WRITE['PV']}"))
    acc = _GEMMS[which][0]
    if d != _Acc(acc) or c != _Acc(acc):
        return TurnEvent("gemm", gemm=which, k=a.k, problem=(
            f"the {which} product writes {_name(d)} and adds {_name(c)}: {_WRITE[which]}"))
    if a.k != b.k:
        return TurnEvent("gemm", gemm=which, k=a.k, problem=(
            f"the {which} product multiplies k-block {a.k} of A with k-block {b.k} of B: "
            "both operands take the same k"))
    if atom.op.gemm != which:
        mine, other = ("tiled_mma_qk", "tiled_mma_pv") if which == "S" else ("tiled_mma_pv",
                                                                             "tiled_mma_qk")
        return TurnEvent("gemm", gemm=which, k=a.k, problem=(
            f"the {which} product was issued with the atom of {other}: use {mine}'s "
            "(the S atom reads A from shared memory, the P V atom takes A, P, from registers)"))
    if atom.accumulate is None:
        return TurnEvent("gemm", gemm=which, k=a.k, problem=(
            f"the {which} product's atom never had warpgroup.Field.ACCUMULATE set: say for "
            "each k-block whether it adds into the accumulator"))
    return TurnEvent("gemm", gemm=which, k=a.k, accumulate=atom.accumulate)


def _name(x) -> str:
    if isinstance(x, _Block):
        return {"Q": "tSrQ", "K": "tSrK", "P": "tOrP", "Vt": "tOrVt"}[x.frag] + f"[.., {x.k}]"
    if isinstance(x, _Acc):
        return x.name
    return repr(x)


def _plain_deep(fn, depth: int = 3):
    """``utils.host_emulation.plain(fn)``, with the @cute.jit helpers it calls by a global name
    made plain too (a learner's own helper runs as Python, as it is traced when compiled)."""
    import types

    from utils.host_emulation import plain

    flat = plain(fn)
    if depth == 0:
        return flat
    names = {}
    for name in flat.__code__.co_names:
        obj = flat.__globals__.get(name)
        if callable(obj) and getattr(obj, "__wrapped__", None) is not None \
                and plain(obj) is not obj and obj is not fn:
            names[name] = _plain_deep(obj, depth - 1)
    if not names:
        return flat
    scope = {**flat.__globals__, **names}
    return types.FunctionType(flat.__code__, scope, flat.__name__, flat.__defaults__,
                              flat.__closure__)


def record_turn(fn, qk_blocks: int = 8, pv_blocks: int = 8) -> list[TurnEvent]:
    """Run ``fn`` (exercise 05.5's signature) as plain Python with recording stand-ins; return
    its fences, wgmma issues, commits and waits in order. ``qk_blocks``: D / 16 k-blocks of
    S = Q K^T; ``pv_blocks``: tile_n / 16 of O += P V."""
    from cutlass.base_dsl.common import DSLBaseError

    from utils.host_emulation import patched, python_loops

    events: list[TurnEvent] = []
    real_size = cute.size

    def size(x, mode=None, **kw):
        if isinstance(x, _Frag):
            if mode not in ([2], (2,), 2):
                raise AssertionError(f"the k-blocks of {x.arg} are its mode 2: "
                                     f"cute.size({x.arg}, mode=[2])")
            return x.blocks
        return real_size(x, mode=mode, **kw)

    def make_mma_atom(op, *args, **kwargs):
        if not isinstance(op, _Op):
            raise AssertionError("make the atom from a tiled MMA's op: "
                                 f"cute.make_mma_atom(tiled_mma_qk.op); got {op!r}")
        return _Atom(op.gemm, events)

    def gemm(atom, d, a, b, c, **kwargs):
        events.append(_gemm_event(atom, d, a, b, c))

    def wait_group(n, **kwargs):
        if not isinstance(n, int) or n < 0:
            raise AssertionError(f"wait_group takes how many groups may still run, a "
                                 f"non-negative int; got {n!r}")
        events.append(TurnEvent("wait", n=n))

    args = [_TiledMma("S", events), _TiledMma("PV", events), _Acc("acc_s"), _Acc("acc_o"),
            _Frag("Q", qk_blocks), _Frag("K", qk_blocks), _Frag("P", pv_blocks),
            _Frag("Vt", pv_blocks)]
    with python_loops(), patched(cute, size=size, make_mma_atom=make_mma_atom, gemm=gemm), \
            patched(warpgroup, fence=lambda **kw: events.append(TurnEvent("fence")),
                    commit_group=lambda **kw: events.append(TurnEvent("commit")),
                    wait_group=wait_group):
        try:
            _plain_deep(fn)(*args)
        except DSLBaseError as exc:
            raise AssertionError(
                "write the issue, commits and wait in the function itself: a nested @cute.jit "
                f"helper tried to compile on its own ({type(exc).__name__})") from None
    return events


def _groups(events: list[TurnEvent]):
    """(groups, pending, waits): the committed groups in order, each a list of gemm events;
    the gemms after the last commit; for each wait, the index of the groups issued before it."""
    groups, current, waits = [], [], []
    for e in events:
        if e.kind == "gemm":
            current.append(e)
        elif e.kind == "commit":
            if current:
                groups.append(current)
            current = []
        elif e.kind == "wait":
            waits.append((len(groups), e.n))
    return groups, current, waits


def _turn_mistake(events: list[TurnEvent], qk_blocks: int = 8, pv_blocks: int = 8) -> str | None:
    """The first thing wrong with a recorded turn, in words; None when it is right."""
    gemms = [e for e in events if e.kind == "gemm"]
    bad = next((e for e in gemms if e.problem), None)
    if bad is not None:
        return bad.problem
    for which, blocks in (("S", qk_blocks), ("PV", pv_blocks)):
        ks = [e.k for e in gemms if e.gemm == which]
        name = "S = Q K^T" if which == "S" else "O += P V"
        if not ks:
            return (f"{name} is never issued: a steady turn issues both products, S of the next "
                    "tile and P V of this one")
        if sorted(ks) != list(range(blocks)):
            missing = sorted(set(range(blocks)) - set(ks))
            twice = sorted({k for k in ks if ks.count(k) > 1})
            what = (f"misses k-block(s) {missing}" if missing else f"issues k-block(s) {twice} "
                    "twice")
            src = "tSrQ" if which == "S" else "tOrP"
            return (f"{name} {what} of its {blocks}: loop k over "
                    f"cutlass.range_constexpr(cute.size({src}, mode=[2]))")
    s = [e for e in gemms if e.gemm == "S"]
    if s[0].accumulate:
        return ("S's first k-block accumulates (ACCUMULATE True): acc_s still holds the "
                "previous tile's scores, so S would be added onto them. Set ACCUMULATE False "
                "for the first k-block of S, then True")
    late = next((e for e in s[1:] if not e.accumulate), None)
    if late is not None:
        return (f"S's k-block {late.k} overwrites the accumulator (ACCUMULATE False after the "
                "first k-block): S would hold only the last k-blocks' part of Q K^T. Set "
                "ACCUMULATE True after the first")
    pv = next((e for e in gemms if e.gemm == "PV" and not e.accumulate), None)
    if pv is not None:
        return (f"O += P V with ACCUMULATE False on k-block {pv.k} overwrites O: every earlier "
                "tile's contribution would be lost. P V always accumulates")
    first = next(i for i, e in enumerate(events) if e.kind == "gemm")
    if not any(e.kind == "fence" for e in events[:first]):
        return ("no warpgroup.fence() before the first wgmma: P (converted to bf16) and O "
                "(rescaled) were just written by ordinary instructions, and without "
                "wgmma.fence the tensor cores may read those registers before the writes land")
    groups, pending, waits = _groups(events)
    if pending:
        return ("some wgmma come after the last commit_group: wait_group counts committed "
                "groups only, so nothing would ever wait for them. Commit each product")
    kinds = [{e.gemm for e in g} for g in groups]
    if any(len(k) > 1 for k in kinds):
        return ("S and P V are in one group (a single commit_group after both): wait_group "
                "then cannot tell them apart. wait_group(1) returns at once with that one group "
                "still running, and wait_group(0) waits for P V too. Commit S, then P V")
    if [k.pop() for k in kinds] != ["S", "PV"]:
        return ("P V is committed before S: wait_group(1) lets the newest group run on, and "
                "the newest is then S, so the softmax would read S while the tensor cores "
                "still write it. Issue S first, then P V")
    if not waits:
        return ("the turn returns without a wait_group: the softmax would read acc_s while "
                "the tensor cores are still writing it")
    # the groups each wait guarantees complete: all but the newest n of those committed
    done = 0
    for issued, n in waits:
        done = max(done, issued - n)
    if done < 1:
        n = waits[-1][1]
        return (f"wait_group({n}) with {waits[-1][0]} group(s) committed guarantees none of "
                "them complete: S may still be running when the softmax reads it. Wait until "
                "one group (P V) may still run")
    if done >= 2:
        return ("the turn waits for P V as well (wait_group(0) after both commits): the "
                "softmax of the next tile then starts only after P V has finished, and the "
                "exponentials no longer overlap P V. wait_group(1) waits for S alone")
    if waits[0][0] < 2:
        return ("the turn waits for S before it issues P V: the tensor cores then idle "
                "between the two products while the warpgroup issues P V. Issue both, then "
                "wait_group(1)")
    return None


def steady_wait_ptx(ptx: str) -> dict:
    """What the PTX says about the steady turn: the PTX lines from the last mbarrier wait before
    the kernel's ``wgmma.wait_group 1`` up to it, counted; ``found`` False when the PTX has no
    wait_group 1 at all."""
    lines = ptx.splitlines()
    ones = [i for i, ln in enumerate(lines) if "wgmma.wait_group.sync.aligned" in ln
            and ln.strip().endswith("1;")]
    if not ones:
        return {"found": False, "wait_group_1": 0}
    end = ones[0]
    start = max((i for i in range(end) if "mbarrier.try_wait" in lines[i]), default=0)
    body = lines[start:end]
    return {"found": True, "wait_group_1": len(ones),
            "fences": sum("wgmma.fence" in ln for ln in body),
            "commits": sum("wgmma.commit_group" in ln for ln in body),
            "wgmma": sum("wgmma.mma_async" in ln for ln in body),
            "waits": sum("wgmma.wait_group" in ln for ln in body)}


def check_gemm_turn(fn, compile_check: bool = True) -> None:
    """Exercise 05.5: ``fn`` issues a steady turn's S = Q K^T and O += P V and waits for S.
    Recorded on the CPU at D = 128 and D = 64 (each k-block, its ACCUMULATE flag, the groups,
    the wait depth), then compiled into the kernel for sm_90a: one wait_group 1 after the turn's
    two commits, and no fence of ptxas's own."""
    for qk, pv in ((8, 8), (4, 4), (8, 5)):
        what = f"with {qk} k-blocks in S = Q K^T and {pv} in O += P V"
        try:
            events = record_turn(fn, qk, pv)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        mistake = _turn_mistake(events, qk, pv)
        if mistake:
            raise AssertionError(f"{what}: {mistake}.")
    if not compile_check:
        return
    art = compile_with_turn(fn)
    found = steady_wait_ptx(art.ptx)
    if not found["found"] or found["wait_group_1"] != 1:
        raise AssertionError(
            f"compiled for sm_90a, the kernel has {found['wait_group_1']} wgmma.wait_group 1: "
            "the steady turn should wait once, with depth 1")
    if found["commits"] != 2 or found["wgmma"] != 16:
        raise AssertionError(
            f"compiled for sm_90a, the steady turn issues {found['wgmma']} wgmma in "
            f"{found['commits']} committed group(s) before its wait_group 1; the kernel's turn "
            "at D = 128 issues 16 (8 for S, 8 for P V) in 2 groups")
    extra = ch05.injected_wgmma_fences(art)
    if extra:
        raise AssertionError(
            f"compiled for sm_90a, ptxas added {extra} wgmma fence(s) of its own "
            "(WARPGROUP.ARRIVE beyond the source's wgmma.fence): it split the groups, so "
            "wait_group(1) now waits for more than S. Keep the products' registers as the "
            "kernel gives them")


_TURN_BUILDS: dict = {}


def compile_with_turn(fn, head_dim: int = 128, causal: bool = False):
    """``HopperWithTurn(fn)`` compiled for sm_90a with fake tensors (no GPU); remembered."""
    key = (fn, head_dim, causal)
    if key not in _TURN_BUILDS:
        _TURN_BUILDS[key] = compile_kernel(HopperWithTurn, fn, head_dim, causal)
    return _TURN_BUILDS[key]


# ================================================================================================
# 05.6: the epilogue's hand-over, threads -> shared memory -> TMA
# ================================================================================================
@cute.jit
def store_o(rO, tOsO, tma_atom_o, tOsO_tma, tOgO_tma, tidx, num_threads):
    """Exercise 05.6's reference: every consumer thread writes its part of O into shared memory,
    fences its own writes for the async proxy and meets the others at a named barrier; then one
    warp stores the whole tile with the TMA and waits until the TMA has read shared memory."""
    cute.autovec_copy(rO, tOsO)  # generic-proxy stores
    cute.arch.fence_view_async_shared()  # ... made visible to the async proxy (the TMA)
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=num_threads)
    if tidx // cute.arch.WARP_SIZE == 0:
        cute.copy(tma_atom_o, tOsO_tma, tOgO_tma)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory outlives the reads


class HopperWithEpilogue(ch05.FlashAttentionHopper):
    """Chapter 05's kernel with the epilogue's store of O replaced by ``store_fn``."""

    def __init__(self, store_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store_fn = store_fn

    @cute.jit
    def store_o(self, rO, tOsO, tma_atom_o, tOsO_tma, tOgO_tma, tidx):
        self.store_fn(rO, tOsO, tma_atom_o, tOsO_tma, tOgO_tma, tidx, self.num_consumer_threads)


# --- recording stand-ins ----------------------------------------------------------------------
@dataclass(frozen=True)
class StoreEvent:
    """One call of one thread: "store" (O into shared memory), "fence" (``what``: the proxy
    fence, or another kind), "barrier" / "arrive" (``bar``, ``count``), "tma" (the TMA store),
    "commit", "wait" (``n``, ``read``)."""

    kind: str
    what: str = ""
    bar: int | None = None
    count: int | None = None
    n: int = -1
    read: bool | None = None


class _Tok:
    def __init__(self, name):
        self.name = name

    def load(self):
        return _Tok(f"{self.name}.load()")

    def __repr__(self):
        return self.name


class _Part(_Tok):
    """tOsO: this thread's part of O in shared memory; ``store`` records a store into it."""

    def __init__(self, name, log):
        super().__init__(name)
        self.log = log

    def store(self, value):
        if not (isinstance(value, _Tok) and value.name.startswith("rO")):
            raise AssertionError(f"tOsO.store(...) takes rO.load(); got {value!r}")
        self.log(StoreEvent("store"))


def record_epilogue(fn, num_threads: int = 256) -> dict[int, list[StoreEvent]]:
    """Run ``fn`` (exercise 05.6's signature) once per consumer thread as plain Python with
    recording stand-ins; return each thread's calls in order. ``tidx`` counts the consumer
    threads from 0; the CTA's first warpgroup (warps 0-3) is the producer."""
    from cutlass.base_dsl.common import DSLBaseError

    from utils.host_emulation import patched, python_loops

    per_thread: dict[int, list[StoreEvent]] = {}
    me = {"tidx": 0}

    def log(event):
        per_thread.setdefault(me["tidx"], []).append(event)

    rO, atom = _Tok("rO"), _Tok("tma_atom_o")
    s_tma, g_tma = _Tok("tOsO_tma"), _Tok("tOgO_tma")
    tOsO = _Part("tOsO", log)

    def autovec_copy(src, dst, **kw):
        if src is rO and dst is tOsO:
            return log(StoreEvent("store"))
        raise AssertionError(f"cute.autovec_copy({src!r}, {dst!r}): this thread's O fragment "
                             "goes from registers into shared memory, cute.autovec_copy(rO, tOsO)")

    def copy(a, src, dst, *args, **kw):
        if a is atom:
            if (src, dst) == (s_tma, g_tma):
                return log(StoreEvent("tma"))
            raise AssertionError(f"cute.copy(tma_atom_o, {src!r}, {dst!r}): the TMA store "
                                 "copies the tile from shared to global memory, "
                                 "cute.copy(tma_atom_o, tOsO_tma, tOgO_tma)")
        if src is rO and dst is tOsO:
            return log(StoreEvent("store"))
        raise AssertionError(f"cute.copy({a!r}, {src!r}, {dst!r}): write your fragment with "
                             "cute.autovec_copy(rO, tOsO); the TMA copy is "
                             "cute.copy(tma_atom_o, tOsO_tma, tOgO_tma)")

    def fence_proxy(kind, *, space=None, **kw):
        log(StoreEvent("fence", what=f"proxy {kind}" + (f" {space}" if space else "")))

    def barrier(*, barrier_id=None, number_of_threads=None, **kw):
        log(StoreEvent("barrier", bar=barrier_id, count=number_of_threads))

    def barrier_arrive(*, barrier_id=None, number_of_threads=None, **kw):
        log(StoreEvent("arrive", bar=barrier_id, count=number_of_threads))

    def wait_group(n, *, read=None, **kw):
        log(StoreEvent("wait", n=n, read=read))

    def other_fence(name):
        return lambda *a, **kw: log(StoreEvent("fence", what=name))

    arch = dict(
        fence_view_async_shared=lambda **kw: log(StoreEvent("fence", what="proxy async.shared "
                                                                          "cta")),
        fence_proxy=fence_proxy, barrier=barrier, barrier_arrive=barrier_arrive,
        sync_threads=lambda **kw: log(StoreEvent("barrier", bar=0, count=None)),
        cp_async_bulk_commit_group=lambda **kw: log(StoreEvent("commit")),
        cp_async_bulk_wait_group=wait_group,
        fence_acq_rel_cta=other_fence("acq_rel.cta"), fence_acq_rel_gpu=other_fence("acq_rel.gpu"),
        warp_idx=lambda **kw: (me["tidx"] + ch05.THREADS_PER_WG) // 32,
        lane_idx=lambda **kw: me["tidx"] % 32,
        thread_idx=lambda **kw: (me["tidx"] + ch05.THREADS_PER_WG, 0, 0),
        make_warp_uniform=lambda x, **kw: x,
    )
    with python_loops(), patched(cute, autovec_copy=autovec_copy, copy=copy), \
            patched(cute.arch, **arch):
        for tidx in range(num_threads):
            me["tidx"] = tidx
            per_thread[tidx] = []
            try:
                _plain_deep(fn)(rO, tOsO, atom, s_tma, g_tma, tidx, num_threads)
            except DSLBaseError as exc:
                raise AssertionError(
                    "write the stores, fence, barrier and copy in the function itself: a nested "
                    f"@cute.jit helper tried to compile on its own ({type(exc).__name__})"
                ) from None
    return per_thread


_WHY = {"no test": (
    "Without it, the TMA reads shared memory through the async proxy, which neither program "
    "order nor the barrier orders against the threads' ordinary (generic-proxy) stores: it may "
    "read stale bytes. Whether it does depends on when each thread's stores drain, which "
    "changes from run to run, so a run that gives the right answer proves nothing and no test "
    "can be sure to catch the missing fence. That is why this check reads your code")}


def _is_proxy_fence(e: StoreEvent) -> bool:
    return e.kind == "fence" and e.what.startswith("proxy async")


def _epilogue_mistake(per_thread: dict[int, list[StoreEvent]], num_threads: int = 256):
    """The first thing wrong with the recorded epilogue, in words; None when it is right."""
    stores = {t: [i for i, e in enumerate(ev) if e.kind == "store"]
              for t, ev in per_thread.items()}
    missing = [t for t, s in stores.items() if not s]
    if missing:
        return (f"{len(missing)} thread(s) (thread {missing[0]} first) never write their part "
                "of O into shared memory: cute.autovec_copy(rO, tOsO) in every consumer thread")
    twice = [t for t, s in stores.items() if len(s) > 1]
    if twice:
        return f"thread {twice[0]} writes its part of O {len(stores[twice[0]])} times"
    issuers = sorted(t for t, ev in per_thread.items() if any(e.kind == "tma" for e in ev))
    if not issuers:
        return ("no thread issues the TMA store, so O never reaches global memory. (tidx counts "
                "the consumer threads from 0; cute.arch.warp_idx() counts the CTA's warps, and "
                "warps 0-3 are the producer's)")
    warps = sorted({t // 32 for t in issuers})
    if len(warps) > 1:
        return (f"{len(warps)} warps issue the TMA store (warps {warps[:4]}...): each would "
                "store the whole tile again. Issue it from one warp (or one thread)")
    for t, ev in per_thread.items():
        kinds = [e.kind for e in ev]
        if "tma" in kinds and kinds.count("tma") > 1:
            return f"thread {t} issues the TMA store {kinds.count('tma')} times"
    # the proxy fence, per writing thread
    fencing = [t for t, ev in per_thread.items() if any(_is_proxy_fence(e) for e in ev)]
    if not fencing:
        other = next((e.what for ev in per_thread.values() for e in ev if e.kind == "fence"),
                     None)
        lead = (f"the fence you wrote ({other}) orders the generic proxy only; " if other
                else "")
        return (f"{lead}no thread issues fence.proxy.async.shared::cta "
                "(cute.arch.fence_view_async_shared()) between its stores and the barrier. "
                + _WHY["no test"])
    if len(fencing) < len(per_thread):
        t = next(t for t in per_thread if t not in fencing)
        return (f"only {len(fencing)} thread(s) fence (not thread {t}): a proxy fence orders "
                "its own thread's stores, so every thread that wrote O fences its own, before "
                "the barrier. " + _WHY["no test"])
    # barriers
    for t, ev in per_thread.items():
        bars = [e for e in ev if e.kind in ("barrier", "arrive")]
        if not bars:
            return (f"thread {t} never reaches a barrier: the thread that issues the TMA store "
                    "cannot know its rows are written")
        b = bars[0]
        if b.bar in (None, 0):
            return ("cute.arch.barrier() with no id is __syncthreads: it waits for all "
                    f"{num_threads + ch05.THREADS_PER_WG} threads of the CTA, and the producer "
                    "warpgroup never comes, so the consumers hang. Use the named barrier "
                    f"barrier_id=EPILOGUE_BARRIER ({EPILOGUE_BARRIER}) with "
                    "number_of_threads=num_threads")
        if b.count != num_threads:
            what = ("completes once that many have arrived, before every row is written"
                    if isinstance(b.count, int) and b.count < num_threads else
                    "waits for threads that never come: a hang")
            return (f"the barrier counts {b.count} threads, but {num_threads} consumer threads "
                    f"write O: it {what}. number_of_threads=num_threads")
        store = stores[t][0]
        fence = next((i for i, e in enumerate(ev) if _is_proxy_fence(e)), None)
        where = ev.index(b)
        if fence is None or fence > where:
            return (f"thread {t} fences after the barrier: its stores are handed over before "
                    "they are made visible to the async proxy. Store, fence, then the barrier. "
                    + _WHY["no test"])
        if fence < store:
            return (f"thread {t} fences before it stores: a fence orders what its thread did "
                    "before it, so stores after it are not covered. Store, fence, barrier")
        if store > where:
            return (f"thread {t} writes its part of O after the barrier: the TMA store may "
                    "already be reading that row")
    ids = {(e.bar, e.count) for ev in per_thread.values() for e in ev
           if e.kind in ("barrier", "arrive")}
    if len(ids) > 1:
        return f"the threads meet at different barriers {sorted(ids, key=str)}: use one"
    for t in issuers:
        ev = per_thread[t]
        kinds = [e.kind for e in ev]
        tma = kinds.index("tma")
        sync = [i for i, e in enumerate(ev) if e.kind == "barrier"]
        if not sync or sync[0] > tma:
            said = ("arrives on the barrier without waiting at it"
                    if "arrive" in kinds[:tma] else "reaches the barrier only after the copy")
            return (f"thread {t} issues the TMA store before the barrier ({said}): the TMA may "
                    "read rows the other warps have not written yet. Wait at the barrier "
                    "(cute.arch.barrier), then copy")
        commits = [i for i, k in enumerate(kinds) if k == "commit" and i > tma]
        if not commits:
            return ("the TMA store is never committed (cute.arch.cp_async_bulk_commit_group()): "
                    "a bulk wait_group waits for committed groups only, so nothing would keep "
                    "the CTA alive until the TMA has read shared memory")
        waits = [ev[i] for i in range(commits[0], len(ev)) if ev[i].kind == "wait"]
        if not waits or waits[0].n != 0:
            return ("once the store is committed, wait until the TMA has read the tile: "
                    "cute.arch.cp_async_bulk_wait_group(0, read=True). Without it the CTA may "
                    "exit, and its shared memory be given to the next CTA, while the TMA still "
                    "reads O from it")
    return None


def check_store_o(fn, compile_check: bool = True) -> None:
    """Exercise 05.6: ``fn`` hands O from the consumer threads to the TMA. Recorded for each of
    the 256 (and 384) consumer threads on the CPU (stores, fences, barrier, who issues the TMA,
    commit and wait), then compiled into the kernel for sm_90a: the proxy fence before the
    epilogue's barrier, the TMA store after it."""
    for threads in (256, 384):
        what = f"with {threads} consumer threads"
        try:
            per_thread = record_epilogue(fn, threads)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
        mistake = _epilogue_mistake(per_thread, threads)
        if mistake:
            raise AssertionError(f"{what}: {mistake}.")
    if not compile_check:
        return
    order = epilogue_ptx_order(compile_with_epilogue(fn).ptx)
    if order["fence"] is None:
        raise AssertionError("compiled for sm_90a, the kernel has no "
                             "fence.proxy.async.shared::cta. " + _WHY["no test"] + ".")
    if order["barrier"] is None or order["store"] is None:
        raise AssertionError(f"compiled for sm_90a, the epilogue's barrier (bar.sync "
                             f"{EPILOGUE_BARRIER}) or its TMA store is missing from the PTX")
    if not order["fence"] < order["barrier"] < order["store"]:
        raise AssertionError(f"compiled for sm_90a, the PTX has the fence at line "
                             f"{order['fence']}, the barrier at {order['barrier']} and the TMA "
                             f"store at {order['store']}: the order must be fence, barrier, "
                             "store")
    if order["wait"] is None or order["wait"] < order["store"]:
        raise AssertionError("compiled for sm_90a, no cp.async.bulk.wait_group.read 0 follows "
                             "the TMA store")


def epilogue_ptx_order(ptx: str) -> dict:
    """PTX line numbers of the epilogue's landmarks: the last proxy fence and the epilogue
    barrier before the TMA store of O, the store itself, and the bulk wait after it."""
    lines = ptx.splitlines()
    store = next((i for i, ln in enumerate(lines) if "cp.async.bulk.tensor" in ln
                  and ".global.shared" in ln), None)
    upto = store if store is not None else len(lines)

    def last(pred):
        return max((i for i in range(upto) if pred(lines[i])), default=None)

    fence = last(lambda ln: "fence.proxy.async" in ln)
    barrier = last(lambda ln: re.match(rf"\s*bar(?:rier)?\.sync\s+{EPILOGUE_BARRIER},", ln)
                   is not None)
    wait = None if store is None else next(
        (i for i in range(store, len(lines)) if "cp.async.bulk.wait_group.read" in lines[i]),
        None)
    return {"fence": fence, "barrier": barrier, "store": store, "wait": wait}


_EPILOGUE_BUILDS: dict = {}


def compile_with_epilogue(fn, head_dim: int = 128, causal: bool = False):
    """``HopperWithEpilogue(fn)`` compiled for sm_90a with fake tensors (no GPU); remembered."""
    key = (fn, head_dim, causal)
    if key not in _EPILOGUE_BUILDS:
        _EPILOGUE_BUILDS[key] = compile_kernel(HopperWithEpilogue, fn, head_dim, causal)
    return _EPILOGUE_BUILDS[key]


# ================================================================================================
# Shared: compile a course subclass; run it on a GPU against float64
# ================================================================================================
def compile_kernel(kernel_class, fn, head_dim: int = 128, causal: bool = False, config=None):
    """``kernel_class(fn, ...)`` (a subclass of the chapter's kernel taking the learner's
    function first) compiled for sm_90a with fake tensors, as ``ch05.compile_only`` does."""
    from cutlass.cute.runtime import make_fake_tensor

    from utils.compile_only import compile_for, fake_stream

    elem = cutlass.BFloat16
    batch, heads, heads_kv = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    seqlen_q, seqlen_k = cute.sym_int32(), cute.sym_int32()

    def bshd(seqlen, nheads):  # (b, s, h, D), 16-byte aligned strides
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(elem, (batch, seqlen, nheads, head_dim), (*strides, 1),
                                assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q),
                           (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    kernel = kernel_class(fn, elem, head_dim, causal, config)
    return compile_for("sm_90a", kernel, bshd(seqlen_q, heads), bshd(seqlen_k, heads_kv),
                       bshd(seqlen_k, heads_kv), bshd(seqlen_q, heads), lse, 1.0, fake_stream())


_GPU_BUILDS: dict = {}


def attention_into_with(kernel_class, fn):
    """``ch05.attention_into`` with ``kernel_class(fn, ...)`` as the kernel: a function (q, k,
    v, out, lse, causal, softmax_scale, config) for ``utils.checks``."""

    def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
        import cuda.bindings.driver as cuda
        import torch

        b, sq, sk, h, hk, d = ch05.check_inputs(q, k, v, softmax_scale, config)
        cfg = config or ch05.default_config(d)
        scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
        args = [ch05._to_cute(t, 3) for t in (q, k, v, out)] + [ch05._to_cute(lse, 2, align=4)]
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        key = (kernel_class, fn, q.dtype, d, bool(causal), cfg)
        if key not in _GPU_BUILDS:
            kernel = kernel_class(fn, ch05.TORCH_TO_CUTLASS[q.dtype], d, bool(causal), cfg)
            _GPU_BUILDS[key] = cute.compile[cute.GPUArch("sm_90a")](kernel, *args, scale, stream)
        _GPU_BUILDS[key](*args, scale, stream)
        return out, lse

    return attention_into


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype): one tile, ragged tiles,
# causal tiles that see no key, GQA, the three-warpgroup D = 64 default, many tiles
GPU_CASES = [
    (1, 128, 128, 1, 1, 128, False, "bfloat16"),
    (1, 300, 77, 2, 2, 128, True, "bfloat16"),
    (1, 1000, 4097, 2, 1, 128, True, "bfloat16"),
    (2, 129, 129, 4, 2, 64, True, "float16"),
    (1, 2048, 2048, 2, 2, 128, False, "bfloat16"),
    (1, 4096, 4096, 2, 2, 64, False, "bfloat16"),
]


def check_on_gpu(kernel_class, fn, cases=GPU_CASES) -> tuple[bool, list[str]]:
    """The whole kernel with ``fn`` at its seam, on fresh random inputs and NaN-filled outputs,
    against the float64 reference. Returns (ok, one line per case)."""
    import torch

    from utils import checks

    run = attention_into_with(kernel_class, fn)
    ok, lines = True, []
    for b, sq, sk, h, hk, d, causal, dtype in cases:
        case_ok, line = checks.check_random_case(run, b, sq, sk, h, hk, d, causal,
                                                 getattr(torch, dtype))
        ok &= case_ok
        lines.append(line)
    return ok, lines


def check_gemm_turn_on_gpu(fn, cases=GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 05.5 on a Hopper GPU: the kernel with ``fn`` as its steady turn's GEMMs."""
    return check_on_gpu(HopperWithTurn, fn, cases)


def check_store_o_on_gpu(fn, cases=GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 05.6 on a Hopper GPU: the kernel with ``fn`` as its epilogue's store of O."""
    return check_on_gpu(HopperWithEpilogue, fn, cases)
