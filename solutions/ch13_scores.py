"""Chapter 13's device-code exercises: a package feature from its check to its kernel.

Two functions change the scores of one key tile in registers, between S = Q K^T and the softmax:

- ``sink_mask`` (exercise 13.3): the window mask with attention sinks. With a bounded left side
  of the window, the first ``sink`` keys stay visible to every row anyway (StreamingLLM keeps
  them: the softmax leans on them). A key j is visible to row i when it passes the window's
  right side and seqlen_k, and either the window's left side or j < sink;
- ``softcap_scores`` (exercise 13.4): the scores squashed by tanh, as Gemma 2 and Grok do,
  tanh(scale s / c) c, written so that the kernel's softmax, which multiplies by the scale
  afterwards, sees exactly that.

Each is checked three ways:

1. on the CPU, as plain Python (``utils.host_emulation``): the function runs once per thread of
   the kernel's consumer warpgroups, on the thread's own fragment, with the (row, column) of
   every element taken from the kernel's wgmma partition by host-side CuTe
   (``fragment_coords_host``); the tile it leaves behind is compared element by element with a
   brute-force mask (windows of every sign, utils.window) or with float64 arithmetic;
2. compiled for sm_90a into a small kernel that loads one tile's fragment, calls the function and
   stores it (``MaskKernel``, ``SoftcapKernel``), with the SASS read: selects, branches, local
   memory, hardware tanh, divisions;
3. on a Hopper GPU inside fa4_final's own forward (``HopperWithScores``) against a float64
   reference, on awkward shapes (``check_sink_mask_on_gpu``, ``check_softcap_on_gpu``).

``HopperWithScores`` is fa4_final.hopper.fwd.HopperForward unchanged, compiled with its mask step
replaced (softcap, then the mask) and every visited key tile masked; with sinks it visits the key
tiles from 0. The package has no such step as a method, so ``scores_seam`` swaps the module's
``apply_mask`` and ``kv_tile_range`` while the kernel is traced, and puts them back after.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import types
from collections import Counter
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from fa4_final.common.fragments import acc_rows_cols
from fa4_final.common.mask import apply_mask, apply_mask_row, fragment_coords
from fa4_final.common.tiles import TileWindow, kv_tile_range, visible_cols
from fa4_final.hopper.fwd import HopperForward
from utils.host_emulation import patched, python_loops

WGMMA_ROWS = 64  # query rows per consumer warpgroup
THREADS_PER_WG = 128
# (consumer warpgroups, tile_n): fa4_final's tiles at D = 128 (128 x 128) and D = 64 (192 x 128)
TILES = ((2, 128), (3, 128))
NO_LEFT = 1 << 29  # the left side the exercise kernel gets when the call has none


# ================================================================================================
# 13.3: the window mask with sink tokens (reference)
# ================================================================================================
@cute.jit
def sink_mask(s, tScS, t0ScS, w: cutlass.Constexpr, m_block, n_block, seqlen_q, seqlen_k,
              window_left, window_right, sink: cutlass.Constexpr[int]):
    """Scores of keys this row may not see -> -inf, the first ``sink`` keys kept however far
    left of the window they are. ``s``: this thread's (rows, cols) view of S; ``tScS`` its
    (row, col) in the tile, ``t0ScS`` thread 0's (compile-time columns)."""
    col_offset = tScS[0, 0][1]
    sink_end = sink - n_block * w.tile_n - col_offset  # the sinks are columns < sink_end
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * w.tile_m + tScS[r, 0][0]
        lo, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
        lo = lo - col_offset
        hi = hi - col_offset
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = t0ScS[0, c][1]
            keep = (col < hi) & ((col >= lo) | (col < sink_end))
            s[r, c] = s[r, c] if keep else -Float32.inf


SINK_MASK_FORBID = {
    apply_mask: "it is the package's window mask on the accumulator; the exercise is to add the "
                "sinks to the rule, with visible_cols for the window",
    apply_mask_row: "it is the Blackwell kernel's window mask, one row per thread",
}


def window_args(causal: bool, window_size, tile_m: int, tile_n: int):
    """(TileWindow, window_left, window_right) as fa4_final hands a call to the kernel: FA4's
    reading of ``causal`` and ``window_size`` (utils.window), 0 for an unbounded side; a right
    side of 0 is the causal mask."""
    from utils.window import fa4_sides

    left, right = fa4_sides(causal, window_size)
    causal = causal or right == 0
    w = TileWindow(tile_m, tile_n, causal, has_left=left is not None,
                   has_right=right is not None and not causal)
    return w, (0 if left is None else left), (0 if right is None else right)


def sink_visible(sq: int, sk: int, causal: bool, window_size, sink: int) -> np.ndarray:
    """(sq, sk) bool by brute force: row i sees key j when FA4's window lets it (utils.window),
    or when j < sink and j passes the window's right side (the sinks ignore the left side only;
    without a left side they change nothing)."""
    from utils.window import fa4_sides, visible_mask

    seen = visible_mask(sq, sk, causal, window_size).numpy()
    left, right = fa4_sides(causal, window_size)
    if left is None or sink <= 0:
        return seen
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    sinks = j < min(sink, sk)
    if right is not None:
        sinks = sinks & (j <= i + (sk - sq) + right)
    return seen | sinks


def key_tiles(w: TileWindow, m_block: int, sq: int, sk: int, window_left, window_right,
              sink: int) -> tuple[int, int]:
    """(n_min, n_max): the key tiles the exercise kernel visits for query tile ``m_block``: the
    package's range (fa4_final.common.tiles.kv_tile_range), from tile 0 when there are sinks."""
    n_min, n_max, _, _ = kv_tile_range(w, m_block, sq, sk, window_left, window_right)
    return (0 if sink > 0 and w.has_left else n_min), n_max


# ================================================================================================
# 13.4: the softcap (reference)
# ================================================================================================
@cute.jit
def softcap_scores(s, softmax_scale: Float32, softcap: Float32):
    """s -> tanh(scale s / c) c / scale for every element: the softmax multiplies by the scale
    next, so it sees tanh(scale s / c) c. Two divisions per call, one MUFU.TANH and two
    multiplies per element."""
    into = softmax_scale / softcap
    back = softcap / softmax_scale
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, c] = cute.math.tanh(s[r, c] * into, fastmath=True) * back


def softcap_reference(s: np.ndarray, softmax_scale: float, softcap: float) -> np.ndarray:
    return np.tanh(s * softmax_scale / softcap) * softcap / softmax_scale


# ================================================================================================
# Fragment coordinates, host-side: the kernel's own wgmma partition
# ================================================================================================
class _CoordsProbe:
    def __init__(self, wgs: int, tile_n: int):
        self.wgs, self.tile_n = wgs, tile_n

    @cute.jit
    def run(self, out: cute.Tensor):
        """out[t, r, c] = (row, col) in the tile of element (r, c) of thread t's rows x columns
        view of S, from the tiled MMA fa4_final's forward uses."""
        from fa4_final.hopper.wgmma import attention_tiled_mmas

        mma_qk, _ = attention_tiled_mmas(cutlass.BFloat16, self.wgs, self.tile_n, 128)
        tile = (WGMMA_ROWS * self.wgs, self.tile_n)
        for t in cutlass.range(THREADS_PER_WG * self.wgs):
            tScS, _ = fragment_coords(mma_qk.get_slice(t), tile)
            for r in cutlass.range(cute.size(tScS, mode=[0])):
                for c in cutlass.range(cute.size(tScS, mode=[1])):
                    out[t, r, c, 0] = tScS[r, c][0]
                    out[t, r, c, 1] = tScS[r, c][1]


@functools.cache
def fragment_coords_host(wgs: int = 2, tile_n: int = 128) -> np.ndarray:
    """int32 (threads, rows, cols, 2): each consumer thread's (row, col) of every element of its
    S fragment, for ``wgs`` warpgroups on a (64 wgs, tile_n) tile (host-side CuTe, no GPU)."""
    from cutlass.cute.runtime import from_dlpack

    threads = THREADS_PER_WG * wgs
    elems = WGMMA_ROWS * tile_n // THREADS_PER_WG  # per thread: 2 rows x tile_n / 4 columns
    out = np.zeros((threads, 2, elems // 2, 2), np.int32)
    probe = _CoordsProbe(wgs, tile_n)
    compiled = cute.compile[cute.GPUArch("sm_90a")](probe.run, from_dlpack(out))
    compiled(from_dlpack(out))
    return out


# ================================================================================================
# Running a function as plain Python, thread by thread
# ================================================================================================
class _F32(float):
    """cutlass.Float32 in an emulation: a plain float (Float32(0.5), Float32.inf)."""

    inf = float("inf")

    def __new__(cls, value=0.0):
        return float(value)


def _as_int(value=0):
    return int(value)


def _plain(fn):
    """``fn`` (a ``@cute.jit`` function) as written, as plain Python, with the names of its
    module that stand for cutlass.Float32 / Int32 bound to plain numbers."""
    raw = getattr(fn, "__wrapped__", fn)
    code = getattr(raw, "_original_code", None) or raw.__code__
    scope = dict(raw.__globals__)
    for name, value in raw.__globals__.items():
        if value is cutlass.Float32:
            scope[name] = _F32
        elif value is cutlass.Int32:
            scope[name] = _as_int
    return types.FunctionType(code, scope, raw.__name__, raw.__defaults__, raw.__closure__)


class _Vec:
    """A fragment loaded into a vector (``s.load()``), float64."""

    def __init__(self, values):
        self.a = np.asarray(values, dtype=np.float64)

    @staticmethod
    def _v(x):
        return x.a if isinstance(x, _Vec) else float(x)

    def __mul__(self, x):
        return _Vec(self.a * self._v(x))

    __rmul__ = __mul__

    def __truediv__(self, x):
        return _Vec(self.a / self._v(x))

    def __rtruediv__(self, x):
        return _Vec(self._v(x) / self.a)

    def __add__(self, x):
        return _Vec(self.a + self._v(x))

    __radd__ = __add__

    def __sub__(self, x):
        return _Vec(self.a - self._v(x))

    def __rsub__(self, x):
        return _Vec(self._v(x) - self.a)

    def __neg__(self):
        return _Vec(-self.a)

    def to(self, dtype):
        return self


class _Frag(dict):
    """One thread's S fragment as a (rows, cols) view: ``s[r, c]``, ``s[i]`` (CuTe's flat
    order, rows first), ``s.load()`` / ``s.store(v)``. A dict keyed by (r, c): the emulation
    runs every element of every thread through Python, so indexing must be cheap."""

    def __init__(self, data: np.ndarray):
        data = np.asarray(data, dtype=np.float64)
        self.shape = data.shape
        super().__init__(((r, c), float(data[r, c])) for r in range(data.shape[0])
                         for c in range(data.shape[1]))

    @property
    def data(self) -> np.ndarray:
        out = np.empty(self.shape)
        for (r, c), x in self.items():
            out[r, c] = x
        return out

    def _rc(self, key):
        if isinstance(key, tuple):
            if len(key) != 2:
                raise AssertionError(f"s is (rows, cols): index it s[r, c], got s[{key}]")
            return (int(key[0]), int(key[1]))
        i = int(key)
        return (i % self.shape[0], i // self.shape[0])

    def __missing__(self, key):
        return dict.__getitem__(self, self._rc(key))

    def __setitem__(self, key, value):
        if type(value) is not float:
            if isinstance(value, _Vec):
                raise AssertionError("s[r, c] holds one score; store a whole vector with "
                                     "s.store(v)")
            value = float(value)
        dict.__setitem__(self, key if type(key) is tuple and key in self else self._rc(key),
                         value)

    def load(self):
        return _Vec(self.data.T.reshape(-1))

    def store(self, value):
        if not isinstance(value, _Vec) or value.a.size != self.shape[0] * self.shape[1]:
            raise AssertionError("s.store takes the whole fragment: the vector s.load() gave, "
                                 "after arithmetic")
        data = value.a.reshape(self.shape[1], self.shape[0]).T
        for r in range(self.shape[0]):
            for c in range(self.shape[1]):
                dict.__setitem__(self, (r, c), float(data[r, c]))


class _Coords(dict):
    """``tScS`` / ``t0ScS``: (row, col) in the tile of each element of a thread's fragment,
    indexed [r, c]."""

    def __init__(self, coords: np.ndarray):
        self.shape = coords.shape[:2]
        super().__init__(((r, c), (int(coords[r, c, 0]), int(coords[r, c, 1])))
                         for r in range(coords.shape[0]) for c in range(coords.shape[1]))

    def __missing__(self, key):
        raise AssertionError(f"tScS and t0ScS are (rows, cols) views of {self.shape[0]} x "
                             f"{self.shape[1]}: index them tScS[r, c], which gives (row, col); "
                             f"got [{key}]")


def _size(real_size):
    def size(x, mode=None, **kwargs):
        if isinstance(x, (_Frag, _Coords)):
            if mode is None:
                return x.shape[0] * x.shape[1]
            n = 1
            for m in mode:
                n *= x.shape[m]
            return n
        return real_size(x, mode=mode, **kwargs) if mode is not None else real_size(x, **kwargs)

    return size


def _min(a, b):
    return min(int(a), int(b))


def _max(a, b):
    return max(int(a), int(b))


@contextlib.contextmanager
def _emulation(tanh=None):
    with python_loops(), patched(cute, size=_size(cute.size)), \
            patched(cutlass, min=_min, max=_max, Float32=_F32, Int32=_as_int), \
            patched(cute.math, tanh=tanh or _no_tanh):
        yield


def _no_tanh(*args, **kwargs):
    raise AssertionError("the mask needs no tanh: that is exercise 13.4's softcap")


# ================================================================================================
# 13.3 on the CPU: every thread of the tile, against brute force
# ================================================================================================
@dataclass(frozen=True)
class MaskCase:
    sq: int
    sk: int
    causal: bool
    window_size: tuple | None
    sink: int
    wgs: int = 2

    def __str__(self):
        return (f"seqlen_q={self.sq}, seqlen_k={self.sk}, causal={self.causal}, "
                f"window_size={self.window_size}, sink={self.sink}, tile "
                f"{WGMMA_ROWS * self.wgs}x128")


def mask_cases() -> list[MaskCase]:
    """Windows of every sign (utils.window.WINDOWS), each with sinks (none, one, a few, a whole
    tile and more), square and not (seqlen_q > seqlen_k leaves rows with no key), both tiles."""
    from utils.window import WINDOWS

    shapes = ((300, 300), (150, 400), (333, 161))
    sinks = (4, 1, 130, 0, 7)
    cases = []
    for n, window in enumerate(WINDOWS):
        sq, sk = shapes[n % len(shapes)]
        cases.append(MaskCase(sq, sk, n % 4 == 3, window, sinks[n % len(sinks)],
                              wgs=TILES[n % 2][0]))
    cases += [MaskCase(300, 300, True, (100, None), 3), MaskCase(260, 600, False, (50, 20), 128),
              MaskCase(300, 300, False, (64, 0), 129, wgs=3)]
    return cases


def emulate_mask(fn, case: MaskCase, m_block: int, n_block: int, values: np.ndarray):
    """The (tile_m, 128) tile of scores ``values`` after ``fn`` ran on every thread's fragment
    of key tile ``n_block`` of query tile ``m_block``, as plain Python."""
    coords = fragment_coords_host(case.wgs, 128)
    threads = _thread_coords(case.wgs)
    w, wl, wr = window_args(case.causal, case.window_size, WGMMA_ROWS * case.wgs, 128)
    run = _plain(fn)
    out = np.full(values.shape, np.nan)
    with _emulation():
        for t, tScS in enumerate(threads):
            rows, cols = coords[t, ..., 0], coords[t, ..., 1]
            frag = _Frag(values[rows, cols])
            run(frag, tScS, threads[0], w, m_block, n_block, case.sq, case.sk, wl, wr,
                case.sink)
            out[rows, cols] = frag.data
    return out


@functools.cache
def _thread_coords(wgs: int) -> list:
    return [_Coords(c) for c in fragment_coords_host(wgs, 128)]


def _why_visible(i, j, case: MaskCase) -> tuple[str, dict]:
    """Why row i sees key j, and the keys at the edges of that reason (for an off-by-one)."""
    from utils.window import fa4_sides, sees

    left, right = fa4_sides(case.causal, case.window_size)
    diagonal = i + case.sk - case.sq
    if sees(i, j, case.sq, case.sk, case.causal, case.window_size):
        edges = {}
        if left is not None:
            edges[diagonal - left] = "the window's first key"
        if right is not None:
            edges[diagonal + right] = "the window's last key"
        return "it is inside the row's window", edges
    return (f"it is a sink token (keys 0..{case.sink - 1}): sinks stay visible left of the "
            f"window", {case.sink - 1: "the last sink"})


def _why_hidden(i, j, case: MaskCase) -> tuple[str, dict]:
    """Why row i may not see key j, and the keys at the edges of that reason."""
    from utils.window import fa4_sides

    left, right = fa4_sides(case.causal, case.window_size)
    diagonal = i + case.sk - case.sq
    if j >= case.sk:
        return (f"it is past the last key (seqlen_k = {case.sk})",
                {case.sk: "the first column past the keys"})
    if right is not None and j > diagonal + right:
        return (f"it is right of the window: row {i} sees keys up to {diagonal + right} "
                f"(i + seqlen_k - seqlen_q + right)",
                {diagonal + right + 1: "the key just right of the window"})
    return (f"it is left of the window (row {i} sees keys from {diagonal - left}) and is not a "
            f"sink: the sinks are keys 0..{case.sink - 1}",
            {diagonal - left - 1: "the key just left of the window",
             case.sink: "the first key after the sinks"})


def _said(reason: tuple[str, dict], j: int) -> str:
    """The reason, and ' (key j is ...: a mask off by one?)' when j sits at one of its edges."""
    why, edges = reason
    return why + (f" (key {j} is {edges[j]}: a mask off by one?)" if j in edges else "")


def _tiles_to_check(case: MaskCase, truth: np.ndarray, w, wl, wr, most: int = 2) -> list:
    """The visited (m_block, n_block) tiles where the mask has work: each holds both visible
    and hidden keys of its rows (an edge of the window, of the sinks or of seqlen_k), at most
    ``most`` of them spread over the case, and one tile with nothing to mask if there is one."""
    tile_m = WGMMA_ROWS * case.wgs
    edges, plain = [], []
    for m_block in range(truth.shape[0] // tile_m):
        n_min, n_max = key_tiles(w, m_block, case.sq, case.sk, wl, wr, case.sink)
        rows = truth[m_block * tile_m:min((m_block + 1) * tile_m, case.sq)]
        for n_block in range(n_min, n_max):
            part = rows[:, n_block * 128:(n_block + 1) * 128]
            (edges if part.any() and not part.all() else plain).append((m_block, n_block))
    step = max(len(edges) // most, 1)
    return edges[::step][:most] + plain[:1]


def _mask_mistake(fn, case: MaskCase, seed: int = 0) -> str | None:
    """The first element where ``fn`` disagrees with brute force, in words (None: none)."""
    tile_m = WGMMA_ROWS * case.wgs
    w, wl, wr = window_args(case.causal, case.window_size, tile_m, 128)
    rows_q = -(-case.sq // tile_m) * tile_m
    truth = np.zeros((rows_q, (-(-case.sk // 128) + 1) * 128), bool)
    truth[:case.sq, :case.sk] = sink_visible(case.sq, case.sk, case.causal, case.window_size,
                                             case.sink)
    rng = np.random.default_rng(seed)
    for m_block, n_block in _tiles_to_check(case, truth, w, wl, wr):
        values = rng.standard_normal((tile_m, 128))
        got = emulate_mask(fn, case, m_block, n_block, values)
        changed = ~np.isclose(got, values) & ~np.isneginf(got)
        if changed.any():
            r, c = (int(x[0]) for x in np.nonzero(changed))
            return (f"{case}: row {m_block * tile_m + r}, key {n_block * 128 + c}: you "
                    f"changed a score to {got[r, c]:.4g} (it was {values[r, c]:.4g}): a "
                    f"visible score stays as it is, a hidden one becomes -inf")
        want = truth[m_block * tile_m:(m_block + 1) * tile_m,
                     n_block * 128:(n_block + 1) * 128]
        wrong = (np.isneginf(got) == want)
        wrong[max(case.sq - m_block * tile_m, 0):] = False  # rows past seqlen_q: never stored
        if wrong.any():
            r, c = (int(x[0]) for x in np.nonzero(wrong))
            i, j = m_block * tile_m + r, n_block * 128 + c
            if want[r, c]:
                return (f"{case}: row {i}, key {j} is visible, but you masked it: "
                        f"{_said(_why_visible(i, j, case), j)}")
            return (f"{case}: row {i}, key {j} must be masked (-inf), but you kept it: "
                    f"{_said(_why_hidden(i, j, case), j)}")
    return None


def check_sink_mask_rules(fn, cases=None) -> None:
    """Exercise 13.3 without compiling: every thread of every visited tile as plain Python."""
    for n, case in enumerate(cases or mask_cases()):
        mistake = _mask_mistake(fn, case, seed=n)
        if mistake:
            raise AssertionError(mistake)


# ================================================================================================
# 13.3 compiled: one tile's fragment through the mask, for sm_90a
# ================================================================================================
class MaskKernel:
    """Each CTA: one (query tile, key tile) of the scores mS; its consumer threads load their
    S fragment (the wgmma partition of fa4_final's forward), call ``fn`` and store it to mO.
    mS and mO are padded to whole tiles, so no load needs a bound check."""

    def __init__(self, fn, w: TileWindow, sink: int, wgs: int):
        self.fn, self.w, self.sink, self.wgs = fn, w, sink, wgs

    @cute.jit
    def __call__(self, mS: cute.Tensor, mO: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32,
                 window_left: Int32, window_right: Int32, stream):
        from fa4_final.hopper.wgmma import attention_tiled_mmas

        mma_qk, _ = attention_tiled_mmas(cutlass.BFloat16, self.wgs, self.w.tile_n, 128)
        grid_m = cute.ceil_div(cute.size(mS, mode=[0]), self.w.tile_m)
        grid_n = cute.ceil_div(cute.size(mS, mode=[1]), self.w.tile_n)
        self.kernel(mma_qk, mS, mO, seqlen_q, seqlen_k, window_left, window_right).launch(
            grid=(grid_m, grid_n, 1), block=(THREADS_PER_WG * self.wgs, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mS: cute.Tensor, mO: cute.Tensor,
               seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, n_block, _ = cute.arch.block_idx()
        w = self.w
        thr = tiled_mma.get_slice(tidx)
        tScS, t0ScS = fragment_coords(thr, (w.tile_m, w.tile_n))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((w.tile_m, w.tile_n)), Float32)
        s = acc_rows_cols(acc)
        gS = cute.local_tile(mS, (w.tile_m, w.tile_n), (m_block, n_block))
        gO = cute.local_tile(mO, (w.tile_m, w.tile_n), (m_block, n_block))
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, c] = gS[tScS[r, c]]
        self.fn(s, tScS, t0ScS, w, m_block, n_block, seqlen_q, seqlen_k, window_left,
                window_right, self.sink)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                gO[tScS[r, c]] = s[r, c]


@cute.jit
def keep_all(s, tScS, t0ScS, w: cutlass.Constexpr, m_block, n_block, seqlen_q, seqlen_k,
             window_left, window_right, sink: cutlass.Constexpr[int]):
    """The probe's baseline: no mask."""


@cute.jit
def window_mask(s, tScS, t0ScS, w: cutlass.Constexpr, m_block, n_block, seqlen_q, seqlen_k,
                window_left, window_right, sink: cutlass.Constexpr[int]):
    """The package's window mask (fa4_final.common.mask.apply_mask's rule, both sides), no sinks:
    the yardstick of what a mask may cost."""
    col_offset = tScS[0, 0][1]
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        row = m_block * w.tile_m + tScS[r, 0][0]
        lo, hi = visible_cols(w, row, n_block, seqlen_q, seqlen_k, window_left, window_right)
        hi = hi - col_offset
        lo = lo - col_offset
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            col = t0ScS[0, c][1]
            s[r, c] = -Float32.inf if (col >= hi) | (col < lo) else s[r, c]


# the probe's window: both sides bounded, the general case of the rule
PROBE_WINDOW = TileWindow(128, 128, False, has_left=True, has_right=True)
PROBE_SINK = 4
_BUILDS: dict = {}


def compile_mask_kernel(fn, w: TileWindow = PROBE_WINDOW, sink: int = PROBE_SINK, wgs: int = 2):
    """MaskKernel(fn) compiled for sm_90a with no GPU (remembered)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = ("mask", fn, w, sink, wgs)
    if key not in _BUILDS:
        _BUILDS[key] = compile_for("sm_90a", MaskKernel(fn, w, sink, wgs),
                                   fake_tensor(Float32, (None, None)),
                                   fake_tensor(Float32, (None, None)), Int32(0), Int32(0),
                                   Int32(0), Int32(0), fake_stream())
    return _BUILDS[key]


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def sass_opcodes(sass: str) -> Counter:
    """Instruction counts of a SASS listing by opcode (FSEL, ISETP, BRA, ...) without their
    modifiers, except MUFU, which keeps its function (MUFU.TANH, MUFU.RCP); NOPs left out."""
    counts = Counter()
    for m in _OPCODE.finditer(sass):
        op = m.group(1)
        if op == "MUFU" and m.group(2):
            op += "." + m.group(2).split(".")[1]
        if op != "NOP":
            counts[op] += 1
    return counts


def mask_sass_facts(fn) -> dict:
    """What the mask adds to the probe kernel's SASS, beside the package's window mask: selects,
    branches, local memory, instructions per element beyond loading and storing."""
    elements = WGMMA_ROWS * 128 // THREADS_PER_WG
    base = compile_mask_kernel(keep_all)
    ops, base_ops = sass_opcodes(compile_mask_kernel(fn).sass), sass_opcodes(base.sass)
    yard = sass_opcodes(compile_mask_kernel(window_mask).sass)
    art = compile_mask_kernel(fn)
    return {
        "elements per thread": elements,
        "selects per element": (ops["FSEL"] + ops["SEL"]) / elements,
        "branches": ops["BRA"] - base_ops["BRA"],
        "local memory": art.spills > 0 or ops["LDL"] + ops["STL"] > 0 or any(
            k.frame_bytes for k in art.kernels),
        "instructions per element": (sum(ops.values()) - sum(base_ops.values())) / elements,
        "package mask per element":
            (sum(yard.values()) - sum(base_ops.values())) / elements,
    }


def _mask_sass_mistake(facts: dict) -> str | None:
    if facts["local memory"]:
        return ("compiled for sm_90a, your mask puts the fragment in local memory (a stack "
                "frame, LDL/STL): index s with compile-time r and c only, loops over "
                "cutlass.range_constexpr")
    if facts["branches"] > 0:
        return (f"compiled for sm_90a, your mask branches ({facts['branches']} BRA more than the "
                f"kernel without a mask): write each element as one select, s[r, c] = s[r, c] "
                f"if keep else -inf, not an if around it")
    if facts["selects per element"] > 2:
        return (f"compiled for sm_90a, your mask costs {facts['selects per element']:.1f} "
                f"selects per element: fold the conditions into one predicate per element")
    limit = facts["package mask per element"] + 1.0
    if facts["instructions per element"] > limit:
        return (f"compiled for sm_90a, your mask costs {facts['instructions per element']:.1f} "
                f"instructions per element, the package's window mask "
                f"{limit - 1.0:.1f}: work out each row's limits once, outside the column loop, "
                f"shifted by this thread's column offset, and compare each element's "
                f"compile-time column t0ScS[0, c][1] with them (Note [Mask with constants])")
    return None


_sink_rules = check_sink_mask_rules  # a private name: the workshop guide lists its messages


def check_sink_mask(fn, compile_check: bool = True) -> None:
    """Exercise 13.3: ``check_sink_mask_rules`` (every thread, plain Python, against brute
    force), then the mask compiled for sm_90a into a one-tile kernel and its SASS read."""
    _sink_rules(fn)
    if not compile_check:
        return
    mistake = _mask_sass_mistake(mask_sass_facts(fn))
    if mistake:
        raise AssertionError(mistake)


# ================================================================================================
# 13.4 on the CPU, then compiled
# ================================================================================================
SOFTCAP_CASES = ((128 ** -0.5, 30.0), (64 ** -0.5, 5.0), (0.3, 50.0), (1.0, 1.0))


def emulate_softcap(fn, values: np.ndarray, scale: float, cap: float) -> tuple[np.ndarray, list]:
    """``fn`` on one thread's fragment ``values`` (rows, cols) as plain Python; returns what it
    left there and the calls of cute.math.tanh it made (their keyword arguments)."""
    calls = []

    def tanh(x, fastmath=False, approx=False, **_):
        calls.append({"fastmath": fastmath, "approx": approx})
        return _Vec(np.tanh(x.a)) if isinstance(x, _Vec) else float(np.tanh(float(x)))

    frag = _Frag(values)
    with _emulation(tanh=tanh):
        _plain(fn)(frag, _F32(scale), _F32(cap))
    return frag.data, calls


def _softcap_mistake(got, s, scale, cap) -> str:
    want = softcap_reference(s, scale, cap)
    i = np.unravel_index(np.argmax(np.abs(got - want)), s.shape)
    guesses = {
        "tanh(s / c) c: the scores reach your function unscaled; the kernel multiplies by the "
        "softmax scale after it, so use tanh(scale s / c) and give back c / scale times it":
            np.tanh(s / cap) * cap,
        "tanh(scale s / c) c: the softmax multiplies by the scale again after your function, "
        "so the cap would be scale c; give back tanh(scale s / c) c / scale":
            np.tanh(s * scale / cap) * cap,
        "tanh(s) c: the argument of tanh is scale s / c":
            np.tanh(s) * cap,
        "c tanh(s / c) / scale: the argument of tanh is scale s / c":
            np.tanh(s / cap) * cap / scale,
    }
    for why, guess in guesses.items():
        if np.allclose(got, guess, rtol=1e-9, atol=1e-12):
            return f"you computed {why}"
    return (f"element {tuple(int(x) for x in i)}: score {s[i]:.6g}, scale {scale:.4g}, cap "
            f"{cap}: you give {got[i]:.6g}, tanh(scale s / c) c / scale is {want[i]:.6g}")


def check_softcap_rules(fn) -> None:
    """Exercise 13.4 without compiling: one fragment per case as plain Python, in float64."""
    rng = np.random.default_rng(13)
    for scale, cap in SOFTCAP_CASES:
        s = rng.standard_normal((2, 32)) * 40.0
        s[0, :4] = (0.0, 1e-3, -1e4, 1e4)
        got, calls = emulate_softcap(fn, s, scale, cap)
        if not np.allclose(got, softcap_reference(s, scale, cap), rtol=1e-9, atol=1e-12):
            raise AssertionError(f"softmax scale {scale:.4g}, softcap {cap}: "
                                 + _softcap_mistake(got, s, scale, cap))
        if not calls:
            raise AssertionError("you never call cute.math.tanh: the softcap is a tanh")
        if not all(c["fastmath"] or c["approx"] for c in calls):
            raise AssertionError("call cute.math.tanh(x, fastmath=True): without it the tanh "
                                 "is a sequence of some twenty instructions per element (an "
                                 "exponential, a reciprocal, a branch-free correction); with "
                                 "it, one MUFU.TANH, as FA4's softcap does")


class SoftcapKernel:
    """Each CTA: one tile of mS; its consumer threads load their S fragment, call ``fn`` with the
    scale and the cap (run-time values, as they would reach a kernel) and store it to mO."""

    def __init__(self, fn, wgs: int = 2, tile_n: int = 128):
        self.fn, self.wgs, self.tile_n = fn, wgs, tile_n

    @cute.jit
    def __call__(self, mS: cute.Tensor, mO: cute.Tensor, softmax_scale: Float32,
                 softcap: Float32, stream):
        from fa4_final.hopper.wgmma import attention_tiled_mmas

        mma_qk, _ = attention_tiled_mmas(cutlass.BFloat16, self.wgs, self.tile_n, 128)
        tile_m = WGMMA_ROWS * self.wgs
        grid = (cute.ceil_div(cute.size(mS, mode=[0]), tile_m),
                cute.ceil_div(cute.size(mS, mode=[1]), self.tile_n), 1)
        self.kernel(mma_qk, mS, mO, softmax_scale, softcap).launch(
            grid=grid, block=(THREADS_PER_WG * self.wgs, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mS: cute.Tensor, mO: cute.Tensor,
               softmax_scale: Float32, softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, n_block, _ = cute.arch.block_idx()
        tile = (WGMMA_ROWS * self.wgs, self.tile_n)
        thr = tiled_mma.get_slice(tidx)
        tScS, _ = fragment_coords(thr, tile)
        acc = cute.make_rmem_tensor(thr.partition_shape_C(tile), Float32)
        s = acc_rows_cols(acc)
        gS = cute.local_tile(mS, tile, (m_block, n_block))
        gO = cute.local_tile(mO, tile, (m_block, n_block))
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, c] = gS[tScS[r, c]]
        self.fn(s, softmax_scale, softcap)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                gO[tScS[r, c]] = s[r, c]


@cute.jit
def softcap_none(s, softmax_scale: Float32, softcap: Float32):
    """The probe's baseline: scores unchanged."""


def compile_softcap_kernel(fn):
    """SoftcapKernel(fn) compiled for sm_90a with no GPU (remembered)."""
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    key = ("softcap", fn)
    if key not in _BUILDS:
        _BUILDS[key] = compile_for("sm_90a", SoftcapKernel(fn), fake_tensor(Float32, (None, None)),
                                   fake_tensor(Float32, (None, None)), Float32(1.0), Float32(1.0),
                                   fake_stream())
    return _BUILDS[key]


def softcap_sass_facts(fn) -> dict:
    elements = WGMMA_ROWS * 128 // THREADS_PER_WG
    ops = sass_opcodes(compile_softcap_kernel(fn).sass)
    base = sass_opcodes(compile_softcap_kernel(softcap_none).sass)
    art = compile_softcap_kernel(fn)
    return {
        "elements per thread": elements,
        "MUFU.TANH": ops["MUFU.TANH"],
        "divisions (IEEE division calls, MUFU.RCP)": ops["CALL"] + ops["MUFU.RCP"],
        "multiplies per element": (ops["FMUL"] + ops["FFMA"] - base["FMUL"] - base["FFMA"])
        / elements,
        "local memory": art.spills > 0 or any(k.frame_bytes for k in art.kernels),
        "instructions per element": (sum(ops.values()) - sum(base.values())) / elements,
    }


def _softcap_sass_mistake(facts: dict) -> str | None:
    n = facts["elements per thread"]
    if facts["local memory"]:
        return ("compiled for sm_90a, your softcap puts the fragment in local memory: index s "
                "with compile-time indices, loops over cutlass.range_constexpr")
    if facts["MUFU.TANH"] != n:
        return (f"compiled for sm_90a, your softcap has {facts['MUFU.TANH']} MUFU.TANH for {n} "
                f"elements per thread: one hardware tanh per element (cute.math.tanh with "
                f"fastmath=True)")
    if facts["divisions (IEEE division calls, MUFU.RCP)"] > n // 4:
        return (f"compiled for sm_90a, your softcap divides per element "
                f"({facts['divisions (IEEE division calls, MUFU.RCP)']} division calls and "
                f"reciprocals for {n} elements): a float32 division is a subroutine "
                f"call of more than a dozen instructions; work out scale / c and c / scale "
                f"once, before the loop")
    if facts["multiplies per element"] > 3:
        return (f"compiled for sm_90a, your softcap costs {facts['multiplies per element']:.1f} "
                f"multiplies per element: one into tanh's argument, one out")
    return None


_softcap_rules = check_softcap_rules  # a private name: the workshop guide lists its messages


def check_softcap(fn, compile_check: bool = True) -> None:
    """Exercise 13.4: ``check_softcap_rules``, then the softcap compiled for sm_90a into a
    one-tile kernel: one MUFU.TANH per element, no division per element."""
    _softcap_rules(fn)
    if not compile_check:
        return
    mistake = _softcap_sass_mistake(softcap_sass_facts(fn))
    if mistake:
        raise AssertionError(mistake)


SOFTCAP_FORBID = {
    math.tanh: "it runs on the host; in device code the tanh is cute.math.tanh",
    np.tanh: "it runs on the host; in device code the tanh is cute.math.tanh",
}


# ================================================================================================
# Both inside fa4_final's forward
# ================================================================================================
class HopperWithScores(HopperForward):
    """fa4_final's Hopper forward with a left window always compiled in (a call with no left
    side gets NO_LEFT) and ``scores_seam``'s mask step: every visited key tile goes through
    ``softcap_fn`` (if any), then ``mask_fn`` with ``sink`` sink tokens. Nothing else changes."""

    def __init__(self, *args, mask_fn=None, sink=0, softcap_fn=None, softcap=None,
                 softmax_scale=None, **kwargs):
        kwargs["has_window_left"] = True
        super().__init__(*args, **kwargs)
        self.mask_fn, self.sink = mask_fn, sink
        self.softcap_fn, self.softcap, self.softmax_scale = softcap_fn, softcap, softmax_scale

    def cache_key(self) -> tuple:
        return super().cache_key() + (("scores", self.mask_fn, self.sink, self.softcap_fn,
                                       self.softcap, self.softmax_scale),)


@contextlib.contextmanager
def scores_seam(mask_fn=None, sink: int = 0, softcap_fn=None, softcap=None,
                softmax_scale=None):
    """While a kernel is traced in this block, fa4_final.hopper.fwd's mask step is: softcap
    (``softcap_fn(s, softmax_scale, softcap)``), then ``mask_fn`` (default: the package's window
    rule) on every visited key tile; with sinks the visited tiles start at 0."""
    from fa4_final.hopper import fwd as fwd_module

    for name in ("kv_tile_range", "apply_mask"):
        if not hasattr(fwd_module, name):  # the seam is the kernel module's own names
            raise RuntimeError(f"fa4_final.hopper.fwd no longer names {name}: the exercise "
                               f"kernel cannot swap its mask step")
    package_range = fwd_module.kv_tile_range

    def tile_range(w, m_block, seqlen_q, seqlen_k, window_left=None, window_right=None):
        n_min, n_max, n_top, _ = package_range(w, m_block, seqlen_q, seqlen_k, window_left,
                                               window_right)
        if sink > 0:
            n_min = Int32(0)
        return n_min, n_max, n_top, n_max - n_min  # every tile masked (with the left side)

    def mask_step(acc_s, tScS, t0ScS, w, m_block, n_block, seqlen_q, seqlen_k, window_left,
                  window_right, mask_left=False):
        s = acc_rows_cols(acc_s)
        if softcap_fn is not None:
            softcap_fn(s, Float32(softmax_scale), Float32(softcap))
        (mask_fn or window_mask)(s, tScS, t0ScS, w, m_block, n_block, seqlen_q, seqlen_k,
                                 window_left, window_right, sink)

    with patched(fwd_module, kv_tile_range=tile_range, apply_mask=mask_step):
        yield


def exercise_config(head_dim: int, causal: bool):
    """The forward's default config in fixed zigzag rounds (no host tile table, whose key ranges
    are the package's)."""
    from fa4_final.hopper.config import hopper_fwd_default

    return replace(hopper_fwd_default(head_dim, causal), schedule="zigzag", l2_sections=False)


def _build(mask_fn, sink, softcap_fn, softcap, head_dim: int, causal: bool, has_right: bool,
           dtype_name: str = "bf16", keep: bool = False):
    """(compiled, artifacts or None, config) of HopperWithScores for sm_90a (remembered)."""
    from fa4_final.hopper.host import forward_fake_args
    from fa4_final.runtime.compile import compile_kernel

    key = ("forward", mask_fn, sink, softcap_fn, softcap, head_dim, causal, has_right,
           dtype_name, keep)
    if key not in _BUILDS:
        cfg = exercise_config(head_dim, causal)
        scale = head_dim ** -0.5
        kernel = HopperWithScores(
            getattr(cutlass, {"bf16": "BFloat16", "fp16": "Float16"}[dtype_name]), head_dim,
            causal, cfg, has_window_right=has_right, mask_fn=mask_fn, sink=sink,
            softcap_fn=softcap_fn, softcap=softcap, softmax_scale=scale)
        with scores_seam(mask_fn, sink, softcap_fn, softcap, scale):
            compiled, art = compile_kernel(kernel, *forward_fake_args(dtype_name, head_dim, cfg),
                                           arch="sm_90a", keep=keep)
        _BUILDS[key] = (compiled, art, cfg)
    return _BUILDS[key]


def compile_scores_kernel(mask_fn=None, sink: int = PROBE_SINK, softcap_fn=None,
                          softcap: float = 30.0, head_dim: int = 128, causal: bool = False):
    """fa4_final's forward with the two exercises in it, compiled for sm_90a with fake tensors
    (no GPU): its artifacts (remembered)."""
    return _build(mask_fn, sink, softcap_fn, softcap, head_dim, causal, True, keep=True)[1]


def scores_reference(q, k, v, causal=False, window_size=None, sink=0, softcap=None,
                     softmax_scale=None, dtype=None):
    """(out, lse) with the softcap on the scaled scores, then the sink mask; float64 by
    default, or ``dtype`` as plain PyTorch computes it in that precision (the scores rounded
    to it, the softmax in float32, P rounded for P V): the tolerance rule's two references."""
    import torch

    dtype = dtype or torch.float64
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    if hk != h:
        kf, vf = (t.repeat_interleave(h // hk, dim=1) for t in (kf, vf))
    s = torch.matmul(qf, kf.transpose(-1, -2)).to(soft) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    seen = torch.from_numpy(sink_visible(sq, sk, causal, window_size, sink)).to(s.device)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    total = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    out = torch.matmul(p.to(dtype), vf)
    return out.transpose(1, 2).contiguous(), lse


def attention_with_scores(q, k, v, causal=False, window_size=None, sink=0, mask_fn=None,
                          softcap=None, softcap_fn=None):
    """fa4_final's forward with the exercises' mask step, on a Hopper GPU: (out, lse), into
    NaN-poisoned buffers (an element the kernel forgets stays NaN). Launched directly, with the
    arguments fa4_final's own launch passes (fixed zigzag rounds: no tile table, no split)."""
    import torch

    from fa4_final.common.timeline import MARKS, MAX_STEPS
    from utils.window import fa4_sides

    b, _, h, d = q.shape
    left, right = fa4_sides(causal, window_size)
    causal = causal or right == 0
    has_right = right is not None and not causal
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    compiled, _, cfg = _build(mask_fn, sink, softcap_fn, softcap, d, causal, has_right,
                              dtype_name)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, q.shape[1]), float("nan"), device=q.device)
    timeline = torch.zeros((1 + cfg.num_consumer_wgs, MAX_STEPS, MARKS), dtype=torch.int64,
                           device=q.device)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    compiled(q, k, v, out, lse, timeline, d ** -0.5, NO_LEFT if left is None else left,
             0 if right is None or causal else right, h * b, sms, None, None, None, None, None,
             None, None, None)
    torch.cuda.synchronize()
    return out, lse


# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, window_size, sink, dtype)
SINK_GPU_CASES = [
    (1, 300, 300, 2, 2, 128, False, (64, 0), 4, "bfloat16"),
    (2, 1000, 1000, 4, 2, 128, True, (200, None), 7, "bfloat16"),
    (1, 333, 901, 4, 1, 64, False, (100, 50), 130, "float16"),
    (1, 901, 333, 2, 2, 64, True, (-3, None), 5, "bfloat16"),  # rows see the sinks only
    (2, 2048, 2048, 4, 4, 128, True, (256, 0), 4, "bfloat16"),
]
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, window_size, softcap, dtype)
SOFTCAP_GPU_CASES = [
    (1, 300, 300, 2, 2, 128, False, None, 30.0, "bfloat16"),
    (2, 1000, 700, 4, 2, 64, True, None, 5.0, "bfloat16"),
    (1, 333, 901, 4, 1, 128, False, (100, 100), 50.0, "float16"),
    (2, 2048, 2048, 4, 4, 128, True, None, 1.0, "bfloat16"),
]


def _gpu_case(q, k, v, causal, window, sink, softcap, mask_fn, softcap_fn, label):
    import torch

    from utils.checks import tolerance_check

    out, lse = attention_with_scores(q, k, v, causal, window, sink, mask_fn, softcap,
                                     softcap_fn)
    ref_out, ref_lse = scores_reference(q, k, v, causal, window, sink, softcap)
    same_out, same_lse = scores_reference(q, k, v, causal, window, sink, softcap,
                                          dtype=q.dtype)
    v_out = tolerance_check(out, ref_out, same_out, "out")
    v_lse = tolerance_check(lse, ref_lse, same_lse.to(torch.float32), "lse", extra_atol=1e-4)
    ok = v_out.passed and v_lse.passed
    return ok, (f"{'PASS' if ok else 'FAIL'} {label}: out max err {v_out.kernel.max_abs:.2e} "
                f"(limit {v_out.limit:.2e}), lse max err {v_lse.kernel.max_abs:.2e} (limit "
                f"{v_lse.limit:.2e})")


def _gpu_inputs(b, sq, sk, h, hk, d, dtype, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(getattr(torch, dtype))
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g).to(getattr(torch, dtype))
    v = torch.randn(b, sk, hk, d, device="cuda", generator=g).to(getattr(torch, dtype))
    return q, k, v


def check_sink_mask_on_gpu(fn, cases=SINK_GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 13.3 on a Hopper GPU: fa4_final's forward with ``fn`` as its mask, on fresh
    random inputs of awkward shapes, against float64. Returns (ok, one line per case)."""
    ok, lines = True, []
    for n, (b, sq, sk, h, hk, d, causal, window, sink, dtype) in enumerate(cases):
        q, k, v = _gpu_inputs(b, sq, sk, h, hk, d, dtype, seed=1300 + n)
        label = (f"b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} window={window} "
                 f"sink={sink} {dtype}")
        case_ok, line = _gpu_case(q, k, v, causal, window, sink, None, fn, None, label)
        ok &= case_ok
        lines.append(line)
    return ok, lines


def check_softcap_on_gpu(fn, cases=SOFTCAP_GPU_CASES) -> tuple[bool, list[str]]:
    """Exercise 13.4 on a Hopper GPU: fa4_final's forward with ``fn`` before its mask, against
    float64 (the tanh in float64 too). Returns (ok, one line per case)."""
    ok, lines = True, []
    for n, (b, sq, sk, h, hk, d, causal, window, cap, dtype) in enumerate(cases):
        q, k, v = _gpu_inputs(b, sq, sk, h, hk, d, dtype, seed=1340 + n)
        label = (f"b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} window={window} "
                 f"softcap={cap} {dtype}")
        case_ok, line = _gpu_case(q, k, v, causal, window, 0, cap, None, fn, label)
        ok &= case_ok
        lines.append(line)
    return ok, lines
