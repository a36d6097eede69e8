"""The Hopper decode kernel with a pair of CTAs sharing each K/V tile (HopperDecodeConfig.cluster
= 2, Note [A pair of CTAs shares the cache] in fa4_final.hopper.decode) on a CPU: the config's
refusals by name, the pipelines' arrival counts, the pair's rows and key range (host emulation
of the kernel's index arithmetic), the pair's walk against the float64 decode, both CTAs' rings
simulated (solutions.ch09_pipeline's event loop) with planted mistakes caught; slow: the builds
compiled for sm_90a (the multicast loads, the remote arrives, the cluster barrier, the builds
without a cluster untouched). The candidate has not run on a GPU (tests/gpu/test_decode_kernel.py
-k cluster is written for that)."""

import re
from dataclasses import replace

import pytest

from fa4_final.common.decode_index import (
    block_key_start,
    block_key_tiles,
    num_m_blocks,
    packed_rows,
    split_key_tiles,
    unpack_row,
)
from fa4_final.hopper.config import (
    DECODE_CLUSTERS,
    HopperDecodeConfig,
    hopper_decode_default,
    hopper_decode_for_page,
    hopper_decode_for_rows,
)
from tests.decode_reference import decode_reference, emulate_decode, merge_splits

CTA_ROWS = 128  # packed rows a CTA of two consumer warpgroups owns


def pair(d=128):
    return replace(hopper_decode_default(d), consumers=2, cluster=2)


def test_decode_cluster_config_refusals_name_the_knob():
    assert DECODE_CLUSTERS == (1, 2)
    for bad in (0, 3, 4, True, 2.0, "2", None):
        with pytest.raises(ValueError, match="cluster must be one of"):
            replace(pair(), cluster=bad).check(128)
    with pytest.raises(ValueError, match="cluster=2.*swap_ab"):
        HopperDecodeConfig(swap_ab=True, rows_n=8, cluster=2).check(128)
    with pytest.raises(ValueError, match="cluster=2.*page_box=16"):
        replace(hopper_decode_for_page(128, 16), cluster=2).check(128)
    for d in (64, 128):
        pair(d).check(d)
        replace(hopper_decode_default(d), cluster=2).check(d)  # one consumer a CTA: 2 x 64 rows


def test_decode_cluster_block_and_resources_are_the_configs_without_it():
    """block_m, the rows whose key tiles a CTA walks, is the pair's; tile_m, shared memory and
    the register plan are the CTA's, as without the cluster; no call of the package reaches
    the cluster (hopper_decode_for_rows leaves it at 1)."""
    for d in (64, 128):
        cfg, flat = pair(d), replace(pair(d), cluster=1)
        assert (cfg.tile_m, cfg.block_m, flat.block_m) == (CTA_ROWS, 2 * CTA_ROWS, CTA_ROWS)
        assert cfg.smem_bytes(d) == flat.smem_bytes(d)
        assert cfg.register_plan == flat.register_plan
        assert hopper_decode_default(d).cluster == 1
        assert hopper_decode_for_rows(hopper_decode_default(d), 256).cluster == 1


def test_decode_cluster_empty_barriers_count_both_ctas_consumer_warps():
    """A stage is free when every consumer warp of both CTAs released it: 16 arrivals with two
    consumer warpgroups (8 a CTA), 8 with one; FULL is the producer's one arrive, as before."""
    import cutlass

    from fa4_final.hopper.decode import HopperDecode

    for consumers, arrivals in ((2, 16), (1, 8)):
        cfg = replace(hopper_decode_default(128), consumers=consumers, cluster=2)
        kernel = HopperDecode(cutlass.BFloat16, 128, True, cfg)
        assert [(s.full_arrivals, s.empty_arrivals) for s in kernel.pipelines()] == [
            (1, arrivals), (1, arrivals)]
        flat = HopperDecode(cutlass.BFloat16, 128, True, replace(cfg, cluster=1))
        assert [s.empty_arrivals for s in flat.pipelines()] == [arrivals // 2] * 2


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("window_left", [None, 0, 37])
def test_decode_cluster_pair_walks_one_key_range(group, window_left):
    """The kernel's arithmetic on the host: the grid has an even number of m-blocks (pairs along
    grid x, rank = m_block % 2); both CTAs of a pair, in every split, walk the same tiles (the
    pair's block of 256 rows), which hold each CTA's own range; over the grid every (token, head)
    is stored once, by the CTA that owns its row."""
    seqlen_k, tile_n = 1000, 128
    for seqlen_q in range(1, 17):
        packed = packed_rows(seqlen_q, group)
        m_blocks = num_m_blocks(seqlen_q, group, 2 * CTA_ROWS) * 2
        assert m_blocks % 2 == 0 and m_blocks * CTA_ROWS >= packed
        stored = []
        for num_splits in (1, 3):
            for bx in range(m_blocks * num_splits):
                m_block, split = bx % m_blocks, bx // m_blocks
                n_end, n_full = block_key_tiles(m_block // 2, 2 * CTA_ROWS, tile_n, group,
                                                seqlen_q, seqlen_k, True)
                n_start, n_left_free = block_key_start(m_block // 2, 2 * CTA_ROWS, tile_n,
                                                       group, seqlen_q, seqlen_k, window_left)
                peer = m_block ^ 1
                assert peer // 2 == m_block // 2 and split == (bx ^ 1) // m_blocks
                lo, hi = split_key_tiles(split, num_splits, seqlen_k, tile_n, n_end, n_start)
                e, f = block_key_tiles(m_block, CTA_ROWS, tile_n, group, seqlen_q, seqlen_k,
                                       True)
                assert e <= n_end and (e == 0 or f >= n_full)
                s, lf = block_key_start(m_block, CTA_ROWS, tile_n, group, seqlen_q, seqlen_k,
                                        window_left)
                if e > 0:
                    assert s >= n_start and lf <= n_left_free
                    own_lo, own_hi = split_key_tiles(split, num_splits, seqlen_k, tile_n, e, s)
                    assert own_hi <= own_lo or (lo <= own_lo and own_hi <= hi)
                if num_splits == 1:
                    for r in range(CTA_ROWS):
                        row = m_block * CTA_ROWS + r
                        if row < packed:
                            stored.append(unpack_row(row, group, 3))
        assert sorted(stored) == sorted((t, 3 * group + h) for t in range(seqlen_q)
                                        for h in range(group))


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, splits, window_left)
    (2, 16, 1000, 32, 2, True, 1, None),  # 256 rows: one pair
    (1, 9, 777, 16, 2, True, 3, None),  # 72 rows: the second CTA all padding
    (2, 12, 4097, 32, 2, True, 5, None),  # 192 rows
    (1, 16, 1025, 64, 2, False, 4, None),  # 512 rows: two pairs
    (2, 16, 5, 32, 2, True, 1, None),  # more tokens than keys
    (1, 13, 2000, 32, 2, True, 3, 100),  # a window narrower than the pair's rows span
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_cluster_walk_is_the_decode(case):
    """The pair's walk is the walk of a 256-row block (its key range, splits and masked tiles;
    each row masked by its own limits): tests.decode_reference.emulate_decode at tile_m = 256 in
    float64 against the float64 decode."""
    import torch

    batch, sq, sk, h, hk, causal, splits, window = case
    g = torch.Generator().manual_seed(sum(case[:5]) + 7)
    q = torch.randn(batch, sq, h, 32, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    out_ref, lse_ref = decode_reference(q, k, v, causal, window_left=window)
    out_p, lse_p, _ = emulate_decode(q, k, v, causal, splits, tile_m=pair().block_m,
                                     window_left=window)
    assert not out_p.isnan().any() and not lse_p.isnan().any()
    out, lse = merge_splits(out_p, lse_p)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a (slow)

BUILDS = {  # name: (head_dim, consumers, build keywords, TMA boxes a tile: D / 64)
    "d128-contiguous-causal": (128, 2, dict(causal=True), 2),
    "d128-paged-seqused-split": (128, 2, dict(causal=True, paged=True, has_seqused_k=True,
                                              split=True), 2),
    "d128-varlen-paged-split": (128, 2, dict(causal=True, paged=True, has_seqused_k=True,
                                             split=True, varlen_q=True), 2),
    "d128-window-paged-split": (128, 2, dict(causal=True, paged=True, has_seqused_k=True,
                                             split=True, has_window_left=True), 2),
    "d64-contiguous-causal": (64, 2, dict(causal=True), 1),
    "d128-one-consumer": (128, 1, dict(causal=True), 2),
}


@pytest.fixture(scope="module")
def built():
    from fa4_final.hopper.host import decode_recipe
    from fa4_final.runtime.compile import artifacts

    cache = {}

    def get(name, cluster=2):
        if (name, cluster) not in cache:
            d, consumers, kw, _ = BUILDS[name]
            cfg = replace(hopper_decode_default(d), consumers=consumers, cluster=cluster)
            cache[name, cluster] = artifacts(decode_recipe(d, config=cfg, **kw))["main"]
        return cache[name, cluster]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDS))
def test_decode_cluster_compile_protocol(built, name):
    """No spill, no stack, the registers of the build without the cluster. Each K and V tile:
    one arrive.expect_tx of the whole tile's bytes (both halves land in each CTA) and D / 64
    multicast TMA loads (this CTA's half of each 64-column box), addressed through the CTA's
    rank (%cluster_ctarank); each release a remote arrive (mapa, then mbarrier.arrive on the
    shared::cluster address); the barrier inits published by one relaxed cluster arrive and a
    cluster wait instead of the CTA's bar.sync 0; the producer's tail waits on EMPTY before it
    exits."""
    d, consumers, _, boxes = BUILDS[name]
    art, flat = built(name), built(name, cluster=1)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    art.forbid("ld.local", "st.local")
    assert art.registers <= flat.registers + 8, (art.resources(), flat.resources())
    ptx = art.ptx
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[^\s]+", ptx)
    assert len(loads) == 2 * boxes and all("multicast::cluster" in x for x in loads), loads
    assert not re.findall(r"multicast", flat.ptx)
    tile_bytes = 128 * d * 2
    expect = re.findall(r"mov\.b32\s+%r\d+,\s*(\d+);\s*\n\s*mbarrier\.arrive\.expect_tx", ptx)
    assert expect and {int(x) for x in expect} == {tile_bytes}, expect
    assert "%cluster_ctarank" in ptx and "%cluster_ctarank" not in flat.ptx
    assert art.count("mapa.shared::cluster") >= 2
    assert art.count("mbarrier.arrive.shared::cluster") == art.count("mapa.shared::cluster")
    assert art.count("barrier.cluster.arrive.relaxed") == 1
    assert art.count("barrier.cluster.wait") == 1
    assert art.count("fence.mbarrier_init.release.cluster") == 1
    syncs = re.findall(r"bar\.sync\s+([^;]+);", ptx)
    flat_syncs = re.findall(r"bar\.sync\s+([^;]+);", flat.ptx)
    assert len(syncs) == len(flat_syncs) - 1 and "0" not in [s.strip() for s in syncs], syncs
    # producer_tail: the producer waits on each stage's EMPTY of both rings once more
    waits = art.count("mbarrier.try_wait.parity")
    assert waits >= flat.count("mbarrier.try_wait.parity") + 2, (waits, flat)


@pytest.mark.slow
def test_decode_cluster_leaves_the_builds_without_it_unchanged(built):
    """cluster = 1 builds as before the knob existed: no cluster instruction at all."""
    for name in ("d128-contiguous-causal", "d64-contiguous-causal"):
        flat = built(name, cluster=1)
        flat.forbid("barrier.cluster", "mapa", "multicast", "%cluster_ctarank")


# ----------------------------------------------------------------------------------------------
# the pair's rings simulated (solutions.ch09_pipeline's event loop)

PAIR_BUGS = {
    "local_release": "a consumer warp releases a stage only in its own CTA (EMPTY counting one "
                     "CTA's warps): the peer's producer refills it while it is read",
    "own_half_bytes": "a FULL barrier expects only its own half's bytes: the consumer reads a "
                      "stage before the peer's half landed",
    "no_producer_tail": "the producer exits after its last load: the CTA may leave while the "
                        "peer still arrives on its barriers",
}


class PairSim:
    """Two CTAs of the pair walking the same key tiles n_hi - 1 .. n_lo: each producer loads
    half r of every K and V tile into both CTAs' stage (the multicast), each consumer reads both
    halves of its own copy, zeros its own V tail and releases the stage in both CTAs; each
    producer ends with the tail wait. Stage and arrival counts from HopperDecode.pipelines()."""

    def __init__(self, kernel, n_lo: int, n_hi: int, seqlen_k: int, seed: int,
                 mutate: str | None = None, timing=None):
        from solutions.ch09_pipeline import Barrier, Buffer, PipelineError, Sim

        if mutate is not None and mutate not in PAIR_BUGS:
            raise ValueError(f"mutate must be one of {sorted(PAIR_BUGS)}, got {mutate!r}")
        self.k, self.mutate, self.seqlen_k = kernel, mutate, seqlen_k
        self.tiles = [n_hi - 1 - i for i in range(max(n_hi - n_lo, 0))]
        self.sim = Sim(seed, timing)
        self.specs = {p.name: p for p in kernel.pipelines()}
        self.finished = {(c, role): False for c in (0, 1) for role in ("producer", "consumer")}
        pair = self

        class CtaBarrier(Barrier):  # an mbarrier of CTA ``owner``: nothing reaches it once
            def __init__(self, owner, *args):  # that CTA has exited
                super().__init__(*args)
                self.owner = owner

            def check(self, what):
                if pair.exited(self.owner):
                    raise PipelineError(f"t={pair.sim.now}: {what} on {self.name} after CTA "
                                        f"{self.owner} exited")

            def arrive(self, who, count=1, tx=0):
                self.check(f"{who} arrives")
                super().arrive(who, count, tx)

            def land(self, nbytes, phase, what):
                self.check(f"bytes of {what} land")
                super().land(nbytes, phase, what)

        self.bar, self.buf = {}, {}
        for c in (0, 1):
            for name, spec in self.specs.items():
                for s in range(spec.stages):
                    self.bar[c, name, "full", s] = CtaBarrier(
                        c, f"cta{c}.{name}.full[{s}]", spec.full_arrivals, self.sim)
                    empty = spec.empty_arrivals  # local_release: the count of one CTA
                    if mutate == "local_release":
                        empty //= 2
                    self.bar[c, name, "empty", s] = CtaBarrier(
                        c, f"cta{c}.{name}.empty[{s}]", empty, self.sim)
                    for half in (0, 1):
                        self.buf[c, name, s, half] = Buffer(
                            f"cta{c}.s{name.upper()}[{s}].half{half}", self.sim)
            self.sim.add(f"producer{c}", self.load(c))
            self.sim.add(f"consumer{c}", self.consume(c))

    def exited(self, c) -> bool:
        return self.finished[c, "producer"] and self.finished[c, "consumer"]

    def run(self):
        return self.sim.run()

    def load(self, c):
        from solutions.ch09_pipeline import PipelineState, Wait, busy

        me = f"producer{c}"
        states = {name: PipelineState.producer(spec.stages) for name, spec in self.specs.items()}
        halves = 1 if self.mutate == "own_half_bytes" else 2
        for n in self.tiles:
            for name in ("k", "v"):
                st = states[name]
                yield Wait(self.bar[c, name, "empty", st.index], st.phase)  # producer_acquire
                self.bar[c, name, "full", st.index].arrive(me, 1, tx=halves)  # expect_tx
                for dst in (0, 1):  # the multicast: half c into both CTAs
                    self.sim.tma_copy(self.buf[dst, name, st.index, c], (name.upper(), n),
                                      self.bar[dst, name, "full", st.index], 1,
                                      st.count // st.stages, me)
                yield busy(1, f"issue {name.upper()}[{n}] half {c}")
                st.advance()
        if self.mutate != "no_producer_tail":
            for name, st in states.items():  # producer_tail
                for _ in range(st.stages):
                    yield Wait(self.bar[c, name, "empty", st.index], st.phase)
                    st.advance()
        self.finished[c, "producer"] = True

    def consume(self, c):
        from solutions.ch09_pipeline import PipelineState, Wait, busy

        me = f"consumer{c}"
        warps = self.specs["k"].empty_arrivals // 2  # lanes 0 and 1 of each warp: one a CTA
        targets = (c,) if self.mutate == "local_release" else (0, 1)
        states = {name: PipelineState(spec.stages) for name, spec in self.specs.items()}
        for i, n in enumerate(self.tiles):
            for name in ("k", "v"):
                st = states[name]
                yield Wait(self.bar[c, name, "full", st.index], st.phase)
                halves = [self.buf[c, name, st.index, h] for h in (0, 1)]
                version = (name.upper(), n)
                if name == "v" and i == 0 and self.seqlen_k - n * self.k.tile_n < self.k.tile_n:
                    for h in halves:  # the V tail's zeros, in this CTA's copy
                        h.start_write(me)
                    yield busy(self.sim.ticks("store_p"), f"zeros V[{n}]")
                    version = ("V", n, "zeroed")
                    for h in halves:
                        h.end_write(me, version)
                for h in halves:
                    h.start_read(me, version)
                yield busy(self.sim.ticks("mma"), f"{name.upper()}[{n}]")
                for h in halves:
                    h.end_read(me)
                for dst in targets:  # consumer_release
                    self.bar[dst, name, "empty", st.index].arrive(me, warps)
                st.advance()
                if name == "k":
                    yield busy(self.sim.ticks("softmax"), f"softmax[{n}]")
        self.finished[c, "consumer"] = True


def pair_problems():
    """(stages, n_lo, n_hi, seqlen_k): every split of a pair's block, partial and full last
    tiles, an empty split."""
    out = []
    for stages in (1, 2, 3):
        for seqlen_k, splits in ((1, 1), (129, 1), (1000, 3), (4096, 5), (300, 7)):
            n_end, _ = block_key_tiles(0, 256, 128, 16, 16, seqlen_k, True)
            for split in range(splits):
                n_lo, n_hi = split_key_tiles(split, splits, seqlen_k, 128, n_end)
                out.append((stages, n_lo, n_hi, seqlen_k))
    return out


def pair_kernel(stages):
    import cutlass

    from fa4_final.hopper.decode import HopperDecode

    return HopperDecode(cutlass.BFloat16, 128, True, replace(pair(), stages=stages))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_decode_cluster_rings_never_deadlock_overwrite_go_stale_or_outlive(stages):
    """Every problem under 12 seeds of random timings: both CTAs finish, no stage is refilled
    while either CTA reads it, every read sees its tile (the V tail zeroed), no arrive or byte
    reaches a CTA after it exited."""
    from tests.test_decode_pipeline import TIMINGS

    kernel = pair_kernel(stages)
    for _, n_lo, n_hi, seqlen_k in [p for p in pair_problems() if p[0] == stages]:
        for seed in range(12):
            sim = PairSim(kernel, n_lo, n_hi, seqlen_k, seed,
                          timing=TIMINGS[seed % len(TIMINGS)]).run()
            assert all(a.done for a in sim.agents)


@pytest.mark.parametrize("bug", sorted(PAIR_BUGS))
def test_decode_cluster_planted_mistakes_are_caught(bug):
    from tests.test_decode_pipeline import caught_errors

    kernel = pair_kernel(2)
    caught = caught_errors(lambda n_lo, n_hi, seqlen_k, seed, timing: PairSim(
        kernel, n_lo, n_hi, seqlen_k, seed, mutate=bug, timing=timing).run(),
        [p for p in pair_problems() if p[0] == 2])
    assert caught, f"{bug} ({PAIR_BUGS[bug]}) was never caught"
    # caught as what it is, not as some other failure (a deadlock of a wrong count)
    want = {"local_release": "Overwrite: ", "own_half_bytes": "landed on",
            "no_producer_tail": "exited"}[bug]
    assert any(want in m for m in caught), caught[:3]
