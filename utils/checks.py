"""Correctness checks: the tolerance rule, an error report, output poisoning.

The rule (as FlashAttention's own tests use it): a kernel run in low precision is compared with a
float64 reference, and its worst error may be at most twice the worst error of plain PyTorch doing
the same computation in the same precision, plus a small absolute slack for rounding the output
itself. A kernel that is as accurate as PyTorch passes with room; one that drops a rescale or
reads a wrong tile fails by orders of magnitude. NaN never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from utils.reference import attention_reference


@dataclass
class ErrorReport:
    name: str
    max_abs: float
    mean_abs: float
    rel_l2: float
    worst_index: tuple[int, ...]
    worst_value: float
    worst_expected: float
    nan_count: int
    inf_mismatch: int  # positions where exactly one of (value, reference) is +-inf or they differ

    def __str__(self) -> str:
        return (
            f"{self.name}: max |err| {self.max_abs:.3e} at {self.worst_index} "
            f"(got {self.worst_value:.6g}, expected {self.worst_expected:.6g}), "
            f"mean |err| {self.mean_abs:.3e}, rel L2 {self.rel_l2:.3e}, "
            f"NaN {self.nan_count}, inf mismatches {self.inf_mismatch}"
        )


def error_report(value: torch.Tensor, expected: torch.Tensor, name: str = "out") -> ErrorReport:
    """Compare ``value`` with ``expected`` (any dtypes, same shape) in float64 on the CPU.

    Infinities must match exactly (an lse of -inf for an empty row is a value, not an error);
    everywhere else the absolute error is measured.
    """
    if value.shape != expected.shape:
        raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {tuple(expected.shape)}")
    v = value.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    nan = torch.isnan(v)
    both_inf = torch.isinf(v) & torch.isinf(e) & (v == e)
    inf_mismatch = (torch.isinf(v) | torch.isinf(e)) & ~both_inf & ~nan
    finite = ~nan & ~torch.isinf(v) & ~torch.isinf(e)
    diff = torch.where(finite, (v - e).abs(), torch.zeros_like(v))
    if v.numel() == 0:
        return ErrorReport(name, 0.0, 0.0, 0.0, (), 0.0, 0.0, 0, 0)
    flat = int(torch.argmax(diff).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), v.shape))
    ef = torch.where(finite, e, torch.zeros_like(e))
    denom = float(ef.norm()) or 1.0
    return ErrorReport(
        name=name,
        max_abs=float(diff.max()),
        mean_abs=float(diff.sum() / max(int(finite.sum()), 1)),
        rel_l2=float(diff.norm()) / denom,
        worst_index=idx,
        worst_value=float(v.reshape(-1)[flat]),
        worst_expected=float(e.reshape(-1)[flat]),
        nan_count=int(nan.sum()),
        inf_mismatch=int(inf_mismatch.sum()),
    )


def rounding_atol(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Worst error of merely storing ``reference`` in ``dtype``: the slack no kernel can beat."""
    ref = reference.detach().to("cpu", torch.float64)
    ref = ref[torch.isfinite(ref)]
    if ref.numel() == 0:
        return 0.0
    return float((ref.to(dtype).to(torch.float64) - ref).abs().max())


@dataclass
class ToleranceVerdict:
    passed: bool
    kernel: ErrorReport
    pytorch: ErrorReport
    limit: float

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: kernel max err {self.kernel.max_abs:.3e} vs limit {self.limit:.3e} "
            f"(= 2 x PyTorch same-precision {self.pytorch.max_abs:.3e} + rounding slack)\n"
            f"  kernel : {self.kernel}\n  pytorch: {self.pytorch}"
        )


def tolerance_check(
    value: torch.Tensor,
    reference: torch.Tensor,
    same_precision: torch.Tensor,
    name: str = "out",
    factor: float = 2.0,
    extra_atol: float = 0.0,
) -> ToleranceVerdict:
    """The rule: max|value - ref| <= factor * max|same_precision - ref| + rounding slack.

    ``reference`` is the float64 result, ``same_precision`` what PyTorch gets in the kernel's
    own precision. Any NaN or mismatched infinity in ``value`` fails.
    """
    kernel = error_report(value, reference, name)
    pytorch = error_report(same_precision, reference, f"{name} (PyTorch)")
    limit = factor * pytorch.max_abs + rounding_atol(reference, value.dtype) + extra_atol
    passed = kernel.nan_count == 0 and kernel.inf_mismatch == 0 and kernel.max_abs <= limit
    return ToleranceVerdict(passed, kernel, pytorch, limit)


def check_attention(attention_fn, q, k, v, causal=False, softmax_scale=None, check_lse=True):
    """Run ``attention_fn`` and check out (and lse) with the tolerance rule.

    Returns a list of verdicts; raises AssertionError with the full report when one fails.
    The float64 reference and the same-precision reference run on the inputs' device.
    """
    out, lse = attention_fn(q, k, v, causal=causal, softmax_scale=softmax_scale)
    ref_out, ref_lse = attention_reference(q, k, v, causal, softmax_scale, dtype=torch.float64)
    pt_out, pt_lse = attention_reference(q, k, v, causal, softmax_scale, dtype=q.dtype)
    verdicts = [tolerance_check(out, ref_out, pt_out, "out")]
    if check_lse:
        # lse is float32 in every kernel; PyTorch's same-precision lse is float32 too.
        verdicts.append(tolerance_check(lse, ref_lse, pt_lse, "lse", extra_atol=1e-5))
    failed = [str(v_) for v_ in verdicts if not v_.passed]
    if failed:
        shape = f"q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} causal={causal}"
        raise AssertionError(f"{shape}\n" + "\n".join(failed))
    return verdicts


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN before a kernel writes it: an unwritten element stays NaN
    and fails every check, where zeros could pass by accident."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-1)


def poisoned_empty(*shape, dtype, device) -> torch.Tensor:
    return poison_(torch.empty(*shape, dtype=dtype, device=device))


# ----------------------------------------------------------------------------------------------
# One-line verdicts for a kernel's output buffers (the --check command lines and GPU tests).

LSE_ATOL = 1e-3  # a kernel's lse (float32 scores) vs float64, where a row sees keys
HANG_DEADLINE_S = 120.0

# Shapes every forward kernel's GPU test runs: one row, lengths that are no multiple of a tile,
# both orders of seqlen_q and seqlen_k under the bottom-right causal diagonal, GQA and MQA.
# (batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, dtype)
AWKWARD_CASES = [
    (1, 1, 1, 1, 1, 128, False, torch.bfloat16),
    (2, 17, 17, 2, 1, 64, True, torch.float16),
    (1, 129, 129, 4, 4, 128, True, torch.bfloat16),
    (1, 1000, 1000, 2, 1, 64, False, torch.bfloat16),
    (1, 4097, 4097, 1, 1, 128, True, torch.float16),
    (1, 100, 1000, 2, 2, 128, True, torch.bfloat16),  # seqlen_q < seqlen_k: bottom-right diagonal
    (1, 1000, 100, 2, 2, 128, True, torch.bfloat16),  # seqlen_q > seqlen_k: 900 rows see no key
    (1, 1000, 100, 2, 2, 64, False, torch.float16),
    (3, 257, 513, 8, 2, 128, False, torch.bfloat16),  # GQA, 4 query heads per kv head
    (2, 300, 77, 6, 1, 128, True, torch.bfloat16),  # MQA
]


def wait_for_gpu(what: str, deadline_s: float = HANG_DEADLINE_S) -> None:
    """torch.cuda.synchronize() with a deadline: a kernel stuck at a barrier would otherwise
    block forever. A hung context cannot be recovered, so this says what hung and exits."""
    import os
    import sys
    import time

    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > deadline_s:
            print(f"GPU HANG: no progress for {deadline_s:.0f} s in {what}", file=sys.stderr,
                  flush=True)
            os._exit(3)
        time.sleep(1e-4)


def compare_outputs(q, k, v, out, lse, causal=False, softmax_scale=None, label="",
                    window_size=None):
    """A kernel's ``out`` and ``lse`` against the float64 reference; returns (ok, one line).

    The course's rule for both (``tolerance_check``: within 2 x PyTorch's own error in the input
    dtype plus rounding slack, no NaN, infinities exactly where the reference has them), and two
    claims the rule cannot make by itself: rows that see no key are exactly out = 0 and
    lse = -inf, and lse is within LSE_ATOL of float64 where a row sees keys. A kernel keeps S in
    float32 while PyTorch's yardstick rounds it to 16 bits, so the rule alone would let lse
    drift; an lse paired with the wrong running max (chapter 07's classic bug) is off by up to
    tau * ln 2 and shows up here first.
    """
    ref_out, ref_lse = attention_reference(q, k, v, causal, softmax_scale,
                                           window_size=window_size)
    same_out, same_lse = attention_reference(q, k, v, causal, softmax_scale, dtype=q.dtype,
                                             window_size=window_size)
    on_out = tolerance_check(out, ref_out, same_out, "out")
    on_lse = tolerance_check(lse, ref_lse, same_lse, "lse", extra_atol=1e-5)
    seen = torch.isfinite(ref_lse).to(lse.device)  # rows that see at least one key
    empty_rows_ok = bool(torch.isneginf(lse[~seen]).all()) and bool(
        (out.transpose(1, 2)[~seen] == 0).all()
    )
    nan = on_out.kernel.nan_count + on_lse.kernel.nan_count
    lse_err = on_lse.kernel.max_abs
    ok = on_out.passed and on_lse.passed and lse_err <= LSE_ATOL and empty_rows_ok
    line = (
        f"{'ok  ' if ok else 'FAIL'} {label}: max|out err| {on_out.kernel.max_abs:.2e} "
        f"(tol {on_out.limit:.2e}, PyTorch {on_out.pytorch.max_abs:.2e}) at (b,s,h,d)="
        f"{on_out.kernel.worst_index}, lse err {lse_err:.2e} (tol "
        f"{min(on_lse.limit, LSE_ATOL):.1e}) at (b,h,s)={on_lse.kernel.worst_index}, inf "
        f"mismatches {on_out.kernel.inf_mismatch + on_lse.kernel.inf_mismatch}, empty rows "
        f"0/-inf {empty_rows_ok}, NaN {nan}"
    )
    return ok, line


def run_into_poisoned(attention_into, q, k, v, causal=False, softmax_scale=None, config=None,
                      label="", wait=None):
    """One launch of ``attention_into(q, k, v, out, lse, causal, softmax_scale, config)`` into
    NaN-poisoned buffers (an element the kernel forgets stays NaN and fails), then
    ``compare_outputs``. ``wait(label)`` waits for the GPU (default: ``wait_for_gpu``, which
    exits with a message instead of hanging). Returns (ok, one line)."""
    b, sq, h, d = q.shape
    out = poisoned_empty(b, sq, h, d, dtype=q.dtype, device=q.device)
    lse = poisoned_empty(b, h, sq, dtype=torch.float32, device=q.device)
    attention_into(q, k, v, out, lse, causal, softmax_scale, config)
    (wait or wait_for_gpu)(label)
    return compare_outputs(q, k, v, out, lse, causal, softmax_scale, label=label)


def check_random_case(attention_into, batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal,
                      dtype, config=None, wait=None, device="cuda"):
    """Fresh random inputs of the given shape, one poisoned run, one line. Returns (ok, line)."""
    from utils.reference import random_qkv

    q, k, v, seed = random_qkv(batch, seqlen_q, heads, dim, seqlen_k=seqlen_k,
                               heads_kv=heads_kv, dtype=dtype, device=device)
    label = (
        f"b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} d={dim} causal={causal} "
        f"{str(dtype).removeprefix('torch.')} {config or 'default config'} seed={seed}"
    )
    return run_into_poisoned(attention_into, q, k, v, causal, config=config, label=label,
                             wait=wait)


def run_cases(check, cases) -> int:
    """Run ``check(*case, config=config)`` -> (ok, line) for every (case, config) of ``cases``,
    printing each line with its time as it goes and a count at the end (the chapters' --check
    command lines). Returns the number of failed cases."""
    import time

    failures = 0
    for case, config in cases:
        t0 = time.perf_counter()
        ok, line = check(*case, config=config)
        failures += not ok
        print(f"{line} [{time.perf_counter() - t0:.1f} s]", flush=True)
    print(f"{len(cases) - failures}/{len(cases)} cases passed", flush=True)
    return failures
