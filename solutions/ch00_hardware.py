"""Chapter 00: the exercises on the cycle model (the model itself is ``utils/roofline.py``), the
chip's peak with the clock each figure assumes, and the reading of the stored microbenchmark.

00.1  write the forward tile's cycles by hand, per unit, for any GPU and tile;
00.2  the head dim at which the tensor cores and the exp unit tie, for any per-SM figures;
00.3  the narrowest KV tile whose matmuls outlast its shared-memory reads (or None).

Each checker refuses an answer that asks ``utils.roofline`` for the cycles (``forbid=``): the
exercises are about doing the count, not about calling the model that does it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from utils import hardware, roofline
from utils.claims import claim
from utils.hardware import PER_SM, ArchFigures

# What the prompts forbid: the model's own counting (the reference is refused anyway).
_MODEL_FORBID = {
    roofline.tile_cycles: "that is the cycle model itself; count the work and divide by the "
                          "per-clock rates yourself",
    roofline.what_if: "it runs the cycle model for you; count the work yourself",
    roofline.smem_traffic: "it lists the shared-memory bytes for you; that count is the "
                           "exercise",
    roofline.tile_matmuls: "it lists the tile's matmuls for you; write them down yourself",
}
FORWARD_FORBID = dict(_MODEL_FORBID)
TIE_FORBID = dict(_MODEL_FORBID)
NARROWEST_FORBID = dict(_MODEL_FORBID)


# ----------------------------------------------------------------------------------------------
# 00.1 The forward tile by hand


def forward_tile_cycles(arch: str, m: int, n: int, d: int) -> dict:
    """Reference for 00.1: {'mma': .., 'exp': .., 'smem': ..} cycles of one forward tile."""
    return roofline.tile_cycles(arch, "fwd", m, n, d).cycles


def _diagnose_smem(arch: str, m: int, n: int, d: int, got: float) -> str:
    """Match a wrong shared-memory count against the usual mistakes."""
    fig = PER_SM[roofline.GPUS[arch]]
    issue = roofline.MMA_ISSUE[roofline.GPUS[arch]]
    rereads = math.ceil(m / issue.rows_per_instruction)
    per = fig.smem_bytes_per_clk
    guesses = [  # in order: the first match wins (two mistakes can give the same number)
        ((m * d + 2 * n * d) * 2 / per, "on Hopper an M=64 wgmma reads all of B: a tile of "
         f"{m} rows is {rereads} warpgroups, so K and V are each read {rereads} times"),
        ((m * d + 2 * rereads * n * d + m * n) * 2 / per, "P does not come from shared memory:"
         f" it is read from {issue.on_chip_a} (the A operand may live there)"),
        ((m * d + 2 * rereads * n * d) / per, "count bytes, not elements: bf16 is 2 bytes"),
        ((m * d + rereads * n * d) * 2 / per, "O = P V reads V from shared memory too"),
        ((2 * rereads * n * d) * 2 / per, "Q is read from shared memory by S = Q K^T at every "
         "KV tile: count it too"),
    ]
    for value, hint in guesses:
        if math.isclose(got, value, rel_tol=1e-6):
            return hint
    return ("count the operands each MMA reads from shared memory: Q and K for S = Q K^T, V for "
            "O = P V; B is read once per instruction of "
            f"{issue.rows_per_instruction} rows")


def check_forward_tile_cycles(fn) -> None:
    """00.1: ``fn(arch, m, n, d) -> dict`` with keys 'mma', 'exp', 'smem' (cycles per SM)."""
    cases = [("B200", 128, 128, 128), ("B200", 128, 128, 64), ("B200", 128, 128, 256),
             ("H100", 128, 128, 128), ("H100", 192, 128, 64), ("B300", 128, 176, 96)]
    for arch, m, n, d in cases:
        got = fn(arch, m, n, d)
        where = f"{arch}, M={m}, N={n}, D={d}"
        if not isinstance(got, dict) or set(got) != set(roofline.UNITS):
            raise AssertionError(f"return a dict with keys {roofline.UNITS}, got {got!r}")
        want = roofline.tile_cycles(arch, "fwd", m, n, d).cycles
        fig = PER_SM[roofline.GPUS[arch]]
        if not math.isclose(got["mma"], want["mma"], rel_tol=1e-6):
            ratio = got["mma"] / want["mma"] if want["mma"] else float("nan")
            hint = ("a tile does two matmuls (S = Q K^T and O = P V), 2*M*N*D FLOPs each"
                    if math.isclose(ratio, 0.5) else
                    f"divide the FLOPs by {fig.mma_flops_per_clk} FLOP per clock per SM")
            raise AssertionError(f"mma: {got['mma']:.0f} cycles, expected {want['mma']:.0f} "
                                 f"({where}): {hint}")
        if not math.isclose(got["exp"], want["exp"], rel_tol=1e-6):
            raise AssertionError(f"exp: {got['exp']:.0f} cycles, expected {want['exp']:.0f} "
                                 f"({where}): one exp per score, M*N of them, "
                                 f"{fig.exp2_per_clk} per clock per SM")
        if not math.isclose(got["smem"], want["smem"], rel_tol=1e-6):
            raise AssertionError(f"smem: {got['smem']:.0f} cycles, expected {want['smem']:.0f} "
                                 f"({where}): {_diagnose_smem(arch, m, n, d, got['smem'])}")


# ----------------------------------------------------------------------------------------------
# 00.2 Where the tensor cores and the exp unit tie


def tie_head_dim(fig: ArchFigures) -> float:
    """Reference for 00.2: the head dim D at which a forward tile's MMA cycles equal its exp
    cycles, for an SM with the per-clock figures ``fig``: 4 M N D / F = M N / E, so D = F / 4E
    (whatever the tile's M and N)."""
    return fig.mma_flops_per_clk / (4 * fig.exp2_per_clk)


def tie_cases() -> list[tuple[str, ArchFigures]]:
    """The SMs 00.2 is checked on: the three real ones and three invented ones (the answer must
    come from the figures, not from a table of GPU names)."""
    b200 = PER_SM["sm_100"]
    return [("H100", PER_SM["sm_90"]), ("B200", b200), ("B300", PER_SM["sm_103"]),
            ("an SM with 4x B200's tensor cores", replace(b200, name="invented 1",
                                                          mma_flops_per_clk=32768)),
            ("an SM with 8 exp/clk and 2048 FLOP/clk", replace(b200, name="invented 2",
                                                                mma_flops_per_clk=2048,
                                                                exp2_per_clk=8)),
            ("an SM with 64 exp/clk", replace(b200, name="invented 3", exp2_per_clk=64))]


def check_tie_head_dim(fn) -> None:
    """00.2: ``fn(fig) -> D`` where MMA and exp cycles of a forward tile are equal."""
    answers = [(name, fig, fn(fig)) for name, fig in tie_cases()]
    for name, _, got in answers:
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            raise AssertionError(f"return a number (the head dim), got {got!r} for {name}")
    if len({got for _, _, got in answers}) == 1:
        raise AssertionError(f"you return {answers[0][2]!r} for every SM, but the tie moves with "
                             "the per-clock figures: set the two cycle counts equal, 4 M N D / "
                             "(FLOP per clock) = M N / (exp per clock); M and N cancel")
    for name, fig, got in answers:
        want = tie_head_dim(fig)
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        f, e = fig.mma_flops_per_clk, fig.exp2_per_clk
        where = f"{name} ({f} FLOP/clk, {e} exp/clk): D = {want:g}, you gave {got:g}"
        if math.isclose(got, 2 * want, rel_tol=1e-6):
            hint = ("a tile does two matmuls, S = Q K^T and O = P V: 4 M N D FLOPs, not 2 M N D")
        elif math.isclose(got, 4 * want, rel_tol=1e-6):
            hint = ("a multiply-add is 2 FLOPs and the tile has two matmuls: 4 M N D FLOPs "
                    "against M N exps")
        elif math.isclose(got * want, 1.0, rel_tol=1e-6):
            hint = "the ratio is upside down: more FLOP per clock moves the tie to a larger D"
        else:
            hint = ("set the two cycle counts equal: 4 M N D / (FLOP per clock) = M N / (exp per "
                    "clock); M and N cancel")
        raise AssertionError(f"{where}. {hint}")


# ----------------------------------------------------------------------------------------------
# 00.3 The narrowest KV tile that keeps the tensor cores the slower unit

NARROWEST_SEARCH = 4096  # the widest KV tile 00.3 considers


def narrowest_kv_tile(arch: str, m: int, d: int) -> int | None:
    """Reference for 00.3: the smallest N (keys per KV tile) for which the forward tile's MMA
    cycles are at least its shared-memory cycles, with M query rows and head dim D; None when no
    N up to NARROWEST_SEARCH does it. Q is read from shared memory at every KV tile whatever N
    is, so a narrow tile pays Q's bytes for little MMA work."""
    for n in range(1, NARROWEST_SEARCH + 1):
        t = roofline.tile_cycles(arch, "fwd", m, n, d)
        if t.mma >= t.smem - 1e-9:
            return n
    return None


NARROWEST_CASES = (("H100", 128, 128), ("H100", 64, 64), ("H100", 192, 256), ("B200", 128, 128),
                   ("B200", 128, 64), ("B300", 256, 128), ("B200", 64, 128))


def check_narrowest_kv_tile(fn) -> None:
    """00.3: ``fn(arch, m, d) -> int or None``."""
    for arch, m, d in NARROWEST_CASES:
        got = fn(arch, m, d)
        want = narrowest_kv_tile(arch, m, d)
        where = f"{arch}, M={m}, D={d}"
        if got == want and (got is None or not isinstance(got, bool)):
            continue
        sm = roofline.GPUS[roofline.resolve_gpu(arch)]
        rows = roofline.MMA_ISSUE[sm].rows_per_instruction
        if want is None:
            raise AssertionError(
                f"{where}: you gave {got!r}, but no N works. One {rows}-row instruction reads "
                f"all of B even for {m} rows, so per key the tile reads 2 x {d} bytes of K and as "
                f"many of V for only 4 x {m} x {d} FLOPs: shared memory binds at every N. "
                "Return None")
        if got is None:
            raise AssertionError(f"{where}: you returned None, but N = {want} already makes "
                                 "the MMA take at least as long as the shared-memory reads")
        if isinstance(got, bool) or not isinstance(got, int):
            raise AssertionError(f"{where}: return an int N (or None), got {got!r}")
        if got == want - 1:
            raise AssertionError(f"{where}: at N = {got} the MMA still takes less time than the "
                                 "shared-memory reads; return the first N where it takes at "
                                 "least as long (a tie counts)")
        if got < want:
            hint = ("on Hopper each 64-row warpgroup reads all of B: K and V are read "
                    f"ceil(M / 64) = {math.ceil(m / 64)} times" if rows == 64 else
                    "count every operand read from shared memory: Q and K for S, V for O")
            raise AssertionError(f"{where}: N = {got} is too narrow, shared memory still binds "
                                 f"there; the tie is at N = {want}. Hint: {hint}")
        raise AssertionError(f"{where}: N = {got} works, but so does N = {want}: return the "
                             "smallest. Hint: P is not read from shared memory (registers on "
                             "Hopper, TMEM on Blackwell)")


# ----------------------------------------------------------------------------------------------
# The chip's peak, with the clock each figure assumes, and the stored microbenchmark

HOPPER = PER_SM["sm_90"]
# NVIDIA's dense bf16 tensor-core figure for the H100 SXM and the H200 SXM (datasheets).
DATASHEET_DENSE_BF16_TFLOPS = hardware.DATASHEET_DENSE_BF16_TFLOPS["sm_90"]


def datasheet_clock_ghz() -> float:
    """The clock at which 4096 FLOP/clk/SM x 132 SMs gives the datasheet's 989 TFLOP/s."""
    return DATASHEET_DENSE_BF16_TFLOPS * 1e12 / (HOPPER.mma_flops_per_clk * HOPPER.sms) / 1e9


def model_peak_tflops() -> float:
    """4096 FLOP/clk/SM x 132 SMs at the 1.98 GHz maximum boost clock (utils.hardware)."""
    return HOPPER.chip_peak(HOPPER.mma_flops_per_clk) / 1e12


def peak_lines(micro=None) -> list[str]:
    """The H100/H200's dense bf16 peak, each figure with the clock it assumes: the datasheet's,
    the per-SM table's product at the maximum boost clock, and (``micro``: the microbench
    results) the large matmul measured on the H200."""
    lines = [f"datasheet (H100/H200 SXM, dense bf16): {DATASHEET_DENSE_BF16_TFLOPS} TFLOP/s = "
             f"{HOPPER.mma_flops_per_clk} FLOP/clk/SM x {HOPPER.sms} SMs x "
             f"{datasheet_clock_ghz():.2f} GHz",
             f"the same product at the {HOPPER.boost_clock_ghz} GHz maximum boost clock: "
             f"{model_peak_tflops():.0f} TFLOP/s (model)"]
    if micro is not None:
        for r in micro.where(metric="matmul_tflops"):
            clock = r.get("sm_clock_mhz")
            at = f"at {clock / 1e3:.2f} GHz" if clock else "at a clock the run did not record"
            lines.append(f"measured, {r['impl']}: {r['value']:.0f} TFLOP/s, {at} "
                         f"({micro.label})")
    return lines


MICRO_PICKS = (("exp2_per_clk_sm", {"emulated_of_8": 0}, "exp2_per_clk", "MUFU ex2"),
               ("smem_bytes_per_clk_sm", {"width_bytes": 16}, "smem_bytes_per_clk",
                "shared memory, 16-byte loads"))


def per_clock_lines(micro) -> list[str]:
    """The microbenchmark's per-SM, per-clock rates next to the table's figures."""
    lines = []
    for metric, match, field, what in MICRO_PICKS:
        rows = micro.where(metric=metric, **match)
        if not rows:
            lines.append(f"  {what}: not in the file")
            continue
        r, model = rows[0], getattr(HOPPER, field)
        spread = f", {r['min']:.4g}..{r['max']:.4g} over the SMs" if r.get("min") else ""
        lines.append(f"  {what:<30} {r['value']:8.3f} {r['unit']:<11} the table says {model}: "
                     f"{r['value'] / model:.1%} of it{spread}")
    clocks = [r["value"] for r in micro.where(metric="sm_clock")]
    if clocks:
        lines.append(f"  SM clock during these kernels: {min(clocks):.2f} to {max(clocks):.2f} "
                     "GHz (from the cycle counters and the time)")
    return lines


def mma_sync_clock_ghz(micro) -> float | None:
    """The SM clock the mma.sync kernel ran at (its cycle counters over its time), or None."""
    rows = [r for r in micro.where(metric="sm_clock") if r["impl"].startswith("mma.sync")]
    return rows[0]["value"] if rows else None


def matmul_tflops(micro) -> float:
    """The stored large bf16 matmul's TFLOP/s."""
    return micro.one(metric="matmul_tflops")["value"]


@claim("00.per_clock_figures_hold", "microbench",
       "MUFU ex2 and 16-byte shared-memory loads measure within 1% of the table's per-clock "
       "figures on every SM")
def _per_clock_figures_hold(res):
    out, ok = [], True
    for metric, match, field, what in MICRO_PICKS:
        r = res.one(metric=metric, **match)
        model = getattr(HOPPER, field)
        lo, hi = r.get("min", r["value"]), r.get("max", r["value"])
        ok &= abs(lo / model - 1) <= 0.01 and abs(hi / model - 1) <= 0.01
        out.append(f"{what} {lo:.3f}..{hi:.3f} vs {model}")
    return ok, "; ".join(out)


@claim("00.matmul_below_both_peaks", "microbench",
       "the large bf16 matmul measured on the H200 stays below the datasheet's peak, which is "
       "below the model's")
def _matmul_below_peaks(res):
    v = matmul_tflops(res)
    return (v < DATASHEET_DENSE_BF16_TFLOPS < model_peak_tflops(),
            f"measured {v:.0f}, datasheet {DATASHEET_DENSE_BF16_TFLOPS}, model "
            f"{model_peak_tflops():.0f}")
