"""Ring attention (solutions/ch14_ring.py) on this CPU: the merge, the block functions, the zigzag
layout, the ring in threads, and the ring on 2 and 4 gloo processes against one process in
float64 (forward and gradients, causal or not, sequence lengths not a multiple of 2W, GQA); a
rank that fails surfaces as an error naming it, never a hang."""

import os
import time

import pytest
import torch

from solutions import ch14_ring as R
from utils.reference import attention_reference

CASES = [
    R.Case(1, 37, 2, 1, 8, True, 1),   # 37 tokens: not a multiple of 2W for W = 2 or 4; GQA
    R.Case(2, 24, 4, 2, 8, False, 2),  # even chunks, batch 2
    R.Case(1, 19, 2, 2, 4, False, 3),  # uneven, not causal
    R.Case(1, 6, 2, 2, 4, True, 4),    # fewer tokens than 2W chunks for W = 4: empty chunks
    R.Case(1, 29, 2, 1, 4, True, 5, cu_seqlens=(0, 3, 17, 18, 29)),  # varlen: 4 documents
]
TOL = 1e-12


def test_ring_block_forward_is_the_reference():
    q, k, v, _ = R.Case(2, 21, 4, 2, 8, True, 7).inputs()
    for causal in (False, True):
        out, lse = R.block_forward(q, k, v, 0, 0, causal)
        ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
        assert (out - ref_out).abs().max() < TOL and (lse - ref_lse).abs().max() < TOL


def test_ring_block_forward_global_offsets_hide_later_keys():
    q, k, v, _ = R.Case(1, 8, 2, 2, 4, True, 8).inputs()
    # queries 0..3 against keys 4..7: no key is visible, every row is (0, -inf)
    out, lse = R.block_forward(q[:, :4], k[:, 4:], v[:, 4:], 0, 4, True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    # queries 4..7 against keys 0..3: all visible, the mask does nothing
    out_m, lse_m = R.block_forward(q[:, 4:], k[:, :4], v[:, :4], 4, 0, True)
    out_n, lse_n = R.block_forward(q[:, 4:], k[:, :4], v[:, :4], 4, 0, False)
    assert torch.equal(out_m, out_n) and torch.equal(lse_m, lse_n)


def test_ring_varlen_reference_is_attention_per_document():
    q, k, v, _ = R.Case(1, 20, 2, 2, 4, True, 11).inputs()
    cu = (0, 7, 20)
    out, lse = R.reference_attention(q, k, v, causal=True, cu_seqlens=cu)
    for a, b in zip(cu, cu[1:]):
        ref_out, ref_lse = attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], causal=True)
        assert (out[:, a:b] - ref_out).abs().max() < TOL
        assert (lse[..., a:b] - ref_lse).abs().max() < TOL


def test_ring_merge_of_two_halves_is_the_whole():
    q, k, v, _ = R.Case(1, 16, 2, 1, 8, True, 9).inputs()
    o1, l1 = R.block_forward(q, k[:, :7], v[:, :7], 0, 0, True)
    o2, l2 = R.block_forward(q, k[:, 7:], v[:, 7:], 0, 7, True)
    out, lse = R.merge(o1, l1, o2, l2)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert (out - ref_out).abs().max() < TOL and (lse - ref_lse).abs().max() < TOL
    # rows 0..6 see no key of the second half: its lse = -inf must leave them alone
    assert torch.all(l2[..., :7] == float("-inf"))


def test_ring_merge_is_stable_and_keeps_empty_rows():
    o = torch.ones(1, 3, 1, 2, dtype=torch.float64)
    lse_a = torch.tensor([[[800.0, float("-inf"), float("-inf")]]], dtype=torch.float64)
    lse_b = torch.tensor([[[801.0, 3.0, float("-inf")]]], dtype=torch.float64)
    out, lse = R.merge(o, lse_a, 2 * o, lse_b)
    assert torch.isfinite(out).all(), "exp(800) must never be formed"
    assert abs(float(lse[0, 0, 0]) - (801 + torch.log1p(torch.exp(torch.tensor(-1.0))))) < 1e-12
    assert float(lse[0, 0, 1]) == 3.0 and torch.all(out[0, 1] == 2)
    assert float(lse[0, 0, 2]) == float("-inf") and torch.all(out[0, 2] == 0)


def test_ring_block_backward_adds_up_to_the_gradient():
    case = R.Case(1, 12, 4, 2, 8, True, 10)
    q, k, v, dout = case.inputs()
    ref = R.reference_case(case)
    out, lse = ref[0], ref[1]
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for ka, kb in ((0, 5), (5, 12)):
        g = R.block_backward(dout, q, k[:, ka:kb], v[:, ka:kb], out, lse, 0, ka, True)
        dq += g[0]
        dk[:, ka:kb] += g[1]
        dv[:, ka:kb] += g[2]
    for got, want in zip((dq, dk, dv), ref[2:]):
        assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_zigzag_layout_covers_and_balances(world):
    for seqlen in (8 * world, 8 * world + 3, 2 * world - 1):
        layout = R.zigzag_layout(seqlen, world)
        tokens = sorted(t for ranges in layout.ranges for a, b in ranges for t in range(a, b))
        assert tokens == list(range(seqlen))
    work = R.visible_pairs(R.zigzag_layout(64 * world, world), causal=True)
    assert max(work) - min(work) < 1e-9 * max(work) + 1e-9, work
    contiguous = R.visible_pairs(R.contiguous_layout(64 * world, world), causal=True)
    assert contiguous[-1] > 1.5 * contiguous[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_in_threads_equals_one_process(world):
    for case in CASES:
        q, k, v, dout = case.inputs()
        layout = R.zigzag_layout(case.s, world)

        def rank_fn(comm, layout=layout, case=case, q=q, k=k, v=v, dout=dout):
            lq, lk, lv, ldo = (layout.shard(t, comm.rank) for t in (q, k, v, dout))
            fwd, bwd = case.blocks()
            out, lse = R.ring_forward(lq, lk, lv, layout, comm, case.causal, block_fn=fwd)
            return (out, lse, *R.ring_backward(ldo, lq, lk, lv, out, lse, layout, comm,
                                               case.causal, block_fn=bwd))

        per_rank = R.ThreadRing(world).run(rank_fn)
        errors = R.ring_errors([[r] for r in per_rank], [case], world)[0]
        assert max(errors.values()) < TOL, (case, errors)


def test_ring_thread_ring_names_a_missing_send():
    def lopsided(comm):
        if comm.rank == 0:
            return comm.exchange(torch.zeros(2)).wait()
        return None

    with pytest.raises(R.RingTimeout, match="rank 0 waited"):
        R.ThreadRing(2, timeout=0.5).run(lopsided)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_on_gloo_processes_equals_one_process(world):
    errors = R.check_on_processes(world, CASES)
    for case, err in zip(CASES, errors):
        assert max(err.values()) < TOL, (world, case, err)


# --- failures: a clear error naming the rank, never a hang --------------------------------------
def failing_worker(rank, world):
    if rank == 1:
        raise ValueError("rank 1 was given a K of the wrong length")
    if rank == 2:
        os._exit(3)
    R.DistRing().exchange(torch.zeros(4)).wait()  # waits for rank 2, which never sends
    return rank


def sleeping_worker(rank, world):
    if rank == 0:
        time.sleep(600)
    return rank


def test_ring_launcher_names_the_ranks_that_raised_and_died():
    t0 = time.monotonic()
    with pytest.raises(R.RankFailed) as failure:
        R.launch(failing_worker, 3, collective_timeout=5, deadline=60, grace=1)
    said = str(failure.value)
    assert "rank 1 failed: ValueError: rank 1 was given a K of the wrong length" in said, said
    assert "rank 2 failed: exited with code 3" in said, said
    assert time.monotonic() - t0 < 45


def test_ring_launcher_names_a_rank_past_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(R.RankFailed, match=r"ranks \[0\] ran past the 2 s deadline"):
        R.launch(sleeping_worker, 2, collective_timeout=5, deadline=2, grace=1)
    assert time.monotonic() - t0 < 45
