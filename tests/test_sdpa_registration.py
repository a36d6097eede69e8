"""fa4_final.api.sdpa, FA4's private contract behind PyTorch's SDPA, on the CPU.

- torch's registration accepts the module (its import check), and every keyword torch's FA4
  glue passes, in torch 2.10 to 2.13 (tests/data/sdpa_torch_keywords.json) and live in the
  installed torch, binds to our signatures;
- our signatures are FA4 4.0.0b36's: names, order, defaults (tests/data/fa4_private_signatures.json,
  checked against FA4's source where /tmp/fa4src holds it); the return is the pair torch unpacks;
- every FA4 parameter is run, a kernel knob, or refused by name;
- SDPA's own ops (aten._scaled_dot_product_flash_attention with its autograd, varlen_attn) on
  CPU tensors, through the dispatcher, torch's FA4 glue (registered for the CPU key here, its
  CUDA-only checks bypassed), this module and the runtime, with the kernels replaced at the
  runtime's boundary by float64 attention: SDPA's math backend's result.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fa4_final.api import sdpa
from fa4_final.common.errors import UnsupportedError
from fa4_final.runtime import dispatch, prologue
from tests.fa4_cpu_reference import visible
from utils.checks import error_report, rounding_atol

fa4 = pytest.importorskip("torch.nn.attention._fa4", reason="this torch has no FA4 registration")

DATA = Path(__file__).resolve().parent / "data"
FA4_SOURCE = Path("/tmp/fa4src/x/flash_attn/cute/interface.py")
FUNCS = {"_flash_attn_fwd": sdpa._flash_attn_fwd, "_flash_attn_bwd": sdpa._flash_attn_bwd}
BF16, FP16 = torch.bfloat16, torch.float16


def fa4_params() -> dict:
    return json.loads((DATA / "fa4_private_signatures.json").read_text())["functions"]


def torch_keywords() -> dict:
    return json.loads((DATA / "sdpa_torch_keywords.json").read_text())["versions"]


def torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


# ----------------------------------------------------------------------------------------------
# the kernels, replaced at the runtime's boundary by float64 attention


def _expand(t, h):
    """(b, s, hk, d) -> (b, h, s, d) float64, each k/v head repeated over its group."""
    return t.double().transpose(1, 2).repeat_interleave(h // t.shape[2], dim=1)


def _probs64(q, k, scale, causal, left, right, lse=None):
    s = (q.double().transpose(1, 2) @ _expand(k, q.shape[2]).transpose(-1, -2)) * scale
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, left, right), -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.double()[..., None]).nan_to_num(0.0), lse


class Float64Kernels:
    """The Backend's forward and backward (the runtime's boundary) in float64, the backward as
    the kernels do it: P from q, k and lse; D = rowsum(dO * O), O used for nothing else; a dlse
    folded into D (D - dlse, as bwd_pre's has_dlse builds; lse_fold)."""

    def __init__(self):
        self.calls = []
        self.dlse_given = []  # per backward call: whether it was given a dlse

    def forward(self, q, k, v, out, lse, causal, scale, left, right, config=None):
        self.calls.append(("forward", tuple(q.shape), causal, scale, left, right))
        p, row_lse = _probs64(q, k, scale, causal, left, right)
        out.copy_((p @ _expand(v, q.shape[2])).transpose(1, 2))
        lse.copy_(row_lse)

    def backward(self, q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
                 deterministic=False, config=None, dlse=None):
        self.calls.append(("backward", tuple(q.shape), causal, scale, left, right,
                           deterministic))
        self.dlse_given.append(dlse is not None)
        h, hk = q.shape[2], k.shape[2]
        p, _ = _probs64(q, k, scale, causal, left, right, lse)
        do, o = (t.double().transpose(1, 2) for t in (dout, out))
        delta = (do * o).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse.double()[..., None]
        ds = p * (do @ _expand(v, h).transpose(-1, -2) - delta)

        def fold(t):  # (b, h, sk, d) -> (b, sk, hk, d): GQA sums each group's heads
            b, _, sk, d = t.shape
            return t.reshape(b, hk, h // hk, sk, d).sum(2).transpose(1, 2)

        dq.copy_((ds @ _expand(k, h) * scale).transpose(1, 2))
        dk.copy_(fold(ds.transpose(-1, -2) @ q.double().transpose(1, 2) * scale))
        dv.copy_(fold(p.transpose(-1, -2) @ do))


@pytest.fixture
def kernels(monkeypatch):
    """The runtime's backend with float64 kernels (varlen through the per-sequence loops)."""
    k = Float64Kernels()
    backend = replace(dispatch.BACKENDS[0], forward=k.forward, backward=k.backward,
                      varlen_forward=None, varlen_backward=None)
    monkeypatch.setattr(prologue, "backend_for", lambda device: backend)
    return k


GLUE_OPS = {  # aten op -> torch's FA4 kernel for it (registered for CUDA by torch)
    "_scaled_dot_product_flash_attention": "_fa4_scaled_dot_product_flash_attention_forward_impl",
    "_scaled_dot_product_flash_attention_backward":
        "_fa4_scaled_dot_product_flash_attention_backward_impl",
    "_flash_attention_forward": "_fa4_flash_attention_forward_impl",
    "_flash_attention_backward": "_fa4_flash_attention_backward_impl",
}


@pytest.fixture
def sdpa_on_cpu(monkeypatch, kernels):
    """torch's FA4 kernels registered for the CPU key with this module as the FA4 module, their
    CUDA-only support checks bypassed: SDPA's ops on CPU tensors reach the runtime."""
    monkeypatch.setattr(fa4, "_FA4_MODULE_PATH", sdpa.SDPA_MODULE)
    monkeypatch.setattr(fa4, "_fa4_forward_support_error", lambda *a, **kw: None)
    monkeypatch.setattr(fa4, "_fa4_backward_support_error", lambda *a, **kw: None)
    lib = torch.library.Library("aten", "IMPL", "CPU")  # noqa: TOR901
    for op, impl in GLUE_OPS.items():
        lib.impl(op, getattr(fa4, impl), "CPU")
    yield kernels
    lib._destroy()


# ----------------------------------------------------------------------------------------------
# the contract


def test_torchs_import_check_accepts_the_module():
    assert fa4._fa4_import_module(sdpa.SDPA_MODULE) is sdpa


def test_signatures_are_fa4s():
    """Names, order and defaults of FA4 4.0.0b36's _flash_attn_fwd and _flash_attn_bwd, all
    positional-or-keyword as there."""
    stored = fa4_params()
    if FA4_SOURCE.exists():  # the stored copy still says what FA4's source says
        tree = ast.parse(FA4_SOURCE.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in stored:
                args = node.args.posonlyargs + node.args.args
                defaults = [None] * (len(args) - len(node.args.defaults)) + \
                    [ast.unparse(d) for d in node.args.defaults]
                assert [[a.arg, d] for a, d in zip(args, defaults)] == \
                    stored[node.name]["params"], node.name
    for name, func in FUNCS.items():
        ours = inspect.signature(func).parameters.values()
        want = stored[name]["params"]
        assert [p.name for p in ours] == [n for n, _ in want], name
        for p, (n, default) in zip(ours, want):
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, n
            if default is None:
                assert p.default is inspect.Parameter.empty, n
            else:
                value = ast.literal_eval(default)
                assert p.default == value and type(p.default) is type(value), (n, p.default)


def test_every_fa4_parameter_is_run_a_knob_or_refused():
    neutral = sdpa._PRIVATE_NEUTRAL
    for name, supported in (("_flash_attn_fwd", sdpa.SUPPORTED_FWD),
                            ("_flash_attn_bwd", sdpa.SUPPORTED_BWD)):
        params = [n for n, _ in fa4_params()[name]["params"]]
        unplaced = [n for n in params
                    if n not in supported and n not in sdpa._FA4_KNOBS and n not in neutral]
        assert not unplaced, f"{name}: neither run, a knob nor refused: {unplaced}"
        assert not set(supported) & (set(sdpa._FA4_KNOBS) | set(neutral)), name
        assert set(supported) <= set(params), name


@pytest.mark.parametrize("version", sorted(torch_keywords()))
def test_every_keyword_torch_passes_binds(version):
    """What torch 2.10-2.13's glue passes (recorded from each wheel's _fa4.py) binds."""
    q = torch.zeros(1)
    for path, kw in torch_keywords()[version].items():
        func = sdpa._flash_attn_bwd if path.endswith("backward") else sdpa._flash_attn_fwd
        positional = (q,) * (6 if func is sdpa._flash_attn_bwd else 3)
        inspect.signature(func).bind(*positional, **kw)


def test_the_installed_torch_passes_what_the_stored_table_says(monkeypatch):
    """A recording module as the registered FA4 module: torch's glue (support checks bypassed)
    passes exactly the stored keywords of its version; each binds to our signatures."""
    seen = {}

    def record(kind):
        def fn(*args, **kw):
            seen.setdefault(kind, []).append({n: "Tensor" if isinstance(x, torch.Tensor) else x
                                              for n, x in kw.items()})
            inspect.signature(FUNCS[f"_flash_attn_{kind}"]).bind(*args, **kw)
            q = args[0]
            if kind == "bwd":
                return tuple(torch.zeros_like(t) for t in args[:3])
            lse = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2],
                                                                  q.shape[1])
            return kw.get("out") if kw.get("out") is not None else torch.zeros_like(q), \
                torch.zeros(lse)
        return fn

    recorder = types.ModuleType("sdpa_keyword_recorder")
    recorder._flash_attn_fwd, recorder._flash_attn_bwd = record("fwd"), record("bwd")
    monkeypatch.setitem(sys.modules, recorder.__name__, recorder)
    monkeypatch.setattr(fa4, "_FA4_MODULE_PATH", recorder.__name__)
    monkeypatch.setattr(fa4, "_fa4_forward_support_error", lambda *a, **kw: None)
    monkeypatch.setattr(fa4, "_fa4_backward_support_error", lambda *a, **kw: None)
    b, h, s, d = 2, 4, 8, 64
    x = torch.zeros(b, h, s, d, dtype=BF16)
    seed, offset = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    fa4._fa4_scaled_dot_product_flash_attention_forward_impl(x, x, x, 0.0, True, False)
    fa4._fa4_scaled_dot_product_flash_attention_backward_impl(
        x, x, x, x, x, torch.zeros(b, h, s), None, None, s, s, 0.0, True, seed, offset)
    xp, cu = torch.zeros(10, h, d, dtype=BF16), torch.tensor([0, 3, 10], dtype=torch.int32)
    window = dict(window_size_left=-1, window_size_right=0)
    fa4._fa4_flash_attention_forward_impl(xp, xp, xp, cu, cu, 7, 7, 0.0, True, False, **window)
    fa4._fa4_flash_attention_backward_impl(xp, xp, xp, xp, xp, torch.zeros(h, 10), cu, cu, 7, 7,
                                           0.0, True, seed, torch.empty(0), **window)
    got = dict(zip(("sdpa_forward", "varlen_forward"), seen["fwd"])) | \
        dict(zip(("sdpa_backward", "varlen_backward"), seen["bwd"]))
    stored = torch_keywords().get(torch_minor())
    if stored is None:
        pytest.skip(f"no stored row for torch {torch_minor()}: add it to "
                    f"sdpa_torch_keywords.json ({got})")
    assert got == stored


def test_the_forward_returns_the_pair_torch_unpacks(sdpa_on_cpu, monkeypatch):
    """torch's glue reads ``out, lse = module._flash_attn_fwd(...)``: FA4 4.0.0b36's five
    values (out, lse and three of its sparse-gather backward) fail there; our pair runs."""
    assert fa4_params()["_flash_attn_fwd"]["returns"].count(",") == 4  # FA4's five
    five = types.ModuleType("sdpa_five_values")
    five._flash_attn_bwd = sdpa._flash_attn_bwd
    five._flash_attn_fwd = lambda *a, **kw: (*sdpa._flash_attn_fwd(*a, **kw), None, None, None)
    monkeypatch.setitem(sys.modules, five.__name__, five)
    q = torch.randn(1, 2, 16, 64).to(BF16)
    assert len(torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)) == 9
    monkeypatch.setattr(fa4, "_FA4_MODULE_PATH", five.__name__)
    with pytest.raises(ValueError, match="too many values to unpack"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)


# ----------------------------------------------------------------------------------------------
# refusals, by name


def _non_neutral(name: str, default):
    if isinstance(default, bool):
        return not default
    return {"_arch": 90}.get(name, torch.zeros(1))


def _refused():
    neutral = sdpa._PRIVATE_NEUTRAL
    for func, supported in (("_flash_attn_fwd", sdpa.SUPPORTED_FWD),
                            ("_flash_attn_bwd", sdpa.SUPPORTED_BWD)):
        for name, default in fa4_params()[func]["params"]:
            if name in neutral and name not in supported and name not in sdpa._FA4_KNOBS:
                yield func, name, _non_neutral(name, ast.literal_eval(default))


@pytest.mark.parametrize("func,name,value", list(_refused()), ids=lambda x: str(x)[:24])
def test_each_feature_fa4_final_lacks_is_refused_by_name(func, name, value):
    x = torch.zeros(1, 8, 2, 64, dtype=BF16)
    args = (x,) * (6 if func == "_flash_attn_bwd" else 3)
    with pytest.raises(UnsupportedError, match=name):
        FUNCS[func](*args, **{name: value})


@pytest.mark.parametrize("func", list(FUNCS))
def test_the_neutral_values_are_not_refused(func, kernels):
    """FA4's off values (softcap 0.0, the False flags) and its knobs at any value run."""
    x = torch.randn(1, 8, 2, 64).to(BF16)
    knobs = dict(num_splits=3, pack_gqa=True) if func == "_flash_attn_fwd" else \
        dict(m_block_size=128, num_threads=384, SdP_swapAB=True, AtomLayoutMdQ=1)
    neutral = {n: v for n, v in sdpa._PRIVATE_NEUTRAL.items()
               if n in inspect.signature(FUNCS[func]).parameters}
    if func == "_flash_attn_fwd":
        plain = sdpa._flash_attn_fwd(x, x, x, return_lse=True)
        got = sdpa._flash_attn_fwd(x, x, x, return_lse=True, **neutral, **knobs)
    else:
        out, lse = sdpa._flash_attn_fwd(x, x, x, return_lse=True)
        plain = sdpa._flash_attn_bwd(x, x, x, out, x, lse)
        got = sdpa._flash_attn_bwd(x, x, x, out, x, lse, **neutral, **knobs)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_page_table_softcap_and_sink_are_run_not_refused():
    """They left the gate of pending features (their GPU tests passed on an H100): checked
    (a page of 8 rows named), then on to the device check on a CPU, no FA4_FINAL_PENDING."""
    names = set(sdpa.SUPPORTED_FWD)
    assert {"page_table", "softcap", "learnable_sink"} <= names
    assert {"softcap", "learnable_sink"} <= set(sdpa.SUPPORTED_BWD)
    assert not hasattr(sdpa, "PENDING_FWD") and not hasattr(sdpa, "PENDING_BWD")
    q = torch.zeros(1, 1, 2, 64, dtype=BF16)
    table, used = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    small = torch.zeros(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="page_size"):
        sdpa._flash_attn_fwd(q, small, small, page_table=table, seqused_k=used)
    kv = torch.zeros(1, 16, 2, 64, dtype=BF16)
    for kw in (dict(page_table=table, seqused_k=used), dict(softcap=0.5),
               dict(learnable_sink=torch.zeros(2))):
        with pytest.raises(UnsupportedError, match="runs on CUDA GPUs"):
            sdpa._flash_attn_fwd(q, kv, kv, **kw)


@pytest.mark.parametrize("window,name", [((-1, 0), "window_size_left=-1"),
                                         ((4, -1), "window_size_right=-1"),
                                         ((None, -2), "window_size_right=-2")])
def test_a_negative_window_side_beside_another_is_ambiguous(window, name):
    x = torch.zeros(1, 8, 2, 64, dtype=BF16)
    with pytest.raises(UnsupportedError, match=f"{name}.*ambiguous"):
        sdpa._flash_attn_fwd(x, x, x, window_size_left=window[0], window_size_right=window[1])
    with pytest.raises(UnsupportedError, match=f"{name}.*ambiguous"):
        sdpa._flash_attn_bwd(x, x, x, x, x, torch.zeros(1, 2, 8), window_size_left=window[0],
                             window_size_right=window[1])


def test_layouts_fa4_final_does_not_run_are_refused_by_name():
    x, cu = torch.zeros(8, 2, 64, dtype=BF16), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="cu_seqlens_q without cu_seqlens_k"):
        sdpa._flash_attn_fwd(x, x, x, cu_seqlens_q=cu)
    with pytest.raises(UnsupportedError, match="cu_seqlens_k without cu_seqlens_q"):
        sdpa._flash_attn_bwd(x, x, x, x, x, torch.zeros(2, 8), cu_seqlens_k=cu)
    with pytest.raises(UnsupportedError, match="seqused_k on a dense"):
        sdpa._flash_attn_fwd(x[None], x[None], x[None], seqused_k=cu[1:])


# ----------------------------------------------------------------------------------------------
# the module's own arguments, on the float64 kernels


def rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_window_sides_mean_what_fa4_means(kernels):
    q, k = rand(1, 40, 2, 64), rand(1, 56, 2, 64, seed=1)
    for left, right, causal, want in [(None, None, True, (True, None, 0)),
                                      (8, 2, False, (False, 8, 2)),
                                      (8, 2, True, (True, 8, 0)),
                                      (-1, -1, False, (False, None, None)),
                                      (None, 0, False, (True, None, 0))]:
        sdpa._flash_attn_fwd(q, k, k, causal=causal, window_size_left=left,
                             window_size_right=right)
        assert kernels.calls[-1][2] == want[0] and kernels.calls[-1][4:] == want[1:]


def test_out_and_lse_are_written_into_and_lse_returned_as_fa4_does(kernels):
    q, k = rand(2, 40, 4, 64), rand(2, 56, 2, 64, seed=1)
    out, lse = sdpa._flash_attn_fwd(q, k, k)
    assert lse is None  # neither return_lse nor a gradient asked for it
    assert sdpa._flash_attn_fwd(q.requires_grad_(), k, k)[1].shape == (2, 4, 40)
    q.requires_grad_(False)
    base = torch.full((2, 4, 40, 64), math.nan, dtype=BF16)  # a buffer in SDPA's layout
    given, given_lse = base.transpose(1, 2), torch.full((2, 4, 40), math.nan)
    got, got_lse = sdpa._flash_attn_fwd(q, k, k, out=given, lse=given_lse)
    assert got is given and got_lse is given_lse
    assert torch.equal(base.transpose(1, 2), out)
    odd = torch.full((2, 40, 4, 66), math.nan, dtype=BF16)[..., :64]  # not writable by TMA
    assert sdpa._flash_attn_fwd(q, k, k, out=odd)[0] is odd and torch.equal(odd, out)


@pytest.mark.parametrize("probe", [False, True], ids=["one_call", "probe_path"])
def test_dlse_adds_the_gradient_of_the_returned_lse(kernels, monkeypatch, probe):
    """By default (lse_fold left the gate) one backward call, given dlse; with the lse_fold row
    put back in PENDING, Note [Gradient of the returned lse]'s two calls, none given a dlse.
    Both against float64 autograd."""
    from fa4_final.runtime import pending

    monkeypatch.delenv(pending.ENV, raising=False)
    if probe:
        monkeypatch.setitem(pending.PENDING, "lse_fold", "put back by the test: the probe")
    q, k, v = (rand(1, 24, 2, 64, dtype=torch.float16, seed=s) for s in range(3))
    dout, dlse = rand(1, 24, 2, 64, dtype=torch.float16, seed=3), rand(1, 2, 24, seed=4).float()
    out, lse = sdpa._flash_attn_fwd(q, k, v, causal=True, return_lse=True)
    got = sdpa._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, dlse=dlse)
    assert kernels.dlse_given == ([False, False] if probe else [True])
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    p, lse64 = _probs64(q64, k64, 64**-0.5, True, None, 0)
    out64 = (p @ _expand(v64, 2)).transpose(1, 2)
    torch.autograd.backward((out64, lse64), (dout.double(), dlse.double()))
    for name, g, want in zip("qkv", got, (q64.grad, k64.grad, v64.grad)):
        assert (g.double() - want).abs().max() <= 4 * rounding_atol(want, g.dtype) + 2e-3, name


def test_preallocated_gradients_are_written_into(kernels):
    q, k = rand(1, 24, 2, 64), rand(1, 30, 1, 64, seed=1)
    out, lse = sdpa._flash_attn_fwd(q, k, k, return_lse=True)
    want = sdpa._flash_attn_bwd(q, k, k, out, q, lse)
    given = [torch.full_like(t, math.nan) for t in (q, k, k)]
    got = sdpa._flash_attn_bwd(q, k, k, out, q, lse, dq=given[0], dk=given[1], dv=given[2],
                               deterministic=True)
    assert all(a is b for a, b in zip(got, given))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert kernels.calls[-1][-1] is True  # deterministic passed on


# ----------------------------------------------------------------------------------------------
# SDPA's own ops on the CPU, through torch's glue, this module and the runtime


def sdpa_math(q, k, v, causal, scale, dtype=torch.float64):
    """SDPA's math backend in ``dtype`` on (b, h, s, d) tensors, with GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype),
                                              is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def assert_close_to_float64(got, want, name):
    """The float64 kernels round twice on the way: the saved out (fp16/bf16, as SDPA hands it
    back to the backward, in D = rowsum(dO * O)) and the gradient itself. A transposed or
    misplaced tensor in the glue is off by the values themselves."""
    report = error_report(got, want, name)
    limit = 2 * rounding_atol(want, got.dtype) + 1e-6
    assert report.nan_count == 0 and report.max_abs <= limit, f"{report}; limit {limit:.3e}"


def projected(b, s, h, d, dtype, seed):
    """(b, h, s, d) as a model makes it: a (b, s, h * d) projection viewed and transposed."""
    return rand(b, s, h * d, dtype=dtype, seed=seed).view(b, s, h, d).transpose(1, 2)


@pytest.mark.parametrize("b,s,h,hk,d,causal,dtype,scale", [
    (2, 77, 4, 4, 64, False, BF16, None),
    (1, 130, 8, 2, 128, True, BF16, None),
    (3, 33, 6, 1, 64, True, FP16, 0.3),
])
def test_sdpas_flash_op_through_fa4_final_matches_the_math_backend(sdpa_on_cpu, b, s, h, hk, d,
                                                                   causal, dtype, scale):
    q = projected(b, s, h, d, dtype, 0).requires_grad_()
    k, v = (projected(b, s, hk, d, dtype, i).requires_grad_() for i in (1, 2))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                             scale=scale)
    out, lse = res[0], res[1]
    assert out.shape == q.shape and lse.shape == (b, h, s) and lse.dtype == torch.float32
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = sdpa_math(*leaves, causal, scale)
    assert (out.double() - want).abs().max() <= rounding_atol(want, dtype) + 1e-9
    scale_ = d**-0.5 if scale is None else scale
    s64 = (q.double() @ k.double().repeat_interleave(h // hk, 1).transpose(-1, -2)) * scale_
    if causal:
        s64 = s64.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
    assert (lse.double() - torch.logsumexp(s64, -1)).abs().max() <= 1e-5
    dout = projected(b, s, h, d, dtype, 3)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    for name, g, w in zip("qkv", grads, want_grads):
        assert_close_to_float64(g, w, f"d{name}")
    assert [c[0] for c in sdpa_on_cpu.calls] == ["forward", "backward"]


def test_varlen_attn_through_fa4_final_matches_the_math_backend(sdpa_on_cpu):
    """torch.nn.attention.varlen.varlen_attn on packed CPU tensors; causal where this torch
    hands FA4 an unambiguous window (2.12 on), the ambiguity refused by name before that."""
    from torch.nn.attention.varlen import varlen_attn

    lens, h, d = [17, 1, 40], 4, 64
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (rand(sum(lens), h, d, seed=i).requires_grad_() for i in range(3))
    converts = hasattr(fa4, "_aten_to_fa4_window_size")
    window = (-1, 0) if converts else (-1, -1)
    out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window)
    dout = rand(sum(lens), h, d, seed=3)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    causal = window == (-1, 0)
    for i in range(len(lens)):
        rows = slice(cu[i], cu[i + 1])
        one = [t[rows].transpose(0, 1)[None].detach().double().requires_grad_()
               for t in (q, k, v)]
        want = sdpa_math(*one, causal, None)
        got = out[rows].transpose(0, 1)[None]
        assert (got.double() - want).abs().max() <= rounding_atol(want, BF16) + 1e-9
        want_grads = torch.autograd.grad(want, one, dout[rows].transpose(0, 1)[None].double())
        for name, g, w in zip("qkv", grads, want_grads):
            assert_close_to_float64(g[rows].transpose(0, 1)[None], w, f"d{name} of sequence {i}")
    if not converts:
        with pytest.raises(UnsupportedError, match="window_size_left=-1.*ambiguous"):
            varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0))


# ----------------------------------------------------------------------------------------------
# registration


def test_register_sdpa_activates_and_restores():
    from torch.nn.attention import current_flash_attention_impl

    restore = getattr(torch.nn.attention, "restore_flash_attention_impl", None)
    if restore is None:
        pytest.skip(f"torch {torch.__version__} has no restore_flash_attention_impl (2.11 on)")
    try:
        assert sdpa.register_sdpa() == "fa4_final"
        assert current_flash_attention_impl() == "fa4_final"
        assert fa4._FA4_MODULE_PATH == "fa4_final.api.sdpa"
    finally:
        restore()
    assert current_flash_attention_impl() is None


def test_register_sdpa_names_the_torch_that_has_the_registry(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    with pytest.raises(UnsupportedError, match=r"torch 2\.10 and later.*this torch is"):
        sdpa.register_sdpa()


def test_importing_fa4_final_registers_nothing():
    code = ("import fa4_final, torch.nn.attention as a; "
            "assert hasattr(fa4_final, 'register_sdpa'); "
            "assert 'fa4_final' not in a.list_flash_attention_impls(); "
            "assert a.current_flash_attention_impl() is None")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-2000:]
