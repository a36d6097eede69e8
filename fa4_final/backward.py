"""The backward's PyTorch entry points: checks, the three kernels compiled once, the workspace.

    backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=False, softmax_scale=None,
                  window_size=(None, None), deterministic=False)
    backward(...) -> (dq, dk, dv)

``out`` and ``lse`` are the forward's (fa4_final.interface.forward). Three launches on the
current stream: bwd_pre (delta, lse in log2 units, zeroed dQ accumulator and turn counters),
hopper.bwd (dK, dV and the dQ accumulator), bwd_post (dQ). Compiled like the forward: fake
tensors, TVM-FFI, one compiled function per (kernel, config, dtype), cached in memory.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fa4_final.checks import _normalise_window, check_grads, check_inputs, check_outputs
from fa4_final.common.constants import CUTLASS_BY_NAME, DTYPE_NAMES
from fa4_final.common.errors import UnsupportedError
from fa4_final.compile import compile_roles, fake_stream, fake_tensor
from fa4_final.config import HopperBwdConfig, hopper_bwd_default
from fa4_final.dispatch import backend_for

# compile_backward's arguments -> the three compiled kernels, in front of the cache (as the
# forward's fa4_final.hopper.launch._COMPILED)
_COMPILED: dict = {}


def _config(head_dim: int, causal: bool, deterministic: bool, config) -> HopperBwdConfig:
    cfg = config or hopper_bwd_default(head_dim, causal)
    if not isinstance(cfg, HopperBwdConfig):
        raise TypeError(f"config must be a HopperBwdConfig or None, got {type(cfg).__name__}")
    if deterministic and not cfg.deterministic:
        cfg = replace(cfg, deterministic=True)
    return cfg


def _kernels(dtype_name, head_dim, causal, has_left, has_right, cfg):
    from fa4_final.common.bwd_post import BackwardPost
    from fa4_final.common.bwd_pre import BackwardPre
    from fa4_final.hopper.bwd import HopperBackward

    dt = CUTLASS_BY_NAME[dtype_name]
    main = HopperBackward(dt, head_dim, causal, cfg, has_window_left=has_left,
                          has_window_right=has_right)
    pre = BackwardPre(dt, head_dim, cfg.tile_m, cfg.deterministic)
    return {"pre": pre, "main": main, "post": BackwardPost(main)}


def _fake_args(dtype_name: str, head_dim: int):
    """Fake arguments of each kernel: symbolic batch, lengths and heads."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    dt = CUTLASS_BY_NAME[dtype_name]
    div = 128 // dt.width  # 16-byte strides (TMA, 128-bit loads), in elements
    b, sq, sk, h, hk, sq_pad, slab, m_blocks = (cute.sym_int() for _ in range(8))
    like_q = lambda: fake_tensor(dt, (b, sq, h, head_dim), divisibility=div)  # noqa: E731
    like_k = lambda: fake_tensor(dt, (b, sk, hk, head_dim), divisibility=div)  # noqa: E731
    lse = fake_tensor(Float32, (b, h, sq), divisibility=1)
    lse2 = fake_tensor(Float32, (b, h, sq_pad), divisibility=4)
    delta = fake_tensor(Float32, (b, h, sq_pad), divisibility=4)
    accum = fake_tensor(Float32, (b, h, slab), divisibility=4)
    # its own extents: without the deterministic mode the caller passes a (1, 1, 1) dummy
    turn = fake_tensor(Int32, (cute.sym_int(), cute.sym_int(), m_blocks), divisibility=1)
    q, out, dout, dq = like_q(), like_q(), like_q(), like_q()
    k, v, dk, dv = like_k(), like_k(), like_k(), like_k()
    return {
        "pre": (out, dout, lse, lse2, delta, accum, turn, fake_stream()),
        "main": (q, k, v, dout, lse2, delta, accum, dk, dv, turn, Float32(1.0), Int32(0),
                 Int32(0), fake_stream()),
        "post": (accum, dq, Float32(1.0), fake_stream()),
    }


def compile_backward(arch: str = "sm_90a", head_dim: int = 128, dtype: str = "bf16",
                     causal: bool = False, config: HopperBwdConfig | None = None,
                     deterministic: bool = False, has_window_left: bool = False,
                     has_window_right: bool = False, keep: bool = False):
    """Compile the three backward kernels for ``arch`` with fake tensors (no GPU needed).
    Returns ({"pre", "main", "post"} -> compiled, {...} -> artifacts or None)."""
    if dtype not in CUTLASS_BY_NAME:
        raise ValueError(f"dtype must be one of {sorted(CUTLASS_BY_NAME)}, got {dtype!r}")
    if arch != "sm_90a":
        raise UnsupportedError(f"the Hopper backward uses wgmma, TMA and setmaxnreg: it "
                               f"compiles for arch='sm_90a' only, got {arch!r}")
    cfg = _config(head_dim, causal, deterministic, config)
    memo = (arch, head_dim, dtype, bool(causal), cfg, bool(has_window_left),
            bool(has_window_right))
    if not keep and memo in _COMPILED:  # the per-call path: a dict lookup, not ~100 us of
        return _COMPILED[memo], dict.fromkeys(_COMPILED[memo])  # kernel objects and keys
    kernels = _kernels(dtype, head_dim, causal, has_window_left, has_window_right, cfg)
    compiled, artifacts = compile_roles(
        kernels, lambda role: _fake_args(dtype, head_dim)[role], "bwd", arch, keep)
    if not keep:
        _COMPILED[memo] = compiled
    return compiled, artifacts


def compile_only(arch: str = "sm_90a", head_dim: int = 128, dtype: str = "bf16",
                 causal: bool = False, config: HopperBwdConfig | None = None,
                 deterministic: bool = False, **window) -> dict:
    """The compiled backward's artifacts (PTX, SASS, resources) per kernel, on any machine."""
    return compile_backward(arch, head_dim, dtype, causal, config, deterministic, keep=True,
                            **window)[1]


def backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal=False, softmax_scale=None,
                  window_size=(None, None), deterministic=False,
                  config: HopperBwdConfig | None = None):
    """Gradients of attention into ``dq`` (like q), ``dk`` and ``dv`` (like k): ``out``, ``lse``
    from the forward, ``dout`` the gradient of out. GQA: dk, dv are summed over each group.
    ``deterministic``: bitwise the same gradients every run (a fixed order of dQ adds)."""
    b, sq, sk, h, hk, d = check_inputs(q, k, v, softmax_scale)
    causal, left, right = _normalise_window(causal, window_size)
    cfg = _config(d, causal, deterministic, config)
    cfg.check(d)
    check_outputs(q, out, lse, (b, h, sq))
    check_grads(q, k, dout, dq, dk, dv)
    arch = backend_for(q.device).target
    if b == 0 or h == 0 or sq == 0:
        dk.zero_()
        dv.zero_()
        return dq, dk, dv
    if sk == 0:
        dq.zero_()
        return dq, dk, dv
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal, scale, left, right,
                    deterministic, config, arch=arch)
    return dq, dk, dv


# What a backward call of one kind needs besides its tensors, looked up once: (compile_backward,
# arch, device, head dim, dtype, causal, has_left, has_right, deterministic, config) -> (the
# three kernels, tile_m, the unused (1, 1, 1) turn buffer outside the deterministic mode).
_PLANS: dict = {}


def _backward_plan(arch, q, causal, has_left, has_right, deterministic, config):
    d = q.shape[-1]
    key = (compile_backward, arch, q.device, d, q.dtype, causal, has_left, has_right,
           deterministic, config)
    plan = _PLANS.get(key)
    if plan is None:
        cfg = _config(d, causal, deterministic, config)
        kernels, _ = compile_backward(arch, d, DTYPE_NAMES[q.dtype], causal, cfg,
                                      has_window_left=has_left, has_window_right=has_right)
        # never read or written without the deterministic mode: one serves every call
        turn = None if cfg.deterministic else torch.empty((1, 1, 1), dtype=torch.int32,
                                                          device=q.device)
        plan = _PLANS[key] = (kernels["pre"], kernels["main"], kernels["post"], cfg.tile_m,
                              cfg.deterministic, turn)
    return plan


def launch_backward(q, k, v, out, lse, dout, dq, dk, dv, causal: bool, softmax_scale: float,
                    left, right, deterministic: bool = False,
                    config: HopperBwdConfig | None = None, arch: str = "sm_90a"):
    """The three launches of backward_into on inputs it checked: non-empty, the window
    normalised (sides None when unbounded, causal with right = 0), the scale resolved."""
    pre, main, post, tile_m, det, turn = _backward_plan(
        arch, q, causal, left is not None, right is not None and not causal, deterministic,
        config)
    b, sq, h, d = q.shape
    m_blocks = -(-sq // tile_m)
    sq_pad = m_blocks * tile_m
    lse2 = q.new_empty((b, h, sq_pad), dtype=torch.float32)
    delta = q.new_empty((b, h, sq_pad), dtype=torch.float32)
    accum = q.new_empty((b, h, sq_pad * d), dtype=torch.float32)
    if det:
        turn = torch.empty((b, h, m_blocks), dtype=torch.int32, device=q.device)
    pre(out, dout, lse, lse2, delta, accum, turn)
    main(q, k, v, dout, lse2, delta, accum, dk, dv, turn, softmax_scale, left or 0, right or 0)
    post(accum, dq, softmax_scale)


# fa4_final.hopper.launch.backward_into calls this for inputs that fa4_final.run checked
backward_into.checked_inputs = launch_backward


def backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
             window_size=(None, None), deterministic=False, config=None):
    """(dq, dk, dv); see backward_into."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return backward_into(q, k, v, out, lse, dout, dq, dk, dv, causal, softmax_scale,
                         window_size, deterministic, config)


SMALL_CASES = [(1, 100, 130, 2, 1, 64, True), (1, 129, 129, 2, 2, 128, False)]
CHECK_CASES = SMALL_CASES + [(2, 200, 333, 4, 2, 128, True), (1, 300, 77, 2, 1, 128, True),
                             (1, 257, 513, 4, 4, 64, False)]


def check(cases=None, deterministic=(False, True), seed: int = 0) -> bool:
    """Small cases for `python -m fa4_final.backward --check [--small]` (and compute-sanitizer):
    this backward on the out and lse of a float64 torch forward (so the backward is checked
    alone), against float64 torch.autograd; one line per case. Returns whether all passed."""
    ok_all = True
    for b, sq, sk, h, hk, d, causal in cases or CHECK_CASES:
        g = torch.Generator(device="cpu").manual_seed(seed)
        q, k, v, dout = (torch.randn(b, s, n, d, generator=g).to("cuda", torch.bfloat16)
                         for s, n in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
        out, lse, ref = _reference(q, k, v, dout, causal)
        for det in deterministic:
            grads = backward(q, k, v, out, lse, dout, causal=causal, deterministic=det)
            torch.cuda.synchronize()
            errs = [(g_.double() - r).abs().max().item() for g_, r in zip(grads, ref)]
            scales = [r.abs().max().item() for r in ref]
            nan = any(torch.isnan(g_).any().item() for g_ in grads)
            ok = not nan and all(e <= 2e-2 * max(s, 1.0) for e, s in zip(errs, scales))
            ok_all &= ok
            print(f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} "
                  f"causal={causal} deterministic={det}: max|err| dq {errs[0]:.2e} dk "
                  f"{errs[1]:.2e} dv {errs[2]:.2e} (max |grad| {max(scales):.2e})", flush=True)
    return ok_all


def _reference(q, k, v, dout, causal):
    """(out in q's dtype, lse float32, float64 autograd (dq, dk, dv)) of plain attention."""
    h, hk = q.shape[2], k.shape[2]
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    qd, kd, vd = (t.transpose(1, 2) for t in leaves)
    kd, vd = kd.repeat_interleave(h // hk, 1), vd.repeat_interleave(h // hk, 1)
    s = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    o = (p @ vd).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, dout.double())
    return o.detach().to(q.dtype).contiguous(), lse.detach().float().contiguous(), grads


if __name__ == "__main__":
    import sys

    if "--check" not in sys.argv:
        sys.exit("usage: python -m fa4_final.backward --check [--small]")
    sys.exit(0 if check(SMALL_CASES if "--small" in sys.argv else None) else 1)
