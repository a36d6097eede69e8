"""The deterministic backward with dQ copies (Note [dQ copies] in fa4_final.common.bwd_tiles)
compiled for sm_90a from fake tensors on a CPU: D = 64 and 128, causal or not, dense and
varlen, no spill, no stack frame, no wgmma serialised; the turn protocol's instructions are in
the main kernel. Slow: one compile of three kernels per case."""

import re
from dataclasses import replace

import pytest

from fa4_final.hopper.config import hopper_bwd_default
from fa4_final.hopper.host import backward_recipe
from fa4_final.runtime.compile import artifacts as compile_artifacts

pytestmark = pytest.mark.slow


def candidate(head_dim, causal, copies=2, early=True):
    """The candidate of issue 34 as the next GPU visit measures it (fa4_final_det_c2)."""
    return replace(hopper_bwd_default(head_dim, causal), deterministic=True, dq_copies=copies,
                   dq_early_release=early)


def _check(arts, zeroes=True):
    main, pre, post = arts["main"], arts["pre"], arts["post"]
    main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32",
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")
    if zeroes:  # bwd_pre zeroes the accumulator, 16 B a store (not with dq_first_store)
        pre.require("st.global.v4")
    post.require("ld.global.v4", "st.global.v4")
    for art in arts.values():
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    fences = main.count("WARPGROUP.ARRIVE", where="sass") - main.count("wgmma.fence.sync.aligned")
    assert fences == 0, "ptxas serialised a wgmma"


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_copies_compile_clean(head_dim, causal, varlen):
    cfg = candidate(head_dim, causal)
    arts = compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                             varlen=varlen))
    _check(arts)
    # early release: the dQ warp waits for the bulk adds' reads, then for their completion
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", arts["main"].ptx)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", arts["main"].ptx)


@pytest.mark.parametrize("copies,early", [(2, False), (1, True), (4, True)])
def test_each_half_alone_compiles_clean(copies, early):
    cfg = candidate(128, False, copies, early)
    _check(compile_artifacts(backward_recipe(128, "bf16", False, cfg, True)))


STORE = "cp.async.bulk.global.shared::cta.bulk_group"  # the plain bulk copy (no .add)
ADD = "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"


def _check_first_store(arts):
    """dq_first_store (Note [dQ copies]): the main kernel stores at turn 0 and adds after, one
    instruction of each per dQ chunk; bwd_pre writes no accumulator (no 16 B zero stores);
    bwd_post still reads the copies 16 B at a time."""
    _check(arts, zeroes=False)
    main = arts["main"]
    assert re.search(re.escape(STORE) + r"\s*\[", main.ptx), "no plain bulk copy in the PTX"
    assert main.count(STORE) == main.count(ADD) > 0, (main.count(STORE), main.count(ADD))
    assert arts["pre"].count("st.global.v4") == 0, "bwd_pre still zeroes the accumulator"
    assert arts["post"].count("ld.global.v4") > 0


@pytest.mark.parametrize("copies", [1, 2, 4])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_first_store_compiles_clean(head_dim, causal, varlen, copies):
    cfg = replace(candidate(head_dim, causal, copies, True), dq_first_store=True)
    _check_first_store(compile_artifacts(backward_recipe(head_dim, "bf16", causal, cfg, True,
                                                         varlen=varlen)))
