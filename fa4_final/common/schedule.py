"""Tile order and the persistent schedulers.

A persistent kernel launches one CTA per SM (or fewer when there is less work) and each CTA walks
many linear tiles t: in fixed rounds (t = blockIdx.x, then zigzag_tile), from a table the host built
(Note [Tile table]), or taking the next at run time from a global counter (Note [Dynamic tiles]).
With fixed rounds or a table its producer and consumer warps walk the same sequence independently
(nothing to communicate: the order is a pure function of t, or of the table); the dynamic producer
hands each tile to the consumers through shared memory. Either way the K/V pipelines run on across
tile boundaries, so the next tile's loads start while the last one's epilogue is being written.

Order: non-causal tiles go m_block fastest, so the CTAs that run at the same
time work on the same (batch, head) and read the same K/V tiles out of L2. Causal tiles go
longest first (the m_block with the most keys, over every head and batch, then the next), so the
short tiles fill the gaps at the end instead of one long tile running alone.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def tile_coords(t, num_m_blocks, num_heads, num_batch, longest_first: bool, l2_group=None):
    """(m_block, head, batch) of linear tile t, for t in [0, num_m_blocks * heads * batch).

    Non-causal: m_block fastest, so the CTAs running together share one head's K and V in L2.
    Causal (``longest_first``): the (head, batch) pairs go in sections of ``l2_group`` pairs;
    inside a section, every pair's last m_block (the one that sees the most keys) first, then
    the m_block before it, and so on. ``l2_group=None`` is one section of all pairs: longest
    first over the whole problem. Smaller sections keep the K and V that run together few
    enough to stay in L2 (Note [Causal order])."""
    if longest_first and l2_group is None:
        l2_group = num_heads * num_batch
    if longest_first:
        pairs = num_heads * num_batch
        span = l2_group * num_m_blocks  # tiles in a full section
        section = t // span
        base = section * l2_group
        size = _min(l2_group, pairs - base)  # the last section may hold fewer pairs
        r = t - section * span
        hb = base + r % size
        m_block = num_m_blocks - 1 - r // size
        return m_block, hb % num_heads, hb // num_heads
    m_block = t % num_m_blocks
    rest = t // num_m_blocks
    return m_block, rest % num_heads, rest // num_heads


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    import cutlass

    return cutlass.min(a, b)


# Note [Causal order]
# Causal tiles cost m_block + 1 KV steps. Longest first over all (head, batch) pairs lets a
# static persistent schedule balance (zigzag_tile pairs long and short tiles), but the tiles that
# run together then span every head. Sections of a few heads, as FA3 and FA4 order them, keep the
# running tiles on few heads' K and V (a section of g heads is g * seqlen_k * D * 4 bytes), at
# the price of a saw-tooth cost sequence that a static schedule cannot balance: they need the
# hardware's own scheduling of one CTA per tile, or a dynamic one.


def persistent_grid(num_tiles: int, max_ctas: int) -> int:
    """CTAs to launch: one per SM, fewer when there are fewer tiles."""
    return max(1, min(num_tiles, max_ctas))


def tiles_of_cta(cta: int, grid: int, num_tiles: int) -> list[int]:
    """The linear tiles CTA ``cta`` computes, in order (host-side mirror of the device loop)."""
    return [t for t in (zigzag_tile(r, cta, grid) for r in range(rounds(num_tiles, grid)))
            if t < num_tiles]


def zigzag_tile(r, cta, grid):
    """Linear tile of CTA ``cta`` in round ``r`` of a persistent grid of ``grid`` CTAs:
    left to right in even rounds, right to left in odd ones.

    With tiles sorted longest first (causal), plain round robin (tile r * grid + cta) hands
    CTA 0 the longest tile of every round and the last CTA the shortest: over many rounds the
    first CTAs fall behind by the sum of those differences, and the kernel waits for them.
    Reversing every other round pairs a long tile with a short one and cancels the drift to
    first order. For equal tiles (non-causal) both orders are the same."""
    odd = r % 2  # arithmetic, not a branch: kernels call this on run-time integers
    return r * grid + cta + odd * (grid - 1 - 2 * cta)


def rounds(num_tiles, grid):
    """Rounds a persistent grid of ``grid`` CTAs needs for ``num_tiles`` tiles."""
    return (num_tiles + grid - 1) // grid


# Note [Tile table]
# The order of the tiles (above) and which CTA computes which are two choices. zigzag_tile hands
# them out in fixed rounds, which balances a cost sequence that falls smoothly (longest first over
# every head). In sections of a few heads (Note [Causal order]) the costs are a saw-tooth, one tooth
# per section, and fixed rounds then leave some CTAs with far more work than others. What balances a
# saw-tooth is what the hardware does with one CTA per tile: the next tile goes to whichever CTA
# frees up first. A persistent kernel can have that without any atomics because the costs are known
# before the launch: a causal tile costs the number of key tiles it visits
# (fa4_final.common.tiles.kv_tile_range) plus a constant for its first and last turns and its
# epilogue. The host replays that greedy assignment (list scheduling) once per shape and uploads the
# result as a table: entry r * grid + cta is the linear tile CTA ``cta`` computes in its round r, or
# num_tiles when it has none left. The producer and the consumer warps read the same entries, so
# they still walk the same tiles without talking to each other (Note [Forward phases] of
# fa4_final.hopper.fwd). The table ends with a row of num_tiles, so reading round r + 1 to learn
# whether round r is a CTA's last never leaves it.

TILE_OVERHEAD_STEPS = 1  # what a tile costs besides its key tiles, in key-tile steps (model)


def list_schedule(costs: list[int], grid: int) -> list[list[int]]:
    """Tiles 0 .. len(costs) - 1, in that order, each to the CTA that frees up first (ties:
    the lowest CTA). Returns each CTA's tiles in the order it computes them."""
    import heapq

    free = [(0, cta) for cta in range(grid)]
    tiles: list[list[int]] = [[] for _ in range(grid)]
    for t, cost in enumerate(costs):
        at, cta = heapq.heappop(free)
        tiles[cta].append(t)
        heapq.heappush(free, (at + cost, cta))
    return tiles


def round_major(per_cta: list[list], sentinel) -> list:
    """Each CTA's entries laid out round by round (round r: CTA 0's r-th entry, CTA 1's, ...),
    ``sentinel`` where a CTA has none, for one round more than the longest list: the sentinel
    row ends every CTA's walk."""
    rows = max(len(entries) for entries in per_cta) + 1
    return [per_cta[cta][r] if r < len(per_cta[cta]) else sentinel
            for r in range(rows) for cta in range(len(per_cta))]


def tile_table(costs: list[int], grid: int) -> list[int]:
    """The flat table of Note [Tile table]: (rounds + 1) * grid entries, round-major; the
    sentinel is len(costs)."""
    return round_major(list_schedule(costs, grid), len(costs))


# Note [Split tail]
# Equal tiles (not causal) over a persistent grid come in rounds: 2048 tiles on 132 SMs are 15
# full rounds and a last one of 68 tiles, during which 64 SMs have nothing to do, 3% of the
# kernel's SM time. The FA4 package's one CTA per tile has the same last, partial wave. The
# split tail cuts the tiles of that last round along the keys instead: their KV steps,
# concatenated, are dealt out in contiguous ranges of equal length to every CTA, so each
# CTA's last work is 16 or 17 steps of 32 instead of 32 steps or nothing. A range may end in
# the next tile, so a CTA computes at most two pieces. Each piece is a tile restricted to a
# range of key tiles: it leaves its unnormalised O, row max and row sum (float32) in a
# workspace and counts itself on the tile's counter (an atomic add); the piece that finds the
# count complete is the last, merges the others into its registers exactly as the online
# softmax merges two key tiles, zeroes the counter for the next launch and stores out and lse
# like an unsplit tile. Nobody waits for anybody. A piece costs its steps plus writing its
# partial (and, for the last one, reading the others'), SPLIT_OVERHEAD_STEPS in the model; the
# host splits only when that model says the kernel ends sooner.
#
# Table entries are then SPLIT_FIELDS int32 each: (tile, first key tile, end key tile, slot,
# first slot of the tile, pieces of the tile); a whole tile has slot -1 and keys [0, 2^30).

SPLIT_FIELDS = 6
WHOLE_TILE_KEYS = 1 << 30
SPLIT_OVERHEAD_STEPS = 2  # a piece's partial write plus the last piece's reads (model)
MIN_PIECE_STEPS = 4  # shorter ranges cost more in overhead than they balance


def split_tail_items(num_tiles: int, steps: int, grid: int):
    """Per CTA, its work items (tile, n_lo, n_hi, slot, first_slot, pieces) for num_tiles
    equal tiles of ``steps`` key tiles each (Note [Split tail]), and the number of slots.
    Without a worthwhile split: whole tiles in rounds, 0 slots."""
    full, rest = divmod(num_tiles, grid)
    items = [[(r * grid + cta, 0, WHOLE_TILE_KEYS, -1, 0, 0) for r in range(full)]
             for cta in range(grid)]
    total = rest * steps
    takers = min(grid, total // MIN_PIECE_STEPS)
    split_end = -(-total // takers) + SPLIT_OVERHEAD_STEPS if takers else steps
    if rest == 0 or steps < 2 or split_end >= steps:
        for i in range(rest):  # the last, partial round as it is
            items[i].append((full * grid + i, 0, WHOLE_TILE_KEYS, -1, 0, 0))
        return items, 0
    # steps [bounds[c], bounds[c + 1]) of the concatenated rest go to CTA c
    bounds = [c * total // takers for c in range(takers + 1)]
    pieces = []  # (cta, tile, n_lo, n_hi) in stream order
    for cta in range(takers):
        a, b = bounds[cta], bounds[cta + 1]
        while a < b:
            t, lo = divmod(a, steps)
            hi = min(b - t * steps, steps)
            pieces.append((cta, full * grid + t, lo, hi))
            a = t * steps + hi
    first_slot, count = {}, {}
    for slot, (_, tile, _, _) in enumerate(pieces):
        first_slot.setdefault(tile, slot)
        count[tile] = count.get(tile, 0) + 1
    for slot, (cta, tile, lo, hi) in enumerate(pieces):
        if count[tile] == 1:  # a tile left whole by the ranges
            items[cta].append((tile, 0, WHOLE_TILE_KEYS, -1, 0, 0))
        else:
            items[cta].append((tile, lo, hi, slot, first_slot[tile], count[tile]))
    return items, len(pieces)


def split_tail_table(num_tiles: int, steps: int, grid: int) -> tuple[list[int], int]:
    """The flat table of Note [Split tail] ((rounds + 1) * grid entries of SPLIT_FIELDS,
    round-major; the sentinel entry's tile is num_tiles) and the number of slots."""
    items, slots = split_tail_items(num_tiles, steps, grid)
    sentinel = (num_tiles, 0, 0, -1, 0, 0)
    return [f for entry in round_major(items, sentinel) for f in entry], slots


def table_rounds(table_entries: int, grid):
    """Rounds a CTA walks in a table of ``table_entries`` entries (its last row is the
    sentinel row)."""
    return table_entries // grid - 1


# Note [Dynamic tiles]
# The tile table balances the costs the host's model predicts. What it cannot see is what a tile
# really costs on the GPU: a tile whose K and V miss in L2, an SM that the power manager clocks
# lower, a CTA whose turns collide with its neighbour's epilogue. A small scatter per tile leaves
# some CTAs behind by the end (in a model of the hand-out, a scatter of 1-2% costs the table half a
# per cent to a per cent more than dynamic hand-out at causal benchmark shapes). The dynamic
# scheduler takes the next tile when a CTA needs it, as the hardware does with one CTA per tile, and
# keeps the persistent kernel's overlap of one tile's epilogue with the next one's loads:
#   - tile t is the t-th of the order above (longest first, in L2 sections), or of
#     Note [Varlen order];
#   - CTA c starts with tile c; after issuing the loads of a tile, its producer warp takes the
#     next from a global counter: t = grid + atomicAdd(counter, 1), none once t >= num_tiles;
#   - the producer hands t to the consumer warpgroups through a ring of TILE_SLOTS slots in
#     shared memory, each with a FULL mbarrier (the producer's arrive, after its store) and
#     an EMPTY one (every consumer thread's arrive, after its load); a t >= num_tiles ends
#     every role's loop;
#   - every CTA that has a first tile (c < num_tiles; a varlen grid may be larger) fetches
#     once more than it has tiles, so a launch makes exactly num_tiles fetches (grid of them
#     return a t past the end, one per such CTA, and num_tiles - grid return tiles; with
#     fewer tiles than CTAs, num_tiles CTAs fetch once): the one that returns num_tiles - 1
#     is the launch's last and sets the counter back to 0 for the next launch (the host
#     zeroes it once, when it creates it; the next launch on the same stream starts after
#     this one has ended).
# The consumers then do not know, during a tile, whether it is their last, which the turns of
# Note [Turns] (fa4_final.hopper.fwd) need in order to skip the last arrive. So here every
# turn hands on, and warpgroup 0 takes one turn more after the loop: the one that the last
# warpgroup's last arrive opened (none in a CTA that found no tile).

TILE_SLOTS = 2  # depth of the producer -> consumers ring of tile indices


@cute.jit
def fetch_tile(counter: cute.Tensor, grid: Int32, num_tiles: Int32) -> Int32:
    """The next tile of Note [Dynamic tiles]: lane 0 of the calling warp adds 1 to the
    counter, the warp gets grid + the old value. The launch's last fetch zeroes the counter."""
    got = Int32(0)
    if cute.arch.lane_idx() == 0:
        got = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        if got == num_tiles - 1:
            counter[0] = Int32(0)
    return grid + cute.arch.shuffle_sync(got, 0)


@cute.jit
def publish_tile(full: cute.Pointer, empty: cute.Pointer, slots: cute.Tensor, r: Int32,
                 tile: Int32):
    """Producer (lane 0): the tile of round r into slot r % TILE_SLOTS once the consumers
    have read what the slot held, then its FULL arrive (a release: the store is seen)."""
    if cute.arch.lane_idx() == 0:
        s = r % TILE_SLOTS
        cute.arch.mbarrier_wait(empty + s, ((r // TILE_SLOTS) % 2) ^ 1)  # lap 0 passes
        slots[s] = tile
        cute.arch.mbarrier_arrive(full + s)


@cute.jit
def read_tile(full: cute.Pointer, empty: cute.Pointer, slots: cute.Tensor, r: Int32) -> Int32:
    """Consumer thread: the tile of round r, then its EMPTY arrive (the slot may be reused)."""
    s = r % TILE_SLOTS
    cute.arch.mbarrier_wait(full + s, (r // TILE_SLOTS) % 2)
    tile = slots[s]
    cute.arch.mbarrier_arrive(empty + s)
    return tile


# ----------------------------------------------------------------------------------------------
# varlen: sequences packed one after another (fa4_final.runtime.varlen)

# Note [Varlen order]
# Sequence b has ceil(len_q[b] / tile_m) query tiles per head. The linear tile index runs over
# the sequences in the order given, each sequence's tiles contiguous: tile t belongs to the first
# sequence b whose prefix sum of tiles (over every head) exceeds t, and inside it r = t - (tiles
# before b) is placed by tile_coords with a batch of one, i.e. the dense kernel's own order:
# m_block fastest when not causal (the CTAs running together read one head's K and V), longest
# first when causal (every head's last m_block, then the one before, in sections of l2_group
# heads). A global longest-first order over all sequences would need the tiles sorted by cost on
# the host (a device sync, or an extra kernel). The costs therefore come as one saw-tooth per
# sequence (per L2 section of its heads), teeth of every size: fixed zigzag rounds leave some
# CTAs far behind on such a sequence, so the varlen kernel takes its tiles at run time
# (Note [Dynamic tiles]), each CTA the next one as it frees up. Nothing is sorted on the host, and
# nothing is read back: each warp finds its tile's sequence from cu_seqlens_q by itself
# (varlen_locate), 32 sequences per step. The host sizes the grid from a bound on the tile
# count (the exact count needs the offsets' values), so a CTA may find no tile at all.


def varlen_tiles(len_q: int, tile_m: int, heads: int) -> int:
    """Tiles of one sequence of ``len_q`` query rows, over every head."""
    return -(-len_q // tile_m) * heads


def varlen_locate_host(t: int, lens_q: list[int], tile_m: int, heads: int):
    """Plain-Python mirror of ``varlen_locate``: (b, tiles before b, total tiles), the warp's
    lanes written out as lists. For t >= total tiles, b and tiles-before are 0."""
    lanes = 32
    b = before = base = 0
    for chunk in range(-(-len(lens_q) // lanes)):
        n = [varlen_tiles(lens_q[i], tile_m, heads) if i < len(lens_q) else 0
             for i in (chunk * lanes + lane for lane in range(lanes))]
        incl = [sum(n[:lane + 1]) for lane in range(lanes)]  # the warp's inclusive scan
        total = incl[-1]
        if base <= t < base + total:
            j = sum(base + incl[lane] <= t for lane in range(lanes))  # popc(ballot(...))
            b = chunk * lanes + j
            before = base + incl[j] - n[j]
        base += total
    return b, before, base


def varlen_tile_coords_host(t: int, lens_q: list[int], tile_m: int, heads: int,
                            longest_first: bool, l2_group=None):
    """(b, m_block, head) of linear tile t (Note [Varlen order]), as the kernel computes it."""
    b, before, _ = varlen_locate_host(t, lens_q, tile_m, heads)
    m_block, head, _ = tile_coords(t - before, -(-lens_q[b] // tile_m), heads, 1,
                                   longest_first, l2_group)
    return b, m_block, head


WARP = 32


@cute.jit
def _warp_inclusive_sum(x: Int32) -> Int32:
    lane = cute.arch.lane_idx()
    for k in cutlass.range_constexpr(5):  # Hillis-Steele over 32 lanes: offsets 1, 2, 4, 8, 16
        y = cute.arch.shuffle_sync_up(x, 1 << k)
        if lane >= (1 << k):
            x = x + y
    return x


@dsl_user_op
def lane_here(*, loc=None, ip=None) -> Int32:
    """The lane index, read where it is called: an asm with side effects, which LLVM may neither
    hoist out of a loop nor read again later. (The lane intrinsic it may move either way: the
    tile loops of the 24-register producer kept a per-lane pointer into cu_seqlens live, and
    spilled it; the consumers' KV loop read the thread index again every step,
    Note [Signalling lane] in fa4_final.hopper.fwd.)"""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %laneid;", "=r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def varlen_locate(t: Int32, mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int],
                  heads: Int32, mSeqUsed: cute.Tensor | None = None):
    """(b, tiles before b, total tiles) for linear tile ``t`` (Note [Varlen order]).

    Warp-collective: all 32 lanes of a warp call it with the same ``t``. Each step reads the
    offsets of 32 sequences (one per lane), scans their tile counts across the warp, and the
    sequence holding t is the number of lanes whose inclusive prefix is still <= t. The loop
    runs ceil(batch / 32) steps whatever t is, so every warp also learns the total.
    ``mSeqUsed`` (the backward's key tiles with seqused_k): sequence i is mSeqUsed[i] long, not
    cu[i + 1] - cu[i]. Host mirror: varlen_locate_host."""
    batch = mCuSeqlensQ.shape[0] - 1
    b, before, base = Int32(0), Int32(0), Int32(0)
    for chunk in cutlass.range(cute.ceil_div(batch, WARP), unroll=1):
        i = chunk * WARP + lane_here()
        n = Int32(0)
        if i < batch:
            if const_expr(mSeqUsed is None):
                n = cute.ceil_div(mCuSeqlensQ[i + 1] - mCuSeqlensQ[i], tile_m) * heads
            else:
                n = cute.ceil_div(mSeqUsed[i], tile_m) * heads
        incl = _warp_inclusive_sum(n)
        total = cute.arch.shuffle_sync(incl, WARP - 1)
        if (t >= base) & (t < base + total):  # the same for every lane: no divergence
            j = cute.arch.popc(cute.arch.vote_ballot_sync(base + incl <= t))
            b = chunk * WARP + j
            before = base + cute.arch.shuffle_sync(incl - n, j)
        base = base + total
    return b, before, base
