"""A cycle model of one attention tile on one SM: tensor cores, exp unit, shared memory.

One tile is one step of the inner loop: in the forward pass a CTA holding M query rows folds in
N keys and values; in the backward pass (FA4's order) a CTA holding M key/value rows folds in N
query rows. On one SM, three units work on that step at the same time, and the slowest one sets
the pace. Per unit, cycles = work / (work per clock per SM), with the per-clock figures from
``utils.hardware.PER_SM`` (the one copy of ANCHORS.md's table):

    MMA    sum over the tile's matmuls of 2*m*n*k FLOPs / dense bf16 FLOP per clock
    exp    M*N exponentials / MUFU ex2 per clock (forward: P = exp2(S - m); backward:
           P = exp2(S - LSE) recomputed)
    SMEM   bytes read from or written to shared memory / 128 B per clock

The first two are counting. The third needs to know which operand of which matmul sits in shared
memory, and that is what changes between GPU generations.

How an MMA touches shared memory
--------------------------------
* Hopper (sm_90) ``wgmma``: a warpgroup issues an M=64 instruction. B always comes from shared
  memory; A from shared memory or from registers. A 128-row tile is two warpgroups, and each one
  reads all of B: B is read ceil(M / 64) times.
* Blackwell (sm_100, sm_103) ``tcgen05.mma``: one thread issues an instruction of up to M=128
  rows per CTA. B comes from shared memory, A from shared memory or from tensor memory (TMEM),
  and the accumulator lives in TMEM. B is read once per 128 rows.
* Blackwell 2-CTA (``cta_group::2``): a CTA pair computes a tile of M=256 rows, 128 per SM;
  each CTA supplies its own A rows and half of B, so each SM reads half of every B operand.

An operand the SM computed itself (P after the softmax, dS after the backward's elementwise step)
is the A operand when the kernel lays the matmul out that way, and is then read from TMEM
(Blackwell) or registers (Hopper), not from shared memory. That is the design of FA4
(``flash_fwd_sm100.py``: P from TMEM; ``flash_bwd_sm100.py``: P^T and dS^T from TMEM).

Forward, per tile (M query rows resident, N keys streamed; bf16 = 2 bytes)::

    S  = Q K^T   m=M n=N k=D   A = Q   (SMEM)   B = K (SMEM)
    O += P V     m=M n=D k=N   A = P   (TMEM / registers)   B = V (SMEM)

Backward, per tile (M key rows resident with dK, dV accumulating on chip, N query rows
streamed)::

    S^T  = K Q^T    m=M n=N k=D   A = K    (SMEM)   B = Q  (SMEM)
    dP^T = V dO^T   m=M n=N k=D   A = V    (SMEM)   B = dO (SMEM)
    dV  += P^T dO   m=M n=D k=N   A = P^T  (TMEM)   B = dO (SMEM)
    dK  += dS^T Q   m=M n=D k=N   A = dS^T (TMEM)   B = Q  (SMEM)
    dQ   = dS K     m=N n=D k=M   A = dS   (SMEM)   B = K  (SMEM)

plus traffic that is not an MMA operand: dS is stored to shared memory (it is dQ's A operand),
and the float32 partial dQ is staged in shared memory (written by threads, read by the TMA that
reduce-adds it into global memory).

The paper's figures fall out (B200, M=N=D=128, one 128x128 bf16 tile = 32 KiB = 256 cycles):

    forward   MMA 4*128^3 / 8192 = 1024;  exp 128*128 / 16 = 1024;
              SMEM Q + K + V = 3 tiles = 768.            H100: MMA 4*128^3 / 4096 = 2048.
    backward  MMA 10*128^3 / 8192 = 2560;
              SMEM reads K,Q + V,dO + dO + Q + dS,K = 8 tiles, dS store = 1,
              dQ fp32 staging 2 (write) + 2 (read) = 4: 13 tiles = 3328.
    2-CTA     M=256 (128 per SM): the five B operands (Q, dO, dO, Q, K) are halved, 2.5 tiles
              less: 10.5 tiles = 2688.

Assumptions that the figures need, stated because the paper gives totals, not the itemisation:
(1) writes into shared memory by TMA loads (Q, K, V, dO arriving from global memory) are not
counted; every access by the SM's own instructions and by TMA stores is. The forward's 768 is
only the MMA reads. (2) The 2-CTA figure halves every MMA's B operand and leaves the rest per SM
unchanged. FA4's real dQ MMA reduces over both CTAs' key rows and its dS exchange also halves the
dQ staging; counting that would lower the figure further. The itemisation above is one that
reproduces the paper's totals and matches FA4's code.

Causal masking is ignored: this is a per-tile model (a masked tile costs the same on every unit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from utils.hardware import PER_SM
from utils.reference import positive_int

UNITS = ("mma", "exp", "smem")
UNIT_LABELS = {"mma": "tensor cores (MMA)", "exp": "exp unit (MUFU)", "smem": "shared memory"}
PASSES = ("fwd", "bwd")

# GPU names the course uses -> key of utils.hardware.PER_SM. H100 and H200 share an SM.
GPUS = {"H100": "sm_90", "H200": "sm_90", "B200": "sm_100", "B300": "sm_103"}
_ALIASES = {
    "sm_90": "H100", "sm_90a": "H100", "hopper": "H100",
    "sm_100": "B200", "sm_100a": "B200", "blackwell": "B200",
    "sm_103": "B300", "sm_103a": "B300",
}


@dataclass(frozen=True)
class MmaIssue:
    """How one architecture's MMA instruction reads shared memory."""

    rows_per_instruction: int  # per CTA: 64 for a wgmma warpgroup, 128 for tcgen05
    on_chip_a: str  # where an operand computed on the SM (P, dS) is read from
    pair_mma: bool  # cta_group::2 exists


MMA_ISSUE = {
    "sm_90": MmaIssue(64, "registers", False),
    "sm_100": MmaIssue(128, "TMEM", True),
    "sm_103": MmaIssue(128, "TMEM", True),
}


@dataclass(frozen=True)
class Matmul:
    """One matmul of a tile: (m x k) @ (k x n), with where its A operand lives."""

    name: str
    a: str
    b: str
    m: int
    n: int
    k: int
    a_on_chip: bool  # A was computed on the SM: read from TMEM / registers, not SMEM

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def tile_matmuls(pass_: str, m: int, n: int, d: int) -> list[Matmul]:
    """The matmuls of one tile (m resident rows per CTA, n streamed rows, head dim d)."""
    if pass_ == "fwd":
        return [
            Matmul("S = Q K^T", "Q", "K", m, n, d, a_on_chip=False),
            Matmul("O += P V", "P", "V", m, d, n, a_on_chip=True),
        ]
    return [
        Matmul("S^T = K Q^T", "K", "Q", m, n, d, a_on_chip=False),
        Matmul("dP^T = V dO^T", "V", "dO", m, n, d, a_on_chip=False),
        Matmul("dV += P^T dO", "P^T", "dO", m, d, n, a_on_chip=True),
        Matmul("dK += dS^T Q", "dS^T", "Q", m, d, n, a_on_chip=True),
        Matmul("dQ = dS K", "dS", "K", n, d, m, a_on_chip=False),
    ]


def smem_traffic(gpu: str, pass_: str, m: int, n: int, d: int, ctas: int = 1,
                 elem_bytes: int = 2) -> list[tuple[str, float]]:
    """(what, bytes) for every shared-memory access of one tile on one SM.

    ``m`` is the per-CTA row count (the pair's M divided by ``ctas``).
    """
    issue = MMA_ISSUE[GPUS[gpu]]
    items: list[tuple[str, float]] = []
    for mm in tile_matmuls(pass_, m, n, d):
        if not mm.a_on_chip:
            items.append((f"{mm.name}: read A = {mm.a}", mm.m * mm.k * elem_bytes))
        rereads = math.ceil(mm.m / issue.rows_per_instruction)
        items.append((f"{mm.name}: read B = {mm.b}" + (f" x{rereads}" if rereads > 1 else "")
                      + (" (half per CTA)" if ctas == 2 else ""),
                      rereads * mm.n * mm.k * elem_bytes / ctas))
    if pass_ == "bwd":
        items.append(("dS store (A operand of dQ)", m * n * elem_bytes))
        items.append(("dQ fp32 partial: threads write", n * d * 4))
        items.append(("dQ fp32 partial: TMA reads for reduce-add", n * d * 4))
    return items


@dataclass(frozen=True)
class TileCycles:
    """Cycles of one tile on one SM, per unit; the largest one binds."""

    gpu: str
    pass_: str
    m: int  # tile rows of the MMA (the pair's rows in 2-CTA mode)
    n: int
    d: int
    ctas: int
    mma: float
    exp: float
    smem: float
    traffic: tuple[tuple[str, float], ...]  # shared-memory accesses per SM, bytes

    @property
    def cycles(self) -> dict[str, float]:
        return {u: getattr(self, u) for u in UNITS}

    @property
    def bound_cycles(self) -> float:
        return max(self.cycles.values())

    @property
    def binding(self) -> tuple[str, ...]:
        """The unit(s) that set the pace; a tie lists each of them."""
        top = self.bound_cycles
        return tuple(u for u, c in self.cycles.items() if math.isclose(c, top, rel_tol=1e-9))

    @property
    def mma_ceiling(self) -> float:
        """Best fraction of tensor-core peak this tile can reach if every unit overlaps."""
        return self.mma / self.bound_cycles

    @property
    def label(self) -> str:
        pair = " 2-CTA" if self.ctas == 2 else ""
        return f"{self.gpu} {self.pass_} {self.m}x{self.n} D={self.d}{pair}"

    def __str__(self) -> str:
        parts = ", ".join(f"{u} {c:.0f}" for u, c in self.cycles.items())
        return (f"{self.label}: {parts} cycles -> bound by {'+'.join(self.binding)} "
                f"({self.bound_cycles:.0f}); MMA at most {self.mma_ceiling:.0%} busy")


def resolve_gpu(arch: str) -> str:
    """'B200', 'b200', 'sm_100a', 'blackwell' -> 'B200'. Raises ValueError naming the options."""
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a string such as 'B200', got {type(arch).__name__}")
    key = arch.strip()
    if key.upper() in GPUS:
        return key.upper()
    if key.lower() in _ALIASES:
        return _ALIASES[key.lower()]
    raise ValueError(f"unknown arch {arch!r}; accepted: {sorted(GPUS)} or {sorted(_ALIASES)}")


def tile_cycles(arch: str = "B200", pass_: str = "fwd", m: int = 128, n: int = 128,
                d: int = 128, ctas: int = 1, elem_bytes: int = 2) -> TileCycles:
    """Cycles per unit for one tile on one SM.

    ``m``: rows of the tile's MMA (query rows forward, key rows backward); with ``ctas=2`` the
    pair's rows, so each SM holds m/2. ``n``: rows streamed per step. ``d``: head dim.
    """
    gpu = resolve_gpu(arch)
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    m, n, d = (positive_int(k, v) for k, v in (("m", m), ("n", n), ("d", d)))
    if ctas not in (1, 2):
        raise ValueError(f"ctas must be 1 or 2 (2-CTA MMA), got {ctas!r}")
    sm = GPUS[gpu]
    if ctas == 2 and not MMA_ISSUE[sm].pair_mma:
        raise ValueError(f"{gpu} ({sm}) has no 2-CTA MMA (cta_group::2 is Blackwell's); use ctas=1")
    if m % ctas:
        raise ValueError(f"m={m} must split evenly over the {ctas} CTAs of a pair")
    figures = PER_SM[sm]
    m_cta = m // ctas
    traffic = smem_traffic(gpu, pass_, m_cta, n, d, ctas, elem_bytes)
    flops = sum(mm.flops for mm in tile_matmuls(pass_, m_cta, n, d))
    return TileCycles(
        gpu=gpu, pass_=pass_, m=m, n=n, d=d, ctas=ctas,
        mma=flops / figures.mma_flops_per_clk,
        exp=m_cta * n / figures.exp2_per_clk,
        smem=sum(b for _, b in traffic) / figures.smem_bytes_per_clk,
        traffic=tuple(traffic),
    )


@dataclass(frozen=True)
class WhatIf:
    """A tile before and after scaling some units' throughput."""

    before: TileCycles
    after: TileCycles
    scale: dict

    @property
    def speedup(self) -> float:
        return self.before.bound_cycles / self.after.bound_cycles

    def __str__(self) -> str:
        knobs = ", ".join(f"{u} x{s:g}" for u, s in self.scale.items()) or "nothing"
        return (f"scale {knobs}: {self.speedup:.2f}x faster per tile\n"
                f"  before  {self.before}\n  after   {self.after}")


def what_if(arch: str = "B200", scale: dict | None = None, pass_: str = "fwd", m: int = 128,
            n: int = 128, d: int = 128, ctas: int = 1) -> WhatIf:
    """Scale units' per-clock throughput (``{"exp": 2}``: twice the exps per clock) and see
    which unit binds before and after."""
    scale = dict(scale or {})
    for unit, factor in scale.items():
        if unit not in UNITS:
            raise ValueError(f"unknown unit {unit!r} in scale; accepted: {UNITS}")
        ok = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not ok or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"scale[{unit!r}] must be a positive number, got {factor!r}")
    before = tile_cycles(arch, pass_, m, n, d, ctas)
    scaled = {u: c / scale.get(u, 1) for u, c in before.cycles.items()}
    after = TileCycles(before.gpu, pass_, m, n, d, ctas, traffic=before.traffic, **scaled)
    return WhatIf(before, after, scale)


# ---------------------------------------------------------------------------------------------
# Pictures (matplotlib is imported on first use, so the model itself stays light)


def plot_per_sm_table(ax=None):
    """Per-SM, per-clock throughput of each unit relative to H100: asymmetric scaling."""
    from utils.plots import grouped_bars

    fields = {"MMA (bf16 FLOP)": "mma_flops_per_clk", "exp (MUFU ex2)": "exp2_per_clk",
              "FMA (fp32)": "fma_per_clk", "shared memory (B)": "smem_bytes_per_clk"}
    gpus = ("H100", "B200", "B300")
    base = PER_SM[GPUS["H100"]]
    series = {g: [getattr(PER_SM[GPUS[g]], f) / getattr(base, f) for f in fields.values()]
              for g in gpus}
    ax = grouped_bars(list(fields), series, title="Per SM, per clock, relative to H100",
                      ylabel="x H100", ax=ax)
    ax.axhline(1.0, color="black", lw=0.8)
    return ax


def plot_tile_cycles(tiles, ax=None, title="Cycles per tile on one SM"):
    """Bars of MMA / exp / SMEM cycles for one or more ``TileCycles``; the binding unit of each
    tile is outlined in black."""
    import matplotlib.pyplot as plt

    from utils.plots import color_for

    tiles = [tiles] if isinstance(tiles, TileCycles) else list(tiles)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(tiles)), 3.8))
    width = 0.8 / len(UNITS)
    for i, unit in enumerate(UNITS):
        xs = [t + (i - 1) * width for t in range(len(tiles))]
        values = [tile.cycles[unit] for tile in tiles]
        bars = ax.bar(xs, values, width, label=UNIT_LABELS[unit], color=color_for(unit))
        for bar, tile, value in zip(bars, tiles, values):
            if unit in tile.binding:
                bar.set_edgecolor("black")
                bar.set_linewidth(2)
            ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(tiles)), [tile.label.replace(" ", "\n", 2) for tile in tiles],
                  fontsize=8)
    ax.set_ylabel("cycles")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def plot_what_if(result: WhatIf, ax=None):
    """Before/after bars of a ``what_if`` with the bound marked as a dashed line."""
    import matplotlib.pyplot as plt

    from utils.plots import color_for

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(UNITS)
    for col, tile in enumerate((result.before, result.after)):
        for i, unit in enumerate(UNITS):
            bar = ax.bar(col + (i - 1) * width, tile.cycles[unit], width, color=color_for(unit),
                         label=UNIT_LABELS[unit] if col == 0 else None)[0]
            if unit in tile.binding:
                bar.set_edgecolor("black")
                bar.set_linewidth(2)
        ax.hlines(tile.bound_cycles, col - 0.45, col + 0.45, colors="black", linestyles="--",
                  lw=1)
    knobs = ", ".join(f"{u} x{s:g}" for u, s in result.scale.items()) or "no change"
    ax.set_xticks([0, 1], ["before", f"after ({knobs})"])
    ax.set_ylabel("cycles per tile")
    ax.set_title(f"{result.before.label}: {result.speedup:.2f}x per tile")
    ax.legend(fontsize=8)
    return ax


def _live_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def interactive_explorer(arch: str = "B200", pass_: str = "fwd", d: int = 128):
    """Sliders for each unit's throughput, head dim, pass, GPU and 2-CTA mode.

    Without ipywidgets or a live Jupyter kernel it draws one static what-if instead and says so.
    """
    start = what_if(arch, {"exp": 2}, pass_, d=d)
    try:
        import ipywidgets as widgets
    except ImportError:
        widgets = None
    if widgets is None or not _live_kernel():
        print("(static picture: the sliders need ipywidgets in a live Jupyter kernel)")
        return plot_what_if(start)

    import matplotlib.pyplot as plt

    def redraw(gpu, pass_, d, ctas, mma, exp, smem):
        try:
            result = what_if(gpu, {"mma": mma, "exp": exp, "smem": smem}, pass_,
                             m=128 * ctas, d=d, ctas=ctas)
        except ValueError as exc:
            print(exc)
            return
        plot_what_if(result)
        plt.show()
        print(result)

    slider = dict(min=0.5, max=4.0, step=0.25, value=1.0, continuous_update=False)
    return widgets.interactive(
        redraw,
        gpu=widgets.Dropdown(options=list(GPUS), value=start.before.gpu),
        pass_=widgets.Dropdown(options=list(PASSES), value=pass_),
        d=widgets.Dropdown(options=[64, 128, 256], value=d),
        ctas=widgets.Dropdown(options=[1, 2], value=1),
        mma=widgets.FloatSlider(description="mma x", **slider),
        exp=widgets.FloatSlider(description="exp x", **slider),
        smem=widgets.FloatSlider(description="smem x", **slider),
    )
