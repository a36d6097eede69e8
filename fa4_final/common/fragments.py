"""Views of tensors: a global tensor with its modes reordered, and tensor-core register
fragments (mma.sync on sm_80, wgmma on sm_90). No data moves.

Both MMA families give a thread two rows of each 16-row band (r and r + 8) and two adjacent
columns of every 8, so the 4 lanes of a quad share their rows and a row reduction is a local one
followed by two butterfly shuffles inside the quad (THREADS_PER_ROW).
- mma.sync m16n8k16 accumulator: ((2, 2), MMA_M, MMA_N): (column pair, row pair), then 16 x 8
  blocks along M and N;
- wgmma m64nNk16 accumulator: ((2, 2, N/8), MMA_M, MMA_N): (column pair, row pair, 8-column
  group), one 64-row block per warpgroup.
"""

import cutlass.cute as cute

THREADS_PER_ROW = 4  # lanes 4i .. 4i+3 of a warp hold the same accumulator rows


def select_modes(t: cute.Tensor, modes: list) -> cute.Tensor:
    """Reorder a tensor's modes (a view; no data moves)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of this thread's accumulator elements: ``view[r, c]`` is its r-th row,
    c-th column. Works for both fragment shapes above (mode 0 of rank 2 or 3)."""
    flat = cute.make_layout(acc.layout.shape)  # compact: the fragment's own index order
    s, d = flat.shape, flat.stride
    if cute.rank(s[0]) == 2:  # mma.sync: ((2 cols, 2 rows), M, N)
        shape = ((s[0][1], s[1]), (s[0][0], s[2]))
        stride = ((d[0][1], d[1]), (d[0][0], d[2]))
    else:  # wgmma: ((2 cols, 2 rows, N/8 groups), M, N)
        shape = ((s[0][1], s[1]), (s[0][0], s[0][2], s[2]))
        stride = ((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape,
                                                                                   stride=stride)))


def acc_as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator (S, now P) as the register A operand of the next MMA (P V).

    The A fragment of a 16-wide k block holds, per thread, rows (r, r + 8) at k = (2q, 2q + 1)
    and (2q + 8, 2q + 9): exactly the accumulator values of two neighbouring 8-column groups. So
    the whole conversion is pairing those groups:
    - mma.sync: ((2, 2), M, N) -> (((2, 2), 2), M, N / 2), pairing n-blocks;
    - wgmma:    ((2, 2, N/8), 1, 1) -> ((2, 2, 2), 1, N / 16), splitting the group mode."""
    if cute.rank(acc.layout.shape[0]) == 2:
        paired = cute.logical_divide(acc.layout, (None, None, 2))  # ((2,2), M, (2, N/2))
        s, d = paired.shape, paired.stride
        layout = cute.make_layout(((s[0], s[2][0]), s[1], s[2][1]),
                                  stride=((d[0], d[2][0]), d[1], d[2][1]))
    else:
        split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
        s, d = split.shape, split.stride
        layout = cute.make_layout(((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
                                  stride=((d[0][0], d[0][1], d[0][2][0]), d[1],
                                          (d[0][2][1], d[2])))
    return cute.make_tensor(acc.iterator, layout)


def tree_reduce(values: list, op):
    """Combine values pairwise: depth log2(n) instead of a chain of n - 1 dependent ops."""
    while len(values) > 1:
        pairs = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2:]
    return values[0]
