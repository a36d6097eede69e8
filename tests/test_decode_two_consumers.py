"""The Hopper decode kernel with two consumer warpgroups (HopperDecodeConfig.consumers = 2,
Note [Two consumer warpgroups] in fa4_final.hopper.decode) on a CPU: the config's refusals by
name, its shared-memory formula and register plan, the choice by packed rows (one consumer up to
64, two above: hopper_decode_for_rows), each warpgroup's rows
(host emulation of the kernel's index arithmetic), the walk at tile_m = 128 against the float64
decode; slow: the builds compiled for sm_90a (resources, barriers, instruction counts)."""

import re
from dataclasses import replace

import pytest

from fa4_final.common.decode_index import (
    block_key_start,
    block_key_tiles,
    num_m_blocks,
    packed_rows,
    unpack_row,
)
from fa4_final.common.register_plan import (
    check_budgets,
    launch_registers,
    problems,
    warp_budgets,
)
from fa4_final.hopper.config import (
    DECODE_WG2_LAUNCH_REGISTERS,
    SM90_DECODE_REGISTERS,
    SM90_DECODE_WG2_REGISTERS,
    SM90_SMEM_BYTES,
    HopperDecodeConfig,
    hopper_decode_default,
    hopper_decode_for_page,
    hopper_decode_for_rows,
)
from tests.decode_reference import decode_reference, emulate_decode, merge_splits, paged_cache

WG2_ROWS = 64  # packed rows a consumer warpgroup owns


def wg2(d=128, page_size=None):
    base = hopper_decode_default(d) if page_size is None else hopper_decode_for_page(d,
                                                                                    page_size)
    return replace(base, consumers=2)


def test_decode_two_consumers_config_refusals_name_the_knob():
    for bad in (0, 3, True, 2.0, "2", None):
        with pytest.raises(ValueError, match="consumers"):
            HopperDecodeConfig(consumers=bad).check(128)
    with pytest.raises(ValueError, match="consumers=2.*swap_ab"):
        HopperDecodeConfig(swap_ab=True, rows_n=8, consumers=2).check(128)
    with pytest.raises(ValueError, match="shared memory"):  # Q 128 x 128 + 4 stages: 289 KB
        replace(wg2(128), stages=4).check(128)
    for d in (64, 128):
        wg2(d).check(d)
        wg2(d, 16).check(d)  # a gathered tile


def test_decode_register_plans_follow_from_the_launch_bound():
    """Each row of DECODE_REGISTER_PLANS: a CTA of 128 + 128 x consumers threads at its launch
    bound starts with its share of the register file, and the producer's and consumers'
    setmaxnreg fill each thread slot of a sub-partition (one producer warp, `consumers` consumer
    warps) without asking for more than the slot held at launch."""
    from fa4_final.hopper.config import DECODE_REGISTER_PLANS

    for consumers, plan in DECODE_REGISTER_PLANS.items():
        threads = 128 * (1 + consumers)
        assert plan.launch_registers == launch_registers(threads * plan.ctas_per_sm), plan
        producer, consumer = plan.setmaxnreg
        assert producer + consumers * consumer <= (1 + consumers) * plan.launch_registers, plan
        cfg = HopperDecodeConfig(consumers=consumers)
        assert (cfg.registers, cfg.launch_registers, cfg.ctas_per_sm_bound) == (
            plan.setmaxnreg, plan.launch_registers, plan.ctas_per_sm)


def test_decode_two_consumers_above_64_packed_rows_only():
    for d in (64, 128):
        cfg = hopper_decode_default(d)
        assert cfg.consumers == 1 and cfg.tile_m == 64
        assert cfg.registers == SM90_DECODE_REGISTERS and cfg.ctas_per_sm_bound == 2
        assert cfg.launch_registers == 128
        assert hopper_decode_for_page(d, 16).consumers == 1
        assert hopper_decode_for_rows(cfg, 64) is cfg  # up to 64 rows: one consumer
        two = hopper_decode_for_rows(cfg, 65)
        assert two == replace(cfg, consumers=2) and two.tile_m == 128
        paged = hopper_decode_for_rows(hopper_decode_for_page(d, 16), 128)
        assert paged.consumers == 2 and paged.page_box == hopper_decode_for_page(d, 16).page_box
        keys_on_m = replace(cfg, swap_ab=True, rows_n=32)
        assert hopper_decode_for_rows(keys_on_m, 128) is keys_on_m


@pytest.mark.parametrize("d", [64, 128])
def test_decode_two_consumers_shared_memory_formula(d):
    """Barriers (1 KB granule), Q of 128 rows (two 64-row stages), three K and three V stages of
    128 keys: 225 KB at D = 128, under the 227 KB a CTA may use."""
    cfg = wg2(d)
    assert cfg.tile_m == 2 * WG2_ROWS
    assert cfg.smem_bytes(d) == 1024 + 128 * d * 2 + 2 * 3 * 128 * d * 2
    assert cfg.smem_bytes(d) - hopper_decode_default(d).smem_bytes(d) == 64 * d * 2
    assert cfg.smem_bytes(d) <= SM90_SMEM_BYTES
    assert cfg.kv_bytes_in_flight(d) == hopper_decode_default(d).kv_bytes_in_flight(d)


def test_decode_two_consumers_register_plan():
    """384 threads launched at one CTA an SM: 168 registers a thread; setmaxnreg 24 for the
    producer warpgroup, 240 for each consumer: each sub-partition holds one producer and two
    consumer warps, 24 + 240 + 240 = 504 = 3 x 168. 248 would not fit."""
    import cutlass

    from fa4_final.hopper.decode import HopperDecode

    cfg = wg2(128)
    kernel = HopperDecode(cutlass.BFloat16, 128, True, cfg)
    assert kernel.num_threads == 384 and kernel.wg_rows == WG2_ROWS
    assert kernel.roles["consumer"]["warpgroups"] == (1, 2)
    assert cfg.registers == SM90_DECODE_WG2_REGISTERS == (24, 240)
    assert cfg.ctas_per_sm_bound == 1
    assert launch_registers(384) == DECODE_WG2_LAUNCH_REGISTERS == 168
    budgets = warp_budgets(kernel.roles)
    check_budgets(budgets, 384)
    assert not problems(budgets, 384)
    worse = warp_budgets({**kernel.roles, "consumer": {**kernel.roles["consumer"],
                                                       "registers": 248}})
    assert problems(worse, 384)
    # a stage's EMPTY barrier completes at one arrive per consumer warp of both warpgroups
    assert [spec.empty_arrivals for spec in kernel.pipelines()] == [8, 8]
    one = HopperDecode(cutlass.BFloat16, 128, True, hopper_decode_default(128))
    assert one.num_threads == 256 and [s.empty_arrivals for s in one.pipelines()] == [4, 4]


@pytest.mark.parametrize("group", [8, 16])
@pytest.mark.parametrize("window_left", [None, 0, 37])
def test_decode_two_consumers_rows_of_each_warpgroup(group, window_left):
    """The kernel's arithmetic on the host: warpgroup 1 + p of m-block m works on the 64-row
    sub-block 2 m + p (load_q: rows min(64 sub + r, last); the epilogue: rows below the packed
    count). Over the two warpgroups the stored rows are the 128-row block's, each (token, head)
    stored once over the grid and loaded from the same (token, head); each sub-block's key
    tiles and masked tiles lie within the 128-row block's (which the CTA walks)."""
    seqlen_k, tile_n = 1000, 128
    for seqlen_q in range(1, 17):
        packed = packed_rows(seqlen_q, group)
        stored = []
        for m_block in range(num_m_blocks(seqlen_q, group, 2 * WG2_ROWS)):
            n_end, n_full = block_key_tiles(m_block, 128, tile_n, group, seqlen_q, seqlen_k,
                                            True)
            n_start, n_left_free = block_key_start(m_block, 128, tile_n, group, seqlen_q,
                                                   seqlen_k, window_left)
            block = []
            for part in (0, 1):
                sub = m_block * 2 + part
                for r in range(WG2_ROWS):
                    row = sub * WG2_ROWS + r
                    loaded = unpack_row(min(row, packed - 1), group, 3)
                    if row < packed:  # the epilogue's store
                        assert loaded == unpack_row(row, group, 3)
                        block.append(row)
                        stored.append(unpack_row(row, group, 3))
                e, f = block_key_tiles(sub, WG2_ROWS, tile_n, group, seqlen_q, seqlen_k, True)
                s, lf = block_key_start(sub, WG2_ROWS, tile_n, group, seqlen_q, seqlen_k,
                                        window_left)
                assert e <= n_end and (e == 0 or f >= n_full)
                if e > 0:
                    assert s >= n_start and lf <= n_left_free
            first = m_block * 128
            assert block == list(range(first, min(first + 128, packed)))
        assert sorted(stored) == sorted((t, 3 * group + h) for t in range(seqlen_q)
                                        for h in range(group))


CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, causal, splits, window_left)
    (2, 16, 1000, 16, 2, True, 1, None),  # 128 rows: one m-block
    (1, 9, 777, 16, 2, True, 3, None),  # 72 rows
    (2, 12, 4097, 32, 2, True, 5, None),  # 192 rows: two m-blocks
    (1, 16, 1025, 32, 2, False, 4, None),  # 256 rows
    (2, 16, 5, 16, 2, True, 1, None),  # more tokens than keys
    (1, 13, 2000, 16, 2, True, 3, 100),  # a window narrower than the block's rows span
    (2, 16, 1500, 32, 2, False, 2, 300),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_two_consumers_walk_is_the_decode(case):
    """The kernel's walk at tile_m = 128 (its key range, splits and masked tiles those of the
    128-row block) in float64, through tests.decode_reference.emulate_decode, against the
    float64 decode; paged (pages of 128 keys) equal to contiguous bit for bit."""
    import torch

    batch, sq, sk, h, hk, causal, splits, window = case
    g = torch.Generator().manual_seed(sum(case[:5]))
    q = torch.randn(batch, sq, h, 32, generator=g, dtype=torch.float64)
    k = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    v = torch.randn(batch, sk, hk, 32, generator=g, dtype=torch.float64)
    out_ref, lse_ref = decode_reference(q, k, v, causal, window_left=window)
    out_p, lse_p, _ = emulate_decode(q, k, v, causal, splits, tile_m=128, window_left=window)
    assert not out_p.isnan().any() and not lse_p.isnan().any()
    out, lse = merge_splits(out_p, lse_p)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)
    if sk % 128 == 0 or sk > 1000:
        pad = -sk % 128
        kk = torch.cat([k, torch.full((batch, pad, hk, 32), float("nan"), dtype=k.dtype)], 1)
        vv = torch.cat([v, torch.full((batch, pad, hk, 32), float("nan"), dtype=v.dtype)], 1)
        used = torch.full((batch,), sk, dtype=torch.int32)
        kp, vp, table = paged_cache(kk, vv, 128, generator=g)
        paged = emulate_decode(q, kp, vp, causal, splits, tile_m=128, page_table=table,
                               seqused_k=used, window_left=window)
        contiguous = emulate_decode(q, kk, vv, causal, splits, tile_m=128, seqused_k=used,
                                    window_left=window)
        assert all(torch.equal(a, b) for a, b in zip(paged[:2], contiguous[:2]))


# ----------------------------------------------------------------------------------------------
# compiled for sm_90a (slow)

BUILDS = {  # name: (head_dim, build keywords, page size or None, step bodies)
    "d128-contiguous-causal": (128, dict(causal=True), None, 3),
    "d128-paged-seqused-split": (128, dict(causal=True, paged=True, has_seqused_k=True,
                                           split=True), None, 3),
    "d128-paged16-seqused": (128, dict(causal=True, paged=True, has_seqused_k=True), 16, 3),
    "d128-varlen-paged-split": (128, dict(causal=True, paged=True, has_seqused_k=True,
                                          split=True, varlen_q=True), None, 3),
    "d128-window-paged-split": (128, dict(causal=True, paged=True, has_seqused_k=True,
                                          split=True, has_window_left=True), None, 4),
    "d64-contiguous-causal": (64, dict(causal=True), None, 3),
    "d64-varlen-seqused": (64, dict(causal=True, has_seqused_k=True, varlen_q=True), None, 3),
    "d64-fp16-paged-split": (64, dict(dtype="fp16", causal=True, paged=True, has_seqused_k=True,
                                      split=True), None, 3),
    "d64-window-not-causal": (64, dict(causal=False, has_window_left=True), None, 4),
}


@pytest.fixture(scope="module")
def built():
    from fa4_final.hopper.host import decode_recipe
    from fa4_final.runtime.compile import artifacts

    cache = {}

    def get(name):
        if name not in cache:
            d, kw, page, _ = BUILDS[name]
            cache[name] = artifacts(decode_recipe(d, config=wg2(d, page), **kw))["main"]
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDS))
def test_decode_two_consumers_compile_clean(built, name):
    """No spill, no stack, no local memory, no wgmma serialised by ptxas; launched for 384
    threads at one CTA an SM, at most 168 registers, setmaxnreg 24 / 240. One step body a loop
    as the one-consumer build (both warpgroups run the same code): D / 16 + tile_n / 16 HGMMA
    each. 16-byte shared stores: a warpgroup's 64 Q rows and half the V tail's zeros."""
    d, kw, page, bodies = BUILDS[name]
    art = built(name)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    art.forbid("ld.local", "st.local")
    assert art.count("WARPGROUP.ARRIVE", "sass") == art.count("wgmma.fence.sync.aligned")
    assert ".reqntid 384, 1, 1" in art.ptx and ".minnctapersm 1" in art.ptx
    assert re.search(r"setmaxnreg.dec.sync.aligned.u32\s+24;", art.ptx)
    assert re.search(r"setmaxnreg.inc.sync.aligned.u32\s+240;", art.ptx)
    assert art.registers <= DECODE_WG2_LAUNCH_REGISTERS, art.resources()
    tile_n = 128
    assert art.count("HGMMA", "sass") == bodies * (d // 16 + tile_n // 16)
    assert art.count("wgmma.commit_group") == 2 * bodies
    assert art.count("STS.128", "sass") == 64 * d // 8 // 128 + tile_n * d // 8 // 256
    assert art.count("ld.global.v4.b32") == 64 * d // 8 // 128
    art.forbid("UTMASTG", "STSM", where="sass")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["d128-paged-seqused-split", "d64-window-not-causal"])
def test_decode_two_consumers_named_barriers(built, name):
    """Three bar.sync instructions (Note [Two consumer warpgroups]): 0 (the init), Q_READY with
    its id in a register and 128 threads (1 for warpgroup 1, 5 for warpgroup 2), the V tail's
    2 with 256 threads (both consumer warpgroups at one instruction); no unaligned barrier."""
    art = built(name)
    syncs = re.findall(r"bar\.sync\s+([^;]+);", art.ptx)
    assert len(syncs) == 3 and art.count("BAR.SYNC", "sass") == 3, syncs
    ids = [s.replace(" ", "").replace("\t", "") for s in syncs]
    assert "0" in ids and "2,256" in ids, ids
    assert sum(bool(re.fullmatch(r"%r\d+,128", i)) for i in ids) == 1, ids
    art.forbid("barrier.cta.sync", "barrier.sync ")
