"""Chapters 09-10: chapter 00's cycle model extended to the whole Blackwell softmax.

Chapter 00 (``utils.roofline``) counts three units per forward tile: tensor cores, the exp unit
(MUFU) and shared memory. On a B200 the first two tie at D = 128, so whatever else the softmax
warps do decides whether the tensor cores wait. This model counts that too, per KV step of one
CTA (two Q tiles of 128 rows against one 128-key tile) on one SM:

    MMA     2 tiles x (S = Q K^T and O += P V) FLOPs / 8192 per clock                 (ANCHORS)
    MUFU    exponentials left on MUFU (and one alpha per row) / 16 per clock          (ANCHORS)
    FP32    FMA-pipe lane operations (a packed FFMA2/FADD2/FMUL2 is 2) / 128 per clock (ANCHORS)
    issue   every instruction of the softmax and correction warps / 128 per clock
            (4 schedulers x 1 warp instruction x 32 lanes: MODEL ASSUMPTION, as since Volta)
    SMEM    operand bytes the MMAs read from shared memory / 128 B per clock          (ANCHORS)
    TMEM    bytes the threads move with tcgen05.ld/st (S in, P out, O in and out when it is
            rescaled): no published bandwidth, so the model reports the bandwidth at which this
            traffic alone would take as long as the MMAs (the break-even), not a time

The instructions per score come from the kernel's code (``InstructionMix``: what one row of one
step costs), and ``tests/test_ch09_model.py`` checks them against the compiled sm_100a SASS of
``fa4_final.blackwell.fwd``, so the model and the kernel cannot drift apart. Every figure this
module prints is labelled *model*; the paper's are labelled *paper*; nothing here is measured.
Two simplifications, stated: the ALU pipe (FMNMX, FSEL, integer) is counted in issue slots only,
and the MMA engine is assumed to run at its peak whenever its operands are ready.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from utils.hardware import PER_SM

B200 = PER_SM["sm_100"]
ISSUE_PER_CLK = 4 * 32  # model assumption: 4 warp schedulers, one instruction each per clock
TILE_M = TILE_N = 128
Q_STAGES = 2
ELEM_BYTES = 2

# What the paper says (ANCHORS.md), for the checks below: labelled "paper" wherever printed.
PAPER = {
    "emulated share of a row": (0.10, 0.25),
    "rescale threshold (log2)": 8.0,
    "forward bf16 on B200, fraction of peak": 0.71,
    "forward bf16 on B200, TFLOP/s": 1613,
}
# FA4 4.0.0b36's own choices (flash_fwd_sm100.py _TUNING_CONFIG; package settings, not figures)
FA4_EMULATED_SHARE = {"d128 non-causal 2-CTA": Fraction(3, 16), "d128 causal": Fraction(1, 8)}


@dataclass(frozen=True)
class InstructionMix:
    """Thread instructions per score of one KV step of the Blackwell softmax, by class.

    From ``RowSoftmax`` and ``softmax_step``: one FFMA2 scales and subtracts two scores, one
    3-input FMNMX folds two into the row max, one FADD2 adds two to the row sum, one F2FP packs
    two probabilities to 16 bits, MUFU takes one exponential; tcgen05.ld brings 32 columns per
    instruction, tcgen05.st 16 words = 32 probabilities. An emulated pair (``exp2_poly2``)
    replaces two MUFU by 2 clamps (FMNMX), 3 FADD2 (floor, n, fraction), 3 FFMA2 (Horner,
    degree 3) and the integer exponent add (about 4.4 SASS instructions per pair after ptxas,
    shl / add / add fused into LEA and IADD3); a masked step adds a compare and a select per
    score."""

    ffma2: float = 0.5
    fmnmx: float = 0.5
    fadd2: float = 0.5
    f2fp: float = 0.5
    mufu: float = 1.0
    ldtm: float = 1 / 32
    sttm: float = 1 / 32
    emulated_pair: tuple = (("ffma2", 3), ("fadd2", 3), ("fmnmx", 2), ("integer", 4.4),
                            ("mufu", -2))
    masked: tuple = (("isetp", 1), ("fsel", 1))

    def per_score(self, emulated: float = 0.0, masked: bool = False) -> dict[str, float]:
        out = {k: getattr(self, k) for k in ("ffma2", "fmnmx", "fadd2", "f2fp", "mufu", "ldtm",
                                              "sttm")}
        out["integer"] = 0.0
        for k, v in self.emulated_pair:
            out[k] = out.get(k, 0.0) + emulated * v / 2
        if masked:
            for k, v in self.masked:
                out[k] = out.get(k, 0.0) + v
        return out


MIX = InstructionMix()
FP32_OPS = {"ffma2": 2, "fadd2": 2, "fmul2": 2}  # lane operations per thread instruction


class _UnitCycles:
    """Cycles per unit of one step (the fields named in UNITS), and which of them binds."""

    UNITS = ("mma", "mufu", "fp32", "issue", "smem")

    @property
    def cycles(self) -> dict[str, float]:
        return {u: getattr(self, u) for u in self.UNITS}

    @property
    def bound(self) -> float:
        return max(self.cycles.values())

    @property
    def binding(self) -> tuple[str, ...]:
        return tuple(u for u, c in self.cycles.items() if math.isclose(c, self.bound))


@dataclass(frozen=True)
class StepCycles(_UnitCycles):
    """One KV step of one CTA on one SM: cycles per unit, TMEM bytes, and what binds."""

    d: int
    two_cta: bool
    emulated: float
    rescale_share: float
    mma: float
    mufu: float
    fp32: float
    issue: float
    smem: float
    tmem_bytes: float

    @property
    def mma_fraction(self) -> float:
        """Best fraction of tensor-core peak the step allows if every unit overlaps (model)."""
        return self.mma / self.bound

    @property
    def headroom(self) -> float:
        """How far the busiest non-MMA unit stays below the MMA time (negative: it binds)."""
        return 1 - max(c for u, c in self.cycles.items() if u != "mma") / self.mma

    @property
    def tmem_break_even(self) -> float:
        """TMEM bytes per clock at which the threads' TMEM traffic takes the MMA time."""
        return self.tmem_bytes / self.mma

    def __str__(self) -> str:
        parts = ", ".join(f"{u} {c:.0f}" for u, c in self.cycles.items())
        return (f"D={self.d}{' 2-CTA' if self.two_cta else ''} emulated {self.emulated:.3g}, "
                f"rescaled {self.rescale_share:.0%}: {parts} cycles -> bound by "
                f"{'+'.join(self.binding)}, MMA at most {self.mma_fraction:.0%} busy (model)")


def step_cycles(d: int = 128, two_cta: bool = False, emulated: float = 0.125,
                rescale_share: float = 1.0, masked: bool = False,
                mix: InstructionMix = MIX, fig=B200) -> StepCycles:
    """Cycles of one KV step (two Q tiles x 128 rows x 128 keys) of one CTA on one SM.

    ``rescale_share``: the fraction of (warp, step) pairs where the correction warp's vote says
    "multiply O" (1 = always, as without conditional rescaling)."""
    if not 0 <= emulated <= 1 or not 0 <= rescale_share <= 1:
        raise ValueError("emulated and rescale_share are fractions in [0, 1]")
    scores = Q_STAGES * TILE_M * TILE_N
    rows = Q_STAGES * TILE_M
    mma = Q_STAGES * 4 * TILE_M * TILE_N * d / fig.mma_flops_per_clk
    per = mix.per_score(emulated, masked)
    mufu = (scores * per["mufu"] + rows) / fig.exp2_per_clk  # + one alpha per row
    fp32_ops = scores * sum(per.get(k, 0) * w for k, w in FP32_OPS.items())
    softmax_instr = scores * sum(per.values())
    # correction, per rescaled tile: D/16 x (tcgen05.ld x16, 8 FMUL2, tcgen05.st x16) per row
    rescaled_rows = rows * rescale_share
    fp32_ops += rescaled_rows * d * 1  # one multiply per element (FMUL2 = 2 per instruction)
    correction_instr = rescaled_rows * (d / 2 + 2 * d / 16) + rows * 4  # + stats, vote, release
    issue = (softmax_instr + correction_instr) / ISSUE_PER_CLK
    # shared memory: each MMA reads A (Q) and B (K, V) tiles; a pair halves every B per SM
    b_share = 0.5 if two_cta else 1.0
    smem = Q_STAGES * (TILE_M * d + b_share * TILE_N * d + b_share * TILE_N * d) * ELEM_BYTES
    # threads' TMEM traffic: S in (fp32), P out (16-bit), O in and out when rescaled (fp32)
    tmem = scores * 4 + scores * ELEM_BYTES + rescaled_rows * d * 4 * 2
    return StepCycles(d, two_cta, float(emulated), float(rescale_share), mma, mufu,
                      fp32_ops / fig.fma_per_clk, issue, smem / fig.smem_bytes_per_clk, tmem)


# ----------------------------------------------------------------------------------------------
# chapter 09: exp2 emulation and conditional rescaling on a B200 (model)


def emulation_window(d: int = 128, rescale_share: float = 1.0, two_cta: bool = False) -> dict:
    """Where emulating a share f of the exponentials keeps every unit at or below the MMA:
    f_min (MUFU falls to the MMA time), f_balance (MUFU equals the next-busiest unit: the most
    headroom), f_max (FP32 or issue reaches the MMA). Continuous f, solved on a fine grid."""
    grid = [i / 4096 for i in range(4097)]
    steps = [step_cycles(d, two_cta, f, rescale_share) for f in grid]
    ok = [s for s in steps if s.mufu <= s.mma and max(s.fp32, s.issue) <= s.mma]
    best = max(steps, key=lambda s: s.headroom)
    return {"f_min": ok[0].emulated if ok else None, "f_max": ok[-1].emulated if ok else None,
            "f_balance": best.emulated, "headroom_at_balance": best.headroom,
            "binding_at_0": steps[0].binding}


def emulation_table(d: int = 128, shares=(0, Fraction(1, 8), Fraction(3, 16), Fraction(1, 4),
                                           Fraction(3, 8), Fraction(1, 2)),
                    rescale_share: float = 1.0, two_cta: bool = False) -> list[StepCycles]:
    return [step_cycles(d, two_cta, float(f), rescale_share) for f in shares]


def rescale_shares(seqlen_k: int = 4096, seed: int = 0) -> dict[str, float]:
    """How often a Blackwell correction warp (32 rows, one per thread) must multiply O, on
    random inputs in the kernel's KV order, without (tau = 0) and with the threshold (tau = 8):
    chapter 07's statistics (computed on the CPU, model input)."""
    from solutions import ch07_rescaling as ch07

    out = {}
    for label, tau in (("tau=0 (every growth)", 0.0), ("tau=8", ch07.FA4_RESCALE_THRESHOLD)):
        row = ch07.rescale_frequency(patterns=("random",), orders=("reverse",), tau=tau,
                                     group_rows=(ch07.BLACKWELL_WARP_ROWS,),
                                     seqlen_k=seqlen_k, seqlen_q=128, heads=2, seed=seed)[0]
        out[label] = row[f"group{ch07.BLACKWELL_WARP_ROWS}"]
    return out


def rescale_effect(d: int = 128, emulated: float = 0.125, shares: dict | None = None) -> list:
    """(label, StepCycles) for always rescaling and for the shares of ``rescale_shares``."""
    shares = shares if shares is not None else rescale_shares()
    rows = [("always (no threshold, worst case)", step_cycles(d, False, emulated, 1.0))]
    rows += [(label, step_cycles(d, False, emulated, r)) for label, r in shares.items()]
    return rows


def paper_checks(d: int = 128) -> list[dict]:
    """The model's figures next to the paper's statements (ANCHORS.md)."""
    from utils import roofline

    tile = roofline.tile_cycles("B200", "fwd", 128, 128, d)
    win = emulation_window(d)
    lo, hi = PAPER["emulated share of a row"]
    best = step_cycles(d, False, 0.125, 0.0)
    return [
        {"statement (paper)": "B200 tile: MMA 1024, exp 1024, shared memory 768 cycles",
         "model": f"MMA {tile.mma:.0f}, exp {tile.exp:.0f}, SMEM {tile.smem:.0f}",
         "agrees": (tile.mma, tile.exp, tile.smem) == (1024, 1024, 768)},
        {"statement (paper)": f"emulate {lo:.0%}-{hi:.0%} of each row",
         "model": (f"MMA-bound for f in [{win['f_min']:.3f}, {win['f_max']:.3f}], most headroom "
                   f"at f = {win['f_balance']:.3f}"),
         "agrees": win["f_min"] <= lo and hi <= win["f_max"]},
        {"statement (paper)": f"{PAPER['forward bf16 on B200, fraction of peak']:.0%} of peak "
                              "(1613 TFLOP/s)",
         "model": f"a step allows at most {best.mma_fraction:.0%} (an upper bound)",
         "agrees": best.mma_fraction >= PAPER["forward bf16 on B200, fraction of peak"]},
    ]


# ----------------------------------------------------------------------------------------------
# chapter 10: when 2-CTA pays (model)


def smem_per_step(d: int) -> dict[str, float]:
    """Shared-memory cycles per KV step per SM, 1-CTA and 2-CTA, against the MMA's."""
    one, two = step_cycles(d, False), step_cycles(d, True)
    return {"mma": one.mma, "smem 1-CTA": one.smem, "smem 2-CTA": two.smem}


def schedule(seqlen: int, heads: int, batch: int, causal: bool, two_cta: bool,
             sms: int = B200.sms) -> dict:
    """The persistent grid's makespan in KV steps (each step one 128-key tile for 256 rows per
    SM, so equal cost on both variants) and its efficiency: the useful scores (visible ones)
    over what the grid's SMs could compute in that time."""
    from fa4_final.common.schedule import tile_coords, tiles_of_cta
    from fa4_final.common.tiles import TileWindow, kv_tile_range

    ctas = 2 if two_cta else 1
    tile_m = Q_STAGES * TILE_M * ctas
    grid = max(1, sms // ctas)
    w = TileWindow(tile_m, TILE_N, causal)
    num_m = -(-seqlen // tile_m)
    num_tiles = num_m * heads * batch
    steps = []
    for t in range(num_tiles):
        m_block, _, _ = tile_coords(t, num_m, heads, batch, longest_first=causal)
        n_min, n_max, _, _ = kv_tile_range(w, m_block, seqlen, seqlen)
        steps.append(n_max - n_min)
    busy = [sum(steps[t] for t in tiles_of_cta(c, min(grid, num_tiles), num_tiles))
            for c in range(min(grid, num_tiles))]
    makespan = max(busy)
    useful = heads * batch * (seqlen * (seqlen + 1) / 2 if causal else seqlen * seqlen)
    per_sm_step = Q_STAGES * TILE_M * TILE_N  # scores one SM computes per step
    capacity = sms * makespan * per_sm_step
    return {"makespan_steps": makespan, "efficiency": useful / capacity,
            "computed_scores": sum(steps) * per_sm_step * ctas, "useful_scores": useful}


def pair_verdict(seqlen: int, d: int = 128, causal: bool = False, tokens: int = 16384,
                 heads: int = 16) -> dict:
    """1-CTA against 2-CTA at one problem: the per-step bound (shared memory halved) times the
    schedule's efficiency (tiles twice as tall): the predicted fraction of MMA peak (model)."""
    batch = max(1, tokens // seqlen)
    out = {}
    for two in (False, True):
        s = step_cycles(d, two, 0.125, 0.0)
        sch = schedule(seqlen, heads, batch, causal, two)
        out["2-CTA" if two else "1-CTA"] = {"step": s.mma_fraction,
                                           "schedule": sch["efficiency"],
                                           "predicted": s.mma_fraction * sch["efficiency"]}
    one, two = out["1-CTA"]["predicted"], out["2-CTA"]["predicted"]
    out["verdict"] = "ties" if math.isclose(one, two, rel_tol=0.005) else \
        "pays" if two > one else "loses"
    out["pays"] = out["verdict"] == "pays"
    return out


def with_mix(**changes) -> InstructionMix:
    return replace(MIX, **changes)


# ----------------------------------------------------------------------------------------------
# chapter 12: one step of the Blackwell backward (model)
#
# A step of fa4_final.blackwell.bwd: one CTA's 128 keys against one 128-query tile, five GEMMs
# (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ = dS K), 128 x 128 scores, each
# turned into P^T and dS^T by the two compute warpgroups (one key row of 64 queries a thread).


@dataclass(frozen=True)
class BwdMix:
    """Compute-warp SASS instructions per score of one backward step, from the compiled kernel
    (``results/compile/sm100_bwd_vs_fa4.json``, role "compute", two step copies of 64 scores a
    thread; tests/test_ch09_model.py checks them): the exponent argument s * scale - lse (FFMA),
    dP - delta (FADD), P (dP - delta) (FMUL), exp2 (MUFU), P^T and dS^T packed to 16 bits
    (F2FP, one per pair each), a select per score that ptxas keeps in both copies (FSEL), lse
    and delta read as 16-byte broadcasts (LDS: 2 x 64 / 4 per 64 scores), dS^T stored 16 bytes
    at a time (STS), S^T and dP^T loaded 64 columns per warpgroup (LDTM), P^T stored (STTM).
    ``packed``: FA4's form, the three FP32 operations in FFMA2 / FADD2 / FMUL2 pairs."""

    ffma: float = 1.0
    fadd: float = 1.0
    fmul: float = 1.0
    mufu: float = 1.0
    f2fp: float = 1.0
    fsel: float = 1.0
    lds: float = 0.5
    sts: float = 1 / 8
    ldtm: float = 1 / 32
    sttm: float = 1 / 64
    packed: bool = False

    def per_score(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in ("ffma", "fadd", "fmul", "mufu", "f2fp", "fsel",
                                              "lds", "sts", "ldtm", "sttm")}
        if self.packed:
            for k in ("ffma", "fadd", "fmul"):
                out[k + "2"] = out.pop(k) / 2
        return out

    def fp32_lane_ops(self) -> float:
        return self.ffma + self.fadd + self.fmul  # packed or not: the same lane operations


BWD_MIX = BwdMix()
FA4_BWD_MIX = replace(BWD_MIX, packed=True)


@dataclass(frozen=True)
class BwdStepCycles(_UnitCycles):
    """One backward step of one CTA (per SM) in cycles per unit, and the bytes with no
    published bandwidth (TMEM, global float32 adds) as break-even rates (model)."""

    d: int
    two_cta: bool
    mma: float
    mufu: float
    fp32: float
    issue: float
    smem: float
    in_order: float  # the step's chain when a step's five GEMMs issue in order (ours)
    tmem_bytes: float
    reduce_bytes: float
    smem_items: tuple
    dsmem_bytes: float = 0.0  # 2-CTA: dS written into the peer CTA per step

    @property
    def mma_fraction(self) -> float:
        return self.mma / max(self.bound, self.in_order)

    def break_even(self, nbytes: float) -> float:
        """Bytes per clock per SM at which ``nbytes`` per step take as long as the MMAs."""
        return nbytes / self.mma

    def reduce_break_even_tb_s(self, fig=B200) -> float:
        """The chip's global float32-add rate (TB/s) at which dQ's adds take the MMA time."""
        return fig.chip_peak(self.break_even(self.reduce_bytes)) / 1e12

    def table(self) -> list[dict]:
        rows = [{"resource": u, "cycles per step": round(c), "label": "model"}
                for u, c in self.cycles.items()]
        rows.append({"resource": "in-order chain (ours)", "cycles per step":
                     round(self.in_order), "label": "model"})
        rows.append({"resource": "TMEM ld/st by threads", "cycles per step":
                     f"{self.tmem_bytes / 1024:.0f} KB: break-even "
                     f"{self.break_even(self.tmem_bytes):.0f} B/clk", "label": "model"})
        rows.append({"resource": "global float32 adds (dQ)", "cycles per step":
                     f"{self.reduce_bytes / 1024:.0f} KB: break-even "
                     f"{self.break_even(self.reduce_bytes):.0f} B/clk/SM = "
                     f"{self.reduce_break_even_tb_s():.1f} TB/s chip", "label": "model"})
        if self.dsmem_bytes:
            rows.append({"resource": "dS exchange into the peer (DSMEM)", "cycles per step":
                         f"{self.dsmem_bytes / 1024:.0f} KB: hidden behind dK at >= "
                         f"{self.dsmem_bytes / (self.mma / 5):.0f} B/clk", "label": "model"})
        return rows

    @property
    def limit(self) -> str:
        """What sets the step time: the busiest unit, or the in-order chain when longer."""
        return "in-order chain" if self.in_order > self.bound else "+".join(self.binding)

    def __str__(self) -> str:
        parts = ", ".join(f"{u} {c:.0f}" for u, c in self.cycles.items())
        return (f"bwd D={self.d} {'2-CTA' if self.two_cta else '1-CTA'}: {parts} cycles, "
                f"in-order chain {self.in_order:.0f} -> bound by {self.limit}, MMA "
                f"at most {self.mma_fraction:.0%} busy (model)")


def bwd_step_cycles(d: int = 128, two_cta: bool = False, mix: BwdMix = BWD_MIX,
                    ds_for_dk_in_smem: bool | None = None, fig=B200) -> BwdStepCycles:
    """Cycles of one backward step (128 keys of this SM x 128 queries) on one SM.

    Shared memory: chapter 00's backward traffic (``utils.roofline.smem_traffic``: the GEMMs'
    smem operands, dS stored, dQ staged and read back by the bulk add), plus what this kernel
    does on top: dK += dS^T Q reads A = dS^T from shared memory (``ds_for_dk_in_smem``: chapter
    00 assumes it on chip), and the compute warps' lse / delta broadcasts (one 128-byte
    wavefront per warp instruction: MODEL ASSUMPTION). 2-CTA: the pair kernel as built
    (fa4_final.blackwell.bwd_pair), corrected where chapter 00's tile differs from it: the B
    operands of S^T, dP^T, dV, dK halve per CTA, but dQ's B (Kt, D/2 x the pair's 256 keys) does
    not, its K doubling as its N halves; dS for dQ is 16 KB stored by the CTA's own warpgroup and
    16 KB written by the peer (DSMEM), not 32 KB stored; each CTA stages and adds half of dQ;
    dK's A (dS^T) is read from TMEM at every D (``ds_for_dk_in_smem`` None: that choice), which
    adds a 16-bit dS^T store to the TMEM traffic. The exchange's 16 KB per step have no
    published rate: a break-even rate, like TMEM's (``dsmem_bytes``)."""
    from utils import roofline

    ctas = 2 if two_cta else 1
    keys, queries = TILE_N, TILE_M  # per SM
    scores = keys * queries
    mma = 5 * 2 * keys * queries * d / fig.mma_flops_per_clk
    mufu = scores * mix.mufu / fig.exp2_per_clk
    fp32 = scores * mix.fp32_lane_ops() / fig.fma_per_clk
    issue = scores * sum(mix.per_score().values()) / ISSUE_PER_CLK
    items = list(roofline.smem_traffic("B200", "bwd", keys, queries, d, ctas, ELEM_BYTES))
    dsmem = 0.0
    if two_cta:
        exchanged = keys * queries * ELEM_BYTES / 2  # one warpgroup's dS: 16 KB
        pair = []
        for w, b in items:
            if w.startswith("dQ fp32"):  # each CTA stages and adds half of dQ's columns
                pair.append((w, b / 2))
            elif w.startswith("dQ = dS K: read B"):  # Kt: D/2 x 256 keys, not halved
                pair.append(("dQ = dS K: read B = Kt (D/2 x 256 keys)", b * 2))
            elif w.startswith("dS store"):
                pair += [("dS store, own queries (A operand of dQ)", exchanged),
                         ("dS half from the peer CTA (DSMEM write)", exchanged)]
            else:
                pair.append((w, b))
        items, dsmem = pair, exchanged
    if ds_for_dk_in_smem is None:
        ds_for_dk_in_smem = not two_cta
    if ds_for_dk_in_smem:
        items.append(("dK += dS^T Q: read A = dS^T", keys * queries * ELEM_BYTES))
    warps = 2 * 4  # two compute warpgroups
    lds_per_warp = mix.lds * scores / (warps * 32)
    items.append(("lse, delta broadcasts (wavefronts x 128 B)", warps * lds_per_warp * 128))
    smem = sum(b for _, b in items) / fig.smem_bytes_per_clk
    gemm = mma / 5
    per_warpgroup = scores / 2 / (ISSUE_PER_CLK / 2)  # a warpgroup's share of issue per score
    ds_time = per_warpgroup * (mix.fadd + mix.fmul + mix.f2fp / 2 + mix.sts) / 2
    # S^T(i) -> exp (MUFU) beside dP^T(i) -> dV(i) beside dS^T(i) -> dK(i), dQ(i) -> S^T(i+1)
    # (2-CTA: dQ(i) also waits for the peer's dS; hidden behind dK(i) below the break-even)
    in_order = gemm + max(mufu, gemm) + max(gemm, ds_time) + 2 * gemm
    ds_t_in_tmem = 0 if ds_for_dk_in_smem else ELEM_BYTES
    tmem = scores * (4 + 4 + ELEM_BYTES + ds_t_in_tmem) + queries * d * 4 / ctas
    reduce_bytes = queries * d * 4 / ctas
    return BwdStepCycles(d, two_cta, mma, mufu, fp32, issue, smem, in_order, tmem,
                         reduce_bytes, tuple(items), dsmem)
