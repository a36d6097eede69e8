"""How many splits a decode call runs (fa4_final.runtime.decode.choose_num_splits): FA4's meaning
of ``num_splits`` (< 1 the heuristic, 1 none, n > 1 that many, capped by the key tiles), and
the heuristic of Note [Split count] on the issue's decode shapes: never more splits than the
SMs need, every split long enough for its partial and none empty."""

import numpy as np
import pytest

from fa4_final.common.combine import MAX_SPLITS
from fa4_final.runtime.decode import (
    check_num_splits,
    choose_num_splits,
    min_tiles_per_split,
    split_ranges,
)

H200_SMS = 132


def heuristic(batch, heads_kv, packed_rows, key_tiles, sms=H200_SMS, **tiles):
    return choose_num_splits(0, batch=batch, heads_kv=heads_kv, packed_rows=packed_rows,
                             key_tiles=key_tiles, num_sms=sms, **tiles)


@pytest.mark.parametrize("value", [True, False, 2.0, 0.5, "4", None, [2]])
def test_num_splits_must_be_an_int(value):
    with pytest.raises(TypeError, match=r"num_splits must be an int \(< 1: chosen by a "
                                        r"heuristic, 1: no split, n > 1: n splits\), got "):
        check_num_splits(value)


def test_num_splits_message_names_the_value():
    with pytest.raises(TypeError, match=r"got True \(bool\)"):
        check_num_splits(True)
    with pytest.raises(TypeError, match=r"got 2.0 \(float\)"):
        check_num_splits(2.0)


@pytest.mark.parametrize("value", [-3, 0, 1, 7, np.int64(5), np.int32(1)])
def test_every_int_is_accepted(value):
    assert check_num_splits(value) == int(value) and type(check_num_splits(value)) is int


def test_explicit_counts_as_fa4_reads_them():
    shape = dict(batch=1, heads_kv=8, packed_rows=4, num_sms=H200_SMS)
    assert choose_num_splits(1, key_tiles=64, **shape) == 1  # 1: no split, whatever the shape
    assert choose_num_splits(5, key_tiles=64, **shape) == 5  # n > 1: n
    assert choose_num_splits(5, key_tiles=3, **shape) == 3  # capped by the key tiles
    assert choose_num_splits(500, key_tiles=4096, **shape) == MAX_SPLITS  # and by the combine
    assert choose_num_splits(7, key_tiles=0, **shape) == 1  # no key: one (empty) split
    for below_one in (0, -1, -100):  # the heuristic
        assert choose_num_splits(below_one, key_tiles=64, **shape) == heuristic(1, 8, 4, 64)


@pytest.mark.parametrize("name, value", [("batch", -1), ("key_tiles", 2.5), ("num_sms", 0),
                                         ("tile_n", 0), ("packed_rows", True)])
def test_shape_arguments_checked(name, value):
    args = dict(batch=1, heads_kv=8, packed_rows=4, key_tiles=64, num_sms=H200_SMS)
    args[name] = value
    with pytest.raises(ValueError, match=name):
        choose_num_splits(0, **args)


def test_enough_ctas_means_no_split():
    # batch 32 x 8 kv heads = 256 CTAs for 132 SMs: every SM has work
    assert heuristic(32, 8, 4, 64) == 1
    assert heuristic(128, 8, 16 * 8, 1024) == 1
    assert heuristic(1, 132, 4, 1024) == 1


def test_few_ctas_split_to_fill_the_sms():
    # batch 1, 8 kv heads, GQA 32/8, one token: 8 CTAs; 8k keys = 64 tiles of 128
    assert heuristic(1, 8, 4, 64) == 16  # floor(132 / 8) = 16 over 64 tiles: 4 each
    assert heuristic(1, 8, 4, 1024) == 16  # 128k keys: 16 splits of 64 tiles, 128 CTAs
    # 16 tokens of GQA 64/8 = 128 packed rows: 2 CTAs of 64 rows per kv head
    assert heuristic(1, 8, 128, 1024) == 8  # 16 CTAs: floor(132 / 16) = 8 splits


def test_short_caches_are_not_cut_thin():
    # 1k keys = 8 tiles: at most 8 // 2 splits for one-token rows
    assert heuristic(1, 8, 4, 8) == 4
    # 64 packed rows write a 64-row partial per split: at least 4 tiles per split
    assert min_tiles_per_split(64, 64, 128) == 4
    assert heuristic(1, 8, 64, 8) == 2
    assert heuristic(1, 1, 1, 1) == 1 and heuristic(1, 1, 1, 3) == 1


GRID = [(b, hk, rows, tiles) for b in (1, 2, 32, 128) for hk in (1, 8) for rows in (1, 4, 32, 128)
        for tiles in (1, 2, 5, 8, 64, 256, 1024)]


@pytest.mark.parametrize("sms", [132, 148, 16])
def test_heuristic_invariants(sms):
    for b, hk, rows, tiles in GRID:
        n = heuristic(b, hk, rows, tiles, sms)
        ctas = b * hk * -(-rows // 64)
        assert 1 <= n <= min(MAX_SPLITS, max(tiles, 1))
        if n > 1:
            assert ctas < sms  # only to fill SMs
            assert ctas * n <= sms  # every CTA finds an SM at once: no SM gets two
            ranges = split_ranges(tiles, n)
            lengths = [hi - lo for lo, hi in ranges]
            assert min(lengths) >= 1, (b, hk, rows, tiles, ranges)  # no empty split
            assert max(lengths) >= min_tiles_per_split(rows, 64, 128)
            assert max(lengths) - min(lengths) < max(lengths)  # evened
        if ctas < sms and tiles >= 2 * min_tiles_per_split(rows, 64, 128) * -(-sms // ctas):
            # long caches: nearly every SM gets a CTA. Evening to t = ceil(T / target) tiles per
            # split keeps n = ceil(T / t) > target T / (T + target) >= 0.8 target at T >= 4 target
            assert ctas * n >= 0.8 * sms or n == MAX_SPLITS, (b, hk, rows, tiles, n)


def test_more_work_never_more_splits():
    for hk in (1, 8):
        for rows in (1, 4, 128):
            counts = [heuristic(b, hk, rows, 1024) for b in (1, 2, 4, 8, 16, 32, 64)]
            assert counts == sorted(counts, reverse=True), counts


def test_issue_decode_grid_counts():
    """The counts the decode benchmark's shapes get (batch 1, 32, 128; 1, 4, 16 tokens; GQA
    32/8 and 64/8; 1k-128k keys at tile_n 128): splits only at batch 1, and then to one CTA per
    SM at most."""
    for batch in (1, 32, 128):
        for tokens in (1, 4, 16):
            for group in (4, 8):
                for keys in (1024, 8192, 32768, 131072):
                    n = heuristic(batch, 8, tokens * group, keys // 128)
                    if batch > 1:
                        assert n == 1
                    else:
                        ctas = 8 * -(-tokens * group // 64)
                        assert 1 < n <= H200_SMS // ctas
