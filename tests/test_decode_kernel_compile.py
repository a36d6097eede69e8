"""fa4_final's Hopper decode forward (fa4_final.hopper.decode) compiled for sm_90a from fake
tensors, on a CPU: D = 64 and 128, contiguous and paged, one split and several, with and without
seqused_k, dense and varlen queries, with and without a left window. What must be in the PTX and
SASS (wgmma, TMA loads, setmaxnreg, mbarrier waits, the 16-byte Q loads and the proxy fence
before wgmma reads them), what must not (local memory, a TMA store, wgmma serialised by ptxas),
and the register plan. A few seconds a compile."""

import re

import pytest

from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper.config import (
    DECODE_LAUNCH_REGISTERS,
    SM90_DECODE_REGISTERS,
    HopperDecodeConfig,
    hopper_decode_default,
)
from fa4_final.hopper.host import decode_recipe
from fa4_final.runtime.compile import artifacts

pytestmark = pytest.mark.slow

VARIANTS = [  # (head_dim, paged, has_seqused_k, split, causal, dtype, varlen_q, window_left)
    (128, False, False, False, True, "bf16", False, False),
    (128, False, True, True, True, "bf16", False, False),
    (128, True, True, False, True, "bf16", False, False),
    (128, True, True, True, True, "bf16", False, False),
    (64, False, False, False, True, "bf16", False, False),
    (64, True, True, True, True, "fp16", False, False),
    (64, True, False, False, False, "bf16", False, False),
    (128, True, True, True, True, "bf16", True, False),
    (64, False, True, False, True, "bf16", True, False),
    (128, True, True, True, True, "bf16", False, True),
    (64, False, False, False, False, "bf16", False, True),
]


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(variant):
        if variant not in cache:
            d, paged, used, split, causal, dtype, varlen, window = variant
            cache[variant] = artifacts(decode_recipe(d, dtype, causal, paged, used, split,
                                                     varlen_q=varlen,
                                                     has_window_left=window))["main"]
        return cache[variant]

    return get


def name(v):
    d, paged, used, split, causal, dtype, varlen, window = v
    return (f"d{d}-{'paged' if paged else 'contiguous'}{'-seqused' if used else ''}"
            f"-{'split' if split else 'one-split'}{'-causal' if causal else ''}-{dtype}"
            f"{'-varlen' if varlen else ''}{'-window' if window else ''}")


@pytest.mark.parametrize("variant", VARIANTS, ids=name)
def test_decode_has_the_hopper_instructions(compiled, variant):
    d, paged, used, split, causal, dtype, varlen, window = variant
    art = compiled(variant)
    art.require("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec",
                "mbarrier.try_wait", "fence.proxy.async", "bar.sync")
    art.require("HGMMA", "UTMALDG", "MUFU.EX2", "LDG.E.128", where="sass")
    # 16-byte shared stores: Q's rows, and zeros over the last V tile's rows past seqlen_k
    # (Note [Keys past the cached length]); three bar.sync: the barriers' init, Q, the zeros
    tile_n = hopper_decode_default(d).tile_n
    assert art.count("STS.128", "sass") == (64 + tile_n) * d // 8 // 128
    assert art.count("bar.sync") == 3
    # out leaves from registers: no shared-memory staging, no TMA store
    art.forbid("UTMASTG", "STSM", where="sass")
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    # ptxas fenced no wgmma on its own (C7512: serialised for lack of registers)
    assert art.count("WARPGROUP.ARRIVE", "sass") == art.count("wgmma.fence.sync.aligned")


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=name)
def test_register_plan(compiled, variant):
    """Launched at 128 registers a thread (two CTAs an SM bound the launch), the producer
    warpgroup drops to 24 and the consumer rises to 232: 24 + 232 = 2 x 128 per thread slot of
    each sub-partition (fa4_final.common.register_plan)."""
    art = compiled(variant)
    producer, consumer = SM90_DECODE_REGISTERS
    assert re.search(rf"setmaxnreg.dec.sync.aligned.u32\s+{producer};", art.ptx)
    assert re.search(rf"setmaxnreg.inc.sync.aligned.u32\s+{consumer};", art.ptx)
    assert art.registers <= DECODE_LAUNCH_REGISTERS, art.resources()
    assert producer + consumer <= 2 * DECODE_LAUNCH_REGISTERS
    assert ".reqntid 256, 1, 1" in art.ptx and ".minnctapersm 2" in art.ptx


@pytest.mark.parametrize("variant", VARIANTS, ids=name)
def test_one_gemm_pair_per_step_body(compiled, variant):
    """Three step bodies (the first tile, the other masked ones, the free ones; a left window
    adds the ones left of it), each with S = Q K^T (D / 16 wgmma) and O += P V (tile_n / 16)."""
    d, window = variant[0], variant[-1]
    tile_n = hopper_decode_default(d).tile_n
    art = compiled(variant)
    bodies = 4 if window else 3
    assert art.count("HGMMA", "sass") == bodies * (d // 16 + tile_n // 16)
    assert art.count("wgmma.commit_group") == 2 * bodies


@pytest.mark.parametrize("variant", VARIANTS, ids=name)
def test_device_reads_are_the_lengths_and_the_pages(compiled, variant):
    """Besides Q's 16-byte loads, the only global reads are seqused_k[b] (once a CTA), the page
    of each key tile (in the producer's loop), paged, the consumers' look at the split's pages
    and at seqused_k (Note [Out-of-range pages give NaN]) and, varlen, the sequence's two
    offsets: no host-side metadata."""
    d, paged, used, split, causal, dtype, varlen, window = variant
    art = compiled(variant)
    looks = int(paged) * (4 + int(used))  # the look at the pages: unrolled by 4
    assert art.count("ld.global.b32") == int(paged) + int(used) + looks + 2 * int(varlen)
    assert art.count("ld.global.v4.b32") == 64 * d // 8 // 128  # Q: 16 B a thread a row chunk


def test_paged_and_contiguous_run_the_same_consumer(compiled):
    """Paged changes only where the producer points its TMA box: the GEMMs, the exponentials
    and the stores are the contiguous build's."""
    contiguous, paged = compiled(VARIANTS[1]), compiled(VARIANTS[3])
    for word in ("HGMMA", "MUFU.EX2", "STG.E", "UTMALDG"):
        assert contiguous.count(word, "sass") == paged.count(word, "sass"), word


def test_split_writes_float32_partials(compiled):
    """One split stores out in the input dtype (a pair of bf16 in 32 bits), several the float32
    partials (a pair in 64 bits: the partials' 16-byte strides let the stores pair up); the lse
    stores are the two 32-bit ones left."""
    one, split = compiled(VARIANTS[0]), compiled(VARIANTS[1])
    assert split.count("st.global.b32") == 2 == one.count("st.global.b32") - 64 * 128 // 128 // 2
    assert split.count("st.global.v2.b32") == 64 * 128 // 128 // 2
    assert one.count("st.global.v2.b32") == 0


def test_a_split_kernel_lets_its_combine_launch_early(compiled):
    """Note [The combine launches early]: a split kernel signals its dependents once, after its
    barriers are set up; one split (no combine after it) does not."""
    split, one = compiled(VARIANTS[1]), compiled(VARIANTS[0])
    assert split.count("griddepcontrol.launch_dependents;") == 1
    assert "griddepcontrol" not in one.ptx
    body = split.ptx[split.ptx.index(".entry"):]
    assert body.index("mbarrier.init") < body.index("griddepcontrol.launch_dependents;")


def test_decode_compiles_for_hopper_only():
    with pytest.raises(UnsupportedError, match="sm_90a"):
        decode_recipe(arch="sm_100a")
    with pytest.raises(TypeError, match="HopperDecodeConfig"):
        decode_recipe(config=object())


@pytest.mark.parametrize("d,page_size", [(64, 16), (128, 16), (128, 48), (128, 64)])
def test_paged_small_pages_compile_gathered_into_whole_tiles(d, page_size):
    """Pages that hold no whole 128-key tile: hopper_decode_for_page gathers each tile from
    boxes (Note [Gathered key tiles]). Clean; one TMA copy per box and 64-column swizzle atom of
    K and of V, each box at its 8-row-aligned place in the stage, the page table read once a box
    (shared by K and V); the consumer's GEMMs those of the one-box kernel."""
    from fa4_final.hopper.config import hopper_decode_for_page

    cfg = hopper_decode_for_page(d, page_size)
    box = cfg.page_box
    assert cfg.tile_n == 128 and box == max(b for b in (16, 32, 64) if page_size % b == 0)
    gathered = artifacts(decode_recipe(d, "bf16", True, True, True, True, config=cfg))["main"]
    flat = artifacts(decode_recipe(d, "bf16", True, True, True, True))["main"]
    assert gathered.spills == 0 and gathered.frame_bytes == 0, gathered.resources()
    copies = 2 * (128 // box) * (d // 64)
    assert gathered.count("cp.async.bulk.tensor") == copies
    assert gathered.count("UTMALDG", "sass") == copies
    assert flat.count("cp.async.bulk.tensor") == 2 * (d // 64)
    assert gathered.count("HGMMA", "sass") == flat.count("HGMMA", "sass")
    assert (gathered.count("ld.global") - flat.count("ld.global")) == 128 // box - 1
    # the boxes' shared-memory offsets within a stage: j * box rows of 64 columns, 2 B each
    offsets = sorted({int(x) for x in re.findall(
        r"cp\.async\.bulk\.tensor[^\[]*\[%r\d+\+(\d+)\]", gathered.ptx)})
    steps = {b - a for a, b in zip(offsets, offsets[1:])}
    assert box * 64 * 2 in steps, offsets


@pytest.mark.parametrize("box", [16, 32])
def test_a_contiguous_cache_can_be_read_in_boxes(box):
    """page_box on a contiguous cache (Note [Boxes of a contiguous cache]): tile_n / box boxes
    a tile, each box's two 64-column copies back to back, no page-table load; the same
    wgmma as one box a tile."""
    from dataclasses import replace

    cfg = replace(hopper_decode_default(128), page_box=box)
    boxed = artifacts(decode_recipe(128, "bf16", False, False, False, False, config=cfg))["main"]
    flat = artifacts(decode_recipe(128, "bf16", False, False, False, False))["main"]
    assert boxed.spills == 0 and boxed.frame_bytes == 0, boxed.resources()
    assert boxed.count("cp.async.bulk.tensor") == 2 * (128 // box) * 2
    assert boxed.count("HGMMA", "sass") == flat.count("HGMMA", "sass")
    assert boxed.count("ld.global") == flat.count("ld.global")
    # in each K or V tile, the copies' shared-memory offsets go box by box: the two halves of
    # box j (16 KB apart, a half's 128 rows) follow each other
    offsets = [int(x) for x in re.findall(r"cp\.async\.bulk\.tensor[^\[]*\[%r\d+\+(\d+)\]",
                                          boxed.ptx)]
    first_tile = offsets[:2 * (128 // box)]
    assert [b - a for a, b in zip(first_tile[::2], first_tile[1::2])] == [128 * 64 * 2] * (
        128 // box), first_tile


@pytest.mark.parametrize("d", [64, 128])
def test_small_pages_compile_with_small_key_tiles(d):
    """Pages of 16 keys read by 16-key tiles (24 stages, the default's bytes in flight), one box
    a tile; clean, three step bodies of S (D / 16 wgmma) and P V (one)."""
    cfg = HopperDecodeConfig(tile_n=16, stages=24)
    art = artifacts(decode_recipe(d, "bf16", True, True, True, True, config=cfg))["main"]
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert art.count("WARPGROUP.ARRIVE", "sass") == art.count("wgmma.fence.sync.aligned")
    assert art.count("HGMMA", "sass") == 3 * (d // 16 + 1)
    assert art.count("STS.128", "sass") == (64 + 16) * d // 8 // 128


def test_a_paged_cache_has_its_own_extents_in_the_fake_arguments():
    """A paged k, v is (num_pages, page_size, h_kv, D): its first two modes are not q's batch
    and length. Tied to q's batch (as a contiguous cache is), every paged launch with a page
    count other than the batch was refused by TVM-FFI on the H200 ("Mismatched mK.shape[0]")."""
    from fa4_final.hopper.host import decode_fake_args

    q, k, v = decode_fake_args("bf16", 128, True, True, False)[:3]
    assert k.shape[0] is not q.shape[0] and k.shape[0] is v.shape[0]
    assert k.shape[1] is v.shape[1] and k.shape[2] is v.shape[2]
    q, k, _ = decode_fake_args("bf16", 128, False, True, False)[:3]
    assert k.shape[0] is q.shape[0]  # a contiguous cache: one entry per sequence


@pytest.mark.parametrize("name", ["n64s3", "n64s4", "n128s2", "n128s2b32", "n64s3b32"])
def test_decode_config_candidates_of_the_benchmark_compile_clean(name):
    """measure.decode's --variants (VARIANTS: tile_n, stages) at D = 128, contiguous with
    seqused_k and splits, as the benchmark launches them: no spill, no stack, no wgmma
    serialised by ptxas, the kernel's shared memory the config's formula; n64s3's 113 KB lets
    two CTAs share an SM (2 x (smem + 1 KB reserved) <= 228 KB, and the launch bound of two
    CTAs holds the registers at 128 a thread)."""
    from measure.decode import VARIANTS

    tile_n, stages, _, consumers, cluster, box = VARIANTS[name]
    assert consumers == cluster == 1
    cfg = HopperDecodeConfig(tile_n=tile_n, stages=stages, page_box=box)
    art = artifacts(decode_recipe(128, "bf16", False, False, True, True, config=cfg))["main"]
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    assert art.count("WARPGROUP.ARRIVE", "sass") == art.count("wgmma.fence.sync.aligned")
    assert art.registers <= DECODE_LAUNCH_REGISTERS, art.resources()
    assert art.count("HGMMA", "sass") == 3 * (128 // 16 + tile_n // 16)
    two_ctas = 2 * (cfg.smem_bytes(128) + 1024) <= 228 * 1024
    assert two_ctas == name.startswith("n64s3")
