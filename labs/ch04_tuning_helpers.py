"""Helpers of labs/ch04_tuning.ipynb: what ptxas made of every tile chapter 04 sweeps, bank
conflicts in the kernel's padded and swizzled shared memory, the instruction mix of one compiled KV
step and the Hopper ceilings it implies, and the stored runs read as lines: the tile sweep and what
each knob did (against the spread of the same kernel between runs), the softmax ablation, the
CUTLASS example comparison and the Nsight Compute profile. Every figure comes from a results file
or a compile; nothing here needs a GPU."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass.cute.runtime import from_dlpack

from solutions import ch04_flash_ampere as fa
from solutions import ch04_teaching as t4
from utils import layout_plots as lp
from utils.claims import claim
from utils.hardware import PER_SM

TileConfig = fa.TileConfig
ELEM_BYTES = t4.ELEM_BYTES
REGISTER_LIMIT = t4.REGISTER_LIMIT
MMA_SYNC_SHARE = t4.MMA_SYNC_SHARE
LEVEL = t4.LEVEL
STANDING = t4.STANDING
config_name = t4.config_name
register_estimate = t4.register_estimate
compiled = t4.compiled
resources = t4.resources
ctas_per_sm = t4.ctas_per_sm
row_config = t4.row_config
_median = t4._median
_kernel = t4._kernel


# ================================================================================================
# What ptxas made of each tile
# ================================================================================================
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
# Bank conflicts in the kernel's shared memory
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
# The instruction mix of one compiled KV step, and the Hopper ceilings it implies
# ================================================================================================
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
    chip would reach if that unit were the only limit: 132 SMs at the 1.98 GHz maximum boost clock
    that utils.hardware.PER_SM assumes (NVIDIA's datasheet peak, 989 TFLOP/s dense bf16, is the
    wgmma rate at 1.83 GHz). Rows: (what, cycles, TFLOP/s)."""
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


# ================================================================================================
# The stored runs: the CUTLASS comparison, the sweep, the spread between runs, the profile
# ================================================================================================
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
# Claims the lab's prose makes (tests/test_claims.py checks each on its file)
# ================================================================================================


def _run_spread_of_ch04() -> float:
    from utils.results import load

    spread = run_spread(*(load(n) for n in ("ch04_fwd", "ch04_sweep", "ch04_cutlass_peer")))
    return spread["spread"] if spread else 0.0


def _tile_ratio(res, d, causal, a: dict, b: dict):
    ra, rb = _sweep_row(res.rows, d, causal, **a), _sweep_row(res.rows, d, causal, **b)
    return None if ra is None or rb is None else ra["tflops"] / rb["tflops"]


@claim("04.lab_three_stages_slower", "ch04_sweep",
       "at D = 128 non-causal, three stages run slower than two (both with 4 k-slices per "
       "trip), by more than the spread of the same kernel between runs")
def _three_stages_slower(res):
    ratio = _tile_ratio(res, 128, False, {"qk_unroll": 4, "num_stages": 3},
                        {"qk_unroll": 4, "num_stages": 2})
    spread = _run_spread_of_ch04()
    return ratio is not None and ratio < 1 - spread, (f"3 vs 2 stages {ratio:.3f}, "
                                                      f"spread {spread:.3f}")


@claim("04.lab_skip_rescale_within_noise", "ch04_sweep",
       "skipping the O rescale changes the default sm_90 tile's speed by less than the spread of "
       "the same kernel between runs")
def _skip_rescale_within_noise(res):
    ratio = _tile_ratio(res, 128, False, {"qk_unroll": 4, "num_stages": 2, "skip_rescale": True},
                        {"qk_unroll": 4, "num_stages": 2})
    spread = _run_spread_of_ch04()
    return ratio is not None and abs(ratio - 1) <= spread, f"{ratio:.3f}, spread {spread:.3f}"


@claim("04.lab_unrolled_d64_faster", "ch04_sweep",
       "at D = 64 the fully unrolled QK^T loop (4 slices per trip) beats one slice per trip by "
       "more than the spread between runs, and spills nothing")
def _unrolled_d64_faster(res):
    ratio = _tile_ratio(res, 64, False, {"qk_unroll": 4}, {"qk_unroll": 1})
    row = _sweep_row(res.rows, 64, False, qk_unroll=4)
    spread = _run_spread_of_ch04()
    ok = ratio is not None and ratio > 1 + spread and row.get("stack_bytes") == 0
    return ok, f"{ratio:.3f}, spread {spread:.3f}, stack {row.get('stack_bytes')}"


@claim("04.lab_softmax_costs_a_sixth", "ch04_sweep",
       "leaving the softmax out makes each ablated tile between 10% and 25% faster in time: the "
       "softmax costs a sixth of the step, give or take")
def _softmax_costs(res):
    shares = []
    rows = [r for r in res.rows if r["d"] == 128 and not r["causal"]]
    for ab in (r for r in rows if r.get("impl") == fa.ABLATION_IMPL):
        full = next(r for r in rows if r.get("impl") != fa.ABLATION_IMPL
                    and row_config(r) == row_config(ab))
        shares.append(1 - full["tflops"] / ab["tflops"])
    return bool(shares) and all(0.10 <= s <= 0.25 for s in shares), f"shares {shares}"


@claim("04.lab_level_with_cutlass", "ch04_cutlass_peer",
       "flash_ampere and CUTLASS's own Ampere FA2 example are level (medians within 3%) on both "
       "inputs, causal or not")
def _level_with_cutlass(res):
    lines = peer_lines(res)
    return bool(lines) and all("(level)" in ln for ln in lines), "; ".join(lines)


@claim("04.lab_integers_faster_non_causal", "ch04_cutlass_peer",
       "non-causal, every implementation ran faster on small integers than on normal values in "
       "every round (its slowest integer round beats its fastest normal one)")
def _integers_faster(res):
    out = []
    for impl in dict.fromkeys(r["impl"] for r in res.rows):
        a = [r["tflops"] for r in res.rows if r["impl"] == impl and not r["causal"]
             and r["data"] == "randn"]
        b = [r["tflops"] for r in res.rows if r["impl"] == impl and not r["causal"]
             and r["data"] != "randn"]
        out.append((impl, min(b) > max(a)))
    return all(ok for _, ok in out), str(out)


@claim("04.lab_no_unit_saturated", "ch04_profile",
       "in the profile neither the tensor pipe nor the issue slots are near full (both under "
       "80% of the cycles)")
def _no_unit_saturated(res):
    by = {r["metric"]: r["value"] for r in res.rows}
    busy, issue = by["tensor_pipe_active_pct"], by["issue_slots_busy_pct"]
    return busy < 80 and issue < 80, f"tensor pipe {busy:.0f}%, issue slots {issue:.0f}%"


@claim("04.lab_two_stages_alone_within_noise", "ch04_sweep",
       "with 4 k-slices per trip, a second stage alone changes the speed by less than the "
       "spread of the same kernel between runs")
def _two_stages_alone(res):
    ratio = _tile_ratio(res, 128, False, {"qk_unroll": 4, "num_stages": 2}, {"qk_unroll": 4})
    spread = _run_spread_of_ch04()
    return ratio is not None and abs(ratio - 1) <= spread, f"{ratio:.3f}, spread {spread:.3f}"


@claim("04.lab_short_of_ceiling_without_softmax", "ch04_sweep",
       "even without its softmax each ablated tile stays below 80% of the mma.sync ceiling "
       "measured by the microbenchmark")
def _short_of_ceiling(res):
    from utils.results import load

    peak = load("microbench").one(metric="mma_sync_tflops")["value"]
    shares = [r["tflops"] / peak for r in res.rows if r.get("impl") == fa.ABLATION_IMPL]
    return bool(shares) and max(shares) < 0.8, f"shares of the ceiling {shares}"
