"""Chapter 03 on a CPU: host-side CuTe, the kernels' per-thread code run in a loop, the
exercises' solutions and checkers, and the kernels compiled for sm_80 / sm_90a."""

import os
import re

import numpy as np
import pytest
import torch

from solutions import ch03_cute_basics as ch03
from tests.exercise_mutations import ch03 as wrong

# ----------------------------------------------------------------------------------------------
# Host-side CuTe


def test_layout_algebra_examples():
    ex = ch03.layout_algebra_examples()
    assert ex["coalesce"][1] == "12:1"
    assert ex["composition"][1] == "(8,4):(1,8)"  # the transpose of a row-major 4x8
    assert ex["complement"][1] == "(2,3):(1,8)"
    assert ex["zipped_divide"][1] == "((4,8),(2,2)):((16,1),(64,8))"
    assert ex["make_layout_tv"][1] == "tile (4, 32), TV ((8,4),4):((16,1),4)"


def test_cute_layout_grid():
    assert ch03.cute_layout_grid((4, 8), (8, 1)).tolist() == [list(range(r * 8, r * 8 + 8))
                                                              for r in range(4)]
    assert ch03.cute_layout_grid((2, 3), (1, 2)).tolist() == [[0, 2, 4], [1, 3, 5]]


def test_cute_thread_slice_matches_ptx_isa_accumulator_fragment():
    # PTX ISA, mma.m16n8k16 C fragment: lane l holds rows l/4 and l/4 + 8, cols 2*(l%4) + {0,1}.
    tile = np.arange(16 * 8, dtype=np.int32).reshape(16, 8)
    (shape, stride), _ = ch03.mma_tv_layouts()["C"]
    for lane in (0, 5, 31):
        r, c = lane // 4, 2 * (lane % 4)
        want = [tile[r, c], tile[r, c + 1], tile[r + 8, c], tile[r + 8, c + 1]]
        assert ch03.cute_thread_slice(tile, shape, stride, lane).tolist() == want


def test_cute_thread_slice_rejects_bad_input():
    tile = np.zeros((16, 8), dtype=np.int32)
    with pytest.raises(ValueError, match="tid"):
        ch03.cute_thread_slice(tile, ((4, 8), (2, 2)), ((32, 1), (16, 8)), 32)
    with pytest.raises(ValueError, match="outside"):
        ch03.cute_thread_slice(tile[:8], ((4, 8), (2, 2)), ((32, 1), (16, 8)), 0)
    with pytest.raises(TypeError, match="float32 or int32"):
        ch03.cute_thread_slice(tile.astype(np.int64), ((4, 8), (2, 2)), ((32, 1), (16, 8)), 0)


def test_copy_tv_layout_gives_each_thread_16_bytes_per_row():
    (shape, stride), tile = ch03.copy_tv_layout()
    assert tile == (4, 256)  # 4 warps x 32 threads x 8 bf16
    coords = ch03.thread_coords(shape, stride, tile, 33)  # warp 1, lane 1
    assert coords == [(1, 8 + i) for i in range(8)]


def test_swizzle_of_the_gemm_is_the_exercise_solution():
    grid = ch03.cute_swizzled_offsets()
    mine = [[ch03.swizzled_offset(r, c) for c in range(64)] for r in range(64)]
    assert grid.tolist() == mine


def test_print_runs_at_trace_time_and_printf_at_run_time(capfd):
    ch03.print_vs_printf(ch03.cutlass.Int32(100), 8)
    out = capfd.readouterr().out
    assert "[trace]   tile = 8, n = ?" in out
    assert "[runtime] n = 100, layout = (100,8):(1,100)" in out


# ----------------------------------------------------------------------------------------------
# The kernels' per-thread code, run for every (block, thread) on the CPU


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
def test_vector_add_on_cpu(n):
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((2, n), dtype=np.float32)
    c = ch03.vector_add_on_cpu(a, b)
    assert np.array_equal(c, a + b), f"n={n}: {np.isnan(c).sum()} elements never written"


@pytest.mark.parametrize("shape", [(1, 4), (17, 132), (33, 260)])
def test_tiled_copy_on_cpu(shape):
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    y = ch03.tiled_copy_on_cpu(x)
    missing = np.argwhere(np.isnan(y))
    assert not len(missing), f"{shape}: {len(missing)} elements never written, first {missing[:3]}"
    assert np.array_equal(x, y)


def test_cpu_runs_reject_bad_input():
    with pytest.raises(ValueError, match="float32"):
        ch03.vector_add_on_cpu(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="same shape"):
        ch03.vector_add_on_cpu(np.zeros(4, np.float32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="multiple of 4"):
        ch03.tiled_copy_on_cpu(np.zeros((3, 6), np.float32))


def test_torch_entry_points_reject_bad_input_before_needing_a_gpu():
    bf = torch.bfloat16
    with pytest.raises(TypeError, match="dtype"):
        ch03.vector_add(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="match"):
        ch03.vector_add(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="CUDA"):
        ch03.vector_add(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="multiple of 8"):
        ch03.tiled_copy(torch.zeros(3, 12, dtype=bf))
    with pytest.raises(ValueError, match="K a multiple of 8"):
        ch03.gemm_tn(torch.zeros(4, 12, dtype=bf), torch.zeros(4, 12, dtype=bf))
    with pytest.raises(ValueError, match="same K"):
        ch03.gemm_tn(torch.zeros(4, 16, dtype=bf), torch.zeros(4, 8, dtype=bf))
    with pytest.raises(TypeError, match="dtype"):
        ch03.gemm_tn(torch.zeros(4, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="CUDA"):
        ch03.gemm_tn(torch.zeros(4, 16, dtype=bf), torch.zeros(4, 16, dtype=bf))


# ----------------------------------------------------------------------------------------------
# Exercises: the solutions pass, wrong answers fail with a useful message


def test_exercise_solutions_pass_their_checks():
    ch03.check_layout_index(ch03.layout_index)
    ch03.check_thread_coords(ch03.thread_coords)
    ch03.check_swizzled_offset(ch03.swizzled_offset)


def test_forbidden_helpers_are_the_ones_that_do_the_work():
    from utils import exercises

    assert exercises.refused_call(wrong.index_from_the_plot_helper, ch03.LAYOUT_INDEX_FORBID)
    assert exercises.refused_call(wrong.coords_from_cute, ch03.THREAD_COORDS_FORBID)
    assert exercises.refused_call(wrong.swizzle_read_from_cute, ch03.SWIZZLE_FORBID)
    assert not exercises.refused_call(ch03.thread_coords, ch03.THREAD_COORDS_FORBID)


# ----------------------------------------------------------------------------------------------
# Compile for real GPUs on this CPU: one compile per (kernel, arch) serves all assertions


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    # The DSL writes .ptx/.cubin files into the working directory: keep them out of the repo.
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ch03_compile"))
    try:
        return {(k, arch): ch03.compile_only(arch, k)
                for k in ch03.KERNELS for arch in ("sm_80", "sm_90a")}
    finally:
        os.chdir(here)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_vector_add_is_scalar(artifacts, arch):
    art = artifacts[("vector_add", arch)]
    art.require("ld.global.b16", "st.global.b16")
    art.forbid("ld.global.v4")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_tiled_copy_moves_16_bytes_per_access(artifacts, arch):
    art = artifacts[("tiled_copy", arch)]
    art.require("ld.global.v4.b32", "st.global.v4.b32")
    # 4 vectors in, 4 vectors out per thread, nothing narrower
    assert art.count("ld.global.v4") == 4 and art.count("st.global.v4") == 4
    assert not re.search(r"ld\.global\.b(16|32)\b", art.ptx)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_gemm_uses_cp_async_ldmatrix_and_mma_sync(artifacts, arch):
    art = artifacts[("gemm", arch)]
    art.require("cp.async.cg.shared.global", "cp.async.wait_group",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    art.forbid("ld.global")  # every global load of A and B goes through cp.async
    # per K tile: (64/16 k-blocks) x (2 x 4 atoms per warp) = 32 mma.sync, 4 x (2 + 2) ldmatrix
    assert art.count("mma.sync") == 32 and art.count("ldmatrix") == 16
    if art.sass:
        art.require("HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDGSTS", where="sass")


@pytest.mark.parametrize("kernel", ch03.KERNELS)
def test_no_spills_and_modest_registers(artifacts, kernel):
    for arch in ("sm_80", "sm_90a"):
        art = artifacts[(kernel, arch)]
        assert art.spills == 0 and art.frame_bytes == 0, art.resources()
        assert 0 < art.registers <= 128, art.resources()


def test_compile_only_rejects_unknown_kernels_and_dtypes():
    with pytest.raises(ValueError, match="kernel must be one of"):
        ch03.compile_only("sm_80", "softmax")
    with pytest.raises(ValueError, match="BFloat16 or Float16"):
        ch03.compile_only("sm_80", "gemm", ch03.cutlass.Float32)


# ----------------------------------------------------------------------------------------------
# Exercise 03.3 (device code): the tiled copy's partition and predicate. The wrong answers are
# in tests/exercise_mutations/ch03.py, written the way a learner would write them.


def test_copy_partition_solution_passes_and_the_cpu_copy_uses_it():
    ch03.check_copy_partition(ch03.copy_partition)
    x = np.random.default_rng(3).standard_normal((19, 136), dtype=np.float32)
    assert np.array_equal(ch03.tiled_copy_on_cpu(x, partition=ch03.copy_partition), x)


@pytest.mark.parametrize("fn, words", [
    (wrong.partition_no_predicate, "rows 37 and beyond .* and at columns 132 and beyond"),
    (wrong.partition_rows_only, "wrote outside the tensor, at columns 132 and beyond"),
    (wrong.partition_thread_zero, r"get_slice\(tidx\)"),
])
def test_copy_partition_check_names_the_mistake(fn, words):
    with pytest.raises(AssertionError, match=words):
        ch03.check_copy_partition(fn)


def test_copy_partition_stub_is_not_done_not_a_crash():
    with pytest.raises(NotImplementedError):
        ch03.check_copy_partition(wrong.partition_not_done)


def test_copy_verdict_on_hand_made_results():
    x = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    dst = np.full((8 + 16, 8 + 128), np.nan, np.float32)
    dst[:8, :8] = x
    assert ch03.copy_verdict(x, dst) is None
    swapped = dst.copy()
    swapped[0, 0], swapped[0, 1] = x[0, 1], x[0, 0]
    assert "received the wrong value (it holds x(0, 1))" in ch03.copy_verdict(x, swapped)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_margin_launch_compiles(arch):
    from utils.compile_only import compile_for, fake_stream

    dt = ch03.cutlass.BFloat16
    fake = [ch03.cute.runtime.make_fake_compact_tensor(
        dt, (ch03.cute.sym_int32(), ch03.cute.sym_int32(divisibility=8)), stride_order=(1, 0),
        assumed_align=16) for _ in range(2)]
    art = compile_for(arch, ch03.TiledCopy().launch_in_margin, *fake, ch03.Int32(1),
                      ch03.Int32(1), fake_stream())
    assert art.count("ld.global.v4") == 4 and art.count("st.global.v4") == 4


# ----------------------------------------------------------------------------------------------
# Exercise 03.5 (device code): the GEMM's epilogue


def test_epilogue_reference_passes_and_reproduces_c_on_the_cpu():
    ch03.check_store_accumulators(ch03.store_accumulators)
    truth = np.random.default_rng(5).standard_normal((70, 130), dtype=np.float32)
    dst = ch03._epilogue_into_margin(truth, ch03.store_accumulators)
    assert ch03.epilogue_verdict(truth, dst) is None
    assert np.array_equal(dst[:70, :130], truth)


def test_epilogue_verdict_on_hand_made_results():
    truth = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    dst = np.full((6 + 64, 5 + 64), np.nan, np.float32)
    dst[:6, :5] = truth
    assert ch03.epilogue_verdict(truth, dst) is None
    swapped = dst.copy()
    swapped[0, 0], swapped[0, 1] = truth[0, 1], truth[0, 0]
    assert "wrong accumulator (it holds C(0, 1))" in ch03.epilogue_verdict(truth, swapped)
    outside = dst.copy()
    outside[6, 0] = 1.0
    assert "outside C, at rows 6 and beyond" in ch03.epilogue_verdict(truth, outside)


# The GEMM with the reference epilogue, compiled on this CPU: the SASS of the chapter's kernel
# (its digest moves only when the kernel or the toolchain does).
GEMM_SASS_SHA256 = {"sm_80": "fc4b32c7da0e18b0", "sm_90a": "588442fe9fba3ced"}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_gemm_with_the_reference_epilogue_is_the_chapters_kernel(artifacts, arch):
    import hashlib

    art = artifacts[("gemm", arch)]
    assert hashlib.sha256(art.sass.encode()).hexdigest()[:16] == GEMM_SASS_SHA256[arch]
    assert ch03._epilogue_stores(art) == 32


def test_stored_pair_rows_of_the_driver_validate_and_read():
    """measure/ch03_kernels.py's rows pass the results validation, and the chapter's reading
    says a ratio inside the spreads is within noise."""
    from measure import ch03_kernels as driver
    from utils import bench, results

    def measured(ms_rounds):
        m = bench.Measured(sensors=None, sensors_note="made up")
        m.ms_rounds, m.reps = list(ms_rounds), 10
        return m

    rows = driver._rows("copy", {"tiled_copy": measured([1.00, 1.02, 0.99]),
                                 "torch copy_": measured([1.01, 0.98, 1.00])}, 4e9, "GB/s", 1e9)
    results.validate({"provenance": {k: "x" for k in results.PROVENANCE_KEYS}, "rows": rows})

    class Res:
        def one(self, impl):
            return next(r for r in rows if r["impl"] == impl)

    said = "\n".join(ch03.kernel_lines(Res(), "tiled_copy"))
    assert "within noise" in said and "GB/s" in said
    assert abs(ch03.kernel_share(Res(), "tiled_copy") - 1.0) < 0.05
