"""Chapter 09: the Blackwell kernels' protocol pieces that a Hopper GPU can run, as small probes.

No Blackwell GPU exists here, so the sm_100 kernels are checked by compiling them. But several of
the rules they depend on are sm_90 rules too, and a probe kernel built for sm_90a runs them for
real on the H200 (tests/gpu/test_protocol_probes.py); tests/test_protocol_probes_compile.py
builds each one on a CPU first.

``RegisterPlanProbe``   a CTA of 8, 12 or 16 warps whose warps run the ``setmaxnreg`` plan of a
                        kernel's role table (``kernel_plans``: the Blackwell forward and
                        backward, the Hopper forward and backward), then each write a flag. A
                        plan within every SM sub-partition's 512 registers per thread slot
                        finishes; one over it waits forever in ``setmaxnreg.inc``
                        (``OLD_BWD_PLAN``, run only on request: ``PROBE_HANG=1``).
``DsExchangeProbe``     a cluster of 2 CTAs doing the pair backward's dS exchange in miniature,
                        with the backward's own steps (fa4_final.blackwell.peer): each CTA
                        arms the peer's mbarrier, fences, and stores a 16 KB tile into the
                        peer's shared memory with st.async, step after step into the same
                        buffer; the peer waits (acquire, cluster scope), fences and copies the
                        tile to global memory with a bulk store (an async-proxy reader, as the
                        MMA is), then frees the buffer for the writer; the follower relays each
                        step to the leader, as the pair's MMA warp does. Ends with a cluster
                        barrier (no CTA leaves while its peer may touch its shared memory).
``MulticastProbe``      a cluster of 2 CTAs filled by multicast TMA: one load with mask 0b11
                        lands in both CTAs' shared memory and completes both CTAs' barriers;
                        each copies its tile out. Ends with a cluster barrier too.

A hung probe would block the GPU, so the GPU test runs the register plans in a subprocess
(``python -m solutions.ch09_protocol_probes plans``) that polls each launch with a deadline and
exits when it passes; the test kills the subprocess if it outlives its timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from fa4_final.blackwell import peer
from fa4_final.common import register_plan as rp
from fa4_final.common.constants import WARP_SIZE
from fa4_final.common.recipe import fake_stream, fake_tensor
from fa4_final.runtime.compile import compile_kernel

ARCH = "sm_90a"
PTXAS_ENTRY_MAX = 255  # registers a thread may use; a 256-thread CTA is launched with 255

# The Blackwell backward's plan before it was checked per sub-partition: compute 176 (warps 0-7),
# dQ 80 (8-11), the MMA warp raised to 160, the load warp lowered to 48 and the two spare warps
# to 24. Its CTA total fits the SM (63488 of 65536 registers), but sub-partition 0 (warps 0, 4,
# 8, 12) needs 176 + 176 + 80 + 160 = 592 registers per thread slot.
OLD_BWD_PLAN = (176,) * 8 + (80,) * 4 + (160, 48, 24, 24)


# ================================================================================================
# The plans of the real kernels
# ================================================================================================
def kernel_plans() -> dict[str, tuple[tuple[int, ...], int]]:
    """{kernel: (the setmaxnreg budget of each warp, threads)} from the role tables of the
    package's kernel objects, built on the CPU (nothing compiles): the Blackwell forward (1- and
    2-CTA) and backward (1-CTA and pair), the Hopper forward (1, 2, 3 consumer warpgroups) and
    backward."""
    from fa4_final.blackwell.bwd import BlackwellBackward
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair
    from fa4_final.blackwell.config import BlackwellBwdConfig, BlackwellFwdConfig
    from fa4_final.blackwell.fwd import BlackwellForward
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.hopper.bwd import HopperBackward
    from fa4_final.hopper.config import HopperBwdConfig, HopperFwdConfig
    from fa4_final.hopper.fwd import HopperForward

    bf16 = CUTLASS_BY_NAME["bf16"]
    kernels = {
        "blackwell fwd 1-CTA": BlackwellForward(bf16, 128, False, BlackwellFwdConfig()),
        "blackwell fwd 2-CTA": BlackwellForward(bf16, 128, False,
                                                BlackwellFwdConfig(two_cta=True)),
        "blackwell bwd 1-CTA": BlackwellBackward(bf16, 128, False, BlackwellBwdConfig()),
        "blackwell bwd pair": BlackwellBackwardPair(bf16, 128, False,
                                                    BlackwellBwdConfig(two_cta=True)),
        "hopper fwd 1 consumer": HopperForward(bf16, 128, False, HopperFwdConfig(
            num_consumer_wgs=1, pingpong=False)),
        "hopper fwd 2 consumers": HopperForward(bf16, 128, False,
                                                HopperFwdConfig(num_consumer_wgs=2)),
        "hopper fwd 3 consumers": HopperForward(bf16, 64, False,
                                                HopperFwdConfig(num_consumer_wgs=3)),
        "hopper bwd": HopperBackward(bf16, 128, False, HopperBwdConfig()),
    }
    out = {}
    for name, k in kernels.items():
        threads = getattr(k, "num_threads", None) or 512  # the Blackwell kernels: 16 warps
        budgets = rp.warp_budgets(k.roles)
        out[name] = (tuple(budgets[w] for w in range(threads // WARP_SIZE)), threads)
    return out


def plan_fits(plan: tuple[int, ...], threads: int) -> bool:
    return not rp.problems(dict(enumerate(plan)), threads)


# ================================================================================================
# a. setmaxnreg plans
# ================================================================================================
def _runs(plan: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first warp, end warp, budget) of each run of equal budgets inside a warpgroup: one
    branch per warpgroup where the warpgroup is uniform, as the kernels have it."""
    out = []
    for w, r in enumerate(plan):
        if out and out[-1][2] == r and w % rp.WARPS_PER_WARPGROUP and out[-1][1] == w:
            out[-1] = (out[-1][0], w + 1, r)
        else:
            out.append((w, w + 1, r))
    return out


class RegisterPlanProbe:
    """One CTA per SM of ``len(plan)`` warps, launched with one CTA an SM (so each thread starts
    with ``register_plan.launch_registers`` registers); warp w runs ``setmaxnreg`` to
    ``plan[w]`` (.inc above its launch registers, .dec otherwise), then lane 0 writes
    ``token + w`` to flag (cta, w)."""

    def __init__(self, plan: tuple[int, ...]):
        self.plan = tuple(int(r) for r in plan)
        self.threads = WARP_SIZE * len(self.plan)
        self.entry = min(rp.launch_registers(self.threads), PTXAS_ENTRY_MAX)

    @cute.jit
    def __call__(self, mFlags: cute.Tensor, token: Int32, stream):
        self.kernel(mFlags, token).launch(grid=[mFlags.shape[0], 1, 1],
                                          block=[self.threads, 1, 1], stream=stream,
                                          min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mFlags: cute.Tensor, token: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        runs = _runs(self.plan)
        for i in cutlass.range_constexpr(len(runs)):
            if warp >= runs[i][0] and warp < runs[i][1]:
                if cutlass.const_expr(runs[i][2] > self.entry):
                    cute.arch.setmaxregister_increase(runs[i][2])
                else:
                    cute.arch.setmaxregister_decrease(runs[i][2])
                if cute.arch.lane_idx() == 0:
                    mFlags[cta, warp] = token + warp


def compile_register_probe(plan, arch: str = ARCH, keep: bool = False):
    """(compiled, artifacts or None) of the probe for ``plan``: flags (ctas, warps) int32."""
    k = RegisterPlanProbe(plan)
    flags = fake_tensor(Int32, (cute.sym_int(), len(k.plan)))
    return compile_kernel(k, flags, Int32(0), fake_stream(), arch=arch, keep=keep)


def run_register_plan(plan, deadline_s: float = 10.0, ctas: int | None = None,
                      seed: int | None = None, arch: str = ARCH) -> dict:
    """Launch the probe for ``plan`` on the current GPU (one CTA per SM unless ``ctas``) and
    poll it until ``deadline_s`` after the launch. Returns {"status": "finished" | "hung",
    "seconds": ..., "bad_flags": [(cta, warp, value), ...] (the first few)}. A hung launch
    cannot be taken back: the caller's process must exit (``main`` does)."""
    import torch

    compiled, _ = compile_register_probe(plan, arch)
    n = ctas or torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**31)
    token = int(torch.randint(1 << 20, 1 << 30, (1,), generator=gen))
    flags = torch.full((n, len(plan)), -1, dtype=torch.int32, device="cuda")  # poisoned
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    t0 = time.perf_counter()
    compiled(flags, token)
    done.record()
    while not done.query():
        if time.perf_counter() - t0 > deadline_s:
            return {"status": "hung", "seconds": time.perf_counter() - t0, "bad_flags": []}
        time.sleep(0.01)
    seconds = time.perf_counter() - t0
    want = token + torch.arange(len(plan), dtype=torch.int32, device="cuda")
    bad = (flags != want).nonzero().tolist()
    return {"status": "finished", "seconds": seconds,
            "bad_flags": [(c, w, int(flags[c, w])) for c, w in bad[:8]],
            "bad_count": len(bad), "ctas": n}


# ================================================================================================
# b. the dS exchange of the pair backward
# ================================================================================================
EXCHANGE_THREADS = 128  # one warpgroup writes, as in the pair backward
EXCHANGE_WORDS = EXCHANGE_THREADS * 32  # 16 KB of int32: 128 bytes (8 st.async.v4) a thread
EXCHANGE_BYTES = 4 * EXCHANGE_WORDS
READER_WARP = EXCHANGE_THREADS // WARP_SIZE  # the warp after the writers reads and relays
LEADER = 0


class DsExchangeProbe:
    """A grid of 2-CTA clusters; CTA r (rank in its cluster) has a 16 KB buffer, mbarriers full
    (the peer's bytes are here), free (the peer has read the bytes this CTA sent) and relay
    (leader: the follower's full completed). ``steps`` times: warps 0-3 of CTA r send tile
    mIn[cta, step] into the peer's buffer (peer.fence_before_peer_store, peer.arm_peer,
    peer.store_peer_v4, after waiting for ``free`` from the second step on); warp 4 waits for
    the peer's tile (peer.wait_peer_bytes), relays (follower) or waits for the relay (leader,
    records ``token + step`` in mRelay), copies the buffer to mOut[cta, step] with a bulk store,
    waits until the store has read it and frees it for the peer (peer.relay_arrive on the
    peer's ``free``). A cluster barrier ends the kernel."""

    def __init__(self, steps: int = 4):
        self.steps = steps
        self.threads = EXCHANGE_THREADS + WARP_SIZE

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, mRelay: cute.Tensor, token: Int32,
                 stream):
        @cute.struct
        class Storage:
            full: cutlass.Int64
            free: cutlass.Int64
            relay: cutlass.Int64
            buf: cute.struct.Align[cute.struct.MemRange[Int32, EXCHANGE_WORDS], 128]

        self.kernel(mIn, mOut, mRelay, token, Storage).launch(
            grid=[mIn.shape[0], 1, 1], block=[self.threads, 1, 1], cluster=(2, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mIn: cute.Tensor, mOut: cute.Tensor, mRelay: cute.Tensor, token: Int32,
               Storage: cutlass.Constexpr):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        r = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        other = 1 - r
        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        full, free, relay = storage.full.ptr, storage.free.ptr, storage.relay.ptr
        buf = storage.buf.get_tensor(cute.make_layout(EXCHANGE_WORDS))
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(full, 1)  # the peer's arm_peer, plus its bytes
                cute.arch.mbarrier_init(free, 1)  # the peer's reader
                cute.arch.mbarrier_init(relay, 1)  # leader: the follower's reader
        # every barrier initialised before either CTA touches the peer's (Note [Allocator
        # barrier first] of fa4_final.blackwell.fwd: inits, fence, cluster arrive, wait)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
        if warp < READER_WARP:
            for step in cutlass.range(self.steps, unroll=1):
                if step > 0:  # the peer has read what this CTA sent last step
                    peer.wait_acquire_cluster(free, (step - 1) % 2)
                peer.fence_before_peer_store()
                if tidx == 0:
                    peer.arm_peer(full, EXCHANGE_BYTES, other)
                src = mIn[cta, step, None]
                base = buf.iterator.toint()
                for j in cutlass.range_constexpr(8):  # 8 x 16 bytes a thread
                    w = 32 * tidx + 4 * j
                    peer.store_peer_v4(base + 4 * w, (src[w], src[w + 1], src[w + 2],
                                                      src[w + 3]), full, other)
        if warp == READER_WARP:
            for step in cutlass.range(self.steps, unroll=1):
                if r == LEADER:  # as the pair's leader MMA warp: both waits, one fence
                    peer.wait_acquire_cluster(full, step % 2)
                    peer.wait_peer_bytes(relay, step % 2)
                    if cute.arch.lane_idx() == 0:
                        mRelay[cta // 2, step] = token + step
                else:  # as the follower's relay
                    peer.wait_peer_bytes(full, step % 2)
                    with cute.arch.elect_one():
                        peer.relay_arrive(relay, Int32(LEADER))
                with cute.arch.elect_one():
                    bulk_store(mOut[cta, step, None].iterator, buf.iterator, EXCHANGE_BYTES)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    peer.relay_arrive(free, other)  # the writer of the peer may go on
            with cute.arch.elect_one():
                cute.arch.cp_async_bulk_wait_group(0, read=False)
        # no CTA leaves while the peer may still write its buffer or arrive on its barriers
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


def bulk_store(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, nbytes: int) -> None:
    """``nbytes`` from shared to global memory by the TMA unit (async proxy), one thread."""
    cute.arch.inline_ptx("cp.async.bulk.global.shared::cta.bulk_group [{$r0}], [{$r1}], {$r2};",
                         read_only_args=[gmem_ptr, smem_ptr, Int32(nbytes)])


def compile_exchange_probe(steps: int = 4, arch: str = ARCH, keep: bool = False):
    k = DsExchangeProbe(steps)
    n = cute.sym_int(divisibility=2)
    t_in = fake_tensor(Int32, (n, steps, EXCHANGE_WORDS), divisibility=4)
    t_out = fake_tensor(Int32, (n, steps, EXCHANGE_WORDS), divisibility=4)
    t_relay = fake_tensor(Int32, (cute.sym_int(), steps))
    return compile_kernel(k, t_in, t_out, t_relay, Int32(0), fake_stream(), arch=arch,
                          keep=keep)


def run_ds_exchange(clusters: int = 8, steps: int = 4, seed: int | None = None,
                    arch: str = ARCH) -> list[str]:
    """Run the exchange probe on the current GPU with fresh random tiles; return the problems
    found (empty: every CTA received its peer's tile of every step, and every leader saw every
    relay)."""
    import torch

    compiled, _ = compile_exchange_probe(steps, arch)
    gen = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**31)
    ctas = 2 * clusters
    x = torch.randint(-2**31, 2**31 - 1, (ctas, steps, EXCHANGE_WORDS), generator=gen,
                      dtype=torch.int32).cuda()
    out = torch.full_like(x, 0x5A5A5A5A)  # poisoned
    relay = torch.full((clusters, steps), -1, dtype=torch.int32, device="cuda")
    token = int(torch.randint(1 << 20, 1 << 30, (1,), generator=gen))
    compiled(x, out, relay, token)
    torch.cuda.synchronize()
    want = x.view(clusters, 2, steps, -1).flip(1).reshape(ctas, steps, -1)  # the peer's tile
    problems = []
    for c in range(ctas):
        for s in range(steps):
            bad = (out[c, s] != want[c, s]).nonzero().flatten()
            if len(bad):
                problems.append(f"CTA {c} (rank {c % 2}) step {s}: {len(bad)} of "
                                f"{EXCHANGE_WORDS} words differ from its peer's tile, first at "
                                f"word {int(bad[0])}: {int(out[c, s, bad[0]]):#x} instead of "
                                f"{int(want[c, s, bad[0]]):#x}")
    seen = relay.cpu()
    for c in range(clusters):
        for s in range(steps):
            if int(seen[c, s]) != token + s:
                problems.append(f"cluster {c} step {s}: the leader recorded {int(seen[c, s])} "
                                f"for the follower's relay, not {token + s}")
    return problems


# ================================================================================================
# c. multicast TMA into a pair
# ================================================================================================
MC_ROWS, MC_COLS = 64, 64  # one int32 tile, 16 KB


class MulticastProbe:
    """A grid of 2-CTA clusters; cluster c loads tile c of mIn (MC_ROWS x MC_COLS int32) with
    TMA multicast into both CTAs' shared memory. ``leader_only``: the leader issues one load of
    the whole tile with mask 0b11; otherwise each CTA loads half and multicasts it (the
    split kernels use). Each CTA's barrier expects the whole tile's bytes; each CTA copies its
    shared tile to mOut[cta]. A cluster barrier ends the kernel."""

    def __init__(self, leader_only: bool = True):
        self.leader_only = leader_only
        self.threads = 128

    @cute.jit
    def __call__(self, mIn: cute.Tensor, mOut: cute.Tensor, stream):
        smem_layout = cute.make_layout((MC_ROWS, MC_COLS), stride=(MC_COLS, 1))
        op = cpasync.CopyBulkTensorTileG2SMulticastOp()
        atom, tma_in = cpasync.make_tiled_tma_atom(
            op, mIn, smem_layout, (MC_ROWS, MC_COLS), num_multicast=1 if self.leader_only else 2)

        @cute.struct
        class Storage:
            full: cutlass.Int64
            tile: cute.struct.Align[cute.struct.MemRange[Int32, MC_ROWS * MC_COLS], 128]

        self.kernel(atom, tma_in, mOut, smem_layout, Storage).launch(
            grid=[2 * (mIn.shape[0] // MC_ROWS), 1, 1], block=[self.threads, 1, 1],
            cluster=(2, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, atom: cute.CopyAtom, tma_in: cute.Tensor, mOut: cute.Tensor,
               smem_layout: cute.Layout, Storage: cutlass.Constexpr):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        r = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        full = storage.full.ptr
        sTile = storage.tile.get_tensor(smem_layout)
        if warp == 0:
            cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(full, 1)
                # each CTA's barrier counts the whole tile: multicast completes both
                cute.arch.mbarrier_arrive_and_expect_tx(full, 4 * MC_ROWS * MC_COLS)
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()  # both barriers armed before any byte lands
        cute.arch.cluster_wait()
        gTile = cute.local_tile(tma_in, (MC_ROWS, MC_COLS), (cta // 2, 0))
        if warp == 0:
            if cutlass.const_expr(self.leader_only):
                if r == LEADER:
                    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(sTile, 0, 2),
                                                   cute.group_modes(gTile, 0, 2))
                    cute.copy(atom, tG, tS, tma_bar_ptr=full, mcast_mask=cutlass.Int16(0b11))
            else:
                tS, tG = cpasync.tma_partition(atom, r, cute.make_layout(2),
                                               cute.group_modes(sTile, 0, 2),
                                               cute.group_modes(gTile, 0, 2))
                cute.copy(atom, tG, tS, tma_bar_ptr=full, mcast_mask=cutlass.Int16(0b11))
        cute.arch.mbarrier_wait(full, 0)
        for i in cutlass.range(tidx, MC_ROWS * MC_COLS, self.threads, unroll=1):
            mOut[cta, i] = sTile[i // MC_COLS, i % MC_COLS]
        # the peer's multicast may still be writing here until both have seen their tile
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


def compile_multicast_probe(leader_only: bool = True, arch: str = ARCH, keep: bool = False):
    k = MulticastProbe(leader_only)
    rows = cute.sym_int(divisibility=MC_ROWS)
    t_in = fake_tensor(Int32, (rows, MC_COLS), divisibility=4)
    t_out = fake_tensor(Int32, (cute.sym_int(), MC_ROWS * MC_COLS), divisibility=4)
    return compile_kernel(k, t_in, t_out, fake_stream(), arch=arch, keep=keep)


def run_multicast(leader_only: bool = True, clusters: int = 8, seed: int | None = None,
                  arch: str = ARCH) -> list[str]:
    """Run the multicast probe with fresh random tiles; return the problems found (empty: both
    CTAs of every cluster hold their cluster's tile)."""
    import torch

    compiled, _ = compile_multicast_probe(leader_only, arch)
    gen = torch.Generator().manual_seed(seed if seed is not None else time.time_ns() % 2**31)
    x = torch.randint(-2**31, 2**31 - 1, (clusters * MC_ROWS, MC_COLS), generator=gen,
                      dtype=torch.int32).cuda()
    out = torch.full((2 * clusters, MC_ROWS * MC_COLS), 0x5A5A5A5A, dtype=torch.int32,
                     device="cuda")  # poisoned
    compiled(x, out)
    torch.cuda.synchronize()
    problems = []
    for c in range(2 * clusters):
        want = x[(c // 2) * MC_ROWS:(c // 2 + 1) * MC_ROWS].flatten()
        bad = (out[c] != want).nonzero().flatten()
        if len(bad):
            problems.append(f"CTA {c} (rank {c % 2}, cluster {c // 2}): {len(bad)} of "
                            f"{MC_ROWS * MC_COLS} words differ from the cluster's tile, first "
                            f"at word {int(bad[0])}: {int(out[c, bad[0]]):#x} instead of "
                            f"{int(want[bad[0]]):#x}")
    return problems


# ================================================================================================
# the subprocess the GPU test runs
# ================================================================================================
def device_arch() -> str:
    """The arch to build the probes for on this GPU: sm_90a (Hopper) or sm_100a (Blackwell)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) == (9, 0):
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    raise RuntimeError(f"the probes need an sm_90 or sm_100 GPU, this one is sm_{major}{minor}")


def main(argv=None) -> int:
    """One JSON line per probe, flushed as each finishes.

    ``plans``: the register-plan probe of each kernel's plan (``--hang``: OLD_BWD_PLAN only).
    A plan that does not finish within ``--deadline`` seconds of its launch is reported as hung
    and the process exits at once (status 3): the launch cannot be taken back.
    ``exchange``: the dS exchange probe; ``multicast``: both multicast probes (leader only,
    split). Each reports the problems it found (none: [])."""
    ap = argparse.ArgumentParser(prog="python -m solutions.ch09_protocol_probes")
    ap.add_argument("what", choices=["plans", "exchange", "multicast"])
    ap.add_argument("--hang", action="store_true", help="run OLD_BWD_PLAN only (it hangs)")
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    arch = device_arch()
    if args.what == "exchange":
        print(json.dumps({"probe": "exchange", "arch": arch,
                          "problems": run_ds_exchange(seed=args.seed, arch=arch)}), flush=True)
        return 0
    if args.what == "multicast":
        for leader_only in (True, False):
            print(json.dumps({"probe": f"multicast {'leader' if leader_only else 'split'}",
                              "arch": arch, "problems": run_multicast(
                                  leader_only, seed=args.seed, arch=arch)}), flush=True)
        return 0
    if args.hang:
        plans = {"old blackwell bwd": (OLD_BWD_PLAN, WARP_SIZE * len(OLD_BWD_PLAN))}
    else:
        plans = kernel_plans()
    done: dict[tuple, dict] = {}
    for name, (plan, threads) in plans.items():
        row = {"plan": name, "arch": arch, "budgets": list(plan), "threads": threads,
               "fits": plan_fits(plan, threads)}
        if plan not in done:  # kernels with the same plan run it once
            done[plan] = run_register_plan(plan, args.deadline, seed=args.seed, arch=arch)
        row.update(done[plan])
        print(json.dumps(row), flush=True)
        if row["status"] == "hung":
            os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
