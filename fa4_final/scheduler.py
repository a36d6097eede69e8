"""Tile order and the persistent static scheduler.

A persistent kernel launches one CTA per SM (or fewer when there is less work) and each CTA walks
the linear tile index t = blockIdx.x, blockIdx.x + gridDim.x, ... Its producer and consumer warps
walk the same sequence independently (nothing to communicate: the order is a pure function of t),
and the K/V pipelines run on across tile boundaries, so the next tile's loads start while the
last one's epilogue is being written.

Order: non-causal tiles go m_block fastest, so the CTAs that run at the same
time work on the same (batch, head) and read the same K/V tiles out of L2. Causal tiles go
longest first (the m_block with the most keys, over every head and batch, then the next), so the
short tiles fill the gaps at the end instead of one long tile running alone.
"""

from __future__ import annotations


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
# -------------------
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
