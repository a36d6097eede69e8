"""Ring attention with fa4_final's kernels inside (solutions/ch14_ring.py), on Hopper GPUs.

With one GPU: 2 ranks share it, as 2 processes joined by gloo (the K, V pieces move through host
memory), so fa4_final's forward and backward run inside the ring at global offsets (the causal
mask as a window) and are checked against float64. With two or more GPUs: one rank per GPU over
NCCL. Also chapter 14's device-code exercises (the merge kernels) against float64 on awkward row
counts. Run: ``pytest -q -m gpu tests/gpu/test_ring_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from solutions import ch14_ring as ring

pytestmark = pytest.mark.gpu

# (b, s, h, hk, d, causal): sequence lengths not a multiple of 2W, GQA, D 64 and 128
GPU_CASES = [
    (1, 1000, 4, 2, 128, True),
    (2, 777, 4, 4, 64, False),
    (1, 4099, 8, 2, 128, True),
]


def _tolerance(ref: torch.Tensor) -> float:
    # bf16 inputs against a float64 reference of the same bf16 values: FA's rule of thumb, a
    # few bf16 ulps of the output's scale
    return 2e-2 * max(1.0, float(ref.abs().max()))


def gpu_ring_worker(rank: int, world: int, cases: list, backend: str):
    """One rank: every case through the ring with fa4_final's kernels, bf16; returns this rank's
    (out, lse, dq, dk, dv) on the CPU, float64."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    comm = ring.DistRing()
    found = []
    for n, (b, s, h, hk, d, causal) in enumerate(cases):
        case = ring.Case(b, s, h, hk, d, causal, 100 + n)
        q, k, v, dout = case.inputs(dtype=torch.bfloat16, device=device)
        layout = ring.zigzag_layout(s, world)
        lq, lk, lv, ldo = (layout.shard(t, rank) for t in (q, k, v, dout))
        out, lse = ring.ring_forward(lq, lk, lv, layout, comm, causal,
                                     block_fn=ring.fa4_block_forward)
        grads = ring.ring_backward(ldo, lq, lk, lv, out, lse, layout, comm, causal,
                                   block_fn=ring.fa4_block_backward)
        torch.cuda.synchronize()
        found.append(tuple(t.double().cpu() for t in (out, lse, *grads)))
    return found


def _check(world: int, backend: str) -> list[str]:
    per_rank = ring.launch(gpu_ring_worker, world, (GPU_CASES, backend), backend=backend,
                           deadline=600, collective_timeout=120)
    lines, bad = [], []
    for n, (b, s, h, hk, d, causal) in enumerate(GPU_CASES):
        case = ring.Case(b, s, h, hk, d, causal, 100 + n)
        q, k, v, dout = (t.to(torch.bfloat16).double() for t in case.inputs())
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = ring.reference_attention(*leaves, causal=causal)
        ref = (ref_out.detach(), ref_lse.detach(),
               *torch.autograd.grad(ref_out, leaves, dout))
        layout = ring.zigzag_layout(s, world)
        errs = []
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            got = layout.unshard([per_rank[r][n][i] for r in range(world)],
                                 dim=2 if name == "lse" else 1)
            err = float((got - ref[i]).abs().max())
            errs.append(f"{name} {err:.1e}")
            if not err <= _tolerance(ref[i]):
                bad.append(f"case {n} {name}: {err:.2e} > {_tolerance(ref[i]):.2e}")
        lines.append(f"W={world} {backend} b={b} s={s} h={h}/{hk} d={d} causal={causal}: max "
                     f"|ring - float64| " + ", ".join(errs))
    assert not bad, "; ".join(bad)
    return lines


def ring_on_one_gpu() -> list[str]:
    """Two ranks on this one GPU through gloo (chapter 14's GPU cell)."""
    return _check(2, "gloo")


def test_ring_fa4_kernels_two_ranks_on_one_gpu():
    for line in ring_on_one_gpu():
        print(line)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_ring_fa4_kernels_over_nccl():
    world = min(torch.cuda.device_count(), 4)
    for line in _check(world, "nccl"):
        print(line)


def test_ring_merge_exercises_on_gpu():
    from solutions import ch14_teaching as t14

    for kwargs in ({"pair": t14.merge_pair}, {"step": t14.merge_step}):
        ok, lines = t14.check_merge_on_gpu(**kwargs)
        assert ok, "\n".join(lines)
