"""Chapter 00: the exercises on the cycle model (the model itself is ``utils/roofline.py``).

00.1  write the forward tile's cycles by hand, per unit, for any GPU and tile;
00.2  say which unit binds a B200 forward tile at D = 64, 128, 256;
00.3  say what B300's doubled exp unit buys per forward tile at D = 64 and D = 128.
"""

from __future__ import annotations

import math

from utils import roofline
from utils.hardware import PER_SM


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


def binding_units(d: int) -> tuple[str, ...]:
    """Reference for 00.2: the unit(s) binding a B200 forward 128 x 128 tile at head dim d."""
    return roofline.tile_cycles("B200", "fwd", 128, 128, d).binding


def check_binding_units(answer) -> None:
    """00.2: ``answer = {64: unit, 128: unit, 256: unit}``; a tie may name either unit or both
    (a tuple)."""
    if not isinstance(answer, dict) or set(answer) != {64, 128, 256}:
        raise AssertionError("give a dict {64: ..., 128: ..., 256: ...} of unit names "
                             f"({roofline.UNITS})")
    for d, named in answer.items():
        names = {named} if isinstance(named, str) else set(named)
        unknown = names - set(roofline.UNITS)
        if unknown:
            raise AssertionError(f"unknown unit {sorted(unknown)}; use {roofline.UNITS}")
        tile = roofline.tile_cycles("B200", "fwd", d=d)
        cycles = ", ".join(f"{u} {c:.0f}" for u, c in tile.cycles.items())
        if not names <= set(tile.binding) or not names:
            raise AssertionError(f"D={d}: {sorted(names)} does not bind. The cycles are "
                                 f"{cycles}: the largest sets the pace")


def b300_speedups() -> tuple[float, float]:
    """Reference for 00.3: B300 over B200 per forward 128 x 128 tile at D = 64 and D = 128."""
    return tuple(roofline.tile_cycles("B200", "fwd", d=d).bound_cycles
                 / roofline.tile_cycles("B300", "fwd", d=d).bound_cycles for d in (64, 128))


def check_b300_speedups(answer) -> None:
    """00.3: ``answer = (speedup at D=64, speedup at D=128)``, bound(B200) / bound(B300)."""
    try:
        d64, d128 = (float(x) for x in answer)
    except (TypeError, ValueError):
        raise AssertionError("give two numbers: (speedup at D=64, speedup at D=128)") from None
    want64, want128 = b300_speedups()
    if not math.isclose(d64, want64, rel_tol=0.01):
        raise AssertionError(f"D=64: {d64:g}x is not it. On B200 the exp unit binds (1024 "
                             "cycles vs MMA 512); what binds once it takes half as long?")
    if not math.isclose(d128, want128, rel_tol=0.01):
        raise AssertionError(f"D=128: {d128:g}x is not it. On B200 exp and MMA tie at 1024 "
                             "cycles: halving exp leaves the MMA where it was")
