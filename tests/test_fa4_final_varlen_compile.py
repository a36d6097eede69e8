"""The Hopper forward's varlen variant compiled for sm_90a with fake tensors, on a CPU: it
compiles for D = 64 and 128, causal or not, with no spills and the dense kernel's registers, and
its instruction mix is that of the dense kernel with the same knobs (the same wgmma, TMA loads
and stores, stmatrix, exponentials) plus the varlen pieces: the warp scan over cu_seqlens
(SHFL, POPC) and the partial last tile's 16-byte stores (Note [Varlen epilogue]). The dense
variant has none of those: the flag compiles them out. Both take their tiles from the dynamic
scheduler's counter (Note [Dynamic tiles])."""

import pytest

from fa4_final.api.interface import compile_only
from fa4_final.hopper.config import hopper_fwd_default

pytestmark = pytest.mark.slow

SAME = ("HGMMA", "UTMALDG", "UTMASTG", "STSM", "MUFU.EX2", "BAR.SYNC")


@pytest.fixture(scope="module")
def artifacts():
    cache = {}

    def get(head_dim, causal, varlen, **kw):
        key = (head_dim, causal, varlen, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = compile_only("sm_90a", head_dim, "bf16", causal, varlen=varlen, **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_compiles_clean_with_the_dense_instruction_mix(artifacts, head_dim, causal):
    # the dense kernel of the same knobs: the dense default also cuts its last round along the
    # keys (Note [Split tail]), which varlen does not (its tile costs are on the device)
    same = hopper_fwd_default(head_dim, causal, varlen=True)
    var, dense = artifacts(head_dim, causal, True), artifacts(head_dim, causal, False,
                                                             config=same)
    assert var.spills == 0 and var.frame_bytes == 0, var.resources()
    assert var.registers == dense.registers, (var.resources(), dense.resources())
    var.require("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "shfl.sync.up")
    for word in SAME:
        assert var.count(word, "sass") == dense.count(word, "sass"), word
    assert var.count("wgmma.mma_async") == dense.count("wgmma.mma_async")
    assert var.count("cp.async.bulk.tensor") == dense.count("cp.async.bulk.tensor")
    # the varlen pieces, and none of them in the dense kernel
    var.require("POPC", "STG.E.128", where="sass")
    dense.forbid("POPC", "STG.E.128", where="sass")
    dense.forbid("shfl.sync.up")
    # no wgmma serialised by ptxas (test_fa4_final_compile.wgmma_serialised)
    assert var.count("WARPGROUP.ARRIVE", "sass") == var.count("wgmma.fence.sync.aligned")
    # its tiles come from the counter of Note [Dynamic tiles], as the dense build's of these
    # knobs do: one global atomic
    assert same.schedules_dynamically
    assert var.count("atom.global.add") == dense.count("atom.global.add") == 1


def test_varlen_with_seqused_k_and_a_window(artifacts):
    art = artifacts(128, False, True, has_seqused_k=True, has_window_left=True,
                    has_window_right=True)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    art.require("HGMMA", "UTMALDG", "UTMASTG", "POPC", where="sass")
