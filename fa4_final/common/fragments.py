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

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

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


# Note [Pairwise conversion]
# P's register A operand holds two 16-bit values per 32-bit register: adjacent columns, the first
# mode of the fragment. ``tOrP.store(s.load().to(dtype))`` converts the whole fragment as one
# vector, and LLVM splits that vector into pieces of its own choosing; where the fragment's size
# is no multiple of those pieces (tile_n 48, 80, 96 or 112 of a wgmma accumulator) the halves
# come out as 16-bit registers and are packed into 32-bit ones right before each wgmma that reads
# them, between wgmma.fence and the wgmma: ptxas then injects warpgroup.arrive (info C7519) and
# the P V wgmma waits for the one before it. ``to_16bit_pairs`` converts each column pair with
# one cvt.rn.{bf16x2,f16x2}.f32 straight into the 32-bit register the wgmma reads. The kernels
# use it only at those tile_n, so the builds that compile clean either way keep their code.


@dsl_user_op
def cvt_pair(lo, hi, dtype, *, loc=None, ip=None) -> Int32:
    """Two float32 -> one 32-bit register of two 16-bit values, ``lo`` in the low half (one
    cvt.rn.bf16x2.f32 or cvt.rn.f16x2.f32; PTX puts its first source in the high half)."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    operands = [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def to_16bit_pairs(src: cute.Tensor, dst: cute.Tensor):
    """``dst`` (a compact 16-bit register fragment whose first mode pairs adjacent columns) =
    ``src`` (float32, the same logical shape, any layout), one cvt per column pair
    (Note [Pairwise conversion])."""
    first = cute.make_layout(dst.layout.shape)  # compact, left-major: pairs are (2j, 2j + 1)
    assert dst.element_type.width == 16 and cute.size(dst) % 2 == 0
    assert cute.cosize(dst.layout) == cute.size(dst) and dst.layout == first, dst.layout
    pairs = cute.recast_tensor(dst, Int32)
    for j in cutlass.range_constexpr(cute.size(pairs)):
        pairs[j] = cvt_pair(src[2 * j], src[2 * j + 1], dst.element_type)
