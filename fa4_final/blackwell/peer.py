"""The steps of a tile exchange between the two CTAs of a cluster, as device functions.

The pair backward (bwd_pair, Note [The dS exchange]) moves 16 KB of dS from each CTA into the
other's shared memory every step. Its steps are here, and nowhere else, so that probe kernels can
run the very same instructions on a Hopper GPU: all of them are sm_90 PTX (distributed shared
memory, st.async, remote mbarriers, cluster-scope waits, proxy fences), nothing of tcgen05.

    writer (one CTA)                              reader (the peer)
    fence_before_peer_store()                     ...
    arm_peer(full, bytes, peer)   one thread      wait_peer_bytes(full, phase)
    store_peer_v4(dst, words, full, peer)         (acquire.cluster, then fence.proxy.async)
                                                  the async proxy (MMA, TMA store) reads them
    optionally: relay_arrive(relay, leader)       wait_acquire_cluster(relay, phase)

Note [Exchange proxies]
Why each fence: st.async writes are generic-proxy writes, performed
asynchronously for the writing thread, whose mbarrier complete_tx releases them at cluster scope.
The reader acquires them at cluster scope (``mbarrier.try_wait.acquire.cluster``; the default
.cta scope does not synchronise with a release from another CTA), then orders them before its
async-proxy reads with ``fence.proxy.async.shared::cta``: a generic-to-async proxy fence on the
path from the writes to the reads. The writer fences first, ``fence.proxy.async.shared::cluster``
before its st.async: the buffer it overwrites was last read by the peer's async proxy (the dQ
MMA of the step before, whose completion the writer has observed), and that read must be
ordered before the new generic writes. FA4 keeps its exchange in the async proxy end to end (a
bulk copy from a staging buffer); the pair has no 16 KB left for that buffer at D = 128.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _asm(text: str, args, constraints: str, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int32(a).ir_value(loc=loc, ip=ip) for a in args], text, constraints,
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def wait_acquire_cluster(mbar_ptr, phase, *, loc=None, ip=None) -> None:
    """Wait for the phase of parity ``phase`` of this CTA's mbarrier at ``mbar_ptr`` to complete,
    with acquire semantics at cluster scope: what a thread of the peer CTA released on it (an
    st.async's complete_tx, a ``relay_arrive``) happens before what this thread does next."""
    _asm("{\n"
         ".reg .pred done;\n"
         "WAIT_CLUSTER:\n"
         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$0], $1;\n"
         "@!done bra WAIT_CLUSTER;\n"
         "}", [mbar_ptr.toint(loc=loc, ip=ip), phase], "r,r", loc=loc, ip=ip)


@dsl_user_op
def wait_peer_bytes(mbar_ptr, phase, *, loc=None, ip=None) -> None:
    """The reader's side: wait (acquire, cluster scope) for the bytes a peer stored here with
    ``store_peer_v4``, then hand them to the async proxy (fence.proxy.async.shared::cta), so
    an MMA or a TMA store issued next reads them."""
    wait_acquire_cluster(mbar_ptr, phase, loc=loc, ip=ip)
    cute.arch.fence_view_async_shared(loc=loc, ip=ip)


@dsl_user_op
def fence_before_peer_store(*, loc=None, ip=None) -> None:
    """The writer's side, before its st.async: order the async-proxy reads of the peer's buffer
    it has seen complete before these generic writes (fence.proxy.async.shared::cluster)."""
    cute.arch.fence_proxy("async.shared", space="cluster", loc=loc, ip=ip)


@dsl_user_op
def arm_peer(mbar_ptr, nbytes: int, peer, *, loc=None, ip=None) -> None:
    """One thread of the writer: arrive once on the peer's mbarrier (same offset as
    ``mbar_ptr`` here) and make it expect ``nbytes`` more bytes."""
    cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, nbytes, peer_cta_rank_in_cluster=peer,
                                            loc=loc, ip=ip)


@dsl_user_op
def store_peer_v4(dst_addr, words, mbar_ptr, peer, *, loc=None, ip=None) -> None:
    """16 bytes (four Int32 ``words``) to the peer's shared memory at the offset of this CTA's
    shared byte address ``dst_addr``, counted by the peer's mbarrier (the one at ``mbar_ptr``'s
    offset) as complete_tx (st.async.shared::cluster ... .v4.b32)."""
    dst = cute.make_ptr(Int32, dst_addr, cute.AddressSpace.smem, assumed_align=16, loc=loc,
                        ip=ip)
    cute.arch.store_async_dsmem(dst, tuple(words), mbar_ptr, peer, loc=loc, ip=ip)


@dsl_user_op
def relay_arrive(mbar_ptr, peer, *, loc=None, ip=None) -> None:
    """Arrive once on the peer's mbarrier (at ``mbar_ptr``'s offset there) with release
    semantics at cluster scope: what this thread observed (an acquire of the peer's bytes)
    and fenced happens before the peer's ``wait_acquire_cluster`` returns."""
    _asm("{\n"
         ".reg .b32 remote;\n"
         "mapa.shared::cluster.u32 remote, $0, $1;\n"
         "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n"
         "}", [mbar_ptr.toint(loc=loc, ip=ip), peer], "r,r", loc=loc, ip=ip)
