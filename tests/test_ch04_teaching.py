"""Chapter 04's teaching helpers: the models give the chapter's arithmetic, the pictures come from
the kernel's own layouts and tile ranges, and every checker accepts the solution and rejects
wrong answers with a message that says what went wrong."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from solutions import ch04_cpu_model as cm  # noqa: E402
from solutions import ch04_flash_ampere as fa  # noqa: E402
from solutions import ch04_teaching as t4  # noqa: E402
from tests import device_exercise_mistakes as wrong  # noqa: E402
from utils.results import Results  # noqa: E402

TileConfig = fa.TileConfig


# ---------------------------------------------------------------------------------------------
# Who holds what
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,d", [(None, 128), (TileConfig(128, 64, 256), 128),
                                   (TileConfig(64, 128, 128), 64)])
def test_p_registers_are_the_a_operand(cfg, d):
    """The PV mma's A operand is held by exactly the threads that hold S (Note [P as an A
    operand]), element by element, for tiles of 4 and 8 warps."""
    np.testing.assert_array_equal(t4.a_owner_map(cfg, d), cm.s_owner_map(cfg, d))


def test_s_owner_reference_matches_the_kernel_layout():
    for cfg, d in t4.OWNER_CONFIGS:
        cfg = fa.default_config(d) if cfg is None else cfg
        owner = cm.s_owner_map(cfg, d)
        mine = np.array([[t4.s_owner(r, c, cfg.num_warps) for c in range(cfg.n_block)]
                         for r in range(cfg.m_block)])
        np.testing.assert_array_equal(mine, owner)


def test_drawings_run_headless():
    axes = t4.draw_s_owners(None, 128, thread=37)
    assert len(axes) == 2 and "thread 37" in axes[0].get_title()
    assert len(t4.draw_p_as_a_operand(None, 64)) == 2
    ax = t4.draw_tile_map(300, 420, 128, 32, causal=True)
    assert "skipped" in ax.get_title()
    plt.close("all")


# ---------------------------------------------------------------------------------------------
# Registers and occupancy
# ---------------------------------------------------------------------------------------------
def test_register_model_accumulators_match_the_kernel():
    for cfg, d in t4._register_cases():
        est = t4.register_estimate(cfg, d)
        acc = cfg.accumulator_registers(d)
        assert est["S = QK^T"]["acc_O"] == acc["acc_O"] == est["O += PV"]["acc_O"]
        assert est["S = QK^T"]["acc_S"] == acc["acc_S"]
        assert est["O += PV"]["P (bf16)"] == acc["acc_S"] // 2
        assert est["peak"] == max(sum(est[p].values()) for p in ("S = QK^T", "O += PV"))
        assert est["fits"] == (est["peak"] <= t4.REGISTER_LIMIT)


def test_register_model_on_the_chapter_tiles():
    """D=128: 128 x 32 with 4 warps fits; 128 x 128 with 4 warps cannot (its accumulators
    alone are 256 registers); 8 warps fit the same tile."""
    assert t4.registers_needed(TileConfig(128, 32, 128), 128)[1]
    peak, fits = t4.registers_needed(TileConfig(128, 128, 128), 128)
    assert not fits and peak > 256
    assert t4.registers_needed(TileConfig(128, 128, 256), 128)[1]
    assert "acc_O 128 + acc_S 32" in t4.estimate_text(TileConfig(128, 32, 128), 128)


def test_ctas_per_sm():
    occ = t4.ctas_per_sm(255, 128, 52224, "sm_90")  # 255 -> 256 per thread: 32768 per CTA
    assert occ["by"]["registers"] == 2 and occ["ctas"] == 2 and occ["warps"] == 8
    assert occ["limited by"] == "registers"
    assert t4.ctas_per_sm(213, 256, 69632)["ctas"] == 1  # more than half of the 64K registers
    assert t4.ctas_per_sm(64, 128, 100 * 1024, "sm_80")["by"]["shared memory"] == 1
    assert t4.ctas_per_sm(64, 128, 200 * 1024, "sm_90")["by"]["shared memory"] == 1
    assert t4.ctas_per_sm(64, 128, 200 * 1024, "sm_80")["ctas"] == 0  # over the per-CTA limit
    assert t4.ctas_per_sm(32, 32, 1024)["limited by"] == "CTA slots"


def test_register_budget_picture_from_rows():
    rows = [{"config": TileConfig(128, 32, 128), "registers": 255, "stack_bytes": 0},
            {"config": TileConfig(128, 128, 128), "registers": 255, "stack_bytes": 800}]
    ax = t4.draw_register_budget(rows)
    assert any("spills" in t.get_text() for t in ax.texts)
    plt.close("all")


@pytest.mark.slow
def test_register_model_agrees_with_ptxas():
    """The model's verdict on two tiles against sm_90a compiles: fits -> no stack frame."""
    for cfg, should_fit in ((fa.default_config(128), True), (TileConfig(128, 128, 128), False)):
        assert t4.register_estimate(cfg, 128)["fits"] is should_fit
        res = t4.resources("sm_90a", 128, cfg)
        assert (res["stack_bytes"] == 0) is should_fit, (cfg, res)
    rows = t4.resource_rows([fa.default_config(128)], 128)
    assert rows[0]["ctas"] >= 1 and "yes" in t4.format_resource_rows(rows)
    mix = t4.instruction_mix(fa.default_config(128), 128)
    c = fa.default_config(128)
    assert mix["mma.sync (HMMA)"] == 2 * (c.m_block // (16 * c.num_warps)) * (c.n_block // 8) * 8
    assert mix["exp2 (MUFU)"] >= c.m_block * c.n_block // c.num_threads
    assert mix["quad shuffles (SHFL)"] > 0 and mix["barriers (BAR)"] >= 2


# ---------------------------------------------------------------------------------------------
# Bank conflicts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_bank_summary(d):
    rows = {r["layout"]: r for r in t4.bank_summary(d)}
    assert rows["row-major"]["ldmatrix_cycles"] == 8
    assert rows["padded"]["ldmatrix_cycles"] == rows["swizzled"]["ldmatrix_cycles"] == 1
    assert all(r["cp_async_cycles"] == 1 for r in rows.values())
    assert rows["padded"]["bytes_per_row"] == 2 * d + 16
    assert rows["swizzled"]["bytes_per_row"] == 2 * d


def test_swizzled_offsets_are_a_permutation_of_16_byte_chunks():
    off = t4.smem_offsets("swizzled", 128, rows=16)
    assert sorted(off.ravel().tolist()) == list(range(16 * 128))
    assert ((off[:, 1:8] - off[:, :1]) == np.arange(1, 8)).all()  # chunks stay whole
    padded = t4.smem_offsets("padded", 128, rows=4)
    assert padded[1, 0] == 136 and padded[3, 5] == 3 * 136 + 5


# ---------------------------------------------------------------------------------------------
# Causal tiles
# ---------------------------------------------------------------------------------------------
def _every_case():
    rng = np.random.default_rng(0)
    cases = list(t4.KV_TILE_CASES)
    for _ in range(12):
        tm, tn = rng.choice([64, 128]), rng.choice([32, 64, 128])
        cases.append((int(rng.integers(1, 700)), int(rng.integers(1, 700)), int(tm), int(tn),
                      bool(rng.integers(2))))
    return cases


@pytest.mark.parametrize("case", _every_case())
def test_tile_map_is_consistent_with_visibility(case):
    """Skipped tiles hold no key any row of the tile sees; unmasked tiles are fully seen by
    every row of the tile (rows past seqlen_q included, as the kernel computes them)."""
    sq, sk, tm, tn, causal = case
    kinds = t4.tile_map(sq, sk, tm, tn, causal)
    rows, cols = kinds.shape[0] * tm, kinds.shape[1] * tn
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    seen = (j < sk) & ((j <= i + sk - sq) if causal else True)
    for m in range(kinds.shape[0]):
        for n in range(kinds.shape[1]):
            block = seen[m * tm:(m + 1) * tm, n * tn:(n + 1) * tn]
            if kinds[m, n] == t4.SKIPPED:
                assert not block.any(), (m, n)
            elif kinds[m, n] == t4.FULL:
                assert block.all(), (m, n)
        visited = kinds[m] != t4.SKIPPED
        assert visited.any() and visited[:np.flatnonzero(visited)[-1] + 1].all()
    if not causal:
        assert (kinds[:, :-1] == t4.FULL).all() and (kinds[:, -1] == t4.MASKED).all()
    # the exercise's reference agrees with the kernel on every query tile
    for m, (visited, masked, _) in enumerate(t4._kernel_kv_tiles(sq, sk, tm, tn, causal)):
        assert t4.kv_tiles(m, sq, sk, tm, tn, causal) == (visited, masked), m


def test_tile_counts_at_the_benchmark_shape():
    c = t4.tile_counts(16384, 16384, 128, 64, causal=True)
    assert c["total"] == 128 * 256
    assert c[t4.TILE_KINDS[t4.MASKED]] == 128 * 2  # 128 / 64 tiles cross each diagonal
    assert c[t4.TILE_KINDS[t4.SKIPPED]] + c[t4.TILE_KINDS[t4.FULL]] \
        + c[t4.TILE_KINDS[t4.MASKED]] == c["total"]


# ---------------------------------------------------------------------------------------------
# Reading the kernel, the SASS and the stored results
# ---------------------------------------------------------------------------------------------
def test_notes_and_sources():
    assert t4.note("Work split").startswith("Note [Work split].")
    assert "compile-time constant" in t4.note("Mask with constants")
    assert "not found" in t4.note("No such note")
    src = t4.source_between(fa.FlashAttentionAmpere.kv_step, "(c) S = Q K^T", "(d)")
    assert src.startswith("# (c)") and "gemm_from_smem" in src and "(d)" not in src
    assert "not found" in t4.source_between(fa.kv_tile_range, "no such marker")


FAKE_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0020*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0040*/                   MUFU.EX2 R3, R3 ;
        /*0050*/              @!PT LDS RZ, [RZ] ;
        /*0060*/                   FMUL R9, R9, R3 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0080*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0090*/                   BRA `(.L_x_2);
"""


def test_loop_body_picks_the_loop_with_most_hmma():
    ops = t4.loop_body(FAKE_SASS)
    assert ops == ["LDSM", "HMMA", "HMMA", "MUFU", "FMUL", "BRA"]  # never-executed LDS left out


def test_hopper_ceilings_arithmetic():
    cfg = TileConfig(128, 32, 128)
    mix = dict.fromkeys(list(t4.INSTRUCTION_CLASSES) + [t4.OTHER], 0.0)
    mix.update({"mma.sync (HMMA)": 128.0, "exp2 (MUFU)": 36.0, t4.OTHER: 376.0})
    rows = {what.split(" (")[0]: (cycles, tflops) for what, cycles, tflops in
            t4.hopper_ceilings(cfg, 128, mix)}
    flops = 4 * 128 * 32 * 128
    assert rows["tensor cores at the wgmma rate"][0] == flops / 4096
    assert rows["tensor cores at the mma.sync rate"][0] == flops / 4096 / t4.MMA_SYNC_SHARE
    assert rows["exp2 on MUFU"][0] == 36 * 32 * 4 / 16
    assert rows["issuing the loop's instructions"][0] == 540 * 4 / 4
    peak = rows["tensor cores at the wgmma rate"][1]
    assert peak == pytest.approx(4096 * 132 * 1.98e9 / 1e12)
    exp = t4.expected_tflops(128)
    assert exp["overlapped"] == pytest.approx(exp["peak"] * t4.MMA_SYNC_SHARE)
    assert exp["serial"] < exp["overlapped"]


def _results(rows, name="fake"):
    prov = dict.fromkeys(("gpu", "driver", "cuda", "torch", "cutlass_dsl", "commit", "date",
                          "command"), "x")
    return Results(name, None, prov, rows)


def _row(impl, tflops, **kw):
    return {"impl": impl, "pass": "fwd", "dtype": "bf16", "b": 1, "s": 16384, "h": 16, "d": 128,
            "causal": False, "ms": 1.0, "tflops": tflops, **kw}


def test_standing_lines_compare_within_one_run():
    res = _results([_row("flash_ampere", 120.0), _row("sdpa_flash", 100.0),
                    _row("flash_ampere", 90.0, d=64), _row("sdpa_flash", 100.0, d=64)])
    lines = t4.standing_lines(res)
    assert lines[0].endswith("1.20x") and lines[1].endswith("0.90x")
    assert lines[-1] == "flash_ampere runs ahead of sdpa_flash at 1 of the 2 shapes"
    assert "no shape" in t4.standing_lines([_row("flash_ampere", 1.0)])[0]


def test_peer_lines_take_medians_and_say_level():
    rows = [_row(impl, t, data="randn", round=r) for r, (a, b, c) in
            enumerate([(100.0, 101.0, 90.0), (104.0, 99.0, 91.0), (102.0, 150.0, 92.0)])
            for impl, t in (("flash_ampere", a), ("cutlass_example_128x64", b),
                            ("flash_ampere_portable", c))]
    (line,) = t4.peer_lines(_results(rows))
    assert "= 1.010 (level)" in line and "the portable tile = 1.121" in line
    ahead = [r if r["impl"] != "cutlass_example_128x64" else {**r, "tflops": 50.0} for r in rows]
    assert "(ours ahead)" in t4.peer_lines(_results(ahead))[0]


def test_run_spread_and_sweep_findings():
    tile = {"m_block": 128, "n_block": 64, "num_threads": 128, "smem_layout": "swizzled",
            "skip_rescale": False, "spill_instructions": 0}
    sweep = _results([
        _row("flash_ampere", 100.0, **tile, num_stages=1, qk_unroll=2, default=False),
        _row("flash_ampere", 102.0, **tile, num_stages=1, qk_unroll=4, default=False),
        _row("flash_ampere", 110.0, **tile, num_stages=2, qk_unroll=4, default=True,
             sdpa_flash_tflops=100.0),
    ], name="ch04_sweep")
    fwd = _results([_row("flash_ampere", 106.0)], name="ch04_fwd")
    spread = t4.run_spread(fwd, sweep)
    assert spread["lo"] == 106.0 and spread["hi"] == 110.0 and spread["timings"] == 2
    assert "a spread of 3.8%" in t4.spread_line(spread)
    text = "\n".join(t4.sweep_findings(sweep, spread["spread"]))
    assert "4 slices per trip vs 2: 102 vs 100 TFLOP/s = 1.02x (within noise)" in text
    assert "2 stages vs 1, 4 slices per trip: 110 vs 102 TFLOP/s = 1.08x; spill-free" in text
    assert "vs SDPA's flash backend in the same sweep: 1.10x" in text
    assert t4.run_spread(fwd) is None


def test_profile_reading_computes_its_verdicts():
    def res(busy, issue):
        return _results([{"metric": "tensor_pipe_active_pct", "value": busy},
                         {"metric": "issue_slots_busy_pct", "value": issue}])
    assert t4.profile_reading(res(61.0, 40.0))[0].endswith("neither is saturated")
    assert t4.profile_reading(res(95.0, 40.0))[0].endswith("close to its limit")


def test_sweep_lines_use_stored_resources_and_ratios():
    tile = {"m_block": 128, "n_block": 64, "num_threads": 128, "num_stages": 1,
            "smem_layout": "swizzled", "acc_O": 128, "acc_S": 64}
    rows = [
        _row("flash_ampere", 100.0, **{**tile, "n_block": 32, "acc_S": 32}, default=True,
             registers=255, stack_bytes=0, spill_instructions=0),
        _row("flash_ampere", 110.0, **tile, default=False, registers=255, stack_bytes=88,
             spill_instructions=68),
        _row("flash_ampere", None, **tile, default=False, causal=True),
    ]
    lines = t4.sweep_lines(_results(rows), compile_groups=())
    text = "\n".join(lines)
    assert "1.10x" in text and "88" in text and "128x32 t128 s1 swizzled u1 *" in text
    assert "not timed" in text


def test_load_stored_missing(capsys):
    assert t4.load_stored("no_such_results_file") is None
    assert "not measured yet" in capsys.readouterr().out


def test_stored_ch04_files_can_be_read():
    for name in ("ch04_fwd", "ch04_sweep"):
        res = t4.load_stored(name)
        if res is None:
            pytest.skip(f"{name} not measured yet")
        assert res.label and res.rows
    fwd = t4.load_stored("ch04_fwd")
    groups, series = t4.tflops_groups(fwd)
    assert "flash_ampere" in series and all(len(v) == len(groups) for v in series.values())
    assert t4.standing_lines(fwd)[-1].startswith("flash_ampere runs ahead of sdpa_flash")


# ---------------------------------------------------------------------------------------------
# Exercise checkers: accept the solution, reject wrong answers in plain words
# ---------------------------------------------------------------------------------------------
def test_check_registers_needed():
    t4.check_registers_needed(t4.registers_needed)

    def accumulators_only(cfg, d):
        n = cfg.m_block * (d + cfg.n_block) // cfg.num_threads
        return n, n <= 255

    with pytest.raises(AssertionError, match="busiest moments"):
        t4.check_registers_needed(accumulators_only)

    def wrong_fits(cfg, d):
        return t4.registers_needed(cfg, d)[0], True

    with pytest.raises(AssertionError, match="fits must be False"):
        t4.check_registers_needed(wrong_fits)
    with pytest.raises(AssertionError, match="pair"):
        t4.check_registers_needed(lambda cfg, d: 200)


def test_check_s_owner():
    t4.check_s_owner(t4.s_owner)
    with pytest.raises(AssertionError, match="warp is wrong"):
        t4.check_s_owner(lambda r, c, w: 32 * (r // 16) + 4 * (r % 8) + (c % 8) // 2)
    with pytest.raises(AssertionError, match="lane is not"):
        t4.check_s_owner(lambda r, c, w: 32 * ((r // 16) % w) + 4 * (r % 8) + (c % 4))
    with pytest.raises(AssertionError, match="thread index"):
        t4.check_s_owner(lambda r, c, w: -1)


def test_check_kv_tiles():
    t4.check_kv_tiles(t4.kv_tiles)

    def everything(m, sq, sk, tm, tn, causal):
        n = -(-sk // tn)
        return list(range(n)), [n - 1]

    with pytest.raises(AssertionError, match="some row of the tile sees some key"):
        t4.check_kv_tiles(everything)

    def no_empty_rule(m, sq, sk, tm, tn, causal):
        visited, masked = t4.kv_tiles(m, sq, sk, tm, tn, causal)
        if causal and (m + 1) * tm + sk - sq <= 0:
            return [], []
        return visited, masked

    with pytest.raises(AssertionError, match="fully masked step on tile 0"):
        t4.check_kv_tiles(no_empty_rule)

    def only_diagonal(m, sq, sk, tm, tn, causal):
        visited, masked = t4.kv_tiles(m, sq, sk, tm, tn, causal)
        return visited, masked[1:] if len(masked) > 1 else masked

    with pytest.raises(AssertionError, match="FIRST row"):
        t4.check_kv_tiles(only_diagonal)
    with pytest.raises(AssertionError, match="pair"):
        t4.check_kv_tiles(lambda *a: [0])


def test_mma_sync_share_is_the_stored_measurement():
    """MMA_SYNC_SHARE feeds the chapter's cycle model; it must be the H200 figure on file."""
    from utils.hardware import PER_SM
    from utils.results import load

    micro = load("microbench")
    per_clk = micro.one(metric="mma_sync_flop_per_clk_sm")["value"]
    assert t4.MMA_SYNC_SHARE == pytest.approx(per_clk / PER_SM["sm_90"].mma_flops_per_clk,
                                              abs=0.005)


def test_ceiling_and_peer_lines_read_the_stored_runs():
    from utils.results import load

    lines = t4.ceiling_lines(load("microbench"), load("ch04_sweep"))
    assert "mma.sync ceiling" in lines[0] and len(lines) == 1 + len(fa.ABLATION_CONFIGS)
    assert all("softmax costs" in line for line in lines[1:])
    peer = t4.cutlass_peer_lines(load("ch04_cutlass_peer"))
    assert any(line.startswith("non-causal, randn: sdpa_flash") for line in peer)


# ----------------------------------------------------------------------------------------------
# Exercises 04.4 and 04.5 (device code): the solutions pass; typical slips
# (tests/device_exercise_mistakes.py) fail with words that name them.


def test_quad_allreduce_solution_passes_and_a_loop_is_fine():
    t4.check_quad_allreduce(t4.quad_allreduce)
    t4.check_quad_allreduce(wrong.allreduce_in_a_loop)


def test_quad_allreduce_model_is_a_butterfly_within_quads():
    lanes = np.arange(32, dtype=np.float32)
    got, calls = t4.run_quad_allreduce(t4.quad_allreduce, lanes, np.fmax)
    assert calls == [("bfly", 2), ("bfly", 1)]
    assert got.tolist() == [4 * (i // 4) + 3 for i in range(32)]


@pytest.mark.parametrize("fn, words", [
    (wrong.allreduce_eight_lanes, "you reduced over 8 lanes .*xor offsets 1 and 2 cover the 4 "
                                  "lanes of a quad"),
    (wrong.allreduce_one_step, "lanes agree in pairs"),
    (wrong.allreduce_same_offset_twice, "repeat one"),
    (wrong.allreduce_shift_down, "shuffle_sync_down"),
    (wrong.allreduce_max_always, "op = sum.*apply `op`"),
    (wrong.allreduce_no_return, "returned None"),
])
def test_quad_allreduce_check_names_the_mistake(fn, words):
    with pytest.raises(AssertionError, match=words):
        t4.check_quad_allreduce(fn)


def test_mask_solution_passes():
    t4.check_mask_scores(t4.mask_scores)


@pytest.mark.parametrize("fn, words", [
    (wrong.mask_top_left, "aligned the diagonal to the top left"),
    (wrong.mask_hides_diagonal, "also hid the diagonal"),
    (wrong.mask_tile_coordinates, "tile's own coordinates"),
    (wrong.mask_causal_only, "past seqlen_k = 67 do not exist"),
    (wrong.mask_wrong_sign, "the wrong way"),
    (wrong.mask_nothing, "nothing was set to -inf"),
])
def test_mask_check_names_the_mistake(fn, words):
    with pytest.raises(AssertionError, match=words):
        t4.check_mask_scores(fn)


def test_device_exercise_stubs_are_not_done_not_a_crash():
    with pytest.raises(NotImplementedError):
        t4.check_mask_scores(wrong.mask_not_done)


def test_mask_truth_is_the_kernels_contract():
    # seqlen_q=2, seqlen_k=4: query i sees keys j <= i + 2 (bottom-right), none past 3
    m = t4.mask_truth([(2, 4, 0, 0)], 2, 8, causal=True)[0]
    assert np.isinf(m).tolist() == [[j > i + 2 for j in range(8)] for i in range(2)]


@pytest.mark.parametrize("causal", [True, False])
def test_the_device_exercise_kernels_compile_for_sm80(causal):
    from utils.compile_only import compile_for, fake_stream, fake_tensor

    h = t4.MaskHarness(t4.mask_scores, causal)
    out = fake_tensor(t4.cutlass.Float32, (None, h.m_block, h.n_block), align=4)
    cases = fake_tensor(t4.cutlass.Int32, (None, 4), align=4)
    compile_for("sm_80", h, out, cases, fake_stream())
    assert t4.QuadReduce().compile("sm_80").count("shfl.sync.bfly") == 4


def test_a_compiled_answer_is_checked_as_written_the_second_time_too():
    # compiling swaps a @cute.jit function's code for the preprocessed one; the lane model
    # must still run the source as written
    for _ in range(2):
        t4.check_quad_allreduce(t4.quad_allreduce)
