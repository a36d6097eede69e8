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


def _check(arts):
    main, pre, post = arts["main"], arts["pre"], arts["post"]
    main.require("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32",
                 "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")
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
