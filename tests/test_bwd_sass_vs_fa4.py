"""The stored side-by-side of the Hopper backwards (results/compile/hopper_bwd_vs_fa4.json, made by
measure.bwd_sass_vs_fa4): its provenance and shape without a compile; our side regenerated from
the compiled kernels (slow); FA4's side for one configuration when its source is on this machine
(slow, skipped without /tmp/fa4src). No GPU anywhere."""

from pathlib import Path

import pytest

from measure import bwd_sass_vs_fa4 as cmp

FA4_SRC = Path("/tmp/fa4src/x/flash_attn/cute/flash_bwd_sm90.py")
NAMES = [cmp.config_name(*c) for c in cmp.CONFIGS]
VOLATILE = {"compile seconds"}  # depends on the machine and the cache, not the code


@pytest.fixture(scope="module")
def table():
    return cmp.load_table()


def _side(table, impl, config):
    return {r["metric"]: r["value"] for r in table.rows
            if r["impl"] == impl and r["config"] == config and r["metric"] not in VOLATILE}


def test_provenance_says_compile_only(table):
    prov = table.provenance
    assert prov["gpu"].startswith("none: compile-only for sm_90a")
    assert prov["fa4_version"] == "4.0.0b36"
    assert prov["cutlass_dsl"] and prov["commit"]


@pytest.mark.parametrize("config", NAMES)
def test_both_sides_stored(table, config):
    for impl in ("fa4_final", "fa4"):
        side = _side(table, impl, config)
        assert side.get("step: HGMMA", 0) > 0, (impl, config)
        assert side.get("step: MUFU.EX2", 0) > 0, (impl, config)
        assert side["spill instructions"] == 0, (impl, config)
        assert side["shared memory bytes"] <= 227 * 1024, (impl, config)


@pytest.mark.parametrize("d,causal,det", cmp.CONFIGS)
def test_our_declared_structure_matches_the_table(table, d, causal, det):
    """Tiles, stages, shared memory and dQ's path: data of the config, no compile."""
    side = _side(table, "fa4_final", cmp.config_name(d, causal, det))
    for metric, value in cmp.our_structure(d, causal, det).items():
        assert side[metric] == value, metric


def test_the_step_holds_one_query_tile_of_exponentials(table):
    """Per MMA warpgroup thread a step takes tile_m * 64 / 128 exponentials (P's share of the
    warpgroup's 64 keys): the loop found is the step, not a prologue."""
    for config in NAMES:
        for impl in ("fa4_final", "fa4"):
            side = _side(table, impl, config)
            tile_m = int(side["tile (m x n)"].split("x")[0])
            assert side["step: MUFU.EX2"] == tile_m * 64 // 128, (impl, config)


@pytest.mark.slow
@pytest.mark.parametrize("d,causal,det", cmp.CONFIGS)
def test_our_side_regenerates(table, d, causal, det):
    config = cmp.config_name(d, causal, det)
    fresh = {r["metric"]: r["value"] for r in cmp.flatten("fa4_final", config,
                                                          cmp.our_metrics(d, causal, det))
             if r["metric"] not in VOLATILE}
    stored = _side(table, "fa4_final", config)
    diff = {m: (stored.get(m), v) for m, v in fresh.items() if stored.get(m) != v}
    assert not diff, (f"{config}: our compiled backward no longer matches the stored table; "
                      f"rerun `python -m measure.bwd_sass_vs_fa4 --write --ours`: {diff}")


@pytest.mark.slow
@pytest.mark.skipif(not FA4_SRC.exists(), reason="FA4's source is not unpacked at /tmp/fa4src")
def test_fa4_side_regenerates(table):
    config = cmp.config_name(128, False, False)
    fresh = {r["metric"]: r["value"] for r in cmp.flatten("fa4", config,
                                                          cmp.fa4_metrics(128, False, False))
             if r["metric"] not in VOLATILE}
    stored = _side(table, "fa4", config)
    diff = {m: (stored.get(m), v) for m, v in fresh.items() if stored.get(m) != v}
    assert not diff, diff
