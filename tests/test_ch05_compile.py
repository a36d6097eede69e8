"""Chapter 05 (Hopper FA3-style forward) on a CPU: it compiles for sm_90a with the instructions
the chapter is about, without spills; bad input is refused clearly; and the index arithmetic that
the producer and the consumers must agree on is checked against brute force."""

from dataclasses import replace

import cutlass
import cutlass.cute as cute
import pytest
import torch

from fa4_final.hopper.wgmma import attention_tiled_mmas
from solutions import ch05_flash_hopper as ch05
from solutions import ch07_rescaling as ch07
from solutions.ch05_softmax import ROWS_PER_WARP, acc_as_a_operand, acc_rows_cols
from utils import checks
from utils.reference import causal_mask


def tiled_mmas(kern):
    """The kernel's two tiled MMAs, as its __call__ builds them."""
    return attention_tiled_mmas(kern.dtype, kern.num_consumer_wgs, kern.tile_n, kern.head_dim)

_ARTIFACTS: dict = {}


@pytest.fixture(scope="module")
def compiled():
    """compiled(head_dim, causal, dtype="bf16", config=None) -> Artifacts, each compiled once."""

    def get(head_dim, causal, dtype="bf16", config=None):
        key = (head_dim, causal, dtype, config)
        if key not in _ARTIFACTS:
            _ARTIFACTS[key] = ch05.compile_only("sm_90a", head_dim, dtype, causal, config)
        return _ARTIFACTS[key]

    return get


MAIN_BUILDS = [(128, False), (128, True), (64, False), (64, True)]


@pytest.mark.parametrize("head_dim,causal", MAIN_BUILDS)
def test_ptx_has_the_hopper_instructions(compiled, head_dim, causal):
    art = compiled(head_dim, causal)
    art.require(
        "wgmma.mma_async", "wgmma.commit_group", "wgmma.wait_group", "wgmma.fence",
        "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg.inc", "setmaxnreg.dec",
        "fence.proxy.async", "ex2.approx",
    )
    # the P V product takes P from registers (RS form): its A operand is a register list
    assert "wgmma.mma_async.sync.aligned.m64n" in art.ptx


@pytest.mark.parametrize("head_dim,causal", MAIN_BUILDS)
def test_sass_uses_hgmma_and_tma_without_spills(compiled, head_dim, causal):
    art = compiled(head_dim, causal)
    art.require("HGMMA", "UTMALDG", "UTMASTG", "MUFU.EX2", "USETMAXREG", where="sass")
    assert art.spills == 0, art.resources()
    assert art.frame_bytes == 0, art.resources()


def test_register_budgets_in_ptx(compiled):
    ptx = compiled(128, False).ptx
    producer, consumer = ch05.REGISTER_BUDGETS[2]
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{producer};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{consumer};" in ptx
    assert ".reqntid 384, 1, 1" in ptx  # 1 producer + 2 consumer warpgroups


def test_wgmma_count_matches_the_loop_structure(compiled):
    """D=128, 128x128 tiles: S = Q K^T is D/16 = 8 wgmma, O += P V is tile_n/16 = 8. The
    overlapped loop has them in three places: S alone (first tile), S + PV (steady state),
    PV alone (last tile): 8 + 16 + 8 = 32."""
    assert compiled(128, False).count("wgmma.mma_async") == 32


def test_sass_overlap_report(compiled):
    """The helper the notebook uses to show where ptxas put the two waits of an overlapped turn
    (how many exponentials run under O += P V) finds them in the compiled kernel."""
    report = ch05.sass_overlap(compiled(128, False).sass)
    assert report["found"] and report["under_pv"] + report["after_pv"] >= 64, report


def test_named_barriers(compiled):
    epilogue = int(ch05.NamedBarrier.EPILOGUE)
    default = compiled(128, True).ptx
    assert f"bar.sync \t{epilogue}, 256;" in default  # all consumer threads before the TMA store
    assert "bar.arrive" not in default  # ping-pong is off by default (Note [Ping-pong])
    pingpong = compiled(128, True, "bf16", replace(ch05.default_config(128), pingpong=True)).ptx
    assert pingpong.count("bar.arrive") >= 1  # the hand-over to the other warpgroup


def test_every_knob_compiles_without_spills(compiled):
    base = ch05.default_config(128)
    for cfg in (
        replace(base, intra_wg_overlap=False),
        replace(base, pingpong=True),
        replace(base, num_stages=3),
        replace(base, exp2_emulation_fraction=0.5, rescale_threshold=8.0),
    ):
        art = compiled(128, True, "bf16", cfg)
        assert art.spills == 0 and art.frame_bytes == 0, (cfg, art.resources())
    # three consumer warpgroups at 160 registers each: the tightest budget
    for cfg in (ch05.HopperConfig(tile_n=96, num_consumer_wgs=3),
                ch05.HopperConfig(tile_n=64, num_consumer_wgs=3, exp2_emulation_fraction=0.25,
                                  rescale_threshold=8.0)):
        art = compiled(64, True, "bf16", cfg)
        assert ".reqntid 512, 1, 1" in art.ptx and art.spills == 0, (cfg, art.resources())


@pytest.mark.parametrize("head_dim,causal", MAIN_BUILDS)
def test_defaults_get_no_wgmma_fences_from_ptxas(compiled, head_dim, causal):
    """ptxas short of registers splits wgmma groups with fences of its own (default_config's
    docstring); the default tiles at D = 64 and 128 must not need them."""
    assert ch05.injected_wgmma_fences(compiled(head_dim, causal)) == 0


def test_head_dim_64_three_warpgroup_tiles(compiled):
    """default_config's docstring, as compiled: at 160 registers per consumer thread, FA4's
    192 x 128 spills, 192 x 112 does not spill but gets fences injected between its P V
    wgmmas, and the two candidates the knob run times compile clean."""
    H = ch05.HopperConfig
    fa4_tile = compiled(64, False, "bf16", H(tile_n=128, num_consumer_wgs=3))
    assert fa4_tile.spills > 0, fa4_tile.resources()
    fenced = compiled(64, False, "bf16", H(tile_n=112, num_consumer_wgs=3))
    assert fenced.spills == 0 and ch05.injected_wgmma_fences(fenced) > 0, fenced.resources()
    for name in ("192 x 64", "192 x 128, no overlap"):
        art = compiled(64, False, "bf16", ch05.bench_configs(64)[name])
        assert art.spills == 0 and ch05.injected_wgmma_fences(art) == 0, (name, art.resources())


# ---------------------------------------------------------------------------------------------
# chapter 06's knob: a share of the exponentials on the FMA polynomial
# ---------------------------------------------------------------------------------------------
FRACTIONS = (0.0, 0.25, 0.5, 1.0)


def test_exp2_emulation_moves_exps_from_mufu_to_fma(compiled):
    """D = 128, 128 x 128 tiles: the overlapped loop has the softmax twice (first tile, steady
    state), each 2 rows x 32 columns = 64 exponentials per thread, plus 2 alphas (MUFU) in the
    steady state. A share f of the 128 goes to the polynomial: 3 fma.rn each, no ex2.approx."""
    base = ch05.default_config(128)
    arts = [compiled(128, False, "bf16", replace(base, exp2_emulation_fraction=f))
            for f in FRACTIONS]
    ex2 = [a.count("ex2.approx") for a in arts]
    fma = [a.count("fma.rn.f32") for a in arts]
    assert ex2 == sorted(ex2, reverse=True) and len(set(ex2)) == len(ex2), ex2
    assert fma == sorted(fma) and len(set(fma)) == len(fma), fma
    for f, art, n_ex2, n_fma in zip(FRACTIONS, arts, ex2, fma):
        emulated = round(2 * 64 * f)
        assert n_ex2 == 2 * 64 + 2 - emulated, (f, n_ex2)
        assert n_fma - fma[0] == 3 * emulated, (f, n_fma)
        assert art.count("MUFU.EX2", where="sass") == n_ex2, (f, art.resources())
        assert art.spills == 0 and art.frame_bytes == 0, (f, art.resources())
    arts[-1].require("FADD.RM", "LEA", "IADD3", where="sass")  # floor trick, exponent add


# ---------------------------------------------------------------------------------------------
# chapter 07's knob: conditional rescaling with a warp vote
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_rescale_threshold_votes_once_per_tile(compiled, causal):
    """tau > 0: one vote.sync.any in the steady-state softmax (the first tile has nothing to
    rescale), and a branch around the O multiply; tau = 0 emits neither."""
    on = compiled(128, causal, "bf16", replace(ch05.default_config(128), rescale_threshold=8.0))
    assert on.count("vote.sync.any") == 1, on.count("vote.sync.any")
    on.require("VOTE.ANY", where="sass")
    assert on.spills == 0 and on.frame_bytes == 0, on.resources()
    assert compiled(128, causal).count("vote.sync.any") == 0


def test_one_warp_owns_the_16_consecutive_rows_of_the_ch07_model():
    """Note [Warp vote]: the vote groups a warp's rows, and ch07_rescaling's model groups
    HOPPER_WARP_ROWS consecutive query rows. Check from the wgmma layout that warp w of the
    consumer threads holds exactly rows 16w .. 16w + 15 of the tile (tile_m = 128 and 192)."""
    assert ROWS_PER_WARP == ch07.HOPPER_WARP_ROWS == 16
    assert ch05.default_config(128).tile_m % ROWS_PER_WARP == 0
    problems = []

    def check(kern, mma_qk):
        c_s = cute.make_identity_tensor((kern.tile_m, kern.tile_n))
        for warp in range(kern.num_consumer_threads // 32):
            rows = set()
            for lane in range(32):
                rc = acc_rows_cols(mma_qk.get_slice(32 * warp + lane).partition_C(c_s))
                rows |= {rc[r, 0][0] for r in range(cute.size(rc, mode=[0]))}
            if rows != set(range(16 * warp, 16 * warp + 16)):
                problems.append((kern.tile_m, warp, sorted(rows)))

    kerns = [ch05.FlashAttentionHopper(cutlass.BFloat16, 128, False, cfg)
             for cfg in (ch05.default_config(128), ch05.HopperConfig(num_consumer_wgs=3))]

    @cute.jit
    def trace():
        for kern in kerns:
            check(kern, tiled_mmas(kern)[0])

    cute.compile[cute.GPUArch("sm_90a")](trace)
    assert not problems, problems[:4]


def test_fp16_and_head_dim_256_compile(compiled):
    for head_dim, dtype in ((128, "fp16"), (256, "bf16")):
        art = compiled(head_dim, False, dtype)
        art.require("wgmma.mma_async", "cp.async.bulk.tensor")
        assert art.spills == 0, art.resources()


def test_sm80_is_refused_clearly():
    with pytest.raises(ValueError, match="sm_90a"):
        ch05.compile_only(arch="sm_80")


# ---------------------------------------------------------------------------------------------
# configuration and shared-memory arithmetic
# ---------------------------------------------------------------------------------------------
def test_shared_memory_budget_arithmetic():
    cfg = ch05.default_config(128)
    # 1 KB of mbarriers (rounded up to the swizzle alignment) + Q 32 KB + 2 x (K + V) 32 KB
    assert ch05.smem_bytes(128, cfg) == (1 + 32 + 2 * 64) * 1024
    assert ch05.max_stages(128, cfg) == 3  # (227 - 1 - 32) // 64
    assert ch05.smem_bytes(256, ch05.default_config(256)) <= ch05.SMEM_BYTES_PER_CTA
    for wgs, (producer, consumer) in ch05.REGISTER_BUDGETS.items():
        assert ch05.THREADS_PER_WG * (producer + wgs * consumer) <= ch05.REGISTERS_PER_SM


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(num_stages=4), "shared memory"),
        (dict(num_consumer_wgs=4), "num_consumer_wgs"),
        (dict(tile_n=72), "tile_n"),
        (dict(exp2_emulation_fraction=0.2), "chapter 06.*k/8"),
        (dict(exp2_emulation_fraction=1.5), "chapter 06"),
        (dict(rescale_threshold=16.0), "chapter 07.*65504"),
        (dict(rescale_threshold=-1.0), "chapter 07"),
        (dict(rescale_threshold=float("nan")), "chapter 07"),
    ],
)
def test_bad_config_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ch05.check_config(128, replace(ch05.default_config(128), **change))


def test_knob_types_and_accepted_values():
    base = ch05.default_config(128)
    with pytest.raises(TypeError, match="chapter 06"):
        ch05.check_config(128, replace(base, exp2_emulation_fraction="half"))
    with pytest.raises(TypeError, match="chapter 07"):
        ch05.check_config(128, replace(base, rescale_threshold=True))
    for f in (0, 0.125, 0.25, 0.5, 0.875, 1.0):
        ch05.check_config(128, replace(base, exp2_emulation_fraction=f))
    for tau in (0, 2.0, 8.0, ch05.MAX_RESCALE_THRESHOLD):
        ch05.check_config(128, replace(base, rescale_threshold=tau))
    # the bound: p <= 2^tau with a little overshoot must stay below fp16's largest value
    assert 2.0**ch05.MAX_RESCALE_THRESHOLD * (1 + 1e-4) < torch.finfo(torch.float16).max
    assert ch05.MAX_RESCALE_THRESHOLD < ch07.largest_safe_threshold(torch.float16, 2**20)


def test_bench_plan_covers_the_brief():
    """The knob run (measure.ch05_knobs) times every knob of chapters 05-07 at D = 128, causal
    and not."""
    for causal in (False, True):
        names = set(ch05.BENCH_PLAN[(128, causal)])
        assert {"default", "no intra-wg overlap", "ping-pong", "3 stages", "exp2 emulation 1/4",
                "exp2 emulation 1/2", "tau = 8"} <= names
    configs = ch05.bench_configs(128)
    for (d, _), names in ch05.BENCH_PLAN.items():
        for name in names:
            ch05.check_config(d, ch05.bench_configs(d)[name])
    assert configs["ping-pong"].pingpong != configs["default"].pingpong


# ---------------------------------------------------------------------------------------------
# torch entry point: input checks (CPU tensors reach every check before the device one)
# ---------------------------------------------------------------------------------------------
def _qkv(dtype=torch.bfloat16, d=128, sq=16, sk=16, h=2, hk=2):
    return (torch.zeros(1, sq, h, d, dtype=dtype), torch.zeros(1, sk, hk, d, dtype=dtype),
            torch.zeros(1, sk, hk, d, dtype=dtype))


def test_input_checks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="CUDA"):
        ch05.attention(q, k, v)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        ch05.attention(*_qkv(torch.float32))
    with pytest.raises(ValueError, match="head dim"):
        ch05.attention(*_qkv(d=96))
    with pytest.raises(ValueError, match="multiple"):
        ch05.attention(*_qkv(h=3, hk=2))
    with pytest.raises(ValueError, match="softmax_scale must be > 0"):
        ch05.attention(q, k, v, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="HopperConfig"):
        ch05.attention(q, k, v, config={"tile_n": 64})
    with pytest.raises(ValueError, match="shared memory"):
        ch05.attention(q, k, v, config=replace(ch05.default_config(128), num_stages=5))
    with pytest.raises(ValueError, match="stride 1"):
        ch05.attention(q.transpose(1, 3).contiguous().transpose(1, 3), k, v)
    odd = torch.zeros(1, 16, 2, 132, dtype=torch.bfloat16)[..., :128]  # head stride 264 B
    with pytest.raises(ValueError, match="16 bytes"):
        ch05.attention(odd, k, v)


def test_command_line_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/gpu/ covers the command line there")
    assert ch05.main(["--small"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_the_knob_run_is_a_measure_driver_and_the_kernel_module_only_times():
    """The knob run's driver lives in measure/ (it writes results); the kernel module keeps the
    timing and refuses to save."""
    from measure import ch05_knobs

    assert ch05_knobs.PRODUCES[0][0] == f"results/h200/{ch05.BENCH_RESULTS}.json"
    with pytest.raises(ValueError, match="measure.ch05_knobs"):
        ch05.bench({}, save=True)
    with pytest.raises(SystemExit):
        ch05.main(["--bench"])


# ---------------------------------------------------------------------------------------------
# what the two warp roles must agree on
# ---------------------------------------------------------------------------------------------
AWKWARD = [1, 17, 63, 64, 65, 128, 129, 200, 640, 1000]
CONFIGS = [
    ch05.default_config(128),  # 128 x 128
    ch05.default_config(256),  # 128 x 80
    ch05.HopperConfig(tile_n=64, num_consumer_wgs=3),  # 192 x 64
    ch05.HopperConfig(tile_n=96, num_consumer_wgs=3),  # 192 x 96
    ch05.HopperConfig(tile_n=128, num_consumer_wgs=1),  # 64 x 128
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.tile_m}x{c.tile_n}")
@pytest.mark.parametrize("causal", [False, True])
def test_kv_tile_counts_cover_exactly_the_visible_keys(cfg, causal):
    """Tiles >= n_tiles hold no key any real row sees; tiles < n_tiles - n_masked are fully
    visible to every row of the query tile (no mask needed); masked tiles are few."""
    kern = ch05.FlashAttentionHopper(cutlass.BFloat16, 128, causal, cfg)
    tm, tn = cfg.tile_m, cfg.tile_n
    for sq in AWKWARD:
        for sk in AWKWARD:
            mask = causal_mask(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
            for m in range(-(-sq // tm)):
                n_tiles, n_masked = kern.kv_tile_counts(m, sq, sk)
                where = f"sq={sq} sk={sk} m_block={m}: n_tiles={n_tiles} n_masked={n_masked}"
                assert 0 <= n_masked <= n_tiles, where
                rows = mask[m * tm : (m + 1) * tm]
                cols = torch.nonzero(rows.any(dim=0)).flatten()
                needed = int(cols.max()) // tn + 1 if cols.numel() else 0
                assert n_tiles == needed, where
                n_full = n_tiles - n_masked
                first_row = m * tm + sk - sq + 1  # keys visible to the tile's first row
                assert n_full * tn <= min(sk, max(first_row, 0) if causal else sk), where
                assert n_masked <= (-(-tm // tn) + 1 if causal else 1), where


@pytest.mark.parametrize("causal", [False, True])
def test_visible_cols_is_the_reference_mask(causal):
    kern = ch05.FlashAttentionHopper(cutlass.BFloat16, 128, causal, ch05.HopperConfig(tile_n=16))
    tn = kern.tile_n
    for sq, sk in [(17, 17), (40, 23), (23, 40), (1, 50), (50, 1)]:
        want = causal_mask(sq, sk) if causal else torch.ones(sq, sk, dtype=torch.bool)
        got = torch.zeros(sq, sk, dtype=torch.bool)
        for i in range(sq):
            for n in range(-(-sk // tn)):
                limit = kern.visible_cols(i, n, sq, sk)
                for c in range(min(tn, sk - n * tn)):
                    got[i, n * tn + c] = c < limit
        assert torch.equal(got, want), (sq, sk)


@pytest.mark.parametrize("num_wgs", [2, 3])
@pytest.mark.parametrize("num_turns", [1, 2, 3, 7])
def test_pingpong_turns_alternate_and_balance(num_wgs, num_turns):
    """Simulate the named barriers (bar.sync / bar.arrive, 2 warpgroups per barrier) with the
    kernel's turn predicates: no deadlock, turns run in (turn, warpgroup) order, and no
    barrier is left with a pending arrive at exit (Note [Turns])."""
    kern = ch05.FlashAttentionHopper(
        cutlass.BFloat16, 128, False, ch05.HopperConfig(num_consumer_wgs=num_wgs)
    )
    programs = []
    for w in range(num_wgs):
        ops = []
        for r in range(num_turns):
            if kern.turn_waits(w, r):
                ops.append(("sync", w))
            ops.append(("issue", (r, w)))
            if kern.turn_passes(w, r, num_turns):
                ops.append(("arrive", (w + 1) % num_wgs))
        programs.append(ops)
    count = [0] * num_wgs  # arrivals in the open phase of each barrier (2 complete it)
    generation = [0] * num_wgs
    waiting = [None] * num_wgs  # (barrier, generation it waits to see complete)
    pc, issued = [0] * num_wgs, []
    while any(pc[w] < len(programs[w]) for w in range(num_wgs)):
        progressed = False
        for w in range(num_wgs):
            if waiting[w] is not None:
                b, gen = waiting[w]
                if generation[b] > gen:
                    waiting[w], progressed = None, True
                continue
            if pc[w] == len(programs[w]):
                continue
            op, arg = programs[w][pc[w]]
            pc[w] += 1
            progressed = True
            if op == "issue":
                issued.append(arg)
                continue
            gen = generation[arg]
            count[arg] += 1
            if count[arg] == 2:
                count[arg], generation[arg] = 0, generation[arg] + 1
            if op == "sync" and generation[arg] == gen:
                waiting[w] = (arg, gen)
        assert progressed, f"deadlock: pc={pc}, waiting={waiting}"
    assert issued == sorted(issued), issued
    assert count == [0] * num_wgs, f"pending arrives at exit: {count}"


def test_register_fragment_views():
    """For the threads of both consumer warpgroups (all lane patterns of warp 0 and one lane of
    every other warp): acc_rows_cols gives one row per r and one column per c, and
    acc_as_a_operand puts each S element exactly where the P V wgmma reads its A operand."""
    threads = list(range(8)) + [32 * w + 5 for w in range(1, 12)] + [255, 383]
    problems = []
    kerns = [ch05.FlashAttentionHopper(cutlass.BFloat16, d, False, cfg) for d, cfg in (
        (128, ch05.default_config(128)), (256, ch05.default_config(256)),  # tile_n 128, 80
        (64, ch05.HopperConfig(tile_n=112, num_consumer_wgs=3)),  # three warpgroups
    )]

    def check(kern, mma_qk, mma_pv):
        c_s = cute.make_identity_tensor((kern.tile_m, kern.tile_n))
        for t in (t for t in threads if t < kern.num_consumer_threads):
            acc = mma_qk.get_slice(t).partition_C(c_s)
            as_a, want = acc_as_a_operand(acc), mma_pv.get_slice(t).partition_A(c_s)
            problems.extend(("A", kern.tile_n, t, i) for i in range(cute.size(want))
                            if as_a[i] != want[i])
            rc = acc_rows_cols(acc)
            grid = [[rc[r, c] for c in range(cute.size(rc, mode=[1]))]
                    for r in range(cute.size(rc, mode=[0]))]
            problems.extend(("row", t, r) for r, row in enumerate(grid)
                            if len({x[0] for x in row}) != 1)
            problems.extend(("col", t, c) for c in range(len(grid[0]))
                            if len({row[c][1] for row in grid}) != 1)

    @cute.jit
    def trace():
        for kern in kerns:
            check(kern, *tiled_mmas(kern))

    cute.compile[cute.GPUArch("sm_90a")](trace)
    assert not problems, problems[:10]


def test_the_gpu_checker_itself():
    """compare() (used by the GPU tests and --check) passes a correct answer and catches a NaN,
    an error above tolerance, and a row that should see no key but got a value."""
    from utils.reference import attention_reference, random_qkv

    q, k, v, _ = random_qkv(1, 40, 2, 64, seqlen_k=30, dtype=torch.bfloat16, seed=0)
    out, lse = attention_reference(q, k, v, causal=True)
    out, lse = out.to(torch.bfloat16), lse.float()
    assert ch05.compare(q, k, v, out, lse, True)[0]
    for spoil in ("nan", "error", "empty row", "lse", "lse inf", "lse nan"):
        bad, bad_lse = out.clone(), lse.clone()
        if spoil == "nan":
            bad[0, 20, 1, 3] = float("nan")
        elif spoil == "error":
            bad[0, 20, 1, 3] += 0.1
        elif spoil == "empty row":
            bad[0, 2, 0, 0] = 1.0  # row 2 sees no key (40 queries, 30 keys, causal)
        elif spoil == "lse":
            bad_lse[0, 1, 20] += 2 * checks.LSE_ATOL  # within PyTorch's bf16 yardstick, not ours
        elif spoil == "lse inf":
            bad_lse[0, 1, 20] = float("-inf")
        else:
            bad_lse[0, 1, 20] = float("nan")
        ok, line = ch05.compare(q, k, v, bad, bad_lse, True, label=spoil)
        assert not ok and line.startswith("FAIL"), line


def test_knob_table_formats_stored_rows():
    """The table the knob run prints and the notebooks show from results/<gpu>/ch05_knobs.json."""
    def row(name, d, causal, ms):
        return {"config": name, "d": d, "causal": causal, "ms": ms,
                "tflops": None if ms is None else 1000.0 / ms}

    rows = [row("default", 128, False, 2.0), row("ping-pong", 128, False, 2.5),
            row("default", 128, True, 1.0), row("tau = 8", 128, True, None)]
    table = ch05.format_knob_rows(rows)
    assert "0.800x" in table and "1.000x" in table and "check FAILED" in table, table
    only = ch05.format_knob_rows(rows, configs=("ping-pong",))
    assert "ping-pong" in only and "tau = 8" not in only and len(only.splitlines()) == 2, only
