"""Chapter 04's teaching helpers: who holds what in the mma.sync layout, the register budget of a
tile against ptxas, the causal tile map, and the readings of the stored measurements the chapter
shows. The KV step's device-code exercises are ``solutions/ch04_kv_step.py``; the tuning lab's
helpers (the sweep, the profile, the CUTLASS comparison, bank conflicts, the instruction mix) are
``labs/ch04_tuning_helpers.py``.

The kernel is ``solutions/ch04_flash_ampere.py`` and its CPU model ``solutions/ch04_cpu_model.py``;
this module only looks at them. Tile configs are read at run time, never copied; layouts and KV
tile ranges come from the kernel's own code run host-side (a ``@cute.jit`` function that launches
nothing runs on the CPU); registers and spills come from ``compile_only``; measured speed only
from ``results/``. Nothing here needs a GPU.

- who holds what: the S tile coloured by thread and warp, and P's registers as the A operand;
- exercise 04.1: registers per thread of a tile, graded against what ptxas allocates; occupancy;
- exercise 04.2: which KV tiles a causal query tile visits and which it masks, graded against
  the kernel's ``kv_tile_range`` run on the CPU; the causal tile map;
- stored results: the forward benchmark against its peers, the mma.sync microbenchmark, the
  chip's peak at each clock, and the claims the chapter's prose makes about them.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

from solutions import ch04_cpu_model as cm
from solutions import ch04_flash_ampere as fa
from utils import hardware, roofline
from utils import layout_plots as lp
from utils.claims import claim
from utils.hardware import PER_SM
from utils.notebook import source_between  # noqa: F401 (the notebook prints kernel excerpts)
from utils.results import load_stored  # noqa: F401 (the notebook's stored-results cells)

TileConfig = fa.TileConfig
ELEM_BYTES = 2  # bf16 / fp16


# ================================================================================================
# Reading the kernel
# ================================================================================================
def source(fn) -> str:
    """The dedented source of a kernel function or method (through the DSL's decorators)."""
    return textwrap.dedent(inspect.getsource(getattr(fn, "__wrapped__", fn))).rstrip()


def note(name: str, module=fa) -> str:
    """The paragraph of ``module`` from ``Note [name]`` (in a docstring or a comment) up to the
    next blank line or the end of the docstring."""
    lines = inspect.getsource(module).splitlines()
    marks = (f"Note [{name}].", f"Note [{name}]:")
    head = next((i for i, ln in enumerate(lines) if any(m in ln for m in marks)), None)
    if head is None:
        return f"(Note [{name}] not found in {module.__name__})"
    first = lines[head]
    lines[head] = first[min(first.find(m) for m in marks if m in first):]
    out = []
    for ln in lines[head:]:
        text = ln.strip().lstrip("#").strip()
        if not text or text == '"""':
            break
        out.append(text.strip('"').rstrip())
        if ln.rstrip().endswith('"""') and len(out) > 1:
            break
    return "\n".join(out)


# '128x64 t128 s1 swizzled u2': the notebook's name for a tile (ch04_flash_ampere.config_label)
config_name = fa.config_label


def _kernel(cfg: TileConfig | None, head_dim: int, causal: bool = False):
    cfg = fa.default_config(head_dim) if cfg is None else cfg
    return fa.FlashAttentionAmpere(cutlass.BFloat16, head_dim, causal, cfg)


# ================================================================================================
# 1. Who holds what
# ================================================================================================
class _AOwners:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def run(self, owner: cute.Tensor):
        """owner[row, k] = the thread whose A fragment of the P V mma.sync holds P[row, k]."""
        tiled_mma = self.kernel.make_tiled_mma()
        cP = cute.make_identity_tensor((self.kernel.m_block, self.kernel.n_block))
        for t in cutlass.range(self.kernel.num_threads):
            tPcP = tiled_mma.get_slice(t).partition_A(cP)  # (MMA, MMA_M, MMA_K) -> (row, k)
            for i in cutlass.range(cute.size(tPcP)):
                owner[tPcP[i][0], tPcP[i][1]] = t


def a_owner_map(cfg: TileConfig | None = None, head_dim: int = 128) -> np.ndarray:
    """(m_block, n_block): which thread the P V mma.sync expects to hold each P[row, k] in its A
    operand, from the kernel's TiledMma on the CPU (``partition_A`` of an identity tensor)."""
    kernel = _kernel(cfg, head_dim)
    owner = np.full((kernel.m_block, kernel.n_block), -1, dtype=np.int32)
    _AOwners(kernel).run(from_dlpack(owner))
    return owner


def _owner_image(ax, owner: np.ndarray, colour_of, labels: bool, outline=(), fontsize=6.0,
                 fill_outline: bool = False):
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    rows, cols = owner.shape
    rgb = np.array([[mcolors.to_rgb(colour_of(int(t))) for t in row] for row in owner])
    ax.imshow(rgb, interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    ax.set_aspect("equal")
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, labelsize=7)
    if labels:
        for r in range(rows):
            for c in range(cols):
                face = mcolors.to_rgb(colour_of(int(owner[r, c])))
                dark = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2] < 0.5
                ax.text(c, r, f"T{owner[r, c]}", ha="center", va="center", fontsize=fontsize,
                        color="white" if dark else "black")
    for r, c in outline:
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=fill_outline,
                                   facecolor="black", edgecolor="black", linewidth=1.4))


WARP_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
                "#c5b0d5", "#c49c94"]


def draw_s_owners(cfg: TileConfig | None = None, head_dim: int = 128, thread: int = 5,
                  axes=None):
    """Two panels from the kernel's own mma.sync layout (``ch04_cpu_model.s_owner_map``): the
    whole S tile coloured by warp, with ``thread``'s elements outlined; and the top-left 16 x 16
    corner coloured and labelled by thread. Returns the axes."""
    import matplotlib.pyplot as plt

    cfg = fa.default_config(head_dim) if cfg is None else cfg
    owner = cm.s_owner_map(cfg, head_dim)
    mine = [(r, c) for r, c in cm.thread_s_elements(thread, cfg, head_dim)]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [1, 2]})
    _owner_image(axes[0], owner // 32, lambda w: WARP_COLOURS[w % len(WARP_COLOURS)], False,
                 outline=mine, fill_outline=True)
    axes[0].set_aspect("auto")
    axes[0].set_title(f"S tile {cfg.m_block} x {cfg.n_block}, {cfg.num_warps} warps: colour = "
                      f"warp;\nblack: thread {thread}'s {len(mine)} values", fontsize=9)
    axes[0].set_xlabel("key (column of S)", fontsize=8)
    axes[0].set_ylabel("query row", fontsize=8)
    corner = owner[:16, :16]
    _owner_image(axes[1], corner, lp.thread_color, True,
                 outline=[(r, c) for r, c in mine if r < 16 and c < 16])
    axes[1].set_title("rows 0-15, keys 0-15: colour = thread", fontsize=9)
    axes[1].set_xticks(range(16))
    axes[1].set_yticks(range(16))
    return axes


def draw_p_as_a_operand(cfg: TileConfig | None = None, head_dim: int = 128, axes=None):
    """Two 16 x 16 panels: who holds S[0:16, 0:16] after S = Q K^T (the accumulators of two
    neighbouring m16n8 MMAs) and who must hold P[0:16, 0:16] as the A operand of the P V
    mma.sync (m16n8k16, k = the 16 keys). Identical pictures: no data has to move."""
    import matplotlib.pyplot as plt

    s_own = cm.s_owner_map(cfg, head_dim)[:16, :16]
    a_own = a_owner_map(cfg, head_dim)[:16, :16]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 6))
    _owner_image(axes[0], s_own, lp.thread_color, True)
    axes[0].set_title("S = Q K^T: accumulators of two m16n8 MMAs\n(keys 0-7 and 8-15)",
                      fontsize=9)
    _owner_image(axes[1], a_own, lp.thread_color, True)
    axes[1].set_title("O += P V: who must hold P as the A operand\n(m16n8k16, k = keys 0-15)",
                      fontsize=9)
    for ax in axes:
        ax.set_xticks(range(16))
        ax.set_yticks(range(16))
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query row", fontsize=8)
    return axes



# ================================================================================================
# 2. Registers and occupancy
# ================================================================================================
REGISTER_LIMIT = 255  # registers one thread may have, on every GPU since Volta
# Everything the register model does not itemise: global and shared addresses, loop counters,
# sequence bounds, the mask's limits, the softmax scale. An estimate, not a count.
BOOKKEEPING_REGISTERS = 24
# ldmatrix.x4 brings a 16 x 16 block of a B operand (K for S = QK^T, V for O += PV): 4 registers
# per thread. The kernel keeps two such blocks in flight, one used while the next loads.
B_BLOCK_REGISTERS = 4
# Per thread, registers are handed out in steps of 8 (256 per warp).
REGISTER_STEP = 8


@dataclass(frozen=True)
class SmLimits:
    registers: int  # 32-bit registers per SM
    smem_per_sm: int  # bytes of shared memory an SM can give to CTAs
    smem_per_cta: int  # the most one CTA may ask for
    smem_reserved_per_cta: int  # kept by the system for each resident CTA
    threads: int  # resident threads per SM
    ctas: int  # resident CTAs per SM


SM_LIMITS = {
    "sm_80": SmLimits(65536, 164 * 1024, 163 * 1024, 1024, 2048, 32),  # A100
    "sm_90": SmLimits(65536, 228 * 1024, 227 * 1024, 1024, 2048, 32),  # H100 / H200
}


def register_estimate(cfg: TileConfig, head_dim: int) -> dict:
    """Registers per thread the kernel needs at its two busiest moments (Note [Registers]).

    Always live: the fp32 O accumulator (m_block * D / threads) and the softmax state (a running
    max and a row sum per row the thread holds: 2 rows per 16-row MMA block). Then either
      S = Q K^T: the fp32 S accumulator (m_block * n_block / threads), the Q fragments of the
                 ``qk_unroll`` 16-wide k-slices one trip of the QK^T loop handles (a warp's
                 slice of Q with r rows is r x 16 values over 32 lanes, 2 per register: r / 4
                 registers), and two 16 x 16 blocks of K; or
      O += P V:  P in bf16 (two per register: half of acc_S) and two 16 x 16 blocks of V.
    Plus BOOKKEEPING_REGISTERS. Returns the items and the peak."""
    threads, warps = cfg.num_threads, cfg.num_warps
    rows_per_warp = cfg.m_block // warps
    acc_o = cfg.m_block * head_dim // threads
    acc_s = cfg.m_block * cfg.n_block // threads
    state = 2 * (rows_per_warp // 8)
    q_slices = cfg.qk_unroll * (rows_per_warp * 16 // 32 // 2)
    b_blocks = 2 * B_BLOCK_REGISTERS
    qk = {"acc_O": acc_o, "acc_S": acc_s, "Q slices": q_slices, "K blocks": b_blocks,
          "softmax state": state, "bookkeeping": BOOKKEEPING_REGISTERS}
    pv = {"acc_O": acc_o, "P (bf16)": acc_s // 2, "V blocks": b_blocks,
          "softmax state": state, "bookkeeping": BOOKKEEPING_REGISTERS}
    peak = max(sum(qk.values()), sum(pv.values()))
    return {"S = QK^T": qk, "O += PV": pv, "peak": peak, "fits": peak <= REGISTER_LIMIT}


def estimate_text(cfg: TileConfig, head_dim: int) -> str:
    """The register model of one tile as two sums, for messages and printing."""
    est = register_estimate(cfg, head_dim)
    parts = []
    for phase in ("S = QK^T", "O += PV"):
        items = est[phase]
        parts.append(f"{phase}: " + " + ".join(f"{k} {v}" for k, v in items.items())
                     + f" = {sum(items.values())}")
    return "; ".join(parts)


def ctas_per_sm(registers: int, threads: int, smem_bytes: int, arch: str = "sm_90") -> dict:
    """How many CTAs of a kernel fit on one SM, by each limit, and the resulting warps."""
    lim = SM_LIMITS[arch]
    regs = -(-max(registers, 1) // REGISTER_STEP) * REGISTER_STEP
    by = {
        "registers": lim.registers // (regs * threads),
        "shared memory": lim.smem_per_sm // (smem_bytes + lim.smem_reserved_per_cta)
        if smem_bytes <= lim.smem_per_cta else 0,
        "threads": lim.threads // threads,
        "CTA slots": lim.ctas,
    }
    ctas = min(by.values())
    return {"by": by, "ctas": ctas, "warps": ctas * threads // 32,
            "limited by": min(by, key=by.get)}


@functools.cache
def compiled(arch: str, head_dim: int, cfg: TileConfig, causal: bool = False):
    """``ch04_flash_ampere.compile_only``, remembered: each compile takes seconds."""
    return fa.compile_only(arch, head_dim, causal=causal, config=cfg)


def resources(arch: str, head_dim: int, cfg: TileConfig, causal: bool = False) -> dict:
    """Registers per thread, stack frame bytes and spill instructions (LDL/STL) of one tile."""
    art = compiled(arch, head_dim, cfg, causal)
    return {"registers": art.registers, "stack_bytes": art.frame_bytes,
            "spill_instructions": art.spills}



# --- Exercise 04.1: registers of a tile, graded against ptxas ------------------------------------
def registers_needed(cfg: TileConfig, head_dim: int) -> tuple[int, bool]:
    """Exercise 04.1's reference: the register model's peak and whether it fits in 255."""
    est = register_estimate(cfg, head_dim)
    return est["peak"], est["fits"]


def _swizzled(m, n, threads, unroll):
    return TileConfig(m, n, threads, smem_layout="swizzled", qk_unroll=unroll)


# Tiles ptxas fits well below the limit, one it fits at the limit (the default at D = 128) and
# one it cannot fit; compiled for sm_80, the kernel's portable target.
REGISTER_TILES = [
    (_swizzled(64, 32, 128, 1), 64),
    (_swizzled(64, 64, 128, 2), 64),
    (_swizzled(64, 64, 128, 1), 128),
    (_swizzled(128, 128, 256, 2), 128),
    (fa.DEFAULT_CONFIGS[128], 128),
    (_swizzled(128, 128, 128, 2), 128),
]
REGISTER_ARCH = "sm_80"
# An estimate of what must be live may undercount what ptxas takes (it spends free registers on
# loading ahead), but not by this much: below this share of ptxas's count something large is left
# out. Above ptxas's count (plus one allocation step) the estimate counts something ptxas did
# without.
LOWER_SHARE = 0.6


def tile_name(cfg: TileConfig, head_dim: int) -> str:
    return (f"{cfg.m_block} x {cfg.n_block} with {cfg.num_warps} warps, {cfg.qk_unroll} k-slice"
            f"{'s' if cfg.qk_unroll > 1 else ''} per QK^T trip, D = {head_dim}")


def ptxas_rows(tiles=None) -> list[dict]:
    """What ptxas made of each tile of REGISTER_TILES (compiled for REGISTER_ARCH, remembered):
    registers per thread, stack frame bytes, spill instructions."""
    out = []
    for cfg, d in REGISTER_TILES if tiles is None else tiles:
        out.append({"config": cfg, "head_dim": d, **resources(REGISTER_ARCH, d, cfg)})
    return out


def check_registers_needed(fn) -> None:
    """Exercise 04.1: ``fn(cfg, head_dim) -> (registers, fits)`` against ptxas on REGISTER_TILES:
    a tile ptxas spilled must not fit; on a tile it fitted in R registers, the estimate must lie
    between LOWER_SHARE * R and R + one allocation step, and say it fits."""
    for cfg, d in REGISTER_TILES:
        got = fn(cfg, d)  # before compiling: an answer that is not done says so at once
        row = ptxas_rows([(cfg, d)])[0]
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"return a pair (registers, fits), got {got!r}")
        regs, fits = got
        if not isinstance(regs, (int, float, np.integer, np.floating)) or regs <= 0:
            raise AssertionError(f"registers must be a positive number, got {regs!r}")
        if bool(fits) != (regs <= REGISTER_LIMIT):
            raise AssertionError(f"{tile_name(cfg, d)}: you estimate {regs} registers, so fits "
                                 f"must be {regs <= REGISTER_LIMIT} (the limit is "
                                 f"{REGISTER_LIMIT} per thread); got {fits!r}")
        acc = cfg.accumulator_registers(d)
        if row["stack_bytes"] > 0:
            if fits:
                raise AssertionError(
                    f"{tile_name(cfg, d)}: ptxas could not fit it: it spilled "
                    f"{row['spill_instructions']} instructions into a {row['stack_bytes']}-byte "
                    f"stack frame, and your estimate of {regs} says it fits. The accumulators "
                    f"alone, acc_O = m_block * D / threads = {acc['acc_O']} and acc_S = "
                    f"m_block * n_block / threads = {acc['acc_S']}, are live through the whole "
                    "step")
            continue
        ptxas = row["registers"]
        if regs > ptxas + REGISTER_STEP:
            raise AssertionError(
                f"{tile_name(cfg, d)}: ptxas fitted it in {ptxas} registers with no spill, and "
                f"your estimate is {regs}: you count something that is not live at the same "
                "time as the rest. S in fp32 is gone once P exists (P takes half the registers, "
                "two bf16 per register), and V's fragments arrive only after the softmax")
        if regs < LOWER_SHARE * ptxas:
            raise AssertionError(
                f"{tile_name(cfg, d)}: ptxas takes {ptxas} registers and your estimate is "
                f"{regs}, less than {LOWER_SHARE:.0%} of that: something large is missing. "
                f"Start from the accumulators (acc_O {acc['acc_O']} + acc_S {acc['acc_S']}), "
                "then the operand fragments in flight, a max and a sum per row the thread "
                "holds, and a few dozen addresses and counters")


def register_lines(fn) -> list[str]:
    """Per tile of REGISTER_TILES: ``fn``'s estimate beside what ptxas allocated."""
    lines = [f"{'tile':58s} {'yours':>5s} {'ptxas':>5s} {'stack B':>7s} {'spills':>6s}"]
    for row in ptxas_rows():
        regs, fits = fn(row["config"], row["head_dim"])
        lines.append(f"{tile_name(row['config'], row['head_dim']):58s} {regs:5.0f} "
                     f"{row['registers']:5d} {row['stack_bytes']:7d} "
                     f"{row['spill_instructions']:6d}")
    return lines


REGISTERS_FORBID = {
    register_estimate: "that is the chapter's own model; write yours",
    fa.compile_only: "the check compiles the tiles; your function estimates from their sizes",
    ptxas_rows: "the check compiles the tiles; your function estimates from their sizes",
}


# ================================================================================================
# 3. Causal block skipping: the kernel's kv_tile_range on the CPU
# ================================================================================================
@cute.jit
def _tile_ranges(out: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, tile_m: cutlass.Constexpr,
                 tile_n: cutlass.Constexpr, causal: cutlass.Constexpr):
    for m in cutlass.range(cute.ceil_div(seqlen_q, tile_m)):
        n_block_max, n_block_masked_min = fa.kv_tile_range(m, seqlen_q, seqlen_k, tile_m,
                                                           tile_n, causal)
        out[m, 0] = n_block_max
        out[m, 1] = n_block_masked_min


def kv_tile_ranges(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool):
    """(query tiles, 2) int array: the kernel's (n_block_max, n_block_masked_min) per query
    tile, computed by ``kv_tile_range`` itself on the CPU."""
    n_q = -(-seqlen_q // tile_m)
    out = np.zeros((n_q, 2), dtype=np.int32)
    _tile_ranges(from_dlpack(out), Int32(seqlen_q), Int32(seqlen_k), tile_m, tile_n,
                 bool(causal))
    return out


SKIPPED, FULL, MASKED = 0, 1, 2
TILE_KINDS = {SKIPPED: "skipped (never loaded)", FULL: "visited, no mask",
              MASKED: "visited, masked"}
TILE_COLOURS = {SKIPPED: "#eeeeee", FULL: "#2ca02c", MASKED: "#ff7f0e"}


def tile_map(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool):
    """(query tiles, KV tiles) array of SKIPPED / FULL / MASKED, as the kernel does it: it visits
    KV tiles n_block_max - 1 down to 0 (tile 0, fully masked, when no row sees a key), masks the
    first one it visits (the only one that can stick out past seqlen_k) and, causal, every tile
    at or above n_block_masked_min."""
    ranges = kv_tile_ranges(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    kinds = np.full((len(ranges), -(-seqlen_k // tile_n)), SKIPPED, dtype=np.int32)
    for m, (n_max, n_masked) in enumerate(ranges):
        first = max(n_max - 1, 0)
        kinds[m, :first + 1] = FULL
        kinds[m, first] = MASKED
        if causal:
            kinds[m, max(n_masked, 0):first + 1] = MASKED
    return kinds


def tile_counts(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool) -> dict:
    kinds = tile_map(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    return {name: int((kinds == k).sum()) for k, name in TILE_KINDS.items()} | {
        "total": int(kinds.size)}


def visible(seqlen_q: int, seqlen_k: int, causal: bool, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) bool: query i sees key j (bottom-right causal; j < seqlen_k, i < seqlen_q)."""
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    seen = (i < seqlen_q) & (j < seqlen_k)
    if causal:
        seen &= j <= i + seqlen_k - seqlen_q
    return seen


def draw_tile_map(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, causal: bool,
                  ax=None):
    """The (query, key) plane cut into the kernel's tiles: each tile coloured by what the kernel
    does with it, the keys each query sees drawn darker, the order of the visits written in the
    visited tiles (the kernel walks from the last tile down to 0)."""
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    kinds = tile_map(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    n_q, n_k = kinds.shape
    rows, cols = n_q * tile_m, n_k * tile_n
    seen = visible(seqlen_q, seqlen_k, causal, rows, cols)
    tile_rgb = {k: np.array(mcolors.to_rgb(c)) for k, c in TILE_COLOURS.items()}
    img = np.ones((rows, cols, 3))
    for m in range(n_q):
        for n in range(n_k):
            block = (slice(m * tile_m, (m + 1) * tile_m), slice(n * tile_n, (n + 1) * tile_n))
            base = tile_rgb[int(kinds[m, n])]
            img[block] = 0.55 * base + 0.45  # light: the tile
            img[block][seen[block]] = base * 0.85  # dark: keys that queries see
    if ax is None:
        _, ax = plt.subplots(figsize=(min(12, 3 + 9 * cols / max(rows, cols)),
                                      min(7, 1.5 + 6 * rows / max(rows, cols))))
    ax.imshow(img, interpolation="nearest", aspect="auto", extent=(0, cols, rows, 0))
    ax.grid(False)
    for n in range(n_k + 1):
        ax.axvline(n * tile_n, color="white", linewidth=0.8)
    for m in range(n_q + 1):
        ax.axhline(m * tile_m, color="white", linewidth=0.8)
    ax.axhline(seqlen_q, color="black", linestyle=":", linewidth=1)
    ax.axvline(seqlen_k, color="black", linestyle=":", linewidth=1)
    for m in range(n_q):
        visited = [n for n in range(n_k) if kinds[m, n] != SKIPPED]
        for step, n in enumerate(sorted(visited, reverse=True)):
            ax.text((n + 0.5) * tile_n, (m + 0.5) * tile_m, str(step + 1), ha="center",
                    va="center", fontsize=7)
    ax.set_xlabel(f"key (seqlen_k = {seqlen_k}, dotted), tiles of {tile_n}")
    ax.set_ylabel(f"query (seqlen_q = {seqlen_q}, dotted), tiles of {tile_m}")
    counts = tile_counts(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    ax.set_title(f"{'causal' if causal else 'non-causal'}: {counts[TILE_KINDS[FULL]]} full, "
                 f"{counts[TILE_KINDS[MASKED]]} masked, {counts[TILE_KINDS[SKIPPED]]} skipped "
                 "(numbers: visit order)", fontsize=9)
    ax.legend(handles=[Patch(color=TILE_COLOURS[k], label=v) for k, v in TILE_KINDS.items()],
              fontsize=7, loc="lower left", framealpha=0.9)
    return ax




# --- Exercise 04.2: which KV tiles a causal CTA visits, and which it masks -----------------------
def kv_tiles(m_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
             causal: bool) -> tuple[list[int], list[int]]:
    """Exercise 04.2's reference: (visited, masked) KV tile indices of query tile ``m_block``,
    sorted. Rows are those of the whole tile, even past seqlen_q (the kernel computes them and
    never stores them); bottom-right causal: row i sees keys j <= i + seqlen_k - seqlen_q."""
    n_tiles = -(-seqlen_k // tile_n)
    if causal:
        offset = seqlen_k - seqlen_q
        last_row_end = max((m_block + 1) * tile_m + offset, 0)  # one past the last row's keys
        n_visit = min(n_tiles, -(-last_row_end // tile_n))
        first_row_end = max(m_block * tile_m + offset + 1, 0)  # one past the first row's keys
        first_masked = min(first_row_end // tile_n, n_visit - 1)
    else:
        n_visit, first_masked = n_tiles, n_tiles - 1
    if n_visit == 0:  # no row sees a key: one fully masked step on tile 0 gives O = 0, lse = -inf
        return [0], [0]
    return list(range(n_visit)), list(range(first_masked, n_visit))


KV_TILE_CASES = [
    # (seqlen_q, seqlen_k, tile_m, tile_n, causal)
    (300, 420, 128, 32, True),  # seqlen_q < seqlen_k: the diagonal moves right
    (300, 77, 128, 32, True),  # seqlen_q > seqlen_k: the first rows see no key
    (256, 256, 128, 64, True),
    (257, 256, 128, 32, True),
    (1000, 1000, 64, 128, True),
    (1, 131, 128, 64, True),
    (4097, 1000, 128, 64, True),
    (300, 420, 128, 32, False),
    (150, 67, 128, 64, False),
    (256, 256, 128, 64, False),
]


def _kernel_kv_tiles(seqlen_q, seqlen_k, tile_m, tile_n, causal):
    """Per query tile: (visited, masked, whether any row sees a key), from the kernel's code."""
    kinds = tile_map(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    ranges = kv_tile_ranges(seqlen_q, seqlen_k, tile_m, tile_n, causal)
    return [([int(n) for n in np.flatnonzero(row != SKIPPED)],
             [int(n) for n in np.flatnonzero(row == MASKED)], bool(n_max > 0))
            for row, (n_max, _) in zip(kinds, ranges)]


def check_kv_tiles(fn) -> None:
    """Exercise 04.2: ``fn(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal) -> (visited,
    masked)`` against the kernel's own ``kv_tile_range`` (run on the CPU) for every query tile of
    awkward shapes, causal and not."""
    for sq, sk, tm, tn, causal in KV_TILE_CASES:
        for m, (visited, masked, any_key) in enumerate(_kernel_kv_tiles(sq, sk, tm, tn, causal)):
            got = fn(m, sq, sk, tm, tn, causal)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"return a pair (visited, masked) of lists, got {got!r}")
            got_v, got_m = sorted(int(x) for x in got[0]), sorted(int(x) for x in got[1])
            if (got_v, got_m) == (visited, masked):
                continue
            where = (f"query tile {m} (rows {m * tm} .. {(m + 1) * tm - 1}) of seqlen_q={sq}, "
                     f"seqlen_k={sk}, tiles {tm} x {tn}, {'causal' if causal else 'non-causal'}")
            head = (f"{where}: the kernel visits {visited} and masks {masked}; you said "
                    f"visited {got_v}, masked {got_m}.")
            if not any_key:
                raise AssertionError(f"{head} No row of this tile sees a key; the kernel still "
                                     "runs one fully masked step on tile 0, so that O = 0 and "
                                     "lse = -inf come out of the same code.")
            if got_v != visited:
                raise AssertionError(
                    f"{head} Visit tile n when some row of the tile sees some key in it: the "
                    "last row sees the most keys (up to (m_block + 1) * tile_m - 1 + seqlen_k - "
                    "seqlen_q, and below seqlen_k).")
            raise AssertionError(
                f"{head} A tile needs the mask when the tile's FIRST row (the one that sees the "
                "fewest keys) does not see all of its keys, or it reaches past seqlen_k; the "
                "kernel also always masks the first tile it visits (the highest).")


# ================================================================================================
# 4. What mma.sync can reach on Hopper, and the stored results
# ================================================================================================
# Hopper runs the warp-synchronous mma.sync at a fraction of the rate its tensor cores reach
# with wgmma. Measured on the H200 (results/h200/microbench.json, solutions.microbench.
# MmaSyncThroughput: independent m16n8k16 from registers): 2702 FLOP/clk/SM of wgmma's 4096.
# tests/test_ch04_teaching.py checks this constant against the stored figure.
MMA_SYNC_SHARE = 0.66
# NVIDIA's datasheet figure for dense bf16 on the H100 and H200 SXM, in TFLOP/s.
DATASHEET_DENSE_BF16_TFLOPS = hardware.DATASHEET_DENSE_BF16_TFLOPS["sm_90"]


def expected_tflops(head_dim: int = 128, n_block: int | None = None) -> dict:
    """Chapter 00's tile model (utils.roofline) with mma.sync at MMA_SYNC_SHARE of the tensor
    cores' rate: the ceiling when the softmax hides under other warps' MMAs, and the figure
    when nothing overlaps. TFLOP/s on an H100/H200."""
    cfg = fa.default_config(head_dim)
    n = cfg.n_block if n_block is None else n_block
    tile = roofline.tile_cycles("H100", "fwd", m=cfg.m_block, n=n, d=head_dim)
    flops = 4 * cfg.m_block * n * head_dim
    peak = PER_SM["sm_90"].chip_peak(1) / 1e12
    mma = tile.mma / MMA_SYNC_SHARE
    return {"tile": tile, "overlapped": flops / max(mma, tile.exp) * peak,
            "serial": flops / (mma + tile.exp) * peak,
            "peak": flops / tile.mma * peak}


# ================================================================================================
# Stored results
# ================================================================================================
def tflops_groups(res, pass_: str = "fwd"):
    """(group labels, {impl: TFLOP/s per group}) for utils.plots.grouped_bars: one group per
    (D, S, causal), every implementation side by side (None where it has no figure)."""
    rows = [r for r in res.rows if r.get("pass") == pass_]
    keys = sorted({(r["d"], r["s"], r["causal"]) for r in rows},
                  key=lambda k: (-k[0], k[2], k[1]))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    series = {impl: [next((r["tflops"] for r in rows if r["impl"] == impl
                           and (r["d"], r["s"], r["causal"]) == key), None) for key in keys]
              for impl in impls}
    labels = [f"D={d} S={s}\n{'causal' if c else 'non-causal'}" for d, s, c in keys]
    return labels, series


def plot_fwd(res, title: str = "Forward, bf16, 16 heads, batch x seqlen = 16384", ax=None):
    import matplotlib.pyplot as plt

    from utils import plots

    groups, series = tflops_groups(res)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 4.5))
    plots.grouped_bars(groups, series, title=title, ylabel="TFLOP/s", ax=ax,
                       provenance=res.label)
    ax.tick_params(axis="x", labelsize=8)
    return ax


STANDING = {"d": 128, "s": 16384, "causal": False}  # the chapter's headline shape


def standing_lines(res, impl: str = "flash_ampere", baseline: str = "sdpa_flash") -> list[str]:
    """``impl`` against ``baseline`` for every (D, S, causal) that a run timed both at (a
    Results or its rows): TFLOP/s and the ratio, from the same run only."""
    rows = [r for r in getattr(res, "rows", res) if r.get("pass", "fwd") == "fwd"]
    shapes = sorted({(r["d"], r["s"], r["causal"]) for r in rows if r.get("impl") == impl},
                    key=lambda k: (-k[0], -k[1], k[2]))
    lines = []
    for d, s_, causal in shapes:
        pick = {who: next((r for r in rows if r.get("impl") == who and r["d"] == d
                           and r["s"] == s_ and r["causal"] == causal and r.get("tflops")), None)
                for who in (impl, baseline)}
        if None in pick.values():
            continue
        ours, base = pick[impl]["tflops"], pick[baseline]["tflops"]
        lines.append(f"D={d:3d} S={s_:5d} {'causal    ' if causal else 'non-causal'}: {impl} "
                     f"{ours:4.0f} TFLOP/s, {baseline} {base:4.0f}: {ours / base:.2f}x")
    if not lines:
        return [f"{getattr(res, 'name', 'this run')} has no shape where both {impl} and "
                f"{baseline} were timed"]
    ahead = sum(float(ln.rsplit(": ", 1)[1].rstrip("x")) > 1 for ln in lines)
    lines.append(f"{impl} runs ahead of {baseline} at {ahead} of the {len(lines)} shapes")
    return lines


def mma_sync_rate_lines(micro) -> list[str]:
    """The stored mma.sync microbenchmark against wgmma's rate (chapter 00's 4096 FLOP/clk/SM),
    and MMA_SYNC_SHARE, the rounded share the models of this chapter use."""
    per_clk = micro.one(metric="mma_sync_flop_per_clk_sm")["value"]
    wgmma = PER_SM["sm_90"].mma_flops_per_clk
    return [f"mma.sync measured: {per_clk:.0f} FLOP/clk/SM, wgmma's rate {wgmma}: mma.sync runs "
            f"at {per_clk / wgmma:.2f} of it, wgmma {wgmma / per_clk:.2f}x as fast "
            f"({micro.label})",
            f"t4.MMA_SYNC_SHARE = {MMA_SYNC_SHARE:g} (the models below use it)"]


def _median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


LEVEL = 0.03  # two kernels within 3% of each other in one run are "level" (peer_lines)



def peak_lines() -> list[str]:
    """The H100/H200's dense bf16 peak, and which clock each figure assumes: the course's model
    (utils.hardware: 4096 FLOP/clk/SM at the 1.98 GHz maximum boost clock) and NVIDIA's
    datasheet figure, which is the same product at a lower clock."""
    h = PER_SM["sm_90"]
    model = h.chip_peak(h.mma_flops_per_clk) / 1e12
    datasheet_ghz = DATASHEET_DENSE_BF16_TFLOPS * 1e12 / (h.mma_flops_per_clk * h.sms) / 1e9
    return [f"model: {h.mma_flops_per_clk} FLOP/clk/SM x {h.sms} SMs x {h.boost_clock_ghz} GHz "
            f"(the maximum boost clock) = {model:.0f} TFLOP/s",
            f"datasheet: {DATASHEET_DENSE_BF16_TFLOPS} TFLOP/s dense bf16 (H100/H200 SXM) = "
            f"{h.mma_flops_per_clk} x {h.sms} x {datasheet_ghz:.2f} GHz"]


def mma_instructions(cfg: TileConfig | None = None, head_dim: int = 128) -> dict:
    """MMA instructions one KV step of one CTA issues, for the same tile: mma.sync m16n8k16 (a
    warp's 16 x 8 x 16 product) against wgmma m64nNk16 (a warpgroup's 64 x N x 16), with N = the
    KV tile for S = Q K^T and N = D for O += P V. Plain arithmetic on the tile's sizes."""
    c = fa.default_config(head_dim) if cfg is None else cfg
    flops = 4 * c.m_block * c.n_block * head_dim
    mma_sync = flops // (2 * 16 * 8 * 16)
    wgmma = (c.m_block // 64) * (head_dim // 16 + c.n_block // 16)
    return {"tile": f"{c.m_block} x {c.n_block}, D = {head_dim}", "mma.sync": mma_sync,
            "wgmma": wgmma, "ratio": mma_sync / wgmma}


def at_standing(res, impl: str) -> dict | None:
    """``impl``'s row of a forward run at the chapter's headline shape (STANDING)."""
    rows = res.where(**{"impl": impl, "pass": "fwd", **STANDING})
    return rows[0] if rows else None


row_config = fa.config_from_row  # the TileConfig a sweep row was measured with


def ceiling_lines(micro, sweep, head_dim: int = 128) -> list[str]:
    """How far the kernel is from mma.sync's own ceiling (microbench) and what the softmax costs
    (the sweep's SoftmaxLeftOut rows), at ``head_dim``, non-causal, for each ablated tile."""
    peak = micro.one(metric="mma_sync_tflops")["value"]
    per_clk = micro.one(metric="mma_sync_flop_per_clk_sm")["value"]
    hopper = PER_SM["sm_90"]
    lines = [f"mma.sync ceiling (independent m16n8k16 from registers, every SM busy): "
             f"{peak:.0f} TFLOP/s, {per_clk:.0f} FLOP/clk/SM = "
             f"{per_clk / hopper.mma_flops_per_clk:.2f} of the wgmma rate"]
    rows = [r for r in sweep.rows if r["d"] == head_dim and not r["causal"]]
    for ab in (r for r in rows if r.get("impl") == fa.ABLATION_IMPL):
        full = next(r for r in rows if r.get("impl") != fa.ABLATION_IMPL
                    and row_config(r) == row_config(ab))
        lines.append(
            f"{config_name(row_config(ab))}: {full['tflops']:.0f} TFLOP/s = "
            f"{full['tflops'] / peak:.0%} of the ceiling; without its softmax "
            f"{ab['tflops']:.0f} = {ab['tflops'] / peak:.0%}, so the softmax costs "
            f"{1 - full['tflops'] / ab['tflops']:.0%} of the time")
    return lines



# ================================================================================================
# Claims the chapter's prose makes (tests/test_claims.py checks each on its file)
# ================================================================================================

def _fwd_shapes(res):
    return sorted({(r["d"], r["s"], r["causal"]) for r in res.rows
                   if r.get("impl") == "flash_ampere" and r.get("tflops")})


def _pick(res, impl, shape):
    d, s, causal = shape
    rows = res.where(impl=impl, d=d, s=s, causal=causal)
    return rows[0] if rows and rows[0].get("tflops") else None


@claim("04.ahead_of_fa2", "ch04_fwd",
       "flash_ampere runs ahead of SDPA's flash backend (FlashAttention-2) at every shape of the "
       "run, by more than either row's spread")
def _ahead_of_fa2(res):
    from utils.bench import compare

    worst = None
    for shape in _fwd_shapes(res):
        ours, fa2 = _pick(res, "flash_ampere", shape), _pick(res, "sdpa_flash", shape)
        if fa2 is None:
            return False, f"no sdpa_flash row at {shape}"
        c = compare(ours, fa2)
        if c is None or c.ratio <= 1 + c.noise:
            return False, f"at {shape}: ratio {c and c.ratio:.3f}, noise {c and c.noise:.3f}"
        worst = c.ratio if worst is None else min(worst, c.ratio)
    return worst is not None, f"smallest ratio over SDPA flash {worst:.3f}"


@claim("04.hopper_kernels_far_ahead", "ch04_fwd",
       "cuDNN and the FA4 package (TMA + wgmma kernels) each run at least 1.3 times as fast as "
       "flash_ampere at every shape of the run")
def _hopper_kernels_far_ahead(res):
    ratios = []
    for shape in _fwd_shapes(res):
        ours = _pick(res, "flash_ampere", shape)
        for peer in ("sdpa_cudnn", "fa4_package"):
            row = _pick(res, peer, shape)
            if row is None:
                return False, f"no {peer} row at {shape}"
            ratios.append(row["tflops"] / ours["tflops"])
    return bool(ratios) and min(ratios) >= 1.3, f"ratios {min(ratios):.2f} to {max(ratios):.2f}"


@claim("04.mma_sync_below_wgmma", "microbench",
       "on the H200 mma.sync reaches well under wgmma's tensor-core rate: below 0.8 of its "
       "4096 FLOP per clock per SM")
def _mma_sync_below_wgmma(res):
    per_clk = res.one(metric="mma_sync_flop_per_clk_sm")["value"]
    share = per_clk / PER_SM["sm_90"].mma_flops_per_clk
    return share < 0.8, f"mma.sync {per_clk:.0f} FLOP/clk/SM = {share:.2f} of wgmma's rate"


KV_TILES_FORBID = {
    fa.kv_tile_range: "that is the kernel's answer, which the check compares with; work it out "
                      "from the rule",
    fa.tiles.kv_tile_range: "that is the kernel's arithmetic (fa4_final.common.tiles); work it "
                            "out from the rule",
    kv_tile_ranges: "that runs the kernel's kv_tile_range; work it out from the rule",
    tile_map: "that runs the kernel's kv_tile_range; work it out from the rule",
}
