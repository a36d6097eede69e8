"""Chapter 04's measurement drivers (measure.ch04_sweep, measure.ch04_cutlass_peer) run only on
a rare GPU session: what they report is checked here, on made-up rows."""

from measure import ch04_sweep
from solutions import ch04_flash_ampere as fa
from solutions import ch04_peers


def _sweep_row(config, d=128, causal=False, tflops=380.0, stack=0, peer=350.0):
    return {
        "d": d, "causal": causal, "m_block": config.m_block, "n_block": config.n_block,
        "num_threads": config.num_threads, "num_stages": config.num_stages,
        "smem_layout": config.smem_layout, "qk_unroll": config.qk_unroll,
        "default": config == fa.default_config(d), "ms": 1e3 / tflops if tflops else None,
        "tflops": tflops, "registers": 255, "stack_bytes": stack,
        "spill_instructions": 2 * stack // 8, "sdpa_flash_tflops": peer,
    }


def test_sweep_table_names_the_fastest_spill_free_tile():
    """``--sweep`` runs on a rare GPU session: its report is checked here, on made-up rows."""
    default = fa.DEFAULT_CONFIGS[128]
    other = fa.TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=1)
    unrolled = fa.TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=8)
    assert {default, other, unrolled} <= set(fa.SWEEP_CONFIGS[128])
    ablation = {**_sweep_row(default, tflops=450.0), "impl": fa.ABLATION_IMPL, "default": False}
    rows = [_sweep_row(default, tflops=390.0), _sweep_row(other, tflops=395.0),
            _sweep_row(unrolled, tflops=400.0, stack=32), ablation,
            _sweep_row(default, causal=True, tflops=None, peer=None)]
    text = ch04_sweep.format_sweep(rows)
    print(text)
    summary = [line for line in text.splitlines() if line.startswith("d=128 causal=False")]
    assert summary and f"fastest spill-free {fa.tile_name(rows[1])} 395.0" in summary[0]
    assert "1.129x SDPA flash" in summary[0] and "target" not in text
    assert "fastest overall" in summary[0] and "(stack 32 B)" in summary[0]
    assert "check FAILED" in text  # the causal row was never timed
    assert " no softmax " in text and "450.0" in text  # listed, but never the fastest tile




def test_cutlass_peer_summary_takes_medians_over_rounds():
    rows = [{"impl": impl, "data": "randn", "causal": False, "round": r, "tflops": t}
            for r, (a, b) in enumerate([(100.0, 90.0), (104.0, 91.0), (102.0, 150.0)])
            for impl, t in (("sdpa_flash", a), ("flash_ampere", b))]
    (line,) = ch04_peers.summary(rows)
    assert line.startswith("non-causal, randn: sdpa_flash 102 (1.000x)")
    assert "flash_ampere 91 (0.892x)" in line


def test_drivers_declare_their_files():
    from measure import ch04_cutlass_peer

    assert ch04_sweep.PRODUCES[0][0] == "results/h200/ch04_sweep.json"
    assert ch04_cutlass_peer.PRODUCES[0][0] == "results/h200/ch04_cutlass_peer.json"
    assert set(ch04_sweep.SWEEP_PLAN) == {(128, False), (128, True), (64, False)}
