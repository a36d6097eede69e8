"""Which query tiles a key tile's backward visits, which of them need a mask, and the fixed turn
order of the deterministic dQ accumulation. The backward's mirror of ``fa4_final.common.tiles``.

Note [Turn order]
In the deterministic mode the key tiles that visit query tile m add their dQ parts one after the
other, in a fixed order. The order decides the speed: a key tile that arrives at m before its
turn waits. With a causal diagonal (or any right window) key tile n reaches m after m - m_min(n)
steps and m_min grows with n, so the highest key tile arrives first: turns go downwards, from
last_visitor(m). Without one every key tile starts at m = 0 and any order makes a staircase;
turns go upwards, from first_visitor(m). A CTA may only wait for CTAs launched before it (a
waiting CTA holds its SM; one that cannot launch would never come): the kernel numbers its
CTAs so that turns follow launch order (``launch_order_reversed``).

Same visibility rule (FlashAttention's, bottom-right aligned): with offset = seqlen_k - seqlen_q,
query i sees key j when 0 <= j < seqlen_k and i + offset - window_left <= j <= i + offset +
window_right, i.e. for a fixed key j the queries
    j - offset - window_right  <=  i  <=  j - offset + window_left.
Plain arithmetic on purpose (kernels call it on ``Int32`` values while traced; the CPU tests on
Python ints against brute force). Rows past seqlen_q in the last query tile are padding that the
kernel makes harmless (their lse is +inf, so P = 0): the ranges may count them as visible.
"""

from __future__ import annotations

import cutlass

from fa4_final.common.tiles import TileWindow


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.min(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else cutlass.max(a, b)


def q_tile_range(w: TileWindow, n_block, seqlen_q, seqlen_k, window_left=None,
                 window_right=None):
    """(m_min, m_max, n_first_masked, n_last_masked) for key tile ``n_block``.

    Query tiles m_min .. m_max - 1 are visited in increasing order; m_min == m_max means none
    (keys that no query sees: their dK and dV are zero). The first ``n_first_masked`` visited
    can hold pairs right of a row's window (causal: above the diagonal); the last
    ``n_last_masked`` can hold pairs left of it. The tiles between need no mask. Keys past
    seqlen_k (the last key tile) are not counted here: the kernel masks every step of that tile.
    """
    offset = seqlen_k - seqlen_q
    num_m = (seqlen_q + w.tile_m - 1) // w.tile_m
    first_key = n_block * w.tile_n
    last_key = _min(first_key + w.tile_n, seqlen_k) - 1
    m_min = 0
    full_right = 0  # first query tile whose every row sees every key of the tile on the right
    if w.masks_right:
        wr = w.right_bound(window_right)
        first_row = _max(first_key - offset - wr, 0)  # the first query that sees first_key
        m_min = _min(first_row // w.tile_m, num_m)
        full_row = _max(last_key - offset - wr, 0)  # from here on rows see last_key too
        full_right = (full_row + w.tile_m - 1) // w.tile_m
    m_max = num_m
    full_left = num_m  # one past the last query tile free of left masking
    if w.has_left:
        last_row = last_key - offset + window_left  # the last query that sees last_key
        m_max = _min((_max(last_row, -1) + w.tile_m) // w.tile_m, num_m)
        # a tile is free of left masking when its last row still sees first_key
        full_left = _max(first_key - offset + window_left + 1, 0) // w.tile_m
    m_max = _max(m_max, m_min)
    n_first = _min(_max(full_right, m_min), m_max) - m_min
    n_last = m_max - _max(_min(full_left, m_max), m_min + n_first)
    return m_min, m_max, n_first, n_last


def visible_queries(w: TileWindow, key, seqlen_q, seqlen_k, window_left=None,
                    window_right=None, big=1 << 30):
    """(lo, hi): key ``key`` is seen by the queries lo <= i < hi (the rule of the module
    docstring; ``big`` stands for an unbounded side). A key past seqlen_k is seen by none. The
    backward kernels hold one key per accumulator row and compare these with query columns."""
    offset = seqlen_k - seqlen_q
    lo = -big
    hi = big
    if w.masks_right:
        lo = key - offset - w.right_bound(window_right)
    if w.has_left:
        hi = key - offset + window_left + 1
    # a key past seqlen_k is seen by no query: hi = -big (arithmetic, no run-time branch, so
    # the kernels may call this on traced values)
    inside = _min(_max(seqlen_k - key, 0), 1)
    hi = _min(hi, (2 * inside - 1) * big)
    return lo, hi


def first_visitor(w: TileWindow, m_block, seqlen_q, seqlen_k, window_left=None):
    """The lowest key tile whose ``q_tile_range`` contains query tile ``m_block`` (no left window:
    0, every key tile reaches the last rows). Key tiles first_visitor .. n all visit m_block
    when n does, so in the deterministic mode key tile n adds its dQ to m_block as turn
    n - first_visitor (Note [dQ turns] in hopper.bwd)."""
    if not w.has_left:
        return 0
    offset = seqlen_k - seqlen_q
    # key tile n reaches m_block when its last key is seen by the tile's first row:
    # last_key(n) >= m_block * tile_m + offset - window_left
    need = m_block * w.tile_m + offset - window_left
    return _max(need, 0) // w.tile_n


def last_visitor(w: TileWindow, m_block, num_n_blocks, seqlen_q, seqlen_k, window_right=None):
    """The highest key tile whose ``q_tile_range`` contains query tile ``m_block`` (-1 if none):
    the last n with m_min(n) <= m_block."""
    if not w.masks_right:
        return num_n_blocks - 1
    offset = seqlen_k - seqlen_q
    reach = (m_block + 1) * w.tile_m - 1 + offset + w.right_bound(window_right)
    return _min(_max(reach + w.tile_n, 0) // w.tile_n - 1, num_n_blocks - 1)


def launch_order_reversed(w: TileWindow) -> bool:
    """Whether the deterministic kernel numbers key tiles from the last: its turns go downwards
    (Note [Turn order]), so the CTAs waited for must be launched first."""
    return w.masks_right


def dq_turn(w: TileWindow, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k,
            window_left=None, window_right=None):
    """Key tile ``n_block``'s turn (0 = first) among the key tiles that add to query tile
    ``m_block``'s dQ in the deterministic mode (Note [Turn order])."""
    if launch_order_reversed(w):
        return last_visitor(w, m_block, num_n_blocks, seqlen_q, seqlen_k, window_right) - n_block
    return n_block - first_visitor(w, m_block, seqlen_q, seqlen_k, window_left)


# Note [A rotated walk]
# Without a mask window every key tile walks query tiles 0 .. M - 1 and every one starts at
# tile 0, so turns upwards (Note [Turn order]) form a staircase: key tile n adds at query tile
# m only after the n below it, and its whole walk lags theirs. HopperBwdConfig.dq_rotated
# starts key tile n at query tile start(n) = n x M // N (N key tiles) and wraps around, so the
# N walks are spread over the query tiles. The turns at query tile m then follow the order
# the key tiles arrive in: first the key tile whose start is the last at or before m,
# first(m) = min(ceil((m + 1) N / M), N) - 1, then first(m) - 1, ..., 0, N - 1, ...,
# first(m) + 1; key tile n's turn is (first(m) - n) mod N. Its predecessor at m is n + 1
# (mod N), which reached m about M / N steps earlier (at the same step when M < N and both
# start at m), so in step with each other no walk waits. The order is fixed by M and N, so
# the bits repeat from run to run; it is not the plain order (and dK, dV sum the steps in the
# walk's order), so they are not the plain mode's bits. The walk's start and length stay live
# in the producer warpgroup's warps, which spill at 24 registers: a rotated build runs them at
# 40 and each MMA warpgroup at 224 (SM90_BWD_REGISTERS_ROTATED), a difference a timing of it
# against the plain walk carries too.
# The price: key tile n now waits for n + 1, launched after it, which Note [Turn order]
# forbids in general. It is safe when all N key tiles of a head can be resident together:
# CTAs launch in order, a head whose key tiles have all launched depends on no other CTA and
# finishes, freeing SMs, so the head at the launch frontier gets its missing key tiles; that
# head alone can block, and only if its N CTAs do not fit on the GPU at once. The kernel
# rotates when N <= ROTATED_MAX_KEY_TILES (64: one CTA a SM, and every whole Hopper GPU has
# more SMs; a smaller one, a MIG slice, is refused before the launch: check_rotated_walk) and
# keeps the plain order otherwise (``rotated_on``), the same choice in every role. The bound
# is well below a whole GPU's 114-132 SMs on purpose: kernels on other streams may hold SMs
# for as long as they like (a collective waiting for its peers), and a head must still fit
# beside them. Walks with a mask window keep the plain order (their m_min differs per key
# tile already, Note [Turn order]).
# Why dq_rotated is an option (config=) and not the deterministic default: the bound above is
# about the SMs a process can count on, and a process cannot always count them. Under MPS with
# an SM share, in a green context, or with several such backwards on concurrent streams, fewer
# SMs may be free than the device reports, and a head's key tiles may then never be resident
# together: the call would hang. Timed on an H100, the rotated walk takes a tenth or more off
# the deterministic time where no mask window and few key tiles meet (S = 4096 dense at D = 64
# and 128) and matches the plain walk elsewhere; a caller who owns the whole GPU may take it.

ROTATED_MAX_KEY_TILES = 64


def rotated_on(num_n_blocks):
    """1 when a walk without a mask window rotates (num_n_blocks <= ROTATED_MAX_KEY_TILES),
    else 0 (Note [A rotated walk]): arithmetic, so a kernel may call it on traced values."""
    return _min(_max(ROTATED_MAX_KEY_TILES + 1 - num_n_blocks, 0), 1)


def check_rotated_walk(num_sms: int) -> None:
    """Refuse the rotated walk on a GPU with fewer SMs than ROTATED_MAX_KEY_TILES (a MIG
    slice): a head's key tiles might not all be resident at once, and a turn could then wait
    for a CTA that never launches (Note [A rotated walk])."""
    if num_sms < ROTATED_MAX_KEY_TILES:
        raise ValueError(f"dq_rotated=True needs a GPU of at least {ROTATED_MAX_KEY_TILES} SMs "
                         f"(every key tile of a head resident; Note [A rotated walk]), this "
                         f"one has {num_sms}: use dq_rotated=False")


def rotated_start(n_block, num_m, num_n_blocks):
    """The query tile (from 0) where key tile ``n_block`` starts its rotated walk."""
    return (n_block * num_m) // _max(num_n_blocks, 1)  # 0 key tiles: a CTA with no step


def _wrap(x, span):
    """x mod span for 0 <= x < 2 span, without a division (min and max: cheap on a GPU)."""
    return x - span * _min(_max(x - span + 1, 0), 1)


def rotated_tile(i, start, num_m):
    """The query tile of step ``i`` (0 = first) of a walk over ``num_m`` tiles from ``start``
    (0 <= i, start < num_m)."""
    return _wrap(i + start, num_m)


def rotated_turn(n_block, m_block, num_m, num_n_blocks):
    """Key tile ``n_block``'s turn at query tile ``m_block`` under the rotated walk: the order
    in which the key tiles arrive there (Note [A rotated walk])."""
    first = _min(((m_block + 1) * num_n_blocks + num_m - 1) // num_m, num_n_blocks) - 1
    return _wrap(first - n_block + num_n_blocks, num_n_blocks)


# Note [dQ copies]
# The deterministic mode's price is a chain: without a causal diagonal every key tile of a head
# reaches query tile m together and adds its part only after all lower key tiles have added
# theirs (Note [Turn order]). With C accumulator copies (HopperBwdConfig.dq_copies) key tile n
# adds into copy n % C and takes turns only among the visitors of m of its own copy, which are
# every C-th visitor of the turn order above: its turn is dq_turn(...) // C (the visitors of a
# copy between the first visitor and n are the floor of (n - first) / C, the same counted
# downwards from the last visitor when turns go downwards). Chains are C times shorter; each
# wait is still on a CTA of the same turn order, so on one launched earlier. The copies of
# query tile m lie side by side: accumulator slab m * C + c (and turn counter m * C + c), so
# bwd_pre zeroes, and bwd_post reads, one contiguous run of C slabs per query tile; bwd_post
# sums copy 0, 1, ..., C - 1 in that order, so the bits are the same every run (and differ from
# the one-copy mode's within float32 rounding). Memory: C accumulators, (C - 1) x tile_m x D x
# 4 B more per query tile and head. C = 1 is the one-accumulator kernel, the same code.
# dq_early_release, the second half of the candidate: today's dQ warp waits for its add to
# complete (for the turn) before it hands the staging buffer back, so every step of a
# deterministic CTA pays the add's whole latency; with it, the buffer goes back once the add
# has read it and the turn passes when the add has completed, as before. Both knobs are reached
# through config= (a HopperBwdConfig) only: deterministic=True alone keeps the one-copy kernel.
# On an H100 the candidates matched float64 and repeated bitwise, and at D = 128 none took more
# than 2% less time than the one-copy kernel at any shape (more at every causal one); at D = 64,
# S = 4096 without a mask, four copies with first stores (below) took less.
# dq_first_store removes the copies' price outside the main kernel: bwd_pre zeroing every copy
# and bwd_post reading every copy cost (C - 1) x the accumulator's bytes twice. With it the
# visitor whose turn is 0 at (m, c) writes its part with a plain bulk copy (bulk_store_f32,
# no read of the slab) and later turns add, so bwd_pre zeroes only the turn counters. Why turn
# 1's add sees turn 0's store whole: both are the same turn protocol as two adds; turn 0's dQ
# warp waits for its bulk group to complete (wait_group 0, writes done, not just read), fences
# (fence.acq_rel.gpu) and increments the counter with release semantics; turn 1 issues its add
# only after an acquire load has seen that increment, so its read-modify-write starts from the
# stored values (both warpgroups' chunks of a step are one CTA's turn, stored together). Why
# an unzeroed slab is never read: a copy with no visitor (copy_visited false: no key tile
# n = c mod C reaches m, e.g. rows that see no key) is never written and its counter stays at
# bwd_pre's 0; bwd_post reads a copy only where its counter is non-zero (the counter ends at
# the copy's visitor count, checked against q_tile_range on the CPU) and takes zero elsewhere,
# so garbage, NaN included, never enters the sum. The sum order is unchanged (copy 0 first),
# and the values equal the zeroing build's (0 + x = x; a zero's sign may differ). Reached
# through config= only, like the other two knobs.
# The copies on the overlapped two-buffer kernel (dq_buffers = 2, dq_adds_overlap: two dQ
# warps, step s on warp s % 2): each warp indexes the slab and counter m * C + n % C and waits
# for turn // C, as the one-buffer warp does, so each copy receives the same adds in the same
# order and every gradient must equal the one-buffer kernel's with the same copies. Why the
# two together: the two warps keep two adds in flight, but with one copy each add still waits
# for the key tile below it, which reaches m in step with it on a walk without a mask window,
# so a chain of N adds at m sets the pace whenever an add's round trip outlasts a step; C
# copies cut the chain to N / C and leave C - 1 steps between the visitors of a copy. On an
# H100 the builds with 2 and 4 copies matched float64, repeated bitwise over 20 runs and gave
# the one-buffer kernel's bits with the same copies (memcheck, racecheck, synccheck clean), and
# where one accumulator cost more than a tenth over the default (S = 4096 without a mask
# window, D = 64 and 128) the copies brought it under a tenth; at D = 128 with a causal
# diagonal four copies took more than half again the default's time and two matched one
# accumulator, which the chain does not explain (not profiled). hopper_bwd_det_copies holds
# the choice, behind the gate of Note [Pending features] until the deterministic suites
# through the call pass with it. The price: C accumulators of memory, and bwd_post reads every
# visited copy.


def dq_copy_turn(w: TileWindow, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k,
                 window_left=None, window_right=None, copies: int = 1):
    """(copy, turn) of key tile ``n_block`` at query tile ``m_block`` with ``copies``
    accumulators (Note [dQ copies]); copies = 1 gives (0, dq_turn(...))."""
    turn = dq_turn(w, n_block, m_block, num_n_blocks, seqlen_q, seqlen_k, window_left,
                   window_right)
    if copies == 1:
        return 0, turn
    return n_block % copies, turn // copies


def dq_slab(m_pad, copy, copies: int = 1):
    """The accumulator slab (and turn counter) of query tile ``m_pad``'s copy ``copy``
    (Note [dQ copies]); ``m_pad`` itself with one copy."""
    if copies == 1:
        return m_pad
    return m_pad * copies + copy


def copy_visited(w: TileWindow, m_block, copy, num_n_blocks, seqlen_q, seqlen_k,
                 window_left=None, window_right=None, copies: int = 1):
    """Whether some key tile adds (or, with dq_first_store, stores) into copy ``copy`` of query
    tile ``m_block``: the visitors of m_block are the key tiles first_visitor .. last_visitor,
    and copy c has one when a key tile n = c (mod copies) lies among them (Note [dQ copies]).
    Its counter then ends at the number of such visitors, and at 0 otherwise: bwd_post reads
    that counter on the device rather than recomputing this, so it needs no key lengths or
    window (the CPU tests check both agree with q_tile_range for every window kind)."""
    lo = _max(first_visitor(w, m_block, seqlen_q, seqlen_k, window_left), 0)
    hi = _min(last_visitor(w, m_block, num_n_blocks, seqlen_q, seqlen_k, window_right),
              num_n_blocks - 1)
    # the first key tile >= lo of this copy
    first_of_copy = lo + (copy - lo % copies + copies) % copies
    return first_of_copy <= hi


# ----------------------------------------------------------------------------------------------
# varlen: the backward over packed sequences (fa4_final.runtime.varlen, Note [Varlen backward])

# Note [Varlen dQ accumulator]
# The float32 dQ accumulator, lse_log2 and delta are per query tile: a tile's tile_m * D floats
# are one contiguous slab in the order the MMA threads hold them (Note [dQ in accumulator order]
# of fa4_final.hopper.bwd), added with one bulk instruction per warpgroup, and its lse and delta
# arrive with one 16-byte-aligned bulk copy of tile_m floats. So a query tile must own a whole
# slab: with packed sequences a tile starts at a sequence's row cu_seqlens_q[b] + m * tile_m,
# anywhere, and row-indexed buffers would need the slabs of two sequences to overlap. Each
# sequence is therefore padded to whole tiles: sequence b's query tile m is slab
#     dq_accum_tile(cu_seqlens_q[b], b, tile_m) + m = cu_seqlens_q[b] // tile_m + b + m,
# an expression of the sequence's own offset (no scan over the lengths before it, on the host or
# the device). Sequence b needs ceil(len_b / tile_m) slabs and the next starts at
# cu[b + 1] // tile_m + b + 1 >= cu[b] // tile_m + ceil(len_b / tile_m) + b: no overlap. All of
# them fit in dq_accum_tiles(total_q, batch, tile_m) = total_q // tile_m + batch slabs, at most
# one tile per sequence more than the packed rows (FA2 and FA3 pad the same way). The padding
# rows of a sequence's last tile get lse_log2 = +inf from bwd_pre (P = 0, so they add exact
# zeros); the slabs between sequences are never read. The alternative, exact per-tile offsets
# (a prefix sum of ceil(len_b / tile_m)), would save those gap slabs but need that scan in
# bwd_pre, the main kernel and bwd_post alike.


def dq_accum_tile(seq_start_q, b, tile_m: int):
    """The dQ accumulator's slab (query tile index) of sequence ``b``'s first query tile, from
    its first packed row ``seq_start_q`` = cu_seqlens_q[b] (Note [Varlen dQ accumulator])."""
    return seq_start_q // tile_m + b


def dq_accum_tiles(total_q: int, batch: int, tile_m: int) -> int:
    """Slabs of the varlen dQ accumulator (and tiles of its lse_log2, delta, turn counters);
    with dq_copies the accumulator and the turn counters hold that many times more
    (Note [dQ copies])."""
    return total_q // tile_m + batch


def varlen_grid_bound(total: int, batch: int, tile: int, heads: int) -> int:
    """CTAs a varlen launch needs at most for ``total`` packed rows cut per sequence into tiles
    of ``tile``: each sequence adds at most one partial tile (sum of ceil(len_b / tile) <=
    ceil(total / tile) + batch), per head. CTAs past the exact count find no tile and exit."""
    return (-(-total // tile) + batch) * heads


def varlen_key_tile_host(t: int, lens_k: list[int], tile_n: int, heads_kv: int,
                         reversed_order: bool = False):
    """(b, n_block, head_kv) of the varlen backward's CTA ``t``, or None past the last key tile:
    sequences in order, in each its kv heads, in each head its key tiles (Note [Varlen backward]
    in fa4_final.hopper.bwd). ``reversed_order``: the deterministic mode's numbering when turns
    go downwards (launch_order_reversed), the highest key tile first. Host mirror of
    HopperBackward.varlen_key_tile."""
    from fa4_final.common.schedule import varlen_locate_host

    b, before, total = varlen_locate_host(t, lens_k, tile_n, heads_kv)
    if not 0 <= t < total:
        return None
    n_blocks = -(-lens_k[b] // tile_n)
    r = t - before
    n_block = r % n_blocks
    if reversed_order:
        n_block = n_blocks - 1 - n_block
    return b, n_block, r // n_blocks
