"""Chapter 05's teaching helpers: the ring simulation finds what it claims to find, the models
give the chapter's arithmetic, and every checker accepts the solution and rejects wrong answers
with a message that says what went wrong."""

import inspect
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from solutions import ch05_flash_hopper as ch05  # noqa: E402
from solutions import ch05_teaching as t5  # noqa: E402
from tests.exercise_mutations import ch05 as wrong  # noqa: E402
from utils.results import Results  # noqa: E402


# ---------------------------------------------------------------------------------------------
# mbarrier semantics and the ring
# ---------------------------------------------------------------------------------------------
def test_fresh_mbarrier_reports_parity_one_complete():
    ring = t5.Ring(stages=1, consumers=2)
    bar = ring.empty[0]
    assert bar.try_wait(1) and not bar.try_wait(0)
    bar.arrive()
    assert not bar.try_wait(0)  # one of two arrivals: phase 0 still running
    bar.arrive()
    assert bar.try_wait(0) and not bar.try_wait(1)  # phase 0 done, phase 1 (parity 1) running


def test_full_barrier_needs_the_arrival_and_every_byte():
    ring = t5.Ring(stages=1, consumers=1, tile_bytes=100)
    full = ring.full[0]
    full.complete_tx(100)  # the TMA may land before the producer's arrive: nothing completes
    assert not full.try_wait(0)
    full.arrive_expect_tx(100)
    assert full.try_wait(0)


@pytest.mark.parametrize("stages,consumers", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_reference_ring_runs_every_tile_in_order(stages, consumers):
    sim = t5.RingSim(n_tiles=11, stages=stages, consumers=consumers).run()
    for me in range(consumers):
        tiles = [tile for who, tile, *_ in sorted(sim.ring.reads, key=lambda r: r[3])
                 if who == me]
        assert tiles == list(range(11))
    assert not sim.ring.in_flight and sim.done


def test_deeper_ring_finishes_sooner():
    ticks = [t5.RingSim(n_tiles=12, stages=s, latency=6, read_ticks=3).run().ring.now
             for s in (1, 2, 3)]
    assert ticks[0] > ticks[1] > ticks[2], ticks


def test_step_and_state_describe_the_ring():
    sim = t5.RingSim(n_tiles=4, stages=2)
    lines = [line for _ in range(5) for line in sim.step()]
    assert any("issues the TMA load of tile 0" in ln for ln in lines)
    assert any("lands in slot 0" in ln for ln in lines)
    state = sim.state()
    assert "full[0]" in state and "empty[1]" in state and "consumer 1" in state


def test_broken_producers_fail_as_documented():
    kinds = {
        "waits on empty with parity lap & 1": t5.Deadlock,
        "never waits on empty": t5.PipelineError,
        "arrives on full without expect-tx": t5.StaleRead,
    }
    assert set(kinds) == set(t5.BROKEN_PRODUCERS)
    for name, step in t5.BROKEN_PRODUCERS.items():
        with pytest.raises(kinds[name]):
            t5.RingSim(n_tiles=6, stages=2, producer_step=step).run()


def test_deadlock_message_names_barrier_and_parity():
    with pytest.raises(t5.Deadlock, match=r"producer waits for parity 0 on empty\[0\]"):
        t5.RingSim(n_tiles=3, stages=1, producer_step=t5.producer_same_parity).run()


def test_no_wait_producer_overwrites_a_slot_being_read():
    def eager(ring, t):  # a plain function: no waits at all, one tile per slot use
        ring.full[t % ring.stages].arrive_expect_tx(ring.tile_bytes)
        ring.tma_load(t % ring.stages, t)

    with pytest.raises(t5.Overwrite, match="slot 0"):
        t5.RingSim(n_tiles=3, stages=1, consumers=1, latency=1, read_ticks=4,
                   producer_step=eager).run()


def test_consumer_mistakes_are_caught():
    def early_release(ring, t, me):  # gives the slot back before reading it
        stage, lap = t % ring.stages, t // ring.stages
        yield ring.full[stage].wait(parity=lap & 1)
        ring.empty[stage].arrive()
        yield from ring.read(stage, t, me)

    def never_releases(ring, t, me):
        stage, lap = t % ring.stages, t // ring.stages
        yield ring.full[stage].wait(parity=lap & 1)
        yield from ring.read(stage, t, me)

    with pytest.raises((t5.Overwrite, t5.StaleRead)):
        t5.RingSim(n_tiles=6, stages=2, consumers=1, latency=1, read_ticks=3,
                   consumer_step=early_release).run()
    with pytest.raises(t5.Deadlock, match="empty"):
        t5.RingSim(n_tiles=6, stages=2, consumer_step=never_releases).run()


def test_wrong_byte_count_deadlocks_with_a_byte_message():
    def half_bytes(ring, t):
        stage, lap = t % ring.stages, t // ring.stages
        yield ring.empty[stage].wait(parity=(lap & 1) ^ 1)
        ring.full[stage].arrive_expect_tx(ring.tile_bytes // 2)
        ring.tma_load(stage, t)

    with pytest.raises(t5.Deadlock, match="nobody announced"):
        t5.RingSim(n_tiles=4, stages=2, producer_step=half_bytes).run()


def test_bad_yield_is_explained():
    def yields_bool(ring, t):
        yield ring.empty[0].try_wait(1)

    with pytest.raises(t5.PipelineError, match="yield a barrier wait"):
        t5.RingSim(n_tiles=1, stages=1, producer_step=yields_bool).run()


# ---------------------------------------------------------------------------------------------
# exercise 05.2
# ---------------------------------------------------------------------------------------------
def test_check_producer_step_accepts_the_solution():
    t5.check_producer_step(t5.producer_step)


@pytest.mark.parametrize("name,words", [
    ("waits on empty with parity lap & 1", "deadlocked"),
    ("never waits on empty", "empty"),
    ("arrives on full without expect-tx", "landed"),
])
def test_check_producer_step_rejects_broken_producers(name, words):
    with pytest.raises(AssertionError, match=words) as err:
        t5.check_producer_step(t5.BROKEN_PRODUCERS[name])
    assert "stage(s)" in str(err.value)  # says which configuration broke


def test_check_producer_step_passes_not_done_through():
    def stub(ring, t):
        raise NotImplementedError

    with pytest.raises(NotImplementedError):
        t5.check_producer_step(stub)


def test_check_producer_step_rejects_double_loads():
    def twice(ring, t):
        yield from t5.producer_step(ring, t)
        ring.tma_load(t % ring.stages, t)  # the same tile again, bytes not announced

    with pytest.raises(AssertionError):
        t5.check_producer_step(twice)


# ---------------------------------------------------------------------------------------------
# exercise 05.1: stages from the shared-memory budget
# ---------------------------------------------------------------------------------------------
def test_stages_that_fit_matches_the_kernel():
    for head_dim, cfg in t5.STAGE_CASES:
        n = t5.stages_that_fit(head_dim, cfg)
        if n >= 1:
            assert n == ch05.max_stages(head_dim, cfg)
            assert ch05.smem_bytes(head_dim, replace(cfg, num_stages=n)) <= ch05.SMEM_BYTES_PER_CTA
        assert ch05.smem_bytes(head_dim, replace(cfg, num_stages=n + 1)) > ch05.SMEM_BYTES_PER_CTA
    assert t5.stages_that_fit(128, ch05.default_config(128)) == 3
    assert any(t5.stages_that_fit(d, c) == 0 for d, c in t5.STAGE_CASES)


def test_check_stages_accepts_the_closed_form():
    def closed_form(head_dim, cfg):
        q = cfg.tile_m * head_dim * 2
        return max(0, (ch05.SMEM_BYTES_PER_CTA - 1024 - q) // (4 * cfg.tile_n * head_dim))

    t5.check_stages_that_fit(t5.stages_that_fit)
    t5.check_stages_that_fit(closed_form)


def test_check_stages_rejects_wrong_counts():
    with pytest.raises(AssertionError, match="more than 227 KB"):
        t5.check_stages_that_fit(lambda d, c: t5.stages_that_fit(d, c) + 1)
    with pytest.raises(AssertionError, match=r"fit: .* <= 227 KB"):
        t5.check_stages_that_fit(lambda d, c: max(0, t5.stages_that_fit(d, c) - 1))
    with pytest.raises(AssertionError, match="more than"):  # forgot V: only K per stage
        t5.check_stages_that_fit(
            lambda d, c: (ch05.SMEM_BYTES_PER_CTA - 1024 - c.tile_m * d * 2) // (2 * c.tile_n * d))
    with pytest.raises(AssertionError, match="whole number"):
        t5.check_stages_that_fit(lambda d, c: 2.5)


def test_smem_breakdown_sums_to_the_kernel_struct():
    for head_dim in (64, 128, 256):
        cfg = ch05.default_config(head_dim)
        total = sum(b for _, b in t5.smem_breakdown(head_dim, cfg))
        assert total == ch05.smem_bytes(head_dim, cfg)


# ---------------------------------------------------------------------------------------------
# exercise 05.3: a race that hides
# ---------------------------------------------------------------------------------------------
def test_race_scenarios_reference_hides_then_shows():
    hides, shows = t5.RACE_SCENARIOS
    t5.check_race_scenarios((dict(hides), dict(shows)))
    with pytest.raises(AssertionError, match="the reference's pair"):
        t5.check_race_scenarios(t5.RACE_SCENARIOS)
    assert t5.run_scenario(hides) is None
    assert t5.run_scenario(shows).startswith("Overwrite")
    assert t5.run_scenario(shows, t5.producer_step) is None  # the correct producer is fine


def test_race_scenarios_stub_is_not_done_and_bad_input_is_explained():
    with pytest.raises(NotImplementedError):
        t5.check_race_scenarios((None, None))
    with pytest.raises(AssertionError, match="pair"):
        t5.check_race_scenarios({"n_tiles": 8})
    with pytest.raises(AssertionError, match="no setting 'tiles'"):
        t5.check_race_scenarios(({"tiles": 8}, {}))
    with pytest.raises(AssertionError, match="whole number"):
        t5.check_race_scenarios((dict(t5.RACE_SCENARIOS[0], latency=0), dict(t5.RACE_SCENARIOS[1])))


def test_a_slow_copy_shows_the_race_too():
    """Changing the TMA latency instead of the read time exposes the same producer: it arms a
    full barrier again before the copy that armed it has landed."""
    hides = dict(t5.RACE_SCENARIOS[0])
    t5.check_race_scenarios((hides, dict(hides, latency=5)))


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
def test_b_operand_reuse_model():
    assert t5.rows_per_b_read_needed("H100") == 32
    sync, wg = t5.mma_styles(m=128, n=128, d=128, warps=4)
    # K and V alone would tie at 32 rows per warp (2048 cycles each); chapter 04's kernel also
    # reloads its Q rows from shared memory every step (ldmatrix), 32 KB more: smem binds
    assert sync["mma_cycles"] == 2048 and sync["smem_cycles"] == 2048 + 256
    assert wg["smem_cycles"] == 1280 < wg["mma_cycles"]
    assert sync["instructions"] == 2048 and wg["instructions"] == 32
    eight = t5.mma_styles(m=128, n=128, d=128, warps=8)[0]
    assert eight["smem_cycles"] == 2 * 2048 + 256  # 16 rows per warp: smem binds further
    ch04_tile = t5.mma_styles(m=128, n=64, d=128, warps=4)[0]  # chapter 04's D = 128 default
    assert ch04_tile["smem_cycles"] > ch04_tile["mma_cycles"]


def test_tensor_map_and_zero_fill():
    tm = t5.tensor_map(batch=2, seqlen=300, heads=3, dim=128, box_rows=128)
    assert tm.box == (64, 128, 1, 1) and tm.box_bytes == 16384
    assert tm.strides_bytes == (3 * 128 * 2, 128 * 2, 300 * 3 * 128 * 2)
    assert "D=128" in str(tm)
    x = np.arange(2 * 300 * 3 * 128, dtype=np.float32).reshape(2, 300, 3, 128) + 1
    box = t5.tma_load_box(x, corner=(64, 256, 1, 1), box=tm.box)
    assert box.shape == (128, 64)
    np.testing.assert_array_equal(box[:44], x[1, 256:300, 1, 64:128])
    assert not box[44:].any()
    assert t5.copy_instructions(128, 128) == {
        "tile_bytes": 32768, "cp.async (16 B each)": 2048, "cp.async per thread": 16,
        "TMA boxes": 2}


def test_swizzle_from_cute_and_its_conflict_freedom():
    layout = t5.smem_tile_layout(head_dim=128)
    assert layout["swizzle"] == (3, 4, 3)
    assert "(8,64):(64,1)" in layout["atom"]
    slots = np.array([[t5.swizzled_chunk(r, c, layout["swizzle"]) for c in range(8)]
                      for r in range(8)])
    for i in range(8):
        assert sorted(slots[i]) == list(range(8))  # each row: a permutation of its chunks
        assert sorted(slots[:, i]) == list(range(8))  # each column: all 8 bank groups


def test_register_arithmetic():
    for row in t5.register_table():
        assert row["total"] <= ch05.REGISTERS_PER_SM
        assert row["threads"] * row["at_launch"] <= ch05.REGISTERS_PER_SM
    two = next(r for r in t5.register_table() if r["consumer_wgs"] == 2)
    assert two["at_launch"] == 168 and two["total"] == 384 * 168
    assert t5.consumer_fragments(128)["sum"] == 160


def test_pingpong_model():
    cyc = t5.turn_cycles(128, 128)
    assert cyc == {"gemm": 1024.0, "exp": 512.0}
    runs = {m: t5.pingpong_schedule(4, cyc["gemm"], cyc["exp"], m) for m in t5.SCHEDULE_MODES}
    assert runs["interleaved"]["tensor_busy"] < runs["issue order"]["tensor_busy"]
    assert runs["issue order"]["makespan"] == runs["ping-pong"]["makespan"]
    for run in runs.values():
        assert sum(1 for s in run["segments"] if s[1] == "gemm") == 2 * 4
    tied = t5.pingpong_schedule(6, 448, 1.25 * 448, "issue order", wgs=3)
    assert tied["tensor_busy"] < 0.85  # more softmax than GEMM: the tensor cores wait
    with pytest.raises(ValueError, match="mode"):
        t5.pingpong_schedule(2, 1, 1, "round robin")


# ---------------------------------------------------------------------------------------------
# SASS reading, on a synthetic turn and on the real kernel
# ---------------------------------------------------------------------------------------------
def _sass(ops):
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;"
                     for i, op in enumerate(ops))


SYNTHETIC = _sass(
    ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", "WARPGROUP.ARRIVE"]
    + ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24"] * 2
    + ["HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR12].tnspB, R88"] * 2
    + ["WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R1, R2, R3, !PT", "MUFU.EX2 R24, R24",
       "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R25, R25", "@P0 FMUL R88, R88, R4",
       "BAR.SYNC.DEFER_BLOCKING R7, 0x100"]
)


def test_steady_turn_on_synthetic_sass():
    turn = t5.steady_turn(SYNTHETIC)
    kinds = [k for k, _ in turn]
    assert kinds.count(t5.SASS_KINDS[0]) == 2 and kinds.count(t5.SASS_KINDS[1]) == 2
    assert kinds.count(t5.SASS_KINDS[3]) == 2
    parts = dict(t5.turn_sections(turn))
    assert parts["S ready, P V may still run"] == {"FMNMX": 1, "MUFU": 1}
    assert parts["after P V is done"] == {"MUFU": 1, "FMUL": 1}
    assert ch05.sass_overlap(SYNTHETIC) == {"under_pv": 1, "after_pv": 1, "found": True}
    assert t5.steady_turn(_sass(["FADD R1, R2, R3"])) == []
    t5.draw_steady_turn(turn)
    plt.close("all")


def test_steady_turn_on_the_compiled_kernel():
    art = ch05.compile_only("sm_90a", head_dim=128)
    turn = t5.steady_turn(art.sass)
    kinds = [k for k, _ in turn]
    # D = 128, 128 x 128: S and P V are 8 HGMMA each; the turn's exps are the overlap report's
    assert kinds.count(t5.SASS_KINDS[0]) == 8 and kinds.count(t5.SASS_KINDS[1]) == 8
    report = ch05.sass_overlap(art.sass)
    assert kinds.count(t5.SASS_KINDS[3]) == report["under_pv"] + report["after_pv"]
    assert len(t5.ptx_lines(art.ptx, r"cp\.async\.bulk\.tensor", limit=50)) >= 4


# ---------------------------------------------------------------------------------------------
# reading the kernel, stored results, pictures
# ---------------------------------------------------------------------------------------------
def test_source_pieces_and_notes():
    piece = t5.source_between(ch05.FlashAttentionHopper.mma_softmax, "# turns 1 .. n-1",
                              "# turn n: the last O += P V")
    assert "self.gemm_turn(" in piece and "wait_group(0)" in piece
    assert "wait_group(1)" in inspect.getsource(ch05.FlashAttentionHopper.gemm_turn)
    assert t5.note("Proxies").startswith("Note [Proxies]")
    assert "Hypothesis" in t5.note("Ping-pong")
    missing = t5.source_between(ch05.FlashAttentionHopper.load, "no such marker")
    assert missing.startswith("# ('no such marker' not found")
    assert t5.note("Phases").startswith("Note [Phases]")
    assert "not found" in t5.note("No such note")


def _fake_results(rows):
    prov = {k: "x" for k in ("gpu", "driver", "cuda", "torch", "cutlass_dsl", "commit", "date",
                             "command")}
    return Results("fake", None, prov, rows)


def test_tflops_groups_and_knob_lines():
    rows = [{"impl": i, "pass": "fwd", "d": d, "s": 4096, "causal": False, "tflops": t}
            for i, d, t in (("flash_hopper", 128, 600.0), ("sdpa_cudnn", 128, 500.0),
                            ("flash_hopper", 64, 400.0))]
    labels, series = t5.tflops_groups(_fake_results(rows))
    assert labels[0].startswith("D=128") and series["sdpa_cudnn"] == [500.0, None]
    t5.plot_tflops(_fake_results(rows), "test")
    plt.close("all")
    knobs = [{"config": "default", "d": 128, "causal": False, "tile_m": 128, "tile_n": 128,
              "tflops": 600.0},
             {"config": "ping-pong", "d": 128, "causal": False, "tile_m": 128, "tile_n": 128,
              "tflops": 540.0},
             {"config": "3 stages", "d": 128, "causal": False, "tflops": None, "verified": False}]
    text = "\n".join(t5.knob_lines(_fake_results(knobs)))
    assert "0.90x default" in text and "not timed" in text


def test_load_stored_missing(capsys):
    assert t5.load_stored("no_such_results_file") is None
    assert "not measured yet" in capsys.readouterr().out


def test_pictures_draw_headless():
    t5.draw_tma_box()
    t5.draw_ring_timeline(t5.RingSim(n_tiles=5, stages=2).run())
    cyc = t5.turn_cycles(128)
    t5.draw_pingpong({m: t5.pingpong_schedule(2, cyc["gemm"], cyc["exp"], m)
                      for m in t5.SCHEDULE_MODES})
    plt.close("all")


# ----------------------------------------------------------------------------------------------
# Exercise 05.4 (device code): the producer's K/V loop. Typical slips live in
# tests/exercise_mutations/ch05.py.


def test_load_kv_is_the_kernels_loop_and_passes():
    assert t5.producer_order(t5.load_kv, 4) == "K3 K2 V3 K1 V2 K0 V1 V0"
    t5.check_load_kv(t5.load_kv)


def test_the_kernel_with_the_reference_producer_compiles_like_the_kernel():
    mine = t5.producer_ptx_counts(t5.load_kv)
    theirs = ch05.compile_only("sm_90a", head_dim=128).ptx
    assert mine["TMA loads"] == sum("cp.async.bulk.tensor" in ln and "shared::cta.global" in ln
                                    for ln in theirs.splitlines())
    assert mine["arrive.expect_tx"] == theirs.count("mbarrier.arrive.expect_tx") == 5
    assert mine["TMA loads"] == mine["TMA loads naming an mbarrier"] == 10
    assert mine["mbarrier waits"] == theirs.count("mbarrier.try_wait")


def test_another_order_that_cannot_deadlock_passes():
    t5.check_load_kv(wrong.load_v_first_in_each_turn)


@pytest.mark.parametrize("fn, words", [
    (wrong.load_all_k_then_v, "(?s)deadlocked.*producer waits for parity 1 on K empty"),
    (wrong.load_in_ascending_order, r"order \[0, 1\]; the consumers read them in the order "
                                    r"\[1, 0\]"),
    (wrong.load_without_acquire, "without a producer_acquire"),
    (wrong.load_without_advance, "without advancing state_k"),
    (wrong.load_barrier_after_advance, "not on the barrier of the slot you acquired"),
    (wrong.load_forgets_last_v, r"V tile\(s\) \[0\] are never loaded"),
    (wrong.load_without_guard, "n_tiles = 0"),
])
def test_load_kv_check_names_the_mistake(fn, words):
    with pytest.raises(AssertionError, match=words):
        t5.check_load_kv(fn, compile_check=False)


def test_a_helper_that_advances_the_state_is_named():
    t5.check_load_kv(wrong.load_with_a_helper, compile_check=False)  # right as Python
    with pytest.raises(AssertionError, match=r"state.advance\(\) in the loop body itself"):
        t5.check_load_kv(wrong.load_with_a_helper)


def test_load_kv_stub_is_not_done_not_a_crash():
    with pytest.raises(NotImplementedError):
        t5.check_load_kv(wrong.load_not_done)


def test_two_ring_simulation_catches_an_overwrite():
    # the producer refills K slot 0 without waiting for its release: recorded calls edited
    calls = [c for c in t5.record_producer(t5.load_kv, 3, stages=1)]
    no_wait = [c if c.kind != "acquire" or c.ring != "K" else
               t5.ProducerCall("acquire", "K", c.index, 1) for c in calls]
    with pytest.raises(t5.PipelineError):
        t5.KVRingSim(n_tiles=3, stages=1, consumers=2, latency=1, read_ticks=5,
                        calls=tuple(no_wait)).run()
