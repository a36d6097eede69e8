"""The decode kernel through fa4_final's API, on a CPU (fa4_final.runtime.decode_entry,
Note [Decode through the API]). Its GPU tests passed on an H100 (tests/gpu/test_decode*.py,
results/h100/gpu_checks.json) and its row of the pending-features gate was deleted:

- flash_attn_varlen_func's page_table (packed and dense q), api.sdpa's _flash_attn_fwd and the
  runtime entry: checked (bad tables, lengths, page sizes, num_splits named), then on to the
  device check without FA4_FINAL_PENDING; what the kernel lacks (head dims, softcap, a right
  window, seqused_q) and a gradient refused by name;
- num_splits: named when it is no int; a forward-only decode shape of flash_attn_func runs the
  runtime entry (recorded here), every other call the forward as before; naming decode in
  FA4_FINAL_PENDING (as the GPU tests still do) changes nothing;
- the compile keys (decode_recipe's arguments) and the split count from shapes only (meta
  tensors: no value is read), the partials and the combine when split;
- the op's fake impl (shapes).

Nothing here runs a GPU kernel (tests/gpu/test_decode_api.py does).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fa4_final import UnsupportedError, flash_attn_func, flash_attn_varlen_func
from fa4_final.api import ops, sdpa
from fa4_final.hopper import host
from fa4_final.hopper.config import HopperDecodeConfig
from fa4_final.runtime import decode_entry, dispatch, pending, prologue
from fa4_final.runtime.decode import choose_num_splits
from tests.decode_reference import assert_close_to_float64

BF16 = torch.bfloat16
GATE = "does not run decode yet"  # the words of the gate decode had (gone with its row)
DEVICE = "runs on CUDA GPUs"  # the device check's (runtime.dispatch.backend_for)


@pytest.fixture(autouse=True)
def no_pending(monkeypatch):
    monkeypatch.delenv(pending.ENV, raising=False)
    monkeypatch.delenv("FA4_FINAL_VARLEN_CHECKS", raising=False)


def paged(batch=3, sq=1, h=8, hk=2, d=64, page=16, num_pages=12, max_pages=4, lengths=(0, 17, 64),
          varlen=False):
    """A paged call's tensors: q (total_q, h, d) with cu_seqlens_q or (batch, sq, h, d); a cache
    of num_pages pages; a table whose unused slots hold -1."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_pages, page, hk, d, generator=g).to(BF16)
    v = torch.randn(num_pages, page, hk, d, generator=g).to(BF16)
    table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(lengths):
        for slot in range(-(-n // page)):
            table[b, slot] = nxt % num_pages
            nxt += 1
    used = torch.tensor(lengths, dtype=torch.int32)
    if varlen:
        q = torch.randn(batch * sq, h, d, generator=g).to(BF16)
        cu = torch.arange(0, batch * sq + 1, sq, dtype=torch.int32)
        return dict(q=q, k=k, v=v, page_table=table, seqused_k=used, cu_seqlens_q=cu)
    q = torch.randn(batch, sq, h, d, generator=g).to(BF16)
    return dict(q=q, k=k, v=v, page_table=table, seqused_k=used)


def _varlen_call(t, **kw):
    return flash_attn_varlen_func(t["q"], t["k"], t["v"], page_table=t["page_table"],
                                  seqused_k=t["seqused_k"], cu_seqlens_q=t.get("cu_seqlens_q"),
                                  **kw)


def _sdpa_call(t, **kw):
    return sdpa._flash_attn_fwd(t["q"], t["k"], t["v"], page_table=t["page_table"],
                                seqused_k=t["seqused_k"], cu_seqlens_q=t.get("cu_seqlens_q"),
                                **kw)


def _entry_call(t, **kw):
    q = t["q"]
    out = torch.zeros_like(q)
    lse = torch.zeros((q.shape[1], q.shape[0]) if q.dim() == 3 else
                      (q.shape[0], q.shape[2], q.shape[1]))
    return decode_entry.decode_forward_into(q, t["k"], t["v"], out, lse,
                                            page_table=t["page_table"], seqused_k=t["seqused_k"],
                                            cu_seqlens_q=t.get("cu_seqlens_q"), **kw)


def _entries(**shape):
    """(function name, call) of every entry that takes a page table, packed and dense q."""
    for varlen in (True, False):
        t = paged(varlen=varlen, **shape)
        yield "flash_attn_varlen_func", lambda t=t, **kw: _varlen_call(t, **kw)
        yield "_flash_attn_fwd", lambda t=t, **kw: _sdpa_call(t, **kw)
        yield "decode_forward_into", lambda t=t, **kw: _entry_call(t, **kw)


# ----------------------------------------------------------------------------------------------
# the gate


def test_decode_passed_its_gpu_tests_and_left_the_gate():
    assert "decode" not in pending.PENDING and pending.listed("decode")


@pytest.mark.parametrize("env", ["", "decode"], ids=["default", "named"])
def test_a_page_table_reaches_the_device_check_on_every_entry(monkeypatch, env):
    """Without FA4_FINAL_PENDING, and with decode named there (as the GPU tests still do)."""
    monkeypatch.setenv(pending.ENV, env)
    with torch.no_grad():
        for func, call in _entries():
            with pytest.raises(UnsupportedError, match=DEVICE) as info:
                call()
            assert GATE not in str(info.value), func


# ----------------------------------------------------------------------------------------------
# checks: each bad value named


def _bad(which):
    t = paged(varlen=True)
    if which == "page past the cache":
        t["page_table"][2, 3] = 12
        return t, ValueError, r"page_table\[2, 3\] = 12 is not a page of the cache: k and v hold 12"
    if which == "seqused_k over the capacity":
        t["seqused_k"][1] = 65
        return t, ValueError, (r"seqused_k\[1\] = 65 must be in \[0, 64\] \(max_pages 4 x "
                               r"page_size 16")
    if which == "page size 24":
        t["k"], t["v"] = t["k"][:, :8].repeat(1, 3, 1, 1), t["v"][:, :8].repeat(1, 3, 1, 1)
        return t, ValueError, (r"page_size \(k.shape\[1\]\) must be a positive multiple of 16, "
                               r"got 24")
    if which == "cu_seqlens_q past q":
        t["cu_seqlens_q"][-1] = 4
        return t, ValueError, r"cu_seqlens_q's last entry must equal the 3 rows of q, got 4"
    if which == "table of int64":
        t["page_table"] = t["page_table"].long()
        return t, TypeError, "page_table must have dtype torch.int32, got torch.int64"
    raise AssertionError(which)


BAD = ["page past the cache", "seqused_k over the capacity", "page size 24",
       "cu_seqlens_q past q", "table of int64"]


@pytest.mark.parametrize("which", BAD)
def test_bad_page_tables_are_named(which):
    t, error, words = _bad(which)
    with pytest.raises(error, match=words):
        _varlen_call(t)
    with torch.no_grad(), pytest.raises(error, match=words):  # the runtime entry the same
        _entry_call(t)


@pytest.mark.parametrize("which", BAD)
def test_sdpa_names_a_bad_page_table(which):
    t, error, words = _bad(which)
    with torch.no_grad(), pytest.raises(error, match=words):
        _sdpa_call(t)


def test_a_value_check_can_be_switched_off_as_the_varlen_checks(monkeypatch):
    monkeypatch.setenv("FA4_FINAL_VARLEN_CHECKS", "0")
    t, _, _ = _bad("page past the cache")
    with torch.no_grad(), pytest.raises(UnsupportedError, match=DEVICE):
        _varlen_call(t)


def test_cu_seqlens_q_values_are_checked_where_the_page_values_are_not(monkeypatch):
    """On a GPU the page table's values are left to the kernel by default (wants_value_checks
    False), but the kernel's q and out addresses trust cu_seqlens_q's offsets: those are still
    checked by the varlen checks' rule. Here wants_value_checks answers as on a GPU."""
    from fa4_final.runtime import decode

    for module in (decode, decode_entry):  # wherever the rule is asked
        monkeypatch.setattr(module, "wants_value_checks", lambda *a: False, raising=False)
    t, error, words = _bad("cu_seqlens_q past q")
    with torch.no_grad(), pytest.raises(error, match=words):
        _varlen_call(t)
    t, _, _ = _bad("page past the cache")  # the page's value is the kernel's to catch
    with torch.no_grad(), pytest.raises(UnsupportedError, match=DEVICE):
        _varlen_call(t)


def test_cu_seqlens_k_and_seqused_k_with_a_page_table(monkeypatch):
    t = paged(varlen=True)
    with pytest.raises(ValueError, match="page_table is not supported with cu_seqlens_k"):
        _varlen_call(t, cu_seqlens_k=t["cu_seqlens_q"])
    t["seqused_k"] = None  # FA4's reading: every page of a row, so a padding -1 is a bad page
    with pytest.raises(ValueError, match="no seqused_k: every entry of the row"):
        _varlen_call(t)
    t["page_table"] = t["page_table"].clamp(min=0)  # every entry a page: to the device check
    with torch.no_grad(), pytest.raises(UnsupportedError, match=DEVICE):
        _varlen_call(t)


@pytest.mark.parametrize("value", [2.0, True, "3", None])
def test_num_splits_that_is_no_int_is_named_everywhere(value):
    q, k, v = (torch.zeros(1, 1, 8, 64, dtype=BF16), torch.zeros(1, 16, 2, 64, dtype=BF16),
               torch.zeros(1, 16, 2, 64, dtype=BF16))
    t = paged(varlen=True)
    for call in (lambda: flash_attn_func(q, k, v, num_splits=value),
                 lambda: _varlen_call(t, num_splits=value),
                 lambda: sdpa._flash_attn_fwd(q, k, v, num_splits=value)):
        with pytest.raises(TypeError, match=f"num_splits must be an int .*got {value!r}"):
            call()


@pytest.mark.parametrize("change, words", [
    (dict(d=128, dv=64), r"head_dim=128, dv=64 with a page_table is refused: the decode kernel, "
                         r"the only one that reads a paged cache, is built for head dims "
                         r"\(64, 128\)"),
    (dict(softcap=5.0), "softcap with a page_table is refused: .* has no softcap"),
    (dict(window_size=(None, 3)), "window_size's right side 3 with a page_table is refused: .* "
                                  "causal \\(bottom-right\\) and a left window only"),
    (dict(window_size=(-5, None), causal=True), "window_size's left side -5 with a page_table "
                                                "is refused: .* a left window side >= 0"),
    (dict(seqused_q=True), "seqused_q with a page_table is refused")])
def test_what_the_decode_kernel_lacks_is_refused_by_name(monkeypatch, change, words):
    t = paged(varlen=True)
    kw = dict(change)
    if "dv" in kw:
        t = paged(varlen=True, d=kw.pop("d"))
        t["v"] = t["v"][..., :kw.pop("dv")].contiguous()
    if kw.pop("seqused_q", False):
        kw["seqused_q"] = torch.ones(3, dtype=torch.int32)
    with torch.no_grad(), pytest.raises(UnsupportedError, match=words):
        _varlen_call(t, **kw)


def test_a_paged_call_that_needs_a_gradient_is_refused_at_the_forward(monkeypatch):
    t = paged(varlen=True)
    t["q"].requires_grad_(True)
    for call in (_varlen_call, _sdpa_call):
        with pytest.raises(UnsupportedError, match="forward only .*FA4 has no paged backward"):
            call(t)
    with torch.no_grad(), pytest.raises(UnsupportedError, match=DEVICE):
        _varlen_call(t)  # no gradient asked: past the refusal, to the device check


# ----------------------------------------------------------------------------------------------
# routing: the runtime entry recorded


class Recorder:
    """The Hopper row for CPU tensors, with decode_entry.run_decode recorded (it writes zeros
    into out and lse): which calls reach the decode kernel, with what."""

    def __init__(self, monkeypatch, hopper: bool = True):
        self.calls = []
        if hopper:  # else the CPU reference kernels answer the forward
            monkeypatch.setattr(prologue, "backend_for", lambda device: dispatch.HOPPER)
            monkeypatch.setattr(prologue, "_BACKENDS", {})
        monkeypatch.setattr(decode_entry, "run_decode", self.run)

    def run(self, q, k, v, out, lse, page_table, seqused_k, cu_seqlens_q, max_seqlen_q, causal,
            scale, left, num_splits, target):
        self.calls.append(dict(page_table=page_table, seqused_k=seqused_k, cu=cu_seqlens_q,
                               max_seqlen_q=max_seqlen_q, causal=causal, scale=scale, left=left,
                               num_splits=num_splits, target=target, out=out.shape,
                               lse=lse.shape))
        out.zero_()
        lse.zero_()


def dense(b=2, sq=1, sk=40, h=8, hk=2, d=64, grad=False):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(b, s, n, d, generator=g).to(BF16).requires_grad_(grad)
            for s, n in ((sq, h), (sk, hk), (sk, hk))]


def test_a_decode_shape_runs_the_decode_entry_with_num_splits(monkeypatch):
    rec = Recorder(monkeypatch)
    q, k, v = dense()
    for splits in (1, 0, 3, -2):
        out, lse = flash_attn_func(q, k, v, causal=True, num_splits=splits, return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)
    out, lse = flash_attn_func(q, k, v, window_size=(5, None))
    assert lse is None
    assert [c["num_splits"] for c in rec.calls] == [1, 0, 3, -2, 1]
    assert [(c["causal"], c["left"]) for c in rec.calls] == [(True, None)] * 4 + [(False, 5)]
    assert all(c["page_table"] is None and c["scale"] == 0.125 for c in rec.calls)


@pytest.mark.parametrize("why, call", [
    ("a gradient", lambda: flash_attn_func(*dense(grad=True), num_splits=3)),
    ("17 tokens", lambda: flash_attn_func(*dense(sq=17), num_splits=3)),
    ("257 packed rows", lambda: flash_attn_func(*dense(sq=1, h=257 * 2, hk=2), num_splits=3)),
    ("a right window", lambda: flash_attn_func(*dense(), window_size=(None, 4), num_splits=3)),
    ("a negative left side", lambda: flash_attn_func(*dense(), window_size=(-3, None))),
    ("a softcap", lambda: flash_attn_func(*dense(), softcap=5.0, num_splits=3)),
    ("varlen without pages", lambda: flash_attn_varlen_func(
        torch.zeros(3, 8, 64, dtype=BF16), torch.zeros(9, 2, 64, dtype=BF16),
        torch.zeros(9, 2, 64, dtype=BF16),
        cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 3, 6, 9], dtype=torch.int32), num_splits=3))])
def test_other_calls_run_the_forward_as_before(monkeypatch, cpu_kernels, why, call):
    rec = Recorder(monkeypatch, hopper=False)
    call()
    assert rec.calls == [], why


def test_naming_decode_in_the_environment_changes_nothing(monkeypatch):
    rec = Recorder(monkeypatch)
    q, k, v = dense()
    for env in ("", "decode"):
        monkeypatch.setenv(pending.ENV, env)
        for splits in (0, 1, 3):
            flash_attn_func(q, k, v, causal=True, return_lse=True, num_splits=splits,
                            pack_gqa=True)
    assert [c["num_splits"] for c in rec.calls] == [0, 1, 3] * 2


def test_a_paged_call_reaches_the_entry_with_its_tensors(monkeypatch):
    rec = Recorder(monkeypatch)
    t = paged(varlen=True, sq=2)
    with torch.no_grad():
        out, lse = _varlen_call(t, causal=True, window_size=(7, None), num_splits=0,
                                max_seqlen_q=2, return_lse=True)
        assert out.shape == t["q"].shape and lse.shape == (8, 6)
        out, lse = _varlen_call(paged(varlen=False, sq=3), num_splits=2)
        assert out.shape == (3, 3, 8, 64) and lse is None
        buf = torch.full((3, 1, 8, 64), float("nan"), dtype=BF16)
        got, _ = _sdpa_call(paged(varlen=False), out=buf, return_lse=True)
        assert got is buf and not buf.isnan().any()
    first, second, third = rec.calls
    assert first["page_table"] is t["page_table"] and first["seqused_k"] is t["seqused_k"]
    assert first["cu"] is t["cu_seqlens_q"] and first["max_seqlen_q"] == 2
    assert (first["causal"], first["left"], first["num_splits"]) == (True, 7, 0)
    assert second["cu"] is None and second["lse"] == (3, 8, 3) and second["num_splits"] == 2
    assert third["out"] == (3, 1, 8, 64) and third["target"] == "sm_90a"


# ----------------------------------------------------------------------------------------------
# compile keys, split count, partials: shapes only


class Launches:
    """decode_entry's compile, launch and combine recorded; 132 SMs."""

    def __init__(self, monkeypatch):
        self.calls = []

        class Plan:
            config = None

        def compiled(recipe_fn, *args):
            self.calls.append(("compiled", recipe_fn, args))
            return Plan()

        monkeypatch.setattr(decode_entry, "compiled", compiled)
        monkeypatch.setattr(decode_entry, "launch_decode",
                            lambda *a: self.calls.append(("launch", a)))
        monkeypatch.setattr(decode_entry, "combine_own_partials",
                            lambda *a: self.calls.append(("combine", a)))
        monkeypatch.setattr(decode_entry, "num_sms", lambda device: 132)


def _meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_the_compile_keys_build_the_decode_recipes(monkeypatch):
    """Meta tensors (no values anywhere) through run_decode: the split count and the recipe's
    arguments come from shapes and the SM count only."""
    rec = Launches(monkeypatch)
    i32 = torch.int32
    # dense, 1 token, GQA 4, 8192 keys, batch 2: 2 x 8 CTAs, the heuristic splits
    q, k = _meta(2, 1, 32, 128), _meta(2, 8192, 8, 128)
    out, lse = _meta(2, 1, 32, 128), _meta(2, 32, 1, dtype=torch.float32)
    decode_entry.run_decode(q, k, k, out, lse, None, None, None, None, True, 0.1, None, 0)
    # paged, pages of 64 keys, varlen queries, a left window, 3 splits asked
    pq, pk = _meta(10, 16, 64), _meta(40, 64, 4, 64)
    pout, plse = _meta(10, 16, 64), _meta(16, 10, dtype=torch.float32)
    table, used, cu = _meta(4, 8, dtype=i32), _meta(4, dtype=i32), _meta(5, dtype=i32)
    decode_entry.run_decode(pq, pk, pk, pout, plse, table, used, cu, 4, False, 0.1, 9, 3)
    # one split asked: out and lse themselves, no combine
    decode_entry.run_decode(q, k, k, out, lse, None, None, None, None, False, 0.1, None, 1)
    keys = [c[2] for c in rec.calls if c[0] == "compiled"]
    want = choose_num_splits(0, batch=2, heads_kv=8, packed_rows=4, key_tiles=64, num_sms=132)
    assert want > 1
    boxes = HopperDecodeConfig(page_box=32)  # a contiguous cache at D = 128
    assert keys[0] == (128, "bf16", True, False, False, True, boxes, False, False)
    assert keys[1] == (64, "bf16", False, True, True, True, HopperDecodeConfig(page_box=64),
                       True, True)  # pages of 64 keys gathered into 128-key tiles
    assert keys[2] == (128, "bf16", False, False, False, False, boxes, False, False)
    launches = [c[1] for c in rec.calls if c[0] == "launch"]
    combines = [c[1] for c in rec.calls if c[0] == "combine"]
    assert launches[0][4].shape == (want, 2, 1, 32, 128)
    assert launches[0][5].shape == (want, 2, 32, 1)
    assert launches[1][4].shape == (3, 10, 16, 64) and launches[1][5].shape == (3, 16, 10)
    # (plan, q, k, v, out, lse, page_table, seqused_k, scale, cu_seqlens_q, max_seqlen_q, left)
    assert launches[1][6] is table and launches[1][7] is used and launches[1][8] == 0.1
    assert launches[1][9] is cu and launches[1][10:] == (4, 9)
    assert launches[0][6:8] == (None, None) and launches[0][9:] == (None, None, None)
    assert launches[2][4] is out and launches[2][5] is lse
    assert len(combines) == 2 and combines[0][2] is out and combines[1][2] is pout
    for args in keys:
        kernel = host.decode_recipe(*args).kernels["main"]
        assert (kernel.head_dim, kernel.causal, kernel.paged, kernel.has_seqused_k, kernel.split,
                kernel.varlen_q, kernel.has_window_left) == (args[0], *args[2:6], *args[7:9])
    gathered = host.decode_recipe(*keys[1]).kernels["main"]
    assert (gathered.tile_n, gathered.cfg.page_box) == (128, 64)


def test_the_split_count_follows_fa4s_meaning():
    q, k = _meta(2, 1, 32, 128), _meta(2, 8192, 8, 128)

    def splits(n, **kw):
        return decode_entry.decode_plan_args(q, k, None, None, None, None, True, None, n, 132,
                                             **kw)[0]

    assert splits(1) == 1 and splits(3) == 3 and splits(500) == 64  # 64 key tiles
    assert splits(0) == splits(-1) > 1
    small = _meta(2, 100, 8, 128)
    assert decode_entry.decode_plan_args(q, small, None, None, None, None, True, None, 5,
                                         132)[0] == 1  # one key tile


# ----------------------------------------------------------------------------------------------
# the op (what torch.compile sees)


def test_the_ops_fake_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pq = torch.empty(6, 8, 64, dtype=BF16, device="cuda")
        pk = torch.empty(12, 16, 2, 64, dtype=BF16, device="cuda")
        table = torch.zeros(3, 4, dtype=torch.int32, device="cuda")
        used = torch.zeros(3, dtype=torch.int32, device="cuda")
        cu = torch.zeros(4, dtype=torch.int32, device="cuda")
        out, lse = ops.decode_fwd(pq, pk, pk, table, used, cu, 2, 0.125, True, None, 0)
        assert out.shape == (6, 8, 64) and lse.shape == (8, 6) and lse.dtype == torch.float32
        q = torch.empty(2, 1, 8, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 40, 2, 64, dtype=BF16, device="cuda")
        out, lse = ops.decode_fwd(q, k, k, None, None, None, -1, 0.125, False, 4, 3)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)


def test_the_dense_runtime_entry_reaches_the_device_check(monkeypatch):
    q, k, v = dense()
    out, lse = torch.zeros_like(q), torch.zeros(2, 8, 1)
    with pytest.raises(UnsupportedError, match=DEVICE):
        decode_entry.decode_forward_into(q, k, v, out, lse)
    row = replace(dispatch.HOPPER, family="Blackwell")
    monkeypatch.setattr(prologue, "backend_for", lambda device: row)
    monkeypatch.setattr(prologue, "_BACKENDS", {})
    with pytest.raises(UnsupportedError, match="built for Hopper"):
        decode_entry.decode_forward_into(q, k, v, out, lse)


# ----------------------------------------------------------------------------------------------
# the whole path on the CPU, the kernel and the combine emulated in float64


class Emulated:
    """decode_entry's compile, launch and combine replaced by tests.decode_reference's walk of
    the kernel (emulate_decode, float64) and float64 merge (merge_splits), the Hopper row for
    CPU tensors: every layer above the kernel runs as on the GPU."""

    def __init__(self, monkeypatch):
        from tests.decode_reference import emulate_decode, merge_splits

        self.splits = []

        class Plan:
            def __init__(self, args):
                self.args = args
                self.config = args[6] or host.hopper_decode_default(args[0])

        def launch(plan, q, k, v, out, lse, page_table, seqused_k, scale, cu, max_q, left):
            n = out.shape[0] if out.dtype == torch.float32 else 1
            self.splits.append(n)
            out_p, lse_p, _ = emulate_decode(q, k, v, plan.args[2], n, scale, page_table,
                                             seqused_k, tile_n=plan.config.tile_n,
                                             cu_seqlens_q=cu, max_seqlen_q=max_q,
                                             window_left=left, page_box=plan.config.page_box)
            if n == 1 and out.dtype != torch.float32:
                out.copy_(out_p[0])
                lse.copy_(lse_p[0])
            else:
                out.copy_(out_p)
                lse.copy_(lse_p)

        def combine(out_p, lse_p, out, lse, target=None):
            m_out, m_lse = merge_splits(out_p, lse_p)
            out.copy_(m_out)
            lse.copy_(m_lse)

        monkeypatch.setattr(prologue, "backend_for", lambda device: dispatch.HOPPER)
        monkeypatch.setattr(prologue, "_BACKENDS", {})
        monkeypatch.setattr(decode_entry, "compiled", lambda fn, *args: Plan(args))
        monkeypatch.setattr(decode_entry, "launch_decode", launch)
        monkeypatch.setattr(decode_entry, "combine_own_partials", combine)
        monkeypatch.setattr(decode_entry, "num_sms", lambda device: 132)


def _close(got, want, what):
    assert_close_to_float64(got, want, what)


@pytest.mark.parametrize("splits", [1, 0, 3])
def test_the_path_with_the_kernel_emulated_equals_float64(monkeypatch, splits):
    """Paged (dense and packed q, a left window, seqused_k with 0 and 1), contiguous
    (flash_attn_func, routed) and api.sdpa, each split as asked, against
    tests.decode_reference's float64 answer."""
    from tests.decode_reference import decode_reference, varlen_decode_reference

    emu = Emulated(monkeypatch)
    lengths = (0, 1, 77, 300)
    t = paged(batch=4, sq=3, h=8, hk=2, d=64, page=32, num_pages=40, max_pages=10,
              lengths=lengths)
    with torch.no_grad():
        out, lse = _varlen_call(t, causal=True, window_size=(40, None), num_splits=splits,
                                return_lse=True)
        want = decode_reference(t["q"], t["k"], t["v"], True, page_table=t["page_table"],
                                seqused_k=t["seqused_k"], window_left=40)
        _close(out, want[0], "paged out")
        _close(lse, want[1], "paged lse")
        out, lse = _sdpa_call(t, causal=True, window_size_left=40, num_splits=splits,
                              return_lse=True)
        _close(out, want[0], "sdpa out")
        tv = paged(batch=4, sq=3, h=8, hk=2, d=64, page=32, num_pages=40, max_pages=10,
                   lengths=lengths, varlen=True)
        out, lse = _varlen_call(tv, causal=True, max_seqlen_q=3, num_splits=splits,
                                return_lse=True)
        want = varlen_decode_reference(tv["q"], tv["k"], tv["v"], tv["cu_seqlens_q"], True,
                                       page_table=tv["page_table"], seqused_k=tv["seqused_k"])
        _close(out, want[0], "packed out")
        _close(lse, want[1], "packed lse")
        q, k, v = dense(b=2, sq=4, sk=300, h=8, hk=2)
        out, lse = flash_attn_func(q, k, v, causal=True, num_splits=splits, return_lse=True)
        want = decode_reference(q, k, v, True)
        _close(out, want[0], "contiguous out")
        _close(lse, want[1], "contiguous lse")
    assert len(emu.splits) == 4
    if splits == 1:
        assert emu.splits == [1, 1, 1, 1]
    elif splits == 3:
        assert emu.splits == [3, 3, 3, 3]
    else:  # the heuristic: 300 keys are 3 tiles of 128 (pages of 32 keys are gathered into
        # whole tiles), too few to split; test_the_compile_keys_build_the_decode_recipes splits
        assert emu.splits == [1, 1, 1, 1], emu.splits


def test_compile_fullgraph_of_a_paged_and_a_routed_call(monkeypatch):
    """torch.compile(fullgraph=True) sees the op (fa4_final::decode_fwd) with no graph break;
    the compiled call's values are checked when it runs (a page past the cache named) and its
    answer is the eager one."""
    emu = Emulated(monkeypatch)
    torch._dynamo.reset()
    t = paged(batch=3, sq=2, h=8, hk=2, d=64, page=32, num_pages=12, max_pages=4,
              lengths=(5, 0, 128))
    q, k, v = dense(b=2, sq=2, sk=100)

    def step(t, q, k, v):
        a, lse = flash_attn_varlen_func(t["q"], t["k"], t["v"], page_table=t["page_table"],
                                        seqused_k=t["seqused_k"], causal=True, num_splits=2,
                                        return_lse=True)
        b, _ = flash_attn_func(q, k, v, causal=True, num_splits=0)
        return a, lse, b

    with torch.no_grad():
        want = step(t, q, k, v)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(t, q, k, v)
        for x, y in zip(got, want):
            assert torch.equal(x, y)
        assert len(emu.splits) == 4
        t["page_table"][2, 3] = 12
        with pytest.raises(ValueError, match=r"page_table\[2, 3\] = 12 is not a page"):
            torch.compile(step, fullgraph=True, backend="aot_eager")(t, q, k, v)
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_api_s_widest_decode_key_compiles_for_sm_90a(monkeypatch):
    """The key a paged call with every choice on builds (64-key pages: tile_n 64 and 6 stages,
    seqused_k, packed queries, a left window, split) compiles for sm_90a from fake tensors:
    no local memory, the TMA loads and wgmma present (one compile, tens of seconds)."""
    from fa4_final.runtime.compile import artifacts

    rec = Launches(monkeypatch)
    i32 = torch.int32
    pq, pk = _meta(10, 16, 64), _meta(40, 64, 4, 64)
    decode_entry.run_decode(pq, pk, pk, _meta(10, 16, 64), _meta(16, 10, dtype=torch.float32),
                            _meta(4, 8, dtype=i32), _meta(4, dtype=i32), _meta(5, dtype=i32), 4,
                            True, 0.1, 9, 3)
    (_, recipe_fn, args), = [c for c in rec.calls if c[0] == "compiled"]
    assert args == (64, "bf16", True, True, True, True, HopperDecodeConfig(page_box=64),
                    True, True)
    art = artifacts(recipe_fn(*args))["main"]
    assert art.spills == 0 and art.frame_bytes == 0, art.resources()
    art.require("cp.async.bulk.tensor", "wgmma.mma_async")


def test_decode_takes_two_consumer_warpgroups_above_64_packed_rows():
    """tokens x heads per KV head > 64: the config of two consumer warpgroups (a 128-row
    m-block, Note [Two consumer warpgroups]); 64 or fewer: one, the default."""
    k = _meta(2, 8192, 8, 128)

    def config(tokens, heads):
        args = decode_entry.decode_plan_args(_meta(2, tokens, heads, 128), k, None, None, None,
                                             None, False, None, 0, 132)[1]
        return args[6]  # the config, None for the default

    assert config(1, 32).consumers == 1 and config(8, 64).consumers == 1  # 4 and 64 rows
    assert config(16, 64).consumers == 2  # 128 rows: 16 tokens at GQA 8
    assert config(16, 128).consumers == 2 and config(16, 128).tile_m == 128  # 256 rows
    assert config(9, 64).consumers == 2  # 72 rows


def test_a_contiguous_cache_is_read_in_boxes_of_32_at_d128_only():
    """Note [Boxes of a contiguous cache]: without a page table, D = 128 fills each key tile
    from boxes of 32 keys (one and two consumer warpgroups alike); D = 64 and a paged cache
    keep their own boxes (one a tile for pages of whole tiles)."""
    def config(d, tokens, heads, paged=False):
        k = _meta(1 if paged else 2, 256 if paged else 8192, 8, d)
        table = torch.zeros(2, 32, dtype=torch.int32) if paged else None
        args = decode_entry.decode_plan_args(_meta(2, tokens, heads, d), k, table, None, None,
                                             None, False, None, 0, 132)[1]
        return args[6]  # None for the default

    assert config(128, 1, 32).page_box == 32 and config(128, 16, 64).page_box == 32
    assert config(128, 16, 64).consumers == 2
    assert config(64, 1, 32) is None and config(64, 16, 64).page_box is None
    assert config(128, 1, 32, paged=True) is None  # pages of 256 keys: one box a tile


# ----------------------------------------------------------------------------------------------
# the value checks read after the launch (Note [Paged KV checks])


class _ValuesRead:
    """A stand-in for runtime.decode.DeferredPagedCheck on a GPU: finish() logs (and raises when
    ``bad``)."""

    def __init__(self, log, bad):
        self.log, self.bad = log, bad

    def finish(self):
        self.log.append("values read")
        if self.bad:
            raise ValueError("page_table[2, 3] = 12 is not a page of the cache")


@pytest.mark.parametrize("bad", [False, True], ids=["good", "bad"])
def test_every_entry_reads_the_values_after_the_launch(monkeypatch, bad):
    """On a GPU the page table's value checks are launched before the decode kernel and read
    after it, so their synchronisation waits for the kernel instead of holding it back; a bad
    value still raises, after a launch that cannot fault (the kernel clamps each length to the
    table's row, and a page out of range is a TMA box out of bounds). Every entry that takes a
    page table, with the device and the kernel replaced by recorders: the values are read after
    the launch, never before it (on a CPU the calls take the custom op, whose body reads them
    again, as a torch.compile'd call's does), and a bad one raises the check's error."""
    from types import SimpleNamespace

    log = []
    monkeypatch.setattr(decode_entry, "start_paged_kv_check",
                        lambda pt, used, paged_kv, check_values=None: (
                            decode_entry.DeferredPagedCheck() if check_values is False
                            else _ValuesRead(log, bad)))
    monkeypatch.setattr(decode_entry, "cached_backend", lambda device: SimpleNamespace(
        family="Hopper", target="sm_90a", label="H100 (sm_90)"))
    monkeypatch.setattr(decode_entry, "run_decode", lambda *a, **k: log.append("launch"))
    with torch.no_grad():
        for func, call in _entries():
            log.clear()
            if bad:
                with pytest.raises(ValueError, match="is not a page of the cache"):
                    call()
            else:
                call()
            assert log[0] == "launch" and set(log[1:]) == {"values read"}, (func, log)


def test_the_eager_path_checks_what_the_public_function_left_and_nothing_twice(monkeypatch):
    """decode_checked (the eager path of a checked public call, Note [The eager path]) checks
    the TMA base addresses, which the public function's check_inputs(check_address=False) left,
    with check_tma_operand's error; then the device. The plan of a shape is computed once
    (decode_plan_args remembers it): a decoding loop asks the same shape every step."""
    t = paged()
    buf = torch.empty(t["q"].numel() + 1, dtype=BF16)
    q = buf[1:].view(t["q"].shape)  # 2 bytes past a 16-byte boundary
    q.copy_(t["q"])
    k = torch.randn(3, 300, 2, 64).to(BF16)
    with pytest.raises(ValueError, match=r"q.*address % 16 = 2"):
        decode_entry.decode_checked("flash_attn_func", q, k, k, None, None, None, None, 0.125,
                                    True, None, 0)
    with pytest.raises(UnsupportedError, match=DEVICE):
        decode_entry.decode_checked("flash_attn_func", t["q"], k, k, None, None, None, None,
                                    0.125, True, None, 0)
    decode_entry._plan.cache_clear()
    for _ in range(3):
        decode_entry.decode_plan_args(t["q"], k, None, None, None, None, True, None, 0, 132)
    info = decode_entry._plan.cache_info()
    assert (info.misses, info.hits) == (1, 2), info


def test_what_the_paged_host_check_cost_is_what_the_stored_runs_say():
    """Note [Paged KV checks] and the README: with the host check on every call (the H100 run
    stored as decode_api_checked) a paged call took 738 us against the kernel's 360 at batch
    32, 8k keys, one token (about twice), and 240 against 29 at batch 1, L2 flushed; without it
    (decode_api) the paged call is within 3% of the paged kernel there."""
    from utils import results

    def ms(res, impl, b):
        row, = [r for r in res.rows if r["impl"] == impl and r.get("b") == b
                and r.get("s") == 8192 and r.get("s_q") == 1 and r.get("mode") == "flush"]
        return row["ms"] * 1000

    checked = results.load("decode_api_checked", gpu="h100")
    assert round(ms(checked, "fa4_final_paged", 32)) == 738
    assert round(ms(checked, "fa4_final_decode_paged", 32)) == 360
    assert round(ms(checked, "fa4_final_paged", 1)) == 240
    assert round(ms(checked, "fa4_final_decode_paged", 1)) == 29
    assert 1.9 < ms(checked, "fa4_final_paged", 32) / ms(checked, "fa4_final_decode_paged", 32)
    now = results.load("decode_api", gpu="h100")
    assert ms(now, "fa4_final_paged", 32) / ms(now, "fa4_final_decode_paged", 32) < 1.03
