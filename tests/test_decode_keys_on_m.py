"""The Hopper decode kernel with the keys on the wgmma M (HopperDecodeConfig.swap_ab,
Note [Keys on M] in fa4_final.hopper.decode) on a CPU: the config's refusals and shared-memory
formula, the walk at rows_n packed rows a CTA in float64 against the float64 decode, the
transposed fragments' (key, packed row) and (d, packed row) mapping traced from the kernel's own
tiled MMAs and run through the column softmax and the epilogue as the kernel does them (the
butterfly shuffles, the four warps' shared-memory exchange), and the builds compiled for sm_90a
(slow: no spill, no local memory, no wgmma serialised by ptxas, the register plan, the GEMM and
barrier counts). Nothing here runs on a GPU."""

import math
from dataclasses import replace

import pytest
import torch

from fa4_final.hopper.config import (
    DECODE_LAUNCH_REGISTERS,
    DECODE_ROWS_NS,
    SM90_DECODE_REGISTERS,
    HopperDecodeConfig,
    hopper_decode_default,
    hopper_decode_for_page,
    hopper_decode_keys_on_m,
)
from tests.decode_reference import decode_reference, emulate_decode, merge_splits, paged_cache

# ----------------------------------------------------------------------------------------------
# the config


def test_decode_keys_on_m_default_is_unchanged():
    for d in (64, 128):
        cfg = hopper_decode_default(d)
        assert cfg.swap_ab is False and cfg.rows_n is None and cfg.tile_m == 64
        for page in (16, 48, 128, 256):
            assert hopper_decode_for_page(d, page).swap_ab is False


def test_decode_keys_on_m_config_refusals_name_the_knob():
    on = HopperDecodeConfig(swap_ab=True, rows_n=8)
    on.check(128)
    assert on.tile_m == 8
    with pytest.raises(ValueError, match=r"rows_n=16 .*needs swap_ab=True"):
        HopperDecodeConfig(rows_n=16).check(128)
    for rows in (None, 4, 12, 64, True):
        with pytest.raises(ValueError, match=r"swap_ab=True needs rows_n.*\(8, 16, 32\)"):
            HopperDecodeConfig(swap_ab=True, rows_n=rows).check(128)
    for tile_n in (16, 32):
        with pytest.raises(ValueError, match=rf"tile_n must be one of \(64, 128\), got {tile_n}"):
            replace(on, tile_n=tile_n).check(64)
    with pytest.raises(TypeError, match="swap_ab must be a bool"):
        HopperDecodeConfig(swap_ab=1, rows_n=8).check(128)
    with pytest.raises(ValueError, match=r"shared memory .*P\^T 128x32"):
        HopperDecodeConfig(stages=4, swap_ab=True, rows_n=32).check(128)
    with pytest.raises(ValueError, match="packed_rows"):
        hopper_decode_keys_on_m(128, 0)


def test_decode_keys_on_m_shared_memory_formula():
    """Barriers + the 4 x rows_n float32 exchange (one 1 KB granule), Q of rows_n rows, the K
    and V rings, P^T of tile_n x rows_n: at rows_n = 32 the 64-row path's 209 KB (Q halves, P^T
    takes the other half); the kernel asserts its struct has this size (HopperDecode.__call__)."""
    for d in (64, 128):
        ring = 3 * 128 * d * 2
        for rows in DECODE_ROWS_NS:
            cfg = HopperDecodeConfig(swap_ab=True, rows_n=rows)
            assert cfg.smem_bytes(d) == 1024 + rows * d * 2 + 2 * ring + rows * 128 * 2
        assert (HopperDecodeConfig(swap_ab=True, rows_n=32).smem_bytes(128)
                == hopper_decode_default(128).smem_bytes(128) == 209 * 1024)
    assert HopperDecodeConfig(swap_ab=True, rows_n=8).smem_bytes(128) == 197 * 1024
    cfg = HopperDecodeConfig(tile_n=64, stages=6, swap_ab=True, rows_n=16)
    assert cfg.smem_bytes(128) == 1024 + 16 * 128 * 2 + 2 * 6 * 64 * 128 * 2 + 16 * 64 * 2


@pytest.mark.parametrize("d", [64, 128])
def test_decode_keys_on_m_picks_the_smallest_n(d):
    """hopper_decode_keys_on_m: the default's tile and stages (a page's gathered box too) with
    rows_n the smallest N that holds tokens x group packed rows; more than 32 take m-blocks of
    32."""
    for rows, want in [(1, 8), (4, 8), (8, 8), (9, 16), (16, 16), (28, 32), (32, 32),
                       (33, 32), (64, 32), (256, 32)]:
        cfg = hopper_decode_keys_on_m(d, rows)
        cfg.check(d)
        assert (cfg.swap_ab, cfg.rows_n, cfg.tile_m) == (True, want, want)
        assert (cfg.tile_n, cfg.stages, cfg.page_box) == (128, 3, None)
    assert hopper_decode_keys_on_m(d, 8, page_size=16).page_box == 16
    assert hopper_decode_keys_on_m(d, 8, page_size=256).page_box is None


def test_decode_keys_on_m_rows_are_kernel_rows_not_peers():
    from measure import decode

    for name in ("fa4_final_decode_keys_on_m", "fa4_final_decode_keys_on_m_paged"):
        assert name in decode.DECODE_KERNEL and name in decode.OURS
        assert name not in decode.PEERS


# ----------------------------------------------------------------------------------------------
# the walk at rows_n packed rows a CTA (the producer's and the splits' arithmetic, tile_m = rows_n)

WALKS = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, splits, tile_n)
    (2, 1, 300, 8, 1, True, 1, 128),  # GQA 8, one token: 8 rows, one m-block of 8
    (2, 1, 777, 16, 4, True, 3, 64),  # GQA 4: 4 rows padded to 8
    (1, 4, 1025, 16, 1, True, 4, 128),  # GQA 16 x 4 tokens: 64 rows, m-blocks of 8..32
    (2, 7, 513, 8, 2, False, 2, 64),  # 28 rows, padding
    (1, 16, 200, 4, 4, True, 2, 128),  # GQA 1: the diagonal crosses m-blocks
    (2, 16, 5, 8, 2, True, 2, 64),  # more tokens than keys: columns that see no key
]


@pytest.mark.parametrize("rows_n", DECODE_ROWS_NS)
@pytest.mark.parametrize("case", WALKS, ids=lambda c: "-".join(map(str, c)))
def test_decode_keys_on_m_walk_is_the_decode(case, rows_n):
    batch, sq, sk, h, hk, causal, splits, tile_n = case
    g = torch.Generator().manual_seed(sum(case[:5]) + rows_n)
    q = torch.randn(batch, sq, h, 32, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    out_ref, lse_ref = decode_reference(q, k, v, causal)
    out_p, lse_p, _ = emulate_decode(q, k, v, causal, splits, tile_m=rows_n, tile_n=tile_n)
    assert not out_p.isnan().any() and not lse_p.isnan().any()
    out, lse = merge_splits(out_p, lse_p)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("page_size,page_box", [(128, None), (16, 16), (48, 16)])
def test_decode_keys_on_m_paged_walk_equals_contiguous(page_size, page_box):
    batch, sq, h, hk, pages = 3, 1, 16, 2, 6
    g = torch.Generator().manual_seed(page_size)
    q = torch.randn(batch, sq, h, 32, generator=g, dtype=torch.float64)
    k = torch.randn(batch, pages * page_size, hk, 32, generator=g, dtype=torch.float64)
    v = torch.randn_like(k)
    used = torch.tensor([pages * page_size, 1, pages * page_size - 37], dtype=torch.int32)
    for b, length in enumerate(used.tolist()):
        k[b, length:] = math.nan
        v[b, length:] = math.nan
    kp, vp, table = paged_cache(k, v, page_size, generator=g)
    contiguous = emulate_decode(q, k, v, True, 2, seqused_k=used, tile_m=8)
    paged = emulate_decode(q, kp, vp, True, 2, page_table=table, seqused_k=used, tile_m=8,
                           page_box=page_box)
    for a, b in zip(contiguous[:2], paged[:2]):
        assert torch.equal(a, b) and not a.isnan().any()


# ----------------------------------------------------------------------------------------------
# the transposed fragments, traced from the kernel's tiled MMAs (Note [Keys on M])


def trace_fragments(d: int, tile_n: int, rows_n: int) -> dict:
    """{thread: (S^T coords, O^T coords)}: for each of the thread's columns c (acc_rows_cols'
    column index) the (key, packed row) of its S^T elements and the (d, packed row) of its O^T
    elements, from keys_on_m_mmas() traced for sm_90a (static layouts; nothing launched)."""
    import cutlass.cute as cute

    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.common.fragments import acc_rows_cols
    from fa4_final.hopper.decode import HopperDecode

    cfg = replace(hopper_decode_keys_on_m(d, rows_n), tile_n=tile_n)
    kernel = HopperDecode(CUTLASS_BY_NAME["bf16"], d, True, cfg)
    got = {}

    def coords(t):
        return [[tuple(int(x) for x in t[r, c]) for r in range(cute.size(t, mode=[0]))]
                for c in range(cute.size(t, mode=[1]))]

    def collect():
        mma_s, mma_o = kernel.keys_on_m_mmas()
        for t in range(128):
            cs = acc_rows_cols(mma_s.get_slice(t).partition_C(
                cute.make_identity_tensor((tile_n, rows_n))))
            co = acc_rows_cols(mma_o.get_slice(t).partition_C(
                cute.make_identity_tensor((d, rows_n))))
            got[t] = (coords(cs), coords(co))

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options="--gpu-arch sm_90a")
    return got


SHUFFLES = (4, 8, 16)  # the kernel's column_exchange
WARPS = 4


def exchange(frag, values, op, shuffles=SHUFFLES, warps=WARPS):
    """column_exchange on the CPU: per thread and column index, op over the lanes of equal
    lane % 4 by butterfly shuffles (xor 4, 8, 16: every lane takes its partner's value of the
    same register), then lanes 0-3 write sX[warp, column] and every thread folds the four warps
    in order."""
    for offset in shuffles:
        values = {t: [op(v, values[t ^ offset][c]) for c, v in enumerate(values[t])]
                  for t in values}
    sx = {}
    for t, vals in values.items():
        if t % 32 < 4:
            for c, v in enumerate(vals):
                col = frag[t][0][c][0][1]
                assert (t // 32, col) not in sx, "two lanes write one exchange slot"
                sx[t // 32, col] = v
    out = {}
    for t, vals in values.items():
        out[t] = []
        for c in range(len(vals)):
            col = frag[t][0][c][0][1]
            total = sx[0, col]
            for w in range(1, warps):
                total = op(total, sx[w, col])
            out[t].append(total)
    return out


def emulate_columns(frag, scores, values, **exchange_kw):
    """(out (rows_n, D), lse (rows_n,)) of the swapped consumer on the CPU, through the traced
    fragments: per step each thread's max over its keys of a column, the exchange, the
    exponentials against the shared max, alpha, the thread's partial sums, P^T assembled from
    every thread's elements (each (key, row) exactly once), O^T = alpha O^T + V^T P^T held by
    each thread at its (d, row) elements; the sums exchanged once; out and lse from O^T's
    elements, lse by the threads holding d = 0."""
    steps, tile_n, rows_n = scores.shape
    d = values.shape[2]
    inf = math.inf
    threads = range(128)
    cols = len(frag[0][0])
    col_max = {t: [-inf] * cols for t in threads}
    col_sum = {t: [0.0] * cols for t in threads}
    o = {t: [[0.0] * len(frag[t][1][c]) for c in range(cols)] for t in threads}
    for i in range(steps):
        s, first = scores[i], i == 0
        local = {t: [max(float(s[kk, cc]) for kk, cc in frag[t][0][c]) for c in range(cols)]
                 for t in threads}
        tile_max = exchange(frag, local, max, **exchange_kw)
        p = torch.full((tile_n, rows_n), math.nan, dtype=torch.float64)
        alpha = {}
        for t in threads:
            alpha[t] = []
            for c in range(cols):
                new = tile_max[t][c] if first else max(col_max[t][c], tile_max[t][c])
                safe = 0.0 if new == -inf else new
                part = 0.0
                for kk, cc in frag[t][0][c]:
                    assert math.isnan(p[kk, cc]), "a (key, row) of P^T written twice"
                    p[kk, cc] = math.exp(float(s[kk, cc]) - safe)
                    part += float(p[kk, cc])
                a = 1.0 if first else math.exp(col_max[t][c] - safe)
                col_sum[t][c] = part if first else col_sum[t][c] * a + part
                col_max[t][c] = new
                alpha[t].append(a)
        assert not p.isnan().any(), "a (key, row) of P^T written by no thread"
        pv = values[i].T @ p  # (D, rows_n): the GEMM; what it reads is the mapping's
        for t in threads:
            for c in range(cols):
                for r, (dd, cc) in enumerate(frag[t][1][c]):
                    assert cc == frag[t][0][c][0][1], "O^T's column is not S^T's"
                    o[t][c][r] = alpha[t][c] * o[t][c][r] + float(pv[dd, cc])
    total = exchange(frag, col_sum, lambda a, b: a + b, **exchange_kw)
    out = torch.full((rows_n, d), math.nan, dtype=torch.float64)
    lse = torch.full((rows_n,), math.nan, dtype=torch.float64)
    for t in threads:
        for c in range(cols):
            seen = total[t][c] > 0
            for r, (dd, cc) in enumerate(frag[t][1][c]):
                assert math.isnan(out[cc, dd]), "an (row, d) of out written twice"
                out[cc, dd] = o[t][c][r] / total[t][c] if seen else 0.0
            if frag[t][1][0][0][0] == 0:
                col = frag[t][1][c][0][1]
                assert math.isnan(lse[col])
                lse[col] = col_max[t][c] + math.log(total[t][c]) if seen else -inf
    assert not out.isnan().any() and not lse.isnan().any()
    return out, lse


@pytest.mark.slow
@pytest.mark.parametrize("d,tile_n,rows_n", [(128, 128, 8), (64, 64, 16), (128, 64, 32),
                                             (64, 128, 32)])
def test_decode_keys_on_m_fragments_give_the_column_softmax(d, tile_n, rows_n):
    """Three key tiles of scores with masked entries (a column masked in the first tile only, a
    column masked in every tile, a column whose max moves in the last tile) through the traced
    fragments and the kernel's exchange: every thread of a column holds the same running max,
    every (key, row) of P^T and (row, d) of out comes from exactly one thread, and out and lse
    are the softmax of the three tiles in float64."""
    frag = trace_fragments(d, tile_n, rows_n)
    # the mask's constants (Note [Mask with constants]): a thread's key of element (r, c) is its
    # first key plus thread 0's key of (r, c), and a column index is one packed row
    for s_coords, _ in frag.values():
        first = s_coords[0][0][0]
        for c, column in enumerate(s_coords):
            assert {cc for _, cc in column} == {column[0][1]}
            assert [kk - first for kk, _ in column] == [kk for kk, _ in frag[0][0][c]]
    scores, values = column_inputs(d, tile_n, rows_n)
    out, lse = emulate_columns(frag, scores, values)
    want_out, want_lse = column_softmax(scores, values)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert (out[2] == 0).all() and lse[2] == -math.inf


@pytest.mark.slow
@pytest.mark.parametrize("mistake", [dict(shuffles=(1, 2)), dict(shuffles=(4, 8)),
                                     dict(warps=1)], ids=str)
def test_decode_keys_on_m_planted_exchange_mistakes_are_caught(mistake):
    """Shuffles over a quad (the 64-row path's row reduction), one shuffle short, or a warp
    that keeps its own max: the emulation disagrees with the softmax."""
    frag = trace_fragments(128, 128, 16)
    scores, values = column_inputs(128, 128, 16)
    out, lse = emulate_columns(frag, scores, values, **mistake)
    want_out, _ = column_softmax(scores, values)
    assert not torch.allclose(out, want_out, rtol=1e-6, atol=1e-6)


def column_inputs(d, tile_n, rows_n, steps=3):
    """Scores (steps, tile_n, rows_n) with the masked patterns of the test above, and V."""
    g = torch.Generator().manual_seed(d + tile_n + rows_n)
    scores = torch.randn(steps, tile_n, rows_n, generator=g, dtype=torch.float64) * 3
    values = torch.randn(steps, tile_n, d, generator=g, dtype=torch.float64)
    scores[0, :, 1] = -math.inf  # masked in the first tile only
    scores[:, :, 2] = -math.inf  # no key at all: out 0, lse -inf
    scores[0, 5:, 3] = -math.inf  # the tile past seqlen_k's end
    scores[2, 7, 0] = 40.0  # the max moves in the last tile: alpha rescales O^T
    return scores, values


def column_softmax(scores, values):
    """(out, lse) of every tile's keys at once, in float64."""
    rows_n, d = scores.shape[2], values.shape[2]
    s = scores.permute(2, 0, 1).reshape(rows_n, -1)  # (rows, keys)
    vv = values.reshape(-1, d)
    m = s.max(dim=1).values
    safe = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - safe[:, None])
    total = p.sum(dim=1)
    seen = total > 0
    want_out = torch.where(seen[:, None], (p @ vv) / torch.where(seen, total, 1.0)[:, None], 0.0)
    want_lse = torch.where(seen, safe + torch.log(torch.where(seen, total, 1.0)), -math.inf)
    return want_out, want_lse


# ----------------------------------------------------------------------------------------------
# the builds, compiled for sm_90a

# (GQA, tokens) of the shapes: packed rows 4..64 -> rows_n 8, 8, 16, 16, 32, 32 (the
# last in two m-blocks)
SHAPES = [(4, 1), (8, 1), (16, 1), (4, 4), (8, 4), (16, 4)]


def build(d, rows, tile_n=128, page_size=None, dtype="bf16", causal=True, paged=False,
          used=False, split=False, varlen=False, window=False):
    from fa4_final.hopper.host import decode_recipe
    from fa4_final.runtime.compile import artifacts

    cfg = replace(hopper_decode_keys_on_m(d, rows, page_size), tile_n=tile_n)
    art = artifacts(decode_recipe(d, dtype, causal, paged, used, split, cfg, varlen_q=varlen,
                                  has_window_left=window))["main"]
    return cfg, art


def check_clean(art, cfg, d, bodies):
    """No spill or stack, no local memory, no wgmma serialised by ptxas (every WARPGROUP.ARRIVE
    is the source's wgmma.fence), the register plan, and per step body S^T's tile_n/64 x D/16
    wgmma, O^T's D/64 x tile_n/16, two named barriers, one stmatrix pass."""
    import re

    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    art.forbid("LDL", "STL", where="sass")
    art.forbid("ld.local", "st.local")
    assert art.count("WARPGROUP.ARRIVE", "sass") == art.count("wgmma.fence.sync.aligned")
    producer, consumer = SM90_DECODE_REGISTERS
    assert re.search(rf"setmaxnreg.dec.sync.aligned.u32\s+{producer};", art.ptx)
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{consumer};", art.ptx)
    assert art.registers <= DECODE_LAUNCH_REGISTERS, art.resources()
    n = cfg.tile_n
    assert art.count("HGMMA", "sass") == bodies * (n // 64 * d // 16 + d // 64 * n // 16)
    assert art.count("wgmma.commit_group") == 2 * bodies
    art.require("stmatrix.sync.aligned", "shfl.sync.bfly", "ex2.approx")
    art.require("STSM", "SHFL.BFLY", "MUFU.EX2", "HGMMA.64x", where="sass")
    # P^T by stmatrix: a warp's tile_n / 4 keys x rows_n, 64 elements a matrix, x4 (x2 at N = 8)
    per_store = 64 * (4 if cfg.rows_n % 16 == 0 else 2)
    assert art.count("stmatrix.sync.aligned") == bodies * n // 4 * cfg.rows_n // per_store
    assert art.count("stmatrix.sync.aligned.m8n8.x") == art.count("stmatrix.sync.aligned")
    assert ".trans" in art.ptx.split("stmatrix.sync.aligned", 1)[1].split("\n", 1)[0]
    # the mbarriers' init, Q, the zeros past seqlen_k, the sums' exchange; two a step body
    assert art.count("bar.sync") == 4 + 2 * bodies


@pytest.mark.slow
@pytest.mark.parametrize("group,tokens", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("d", [64, 128])
def test_decode_keys_on_m_compiles_clean(d, group, tokens):
    cfg, art = build(d, group * tokens)
    assert cfg.rows_n == min([n for n in DECODE_ROWS_NS if n >= group * tokens] + [32])
    check_clean(art, cfg, d, bodies=3)


VARIANTS = {  # name: (d, rows, build keywords, step bodies)
    "paged-seqused-split": (128, 8, dict(paged=True, used=True, split=True), 3),
    "gathered16-split": (128, 8, dict(page_size=16, paged=True, used=True, split=True), 3),
    "gathered48-d64": (64, 32, dict(page_size=48, paged=True, used=True), 3),
    "varlen-paged-split": (128, 16, dict(paged=True, used=True, split=True, varlen=True), 3),
    "window-paged-split": (128, 8, dict(paged=True, used=True, split=True, window=True), 4),
    "window-not-causal-d64": (64, 16, dict(causal=False, window=True), 4),
    "fp16-paged-split-d64": (64, 32, dict(dtype="fp16", paged=True, used=True, split=True), 3),
    "tile64": (128, 32, dict(tile_n=64), 3),
    # measure.decode's builds: not causal, the paged one with seqused_k
    "not-causal-paged-split": (128, 8, dict(causal=False, paged=True, used=True, split=True), 3),
    "not-causal-d64-rows32": (64, 32, dict(causal=False), 3),
    "tile64-d64-rows8": (64, 8, dict(tile_n=64, split=True), 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_keys_on_m_variants_compile_clean(name):
    d, rows, kw, bodies = VARIANTS[name]
    cfg, art = build(d, rows, **kw)
    check_clean(art, cfg, d, bodies)
    # the device reads: seqused_k, a page (a box), the varlen offsets; Q by 16 B
    assert art.count("ld.global.v4.b32") == -(-cfg.rows_n * d // 8 // 128)


# ----------------------------------------------------------------------------------------------
# measure.decode's kernel rows, with CPU stand-ins for the compile, the launch and the combine


@pytest.mark.parametrize("variants", [(), ("n64s3", "split2", "wg2", "pair", "b32", "pdl", "c16",
                                          "c16p")],
                         ids=["default", "variants"])
@pytest.mark.parametrize("fail,room", [(False, True), (True, True), (False, False)],
                         ids=["built", "fails", "no-room"])
def test_decode_keys_on_m_measure_rows_with_cpu_stand_ins(monkeypatch, fail, room, variants):
    """_kernel_calls on CPU tensors, the kernel launches replaced by the float64 decode of what
    they are given (the page table, the split partials, the configs they were compiled with):
    four rows, the keys-on-M ones with swap_ab configs (a gathered box for pages of 16),
    rows_n, max_diff to the 64-row row and paged bit for bit; a keys-on-M build that fails
    leaves error rows for its two names and the 64-row rows timed. ``--variants`` (measure.decode
    VARIANTS) add a contiguous row per config candidate: its tile, stages and consumer
    warpgroups compiled (wg2: its split count at tile_m = 128), the
    split count times its factor, max_diff to the default's out. With no room for the cache
    in table order: the paged row timed unchecked, the candidates still there, the keys-on-M
    rows error rows saying why."""
    import fa4_final.hopper.host as host
    import fa4_final.runtime.compile as compile_mod
    import fa4_final.runtime.decode as runtime_decode
    from measure import decode

    shape = decode.DecodeShape(batch=2, tokens=1, keys=256, heads=8, heads_kv=1, d=64)
    seen = []

    def fake_compiled(fn, *args):
        if fn.__name__ == "combine_recipe":  # a combine candidate: pdl's, c16's or c16p's
            assert args in ((64, "bf16", "sm_90a", True, 4, False),
                            (64, "bf16", "sm_90a", False, 16, False),
                            (64, "bf16", "sm_90a", False, 16, True))
            return type("Plan", (), {"kernels": {"main": fake_combine}})()
        cfg = args[-1]
        if fail and cfg.swap_ab:
            raise RuntimeError("keys-on-M build failed")
        seen.append(cfg)
        return type("Plan", (), {"config": cfg})()

    def fake_launch(plan, q, k, v, out, lse, table=None, used=None):
        ref_out, ref_lse = decode_reference(q.double(), k.double(), v.double(), False,
                                            page_table=table, seqused_k=used)
        if out.dim() == 5:  # the partials: all in split 0
            out.zero_()
            lse.fill_(-math.inf)
            out[0], lse[0] = ref_out.float(), ref_lse.float()
        else:
            out.copy_(ref_out)
            lse.copy_(ref_lse)

    def fake_combine(out_p, lse_p, out, lse):
        merged, merged_lse = merge_splits(out_p.double(), lse_p.double())
        out.copy_(merged)
        lse.copy_(merged_lse)

    monkeypatch.setattr(compile_mod, "compiled", fake_compiled)
    monkeypatch.setattr(host, "launch_decode", fake_launch)
    monkeypatch.setattr(runtime_decode, "combine_splits", fake_combine)
    monkeypatch.setattr(decode, "_second_copy_fits", lambda k, v: room)
    tiles = []  # (tile_m, tile_n) of each split count asked for
    monkeypatch.setattr(decode, "split_count",
                        lambda shape, req, tile_m, tile_n: tiles.append((tile_m, tile_n)) or 2)
    monkeypatch.setattr(decode.bench, "peers", lambda: {"sdpa_flash": lambda q, k, v: (
        decode_reference(q.double(), k.double(), v.double(), False)[0].to(q.dtype),)})
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=g).bfloat16()
    k = torch.randn(2, 256, 1, 64, generator=g).bfloat16()
    v = torch.randn(2, 256, 1, 64, generator=g).bfloat16()
    page = 16
    k_cache, v_cache = k.view(-1, page, 1, 64), v.view(-1, page, 1, 64)
    table = decode.random_page_table(2, 256, page, g)
    used = torch.full((2,), 256, dtype=torch.int32)
    calls, extra = decode._kernel_calls(shape, q, k, v, k_cache, v_cache, table, used, 0,
                                        variants)
    names = ["fa4_final_decode", "fa4_final_decode_paged", "fa4_final_decode_keys_on_m",
             "fa4_final_decode_keys_on_m_paged"]
    for name in variants:
        row = extra.pop(f"fa4_final_decode_{name}")
        if name in decode.COMBINE_VARIANTS:  # the default kernel and splits, a combine
            assert {k: row[k] for k in decode.COMBINE_VARIANTS[name]} \
                == decode.COMBINE_VARIANTS[name]
            assert row["splits"] == 2 and row["max_diff"] < 1e-2
            assert calls.pop(f"fa4_final_decode_{name}")().shape == q.shape
            continue
        tile_n, stages, factor, consumers, cluster, box = decode.VARIANTS[name]
        assert (row["tile_n"], row["stages"], row["splits"], row["consumers"],
                row["cluster"], row["page_box"]) == (tile_n, stages, 2 * factor, consumers,
                                                     cluster, box)
        assert row["max_diff"] < 1e-2
        assert any(not c.swap_ab and (c.tile_n, c.stages, c.consumers, c.cluster, c.page_box)
                   == (tile_n, stages, consumers, cluster, box) for c in seen)
        assert calls.pop(f"fa4_final_decode_{name}")().shape == q.shape
    # wg2 (Note [Two consumer warpgroups]): its split count taken at tile_m = 128
    assert ((128, 128) in tiles) == ("wg2" in variants)
    assert sorted(extra) == sorted(names)
    if not room:
        assert extra["fa4_final_decode_paged"]["bitwise_equal"] is None
        assert "does not fit" in extra["fa4_final_decode_paged"]["unchecked"]
        assert sorted(calls) == names[:2]
        for name in names[2:]:
            assert extra[name]["error"].startswith("not run: the cache in table order")
        return
    assert extra["fa4_final_decode_paged"]["bitwise_equal"] is True
    if fail:
        assert sorted(calls) == names[:2]
        for name in names[2:]:
            assert "keys-on-M build failed" in extra[name]["error"]
        return
    assert sorted(calls) == sorted(names)
    swapped = [c for c in seen if c.swap_ab]
    assert {(c.rows_n, c.page_box) for c in swapped} == {(8, None), (8, 16)}
    for name in names[2:]:
        assert extra[name]["rows_n"] == 8 and extra[name]["splits"] == 2
        assert extra[name]["max_diff"] < 1e-2
    assert extra["fa4_final_decode_keys_on_m_paged"]["bitwise_equal"] is True
    assert calls["fa4_final_decode_keys_on_m"]().shape == q.shape
