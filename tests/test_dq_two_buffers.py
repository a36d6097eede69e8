"""The deterministic backward with two dQ staging buffers (HopperBwdConfig.dq_buffers = 2,
Note [Two dQ buffers] in fa4_final.hopper.bwd): what the config accepts and refuses, its shared
memory, and the kernel compiled for sm_90a from fake tensors on a CPU (slow): no spill, no wgmma
serialised, the second buffer's named barriers in the SASS, the turn protocol unchanged."""

import re
from dataclasses import replace

import pytest

from fa4_final.hopper.config import SM90_SMEM_BYTES, HopperBwdConfig, hopper_bwd_default


def two_buffers(head_dim, causal, **kw):
    """The candidate a GPU visit times (fa4_final_det_db in measure.bwd_phases)."""
    return replace(hopper_bwd_default(head_dim, causal), deterministic=True, dq_buffers=2, **kw)


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, True)])
def test_two_dq_buffers_fit_where_the_default_tile_leaves_room(head_dim, causal):
    cfg = two_buffers(head_dim, causal)
    cfg.check(head_dim)
    one = replace(cfg, dq_buffers=1).smem_bytes(head_dim)
    assert cfg.smem_bytes(head_dim) == one + cfg.tile_m * head_dim * 4 <= SM90_SMEM_BYTES


def test_two_dq_buffers_at_d128_not_causal_need_the_causal_tile():
    """80 query rows a step leave no room for a second 40 KB buffer; 64 rows (the causal
    default's tile, dQ = dS K) do."""
    with pytest.raises(ValueError, match="shared memory"):
        two_buffers(128, False).check(128)
    two_buffers(128, False, tile_m=64, dq_swap_ab=False).check(128)


@pytest.mark.parametrize("bad,match", [
    ({"deterministic": False}, "deterministic=True"),
    ({"dq_early_release": True}, "dq_early_release=False"),
    ({"stages_q": 1, "stages_ds": 1}, "even"),
    ({"dq_single_wg": True}, "dq_single_wg=True"),
    ({"dq_buffers": 3}, "1 or 2"),
    ({"dq_buffers": True}, "1 or 2"),
])
def test_two_dq_buffers_refuse_what_they_are_not_built_for(bad, match):
    cfg = replace(HopperBwdConfig(tile_m=64, deterministic=True, dq_buffers=2), **bad)
    with pytest.raises(ValueError, match=match):
        cfg.check(128)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,causal,varlen", [(64, False, False), (128, True, False),
                                                    (128, False, False), (128, True, True)])
def test_two_dq_buffers_compile_clean(head_dim, causal, varlen):
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    cfg = two_buffers(head_dim, causal)
    if head_dim == 128 and not causal:
        cfg = replace(cfg, tile_m=64, dq_swap_ab=False)
    arts = compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                             varlen=varlen))
    main = arts["main"]
    main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32",
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")
    for art in arts.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    fences = main.count("WARPGROUP.ARRIVE", where="sass") - main.count("wgmma.fence.sync.aligned")
    assert fences == 0, "ptxas serialised a wgmma"
    # the second buffer's barriers (8, 9: EMPTY; 10, 11: FULL) are used, by sync and arrive
    ids = {int(i) for i in re.findall(r"bar(?:rier)?\.(?:cta\.)?(?:sync|arrive)(?:\.aligned)?\s+"
                                      r"(\d+)", main.ptx)}
    assert {4, 5, 6, 7, 8, 9, 10, 11} <= ids, sorted(ids)
    # dQ leaves the registers 16 B a store, one copy of the store code a buffer
    one = compile_artifacts(backward_recipe(head_dim, "bf16", causal,
                                            replace(cfg, dq_buffers=1), True, varlen=varlen))
    assert main.count("STS.128", where="sass") == 2 * one["main"].count("STS.128", where="sass")
    assert main.registers == one["main"].registers


# Note [Adds in flight across turns] (HopperBwdConfig.dq_adds_overlap)

@pytest.mark.parametrize("bad", [{"dq_buffers": 1}, {"dq_adds_overlap": 1}])
def test_adds_overlap_refuses_what_it_is_not_built_for(bad):
    cfg = replace(HopperBwdConfig(tile_m=64, deterministic=True, dq_buffers=2,
                                  dq_adds_overlap=True), **bad)
    with pytest.raises(ValueError, match="dq_adds_overlap"):
        cfg.check(128)


def _clean_with_the_mma_code_of(arts, other) -> None:
    """No spill in any of the build's kernels, and its main kernel has ``other``'s registers
    and its counts of wgmma, 16-byte shared stores and shared loads."""
    for art in arts.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    main = arts["main"]
    assert main.registers == other.registers
    for op in ("HGMMA", "STS.128", "LDS"):
        assert main.count(op, where="sass") == other.count(op, where="sass"), op


def _dq_warp_order(ptx: str) -> list[str]:
    """The dQ warp's protocol instructions in PTX order (turn loads, bulk adds, completion waits,
    fences, turn passes)."""
    pattern = (r"ld\.acquire\.gpu|cp\.reduce\.async\.bulk|cp\.async\.bulk\.wait_group(?:\.read)?"
               r"\s+\d+|fence\.acq_rel\.gpu|red\.release\.gpu")
    return [re.sub(r"\s+", " ", t) for t in re.findall(pattern, ptx)]


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,causal,varlen", [(64, False, False), (128, True, False),
                                                    (128, True, True)])
def test_adds_overlap_compiles_clean_with_a_dq_warp_per_buffer(head_dim, causal, varlen):
    """No spill (the dQ warps run on the producer's 24 registers), the MMA warpgroups' code the
    one-warp build's, and the one-warp cycle twice, once per dQ warp: wait for the turn, the
    step's two bulk adds, a wait for all of this warp's adds (wait_group 0), a fence, the turn
    passed. No warp waits for a later step before passing a turn (no wait_group > 0)."""
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    cfg = two_buffers(head_dim, causal, dq_adds_overlap=True)
    arts = compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                             varlen=varlen))
    one_warp = compile_artifacts(backward_recipe(head_dim, "bf16", causal,
                                                 replace(cfg, dq_adds_overlap=False), True,
                                                 varlen=varlen))["main"]
    main = arts["main"]
    _clean_with_the_mma_code_of(arts, one_warp)
    cycle = ["ld.acquire.gpu", "ld.acquire.gpu", "cp.reduce.async.bulk",
             "cp.reduce.async.bulk", "cp.async.bulk.wait_group 0", "fence.acq_rel.gpu",
             "red.release.gpu"]
    one = _dq_warp_order(one_warp.ptx)
    two = _dq_warp_order(main.ptx)
    assert one[:len(cycle)] == cycle, one
    assert two[:2 * len(cycle)] == 2 * cycle, two
    assert not any(re.fullmatch(r"cp\.async\.bulk\.wait_group [1-9]\d*", t) for t in two), two


# dq_copies with two buffers and a dQ warp each (Note [dQ copies] in fa4_final.common.bwd_tiles)

def _turn_protocol(ptx: str) -> dict:
    return {op: ptx.count(op) for op in ("ld.acquire.gpu", "red.release.gpu",
                                         "cp.reduce.async.bulk", "fence.acq_rel.gpu")}


@pytest.mark.slow
@pytest.mark.parametrize("head_dim,causal,varlen", [(64, False, False), (128, False, False),
                                                    (128, True, True)])
def test_copies_with_two_buffers_compile_clean(head_dim, causal, varlen):
    """Four copies with first stores on the overlapped two-buffer kernel: accepted, no spill,
    the same registers and MMA code as one copy, the turn protocol's instructions the same in
    number; each dQ warp's first add can be a plain bulk store (a turn-0 visitor of its copy),
    and the copy's slab and counter come from the key tile (n mod 4: an and, no division)."""
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts as compile_artifacts

    base = two_buffers(head_dim, causal, dq_adds_overlap=True)
    if head_dim == 128 and not causal:
        base = replace(base, tile_m=64, dq_swap_ab=False)
    cfg = replace(base, dq_copies=4, dq_first_store=True)
    cfg.check(head_dim)
    arts = compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                             varlen=varlen))
    one = compile_artifacts(backward_recipe(head_dim, "bf16", causal, base, True,
                                            varlen=varlen))["main"]
    main = arts["main"]
    _clean_with_the_mma_code_of(arts, one)
    assert _turn_protocol(main.ptx) == _turn_protocol(one.ptx)
    stores = re.findall(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group(?!\.)", main.ptx)
    assert len(stores) >= 2, "no plain bulk store for a copy's first visitor"
    def divisions(art):
        return len(re.findall(r"\b(?:div|rem)\.(?:s|u)32", art.ptx))
    assert divisions(main) == divisions(one), "a division in the copy's index"
