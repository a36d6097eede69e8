"""The split-KV combine (fa4_final.common.combine, launched by
fa4_final.runtime.decode.combine_splits) on an H100/H200 against float64.

Awkward shapes: 1 split, 3 splits with an empty one, 17 and 128 splits; seqlen_q 1, 7 and 16;
row counts that fill no whole CTA; head dims 64 and 128, bf16 and fp16; the varlen layout
(total_q rows). The partials are random float32 with lse values spread over tens of nats (some
weights underflow), empty splits (lse -inf) whose partial out is NaN (the combine must never
read it), and rows no split saw (out 0, lse -inf). The yardstick is the float64 host model of
tests/test_decode_combine.py on the same partials, and for one case attention itself: partials
of real key ranges merged equal one softmax over all keys. out and lse are NaN-filled before
each run and sit inside larger buffers whose guard entries must keep their sentinel; NaN never
passes; two runs are bitwise equal (the fixed order).
    timeout 400 python -m pytest -q -m gpu tests/gpu/test_decode_combine.py
"""

import math

import pytest
import torch

from fa4_final.runtime.decode import combine_splits
from tests.test_decode_combine import attention_partials, combine_reference, one_shot
from utils.checks import poison_, rounding_atol
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16
DEVICE = "cuda"
SENTINEL = 7.0
GUARD = 3  # guard query rows (out) and columns (lse) on each side

CASES = {  # name: (num_splits, batch, seqlen_q, heads, dv, dtype, empty fraction, all-empty rows)
    "1-split": (1, 2, 1, 8, 128, BF16, 0.0, False),
    "3-splits-one-empty": (3, 2, 7, 4, 128, BF16, "split 1", False),
    "3-splits-one-empty-d64": (3, 3, 16, 5, 64, FP16, "split 1", False),
    "17-splits-seqlen-7": (17, 3, 7, 3, 64, BF16, 0.3, True),
    "128-splits": (128, 1, 16, 4, 128, FP16, 0.3, True),
    "128-splits-d64": (128, 2, 1, 32, 64, BF16, 0.5, False),
    "rows-no-split-saw": (4, 3, 16, 2, 128, BF16, 0.0, True),
    "odd-row-count": (8, 33, 7, 5, 128, BF16, 0.1, True),  # 1155 rows: a partial last CTA
}


def _partials(n, rows_shape, dv, empty, all_empty_rows, seed, layout="dense"):
    """float32 (out_partial, lse_partial) in the dense (b, s, h) or varlen (total_q, h) layout;
    empty splits: lse -inf, out NaN."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if layout == "dense":
        b, sq, h = rows_shape
        out_shape, lse_shape = (n, b, sq, h, dv), (n, b, h, sq)
    else:
        total_q, h = rows_shape
        out_shape, lse_shape = (n, total_q, h, dv), (n, h, total_q)
    out_p = torch.randn(out_shape, generator=g, device=DEVICE)
    lse_p = torch.randn(lse_shape, generator=g, device=DEVICE) * 8 + 3
    lse_p[..., ::5] -= 90  # weights that underflow next to the others
    if empty == "split 1":
        empty_mask = torch.zeros(lse_shape, dtype=torch.bool, device=DEVICE)
        empty_mask[1] = True
    else:
        empty_mask = torch.rand(lse_shape, generator=g, device=DEVICE) < empty
    if all_empty_rows:  # every third row: no split saw it
        empty_mask[..., ::3] = True
    lse_p[empty_mask] = -math.inf
    rows_out = empty_mask.permute(0, 1, 3, 2) if layout == "dense" else empty_mask.transpose(1, 2)
    out_p[rows_out] = math.nan
    return out_p, lse_p


def _guarded_outputs(dtype, out_shape, lse_shape):
    """out and lse views inside sentinel-filled buffers (GUARD query rows of out, GUARD lse
    columns on each side), the views NaN-filled."""
    if len(out_shape) == 4:
        b, sq, h, dv = out_shape
        out_buf = torch.full((b, sq + 2 * GUARD, h, dv), SENTINEL, dtype=dtype, device=DEVICE)
        out = out_buf[:, GUARD:GUARD + sq]
    else:
        total_q, h, dv = out_shape
        out_buf = torch.full((total_q + 2 * GUARD, h, dv), SENTINEL, dtype=dtype, device=DEVICE)
        out = out_buf[GUARD:GUARD + total_q]
    *lead, last = lse_shape
    lse_buf = torch.full((*lead, last + 2 * GUARD), SENTINEL, device=DEVICE)
    lse = lse_buf[..., GUARD:GUARD + last]
    poison_(out)
    poison_(lse)
    return out, lse, out_buf, lse_buf


def _check(out, lse, ref_out, ref_lse, what):
    """The rule: no NaN; -inf exactly where the reference has it; out within the rounding of
    the output dtype plus float32's error, lse within float32's."""
    assert not torch.isnan(out).any(), f"{what}: {int(torch.isnan(out).sum())} NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: {int(torch.isnan(lse).sum())} NaN in lse"
    ref_out, ref_lse = ref_out.to(out.device), ref_lse.to(out.device)
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), f"{what}: lse -inf at other rows"
    err = (out.double() - ref_out).abs().max().item()
    limit = rounding_atol(ref_out, out.dtype) + 1e-5 * (1 + ref_out.abs().max().item())
    assert err <= limit, f"{what}: out error {err:.3e} > {limit:.3e}"
    if (~empty).any():
        lerr = (lse.double() - ref_lse)[~empty].abs()
        lim = 2e-5 + 2e-6 * ref_lse[~empty].abs()
        assert (lerr <= lim).all(), f"{what}: lse error {lerr.max().item():.3e}"


def _to_dense_model(out_p, lse_p):
    """The varlen layout as a batch of one, for the host model."""
    return out_p.unsqueeze(1), lse_p.unsqueeze(1)


@pytest.mark.parametrize("name", list(CASES))
def test_combine_against_float64(name):
    n, b, sq, h, dv, dtype, empty, all_empty = CASES[name]
    out_p, lse_p = _partials(n, (b, sq, h), dv, empty, all_empty, seed=len(name))
    ref_out, ref_lse = combine_reference(out_p.double(), lse_p.double())
    out, lse, out_buf, lse_buf = _guarded_outputs(dtype, (b, sq, h, dv), (b, h, sq))
    combine_splits(out_p, lse_p, out, lse)
    torch.cuda.synchronize()
    _check(out, lse, ref_out, ref_lse, name)
    assert (out_buf[:, :GUARD] == SENTINEL).all() and (out_buf[:, GUARD + sq:] == SENTINEL).all()
    assert (lse_buf[..., :GUARD] == SENTINEL).all()
    assert (lse_buf[..., GUARD + sq:] == SENTINEL).all()
    first = out.clone(), lse.clone()
    combine_splits(out_p, lse_p, out, lse)  # the fixed order: the same bits again
    assert torch.equal(out.view(torch.int16), first[0].view(torch.int16))
    assert torch.equal(lse.view(torch.int32), first[1].view(torch.int32))


@pytest.mark.parametrize("n, total_q, h, dv, dtype", [
    (3, 37, 6, 128, BF16), (17, 1, 32, 64, FP16), (128, 23, 4, 128, BF16)])
def test_varlen_layout(n, total_q, h, dv, dtype):
    out_p, lse_p = _partials(n, (total_q, h), dv, 0.3, True, seed=total_q, layout="varlen")
    ref_out, ref_lse = combine_reference(*_to_dense_model(out_p.double(), lse_p.double()))
    out, lse, out_buf, lse_buf = _guarded_outputs(dtype, (total_q, h, dv), (h, total_q))
    combine_splits(out_p, lse_p, out, lse)
    torch.cuda.synchronize()
    _check(out, lse, ref_out[0], ref_lse[0], f"varlen n={n} total_q={total_q}")
    assert (out_buf[:GUARD] == SENTINEL).all() and (out_buf[GUARD + total_q:] == SENTINEL).all()
    assert (lse_buf[:, :GUARD] == SENTINEL).all()


@pytest.mark.parametrize("dv, dtype", [(128, BF16), (64, FP16)])
def test_partials_of_attention_merge_to_attention(dv, dtype):
    """Real partials: attention over key ranges (one empty, one that some rows see nothing
    of), rounded to float32, merged by the kernel, against one float64 softmax over all keys."""
    b, sq, sk, h = 2, 16, 700, 4
    g = torch.Generator().manual_seed(dv)
    q, k, v = (torch.randn(b, s, h, dv, generator=g, dtype=torch.float64)
               for s in (sq, sk, sk))
    qi, kj = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    visible = (kj <= qi + 290).expand(b, h, sq, sk)  # rows 0-9 see no key from 300 on
    bounds = [(0, 128), (128, 128), (128, 300), (300, 512), (512, 700)]
    out_p, lse_p = attention_partials(q, k, v, bounds, visible)
    ref_out, ref_lse = one_shot(q, k, v, visible)
    out, lse, _, _ = _guarded_outputs(dtype, (b, sq, h, dv), (b, h, sq))
    combine_splits(out_p.float().to(DEVICE), lse_p.float().to(DEVICE), out, lse)
    torch.cuda.synchronize()
    _check(out, lse, ref_out, ref_lse, f"attention d={dv}")


def test_a_nan_never_passes():
    """The rule itself: a result with one NaN, or a -inf where the reference has a value,
    fails."""
    out_p, lse_p = _partials(3, (1, 4, 2), 128, 0.0, False, seed=1)
    ref_out, ref_lse = combine_reference(out_p.double(), lse_p.double())
    out, lse, _, _ = _guarded_outputs(BF16, (1, 4, 2, 128), (1, 2, 4))
    combine_splits(out_p, lse_p, out, lse)
    torch.cuda.synchronize()
    _check(out, lse, ref_out, ref_lse, "clean")
    bad = out.clone()
    bad[0, 2, 1, 5] = math.nan
    with pytest.raises(AssertionError, match="NaN in out"):
        _check(bad, lse, ref_out, ref_lse, "planted")
    bad_lse = lse.clone()
    bad_lse[0, 1, 3] = -math.inf
    with pytest.raises(AssertionError, match="-inf at other rows"):
        _check(out, bad_lse, ref_out, ref_lse, "planted")


@pytest.mark.parametrize("n", [1, 3, 40])
def test_a_nan_split_poisons_its_row(n):
    """Note [A NaN split poisons the row]: rows with one split's lse NaN (a poisoned decode
    split; its partial out NaN too) come out NaN in out and lse, beside an all-empty NaN row;
    every other row is the model's (a NaN lse is never taken as an empty split)."""
    out_p, lse_p = _partials(n, (2, 5, 3), 128, 0.2, False, seed=n)
    lse_p[n // 2, 0, 1, 2] = math.nan  # one split of row (b 0, h 1, q 2)
    out_p[n // 2, 0, 2, 1] = math.nan
    lse_p[:, 1, 2, 4] = -math.inf  # row (b 1, h 2, q 4): every split empty ...
    lse_p[n - 1, 1, 2, 4] = math.nan  # ... and one of them poisoned
    ref_out, ref_lse = combine_reference(out_p.double(), lse_p.double())
    out, lse, _, _ = _guarded_outputs(BF16, (2, 5, 3, 128), (2, 3, 5))
    combine_splits(out_p, lse_p, out, lse)
    torch.cuda.synchronize()
    poisoned = torch.zeros(2, 3, 5, dtype=torch.bool, device=DEVICE)
    poisoned[0, 1, 2] = poisoned[1, 2, 4] = True
    assert torch.equal(torch.isnan(lse), poisoned), "lse NaN exactly at the poisoned rows"
    assert torch.equal(torch.isnan(out).all(-1), poisoned.permute(0, 2, 1))
    assert torch.equal(torch.isnan(out).any(-1), poisoned.permute(0, 2, 1))
    keep = ~poisoned
    ref_out, ref_lse = ref_out.to(DEVICE), ref_lse.to(DEVICE)
    _check(out.masked_fill(poisoned.permute(0, 2, 1)[..., None], 0),
           lse.masked_fill(poisoned, 0), torch.where(ref_out.isnan(), 0.0, ref_out),
           torch.where(ref_lse.isnan(), 0.0, ref_lse), f"n={n}, the rows not poisoned")
    assert keep.sum() == 2 * 3 * 5 - 2


def test_empty_problems_launch_nothing():
    out = torch.empty(0, 1, 4, 128, dtype=BF16, device=DEVICE)
    lse = torch.empty(0, 4, 1, device=DEVICE)
    op = torch.empty(2, 0, 1, 4, 128, device=DEVICE)
    lp = torch.empty(2, 0, 4, 1, device=DEVICE)
    combine_splits(op, lp, out, lse)


@pytest.mark.parametrize("unroll, pdl, prefetch", [(8, False, False), (16, False, False),
                                                   (4, True, False), (4, False, True),
                                                   (16, False, True)])
@pytest.mark.parametrize("name", ["17-splits-seqlen-7", "128-splits", "odd-row-count",
                                  "3-splits-one-empty-d64"])
def test_candidates_give_the_default_bits(name, unroll, pdl, prefetch):
    """Note [Splits in flight], Note [The combine launches early] and
    Note [The first splits before the weights] (the empty splits' partials are NaN: loaded,
    never added): the candidates add the same partials in the same order, so their out and
    lse are the default combine's bit for bit (the default checked against float64 above);
    launched on contiguous outputs through the compiled plan, as the decode path does."""
    from fa4_final.common.combine import UNROLL, combine_recipe
    from fa4_final.common.constants import DTYPE_NAMES
    from fa4_final.runtime.compile import compiled
    from fa4_final.runtime.prologue import device_arch

    n, b, sq, h, dv, dtype, empty, all_empty = CASES[name]
    out_p, lse_p = _partials(n, (b, sq, h), dv, empty, all_empty, seed=len(name))
    runs = []
    for kwargs in ({}, {"unroll": unroll, "pdl": pdl, "prefetch": prefetch}):
        out = poison_(torch.empty(b, sq, h, dv, dtype=dtype, device=DEVICE))
        lse = poison_(torch.empty(b, h, sq, device=DEVICE))
        plan = compiled(combine_recipe, dv, DTYPE_NAMES[dtype], device_arch(out.device),
                        kwargs.get("pdl", False), kwargs.get("unroll", UNROLL),
                        kwargs.get("prefetch", False))
        plan.kernels["main"](out_p, lse_p, out, lse)
        torch.cuda.synchronize()
        runs.append((out, lse))
    (o0, l0), (o1, l1) = runs
    ref_out, ref_lse = combine_reference(out_p.double(), lse_p.double())
    _check(o0, l0, ref_out, ref_lse, f"{name} default")
    assert torch.equal(o0.view(torch.int16), o1.view(torch.int16)), f"{name}: out bits differ"
    assert torch.equal(l0.view(torch.int32), l1.view(torch.int32)), f"{name}: lse bits differ"
