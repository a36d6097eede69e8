"""fa4_final's Hopper decode forward (fa4_final.hopper.decode) on an H100/H200 against float64.

Awkward key lengths (1, 5, 777, 1025, 4097, 128k), 1/4/7/16 query tokens, GQA 1/4/8/16, D = 64 and
128, bf16 and fp16, causal (bottom-right) and not, per-sequence cached lengths (seqused_k, one of
them 0), one split and several. Every output is NaN-filled first and NaN never passes. With
several splits the float32 partials are checked twice: merged in float64 here (the combine's
math, tests.decode_reference.merge_splits) and merged by the package's combine
(fa4_final.runtime.decode.combine_splits, skipped with a message while it does not exist). Paged
equals contiguous bit for bit, over shuffled pages among NaN pages no sequence owns; two runs are
bitwise equal; a CUDA graph captured once follows new lengths and pages written into its input
tensors; varlen queries (chunked prefill and decode in one launch) over a paged cache; a left
(sliding) window. A broken mbarrier protocol hangs rather than fails: utils.checks.wait_for_gpu
exits with a message after a deadline. Run:
    timeout 900 python -m pytest -q -m gpu tests/gpu/test_decode_kernel.py
"""

import math
from dataclasses import replace

import pytest
import torch

from fa4_final.common.decode_index import page_size_problem
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.host import decode_recipe, launch_decode
from fa4_final.runtime.compile import compiled
from tests.decode_reference import merge_splits, paged_cache, sequence_keys
from utils.checks import poisoned_empty, tolerance_check, wait_for_gpu
from utils.hardware import missing
from utils.reference import attention_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16
NAMES = {BF16: "bf16", FP16: "fp16"}
DEVICE = "cuda"


def combine_fn():
    """The package's split combine, imported when a test needs it."""
    try:
        from fa4_final.runtime.decode import combine_splits
    except ImportError as exc:
        pytest.skip(f"the split combine (fa4_final.runtime.decode.combine_splits) is not in this "
                    f"tree yet: {exc}")
    return combine_splits


def run_decode(q, k, v, causal, num_splits=1, page_table=None, seqused_k=None, config=None,
               window_left=None):
    """(out, lse, partials or None): one decode launch into NaN-filled outputs; with several
    splits, the partials merged by the package's combine."""
    b, sq, h, d = q.shape
    split = num_splits > 1
    plan = compiled(decode_recipe, d, NAMES[q.dtype], causal, page_table is not None,
                    seqused_k is not None, split, config, False, window_left is not None)
    out = poisoned_empty(b, sq, h, d, dtype=q.dtype, device=DEVICE)
    lse = poisoned_empty(b, h, sq, dtype=torch.float32, device=DEVICE)
    label = f"decode q {tuple(q.shape)} k {tuple(k.shape)} splits {num_splits}"
    if not split:
        launch_decode(plan, q, k, v, out, lse, page_table, seqused_k, window_left=window_left)
        wait_for_gpu(label)
        return out, lse, None
    out_p = poisoned_empty(num_splits, b, sq, h, d, dtype=torch.float32, device=DEVICE)
    lse_p = poisoned_empty(num_splits, b, h, sq, dtype=torch.float32, device=DEVICE)
    launch_decode(plan, q, k, v, out_p, lse_p, page_table, seqused_k, window_left=window_left)
    wait_for_gpu(label)
    return out, lse, (out_p, lse_p)


def check_against_float64(q, k, v, out, lse, causal, page_table=None, seqused_k=None,
                          window_left=None):
    """Each sequence against float64 on its first seqused_k keys (utils.checks' rule: error <=
    2 x PyTorch's own in the input precision + rounding); a sequence with no key: out 0 and
    lse -inf exactly."""
    b = q.shape[0]
    lengths = [int(x) for x in seqused_k] if seqused_k is not None else None
    for i in range(b):
        length = lengths[i] if lengths is not None else (
            k.shape[1] * page_table.shape[1] if page_table is not None else k.shape[1])
        if length == 0:
            assert (out[i] == 0).all() and torch.isneginf(lse[i]).all(), f"sequence {i}"
            continue
        ks = sequence_keys(k, i, length, page_table).unsqueeze(0)
        vs = sequence_keys(v, i, length, page_table).unsqueeze(0)
        qi = q[i:i + 1]
        window = None if window_left is None else (window_left, None)
        ref_out, ref_lse = attention_reference(qi, ks, vs, causal, dtype=torch.float64,
                                               window_size=window)
        pt_out, pt_lse = attention_reference(qi, ks, vs, causal, dtype=q.dtype,
                                             window_size=window)
        verdicts = [tolerance_check(out[i:i + 1], ref_out, pt_out, "out"),
                    tolerance_check(lse[i:i + 1], ref_lse, pt_lse, "lse", extra_atol=1e-5)]
        failed = [str(x) for x in verdicts if not x.passed]
        assert not failed, f"sequence {i} ({length} keys)\n" + "\n".join(failed)


def qkv(batch, seqlen_q, cache, heads, heads_kv, d, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, cache, heads_kv, d, generator=g, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, cache, heads_kv, d, generator=g, device=DEVICE, dtype=dtype)
    return q, k, v


CASES = {  # name: (batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, causal, splits)
    "1tok-gqa4-1000": (4, 1, 1000, 32, 8, 128, BF16, True, 1),
    "4tok-gqa4-4097-3splits": (2, 4, 4097, 32, 8, 128, BF16, True, 3),
    "16tok-gqa16-3001-5splits": (2, 16, 3001, 64, 4, 128, BF16, True, 5),  # 4 m-blocks
    "16tok-gqa1-777-fp16-d64": (3, 16, 777, 16, 16, 64, FP16, True, 1),
    "16tok-gqa8-1025-d64": (2, 16, 1025, 16, 2, 64, BF16, True, 2),  # 2 m-blocks
    "1tok-gqa8-128k-32splits": (1, 1, 131072, 32, 4, 128, BF16, True, 32),
    "one-key-empty-split": (2, 4, 1, 8, 2, 64, BF16, True, 2),
    "more-tokens-than-keys": (2, 16, 5, 8, 2, 128, BF16, True, 1),
    "7tok-not-causal-d64": (2, 7, 1025, 16, 4, 64, BF16, False, 4),
    "1tok-gqa16-fp16-7splits": (3, 1, 2049, 16, 1, 128, FP16, True, 7),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decode_matches_float64(name):
    b, sq, sk, h, hk, d, dtype, causal, splits = CASES[name]
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype, seed=len(name))
    out, lse, partials = run_decode(q, k, v, causal, splits)
    check_decode(q, k, v, out, lse, partials, causal, name)


def check_decode(q, k, v, out, lse, partials, causal, label):
    """One decode launch's result against float64: out and lse, or, when it wrote split
    partials, each partial written (no NaN left), their float64 merge (the kernel alone,
    whatever the combine does), then the package's combine into out and lse."""
    if partials is None:
        check_against_float64(q, k, v, out, lse, causal)
        return
    out_p, lse_p = partials
    assert not out_p.isnan().any() and not lse_p.isnan().any(), "a partial was not written"
    m_out, m_lse = merge_splits(out_p.cpu(), lse_p.cpu())
    check_against_float64(q, k, v, m_out.to(DEVICE, q.dtype), m_lse.to(DEVICE, torch.float32),
                          causal)
    combine_fn()(out_p, lse_p, out, lse)
    wait_for_gpu(f"combine after {label}")
    check_against_float64(q, k, v, out, lse, causal)


def paged_equals_contiguous(q, k, v, page_size, seed, causal, splits, seqused_k,
                            window_left=None, config=None):
    """k and v cut into pages shuffled among NaN pages (paged_cache, seeded): the paged launch
    gives the contiguous launch's every bit (the split partials when there are several, else
    out and lse), and its answer (partials merged in float64) is float64's."""
    kp, vp, table = paged_cache(k.cpu(), v.cpu(), page_size,
                                generator=torch.Generator().manual_seed(seed))
    kp, vp, table = kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)
    launch = dict(seqused_k=seqused_k, window_left=window_left)
    # a gathered config's contiguous twin: the same tile and stages, one box a tile
    flat = config if config is None or config.page_box is None else replace(config,
                                                                            page_box=None)
    contiguous = run_decode(q, k, v, causal, splits, config=flat, **launch)
    paged = run_decode(q, kp, vp, causal, splits, page_table=table, config=config, **launch)
    got, want = (paged[2], contiguous[2]) if splits > 1 else (paged[:2], contiguous[:2])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    out, lse = paged[:2]
    if splits > 1:
        m_out, m_lse = merge_splits(paged[2][0].cpu(), paged[2][1].cpu())
        out, lse = m_out.to(DEVICE, q.dtype), m_lse.to(DEVICE).float()
    check_against_float64(q, kp, vp, out, lse, causal, page_table=table, seqused_k=seqused_k,
                          window_left=window_left)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("d,page_size,dtype", [(128, 128, BF16), (128, 256, FP16),
                                               (64, 512, BF16)])
def test_paged_equals_contiguous_bit_for_bit(d, page_size, dtype, splits):
    """Pages shuffled among NaN pages no sequence owns, lengths per sequence (one of them 0,
    one a single key), NaN in the cache rows past them (Note [Keys past the cached length]):
    the paged launch gives the contiguous launch's every bit, and both are float64's answer."""
    batch, sq, h, hk, pages = 4, 4, 16, 2, 9
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, dtype, seed=page_size + d + splits)
    used = torch.tensor([pages * page_size, 0, 1, pages * page_size - 77], dtype=torch.int32,
                        device=DEVICE)
    for b, length in enumerate(used.tolist()):  # rows a serving engine never wrote
        k[b, length:] = float("nan")
        v[b, length:] = float("nan")
    paged_equals_contiguous(q, k, v, page_size, splits, True, splits, used)


def run_varlen_over_pages(cfg, lengths_q, splits, seed, table_seed, label):
    """Packed query sequences of ``lengths_q`` tokens (32 query heads over 4 KV heads, D = 128),
    each over its own pages of 256 keys and cached length (3000, 1, 517, 129, 2048), run by the
    decode kernel built with ``cfg`` (None: the default) into NaN-filled outputs: every sequence
    against float64, the split partials merged in float64 and by the package's combine."""
    used = [3000, 1, 517, 129, 2048]
    h, hk, d, page_size, pages = 32, 4, 128, 256, 12
    cu = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    total_q = int(cu[-1])
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(total_q, h, d, generator=g, device=DEVICE, dtype=BF16)
    k = torch.randn(len(lengths_q), pages * page_size, hk, d, generator=g, device=DEVICE,
                    dtype=BF16)
    v = torch.randn_like(k)
    kp, vp, table = paged_cache(k.cpu(), v.cpu(), page_size,
                                generator=torch.Generator().manual_seed(table_seed))
    kp, vp, table = kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)
    used_k = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    cu_q = cu.to(DEVICE)
    plan = compiled(decode_recipe, d, "bf16", True, True, True, splits > 1, cfg, True)
    out = poisoned_empty(total_q, h, d, dtype=BF16, device=DEVICE)
    lse = poisoned_empty(h, total_q, dtype=torch.float32, device=DEVICE)
    if splits == 1:
        launch_decode(plan, q, kp, vp, out, lse, table, used_k, cu_seqlens_q=cu_q,
                      max_seqlen_q=max(lengths_q))
    else:
        out_p = poisoned_empty(splits, total_q, h, d, dtype=torch.float32, device=DEVICE)
        lse_p = poisoned_empty(splits, h, total_q, dtype=torch.float32, device=DEVICE)
        launch_decode(plan, q, kp, vp, out_p, lse_p, table, used_k, cu_seqlens_q=cu_q,
                      max_seqlen_q=max(lengths_q))
        wait_for_gpu(label)
        assert not out_p.isnan().any() and not lse_p.isnan().any()
        m_out, m_lse = merge_splits(out_p.cpu(), lse_p.cpu())
        check_varlen(q, kp, vp, cu, m_out.to(DEVICE, BF16), m_lse.to(DEVICE).float(), table,
                     used_k)
        combine_fn()(out_p, lse_p, out, lse)
    wait_for_gpu(label)
    check_varlen(q, kp, vp, cu, out, lse, table, used_k)


@pytest.mark.parametrize("splits", [1, 4])
def test_varlen_queries_over_a_paged_cache(splits):
    """Chunked prefill and decode steps in one launch: packed query sequences of 16, 1, 0, 7
    and 3 tokens (cu_seqlens_q, max_seqlen_q), each over its own pages and cached length; every
    sequence against float64, the partials merged in float64 and by the package's combine."""
    run_varlen_over_pages(None, [16, 1, 0, 7, 3], splits, seed=splits, table_seed=3,
                          label="varlen decode")


def check_varlen(q, k, v, cu, out, lse, table, used_k):
    """Each packed sequence as a batch of one against float64 (check_against_float64)."""
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi > lo:
            check_against_float64(q[None, lo:hi], k, v, out[None, lo:hi], lse[None, :, lo:hi],
                                  True, page_table=table[b:b + 1], seqused_k=used_k[b:b + 1])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window_left,causal,d", [(1000, True, 128), (37, True, 64),
                                                  (0, True, 128), (500, False, 64)])
def test_sliding_window(window_left, causal, d, splits):
    """A left window (token t sees keys from t + seqlen_k - seqlen_q - window_left on), over a
    paged cache with per-sequence lengths: against float64, and the paged launch equal to the
    contiguous one bit for bit."""
    batch, sq, h, hk, page_size, pages = 3, 4, 16, 4, 128, 24
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=window_left + splits)
    used = torch.tensor([pages * page_size, 1000, 333], dtype=torch.int32, device=DEVICE)
    paged_equals_contiguous(q, k, v, page_size, 4, causal, splits, used, window_left=window_left)


@pytest.mark.parametrize("page_size,splits,d", [(16, 1, 128), (48, 3, 128), (64, 2, 128),
                                                 (192, 1, 128), (16, 2, 64), (80, 1, 64)])
def test_small_pages_gathered_into_whole_tiles(page_size, splits, d):
    """Pages that hold no whole 128-key tile run with hopper_decode_for_page's gathered tiles
    (Note [Gathered key tiles]: boxes of 16, 16, 64, 64, 16, 16 keys here), the NaN rows past
    each sequence's end and the NaN pages no sequence owns never let a NaN through: paged equal
    to the contiguous launch of the same tile bit for bit, and float64's answer."""
    from fa4_final.hopper.config import hopper_decode_for_page

    batch, sq, h, hk = 3, 4, 32, 8
    pages = 2048 // page_size + 1
    cfg = hopper_decode_for_page(d, page_size)
    assert cfg.tile_n == 128 and cfg.page_box is not None and page_size % cfg.page_box == 0
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=page_size + d)
    used = torch.tensor([pages * page_size, 1, 1000], dtype=torch.int32, device=DEVICE)
    for b, length in enumerate(used.tolist()):  # rows never written: any bits, NaN too
        k[b, length:] = math.nan
        v[b, length:] = math.nan
    paged_equals_contiguous(q, k, v, page_size, 7, True, splits, used, config=cfg)


@pytest.mark.parametrize("page_size,splits", [(16, 1), (48, 3), (64, 2)])
def test_small_pages_with_small_key_tiles(page_size, splits):
    """A small key tile (the largest of 16, 32, 64 that divides the page) also takes small
    pages, one box a tile: paged equal to contiguous (the same config) bit for bit, and float64's
    answer."""
    from fa4_final.hopper.config import HopperDecodeConfig

    batch, sq, h, hk, d = 3, 4, 32, 8, 128
    pages = 2048 // page_size
    tile_n = max(t for t in (16, 32, 64) if page_size % t == 0)
    cfg = HopperDecodeConfig(tile_n=tile_n, stages=3 * 128 // tile_n)
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=page_size)
    used = torch.tensor([pages * page_size, 1, 1000], dtype=torch.int32, device=DEVICE)
    paged_equals_contiguous(q, k, v, page_size, 5, True, splits, used, config=cfg)


@pytest.mark.parametrize("box,splits,seqused,consumers,d", [
    (32, 1, False, 1, 128), (16, 3, True, 1, 128), (32, 2, True, 2, 128), (32, 3, True, 1, 64)])
def test_a_contiguous_cache_read_in_boxes_gives_the_same_bits(box, splits, seqused, consumers, d):
    """page_box on a contiguous cache (Note [Boxes of a contiguous cache]): the same tile from
    smaller TMA boxes, so the same out and lse bit for bit as one box a tile, and float64's
    answer; with seqused_k the rows past each length are NaN and stay out. Two consumers
    (128 packed rows: 16 tokens at GQA 8) and D = 64 (one 64-column copy a box) too."""
    from fa4_final.hopper.config import hopper_decode_default

    batch, hk = 3, 8
    sq, h = (16, 64) if consumers == 2 else (4, 32)
    q, k, v = qkv(batch, sq, 2000, h, hk, d, BF16, seed=box + splits + d)
    used = None
    if seqused:
        used = torch.tensor([2000, 1, 777], dtype=torch.int32, device=DEVICE)
        for b, length in enumerate(used.tolist()):
            k[b, length:] = math.nan
            v[b, length:] = math.nan
    base = replace(hopper_decode_default(d), consumers=consumers)
    got = run_decode(q, k, v, True, splits, seqused_k=used, config=replace(base, page_box=box))
    want = run_decode(q, k, v, True, splits, seqused_k=used, config=base)
    if splits > 1:
        combine = combine_fn()
        for out, lse, (out_p, lse_p) in (got, want):
            combine(out_p, lse_p, out, lse)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check_against_float64(q, k, v, got[0], got[1], True, seqused_k=used)


def test_paged_without_seqused_k_reads_every_page():
    """Without seqused_k a sequence's length is its pages times the page size (FA4's)."""
    q, k, v = qkv(2, 1, 4 * 128, 8, 2, 128, BF16, seed=5)
    kp, vp, table = paged_cache(k.cpu(), v.cpu(), 128, generator=torch.Generator().manual_seed(1))
    kp, vp, table = kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)
    out, lse, _ = run_decode(q, kp, vp, True, page_table=table)
    check_against_float64(q, kp, vp, out, lse, True, page_table=table)
    want = run_decode(q, k, v, True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_two_runs_are_bitwise_equal():
    q, k, v = qkv(2, 4, 5000, 32, 8, 128, BF16, seed=11)
    first = run_decode(q, k, v, True, 4)
    second = run_decode(q, k, v, True, 4)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


def test_cuda_graph_follows_lengths_and_pages_on_the_device():
    """Captured once after a warm-up call, the launch reads seqused_k and the page table from
    device memory at every replay: new values written into those tensors give new answers, with
    no recapture and no host synchronisation in the launch."""
    batch, sq, h, hk, d, page_size, pages = 3, 4, 16, 4, 128, 128, 6
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=21)
    kp, vp, table = paged_cache(k.cpu(), v.cpu(), page_size,
                                generator=torch.Generator().manual_seed(2))
    kp, vp, table = kp.to(DEVICE), vp.to(DEVICE), table.to(DEVICE)
    used = torch.tensor([700, 129, 5], dtype=torch.int32, device=DEVICE)
    plan = compiled(decode_recipe, d, "bf16", True, True, True, False, None)
    out = poisoned_empty(batch, sq, h, d, dtype=BF16, device=DEVICE)
    lse = poisoned_empty(batch, h, sq, dtype=torch.float32, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        launch_decode(plan, q, kp, vp, out, lse, table, used)  # warm-up: compiled, loaded
        with torch.cuda.graph(graph, stream=side):
            launch_decode(plan, q, kp, vp, out, lse, table, used)
    torch.cuda.current_stream().wait_stream(side)
    for lengths, flip in (([700, 129, 5], False), ([1, 768, 300], True), ([0, 64, 768], False)):
        used.copy_(torch.tensor(lengths, dtype=torch.int32))
        if flip:  # the same pages in another order: another cache for every sequence
            table.copy_(table.flip(1))
        out.fill_(float("nan"))
        graph.replay()
        wait_for_gpu(f"graph replay {lengths}")
        check_against_float64(q, kp, vp, out, lse, True, page_table=table, seqused_k=used)


def test_page_sizes_that_split_a_tile_are_refused():
    """A page of 64 keys under 128-key tiles: UnsupportedError naming the page size, before
    any launch."""
    q, k, v = qkv(1, 1, 256, 8, 2, 128, BF16, seed=1)
    kp, vp, table = paged_cache(k.cpu(), v.cpu(), 64)
    plan = compiled(decode_recipe, 128, "bf16", True, True, False, False, None)
    out = poisoned_empty(1, 1, 8, 128, dtype=BF16, device=DEVICE)
    lse = poisoned_empty(1, 8, 1, dtype=torch.float32, device=DEVICE)
    assert page_size_problem(64, 128) is not None
    with pytest.raises(UnsupportedError, match="page_size=64"):
        launch_decode(plan, q, kp.to(DEVICE), vp.to(DEVICE), out, lse, table.to(DEVICE))
    assert out.isnan().all()
    assert math.isnan(float(lse[0, 0, 0]))


# ----------------------------------------------------------------------------------------------
# keys on the wgmma M (HopperDecodeConfig.swap_ab, Note [Keys on M]): -k keys_on_m

KEYS_ON_M_CASES = {  # name: (batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, causal,
    # splits, tile_n); rows_n is hopper_decode_keys_on_m's for tokens x group
    "1tok-gqa8-1000": (4, 1, 1000, 32, 4, 128, BF16, True, 1, 128),  # rows_n 8
    "1tok-gqa4-4097-3splits": (2, 1, 4097, 32, 8, 128, BF16, True, 3, 128),  # 4 rows in 8
    "1tok-gqa1-5": (3, 1, 5, 8, 8, 64, BF16, True, 1, 128),  # 1 row in 8
    "4tok-gqa4-777-d64": (3, 4, 777, 16, 4, 64, BF16, True, 1, 128),  # 16
    "4tok-gqa8-3001-5splits": (2, 4, 3001, 32, 4, 128, BF16, True, 5, 128),  # 32
    "4tok-gqa16-1025-fp16": (2, 4, 1025, 64, 4, 128, FP16, True, 2, 128),  # 2 x 32
    "16tok-gqa1-257-d64": (2, 16, 257, 8, 8, 64, BF16, True, 1, 128),  # 16
    "16tok-gqa8-2049-3splits": (2, 16, 2049, 16, 2, 128, BF16, True, 3, 128),  # 4 x 32
    "16tok-gqa16-4097-tile64": (1, 16, 4097, 32, 2, 128, BF16, True, 4, 64),  # 8 x 32
    "7tok-gqa4-not-causal": (2, 7, 1025, 16, 4, 64, BF16, False, 4, 128),  # 28 in 32
    "3tok-gqa8-333-tile64": (2, 3, 333, 16, 2, 128, BF16, True, 2, 64),  # 24 in 32
    "more-tokens-than-keys": (2, 16, 5, 8, 2, 128, BF16, True, 1, 128),  # rows see no key
    "one-key-empty-split": (2, 4, 1, 8, 2, 64, BF16, True, 2, 128),
    "1tok-gqa16-128k-32splits": (1, 1, 131072, 32, 2, 128, BF16, True, 32, 128),
}


def pages_among_nan_pages(cfg, sq, h, hk, d, page_size, splits, seed, table_seed):
    """Four sequences of ``sq`` tokens over pages of ``page_size`` keys shuffled among NaN pages
    no sequence owns (paged_equals_contiguous), their cached lengths the whole cache, 0, 1 and
    the cache less 77, NaN in the rows past each length (rows a serving engine never wrote):
    the paged launch of ``cfg`` gives the contiguous launch's every bit, and float64's answer."""
    pages = 2048 // page_size + 1
    q, k, v = qkv(4, sq, pages * page_size, h, hk, d, BF16, seed=seed)
    used = torch.tensor([pages * page_size, 0, 1, pages * page_size - 77], dtype=torch.int32,
                        device=DEVICE)
    for b, length in enumerate(used.tolist()):
        k[b, length:] = float("nan")
        v[b, length:] = float("nan")
    paged_equals_contiguous(q, k, v, page_size, table_seed, True, splits, used, config=cfg)


def keys_on_m_config(d, tokens, group, tile_n=128, page_size=None):
    from fa4_final.hopper.config import hopper_decode_keys_on_m

    return replace(hopper_decode_keys_on_m(d, tokens * group, page_size), tile_n=tile_n)


@pytest.mark.parametrize("name", list(KEYS_ON_M_CASES))
def test_keys_on_m_matches_float64(name):
    """Awkward lengths, 1-16 tokens, GQA 1/4/8/16, D = 64/128, bf16 and fp16, causal and not,
    one split and several, tile_n 64 and 128, into NaN-filled outputs: against float64 (the
    partials merged in float64 and by the package's combine), and within float64's tolerance of
    the 64-row kernel on the same inputs."""
    b, sq, sk, h, hk, d, dtype, causal, splits, tile_n = KEYS_ON_M_CASES[name]
    cfg = keys_on_m_config(d, sq, h // hk, tile_n)
    assert cfg.swap_ab
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype, seed=len(name) + 100)
    out, lse, partials = run_decode(q, k, v, causal, splits, config=cfg)
    check_decode(q, k, v, out, lse, partials, causal, f"keys_on_m {name}")
    rows_out, rows_lse, rows_partials = run_decode(q, k, v, causal, splits)  # the 64-row path
    if rows_partials is not None:
        combine_fn()(*rows_partials, rows_out, rows_lse)
        wait_for_gpu(f"combine after the 64-row {name}")
    assert not out.isnan().any() and not lse.isnan().any()
    print(f"{name}: rows_n {cfg.rows_n}, max |out - 64-row out| "
          f"{float((out.float() - rows_out.float()).abs().max()):.3g}")


@pytest.mark.parametrize("page_size,splits,d", [(128, 1, 128), (256, 3, 128), (16, 2, 128),
                                                 (48, 1, 64), (64, 3, 64)])
def test_keys_on_m_paged_is_the_contiguous_launch_bitwise(page_size, splits, d):
    """Pages shuffled among NaN pages no sequence owns, lengths per sequence (one 0, one a
    single key), NaN in the cache rows past them; gathered tiles for pages of 16, 48 and 64
    keys: the paged swapped launch gives the contiguous swapped launch's every bit, and
    float64's answer."""
    sq, h, hk = 1, 32, 4  # GQA 8, one token: rows_n 8
    cfg = keys_on_m_config(d, sq, h // hk, page_size=page_size)
    pages_among_nan_pages(cfg, sq, h, hk, d, page_size, splits, seed=page_size + splits,
                          table_seed=splits + 40)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window_left,causal,d", [(1000, True, 128), (37, True, 64),
                                                  (0, True, 128), (500, False, 64)])
def test_keys_on_m_sliding_window(window_left, causal, d, splits):
    """A left window over a paged cache with per-sequence lengths, keys on M: against float64,
    paged equal to contiguous bit for bit."""
    batch, sq, h, hk, page_size, pages = 3, 4, 16, 4, 128, 24
    cfg = keys_on_m_config(d, sq, h // hk)
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=window_left + splits + 7)
    used = torch.tensor([pages * page_size, 1000, 333], dtype=torch.int32, device=DEVICE)
    paged_equals_contiguous(q, k, v, page_size, 4, causal, splits, used,
                            window_left=window_left, config=cfg)


@pytest.mark.parametrize("splits", [1, 4])
def test_keys_on_m_varlen_queries_over_a_paged_cache(splits):
    """Packed query sequences of 16, 1, 0, 7 and 3 tokens at GQA 8 (rows_n 32: the longest
    sequence's 128 rows in four m-blocks, the others' in fewer or none), each over its own pages
    and cached length, keys on M: every sequence against float64."""
    run_varlen_over_pages(keys_on_m_config(128, 16, 8), [16, 1, 0, 7, 3], splits,
                          seed=splits + 50, table_seed=3, label="varlen keys_on_m decode")


def test_keys_on_m_two_runs_are_bitwise_equal():
    """The column sums and maxima are folded in a fixed order (warp 0 to 3): two runs give the
    same bits."""
    q, k, v = qkv(2, 1, 5000, 32, 4, 128, BF16, seed=12)
    cfg = keys_on_m_config(128, 1, 8)
    first = run_decode(q, k, v, True, 4, config=cfg)
    second = run_decode(q, k, v, True, 4, config=cfg)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# two consumer warpgroups, 128 packed rows a CTA (HopperDecodeConfig.consumers = 2,
# Note [Two consumer warpgroups]): -k two_consumers

TWO_CONSUMERS_CASES = {  # name: (batch, seqlen_q, seqlen_k, heads, heads_kv, d, dtype, causal,
    # splits); packed rows tokens x group in m-blocks of 128, 64 a consumer warpgroup
    "16tok-gqa8-1025": (2, 16, 1025, 32, 4, 128, BF16, True, 1),  # 128 rows: one m-block
    "9tok-gqa8-777-3splits": (3, 9, 777, 16, 2, 128, BF16, True, 3),  # 72: the second has 8
    "11tok-gqa8-4097-5splits-d64": (2, 11, 4097, 16, 2, 64, BF16, True, 5),  # 88
    "12tok-gqa16-3001-fp16": (2, 12, 3001, 32, 2, 128, FP16, True, 2),  # 192: 2 m-blocks
    "16tok-gqa16-2049-d64": (2, 16, 2049, 64, 4, 64, BF16, True, 4),  # 256: 2 full m-blocks
    "13tok-gqa8-not-causal-d64": (2, 13, 1000, 16, 2, 64, BF16, False, 4),  # 104
    "15tok-gqa16-not-causal": (2, 15, 1537, 32, 2, 128, BF16, False, 1),  # 240
    "4tok-gqa8-1000": (2, 4, 1000, 32, 4, 128, BF16, True, 1),  # 32: the second all padding
    "more-tokens-than-keys": (2, 16, 5, 16, 2, 128, BF16, True, 1),  # rows that see no key
    "one-key-empty-split": (2, 10, 1, 16, 2, 64, BF16, True, 2),
    "16tok-gqa8-128k-16splits": (1, 16, 131072, 32, 4, 128, BF16, True, 16),
}


def two_consumers_config(d, page_size=None):
    from fa4_final.hopper.config import hopper_decode_default, hopper_decode_for_page

    base = hopper_decode_default(d) if page_size is None else hopper_decode_for_page(d,
                                                                                    page_size)
    return replace(base, consumers=2)


@pytest.mark.parametrize("name", list(TWO_CONSUMERS_CASES))
def test_two_consumers_matches_float64(name):
    """Tokens 9-16 at GQA 8 and 16 (72-256 packed rows: a second warpgroup with a few real rows,
    one with none, two m-blocks), awkward lengths, D = 64/128, bf16 and fp16, causal and not,
    one split and several, into NaN-filled outputs: against float64 (the partials merged in
    float64 and by the package's combine). Not causal, the key range and the splits are the
    64-row kernel's and each row's arithmetic the same: bit for bit its out, lse or partials;
    causal, the 128-row block's range may add tiles fully masked for some rows (printed)."""
    d = TWO_CONSUMERS_CASES[name][5]
    against_float64_and_a_twin(name, two_consumers_config(d), None, "64-row",
                               seed=len(name) + 200, label=f"two_consumers {name}")


def against_float64_and_a_twin(name, cfg, twin_cfg, twin: str, seed: int, label: str):
    """TWO_CONSUMERS_CASES[name] run with ``cfg`` into NaN-filled outputs, against float64
    (the partials merged in float64 and by the package's combine); beside it the kernel built
    with ``twin_cfg`` (None: the default), whose bits it must give when not causal (the same
    key range, splits and per-row arithmetic); the largest difference printed."""
    b, sq, sk, h, hk, d, dtype, causal, splits = TWO_CONSUMERS_CASES[name]
    q, k, v = qkv(b, sq, sk, h, hk, d, dtype, seed=seed)
    out, lse, partials = run_decode(q, k, v, causal, splits, config=cfg)
    rows = run_decode(q, k, v, causal, splits, config=twin_cfg)
    check_decode(q, k, v, out, lse, partials, causal, label)
    if partials is not None:
        combine_fn()(*rows[2], rows[0], rows[1])
        wait_for_gpu(f"combine after the {twin} {name}")
    assert not out.isnan().any() and not lse.isnan().any()
    if not causal:
        got, want = (partials, rows[2]) if splits > 1 else ((out, lse), rows[:2])
        for a, b_ in zip(got, want):
            assert torch.equal(a, b_), f"not the {twin} kernel's bits"
    print(f"{name}: max |out - {twin} out| "
          f"{float((out.float() - rows[0].float()).abs().max()):.3g}")


@pytest.mark.parametrize("page_size,splits,d", [(128, 1, 128), (256, 3, 128), (16, 2, 128),
                                                 (48, 1, 64), (64, 3, 64)])
def test_two_consumers_paged_is_the_contiguous_launch_bitwise(page_size, splits, d):
    """16 tokens at GQA 8 (128 rows) over pages shuffled among NaN pages no sequence owns,
    lengths per sequence (one 0, one a single key), NaN in the cache rows past them, pages of
    16, 48 and 64 keys read as boxes of a tile: the paged launch gives the contiguous launch's
    every bit, and float64's answer (the V tail's zeros shared by the two warpgroups)."""
    sq, h, hk = 16, 32, 4
    pages_among_nan_pages(two_consumers_config(d, page_size), sq, h, hk, d, page_size, splits,
                          seed=page_size + splits + 60, table_seed=splits + 70)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window_left,causal,d", [(1000, True, 128), (37, True, 64),
                                                  (0, True, 128), (500, False, 64)])
def test_two_consumers_sliding_window(window_left, causal, d, splits):
    """A left window over a paged cache with per-sequence lengths, 12 tokens at GQA 8 (96 rows:
    the two warpgroups' windows start apart): against float64, paged equal to contiguous."""
    batch, sq, h, hk, page_size, pages = 3, 12, 16, 2, 128, 24
    cfg = two_consumers_config(d)
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=window_left + splits + 9)
    used = torch.tensor([pages * page_size, 1000, 333], dtype=torch.int32, device=DEVICE)
    paged_equals_contiguous(q, k, v, page_size, 5, causal, splits, used,
                            window_left=window_left, config=cfg)


@pytest.mark.parametrize("splits", [1, 4])
def test_two_consumers_varlen_queries_over_a_paged_cache(splits):
    """Packed query sequences of 16, 1, 0, 9 and 3 tokens at GQA 8 (the longest one's 128 rows
    one m-block, the others' fewer), each over its own pages and cached length, two consumer
    warpgroups: every sequence against float64."""
    run_varlen_over_pages(two_consumers_config(128), [16, 1, 0, 9, 3], splits,
                          seed=splits + 80, table_seed=4, label="varlen two_consumers decode")


def test_two_consumers_two_runs_are_bitwise_equal():
    """Each row's sums run in the 64-row kernel's order: two runs give the same bits."""
    q, k, v = qkv(2, 16, 5000, 32, 4, 128, BF16, seed=13)
    cfg = two_consumers_config(128)
    first = run_decode(q, k, v, True, 4, config=cfg)
    second = run_decode(q, k, v, True, 4, config=cfg)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# a pair of CTAs sharing each K/V tile by multicast (HopperDecodeConfig.cluster = 2,
# Note [A pair of CTAs shares the cache]): -k cluster


def cluster_config(d):
    return replace(two_consumers_config(d), cluster=2)


@pytest.mark.parametrize("name", list(TWO_CONSUMERS_CASES))
def test_cluster_matches_float64(name):
    """The two-consumer cases (72-256 packed rows: a pair whose second CTA holds a few real rows
    or none, a pair of two full m-blocks, rows that see no key, an empty split, 128k keys) with
    the pair of CTAs: against float64 into NaN-filled outputs. Not causal, each row's key range
    and splits are the kernel's without the cluster: bit for bit its out, lse or partials."""
    d = TWO_CONSUMERS_CASES[name][5]
    against_float64_and_a_twin(name, cluster_config(d), two_consumers_config(d), "two-consumer",
                               seed=len(name) + 300, label=f"cluster {name}")


@pytest.mark.parametrize("page_size,splits,d", [(128, 1, 128), (256, 3, 128), (128, 2, 64)])
def test_cluster_paged_is_the_contiguous_launch_bitwise(page_size, splits, d):
    """16 tokens at GQA 16 (256 rows: one pair) over pages shuffled among NaN pages, per-sequence
    lengths with NaN past them: the paged launch gives the contiguous launch's bits and
    float64's answer (each CTA zeros its own copy of the V tail)."""
    pages_among_nan_pages(cluster_config(d), 16, 32, 2, d, page_size, splits,
                          seed=page_size + splits + 90, table_seed=splits + 95)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window_left,causal,d", [(1000, True, 128), (37, True, 64),
                                                  (500, False, 64)])
def test_cluster_sliding_window(window_left, causal, d, splits):
    """A left window, 16 tokens at GQA 16 (the pair's windows start apart): against float64,
    paged equal to contiguous."""
    batch, sq, h, hk, page_size, pages = 3, 16, 32, 2, 128, 24
    q, k, v = qkv(batch, sq, pages * page_size, h, hk, d, BF16, seed=window_left + splits + 19)
    used = torch.tensor([pages * page_size, 1000, 333], dtype=torch.int32, device=DEVICE)
    paged_equals_contiguous(q, k, v, page_size, 5, causal, splits, used,
                            window_left=window_left, config=cluster_config(d))


@pytest.mark.parametrize("splits", [1, 4])
def test_cluster_varlen_queries_over_a_paged_cache(splits):
    """Packed query sequences of 16, 1, 0, 9 and 3 tokens at GQA 8 with the pair of CTAs (the
    grid sized for the longest; pairs past a shorter sequence's rows visit nothing)."""
    run_varlen_over_pages(cluster_config(128), [16, 1, 0, 9, 3], splits,
                          seed=splits + 180, table_seed=5, label="varlen cluster decode")


def test_cluster_two_runs_are_bitwise_equal():
    """The multicast changes where a tile's bytes come from, not the order of any sum."""
    q, k, v = qkv(2, 16, 5000, 64, 4, 128, BF16, seed=23)
    first = run_decode(q, k, v, True, 4, config=cluster_config(128))
    second = run_decode(q, k, v, True, 4, config=cluster_config(128))
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)
