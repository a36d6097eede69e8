"""Chapter 04's teaching helpers: pictures, the register and occupancy arithmetic, the causal tile
map, the instruction mix of the compiled loop, and the exercises' references and checkers.

The kernel is ``solutions/ch04_flash_ampere.py`` and its CPU model ``solutions/ch04_cpu_model.py``;
this module only looks at them. Tile configs (``DEFAULT_CONFIGS``, ``SWEEP_CONFIGS``) are read at
run time, never copied; layouts and KV tile ranges come from the kernel's own code run host-side
(a ``@cute.jit`` function that launches nothing runs on the CPU); registers and spills come from
``compile_only``; measured speed only from ``results/``. Nothing here needs a GPU.

- who holds what: the S tile coloured by thread and warp, and P's registers as the A operand;
- the register model (``register_estimate``) and occupancy (``ctas_per_sm``), next to what ptxas
  made of each tile (``resources``, cached: a compile takes seconds);
- bank conflicts of one ldmatrix read in the kernel's padded and swizzled shared memory;
- the causal tile map from the kernel's ``kv_tile_range``;
- the instruction mix of one KV step in the SASS, and the Hopper ceilings it implies;
- stored results: the forward benchmark, the target verdict, the tile sweep;
- exercises 04.1 (registers of a tile), 04.2 (which thread holds S[r, c]), 04.3 (which KV tiles
  a causal CTA visits and masks).
"""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
from collections import Counter
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

from solutions import ch04_cpu_model as cm
from solutions import ch04_flash_ampere as fa
from utils import layout_plots as lp
from utils import roofline
from utils.hardware import PER_SM
from utils.notebook import source_between
from utils.results import load_stored  # noqa: F401 (the notebook's stored-results cells)

TileConfig = fa.TileConfig
ELEM_BYTES = 2  # bf16 / fp16


# ================================================================================================
# Reading the kernel and the stored results
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


def resource_rows(configs, head_dim: int = 128, arch: str = "sm_90a", causal: bool = False):
    """Per tile: the model, what ptxas made of it, and CTAs per SM on that arch."""
    sm = "sm_90" if arch.startswith("sm_90") else "sm_80"
    rows = []
    for cfg in configs:
        est = register_estimate(cfg, head_dim)
        res = resources(arch, head_dim, cfg, causal)
        occ = ctas_per_sm(res["registers"], cfg.num_threads, cfg.smem_bytes(head_dim), sm)
        rows.append({"config": cfg, "acc_O": est["S = QK^T"]["acc_O"],
                     "acc_S": est["S = QK^T"]["acc_S"], "model": est["peak"],
                     "model_fits": est["fits"], **res, "smem_bytes": cfg.smem_bytes(head_dim),
                     "ctas": occ["ctas"], "warps": occ["warps"], "limit": occ["limited by"],
                     "ctas_by_registers": occ["by"]["registers"],
                     "ctas_by_smem": occ["by"]["shared memory"]})
    return rows


def format_resource_rows(rows, head_dim: int = 128) -> str:
    default = fa.default_config(head_dim)
    lines = [f"{'tile':28s} {'acc_O':>5s} {'acc_S':>5s} {'model':>5s} {'regs':>4s} "
             f"{'stack':>5s} {'spills':>6s} {'smem KB':>7s} {'CTAs/SM (regs, smem)':>21s}  "
             "model agrees?"]
    for r in rows:
        spilled = r["spill_instructions"] > 0 or r["stack_bytes"] > 0
        agrees = "yes" if r["model_fits"] != spilled else "NO"
        name = config_name(r["config"]) + (" *" if r["config"] == default else "")
        lines.append(
            f"{name:28s} {r['acc_O']:5d} {r['acc_S']:5d} {r['model']:5d} {r['registers']:4d} "
            f"{r['stack_bytes']:5d} {r['spill_instructions']:6d} {r['smem_bytes'] / 1024:7.1f} "
            f"{r['ctas']:>6d} ({r['ctas_by_registers']}, {r['ctas_by_smem']}){'':9s}  {agrees}")
    return "\n".join(lines)


def draw_register_budget(rows, head_dim: int = 128, ax=None):
    """Stacked bars: the register model's items at each tile's busiest moment, the 255 limit,
    and what ptxas allocated (its stack frame, where spills go, on top in red)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.5))
    colours = {"acc_O": "#1f77b4", "acc_S": "#ff7f0e", "P (bf16)": "#ffbb78",
               "Q slices": "#2ca02c", "K blocks": "#98df8a", "V blocks": "#98df8a",
               "softmax state": "#9467bd", "bookkeeping": "#c7c7c7"}
    seen = set()
    for x, r in enumerate(rows):
        est = register_estimate(r["config"], head_dim)
        phase = max(("S = QK^T", "O += PV"), key=lambda p: sum(est[p].values()))
        bottom = 0
        for item, n in est[phase].items():
            ax.bar(x, n, bottom=bottom, color=colours[item], width=0.6,
                   label=item if item not in seen else None)
            seen.add(item)
            bottom += n
        ax.plot([x - 0.35, x + 0.35], [r["registers"]] * 2, color="black", linewidth=2.5,
                label="ptxas: registers" if x == 0 else None)
        if r["stack_bytes"]:
            ax.annotate(f"spills:\n{r['stack_bytes']} B", (x, max(bottom, r["registers"])),
                        xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7,
                        color="#d62728")
    ax.axhline(REGISTER_LIMIT, color="#d62728", linestyle="--", linewidth=1)
    ax.text(-0.45, REGISTER_LIMIT + 4, "255 per thread", color="#d62728", ha="left",
            fontsize=8)
    ax.set_xticks(range(len(rows)), [config_name(r["config"]).replace(" ", "\n", 2)
                                     for r in rows], fontsize=7)
    ax.set_ylabel("registers per thread")
    ax.set_title(f"Register model at each tile's busiest moment (D={head_dim}) vs ptxas")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


# ================================================================================================
# 3. Bank conflicts in the kernel's shared memory
# ================================================================================================
class _SmemProbe:
    def __init__(self, kernel, rows: int):
        self.kernel = kernel
        self.rows = rows

    @cute.jit
    def run(self, out: cute.Tensor):
        layout = self.kernel.smem_layout(self.rows)  # the kernel's own (rows, D) layout
        for r in cutlass.range(self.rows):
            for c in cutlass.range(self.kernel.head_dim):
                out[r, c] = layout((r, c))


def smem_offsets(smem_layout: str, head_dim: int = 128, rows: int = 16) -> np.ndarray:
    """(rows, head_dim) element offsets of the kernel's shared-memory tile: "padded" and
    "swizzled" evaluated from ``FlashAttentionAmpere.smem_layout`` on the CPU; "row-major" is the
    plain layout with neither (rows head_dim elements apart), for comparison."""
    if smem_layout == "row-major":
        return np.arange(rows)[:, None] * head_dim + np.arange(head_dim)[None, :]
    kernel = _kernel(TileConfig(smem_layout=smem_layout), head_dim)
    out = np.zeros((rows, head_dim), dtype=np.int32)
    _SmemProbe(kernel, rows).run(from_dlpack(out))
    return out


def ldmatrix_addresses(smem_layout: str, head_dim: int = 128, chunk: int = 0, row0: int = 0):
    """Byte addresses of one 8 x 8 matrix of an ldmatrix: 16 bytes (8 values) at 16-byte chunk
    ``chunk`` of rows row0 .. row0 + 7, one address per thread."""
    off = smem_offsets(smem_layout, head_dim, rows=row0 + 8)
    return [int(off[row0 + r, 8 * chunk]) * ELEM_BYTES for r in range(8)]


def cp_async_addresses(smem_layout: str, head_dim: int = 128, row: int = 0, half: int = 0):
    """Byte addresses of one 128-byte phase of the cp.async writes: 8 threads x 16 bytes covering
    64 values of one row (the kernel's copy layout: 8 threads per 128-byte row chunk)."""
    off = smem_offsets(smem_layout, head_dim, rows=row + 1)
    return [int(off[row, 64 * half + 8 * t]) * ELEM_BYTES for t in range(8)]


def bank_summary(head_dim: int = 128) -> list[dict]:
    """Per layout: shared memory per row of the tile, and the worst ldmatrix read and cp.async
    write phase over the first 16 rows, in cycles (ideal: 1)."""
    out = []
    for name in ("row-major", "padded", "swizzled"):
        ld = max(lp.bank_wavefronts(ldmatrix_addresses(name, head_dim, chunk, row0), 16).wavefronts
                 for chunk in range(head_dim // 8) for row0 in (0, 8))
        cp = max(lp.bank_wavefronts(cp_async_addresses(name, head_dim, row, half), 16).wavefronts
                 for row in range(16) for half in range(head_dim // 64))
        per_row = head_dim if name == "row-major" else TileConfig(smem_layout=name).smem_row(
            head_dim)
        out.append({"layout": name, "bytes_per_row": per_row * ELEM_BYTES,
                    "ldmatrix_cycles": ld, "cp_async_cycles": cp})
    return out


# ================================================================================================
# 4. Causal block skipping: the kernel's kv_tile_range on the CPU
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


# ================================================================================================
# 5. Why it cannot reach Hopper speed: the instruction mix of one KV step
# ================================================================================================
# Hopper runs the warp-synchronous mma.sync at a fraction of the rate its tensor cores reach
# with wgmma. Measured on the H200 (results/h200/microbench.json, solutions.microbench.
# MmaSyncThroughput: independent m16n8k16 from registers): 2702 FLOP/clk/SM of wgmma's 4096.
# tests/test_ch04_teaching.py checks this constant against the stored figure.
MMA_SYNC_SHARE = 0.66
SCHEDULERS_PER_SM = 4  # one warp instruction issued per clock by each
INSTRUCTION_CLASSES = {
    "mma.sync (HMMA)": ("HMMA",),
    "ldmatrix (LDSM)": ("LDSM",),
    "cp.async + waits (LDGSTS, LDGDEPBAR, DEPBAR)": ("LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "exp2 (MUFU)": ("MUFU",),
    "fp32 softmax math (FMUL, FFMA, FADD, FMNMX, FSEL, FSETP)":
        ("FMUL", "FFMA", "FADD", "FMNMX", "FSEL", "FSETP"),
    "convert P to bf16 (F2FP)": ("F2FP",),
    "quad shuffles (SHFL)": ("SHFL",),
    "barriers (BAR)": ("BAR",),
    "spills (LDL, STL)": ("LDL", "STL"),
}
OTHER = "addresses, counters, other"
_SASS_LINE = re.compile(r"/\*[0-9a-f]+\*/\s+(?P<pred>@!?U?P\w+\s+)?(?P<op>[A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def loop_body(sass: str) -> list[str]:
    """Opcodes of the loop with the most HMMA (the KV loop), never-executed ones (@!PT) left
    out: the region from a label to the last branch back to it."""
    lines = sass.splitlines()
    labels = {}
    best: list[str] = []
    for i, ln in enumerate(lines):
        lab = _LABEL.match(ln)
        if lab:
            labels[lab.group(1)] = i
        br = _BRANCH.search(ln)
        if br and br.group(1) in labels and labels[br.group(1)] < i:
            ops = []
            for body in lines[labels[br.group(1)]:i + 1]:
                m = _SASS_LINE.search(body)
                if m and not (m.group("pred") or "").strip().startswith(("@!PT", "@!UPT")) \
                        and m.group("op") != "NOP":
                    ops.append(m.group("op"))
            if ops.count("HMMA") > best.count("HMMA"):
                best = ops
    return best


def instruction_mix(cfg: TileConfig | None = None, head_dim: int = 128, arch: str = "sm_90a"):
    """Per warp and per KV step, the compiled loop's instructions by class (a dict, in the order
    of INSTRUCTION_CLASSES, OTHER last). Normalised by the mma.sync count one step needs, so an
    unrolled loop still gives one step. The tile is compiled with its QK^T loop fully unrolled
    (``qk_unroll = D / 16``): a rolled inner loop's body runs several times per step, so its
    static count would not be one step; unrolled, the instructions per step are the same, plus
    any spill traffic the extra registers cause."""
    cfg = fa.default_config(head_dim) if cfg is None else cfg
    cfg = replace(cfg, qk_unroll=head_dim // 16)
    ops = Counter(loop_body(compiled(arch, head_dim, cfg).sass))
    if not ops["HMMA"]:
        raise RuntimeError("found no loop with mma.sync (HMMA) in the SASS: is nvdisasm there? "
                           "(nvidia-cutlass-dsl-libs-base[sass] brings it)")
    per_step = 2 * (cfg.m_block // (16 * cfg.num_warps)) * (cfg.n_block // 8) * (head_dim // 16)
    steps = max(1, round(ops["HMMA"] / per_step))
    mix = {}
    for name, opcodes in INSTRUCTION_CLASSES.items():
        mix[name] = sum(ops.pop(op, 0) for op in opcodes) / steps
    mix[OTHER] = sum(ops.values()) / steps
    return mix


def hopper_ceilings(cfg: TileConfig | None = None, head_dim: int = 128, mix: dict | None = None):
    """One KV step of one CTA on one H100/H200 SM, per unit: cycles, and the TFLOP/s the whole
    chip would reach if that unit were the only limit (132 SMs at the boost clock of
    utils.hardware.PER_SM). Rows: (what, cycles, TFLOP/s)."""
    cfg = fa.default_config(head_dim) if cfg is None else cfg
    mix = instruction_mix(cfg, head_dim) if mix is None else mix
    hopper = PER_SM["sm_90"]
    flops = 4 * cfg.m_block * cfg.n_block * head_dim
    warps = cfg.num_warps
    wgmma_rate = flops / hopper.mma_flops_per_clk
    mma_sync = wgmma_rate / MMA_SYNC_SHARE
    mufu = mix["exp2 (MUFU)"] * 32 * warps / hopper.exp2_per_clk
    issue = sum(mix.values()) * warps / SCHEDULERS_PER_SM
    rows = [
        ("tensor cores at the wgmma rate", wgmma_rate),
        (f"tensor cores at the mma.sync rate (measured: {MMA_SYNC_SHARE:g} of it)", mma_sync),
        ("exp2 on MUFU", mufu),
        ("issuing the loop's instructions (4 schedulers)", issue),
        ("mma.sync, then exp2, no overlap", mma_sync + mufu),
    ]
    tflops = lambda cycles: flops / cycles * hopper.chip_peak(1) / 1e12  # noqa: E731
    return [(what, cycles, tflops(cycles)) for what, cycles in rows]


def issue_rows(configs, head_dim: int = 128, arch: str = "sm_90a") -> list[dict]:
    """Per tile, one KV step of one CTA on one H100/H200 SM: cycles to issue the compiled loop's
    instructions (4 schedulers) against cycles of mma.sync (at MMA_SYNC_SHARE of the tensor-core
    rate). The O rescale costs acc_O FMULs per thread and step whatever n_block is, like the
    barriers and shuffles: wider KV tiles spread those over more keys."""
    hopper = PER_SM["sm_90"]
    rows = []
    for cfg in configs:
        mix = instruction_mix(cfg, head_dim, arch)
        per_warp = sum(mix.values())
        issue = per_warp * cfg.num_warps / SCHEDULERS_PER_SM
        mma = 4 * cfg.m_block * cfg.n_block * head_dim / hopper.mma_flops_per_clk / MMA_SYNC_SHARE
        rows.append({"config": cfg, "per_warp": per_warp, "issue": issue, "mma_sync": mma,
                     "issue_share": issue / mma, "hmma": mix["mma.sync (HMMA)"],
                     "o_rescale": cfg.m_block * head_dim // cfg.num_threads})
    return rows


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
# 6. Stored results
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


TARGET = {"ratio": 1.1, "baseline": "sdpa_flash", "d": 128, "s": 16384, "causal": False}


def target_verdict(res, impl: str = "flash_ampere", **target) -> str:
    """One plain sentence: the issue's target (1.1x SDPA's flash backend at D=128, S=16384,
    non-causal) against a run where both were measured together (a Results or its rows)."""
    t = {**TARGET, **target}
    rows, name = getattr(res, "rows", res), getattr(res, "name", "this run")
    where = {"d": t["d"], "s": t["s"], "causal": t["causal"], "pass": "fwd"}
    found = {}
    for who in (impl, t["baseline"]):
        match = [r for r in rows
                 if r.get("impl") == who and all(r.get(k) == v for k, v in where.items())]
        if len(match) != 1 or not match[0].get("tflops"):
            return f"target cannot be judged from {name}: {len(match)} timed rows of {who}"
        found[who] = match[0]
    ours, base = found[impl], found[t["baseline"]]
    ratio = ours["tflops"] / base["tflops"]
    verdict = "MET" if ratio >= t["ratio"] else "NOT met"
    return (f"target {t['ratio']:g}x {t['baseline']} at D={t['d']}, S={t['s']}, "
            f"{'causal' if t['causal'] else 'non-causal'}: {impl} {ours['tflops']:.0f} TFLOP/s, "
            f"{t['baseline']} {base['tflops']:.0f} in the same run = {ratio:.2f}x -> {verdict}")


row_config = fa.config_from_row  # the TileConfig a sweep row was measured with


def sweep_lines(res, compile_groups=((128, False),), arch: str = "sm_90a") -> list[str]:
    """The stored tile sweep, grouped by (D, causal): TFLOP/s, ratio to the group's default
    row, the accumulators, and registers / stack / spill instructions (from the row when the
    sweep stored them, else compiled here for the groups in ``compile_groups``)."""
    lines = []
    groups = dict.fromkeys((r["d"], r["causal"]) for r in res.rows)
    for d, causal in groups:
        rows = [r for r in res.rows if (r["d"], r["causal"]) == (d, causal)]
        base = next((r["tflops"] for r in rows if r.get("default") and r.get("tflops")
                     and r.get("impl") != fa.ABLATION_IMPL), None)
        lines.append(f"D={d} {'causal' if causal else 'non-causal'} (S={rows[0]['s']}):")
        lines.append(f"    {'tile':28s} {'TFLOP/s':>7s} {'vs def':>6s} {'acc O+S':>7s} "
                     f"{'regs':>4s} {'stack':>5s} {'spills':>6s}")
        for r in sorted(rows, key=lambda r: -(r.get("tflops") or 0)):
            name = config_name(row_config(r)) + (" *" if r.get("default") else "")
            if r.get("impl") == fa.ABLATION_IMPL:  # Note [What the softmax costs]
                lines.append(f"    {name + ' without softmax':28s} {r['tflops']:7.0f} "
                             f"{r['tflops'] / base if base else 0:5.2f}x  (timing ablation: "
                             "output is not attention)")
                continue
            if "registers" in r:
                regs = {k: r.get(k) for k in ("registers", "stack_bytes", "spill_instructions")}
            elif (d, causal) in compile_groups:
                regs = resources(arch, d, row_config(r), causal)
            else:
                regs = {"registers": None, "stack_bytes": None, "spill_instructions": None}
            cells = "".join(f" {'-' if v is None else v:>{w}}" for v, w in
                            zip(regs.values(), (4, 5, 6)))
            acc = r.get("acc_O", 0) + r.get("acc_S", 0)
            if not r.get("tflops"):
                lines.append(f"    {name:28s} {'not timed (check failed)':>22s}{cells}")
                continue
            ratio = f"{r['tflops'] / base:5.2f}x" if base else "     "
            lines.append(f"    {name:28s} {r['tflops']:7.0f} {ratio:>6s} {acc:7d}{cells}")
    return lines


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


# What profile_lines prints, in order: (metric, what it is); rows the file lacks are skipped.
PROFILE_METRICS = (
    ("tensor_pipe_active_pct", "tensor pipe busy (share of cycles, %)"),
    ("issue_slots_busy_pct", "issue slots used (%)"),
    ("achieved_warps_per_scheduler", "warps per scheduler (achieved)"),
    ("registers_per_thread", "registers per thread"),
    ("ctas_per_sm_limit_registers", "CTAs per SM the registers allow"),
    ("ctas_per_sm_limit_shared_mem", "CTAs per SM the shared memory allows"),
    ("smem_load_bank_conflicts_pct", "shared loads: bank-conflict wavefronts (%)"),
    ("mma_sync_per_warp_per_step", "mma.sync per warp per KV step"),
    ("other_instructions_per_warp_per_step", "other instructions per warp per KV step"),
    ("warp_time_loop_head_pct", "warp time: loop head (waits, barrier, cp.async) %"),
    ("warp_time_qk_pct", "warp time: S = QK^T %"),
    ("warp_time_softmax_pct", "warp time: softmax %"),
    ("warp_time_pv_pct", "warp time: O += PV %"),
    ("warp_time_at_mma_sync_pct", "warp time at an mma.sync (either GEMM) %"),
)


def profile_lines(res, stalls: int = 6) -> list[str]:
    """The stored Nsight Compute profile (solutions.ch04_profile): the counters of
    PROFILE_METRICS, then the ``stalls`` largest stall reasons in cycles per issued
    instruction."""
    by_metric = {r["metric"]: r for r in res.rows}
    first = res.rows[0]
    head = (f"{first['config']} at D={first['d']}, S={first['s']}, "
            f"{'causal' if first['causal'] else 'non-causal'}")
    if "sm_clock_ghz" in by_metric:
        head += f"; SM clock held at {by_metric['sm_clock_ghz']['value']:.2f} GHz by ncu"
    lines = [head]
    for metric, what in PROFILE_METRICS:
        if metric in by_metric:
            v = by_metric[metric]["value"]
            lines.append(f"  {what:58s} {v:8.2f}" if v % 1 else f"  {what:58s} {v:8.0f}")
    stall_rows = sorted((r for r in res.rows if r["metric"].startswith("stall_")
                         and not r["metric"].endswith("_pct")), key=lambda r: -r["value"])
    if stall_rows:
        total = sum(r["value"] for r in stall_rows)
        lines.append(f"  cycles between two issues of a warp, by reason (sum {total:.2f}):")
        for r in stall_rows[:stalls]:
            lines.append(f"    {r['metric'][6:]:26s} {r['value']:5.2f}")
    for reason, what in (("wait", "'wait' samples at an mma.sync (its issue gap) %"),
                         ("short_sb", "'short_scoreboard' samples at an mma.sync (its "
                                      "ldmatrix) %")):
        row = by_metric.get(f"stall_{reason}_samples_at_mma_sync_pct")
        if row is not None:
            lines.append(f"  {what:58s} {row['value']:8.0f}")
    return lines


def cutlass_peer_lines(res) -> list[str]:
    """The stored ch04_cutlass_peer run, one line per (causal, data): medians over rounds and
    ratios to SDPA's flash backend from the same run."""
    from solutions.ch04_peers import summary

    return summary(res.rows)


# ================================================================================================
# 7. Exercises
# ================================================================================================
# --- 04.1: registers of a tile ------------------------------------------------------------------
def registers_needed(cfg: TileConfig, head_dim: int) -> tuple[int, bool]:
    """Exercise 04.1's reference: the register model's peak and whether it fits in 255."""
    est = register_estimate(cfg, head_dim)
    return est["peak"], est["fits"]


def _register_cases():
    cases = []
    for d in (64, 128):
        for m in (64, 128, 256):
            for n in (32, 64, 128):
                for threads, unroll in ((128, 1), (128, 2), (256, 1), (256, 2)):
                    cfg = TileConfig(m, n, threads, qk_unroll=unroll)
                    try:
                        cfg.check(d)
                    except ValueError:
                        continue
                    cases.append((cfg, d))
    return cases


def check_registers_needed(fn) -> None:
    """Exercise 04.1: ``fn(cfg, head_dim) -> (registers, fits)`` against the register model on
    every valid tile of 64/128/256 rows, 32/64/128 keys, 4 or 8 warps, 1 or 2 k-slices per
    trip, D = 64 and 128."""
    for cfg, d in _register_cases():
        got = fn(cfg, d)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"return a pair (registers, fits), got {got!r}")
        regs, fits = got
        want, want_fits = registers_needed(cfg, d)
        tile = f"{cfg.m_block} x {cfg.n_block} with {cfg.num_warps} warps at D={d}"
        if regs != want:
            est = register_estimate(cfg, d)
            acc = (est["S = QK^T"]["acc_O"], est["S = QK^T"]["acc_S"])
            raise AssertionError(
                f"{tile}: you counted {regs} registers, the model counts {want}. Its two "
                f"busiest moments: {estimate_text(cfg, d)}; the peak is the larger. (Check "
                f"first: acc_O = m_block * D / threads = {acc[0]}, acc_S = m_block * n_block / "
                f"threads = {acc[1]}.)")
        if fits is not want_fits:
            raise AssertionError(f"{tile}: {regs} registers, so fits must be {want_fits} (the "
                                 f"limit is {REGISTER_LIMIT} per thread); got {fits!r}")


# --- 04.2: which thread holds S[r, c] -----------------------------------------------------------
def s_owner(row: int, col: int, num_warps: int) -> int:
    """Exercise 04.2's reference: the thread whose mma.sync accumulator holds S[row, col]."""
    warp = (row // 16) % num_warps  # warps take 16-row slices in turn (Note [Work split])
    lane = 4 * (row % 8) + (col % 8) // 2  # m16n8: lane l has rows l//4 (+8), cols 2(l%4) (+1)
    return 32 * warp + lane


OWNER_CONFIGS = [(None, 128), (TileConfig(128, 64, 256), 128), (TileConfig(64, 128, 128), 64)]


def check_s_owner(fn) -> None:
    """Exercise 04.2: ``fn(row, col, num_warps) -> thread`` against the kernel's own TiledMma
    (``ch04_cpu_model.s_owner_map``) for every element of three tiles."""
    for cfg, d in OWNER_CONFIGS:
        cfg = fa.default_config(d) if cfg is None else cfg
        owner = cm.s_owner_map(cfg, d)
        for r in range(cfg.m_block):
            for c in range(cfg.n_block):
                got, want = fn(r, c, cfg.num_warps), int(owner[r, c])
                if got == want:
                    continue
                tile = f"a {cfg.m_block} x {cfg.n_block} tile with {cfg.num_warps} warps"
                head = (f"S[{r}, {c}] of {tile} is held by thread {want} (warp {want // 32}, "
                        f"lane {want % 32}); you said {got!r}.")
                if not isinstance(got, (int, np.integer)) or got < 0:
                    raise AssertionError(f"{head} Return a thread index 0..{cfg.num_threads - 1}.")
                if got // 32 != want // 32:
                    raise AssertionError(
                        f"{head} The warp is wrong: warps own 16-row slices of the tile in turn, "
                        f"warp w rows 16w .. 16w + 15, then 16 * {cfg.num_warps} rows later "
                        f"again (Note [Work split]); there are only {cfg.num_warps} warps.")
                raise AssertionError(
                    f"{head} The warp is right, the lane is not: in each 16 x 8 block, lane l "
                    "holds rows l // 4 and l // 4 + 8 and columns 2 * (l % 4) and 2 * (l % 4) "
                    "+ 1 (chapter 03's picture of the m16n8k16 accumulator).")


# --- 04.3: which KV tiles a causal CTA visits, and which it masks -------------------------------
def kv_tiles(m_block: int, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int,
             causal: bool) -> tuple[list[int], list[int]]:
    """Exercise 04.3's reference: (visited, masked) KV tile indices of query tile ``m_block``,
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
    """Exercise 04.3: ``fn(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal) -> (visited,
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


__all__ = [
    "BOOKKEEPING_REGISTERS",
    "KV_TILE_CASES",
    "MMA_SYNC_SHARE",
    "ceiling_lines",
    "cutlass_peer_lines",
    "profile_lines",
    "REGISTER_LIMIT",
    "SM_LIMITS",
    "TILE_KINDS",
    "a_owner_map",
    "bank_summary",
    "check_kv_tiles",
    "check_registers_needed",
    "check_s_owner",
    "compiled",
    "config_name",
    "cp_async_addresses",
    "ctas_per_sm",
    "draw_p_as_a_operand",
    "draw_register_budget",
    "draw_s_owners",
    "draw_tile_map",
    "estimate_text",
    "expected_tflops",
    "format_resource_rows",
    "hopper_ceilings",
    "instruction_mix",
    "issue_rows",
    "kv_tile_ranges",
    "kv_tiles",
    "ldmatrix_addresses",
    "load_stored",
    "loop_body",
    "note",
    "plot_fwd",
    "register_estimate",
    "registers_needed",
    "resource_rows",
    "resources",
    "row_config",
    "s_owner",
    "smem_offsets",
    "source",
    "source_between",
    "sweep_lines",
    "target_verdict",
    "tflops_groups",
    "tile_counts",
    "tile_map",
    "visible",
]

