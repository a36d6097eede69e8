"""Chapter 13's device-code exercises (solutions/ch13_scores.py) on a CPU: the fragment coordinates
host-side CuTe reads from the kernel's partition, the brute-force rule with sinks, the key tiles
the exercise kernel visits, the references through the checkers, the float64 reference of the GPU
check, and (slow) the references compiled for sm_90a, alone and inside fa4_final's forward."""

import numpy as np
import pytest
import torch

from fa4_final.hopper import fwd as fwd_module
from solutions import ch13_scores as t13s
from utils.window import WINDOWS, sees, visible_mask


@pytest.mark.parametrize("wgs", [2, 3])
def test_fragment_coordinates_cover_the_tile_once(wgs):
    coords = t13s.fragment_coords_host(wgs, 128)
    assert coords.shape == (128 * wgs, 2, 32, 2)
    cells = {(int(r), int(c)) for r, c in coords.reshape(-1, 2)}
    assert len(cells) == 64 * wgs * 128 == coords.shape[0] * 64
    # the wgmma accumulator: thread 0 holds columns 8 j + e, rows 0 and 8
    assert [int(c) for c in coords[0, 0, :, 1]] == [8 * (c // 2) + c % 2 for c in range(32)]
    assert sorted({int(r) for r in coords[0, :, 0, 0]}) == [0, 8]
    # every thread's columns are thread 0's plus one offset (Note [Mask with constants])
    offsets = coords[:, :, :, 1] - coords[0:1, :, :, 1]
    assert (offsets == offsets[:, :1, :1]).all()


@pytest.mark.parametrize("window", WINDOWS)
def test_sink_rule_by_brute_force(window):
    sq, sk, sink = 37, 53, 5
    for causal in (False, True):
        got = t13s.sink_visible(sq, sk, causal, window, sink)
        assert (t13s.sink_visible(sq, sk, causal, window, 0)
                == visible_mask(sq, sk, causal, window).numpy()).all()
        from utils.window import fa4_sides

        left, right = fa4_sides(causal, window)
        for i in range(sq):
            for j in range(sk):
                want = sees(i, j, sq, sk, causal, window) or (
                    left is not None and j < sink
                    and (right is None or j <= i + sk - sq + right))
                assert got[i, j] == want, (window, causal, i, j)


def test_visited_key_tiles_hold_every_visible_key():
    for window in WINDOWS:
        for sq, sk in ((300, 300), (150, 400), (333, 161)):
            for sink in (0, 3, 130):
                for causal in (False, True):
                    w, wl, wr = t13s.window_args(causal, window, 128, 128)
                    seen = t13s.sink_visible(sq, sk, causal, window, sink)
                    for m in range(-(-sq // 128)):
                        lo, hi = t13s.key_tiles(w, m, sq, sk, wl, wr, sink)
                        rows = seen[m * 128:(m + 1) * 128]
                        cols = np.nonzero(rows.any(axis=0))[0]
                        if cols.size:
                            assert lo * 128 <= cols.min() and cols.max() < hi * 128, (
                                window, sq, sk, sink, causal, m)


def test_the_references_pass_their_rules():
    t13s.check_sink_mask_rules(t13s.sink_mask)
    t13s.check_softcap_rules(t13s.softcap_scores)


def test_the_package_window_mask_misses_the_sinks():
    with pytest.raises(AssertionError, match="sink token"):
        t13s.check_sink_mask_rules(t13s.window_mask)


def test_emulation_keeps_visible_scores_exactly():
    case = t13s.MaskCase(150, 400, False, (64, 0), 3)
    values = np.random.default_rng(1).standard_normal((128, 128))
    got = t13s.emulate_mask(t13s.sink_mask, case, 0, 0, values)
    kept = ~np.isneginf(got)
    assert (got[kept] == values[kept]).all() and kept.any() and (~kept).any()


def test_scores_reference_is_the_course_reference_without_the_feature():
    from utils.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, 2, 16, generator=g) for s in (40, 70, 70))
    for causal, window in ((False, None), (True, None), (False, (9, 3)), (False, (-3, 10))):
        out, lse = t13s.scores_reference(q, k, v, causal, window)
        ref_out, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window)
        assert torch.allclose(out, ref_out) and torch.allclose(lse, ref_lse, equal_nan=True)


def test_scores_reference_caps_and_keeps_sinks():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 30, 1, 8, generator=g) * 4 for _ in range(3))
    out, lse = t13s.scores_reference(q, k, v, False, None, softcap=2.0)
    s = (q[0, :, 0].double() @ k[0, :, 0].double().T) * 8 ** -0.5
    s = torch.tanh(s / 2.0) * 2.0
    assert torch.allclose(lse[0, 0], torch.logsumexp(s, dim=-1))
    # with a window of one key and 2 sinks, a late row averages its own value and the sinks'
    out, _ = t13s.scores_reference(q, k, v, False, (0, 0), sink=2)
    s = (q[0, 20, 0].double() @ k[0, [0, 1, 20], 0].double().T) * 8 ** -0.5
    want = torch.softmax(s, dim=-1) @ v[0, [0, 1, 20], 0].double()
    assert torch.allclose(out[0, 20, 0], want)


def test_the_seam_puts_the_package_back():
    saved = (fwd_module.apply_mask, fwd_module.kv_tile_range)
    with pytest.raises(RuntimeError):
        with t13s.scores_seam(t13s.sink_mask, 4):
            assert fwd_module.apply_mask is not saved[0]
            raise RuntimeError("a compile that fails")
    assert (fwd_module.apply_mask, fwd_module.kv_tile_range) == saved


@pytest.mark.slow
def test_references_compile_to_selects_and_one_tanh():
    assert t13s._mask_sass_mistake(t13s.mask_sass_facts(t13s.sink_mask)) is None
    facts = t13s.softcap_sass_facts(t13s.softcap_scores)
    assert t13s._softcap_sass_mistake(facts) is None
    assert facts["MUFU.TANH"] == facts["elements per thread"]


@pytest.mark.slow
def test_both_references_compile_into_the_forward():
    art = t13s.compile_scores_kernel(t13s.sink_mask, 4, t13s.softcap_scores, 30.0)
    assert art.spills == 0 and not any(k.frame_bytes for k in art.kernels)
    assert art.ptx.count("tanh.approx.f32") > 0
