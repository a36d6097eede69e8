"""Chapters 09-10's teaching helpers: a CPU model of tensor memory, pictures, and the exercises.

The kernels are ``fa4_final.blackwell`` (primer, fwd); the pipeline simulation is
``solutions.ch09_pipeline``, the cycle model ``solutions.ch09_model``, the comparison with FA4
``solutions.ch09_compare``. This module adds what a learner pokes at on a CPU:

- ``TmemModel``: tensor memory as an allocator of columns with the rules of tcgen05.alloc, and
  the lane-quarter rule of tcgen05.ld / st, raising in plain words when a rule is broken;
- pictures: the forward's TMEM plan and roles, and (chapter 10) a CTA pair's MMA;
- exercises 09.1-09.3 and 10.1-10.2: references and checkers.

Nothing here needs a GPU.
"""

from __future__ import annotations

import math

from fa4_final.blackwell import tmem
from fa4_final.blackwell.config import BlackwellFwdConfig
from fa4_final.constants import SM100_SMEM_BYTES
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
    """Reference for 09.3 / 10.3: arrivals that complete one phase of s[i]'s EMPTY barrier."""
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


def smem_cycles_per_step(d: int, two_cta: bool) -> float:
    """Reference for 10.1: shared-memory cycles per KV step on one SM (two Q tiles)."""
    from solutions import ch09_model

    return ch09_model.step_cycles(d, two_cta).smem


def check_smem_cycles_per_step(fn) -> None:
    for d in (64, 128):
        for two in (False, True):
            got, want = fn(d, two), smem_cycles_per_step(d, two)
            if not math.isclose(got, want, rel_tol=1e-6):
                raise AssertionError(
                    f"D={d} {'2-CTA' if two else '1-CTA'}: {got:g} cycles, expected {want:g}. "
                    "Per step each SM's MMAs read both Q tiles (A, 128 x D each), K twice and V "
                    "twice (B, 128 x D each, once per Q tile); in a pair each SM reads half of "
                    "every B. 2 bytes per element, 128 bytes per clock")


def kv_stages_that_fit(d: int, two_cta: bool) -> int:
    """Reference for 10.2: the K/V ring depth FA4's rule gives (BlackwellFwdConfig)."""
    return BlackwellFwdConfig(two_cta=two_cta).ring_depth(d)


def check_kv_stages_that_fit(fn) -> None:
    for d in (64, 128):
        for two in (False, True):
            got, want = fn(d, two), kv_stages_that_fit(d, two)
            if got != want:
                raise AssertionError(
                    f"D={d} {'2-CTA' if two else '1-CTA'}: {got}, expected {want}. Take 224 KB, "
                    "subtract Q and O (two 128 x D tiles each, bf16), divide by one K/V stage "
                    f"(128 x D x 2 bytes, half of it in a pair); at most 32. ({SM100_SMEM_BYTES} "
                    "B is the limit; the rest holds barriers and row statistics)")
