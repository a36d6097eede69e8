"""fa4_final's public API on a CPU: return conventions, gradients (also of the returned lse),
FA4 keywords, dispatch of checked arguments to the kernel of a GPU, and the varlen fallback loop.

Kernels cannot run here: the custom ops get the test-only CPU reference
(tests/fa4_cpu_reference.py), and the layers below them get a fake backend that computes with it.
"""

import math
from dataclasses import replace

import pytest
import torch

from fa4_final import flash_attn_func, flash_attn_varlen_func
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime import checks, dispatch, prologue, varlen
from tests import fa4_cpu_reference as ref

BF16, FP16 = torch.bfloat16, torch.float16


def qkv(b=2, sq=40, sk=56, h=4, hk=2, d=64, dtype=BF16, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, s, n, d, generator=g).to(dtype) for s, n in ((sq, h), (sk, hk), (sk, hk))]
    return [t.requires_grad_(grad) for t in ts]


def reference64(q, k, v, causal=False, window=(None, None), scale=None):
    """float64 attention with autograd: (out, lse) in the package's layout."""
    return ref.attention_masked(q, k, v, causal, window, scale)


# ----------------------------------------------------------------------------------------------
# return conventions (FA4's: a pair, lse None unless asked for or needed)


def test_returns_out_and_no_lse_without_grad(cpu_kernels):
    q, k, v = qkv()
    out, lse = flash_attn_func(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype and lse is None


def test_lse_needed_for_grad_comes_back_detached(cpu_kernels):
    q, k, v = qkv(grad=True)
    out, lse = flash_attn_func(q, k, v)
    assert out.requires_grad and lse is not None and not lse.requires_grad
    assert lse.shape == (2, 4, 40) and lse.dtype == torch.float32


def test_return_lse_gives_a_differentiable_lse(cpu_kernels):
    q, k, v = qkv(grad=True)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert lse.requires_grad
    _, lse64 = reference64(q, k, v)
    torch.testing.assert_close(lse.double(), lse64, atol=2e-2, rtol=0)


@pytest.mark.parametrize("causal, window", [
    (False, (None, None)), (True, (None, None)), (False, (7, 3)), (True, (5, -1)),
    (False, (-1, 0)), (False, (-1, -1)), (False, (None, -3)), (False, (-4, None)),
    (False, (6, -2)), (True, (-2, None)), (False, (2, -5))])
def test_forward_negative_window_matches_float64(cpu_kernels, causal, window):
    """The public call's window reaches the ops as FA4 reads it (utils.window): a
    negative side is a bound, both negative no window, causal sets the right side to 0."""
    q, k, v = qkv(sq=40, sk=56)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    out64, lse64 = reference64(q, k, v, causal, window)
    torch.testing.assert_close(out.double(), out64, atol=2e-2, rtol=0)
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], lse64[finite], atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("return_lse", [False, True])
def test_gradients_match_float64(cpu_kernels, dtype, return_lse):
    """With return_lse the loss uses lse too: its gradient goes through the second backward
    (Note [Gradient of the returned lse]); without, lse is detached and adds nothing."""
    q, k, v = qkv(dtype=dtype, grad=True)
    w_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    w_lse = torch.randn(2, 4, 40, generator=torch.Generator().manual_seed(2))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=return_lse)
    loss = (out.float() * w_out).sum() + ((lse * w_lse).sum() if return_lse else 0.0)
    grads = torch.autograd.grad(loss, (q, k, v))
    out64, lse64 = reference64(q, k, v, causal=True)
    loss64 = (out64 * w_out.double()).sum()
    if return_lse:
        loss64 = loss64 + (lse64 * w_lse.double()).sum()
    grads64 = torch.autograd.grad(loss64, (q, k, v))
    for name, g, g64 in zip("qkv", grads, grads64):
        err = (g.double() - g64).abs().max().item()
        scale = g64.abs().max().item()
        # the CPU reference rounds each gradient once to the dtype: bf16 2^-8, fp16 2^-11
        assert err <= {BF16: 1e-2, FP16: 2e-3}[dtype] * scale, \
            f"d{name}: max error {err:.3g} vs max {scale:.3g}"


def test_gqa_and_mqa_gradients_fold_heads(cpu_kernels):
    for hk in (1, 2):
        q, k, v = qkv(h=4, hk=hk, dtype=FP16, grad=True)
        out, _ = flash_attn_func(q, k, v)
        dk = torch.autograd.grad(out.float().sum(), k)[0]
        assert dk.shape == k.shape


def test_a_cpu_tensor_without_a_kernel_names_the_supported_gpus():
    with pytest.raises(UnsupportedError, match=r"Hopper \(H100, H200, sm_90\); got a tensor on "
                                               r"cpu"):
        flash_attn_func(*qkv())


# ----------------------------------------------------------------------------------------------
# arguments


def test_arguments_after_v_are_keyword_only():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="positional"):
        flash_attn_func(q, k, v, 0.0, 0.125)  # FA2 order: dropout_p, softmax_scale


@pytest.mark.parametrize("kw", [dict(softcap=0.0), dict(qv=None), dict(num_splits=4),
                                dict(pack_gqa=True), dict(learnable_sink=None)])
def test_fa4_keywords_at_their_neutral_value_are_accepted(cpu_kernels, kw):
    flash_attn_func(*qkv(), **kw)


@pytest.mark.parametrize("kw, name", [(dict(score_mod=lambda *a: a[0]), "score_mod"),
                                      (dict(qv=torch.zeros(2, 40, 4, 64)), "qv")])
def test_fa4_features_not_implemented_are_refused(kw, name):
    with pytest.raises(UnsupportedError, match=f"FA4's {name}"):
        flash_attn_func(*qkv(), **kw)


@pytest.mark.parametrize("kw", [dict(softcap=30.0), dict(learnable_sink=torch.zeros(4))])
def test_softcap_and_learnable_sink_run(cpu_kernels, kw):
    """Both passed their GPU tests (Note [Pending features]): taken without FA4_FINAL_PENDING."""
    out, _ = flash_attn_func(*qkv(), **kw)
    assert out.shape == (2, 40, 4, 64)


def test_unknown_keyword():
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout'"):
        flash_attn_func(*qkv(), dropout=0.1)


@pytest.mark.parametrize("kw, error, match", [
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(deterministic=None), TypeError, "deterministic"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(window_size=3), ValueError, "pair"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
])
def test_bad_options(kw, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*qkv(), **kw)


@pytest.mark.parametrize("change, error, match", [
    (dict(dtype=torch.float32), TypeError, "torch.bfloat16, torch.float16"),
    (dict(d=80), ValueError, r"head_dim must be one of \(64, 96, 128, 192, 256\) .*got 80"),
    (dict(h=6, hk=4), ValueError, "multiple of"),
])
def test_bad_inputs(change, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*qkv(**change))


def test_strides_and_batches():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="contiguous"):
        flash_attn_func(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v)
    with pytest.raises(ValueError, match="batch"):
        flash_attn_func(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="same shape"):
        flash_attn_func(q, k, v[:, :10])
    with pytest.raises(UnsupportedError, match=r"v's head dim 32 differs.*takes dv != d"):
        flash_attn_func(q, k, v[..., :32].contiguous())


def test_a_16_byte_stride_rule_on_a_sliced_head_dim():
    big = torch.zeros(2, 40, 4, 72, dtype=BF16)  # rows of 144 B: a multiple of 16
    q = big[..., :64]
    assert checks.check_inputs(q, q, q, check_address=False)[-1] == 64
    odd = torch.zeros(2, 40, 4, 66, dtype=BF16)[..., :64]  # rows of 132 B: not
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        checks.check_inputs(odd, odd, odd, check_address=False)


# ----------------------------------------------------------------------------------------------
# dispatch of checked arguments (a fake backend stands in for the GPU)


class Recorder:
    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, out, lse, causal, scale, left, right, config):
        self.calls.append(dict(shape=tuple(q.shape), sk=k.shape[1], causal=causal, scale=scale,
                               left=left, right=right))
        o, l = ref.dense_forward(q, k, v, scale, causal, left, right)
        out.copy_(o)
        lse.copy_(l)

    def backward(self, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right, det,
                 config=None):
        self.calls.append(dict(backward=True, shape=tuple(q.shape), deterministic=det))
        for t, g in zip((dq, dk, dv),
                        ref.dense_backward(dout, q, k, v, out, lse, scale, causal, left, right)):
            t.copy_(g)


@pytest.fixture
def fake_gpu(monkeypatch):
    rec = Recorder()
    backend = replace(dispatch.BACKENDS[0], forward=rec.forward, backward=rec.backward,
                      varlen_forward=None, varlen_backward=None)  # the per-sequence loops
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    return rec


def test_forward_into_resolves_scale_and_window(fake_gpu):
    q, k, v = qkv()
    prologue.forward(q, k, v, window_size=(None, 0))
    prologue.forward(q, k, v, softmax_scale=0.5, window_size=(8, 2))
    assert fake_gpu.calls == [
        dict(shape=(2, 40, 4, 64), sk=56, causal=True, scale=64**-0.5, left=None, right=0),
        dict(shape=(2, 40, 4, 64), sk=56, causal=False, scale=0.5, left=8, right=2)]


def test_empty_problems_never_reach_the_kernel(fake_gpu):
    q, k, v = qkv(sk=0)
    out, lse = prologue.forward(q, k, v)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    q, k, v = qkv(sq=0)
    out, lse = prologue.forward(q, k, v)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in qkv(sq=0))
    prologue.backward_into(q, k, v, out, lse, torch.empty_like(q), dq, dk, dv)
    assert torch.all(dk == 0) and torch.all(dv == 0)
    assert fake_gpu.calls == []


def test_every_entry_point_resolves_the_call_once(fake_gpu):
    """One prologue (runtime.prologue.prepare) for the forward and the backward: the window
    normalised, the default scale, the deterministic flag passed on."""
    q, k, v = qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 4, 40)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    prologue.backward_into(q, k, v, out, lse, torch.empty_like(q), *grads, causal=True,
                           deterministic=True)
    assert fake_gpu.calls == [dict(backward=True, shape=(2, 40, 4, 64), deterministic=True)]
    p = prologue.prepare(64, False, None, (3, -1))
    assert (p.backend, p.causal, p.left, p.right, p.scale) == (None, False, 3, -1, 64**-0.5)


# ----------------------------------------------------------------------------------------------
# varlen


def packed(lens_q, lens_k, h=4, hk=2, d=64, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (torch.randn(n, heads, d, generator=g).to(dtype)
               for n, heads in ((tq, h), (tk, hk), (tk, hk)))
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1]


LENS = ([5, 0, 33, 17, 1], [9, 12, 0, 40, 3])  # an empty q, an empty k, short and long


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fallback_is_the_dense_kernel_per_sequence(fake_gpu, causal):
    q, k, v, cu_q, cu_k = packed(*LENS)
    seqused = torch.tensor([9, 12, 0, 31, 2], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"))
    varlen.varlen_forward_into(q, k, v, cu_q, cu_k, seqused, 33, 40, out, lse, causal=causal)
    want_out, want_lse = ref.varlen_forward(q, k, v, cu_q, cu_k, seqused, 64**-0.5, causal,
                                            None, None)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    # sequence 2 has no keys: zeros and -inf; sequence 1 has no rows: no launch
    assert torch.all(lse[:, 5:38] == -math.inf) and torch.all(out[5:38] == 0)
    assert [c["shape"][1] for c in fake_gpu.calls] == [5, 17, 1]
    assert [c["sk"] for c in fake_gpu.calls] == [9, 31, 2]


def test_forward_loop_is_the_per_sequence_reference(fake_gpu):
    q, k, v, cu_q, cu_k = packed(*LENS)
    out, lse = varlen.forward_loop(q, k, v, cu_q, cu_k, causal=True)
    want_out, want_lse = ref.varlen_forward(q, k, v, cu_q, cu_k, None, 64**-0.5, True, None,
                                            None)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert [c["shape"][1] for c in fake_gpu.calls] == [5, 17, 1]


def test_varlen_fallback_backward(fake_gpu):
    q, k, v, cu_q, cu_k = packed(*LENS, dtype=FP16)
    out, lse = ref.varlen_forward(q, k, v, cu_q, cu_k, None, 0.125, True, None, None)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(FP16)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    varlen.varlen_backward_into(q, k, v, out, lse, dout, *grads, cu_q, cu_k, None, None, None,
                                causal=True, softmax_scale=0.125)
    want = ref.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, None, 0.125, True, None,
                               None)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    assert all(c.get("backward") for c in fake_gpu.calls) and len(fake_gpu.calls) == 3


def test_varlen_api_matches_dense_per_sequence(cpu_kernels):
    q, k, v, cu_q, cu_k = packed(*LENS, dtype=FP16)
    q.requires_grad_(True)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      max_seqlen_q=33, max_seqlen_k=40, causal=True,
                                      return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for i in range(5):
        a, b = cu_q[i].item(), cu_q[i + 1].item()
        c, e = cu_k[i].item(), cu_k[i + 1].item()
        o, l = flash_attn_func(q[None, a:b], k[None, c:e], v[None, c:e], causal=True,
                               return_lse=True)
        assert torch.equal(out[a:b], o[0]) and torch.equal(lse[:, a:b], l[0])
    (out.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert torch.isfinite(q.grad).all()


def test_varlen_all_empty(fake_gpu):
    q, k, v, cu_q, cu_k = packed([0, 0], [0, 3])
    out, lse = torch.empty_like(q), torch.empty(4, 0)
    varlen.varlen_forward_into(q, k, v, cu_q, cu_k, None, None, None, out, lse)
    q, k, v, cu_q, cu_k = packed([], [])
    varlen.varlen_forward_into(q, k, v, cu_q, cu_k, None, None, None, torch.empty_like(q),
                               torch.empty(4, 0))
    assert fake_gpu.calls == []


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("change, error, match", [
    (dict(cu_seqlens_q=_cu(0, 5, 5, 38, 55, 56).long()), TypeError, "cu_seqlens_q must have "
                                                                     "dtype torch.int32"),
    (dict(cu_seqlens_k=_cu(0, 9, 21, 21, 61, 64)[None]), ValueError, "cu_seqlens_k must be 1-D"),
    (dict(cu_seqlens_k=_cu(0, 9, 21, 61, 64)), ValueError, "batch \\+ 1 long"),
    (dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q is required"),
    (dict(seqused_k=_cu(1, 2)), ValueError, "seqused_k must have 5 entries"),
    (dict(seqused_k=_cu(1, 2, 3, 4, 5).float()), TypeError, "seqused_k must have dtype"),
    (dict(cu_seqlens_q=_cu(0, 5, 5, 38, 55, 56).to("meta")), ValueError, "q's device"),
    (dict(max_seqlen_q=-3), ValueError, "max_seqlen_q must be an int >= 0"),
    (dict(q=torch.zeros(1, 56, 4, 64, dtype=BF16)), ValueError, "3-D"),
])
def test_varlen_metadata_checks(change, error, match):
    q, k, v, cu_q, cu_k = packed(*LENS)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=None,
                max_seqlen_k=None, seqused_k=None) | change
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**args)


@pytest.mark.parametrize("cu_q, cu_k, used, max_q, max_k, match", [
    ([1, 5, 56], [0, 9, 64], None, None, None, "cu_seqlens_q must start at 0"),
    ([0, 30, 20, 56], [0, 9, 20, 64], None, None, None, "non-decreasing.*entry 2 = 20 < entry "
                                                        "1 = 30"),
    ([0, 5, 50], [0, 9, 64], None, None, None, "last entry must equal the 56 rows of q"),
    ([0, 5, 56], [0, 9, 60], None, None, None, "64 rows of k and v"),
    ([0, 5, 56], [0, 9, 64], [9, 56], None, None, r"seqused_k\[1\] = 56 must be in \[0, 55\]"),
    ([0, 5, 56], [0, 9, 64], [-1, 3], None, None, r"seqused_k\[0\] = -1"),
    ([0, 5, 56], [0, 9, 64], None, 50, None, "max_seqlen_q = 50 is less than the longest "
                                             "sequence, 51"),
    ([0, 5, 56], [0, 9, 64], [9, 20], None, 19, "max_seqlen_k = 19"),
])
def test_varlen_value_checks(cu_q, cu_k, used, max_q, max_k, match):
    with pytest.raises(ValueError, match=match):
        checks.check_varlen_values(cu_q, cu_k, used, 56, 64, max_q, max_k)


def test_varlen_values_allow_empty_sequences():
    assert checks.check_varlen_values([0, 0, 3, 3], [0, 4, 4, 4], [2, 0, 0], 3, 4, 3, 2) == (
        [0, 3, 0], [2, 0, 0])


def test_varlen_value_checks_run_in_the_fallback(fake_gpu):
    q, k, v, cu_q, cu_k = packed(*LENS)
    bad = cu_k.clone()
    bad[2] = 30  # > cu_k[3] = 21
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        varlen.varlen_forward_into(q, k, v, cu_q, bad, None, None, None, torch.empty_like(q),
                                   torch.empty(4, q.shape[0]))
