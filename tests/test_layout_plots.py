"""The layout-drawing helper: its pure-Python evaluator agrees with CuTe, its bank model counts
what the hardware does, and every picture renders headless."""

import random

import cutlass
import cutlass.cute as cute
import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from utils import layout_plots as lp  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _random_layout(rng, depth=0):
    if depth >= 2 or rng.random() < 0.45:
        return rng.randint(1, 5), rng.choice([0, 1, 2, 3, 7, 16])
    modes = [_random_layout(rng, depth + 1) for _ in range(rng.randint(2, 3))]
    return tuple(m[0] for m in modes), tuple(m[1] for m in modes)


_RNG = random.Random(11)
LAYOUTS = [((4, 8), (8, 1)), ((4, (2, 4)), (2, (1, 8))), (((4, 8), (2, 2)), ((32, 1), (16, 8)))]
LAYOUTS += [lay for lay in (_random_layout(_RNG) for _ in range(40))
            if isinstance(lay[0], tuple) and lp.size(lay[0]) <= 40]


@cute.jit
def _cute_values(layouts: cutlass.Constexpr):
    # Every layout at every 1-D coordinate and, for rank-2 ones, every (i, j), on the host.
    out = []
    for shape, stride in layouts:
        layout = cute.make_layout(shape, stride=stride)
        out.append(([layout(i) for i in range(cute.size(layout))], lp.layout_grid(layout).tolist()
                    if len(shape) == 2 else None))
    return out


def test_evaluator_matches_cute_on_nested_and_random_layouts():
    for (shape, stride), (flat, grid) in zip(LAYOUTS, _cute_values(tuple(LAYOUTS))):
        mine = [lp.crd2idx(i, shape, stride) for i in range(lp.size(shape))]
        assert mine == flat, f"{shape}:{stride}: 1-D evaluation differs from CuTe"
        if grid is not None:
            assert lp.layout_grid((shape, stride)).tolist() == grid, f"{shape}:{stride} grid"


def test_idx2crd_is_leftmost_fastest():
    assert lp.idx2crd(13, (4, 8)) == (1, 3)
    assert lp.idx2crd(29, (4, (2, 4))) == (1, (1, 3))
    assert lp.crd2idx((1, (1, 2)), (4, (2, 4)), (2, (1, 8))) == 19
    assert lp.size(((2, 3), 4)) == 24


@pytest.mark.parametrize("bad", [((4, 8), (1,)), ((4, 8), 1), ((0, 8), (1, 4)), "4:1"])
def test_bad_layouts_are_rejected_clearly(bad):
    with pytest.raises((ValueError, TypeError), match="shape|expected|extent"):
        lp.layout_grid(bad)


@cute.jit
def _cute_swizzled(bits: cutlass.Constexpr, base: cutlass.Constexpr, shift: cutlass.Constexpr):
    layout = cute.make_composed_layout(cute.make_swizzle(bits, base, shift), 0,
                                       cute.make_layout(1024))
    return [layout(i) for i in range(1024)]


@pytest.mark.parametrize("params", [(3, 3, 3), (2, 3, 3), (3, 4, 3), (1, 2, 5)])
def test_swizzle_matches_cute(params):
    assert [lp.swizzle(i, *params) for i in range(1024)] == _cute_swizzled(*params)


def test_bank_model_known_cases():
    assert lp.bank_wavefronts([4 * t for t in range(32)], 4).wavefronts == 1  # consecutive words
    assert lp.bank_wavefronts([0] * 32, 4).conflict_free  # one word for all: a broadcast
    assert lp.bank_wavefronts([8 * t for t in range(32)], 4).ways == 2  # stride 2 words
    assert lp.bank_wavefronts([128 * t for t in range(32)], 4).ways == 32  # one bank
    rows = lp.bank_wavefronts([128 * r for r in range(8)], 16)  # ldmatrix, unswizzled
    assert (rows.wavefronts, rows.ideal, rows.ways) == (8, 1, 8)
    full = lp.bank_wavefronts([16 * t for t in range(32)], 16)  # 512 B in 4 phases of 128 B
    assert (full.wavefronts, full.ideal) == (4, 4) and full.conflict_free
    assert lp.bank_wavefronts([8 * t for t in range(32)], 8).wavefronts == 2


@pytest.mark.parametrize("addrs,nbytes", [([2], 4), ([0] * 33, 4), ([0], 3), ([-16], 16)])
def test_bank_model_rejects_bad_requests(addrs, nbytes):
    with pytest.raises(ValueError, match="access_bytes|addresses|warp"):
        lp.bank_wavefronts(addrs, nbytes)


def test_swizzle_makes_column_reads_conflict_free():
    assert lp.column_read_report(None).ways == 8
    assert all(lp.column_read_report((3, 3, 3), chunk=c).conflict_free for c in range(8))
    slots = lp.chunk_slots((3, 3, 3))
    assert all(sorted(slots[:, c]) == list(range(8)) for c in range(8))


def test_tv_cells_cover_the_mma_accumulator_once():
    cells = lp.tv_cells((((4, 8), (2, 2)), ((32, 1), (16, 8))), (16, 8))
    assert len(cells) == 128 and all(len(v) == 1 for v in cells.values())
    assert cells[(1, 2)] == [(5, 0)] and cells[(9, 3)] == [(5, 3)]  # lane 5: rows 1, 9; cols 2, 3
    with pytest.raises(ValueError, match="outside"):
        lp.tv_cells((((4, 8), (2, 2)), ((32, 1), (16, 8))), (8, 8))


def test_pictures_render_headless():
    lp.draw_layout(((4, 8), (8, 1)))
    lp.draw_layout((8, 2), title="rank 1")
    lp.draw_tv_layout((((4, 8), (2, 2)), ((32, 1), (16, 8))), (16, 8))
    lp.draw_tv_layout(((4, 2), (1, 0)), (4, 2))  # a broadcast and uncovered cells
    ax = lp.draw_banks([128 * r for r in range(8)], 16)
    assert "8-way" in ax.get_title()
    axes = lp.draw_swizzle((3, 3, 3))
    assert "8-way" in axes[0].get_title() and "conflict free" in axes[1].get_title()
    for a in plt.gcf().axes:
        a.figure.canvas.draw()


@cute.jit
def _draw_cute_objects():
    lp.draw_layout(cute.make_layout((4, (2, 4)), stride=(2, (1, 8))))
    lp.draw_tv_layout(cute.make_layout(((4, 8), (2, 2)), stride=((32, 1), (16, 8))), (16, 8))
    swizzled = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))
    lp.draw_swizzle(cute.make_swizzle(3, 3, 3))
    return lp.layout_grid(swizzled)[1, :9].tolist()


def test_draws_cute_objects_inside_a_host_jit():
    # Row 1 of the swizzled (8, 64) atom: chunk 0 and chunk 1 trade places (1 XOR 0 = 1).
    assert _draw_cute_objects() == [72, 73, 74, 75, 76, 77, 78, 79, 64]


@cute.jit
def _dynamic_layout(n: cutlass.Int32):
    lp.layout_grid(cute.make_layout((n, 4)))


def test_dynamic_cute_layout_is_refused():
    with pytest.raises(Exception, match="static|int"):
        _dynamic_layout(cutlass.Int32(4))
