"""The Hopper decode kernel's index arithmetic on the CPU (fa4_final.common.decode_index): packed
GQA rows, key limits, the key tiles of an m-block and of a split, the masked tiles, pages; each
against brute force, then the kernel's whole walk (tests.decode_reference.emulate_decode) in
float64 against the float64 decode, contiguous and paged, one split and several."""

import math
import random

import pytest
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
    page_box_for,
    page_size_problem,
    split_key_tiles,
    unpack_row,
)
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.config import (
    HopperDecodeConfig,
    hopper_decode_default,
    hopper_decode_for_page,
)
from tests.decode_reference import (
    cached_lengths,
    decode_reference,
    emulate_decode,
    merge_splits,
    paged_cache,
    varlen_decode_reference,
)

GROUPS = (1, 4, 8, 16)


def visible(token: int, key: int, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    """Brute force: bottom-right causal, or every key of the sequence."""
    return 0 <= key < seqlen_k and (not causal or key <= token + seqlen_k - seqlen_q)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("seqlen_q", [1, 3, 4, 16])
def test_packed_rows_cover_each_token_and_head_once(group, seqlen_q):
    """Row r -> (token r // group, head kv_head * group + r % group): a bijection onto the
    group's (token, head) pairs, the heads of a token adjacent (FA4's pack_gqa order)."""
    for kv_head in (0, 3):
        rows = packed_rows(seqlen_q, group)
        pairs = [unpack_row(r, group, kv_head) for r in range(rows)]
        assert sorted(pairs) == [(t, kv_head * group + g) for t in range(seqlen_q)
                                 for g in range(group)]
        assert pairs[:group] == [(0, kv_head * group + g) for g in range(group)]
    assert num_m_blocks(seqlen_q, group, 64) == -(-seqlen_q * group // 64)


@pytest.mark.parametrize("causal", [False, True])
def test_key_limit_is_the_brute_force_visibility(causal):
    for group in (1, 4):
        for seqlen_q in (1, 5, 16):
            for seqlen_k in (1, 3, 16, 130):
                for r in range(packed_rows(seqlen_q, group)):
                    t = r // group
                    lim = key_limit(r, group, seqlen_q, seqlen_k, causal)
                    seen = [j for j in range(-2, seqlen_k + 3)
                            if visible(t, j, seqlen_q, seqlen_k, causal)]
                    assert seen == list(range(max(lim, 0))), (r, seqlen_q, seqlen_k)


def block_cases():
    for tile_m, tile_n in ((64, 128), (64, 32)):
        for group in GROUPS:
            for seqlen_q in (1, 2, 4, 7, 16):
                for seqlen_k in (1, 17, 128, 129, 300, 1000):
                    yield tile_m, tile_n, group, seqlen_q, seqlen_k


@pytest.mark.parametrize("causal", [False, True])
def test_block_key_tiles_are_tight(causal):
    """n_end: every key a real row of the m-block sees lies in tiles < n_end, and the last of
    them holds one; n_full: tiles below it are seen whole by every real row, and tile n_full
    (when visited) hides a key from some row or runs past seqlen_k."""
    for tile_m, tile_n, group, seqlen_q, seqlen_k in block_cases():
        for m_block in range(num_m_blocks(seqlen_q, group, tile_m)):
            rows = range(m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q * group))
            n_end, n_full = block_key_tiles(m_block, tile_m, tile_n, group, seqlen_q, seqlen_k,
                                            causal)
            seen = {j for r in rows for j in range(seqlen_k)
                    if visible(r // group, j, seqlen_q, seqlen_k, causal)}
            assert n_end == (-(-(max(seen) + 1) // tile_n) if seen else 0)
            for n in range(min(n_full, n_end)):
                assert all(visible(r // group, j, seqlen_q, seqlen_k, causal)
                           for r in rows for j in range(n * tile_n, (n + 1) * tile_n))
            if n_full < n_end:
                assert not all(visible(r // group, j, seqlen_q, seqlen_k, causal)
                               for r in rows
                               for j in range(n_full * tile_n, (n_full + 1) * tile_n))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_splits_cut_the_key_tiles_in_order(num_splits):
    """The splits' ranges are consecutive, disjoint, cover 0 .. n_end and cut at the same keys
    for every m-block (their size comes from the whole sequence); masked_tiles counts exactly
    the split's tiles at or above n_full."""
    for tile_m, tile_n, group, seqlen_q, seqlen_k in block_cases():
        per = math.ceil(math.ceil(seqlen_k / tile_n) / num_splits)
        for m_block in range(num_m_blocks(seqlen_q, group, tile_m)):
            n_end, n_full = block_key_tiles(m_block, tile_m, tile_n, group, seqlen_q, seqlen_k,
                                            True)
            covered = []
            for split in range(num_splits):
                n_lo, n_hi = split_key_tiles(split, num_splits, seqlen_k, tile_n, n_end)
                assert n_lo == split * per and n_hi - n_lo <= per
                covered += range(n_lo, n_hi)
                assert masked_tiles(n_lo, n_hi, n_full) == sum(
                    1 for n in range(n_lo, n_hi) if n >= n_full)
            assert covered == list(range(n_end))


@pytest.mark.parametrize("page_size", [16, 48, 64, 80, 96, 192, 208])
def test_paged_gathered_tile_reads_the_keys_of_its_rows(page_size):
    """Note [Gathered key tiles], emulated: box j of key tile n, read from the page the table
    maps, fills the stage's rows j * page_box .. with exactly the sequence's keys n * 128 + r
    while they are real keys; rows past the last key read a box of a page the sequence owns
    (never a slot past its pages: the table may hold anything there)."""
    tile_n = 128
    box = page_box_for(page_size)
    rng = random.Random(page_size)
    for seqlen_k in (1, 15, 16, 17, 127, 128, 129, 1000, 2048):
        pages = -(-seqlen_k // page_size)
        table = rng.sample(range(10 * pages + 10), pages)  # slot -> page, scattered
        # the cache: page p, row r holds the key the table maps there (or -1: not the sequence's)
        cache = {(table[s], r): s * page_size + r for s in range(pages) for r in range(page_size)}
        for n in range(-(-seqlen_k // tile_n)):
            tile = []
            for j in range(tile_n // box):
                key = gathered_box_start(n, j, tile_n, box, seqlen_k)
                slot, inside = key_box_location(key, page_size, box)
                assert 0 <= slot < pages, (seqlen_k, n, j)
                tile += [cache[(table[slot], inside * box + r)] for r in range(box)]
            for r, key in enumerate(tile):
                if n * tile_n + r < seqlen_k:
                    assert key == n * tile_n + r, (seqlen_k, n, r)
                else:
                    assert 0 <= key < pages * page_size


def test_gathered_page_sizes_are_checked_by_name():
    from fa4_final.hopper.host import check_decode_page_size

    cfg = hopper_decode_for_page(128, 48)
    assert cfg.page_box == 16
    check_decode_page_size(48, cfg)
    check_decode_page_size(16, cfg)
    with pytest.raises(UnsupportedError, match="page_size=40:.*multiple of 16"):
        check_decode_page_size(40, cfg)
    with pytest.raises(ValueError, match="page_box"):
        HopperDecodeConfig(page_box=24).check(128)
    with pytest.raises(ValueError, match="page_box"):
        HopperDecodeConfig(tile_n=64, page_box=64).check(128)
    assert page_box_for(8) is None and page_box_for(0) is None and page_box_for(96) == 32


@pytest.mark.parametrize("tile_n", [32, 64, 128])
@pytest.mark.parametrize("page_size", [128, 256, 512])
def test_a_key_tile_lies_in_one_page(tile_n, page_size):
    """Key j = n * tile_n + c of a sequence is row (inside * tile_n + c) of its page
    ``table[slot]``: exactly row j % page_size of page slot j // page_size."""
    for n in range(40):
        slot, inside = key_tile_location(n, tile_n, page_size)
        for c in (0, tile_n - 1):
            j = n * tile_n + c
            assert (slot, inside * tile_n + c) == (j // page_size, j % page_size)


def test_page_sizes_that_split_a_tile_are_refused_by_name():
    from fa4_final.hopper.host import check_decode_page_size

    assert page_size_problem(256, 128) is None and page_size_problem(64, 64) is None
    for page_size in (16, 64, 96, 0):
        with pytest.raises(UnsupportedError, match=f"page_size={page_size}:.*multiple of 128"):
            check_decode_page_size(page_size, hopper_decode_default(128))
    check_decode_page_size(64, HopperDecodeConfig(tile_n=64))


@pytest.mark.parametrize("d", [64, 128])
def test_every_page_of_16k_keys_gets_a_config_that_takes_it(d):
    """hopper_decode_for_page: the default's 128-key tiles and stages for every page, gathered
    from boxes when the page is smaller or no multiple of the tile (the same K/V bytes in flight
    and shared memory); pages of no multiple of 16 keep the default, which names them."""
    default = hopper_decode_default(d)
    for page_size in range(16, 1025, 16):
        cfg = hopper_decode_for_page(d, page_size)
        cfg.check(d)
        assert page_size_problem(page_size, cfg.tile_n, cfg.page_box) is None
        assert (cfg.tile_n, cfg.stages) == (default.tile_n, default.stages)
        if page_size % 128 == 0:
            assert cfg == default
        else:  # gathered from the largest box of 64, 32, 16 keys that divides the page
            assert cfg.page_box == max(b for b in (16, 32, 64) if page_size % b == 0)
        assert cfg.kv_bytes_in_flight(d) == default.kv_bytes_in_flight(d)
        assert cfg.smem_bytes(d) == default.smem_bytes(d)
    for page_size in (8, 24, 100):
        assert hopper_decode_for_page(d, page_size) == default
        assert f"page_size={page_size}" in page_size_problem(page_size, default.tile_n)


def test_decode_config_checks_name_the_knob():
    for d in (64, 128):
        cfg = hopper_decode_default(d)
        cfg.check(d)
        assert cfg.tile_m == 64 and cfg.smem_bytes(d) <= 227 * 1024
    # Note [Decode bytes in flight]: 209 KB at D = 128 (one CTA an SM), 105 KB at D = 64 (two)
    assert hopper_decode_default(128).smem_bytes(128) == 209 * 1024
    assert 2 * (hopper_decode_default(64).smem_bytes(64) + 1024) <= 228 * 1024
    assert hopper_decode_default(128).kv_bytes_in_flight(128) == 192 * 1024
    with pytest.raises(ValueError, match="tile_n"):
        HopperDecodeConfig(tile_n=96).check(128)
    with pytest.raises(ValueError, match="stages"):
        HopperDecodeConfig(stages=0).check(128)
    with pytest.raises(ValueError, match="shared memory"):
        HopperDecodeConfig(stages=4).check(128)
    with pytest.raises(ValueError, match="head_dim"):
        HopperDecodeConfig().check(96)


# ----------------------------------------------------------------------------------------------
# the kernel's walk in float64 against the float64 decode

def inputs(batch, seqlen_q, seqlen_k, heads, heads_kv, d, seed, cache=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g, dtype=torch.float64)
    cache = cache or seqlen_k
    k = torch.randn(batch, cache, heads_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, cache, heads_kv, d, generator=g, dtype=torch.float64)
    return q, k, v, g


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, splits, tile_n)
    (1, 1, 1, 4, 1, True, 1, 128),
    (2, 1, 300, 8, 2, True, 1, 128),
    (2, 4, 300, 8, 1, True, 3, 128),
    (1, 16, 1000, 16, 2, True, 4, 128),  # 16 tokens x GQA 8: 128 packed rows, two m-blocks
    (2, 16, 257, 16, 1, True, 7, 64),  # GQA 16: four m-blocks, more splits than some have tiles
    (1, 5, 3, 4, 4, True, 2, 32),  # more tokens than keys: rows that see nothing
    (2, 3, 200, 4, 1, False, 5, 32),
    (1, 16, 200, 4, 1, True, 1, 32),  # the diagonal crosses a tile edge: two masked tiles
    (1, 16, 200, 4, 1, True, 2, 32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_kernels_walk_is_the_decode(case):
    batch, sq, sk, h, hk, causal, splits, tile_n = case
    q, k, v, _ = inputs(batch, sq, sk, h, hk, 32, seed=sum(case[:5]))
    out_ref, lse_ref = decode_reference(q, k, v, causal)
    out_p, lse_p, _ = emulate_decode(q, k, v, causal, splits, tile_n=tile_n)
    assert not out_p.isnan().any() and not lse_p.isnan().any()  # every partial written
    out, lse = merge_splits(out_p, lse_p)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)
    if splits == 1:  # one split: the partials are out and lse themselves
        torch.testing.assert_close(out_p[0], out_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("page_size,tile_n,page_box",
                         [(128, 128, None), (256, 128, None), (64, 64, None), (48, 16, None),
                          (16, 128, 16), (48, 128, 16), (64, 128, 64), (96, 64, 32)])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_walk_equals_contiguous_bit_for_bit(page_size, tile_n, page_box, splits):
    """The cache as shuffled pages among NaN pages no sequence owns, cached lengths per sequence
    (seqused_k) shorter than the pages hold, NaN in the rows past them (Note [Keys past the
    cached length]): the paged walk reads no foreign page, lets no NaN through and gives the
    contiguous walk's every bit."""
    batch, sq, h, hk = 3, 4, 8, 2
    pages = 5
    q, k, v, g = inputs(batch, sq, 0, h, hk, 32, seed=page_size + splits,
                        cache=pages * page_size)
    used = torch.tensor([pages * page_size, 1, pages * page_size - 77], dtype=torch.int32)
    for b, length in enumerate(used.tolist()):  # rows never written: any bits, NaN too
        k[b, length:] = math.nan
        v[b, length:] = math.nan
    kp, vp, table = paged_cache(k, v, page_size, generator=g)
    contiguous = emulate_decode(q, k, v, True, splits, seqused_k=used, tile_n=tile_n)
    paged = emulate_decode(q, kp, vp, True, splits, page_table=table, seqused_k=used,
                           tile_n=tile_n, page_box=page_box)
    assert contiguous[2] == paged[2]
    for a, b in zip(contiguous[:2], paged[:2]):
        assert torch.equal(a, b) and not a.isnan().any()
    out, lse = merge_splits(*paged[:2])
    out_ref, lse_ref = decode_reference(q, kp, vp, True, page_table=table, seqused_k=used)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)
    assert cached_lengths(kp, batch, table) == [pages * page_size] * batch


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_varlen_walk_is_the_decode_of_each_sequence(paged, splits):
    """Packed query sequences of 16, 1, 0 and 5 tokens (chunked prefill and decode steps in one
    launch) over a batched or paged cache with per-sequence lengths: the grid's m-blocks are
    counted for the longest sequence, the ones past a shorter sequence visit no key and store
    nothing, and every row of every sequence is its own decode."""
    lengths_q = [16, 1, 0, 5]
    cu = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    h, hk, d, page_size, pages = 16, 2, 32, 64, 4
    g = torch.Generator().manual_seed(splits + 2 * paged)
    q = torch.randn(int(cu[-1]), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(len(lengths_q), pages * page_size, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(len(lengths_q), pages * page_size, hk, d, generator=g, dtype=torch.float64)
    used = torch.tensor([256, 3, 100, 129], dtype=torch.int32)
    table = None
    if paged:
        k, v, table = paged_cache(k, v, page_size, generator=g)
    out_p, lse_p, _ = emulate_decode(q, k, v, True, splits, page_table=table, seqused_k=used,
                                     tile_n=64, cu_seqlens_q=cu, max_seqlen_q=max(lengths_q))
    assert out_p.shape == (splits, int(cu[-1]), h, d) and lse_p.shape == (splits, h, int(cu[-1]))
    assert not out_p.isnan().any() and not lse_p.isnan().any()
    out, lse = merge_splits(out_p, lse_p)
    out_ref, lse_ref = varlen_decode_reference(q, k, v, cu, True, page_table=table,
                                               seqused_k=used)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# a left window (sliding-window attention)

def visible_window(token, key, seqlen_q, seqlen_k, causal, window_left):
    return visible(token, key, seqlen_q, seqlen_k, causal) and (
        key >= token + seqlen_k - seqlen_q - window_left)


@pytest.mark.parametrize("window_left", [0, 5, 127, 300])
def test_window_start_and_tiles_are_tight(window_left):
    """key_start is the brute-force window's first key; n_start the first tile any real row of
    the m-block sees; tiles below n_left_free (and only they) hide a key of the rows' range from
    some row's window; the splits cut n_start .. n_end in order."""
    for tile_m, tile_n, group, seqlen_q, seqlen_k in block_cases():
        for r in range(0, seqlen_q * group, max(1, group // 2)):
            seen = [j for j in range(seqlen_k)
                    if visible_window(r // group, j, seqlen_q, seqlen_k, True, window_left)]
            if seen:
                assert key_start(r, group, seqlen_q, seqlen_k, window_left) == seen[0]
        for m_block in range(num_m_blocks(seqlen_q, group, tile_m)):
            rows = range(m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q * group))
            n_end, _ = block_key_tiles(m_block, tile_m, tile_n, group, seqlen_q, seqlen_k, True)
            n_start, n_left_free = block_key_start(m_block, tile_m, tile_n, group, seqlen_q,
                                                   seqlen_k, window_left)
            seen = {j for r in rows for j in range(seqlen_k)
                    if visible_window(r // group, j, seqlen_q, seqlen_k, True, window_left)}
            if seen:
                assert n_start == min(seen) // tile_n
            starts = [key_start(r, group, seqlen_q, seqlen_k, window_left) for r in rows]
            for n in range(n_start, n_end):
                hides = any(j < st for st in starts for j in range(n * tile_n, (n + 1) * tile_n))
                assert hides == (n < n_left_free), (n, n_left_free)
            for splits in (1, 3):
                covered = []
                for split in range(splits):
                    n_lo, n_hi = split_key_tiles(split, splits, seqlen_k, tile_n, n_end, n_start)
                    covered += range(n_lo, n_hi)
                    assert left_masked_tiles(n_lo, n_hi, n_left_free) == sum(
                        1 for n in range(n_lo, n_hi) if n < n_left_free)
                assert covered == list(range(n_start, n_end))
    assert block_key_start(0, 64, 128, 4, 1, 1000, None) == (0, 0)


WINDOW_CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, splits, tile_n, window)
    (2, 1, 1000, 8, 2, True, 1, 128, 300),
    (1, 16, 1024, 8, 2, True, 3, 32, 40),  # a window narrower than the tiles' rows span
    (2, 4, 704, 4, 1, True, 2, 64, 0),  # the diagonal alone
    (1, 7, 500, 4, 4, True, 4, 32, 5000),  # wider than the cache
    (2, 5, 333, 8, 2, False, 2, 32, 60),  # not causal: the window's left side alone
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_windowed_walk_is_the_decode(case):
    batch, sq, sk, h, hk, causal, splits, tile_n, window = case
    q, k, v, g = inputs(batch, sq, sk, h, hk, 32, seed=sum(case))
    out_ref, lse_ref = decode_reference(q, k, v, causal, window_left=window)
    out_p, lse_p, visited = emulate_decode(q, k, v, causal, splits, tile_n=tile_n,
                                           window_left=window)
    assert not out_p.isnan().any() and not lse_p.isnan().any()
    out, lse = merge_splits(out_p, lse_p)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)
    unwindowed = emulate_decode(q, k, v, causal, splits, tile_n=tile_n)[2]
    assert visited <= unwindowed  # the window's tiles only
    if sk > 2 * (window + sq) + 2 * tile_n:
        assert visited < unwindowed
    used = torch.tensor([sk - 13] * batch, dtype=torch.int32)  # and paged, seqused_k
    if sk % tile_n == 0:
        kp, vp, table = paged_cache(k, v, tile_n, generator=g)
        paged = emulate_decode(q, kp, vp, causal, splits, tile_n=tile_n, window_left=window,
                               page_table=table, seqused_k=used)
        contiguous = emulate_decode(q, k, v, causal, splits, tile_n=tile_n, window_left=window,
                                    seqused_k=used)
        assert all(torch.equal(a, b) for a, b in zip(paged[:2], contiguous[:2]))
        out, lse = merge_splits(*paged[:2])
        out_ref, lse_ref = decode_reference(q, k, v, causal, window_left=window, seqused_k=used)
        torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)


def test_a_split_with_no_key_writes_minus_inf_and_zero():
    q, k, v, _ = inputs(1, 1, 130, 4, 1, 16, seed=3)
    out_p, lse_p, visited = emulate_decode(q, k, v, True, 5)  # 2 tiles over 5 splits
    assert visited == 2
    assert torch.isinf(lse_p[2:]).all() and (lse_p[2:] < 0).all()
    assert (out_p[2:] == 0).all()
    assert math.isfinite(float(lse_p[0, 0, 0, 0]))
