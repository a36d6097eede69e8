"""The Hopper decode kernel's K and V rings simulated on the CPU (solutions.ch09_pipeline's event
loop): its producer warp and consumer warpgroup replayed as generators that wait and arrive where
fa4_final.hopper.decode.HopperDecode.load and .step do, with the stage and arrival counts of the
kernel's own ``pipelines()`` and the key tiles of fa4_final.common.decode_index, under random
operation times. Checked: no deadlock, no stage overwritten while read, every read sees the tile
it expects, and the zeros over the last V tile's rows (Note [Keys past the cached length]) are
written after the tile landed and before anything reads or refills the stage. Planted mistakes
are caught."""

import pytest

from fa4_final.common.constants import WARP_SIZE
from fa4_final.common.decode_index import block_key_tiles, split_key_tiles
from fa4_final.hopper.config import HopperDecodeConfig
from fa4_final.hopper.decode import HopperDecode
from solutions.ch09_pipeline import (
    Barrier,
    Buffer,
    PipelineError,
    PipelineState,
    Sim,
    Timing,
    Wait,
    busy,
)

BUGS = {
    "release_k_before_s": "the consumer frees a K stage before its S = Q K^T has read it",
    "zeros_after_release": "the consumer writes the V tail's zeros after freeing the stage",
    "thread_arrivals": "EMPTY counts one arrival per consumer thread, but lane 0 of each warp "
                       "arrives",
    "no_v_wait": "the consumer reads V without waiting for its FULL barrier",
}


class DecodeSim:
    """One CTA of the decode kernel: its split's key tiles n_hi - 1 .. n_lo."""

    def __init__(self, kernel: HopperDecode, n_lo: int, n_hi: int, seqlen_k: int, seed: int,
                 mutate: str | None = None, timing: Timing | None = None):
        if mutate is not None and mutate not in BUGS:
            raise ValueError(f"mutate must be one of {sorted(BUGS)}, got {mutate!r}")
        self.k, self.mutate = kernel, mutate
        self.tiles = [n_hi - 1 - i for i in range(max(n_hi - n_lo, 0))]
        self.seqlen_k = seqlen_k
        self.sim = Sim(seed, timing)
        self.specs = {p.name: p for p in kernel.pipelines()}
        self.bar, self.buf = {}, {}
        for name, spec in self.specs.items():
            for s in range(spec.stages):
                empty = spec.empty_arrivals
                if mutate == "thread_arrivals":
                    empty *= WARP_SIZE
                self.bar[name, "full", s] = Barrier(f"{name}.full[{s}]", spec.full_arrivals,
                                                    self.sim)
                self.bar[name, "empty", s] = Barrier(f"{name}.empty[{s}]", empty, self.sim)
                self.buf[name, s] = Buffer(f"s{name.upper()}[{s}]", self.sim)
        self.sim.add("producer", self.load())
        self.sim.add("consumer", self.consume())

    def run(self) -> Sim:
        return self.sim.run()

    # ---- HopperDecode.load / load_one: K[n] then V[n], n from the top down
    def load(self):
        me = "producer"
        states = {name: PipelineState.producer(spec.stages) for name, spec in self.specs.items()}
        for n in self.tiles:
            for name in ("k", "v"):
                st = states[name]
                yield Wait(self.bar[name, "empty", st.index], st.phase)  # producer_acquire
                full = self.bar[name, "full", st.index]
                full.arrive(me, self.specs[name].full_arrivals, tx=1)  # arrive_expect_tx
                self.sim.tma_copy(self.buf[name, st.index], (name.upper(), n), full, 1,
                                  st.count // st.stages, me)
                yield busy(1, f"issue {name.upper()}[{n}]")
                st.advance()

    # ---- HopperDecode.step (and zero_v_tail), once per key tile
    def consume(self):
        me = "consumer"
        warps = self.specs["k"].empty_arrivals  # lane 0 of each consumer warp arrives
        sk = PipelineState(self.specs["k"].stages)
        sv = PipelineState(self.specs["v"].stages)
        tile_n = self.k.tile_n
        for i, n in enumerate(self.tiles):
            k_buf, v_buf = self.buf["k", sk.index], self.buf["v", sv.index]
            yield Wait(self.bar["k", "full", sk.index], sk.phase)
            if self.mutate == "release_k_before_s":
                self.bar["k", "empty", sk.index].arrive(me, warps)
            k_buf.start_read(me, ("K", n))  # wgmma S = Q K^T, then wait_group(0)
            yield busy(self.sim.ticks("mma"), f"S[{n}]")
            k_buf.end_read(me)
            if self.mutate != "release_k_before_s":
                self.bar["k", "empty", sk.index].arrive(me, warps)  # consumer_release
            sk.advance()
            yield busy(self.sim.ticks("softmax"), f"softmax[{n}]")  # mask, softmax, P
            if self.mutate != "no_v_wait":
                yield Wait(self.bar["v", "full", sv.index], sv.phase)
            tail = i == 0 and self.seqlen_k - n * tile_n < tile_n
            version = ("V", n)
            if tail and self.mutate != "zeros_after_release":
                v_buf.start_write(me)  # zeros over the rows past seqlen_k, fence, bar.sync
                yield busy(self.sim.ticks("store_p"), f"zeros V[{n}]")
                version = ("V", n, "zeroed")
                v_buf.end_write(me, version)
            v_buf.start_read(me, version)  # wgmma O += P V, then wait_group(0)
            yield busy(self.sim.ticks("mma"), f"PV[{n}]")
            v_buf.end_read(me)
            self.bar["v", "empty", sv.index].arrive(me, warps)
            if tail and self.mutate == "zeros_after_release":
                v_buf.start_write(me)
                yield busy(self.sim.ticks("store_p"), f"zeros V[{n}]")
                v_buf.end_write(me, ("V", n, "zeroed"))
            sv.advance()


def cta_problems():
    """(stages, n_lo, n_hi, seqlen_k) of CTAs of several decode launches: every split of an
    m-block, key lengths whose last tile is partial or full, 1 to 4 stages."""
    out = []
    for stages in (1, 2, 3, 4):
        for seqlen_k, splits in ((1, 1), (129, 1), (1000, 1), (1000, 3), (4096, 5), (300, 7)):
            n_end, _ = block_key_tiles(0, 64, 128, 8, 1, seqlen_k, True)
            for split in range(splits):
                n_lo, n_hi = split_key_tiles(split, splits, seqlen_k, 128, n_end)
                out.append((stages, n_lo, n_hi, seqlen_k))
    return out


# the TMA sometimes far slower than the consumer's work, sometimes far faster
TIMINGS = (Timing(), Timing(tma=(1, 60)), Timing(tma=(1, 2), mma=(5, 20), softmax=(5, 20)))


def kernel_of(stages: int) -> HopperDecode:
    import cutlass

    return HopperDecode(cutlass.BFloat16, 64, True, HopperDecodeConfig(stages=stages))


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_rings_never_deadlock_overwrite_or_go_stale(stages):
    kernel = kernel_of(stages)
    cases = [c for c in cta_problems() if c[0] == stages]
    for _, n_lo, n_hi, seqlen_k in cases:
        for seed in range(12):
            timing = TIMINGS[seed % len(TIMINGS)]
            sim = DecodeSim(kernel, n_lo, n_hi, seqlen_k, seed, timing=timing).run()
            assert all(a.done for a in sim.agents)


def test_the_simulated_rings_are_the_kernels():
    """Stage and arrival counts come from HopperDecode.pipelines(): FULL completes with the TMA
    warp's one arrive (and the bytes), EMPTY with one arrive per consumer warp."""
    kernel = kernel_of(3)
    specs = {p.name: p for p in kernel.pipelines()}
    assert set(specs) == {"k", "v"}
    for spec in specs.values():
        assert (spec.kind, spec.stages, spec.full_arrivals, spec.empty_arrivals) == \
            ("tma_async", 3, 1, 4)


def caught_errors(run, problems, seeds: int = 12) -> list[str]:
    """The PipelineErrors (``Kind: message``) of ``run(n_lo, n_hi, seqlen_k, seed, timing)``
    over every (stages, n_lo, n_hi, seqlen_k) problem and seed, TIMINGS taken in turn."""
    caught = []
    for _, n_lo, n_hi, seqlen_k in problems:
        for seed in range(seeds):
            try:
                run(n_lo, n_hi, seqlen_k, seed, TIMINGS[seed % len(TIMINGS)])
            except PipelineError as exc:
                caught.append(f"{type(exc).__name__}: {exc}")
    return caught


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_mistakes_are_caught(bug):
    kernel = kernel_of(2)
    caught = caught_errors(lambda n_lo, n_hi, seqlen_k, seed, timing: DecodeSim(
        kernel, n_lo, n_hi, seqlen_k, seed, mutate=bug, timing=timing).run(),
        [c for c in cta_problems() if c[0] == 2])
    assert caught, f"{bug} ({BUGS[bug]}) was never caught"
