"""Chapter 02's exercises: typical wrong answers, each with the words its checker must say."""

import torch

from solutions import ch02_online_softmax as ch02
from tests.exercise_mutations import Mutation

NEG_INF = float("-inf")


# --- 02.1 the tile update ---------------------------------------------------------------------
def _parts(m, s, guard=True, exp=torch.exp2):
    m_new = torch.maximum(m, s.amax(-1))
    m_use = m_new.masked_fill(m_new == NEG_INF, 0.0) if guard else m_new
    return m_new, exp(m - m_use), exp(s - m_use[..., None])


def update_no_l_rescale(o, m, l, s, v):  # noqa: E741
    m_new, alpha, p = _parts(m, s)
    return alpha[..., None] * o + p.to(v.dtype) @ v, m_new, l + p.sum(-1)


def update_no_o_rescale(o, m, l, s, v):  # noqa: E741
    m_new, alpha, p = _parts(m, s)
    return o + p.to(v.dtype) @ v, m_new, alpha * l + p.sum(-1)


def update_natural_exp(o, m, l, s, v):  # noqa: E741
    m_new, alpha, p = _parts(m, s, exp=torch.exp)
    return alpha[..., None] * o + p.to(v.dtype) @ v, m_new, alpha * l + p.sum(-1)


def update_no_inf_guard(o, m, l, s, v):  # noqa: E741
    m_new, alpha, p = _parts(m, s, guard=False)
    return alpha[..., None] * o + p.to(v.dtype) @ v, m_new, alpha * l + p.sum(-1)


def update_normalised_o(o, m, l, s, v):  # noqa: E741
    m_new, alpha, p = _parts(m, s)
    l_new = alpha * l + p.sum(-1)
    o_new = alpha[..., None] * o + p.to(v.dtype) @ v
    return o_new / l_new.masked_fill(l_new == 0, 1.0)[..., None], m_new, l_new


def update_from_row_stats(o, m, l, s, v):  # noqa: E741
    m_tile, l_tile = ch02.online_softmax_stats(s, tile=s.shape[-1])
    m_new = torch.maximum(m, m_tile)
    m_use = m_new.masked_fill(m_new == NEG_INF, 0.0)
    alpha = torch.exp2(m - m_use)
    p = torch.exp2(s - m_use[..., None])
    return alpha[..., None] * o + p.to(v.dtype) @ v, m_new, alpha * l + l_tile


# --- 02.2 the LSE -----------------------------------------------------------------------------
def lse_log2_units(m, l):  # noqa: E741
    return m + torch.log2(l)


def lse_natural_log_of_l(m, l):  # noqa: E741
    return m + torch.log(l)


def lse_max_alone(m, l):  # noqa: E741
    return m * ch02.LN2


def lse_nan_for_empty_rows(m, l):  # noqa: E741
    return torch.where(l > 0, (m + torch.log2(l)) * ch02.LN2, float("nan"))


def lse_one_column(m, l):  # noqa: E741
    return ((m + torch.log2(l)) * ch02.LN2)[..., None]


# --- 02.3 how many KV tiles -------------------------------------------------------------------
def tiles_never_skip(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    return -(-seqlen_k // tile_n)


def tiles_floor_not_ceil(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    end = seqlen_k if not causal else min(seqlen_k, q_end + seqlen_k - seqlen_q)
    return max(0, end // tile_n)


def tiles_top_left(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    end = seqlen_k if not causal else min(seqlen_k, q_end)
    return max(0, -(-end // tile_n))


def tiles_first_row(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    end = seqlen_k if not causal else min(seqlen_k, q_start + 1 + seqlen_k - seqlen_q)
    return max(0, -(-end // tile_n))


def tiles_negative_when_nothing_seen(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    end = seqlen_k if not causal else min(seqlen_k, q_end + seqlen_k - seqlen_q)
    return -(-end // tile_n)


def tiles_from_count_tiles(q_start, q_end, seqlen_q, seqlen_k, tile_n, causal):
    return ch02.count_tiles(q_end - q_start, seqlen_k, q_end - q_start, tile_n, causal).computed


U = dict(check=ch02.check_tile_update, reference=ch02.tile_update,
         forbid=ch02.TILE_UPDATE_FORBID)
L = dict(check=ch02.check_lse, reference=ch02.lse_from_state)
K = dict(check=ch02.check_kv_tiles_to_visit, reference=ch02.kv_tiles_to_visit,
         forbid=ch02.kv_tiles_forbid())

MUTATIONS = [
    Mutation("02.1", answer=update_no_l_rescale, says="rescale l", **U),
    Mutation("02.1", answer=update_no_o_rescale, says="O must be rescaled", **U),
    Mutation("02.1", answer=update_natural_exp, says="log2 domain", **U),
    Mutation("02.1", answer=update_no_inf_guard, says="NaN", **U),
    Mutation("02.1", answer=update_normalised_o, says="unnormalised", **U),
    Mutation("02.1", answer=update_from_row_stats, says="running max and sum", **U),
    Mutation("02.2", answer=lse_log2_units, says="ln 2", **L),
    Mutation("02.2", answer=lse_natural_log_of_l, says="log2", **L),
    Mutation("02.2", answer=lse_max_alone, says="max alone", **L),
    Mutation("02.2", answer=lse_nan_for_empty_rows, says="NaN", **L),
    Mutation("02.2", answer=lse_one_column, says="one LSE per row", **L),
    Mutation("02.3", answer=tiles_never_skip, says="no key any row sees", **K),
    Mutation("02.3", answer=tiles_floor_not_ceil, says="ceil(", **K),
    Mutation("02.3", answer=tiles_top_left, says="sees key", **K),
    Mutation("02.3", answer=tiles_first_row, says="sees key", **K),
    Mutation("02.3", answer=tiles_negative_when_nothing_seen, says="cannot be negative",
             **K),
    Mutation("02.3", answer=tiles_from_count_tiles, says="counts the tiles for you", **K),
]
