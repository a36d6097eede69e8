"""The hardware rules no compiler checks (solutions/ch09_hardware_rules.py), held against the
compiled PTX of every Blackwell kernel (sm_100a, on a CPU): the 2-CTA allocator barrier set up
before the cluster arrive, the dS exchange fenced on both sides, TMEM allocated and freed once,
TMEM loads and stores complete before a signal, warpgroup 3's one setmaxnreg."""

import re

import pytest

from fa4_final.blackwell.config import Q_STAGES, BlackwellBwdConfig, BlackwellFwdConfig
from solutions import ch09_hardware_rules as H

pytestmark = pytest.mark.slow

PAIR = BlackwellBwdConfig(two_cta=True)
KERNELS = {  # name: (kind, head_dim, config)
    "fwd 1-CTA": ("fwd", 128, BlackwellFwdConfig()),
    "fwd 2-CTA": ("fwd", 128, BlackwellFwdConfig(two_cta=True)),
    "bwd 1-CTA": ("bwd", 128, BlackwellBwdConfig()),
    "bwd pair D=128": ("bwd", 128, PAIR),
    "bwd pair D=64": ("bwd", 64, PAIR),
}


@pytest.fixture(scope="module")
def ptx():
    cache = {}

    def get(name):
        if name not in cache:
            kind, d, cfg = KERNELS[name]
            from fa4_final.blackwell import host
            from fa4_final.runtime.compile import artifacts

            recipe = host.forward_recipe if kind == "fwd" else host.backward_recipe
            cache[name] = artifacts(recipe(d, "bf16", False, cfg), ("main",))["main"].ptx
        return cache[name]

    return get


def dealloc_offset(name) -> int:
    """Byte offset of the 2-CTA dealloc mbarrier in the kernel's barrier block: after the
    forward's pipeline barriers (BlackwellFwdConfig._fixed_smem's order), the last of the
    pair backward's barriers (pair_smem_fields)."""
    kind, d, cfg = KERNELS[name]
    if kind == "fwd":
        return 8 * 2 * (Q_STAGES + cfg.ring_depth(d) + 4 * Q_STAGES)
    return cfg.pair_smem_fields(d)[0][1] - 8


@pytest.mark.parametrize("name", ["fwd 2-CTA", "bwd pair D=128", "bwd pair D=64"])
def test_pair_dealloc_barrier_initialised_before_cluster_arrive(ptx, name):
    """The allocator's dealloc mbarrier (TmemAllocator, 2-CTA) is initialised before the
    barrier.cluster.arrive.relaxed that publishes the pair's barriers (fwd Note [Allocator
    barrier first])."""
    text = ptx(name)
    assert text.count("barrier.cluster.arrive.relaxed") == 1
    assert H.barrier_init_before_cluster_arrive(text, dealloc_offset(name)) == []


def test_barrier_order_check_refuses_an_init_after_the_arrive():
    """The check itself, on the order the kernels had: the dealloc init after the arrive."""
    ptx = "\n".join([
        "mbarrier.init.shared.b64 [%r10], %r1;",
        "mbarrier.init.shared.b64 [%r10+8], %r1;",
        "fence.mbarrier_init.release.cluster;",
        "barrier.cluster.arrive.relaxed;",
        "add.s32 %r12, %r10, 144;",
        "mbarrier.init.shared.b64 [%r12], %r2;",
        "barrier.cluster.wait;",
    ])
    assert H.barrier_init_before_cluster_arrive(ptx, 8) == []
    found = H.barrier_init_before_cluster_arrive(ptx, 144)
    assert found and "after the cluster arrive" in found[0]


@pytest.mark.parametrize("name", ["bwd pair D=128", "bwd pair D=64"])
def test_ds_exchange_writer_fences_before_st_async(ptx, name):
    """Each compiled copy of the exchange: fence.proxy.async.shared::cluster between the wait
    that frees the peer's block and the st.async into it (fa4_final.blackwell.peer)."""
    text = ptx(name)
    assert text.count("st.async.shared::cluster") > 0
    assert H.peer_stores_fenced(text) == []
    assert text.count("fence.proxy.async.shared::cluster") == \
        text.count("mbarrier.arrive.expect_tx.shared::cluster")  # one per compiled copy


@pytest.mark.parametrize("name", ["bwd pair D=128", "bwd pair D=64"])
def test_ds_exchange_reader_acquires_at_cluster_scope_then_fences(ptx, name):
    """The leader's MMA thread waits for its dsx and dsx_relay barriers, the follower's relay
    for its dsx barrier, each at cluster scope (mbarrier.try_wait...acquire.cluster), with a
    fence.proxy.async before the MMA; the relay arrives with release at cluster scope."""
    text = ptx(name)
    assert text.count("mbarrier.try_wait.parity.acquire.cluster") == 3
    assert H.peer_waits_acquire_then_fence(text) == []
    assert "mbarrier.arrive.release.cluster.shared::cluster" in text


@pytest.mark.parametrize("name", list(KERNELS))
def test_tmem_allocated_and_freed_once_by_one_warp(ptx, name):
    assert H.tmem_alloc_once(ptx(name)) == []


@pytest.mark.parametrize("name", list(KERNELS))
def test_tmem_loads_complete_before_a_signal(ptx, name):
    assert H.tmem_loads_complete_before_signal(ptx(name)) == []


@pytest.mark.parametrize("name", list(KERNELS))
def test_tmem_stores_waited_before_a_signal(ptx, name):
    assert H.tmem_stores_waited_before_signal(ptx(name)) == []


@pytest.mark.parametrize("name", ["bwd 1-CTA", "bwd pair D=128"])
def test_backward_warpgroup3_lowers_once(ptx, name):
    """One setmaxnreg instruction for the compute warpgroups, one for the dQ warpgroup, one
    for warpgroup 3: every warp of a warpgroup runs the same instruction."""
    found = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx(name))
    assert found == [("dec", "112"), ("inc", "176"), ("dec", "48")], found


@pytest.mark.parametrize("name", list(KERNELS))
def test_tcgen05_thread_sync_fences_are_not_emitted(ptx, name):
    """Recorded, not endorsed (the table's open row): the kernels order tcgen05 operations of
    different threads with mbarriers and named barriers alone, as FA4's sm100 kernels and
    CUTLASS's DSL pipelines do, without tcgen05.fence::before/after_thread_sync. If a kernel
    starts emitting them, this test and the table's row change together."""
    assert "tcgen05.fence::" not in ptx(name)


def test_pair_mma_warp_reads_its_descriptor_words_each_step(ptx):
    """bwd_pair Note [Descriptors read each step]: two ld.volatile.shared.v4 inside the
    leader's step loop; the 1-CTA kernel has none."""
    assert ptx("bwd pair D=128").count("ld.volatile.shared.v4.u32") == 2
    assert "ld.volatile.shared" not in ptx("bwd 1-CTA")
