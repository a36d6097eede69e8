"""fa4_final's Hopper forward compiled for sm_90a with fake tensors, on a CPU: the instructions
it must contain, and resources (no spills, no wgmma serialised by ptxas)."""

import re
from dataclasses import fields, replace

import pytest

from fa4_final.api.interface import compile_only
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.config import SCHEDULES, HopperFwdConfig, hopper_fwd_default

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(head_dim=128, causal=False, dtype="bf16", **kw):
        key = (head_dim, causal, dtype, tuple(sorted(kw.items())))
        if key not in cache:
            window = {k: kw.pop(k) for k in ("has_window_left", "has_window_right") if k in kw}
            cfg = replace(hopper_fwd_default(head_dim, causal), **kw) if kw else None
            cache[key] = compile_only("sm_90a", head_dim, dtype, causal, cfg, **window)
        return cache[key]

    return get


def wgmma_serialised(art) -> int:
    """Fences ptxas added on its own (C7512: wgmma serialised for lack of registers): each
    WARPGROUP.ARRIVE in the SASS beyond the source's wgmma.fence splits a GEMM into pieces."""
    return art.count("WARPGROUP.ARRIVE", where="sass") - art.count("wgmma.fence.sync.aligned")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_default_forward_has_the_hopper_instructions(artifacts, head_dim, causal):
    art = artifacts(head_dim, causal)
    art.require("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc",
                "setmaxnreg.dec", "mbarrier.try_wait", "bar.arrive", "bar.sync")
    art.require("HGMMA", "UTMALDG", "UTMASTG", "STSM", "MUFU.EX2", where="sass")
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert wgmma_serialised(art) == 0


@pytest.mark.parametrize("knobs", [
    dict(pingpong=False), dict(schedule="grid"), dict(schedule="zigzag"),
    dict(schedule="table"), dict(schedule="dynamic", l2_sections=True),
    dict(intra_wg_overlap=False), dict(exp2_emulation_fraction=0.25),
    dict(rescale_threshold=8.0), dict(has_window_left=True),
    dict(has_window_right=True, has_window_left=True), dict(stages_k=2, stages_v=3),
    dict(pin_lane=True), dict(rescale_skip_unchanged=True),
])
def test_every_knob_compiles_clean(artifacts, knobs):
    art = artifacts(128, False, **dict(knobs))
    assert art.spills == 0, art.resources()
    assert wgmma_serialised(art) == 0


def test_fp16_and_three_warpgroups(artifacts):
    art = artifacts(64, True, "fp16")
    assert art.spills == 0 and wgmma_serialised(art) == 0
    # 3 consumer warpgroups: 160 registers each, 32 for the producer (4 x 128 x 160 <= 64 K)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+160;", art.ptx)
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+32;", art.ptx)


def test_knobs_show_in_the_code(artifacts):
    assert artifacts(128, False, rescale_threshold=8.0).count("vote.sync.any", "ptx") >= 1
    assert artifacts(128, False).count("vote.sync.any", "ptx") == 0
    assert artifacts(128, False, pingpong=False).count("bar.arrive") == 0
    emulated = artifacts(128, False, exp2_emulation_fraction=0.25)
    assert emulated.count("add.rm.f32") > 0 and artifacts(128, False).count("add.rm.f32") == 0


def test_the_d64_defaults_skip_the_rescale_by_a_vote(artifacts):
    """D = 64 (dense) skips O's multiply where no row moved (tau = 0), its causal kernel has two
    K/V stages; varlen and D = 128 keep the always-rescale step (hopper.config.
    hopper_fwd_default)."""
    for causal in (False, True):
        d64 = hopper_fwd_default(64, causal)
        assert (d64.rescale_threshold, d64.rescale_skip_unchanged) == (0.0, True)
        for other in (hopper_fwd_default(64, causal, varlen=True), hopper_fwd_default(128, causal)):
            assert (other.rescale_threshold, other.rescale_skip_unchanged) == (0.0, False)
    assert (hopper_fwd_default(64, True).stages_k, hopper_fwd_default(64, True).stages_v) == (2, 2)
    art = artifacts(64, True)
    assert art.count("vote.sync.any", "ptx") >= 1 and art.spills == 0
    assert wgmma_serialised(art) == 0


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="shared memory"):
        HopperFwdConfig(stages_k=4, stages_v=4).check(128)
    with pytest.raises(ValueError, match="num_consumer_wgs"):
        HopperFwdConfig(num_consumer_wgs=4).check(128)
    with pytest.raises(ValueError, match="schedule"):
        HopperFwdConfig(schedule="later").check(128)
    with pytest.raises(ValueError, match="head_dim"):
        HopperFwdConfig().check(80)  # FWD_HEAD_DIMS: 64, 96, 128, 192, 256
    with pytest.raises(ValueError, match="rescale_threshold"):
        HopperFwdConfig(rescale_threshold=16.0).check(128)
    with pytest.raises(ValueError, match="pingpong"):
        HopperFwdConfig(num_consumer_wgs=1).check(128)
    with pytest.raises(UnsupportedError, match="sm_90a"):
        compile_only("sm_80")
    from fa4_final.hopper.host import forward_recipe

    with pytest.raises(UnsupportedError, match="compiles for arch='sm_90a' only"):
        forward_recipe(arch="sm_100a")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_tile_table_is_read_not_computed(artifacts, head_dim):
    """Note [Tile table]: with a table the tile loop reads its tiles from global memory (the
    producer and consumers each: two more global loads a round, one of them the next round's)
    instead of the zigzag arithmetic; clean, and the rest of the kernel unchanged."""
    assert hopper_fwd_default(head_dim, False).uses_table
    assert not hopper_fwd_default(head_dim, True, varlen=True).uses_table
    plain = artifacts(head_dim, True, schedule="zigzag")
    table = artifacts(head_dim, True, schedule="table")
    assert table.spills == 0 and wgmma_serialised(table) == 0, table.resources()
    assert table.count("ld.global") > plain.count("ld.global")
    assert table.count("HGMMA", "sass") == plain.count("HGMMA", "sass")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dynamic_tiles_take_their_tiles_from_one_atomic(artifacts, head_dim):
    """Note [Dynamic tiles]: the dynamic build reads no table; its one global atomic is the
    producer's fetch, the tile ring adds mbarrier arrives and waits, and the GPU work (the
    wgmma) and the registers stay those of the table's build, with no spills."""
    assert hopper_fwd_default(head_dim, True).schedules_dynamically  # the causal default
    assert hopper_fwd_default(head_dim, True, varlen=True).schedules_dynamically  # and varlen's
    table = artifacts(head_dim, True, schedule="table")
    dynamic = artifacts(head_dim, True)
    assert dynamic.spills == 0 and wgmma_serialised(dynamic) == 0, dynamic.resources()
    assert dynamic.count("atom.global.add") == 1 and table.count("atom.global.add") == 0
    assert dynamic.count("ld.global") == 0 < table.count("ld.global")
    assert dynamic.count("mbarrier.arrive") > table.count("mbarrier.arrive")
    assert dynamic.count("HGMMA", "sass") == table.count("HGMMA", "sass")
    assert dynamic.registers == table.registers


def test_the_schedule_is_one_choice():
    """Each schedule is one behaviour: what the kernel and the host derive from it."""
    derived = {s: (c.persistent, c.uses_table, c.splits_tail, c.schedules_dynamically)
               for s in SCHEDULES for c in [HopperFwdConfig(schedule=s)]}
    assert derived == {"grid": (False, False, False, False),
                       "zigzag": (True, False, False, False),
                       "table": (True, True, False, False),
                       "split_tail": (True, True, True, False),
                       "dynamic": (True, False, False, True)}


def test_the_forward_config_has_at_most_14_knobs():
    assert len(fields(HopperFwdConfig)) <= 14, [f.name for f in fields(HopperFwdConfig)]


def test_a_varlen_kernel_refuses_a_table():
    from fa4_final.hopper.host import forward_recipe

    with pytest.raises(ValueError, match="schedule='table'"):
        forward_recipe(128, "bf16", True, HopperFwdConfig(schedule="table"), varlen=True)


def test_sm90_comparison_finds_the_kv_step(artifacts):
    """solutions.ch08_compare reads the steady KV step out of the SASS: one loop, the S and
    P V GEMMs (D/16 + tile_n/16 HGMMA), a MUFU.EX2 per score of the thread's two rows plus the
    two alphas, the turn's bar.sync / bar.arrive, the two waits; and the stored table holds
    FA4's side for every configuration."""
    from solutions import ch08_compare

    loops = ch08_compare.kv_loops(artifacts(128, False).sass)
    assert len(loops) == 1
    step = ch08_compare.step_metrics(loops[0])["counts"]
    assert step["HGMMA"] == 128 // 16 + 128 // 16 and step["MUFU.EX2"] == 64 + 2
    assert step["BAR.SYNC"] == step["BAR.ARV"] == 1 and step["WARPGROUP.DEPBAR"] == 2
    table = ch08_compare.load_table()
    for d, causal in ch08_compare.CONFIGS:
        name = ch08_compare.config_name(d, causal)
        for impl in ("fa4", "fa4_final"):
            assert table.where(impl=impl, config=name, metric="steady step: instructions")


def test_d64_causal_default_reads_the_lane_once(artifacts):
    """Note [Signalling lane]: the default D = 64 causal build keeps the thread index out of its
    KV loops; without pin_lane LLVM reads it (S2R) again in the loops."""
    from solutions.ch08_compare import thread_index_reads

    assert hopper_fwd_default(64, True).pin_lane
    assert thread_index_reads(artifacts(64, True).sass) == 0
    assert thread_index_reads(artifacts(64, True, pin_lane=False).sass) > 0


def test_skip_unchanged_keeps_the_vote_off_the_exponentials(artifacts):
    """Note [Warp vote]: with tau = 8 alone the steady step's maxima are selected by the vote
    before its first exponential; with rescale_skip_unchanged (tau = 0 or 8) nothing before the
    first exponential reads the vote's predicate (the vote only gates O)."""
    from solutions.ch08_compare import exponentials_wait_for_vote

    assert exponentials_wait_for_vote(artifacts(64, False, rescale_threshold=8.0,
                                                rescale_skip_unchanged=False).sass)
    for tau in (0.0, 8.0):
        skip = artifacts(64, False, rescale_threshold=tau, rescale_skip_unchanged=True)
        assert not exponentials_wait_for_vote(skip.sass), tau
        assert skip.spills == 0


def test_o_multiply_sits_where_the_notebook_says(artifacts):
    """Notebook 08, "The vote on the path": in the plain D = 128 step ptxas spreads O's 64
    multiplies over the turn and S's issue; behind the skip's branch (the D = 64 default) O's 32
    sit in one block between S's issue and P V's."""
    from solutions.ch08_compare import o_multiply_placement

    plain = o_multiply_placement(artifacts(128, False).sass)
    assert plain["between S's and P V's issue"] == 0
    assert plain["before the turn"] + plain["with S's issue"] == 64
    assert hopper_fwd_default(64).rescale_skip_unchanged
    skip = o_multiply_placement(artifacts(64, False).sass)
    assert skip["between S's and P V's issue"] == 32 and skip["first GEMM's HGMMA"] == 64 // 16
