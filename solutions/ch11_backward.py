"""Chapter 11: the backward pass of attention, in PyTorch with an explicit tile loop.

The forward (chapters 01-02) computes, per (batch, head), with scale = softmax_scale:

    S = scale * Q K^T        P = exp(S - lse)  (= softmax(S), lse kept by the forward)
    O = P V

Given dO = dLoss/dO, the chain rule through the three lines gives (``backward_math``):

    dV = P^T dO                                   (Sk, D)
    dP = dO V^T                                   (Sq, Sk)
    dS = P * (dP - delta),  delta_i = sum_j P_ij dP_ij = sum_d dO_id O_id
    dQ = scale * dS K                             (Sq, D)
    dK = scale * dS^T Q                           (Sk, D)

The softmax's Jacobian is diag(P) - P P^T per row, which is where delta comes from; and because
sum_j P_ij dP_ij = sum_j P_ij sum_d dO_id V_jd = sum_d dO_id O_id, delta is one dot product per
row of two tensors the forward already has (``softmax_delta``). No (Sq, Sk) matrix is ever
stored: the backward recomputes S from Q and K and P from the forward's lse, one tile at a time.

Five GEMMs per tile instead of the forward's two (S = QK^T is recomputed; dP, dV, dK, dQ are
new), each 2 * tile_m * tile_n * D FLOPs: the backward costs 2.5x the forward
(``backward_flops``), which is the factor every benchmark of the course applies.

The loop (``attention_backward_tiles``) runs in the order of the kernels: the outer loop over KV
tiles (one CTA per KV tile: K and V loaded once, dK and dV accumulated locally, written once),
the inner loop over the Q tiles that see them. dQ gets a contribution from every KV tile, so it
is accumulated in float32 in memory, an atomic add per KV tile in a kernel; ``BackwardCounts``
counts what that costs. GQA: a KV head serves several query heads, so dK and dV are the sums over
the group. The order of float32 additions decides the last bits of dQ (``sum_orders``): chapter
11's deterministic mode fixes that order.

As kernels do: inputs in bf16/fp16 (float64 in the checks), scores and accumulators in float32,
P and dS rounded to the input dtype before they enter a GEMM, exp2 with log2(e) folded into the
scale, rows that see no key (lse = -inf) contribute nothing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from utils.reference import attention_reference, check_attention_inputs, positive_int, random_qkv

LOG2E = math.log2(math.e)
NEG_INF = float("-inf")

# ---------------------------------------------------------------------------------------------
# 1. What the answer must be: torch.autograd through the float64 reference


def backward_reference(q, k, v, dout, causal=False, softmax_scale=None, dtype=torch.float64):
    """(dq, dk, dv) of the reference attention by torch.autograd, computed in ``dtype``
    (float64 by default: the yardstick; ``dtype=q.dtype`` is PyTorch's same-precision answer).
    GQA: dk and dv come out with k's and v's heads, summed over each group by autograd itself."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = attention_reference(*leaves, causal=causal, softmax_scale=softmax_scale,
                                 dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return dq, dk, dv


def backward_math(q, k, v, dout, causal=False, softmax_scale=None):
    """The five lines of the module docstring on whole matrices (float64, no tiles): what the
    tile loop distributes. Returns (dq, dk, dv) like ``backward_reference``."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    qh, kh, vh, doh = (_heads_first(t.double(), h) for t in (q, k, v, dout))
    s = scale * qh @ kh.transpose(-1, -2)
    if causal:
        s = s.masked_fill(~_visible(0, sq, 0, sk, sq, sk, True, s.device), NEG_INF)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse.masked_fill(lse == NEG_INF, 0.0))  # empty rows: all zero
    o = p @ vh
    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq, dk = scale * ds @ kh, scale * ds.transpose(-1, -2) @ qh
    return _to_input_layout(dq, h), _to_input_layout(dk, hk), _to_input_layout(dv, hk)


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, H, S, D), each kv head repeated H / Hkv times (GQA)."""
    return t.transpose(1, 2).repeat_interleave(heads // t.shape[2], dim=1)


def _to_input_layout(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, heads, D), summing the H / heads copies of each head (GQA)."""
    b, h, s, d = t.shape
    t = t.reshape(b, heads, h // heads, s, d).sum(2)
    return t.transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# 2. The pieces of the tile loop (each is an exercise)


def softmax_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dO * O) per (batch, head, query row): (B, H, Sq), float32 (float64 for
    float64 inputs). It equals sum_j P_ij dP_ij, the softmax Jacobian's term, from O alone."""
    acc = torch.promote_types(out.dtype, torch.float32)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)


def recompute_p(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P of one tile from its scores and the forward's LSE, as the kernel recomputes it.

    s: (..., rows, cols) scores times scale * log2(e) (log2 units), -inf where masked;
    lse: (..., rows) the forward's natural-log LSE. P = 2^(s - lse * log2 e). A row that saw no
    key has lse = -inf; it must give P = 0 (not 2^(-inf + inf) = NaN): +inf in its place does."""
    lse_log2 = (lse * LOG2E).masked_fill(lse == NEG_INF, math.inf)
    return torch.exp2(s - lse_log2[..., None])


def ds_from_dp(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dS = P * (dP - delta): p, dp (..., rows, cols), delta (..., rows)."""
    return p * (dp - delta[..., None])


def tile_step(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, visible=None, p_fn=recompute_p,
              ds_fn=ds_from_dp):
    """One (Q tile, KV tile) step: the five GEMMs. Returns (dq_part, dk_part, dv_part) in the
    accumulator dtype, dq and dk without the softmax scale (the loop applies it once).

    q_t, do_t: (..., rows, D); k_t, v_t: (..., cols, D), in the inputs' dtype as loaded;
    lse_t, delta_t: (..., rows); ``visible`` (rows, cols) bool or None (no mask). As on the
    tensor cores: GEMM operands in the inputs' dtype (P and dS rounded to it), float32 sums."""
    acc = torch.promote_types(q_t.dtype, torch.float32)
    q_a, k_a, v_a, do_a = (t.to(acc) for t in (q_t, k_t, v_t, do_t))
    s = (q_a @ k_a.transpose(-1, -2)) * (scale * LOG2E)  # GEMM 1: S = Q K^T (recomputed)
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    p = p_fn(s, lse_t)
    dp = do_a @ v_a.transpose(-1, -2)  # GEMM 2: dP = dO V^T
    ds = ds_fn(p, dp, delta_t)
    p_in, ds_in = (t.to(q_t.dtype).to(acc) for t in (p, ds))
    dv_part = p_in.transpose(-1, -2) @ do_a  # GEMM 3: dV += P^T dO
    dk_part = ds_in.transpose(-1, -2) @ q_a  # GEMM 4: dK += dS^T Q
    dq_part = ds_in @ k_a  # GEMM 5: dQ += dS K
    return dq_part, dk_part, dv_part


def first_q_tile(k_start: int, seqlen_q: int, seqlen_k: int, tile_m: int, causal: bool) -> int:
    """The first Q tile (index) with a row that sees key ``k_start``, the first key of a KV
    tile; every later Q tile sees it too (causal, bottom-right aligned: row i sees j <= i +
    seqlen_k - seqlen_q). Without a mask every Q tile sees every key: 0. Q tiles before it are
    skipped by the backward's inner loop."""
    if not causal:
        return 0
    first_row = k_start - (seqlen_k - seqlen_q)  # the first row that sees key k_start
    return max(first_row, 0) // tile_m


def _visible(q0, q1, k0, k1, seqlen_q, seqlen_k, causal, device=None):
    """(q1 - q0, k1 - k0) bool: query q0 + r sees key k0 + c."""
    rows = torch.arange(q0, q1, device=device)[:, None]
    cols = torch.arange(k0, k1, device=device)[None, :]
    if not causal:
        return torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    return cols <= rows + (seqlen_k - seqlen_q)


# ---------------------------------------------------------------------------------------------
# 3. The loop


@dataclass
class BackwardCounts:
    """What the tile loop did, per (batch, head): tiles computed / skipped / masked, GEMM FLOPs
    done, and bytes a kernel with this loop order moves to and from memory (K, V, dK, dV once
    per KV tile; Q, dO, lse, delta once per visited tile; dQ's float32 accumulator read and
    written once per visited tile: the atomic adds)."""

    computed: int = 0
    skipped: int = 0
    masked: int = 0
    gemm_flops: float = 0.0
    kv_bytes: int = 0  # K, V read and dK, dV written, once per KV tile
    q_bytes: int = 0  # Q, dO, lse, delta read for every visited tile
    dq_accum_bytes: int = 0  # float32 dQ read-modify-write per visited tile (atomics, in L2)

    @property
    def total(self) -> int:
        return self.computed + self.skipped


def attention_backward_tiles(q, k, v, out, lse, dout, causal=False, softmax_scale=None, *,
                             tile_m=64, tile_n=128, counts: BackwardCounts | None = None,
                             step=tile_step, q_start=first_q_tile, delta_fn=softmax_delta):
    """(dq, dk, dv) by the kernels' loop: for each KV tile (outer), for each Q tile that sees it
    (inner). dK and dV stay local to the KV tile; dQ is a float32 accumulator in "memory" that
    every KV tile adds to. ``step``, ``q_start``, ``delta_fn`` are the loop's pieces (the
    exercises plug in here). ``out`` and ``lse`` are the forward's; outputs in q's dtype."""
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v, softmax_scale)
    positive_int("tile_m", tile_m), positive_int("tile_n", tile_n)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    counts = counts if counts is not None else BackwardCounts()
    e = q.element_size()
    # (B, H, S, D): the loop runs every head at once, each kv head repeated over its group
    qh, doh = (t.transpose(1, 2) for t in (q, dout))
    kh, vh = (_heads_first(t, h) for t in (k, v))
    delta = delta_fn(out, dout).to(acc)  # the preprocessing kernel: (B, H, Sq)
    lse = lse.to(acc)
    dq_accum = torch.zeros(qh.shape, dtype=torch.float32 if acc != torch.float64 else acc,
                           device=q.device)  # "global memory", zeroed by the preprocessing
    dk = torch.empty(kh.shape, dtype=acc, device=q.device)
    dv = torch.empty_like(dk)
    n_q = -(-sq // tile_m)
    for k0 in range(0, sk, tile_n):  # one CTA per KV tile
        k1 = min(k0 + tile_n, sk)
        k_t, v_t = kh[:, :, k0:k1], vh[:, :, k0:k1]  # loaded once, stay on chip
        dk_t = torch.zeros(k_t.shape, dtype=acc, device=q.device)  # registers
        dv_t = torch.zeros_like(dk_t)
        counts.kv_bytes += 4 * (k1 - k0) * d * e  # K, V in; dK, dV out
        m_first = q_start(k0, sq, sk, tile_m, causal)
        counts.skipped += min(m_first, n_q)
        for m in range(m_first, n_q):
            q0, q1 = m * tile_m, min((m + 1) * tile_m, sq)
            visible = _visible(q0, q1, k0, k1, sq, sk, causal, q.device)
            whole = bool(visible.all())
            if not visible.any():  # a Q tile the loop should have skipped: no harm, counted
                counts.skipped += 1
                continue
            dq_p, dk_p, dv_p = step(qh[:, :, q0:q1], k_t, v_t, doh[:, :, q0:q1], lse[:, :, q0:q1],
                                    delta[:, :, q0:q1], scale, None if whole else visible)
            dv_t += dv_p
            dk_t += dk_p
            dq_accum[:, :, q0:q1] += dq_p.to(dq_accum.dtype)  # a kernel: atomic adds
            counts.computed += 1
            counts.masked += not whole
            counts.gemm_flops += 5 * 2 * (q1 - q0) * (k1 - k0) * d
            counts.q_bytes += (q1 - q0) * (2 * d * e + 2 * 4)  # Q, dO; lse, delta
            counts.dq_accum_bytes += 2 * (q1 - q0) * d * 4  # read + write float32
        dk[:, :, k0:k1] = dk_t * scale
        dv[:, :, k0:k1] = dv_t
    dq = (dq_accum * scale).to(q.dtype)  # the postprocessing kernel
    to_layout = lambda t, heads: _to_input_layout(t, heads).to(q.dtype)  # noqa: E731
    return dq.transpose(1, 2).contiguous(), to_layout(dk, hk), to_layout(dv, hk)


def backward(q, k, v, dout, causal=False, softmax_scale=None, **kw):
    """The forward as a kernel stores it (out rounded to q's dtype, lse in float32, both from
    float32-or-better scores), then the tile loop: (dq, dk, dv). An lse from scores rounded to
    bf16 would not match the float32 scores the loop recomputes: P would not sum to 1."""
    out, lse = attention_reference(q, k, v, causal, softmax_scale)
    return attention_backward_tiles(q, k, v, out.to(q.dtype), lse.float(), dout, causal,
                                    softmax_scale, **kw)


# ---------------------------------------------------------------------------------------------
# 4. Counting: FLOPs, bytes, and why the backward is 2.5x the forward


def forward_flops(b, h, sq, sk, d, causal=False) -> float:
    """Two GEMMs (S = QK^T, O = PV) of 2 * sq * sk * d each; causal counts half the square."""
    return 4.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)


def backward_flops(b, h, sq, sk, d, causal=False) -> float:
    """Five GEMMs of the same size (S recomputed, dP, dV, dK, dQ): 2.5x the forward."""
    return 10.0 * b * h * sq * sk * d * (0.5 if causal else 1.0)


@dataclass(frozen=True)
class BackwardTraffic:
    """Bytes a tiled backward moves per (batch, head), against its FLOPs."""

    hbm_bytes: float  # Q, K, V, O, dO read, dQ, dK, dV written once; lse, delta; the dQ pass
    dq_accum_bytes: float  # float32 atomic adds into dQ's accumulator (mostly L2 traffic)
    flops: float

    @property
    def intensity(self) -> float:
        return self.flops / self.hbm_bytes


def backward_traffic(sq, sk, d, tile_n=128, elem_bytes=2, causal=False) -> BackwardTraffic:
    """Per (batch, head): the compulsory traffic and the dQ accumulator's. Every KV tile adds a
    float32 (Sq, D) slab to dQ (read + write), so that term is sk / tile_n times dQ's size:
    the price of keeping K and V stationary."""
    n_kv = -(-sk // tile_n)
    compulsory = (sq * d * elem_bytes * 3  # Q, O, dO
                  + sk * d * elem_bytes * 2  # K, V
                  + sq * d * elem_bytes + sk * d * elem_bytes * 2  # dQ, dK, dV
                  + sq * 4 * 2  # lse, delta
                  + sq * d * 4 * 2)  # the preprocess zeroes dQ's accumulator, the post reads it
    frac = 0.5 if causal else 1.0
    accum = 2 * 4 * sq * d * n_kv * frac
    return BackwardTraffic(float(compulsory), float(accum), backward_flops(1, 1, sq, sk, d, causal))


# ---------------------------------------------------------------------------------------------
# 5. Determinism: float32 addition is not associative


def sum_orders(parts: list[torch.Tensor], orders: int = 20, seed: int = 0) -> int:
    """Add the float32 ``parts`` (one per KV tile, as atomics would) in ``orders`` random
    orders; return how many bitwise-different results came out. 1 means the order never
    mattered; atomics from CTAs that finish in a different order each run make it > 1."""
    rng = random.Random(seed)
    seen = set()
    for _ in range(orders):
        idx = list(range(len(parts)))
        rng.shuffle(idx)
        total = torch.zeros_like(parts[0], dtype=torch.float32)
        for i in idx:
            total += parts[i].float()
        seen.add(total.numpy().tobytes())
    return len(seen)


def dq_parts(q, k, v, dout, tile_n=128, causal=False):
    """The float32 dQ contributions of each KV tile (what the CTAs add), for ``sum_orders``."""
    out, lse = attention_reference(q, k, v, causal, dtype=q.dtype)
    b, sq, sk, h, hk, d = check_attention_inputs(q, k, v)
    q, k, v, dout = (t.float() for t in (q, k, v, dout))  # the parts as float32 GEMMs give them
    parts = []
    for k0 in range(0, sk, tile_n):
        kk, vv = k[:, k0:k0 + tile_n], v[:, k0:k0 + tile_n]
        dq, _, _ = attention_backward_tiles(q, kk, vv, out, lse, dout, False, d**-0.5,
                                            tile_m=sq, tile_n=tile_n)
        parts.append(dq)
    return parts


# ---------------------------------------------------------------------------------------------
# 6. Checkers


SHAPES = [  # (b, sq, sk, h, hk, d): lengths off the tiles, sq != sk both ways, GQA and MQA
    (2, 75, 110, 4, 2, 16), (1, 110, 75, 4, 1, 16), (1, 33, 33, 2, 2, 8), (1, 1, 70, 2, 1, 8)]


def compare_with_autograd(what: str = "the tile loop", causal_cases=(False, True),
                          tile_m=32, tile_n=48, **pieces) -> str | None:
    """Run the tile loop (with the given pieces) in float64 on awkward shapes and compare with
    torch.autograd; describe the first mismatch, or return None."""
    for b, sq, sk, h, hk, d in SHAPES:
        q, k, v, _ = random_qkv(b, sq, h, d, seqlen_k=sk, heads_kv=hk, dtype=torch.float64,
                                scale=1.5)
        dout = torch.randn(b, sq, h, d, dtype=torch.float64)
        for causal in causal_cases:
            out, lse = attention_reference(q, k, v, causal)
            got = attention_backward_tiles(q, k, v, out, lse, dout, causal, tile_m=tile_m,
                                           tile_n=tile_n, **pieces)
            want = backward_reference(q, k, v, dout, causal)
            case = (f"b={b}, seqlen_q={sq}, seqlen_k={sk}, heads {h}/{hk} (q/kv), tiles "
                    f"{tile_m}x{tile_n}, causal={causal}")
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                    return f"{name} has the wrong shape with {what} ({case})"
                if torch.isnan(g).any():
                    return f"NaN in {name} with {what} ({case})"
                err = (g - w).abs().max().item()
                if err > 1e-9 * max(1.0, w.abs().max().item()):
                    return (f"with {what}, {name} is off by up to {err:.3g} from torch.autograd "
                            f"({case})")
    return None


def _close(a, b, tol=1e-12) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and torch.allclose(a.double(), b.double(), rtol=1e-9, atol=tol))


def check_softmax_delta(fn) -> None:
    """Exercise 11.1: ``fn(out, dout) -> delta`` of shape (B, H, Sq)."""
    g = torch.Generator().manual_seed(3)
    out = torch.randn(2, 7, 3, 5, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 7, 3, 5, generator=g, dtype=torch.float64)
    got = fn(out, dout)
    want = softmax_delta(out, dout)
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"return a tensor, got {type(got).__name__}")
    if got.shape != want.shape:
        if got.shape == (2, 7, 3):
            raise AssertionError("the shape is (B, Sq, H): lse and delta are (B, H, Sq), like "
                                 "the forward's lse; transpose the last two dims")
        raise AssertionError(f"delta has one value per (batch, head, query row): shape "
                             f"{tuple(want.shape)}, got {tuple(got.shape)}")
    if not _close(got, want):
        if _close(got, (dout * out).sum((-1, -3)).unsqueeze(-1).expand_as(want)):
            raise AssertionError("sum over the head dim only, per query row")
        raise AssertionError("delta_i = sum over d of dO[i, d] * O[i, d]")
    bf = fn(out.bfloat16(), dout.bfloat16())
    if bf.dtype != torch.float32:
        raise AssertionError(f"for bf16 inputs, accumulate and return float32 (got {bf.dtype}): "
                             f"a bf16 sum of D products loses the bits dS needs")
    problem = compare_with_autograd("your softmax_delta", delta_fn=fn)
    if problem:
        raise AssertionError(problem)


def check_tile_step(fn) -> None:
    """Exercise 11.4: ``fn(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, visible) -> (dq_part,
    dk_part, dv_part)``, dq and dk without the final scale."""
    g = torch.Generator().manual_seed(6)
    q_t, do_t = (torch.randn(2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    k_t, v_t = (torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    s = q_t @ k_t.transpose(-1, -2) * 0.5
    visible = torch.ones(6, 5, dtype=torch.bool).tril(-1)
    lse = torch.logsumexp(s.masked_fill(~visible, NEG_INF), -1)
    delta = torch.randn(2, 6, generator=g, dtype=torch.float64)
    got = fn(q_t, k_t, v_t, do_t, lse, delta, 0.5, visible)
    want = tile_step(q_t, k_t, v_t, do_t, lse, delta, 0.5, visible)
    if not (isinstance(got, tuple) and len(got) == 3):
        raise AssertionError("return the three contributions as a tuple (dq, dk, dv)")
    for name, a, b in zip(("dq_part", "dk_part", "dv_part"), got, want):
        if not isinstance(a, torch.Tensor) or a.shape != b.shape:
            raise AssertionError(f"{name} must have shape {tuple(b.shape)}")
        if torch.isnan(a).any():
            raise AssertionError(f"NaN in {name}: row 0 sees no key here; recompute_p gives it "
                                 f"P = 0")
        if not _close(a, b, 1e-10):
            if _close(a, b * 0.5, 1e-10) or _close(a * 0.5, b, 1e-10):
                raise AssertionError(f"{name} is off by the softmax scale: leave dq and dk "
                                     f"unscaled here (the loop multiplies once at the end), and "
                                     f"compute S with scale * log2(e)")
            hint = {"dv_part": "dV = P^T dO", "dk_part": "dK = dS^T Q",
                    "dq_part": "dQ = dS K"}[name]
            raise AssertionError(f"{name} is wrong: {hint}, with P from recompute_p and dS "
                                 f"from ds_from_dp; masked scores are -inf before P")
    problem = compare_with_autograd("your tile_step", step=fn)
    if problem:
        raise AssertionError(problem)


def check_first_q_tile(fn) -> None:
    """Exercise 11.5: ``fn(k_start, seqlen_q, seqlen_k, tile_m, causal) -> int``."""
    for sq, sk in ((100, 100), (40, 130), (130, 40), (64, 64), (1, 300), (300, 1)):
        for tile_m, tile_n in ((32, 32), (64, 16), (16, 64)):
            n_q = -(-sq // tile_m)
            for k0 in range(0, sk, tile_n):
                if fn(k0, sq, sk, tile_m, False) != 0:
                    raise AssertionError("without a mask every Q tile sees every key: 0")
                got = fn(k0, sq, sk, tile_m, True)
                where = (f"key tile starting at {k0}, seqlen_q={sq}, seqlen_k={sk}, "
                         f"tile_m={tile_m}: row i sees keys j <= i + {sk - sq}")
                if not isinstance(got, int) or isinstance(got, bool):
                    raise AssertionError(f"return an int, got {type(got).__name__} ({where})")
                want = first_q_tile(k0, sq, sk, tile_m, True)
                if min(got, n_q) != min(want, n_q):
                    if got > want:
                        raise AssertionError(f"you start at Q tile {got}, but row "
                                             f"{max(k0 - sk + sq, 0)} in tile {want} sees key "
                                             f"{k0} already ({where})")
                    raise AssertionError(f"you start at Q tile {got}, but no row before tile "
                                         f"{want} sees key {k0} ({where})")
    counts = BackwardCounts()
    q, k, v, _ = random_qkv(1, 70, 2, 8, seqlen_k=130, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, True)
    attention_backward_tiles(q, k, v, out, lse, torch.randn_like(q), True, tile_m=16,
                             tile_n=32, counts=counts, q_start=fn)
    ref = BackwardCounts()
    attention_backward_tiles(q, k, v, out, lse, torch.randn_like(q), True, tile_m=16,
                             tile_n=32, counts=ref)
    if counts.computed != ref.computed:
        raise AssertionError(f"the loop computed {counts.computed} tiles; {ref.computed} hold a "
                             f"visible key")
    problem = compare_with_autograd("your first_q_tile", causal_cases=(True,), q_start=fn)
    if problem:
        raise AssertionError(problem)


def dq_add_bytes(seqlen_q: int, seqlen_k: int, head_dim: int, tile_m: int, tile_n: int,
                 causal: bool) -> int:
    """Exercise 11.4's reference: the float32 bytes the bulk adds of one (batch, head) send into
    dQ's accumulator. Every (query tile, key tile) pair the loop visits adds one whole
    tile_m x head_dim block, the last query tile's padding rows included (the accumulator is
    padded to whole tiles); a key tile visits the query tiles from ``first_q_tile`` on."""
    n_q = -(-seqlen_q // tile_m)
    visited = 0
    for k0 in range(0, seqlen_k, tile_n):
        visited += n_q - min(first_q_tile(k0, seqlen_q, seqlen_k, tile_m, causal), n_q)
    return visited * tile_m * head_dim * 4


def _dq_bytes_forbid() -> dict:
    from fa4_final.common.bwd_tiles import q_tile_range

    why = "it walks the loop for you; count the visited tiles with first_q_tile"
    return {q_tile_range: "that is the kernel's own range; count with your first_q_tile",
            attention_backward_tiles: why, BackwardCounts: why,
            backward_traffic: "its accumulator term is the average, not the count"}


FORBID_DQ_BYTES = _dq_bytes_forbid()
DQ_BYTES_SHAPES = [(4096, 4096, 128, 64, 128), (1000, 1000, 64, 128, 128),
                   (300, 520, 128, 80, 128), (700, 400, 128, 64, 128), (1, 300, 64, 64, 128),
                   (257, 513, 128, 64, 128)]


def check_dq_add_bytes(fn) -> None:
    """Exercise 11.4: ``fn(seqlen_q, seqlen_k, head_dim, tile_m, tile_n, causal) -> bytes``,
    against the kernel's own tile ranges (fa4_final.common.bwd_tiles.q_tile_range) on awkward
    shapes, causal or not."""
    from fa4_final.common.bwd_tiles import q_tile_range
    from fa4_final.common.tiles import TileWindow

    for sq, sk, d, tm, tn in DQ_BYTES_SHAPES:
        for causal in (False, True):
            w = TileWindow(tm, tn, causal)
            n_q, n_k = -(-sq // tm), -(-sk // tn)
            pairs = sum(q_tile_range(w, n, sq, sk)[1] - q_tile_range(w, n, sq, sk)[0]
                        for n in range(n_k))
            block = tm * d * 4
            want = pairs * block
            got = fn(sq, sk, d, tm, tn, causal)
            where = (f"seqlen_q={sq}, seqlen_k={sk}, D={d}, tiles {tm} x {tn}, "
                     f"causal={causal}: {pairs} of the {n_q} x {n_k} tile pairs are visited")
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise AssertionError(f"return a number of bytes, got {type(got).__name__}")
            if got == want:
                continue
            if causal and got == n_q * n_k * block:
                raise AssertionError(f"{where}: you counted every pair. With a causal mask key "
                                     "tile n skips the query tiles before first_q_tile (no row "
                                     "there sees its keys): they add nothing")
            if causal and abs(got - n_q * n_k * block / 2) < block:
                raise AssertionError(f"{where}: the causal count is not half the grid: the "
                                     "tiles on the diagonal are added whole. Count the visited "
                                     "pairs with first_q_tile")
            if got * 2 == want:
                raise AssertionError(f"{where}: the accumulator is float32, 4 bytes an element "
                                     "(the bf16 dQ is made from it at the very end)")
            if got < want and got % (d * 4) == 0 and sq % tm:
                raise AssertionError(f"{where}: a bulk add sends a whole tile of {tm} rows, the "
                                     "last query tile's padding rows too (the accumulator is "
                                     "padded to whole tiles)")
            raise AssertionError(f"{where}: got {got} bytes, the kernel's adds send {want}")


# ---------------------------------------------------------------------------------------------
# 7. Pictures


def plot_dataflow(ax=None):
    """The backward of one (Q tile, KV tile) pair: which operands each of the five GEMMs reads
    and where its result goes (inputs grey, recomputed or derived blue, outputs green)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 4.2))
    boxes = {  # name: (x, y, kind)
        "Q": (0, 3), "K": (0, 2), "V": (0, 1), "dO": (0, 0),
        "lse": (1.6, 3.6), "delta = rowsum(dO*O)": (1.6, -0.6),
        "S = QK^T": (2.2, 2.6), "P = exp(S - lse)": (4.2, 2.6),
        "dP = dO V^T": (2.2, 0.6), "dS = P (dP - delta)": (4.2, 1.2),
        "dV += P^T dO": (6.6, 3.0), "dK += dS^T Q": (6.6, 1.8), "dQ += dS K": (6.6, 0.4),
    }
    kind = {"Q": 0, "K": 0, "V": 0, "dO": 0, "lse": 0, "delta = rowsum(dO*O)": 0,
            "dV += P^T dO": 2, "dK += dS^T Q": 2, "dQ += dS K": 2}
    colors = {0: "#d9d9d9", 1: "#9ecae1", 2: "#a1d99b"}
    for name, (x, y) in boxes.items():
        w = 0.6 if len(name) <= 3 else 1.55
        ax.add_patch(FancyBboxPatch((x, y), w, 0.5, boxstyle="round,pad=0.05",
                                    fc=colors[kind.get(name, 1)], ec="black", lw=0.8))
        ax.text(x + w / 2, y + 0.25, name, ha="center", va="center", fontsize=9)
    edges = [("Q", "S = QK^T"), ("K", "S = QK^T"), ("lse", "P = exp(S - lse)"),
             ("S = QK^T", "P = exp(S - lse)"), ("dO", "dP = dO V^T"), ("V", "dP = dO V^T"),
             ("P = exp(S - lse)", "dS = P (dP - delta)"), ("dP = dO V^T", "dS = P (dP - delta)"),
             ("delta = rowsum(dO*O)", "dS = P (dP - delta)"), ("P = exp(S - lse)", "dV += P^T dO"),
             ("dS = P (dP - delta)", "dK += dS^T Q"), ("dS = P (dP - delta)", "dQ += dS K")]
    for a, b in edges:
        (xa, ya), (xb, yb) = boxes[a], boxes[b]
        wa = 0.6 if len(a) <= 3 else 1.55
        ax.add_patch(FancyArrowPatch((xa + wa + 0.05, ya + 0.25), (xb - 0.05, yb + 0.25),
                                     arrowstyle="->", mutation_scale=10, lw=0.8, color="#444"))
    ax.set_xlim(-0.3, 8.5)
    ax.set_ylim(-0.9, 4.4)
    ax.axis("off")
    ax.set_title("One tile of the backward: 5 GEMMs (S recomputed, dP, dV, dK, dQ)")
    return ax
