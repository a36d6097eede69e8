"""Chapters 09-10's teaching helpers: a CPU model of tensor memory, pictures, and the exercises.

The kernels are ``solutions.ch09_primer`` and ``fa4_final.blackwell.fwd``; the pipeline
simulation is ``solutions.ch09_pipeline``, the cycle model ``solutions.ch09_model``, the
comparison with FA4 ``solutions.ch09_compare``. This module adds what a learner pokes at on a CPU:

- ``TmemModel``: tensor memory as an allocator of columns with the rules of tcgen05.alloc, and
  the lane-quarter rule of tcgen05.ld / st, raising in plain words when a rule is broken;
- pictures: the forward's TMEM plan and roles, and (chapter 10) a CTA pair's MMA;
- exercises 09.1-09.5: references and checkers; for the device-code ones (09.3, 09.4) the CPU
  emulation of the primer's pieces, their replay in the primer's simulation, the PTX checks
  of the compiled primer and the GPU check (chapter 10's are in ``solutions.ch10_teaching``);
- the forward compiled (``compile_forward``) and run on a Blackwell GPU (``FORWARD_VARIANTS``,
  ``verify_forward``: ``measure.blackwell_fwd`` times them);
- the claims behind chapter 09's and the lab's comparison with FA4's compiled forward.

Nothing here needs a GPU.
"""

from __future__ import annotations

from fa4_final.blackwell import tmem
from fa4_final.blackwell.config import BlackwellFwdConfig
from utils.claims import claim
from utils.host_emulation import patched
from utils.notebook import source_between  # noqa: F401 (the notebooks quote the kernel with it)
from utils.results import load_stored  # noqa: F401


class TmemError(Exception):
    """A tensor-memory rule was broken; the message says which one."""


class TmemModel:
    """One SM's tensor memory: 128 lanes x 512 columns of 32 bits, allocated in columns.

    ``alloc(warp, columns)`` follows tcgen05.alloc's rules: a power of two >= 32 columns, all
    128 lanes; where in the 512 columns it lands is the hardware's choice, modelled here as the
    first free range; ``free(warp, start)`` must come from the warp that allocated.
    ``load(warp, lanes)`` and ``store`` check the lane-quarter rule: warp w reaches lanes
    32 (w mod 4) .. 32 (w mod 4) + 31.
    """

    def __init__(self):
        self.owner: list[tuple[int, int] | None] = [None] * tmem.TMEM_COLUMNS
        self.allocations: dict[int, tuple[int, int]] = {}  # start -> (columns, warp)
        self.log: list[str] = []

    def alloc(self, warp: int, columns: int) -> int:
        if columns < tmem.MIN_ALLOC_COLUMNS or columns & (columns - 1):
            raise TmemError(f"tcgen05.alloc of {columns} columns: the count must be a power of "
                            f"two >= {tmem.MIN_ALLOC_COLUMNS}")
        if columns > tmem.TMEM_COLUMNS:
            raise TmemError(f"{columns} columns: an SM has {tmem.TMEM_COLUMNS}")
        for start in range(0, tmem.TMEM_COLUMNS - columns + 1, tmem.MIN_ALLOC_COLUMNS):
            if all(c is None for c in self.owner[start:start + columns]):
                for c in range(start, start + columns):
                    self.owner[c] = (start, warp)
                self.allocations[start] = (columns, warp)
                self.log.append(f"warp {warp} allocates columns {start}..{start + columns - 1}")
                return start
        used = sum(c is not None for c in self.owner)
        raise TmemError(f"tcgen05.alloc of {columns} columns blocks: {used} of "
                        f"{tmem.TMEM_COLUMNS} are taken and no free range that long is left "
                        f"(on the GPU the warp would wait until another CTA frees TMEM)")

    def free(self, warp: int, start: int) -> None:
        if start not in self.allocations:
            raise TmemError(f"tcgen05.dealloc at column {start}: nothing was allocated there")
        columns, owner = self.allocations[start]
        if owner != warp:
            raise TmemError(f"warp {warp} frees columns {start}.. allocated by warp {owner}: "
                            f"the allocating warp must free them")
        for c in range(start, start + columns):
            self.owner[c] = None
        del self.allocations[start]
        self.log.append(f"warp {warp} frees columns {start}..{start + columns - 1}")

    @property
    def free_columns(self) -> int:
        return sum(c is None for c in self.owner)

    def _access(self, what: str, warp: int, lanes, column: int) -> None:
        allowed = tmem.lane_quarter(warp)
        bad = [lane for lane in lanes if lane not in allowed]
        if bad:
            raise TmemError(f"warp {warp} {what}s lanes {bad[0]}..{bad[-1]}: warp {warp} may "
                            f"only reach lanes {allowed.start}..{allowed.stop - 1} (warp "
                            f"{warp} mod 4 = {warp % 4})")
        if self.owner[column] is None:
            raise TmemError(f"warp {warp} {what}s column {column}, which nobody allocated")

    def load(self, warp: int, lanes, column: int) -> None:
        self._access("load", warp, lanes, column)

    def store(self, warp: int, lanes, column: int) -> None:
        self._access("store", warp, lanes, column)


def ld_registers(shape: str = "32x32b", repetition: int = 32) -> dict:
    """What one tcgen05.ld of a 32x32b shape moves: each of the warp's 32 threads gets
    ``repetition`` consecutive 32-bit columns of ITS OWN lane (thread t <-> lane 32 q + t)."""
    if shape != "32x32b":
        raise ValueError("only the 32x32b shape (one lane per thread) is modelled here")
    if repetition not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"repetition must be a power of two in 1..128, got {repetition}")
    return {"lanes per warp": 32, "columns per thread": repetition,
            "registers per thread": repetition, "bytes per warp": 32 * repetition * 4}


# ----------------------------------------------------------------------------------------------
# pictures


def draw_tmem_plan(plan=None, roles=None, ax=None, title=None):
    """TMEM as 128 lanes x 512 columns with the plan's regions, and the lane quarter each
    warpgroup's warps reach."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    plan = plan or tmem.forward_plan(128, 128)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.2))
    colors = {"S": "#1f77b4", "O": "#ff7f0e", "P": "#2ca02c"}
    ax.add_patch(Rectangle((0, 0), tmem.TMEM_COLUMNS, tmem.TMEM_LANES, facecolor="#f4f4f4",
                           edgecolor="black"))
    for r in plan.regions:
        alias = r.alias_of is not None
        ax.add_patch(Rectangle((r.start, 0), r.columns, tmem.TMEM_LANES,
                               facecolor=colors[r.name[0]], alpha=0.35 if not alias else 0.6,
                               edgecolor="black", hatch="//" if alias else None))
        ax.text(r.start + r.columns / 2, tmem.TMEM_LANES * (0.3 if alias else 0.7),
                f"{r.name}\ncols {r.start}-{r.end - 1}", ha="center", va="center", fontsize=8)
    for q in range(4):
        ax.axhline(32 * q, color="gray", lw=0.6, ls=":")
        ax.text(-6, 32 * q + 16, f"lanes {32 * q}-{32 * q + 31}\nwarps {q}, {q + 4}, {q + 8}",
                ha="right", va="center", fontsize=7)
    ax.set_xlim(-70, tmem.TMEM_COLUMNS + 4)
    ax.set_ylim(tmem.TMEM_LANES + 2, -2)
    ax.set_xlabel("column (32 bits each)")
    ax.set_ylabel("lane = query row")
    ax.set_title(title or f"TMEM plan: {plan.columns_used} of {tmem.TMEM_COLUMNS} columns used, "
                 f"{plan.columns_allocated} allocated")
    ax.grid(False)
    return ax


def draw_pair(ax=None):
    """Chapter 10's picture: a CTA pair's 256-row tcgen05.mma. Each CTA holds its own 128 rows
    of Q (A) and half of the K tile (B); the MMA writes each CTA's 128 rows of S into that
    CTA's TMEM; one commit arrives on both CTAs' barriers."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.6))
    for cta, x0 in ((0, 0.0), (1, 6.0)):
        ax.add_patch(Rectangle((x0, 0), 5, 4, facecolor="#fafafa", edgecolor="black"))
        ax.text(x0 + 2.5, 4.2, f"CTA {cta} (SM {cta})" + (": leader, issues the MMA"
                                                         if cta == 0 else ""),
                ha="center", fontsize=9)
        ax.add_patch(Rectangle((x0 + 0.3, 2.2), 1.8, 1.4, facecolor="#9ecae1"))
        ax.text(x0 + 1.2, 2.9, f"Q rows\n{128 * cta}-{128 * cta + 127}", ha="center",
                va="center", fontsize=8)
        ax.add_patch(Rectangle((x0 + 2.7, 2.2), 2.0, 1.4, facecolor="#fdae6b"))
        ax.text(x0 + 3.7, 2.9, f"K keys\n{64 * cta}-{64 * cta + 63} (half)", ha="center",
                va="center", fontsize=8)
        ax.add_patch(Rectangle((x0 + 0.3, 0.3), 4.4, 1.4, facecolor="#a1d99b"))
        ax.text(x0 + 2.5, 1.0, f"TMEM: S rows {128 * cta}-{128 * cta + 127} x all 128 keys",
                ha="center", va="center", fontsize=8)
    for src, dst in (((4.7, 2.9), (6.3, 1.0)), ((8.7, 2.9), (4.7, 1.0))):
        ax.add_patch(FancyArrowPatch(src, dst, arrowstyle="->", mutation_scale=12, color="gray"))
    ax.text(5.5, -0.4, "each SM reads half of every B operand from shared memory; "
            "tcgen05.commit (multicast) arrives on both CTAs' barriers",
            ha="center", fontsize=8)
    ax.set_xlim(-0.3, 11.3)
    ax.set_ylim(-0.8, 4.6)
    ax.axis("off")
    ax.set_title("2-CTA MMA: S (256 x 128) = Q (256 x D) K^T, cta_group::2")
    return ax


# ----------------------------------------------------------------------------------------------
# exercises


def plan_columns(tile_n: int, head_dim: int) -> dict:
    """Reference for 09.1: {region: (first column, columns)} of the forward's TMEM plan with two
    Q stages, 16-bit P; and "alloc": the columns to allocate."""
    plan = tmem.forward_plan(tile_n, head_dim)
    out = {r.name: (r.start, r.columns) for r in plan.regions}
    out["alloc"] = plan.columns_allocated
    return out


def check_plan_columns(fn) -> None:
    for tile_n, d in ((128, 128), (128, 64), (64, 128), (64, 64)):
        got = fn(tile_n, d)
        want = plan_columns(tile_n, d)
        where = f"tile_n={tile_n}, head_dim={d}"
        if not isinstance(got, dict) or set(got) != set(want):
            raise AssertionError(f"return a dict with keys {sorted(want)} ({where}), got "
                                 f"{got!r}")
        for name in ("S0", "S1", "O0", "O1"):
            if got[name] != want[name]:
                raise AssertionError(f"{name}: {got[name]}, expected {want[name]} ({where}): "
                                     "S0, S1 first (tile_n fp32 columns each), then O0, O1 "
                                     "(head_dim fp32 columns each)")
        for name in ("P0", "P1"):
            if got[name][1] != want[name][1]:
                raise AssertionError(f"{name} takes {got[name][1]} columns, expected "
                                     f"{want[name][1]} ({where}): two 16-bit values share a "
                                     "32-bit column")
            if got[name] != want[name]:
                raise AssertionError(f"{name}: {got[name]}, expected {want[name]} ({where}): P_i "
                                     f"lives in the upper half of S_i's columns")
        if got["alloc"] != want["alloc"]:
            raise AssertionError(f"alloc {got['alloc']}, expected {want['alloc']} ({where}): a "
                                 "power of two >= 32 that holds every region")
    try:
        got = fn(128, 256)
    except ValueError:
        return
    raise AssertionError("tile_n=128, head_dim=256: S0, S1, O0, O1 need 2 x 128 + 2 x 256 = 768 "
                         "columns, more than the 512 of an SM's TMEM; raise ValueError (saying "
                         f"so) instead of returning a plan ({got!r})")


def warps_for_rows(rows: range) -> list[int]:
    """Reference for 09.2: the warp indices (among 0..15) whose lane quarter covers ``rows``
    (TMEM lanes), i.e. the warps that may load those rows of S."""
    return [w for w in range(16) if set(rows) <= set(tmem.lane_quarter(w))]


def check_warps_for_rows(fn) -> None:
    for rows in (range(0, 32), range(40, 50), range(96, 128), range(30, 34)):
        got = fn(rows)
        want = warps_for_rows(rows)
        if sorted(got or []) != want:
            raise AssertionError(
                f"rows {rows.start}..{rows.stop - 1}: {got}, expected {want}. Warp w reaches "
                "lanes 32 (w mod 4) .. 32 (w mod 4) + 31; a range that crosses a multiple of "
                "32 is reachable by no single warp")


def s_empty_arrivals(two_cta: bool) -> int:
    """Reference for 09.5: arrivals that complete one phase of s[i]'s EMPTY barrier."""
    from solutions.ch09_pipeline import make_kernel

    k = make_kernel(128, False, BlackwellFwdConfig(two_cta=two_cta))
    return {p.name: p for p in k.pipelines()}["s"].empty_arrivals


def check_s_empty_arrivals(answer) -> None:
    if not isinstance(answer, dict) or set(answer) != {"1-CTA", "2-CTA"}:
        raise AssertionError('give {"1-CTA": n, "2-CTA": n}')
    for key, two in (("1-CTA", False), ("2-CTA", True)):
        want = s_empty_arrivals(two)
        if answer[key] != want:
            hint = ("the softmax warpgroup (one arrival per thread, after its P store) and the "
                    "correction warpgroup (after rescaling O) both release s[i]")
            if two:
                hint += "; in a pair both CTAs' warpgroups arrive on the leader's barrier"
            raise AssertionError(f"{key}: {answer[key]} is not it: {hint}")


# ----------------------------------------------------------------------------------------------
# exercises 09.3 and 09.4: the primer's MMA issue and its softmax warpgroup, in device code.
# Each is run as plain Python with stand-ins that compute on NumPy and write down every call
# (the row arithmetic against float64), the calls are replayed in the primer's simulation
# (solutions.ch09_pipeline.PrimerSim: deadlock, overwrite, stale read), and the primer is
# compiled for sm_100a with the piece inside and its PTX read.


class _F32(float):
    """cutlass.Float32 in an emulation: a plain float (Float32(0.0), Float32.inf)."""

    inf = float("inf")

    def __new__(cls, value=0.0):
        return float(value)


def _run_plain(fn, *args):
    """``fn`` (a ``@cute.jit`` function) as written, as plain Python, with cutlass.Float32 a
    plain float. The caller patches the DSL calls it makes."""
    import types

    import cutlass

    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None) or raw.__code__
    scope = {name: (_F32 if value is cutlass.Float32 else value)
             for name, value in raw.__globals__.items()}
    plain = types.FunctionType(code, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    with patched(cutlass, Float32=_F32):
        return plain(*args)


class _Bar:
    """An mbarrier pointer in an emulation."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"mbar_{self.name}"


class _Recorder:
    """What one thread (or warp) did: its calls as ``Op``s; calls inside ``elect_one`` are
    kept only on the elected lane (``lane == 0``)."""

    def __init__(self, lane: int = 0):
        self.lane, self.ops, self.muted = lane, [], False
        self.elect_depth = 0

    def add(self, op) -> None:
        if not self.muted:
            self.ops.append(op)

    def elect_one(self):
        import contextlib

        rec = self

        @contextlib.contextmanager
        def block():
            muted = rec.muted
            rec.muted = muted or rec.lane != 0
            rec.elect_depth += 1
            try:
                yield
            finally:
                rec.muted = muted
                rec.elect_depth -= 1

        return block()


def _bar_arg(bar, what: str) -> str:
    if not isinstance(bar, _Bar):
        raise AssertionError(f"{what} takes an mbarrier pointer (one of the mbar_ arguments); "
                             f"got {bar!r}")
    return bar.name


def _arch_recorders(rec: _Recorder) -> dict:
    """cute.arch calls the primer's pieces may make, recorded as ``Op``s."""
    import numpy as np

    from solutions.ch09_pipeline import Op

    def wait(bar, phase=0, *args, **kwargs):
        rec.add(Op("wait", _bar_arg(bar, "mbarrier_wait"), parity=int(phase) & 1))

    def arrive(bar, peer_cta_rank_in_cluster=None, arrive_count=1, **kwargs):
        cta = 0 if peer_cta_rank_in_cluster is None else int(peer_cta_rank_in_cluster)
        rec.add(Op("arrive", _bar_arg(bar, "mbarrier_arrive"), cta=cta,
                   count=int(arrive_count), what="remote" if peer_cta_rank_in_cluster
                   is not None else "local"))

    def fmax(a, b, *args, **kwargs):
        return float(np.fmax(float(a), float(b)))

    def fmin(a, b, *args, **kwargs):
        return float(np.fmin(float(a), float(b)))

    return {"mbarrier_wait": wait, "mbarrier_arrive": arrive,
            "fence_view_async_tmem_store": lambda *a, **k: rec.add(Op("wait_st")),
            "fence_view_async_tmem_load": lambda *a, **k: rec.add(Op("wait_ld")),
            "elect_one": rec.elect_one, "fmax": fmax, "fmin": fmin}


# --- 09.4: the softmax warpgroup ---------------------------------------------------------------
class _TmemCopy:
    def __init__(self, kind: str):
        self.kind = kind  # "ld" (load_s) or "st" (store_p)

    def __repr__(self):
        return "load_s" if self.kind == "ld" else "store_p"


class _TmemRow:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"t{self.name}t{self.name}"


class _Vec16:
    """A row converted with ``.to(dtype)``: values rounded to the 16-bit type."""

    def __init__(self, values, dtype):
        self.values, self.dtype = values, dtype


class _Loaded:
    """``rS.load()``: the row as a vector; ``.to(dtype)`` rounds it."""

    def __init__(self, values):
        self.values = values

    def to(self, dtype):
        return _Vec16(_round16(self.values, dtype), dtype)


def _round16(values, dtype):
    import cutlass
    import numpy as np
    import torch

    t = torch.tensor(np.asarray(values, dtype=np.float32))
    if dtype is cutlass.BFloat16:
        return t.to(torch.bfloat16).double().numpy()
    if dtype is cutlass.Float16:
        return t.to(torch.float16).double().numpy()
    return t.double().numpy()


class _RegRow:
    """``rS``: the thread's 128 fp32 registers."""

    def __init__(self, n: int):
        import numpy as np

        self.data = np.zeros(n)
        self.element_type = __import__("cutlass").Float32

    def __getitem__(self, i):
        return float(self.data[int(i)])

    def __setitem__(self, i, value):
        self.data[int(i)] = float(value)

    def load(self):
        return _Loaded(self.data.copy())

    def store(self, vec):
        self.data[:] = vec.values if isinstance(vec, (_Loaded, _Vec16)) else vec


class _PRow:
    """``rP``: 128 16-bit values (in the 64 registers of ``rP32``)."""

    def __init__(self, n: int):
        import cutlass
        import numpy as np

        self.data = np.full(n, np.nan)
        self.element_type = cutlass.BFloat16
        self.stored_as = None

    def __getitem__(self, i):
        return float(self.data[int(i)])

    def __setitem__(self, i, value):
        self.data[int(i)] = _round16([float(value)], self.element_type)[0]
        self.stored_as = self.element_type

    def store(self, vec):
        if isinstance(vec, _Vec16):
            if vec.dtype is not self.element_type:
                raise AssertionError(
                    f"P was converted to {getattr(vec.dtype, '__name__', vec.dtype)}, but the "
                    f"P V MMA reads it as {self.element_type.__name__}: convert with "
                    ".to(rP.element_type)")
            self.data[:] = vec.values
            self.stored_as = vec.dtype
            return
        raise AssertionError("rP.store takes the row converted to 16 bits: "
                             "rP.store(rS.load().to(rP.element_type))")


class _PWords:
    """``rP32``: the same registers as ``rP``, as 32-bit words (the source of store_p)."""

    def __init__(self, p: _PRow):
        self.p = p


def run_softmax_to_p(fn, S, scale_log2: float):
    """Run ``fn`` (exercise 09.4's signature) for every softmax thread of the primer on the
    scores ``S`` (128 x 128; thread t owns row t), as plain Python. Returns (P as stored in
    TMEM per row, (max_scaled, row_sum) per row, each thread's calls as ``Op``s)."""
    import cutlass.cute as cute
    import numpy as np

    from solutions.ch09_pipeline import Op
    from utils.host_emulation import patched, python_loops

    rows = S.shape[0]
    P = np.full(S.shape, np.nan)
    stats, calls = [], []
    for t in range(rows):
        rec = _Recorder(lane=t % 32)
        load_s, store_p = _TmemCopy("ld"), _TmemCopy("st")
        tStS, tPtP = _TmemRow("S"), _TmemRow("P")
        rS, rP = _RegRow(S.shape[1]), _PRow(S.shape[1])
        rP32 = _PWords(rP)

        def copy(atom, src, dst, *args, t=t, rec=rec, rS=rS, rP=rP, rP32=rP32, tStS=tStS,
                 tPtP=tPtP, load_s=load_s, store_p=store_p, **kwargs):
            if atom is load_s:
                if src is not tStS or dst is not rS:
                    raise AssertionError("the load of S is cute.copy(load_s, tStS, rS): TMEM "
                                         "(this thread's row of S) into the registers rS")
                rS.data[:] = S[t]
                rec.add(Op("ld", what="S"))
            elif atom is store_p:
                if src is not rP32 or dst is not tPtP:
                    raise AssertionError("the store of P is cute.copy(store_p, rP32, tPtP): the "
                                         "32-bit words of rP into this thread's row of P in TMEM")
                if rP.stored_as is None:
                    raise AssertionError("you stored rP to TMEM before writing anything into it: "
                                         "rP.store(rS.load().to(rP.element_type)) first")
                P[t] = rP.data
                rec.add(Op("st", what="P"))
            else:
                raise AssertionError(f"cute.copy with {atom!r}: the piece copies only with "
                                     "load_s (S from TMEM) and store_p (P to TMEM)")

        def size(x, mode=None, **kwargs):
            if isinstance(x, (_RegRow, _PRow)):
                return len(x.data)
            raise AssertionError(f"cute.size of {x!r}: size the registers (rS)")

        def exp2(x, *args, **kwargs):
            return float(np.exp2(float(x)))

        def exp(x, *args, **kwargs):
            return float(np.exp(float(x)))

        arch = _arch_recorders(rec)
        with np.errstate(all="ignore"), python_loops(), patched(cute, copy=copy, size=size), \
                patched(cute.arch, **arch), patched(cute.math, exp2=exp2, exp=exp):
            out = _run_plain(fn, load_s, tStS, rS, store_p, tPtP, rP32, rP, _Bar("s"),
                             _Bar("p"), scale_log2)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise AssertionError("return (max_scaled, row_sum): the epilogue needs the row's max "
                                 "(times scale_log2) and its sum to finish O and the LSE")
        stats.append((float(out[0]), float(out[1])))
        calls.append(rec.ops)
    return P, stats, calls


def softmax_cases(seed: int = 9):
    """Scores of the primer's 128 x 128 tile: random rows, a row whose scores are all large
    (exp2 of them overflows float32 unless the max is subtracted first), a row with one
    dominant score, a row of equal scores, a row of negative scores."""
    import numpy as np

    rng = np.random.default_rng(seed)
    S = rng.standard_normal((128, 128)) * 3
    S[5] += 2000.0
    S[17] = rng.standard_normal(128) * 0.1
    S[17, 40] = 30.0
    S[64] = 1.5
    S[100] = -500.0 + rng.standard_normal(128)
    return S.astype(np.float32).astype(np.float64)


def _p_mistake(P, S, c: float, stats) -> str | None:
    """The first row whose P or statistics are not the softmax's, with a guess at why."""
    import numpy as np

    with np.errstate(all="ignore"):
        mx = S.max(axis=1, keepdims=True)
        want = np.exp2(c * (S - mx))
        tol = 2.0**-8 * np.abs(want) + 1e-6
        bad = ~(np.abs(P - want) <= tol)
    if bad.any():
        r, col = map(int, np.argwhere(bad)[0])
        guesses = [
            (np.exp2(c * S), "you did not subtract the row's max: exp2 of raw scores overflows "
             "(row 5's scores are near 2000) and the MMA would sum infinities"),
            (np.exp(c * (S - mx)), "exp2 takes its argument in log2 units: scale_log2 already "
             "carries log2(e), so use cute.math.exp2, not exp"),
            (np.exp2(S - mx), "multiply the scores by scale_log2 (the softmax scale times "
             "log2(e)) before exp2"),
            (np.exp2(c * S - mx), "subtract the max scaled too: exp2(s * scale_log2 - max * "
             "scale_log2)"),
        ]
        hint = next((why for g, why in guesses
                     if np.allclose(P[r], g[r], rtol=2**-7, atol=1e-6, equal_nan=True)),
                    "P must be exp2(scale_log2 * (s - max)) of each score, in 16 bits")
        return (f"row {r}: P[{col}] = {P[r, col]:.4g}, expected exp2(scale_log2 * (s - max)) = "
                f"{want[r, col]:.4g}; {hint}")
    for r, (ms, rsum) in enumerate(stats):
        want_m = float(c * mx[r, 0])
        if not np.isclose(ms, want_m, rtol=1e-5, atol=1e-5):
            return (f"row {r}: the returned max_scaled is {ms:.6g}, expected max * scale_log2 = "
                    f"{want_m:.6g} (the epilogue's LSE is built on it)")
        want_sum = float(want[r].sum())
        if not np.isclose(rsum, want_sum, rtol=2e-3):
            return (f"row {r}: the returned row_sum is {rsum:.6g}, expected the sum of the row's "
                    f"exponentials, {want_sum:.6g} (O is divided by it)")
    return None


def _group_calls(calls) -> list[tuple[int, list]]:
    """Threads that made the same calls, grouped: [(threads, ops), ...]."""
    groups: dict = {}
    for ops in calls:
        key = tuple(ops)
        groups[key] = groups.get(key, 0) + 1
    return [(n, list(key)) for key, n in groups.items()]


def check_softmax_to_p(fn, compile_check: bool = True) -> None:
    """Exercise 09.4: ``fn`` (the softmax warpgroup from S to P) run for all 128 threads on
    scores with hard rows, P and the returned statistics against float64; its calls replayed
    against the primer's MMA warp in the simulation (eight interleavings); then compiled into
    the primer for sm_100a and the PTX read."""
    S = softmax_cases()
    c = 128**-0.5 * 1.4426950408889634
    P, stats, calls = run_softmax_to_p(fn, S, c)
    groups = _group_calls(calls)
    for _, ops in groups:
        kinds = [op.kind for op in ops]
        if "ld" not in kinds:
            raise AssertionError("the thread never loads its row of S: cute.copy(load_s, tStS, "
                                 "rS)")
        if "st" not in kinds:
            raise AssertionError("P never reaches TMEM: cute.copy(store_p, rP32, tPtP) after "
                                 "converting the row into rP")
    mistake = _p_mistake(P, S, c, stats)
    if mistake:
        raise AssertionError(mistake)
    _check_softmax_order(groups)
    if compile_check:
        problems = softmax_ptx_problems(compile_with_pieces(softmax_fn=fn).ptx)
        if problems:
            raise AssertionError("compiled for sm_100a: " + "; ".join(problems))


def _check_softmax_order(groups) -> None:
    from solutions import ch09_pipeline as sim

    arrivals = sum(n * sum(op.count for op in ops if op.kind == "arrive" and op.bar == "p")
                   for n, ops in groups)
    try:
        sim.primer_run({0: sim.primer_mma_ops()}, {0: groups})
    except sim.Deadlock as exc:
        waits_p = any(op.kind == "wait" and op.bar == "p" for _, ops in groups for op in ops)
        if waits_p:
            hint = ("the softmax waits on mbar_p, which only the softmax's own arrivals "
                    "complete: wait on mbar_s, the barrier the MMA warp's commit arrives on")
        elif arrivals != sim.PRIMER_ROWS:
            hint = (f"mbar_p completes after {sim.PRIMER_ROWS} arrivals, one per softmax thread; "
                    f"your threads make {arrivals} (an arrive inside elect_one, or under a "
                    "condition, is made by fewer threads)")
        else:
            hint = "every role ends up waiting on a barrier nobody will complete"
        raise AssertionError(f"{hint}. Simulated: {exc}") from None
    except sim.EarlyArrival as exc:
        raise AssertionError(
            "an arrival the barrier does not expect: the softmax arrives on mbar_p (the MMA "
            f"warp waits there before O = P V), once per thread. Simulated: {exc}") from None
    except (sim.StaleRead, sim.Overwrite) as exc:
        text = str(exc)
        if "S in TMEM" in text:
            hint = ("the softmax loaded S before the MMAs that write it had completed: wait on "
                    "mbar_s with parity 0 (its first phase completes when the commit arrives) "
                    "before cute.copy(load_s, ...)")
        elif "P in TMEM" in text:
            hint = ("the MMA read P while a tcgen05.st was still writing it: the arrive on "
                    "mbar_p tells the MMA warp P is ready, so call "
                    "cute.arch.fence_view_async_tmem_store() (tcgen05.wait::st) after the store "
                    "and before the arrive")
        else:
            hint = "a buffer was read while being written"
        raise AssertionError(f"{hint}. Simulated: {exc}") from None


# --- 09.3: the MMA warp's S = Q K^T and its commit ---------------------------------------------
class _Mma:
    """``mma_qk``: the tiled MMA; ``.set(tcgen05.Field.ACCUMULATE, flag)`` is recorded."""

    def __init__(self):
        self.accumulate = None

    def set(self, field, value):
        from cutlass.cute.nvgpu import tcgen05

        if field is not tcgen05.Field.ACCUMULATE:
            raise AssertionError(f"mma_qk.set({field!r}, ...): the flag that says whether an "
                                 "MMA adds to the accumulator is tcgen05.Field.ACCUMULATE")
        self.accumulate = bool(value)


class _Acc:
    """``tStS``: the fp32 accumulator S in TMEM (128 x 128)."""

    def __init__(self, data):
        self.data = data


class _Descs:
    """``tSrQ`` / ``tSrK``: (MMA, 1, D/16) shared-memory descriptors; ``[None, None, k]`` is the
    k-th block of 16 along D."""

    def __init__(self, name: str, blocks: int):
        self.name, self.blocks = name, blocks

    def __getitem__(self, key):
        if not (isinstance(key, tuple) and len(key) == 3 and key[0] is None and key[1] is None):
            raise AssertionError(f"index the descriptors as t{self.name[1:]}[None, None, k] "
                                 f"(mode 2 is the K-block along D); got {key!r}")
        k = int(key[2])
        if not 0 <= k < self.blocks:
            raise AssertionError(f"K-block {k} of {self.name}: there are {self.blocks} (D / 16)")
        return (self.name, k)


def run_issue_qk(fn, Q, K, leftover):
    """Run ``fn`` (exercise 09.3's signature) as plain Python for the MMA warp: every
    ``cute.gemm`` computed on NumPy into S, which starts as ``leftover`` (what TMEM held).
    Returns (S after the calls, the calls as ``Op``s)."""
    import cutlass.cute as cute
    import numpy as np
    from cutlass.cute.nvgpu import tcgen05

    from solutions.ch09_pipeline import Op
    from utils.host_emulation import patched, python_loops

    d = Q.shape[1]
    rec = _Recorder(lane=0)
    mma, tStS = _Mma(), _Acc(leftover.copy())
    tSrQ, tSrK = _Descs("sQ", d // 16), _Descs("sK", d // 16)

    def gemm(atom, dst, a, b, c, *args, **kwargs):
        if atom is not mma:
            raise AssertionError("cute.gemm's first argument is the tiled MMA, mma_qk")
        if dst is not tStS or c is not tStS:
            raise AssertionError("S accumulates in TMEM: cute.gemm(mma_qk, tStS, a, b, tStS)")
        if not (isinstance(a, tuple) and a[0] == "sQ" and isinstance(b, tuple)
                and b[0] == "sK"):
            raise AssertionError("the A operand is a block of Q (tSrQ[None, None, k]) and the B "
                                 "operand the same block of K (tSrK[None, None, k])")
        if a[1] != b[1]:
            raise AssertionError(f"an MMA multiplies block {a[1]} of Q with block {b[1]} of K: "
                                 "both operands take the same 16 columns of D")
        if mma.accumulate is None:
            raise AssertionError("set the accumulate flag before each MMA: mma_qk.set("
                                 "tcgen05.Field.ACCUMULATE, ...); its value stays from one MMA "
                                 "to the next")
        k = a[1]
        part = Q[:, 16 * k:16 * k + 16] @ K[:, 16 * k:16 * k + 16].T
        tStS.data = tStS.data + part if mma.accumulate else part
        rec.add(Op("gemm", what="S", k=k, accumulate=mma.accumulate))

    def size(x, mode=None, **kwargs):
        if isinstance(x, _Descs):
            return x.blocks if mode in ([2], (2,), 2) else x.blocks * 1
        raise AssertionError(f"cute.size of {x!r}: the K-blocks are cute.size(tSrQ, mode=[2])")

    def commit(bar, mask=None, cta_group=None, **kwargs):
        rec.add(Op("commit", _bar_arg(bar, "tcgen05.commit"),
                   count=1 if rec.elect_depth else 32,
                   mask=None if mask is None else int(mask)))

    arch = _arch_recorders(rec)
    with np.errstate(all="ignore"), python_loops(), patched(cute, gemm=gemm, size=size), \
            patched(cute.arch, **arch), patched(tcgen05, commit=commit):
        _run_plain(fn, mma, tStS, tSrQ, tSrK, _Bar("s"))
    return tStS.data, rec.ops


def issue_cases(head_dim: int, seed: int = 3):
    import numpy as np

    rng = np.random.default_rng(seed + head_dim)
    Q = rng.standard_normal((128, head_dim))
    K = rng.standard_normal((128, head_dim))
    leftover = rng.standard_normal((128, 128)) * 50  # what the last tile left in TMEM
    return Q, K, leftover


def check_issue_qk(fn, compile_check: bool = True) -> None:
    """Exercise 09.3: ``fn`` (the MMA warp's S = Q K^T and its commit) run on NumPy for D = 64
    and 128 with TMEM holding a previous tile's S, compared with Q K^T in float64; its calls
    replayed in the primer's simulation; then compiled into the primer for sm_100a: D/16 MMAs
    before the first commit, the commit by one elected thread onto the barrier the softmax
    waits on."""
    import numpy as np

    from solutions import ch09_pipeline as sim

    for d in (64, 128):
        Q, K, leftover = issue_cases(d)
        S, ops = run_issue_qk(fn, Q, K, leftover)
        gemms = [op for op in ops if op.kind == "gemm"]
        ks = [op.k for op in gemms]
        if sorted(set(ks)) != list(range(d // 16)):
            missing = sorted(set(range(d // 16)) - set(ks))
            raise AssertionError(f"D = {d}: S = Q K^T takes {d // 16} MMAs, one per block of 16 "
                                 f"along D; blocks {missing} were never issued")
        if len(ks) != len(set(ks)):
            raise AssertionError(f"D = {d}: a block of D was multiplied twice ({ks})")
        want = Q @ K.T
        if not np.allclose(S, want, rtol=1e-9, atol=1e-9):
            if gemms[0].accumulate:
                why = ("the first MMA added to what TMEM held from before: set ACCUMULATE to "
                       "False for k = 0, so that it overwrites S")
            elif not all(op.accumulate for op in gemms[1:]):
                why = ("an MMA after the first overwrote S instead of adding to it: ACCUMULATE "
                       "must be True for every k > 0")
            else:
                why = "S is not Q K^T"
            raise AssertionError(f"D = {d}: {why}")
        commits = [op for op in ops if op.kind == "commit"]
        if not commits:
            raise AssertionError("no tcgen05.commit: nothing tells the softmax that S is ready "
                                 "(tcgen05.commit(mbar_s) after the MMAs)")
        if any(op.count != 1 for op in commits):
            raise AssertionError("tcgen05.commit ran on all 32 threads of the warp: 32 arrivals "
                                 "on a barrier that counts 1. Put it inside "
                                 "`with cute.arch.elect_one():`")
        if len(commits) > 1:
            raise AssertionError(f"{len(commits)} commits: mbar_s counts one arrival per phase; "
                                 "commit once, after the last MMA")
        last = max(i for i, op in enumerate(ops) if op.kind == "gemm")
        if ops.index(commits[0]) < last:
            raise AssertionError("the commit comes before the last MMA: it arrives when the MMAs "
                                 "issued before it complete, so the softmax would read a partial "
                                 "S. Commit after the loop")
        mma_ops = sim.primer_mma_ops(d)
        first_commit = next(i for i, op in enumerate(mma_ops) if op.kind == "commit")
        replay = [mma_ops[0]] + ops + mma_ops[first_commit + 1:]
        try:
            sim.primer_run({0: replay}, {0: [(sim.PRIMER_ROWS, sim.primer_softmax_ops())]},
                           head_dim=d)
        except sim.PipelineError as exc:
            hint = ("the commit goes onto mbar_s, the barrier the softmax waits on for S"
                    if any(op.bar != "s" for op in commits) else "")
            raise AssertionError(f"D = {d}: {hint + '. ' if hint else ''}Simulated: "
                                 f"{str(exc).splitlines()[0]}") from None
    if compile_check:
        problems = issue_ptx_problems(compile_with_pieces(issue_qk_fn=fn).ptx, 128)
        if problems:
            raise AssertionError("compiled for sm_100a: " + "; ".join(problems))


# --- the primer compiled with the pieces: what its PTX must show -------------------------------
_PIECE_BUILDS: dict = {}


def compile_with_pieces(issue_qk_fn=None, softmax_fn=None, head_dim: int = 128):
    """The primer compiled for sm_100a (no GPU) with the given pieces; remembered."""
    from solutions import ch09_primer

    key = (issue_qk_fn, softmax_fn, head_dim)
    if key not in _PIECE_BUILDS:
        _PIECE_BUILDS[key] = ch09_primer.compile_one_tile(
            head_dim, issue_qk_fn=issue_qk_fn, softmax_fn=softmax_fn)[1]
    return _PIECE_BUILDS[key]


PRIMER_BARRIER_OFFSETS = {0: "load", 8: "s", 16: "p", 24: "o"}  # the primer's struct


def barrier_registers(ptx: str, offsets=PRIMER_BARRIER_OFFSETS) -> dict:
    """{name: the PTX register holding its address}: the primer's barriers are the first
    fields of its shared storage (mbar_load, mbar_s, mbar_p, mbar_o, 8 bytes each), at the
    dynamic shared-memory base plus their offset."""
    import re

    roots = set(re.findall(r"mov\.b32\s+(%r\d+),\s*__dynamic_shmem__0;", ptx))
    roots |= {dst for dst, src in re.findall(
        r"shfl\.sync\.idx\.b32\s+(%r\d+),\s*(%r\d+),", ptx) if src in roots}
    adds = re.findall(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(\d+);", ptx)
    best: dict = {}
    for root in sorted(roots):
        found = {offsets[0]: root}
        for dst, src, imm in adds:
            if src == root and int(imm) in offsets and offsets[int(imm)] not in found:
                found[offsets[int(imm)]] = dst
        if len(found) > len(best):
            best = found
    return best


def _lines(ptx: str) -> list[str]:
    return [ln.strip() for ln in ptx.splitlines()]


def softmax_ptx_problems(ptx: str) -> list[str]:
    """What the primer's PTX shows wrong about the softmax piece (empty: nothing): 4 loads of
    S (32x32b.x32) before the first store, 4 stores of P (32x32b.x16), tcgen05.wait::st after
    the last store and before the arrive, the arrive on mbar_p, the first wait on mbar_s."""
    import re

    bars = barrier_registers(ptx)
    lines = _lines(ptx)
    out = []
    st = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.st.")]
    if len(st) != 4:
        out.append(f"{len(st)} tcgen05.st, expected 4 (64 columns of P, 16 per store)")
        return out
    arrive = [i for i, ln in enumerate(lines) if ln.startswith("mbarrier.arrive.")
              and "expect_tx" not in ln]
    lds = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.ld.") and i < st[0]]
    if len(lds) != 4:
        out.append(f"{len(lds)} tcgen05.ld before the first store of P, expected 4 (128 columns "
                   "of S, 32 per load)")
    waits = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.wait::st")]
    if not waits:
        out.append("no tcgen05.wait::st: nothing makes the stores of P complete before the MMA "
                   "warp is told P is ready")
    after = [i for i in arrive if i > st[0]]
    if not after:
        out.append("no mbarrier.arrive after the stores of P")
        return out
    first = after[0]
    if not any(st[-1] < w < first for w in waits):
        out.append("the arrive comes before tcgen05.wait::st: the MMA warp may read P while "
                   "its stores are in flight")
    m = re.search(r"\[(%r\d+)\]", lines[first])
    if m and bars.get("p") and m.group(1) != bars["p"]:
        out.append(f"the softmax arrives on {_which(m.group(1), bars)}, not on mbar_p")
    ld_waits = [i for i, ln in enumerate(lines) if "mbarrier.try_wait" in ln and i < lds[0]] \
        if lds else []
    if ld_waits:
        w = lines[ld_waits[-1]]
        m = re.search(r"\[(%r\d+)\],\s*(\d+)", w)
        if m and bars.get("s") and (m.group(1), m.group(2)) != (bars["s"], "0"):
            out.append(f"the last wait before loading S is on {_which(m.group(1), bars)} with "
                       f"parity {m.group(2)}, not on mbar_s with parity 0")
    return out


def _which(reg: str, bars: dict) -> str:
    names = {v: f"mbar_{k}" for k, v in bars.items()}
    return names.get(reg, f"an unknown barrier ({reg})")


def issue_ptx_problems(ptx: str, head_dim: int) -> list[str]:
    """What the primer's PTX shows wrong about the MMA issue piece: D/16 tcgen05.mma before the
    first commit, the commit after an elect.sync, onto mbar_s, and two commits in all."""
    import re

    bars = barrier_registers(ptx)
    lines = _lines(ptx)
    out = []
    mmas = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.mma")]
    commits = [i for i, ln in enumerate(lines) if ln.startswith("tcgen05.commit")]
    if len(commits) != 2:
        out.append(f"{len(commits)} tcgen05.commit in the kernel, expected 2 (S is ready, O is "
                   "ready)")
    if not commits:
        return out
    before = [i for i in mmas if i < commits[0]]
    if len(before) != head_dim // 16:
        out.append(f"{len(before)} tcgen05.mma before the first commit, expected "
                   f"{head_dim // 16} (D / 16)")
    if not any("elect.sync" in lines[j] for j in range(max(commits[0] - 6, 0), commits[0])):
        out.append("the commit is not issued by an elected thread (no elect.sync before it)")
    m = re.search(r"\[(%r\d+)\]", lines[commits[0]])
    if m and bars.get("s") and m.group(1) != bars["s"]:
        out.append(f"the first commit goes onto {_which(m.group(1), bars)}, not onto mbar_s")
    return out


# --- on a Blackwell GPU -------------------------------------------------------------------------
PRIMER_GPU_CASES = [(64, 1.0, 0), (128, 1.0, 1), (128, 8.0, 2), (64, 30.0, 3)]


def check_primer_on_gpu(issue_qk_fn=None, softmax_fn=None, cases=PRIMER_GPU_CASES):
    """The primer with the given pieces on a B200/B300, on fresh random tiles (scale: the
    inputs' spread; 30 makes exp2 overflow unless the max is subtracted), against float64.
    Returns (ok, one line per case)."""
    import torch

    from solutions import ch09_primer
    from utils.checks import poison_, tolerance_check
    from utils.reference import attention_reference

    ok, lines = True, []
    for d, scale, seed in cases:
        compiled, _ = ch09_primer.compile_one_tile(d, keep=False, issue_qk_fn=issue_qk_fn,
                                                   softmax_fn=softmax_fn)
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(128, d, generator=g) * s for s in (scale, 1.0, 1.0))
        q, k, v = (t.to(torch.bfloat16).cuda() for t in (q, k, v))
        out = poison_(torch.empty_like(q))
        lse = poison_(torch.empty(128, dtype=torch.float32, device="cuda"))
        compiled(q, k, v, out, lse, d**-0.5)
        torch.cuda.synchronize()
        q4, k4, v4 = (t[None, :, None] for t in (q, k, v))
        ref = attention_reference(q4, k4, v4, dtype=torch.float64)
        same = attention_reference(q4, k4, v4, dtype=torch.bfloat16)
        verdict = tolerance_check(out[None, :, None], ref[0], same[0], "out")
        lse_ok = bool(torch.allclose(lse.double(), ref[1][0, 0].cuda(), atol=1e-3))
        ok &= verdict.ok and lse_ok
        lines.append(f"D={d} scale={scale} seed={seed}: out {'ok' if verdict.ok else 'WRONG'}, "
                     f"lse {'ok' if lse_ok else 'WRONG'}")
    return ok, lines


# --- the forward compiled (no GPU) and on a Blackwell GPU (measure.blackwell_fwd times it) -----
def compile_forward(head_dim: int = 128, causal: bool = False, cfg=None, dtype: str = "bf16"):
    """``fa4_final.blackwell``'s forward compiled for sm_100a from fake tensors (no GPU): its
    artifacts (PTX, SASS, resources), through the package's sm_100a compile-only entry point
    (fa4_final.api.sm100)."""
    from fa4_final.api.sm100 import compile_only

    return compile_only(head_dim, dtype, causal, cfg)


# --- the forward on a Blackwell GPU (measure.blackwell_fwd times it) ---------------------------
FORWARD_VARIANTS = {
    "fa4_final_sm100": {},
    "fa4_final_sm100_1cta": {"two_cta": False},
    "fa4_final_sm100_2cta": {"two_cta": True},
    "fa4_final_sm100_no_emulation": {"exp2_emulation_fraction": 0.0},
    "fa4_final_sm100_always_rescale": {"rescale_threshold": 0.0},
}


def forward_variant(knobs: dict):
    """``attention(q, k, v, causal, softmax_scale)`` of the sm_100a forward with ``knobs``
    changed in its default configuration."""
    from dataclasses import replace

    from fa4_final.api.sm100 import attention
    from fa4_final.blackwell.config import blackwell_fwd_default

    def run(q, k, v, causal=False, softmax_scale=None):
        cfg = replace(blackwell_fwd_default(q.shape[-1], causal), **knobs)
        return attention(q, k, v, causal, softmax_scale, config=cfg)

    return run


def verify_forward(fn, d: int, causal: bool) -> bool:
    """One awkward case (lengths off the tile, GQA) against float64 on a Blackwell GPU."""
    import torch

    from utils.checks import tolerance_check
    from utils.reference import attention_reference, random_qkv

    q, k, v, _ = random_qkv(2, 1000, 4, d, seqlen_k=1100, heads_kv=2, dtype=torch.bfloat16,
                            device="cuda")
    out, _ = fn(q, k, v, causal=causal)
    ref = attention_reference(q, k, v, causal, dtype=torch.float64)
    same = attention_reference(q, k, v, causal, dtype=torch.bfloat16)
    return tolerance_check(out, ref[0], same[0], "out").ok


def check_forward_on_gpu() -> tuple[bool, list[str]]:
    """Every forward variant on one awkward case per head dim and mask: (ok, one line each)."""
    ok, lines = True, []
    for name, knobs in FORWARD_VARIANTS.items():
        fn = forward_variant(knobs)
        for d in (64, 128):
            for causal in (False, True):
                good = verify_forward(fn, d, causal)
                ok &= good
                lines.append(f"{name} D={d} causal={causal}: "
                             f"{'verified' if good else 'WRONG'}")
    return ok, lines


# --- the stored comparison with FA4 (section 6): what the chapter prints, and its claims -------
FA4_SUMMARY_METRICS = [
    "UTC*MMA (tcgen05.mma)", "softmax: MUFU.EX2", "softmax: FFMA2", "softmax: FADD2",
    "softmax: F2FP (fp32 -> 16-bit pairs)", "softmax: LDTM (tcgen05.ld)",
    "softmax: STTM (tcgen05.st)", "registers (launch)", "spill instructions",
    "TMEM columns allocated", "instruction descriptors"]
SAME_SHARE_CONFIGS = ("d128 causal", "d64 non-causal", "d64 causal")  # same emulated share
SAME_CODE_METRICS = ("softmax: MUFU.EX2", "softmax: FFMA2", "softmax: F2FP (fp32 -> 16-bit pairs)",
                     "softmax: LDTM (tcgen05.ld)", "softmax: STTM (tcgen05.st)")


def _fa4_configs():
    from solutions import ch09_compare

    return [c["config"] for c in ch09_compare.CONFIGS if c["fa4"]]


@claim("09.softmax_matches_fa4", "sm100_fwd_vs_fa4",
       "where both kernels emulate the same share (D = 128 causal, D = 64), our softmax "
       "warpgroups hold exactly FA4's MUFU.EX2, FFMA2, F2FP, LDTM and STTM counts; TMEM columns "
       "and instruction descriptors are the same in every configuration", gpu="compile")
def _softmax_matches_fa4(res):
    from solutions.ch09_compare import value

    diffs = [(c, m, value(res, "fa4_final", c, m), value(res, "fa4", c, m))
             for c in SAME_SHARE_CONFIGS for m in SAME_CODE_METRICS
             if value(res, "fa4_final", c, m) != value(res, "fa4", c, m)]
    diffs += [(c, m, value(res, "fa4_final", c, m), value(res, "fa4", c, m))
              for c in _fa4_configs() for m in ("TMEM columns allocated", "instruction descriptors")
              if value(res, "fa4_final", c, m) != value(res, "fa4", c, m)]
    return not diffs, f"differences: {diffs}" if diffs else "equal, metric by metric"


@claim("09.mma_count_half_of_fa4", "sm100_fwd_vs_fa4",
       "our code holds half as many tcgen05.mma as FA4's in every configuration", gpu="compile")
def _mma_count_half(res):
    from solutions.ch09_compare import value

    pairs = {c: (value(res, "fa4_final", c, "UTC*MMA (tcgen05.mma)"),
                 value(res, "fa4", c, "UTC*MMA (tcgen05.mma)")) for c in _fa4_configs()}
    return all(2 * a == b for a, b in pairs.values()), f"ours / FA4's: {pairs}"


@claim("09.fa4_emulates_more_2cta", "sm100_fwd_vs_fa4",
       "at non-causal D = 128 (2-CTA) FA4's softmax holds fewer MUFU.EX2 than ours", gpu="compile")
def _fa4_emulates_more(res):
    from solutions.ch09_compare import value

    c = "d128 non-causal 2-CTA"
    a, b = (value(res, impl, c, "softmax: MUFU.EX2") for impl in ("fa4_final", "fa4"))
    return b < a, f"MUFU.EX2 ours {a}, FA4 {b}"


@claim("09.lab_correction_rolled", "sm100_fwd_vs_fa4",
       "in the correction warpgroup our code holds fewer FMUL2, F2FP and LDTM than FA4's in "
       "every configuration", gpu="compile")
def _correction_rolled(res):
    from solutions.ch09_compare import value

    metrics = [f"correction: {m}" for m in ("FMUL2", "F2FP (fp32 -> 16-bit pairs)",
                                            "LDTM (tcgen05.ld)")]
    pairs = {(c, m): (value(res, "fa4_final", c, m), value(res, "fa4", c, m))
             for c in _fa4_configs() for m in metrics}
    return all(a < b for a, b in pairs.values()), f"ours / FA4's: {list(pairs.values())}"


@claim("09.lab_fewer_named_barriers", "sm100_fwd_vs_fa4",
       "our kernel's code passes fewer named barriers (BAR) than FA4's in every configuration",
       gpu="compile")
def _fewer_named_barriers(res):
    from solutions.ch09_compare import value

    pairs = {c: (value(res, "fa4_final", c, "BAR (named barriers)"),
                 value(res, "fa4", c, "BAR (named barriers)")) for c in _fa4_configs()}
    return all(a < b for a, b in pairs.values()), f"ours / FA4's: {pairs}"
