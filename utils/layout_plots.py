"""Pictures of CuTe layouts: index grids, thread-value (TV) layouts, shared-memory banks, swizzles.

A layout is a function from coordinates to an index, given by a shape and a stride:
``index = sum(coord_i * stride_i)``. Every function here accepts a layout in one of two forms:

* a plain ``(shape, stride)`` pair of (possibly nested) int tuples, evaluated by the small
  pure-Python evaluator below (``crd2idx``, ``idx2crd``), which follows CuTe's conventions;
* a CuTe object (``cute.Layout`` or a swizzled ``cute.ComposedLayout``). Those exist only while a
  ``@cute.jit`` function is being traced, so call the drawing function from inside one; a static
  layout then evaluates to plain Python ints on the CPU, with no GPU involved.

Conventions, all CuTe's: a 1-D index into a multi-mode shape is split colexicographically (the
leftmost mode varies fastest), so a ``(M, N)`` tile's element ``(m, n)`` has linear coordinate
``m + M * n``. A TV layout maps ``(thread, value)`` to that linear coordinate of the tile.

The shared-memory bank model (``bank_wavefronts``): 32 banks of 4 bytes; a warp's request is
served in phases of 128 bytes (32 threads for 4-byte accesses, 16 for 8-byte, 8 for 16-byte,
which is also how ``ldmatrix`` reads its 8 row addresses per matrix); within a phase, a bank
serves one 4-byte word per cycle (threads reading the same word share it). The number of
cycles ("wavefronts") is the largest count of distinct words any bank must serve.

Nothing here needs a GPU, and drawing needs only matplotlib (works headless with Agg).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np

NUM_BANKS = 32
BANK_BYTES = 4
PHASE_BYTES = NUM_BANKS * BANK_BYTES  # 128 bytes served per shared-memory cycle

# One colour per thread id (mod 40), the same in every picture of the course.
_PALETTE = [plt.get_cmap("tab20")(i) for i in range(20)]
_PALETTE += [plt.get_cmap("tab20b")(i) for i in range(20)]
PALETTE = [mcolors.to_hex(c) for c in _PALETTE[0::2] + _PALETTE[1::2]]
CONFLICT_COLOR = "#d62728"
EMPTY_COLOR = "#eeeeee"


def thread_color(t: int) -> str:
    """The colour of thread ``t`` in every picture."""
    return PALETTE[t % len(PALETTE)]


# ----------------------------------------------------------------------------------------------
# A pure-Python layout evaluator (CuTe's rules, for plain tuples).


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_congruent(shape, stride) -> None:
    if _is_int(shape):
        if not _is_int(stride):
            raise ValueError(f"shape {shape} is an int but its stride {stride!r} is not")
        if shape < 1:
            raise ValueError(f"every extent of a shape must be >= 1, got {shape}")
        return
    if not isinstance(shape, tuple) or not isinstance(stride, tuple) or len(shape) != len(stride):
        raise ValueError(
            f"shape {shape!r} and stride {stride!r} must be ints or tuples of the same nesting"
        )
    for s, d in zip(shape, stride):
        _check_congruent(s, d)


def _is_static(shape) -> bool:
    if isinstance(shape, tuple):
        return all(_is_static(s) for s in shape)
    return _is_int(shape)


def size(shape) -> int:
    """Number of coordinates of a (possibly nested) shape: the product of its extents."""
    return int(shape) if _is_int(shape) else prod(size(s) for s in shape)


def idx2crd(index: int, shape):
    """Split a 1-D index into a coordinate of ``shape``, leftmost mode fastest (CuTe's order)."""
    if _is_int(shape):
        return int(index)
    coord = []
    for s in shape:
        n = size(s)
        coord.append(idx2crd(index % n, s))
        index //= n
    return tuple(coord)


def crd2idx(coord, shape, stride) -> int:
    """The index a layout ``shape:stride`` gives ``coord``; an int coordinate into a tuple mode
    is first split with ``idx2crd`` (so a layout is also a function of one integer)."""
    if _is_int(coord) and not _is_int(shape):
        coord = idx2crd(coord, shape)
    if _is_int(shape):
        return int(coord) * int(stride)
    if not isinstance(coord, tuple) or len(coord) != len(shape):
        raise ValueError(f"coordinate {coord!r} does not match shape {shape!r}")
    return sum(crd2idx(c, s, d) for c, s, d in zip(coord, shape, stride))


def swizzle(offset: int, bits: int, base: int, shift: int) -> int:
    """CuTe's ``Swizzle<bits, base, shift>``: XOR the ``bits`` bits found ``shift`` positions
    above bit ``base`` into bits ``[base, base + bits)``. Offsets are in the units the swizzle is
    composed with (elements, for a swizzled shared-memory layout)."""
    mask = ((1 << bits) - 1) << (base + shift)
    return offset ^ ((offset & mask) >> shift)


@dataclass(frozen=True)
class _Fn:
    """A layout as a shape plus a function from coordinate to index."""

    shape: object
    fn: object
    name: str

    def __call__(self, coord) -> int:
        return self.fn(coord)


def as_layout(layout) -> _Fn:
    """Accept ``(shape, stride)`` tuples or a static CuTe layout; return a callable layout."""
    if isinstance(layout, tuple) and len(layout) == 2:
        shape, stride = layout
        _check_congruent(shape, stride)
        return _Fn(shape, lambda c: crd2idx(c, shape, stride), f"{_fmt(shape)}:{_fmt(stride)}")
    if callable(layout) and hasattr(layout, "shape"):
        shape = layout.shape
        if not _is_static(shape):
            raise TypeError(f"layout {layout} has a dynamic shape: only static layouts (every "
                            "extent known while tracing) can be evaluated or drawn")

        def fn(coord, _layout=layout):
            value = _layout(coord)
            if not _is_int(value):
                raise TypeError(
                    f"layout {layout} gave {value!r} at {coord}: only static layouts (all "
                    "extents and strides known while tracing) can be drawn"
                )
            return int(value)

        return _Fn(shape, fn, str(layout))
    raise TypeError(
        "expected a (shape, stride) pair of int tuples or a static CuTe Layout/ComposedLayout "
        f"(inside a @cute.jit function), got {type(layout).__name__}"
    )


def _fmt(x) -> str:
    return str(x) if _is_int(x) else "(" + ",".join(_fmt(e) for e in x) + ")"


def layout_grid(layout) -> np.ndarray:
    """The index of every coordinate as a 2-D array: rank-2 layouts give
    ``size(mode 0) x size(mode 1)``, rank-1 layouts a single row."""
    fn = as_layout(layout)
    shape = fn.shape
    if _is_int(shape) or len(shape) == 1:
        n = size(shape)
        return np.array([[fn(i if _is_int(shape) else (i,)) for i in range(n)]], dtype=np.int64)
    if len(shape) != 2:
        raise ValueError(f"can only grid rank-1 or rank-2 layouts, got shape {shape}")
    rows, cols = size(shape[0]), size(shape[1])
    return np.array([[fn((i, j)) for j in range(cols)] for i in range(rows)], dtype=np.int64)


def tv_cells(tv_layout, tile_shape) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Which ``(thread, value)`` pairs land on each ``(m, n)`` cell of a ``(M, N)`` tile."""
    fn = as_layout(tv_layout)
    if _is_int(fn.shape) or len(fn.shape) != 2:
        raise ValueError(f"a TV layout has two modes (threads, values), got shape {fn.shape}")
    tile_m, tile_n = tile_shape
    cells: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for t in range(size(fn.shape[0])):
        for v in range(size(fn.shape[1])):
            idx = fn((t, v))
            m, n = idx % tile_m, idx // tile_m
            if n >= tile_n:
                raise ValueError(
                    f"TV layout {fn.name} sends (T{t}, V{v}) to index {idx}, outside the "
                    f"{tile_m}x{tile_n} tile"
                )
            cells.setdefault((m, n), []).append((t, v))
    return cells


# ----------------------------------------------------------------------------------------------
# The shared-memory bank model.


@dataclass(frozen=True)
class BankReport:
    wavefronts: int  # shared-memory cycles the request takes
    ideal: int  # cycles with no conflict: one per 128-byte phase
    # phases[p][bank] = distinct word addresses bank must serve in phase p, with the threads
    # reading each word: {word: [threads]}
    phases: tuple

    @property
    def conflict_free(self) -> bool:
        return self.wavefronts == self.ideal

    @property
    def ways(self) -> int:
        """The worst phase's conflict degree (1 = conflict free)."""
        return max((max((len(b) for b in ph.values()), default=1) for ph in self.phases),
                   default=1)


def bank_wavefronts(byte_addresses, access_bytes: int = 4) -> BankReport:
    """Count the cycles one warp-wide shared-memory access takes, given each thread's starting
    byte address (thread ``t`` is ``byte_addresses[t]``) and the bytes each thread reads."""
    if access_bytes not in (1, 2, 4, 8, 16):
        raise ValueError(f"access_bytes must be 1, 2, 4, 8 or 16, got {access_bytes}")
    addrs = [int(a) for a in byte_addresses]
    if not 1 <= len(addrs) <= 32:
        raise ValueError(f"give one address per thread of one warp (1..32), got {len(addrs)}")
    if any(a < 0 or a % access_bytes for a in addrs):
        raise ValueError(
            f"addresses must be non-negative multiples of access_bytes={access_bytes}: {addrs}"
        )
    per_phase = PHASE_BYTES // max(access_bytes, BANK_BYTES)
    phases = []
    for p0 in range(0, len(addrs), per_phase):
        banks: dict[int, dict[int, list[int]]] = {}
        for t in range(p0, min(p0 + per_phase, len(addrs))):
            first = addrs[t] // BANK_BYTES
            last = (addrs[t] + access_bytes - 1) // BANK_BYTES
            for word in range(first, last + 1):
                banks.setdefault(word % NUM_BANKS, {}).setdefault(word, []).append(t)
        phases.append(banks)
    wavefronts = sum(max(len(words) for words in ph.values()) for ph in phases)
    return BankReport(wavefronts, len(phases), tuple(phases))


# ----------------------------------------------------------------------------------------------
# Drawing.


def _text_color(face: str) -> str:
    r, g, b = mcolors.to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _new_axes(ax, cols: int, rows: int, cell: float = 0.45):
    if ax is None:
        width = min(16.0, max(3.0, cols * cell + 1.0))
        height = min(12.0, max(1.6, rows * cell + 1.0))
        _, ax = plt.subplots(figsize=(width, height))
    return ax


def _grid_axes(ax, rows: int, cols: int, row_label: str, col_label: str) -> None:
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_aspect("equal")
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    step_c = 1 if cols <= 32 else cols // 16
    step_r = 1 if rows <= 32 else rows // 16
    ax.set_xticks(range(0, cols, step_c))
    ax.set_yticks(range(0, rows, step_r))
    ax.tick_params(length=0, labelsize=7)
    ax.xaxis.tick_top()
    ax.set_xlabel(col_label, fontsize=8)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel(row_label, fontsize=8)


def _paint(ax, faces, texts, fontsize: float, outlined=()) -> None:
    """Fill a grid of cells in one image (fast even for large grids), write each cell's text in
    black or white for contrast, and outline the cells in ``outlined`` in red."""
    rows, cols = len(faces), len(faces[0])
    rgb = np.array([[mcolors.to_rgb(f) for f in row] for row in faces])
    ax.imshow(rgb, interpolation="nearest", extent=(-0.5, cols - 0.5, rows - 0.5, -0.5))
    ax.hlines(np.arange(rows + 1) - 0.5, -0.5, cols - 0.5, colors="white", linewidth=0.8)
    ax.vlines(np.arange(cols + 1) - 0.5, -0.5, rows - 0.5, colors="white", linewidth=0.8)
    for r in range(rows):
        for c in range(cols):
            if texts[r][c]:
                ax.text(c, r, texts[r][c], ha="center", va="center", fontsize=fontsize,
                        color=_text_color(faces[r][c]))
    for r, c in outlined:
        ax.add_patch(plt.Rectangle((c - 0.45, r - 0.45), 0.9, 0.9, fill=False,
                                   edgecolor=CONFLICT_COLOR, linewidth=1.6))


def _fontsize(rows: int, cols: int) -> float:
    return max(4.0, min(9.0, 140.0 / max(cols, rows, 1)))


def draw_layout(layout, ax=None, title: str | None = None, labels: bool | None = None):
    """Draw a rank-1 or rank-2 layout as a grid: cell ``(i, j)`` shows the index the layout
    gives that coordinate; cells with the same index share a colour. Returns the axes."""
    grid = layout_grid(layout)
    rows, cols = grid.shape
    ax = _new_axes(ax, cols, rows)
    labels = rows * cols <= 1024 if labels is None else labels
    faces = [[thread_color(int(i)) for i in row] for row in grid]
    texts = [[str(int(i)) if labels else "" for i in row] for row in grid]
    _paint(ax, faces, texts, _fontsize(rows, cols))
    _grid_axes(ax, rows, cols, "mode 0", "mode 1")
    ax.set_title(title or f"layout {as_layout(layout).name}", pad=18)
    return ax


def draw_tv_layout(tv_layout, tile_shape, ax=None, title: str | None = None,
                   labels: bool | None = None, window: tuple[int, int] | None = None):
    """Draw which thread owns each element of a ``(M, N)`` tile under a TV layout: cells are
    coloured by thread and labelled ``T<t>V<v>``. A cell reached by several (thread, value)
    pairs (a broadcast) shows the first and a ``+``; cells no thread owns stay grey.
    ``window=(rows, cols)`` draws only the top-left corner of a large tile."""
    cells = tv_cells(tv_layout, tile_shape)
    rows, cols = tile_shape
    if window is not None:
        rows, cols = min(rows, window[0]), min(cols, window[1])
        cells = {(m, n): o for (m, n), o in cells.items() if m < rows and n < cols}
    ax = _new_axes(ax, cols, rows, cell=0.62)
    labels = rows * cols <= 512 if labels is None else labels
    faces = [[EMPTY_COLOR] * cols for _ in range(rows)]
    texts = [[""] * cols for _ in range(rows)]
    for (m, n), owners in cells.items():
        t, v = owners[0]
        faces[m][n] = thread_color(t)
        if labels:
            texts[m][n] = f"T{t}\nV{v}" + ("+" if len(owners) > 1 else "")
    _paint(ax, faces, texts, _fontsize(rows, cols) * 0.8)
    _grid_axes(ax, rows, cols, "m", "n")
    where = f"a {tile_shape[0]}x{tile_shape[1]} tile" + (
        "" if (rows, cols) == tuple(tile_shape) else f" (its top-left {rows}x{cols})")
    ax.set_title(title or f"TV layout {as_layout(tv_layout).name} on {where}", pad=18)
    return ax


def draw_banks(byte_addresses, access_bytes: int = 4, ax=None, title: str | None = None):
    """Draw one warp-wide shared-memory access: 32 columns (banks), one row per cycle
    (wavefront). Each cell names the thread reading that bank in that cycle (``+``: several
    threads share the word, a free broadcast). Rows beyond a phase's first are conflicts: their
    cells are outlined in red. Returns the axes."""
    report = bank_wavefronts(byte_addresses, access_bytes)
    faces, texts, ylabels, outlined = [], [], [], []
    for p, banks in enumerate(report.phases):
        for k in range(max(len(words) for words in banks.values())):
            face_row, text_row = [EMPTY_COLOR] * NUM_BANKS, [""] * NUM_BANKS
            for bank, words in banks.items():
                ordered = sorted(words.items())
                if k < len(ordered):
                    threads = ordered[k][1]
                    face_row[bank] = thread_color(threads[0])
                    text_row[bank] = f"T{threads[0]}" + ("+" if len(set(threads)) > 1 else "")
                    if k > 0:
                        outlined.append((len(faces), bank))
            faces.append(face_row)
            texts.append(text_row)
            ylabels.append(f"phase {p}" + (f" +{k}" if k else ""))
    rows = len(faces)
    ax = _new_axes(ax, NUM_BANKS, rows, cell=0.42)
    _paint(ax, faces, texts, 6.0, outlined)
    _grid_axes(ax, rows, NUM_BANKS, "cycle", "bank")
    ax.set_yticks(range(rows))
    ax.set_yticklabels(ylabels)
    verdict = ("no bank conflict" if report.conflict_free
               else f"{report.ways}-way bank conflict")
    ax.set_title(title or f"{len(byte_addresses)} threads x {access_bytes} B: "
                 f"{report.wavefronts} cycles (ideal {report.ideal}), {verdict}", pad=18)
    return ax


def _as_swizzle(sw) -> tuple[int, int, int]:
    if isinstance(sw, tuple) and len(sw) == 3 and all(_is_int(x) for x in sw):
        return tuple(int(x) for x in sw)
    if all(hasattr(sw, a) for a in ("num_bits", "num_base", "num_shift")):
        return int(sw.num_bits), int(sw.num_base), int(sw.num_shift)
    raise TypeError(f"expected (bits, base, shift) or a cute.Swizzle, got {sw!r}")


def chunk_slots(sw, rows: int = 8, row_bytes: int = 128, elem_bytes: int = 2) -> np.ndarray:
    """For a row-major ``rows x row_bytes`` tile stored through swizzle ``sw`` (in element
    units, ``None`` for none): the 16-byte slot of its 128-byte line (0..7, i.e. banks
    ``4s..4s+3``) that holds each 16-byte chunk. Shape ``(rows, row_bytes // 16)``."""
    if row_bytes % 16 or 16 % elem_bytes:
        raise ValueError(f"row_bytes ({row_bytes}) must be a multiple of 16 and elem_bytes "
                         f"({elem_bytes}) must divide 16")
    params = None if sw is None else _as_swizzle(sw)
    per_row = row_bytes // elem_bytes
    out = np.zeros((rows, row_bytes // 16), dtype=np.int64)
    for r in range(rows):
        for c in range(row_bytes // 16):
            e = r * per_row + c * (16 // elem_bytes)
            e = e if params is None else swizzle(e, *params)
            out[r, c] = (e * elem_bytes % PHASE_BYTES) // 16
    return out


def column_read_report(sw, rows: int = 8, row_bytes: int = 128, elem_bytes: int = 2,
                       chunk: int = 0) -> BankReport:
    """Bank report for 8 threads each reading 16 bytes of chunk ``chunk`` in rows 0..7 (the
    pattern of one ``ldmatrix`` 8x8 matrix), through swizzle ``sw`` (``None``: none)."""
    params = None if sw is None else _as_swizzle(sw)
    per_row = row_bytes // elem_bytes
    addrs = []
    for r in range(min(rows, 8)):
        e = r * per_row + chunk * (16 // elem_bytes)
        addrs.append((e if params is None else swizzle(e, *params)) * elem_bytes)
    return bank_wavefronts(addrs, 16)


def draw_swizzle(sw, rows: int = 8, row_bytes: int = 128, elem_bytes: int = 2, axes=None):
    """Two panels: a row-major tile of 16-byte chunks without and with swizzle ``sw``. Each
    cell is a logical chunk ``(row, chunk)``, coloured and labelled by the bank group it lands
    in. A column read (one ``ldmatrix``) is conflict free when its column shows 8 colours.
    Returns the two axes."""
    params = _as_swizzle(sw)
    cols = row_bytes // 16
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(min(16, 2 * cols * 0.6 + 2), rows * 0.5 + 1.4))
    name = "Swizzle<{},{},{}>".format(*params)
    for ax, s, label in ((axes[0], None, "no swizzle"), (axes[1], params, name)):
        slots = chunk_slots(s, rows, row_bytes, elem_bytes)
        faces = [[thread_color(int(x)) for x in row] for row in slots]
        texts = [[f"b{4 * int(x)}-{4 * int(x) + 3}" for x in row] for row in slots]
        _paint(ax, faces, texts, _fontsize(rows, cols) * 0.9)
        _grid_axes(ax, rows, cols, "row", "16-byte chunk (logical)")
        report = column_read_report(s, rows, row_bytes, elem_bytes)
        verdict = "conflict free" if report.conflict_free else f"{report.ways}-way conflict"
        ax.set_title(f"{label}: column read {verdict}", pad=18, fontsize=10)
    return axes


__all__ = [
    "BANK_BYTES",
    "NUM_BANKS",
    "PALETTE",
    "BankReport",
    "as_layout",
    "bank_wavefronts",
    "chunk_slots",
    "column_read_report",
    "crd2idx",
    "draw_banks",
    "draw_layout",
    "draw_swizzle",
    "draw_tv_layout",
    "idx2crd",
    "layout_grid",
    "size",
    "swizzle",
    "thread_color",
    "tv_cells",
]
