"""Chapter 05's consumer exercises in device code (solutions/ch05_consumer.py): the steady turn's
GEMMs (05.5) and the epilogue's hand-over to the TMA (05.6).

The recorders see what an answer does, call by call and thread by thread, and the checkers name
each slip (the planted mistakes of tests/exercise_mutations/ch05.py are held against them by
tests/test_exercise_mutations.py). The compiled checks read the PTX. And the kernel's two seams,
``gemm_turn`` and ``store_o``, were extracted from the kernel without changing it: with the
references plugged in, the course subclasses compile to the kernel's own SASS, byte for byte
(when the methods were extracted, the SASS of all six default builds, D = 64, 128 and 256,
causal or not, was compared before and after: unchanged)."""

import hashlib
import re
from importlib.metadata import version

import pytest

from solutions import ch05_consumer as c5
from solutions import ch05_flash_hopper as ch05
from tests.exercise_mutations import ch05 as wrong


# ---------------------------------------------------------------------------------------------
# 05.5: the turn's GEMMs, recorded
# ---------------------------------------------------------------------------------------------
def test_reference_turn_is_two_groups_then_wait_one():
    events = c5.record_turn(c5.gemm_turn, 8, 8)
    kinds = [e.kind for e in events]
    assert kinds == ["fence", *["gemm"] * 8, "commit", "fence", *["gemm"] * 8, "commit", "wait"]
    assert [e.accumulate for e in events if e.gemm == "S"] == [False] + [True] * 7
    assert all(e.accumulate for e in events if e.gemm == "PV")
    assert events[-1].n == 1
    assert c5._turn_mistake(events) is None
    c5.check_gemm_turn(c5.gemm_turn, compile_check=False)


def test_a_helper_of_ones_own_and_one_fence_for_both_pass():
    c5.check_gemm_turn(wrong.turn_with_own_helper, compile_check=False)
    one_fence = [e for i, e in enumerate(c5.record_turn(c5.gemm_turn))
                 if not (e.kind == "fence" and i > 0)]
    assert c5._turn_mistake(one_fence) is None  # no register writes between the two issues


def _events(text):
    """A turn written as 'f S0 S1 c P0 P1 c w1' (f fence, S/P gemm k-block, c commit, wN wait;
    a lowercase s or p accumulates, upper case does not... for S the first is upper)."""
    out = []
    for tok in text.split():
        if tok == "f":
            out.append(c5.TurnEvent("fence"))
        elif tok == "c":
            out.append(c5.TurnEvent("commit"))
        elif tok[0] == "w":
            out.append(c5.TurnEvent("wait", n=int(tok[1:])))
        else:
            gemm = "S" if tok[0] in "Ss" else "PV"
            out.append(c5.TurnEvent("gemm", gemm=gemm, k=int(tok[1:]), accumulate=tok[0].islower()))
    return out


@pytest.mark.parametrize("text, words", [
    ("f S0 s1 c f p0 p1 c w1", None),
    ("f S0 c w0 f p0 p1 c", "misses k-block"),
    ("f S0 s1 c w0 f p0 p1 c", "waits for S before it issues P V"),
    ("f S0 s1 c f p0 p1", "after the last commit_group"),
    ("f S0 s1 c f p0 p1 c w2", "guarantees none of them complete"),
    ("f S0 s1 c f p0 p1 c", "without a wait_group"),
    ("f S0 S1 c f p0 p1 c w1", "k-block 1 overwrites"),
    ("f S0 s1 c f P0 p1 c w1", "overwrites O"),
    ("f S0 s1 s1 c f p0 p1 c w1", "twice"),
])
def test_turn_mistakes_in_words(text, words):
    said = c5._turn_mistake(_events(text), 2, 2)
    if words is None:
        assert said is None, said
    else:
        assert said is not None and words in said, said


def test_turn_operands_are_checked():
    @c5.cute.jit
    def swapped(tiled_mma_qk, tiled_mma_pv, acc_s, acc_o, tSrQ, tSrK, tOrP, tOrVt):
        pass

    with pytest.raises(AssertionError, match="never issued"):
        c5.check_gemm_turn(swapped, compile_check=False)


# ---------------------------------------------------------------------------------------------
# 05.6: the epilogue, recorded thread by thread
# ---------------------------------------------------------------------------------------------
def test_reference_epilogue_per_thread():
    per_thread = c5.record_epilogue(c5.store_o, 256)
    assert [e.kind for e in per_thread[0]] == ["store", "fence", "barrier", "tma", "commit",
                                               "wait"]
    assert [e.kind for e in per_thread[200]] == ["store", "fence", "barrier"]
    assert per_thread[0][2].bar == c5.EPILOGUE_BARRIER and per_thread[0][2].count == 256
    assert c5._epilogue_mistake(per_thread, 256) is None
    c5.check_store_o(c5.store_o, compile_check=False)


def _ev(kinds, bar=c5.EPILOGUE_BARRIER, count=256):
    out = []
    for k in kinds.split():
        if k in ("barrier", "arrive"):
            out.append(c5.StoreEvent(k, bar=bar, count=count))
        elif k == "fence":
            out.append(c5.StoreEvent("fence", what="proxy async.shared cta"))
        elif k == "wait":
            out.append(c5.StoreEvent("wait", n=0, read=True))
        else:
            out.append(c5.StoreEvent(k))
    return out


def test_one_thread_issuing_and_fa4s_arrive_then_sync_are_right_too():
    # FA4's way: the writers arrive, the issuing warp syncs (here the issuer is one thread)
    per = {t: _ev("store fence arrive") for t in range(256)}
    per[0] = _ev("store fence barrier tma commit wait")
    assert c5._epilogue_mistake(per) is None


@pytest.mark.parametrize("issuer, others, count, words", [
    ("store fence arrive tma commit wait", "store fence barrier", 256, "without waiting"),
    ("store fence barrier tma commit wait", "store fence barrier", 128, "before every row"),
    ("store fence barrier tma commit wait", "store fence barrier", 384, "a hang"),
    ("store barrier fence tma commit wait", "store barrier fence", 256, "after the barrier"),
    ("store fence barrier tma wait", "store fence barrier", 256, "never committed"),
    ("store fence barrier store tma commit wait", "store fence barrier", 256, "2 times"),
])
def test_epilogue_mistakes_in_words(issuer, others, count, words):
    per = {t: _ev(others, count=count) for t in range(256)}
    per[0] = _ev(issuer, count=count)
    said = c5._epilogue_mistake(per)
    assert said is not None and words in said, said


# ---------------------------------------------------------------------------------------------
# compiled: the seams reproduce the kernel; the PTX checks see what the recorders see
# ---------------------------------------------------------------------------------------------
def _sass(art):
    return re.sub(r"kernel_cutlass_\w+", "KERNEL", art.sass)


@pytest.fixture(scope="module")
def kernel_d128():
    return ch05.compile_only("sm_90a", head_dim=128)


# The default kernels' sm_90a SASS (sha256 of nvdisasm's text, the kernel's mangled name replaced
# by KERNEL) as compiled before gemm_turn and store_o were split out of the kernel: the split must
# change no instruction. Recorded with nvidia-cutlass-dsl 4.8.1. The kernel reads shared pieces
# of fa4_final (softmax, masks, wgmma issue): a change there moves these digests too.
SASS_DSL_VERSION = "4.8.1"
SASS_SHA256 = {
    (64, False): "69743613db07456b40f0aacb1d67d7633a32b060027ce95e2d26fb68e0af2022",
    (64, True): "3a3c621500eedc3f60679bf58c47da83c9747fc99b3c2b975abed4bdd49cfb5a",
    (128, False): "9023e9fd74299a89b0fb6edd5b77c4944d7264d9f8c6f463442908d16e502c39",
    (128, True): "ff988f095b7a7f82400e6e673a413eadcb08c9e05b4e28d64a4a0e36a1320f31",
    (256, False): "4a2257e9e34a5a246afae65d5cd95e347df358cf22bc11f0b440aa927cf6f0b4",
    (256, True): "273fe07cb6ba7599f1078e152da2875f8e7f49f236f7a34144c7f3e41cc59797",
}


@pytest.mark.slow
@pytest.mark.skipif(version("nvidia-cutlass-dsl") != SASS_DSL_VERSION,
                    reason=f"the digests were recorded with CuTe DSL {SASS_DSL_VERSION}")
@pytest.mark.parametrize("head_dim, causal", list(SASS_SHA256))
def test_default_sass_is_unchanged_by_the_exercise_seams(head_dim, causal):
    art = ch05.compile_only("sm_90a", head_dim=head_dim, causal=causal)
    digest = hashlib.sha256(_sass(art).encode()).hexdigest()
    assert digest == SASS_SHA256[(head_dim, causal)], (
        f"D={head_dim} causal={causal}: the default kernel's sm_90a SASS changed; the kernel's "
        "code must compile to the same instructions")


@pytest.mark.slow
def test_the_turn_seam_with_the_reference_is_the_kernel_byte_for_byte(kernel_d128):
    assert _sass(c5.compile_with_turn(c5.gemm_turn)) == _sass(kernel_d128)


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_epilogue_seam_with_the_reference_is_the_kernel_byte_for_byte(head_dim, kernel_d128):
    kernel = kernel_d128 if head_dim == 128 else ch05.compile_only("sm_90a", head_dim=64)
    mine = c5.compile_kernel(c5.HopperWithEpilogue, c5.store_o, head_dim)
    assert _sass(mine) == _sass(kernel)


@pytest.mark.slow
def test_the_full_checks_pass_the_references_and_read_the_ptx(kernel_d128):
    c5.check_gemm_turn(c5.gemm_turn)
    c5.check_store_o(c5.store_o)
    turn = c5.steady_wait_ptx(kernel_d128.ptx)
    assert turn == {"found": True, "wait_group_1": 1, "fences": 2, "commits": 2, "wgmma": 16,
                    "waits": 0}
    order = c5.epilogue_ptx_order(kernel_d128.ptx)
    assert order["fence"] < order["barrier"] < order["store"] < order["wait"]


@pytest.mark.slow
def test_the_ptx_shows_a_missing_proxy_fence_and_a_serialised_turn():
    """What the recorders refuse, the compiled kernel shows too: no fence.proxy.async before
    the epilogue's barrier; no wait_group 1 in a turn that waits for everything."""
    order = c5.epilogue_ptx_order(c5.compile_with_epilogue(wrong.store_without_fence).ptx)
    assert order["fence"] is None and order["barrier"] < order["store"]
    turn = c5.steady_wait_ptx(c5.compile_with_turn(wrong.turn_waits_for_everything).ptx)
    assert turn["wait_group_1"] == 0


@pytest.mark.slow
def test_a_learners_own_helper_compiles_into_the_turn():
    c5.check_gemm_turn(wrong.turn_with_own_helper)
