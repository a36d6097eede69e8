"""Float64 decode on the CPU: the answer (``decode_reference``), a walk of the Hopper decode
kernel's own index arithmetic (``emulate_decode``), and the inputs both take (``paged_cache``).

The reference knows nothing of tiles, splits or pages: per sequence it gathers the first
seqused_k keys, masks bottom-right causal, and takes the softmax in float64. The emulation does
what the kernel does, with the functions the kernel calls (fa4_final.common.decode_index): the
grid of (m-block, split, KV head, batch entry), packed GQA rows, the split's key tiles from the
highest down, each tile read from its page, the mask only on the tiles the kernel masks, the
online softmax per split, float32-layout partials (out_partial (splits, b, s_q, h, D), lse_partial
(splits, b, h, s_q), natural log, -inf for a split with no key), and a float64 merge of them.
Where the kernel's arithmetic is wrong (a tile it skips, a mask it omits, a wrong page) the
emulation disagrees with the reference.
"""

from __future__ import annotations

import math

import torch

from fa4_final.common.decode_index import (
    block_key_start,
    block_key_tiles,
    gathered_box_start,
    key_box_location,
    key_limit,
    key_start,
    key_tile_location,
    left_masked_tiles,
    masked_tiles,
    num_m_blocks,
    packed_rows,
    split_key_tiles,
    unpack_row,
)

F64 = torch.float64


def sequence_keys(k, b: int, length: int, page_table=None):
    """The first ``length`` key rows of sequence ``b``, (length, h_kv, D): contiguous k is
    (b, s_k, h_kv, D); paged k is (num_pages, page_size, h_kv, D) with page_table (b, pages)."""
    if page_table is None:
        return k[b, :length]
    page_size = k.shape[1]
    pages = -(-length // page_size)
    rows = torch.cat([k[int(page_table[b, i])] for i in range(pages)]) if pages else k[0, :0]
    return rows[:length]


def cached_lengths(k, batch: int, page_table=None, seqused_k=None) -> list[int]:
    """Each sequence's key count, as the kernel takes it (HopperDecode.cached_length):
    seqused_k clamped to what the cache (the table's row) holds."""
    length = k.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    if seqused_k is not None:
        return [min(int(x), length) for x in seqused_k]
    return [length] * batch


def decode_reference(q, k, v, causal: bool, softmax_scale=None, page_table=None,
                     seqused_k=None, window_left=None):
    """Float64 (out (b, s_q, h, D), lse (b, h, s_q)); a row with no visible key: out 0,
    lse -inf. Causal is bottom-right: token t sees keys j <= t + seqlen_k - seqlen_q; a left
    window, keys j >= t + seqlen_k - seqlen_q - window_left."""
    b_count, sq, h, d = q.shape
    h_kv = k.shape[2]
    group = h // h_kv
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(b_count, sq, h, d, dtype=F64)
    lse = torch.full((b_count, h, sq), -math.inf, dtype=F64)
    for b, length in enumerate(cached_lengths(k, b_count, page_table, seqused_k)):
        keys = sequence_keys(k, b, length, page_table).to(F64)  # (L, h_kv, D)
        vals = sequence_keys(v, b, length, page_table).to(F64)
        visible = torch.ones(sq, length, dtype=torch.bool)
        t, j = torch.arange(sq)[:, None], torch.arange(length)[None, :]
        if causal:
            visible = j <= t + length - sq
        if window_left is not None:
            visible = visible & (j >= t + length - sq - window_left)
        for head in range(h):
            s = scale * q[b, :, head].to(F64) @ keys[:, head // group].T  # (s_q, L)
            s = s.masked_fill(~visible, -math.inf)
            row_lse = torch.logsumexp(s, dim=1)
            seen = visible.any(dim=1)
            p = torch.exp(s - torch.where(seen, row_lse, 0.0)[:, None])
            out[b, :, head] = torch.where(seen[:, None], p @ vals[:, head // group], 0.0)
            lse[b, head] = torch.where(seen, row_lse, -math.inf)
    return out, lse


def key_tile(x, b: int, kv_head: int, n: int, tile_n: int, page_table=None, page_box=None,
             seqlen_k=None):
    """Key tile ``n`` of sequence ``b`` as the producer's TMA box reads it, (tile_n, D): from
    its page (paged), else rows n * tile_n .. of the batch entry, zero past the cache's end (the
    TMA box's fill). ``page_box``: gathered from boxes of that many keys, the boxes past the
    sequence's ``seqlen_k`` keys pointed at its last key's box (Note [Gathered key tiles])."""
    if page_box is not None:
        boxes = []
        for j in range(tile_n // page_box):
            key = gathered_box_start(n, j, tile_n, page_box, seqlen_k)
            slot, inside = key_box_location(key, x.shape[1], page_box)
            page = int(page_table[b, slot])
            boxes.append(x[page, inside * page_box:(inside + 1) * page_box, kv_head])
        return torch.cat(boxes)
    if page_table is not None:
        slot, inside = key_tile_location(n, tile_n, x.shape[1])
        page = int(page_table[b, slot])
        return x[page, inside * tile_n:(inside + 1) * tile_n, kv_head]
    rows = x[b, n * tile_n:(n + 1) * tile_n, kv_head]
    pad = torch.zeros(tile_n - rows.shape[0], rows.shape[1], dtype=rows.dtype)
    return torch.cat([rows, pad])


def emulate_decode(q, k, v, causal: bool, num_splits: int, softmax_scale=None, page_table=None,
                   seqused_k=None, tile_m: int = 64, tile_n: int = 128, cu_seqlens_q=None,
                   max_seqlen_q=None, window_left=None, page_box=None):
    """(out_partial, lse_partial, tiles visited) of the kernel's walk, in float64 and the split
    contract's layout. Rows of a tile the kernel does not mask are not masked here either; V's rows
    past the cached length are zeroed in the tile that holds its end, as the kernel does.
    Varlen queries (``cu_seqlens_q``, ``max_seqlen_q``): q (total_q, h, D), the partials
    (splits, total_q, h, D) and (splits, h, total_q), the grid's m-blocks counted for
    max_seqlen_q as the kernel counts them. ``page_box``: key tiles gathered from pages smaller
    than them (key_tile)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        cu = [int(x) for x in cu_seqlens_q]
        b_count, (total_q, h, d) = len(cu) - 1, q.shape
        out_p = torch.full((num_splits, 1, total_q, h, d), math.nan, dtype=F64)
        lse_p = torch.full((num_splits, 1, h, total_q), math.nan, dtype=F64)
        q = q.unsqueeze(0)
        bound = max_seqlen_q
    else:
        b_count, bound, h, d = q.shape
        cu = None
        out_p = torch.full((num_splits, b_count, bound, h, d), math.nan, dtype=F64)
        lse_p = torch.full((num_splits, b_count, h, bound), math.nan, dtype=F64)
    h_kv = k.shape[2]
    group = h // h_kv
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    visited = 0
    lengths = cached_lengths(k, b_count, page_table, seqused_k)
    for b in range(b_count):
        seqlen_k = lengths[b]
        # the sequence's rows in q, out and lse: batch entry qb from row q_offset
        qb, q_offset, sq = (0, cu[b], cu[b + 1] - cu[b]) if varlen else (b, 0, bound)
        for kv_head in range(h_kv):
            for m_block in range(num_m_blocks(bound, group, tile_m)):
                n_end, n_full = block_key_tiles(m_block, tile_m, tile_n, group, sq, seqlen_k,
                                                causal)
                first = m_block * tile_m
                rows = list(range(first, min(first + tile_m, packed_rows(sq, group))))
                if not rows:  # an m-block past a shorter sequence: no key, no store
                    assert n_end == 0
                    continue
                where = [(q_offset + t, hh) for t, hh in
                         (unpack_row(r, group, kv_head) for r in rows)]
                qt = torch.stack([q[qb, t, hh] for t, hh in where]).to(F64)  # (rows, D)
                limits = torch.tensor([key_limit(r, group, sq, seqlen_k, causal) for r in rows])
                starts = torch.tensor([key_start(r, group, sq, seqlen_k, window_left)
                                       for r in rows])
                n_start, n_left_free = block_key_start(m_block, tile_m, tile_n, group, sq,
                                                       seqlen_k, window_left)
                for split in range(num_splits):
                    n_lo, n_hi = split_key_tiles(split, num_splits, seqlen_k, tile_n, n_end,
                                                 n_start)
                    top = max(masked_tiles(n_lo, n_hi, n_full), 1)
                    bottom_start = n_hi - n_lo
                    if window_left is not None:
                        bottom_start = max(bottom_start - left_masked_tiles(n_lo, n_hi,
                                                                            n_left_free), top)
                    m = torch.full((len(rows),), -math.inf, dtype=F64)
                    lsum = torch.zeros(len(rows), dtype=F64)
                    o = torch.zeros(len(rows), d, dtype=F64)
                    for i in range(n_hi - n_lo):
                        n = n_hi - 1 - i
                        visited += 1
                        kt = key_tile(k, b, kv_head, n, tile_n, page_table, page_box,
                                      seqlen_k).to(F64)
                        vt = key_tile(v, b, kv_head, n, tile_n, page_table, page_box,
                                      seqlen_k).to(F64)
                        if i == 0 and seqlen_k - n * tile_n < tile_n:
                            # Note [Keys past the cached length]: zeros over V's rows past it
                            vt = vt.clone()
                            vt[seqlen_k - n * tile_n:] = 0.0
                        s = scale * qt @ kt.T  # (rows, tile_n)
                        if i < top or i >= bottom_start:
                            cols = (n * tile_n + torch.arange(tile_n))[None, :]
                            hidden = cols >= limits[:, None]
                            if window_left is not None:
                                hidden = hidden | (cols < starts[:, None])
                            s = s.masked_fill(hidden, -math.inf)
                        m_new = torch.maximum(m, s.max(dim=1).values)
                        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
                        alpha = torch.exp(m - m_safe)
                        p = torch.exp(s - m_safe[:, None])
                        lsum = alpha * lsum + p.sum(dim=1)
                        o = alpha[:, None] * o + p @ vt
                        m = m_new
                    seen = lsum > 0
                    row_out = torch.where(seen[:, None], o / torch.where(seen, lsum, 1.0)[:, None],
                                          0.0)
                    row_lse = torch.where(seen, m + torch.log(torch.where(seen, lsum, 1.0)),
                                          -math.inf)
                    for j, (t, hh) in enumerate(where):
                        out_p[split, qb, t, hh] = row_out[j]
                        lse_p[split, qb, hh, t] = row_lse[j]
    if varlen:
        return out_p[:, 0], lse_p[:, 0], visited
    return out_p, lse_p, visited


def varlen_decode_reference(q, k, v, cu_seqlens_q, causal: bool, softmax_scale=None,
                            page_table=None, seqused_k=None, window_left=None):
    """decode_reference of packed query sequences: q (total_q, h, D), sequence b's tokens rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its keys batch entry b of k and v (or row b of
    the page table). Returns out (total_q, h, D), lse (h, total_q), float64."""
    total_q, h, d = q.shape
    out = torch.zeros(total_q, h, d, dtype=F64)
    lse = torch.full((h, total_q), -math.inf, dtype=F64)
    cu = [int(x) for x in cu_seqlens_q]
    lengths = cached_lengths(k, len(cu) - 1, page_table, seqused_k)
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        one = torch.tensor([lengths[b]], dtype=torch.int32)
        if page_table is None:
            o, s = decode_reference(q[None, lo:hi], k[b:b + 1], v[b:b + 1], causal,
                                    softmax_scale, seqused_k=one, window_left=window_left)
        else:
            o, s = decode_reference(q[None, lo:hi], k, v, causal, softmax_scale,
                                    page_table=page_table[b:b + 1], seqused_k=one,
                                    window_left=window_left)
        out[lo:hi], lse[:, lo:hi] = o[0], s[0]
    return out, lse


def merge_splits(out_partial, lse_partial):
    """Float64 merge of split partials (the combine's math, splits in order): out =
    sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s); every split -inf: out 0,
    lse -inf. Returns (out (b, s_q, h, D), lse (b, h, s_q)); varlen partials ((splits, total_q,
    h, D), (splits, h, total_q)) give (total_q, h, D) and (h, total_q)."""
    if out_partial.dim() == 4:
        out, lse = merge_splits(out_partial.unsqueeze(1), lse_partial.unsqueeze(1))
        return out[0], lse[0]
    lse_p = lse_partial.to(F64)
    lse = torch.logsumexp(lse_p, dim=0)  # (b, h, s_q)
    seen = torch.isfinite(lse)
    w = torch.exp(lse_p - torch.where(seen, lse, 0.0)[None])  # (splits, b, h, s_q)
    w = torch.where(seen[None], w, 0.0).permute(0, 1, 3, 2)[..., None]  # (splits, b, s_q, h, 1)
    out = (w * torch.nan_to_num(out_partial.to(F64), nan=0.0)).sum(dim=0)
    return out, torch.where(seen, lse, -math.inf)


def paged_cache(k, v, page_size: int, generator=None, spare_pages: int = 3):
    """The contiguous cache (b, s_k, h_kv, D) as pages: (k_paged, v_paged, page_table) with
    the pages in a shuffled order among ``spare_pages`` extra pages that no sequence owns and
    that hold NaN (a read of one shows). s_k must be a multiple of page_size."""
    b_count, sk, h_kv, d = k.shape
    assert sk % page_size == 0, (sk, page_size)
    per_seq = sk // page_size
    total = b_count * per_seq + spare_pages
    order = torch.randperm(total, generator=generator)
    kp = torch.full((total, page_size, h_kv, d), math.nan, dtype=k.dtype)
    vp = torch.full((total, page_size, h_kv, d), math.nan, dtype=v.dtype)
    table = torch.empty(b_count, per_seq, dtype=torch.int32)
    for b in range(b_count):
        for i in range(per_seq):
            page = int(order[b * per_seq + i])
            table[b, i] = page
            kp[page] = k[b, i * page_size:(i + 1) * page_size]
            vp[page] = v[b, i * page_size:(i + 1) * page_size]
    return kp, vp, table


def assert_close_to_float64(got, want, what: str, atol: float = 2e-2) -> None:
    """``got`` against a float64 answer: the same rows finite (-inf lse where no key is seen),
    the finite ones within ``atol``."""
    err = (got.double() - want).abs()
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite), what
    assert float(torch.where(finite, err, 0.0).max()) < atol, what
