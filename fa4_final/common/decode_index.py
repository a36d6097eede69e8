"""The decode kernel's index arithmetic: packed query rows, key tiles per split, pages.

Plain arithmetic on purpose, like common.tiles: the Hopper decode kernel calls these functions
on run-time ``Int32`` values while it is traced, and the CPU tests call them on Python ints and
hold them against brute force and a float64 walk of the whole decode.

Note [Packed GQA rows]
The query heads that share a KV head read the same keys, so a CTA takes all of them at once: the
rows of its query tile are (token, head) pairs of one (batch entry, KV head), the heads of a
token next to each other,
    packed row r  ->  token r // group,  head kv_head * group + r % group,
with ``group`` = heads // heads_kv. A sequence's seqlen_q tokens give seqlen_q * group packed rows,
cut into tiles of tile_m rows (m-blocks); the last m-block's rows past that count are padding,
computed and never stored. Causal masking is bottom-right (the query tokens are the last
seqlen_q of the sequence): token t sees keys j < t + seqlen_k - seqlen_q + 1, so a packed row's
key limit depends on its token only, and the rows of one token share it.
With two consumer warpgroups (tile_m = 128, Note [Two consumer warpgroups] in
fa4_final.hopper.decode) warpgroup p of m-block m owns the 64-row tile 2 m + p: rows
64 (2 m + p) + r, the same packed rows in the same order, while the key tiles, splits and masked
tiles are those of the 128-row m-block, a superset of each 64-row tile's.

Note [Key splits]
A (batch entry, KV head)'s key tiles are cut into ``num_splits`` consecutive ranges of
ceil(tiles / num_splits) tiles, counted over the whole sequence (ceil(seqlen_k / tile_n) tiles)
so that every m-block cuts at the same keys; an m-block whose causal limit ends earlier clips
its ranges there. With a left window (sliding-window attention) an m-block sees only the tiles
from n_start on, and the count starts there: the splits share the window, not the cache. A
split left with no tile writes lse = -inf and out = 0, which the combine weighs by exp(-inf) =
0. The tiles are visited from the highest down, so the ones that need a mask (past seqlen_k or
right of a row's causal limit) come first, and those left of a row's window last.

Note [Key tile pages]
A paged cache keeps keys in pages of page_size rows, k of shape (num_pages, page_size, heads_kv,
D), and a sequence's page i is page_table[b, i]. With page_size a multiple of tile_n, key tile n
lies inside one page: slot n // (page_size // tile_n) of the sequence's row of the table, tile
n % (page_size // tile_n) inside that page, so one TMA box per tile still reads it. A contiguous
cache is the same walk with one page per sequence: page b, page_size = the cache's length.

Note [Gathered key tiles]
Serving engines use small pages (16 keys is common), and a key tile of 16 keys would make every
step a 64 x 16 GEMM pair with the same fixed softmax work, so a page smaller than the tile is
gathered instead: the tile stays 128 keys and is filled by tile_n / page_box TMA boxes of
page_box keys (the largest of 64, 32, 16 that divides the page). Box j of key tile n starts at
key n * tile_n + j * page_box, which lies in slot key // page_size of the table at box
(key % page_size) // page_box of that page; every box signals the stage's one FULL barrier,
which the producer arms with the whole tile's bytes. A box past the sequence's last key (the
last tile may end past it) is pointed at the box that holds that last key: it reads real memory
of a page the table maps (a slot past the sequence's pages may hold anything, and the table's
row may be shorter than the tile), and the consumer masks those keys and zeroes V's rows there
as for any tile that ends past seqlen_k. The rows of a box stay whole 8-row swizzle atoms of the
stage's layout, so the consumer reads the tile exactly as a tile that one box filled.
"""

from __future__ import annotations

from fa4_final.common.tiles import _max, _min


def _cdiv(a, b):
    """ceil(a / b) for a >= 0, b > 0: ints or run-time Int32 alike (either may be either)."""
    return (a + b - 1) // b


def packed_rows(seqlen_q, group):
    """Packed query rows of one (batch entry, KV head): every token times every head of its group
    (Note [Packed GQA rows])."""
    return seqlen_q * group


def num_m_blocks(seqlen_q, group, tile_m: int):
    """Query tiles of tile_m packed rows over one (batch entry, KV head)."""
    return _cdiv(packed_rows(seqlen_q, group), tile_m)


def unpack_row(row, group, kv_head):
    """(token, query head) of packed row ``row`` of KV head ``kv_head``."""
    return row // group, kv_head * group + row % group


def key_limit(row, group, seqlen_q, seqlen_k, causal: bool):
    """One past the last key packed row ``row`` sees (<= 0: none). Not causal: seqlen_k.
    Causal: bottom-right, token t sees keys j <= t + seqlen_k - seqlen_q."""
    if not causal:
        return seqlen_k
    return _min(seqlen_k, row // group + seqlen_k - seqlen_q + 1)


def key_start(row, group, seqlen_q, seqlen_k, window_left=None):
    """The first key packed row ``row`` sees: 0, or with a left window (sliding-window
    attention) token t's t + seqlen_k - seqlen_q - window_left, clamped at 0."""
    if window_left is None:
        return 0
    return _max(row // group + seqlen_k - seqlen_q - window_left, 0)


def block_key_start(m_block, tile_m: int, tile_n: int, group, seqlen_q, seqlen_k,
                    window_left=None):
    """(n_start, n_left_free) for m-block ``m_block`` with a left window: its rows see no key
    of tiles below n_start, and tiles n < n_left_free hold keys left of some row's window (a
    mask is needed there). Without a window: (0, 0)."""
    if window_left is None:
        return 0, 0
    first = m_block * tile_m
    last = _max(_min(first + tile_m, packed_rows(seqlen_q, group)) - 1, first)
    start_first = key_start(first, group, seqlen_q, seqlen_k, window_left)
    start_last = key_start(last, group, seqlen_q, seqlen_k, window_left)
    return start_first // tile_n, _cdiv(start_last, tile_n)


def block_key_tiles(m_block, tile_m: int, tile_n: int, group, seqlen_q, seqlen_k,
                    causal: bool):
    """(n_end, n_full) for m-block ``m_block``: its rows see keys of tiles 0 .. n_end - 1 only,
    and tiles n >= n_full hold keys some of its rows must not see (a mask is needed there).
    Padding rows past the packed count are left out of n_end (they are never stored); an
    m-block wholly past them (varlen: the grid is sized for the longest sequence) visits none."""
    first = m_block * tile_m
    rows = packed_rows(seqlen_q, group)
    last = _min(first + tile_m, rows) - 1
    end = _max(key_limit(last, group, seqlen_q, seqlen_k, causal), 0)
    end = _min(_max(rows - first, 0), 1) * end  # no arithmetic branch: traced code takes it too
    full = _max(key_limit(first, group, seqlen_q, seqlen_k, causal), 0)
    return _cdiv(end, tile_n), full // tile_n


def split_key_tiles(split, num_splits, seqlen_k, tile_n: int, n_end, n_start=0):
    """(n_lo, n_hi): split ``split`` of ``num_splits`` visits key tiles n_lo <= n < n_hi
    (Note [Key splits]); n_hi <= n_lo means none. With a left window the splits cut the tiles
    from the m-block's first one, ``n_start``, on."""
    per_split = _cdiv(_max(_cdiv(seqlen_k, tile_n) - n_start, 0), num_splits)
    n_lo = n_start + split * per_split
    n_hi = _min(n_lo + per_split, n_end)
    return n_lo, _max(n_hi, n_lo)


def masked_tiles(n_lo, n_hi, n_full):
    """How many of the split's tiles, the first visited (the highest), need a mask."""
    return _min(_max(n_hi - _max(n_full, n_lo), 0), n_hi - n_lo)


def left_masked_tiles(n_lo, n_hi, n_left_free):
    """How many of the split's tiles, the last visited (the lowest), need a left-window
    mask."""
    return _min(_max(_min(n_hi, n_left_free) - n_lo, 0), _max(n_hi - n_lo, 0))


def key_tile_location(n, tile_n: int, page_size):
    """(slot in the sequence's page-table row, tile inside that page) of key tile ``n``
    (Note [Key tile pages]); page_size is a multiple of tile_n."""
    tiles_per_page = page_size // tile_n
    return n // tiles_per_page, n % tiles_per_page


def gathered_box_start(n, j, tile_n: int, page_box: int, seqlen_k):
    """The first key of box ``j`` of key tile ``n`` when pages smaller than the tile are gathered
    (Note [Gathered key tiles]): n * tile_n + j * page_box, or the box of the sequence's last key
    when that lies past it. seqlen_k >= 1 (a split with no keys loads no tile)."""
    last = (seqlen_k - 1) // page_box * page_box
    return _min(n * tile_n + j * page_box, last)


def key_box_location(key, page_size, page_box: int):
    """(slot in the sequence's page-table row, box inside that page) of the box of ``page_box``
    keys that starts at ``key`` (a multiple of page_box; page_size a multiple of page_box)."""
    return key // page_size, key % page_size // page_box


def page_box_for(page_size: int) -> int | None:
    """Keys per TMA box of a gathered key tile: the largest of 64, 32, 16 that divides the page
    (Note [Gathered key tiles]); None when none does (no multiple of 16)."""
    for box in (64, 32, 16):
        if page_size > 0 and page_size % box == 0:
            return box
    return None


def page_size_problem(page_size: int, tile_n: int, page_box: int | None = None) -> str | None:
    """Why the TMA page walk cannot take pages of ``page_size`` rows, or None when it can. With
    ``page_box`` (a gathered key tile) the page must hold whole boxes."""
    if page_box is not None:
        if page_size < 1 or page_size % page_box:
            return (f"page_size={page_size}: this decode kernel gathers each {tile_n}-key tile "
                    f"from boxes of {page_box} keys, so the page size must be a positive "
                    f"multiple of {page_box} (hopper.config.hopper_decode_for_page chooses the "
                    f"box for a page size; pages must be multiples of 16 keys)")
        return None
    if page_size < 1 or page_size % tile_n:
        return (f"page_size={page_size}: the decode kernel loads each key tile of {tile_n} rows "
                f"with one TMA box from one page, so the page size must be a positive multiple "
                f"of {tile_n}; the config of hopper.config.hopper_decode_for_page takes "
                f"pages of any multiple of 16 keys (smaller pages gathered into whole tiles)")
    return None
