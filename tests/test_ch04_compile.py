"""Chapter 04's kernel with no GPU: it compiles for sm_80 and sm_90a, uses the instructions the
chapter teaches, spills nothing (bf16 and fp16, causal or not), and rejects bad input before it
needs a GPU."""

import hashlib
from dataclasses import replace
from importlib.metadata import version

import pytest
import torch

from solutions import ch04_flash_ampere as fa

ARCHS = ("sm_80", "sm_90a")
HEAD_DIMS = (64, 128)
CASES = [(arch, d, causal, "bf16") for arch in ARCHS for d in HEAD_DIMS for causal in (False, True)]
# The register allocation differs between bf16 and fp16 (a 1-instruction change to the softmax
# or the tile is enough to tip ptxas into spilling near 255 registers), so fp16 is checked too.
SPILL_CASES = CASES + [(arch, d, causal, "fp16") for arch, d, causal, _ in CASES]


@pytest.fixture(scope="module")
def artifacts():
    """One compile per (arch, head_dim, causal, dtype) of the default tiles, shared by every
    test."""
    return {case: fa.compile_only(case[0], case[1], dtype=case[3], causal=case[2])
            for case in SPILL_CASES}


def _name(case):
    arch, d, causal, dtype = case
    return f"{arch}-d{d}-{'causal' if causal else 'full'}-{dtype}"


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_instructions(artifacts, case):
    art = artifacts[case]
    # cp.async (16-byte global -> shared), ldmatrix (x4 and .trans for V), mma.sync m16n8k16,
    # MUFU exp2, and the quad butterfly shuffles of the row max / row sum.
    art.require(
        "cp.async.cg.shared.global",
        "cp.async.commit_group",
        "cp.async.wait_group",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
        "mma.sync.aligned.m16n8k16.row.col.f32",
        "ex2.approx",
        "shfl.sync.bfly",
    )
    art.require("HMMA.16816.F32", "LDGSTS", "LDSM", "MUFU.EX2", where="sass")
    # Ampere-style only: no TMA, no WGMMA.
    art.forbid("cp.async.bulk.tensor", "wgmma")


@pytest.mark.parametrize("case", SPILL_CASES, ids=_name)
def test_no_spills(artifacts, case):
    art = artifacts[case]
    assert art.spills == 0, f"{_name(case)}: {art.spills} spill instructions\n{art.resources()}"
    assert art.frame_bytes == 0, f"{_name(case)}: stack frame\n{art.resources()}"
    assert 0 < art.registers <= 255, art.resources()


TUNED_CASES = list(fa.TUNED_CONFIGS.items())


@pytest.mark.parametrize("key, config", TUNED_CASES,
                         ids=[_name((f"{a}a" if a == "sm_90" else a, d, c, t))
                              for (a, d, c, t), _ in TUNED_CASES])
def test_tuned_configs_spill_nothing_on_their_arch(key, config):
    """A tuned tile replaces the default only on its arch (sm_90 means sm_90a here) and dtype:
    it must compile there with no spills."""
    arch, d, causal, dtype = key
    target = "sm_90a" if arch == "sm_90" else arch
    art = fa.compile_only(target, d, dtype=dtype, causal=causal, config=config)
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert fa.default_config(d, causal, arch, dtype) == config
    assert fa.default_config(d, causal) == fa.DEFAULT_CONFIGS[d]  # elsewhere: the portable one


def test_every_dtype_without_a_tuned_tile_gets_the_portable_one():
    """Causal fp16 on sm_90 has no entry (the causal tile spills 2 instructions there)."""
    assert fa.default_config(128, True, "sm_90", "fp16") == fa.DEFAULT_CONFIGS[128]
    assert fa.default_config(128, True, "sm_90", "bf16") != fa.DEFAULT_CONFIGS[128]
    assert set(fa.DTYPE_NAMES.values()) == {"bf16", "fp16"}


SKIP_CONFIG = replace(fa.SM90_D128_TILE, skip_rescale=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_skip_rescale_votes_and_spills_nothing(artifacts, dtype):
    """Note [Skipping the rescale]: the swept skip_rescale tile asks its warp with
    vote.sync.any, and still fits in 255 registers on sm_90a; kernels without it never vote."""
    assert SKIP_CONFIG in fa.SWEEP_CONFIGS[128]
    assert not fa.default_config(128, False, "sm_90", "bf16").skip_rescale
    art = fa.compile_only("sm_90a", 128, dtype=dtype, causal=False, config=SKIP_CONFIG)
    art.require("vote.sync.any")
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    artifacts[("sm_90a", 128, False, dtype)].forbid("vote.sync")


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_two_copies_of_the_kv_step(artifacts, case):
    """The KV step exists twice: the peeled first tile and the loop (the causal mask is a branch
    inside it, not a third copy). Each copy issues (M/16/warps) * (D/8) * (N/16) mmas for PV,
    unrolled, but only (M/16/warps) * (N/8) * qk_unroll for QK^T: its k-loop stays a loop, which
    is what keeps 128 x 64 free of spills (Note [Registers])."""
    _, d, _, _ = case
    c = fa.default_config(d)
    m_atoms = c.m_block // (16 * c.num_warps)
    pv = m_atoms * (d // 8) * (c.n_block // 16)
    qk_trip = m_atoms * (c.n_block // 8) * c.qk_unroll
    if d == 128:  # at D = 64 the fully unrolled loop fits (64 fewer accumulator registers)
        assert c.qk_unroll < d // 16, "the default must not unroll QK^T fully at D = 128"
    assert artifacts[case].count("mma.sync") == 2 * (pv + qk_trip)


# The default kernels' sm_80 SASS (sha256 of nvdisasm's text) as compiled before the KV step was
# split into the methods a course subclass replaces (gemm_qk, online_softmax, gemm_pv; exercises
# 04.3-04.5): the split must change no instruction. Recorded with nvidia-cutlass-dsl 4.8.1.
SASS_DSL_VERSION = "4.8.1"
SASS_SHA256 = {
    ("sm_80", 64, False, "bf16"):
        "6cd24c0cd88c0b8f58c35106c5a2686bd437d3680e8aab4e55aab9b7a0056d26",
    ("sm_80", 64, True, "bf16"):
        "d77f29b7b5f74df261c8ed800f222a9444be0eaa67a07874860e1f8655acb1d2",
    ("sm_80", 128, False, "bf16"):
        "b0414797d36002bcb2aa30fa33b8f87ba17ac3c71ac2a1173df7e0653723e93f",
    ("sm_80", 128, True, "bf16"):
        "9b2add6e584f4732aee32207e602c1c6716b37820e21f7d80b7c396402147807",
    ("sm_80", 64, False, "fp16"):
        "f630a3fe493edb72333b52772bc3a15a4ea9e68f33b62d67ef7dafcc668a5c23",
    ("sm_80", 64, True, "fp16"):
        "0822b281d42c4f758952ea357aace70a3d1bea684dad36bf7cbcc89f7e9af802",
    ("sm_80", 128, False, "fp16"):
        "ae504bdb871adcd56c8c02c382c7d340e73cfdc87ec005a4ad23a087ed7172f9",
    ("sm_80", 128, True, "fp16"):
        "4908c5a1e13a189f3a6224e6adefd958b03685683c2c390a95daa68f4057f130",
}


@pytest.mark.skipif(version("nvidia-cutlass-dsl") != SASS_DSL_VERSION,
                    reason=f"the digests were recorded with CuTe DSL {SASS_DSL_VERSION}")
@pytest.mark.parametrize("case", list(SASS_SHA256), ids=_name)
def test_default_sass_is_unchanged_by_the_exercise_seams(artifacts, case):
    digest = hashlib.sha256(artifacts[case].sass.encode()).hexdigest()
    assert digest == SASS_SHA256[case], (
        f"{_name(case)}: the default kernel's sm_80 SASS changed; the kernel's code must compile "
        "to the same instructions")


# ----------------------------------------------------------------------------------------------
# Input checks: they run on CPU tensors and must fire before anything needs a GPU.


def _qkv(dtype=torch.bfloat16, b=1, sq=5, sk=7, h=4, hk=2, d=64):
    return (
        torch.zeros(b, sq, h, d, dtype=dtype),
        torch.zeros(b, sk, hk, d, dtype=dtype),
        torch.zeros(b, sk, hk, d, dtype=dtype),
    )


def test_valid_input_on_cpu_asks_for_cuda():
    with pytest.raises(ValueError, match="CUDA tensors"):
        fa.attention(*_qkv())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejects_wide_dtypes(dtype):
    with pytest.raises(TypeError, match="bfloat16 or torch.float16"):
        fa.attention(*_qkv(dtype))


def test_rejects_mixed_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="share a dtype"):
        fa.attention(q, k.half(), v)


@pytest.mark.parametrize("d", [32, 96, 256])
def test_rejects_head_dim(d):
    with pytest.raises(ValueError, match=r"head dim must be one of \(64, 128\)"):
        fa.attention(*_qkv(d=d))


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_rejects_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        fa.attention(*_qkv(), softmax_scale=scale)


def test_rejects_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of k/v's 3 heads"):
        fa.attention(q, *_qkv(h=3, hk=3)[1:])
    with pytest.raises(ValueError, match="4-D"):
        fa.attention(q[0], k, v)
    with pytest.raises(ValueError, match="same shape"):
        fa.attention(q, k, v[:, :3])


def test_rejects_noncontiguous_head_dim():
    q, k, v = _qkv()
    q_t = torch.zeros(1, 5, 64, 4, dtype=torch.bfloat16).transpose(-1, -2)  # stride(-1) = 4
    with pytest.raises(ValueError, match="contiguous in its last"):
        fa.attention(q_t, k, v)


def test_rejects_unaligned_strides_and_addresses():
    q, k, v = _qkv()
    wide = torch.zeros(1, 5, 4 * 64 + 4, dtype=torch.bfloat16)  # rows 260 elements apart
    q_odd_stride = wide[:, :, : 4 * 64].unflatten(-1, (4, 64))
    with pytest.raises(ValueError, match="multiples of 8"):
        fa.attention(q_odd_stride, k, v)
    flat = torch.zeros(1 + 5 * 4 * 64, dtype=torch.bfloat16)
    q_shifted = flat[1:].view(1, 5, 4, 64)  # starts 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte boundary"):
        fa.attention(q_shifted, k, v)


def test_accepts_strided_views_up_to_the_device_check():
    """(b, h, s, d) storage seen as (b, s, h, d): strides (h*s*d, d, s*d, 1) are fine."""
    q = torch.zeros(1, 4, 5, 64, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.zeros(1, 2, 7, 64, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(ValueError, match="CUDA tensors"):
        fa.attention(q, k, k)


@pytest.mark.parametrize(
    "config, message",
    [
        (fa.TileConfig(num_threads=100), "num_threads"),
        (fa.TileConfig(m_block=96), "multiple of 16 \\* warps"),
        (fa.TileConfig(n_block=40), "multiple of 16"),
        (fa.TileConfig(m_block=128, n_block=16, num_threads=256), "num_threads // 8"),
        (fa.TileConfig(num_stages=4), "num_stages"),
        (fa.TileConfig(smem_layout="interleaved"), "smem_layout"),
        (fa.TileConfig(qk_unroll=3), "qk_unroll must divide"),
        (fa.TileConfig(qk_unroll=0), "qk_unroll must divide"),
        (fa.TileConfig(m_block=256, n_block=256, num_stages=2), "shared memory"),
    ],
)
def test_rejects_bad_config(config, message):
    with pytest.raises(ValueError, match=message):
        fa.attention(*_qkv(), config=config)


def test_rejects_config_type():
    with pytest.raises(TypeError, match="TileConfig"):
        fa.attention(*_qkv(), config=(128, 64))


def test_attention_into_checks_buffers():
    q, k, v = _qkv()
    lse = torch.empty(1, 4, 5)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        fa.attention_into(q, k, v, torch.empty(1, 5, 4, 64), lse)


def test_compile_only_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be one of"):
        fa.compile_only("sm_80", 64, dtype="fp32")
    with pytest.raises(ValueError, match="head_dim must be one of"):
        fa.compile_only("sm_80", 96)
    with pytest.raises(ValueError, match="arch must be one of"):
        fa.compile_only("sm_70", 64)


def test_default_configs_fit():
    for d, config in fa.DEFAULT_CONFIGS.items():
        config.check(d)
        acc = config.accumulator_registers(d)
        assert acc["acc_O"] + acc["acc_S"] <= 192, (d, acc)  # leaves room for operands
    for d, configs in fa.SWEEP_CONFIGS.items():
        for config in configs:
            config.check(d)


@pytest.mark.slow
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_sweep_compiles(d):
    """Every tile the chapter sweeps compiles for sm_90a; prints its registers and spills. At
    D=128 the fully unrolled QK^T loop spills: the sweep keeps it to measure what spills cost."""
    rows = fa.config_report("sm_90a", d, causal=False)
    for row in rows:
        print(row)
        assert row["registers"] <= 255
    unrolled = [r for r in rows if r["config"].qk_unroll == d // 16]
    if d == 128:
        assert unrolled and all(r["stack_bytes"] > 0 for r in unrolled), rows


def test_launched_resources_before_any_launch():
    assert fa.launched_resources(128, False, fa.default_config(128)) is None
