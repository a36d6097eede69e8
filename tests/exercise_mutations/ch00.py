"""Chapter 00's exercises: typical wrong answers, each with the words its checker must say."""

import math

from solutions import ch00_hardware as ch00
from tests.exercise_mutations import Mutation
from utils import roofline
from utils.hardware import PER_SM


# --- 00.1 the forward tile by hand ------------------------------------------------------------
def _by_hand(arch, m, n, d, p_in_smem=False, rereads=True, bytes_per=2, one_matmul=False):
    fig = PER_SM[roofline.GPUS[arch]]
    reads = math.ceil(m / (64 if arch in ("H100", "H200") else 128)) if rereads else 1
    smem = (m * d + 2 * reads * n * d + (m * n if p_in_smem else 0)) * bytes_per
    return {"mma": (2 if one_matmul else 4) * m * n * d / fig.mma_flops_per_clk,
            "exp": m * n / fig.exp2_per_clk, "smem": smem / fig.smem_bytes_per_clk}


def tile_one_matmul(arch, m, n, d):
    return _by_hand(arch, m, n, d, one_matmul=True)


def tile_p_from_smem(arch, m, n, d):
    return _by_hand(arch, m, n, d, p_in_smem=True)


def tile_b_read_once(arch, m, n, d):
    return _by_hand(arch, m, n, d, rereads=False)


def tile_elements_not_bytes(arch, m, n, d):
    return _by_hand(arch, m, n, d, bytes_per=1)


def tile_asks_the_model(arch, m, n, d):
    return roofline.tile_cycles(arch, "fwd", m, n, d).cycles


def tile_calls_the_reference(arch, m, n, d):
    return ch00.forward_tile_cycles(arch, m, n, d)


# --- 00.2 the head dim of the tie -------------------------------------------------------------
def tie_one_matmul(fig):
    return fig.mma_flops_per_clk / (2 * fig.exp2_per_clk)


def tie_upside_down(fig):
    return 4 * fig.exp2_per_clk / fig.mma_flops_per_clk


def tie_from_b200(fig):
    return 128  # the one tie printed in the chapter


def tie_by_search(fig):
    for d in range(1, 2049):
        t = roofline.tile_cycles("B200", "fwd", d=d)
        if t.mma >= t.exp:
            return d
    return None


# --- 00.3 the narrowest KV tile ---------------------------------------------------------------
def _narrowest(arch, m, d, **kw):
    for n in range(1, ch00.NARROWEST_SEARCH + 1):
        t = _by_hand(arch, m, n, d, **kw)
        if t["mma"] >= t["smem"]:
            return n
    return None


def narrowest_b_read_once(arch, m, d):
    return _narrowest(arch, m, d, rereads=False)


def narrowest_p_from_smem(arch, m, d):
    return _narrowest(arch, m, d, p_in_smem=True)


def narrowest_last_bound_n(arch, m, d):
    n = _narrowest(arch, m, d)
    return None if n is None else n - 1  # the last N where shared memory still binds


def narrowest_never_none(arch, m, d):
    return _narrowest(arch, m, d) or ch00.NARROWEST_SEARCH


def narrowest_asks_the_model(arch, m, d):
    for n in range(1, ch00.NARROWEST_SEARCH + 1):
        t = roofline.tile_cycles(arch, "fwd", m, n, d)
        if t.mma >= t.smem:
            return n
    return None


T1 = dict(check=ch00.check_forward_tile_cycles, reference=ch00.forward_tile_cycles,
          forbid=ch00.FORWARD_FORBID)
T2 = dict(check=ch00.check_tie_head_dim, reference=ch00.tie_head_dim, forbid=ch00.TIE_FORBID)
T3 = dict(check=ch00.check_narrowest_kv_tile, reference=ch00.narrowest_kv_tile,
          forbid=ch00.NARROWEST_FORBID)

MUTATIONS = [
    Mutation("00.1", answer=tile_one_matmul, says="two matmuls", **T1),
    Mutation("00.1", answer=tile_p_from_smem, says="P does not come from shared memory", **T1),
    Mutation("00.1", answer=tile_b_read_once, says="warpgroups", **T1),
    Mutation("00.1", answer=tile_elements_not_bytes, says="bytes, not elements", **T1),
    Mutation("00.1", answer=tile_asks_the_model, says="the cycle model itself", **T1),
    Mutation("00.1", answer=tile_calls_the_reference, says="reference solution", **T1),
    Mutation("00.2", answer=tie_one_matmul, says="two matmuls", **T2),
    Mutation("00.2", answer=tie_upside_down, says="upside down", **T2),
    Mutation("00.2", answer=tie_from_b200, says="M and N cancel", **T2),
    Mutation("00.2", answer=tie_by_search, says="the cycle model itself", **T2),
    Mutation("00.3", answer=narrowest_b_read_once, says="ceil(M / 64)", **T3),
    Mutation("00.3", answer=narrowest_p_from_smem, says="P is not read from shared memory",
             **T3),
    Mutation("00.3", answer=narrowest_last_bound_n, says="a tie counts", **T3),
    Mutation("00.3", answer=narrowest_never_none, says="Return None", **T3),
    Mutation("00.3", answer=narrowest_asks_the_model, says="the cycle model itself", **T3),
]
