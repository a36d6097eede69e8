"""Chapter 04's teaching helpers: the pictures come from the kernel's own layouts and tile ranges,
the register exercise is graded against ptxas, the tile exercise against the kernel's own
kv_tile_range, and the stored results are read as the chapter prints them. The planted mistakes of
every exercise are in tests/exercise_mutations/ch04.py."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from solutions import ch04_cpu_model as cm  # noqa: E402
from solutions import ch04_flash_ampere as fa  # noqa: E402
from solutions import ch04_teaching as t4  # noqa: E402
from utils.exercises import judge  # noqa: E402
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


def test_drawings_run_headless():
    axes = t4.draw_s_owners(None, 128, thread=37)
    assert len(axes) == 2 and "thread 37" in axes[0].get_title()
    assert len(t4.draw_p_as_a_operand(None, 64)) == 2
    ax = t4.draw_tile_map(300, 420, 128, 32, causal=True)
    assert "skipped" in ax.get_title()
    plt.close("all")


# ---------------------------------------------------------------------------------------------
# Registers and occupancy (exercise 04.1)
# ---------------------------------------------------------------------------------------------
def test_register_model_on_the_chapter_tiles():
    """D=128: 128 x 32 with 4 warps fits; 128 x 128 with 4 warps cannot (its accumulators
    alone are 256 registers); 8 warps fit the same tile."""
    assert t4.registers_needed(TileConfig(128, 32, 128), 128)[1]
    peak, fits = t4.registers_needed(TileConfig(128, 128, 128), 128)
    assert not fits and peak > 256
    assert t4.registers_needed(TileConfig(128, 128, 256), 128)[1]
    assert "acc_O 128 + acc_S 32" in t4.estimate_text(TileConfig(128, 32, 128), 128)


def test_register_tiles_are_valid_and_include_one_that_cannot_fit():
    for cfg, d in t4.REGISTER_TILES:
        cfg.check(d)
    assert any(sum(cfg.accumulator_registers(d).values()) > t4.REGISTER_LIMIT
               for cfg, d in t4.REGISTER_TILES)
    assert (fa.DEFAULT_CONFIGS[128], 128) in t4.REGISTER_TILES


def test_ctas_per_sm():
    occ = t4.ctas_per_sm(255, 128, 52224, "sm_90")  # 255 -> 256 per thread: 32768 per CTA
    assert occ["by"]["registers"] == 2 and occ["ctas"] == 2 and occ["warps"] == 8
    assert occ["limited by"] == "registers"
    assert t4.ctas_per_sm(213, 256, 69632)["ctas"] == 1  # more than half of the 64K registers
    assert t4.ctas_per_sm(64, 128, 100 * 1024, "sm_80")["by"]["shared memory"] == 1
    assert t4.ctas_per_sm(64, 128, 200 * 1024, "sm_90")["by"]["shared memory"] == 1
    assert t4.ctas_per_sm(64, 128, 200 * 1024, "sm_80")["ctas"] == 0  # over the per-CTA limit
    assert t4.ctas_per_sm(32, 32, 1024)["limited by"] == "CTA slots"


def test_the_register_exercise_refuses_the_chapters_model_before_compiling():
    def from_the_model(cfg, head_dim):
        return t4.register_estimate(cfg, head_dim)["peak"], True

    said = judge(t4.check_registers_needed, from_the_model, t4.registers_needed,
                 t4.REGISTERS_FORBID)
    assert said and "the chapter's own model" in said


@pytest.mark.slow
def test_the_register_exercise_is_graded_against_ptxas():
    """The reference passes; ptxas fits every tile but the 128 x 128 one with 4 warps; and a
    better estimate than the reference (closer to ptxas) passes too."""
    t4.check_registers_needed(t4.registers_needed)
    rows = t4.ptxas_rows()
    spilled = [(r["config"], r["head_dim"]) for r in rows if r["stack_bytes"] > 0]
    assert spilled == [(TileConfig(128, 128, 128, smem_layout="swizzled", qk_unroll=2), 128)]

    def closer_to_ptxas(cfg, d):
        peak, fits = t4.registers_needed(cfg, d)
        got = {(r["config"], r["head_dim"]): r["registers"] for r in rows}[(cfg, d)]
        return (got, True) if fits else (peak, False)

    t4.check_registers_needed(closer_to_ptxas)
    lines = t4.register_lines(t4.registers_needed)
    assert len(lines) == 1 + len(t4.REGISTER_TILES) and "ptxas" in lines[0]


# ---------------------------------------------------------------------------------------------
# Causal tiles (exercise 04.2)
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


def test_check_kv_tiles_accepts_the_reference_and_refuses_the_kernels_answer():
    t4.check_kv_tiles(t4.kv_tiles)

    def via_the_kernel(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal):
        n_max, _ = fa.kv_tile_range(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)
        return list(range(n_max)), []

    said = judge(t4.check_kv_tiles, via_the_kernel, t4.kv_tiles, t4.KV_TILES_FORBID)
    assert said and "fa.kv_tile_range" in said and "work it out from the rule" in said
    with pytest.raises(AssertionError, match="pair"):
        t4.check_kv_tiles(lambda *a: [0])


# ---------------------------------------------------------------------------------------------
# Reading the kernel and the stored results
# ---------------------------------------------------------------------------------------------
def test_notes_and_sources():
    assert t4.note("Work split").startswith("Note [Work split].")
    assert "compile-time constant" in t4.note("Mask with constants")
    assert "not found" in t4.note("No such note")
    src = t4.source_between(fa.FlashAttentionAmpere.kv_step, "# (a)", None)
    assert src.startswith("# (a)") and "self.gemm_qk" in src and "self.gemm_pv" in src


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
    assert t4.at_standing(res, "flash_ampere")["tflops"] == 120.0


def test_peak_lines_say_which_clock_each_figure_assumes():
    model, datasheet = t4.peak_lines()
    assert "1.98 GHz" in model and "maximum boost" in model
    assert datasheet.startswith("datasheet: 989 TFLOP/s") and "1.83 GHz" in datasheet


def test_mma_instructions_of_one_step():
    m = t4.mma_instructions(fa.default_config(128), 128)
    assert m["mma.sync"] == 4 * 128 * 64 * 128 // 4096  # one m16n8k16 is 4096 FLOP
    assert m["wgmma"] == 2 * (128 // 16 + 64 // 16)  # two 64-row warpgroups, QK^T and PV


def test_mma_sync_share_is_the_stored_measurement():
    """MMA_SYNC_SHARE feeds the models; it must be the H200 figure on file."""
    from utils.hardware import PER_SM
    from utils.results import load

    micro = load("microbench")
    per_clk = micro.one(metric="mma_sync_flop_per_clk_sm")["value"]
    assert t4.MMA_SYNC_SHARE == pytest.approx(per_clk / PER_SM["sm_90"].mma_flops_per_clk,
                                              abs=0.005)


def test_expected_tflops_model():
    exp = t4.expected_tflops(128)
    assert exp["overlapped"] == pytest.approx(exp["peak"] * t4.MMA_SYNC_SHARE)
    assert exp["serial"] < exp["overlapped"]


def test_load_stored_missing(capsys):
    assert t4.load_stored("no_such_results_file") is None
    assert "not measured yet" in capsys.readouterr().out


def test_stored_ch04_files_can_be_read():
    fwd = t4.load_stored("ch04_fwd")
    if fwd is None:
        pytest.skip("ch04_fwd not measured yet")
    groups, series = t4.tflops_groups(fwd)
    assert "flash_ampere" in series and all(len(v) == len(groups) for v in series.values())
    assert t4.standing_lines(fwd)[-1].startswith("flash_ampere runs ahead of sdpa_flash")
    assert t4.at_standing(fwd, "sdpa_flash") is not None


def test_ceiling_lines_read_the_stored_runs():
    """Chapter 05 prints these too."""
    from utils.results import load

    lines = t4.ceiling_lines(load("microbench"), load("ch04_sweep"))
    assert "mma.sync ceiling" in lines[0] and len(lines) == 1 + len(fa.ABLATION_CONFIGS)
    assert all("softmax costs" in line for line in lines[1:])
