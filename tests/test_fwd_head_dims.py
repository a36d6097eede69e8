"""The Hopper forward at head dims 96, 192 and 256 and with dv != D (Note [Head dims] in
fa4_final.hopper.config), checked with no GPU.

Fast: every (D, dv) of FWD_HEAD_DIMS gets a default config whose shared storage fits 227 KB
and whose check passes; the defaults at D = dv = 64 and 128 are the timed ones, unchanged;
bad knobs are refused by name. O over Q (separate_o=False): the tile layouts of O and Q,
built by the kernel's own smem_tile_layout for sm_90a on this CPU, put O's element (r, c) at
Q's (r, c) for every (D, dv) the check allows, so a warpgroup's O rows overwrite only its own
Q rows; for dv = 96 they do not, and the check refuses it.
Slow: the default builds compiled for sm_90a: no spill, no stack, no wgmma serialised by ptxas,
the consumers' setmaxnreg 240; and the fact Note [Pairwise conversion] rests on (at tile_n 80
the vector conversion makes ptxas inject warpgroup.arrive, the pairwise one does not), so the
Note cannot drift from the compiler; the stored compile table agrees with both Notes.
Nothing here runs on a GPU: tests/gpu/test_fwd_head_dims.py does.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from fa4_final.common.constants import FWD_HEAD_DIMS, SM90_SMEM_BYTES
from fa4_final.hopper.config import (
    FWD_TILE_NS,
    MEASURED_THREE_WG,
    MEASURED_TILE_N,
    HopperFwdConfig,
    hopper_fwd_default,
)

PAIRS = [(d, dv) for d in FWD_HEAD_DIMS for dv in FWD_HEAD_DIMS]


@pytest.mark.parametrize("d, dv", PAIRS, ids=str)
def test_every_head_dim_pair_has_a_default_that_fits(d, dv):
    for causal in (False, True):
        for varlen in (False, True):
            cfg = hopper_fwd_default(d, causal, varlen, dv)
            cfg.check(d, dv)
            assert cfg.smem_bytes(d, head_dim_v=dv) <= SM90_SMEM_BYTES
            # compile-only defaults take 64 or 128 keys; the timed pairs FA4's tile (Note
            # [Head dims]), converted pair by pair (Note [Pairwise conversion])
            timed = None if varlen else MEASURED_TILE_N.get((d, dv))
            three = None if varlen else MEASURED_THREE_WG.get((d, dv))
            if three is not None:
                timed = three[0]
                assert (cfg.num_consumer_wgs, cfg.stages_k, cfg.stages_v) == (3, *three[1:])
            assert cfg.tile_n == (timed or cfg.tile_n)
            assert cfg.tile_n in (64, 128) or timed
            assert cfg.separate_o or (dv <= d and d % 64 == 0 and dv % 64 == 0)


def test_timed_defaults_are_unchanged():
    """D = dv = 64 and 128 are the measured defaults (fa4_final.hopper.defaults): the new knobs
    keep their old values there."""
    for d in (64, 128):
        for causal in (False, True):
            for varlen in (False, True):
                cfg = hopper_fwd_default(d, causal, varlen)
                assert cfg == hopper_fwd_default(d, causal, varlen, d)
                assert (cfg.tile_n, cfg.separate_o) == (128, True)
                assert cfg.num_consumer_wgs == (3 if d == 64 else 2)
                assert (cfg.stages_k, cfg.stages_v) == (
                    (2, 2) if d == 64 and causal and not varlen else (3, 3) if d == 64
                    else (3, 2))


def test_large_head_dims_need_the_new_knobs():
    """At D = dv = 256 the D = 128 layout (O's own buffer, 128 keys a stage) cannot fit."""
    old = hopper_fwd_default(128)
    with pytest.raises(ValueError, match="shared memory"):
        old.check(256, 256)
    cfg = hopper_fwd_default(256, head_dim_v=256)
    assert not cfg.separate_o and cfg.tile_n == 80
    assert hopper_fwd_default(192, head_dim_v=128).tile_n == 128  # the FA4 package's tile


@pytest.mark.parametrize("knobs, head_dims, words", [
    ({}, (80, 80), "head_dim must be one of"),
    ({}, (128, 48), "head_dim_v must be one of"),
    ({"tile_n": 100}, (128, 128), "tile_n must be one of"),
    ({"tile_n": True}, (128, 128), "tile_n must be one of"),
    ({"separate_o": False}, (128, 256), "dv <= D"),
    ({"separate_o": False}, (192, 96), "multiples of 64"),
    ({"stages_k": 3, "stages_v": 3}, (256, 256), "separate_o=False"),
])
def test_bad_knobs_are_refused_by_name(knobs, head_dims, words):
    cfg = replace(HopperFwdConfig(), **knobs)
    with pytest.raises(ValueError, match=re.escape(words)):
        cfg.check(*head_dims)


def test_smem_bytes_counts_o_only_with_its_own_buffer():
    cfg = HopperFwdConfig(tile_n=64, stages_k=3, stages_v=2)
    tile_o = cfg.tile_m * 128 * 2
    assert cfg.smem_bytes(192, head_dim_v=128) - \
        replace(cfg, separate_o=False).smem_bytes(192, head_dim_v=128) == tile_o
    assert FWD_TILE_NS[-1] == 128 and all(t % 16 == 0 for t in FWD_TILE_NS)


# ----------------------------------------------------------------------------------------------
# O over Q: the two tile layouts, built on this CPU


def _layouts(d, dv):
    import cutlass
    import cutlass.cute as cute

    from fa4_final.hopper.wgmma import smem_tile_layout

    got = {}

    @cute.jit
    def probe():
        for name, cols in (("q", d), ("o", dv)):
            lay = smem_tile_layout(cutlass.BFloat16, cols, 128)
            got[name] = (str(lay.inner), lay.outer.shape, lay.outer.stride)

    cute.compile(probe)
    return got["q"], got["o"]


def _o_sits_on_q(q, o) -> bool:
    """O's (r, c) offset equals Q's for every (r, c) of O: the same swizzle, the same row
    modes, and O's column blocks a prefix of Q's with the same strides."""
    (q_sw, (q_rows, q_cols), (q_rs, q_cs)), (o_sw, (o_rows, o_cols), (o_rs, o_cs)) = q, o
    one_block = o_cols[1] == 1  # a mode of extent 1 has no stride of its own
    return (q_sw == o_sw and q_rows == o_rows and q_rs == o_rs and q_cols[0] == o_cols[0]
            and q_cs[0] == o_cs[0] and (one_block or q_cs[1] == o_cs[1])
            and o_cols[1] <= q_cols[1])


@pytest.mark.parametrize("d, dv", [(192, 128), (256, 256), (256, 192), (128, 64), (256, 64)],
                         ids=str)
def test_o_over_q_writes_each_row_onto_its_own_q_row(d, dv):
    HopperFwdConfig(separate_o=False, tile_n=64, stages_k=2, stages_v=2).check(d, dv)
    q, o = _layouts(d, dv)
    assert _o_sits_on_q(q, o), (q, o)


def test_o_over_q_is_refused_where_the_layouts_differ():
    q, o = _layouts(192, 96)  # dv = 96: a 64 B swizzle atom of 32 columns
    assert not _o_sits_on_q(q, o), (q, o)
    with pytest.raises(ValueError, match="multiples of 64"):
        HopperFwdConfig(separate_o=False).check(192, 96)


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a

BUILDS = [(96, 96, False), (96, 96, True), (192, 128, False), (192, 128, True),
          (192, 192, True), (256, 256, False), (256, 256, True), (128, 64, False),
          (256, 128, True)]


def _serialised(art) -> int:
    """warpgroup.arrive instructions ptxas added beyond the source's wgmma fences."""
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


def _build(d, dv, causal, **kw):
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import artifacts

    return artifacts(forward_recipe(d, "bf16", causal, head_dim_v=dv, **kw))["main"]


@pytest.mark.slow
@pytest.mark.parametrize("d, dv, causal", BUILDS, ids=str)
def test_default_builds_compile_clean(d, dv, causal):
    art = _build(d, dv, causal)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert _serialised(art) == 0, art.resources()
    _, consumer = hopper_fwd_default(d, causal, head_dim_v=dv).registers
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{consumer};", art.ptx)
    # S = Q K^T at N = tile_n, P V at N = dv: the wgmma shapes of the config
    cfg = hopper_fwd_default(d, causal, head_dim_v=dv)
    assert f"m64n{cfg.tile_n}k16" in art.ptx and f"m64n{dv}k16" in art.ptx


@pytest.mark.slow
@pytest.mark.parametrize("d, dv", [(192, 128), (96, 96), (192, 192)], ids=str)
def test_varlen_build_compiles_clean(d, dv):
    """The varlen epilogue's predicated row store (common.seqlens.store_rows) at O widths of 12
    and 24 threads a row (dv = 96, 192), whose rows per pass do not divide the tile evenly
    (rows_per_store_pass); this build failed to trace before that rule."""
    art = _build(d, dv, True, varlen=True, has_seqused_k=True)
    assert art.spills == 0 and _serialised(art) == 0, art.resources()


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_the_three_warpgroup_d96_candidate_compiles_clean(causal):
    """measure.features' fa4_final_3wg row (D = dv = 96, three consumer warpgroups of 160
    registers, 96 keys in three K stages): no spill, no stack, no wgmma serialised, so a timed
    run compares tiles, not a spilling build."""
    from measure import features

    cfg = features.three_wg_config(features.FeatureShape("d96", 1, 4096, 16, causal))
    assert (cfg.num_consumer_wgs, cfg.tile_n, cfg.stages_k) == (3, 96, 3)
    art = _build(96, 96, causal, config=cfg)
    assert art.spills == 0 and art.frame_bytes == 0 and _serialised(art) == 0, art.resources()


@pytest.mark.parametrize("rows, threads, per_row, want", [
    (128, 256, 8, 32), (128, 256, 16, 16), (128, 256, 32, 8), (128, 256, 12, 16),
    (128, 256, 24, 8), (192, 384, 16, 24), (128, 384, 16, 16)])
def test_rows_per_store_pass_divides_the_tile(rows, threads, per_row, want):
    from fa4_final.common.seqlens import rows_per_store_pass

    n = rows_per_store_pass(rows, threads, per_row)
    assert n == want and rows % n == 0 and n * per_row <= threads


@pytest.mark.slow
def test_pairwise_conversion_is_what_keeps_tile_n_80_clean():
    """Note [Pairwise conversion]: at tile_n 80 the kernel's P conversion compiles with no
    injected warpgroup.arrive, and the same kernel converting P as one vector gets some."""
    from measure.fwd_head_dims_compiled import our_metrics

    cfg = replace(hopper_fwd_default(128), tile_n=80)
    assert our_metrics(128, 128, False, cfg)["injected arrives"] == 0
    assert our_metrics(128, 128, False, cfg, vector_p=True)["injected arrives"] > 0


def test_stored_compile_table_says_what_the_notes_say():
    """results/compile/hopper_fwd_head_dims.json (measure.fwd_head_dims_compiled): every build
    of ours compiles with no spill and nothing injected; converting P as one vector injects
    arrives exactly at the tile_n that are no multiple of 64; the FA4 package's builds at the
    same shapes inject none either."""
    from measure.fwd_head_dims_compiled import load_table

    rows = load_table().rows
    injected = {(r["impl"], r["group"], r["config"]): r["value"] for r in rows
                if r["metric"] == "injected arrives"}
    spills = [r for r in rows if r["metric"] == "spill instructions" and r["value"]]
    assert not spills, spills
    for (impl, group, config), value in injected.items():
        if group == "tile_n, P as one vector":
            tile_n = int(config.rsplit(" ", 1)[1])
            assert (value > 0) == (tile_n % 64 != 0), (config, value)
        else:
            assert value == 0, (impl, group, config, value)
    assert any(k[0] == "fa4_package" for k in injected)


def test_d96_takes_three_warpgroups_where_the_stored_run_says():
    """Note [Head dims]: at D = dv = 96 (dense) three consumer warpgroups of 96 keys were
    1.02-1.17x two of 128 keys at all eight shapes x modes of results/h100/features_d96.json,
    beyond the spread at three; the default is what the stored run timed as fa4_final_3wg."""
    from measure import features
    from utils import bench, results

    res = results.load("features_d96", gpu="h100")
    cmps = [bench.compare(rows["fa4_final_3wg"], rows["fa4_final"])
            for s in (4096, 16384) for c in (False, True) for mode in ("flush", "back_to_back")
            for rows in [features.shape_rows(res, "d96", s, c, mode)]]
    assert all(1.015 <= x.ratio < 1.175 for x in cmps)
    assert sum(x.verdict == "faster" for x in cmps) == 3
    for causal in (False, True):
        want = features.three_wg_config(features.FeatureShape("d96", 4, 4096, 16, causal))
        got = hopper_fwd_default(96, causal, head_dim_v=96)
        assert got == want
        assert (got.num_consumer_wgs, got.tile_n, got.stages_k, got.stages_v) == (3, 96, 3, 2)
        assert hopper_fwd_default(96, causal, True, 96).num_consumer_wgs == 2  # varlen: untimed
