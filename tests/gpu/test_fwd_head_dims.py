"""The Hopper forward at head dims 96, 192 and 256 and with dv != D (Note [Head dims] in
fa4_final.hopper.config), on an H100/H200, against float64 (utils.reference.
attention_reference_features).

The kernels are reached through fa4_final.hopper.host (forward_recipe with head_dim_v,
launch_forward / launch_varlen_forward) because the API still refuses these head dims: these
tests are what lifts that refusal. Outputs are filled with NaN first. The rule is the course's
(utils.checks.tolerance_check): max error <= 2 x PyTorch's own error in the input dtype +
rounding slack. The shapes: tails of every tile, one row, rows that see no key (causal,
seqlen_q > seqlen_k), GQA, and enough tiles that each persistent CTA computes several, so the
builds that write O over Q (D = 192 with dv = 128, D = dv = 256) reuse Q's buffer across
tiles, with every schedule of their defaults (split tail dense, dynamic causal, varlen).
Run (about 8 minutes, most of it compiling ~21 kernels):
    timeout 900 python -m pytest tests/gpu/test_fwd_head_dims.py -m gpu -x -v
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_softcap_sinks import _same_precision
from utils import checks
from utils.hardware import missing
from utils.reference import attention_reference_features, causal_mask

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]

BF16, FP16 = torch.bfloat16, torch.float16
NAMES = {BF16: "bf16", FP16: "fp16"}

# (batch, seqlen_q, seqlen_k, heads, heads_kv, D, dv, causal, dtype)
CASES = [
    (1, 1, 1, 1, 1, 96, 96, False, BF16),
    (2, 257, 513, 4, 2, 96, 96, True, FP16),
    (1, 1000, 100, 2, 2, 192, 128, True, BF16),  # rows that see no key
    (4, 2049, 2049, 16, 16, 192, 128, False, BF16),  # many tiles a CTA: O over Q reused
    (2, 2049, 2049, 16, 4, 192, 128, True, BF16),
    (2, 300, 77, 6, 1, 192, 192, True, BF16),
    (2, 1025, 1025, 8, 8, 192, 192, False, FP16),
    (1, 17, 17, 2, 1, 256, 256, False, BF16),
    (4, 2049, 2049, 16, 16, 256, 256, False, BF16),  # O over Q, split tail
    (2, 2049, 2049, 16, 8, 256, 256, True, FP16),  # O over Q, dynamic tiles
    (2, 129, 1000, 4, 4, 128, 64, False, BF16),
    (2, 1000, 1000, 4, 2, 256, 128, True, BF16),
    (1, 513, 257, 2, 2, 64, 256, True, BF16),
]


def _ids(case):
    b, sq, sk, h, hk, d, dv, causal, dt = case
    return (f"b{b}-{sq}x{sk}-h{h}/{hk}-d{d}/{dv}-{'causal' if causal else 'dense'}"
            f"-{NAMES[dt]}")


def _inputs(b, sq, sk, h, hk, d, dv, dtype, seed=None):
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to("cuda", dtype)
    v = torch.randn(b, sk, hk, dv, generator=g).to("cuda", dtype)
    return q, k, v, seed


def _plan(d, dv, causal, dtype, varlen=False, has_seqused_k=False):
    from fa4_final.hopper.host import forward_recipe
    from fa4_final.runtime.compile import compiled

    return compiled(forward_recipe, d, NAMES[dtype], causal, None, False, False, varlen,
                    has_seqused_k, "sm_90a", 0.0, None, dv)


def _check(label, q, k, v, causal, out, lse):
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = attention_reference_features(q, k, v, causal, scale)
    same_out, same_lse = _same_precision(q, k, v, causal, scale, 0.0, None)
    on_out = checks.tolerance_check(out, ref_out, same_out, "out")
    on_lse = checks.tolerance_check(lse, ref_lse, same_lse, "lse", extra_atol=checks.LSE_ATOL)
    sq, sk = q.shape[1], k.shape[1]
    empty = ~causal_mask(sq, sk, q.device).any(dim=1) if causal else \
        torch.zeros(sq, dtype=torch.bool, device=q.device)
    empty_ok = bool((out[:, empty] == 0).all()) and bool(torch.isneginf(lse[:, :, empty]).all())
    assert on_out.passed and on_lse.passed and empty_ok, \
        f"{label}\n{on_out}\n{on_lse}\nempty rows out = 0, lse = -inf: {empty_ok}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_matches_float64(case):
    from fa4_final.hopper.host import launch_forward

    b, sq, sk, h, hk, d, dv, causal, dtype = case
    q, k, v, seed = _inputs(b, sq, sk, h, hk, d, dv, dtype)
    out = checks.poisoned_empty(b, sq, h, dv, dtype=dtype, device="cuda")
    lse = checks.poisoned_empty(b, h, sq, dtype=torch.float32, device="cuda")
    plan = _plan(d, dv, causal, dtype)
    launch_forward(plan, q, k, v, out, lse, causal, d ** -0.5, None, 0 if causal else None)
    label = f"{_ids(case)} seed={seed} config={plan.config}"
    checks.wait_for_gpu(label)
    _check(label, q, k, v, causal, out, lse)


# (192, 192) and (128, 192): v head dim 192 (what lifted the varlen_row_store row, on an H200)
@pytest.mark.parametrize("d, dv", [(192, 128), (256, 256), (96, 96), (192, 192), (128, 192)],
                         ids=str)
def test_varlen_forward_matches_float64_per_sequence(d, dv):
    """Packed sequences of 37, 1300 and 1 queries over 1300, 77 and 5 keys, causal, with
    seqused_k cutting the first sequence's keys to 900; checked sequence by sequence (the
    partial last tile of a sequence is stored row by row: Note [Varlen epilogue])."""
    from fa4_final.hopper.host import launch_varlen_forward

    lens_q, lens_k, used_k, h, hk = [37, 1300, 1], [1300, 77, 5], [900, 77, 5], 4, 2
    plan = _plan(d, dv, True, BF16, varlen=True, has_seqused_k=True)
    parts = [_inputs(1, sq, sk, h, hk, d, dv, BF16) for sq, sk in zip(lens_q, lens_k)]
    q, k, v = (torch.cat([p[i][0] for p in parts]) for i in range(3))
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)),  # noqa: E731
                                   dtype=torch.int32, device="cuda")
    out = checks.poisoned_empty(q.shape[0], h, dv, dtype=BF16, device="cuda")
    lse = checks.poisoned_empty(h, q.shape[0], dtype=torch.float32, device="cuda")
    launch_varlen_forward(plan, q, k, v, cu(lens_q), cu(lens_k),
                          torch.tensor(used_k, dtype=torch.int32, device="cuda"), max(lens_q),
                          max(lens_k), out, lse, True, d ** -0.5, None, 0)
    checks.wait_for_gpu(f"varlen d{d}/{dv}")
    oq = ok_ = 0
    for i, (sq, sk, uk) in enumerate(zip(lens_q, lens_k, used_k)):
        _check(f"varlen d{d}/{dv} sequence {i} ({sq} x {uk} of {sk}) seeds "
               f"{[p[3] for p in parts]}", q[None, oq:oq + sq], k[None, ok_:ok_ + uk],
               v[None, ok_:ok_ + uk], True, out[None, oq:oq + sq], lse[None, :, oq:oq + sq])
        oq, ok_ = oq + sq, ok_ + sk


# FA4's own sm90 tiles (tile_n 80 at D = 256, 112 at D = dv = 192) and one more off the 64-grid:
# P converted pair by pair (Note [Pairwise conversion] in fa4_final.common.fragments)
PAIRWISE = [(256, 256, 80, False), (256, 256, 80, True), (192, 192, 112, False),
            (128, 128, 80, True), (128, 128, 48, False)]


@pytest.mark.parametrize("d, dv, tile_n, causal", PAIRWISE, ids=str)
def test_pairwise_p_tiles_match_float64(d, dv, tile_n, causal):
    from dataclasses import replace

    from fa4_final.common.constants import SM90_SMEM_BYTES
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import forward_recipe, launch_forward
    from fa4_final.runtime.compile import compiled

    cfg = replace(hopper_fwd_default(d, causal, head_dim_v=dv), tile_n=tile_n, stages_k=2,
                  stages_v=2)
    if cfg.smem_bytes(d, head_dim_v=dv) > SM90_SMEM_BYTES:
        cfg = replace(cfg, separate_o=False)
    b, sq, sk, h, hk = 2, 1031, 1031 if not causal else 2049, 8, 4
    q, k, v, seed = _inputs(b, sq, sk, h, hk, d, dv, BF16)
    out = checks.poisoned_empty(b, sq, h, dv, dtype=BF16, device="cuda")
    lse = checks.poisoned_empty(b, h, sq, dtype=torch.float32, device="cuda")
    plan = compiled(forward_recipe, d, "bf16", causal, cfg, False, False, False, False,
                    "sm_90a", 0.0, None, dv)
    launch_forward(plan, q, k, v, out, lse, causal, d ** -0.5, None, 0 if causal else None)
    label = f"d{d}/{dv} tile_n {tile_n} causal={causal} seed={seed} config={cfg}"
    checks.wait_for_gpu(label)
    _check(label, q, k, v, causal, out, lse)
