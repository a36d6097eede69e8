"""Chapter 15 (decoding) on the CPU: the decode roofline and GQA-packing models, the split plan
against fa4_final's heuristic, the combine's float64 reference against one softmax, the two
device-code exercises' references through their checkers (host-side DSL; compiled for sm_90a in
the slow tests), the paged test cache that traces every value back to its page, and the readers
of results/h200/decode.json on a made-up file."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fa4_final.runtime import decode as rdecode
from solutions import ch15_decoding as t15
from utils.results import Results


def test_decode_roofline_counts_the_cache_and_two_gemms():
    s = t15.decode_step(batch=32, tokens=1, keys=8192, heads=32, heads_kv=8, d=128)
    assert s["kv_bytes"] == 2 * 32 * 8192 * 8 * 128 * 2
    assert s["flops"] == 4 * 32 * 32 * 1 * 8192 * 128
    assert s["flop_per_byte"] == pytest.approx(4.0)  # GQA 4, one token: 4 rows share a key
    assert s["t_memory_us"] > 20 * s["t_math_us"]  # memory-bound by far
    assert t15.ridge_point() == pytest.approx(989 / 4.8)


@pytest.mark.parametrize("rows", [1, 4, 8, 64, 128])
def test_decode_tile_intensity_is_its_rows(rows):
    assert t15.tile_intensity(rows) == pytest.approx(rows)
    group = 8
    s = t15.decode_step(1, rows // group or 1, 4096, group, 1, 128)
    if rows % group == 0:
        assert s["flop_per_byte"] == pytest.approx(rows)


def test_decode_gqa_packing_reads_the_keys_once_per_kv_head():
    for tokens in (1, 4, 16):
        for heads in (32, 64):
            group = heads // 8
            unpacked = t15.tile_use(tokens, heads, 8, packed=False)
            packed = t15.tile_use(tokens, heads, 8, packed=True)
            assert unpacked["kv_reads"] == group
            assert packed["tiles"] == -(-tokens * group // 64)
            assert packed["real_rows_per_tile"] * packed["tiles"] == tokens * group


def test_split_kv_plan_is_the_package_heuristic():
    for batch in (1, 4, 32, 128):
        for keys in (1024, 8192, 131072):
            plan = t15.split_plan(batch, 1, keys, 32, 8)
            want = rdecode.choose_num_splits(0, batch=batch, heads_kv=8, packed_rows=4,
                                             key_tiles=-(-keys // 128), num_sms=132)
            assert plan["splits"] == want
            assert plan["ctas"] == batch * 8
            assert plan["tiles_per_split"] * plan["splits"] >= -(-keys // 128)
    assert t15.split_plan(128, 1, 8192, 32, 8)["splits"] == 1  # CTAs enough: no split
    assert t15.split_plan(1, 1, 32768, 32, 8)["splits"] > 8


def test_split_kv_combine_reference_equals_one_softmax():
    g = torch.Generator().manual_seed(3)
    rows, keys, d, splits = 6, 50, 8, 4
    s = torch.randn(rows, keys, generator=g, dtype=torch.float64) * 3
    v = torch.randn(keys, d, generator=g, dtype=torch.float64)
    s[2, :] = float("-inf")  # a row that sees no key
    s[3, :30] = float("-inf")  # a row the first splits do not see
    bounds = [0, 13, 26, 39, 50]
    lse_p = np.full((splits, rows), -np.inf)
    out_p = np.full((splits, rows, d), np.nan)
    for i in range(splits):
        blk = s[:, bounds[i]:bounds[i + 1]]
        lse = torch.logsumexp(blk, dim=1)
        seen = torch.isfinite(lse)
        p = torch.exp(blk - torch.where(seen, lse, 0.0)[:, None])
        lse_p[i] = lse.numpy()
        out_p[i][seen.numpy()] = (p @ v[bounds[i]:bounds[i + 1]]).numpy()[seen.numpy()]
    out, lse, w = t15.combine_reference(lse_p, out_p)
    want_lse = torch.logsumexp(s, dim=1)
    seen = torch.isfinite(want_lse)
    want = torch.where(seen[:, None], torch.softmax(torch.where(
        seen[:, None], s, 0.0), dim=1) @ v, 0.0)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen.numpy())
    np.testing.assert_allclose(lse[seen.numpy()], want_lse[seen].numpy(), atol=1e-12)
    np.testing.assert_allclose(w[seen.numpy()].sum(1), 1.0)
    assert np.all(w[~seen.numpy()] == 0)


def test_decode_combine_exercise_reference_passes_on_the_cpu():
    t15.check_combine_row(t15.combine_row, compile_check=False)


def test_decode_combine_host_run_leaves_empty_splits_unread():
    rows, lse_p, out_p = t15.combine_case(4)
    out, lse, w = t15.run_combine_on_cpu(t15.combine_row, lse_p, out_p)
    assert np.isfinite(out).all()  # NaN partials of empty splits never reached out
    assert np.all(w[np.isneginf(lse_p).T] == 0)
    assert np.isneginf(lse[4]) and np.all(out[4] == 0)  # the row no split saw


@pytest.mark.slow
def test_decode_combine_exercise_compiles_for_sm90a():
    t15.check_combine_row(t15.combine_row)
    facts = t15.combine_sass_facts(t15.combine_row)
    assert facts["MUFU.LG2"] == 1 and not facts["local memory"]
    assert facts["shared-memory stores (STS)"] > 0


def test_paged_case_traces_every_value_to_its_page():
    case = t15.PagedCase((100, 0, 37), 16, 64)
    assert case.table.shape == (3, 8)
    assert (case.table[0, 7:] == -1).all() and (case.table[1] == -1).all()
    used = np.concatenate([case.table[b, :p] for b, p in enumerate(case.pages_of)])
    assert len(set(used.tolist())) == len(used) and used.max() < case.num_pages
    assert tuple(int(x) for x in case.where(case.k[5, 3, 1, 2])) == (5, 3, 1, 2)
    assert case.where(-1.0) is None and case.where(0.0) is None
    page, row = case.expected(0, 0, 40)
    assert (page, row) == (int(case.table[0, 2]), 8)
    assert rdecode.paged_key_row(case.table[0].tolist(), 16, 40) == (page, row)


def test_paged_gather_exercise_reference_passes_on_the_cpu():
    t15.check_gather_key_row(t15.gather_key_row, compile_check=False)


def test_paged_gather_host_run_equals_the_package_gather():
    case = t15.PagedCase((131, 5, 96), 48, 32)
    out = case.run(t15.gather_key_row)
    k = torch.from_numpy(case.k.copy())
    for b, length in enumerate(case.lengths):
        want = rdecode.gather_pages(k, torch.from_numpy(case.table[b].copy()), int(length))
        got = torch.from_numpy(out[b]).permute(1, 2, 0, 3).reshape(-1, case.heads_kv, case.d)
        assert torch.equal(got[:length], want)
        assert torch.all(got[length:] == 0)


@pytest.mark.slow
def test_paged_gather_exercise_compiles_for_sm90a():
    t15.check_gather_key_row(t15.gather_key_row)
    facts = t15.gather_ptx_facts(t15.gather_key_row)
    assert facts["integer divisions (div/rem)"] == 0
    assert facts["scalar 32-bit global loads (seqlen, page table)"] >= 2


def _fake_decode_results():
    shape = {**t15.HEADLINE, "pass": "fwd", "dtype": "bf16", "causal": False, "page": 128}
    rows = [{"impl": "copy", "metric": "copy_rate", "value": 4.0, "unit": "TB/s",
             "mode": "flush"}]
    for impl, ms, spread in (("fa4_final_decode", 0.30, 0.02),
                             ("fa4_final_decode_paged", 0.305, 0.02),
                             ("sdpa_cudnn", 0.26, 0.03), ("sdpa_flash", 0.40, 0.05)):
        kv = 2 * 32 * 8192 * 8 * 128 * 2
        rows.append({"impl": impl, "mode": "flush", **shape, "ms": ms, "spread": spread,
                     "kv_bytes": kv, "read_tbps": kv / (ms * 1e-3) / 1e12,
                     "of_copy": kv / (ms * 1e-3) / 1e12 / 4.0})
    prov = {"gpu": "NVIDIA H200", "driver": "x", "cuda": "x", "torch": "x", "cutlass_dsl": "x",
            "commit": "0" * 10, "date": "2026-12-04"}
    return Results("decode", Path("decode.json"), prov, rows)


def test_decode_readers_on_a_made_up_file():
    res = _fake_decode_results()
    assert t15.copy_rate(res) == 4.0
    assert t15.of_copy(res) == pytest.approx(2 * 32 * 8192 * 8 * 128 * 2 / 0.30e-3 / 4e12)
    assert t15.paged_over_contiguous(res) == pytest.approx(0.305 / 0.30)
    lines = t15.headline_lines(res)
    assert len(lines) == 5 and "copy rate of the run 4.00 TB/s" in lines[0]
    assert "slower" in t15.verdict(res, "fa4_final_decode", "sdpa_cudnn")
    assert "within noise" in t15.verdict(res, "fa4_final_decode_paged", "fa4_final_decode")
    assert "no time" in t15.verdict(res, "fa4_final_decode", "fa4_package")
    assert t15.decode_row(res, "fa4_final_decode", mode="back_to_back") is None


def test_decode_grid_lines_compare_with_the_fastest_peer_on_a_made_up_file():
    from measure.decode import attach_roofline

    res = _fake_decode_results()
    attach_roofline(res.rows)
    lines = t15.grid_lines(res, "fa4_final_decode")
    assert len(lines) == 2
    assert "0.87x sdpa_cudnn" in lines[0] and "slower" in lines[0]
    assert lines[-1] == ("fa4_final_decode at or above the fastest peer at 0 of 1 shapes "
                         "(flush)")
    assert t15.grid_lines(res, "fa4_final_decode", "back_to_back")[-1].endswith("0 of 0 shapes "
                                                                                "(back_to_back)")


def test_decode_combine_gpu_cases_pass_on_the_cpu():
    """The GPU check's cases through the host run of the reference: its inputs and its
    comparison are sound before a GPU sees them."""
    for n, (rows, splits) in enumerate(((1, 1), (300, 3), (77, 17), (40, 32))):
        lse, part = t15._gpu_partials(rows, splits, 16, 1500 + n)
        want_o, want_l, _ = t15.combine_reference(lse.numpy(), part.numpy())
        out, got_l, _ = t15.run_combine_on_cpu(t15.combine_row, lse.numpy(), part.numpy())
        ok, err, lse_right = t15.combine_agrees(out.astype(np.float64),
                                                got_l.astype(np.float64), want_o, want_l)
        assert ok, (rows, splits, err, lse_right)
    from tests.exercise_mutations import ch15 as wrong

    lse, part = t15._gpu_partials(300, 3, 16, 1501)
    want_o, want_l, _ = t15.combine_reference(lse.numpy(), part.numpy())
    out, got_l, _ = t15.run_combine_on_cpu(wrong.combine_reads_every_split, lse.numpy(),
                                           part.numpy())
    assert not t15.combine_agrees(out.astype(np.float64), got_l.astype(np.float64), want_o,
                                  want_l)[0]


@pytest.mark.parametrize("page_size, tile_n, lengths", [(32, 64, (1000, 0, 333, 129)),
                                                        (48, 32, (129, 96))])
def test_paged_gather_gpu_cases_pass_on_the_cpu(page_size, tile_n, lengths):
    k, table, want = t15.gather_gpu_case(page_size, tile_n, lengths, 7, d=8)
    out = np.full(tuple(want.shape), np.nan, np.float32)
    t15._on_cpu(t15.GatherKernels(t15.gather_key_row, tile_n, 8).on_cpu, k.numpy(),
                table.numpy(), np.asarray(lengths, np.int32), out)
    assert torch.equal(torch.from_numpy(out), want)


def test_split_kv_graph_reference_follows_the_combine_layout():
    g = torch.Generator().manual_seed(5)
    splits, b, q, h, d = 3, 2, 2, 3, 4
    lp = torch.randn(splits, b, h, q, generator=g, dtype=torch.float64)
    lp[1, 0, 2, 1] = float("-inf")
    op = torch.randn(splits, b, q, h, d, generator=g, dtype=torch.float64)
    out, lse = t15.graph_reference(lp, op)
    for bb in range(b):
        for qq in range(q):
            for hh in range(h):
                o1, l1, _ = t15.combine_reference(lp[:, bb, hh, qq, None].numpy(),
                                                  op[:, bb, qq, hh, None].numpy())
                np.testing.assert_allclose(out[bb, qq, hh], o1[0])
                assert lse[bb, hh, qq] == pytest.approx(l1[0])


def test_decode_graph_reference_serves_every_step():
    t15.check_serve_graph(t15.serve_graph)
    engine = t15.DecodeEngine()
    steps = t15.decode_steps(engine)
    outs = t15.serve_graph(engine, steps)
    assert engine.captures == 1 and engine.direct_launches == 1
    assert engine.replayed == len(steps)
    assert all(not torch.equal(a, b) for a, b in zip(outs, outs[1:]))


def test_paged_decode_steps_grow_and_take_new_pages():
    engine = t15.DecodeEngine()
    steps = t15.decode_steps(engine, count=6)
    page = engine.k_cache.shape[1]
    for (_, t0, n0), (_, t1, n1) in zip(steps, steps[1:]):
        assert torch.equal(n1, n0 + 1)
        for b in range(len(n1)):
            used0, used1 = (-(-int(n[b]) // page) for n in (n0, n1))
            assert torch.equal(t1[b, :used0], t0[b, :used0])  # pages stay where they were
            assert (t1[b, :used1] >= 0).all() and (t1[b, used1:] == -1).all()
    _, table, lengths = steps[-1]
    pages = torch.cat([table[b, :-(-int(n) // page)] for b, n in enumerate(lengths)])
    assert len(set(pages.tolist())) == len(pages)  # no page handed out twice


def test_decode_graph_capture_refuses_a_compile():
    engine = t15.DecodeEngine()
    graph = t15.Graph()
    with pytest.raises(t15.GraphRuleError, match="compiled while the graph"):
        with engine.capture(graph):
            engine.decode(engine.q, engine.page_table, engine.seqused_k, engine.out)
