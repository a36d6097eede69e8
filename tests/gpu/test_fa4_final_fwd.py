"""fa4_final's Hopper forward on an H100/H200 against the float64 reference (chapter 08).

Every case draws fresh random inputs, fills the outputs with NaN first and compares out and lse
with float64 (utils.checks.compare_outputs: the course's tolerance rule, empty rows exactly 0 and
-inf). A broken mbarrier protocol hangs instead of failing: utils.checks.wait_for_gpu exits with
a message after a deadline. Run: timeout 600 python -m pytest tests/gpu/test_fa4_final_fwd.py
"""

import pytest
import torch

from measure import fwd_checks as ch08_checks
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


@pytest.mark.parametrize("case, config", ch08_checks.all_cases(),
                         ids=lambda x: str(x)[:60] if x is not None else "default")
def test_forward_matches_float64(case, config):
    ok, line = ch08_checks.check_case(*case, config=config)
    assert ok, line


def test_registry_signature():
    from fa4_final.api.interface import attention
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(1, 300, 2, 128, device="cuda")
    out, lse = attention(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == (1, 2, 300) and lse.dtype == torch.float32


def test_timeline_records_every_phase():
    from fa4_final.common.timeline import Mark
    from fa4_final.runtime.prologue import forward_timeline
    from utils.reference import random_qkv

    q, k, v, _ = random_qkv(1, 4096, 2, 128, device="cuda")
    tl = forward_timeline(q, k, v)
    consumer = tl[1]  # warpgroup 0 of the consumers, steps of CTA 0's first tile
    steps = int((consumer[:, Mark.P_READY] > 0).sum())
    assert steps >= 16, tl[:, :4]
    stamps = consumer[:steps]
    assert bool((stamps[:, 1:] >= stamps[:, :-1]).all())  # marks in order inside a step
    assert bool((stamps[1:, Mark.WAIT] >= stamps[:-1, Mark.P_READY]).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_d64_default_rescales_on_the_adversarial_input(causal, dtype):
    """The D = 64 default multiplies O only in steps where a row's max grew by more than tau
    (tau = 0: moved at all): on chapter 07's input whose max grows by tau + 1 at every KV tile
    (in the kernel's reverse order), every warp votes to rescale at every tile, and out and lse
    must still match float64."""
    from fa4_final.hopper.config import hopper_fwd_default
    from solutions import ch07_rescaling as ch07
    from utils import checks

    cfg = hopper_fwd_default(64, causal)
    assert cfg.rescale_skip_unchanged or cfg.rescale_threshold > 0
    q, k, v = ch07.pattern_qkv("adversarial", 1031, 1031, 2, 64, tile_n=cfg.tile_n,
                               tau=cfg.rescale_threshold, kv_order="reverse")
    q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
    b, sq, h, d = q.shape
    out = checks.poisoned_empty(b, sq, h, d, dtype=dtype, device="cuda")
    lse = checks.poisoned_empty(b, h, sq, dtype=torch.float32, device="cuda")
    label = f"adversarial D=64 default causal={causal} {dtype}"
    ch08_checks.run_into(q, k, v, out, lse, causal, None, cfg, None)
    checks.wait_for_gpu(label)
    ok, line = checks.compare_outputs(q, k, v, out, lse, causal, label=label)
    assert ok, line


def test_dynamic_tiles_counter_survives_streams_and_graph_replays():
    """Note [Dynamic tiles]: the causal default takes its tiles from a counter that each
    launch's last fetch sets back to zero. Launches on two streams at once each get their own
    counter, and a CUDA graph replayed many times zeroes its own: every result must equal the
    first one bit for bit (the same tiles, computed by whichever CTA, give the same bits)."""
    from fa4_final.api.interface import attention
    from fa4_final.hopper.config import hopper_fwd_default
    from utils import checks
    from utils.reference import random_qkv

    assert hopper_fwd_default(64, True).schedules_dynamically
    q, k, v, _ = random_qkv(2, 3000, 8, 64, dtype=torch.bfloat16, device="cuda")
    want, want_lse = attention(q, k, v, causal=True)
    assert not torch.isnan(want).any()
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    torch.cuda.synchronize()
    for _ in range(5):  # interleaved launches on two streams
        for s in streams:
            with torch.cuda.stream(s):
                outs.append(attention(q, k, v, causal=True))
    torch.cuda.synchronize()
    checks.wait_for_gpu("two streams")
    for out, lse in outs:
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention(q, k, v, causal=True)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=side):
            g_out, g_lse = attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(4):
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g_out, want) and torch.equal(g_lse, want_lse)
    out, lse = attention(q, k, v, causal=True)  # and the eager path after the graph
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
