"""tcgen05.mma from descriptors: what one thread hands the tensor cores.

A ``tcgen05.mma`` names its operands by *descriptors*, not registers:

- the **instruction descriptor** (32 bits) says what to compute: operand and accumulator
  types, M and N, and whether A and B are K-major or MN-major (PTX ISA, "Instruction descriptor"
  of tcgen05.mma, kind::f16). ``instr_desc`` encodes it, ``decode_instr_desc`` reads it back;
- a **shared-memory descriptor** (64 bits) says where an operand tile is and how it is laid
  out: start address / 16 in bits 0-13, the leading- and stride-byte offsets (LBO, SBO, / 16)
  in bits 16-29 and 32-45, a fixed version field (bits 46-47) and the swizzle mode in bits
  61-63. Only the start address changes from one 16-deep K block, or one pipeline stage, to the
  next, so a kernel computes the descriptor once (CuTe builds it from the tile's layout) and
  adds small constants to its low word;
- an operand in tensor memory (A = P here) is named by its TMEM address: lane in the upper 16
  bits, column in the lower 16.

``mma`` issues the D/16 (or n/16) instructions of one GEMM from a single elected thread in one
inline-PTX block, the low words computed on the fly. Why not CuTe's ``cute.gemm`` with the
descriptor fragments? It precomputes a 64-bit descriptor per (K block, stage): for Q, K and V
that is 2 * 8 + 3 * 8 + 3 * 8 = 64 descriptors at D = 128, more than the 63 uniform registers,
and the MMA warp (48 registers) spilled them (measured on our compile: 78 spill instructions);
FA4's own forward issues its MMAs the same lean way. ``reload_words`` reads descriptor base
words back from shared memory where they must be fresh each step (bwd_pair,
Note [Descriptors read each step]).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

# operand formats of kind::f16 (PTX ISA) and accumulator formats
_AB_FORMAT = {"Float16": 0, "BFloat16": 1}
_D_FORMAT = {"Float16": 0, "Float32": 1}
SWIZZLE_MODES = {0: "none", 1: "128B with 32B atoms", 2: "128B", 4: "64B", 6: "32B"}


def instr_desc(a_type, b_type, acc_type, m: int, n: int, a_mn_major: bool,
               b_mn_major: bool) -> int:
    """The 32-bit instruction descriptor of a dense tcgen05.mma.kind::f16."""
    names = [getattr(t, "__name__", str(t)) for t in (a_type, b_type, acc_type)]
    if names[0] not in _AB_FORMAT or names[1] not in _AB_FORMAT:
        raise ValueError(f"A and B must be Float16 or BFloat16 for kind::f16, got {names[:2]}")
    if names[2] not in _D_FORMAT:
        raise ValueError(f"the accumulator must be Float16 or Float32, got {names[2]}")
    if m not in (64, 128, 256):
        raise ValueError(f"M must be 64, 128 or 256, got {m}")
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"N must be a multiple of 8 in [8, 256], got {n}")
    return (_D_FORMAT[names[2]] << 4 | _AB_FORMAT[names[0]] << 7 | _AB_FORMAT[names[1]] << 10
            | int(a_mn_major) << 15 | int(b_mn_major) << 16 | (n >> 3) << 17 | (m >> 4) << 24)


def decode_instr_desc(desc: int) -> dict:
    """The fields of an instruction descriptor, for reading one out of PTX."""
    fmt = {v: k for k, v in _AB_FORMAT.items()}
    return {"D format": {0: "Float16", 1: "Float32"}.get(desc >> 4 & 3, "?"),
            "A format": fmt.get(desc >> 7 & 7, "?"), "B format": fmt.get(desc >> 10 & 7, "?"),
            "negate A": bool(desc >> 13 & 1), "negate B": bool(desc >> 14 & 1),
            "A major": "MN" if desc >> 15 & 1 else "K", "B major": "MN" if desc >> 16 & 1 else "K",
            "N": (desc >> 17 & 0x3F) << 3, "M": (desc >> 24 & 0x1F) << 4}


def decode_smem_desc(desc: int) -> dict:
    """The fields of a 64-bit shared-memory matrix descriptor (byte quantities multiplied
    back from their 16-byte units)."""
    return {"start address": (desc & 0x3FFF) << 4, "LBO bytes": (desc >> 16 & 0x3FFF) << 4,
            "SBO bytes": (desc >> 32 & 0x3FFF) << 4, "version": desc >> 46 & 3,
            "base offset": desc >> 49 & 7, "swizzle": SWIZZLE_MODES.get(desc >> 61 & 7, "?")}


def op_instr_desc(op) -> int:
    """``instr_desc`` of a CuTe tcgen05 MMA op (its types, shape and major modes)."""
    mn = cute.nvgpu.OperandMajorMode.MN
    return instr_desc(op.a_dtype, op.b_dtype, op.acc_dtype, op.shape_mnk[0], op.shape_mnk[1],
                      op.a_major_mode == mn, op.b_major_mode == mn)


@dsl_user_op
def smem_desc_words(fragment: cute.Tensor, *, loc=None, ip=None) -> tuple:
    """(low, high) 32-bit words of the descriptor CuTe built for element 0 of a shared-memory
    operand fragment (``tiled_mma.make_fragment_A/B`` of a staged smem tensor); the high word
    is a compile-time constant after folding."""
    d = Int64(tcgen05.smem_descriptor_to_int(fragment.iterator, loc=loc, ip=ip))
    return Int32(d & 0xFFFFFFFF), Int32(d >> 32)


def block_offsets(fragment_layout, blocks: int, word_bits: int = 0, elem_bits: int = 0) -> list:
    """Offsets (in the operand's own units: 16 B for smem descriptors, 32-bit columns for
    TMEM) of K blocks 0 .. blocks-1 of a (MMA, 1, K blocks[, STAGE]) fragment layout."""
    layout = fragment_layout
    if word_bits:
        layout = cute.recast_layout(word_bits, elem_bits, fragment_layout)
    rank = len(layout.shape)
    return [cute.crd2idx((0, 0, k) + (0,) * (rank - 3), layout) for k in range(blocks)]


@dsl_user_op
def mma(acc_tmem: Int32, a: Int32, a_hi, a_offsets: list, b_lo: Int32, b_hi: Int32,
        b_offsets: list, idesc: int, accumulate, cta_group: int = 1, *, loc=None,
        ip=None) -> None:
    """acc (+)= A B: len(a_offsets) tcgen05.mma instructions, one per 16-deep K block, issued
    by one elected lane of the calling warp. ``a`` is the low descriptor word of an smem A
    (``a_hi`` its high word) or, with ``a_hi=None``, A's TMEM address; ``accumulate`` is a
    Python bool or a run-time Boolean for the first block (the rest always accumulate)."""
    ts = a_hi is None
    acc_flag = Int32(int(accumulate)) if isinstance(accumulate, bool) else Int32(accumulate)
    args = [Int32(x) for x in (acc_tmem, a, b_lo, b_hi)] + [acc_flag]
    if not ts:
        args.append(Int32(a_hi))
    instr = f"tcgen05.mma.cta_group::{cta_group}.kind::f16"
    a_operand = "[$1]" if ts else "da"
    body = [
        "{",
        ".reg .pred leader, p;",
        ".reg .b32 alo, blo, id;",
        ".reg .b64 da, db;",
        "elect.sync _|leader, -1;",
        f"mov.b32 id, {hex(idesc)};",
        "setp.ne.b32 p, $4, 0;",
        "mov.b64 db, {$2, $3};",
    ]
    if not ts:
        body.append("mov.b64 da, {$1, $5};")
    body.append(f"@leader {instr} [$0], {a_operand}, db, id, p;")
    for k in range(1, len(b_offsets)):
        body.append(f"add.u32 blo, $2, {hex(b_offsets[k])};")
        body.append("mov.b64 db, {blo, $3};")
        if ts:
            a_k = f"[$1 + {hex(a_offsets[k])}]"
        else:
            body.append(f"add.u32 alo, $1, {hex(a_offsets[k])};")
            body.append("mov.b64 da, {alo, $5};")
            a_k = "da"
        body.append(f"@leader {instr} [$0], {a_k}, db, id, 1;")
    body.append("}")
    llvm.inline_asm(None, [x.ir_value(loc=loc, ip=ip) for x in args], "\n".join(body),
                    ",".join(["r"] * len(args)), has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def reload_words(addr: Int32, count: int, *, loc=None, ip=None) -> list:
    """``count`` (a multiple of 4) 32-bit words from shared byte address ``addr``, read with
    ``ld.volatile.shared.v4``: executed where it stands, every time
    (Note [Descriptors read each step])."""
    i32 = T.i32()
    out = []
    for k in range(0, count, 4):
        struct = llvm.inline_asm(
            llvm.StructType.get_literal([i32] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
            f"ld.volatile.shared.v4.u32 {{$0, $1, $2, $3}}, [$4+{4 * k}];", "=r,=r,=r,=r,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        out += [Int32(llvm.extractvalue(i32, struct, [j], loc=loc, ip=ip)) for j in range(4)]
    return out
