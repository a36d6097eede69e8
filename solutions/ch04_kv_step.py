"""Chapter 04's KV step, written by the learner in three pieces of device code (exercises 04.3,
04.4 and 04.5), and everything that checks them.

One step of the kernel's KV loop (``FlashAttentionAmpere.kv_step``) is three pieces between its
loads and barriers:

- ``gemm_qk``: S = Q K^T, a loop over the 16-wide k-slices of the head dim: ldmatrix of a slice of
  Q and of K from shared memory into registers, then mma.sync (exercise 04.3);
- ``online_softmax``: per row of S the thread holds, the row max over the quad (two butterfly
  shuffles), the new running max, P = exp2(...), the rescale factor, the row sum, and O rescaled
  (exercise 04.4);
- ``gemm_pv``: O += P V, P straight from the registers that held S, V's k-slices by ldmatrix
  (exercise 04.5).

``KernelWithPieces`` is the chapter's kernel with any of the three replaced by other code (the
learner's); with none replaced its sm_80 SASS is the kernel's, byte for byte (a test holds it).
Each piece is checked three ways:

1. on the CPU, as plain Python (``utils.host_emulation``): the GEMM loops with stand-ins that
   hold each k-slice as a float64 array and write down every ldmatrix and mma.sync (which slice
   went into which registers, which registers met in which mma.sync), against float64; the
   softmax as a warp of 32 lanes, each lane a thread of its own with its own fragment from the
   kernel's mma.sync layout, the shuffles exchanging values between them, against float64;
2. compiled into the kernel for sm_80, with its SASS read: mma.sync (HMMA) per step, shuffles,
   local memory (a stack frame, LDL/STL);
3. on a GPU (``check_pieces_on_gpu``): the kernel with the piece, on awkward shapes, against the
   float64 reference.

Every checker says in words what is wrong (which slice met which, which lane disagrees, a
missing rescale, the wrong shuffle offsets, a row that turns NaN).
"""

from __future__ import annotations

import functools
import re
import threading
import types

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, const_expr
from cutlass.cute.runtime import from_dlpack

from solutions import ch04_flash_ampere as fa
from utils.host_emulation import patched, python_loops

TileConfig = fa.TileConfig
LANES = 32


# ================================================================================================
# The kernel with its three pieces swappable
# ================================================================================================
class KernelWithPieces(fa.FlashAttentionAmpere):
    """Chapter 04's kernel with ``qk`` (S = Q K^T, gemm_from_smem's signature), ``softmax`` (the
    online softmax on the rows x columns views of S and O) and ``pv`` (O += P V, gemm_from_regs's
    signature) in place of its own pieces; None keeps the kernel's. Everything else, loads,
    barriers, mask, epilogue, is the kernel's own code."""

    def __init__(self, qk=None, softmax=None, pv=None, dtype=cutlass.BFloat16,
                 head_dim: int = 128, causal: bool = False, config: TileConfig | None = None):
        super().__init__(dtype, head_dim, causal,
                         fa.default_config(head_dim) if config is None else config)
        self.qk = fa.gemm_from_smem if qk is None else qk
        self.softmax = softmax
        self.pv = fa.gemm_from_regs if pv is None else pv

    @cute.jit
    def gemm_qk(self, acc_S, thr, stage):
        self.qk(thr.tiled_mma, acc_S, thr.tSrQ, thr.tSrK, thr.tSsQ,
                thr.tSsK[None, None, None, stage], thr.smem_copy_Q, thr.smem_copy_K,
                self.config.qk_unroll)

    @cute.jit
    def online_softmax(self, acc_S, acc_O, row_max, row_sum, scale_log2,
                       is_first: cutlass.Constexpr):
        if const_expr(self.softmax is None):
            fa.FlashAttentionAmpere.online_softmax(self, acc_S, acc_O, row_max, row_sum,
                                                   scale_log2, is_first)
        else:
            self.softmax(fa.rows_cols_view(acc_S), fa.rows_cols_view(acc_O), row_max, row_sum,
                         scale_log2, is_first)

    @cute.jit
    def gemm_pv(self, rP, thr, stage):
        self.pv(thr.tiled_mma, thr.acc_O, fa.acc_as_a_operand(rP), thr.tOrVt,
                thr.tOsVt[None, None, None, stage], thr.smem_copy_V)


_BUILDS: dict = {}


def compile_with(qk=None, softmax=None, pv=None, head_dim: int = 128, causal: bool = False,
                 arch: str = "sm_80", dtype: str = "bf16"):
    """``KernelWithPieces`` compiled for ``arch`` with fake tensors (no GPU), as
    ``fa.compile_only`` compiles the kernel; remembered per pieces and shape."""
    from cutlass.cute.runtime import make_fake_tensor

    from utils.compile_only import compile_for, fake_stream

    key = (qk, softmax, pv, head_dim, causal, arch, dtype)
    if key not in _BUILDS:
        elem = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
        kernel = KernelWithPieces(qk, softmax, pv, elem, head_dim, causal)

        def fake(dt, rank, align):
            shape = tuple(cute.sym_int32() for _ in range(rank))
            stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
            return make_fake_tensor(dt, shape, stride, assumed_align=align)

        q, k, v, o = (fake(elem, 4, 16) for _ in range(4))
        _BUILDS[key] = compile_for(arch, kernel, q, k, v, o, fake(Float32, 3, 4), Float32(1.0),
                                   fake_stream())
    return _BUILDS[key]


_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", re.M)


def sass_body(sass: str) -> list[str]:
    """The SASS instructions alone (no section headers, which carry the kernel's class name)."""
    return _INSTRUCTION.findall(sass)


def sass_counts(art) -> dict:
    """What the checkers read from a compiled kernel: mma.sync (HMMA), shuffles (SHFL.BFLY and
    any other SHFL), exp2 (MUFU.EX2), local memory (stack frame bytes, LDL/STL)."""
    body = sass_body(art.sass)
    ops = [ins.split()[0] if not ins.startswith("@") else ins.split()[1] for ins in body]
    return {"HMMA": sum(op.startswith("HMMA") for op in ops),
            "SHFL.BFLY": sum(op.startswith("SHFL.BFLY") for op in ops),
            "SHFL": sum(op.startswith("SHFL") for op in ops),
            "MUFU.EX2": sum(op.startswith("MUFU.EX2") for op in ops),
            "LDL/STL": sum(op.startswith(("LDL", "STL")) for op in ops),
            "stack bytes": art.frame_bytes, "registers": art.registers}


def same_as_kernel(art, head_dim: int = 128, causal: bool = False) -> bool:
    """Whether ``art`` has the kernel's own SASS, instruction for instruction."""
    return sass_body(art.sass) == sass_body(compile_with(None, None, None, head_dim, causal).sass)


def _expected_hmma(head_dim: int = 128) -> dict:
    """mma.sync per KV step of the default tile: QK^T per trip of its loop, PV per step."""
    c = fa.default_config(head_dim)
    m_atoms = c.m_block // (16 * c.num_warps)  # 16-row MMA blocks per warp
    return {"qk_trip": m_atoms * (c.n_block // 8) * c.qk_unroll,
            "qk_step": m_atoms * (c.n_block // 8) * (head_dim // 16),
            "pv_step": m_atoms * (head_dim // 8) * (c.n_block // 16),
            "unroll": c.qk_unroll, "slices": head_dim // 16}


def _local_memory(counts) -> bool:
    return counts["stack bytes"] > 0 or counts["LDL/STL"] > 0


# ================================================================================================
# Running a piece as plain Python
# ================================================================================================
class _F32(float):
    """cutlass.Float32 in an emulation: a plain float (Float32(0.0), Float32.inf)."""

    inf = float("inf")

    def __new__(cls, value=0.0):
        return float(value)


def _run_plain(fn, *args):
    """``fn`` (a ``@cute.jit`` function) as written, as plain Python: its source's code with the
    names that stand for cutlass.Float32 bound to a plain float. Loops must already be patched."""
    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None) or raw.__code__
    scope = dict(raw.__globals__)
    for name, value in raw.__globals__.items():
        if value is cutlass.Float32:
            scope[name] = _F32
    plain = types.FunctionType(code, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    with patched(cutlass, Float32=_F32):
        return plain(*args)


class _RunTime(int):
    """A loop counter of a run-time loop (``cutlass.range``): an int that remembers it is not a
    compile-time value, through the arithmetic done on it."""

    def _keep(self, value):
        return _RunTime(value) if isinstance(value, int) else value

    def __add__(self, other):
        return self._keep(int(self) + int(other))

    __radd__ = __add__

    def __sub__(self, other):
        return self._keep(int(self) - int(other))

    def __rsub__(self, other):
        return self._keep(int(other) - int(self))

    def __mul__(self, other):
        return self._keep(int(self) * int(other))

    __rmul__ = __mul__

    def __mod__(self, other):
        return self._keep(int(self) % int(other))

    def __floordiv__(self, other):
        return self._keep(int(self) // int(other))


class _Log:
    def __init__(self):
        self.loops = []  # ("range" or "range_constexpr", trips, options)
        self.copies = []  # (operand, k, slot)
        self.gemms = []  # ((A operand, k), (B operand, k))
        self.run_time_slots = []  # register fragments indexed by a run-time loop counter
        self.sequence = []  # ("copy", operand, k) and ("mma", operand of A, k), in order


def _index(key, name):
    if not (isinstance(key, tuple) and len(key) == 3 and key[0] is None and key[1] is None):
        raise AssertionError(f"index {name} as {name}[None, None, k]: modes 0 and 1 are one "
                             "k-slice of this thread's fragment, mode 2 picks the k-slice")
    return key[2]


class _SliceRef:
    def __init__(self, owner, k):
        self.owner, self.k = owner, k


class _Smem:
    """An operand in shared memory, (CPY, MMA_rows, MMA_K): k-slices of 16 columns."""

    def __init__(self, name, operand, slices):
        self.name, self.operand, self.slices = name, operand, slices

    def __getitem__(self, key):
        k = _index(key, self.name)
        n = len(self.slices)
        if not isinstance(k, (int, np.integer)) or not 0 <= int(k) < n:
            raise AssertionError(f"{self.name} ({self.operand} in shared memory) has k-slices "
                                 f"0..{n - 1} (cute.size({self.name}, mode=[2]) = {n}); you asked "
                                 f"for slice {k!r}")
        return _SliceRef(self, int(k))


class _Regs:
    """An operand's register fragment, (MMA, MMA_rows, MMA_K), seen by the MMA ("mma") or, after
    ``smem_copy.retile``, by the ldmatrix copy ("copy"): the same registers either way."""

    def __init__(self, name, operand, slots, log, view="mma", preloaded=False):
        self.name, self.operand, self.slots, self.log = name, operand, slots, log
        self.view, self.preloaded = view, preloaded

    def __getitem__(self, key):
        j = _index(key, self.name)
        n = len(self.slots)
        if not isinstance(j, (int, np.integer)) or not 0 <= int(j) < n:
            raise AssertionError(f"{self.name} holds k-slices 0..{n - 1} of {self.operand}; you "
                                 f"asked for slot {j!r}")
        if isinstance(j, _RunTime):
            self.log.run_time_slots.append(self.name)
        return _SliceRef(self, int(j))


class _Acc:
    def __init__(self, name, data):
        self.name, self.data = name, data


class _SmemCopy:
    """smem_copy_A / smem_copy_B: the ldmatrix copy of one operand."""

    def __init__(self, name, operand):
        self.name, self.operand = name, operand

    def retile(self, regs):
        if not isinstance(regs, _Regs) or regs.operand != self.operand:
            raise AssertionError(f"{self.name}.retile takes the register fragment of "
                                 f"{self.operand}, got {getattr(regs, 'name', regs)!r}")
        return _Regs(regs.name, regs.operand, regs.slots, regs.log, view="copy",
                     preloaded=regs.preloaded)


class _TiledMma:
    pass


def _gemm_model(log: _Log):
    def copy(atom, src, dst, *args, **kwargs):
        if not isinstance(atom, _SmemCopy):
            raise AssertionError(f"cute.copy's first argument is the ldmatrix copy of the "
                                 f"operand (smem_copy_A or smem_copy_B), got {atom!r}")
        if not (isinstance(src, _SliceRef) and isinstance(src.owner, _Smem)):
            raise AssertionError(f"{atom.name} copies a k-slice of shared memory (its operand's "
                                 "tCs..[None, None, k]) into registers; its source was not one")
        if not (isinstance(dst, _SliceRef) and isinstance(dst.owner, _Regs)):
            raise AssertionError(f"{atom.name} writes registers: its destination is a slot of "
                                 "the retiled fragment, retile(tCr..)[None, None, j]")
        regs = dst.owner
        if regs.preloaded:
            raise AssertionError(f"{regs.name} ({regs.operand}) is already in registers: "
                                 "nothing is loaded into it; only the B operand (V) is read "
                                 "from shared memory")
        if src.owner.operand != atom.operand or regs.operand != atom.operand:
            raise AssertionError(f"{atom.name} loads {atom.operand}; you gave it "
                                 f"{src.owner.operand}'s slice and {regs.operand}'s registers. "
                                 "Each operand has its own copy, slices and fragment")
        if regs.view != "copy":
            raise AssertionError(f"ldmatrix writes its registers in its own arrangement: copy "
                                 f"into {atom.name}.retile({regs.name})[None, None, j], the same "
                                 f"registers seen by the copy; {regs.name}[None, None, j] is "
                                 "the MMA's view (the DSL refuses it: mode sizes differ)")
        regs.slots[dst.k] = (src.owner.operand, src.k, src.owner.slices[src.k])
        log.copies.append((src.owner.operand, src.k, dst.k))
        log.sequence.append(("copy", src.owner.operand, src.k))

    def gemm(mma, d, a, b, c, *args, **kwargs):
        if not isinstance(mma, _TiledMma):
            raise AssertionError("cute.gemm's first argument is tiled_mma")
        if not (isinstance(d, _Acc) and c is d):
            raise AssertionError("accumulate in place: cute.gemm(tiled_mma, acc, a, b, acc) adds "
                                 "a b^T to acc and writes acc")
        for ref, which in ((a, "A"), (b, "B")):
            if not (isinstance(ref, _SliceRef) and isinstance(ref.owner, _Regs)):
                raise AssertionError(f"the mma.sync's {which} operand is a k-slice of a register "
                                     f"fragment (tCr{which}[None, None, j]); got {ref!r}")
            if ref.owner.view != "mma":
                raise AssertionError(f"the mma.sync reads {ref.owner.name}[None, None, j], the "
                                     "MMA's view of the registers, not the copy's retiled view")
        if a.owner.operand not in ("Q", "P") or b.owner.operand not in ("K", "V"):
            raise AssertionError(f"operands in the wrong places: cute.gemm(tiled_mma, acc, A, B, "
                                 f"acc) with A = Q (or P) and B = K (or V); you passed "
                                 f"{a.owner.operand} as A and {b.owner.operand} as B")
        held = []
        for ref in (a, b):
            slot = ref.owner.slots[ref.k]
            if slot is None:
                raise AssertionError(f"the mma.sync read slot {ref.k} of {ref.owner.name} "
                                     f"({ref.owner.operand}'s registers) before any ldmatrix "
                                     "filled it")
            held.append(slot)
        (oa, ka, da), (ob, kb, db) = held
        if ka != kb:
            raise AssertionError(
                f"an mma.sync multiplied slice {ka} of {oa} with slice {kb} of {ob}: the k-th 16 "
                f"columns of {oa} go with the k-th 16 of {ob}. Check which slice each ldmatrix "
                "loads into which registers, and which registers each mma.sync reads")
        log.gemms.append(((oa, ka), (ob, kb)))
        log.sequence.append(("mma", oa, ka))
        d.data += da @ db.T

    return copy, gemm


def _size_model(real_size):
    def size(x, mode=None, **kwargs):
        if isinstance(x, (_Smem, _Regs)):
            if mode in ([2], (2,), 2):
                return len(x.slots) if isinstance(x, _Regs) else len(x.slices)
            raise AssertionError(f"the k-slices are mode 2: cute.size({x.name}, mode=[2]); "
                                 f"you asked for mode {mode}")
        return real_size(x, mode=mode, **kwargs) if mode is not None else real_size(x, **kwargs)

    return size


def _loop_model(log: _Log):
    def run_time(*args, **options):
        trips = range(*(int(a) for a in args))
        log.loops.append(("range", len(trips), options))
        return [_RunTime(i) for i in trips]

    def compile_time(*args, **options):
        trips = range(*(int(a) for a in args))
        log.loops.append(("range_constexpr", len(trips), options))
        return list(trips)

    return run_time, compile_time


def run_gemm(fn, kind: str, head_dim: int = 128, seed: int = 0):
    """Run a GEMM piece as plain Python at the default tile's sizes: ``kind`` "qk" (exercise
    04.3: fn(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, smem_copy_A, smem_copy_B, unroll)) or "pv"
    (04.5: fn(tiled_mma, acc, tCrA, tCrB, tCsB, smem_copy_B)). Each k-slice is a float64 array
    of the whole tile. Returns (acc, what acc must be, the log of copies and mma.syncs)."""
    cfg = fa.default_config(head_dim)
    rng = np.random.default_rng(seed)
    M, N, D = cfg.m_block, cfg.n_block, head_dim
    log = _Log()
    init = rng.standard_normal((M, D if kind == "pv" else N))
    acc = _Acc("acc", init.copy())
    if kind == "qk":
        q, k = rng.standard_normal((M, D)), rng.standard_normal((N, D))
        q_sl = [q[:, 16 * i:16 * i + 16] for i in range(D // 16)]
        k_sl = [k[:, 16 * i:16 * i + 16] for i in range(D // 16)]
        args = (_TiledMma(), acc, _Regs("tCrA", "Q", [None] * (D // 16), log),
                _Regs("tCrB", "K", [None] * (D // 16), log), _Smem("tCsA", "Q", q_sl),
                _Smem("tCsB", "K", k_sl), _SmemCopy("smem_copy_A", "Q"),
                _SmemCopy("smem_copy_B", "K"), cfg.qk_unroll)
        want = init + q @ k.T
    else:
        p, v = rng.standard_normal((M, N)), rng.standard_normal((N, D))
        p_sl = [("P", i, p[:, 16 * i:16 * i + 16]) for i in range(N // 16)]
        vt_sl = [v.T[:, 16 * i:16 * i + 16] for i in range(N // 16)]
        args = (_TiledMma(), acc, _Regs("tCrA", "P", p_sl, log, preloaded=True),
                _Regs("tCrB", "V", [None] * (N // 16), log), _Smem("tCsB", "V", vt_sl),
                _SmemCopy("smem_copy_B", "V"))
        want = init + p @ v
    copy, gemm = _gemm_model(log)
    run_time, compile_time = _loop_model(log)
    with python_loops(), patched(cutlass, range=run_time, range_constexpr=compile_time), \
            patched(cute, copy=copy, gemm=gemm, size=_size_model(cute.size)):
        _run_plain(fn, *args)
    return acc.data, want, log


def _run_gemm_where(fn, kind, head_dim, where):
    try:
        return run_gemm(fn, kind, head_dim)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {exc}") from None


def _pairs_mistake(log: _Log, slices: int, a: str, b: str) -> str | None:
    """The first wrong pairing of k-slices in the mma.syncs, in words (None: every k once)."""
    seen = {}
    for (_, ka), (_, kb) in log.gemms:
        if ka != kb:
            return (f"an mma.sync multiplied slice {ka} of {a} with slice {kb} of {b}: the k-th "
                    f"16 columns of {a} go with the k-th 16 of {b}. Check which slice each "
                    "ldmatrix loads and which registers each mma.sync reads")
        seen[ka] = seen.get(ka, 0) + 1
    missing = [k for k in range(slices) if k not in seen]
    twice = [k for k, n in seen.items() if n > 1]
    if missing:
        return (f"k-slices {missing} of {slices} never reached an mma.sync: the loop must "
                f"cover every 16-wide slice of the reduction dimension, 0..{slices - 1}")
    if twice:
        return f"k-slices {twice} were multiplied more than once"
    return None


# ================================================================================================
# Exercise 04.3: S = Q K^T, the loop over the head dim
# ================================================================================================
gemm_qk = fa.gemm_from_smem  # the reference is the kernel's own loop


def check_gemm_qk(fn, compile_check: bool = True) -> None:
    """Exercise 04.3: ``fn`` (gemm_from_smem's signature) run as plain Python at D = 128 and
    D = 64 against float64, its loop and slices named; then compiled into the kernel for sm_80:
    no local memory, and as many mma.sync per step as the kernel's."""
    for d in (128, 64):
        slices, unroll = d // 16, fa.default_config(d).qk_unroll
        where = f"at D = {d} ({slices} k-slices of 16, unroll = {unroll})"
        got, want, log = _run_gemm_where(fn, "qk", d, where)
        loops = [lp for lp in log.loops if lp[1] == slices]
        if not log.gemms:
            raise AssertionError(f"{where}: no mma.sync was issued: after loading a slice of Q "
                                 "and of K, cute.gemm(tiled_mma, acc, tCrA[...], tCrB[...], acc)")
        mistake = _pairs_mistake(log, slices, "Q", "K")
        if mistake:
            raise AssertionError(f"{where}: {mistake}.")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-9):
            raise AssertionError(f"{where}: acc is not its starting value plus Q K^T (largest "
                                 f"error {np.abs(got - want).max():.3g}): add into acc, never "
                                 "reset it; the kernel zeroes it before the step")
        if log.run_time_slots:
            raise AssertionError(
                f"{where}: {log.run_time_slots[0]} is indexed by the run-time loop counter k. "
                "Registers have no addresses: a fragment indexed at run time is put in local "
                "memory (DRAM behind L1), and the loads the loop hides become memory traffic. "
                "Load every k-slice into slot 0 of the fragment and multiply slot 0; the next "
                "trip reuses the same registers")
        if any(kind == "range_constexpr" for kind, _, _ in loops):
            raise AssertionError(
                f"{where}: you unrolled the loop over the k-slices completely "
                "(cutlass.range_constexpr). At D = 128 ptxas then loads the fragments of many "
                "slices ahead, on top of acc_O and acc_S, and spills (Note [Registers]). Keep a "
                "run-time loop and unroll it `unroll` times: cutlass.range(n, unroll=unroll)")
        if loops and loops[0][2].get("unroll") != unroll and not loops[0][2].get("unroll_full"):
            raise AssertionError(
                f"{where}: your loop is cutlass.range(..., {loops[0][2] or 'no options'}); the "
                f"kernel's tile asks for unroll={unroll} (its qk_unroll: k-slices per trip). "
                "Pass unroll=unroll: fewer slices per trip leave the tensor cores waiting for "
                "ldmatrix, more spill")
    if compile_check:
        _compiled_gemm_check(fn, "qk")


def _compiled_gemm_check(fn, kind: str) -> None:
    art = compile_with(qk=fn) if kind == "qk" else compile_with(pv=fn)
    counts, want = sass_counts(art), sass_counts(compile_with())
    if _local_memory(counts):
        _, _, log = run_gemm(fn, kind)
        cause = ""
        if log.run_time_slots:
            name = log.run_time_slots[0]
            cause = (f" The cause: {name} is indexed by the run-time loop counter; registers "
                     "have no addresses, so a fragment indexed at run time lives in local "
                     "memory (DRAM behind L1). "
                     + ("Load every slice into slot 0 of the fragment and multiply slot 0"
                        if kind == "qk" else
                        "P's registers are indexed by k, so the loop over k must be unrolled "
                        "at compile time: cutlass.range_constexpr"))
        raise AssertionError(
            f"compiled for sm_80, the kernel with your {'QK^T' if kind == 'qk' else 'PV'} loop "
            f"uses local memory: a {counts['stack bytes']}-byte stack frame and "
            f"{counts['LDL/STL']} LDL/STL instructions (the kernel's own: none).{cause}")
    if counts["HMMA"] != want["HMMA"]:
        e = _expected_hmma()
        raise AssertionError(
            f"compiled for sm_80, the kernel with your loop has {counts['HMMA']} mma.sync (HMMA) "
            f"where the kernel has {want['HMMA']}: the step exists twice (the peeled first tile "
            f"and the loop), each with {e['pv_step']} for P V and, for Q K^T, "
            f"{e['qk_trip']} per trip of a loop unrolled {e['unroll']} times")


# ================================================================================================
# Exercise 04.5: O += P V, P from registers
# ================================================================================================
gemm_pv = fa.gemm_from_regs  # the reference is the kernel's own loop


def check_gemm_pv(fn, compile_check: bool = True) -> None:
    """Exercise 04.5: ``fn`` (gemm_from_regs's signature) run as plain Python at D = 128 and
    D = 64 against float64, its slices named; then compiled into the kernel for sm_80: no local
    memory, the kernel's mma.sync count."""
    for d in (128, 64):
        slices = fa.default_config(d).n_block // 16
        where = f"at D = {d} (the tile's {fa.default_config(d).n_block} keys: {slices} k-slices)"
        got, want, log = _run_gemm_where(fn, "pv", d, where)
        if not log.gemms:
            raise AssertionError(f"{where}: no mma.sync was issued: cute.gemm(tiled_mma, acc, "
                                 "tCrA[None, None, k], tCrB[None, None, k], acc)")
        mistake = _pairs_mistake(log, slices, "P", "V")
        if mistake:
            raise AssertionError(f"{where}: {mistake}.")
        if not np.allclose(got, want, rtol=1e-12, atol=1e-9):
            raise AssertionError(f"{where}: acc is not its starting value plus P V (largest "
                                 f"error {np.abs(got - want).max():.3g}): O carries the earlier "
                                 "tiles; add into it")
        if log.run_time_slots:
            raise AssertionError(
                f"{where}: {log.run_time_slots[0]} is indexed by a run-time loop counter "
                "(cutlass.range). P's registers are indexed by k, and registers have no "
                "addresses: the loop over k must be unrolled at compile time "
                "(cutlass.range_constexpr), or the fragment goes to local memory")
    if compile_check:
        _compiled_gemm_check(fn, "pv")


def pv_load_order(fn, head_dim: int = 128) -> str:
    """The ldmatrix loads and mma.syncs of a PV loop, in order: 'ld V0, ld V1, mma 0, ...'."""
    _, _, log = run_gemm(fn, "pv", head_dim)
    return _order(log)


def _order(log: _Log) -> str:
    return ", ".join(f"ld {op}{k}" if kind == "copy" else f"mma {op}{k}"
                     for kind, op, k in log.sequence)


# ================================================================================================
# Exercise 04.4: the online softmax in registers
# ================================================================================================
@cute.jit
def online_softmax(s, o, row_max, row_sum, scale_log2, is_first: cutlass.Constexpr):
    """Exercise 04.4's reference: one tile of the online softmax on this thread's rows.

    ``s``, ``o``: rows x columns views of the thread's S and O fragments (row r of s holds this
    lane's n_block / 4 scores of one row; the other 3 lanes of its quad hold the rest);
    ``row_max``, ``row_sum``: the running max and this lane's partial row sum, per row. With
    c = scale_log2: m_new = max(m_old, max_j s_j), P = exp2(c s - c m_new), correction =
    exp2(c (m_old - m_new)), l = l correction + sum_j P_j, O = O correction."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        s_row = s[r, None].load()
        m_tile = s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)  # this lane's columns
        m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=2))
        m_tile = cute.arch.fmax(m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=1))
        m_old = row_max[r]
        m_new = m_tile if const_expr(is_first) else cute.arch.fmax(m_old, m_tile)
        row_max[r] = m_new
        # a row that has seen only masked keys: subtract 0, so exp2(-inf - 0) = 0, not NaN
        m_safe = 0.0 if m_new == -Float32.inf else m_new
        p_row = cute.math.exp2(s_row * scale_log2 - m_safe * scale_log2, fastmath=True)
        s[r, None].store(p_row)
        p_sum = p_row.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if const_expr(is_first):
            row_sum[r] = p_sum
        else:
            correction = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
            row_sum[r] = row_sum[r] * correction + p_sum
            o[r, None].store(o[r, None].load() * correction)


class _CoordsProbe:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def run(self, s_out: cute.Tensor, o_out: cute.Tensor):
        """s_out[t, r, c] = (row, col) of element (r, c) of thread t's rows x columns view of S;
        o_out the same for O."""
        k = self.kernel
        tiled_mma = k.make_tiled_mma()
        cS = cute.make_identity_tensor((k.m_block, k.n_block))
        cO = cute.make_identity_tensor((k.m_block, k.head_dim))
        for t in cutlass.range(k.num_threads):
            thr = tiled_mma.get_slice(t)
            tScS = fa.rows_cols_view(thr.partition_C(cS))  # ((2, MMA_M), (2, MMA_N))
            tOcO = fa.rows_cols_view(thr.partition_C(cO))  # ((2, MMA_M), (2, MMA_D))
            for r in cutlass.range(cute.size(tScS, mode=[0])):
                for c in cutlass.range(cute.size(tScS, mode=[1])):
                    s_out[t, r, c, 0] = tScS[r, c][0]
                    s_out[t, r, c, 1] = tScS[r, c][1]
                for c in cutlass.range(cute.size(tOcO, mode=[1])):
                    o_out[t, r, c, 0] = tOcO[r, c][0]
                    o_out[t, r, c, 1] = tOcO[r, c][1]


@functools.cache
def fragment_coords(head_dim: int = 128):
    """(S, O) int arrays (threads, rows, columns, 2): the (row, col) in the tile of each element
    of each thread's rows x columns view, from the kernel's own mma.sync partition, host-side."""
    cfg = fa.default_config(head_dim)
    kernel = fa.FlashAttentionAmpere(cutlass.BFloat16, head_dim, False, cfg)
    rows = 2 * cfg.m_block // (16 * cfg.num_warps)
    s_out = np.zeros((cfg.num_threads, rows, cfg.n_block // 4, 2), np.int32)
    o_out = np.zeros((cfg.num_threads, rows, head_dim // 4, 2), np.int32)
    _CoordsProbe(kernel).run(from_dlpack(s_out), from_dlpack(o_out))
    return s_out, o_out


# --- stand-ins for one lane's registers ----------------------------------------------------------
class _Vec:
    """A row of a fragment loaded into a vector (a TensorSSA), float64."""

    def __init__(self, values):
        self.a = np.array(values, dtype=np.float64)

    @staticmethod
    def _v(x):
        return x.a if isinstance(x, _Vec) else float(x)

    def __add__(self, x):
        return _Vec(self.a + self._v(x))

    def __radd__(self, x):
        return _Vec(self._v(x) + self.a)

    def __sub__(self, x):
        return _Vec(self.a - self._v(x))

    def __rsub__(self, x):
        return _Vec(self._v(x) - self.a)

    def __mul__(self, x):
        return _Vec(self.a * self._v(x))

    def __rmul__(self, x):
        return _Vec(self._v(x) * self.a)

    def __truediv__(self, x):
        return _Vec(self.a / self._v(x))

    def __neg__(self):
        return _Vec(-self.a)

    def __len__(self):
        return len(self.a)

    def reduce(self, op, init, reduction_profile=0, **kwargs):
        name = getattr(op, "name", str(op))
        fold = {"MAX": np.fmax, "MIN": np.fmin, "ADD": np.add, "MUL": np.multiply}[name]
        return float(fold.reduce(np.append(self.a, float(init))))

    def to(self, dtype):
        return self


class _RowRef:
    def __init__(self, frag, r):
        self.frag, self.r = frag, r

    def load(self):
        return _Vec(self.frag.data[self.r])

    def store(self, value):
        if not isinstance(value, _Vec) or len(value) != self.frag.data.shape[1]:
            raise AssertionError(f"{self.frag.name}[r, None].store takes a whole row (the "
                                 "vector a .load() gave, after arithmetic); got "
                                 f"{type(value).__name__}")
        self.frag.data[self.r] = value.a


class _Rows:
    """A thread's fragment seen as rows x columns (``s`` or ``o``)."""

    def __init__(self, name, data):
        self.name, self.data = name, np.array(data, dtype=np.float64)

    def _rc(self, key):
        if isinstance(key, tuple) and len(key) == 2:
            return key
        i = int(key)
        return i % self.data.shape[0], i // self.data.shape[0]  # CuTe's flat order: rows first

    def __getitem__(self, key):
        r, c = self._rc(key)
        if c is None:
            return _RowRef(self, int(r))
        return float(self.data[int(r), int(c)])

    def __setitem__(self, key, value):
        r, c = self._rc(key)
        if c is None:
            _RowRef(self, int(r)).store(value)
        else:
            self.data[int(r), int(c)] = float(value)


class _PerRow:
    """``row_max`` or ``row_sum``: one value per row this thread holds."""

    def __init__(self, name, data):
        self.name, self.data = name, np.array(data, dtype=np.float64)

    def __getitem__(self, r):
        return float(self.data[int(r)])

    def __setitem__(self, r, value):
        if isinstance(value, _Vec):
            raise AssertionError(f"{self.name}[r] holds one number per row; you stored a whole "
                                 "row: reduce it first (.reduce(cute.ReductionOp.ADD, 0.0, 0))")
        self.data[int(r)] = float(value)


class _Diverged(Exception):
    pass


class _Meeting:
    """Where the lanes of a warp meet at a shuffle: it completes when all have arrived, and
    breaks when a lane has finished (or failed) while others wait for it."""

    def __init__(self, lanes: int):
        self.lanes, self.cond = lanes, threading.Condition()
        self.generation, self.arrived, self.finished, self.broken = 0, 0, 0, False

    def wait(self):
        with self.cond:
            if self.broken:
                raise _Diverged
            gen = self.generation
            self.arrived += 1
            if self.arrived == self.lanes:
                self.arrived, self.generation = 0, gen + 1
                self.cond.notify_all()
                return
            while gen == self.generation:
                if self.broken or (self.finished and self.arrived + self.finished >= self.lanes):
                    self.broken = True
                    self.cond.notify_all()
                    raise _Diverged
                if not self.cond.wait(timeout=30):
                    self.broken = True

    def finish(self):
        with self.cond:
            self.finished += 1
            self.cond.notify_all()


class _Warp:
    """32 lanes, each a Python thread running the learner's function on its own registers; a
    shuffle is a meeting point where every lane hands in its value and takes its partner's."""

    def __init__(self, lanes: int = LANES):
        self.lanes = lanes
        self.meeting = _Meeting(lanes)
        self.slots = [None] * lanes
        self.calls = [[] for _ in range(lanes)]
        self.local = threading.local()

    def _exchange(self, lane, value):
        self.slots[lane] = value
        self.meeting.wait()
        seen = list(self.slots)
        self.meeting.wait()
        return seen

    def shuffle(self, kind):
        def fn(value, offset, mask=0xFFFFFFFF, mask_and_clamp=None, **_):
            lane = self.local.lane
            if isinstance(value, _Vec):
                raise AssertionError("shuffle one number per lane (a row's max), not a vector")
            offset = int(offset)
            self.calls[lane].append((kind, offset))
            c = (0 if kind == "up" else 31) if mask_and_clamp is None else int(mask_and_clamp)
            seg, clamp = (c >> 8) & 31, c & 31
            lo = lane & seg
            hi = lo | (clamp & ~seg)
            src = {"bfly": lane ^ offset, "down": lane + offset, "up": lane - offset,
                   "idx": (offset & ~seg) | lo}[kind]
            ok = src >= lo if kind == "up" else src <= hi
            seen = self._exchange(lane, float(value))
            return seen[src] if ok and 0 <= src < self.lanes else float(value)

        return fn

    def vote_any(self, pred, mask=0xFFFFFFFF, **_):
        lane = self.local.lane
        self.calls[lane].append(("vote", 0))
        return any(self._exchange(lane, bool(pred)))

    def run(self, fn, args_of_lane):
        errors = [None] * self.lanes

        def lane_main(lane):
            self.local.lane = lane
            try:
                with np.errstate(all="ignore"):  # -inf - -inf is the case being checked
                    fn(*args_of_lane(lane))
            except BaseException as exc:  # reported below, for the first lane that failed
                errors[lane] = exc
            finally:
                self.meeting.finish()

        threads = [threading.Thread(target=lane_main, args=(i,)) for i in range(self.lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        real = [e for e in errors if e is not None and not isinstance(e, _Diverged)]
        if real:
            raise real[0]
        counts = sorted({len(c) for c in self.calls})
        if len(counts) > 1 or any(isinstance(e, _Diverged) for e in errors):
            raise AssertionError(
                f"the lanes of the warp made different numbers of shuffles ({counts[0]} to "
                f"{counts[-1]}): shfl.sync needs every lane of the warp at every shuffle, so "
                "keep shuffles out of branches that some lanes take and others skip")


def _softmax_model(warp: _Warp):
    def fmax(a, b, **_):
        return float(np.fmax(float(a), float(b)))

    def fmin(a, b, **_):
        return float(np.fmin(float(a), float(b)))

    def unary(np_fn):
        def fn(x, *args, **_):
            return _Vec(np_fn(x.a)) if isinstance(x, _Vec) else float(np_fn(float(x)))
        return fn

    def size(x, mode=None, **_):
        if isinstance(x, _Rows):
            shape = x.data.shape
            return shape[mode[0]] if mode else shape[0] * shape[1]
        if isinstance(x, _PerRow):
            return len(x.data)
        if isinstance(x, _Vec):
            return len(x)
        raise AssertionError(f"cute.size of {x!r} in the softmax: size the fragments you were "
                             "given (s, o, row_max, row_sum)")

    def like(x, dtype=None, **_):
        if isinstance(x, _PerRow):
            return _PerRow(x.name + "_like", np.zeros_like(x.data))
        if isinstance(x, _Rows):
            return _Rows(x.name + "_like", np.zeros_like(x.data))
        raise AssertionError(f"make_fragment_like of {x!r}: only of s, o, row_max, row_sum")

    def rmem(shape, dtype=None, **_):
        shape = shape if isinstance(shape, tuple) else (int(shape),)
        if len(shape) == 1:
            return _PerRow("fragment", np.zeros(int(shape[0])))
        return _Rows("fragment", np.zeros(tuple(int(n) for n in shape)))

    arch = {f"shuffle_sync{'' if k == 'idx' else '_' + k}": warp.shuffle(k)
            for k in ("bfly", "down", "up", "idx")}
    arch.update(fmax=fmax, fmin=fmin, vote_any_sync=warp.vote_any)
    math = {"exp2": unary(np.exp2), "exp": unary(np.exp), "log2": unary(np.log2),
            "log": unary(np.log)}
    return arch, math, {"size": size, "make_fragment_like": like, "make_rmem_tensor": rmem}


def run_softmax(fn, case: dict) -> dict:
    """Run a softmax piece (exercise 04.4's signature) for warp 0 of the default D = 128 tile,
    as 32 lanes on the CPU with float64 values, on ``case`` (``softmax_cases``). Returns each
    lane's s (P), o, row_max and row_sum after the call, and the shuffles each lane made."""
    s_xy, o_xy = fragment_coords(128)
    warp = _Warp()
    frags = []
    for lane in range(LANES):
        rows = s_xy[lane, :, 0, 0]
        frags.append((_Rows("s", case["S"][s_xy[lane, ..., 0], s_xy[lane, ..., 1]]),
                      _Rows("o", case["O"][o_xy[lane, ..., 0], o_xy[lane, ..., 1]]),
                      _PerRow("row_max", case["m"][rows]),
                      _PerRow("row_sum", case["l"][lane])))
    arch, math, top = _softmax_model(warp)
    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None) or raw.__code__
    scope = {name: (_F32 if value is cutlass.Float32 else value)
             for name, value in raw.__globals__.items()}
    plain = types.FunctionType(code, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    with np.errstate(all="ignore"), python_loops(), \
            patched(cutlass, Float32=_F32, Boolean=bool), \
            patched(cute.arch, **arch), patched(cute.math, **math), patched(cute, **top):
        warp.run(plain, lambda lane: (*frags[lane], case["c"], case["is_first"]))
    return {"P": [f[0].data for f in frags], "O": [f[1].data for f in frags],
            "m": [f[2].data for f in frags], "l": [f[3].data for f in frags],
            "calls": warp.calls, "s_xy": s_xy, "o_xy": o_xy}


def softmax_cases(seed: int = 4):
    """Two steps of the online softmax on the default D = 128 tile (128 x 64 scores), with the
    rows that make it hard: the first step with a row whose keys are all masked and one half
    masked; a later step where some rows' max grows and some do not, a row masked in this tile
    after finite ones, a row that has still seen no key, a row that sees its first keys now."""
    rng = np.random.default_rng(seed)
    cfg = fa.default_config(128)
    M, N, D = cfg.m_block, cfg.n_block, 128
    c = 128 ** -0.5 * float(np.log2(np.e))
    threads = cfg.num_threads
    rows_per_thread = 2 * M // (16 * cfg.num_warps)
    first_S = rng.standard_normal((M, N)) * 4
    first_S[0] = -np.inf  # every key masked
    first_S[1, 20:] = -np.inf  # a causal edge
    first_S[64, :3] = -np.inf
    first = {"name": "first step", "S": first_S, "O": np.zeros((M, D)),
             "m": np.full(M, -np.inf), "l": np.zeros((threads, rows_per_thread)), "c": c,
             "is_first": True, "grow": [], "empty": [0], "new": []}
    S = rng.standard_normal((M, N)) * 4
    m_old = S.max(axis=1) + rng.choice([-3.0, 2.0], size=M)  # about half the rows grow
    S[2] = -np.inf  # masked in this tile, after finite tiles
    m_old[3], S[3] = -np.inf, -np.inf  # still no key seen
    m_old[65] = -np.inf  # its first keys now
    S[66, :40] = -np.inf
    l_old = rng.uniform(0.5, 3.0, (threads, rows_per_thread))
    O = rng.standard_normal((M, D))
    s_xy, _ = fragment_coords(128)
    for t in range(threads):
        for r in range(rows_per_thread):
            if np.isneginf(m_old[s_xy[t, r, 0, 0]]):
                l_old[t, r] = 0.0
    O[[3, 65]] = 0.0
    grow = [int(i) for i in np.flatnonzero(S.max(axis=1) > m_old)]
    later = {"name": "later step", "S": S, "O": O, "m": m_old, "l": l_old, "c": c,
             "is_first": False, "grow": grow, "empty": [3], "new": [65]}
    return [first, later]


def softmax_truth(case: dict, variant: str = "") -> dict:
    """What each lane must hold after the step, in float64: P, O, row_max, row_sum. A
    ``variant`` is a typical slip, used to name it: "no_max_carry" (m_new = this tile's max),
    "p_tile_max" (P subtracts this tile's max), "no_scale", "natural_exp", "no_l_rescale",
    "l_reset", "l_quad_sum", "no_o_rescale"."""
    S, m_old, c = case["S"], case["m"], case["c"]
    with np.errstate(invalid="ignore", over="ignore"):
        m_tile = np.max(S, axis=1)
        carry = not case["is_first"] and variant != "no_max_carry"
        m_new = np.fmax(m_old, m_tile) if carry else m_tile
        m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
        sub = np.where(np.isneginf(m_tile), 0.0, m_tile) if variant == "p_tile_max" else m_safe
        if variant == "no_scale":
            P = np.exp2(S - sub[:, None])
        elif variant == "natural_exp":
            P = np.exp(S * c - sub[:, None] * c)
        else:
            P = np.exp2(S * c - sub[:, None] * c)
        corr = (np.ones_like(m_new) if case["is_first"] else np.exp2((m_old - m_safe) * c))
    s_xy, o_xy = fragment_coords(128)
    out = {"P": [], "O": [], "m": [], "l": []}
    for lane in range(LANES):
        rows = s_xy[lane, :, 0, 0]
        p = P[s_xy[lane, ..., 0], s_xy[lane, ..., 1]]
        part = p.sum(axis=1)
        if variant == "l_quad_sum":
            quad = range(4 * (lane // 4), 4 * (lane // 4) + 4)
            part = sum(P[s_xy[q, ..., 0], s_xy[q, ..., 1]].sum(axis=1) for q in quad)
        l_old = case["l"][lane]
        if case["is_first"] or variant == "l_reset":
            l_new = part
        elif variant == "no_l_rescale":
            l_new = l_old + part
        else:
            l_new = l_old * corr[rows] + part
        o = case["O"][o_xy[lane, ..., 0], o_xy[lane, ..., 1]]
        if not case["is_first"] and variant != "no_o_rescale":
            o = o * corr[rows][:, None]
        out["P"].append(p)
        out["O"].append(o)
        out["m"].append(m_new[rows])
        out["l"].append(l_new)
    return out


def _same(a, b) -> bool:
    return all(np.allclose(x, y, rtol=1e-9, atol=1e-12, equal_nan=True) for x, y in zip(a, b))


def _shuffle_hint(calls) -> str:
    offsets = [o for k, o in calls if k == "bfly"]
    kinds = sorted({k for k, _ in calls} - {"bfly", "vote"})
    if not calls:
        return ("no lane read another lane's value: a row's scores are spread over the 4 lanes "
                "of a quad, so each lane's max covers only its own columns until it reads its "
                "neighbours' with cute.arch.shuffle_sync_bfly")
    if kinds:
        return (f"you used shuffle_sync_{kinds[0]}: a shift or an indexed read leaves some lanes "
                "of the quad without the full result; the butterfly (xor) pairs every lane "
                "with a partner, so after two steps all 4 agree")
    if any(o >= 4 for o in offsets):
        return (f"your xor offsets {sorted(set(offsets))} reach beyond the quad: lanes 4q..4q+3 "
                "hold one row, and offset 4 or more mixes in other quads, which hold other "
                "rows. Offsets 2 and 1 cover the quad")
    if sorted(set(offsets)) != [1, 2]:
        return (f"the xor offsets {sorted(set(offsets))} pair each lane with one partner only: "
                "lanes then agree in pairs. Two butterfly steps, offsets 2 and 1, reach all "
                "four lanes of the quad")
    return ""


def _diagnose_softmax(got: dict, case: dict) -> str | None:
    """The first thing ``got`` gets wrong on ``case``, in words (None: all right)."""
    want = softmax_truth(case)
    s_xy = got["s_xy"]
    name = case["name"]

    def row_of(lane, r):
        return int(s_xy[lane, r, 0, 0])

    # NaN where the truth is finite
    for key, what in (("P", "P"), ("l", "row_sum"), ("O", "O"), ("m", "row_max")):
        for lane in range(LANES):
            bad = np.isnan(got[key][lane]) & ~np.isnan(want[key][lane])
            if bad.any():
                r = int(np.argwhere(bad)[0][0])
                row = row_of(lane, r)
                if row in case["empty"] or (case["is_first"] and np.isneginf(case["S"][row]).all()):
                    return (f"{name}: row {row} has seen no key yet (all its scores are -inf), "
                            f"and its {what} came out NaN: with m_new = -inf, exp2(c s - c m_new)"
                            " is exp2(-inf + inf) = NaN. For such a row subtract 0 instead of "
                            "m_new: its P is then exp2(-inf) = 0 and the row stays empty")
                return f"{name}: {what} of row {row} (lane {lane}) is NaN"
    # the row max: the quad must agree, on the right value
    for lane in range(LANES):
        quad = [got["m"][q] for q in range(4 * (lane // 4), 4 * (lane // 4) + 4)]
        if not all(np.array_equal(quad[0], q, equal_nan=True) for q in quad):
            hint = _shuffle_hint(got["calls"][lane])
            return (f"{name}: the 4 lanes of quad {lane // 4} (lanes {4 * (lane // 4)}.."
                    f"{4 * (lane // 4) + 3}) disagree on the max of their rows "
                    f"{[row_of(lane, r) for r in range(len(quad[0]))]}: every lane needs the "
                    f"whole row's max. {hint}".rstrip())
    if not _same(got["m"], want["m"]):
        hint = _shuffle_hint(got["calls"][0])
        if hint:
            return f"{name}: row_max is wrong: {hint}"
        for variant, words in (
                ("no_max_carry", "row_max holds this tile's max only: the running max must "
                                 "remember the earlier tiles, m_new = max(m_old, m_tile)"),):
            if _same(got["m"], softmax_truth(case, variant)["m"]):
                return f"{name}: {words}"
        if _same(got["m"], [case["m"][s_xy[lane, :, 0, 0]] for lane in range(LANES)]):
            return f"{name}: row_max was not updated: store the new running max into row_max[r]"
        lane = next(i for i in range(LANES) if not _same([got["m"][i]], [want["m"][i]]))
        r = int(np.flatnonzero(~np.isclose(got["m"][lane], want["m"][lane]))[0])
        return (f"{name}: row_max of row {row_of(lane, r)} is {got['m'][lane][r]:.4g}, the "
                f"running max is {want['m'][lane][r]:.4g}")
    # P
    if not _same(got["P"], want["P"]):
        if _same(got["P"], [case["S"][s_xy[i, ..., 0], s_xy[i, ..., 1]] for i in range(LANES)]):
            return (f"{name}: s still holds the scores: store P back into the same registers, "
                    "s[r, None].store(p_row); the P V mma.sync reads them from there")
        for variant, words in (
                ("p_tile_max", "P subtracts this tile's max; subtract the running max m_new, "
                               "so that P of every tile is scaled alike"),
                ("no_scale", "P = exp2(s - m): the softmax scale is missing; P = exp2(c s - c "
                             "m_new) with c = scale_log2"),
                ("natural_exp", "P uses exp; scale_log2 is softmax_scale * log2(e), meant for "
                                "exp2 (one MUFU.EX2 instruction): P = exp2(c s - c m_new)")):
            if _same(got["P"], softmax_truth(case, variant)["P"]):
                return f"{name}: {words}"
        return (f"{name}: P is not exp2(c s - c m_new) (c = scale_log2) in every column: check "
                "the row you load, the max you subtract and what you store")
    # the row sum
    if not _same(got["l"], want["l"]):
        for variant, words in (
                ("l_quad_sum", "row_sum holds the whole row's sum, added over the quad: keep "
                               "this lane's partial sum, rescaled each step; finalize adds the "
                               "four partial sums once, at the end (fewer shuffles per step)"),
                ("no_l_rescale", "missing rescale of the row sum: the earlier tiles' sum was "
                                 "taken against the old max, so l = l * exp2(c (m_old - m_new))"
                                 " + sum(P)"),
                ("l_reset", "the row sum forgets the earlier tiles: l = l * correction + "
                            "sum(P), not sum(P) alone")):
            if _same(got["l"], softmax_truth(case, variant)["l"]):
                return f"{name}: {words}"
        return f"{name}: row_sum is not l * exp2(c (m_old - m_new)) + sum(P) for this lane"
    # O
    if not _same(got["O"], want["O"]):
        if _same(got["O"], softmax_truth(case, "no_o_rescale")["O"]):
            return (f"{name}: missing rescale of O: O was summed against the old max, so each "
                    "row of O is multiplied by its correction exp2(c (m_old - m_new)), the "
                    "same factor as the row sum")
        return (f"{name}: O is not O * exp2(c (m_old - m_new)) row by row: each row of o has "
                "its own factor")
    return None


def check_online_softmax(fn, compile_check: bool = True) -> None:
    """Exercise 04.4: ``fn(s, o, row_max, row_sum, scale_log2, is_first)`` run for warp 0 of the
    default D = 128 tile as 32 lanes on the CPU, against float64 on two steps with fully masked
    rows, growing and stale maxima; then compiled into the kernel for sm_80: two shuffles per row
    and step, no local memory."""
    for case in softmax_cases():
        try:
            got = run_softmax(fn, case)
        except AssertionError as exc:
            raise AssertionError(f"{case['name']}: {exc}") from None
        mistake = _diagnose_softmax(got, case)
        if mistake:
            raise AssertionError(mistake + ".")
    if not compile_check:
        return
    art = compile_with(softmax=fn)
    counts, want = sass_counts(art), sass_counts(compile_with())
    spill = (f"a {counts['stack bytes']}-byte stack frame and {counts['LDL/STL']} LDL/STL (the "
             "kernel's own: none)")
    if counts["SHFL.BFLY"] != want["SHFL.BFLY"]:
        rows = fragment_coords(128)[0].shape[1]
        per = (counts["SHFL.BFLY"] - (want["SHFL.BFLY"] - 4 * rows)) / (2 * rows)
        raise AssertionError(
            f"compiled for sm_80, the kernel with your softmax has {counts['SHFL.BFLY']} "
            f"butterfly shuffles where the kernel has {want['SHFL.BFLY']}: about {per:g} per "
            "row and step instead of 2. A quad needs two for the max; the row sum needs none "
            "inside the loop (finalize adds the partial sums once)"
            + (f"; the extra values even spill: {spill}" if _local_memory(counts) else ""))
    if _local_memory(counts):
        raise AssertionError(
            f"compiled for sm_80, the kernel with your softmax uses local memory: {spill}. A "
            "fragment indexed by a run-time value, or more values live than fit in 255 "
            "registers (keep the loop over rows at compile time, cutlass.range_constexpr)")


# ================================================================================================
# On a GPU: the kernel with the pieces, against float64
# ================================================================================================
_GPU_BUILDS: dict = {}

# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype): ragged tiles, seqlen_q <
# seqlen_k (the diagonal moves right), rows that see no key, GQA, fp16, a long KV loop
GPU_CASES = [
    (1, 77, 131, 4, 2, 64, True, "bfloat16"),
    (1, 150, 67, 4, 2, 128, False, "bfloat16"),
    (2, 17, 17, 3, 1, 128, True, "float16"),
    (1, 4097, 1000, 2, 2, 64, True, "float16"),
    (1, 1000, 4097, 2, 1, 128, True, "bfloat16"),
    (1, 2048, 2048, 2, 2, 128, False, "bfloat16"),
]


def attention_into_with(qk=None, softmax=None, pv=None):
    """``fa.attention_into`` with ``KernelWithPieces(qk, softmax, pv)`` on the portable tile: a
    function (q, k, v, out, lse, causal, softmax_scale, config) for ``utils.checks``."""

    def attention_into(q, k, v, out, lse, causal=False, softmax_scale=None, config=None):
        import cuda.bindings.driver as cuda
        import torch

        d = q.shape[-1]
        cfg = fa.DEFAULT_CONFIGS[d] if config is None else config
        fa._check_host_side(q, k, v, softmax_scale, cfg, causal)
        scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
        args = [fa._to_cute(t, 3, 16) for t in (q, k, v, out)] + [fa._to_cute(lse, 2, 4)]
        with torch.cuda.device(q.device):
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            key = (qk, softmax, pv, q.dtype, d, bool(causal), cfg)
            if key not in _GPU_BUILDS:
                kernel = KernelWithPieces(qk, softmax, pv, fa.SUPPORTED_DTYPES[q.dtype], d,
                                          bool(causal), cfg)
                _GPU_BUILDS[key] = cute.compile(kernel, *args, Float32(scale), stream)
            _GPU_BUILDS[key](*args, Float32(scale), stream)
        return out, lse

    return attention_into


def check_pieces_on_gpu(qk=None, softmax=None, pv=None, cases=GPU_CASES):
    """The kernel with the given pieces (None: the kernel's own) on fresh random inputs of
    awkward shapes, into NaN-poisoned outputs, against the float64 reference. Returns (ok, one
    line per case)."""
    import torch

    from utils import checks

    run = attention_into_with(qk, softmax, pv)
    ok, lines = True, []
    for b, sq, sk, h, hk, d, causal, dtype in cases:
        case_ok, line = checks.check_random_case(run, b, sq, sk, h, hk, d, causal,
                                                 getattr(torch, dtype))
        ok &= case_ok
        lines.append(line)
    return ok, lines


def piece_report(qk=None, softmax=None, pv=None) -> list[str]:
    """What the compiled kernel with these pieces looks like next to the kernel's own (sm_80,
    D = 128): mma.sync, shuffles, exp2, local memory, and whether the SASS is the kernel's."""
    art = compile_with(qk, softmax, pv)
    mine, ref = sass_counts(art), sass_counts(compile_with())
    keys = ("HMMA", "SHFL.BFLY", "MUFU.EX2", "LDL/STL", "stack bytes", "registers")
    lines = [f"{'':24s} {'yours':>6s} {'the kernel':>10s}"]
    lines += [f"{k:24s} {mine[k]:6d} {ref[k]:10d}" for k in keys]
    same = sass_body(art.sass) == sass_body(compile_with().sass)
    lines.append("SASS: " + ("instruction for instruction the kernel's own" if same else
                             "not the kernel's own instructions (the counts above decide)"))
    return lines


# What each exercise's prompt forbids ({helper: why}); the reference is refused anyway.
QK_FORBID = {fa.FlashAttentionAmpere.gemm_qk: "that is the kernel's own step; write the loop",
             fa.gemm_from_regs: "that is O += P V's loop, with A from registers"}
SOFTMAX_FORBID = {fa.quad_allreduce: "write the two shuffles of the quad yourself",
                  fa.FlashAttentionAmpere.online_softmax: "that is the kernel's own softmax"}
PV_FORBID = {fa.FlashAttentionAmpere.gemm_pv: "that is the kernel's own step; write the loop",
             fa.gemm_from_smem: "that is S = Q K^T's loop, with A from shared memory"}
