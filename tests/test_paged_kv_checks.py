"""A paged KV cache's checks (fa4_final.runtime.decode, Note [Paged KV checks]) and its address
arithmetic, on CPU tensors: every bad input gets an error that names the argument, the value and
what is accepted; the used pages' values are checked, padding columns are not; a gather by
paged_key_row equals the contiguous cache bit for bit."""

import pytest
import torch

from fa4_final.runtime.decode import (
    PagedKV,
    check_num_splits,
    check_paged_kv,
    gather_pages,
    paged_key_row,
)

NUM_PAGES, PAGE, HK, D = 12, 16, 2, 64


def _cache(num_pages=NUM_PAGES, page=PAGE, hk=HK, d=D, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_pages, page, hk, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page, hk, d, generator=g).to(dtype)
    return k, v


def _table():
    """3 sequences, 4 page slots each: 0, 17 and 64 keys used; unused slots hold -1."""
    table = torch.tensor([[-1, -1, -1, -1], [5, 0, -1, -1], [11, 3, 7, 2]], dtype=torch.int32)
    used = torch.tensor([0, 17, 64], dtype=torch.int32)
    return table, used


def test_a_good_cache_passes():
    k, v = _cache()
    table, used = _table()
    paged = check_paged_kv(k, v, table, used, batch=3)
    assert paged == PagedKV(NUM_PAGES, PAGE, 4) and paged.capacity == 64


def _raises(error, says, k=None, v=None, table=None, used=None, batch=3, **kw):
    k0, v0 = _cache()
    t0, u0 = _table()
    with pytest.raises(error, match=says):
        check_paged_kv(k0 if k is None else k, v0 if v is None else v,
                       t0 if table is None else table, u0 if used is None else used, batch, **kw)


def test_a_page_past_the_cache():
    table, _ = _table()
    table[2, 1] = NUM_PAGES
    _raises(ValueError, r"page_table\[2, 1\] = 12 is not a page of the cache: k and v hold 12 "
                        r"pages, so the pages a sequence uses must be in \[0, 12\) \(sequence 2 "
                        r"uses its first 4 entries: seqused_k\[2\] = 64, page_size 16\)",
            table=table)


def test_a_negative_page_in_use():
    table, _ = _table()
    table[1, 1] = -1  # sequence 1 uses 2 pages (17 keys)
    _raises(ValueError, r"page_table\[1, 1\] = -1 is not a page", table=table)


def test_the_first_bad_page_is_named():
    table, _ = _table()
    table[2, 3] = 99
    table[1, 0] = 40
    _raises(ValueError, r"page_table\[1, 0\] = 40", table=table)


def test_padding_columns_may_hold_anything():
    k, v = _cache()
    table, used = _table()
    table[1, 2:] = 2**31 - 1
    table[0, :] = -7
    check_paged_kv(k, v, table, used, batch=3)


def test_seqused_k_over_the_page_table():
    _, used = _table()
    used[1] = 65
    _raises(ValueError, r"seqused_k\[1\] = 65 must be in \[0, 64\] \(max_pages 4 x page_size "
                        r"16: the keys page_table row 1 can map\)", used=used)


def test_seqused_k_negative():
    _, used = _table()
    used[0] = -1
    _raises(ValueError, r"seqused_k\[0\] = -1 must be in \[0, 64\]", used=used)


def test_value_checks_can_be_skipped(monkeypatch):
    k, v = _cache()
    table, used = _table()
    table[2, 0] = 1000
    check_paged_kv(k, v, table, used, 3, check_values=False)
    monkeypatch.setenv("FA4_FINAL_VARLEN_CHECKS", "0")
    check_paged_kv(k, v, table, used, 3)  # the varlen checks' switch turns these off too
    with pytest.raises(ValueError, match="1000"):
        check_paged_kv(k, v, table, used, 3, check_values=True)


@pytest.mark.parametrize("page", [8, 24, 40, 0])
def test_page_size_a_multiple_of_16(page):
    k, v = _cache(page=max(page, 1))
    if page == 0:
        k, v = k[:, :0], v[:, :0]
    _raises(ValueError, rf"page_size \(k.shape\[1\]\) must be a positive multiple of 16, got "
                        rf"{page}", k=k, v=v)


@pytest.mark.parametrize("page", [16, 32, 48, 128, 256])
def test_page_sizes_accepted(page):
    k, v = _cache(num_pages=4, page=page)
    table = torch.tensor([[0, 3]], dtype=torch.int32)
    check_paged_kv(k, v, table, torch.tensor([2 * page], dtype=torch.int32), 1)


def test_page_table_dtype():
    table, _ = _table()
    _raises(TypeError, "page_table must have dtype torch.int32, got torch.int64",
            table=table.long())
    _raises(TypeError, "page_table must be a torch.Tensor of int32, got list",
            table=table.tolist())


@pytest.mark.parametrize("shape, says", [
    ((12,), r"got shape \(12,\)"), ((2, 4), r"got shape \(2, 4\)"),
    ((3, 4, 1), r"got shape \(3, 4, 1\)")])
def test_page_table_shape(shape, says):
    _raises(ValueError, r"page_table must be 2-D \(batch, max_pages\) = \(3, max_pages\), " + says,
            table=torch.zeros(shape, dtype=torch.int32))


def test_page_table_device():
    table = torch.zeros((3, 4), dtype=torch.int32, device="meta")
    _raises(ValueError, "page_table must be on k's device cpu, got meta", table=table)


def test_seqused_k_optional_and_checked():
    """No seqused_k: each sequence uses its row's every page (FA4's reading), so every entry
    of the table must be a page of the cache."""
    k, v = _cache()
    table, used = _table()
    full = torch.zeros_like(table)
    assert check_paged_kv(k, v, full, None, 3, check_values=True).capacity == \
        full.shape[1] * k.shape[1]
    bad = full.clone()
    bad[1, -1] = k.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[1, .*no seqused_k: every entry"):
        check_paged_kv(k, v, bad, None, 3, check_values=True)
    _raises(TypeError, "seqused_k must have dtype torch.int32, got torch.int64", used=used.long())
    _raises(ValueError, r"seqused_k must have shape \(3,\)", used=used[:2])
    _raises(ValueError, "seqused_k must be on k's device cpu, got meta",
            used=torch.zeros(3, dtype=torch.int32, device="meta"))


def test_not_with_cu_seqlens_k():
    _raises(ValueError, "page_table is not supported with cu_seqlens_k",
            cu_seqlens_k=torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("which", ["k", "v"])
def test_cache_shape(which):
    k, v = _cache()
    bad = {which: (k if which == "k" else v).reshape(NUM_PAGES * PAGE, HK, D)}
    _raises(ValueError, rf"with a page_table, {which} must be 4-D \(num_pages, page_size, "
                        rf"heads_kv, head_dim\), got shape \(192, 2, 64\)", **bad)


def test_k_and_v_alike_and_not_empty():
    k, v = _cache()
    _raises(ValueError, "k and v must have the same", v=v[:6])
    _raises(ValueError, "hold no page", k=k[:0], v=v[:0])


@pytest.mark.parametrize("value", [True, 2.0, "2"])
def test_num_splits_refused_with_its_value(value):
    with pytest.raises(TypeError, match=f"got {value!r}"):
        check_num_splits(value)


# ----------------------------------------------------------------------------------------------
# the address arithmetic


def test_paged_key_row():
    row = [7, 2, 9]
    assert paged_key_row(row, 16, 0) == (7, 0)
    assert paged_key_row(row, 16, 15) == (7, 15)
    assert paged_key_row(row, 16, 16) == (2, 0)
    assert paged_key_row(row, 16, 47) == (9, 15)
    assert paged_key_row(torch.tensor(row, dtype=torch.int32), 32, 40) == (2, 8)
    with pytest.raises(ValueError, match="key_index 48 is outside the 3 pages of 16 keys"):
        paged_key_row(row, 16, 48)
    with pytest.raises(ValueError, match="key_index -1"):
        paged_key_row(row, 16, -1)


@pytest.mark.parametrize("page", [16, 48, 128])
def test_paged_equals_contiguous_bit_for_bit(page):
    """A contiguous cache scattered into shuffled pages and gathered back by the page table is
    the same bits, for every sequence length (partial last pages included)."""
    g = torch.Generator().manual_seed(page)
    batch, max_pages = 3, 5
    lengths = [1, page * 3 + 5, page * max_pages]
    dense = torch.randn(batch, page * max_pages, HK, D, generator=g).to(torch.bfloat16)
    num_pages = batch * max_pages + 4  # spare pages that nobody uses
    order = torch.randperm(num_pages, generator=g)[:batch * max_pages].to(torch.int32)
    table = order.reshape(batch, max_pages)
    cache = torch.full((num_pages, page, HK, D), float("nan"), dtype=torch.bfloat16)
    for b in range(batch):
        for key in range(lengths[b]):
            p, r = paged_key_row(table[b], page, key)
            cache[p, r] = dense[b, key]
    check_paged_kv(cache, cache, table, torch.tensor(lengths, dtype=torch.int32), batch)
    for b in range(batch):
        got = gather_pages(cache, table[b], lengths[b])
        assert torch.equal(got.view(torch.int16), dense[b, :lengths[b]].view(torch.int16))


def test_fake_tensors_skip_the_value_checks():
    """Under torch.compile's tracing the tensors have no values: the metadata is checked, the
    values are left to the eager call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        k, v = _cache()
        table = torch.full((3, 4), 10**6, dtype=torch.int32)
        used = torch.tensor([0, 17, 64], dtype=torch.int32)
        assert check_paged_kv(k, v, table, used, 3).capacity == 64
        with pytest.raises(TypeError, match="page_table must have dtype torch.int32"):
            check_paged_kv(k, v, table.long(), used, 3)


# ----------------------------------------------------------------------------------------------
# the deferred value check (DeferredPagedCheck: reductions launched, four numbers read later)


def _verdict(fn, *args):
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return None


def test_deferred_check_agrees_with_the_detailed_check_on_random_tables():
    """Random tables and lengths, most of them good, some with a page past the cache or below
    0 in a used or an unused column, a length below 0 or past the capacity, with and without
    seqused_k: the reductions' verdict is the detailed check's, and a bad call raises the
    detailed check's very message (the first bad value named)."""
    from fa4_final.runtime.decode import DeferredPagedCheck, check_paged_kv_values

    g = torch.Generator().manual_seed(3)
    bad_calls = 0
    for trial in range(400):
        batch = int(torch.randint(1, 6, (), generator=g))
        max_pages = int(torch.randint(0, 6, (), generator=g))
        page, num_pages = 16, int(torch.randint(1, 9, (), generator=g))
        paged = PagedKV(num_pages, page, max_pages)
        table = torch.randint(0, num_pages, (batch, max_pages), generator=g, dtype=torch.int32)
        used = torch.randint(0, paged.capacity + 1, (batch,), generator=g, dtype=torch.int32)
        kind = trial % 8
        if kind == 1 and max_pages:
            table[torch.randint(0, batch, (), generator=g), -1] = num_pages  # maybe unused
        elif kind == 2 and max_pages:
            table[0, 0] = -1
        elif kind == 3:
            used[-1] = paged.capacity + 1
        elif kind == 4:
            used[0] = -3
        seqused = None if kind == 5 else used
        want = _verdict(check_paged_kv_values, table, seqused, paged)
        got = _verdict(DeferredPagedCheck.start(table, seqused, paged).finish)
        assert got == want, (trial, table.tolist(), used.tolist(), kind)
        bad_calls += want is not None
    assert 40 < bad_calls < 300, bad_calls


def test_deferred_check_launches_a_few_kernels_and_reads_four_numbers():
    """What the launch path pays: with seqused_k, aminmax of the lengths, the column starts, one
    compare, one select, aminmax of the entries and one stack (six operations that make a
    kernel on a GPU; views aside); without, two; then one copy of four numbers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fa4_final.runtime.decode import DeferredPagedCheck

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.split("::")[1] not in VIEWS:
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    # views, and the 0-d host tensor torch.where wraps its Python 0 in (no kernel either)
    VIEWS = {"unsqueeze", "slice", "view", "alias", "select", "expand", "unbind", "detach",
             "lift_fresh", "scalar_tensor"}
    k, v = _cache()
    table, used = _table()
    paged = check_paged_kv(k, v, table, used, 3, check_values=False)
    # without seqused_k every column is in use: no padding -1 then
    for tab, seqused, most in ((table, used, 6), (table.clamp(min=0), None, 3)):
        with Count() as count:
            values = DeferredPagedCheck.start(tab, seqused, paged)
        assert len(count.ops) <= most, count.ops
        assert values.summary.shape == (4,)
        values.finish()
