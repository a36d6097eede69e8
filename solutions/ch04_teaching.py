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
- stored results: the forward benchmark and how it stands against its peers, the tile sweep and
  what each knob did, the Nsight Compute profile;
- exercises 04.1 (registers of a tile), 04.2 (which thread holds S[r, c]), 04.3 (which KV tiles
  a causal CTA visits and masks), and two in device code: 04.4 (the quad all-reduce, checked by
  a model of a warp as a vector of 32 lanes and a compile for sm_80) and 04.5 (a fragment's
  causal mask, run host-side for every thread of the kernel's tile); both run on a GPU inside
  small kernels (``QuadReduce``, ``MaskHarness``).
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


def peer_lines(res, ours: str = "flash_ampere", peer: str = "cutlass_example_128x64",
               portable: str = "flash_ampere_portable") -> list[str]:
    """The stored ch04_cutlass_peer run (medians over rounds): ours against CUTLASS's example
    (with a verdict: level within LEVEL, or who is ahead) and against the portable (sm_80-safe)
    default tile, per (causal, data)."""
    groups = dict.fromkeys((r["causal"], r["data"]) for r in res.rows)
    lines = []
    for causal, data in groups:
        med = {}
        for impl in (ours, peer, portable):
            vals = [r["tflops"] for r in res.rows if (r["causal"], r["data"]) == (causal, data)
                    and r["impl"] == impl and r.get("tflops")]
            if vals:
                med[impl] = _median(vals)
        if ours not in med:
            continue
        what = f"{'causal' if causal else 'non-causal'}, {data}:"
        parts = []
        if peer in med:
            ratio = med[ours] / med[peer]
            verdict = ("level" if abs(ratio - 1) < LEVEL else
                       "ours ahead" if ratio > 1 else "CUTLASS's ahead")
            parts.append(f"{ours} / CUTLASS's example = {ratio:.3f} ({verdict})")
        if portable in med:
            parts.append(f"{ours} / the portable tile = {med[ours] / med[portable]:.3f}")
        lines.append(f"{what:24s} " + "; ".join(parts))
    return lines


def run_spread(*results, impl: str = "flash_ampere", **at) -> dict | None:
    """The same kernel at the same shape in several stored runs (the default tile of each, on
    random inputs): the lowest and highest TFLOP/s, their spread (a fraction), how many timings
    from which files. None with fewer than two timings. The yardstick for small differences."""
    at = {**STANDING, **at}
    seen = []
    for res in results:
        if res is None:
            continue
        for r in res.rows:
            if (r.get("impl") == impl and r.get("tflops") and r.get("pass", "fwd") == "fwd"
                    and all(r.get(k) == v for k, v in at.items()) and r.get("default", True)
                    and r.get("data", "randn") == "randn"):
                seen.append((r["tflops"], res.name))
    if len(seen) < 2:
        return None
    lo, hi = min(seen)[0], max(seen)[0]
    return {"lo": lo, "hi": hi, "spread": hi / lo - 1, "timings": len(seen),
            "files": sorted({n for _, n in seen}), "impl": impl, **at}


def spread_line(spread: dict | None) -> str:
    if spread is None:
        return "fewer than two runs of the same kernel and shape are stored"
    return (f"{spread['impl']} at D={spread['d']}, S={spread['s']}, "
            f"{'causal' if spread['causal'] else 'non-causal'}, {spread['timings']} timings in "
            f"{', '.join(spread['files'])}: {spread['lo']:.0f} to {spread['hi']:.0f} TFLOP/s, a "
            f"spread of {spread['spread']:.1%}")


def _sweep_row(rows, d, causal, impl="flash_ampere", **tile):
    base = {"m_block": 128, "n_block": 64, "num_threads": 128, "num_stages": 1,
            "smem_layout": "swizzled", "qk_unroll": 2, "skip_rescale": False, **tile}
    return next((r for r in rows if r.get("impl") == impl and r["d"] == d
                 and r["causal"] == causal and r.get("tflops")
                 and all(r.get(k) == v for k, v in base.items())), None)


def sweep_findings(res, spread: float | None = None) -> list[str]:
    """What the stored sweep says about each knob, one line each, computed from its rows:
    A vs B in TFLOP/s and their ratio, with A's spills. A ratio is marked "within noise" when
    it does not clear the larger of the two rows' own spreads (``utils.bench.compare``) and
    ``spread`` (a fraction: the same kernel between runs, from ``run_spread``)."""
    rows = res.rows
    out = []

    def spills(r):
        n = r.get("spill_instructions")
        return "spill-free" if n == 0 else (f"{n} spill instructions" if n else "spills unknown")

    def compare(what, d, causal, a, b):
        from utils.bench import compare as against

        ra, rb = _sweep_row(rows, d, causal, **a), _sweep_row(rows, d, causal, **b)
        if ra is None or rb is None:
            return
        ratio = ra["tflops"] / rb["tflops"]
        c = against(ra, rb)
        limit = max(c.noise if c is not None else 0.0, spread or 0.0)
        noise = " (within noise)" if abs(ratio - 1) <= limit else ""
        out.append(f"D={d} {'causal' if causal else 'non-causal'}, {what}: {ra['tflops']:.0f} vs "
                   f"{rb['tflops']:.0f} TFLOP/s = {ratio:.2f}x{noise}; {spills(ra)}")

    compare("QK^T fully unrolled (4 slices per trip) vs 1 slice", 64, False,
            {"qk_unroll": 4}, {"qk_unroll": 1})
    compare("4 slices per trip vs 2", 128, False, {"qk_unroll": 4}, {"qk_unroll": 2})
    compare("2 stages vs 1, 4 slices per trip", 128, False,
            {"qk_unroll": 4, "num_stages": 2}, {"qk_unroll": 4})
    compare("2 stages, 4 slices vs the portable default (1 stage, 2 slices)", 128, False,
            {"qk_unroll": 4, "num_stages": 2}, {})
    two = _sweep_row(rows, 128, False, qk_unroll=4, num_stages=2)
    if two is not None and two.get("sdpa_flash_tflops"):
        out.append(f"D=128 non-causal, 2 stages and 4 slices vs SDPA's flash backend in the "
                   f"same sweep: {two['tflops'] / two['sdpa_flash_tflops']:.2f}x")
    compare("4 slices, 1 stage vs the portable default", 128, True, {"qk_unroll": 4}, {})
    compare("2 stages vs 1, 4 slices per trip", 128, True,
            {"qk_unroll": 4, "num_stages": 2}, {"qk_unroll": 4})
    compare("3 stages vs 2, 4 slices per trip", 128, False,
            {"qk_unroll": 4, "num_stages": 3}, {"qk_unroll": 4, "num_stages": 2})
    compare("skip_rescale vs the same tile without it", 128, False,
            {"qk_unroll": 4, "num_stages": 2, "skip_rescale": True},
            {"qk_unroll": 4, "num_stages": 2})
    compare("KV tile 128 x 64 vs 128 x 32", 128, False, {}, {"n_block": 32})
    compare("QK^T fully unrolled (8 slices) vs 4 slices", 128, False,
            {"qk_unroll": 8}, {"qk_unroll": 4})
    compare("8 warps (256 x 64) vs 4 warps (128 x 64)", 128, False,
            {"m_block": 256, "num_threads": 256}, {})
    compare("padded vs swizzled shared memory", 128, False, {"smem_layout": "padded"}, {})
    return out


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
    instruction, and the shares of two stall reasons that sit at an mma.sync."""
    from solutions.ch04_profile import format_profile

    by_metric = {r["metric"]: r for r in res.rows}
    lines = format_profile(res, PROFILE_METRICS, stalls)
    for reason, what in (("wait", "'wait' samples at an mma.sync (its issue gap) %"),
                         ("short_sb", "'short_scoreboard' samples at an mma.sync (its "
                                      "ldmatrix) %")):
        row = by_metric.get(f"stall_{reason}_samples_at_mma_sync_pct")
        if row is not None:
            lines.append(f"  {what:58s} {row['value']:8.0f}")
    return lines


def profile_reading(res) -> list[str]:
    """The stored profile read as sentences, each number next to what it means (verdicts are
    computed from the numbers, so a new profile cannot leave an old sentence behind)."""
    by = {r["metric"]: r["value"] for r in res.rows}
    out = []
    if "tensor_pipe_active_pct" in by and "issue_slots_busy_pct" in by:
        busy, issue = by["tensor_pipe_active_pct"], by["issue_slots_busy_pct"]
        verdict = ("neither is saturated" if max(busy, issue) < 80
                   else "one of them is close to its limit")
        out.append(f"tensor pipe busy {busy:.0f}% of the cycles, issue slots used {issue:.0f}%: "
                   f"{verdict}")
    if "warp_time_at_mma_sync_pct" in by:
        line = f"a warp spends {by['warp_time_at_mma_sync_pct']:.0f}% of its time at an mma.sync"
        extra = [f"{by[k]:.0f}% of its '{name}' samples" for k, name in
                 (("stall_wait_samples_at_mma_sync_pct", "wait"),
                  ("stall_short_sb_samples_at_mma_sync_pct", "short_scoreboard")) if k in by]
        out.append(line + (" (and " + " and ".join(extra) + " sit there)" if extra else ""))
    parts = [(p, by.get(f"warp_time_{p}_pct")) for p in ("loop_head", "qk", "softmax", "pv")]
    if all(v is not None for _, v in parts):
        names = {"loop_head": "loop head", "qk": "S = QK^T", "softmax": "softmax",
                 "pv": "O += PV"}
        ranked = sorted(parts, key=lambda kv: -kv[1])
        out.append("by part of the KV loop, largest first: "
                   + ", ".join(f"{names[p]} {v:.0f}%" for p, v in ranked))
    return out


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


# --- 04.4: the quad all-reduce (device code) ---------------------------------------------------
# A row of S lives in the 4 lanes of a quad (lanes 4q .. 4q + 3). Every lane needs the row's
# max (and, in finalize, its sum): a reduction whose result ends up in all 4 lanes.
@cute.jit
def quad_allreduce(x: cutlass.Float32, op: cutlass.Constexpr) -> cutlass.Float32:
    """Exercise 04.4's reference: ``op`` over the 4 lanes of this lane's quad, in every lane.
    The butterfly with xor 2 pairs lanes {0, 2} and {1, 3}; then xor 1 pairs {0, 1}, {2, 3}."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return op(x, cute.arch.shuffle_sync_bfly(x, offset=1))


LANES = 32


def _shuffle_model(kind: str, calls: list):
    """A warp-wide shuffle of PTX's ``shfl.sync`` on a NumPy vector of 32 lanes (one value per
    lane), recording (kind, offset) in ``calls``. A lane whose source is outside its segment
    keeps its own value, as the instruction does; ``mask_and_clamp`` is PTX's c operand,
    (segment mask << 8) | clamp."""

    def shuffle(value, offset, mask=0xFFFFFFFF, mask_and_clamp=None, **_):
        if not (isinstance(value, np.ndarray) and value.shape == (LANES,)):
            raise AssertionError(f"cute.arch.shuffle_sync_{kind} got {value!r}; shuffle the "
                                 "lane's value x (or a value computed from it)")
        offset = int(offset)
        calls.append((kind, offset))
        c = (0 if kind == "up" else 31) if mask_and_clamp is None else int(mask_and_clamp)
        seg, clamp = (c >> 8) & 31, c & 31
        lane = np.arange(LANES)
        lo = lane & seg
        hi = lo | (clamp & ~seg)
        src = {"bfly": lane ^ offset, "down": lane + offset, "up": lane - offset,
               "idx": (offset & ~seg) | lo}[kind]
        ok = (src >= lo) if kind == "up" else (src <= hi)
        return np.where(ok, value[np.clip(src, 0, LANES - 1)], value)

    return shuffle


def run_quad_allreduce(fn, lanes: np.ndarray, op) -> tuple[np.ndarray, list]:
    """``fn(x, op)`` run as plain Python for a whole warp at once: x is the vector of the 32
    lanes' values and every ``cute.arch`` shuffle a lane permutation of it. Returns each lane's
    result and the shuffles made, [(kind, offset), ...]."""
    from utils.host_emulation import patched, plain, python_loops

    calls: list = []
    shuffles = {f"shuffle_sync{'' if k == 'idx' else '_' + k}": _shuffle_model(k, calls)
                for k in ("bfly", "down", "up", "idx")}
    with python_loops(), patched(cute.arch, fmax=np.fmax, **shuffles):
        out = plain(fn)(lanes.astype(np.float32), op)
    return out, calls


def _quad_truth(lanes: np.ndarray, op) -> np.ndarray:
    quads = lanes.reshape(-1, 4)
    return np.repeat(op.reduce(quads, axis=1), 4)


def check_quad_allreduce(fn) -> None:
    """Exercise 04.4: ``fn(x, op)`` must leave in every lane ``op`` over its quad's 4 values, for
    op = max and op = add, with butterfly shuffles; then the compiled sm_80 kernel must hold two
    ``shfl.sync.bfly`` per reduction."""
    rng = np.random.default_rng(44)
    with_inf = np.where(np.arange(LANES) % 4 == 3, -np.inf, rng.standard_normal(LANES))
    cases = [("max", np.fmax, rng.standard_normal(LANES)), ("max", np.fmax, with_inf),
             ("sum", np.add, rng.integers(1, 9, LANES).astype(np.float64)),
             ("sum", np.add, 2.0 ** np.arange(LANES) % 97)]
    for name, op, lanes in cases:
        lanes = lanes.astype(np.float32)
        got, calls = run_quad_allreduce(fn, lanes, op)
        if got is None:
            raise AssertionError("quad_allreduce returned None: return the combined value")
        got = np.broadcast_to(np.asarray(got, dtype=np.float32), (LANES,))
        want = _quad_truth(lanes, op)
        if np.array_equal(got, want):
            continue
        offsets = [o for k, o in calls if k == "bfly"]
        kinds = sorted({k for k, _ in calls} - {"bfly"})
        lane = int(np.flatnonzero(got != want)[0])
        quad = ", ".join(f"{v:.3g}" for v in lanes[4 * (lane // 4):4 * (lane // 4) + 4])
        head = (f"with op = {name}, lane {lane} holds {got[lane]:.3g} but its quad (lanes "
                f"{4 * (lane // 4)}..{4 * (lane // 4) + 3}, values {quad}) gives "
                f"{want[lane]:.3g}.")
        if not calls:
            why = ("no shuffle was made: a lane sees only its own value until it reads its "
                   "neighbours' with cute.arch.shuffle_sync_bfly")
        elif kinds:
            why = (f"you used shuffle_sync_{kinds[0]}: a shift or an indexed read leaves some "
                   "lanes of the quad without the full result. The butterfly (xor) pairs every "
                   "lane with a partner, so after two steps all 4 lanes hold it")
        elif any(o >= 4 for o in offsets):
            reach = 2 ** max(o.bit_length() for o in offsets)
            why = (f"you reduced over {reach} lanes (xor offsets {sorted(set(offsets))}): xor "
                   "offsets 1 and 2 cover the 4 lanes of a quad; offset 4 and above reach other "
                   "quads, which hold other rows")
        elif len(set(offsets)) < len(offsets):
            why = (f"the offsets {offsets} repeat one: the second shuffle with the same offset "
                   "combines the same pair again (a max does not notice, a sum doubles). Use "
                   "offsets 2 and 1, once each")
        elif sorted(set(offsets)) != [1, 2]:
            why = (f"the offsets {offsets} combine each lane with only one partner: lanes agree "
                   "in pairs. Two butterfly steps, xor 2 and xor 1, reach all four")
        else:
            why = ("the shuffles are right, so look at how the values are combined: apply `op` "
                   "to the lane's value and the shuffled one after each shuffle, and return the "
                   "result")
        raise AssertionError(f"{head} Hint: {why}.")
    art = QuadReduce(fn).compile("sm_80")
    n = art.count("shfl.sync.bfly")
    if n != 4:
        raise AssertionError(f"the compiled sm_80 kernel (one max and one sum per thread) has {n} "
                             "shfl.sync.bfly; two per reduction is all a quad needs")


class QuadReduce:
    """A small kernel around a quad all-reduce: thread i reads x[i] and writes the max and the
    sum of its quad's four values (lanes 4q .. 4q + 3) to mx[i] and sm[i]."""

    THREADS = 128

    def __init__(self, allreduce=quad_allreduce):
        self.allreduce = allreduce

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mMax: cute.Tensor, mSum: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.THREADS + tidx
        x = mX[i]
        mMax[i] = self.allreduce(x, fa.fmax)
        mSum[i] = self.allreduce(x, fa.fadd)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mMax: cute.Tensor, mSum: cute.Tensor, stream):
        self.kernel(mX, mMax, mSum).launch(grid=(cute.size(mX) // self.THREADS, 1, 1),
                                           block=(self.THREADS, 1, 1), stream=stream)

    def compile(self, arch: str = "sm_80"):
        from utils.compile_only import compile_for, fake_stream, fake_tensor

        return compile_for(arch, self, *(fake_tensor(cutlass.Float32, (None,), align=4)
                                         for _ in range(3)), fake_stream())


_GPU_COMPILED: dict = {}


def _launch(key, build, tensors, device):
    import cuda.bindings.driver as cuda
    import torch

    with torch.cuda.device(device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        if key not in _GPU_COMPILED:
            _GPU_COMPILED[key] = cute.compile(build(), *tensors, stream)
        _GPU_COMPILED[key](*tensors, stream)


def check_quad_allreduce_on_gpu(fn, n: int = 1 << 16, seed: int = 0):
    """Exercise 04.4 on a GPU: ``QuadReduce(fn)`` on n random values against torch's max and
    sum over groups of 4. Returns (ok, one line)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g)
    mx, sm = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    tensors = [from_dlpack(t).mark_layout_dynamic() for t in (x, mx, sm)]
    _launch(("quad", fn), lambda: QuadReduce(fn), tensors, x.device)
    torch.cuda.synchronize()
    quads = x.view(-1, 4)
    want_max = quads.amax(1).repeat_interleave(4)
    want_sum = quads.double().sum(1).repeat_interleave(4)
    max_ok = torch.equal(mx, want_max)
    # fp32 sums in another order than torch's: a few ulp
    sum_err = (sm.double() - want_sum).abs().max().item()
    ok = max_ok and sum_err < 1e-5
    return ok, (f"{n} lanes: max {'exact' if max_ok else 'WRONG'}, sum max |error| "
                f"{sum_err:.1e} ({'ok' if ok else 'WRONG'})")


# --- 04.5: the causal mask on a thread's fragment (device code) ---------------------------------
@cute.jit
def mask_scores(acc_S: cute.Tensor, tScS: cute.Tensor, row0: Int32, col0: Int32,
                seqlen_q: Int32, seqlen_k: Int32, causal: cutlass.Constexpr):
    """Exercise 04.5's reference: -inf into every score of the fragment its query may not see.
    acc_S[i] is S[row0 + tScS[i][0], col0 + tScS[i][1]] (query row, key column in the whole
    sequence); keys past seqlen_k do not exist; causal is bottom-right aligned, so query i sees
    keys j <= i + seqlen_k - seqlen_q."""
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row = row0 + tScS[i][0]
        col = col0 + tScS[i][1]
        limit = seqlen_k  # one past the last key this row may see
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q)
        acc_S[i] = -cutlass.Float32.inf if col >= limit else acc_S[i]


class MaskHarness:
    """Run a fragment mask for every thread of one CTA of chapter 04's kernel, for a list of
    (seqlen_q, seqlen_k, m_block, n_block) cases, with the kernel's own mma.sync partition: on
    the CPU (``on_cpu``) or as a kernel, one CTA per case (``__call__``). out[case, r, c] is 0
    where S[r, c] of the (m_block, n_block) tile stays, -inf where the mask cleared it."""

    def __init__(self, mask=mask_scores, causal: bool = True, cfg: TileConfig | None = None):
        self.mask, self.causal = mask, causal
        self.flash = _kernel(cfg, 128, causal)
        self.m_block, self.n_block = self.flash.m_block, self.flash.n_block
        self.num_threads = self.flash.num_threads

    @cute.jit
    def thread(self, out: cute.Tensor, cases: cute.Tensor, case, tidx):
        tiled_mma = self.flash.make_tiled_mma()
        cS = cute.make_identity_tensor((self.m_block, self.n_block))
        tScS = tiled_mma.get_slice(tidx).partition_C(cS)  # ((2, 2), MMA_M, MMA_N) -> (r, c)
        acc_S = cute.make_rmem_tensor(tScS.shape, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        acc_S.fill(0.0)
        seqlen_q, seqlen_k = cases[case, 0], cases[case, 1]
        row0, col0 = cases[case, 2] * self.m_block, cases[case, 3] * self.n_block
        self.mask(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, self.causal)
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            out[case, tScS[i][0], tScS[i][1]] = acc_S[i]

    @cute.jit
    def on_cpu(self, out: cute.Tensor, cases: cute.Tensor):
        for case in cutlass.range(cute.size(cases, mode=[0])):
            for tidx in cutlass.range(self.num_threads):
                self.thread(out, cases, case, tidx)

    @cute.kernel
    def kernel(self, out: cute.Tensor, cases: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        case, _, _ = cute.arch.block_idx()
        self.thread(out, cases, case, tidx)

    @cute.jit
    def __call__(self, out: cute.Tensor, cases: cute.Tensor, stream):
        self.kernel(out, cases).launch(grid=(cute.size(cases, mode=[0]), 1, 1),
                                       block=(self.num_threads, 1, 1), stream=stream)


# (seqlen_q, seqlen_k, causal): fewer queries than keys (the diagonal moves right), more (the
# first rows see no key), equal lengths that are no multiple of the tile, one query
MASK_SHAPES = [(77, 131, True), (300, 77, True), (200, 200, True), (1, 131, True),
               (150, 67, False), (64, 200, False)]


def _mask_cases(seqlen_q, seqlen_k, tile_m, tile_n):
    return [(seqlen_q, seqlen_k, m, n) for m in range(-(-seqlen_q // tile_m))
            for n in range(-(-seqlen_k // tile_n))]


def mask_truth(cases, tile_m, tile_n, causal, offset=None, origin=True, strict=False):
    """(cases, tile_m, tile_n) of 0 / -inf: the mask the kernel applies, or a variant of it (a
    typical slip) that the check uses to name the mistake: ``offset`` replaces seqlen_k -
    seqlen_q, ``origin=False`` forgets the tile's position, ``strict`` also hides the diagonal."""
    out = np.zeros((len(cases), tile_m, tile_n), np.float32)
    r, c = np.arange(tile_m)[:, None], np.arange(tile_n)[None, :]
    for i, (sq, sk, mb, nb) in enumerate(cases):
        row, col = (r + mb * tile_m, c + nb * tile_n) if origin else (r, c)
        hide = col >= sk
        if causal:
            off = sk - sq if offset is None else offset(sq, sk)
            hide = hide | ((col >= row + off) if strict else (col > row + off))
        out[i][np.broadcast_to(hide, (tile_m, tile_n))] = -np.inf
    return out


def run_mask_on_cpu(fn, cases, causal: bool) -> np.ndarray:
    """``MaskHarness(fn).on_cpu`` for ``cases``: the (cases, tile_m, tile_n) result."""
    harness = MaskHarness(fn, causal)
    out = np.full((len(cases), harness.m_block, harness.n_block), np.nan, np.float32)
    table = np.array(cases, dtype=np.int32).reshape(-1, 4)
    harness.on_cpu(from_dlpack(out), from_dlpack(table))
    return out


def _mask_hint(got, live, cases, tm, tn, causal) -> str:
    variants = [
        (dict(origin=False),
         "you compared the tile's own coordinates: tScS[i] is the position inside the tile; "
         "add the tile's origin (row0, col0) to get the query and the key"),
        (dict(offset=lambda sq, sk: 0),
         "you aligned the diagonal to the top left (query i sees keys j <= i). With "
         "seqlen_q != seqlen_k the queries are the last seqlen_q positions of the sequence: "
         "query i sees keys j <= i + seqlen_k - seqlen_q"),
        (dict(offset=lambda sq, sk: sq - sk),
         "the diagonal moved the wrong way: query i sees keys j <= i + seqlen_k - seqlen_q, "
         "not i + seqlen_q - seqlen_k"),
        (dict(strict=True),
         "you also hid the diagonal: query i sees key i + seqlen_k - seqlen_q itself, so mask "
         "j > i + seqlen_k - seqlen_q, not j >="),
        (dict(offset=lambda sq, sk: sk - sq + 1),
         "you let one key too many through: query i sees keys up to i + seqlen_k - seqlen_q "
         "and no further"),
    ]
    for kw, hint in variants:
        if np.array_equal(np.isinf(got[live]),
                          np.isinf(mask_truth(cases, tm, tn, causal, **kw)[live])):
            return hint
    return ""


def check_mask_scores(fn) -> None:
    """Exercise 04.5: ``fn(acc_S, tScS, row0, col0, seqlen_q, seqlen_k, causal)`` run on the CPU
    for every thread of the kernel's default D = 128 tile, for every tile of awkward shapes,
    causal and not; the scores it sets to -inf must be exactly those the kernel masks."""
    tm, tn = MaskHarness(mask_scores).m_block, MaskHarness(mask_scores).n_block
    for causal in (True, False):
        shapes = [(sq, sk) for sq, sk, c in MASK_SHAPES if c == causal]
        cases = [case for sq, sk in shapes for case in _mask_cases(sq, sk, tm, tn)]
        got = run_mask_on_cpu(fn, cases, causal)
        want = mask_truth(cases, tm, tn, causal)
        if np.isnan(got).any() or (np.isfinite(got) & (got != 0)).any():
            raise AssertionError("leave the scores a query may see as they are and set the "
                                 "others to -inf (-cutlass.Float32.inf); nothing else")
        # rows past seqlen_q are computed and never stored: whatever the mask does there is fine
        live = np.stack([np.arange(tm)[:, None] + mb * tm < sq for sq, _, mb, _ in cases])
        live = np.broadcast_to(live, got.shape)
        bad = live & (np.isinf(got) != np.isinf(want))
        if not bad.any():
            continue
        k, r, c = (int(v) for v in np.argwhere(bad)[0])
        sq, sk, mb, nb = cases[k]
        row, col = mb * tm + r, nb * tn + c
        should = "hidden (-inf)" if np.isinf(want[k, r, c]) else "visible"
        what = (f"seqlen_q={sq}, seqlen_k={sk}, {'causal' if causal else 'non-causal'}, tile "
                f"({mb}, {nb}) of {tm} x {tn}: S[{row}, {col}] (query {row}, key {col}) must be "
                f"{should}, and {int(bad.sum())} scores of these tiles are wrong.")
        if col >= sk and not np.isinf(got[k, r, c]):
            hint = (f"keys at and past seqlen_k = {sk} do not exist (the last K tile's rows "
                    "there are zeros): their scores must be -inf too, causal or not")
        else:
            hint = _mask_hint(got, live, cases, tm, tn, causal)
        if not hint and not np.isinf(got).any():
            hint = "nothing was set to -inf"
        raise AssertionError(what + (f" Hint: {hint}." if hint else ""))


def check_mask_on_gpu(fn, shapes=MASK_SHAPES):
    """Exercise 04.5 on a GPU: ``MaskHarness(fn)`` as a kernel, one CTA per tile of each shape,
    against the mask the kernel applies. Returns (ok, lines)."""
    import torch

    lines, ok = [], True
    for causal in (True, False):
        harness = MaskHarness(fn, causal)
        tm, tn = harness.m_block, harness.n_block
        cases = [case for sq, sk, c in shapes if c == causal
                 for case in _mask_cases(sq, sk, tm, tn)]
        out = torch.full((len(cases), tm, tn), float("nan"), device="cuda")
        table = torch.tensor(cases, dtype=torch.int32, device="cuda").reshape(-1, 4)
        tensors = [from_dlpack(out).mark_layout_dynamic(leading_dim=2),
                   from_dlpack(table).mark_layout_dynamic(leading_dim=1)]
        _launch(("mask", fn, causal), lambda: harness, tensors, out.device)
        got = out.cpu().numpy()
        want = mask_truth(cases, tm, tn, causal)
        live = np.broadcast_to(np.stack([np.arange(tm)[:, None] + mb * tm < sq
                                         for sq, _, mb, _ in cases]), got.shape)
        bad = int((live & (np.isinf(got) != np.isinf(want))).sum()) + int(np.isnan(got).sum())
        ok &= bad == 0
        lines.append(f"{'causal' if causal else 'non-causal'}: {len(cases)} tiles of {tm} x {tn}"
                     f", {bad} scores wrong")
    return ok, lines


__all__ = [
    "BOOKKEEPING_REGISTERS",
    "MASK_SHAPES",
    "MaskHarness",
    "QuadReduce",
    "check_mask_on_gpu",
    "check_mask_scores",
    "check_quad_allreduce",
    "check_quad_allreduce_on_gpu",
    "mask_scores",
    "mask_truth",
    "quad_allreduce",
    "run_mask_on_cpu",
    "run_quad_allreduce",
    "KV_TILE_CASES",
    "MMA_SYNC_SHARE",
    "ceiling_lines",
    "cutlass_peer_lines",
    "profile_lines",
    "profile_reading",
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
    "mma_sync_rate_lines",
    "peer_lines",
    "run_spread",
    "spread_line",
    "standing_lines",
    "sweep_findings",
    "tflops_groups",
    "tile_counts",
    "tile_map",
    "visible",
]

