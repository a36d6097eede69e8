"""The 2-CTA mode of the Blackwell backward (chapter 11): a CTA pair shares every GEMM
(``tcgen05.mma.cta_group::2``), dS exchanged through distributed shared memory. DRAFT: host
tables only (pipelines, roles, TMEM plan), replayed by solutions.ch09_pipeline.PairBackwardSim.
"""

from __future__ import annotations

from fa4_final.blackwell.bwd import GROUP_THREADS, WARPS_PER_GROUP, BlackwellBackward, PipelineSpec
from fa4_final.tiles import TileWindow

PAIR = 2  # CTAs of a cluster: (2, 1, 1)
COMPUTE_WARPS = 2 * WARPS_PER_GROUP
DQ_WARPS = WARPS_PER_GROUP


class BlackwellBackwardPair(BlackwellBackward):
    """dK, dV and the float32 dQ accumulator on sm_100a, one CTA pair per 256 keys."""

    def __init__(self, dtype, head_dim: int, causal: bool, config,
                 has_window_left: bool = False, has_window_right: bool = False):
        if not config.two_cta:
            raise ValueError("BlackwellBackwardPair needs BlackwellBwdConfig(two_cta=True)")
        if config.deterministic:
            raise ValueError("the 2-CTA backward has no deterministic mode (its two CTAs add "
                             "disjoint halves of dQ; the turn counters are per key tile): use "
                             "two_cta=False with deterministic=True")
        super().__init__(dtype, head_dim, causal, config, has_window_left, has_window_right)
        self.pair_tile_n = PAIR * self.tile_n
        # a pair's query tiles are those that see any of its 256 keys (bwd_tiles.q_tile_range)
        self.window = TileWindow(self.tile_m, self.pair_tile_n, self.causal,
                                 has_left=bool(has_window_left),
                                 has_right=bool(has_window_right) and not self.causal)
        self.roles["mma"]["does"] = ("leader: TMEM alloc/free, one thread issues every pair "
                                     "tcgen05.mma; follower: relays its dS-exchange barrier")

    def pipelines(self) -> tuple[PipelineSpec, ...]:
        """The pair's pipelines (Note [The pair's handshakes]); arrivals per barrier phase. Kinds:
        tma_umma: FULL in the leader, counting both CTAs' TMA bytes, EMPTY in each CTA (the
        leader's commit reaches both); umma_async: FULL in each CTA (commit to both), EMPTY in
        the leader, counting both CTAs' warps; local: both barriers in each CTA, its own
        threads; peer: FULL in each CTA, armed and filled by the other CTA (no EMPTY: dq's FULL
        frees it); relay: one barrier in the leader, the follower's MMA warp arrives."""
        return (
            PipelineSpec("kv", "K, V (own keys), Kt (D/2 x 256 keys), once", "tma_umma", 1,
                         "load", "mma", 1, 1),
            PipelineSpec("q", "Q (64 queries), Qt (D/2) per step", "tma_umma", self.q_stages,
                         "load", "mma", 1, 1),
            PipelineSpec("do", "dO (64 queries), dOt (D/2) per step", "tma_umma",
                         self.do_stages, "load", "mma", 1, 1),
            PipelineSpec("rows", "lse (log2 units) and delta of the step's 128 queries", "local",
                         self.q_stages, "load", "compute", 1, COMPUTE_WARPS),
            PipelineSpec("s", "full: S^T in TMEM; empty: P^T in TMEM", "umma_async", 1, "mma",
                         "compute", 1, PAIR * COMPUTE_WARPS),
            PipelineSpec("dp", "full: dP^T in TMEM; empty: dS^T in TMEM, own dS block stored",
                         "umma_async", 1, "mma", "compute", 1, PAIR * COMPUTE_WARPS),
            PipelineSpec("dsx", "full: the peer's 16 KB of dS (block 1 - rank of sdS)", "peer", 1,
                         "compute (peer)", "mma (leader) / relay (follower)", 1, 0),
            PipelineSpec("dsx_relay", "the follower's dsx FULL completed", "relay", 1,
                         "mma warp (follower)", "mma (leader)", 1, 0),
            PipelineSpec("dq", "full: dQ in TMEM, dS read; empty: dQ read", "umma_async", 1,
                         "mma", "dq (+ compute: dS free)", 1, PAIR * DQ_WARPS),
            PipelineSpec("dkv", "full: the pair's last dK, dV MMA done", "umma_async", 1, "mma",
                         "compute", 1, PAIR * COMPUTE_WARPS),
        )


DS_EXCHANGE_BYTES = 128 * 64 * 2  # one warpgroup's dS: 128 keys x 64 queries, 16-bit
assert GROUP_THREADS * 128 == DS_EXCHANGE_BYTES  # 128 B (64 queries) a thread
