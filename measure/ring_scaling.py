"""Ring attention across GPUs: correctness against one GPU, then scaling from 1 to N GPUs.

    python -m measure.ring_scaling [--seqlens 131072,262144,524288,1048576] [--rounds 3]

Needs at least 2 CUDA GPUs of one host (it refuses, saying so, with fewer). One process per GPU
(solutions.ch14_ring.launch, NCCL). In one run:

1. correctness: the ring with fa4_final's kernels (solutions.ch14_ring.fa4_block_forward /
   fa4_block_backward) on all GPUs against fa4_final on one GPU, forward and gradients, bf16,
   causal, at a length that fits one GPU;
2. scaling: forward and forward + backward of one causal problem (D = 128, bf16) on
   W = 1, 2, 4, ... GPUs for each sequence length that fits, in interleaved rounds, three ways
   (32 heads, MHA: the same problem for all three):
   - ``fa4_final_ring``: this chapter's ring with fa4_final's kernels;
   - ``torch_cp_cudnn``: PyTorch's ``context_parallel`` (its own ring over SDPA, head-tail load
     balance, rotate method "alltoall") with SDPA's cuDNN backend; at W = 1 plain SDPA;
   - ``torch_cp_fa4_final``: the same with fa4_final registered as SDPA's flash implementation
     (solutions.ch14_ring.activate_fa4_sdpa); skipped, with the reason stored in the file,
     while fa4_final has no SDPA registration.
   Rows keep the slowest rank's median time over rounds, every round, and TFLOP/s of the whole
   problem (4 B H S^2 D / 2 forward, x 3.5 forward + backward).

Writes results/h200x<N>/ring_scaling.json (N the GPUs used), with provenance.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from solutions import ch14_ring as ring
from utils import results

PRODUCES = [
    ("results/h200x*/ring_scaling.json", "python -m measure.ring_scaling",
     "ring attention on 1 to N GPUs (NCCL) at 128k-1M tokens: fa4_final's ring, PyTorch's "
     "context_parallel with cuDNN and with fa4_final (when registered), correctness against "
     "one GPU; chapter 14 describes it"),
]

# MHA: PyTorch's context_parallel path takes SDPA's flash and cuDNN ops, which here get no GQA
HEADS, HEADS_KV, HEAD_DIM = 32, 32, 128


def _inputs(seqlen: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, seqlen, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, seqlen, HEADS_KV, HEAD_DIM, device=device, dtype=torch.bfloat16,
                        generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    return q, k, v, dout


def _time(fn, repeats: int = 3) -> float:
    import torch.distributed as dist

    fn()  # warm-up (compiles)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fa4_ring(q, k, v, dout, layout, comm, backward: bool):
    def run():
        out, lse = ring.ring_forward(q, k, v, layout, comm, True,
                                     block_fn=ring.fa4_block_forward)
        if backward:
            ring.ring_backward(dout, q, k, v, out, lse, layout, comm, True,
                               block_fn=ring.fa4_block_backward)
    return run


def _time_torch_cp(q, k, v, dout, world, backward: bool, backend: str, repeats: int) -> float:
    """PyTorch's context_parallel over the whole problem: it shards the buffers once on entry
    (not timed); inside, each timed call is one SDPA (its ring) forward, or forward and
    backward. With W = 1 it is plain SDPA on one GPU, the baseline of the same backend."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = SDPBackend.CUDNN_ATTENTION if backend == "cudnn" else SDPBackend.FLASH_ATTENTION
    bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]  # (b, h, s, d) for SDPA
    if world > 1:
        set_rotate_method("alltoall")
        cp = context_parallel(init_device_mesh("cuda", (world,)), buffers=bufs,
                              buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs))
    else:
        cp = contextlib.nullcontext()
    with cp:
        leaves = [b.detach().requires_grad_(backward) for b in bufs[:3]]

        def run():
            with sdpa_kernel(sdpa):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                if backward:
                    out.backward(bufs[3])

        return _time(run, repeats)


def scaling_worker(rank: int, world: int, seqlens: list, repeats: int, skip_fa4_cp: str | None):
    """One rank: every sequence length, three implementations, forward and fwd + bwd."""
    comm = ring.DistRing()
    device = torch.device("cuda", rank)
    found, activated = [], []
    for seqlen in seqlens:
        q, k, v, dout = _inputs(seqlen, device)
        layout = ring.zigzag_layout(seqlen, world)
        lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
        names = ["fa4_final_ring", "torch_cp_cudnn"]
        if skip_fa4_cp is None:
            names.append("torch_cp_fa4_final")
        for name in names:
            for pass_, bwd in (("fwd", False), ("fwd+bwd", True)):
                try:
                    if name == "fa4_final_ring":
                        ms = _time(_fa4_ring(lq, lk, lv, ldo, layout, comm, bwd), repeats)
                    else:
                        if name == "torch_cp_fa4_final" and not activated:
                            ring.activate_fa4_sdpa()  # SDPA's flash ops now run fa4_final
                            activated.append(True)
                        ms = _time_torch_cp(q, k, v, dout, world, bwd,
                                            "cudnn" if name == "torch_cp_cudnn" else "flash",
                                            repeats)
                    found.append({"impl": name, "s": seqlen, "pass": pass_, "ms": ms})
                except torch.cuda.OutOfMemoryError as exc:
                    found.append({"impl": name, "s": seqlen, "pass": pass_, "ms": None,
                                  "error": f"out of memory: {str(exc)[:120]}"})
                    torch.cuda.empty_cache()
        del q, k, v, dout
        torch.cuda.empty_cache()
    return found


def correctness_worker(rank: int, world: int, seqlen: int):
    """The ring on all GPUs; rank 0 also runs fa4_final on one GPU over the whole sequence."""
    comm = ring.DistRing()
    device = torch.device("cuda", rank)
    q, k, v, dout = _inputs(seqlen, device, seed=1)
    layout = ring.zigzag_layout(seqlen, world)
    lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
    out, lse = ring.ring_forward(lq, lk, lv, layout, comm, True, block_fn=ring.fa4_block_forward)
    grads = ring.ring_backward(ldo, lq, lk, lv, out, lse, layout, comm, True,
                               block_fn=ring.fa4_block_backward)
    mine = [t.float().cpu() for t in (out, lse, *grads)]
    one = None
    if rank == 0:
        o1, l1 = ring.fa4_block_forward(q, k, v, 0, 0, True)
        g1 = ring.fa4_block_backward(dout, q, k, v, o1, l1, 0, 0, True)
        one = [t.float().cpu() for t in (o1, l1, *g1)]
    return mine, one


def _flops(seqlen: int, pass_: str) -> float:
    fwd = 4 * HEADS * seqlen**2 * HEAD_DIM / 2
    return fwd * (3.5 if pass_ == "fwd+bwd" else 1.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="131072,262144,524288,1048576")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-seqlen", type=int, default=32768)
    args = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise SystemExit(f"measure.ring_scaling needs at least 2 CUDA GPUs of one host; this "
                         f"machine has {gpus}. (On one GPU, tests/gpu/test_ring_attention.py "
                         "checks the ring with 2 ranks sharing it.)")
    seqlens = [int(s) for s in args.seqlens.split(",")]
    path, why = ring.fa4_sdpa_module()
    skip = None if path is not None else why
    print(why, flush=True)

    rows = []
    mine_one = ring.launch(correctness_worker, gpus, (args.check_seqlen,), backend="nccl",
                           deadline=900, collective_timeout=300)
    layout = ring.zigzag_layout(args.check_seqlen, gpus)
    one = mine_one[0][1]
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        got = layout.unshard([mine_one[r][0][i] for r in range(gpus)],
                             dim=2 if name == "lse" else 1)
        err = float((got - one[i]).abs().max())
        rows.append({"impl": "fa4_final_ring", "metric": f"max_abs_diff_vs_one_gpu_{name}",
                     "value": err, "unit": "abs", "world": gpus, "s": args.check_seqlen})
        print(f"ring on {gpus} GPUs vs one GPU, {name}: max |diff| {err:.2e}", flush=True)

    worlds = [w for w in (1, 2, 4, 8) if w <= gpus]
    timings: dict = {}
    for rnd in range(args.rounds):
        for world in (worlds if rnd % 2 == 0 else list(reversed(worlds))):
            per_rank = ring.launch(scaling_worker, world, (seqlens, args.repeats, skip),
                                   backend="nccl", deadline=1800, collective_timeout=600)
            for n, row in enumerate(per_rank[0]):
                key = (row["impl"], row["s"], row["pass"], world)
                times = [per_rank[r][n]["ms"] for r in range(world)]
                slowest = None if any(t is None for t in times) else max(times)
                timings.setdefault(key, []).append(slowest)
                print(f"round {rnd} W={world} {row['impl']} S={row['s']} {row['pass']}: "
                      f"{slowest if slowest is None else round(slowest, 2)} ms", flush=True)
    for (impl, s, pass_, world), values in sorted(timings.items()):
        ok = [v for v in values if v is not None]
        ms = statistics.median(ok) if ok else None
        rows.append({
            "impl": impl, "pass": pass_, "dtype": "bf16", "b": 1, "s": s, "h": HEADS,
            "h_kv": HEADS_KV, "d": HEAD_DIM, "causal": True, "world": world, "ms": ms,
            "ms_rounds": values,
            "spread": (max(ok) - min(ok)) / ms if ok and ms else None,
            "tflops": _flops(s, pass_) / (ms * 1e-3) / 1e12 if ms else None,
            "note": "slowest rank; None: out of memory at this length on this many GPUs",
        })
    if skip is not None:
        rows.append({"impl": "torch_cp_fa4_final", "metric": "skipped", "value": 0,
                     "unit": "", "reason": skip})
    command = "python -m measure.ring_scaling" + (
        "" if args.seqlens == "131072,262144,524288,1048576" else f" --seqlens {args.seqlens}")
    out = results.save("ring_scaling", rows, command, gpu=f"h200x{gpus}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
