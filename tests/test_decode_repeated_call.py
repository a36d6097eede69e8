"""Note [A repeated decode call] (fa4_final.runtime.decode_entry) on a CPU: a decode call of
flash_attn_func, or of flash_attn_varlen_func with a page table and a dense q, that repeats an
earlier call's signature skips the checks and the plan's lookups, and launches the same
kernels with the same arguments; every call that differs in anything the checks read (a type,
a shape, a stride, a dtype, an option, a gradient, a base address, a page table's values
wanted now) takes the whole path and gets the answer or the error it gets without the memo.

The kernel and the combine are tests.decode_reference's float64 walk and merge (as in
tests/test_decode_api.py), the Hopper row is given to CPU tensors and the eager path admits
them; nothing here runs a GPU kernel (tests/gpu/test_decode_api.py does, with the memo).
"""

from __future__ import annotations

import pytest
import torch

from fa4_final import flash_attn_func, flash_attn_varlen_func
from fa4_final.api import interface, ops
from fa4_final.runtime import decode_entry, pending
from tests.decode_reference import assert_close_to_float64, decode_reference
from tests.test_decode_api import Emulated

BF16 = torch.bfloat16


class Kernels(Emulated):
    """tests/test_decode_api.py's Emulated kernels (float64 on CPU tensors, the Hopper row),
    every launch recorded with its arguments, the combine's compiled plan emulated too, the
    eager path open to CPU tensors, and the public functions' checks counted."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.launches, self.checks, self.repeats = [], 0, 0
        plan_of, run, merge = (decode_entry.compiled, decode_entry.launch_decode,
                               decode_entry.combine_own_partials)

        class CombinePlan:
            kernels = {"main": merge}

        def compiled(fn, *args):
            return plan_of(fn, *args) if fn is decode_entry.decode_recipe else CombinePlan()

        def launch(plan, q, k, v, out, lse, page_table, seqused_k, scale, cu, max_q, left):
            n = out.shape[0] if out.dtype == torch.float32 else 1
            self.launches.append((plan.args, n, scale, left, tuple(out.shape)))
            run(plan, q, k, v, out, lse, page_table, seqused_k, scale, cu, max_q, left)

        def counted(*a, _check=interface.check_inputs, **kw):
            self.checks += 1
            return _check(*a, **kw)

        def counted_paged(*a, _check=decode_entry.check_paged_call, **kw):
            self.checks += 1
            return _check(*a, **kw)

        def repeated(*a, _launch=decode_entry.launch_resolved):
            self.repeats += 1
            return _launch(*a)

        monkeypatch.setattr(decode_entry, "compiled", compiled)
        monkeypatch.setattr(decode_entry, "launch_decode", launch)
        monkeypatch.setattr(decode_entry, "launch_resolved", repeated)
        monkeypatch.setattr(ops, "EAGER_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(interface, "check_inputs", counted)
        monkeypatch.setattr(decode_entry, "check_paged_call", counted_paged)
        monkeypatch.setattr(interface, "_REPEATED", {})
        monkeypatch.setenv(pending.ENV, "repeated_decode")  # Note [Pending features]


def decode_inputs(b=2, sq=2, sk=700, h=8, hk=2, d=64, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g).to(BF16) for s, n in ((sq, h), (sk, hk), (sk, hk))]


def _close(got, want, what):
    assert_close_to_float64(got, want, what)


@pytest.mark.parametrize("splits", [1, 0, 3])
def test_a_repeated_decode_call_checks_once_and_launches_the_same(monkeypatch, splits):
    """Three calls of one signature: the checks run once, the second and third take the
    repeated path, launch what the first launched, and equal float64 and each other."""
    kern = Kernels(monkeypatch)
    q, k, v = decode_inputs()
    outs = [flash_attn_func(q, k, v, causal=True, window_size=(300, None), num_splits=splits,
                            return_lse=True) for _ in range(3)]
    assert kern.checks == 1 and kern.repeats == 2
    assert kern.launches[0] == kern.launches[1] == kern.launches[2]
    want = decode_reference(q, k, v, True, window_left=300)
    for out, lse in outs:
        _close(out, want[0], "out")
        _close(lse, want[1], "lse")
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    assert outs[0][0].data_ptr() != outs[1][0].data_ptr()  # fresh outputs every call


def _answer(call):
    """What a call returns (out, lse or None) or the error it raises: its type and message."""
    try:
        out, lse = call()
    except Exception as e:  # noqa: BLE001 - the error is the answer compared
        return type(e), str(e)
    return out, lse


def _same(a, b) -> bool:
    if isinstance(a[0], type) or isinstance(b[0], type):
        return a == b
    return torch.equal(a[0], b[0]) and ((a[1] is None and b[1] is None)
                                        or torch.equal(a[1], b[1]))


VARIANTS = {
    "causal=1, not True": lambda q, k, v: dict(causal=1),
    "num_splits=True, not 1": lambda q, k, v: dict(num_splits=True),
    "num_splits 2.0": lambda q, k, v: dict(num_splits=2.0),
    "window (300.0, None)": lambda q, k, v: dict(window_size=(300.0, None)),
    "window as a list": lambda q, k, v: dict(window_size=[300, None]),
    "softmax_scale a tensor": lambda q, k, v: dict(softmax_scale=torch.tensor(0.125)),
    "softmax_scale 0": lambda q, k, v: dict(softmax_scale=0),
    "softcap 2.0": lambda q, k, v: dict(softcap=2.0),
    "return_lse=1": lambda q, k, v: dict(return_lse=1),
    "deterministic='yes'": lambda q, k, v: dict(deterministic="yes"),
    "pack_gqa": lambda q, k, v: dict(pack_gqa=True),
    "an unknown keyword": lambda q, k, v: dict(dropout_p=0.1),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_call_that_differs_gets_what_it_gets_without_the_memo(monkeypatch, name):
    """After a remembered call, each variant's answer (result or error) is the one it gets in a
    process that remembered nothing, and no variant takes the repeated path."""
    kern = Kernels(monkeypatch)
    q, k, v = decode_inputs()
    base = dict(causal=True, window_size=(300, None), num_splits=0, return_lse=True)
    other = {**base, **VARIANTS[name](q, k, v)}
    fresh = _answer(lambda: flash_attn_func(q, k, v, **other))
    interface._REPEATED.clear()
    flash_attn_func(q, k, v, **base)
    assert len(interface._REPEATED) == 1
    repeats = kern.repeats
    after = _answer(lambda: flash_attn_func(q, k, v, **other))
    assert kern.repeats == repeats, name
    assert _same(fresh, after), (name, fresh, after)


def _misaligned(t):
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    x = buf[1:].view(t.shape)
    x.copy_(t)
    return x


TENSORS = {
    "q of another dtype": lambda q, k, v: (q.half(), k, v),
    "q with more tokens": lambda q, k, v: (torch.cat([q, q], 1), k, v),
    "k transposed (other strides)": lambda q, k, v: (q, k.transpose(0, 1).contiguous()
                                                     .transpose(0, 1), v),
    "v of another head dim": lambda q, k, v: (q, k, torch.zeros(*v.shape[:3], 32, dtype=BF16)),
    "q that requires grad": lambda q, k, v: (q.clone().requires_grad_(), k, v),
    "a subclass of Tensor": lambda q, k, v: (torch.nn.Parameter(q, requires_grad=False), k, v),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_other_tensors_get_what_they_get_without_the_memo(monkeypatch, cpu_kernels, name):
    kern = Kernels(monkeypatch)
    q, k, v = decode_inputs()
    args = TENSORS[name](q, k, v)
    fresh = _answer(lambda: flash_attn_func(*args, causal=True, num_splits=0))
    interface._REPEATED.clear()
    flash_attn_func(q, k, v, causal=True, num_splits=0)
    repeats = kern.repeats
    after = _answer(lambda: flash_attn_func(*args, causal=True, num_splits=0))
    assert kern.repeats == repeats, name
    assert _same(fresh, after), (name, fresh, after)


def test_a_misaligned_base_address_is_refused_on_the_repeated_path(monkeypatch):
    """Same shapes and strides, q 2 bytes past a 16-byte boundary: the repeated path still
    checks the TMA base addresses, with the whole path's words."""
    kern = Kernels(monkeypatch)
    q, k, v = decode_inputs()
    flash_attn_func(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match=r"q.*address % 16 = 2"):
        flash_attn_func(_misaligned(q), k, v, num_splits=0)
    assert kern.repeats == 1  # it took the repeated path, and refused there


def test_grad_mode_and_observers_take_the_whole_path(monkeypatch):
    """A remembered signature is not enough: an input that requires grad (under grad mode)
    or a dispatch mode watching the call sends it the whole way."""
    kern = Kernels(monkeypatch)
    q, k, v = decode_inputs()
    flash_attn_func(q, k, v, num_splits=0)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        _answer(lambda: flash_attn_func(q, k, v, num_splits=0))
    assert kern.repeats == 0


def test_the_memo_is_bounded(monkeypatch):
    Kernels(monkeypatch)
    q, k, v = decode_inputs(sk=64)
    for left in range(interface._REPEATED_KEPT + 5):
        flash_attn_func(q, k, v, window_size=(left, None), num_splits=1)
    assert 0 < len(interface._REPEATED) <= interface._REPEATED_KEPT


def test_an_empty_cache_is_not_remembered(monkeypatch):
    Kernels(monkeypatch)
    q, k, v = decode_inputs(sk=0)
    out, _ = flash_attn_func(q, k, v, num_splits=0)
    assert interface._REPEATED == {} and torch.equal(out, torch.zeros_like(out))


# ----------------------------------------------------------------------------------------------
# a page table and a dense q (the serving call)


def paged_inputs(lengths=(700, 1, 0, 333), page=64, seed=6):
    """q (4, 2, 8, 64), a cache of shuffled 64-key pages, a table with -1 in unused slots."""
    g = torch.Generator().manual_seed(seed)
    num_pages, hk, d = 40, 2, 64
    k = torch.randn(num_pages, page, hk, d, generator=g).to(BF16)
    v = torch.randn(num_pages, page, hk, d, generator=g).to(BF16)
    order = torch.randperm(num_pages, generator=g)
    table = torch.full((len(lengths), 12), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(lengths):
        for slot in range(-(-n // page)):
            table[b, slot] = int(order[nxt])
            nxt += 1
    q = torch.randn(len(lengths), 2, 8, d, generator=g).to(BF16)
    return q, k, v, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("splits", [1, 0, 3])
def test_a_repeated_paged_call_checks_once_and_equals_float64(monkeypatch, splits):
    """The values are not checked on the host (as on a GPU by default): three calls, the checks
    once; new lengths written into seqused_k reach the repeated call."""
    monkeypatch.setenv("FA4_FINAL_VARLEN_CHECKS", "0")
    kern = Kernels(monkeypatch)
    q, k, v, table, used = paged_inputs()
    kw = dict(page_table=table, seqused_k=used, causal=True, num_splits=splits,
              return_lse=True)
    outs = [flash_attn_varlen_func(q, k, v, **kw) for _ in range(3)]
    assert kern.checks == 1 and kern.repeats == 2
    assert kern.launches[0] == kern.launches[1] == kern.launches[2]
    want = decode_reference(q, k, v, True, page_table=table, seqused_k=used)
    for out, lse in outs:
        _close(out, want[0], "out")
        _close(lse, want[1], "lse")
    used.copy_(torch.tensor([5, 640, 64, 0], dtype=torch.int32))
    out, lse = flash_attn_varlen_func(q, k, v, **kw)
    assert kern.repeats == 3
    want = decode_reference(q, k, v, True, page_table=table, seqused_k=used)
    _close(out, want[0], "out, new lengths")
    _close(lse, want[1], "lse, new lengths")


def test_values_wanted_now_send_a_paged_call_the_whole_way(monkeypatch):
    """Off a GPU the page table's values are checked on every call (Note [Paged KV checks]): a
    remembered signature still takes the whole path, which names a bad page."""
    monkeypatch.setenv("FA4_FINAL_VARLEN_CHECKS", "0")
    kern = Kernels(monkeypatch)
    q, k, v, table, used = paged_inputs()
    flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used, num_splits=0)
    assert len(interface._REPEATED) == 1
    monkeypatch.delenv("FA4_FINAL_VARLEN_CHECKS")
    table[0, 0] = 40  # past the cache's 40 pages
    with pytest.raises(ValueError, match="page"):
        flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used, num_splits=0)
    assert kern.repeats == 0


PAGED_VARIANTS = {
    "the table int64": lambda t, u: dict(page_table=t.long(), seqused_k=u),
    "no seqused_k": lambda t, u: dict(page_table=t, seqused_k=None),
    "seqused_k int64": lambda t, u: dict(page_table=t, seqused_k=u.long()),
    "a narrower table": lambda t, u: dict(page_table=t[:, :11].contiguous(), seqused_k=u),
    "a table of other strides": lambda t, u: dict(page_table=t.t().contiguous().t(),
                                                  seqused_k=u),
    "max_seqlen_k 700.0": lambda t, u: dict(page_table=t, seqused_k=u, max_seqlen_k=700.0),
    "cu_seqlens_k too": lambda t, u: dict(page_table=t, seqused_k=u,
                                          cu_seqlens_k=torch.zeros(5, dtype=torch.int32)),
}


@pytest.mark.parametrize("name", list(PAGED_VARIANTS))
def test_a_paged_call_that_differs_gets_what_it_gets_without_the_memo(monkeypatch, name):
    monkeypatch.setenv("FA4_FINAL_VARLEN_CHECKS", "0")
    kern = Kernels(monkeypatch)
    q, k, v, table, used = paged_inputs()
    other = dict(causal=True, num_splits=0, **PAGED_VARIANTS[name](table, used))
    fresh = _answer(lambda: flash_attn_varlen_func(q, k, v, **other))
    interface._REPEATED.clear()
    flash_attn_varlen_func(q, k, v, page_table=table, seqused_k=used, causal=True,
                           num_splits=0)
    repeats = kern.repeats
    after = _answer(lambda: flash_attn_varlen_func(q, k, v, **other))
    assert kern.repeats == repeats, name
    assert _same(fresh, after), (name, fresh, after)


def test_without_the_gate_listing_it_every_call_takes_the_whole_path(monkeypatch):
    """Put back in Note [Pending features] (its row was deleted after its GPU tests), unlisted,
    nothing is remembered; as shipped, the row is gone and the memo runs unlisted."""
    assert "repeated_decode" not in pending.PENDING and pending.listed("repeated_decode")
    kern = Kernels(monkeypatch)
    monkeypatch.setitem(pending.PENDING, "repeated_decode", "put back by this test")
    monkeypatch.delenv(pending.ENV)
    q, k, v = decode_inputs()
    for _ in range(3):
        flash_attn_func(q, k, v, num_splits=0)
    assert kern.checks == 3 and kern.repeats == 0 and interface._REPEATED == {}
