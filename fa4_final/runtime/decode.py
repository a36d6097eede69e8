"""Decoding's arguments and its combine launch: how many splits, a paged KV cache checked, the
split partials merged.

A decode step asks for few query rows (1-16 tokens) against a long KV cache, so one CTA per
(batch, kv head) leaves most SMs idle while the cache is read once. Split-KV cuts each key range
into ``num_splits`` pieces, one CTA each, and merges their float32 partials afterwards
(fa4_final.common.combine). The arguments keep FA4's meaning:

- ``num_splits``: an int; < 1 lets the heuristic choose (Note [Split count]), 1 means no split,
  n > 1 asks for n splits, capped by the key tiles there are (a split gets at least one) and by
  the combine's MAX_SPLITS. A speed knob only: the result does not depend on it beyond rounding.
- ``page_table``: (batch, max_pages) int32 with k and v as (num_pages, page_size, heads_kv, d),
  passed to the varlen entry with ``seqused_k`` (sequence b's keys are the first seqused_k[b]
  rows of the pages page_table[b, 0], page_table[b, 1], ...). Note [Paged KV checks] says what
  is checked and when.

``paged_key_row`` is the page-table address arithmetic as a pure function: the kernel's gather
and the tests use the same rule.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import torch

from fa4_final.common.combine import MAX_SPLITS
from fa4_final.common.constants import DTYPE_NAMES, HEAD_DIMS, TORCH_TO_CUTLASS
from fa4_final.common.errors import UnsupportedError

PAGE_ALIGN = 16  # page sizes in keys: a page edge never cuts the 16 keys of one P V wgmma step
MIN_TILES_PER_SPLIT = 2  # a split's fixed cost (prologue, partial) spread over >= 2 key tiles
PARTIAL_SHARE = 4  # a split reads >= 4x the bytes of the partial it writes and the combine reads
CTAS_PER_SM = 1  # the CTAs per SM the split count aims at (Note [Split count])

# ----------------------------------------------------------------------------------------------
# num_splits


def check_num_splits(num_splits) -> int:
    """``num_splits`` as an int: any int is accepted (< 1: the heuristic, 1: no split, n > 1: n
    splits); a bool, a float or anything else is refused."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (< 1: chosen by a heuristic, 1: no split, "
                        f"n > 1: n splits), got {num_splits!r} ({type(num_splits).__name__})")
    return int(num_splits)


def min_tiles_per_split(packed_rows: int, tile_m: int, tile_n: int) -> int:
    """The fewest key tiles a split should walk: MIN_TILES_PER_SPLIT, or more when the rows of a
    CTA make its float32 partial large next to its keys (Note [Split count])."""
    rows = max(1, min(packed_rows, tile_m))
    # partial: rows x dv x 4 B written and read again = 8 rows dv; keys: tiles x tile_n x dv
    # x 2 B for K and V each = 4 tiles tile_n dv; ask 4 tiles tile_n >= PARTIAL_SHARE x 8 rows
    return max(MIN_TILES_PER_SPLIT, -(-PARTIAL_SHARE * 8 * rows // (4 * tile_n)))


# Note [Split count]
# A decode step is memory-bound: its time is the KV cache's bytes over the bandwidth the SMs
# draw, and an SM with no CTA draws none. Without splits there are
#     ctas = batch x heads_kv x ceil(packed_rows / tile_m)
# CTAs, packed_rows being the query rows of one (batch, kv head) with its query heads packed
# into the tile (seqlen_q x heads / heads_kv). The heuristic (num_splits < 1):
#   1. ctas >= num_sms x CTAS_PER_SM: every SM has work already; no split (a split only adds
#      its partial's traffic and the combine).
#   2. else the most splits whose CTAs all find a slot at once: floor(num_sms x CTAS_PER_SM /
#      ctas). Not the ceiling: at batch 1 and 8 kv heads that is 17 splits, 136 CTAs for 132
#      SMs, and four SMs then stream two CTAs' keys while the others stream one; the step
#      takes as long as those four. On an H100 that shape (128k keys) reached 68-76% of the
#      copy rate with 17 splits where cuDNN reached about 90% (the decode grid measurement);
#      16 splits leave 4 SMs idle (3% of them) and none doubled;
#   3. capped so that each split walks at least min_tiles_per_split key tiles: its fixed cost
#      (prologue, the partial written in float32 and read back by the combine, 8 B per row and
#      column) stays a small share of the 4 B per key and column of K and V it reads;
#   4. capped by MAX_SPLITS (the combine's bound);
#   5. evened: with t = ceil(key_tiles / splits) tiles per split, ceil(key_tiles / t) splits,
#      so no split is empty when the kernel gives each split t tiles (FA4's cut: the last
#      split takes the rest). Evening can only lower the count, and by little on long caches:
#      ceil(T / t) > splits T / (T + splits) >= 0.8 splits once T >= 4 splits.
# The decode benchmark is the judge of the constants: CTAS_PER_SM = 1 (FA4 aims at one CTA per
# SM too, although a decode CTA may fit twice), 2 tiles and a quarter for the partial. FA4's own
# rule (floor(num_sms / ctas), no split at <= 4 key tiles) differs in 3 and 5.


def choose_num_splits(num_splits: int, *, batch: int, heads_kv: int, packed_rows: int,
                      key_tiles: int, num_sms: int, tile_m: int = 64, tile_n: int = 128) -> int:
    """The number of splits a call runs: ``num_splits`` as FA4 reads it (< 1: the heuristic of
    Note [Split count], 1: none, n > 1: n), capped by ``key_tiles`` (tiles of ``tile_n`` keys of
    the longest sequence) and MAX_SPLITS; always >= 1. ``heads_kv`` and ``packed_rows`` as the
    kernel tiles the queries: with GQA packing the kv heads and seqlen_q x heads / heads_kv,
    without it the query heads and seqlen_q."""
    num_splits = check_num_splits(num_splits)
    for name, value in (("batch", batch), ("heads_kv", heads_kv), ("packed_rows", packed_rows),
                        ("key_tiles", key_tiles), ("num_sms", num_sms), ("tile_m", tile_m),
                        ("tile_n", tile_n)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if min(tile_m, tile_n, num_sms) < 1:
        raise ValueError(f"tile_m, tile_n and num_sms must be >= 1, got {tile_m}, {tile_n}, "
                         f"{num_sms}")
    cap = max(1, min(key_tiles, MAX_SPLITS))
    if num_splits >= 1:
        return min(num_splits, cap)
    ctas = batch * heads_kv * -(-packed_rows // tile_m)
    slots = num_sms * CTAS_PER_SM
    if ctas == 0 or ctas >= slots:
        return 1
    splits = slots // ctas  # Note [Split count], 2: one wave, no SM given two CTAs' keys
    splits = min(splits, key_tiles // min_tiles_per_split(packed_rows, tile_m, tile_n),
                 MAX_SPLITS)
    if splits <= 1:
        return 1
    per_split = -(-key_tiles // splits)
    return -(-key_tiles // per_split)


def split_ranges(key_tiles: int, num_splits: int) -> list[tuple[int, int]]:
    """[first, last) key tiles of each split: the first ones take ceil(key_tiles / num_splits)
    tiles each; with lengths that differ per sequence some splits may be empty (first == last),
    which the combine weighs 0."""
    per = -(-key_tiles // num_splits) if num_splits else 0
    return [(min(s * per, key_tiles), min((s + 1) * per, key_tiles)) for s in range(num_splits)]


# ----------------------------------------------------------------------------------------------
# paged KV


def paged_key_row(page_table_row, page_size: int, key_index: int) -> tuple[int, int]:
    """(page, row) where key ``key_index`` of a sequence lives: page_table_row[key_index //
    page_size] and key_index % page_size, so the key is k[page, row]. The kernel's gather does
    this arithmetic."""
    slot, row = divmod(key_index, page_size)
    if key_index < 0 or slot >= len(page_table_row):
        raise ValueError(f"key_index {key_index} is outside the {len(page_table_row)} pages of "
                         f"{page_size} keys this page_table row maps (keys 0 .. "
                         f"{len(page_table_row) * page_size - 1})")
    return int(page_table_row[slot]), row


def gather_pages(cache: torch.Tensor, page_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` keys (or values) of one sequence, contiguous: (length, heads_kv, d)
    from a (num_pages, page_size, heads_kv, d) cache, by paged_key_row's rule, vectorised."""
    index = torch.arange(length, device=page_table_row.device)
    pages = page_table_row.long()[index // cache.shape[1]]
    return cache[pages.to(cache.device), (index % cache.shape[1]).to(cache.device)]


@dataclass(frozen=True)
class PagedKV:
    num_pages: int
    page_size: int
    max_pages: int  # page_table's columns

    @property
    def capacity(self) -> int:
        """Keys a sequence can hold: max_pages x page_size."""
        return self.max_pages * self.page_size


# Note [Paged KV checks]
# What a page table must be, checked before any kernel sees it (errors name the argument, the
# value and what is accepted):
#   - metadata, free (also on fake tensors): page_table an int32 (batch, max_pages) tensor on k's
#     device; k and v (num_pages, page_size, heads_kv, d) alike, num_pages >= 1, page_size a
#     positive multiple of 16; seqused_k, when given, int32, (batch,), on k's device (None:
#     each sequence uses its table row's every page, max_pages x page_size keys, as in FA4); no
#     cu_seqlens_k (FA4 takes one or the other);
#   - values: each seqused_k[b] in [0, max_pages x page_size], and every page a sequence uses
#     (columns 0 .. ceil(seqused_k[b] / page_size) - 1 of row b; every column without
#     seqused_k) in [0, num_pages). Columns past
#     a sequence's last used page are never read and may hold anything (engines pad them with
#     -1 or 0).
# FA4 checks the metadata with asserts and the values not at all: a page past the cache is not
# caught there (a gathered load reads out of bounds, a TMA load clips it to zeros). Here a bad
# value can neither fault nor pass as an answer, and finding it stops nothing:
#   - the launch is safe on any values: the kernel clamps each cached length to max_pages x
#     page_size, so it never reads a page-table slot past its row, and a page index out of
#     range is a TMA box out of bounds, which the hardware fills with zeros;
#   - the kernel looks at the values it uses (Note [Out-of-range pages give NaN] in
#     fa4_final.hopper.decode): a sequence whose seqused_k is out of range, or a page it reads
#     that is not a page of the cache, gets NaN in every row of out and lse (through the split
#     combine too: Note [A NaN split poisons the row] in fa4_final.common.combine);
#   - the error that names the bad value is a host check, asked for with
#     FA4_FINAL_PAGED_CHECKS=1 (or check_values=True): a few reductions on the device (the
#     extremes of seqused_k and of the page entries in use: DeferredPagedCheck), launched
#     before the kernel, and one copy of four numbers to the host after its launch; only when
#     they are out of range does check_paged_kv_values look for the first bad value to name it.
#     That copy waits for the kernel, so the host cannot queue the next call while the kernel
#     runs: measured on an H100 with the check on every call, a paged call took 738 us against
#     the kernel's 360 (batch 32, 8k keys, one query token, the L2 flushed) and 240 against 29
#     at batch 1, which is why it is not the default on a GPU.
# On tensors off a GPU (no kernel runs there, nothing to wait for) the values are checked at
# once. The check is skipped where values cannot be read or a synchronisation is not allowed:
# while torch.compile traces (fake tensors) and while a CUDA graph is being captured; and
# FA4_FINAL_VARLEN_CHECKS=0, the switch of the varlen checks, turns it off everywhere.


PAGED_CHECKS_ENV = "FA4_FINAL_PAGED_CHECKS"  # "1": name a bad page on the host (Note above)


def _index_tensor(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on k's device {device}, got {t.device}")


def check_paged_kv(k, v, page_table, seqused_k, batch: int, cu_seqlens_k=None,
                   check_values: bool | None = None) -> PagedKV:
    """Validate a paged KV cache (Note [Paged KV checks]); return its sizes. ``batch``: the
    number of sequences (cu_seqlens_q's entries - 1). ``check_values``: None checks the values
    where wants_value_checks says; True or False forces."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"with a page_table, {name} must be 4-D (num_pages, page_size, "
                             f"heads_kv, head_dim), got shape {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (num_pages, page_size, heads_kv), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    num_pages, page_size = k.shape[0], k.shape[1]
    if num_pages < 1:
        raise ValueError(f"k and v hold no page (shape {tuple(k.shape)}): a paged cache needs "
                         f"num_pages >= 1")
    if page_size < 1 or page_size % PAGE_ALIGN:
        raise ValueError(f"page_size (k.shape[1]) must be a positive multiple of {PAGE_ALIGN}, "
                         f"got {page_size}")
    if cu_seqlens_k is not None:
        raise ValueError("page_table is not supported with cu_seqlens_k: pass seqused_k (the "
                         "used length of each sequence) and leave cu_seqlens_k None")
    _index_tensor("page_table", page_table, k.device)
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be 2-D (batch, max_pages) = ({batch}, max_pages), got "
                         f"shape {tuple(page_table.shape)}")
    if seqused_k is not None:  # None: every sequence uses all its row's pages (FA4's reading)
        _index_tensor("seqused_k", seqused_k, k.device)
        if seqused_k.dim() != 1 or seqused_k.shape[0] != batch:
            raise ValueError(f"seqused_k must have shape ({batch},) (one length per sequence), "
                             f"got {tuple(seqused_k.shape)}")
    paged = PagedKV(num_pages, page_size, page_table.shape[1])
    start_paged_kv_check(page_table, seqused_k, paged, check_values).finish()  # here, at once
    return paged


def wants_value_checks(check_values: bool | None, page_table, seqused_k) -> bool:
    """Whether a paged call's values are checked on the host (Note [Paged KV checks]):
    ``check_values`` when given; else never with FA4_FINAL_VARLEN_CHECKS=0 or where the values
    cannot be read now; else on a GPU only with FA4_FINAL_PAGED_CHECKS=1 (the kernel turns a
    bad value into NaN rows by itself), and always off one."""
    if check_values is not None:
        return check_values
    if os.environ.get("FA4_FINAL_VARLEN_CHECKS") == "0" or not _values_readable(
            page_table, *(() if seqused_k is None else (seqused_k,))):
        return False
    return page_table.device.type != "cuda" or os.environ.get(PAGED_CHECKS_ENV) == "1"


def _values_readable(*tensors) -> bool:
    """Whether the tensors' values can be read now: not while torch.compile traces (fake or
    meta tensors, no values) or a CUDA graph is being captured (no synchronisation allowed)."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling() or any(t.device.type == "meta" or is_fake(t)
                                            for t in tensors):
        return False
    return not (tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing())


@dataclass
class DeferredPagedCheck:
    """The value half of Note [Paged KV checks] in two steps: ``start`` launches reductions on
    the device (no synchronisation), ``finish`` copies their four numbers to the host and, when
    one is out of range, raises check_paged_kv_values's error naming the first bad value. An
    instance made with ``summary`` None checks nothing."""

    page_table: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    paged: PagedKV | None = None
    summary: torch.Tensor | None = None  # (min used, max used, min page, max page in use)

    @classmethod
    def start(cls, page_table, seqused_k, paged: PagedKV) -> DeferredPagedCheck:
        """Six small kernels at most: seqused_k's extremes, and the extremes of the entries in
        use (column j of row b when j x page_size < seqused_k[b]; every column without
        seqused_k), an entry not in use counted as page 0."""
        batch, max_pages = page_table.shape
        if batch == 0:
            return cls()
        parts = []
        if seqused_k is None:
            cap = torch.full((), paged.capacity, dtype=torch.int32, device=page_table.device)
            parts += [cap, cap]
            entries = page_table
        else:
            parts += list(torch.aminmax(seqused_k))
            starts = torch.arange(0, max_pages * paged.page_size, paged.page_size,
                                  dtype=torch.int32, device=page_table.device)
            entries = torch.where(starts[None, :] < seqused_k[:, None], page_table, 0)
        if max_pages:
            parts += list(torch.aminmax(entries))
        else:
            parts += [parts[0].new_zeros(()), parts[0].new_zeros(())]
        return cls(page_table, seqused_k, paged, torch.stack(parts))

    def finish(self) -> None:
        if self.summary is None:
            return
        lo_used, hi_used, lo_page, hi_page = self.summary.tolist()
        paged = self.paged
        if (lo_used < 0 or hi_used > paged.capacity or lo_page < 0
                or hi_page >= paged.num_pages):
            check_paged_kv_values(self.page_table, self.seqused_k, paged)  # names the value
            raise ValueError(f"page_table or seqused_k out of range (seqused_k in [{lo_used}, "
                             f"{hi_used}], pages in use in [{lo_page}, {hi_page}]; accepted: "
                             f"[0, {paged.capacity}] and [0, {paged.num_pages}))")


def start_paged_kv_check(page_table, seqused_k, paged: PagedKV,
                         check_values: bool | None = None) -> DeferredPagedCheck:
    """DeferredPagedCheck.start where wants_value_checks says the values are checked, else a
    check of nothing. Off a GPU (no kernel to overlap with) the check finishes here, so a bad
    value is named before anything else is looked at."""
    if not wants_value_checks(check_values, page_table, seqused_k):
        return DeferredPagedCheck()
    values = DeferredPagedCheck.start(page_table, seqused_k, paged)
    if page_table.device.type != "cuda":
        values.finish()
        return DeferredPagedCheck()
    return values


def check_paged_kv_values(page_table, seqused_k, paged: PagedKV) -> None:
    """The value half of Note [Paged KV checks] in detail, what DeferredPagedCheck falls back on
    when an extreme is out of range, to name the first bad value: reductions on the device, one
    copy of (first bad sequence, first bad page slot, its entry) to the host. ``seqused_k``
    None: each sequence uses every page of its row."""
    batch, max_pages = page_table.shape
    if batch == 0:
        return
    used = (torch.full((batch,), paged.capacity, dtype=torch.long, device=page_table.device)
            if seqused_k is None else seqused_k.long())
    big = batch * max(max_pages, 1)  # "none": past every index
    bad_len = (used < 0) | (used > paged.capacity)
    first_len = torch.where(bad_len, torch.arange(batch, device=used.device), big).min()
    first_page = torch.full((), big, dtype=torch.long, device=used.device)
    entry = torch.zeros((), dtype=torch.long, device=used.device)
    if max_pages:
        pages_used = (used.clamp(0, paged.capacity) + paged.page_size - 1) // paged.page_size
        cols = torch.arange(max_pages, device=page_table.device)
        in_use = cols[None, :] < pages_used[:, None]
        bad_page = in_use & ((page_table < 0) | (page_table >= paged.num_pages))
        slots = torch.arange(batch * max_pages, device=page_table.device)
        first_page = torch.where(bad_page.flatten(), slots, big).min()
        entry = page_table.flatten()[first_page.clamp(max=batch * max_pages - 1)].long()
    b_len, slot, value = torch.stack([first_len, first_page, entry]).tolist()
    if b_len < big:
        raise ValueError(f"seqused_k[{b_len}] = {int(seqused_k[b_len])} must be in [0, "
                         f"{paged.capacity}] (max_pages {max_pages} x page_size "
                         f"{paged.page_size}: the keys page_table row {b_len} can map)")
    if slot < big:
        b, col = divmod(slot, max_pages)
        n = paged.capacity if seqused_k is None else int(seqused_k[b])
        why = (f"seqused_k[{b}] = {n}, page_size {paged.page_size}" if seqused_k is not None
               else "no seqused_k: every entry of the row")
        raise ValueError(f"page_table[{b}, {col}] = {value} is not a page of the cache: k and v "
                         f"hold {paged.num_pages} pages, so the pages a sequence uses must be in "
                         f"[0, {paged.num_pages}) (sequence {b} uses its first "
                         f"{-(-n // paged.page_size)} entries: {why})")


# ----------------------------------------------------------------------------------------------
# the combine


def _combine_layout(out_partial, lse_partial, out, lse) -> tuple:
    """Check the combine's four tensors; return them in the dense layout (varlen: a batch of
    one) and the number of rows."""
    named = (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out),
             ("lse", lse))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != out.device:
            raise ValueError(f"{name} must be on out's device {out.device}, got {t.device}")
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("lse", lse)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if out.dtype not in TORCH_TO_CUTLASS:
        raise TypeError(f"out has dtype {out.dtype}; accepted: torch.bfloat16, torch.float16")
    varlen = out.dim() == 3
    if varlen:  # (n, total_q, h, dv), (n, h, total_q), (total_q, h, dv), (h, total_q)
        total_q, h, dv = out.shape
        shapes = {"out_partial": (out_partial.shape[0], total_q, h, dv),
                  "lse_partial": (lse_partial.shape[0], h, total_q), "lse": (h, total_q)}
    elif out.dim() == 4:
        b, sq, h, dv = out.shape
        shapes = {"out_partial": (out_partial.shape[0], b, sq, h, dv),
                  "lse_partial": (lse_partial.shape[0], b, h, sq), "lse": (b, h, sq)}
    else:
        raise ValueError(f"out must be (batch, seqlen_q, heads, dv) or, varlen, (total_q, "
                         f"heads, dv), got shape {tuple(out.shape)}")
    for name, t in named:
        if name != "out" and (t.dim() != len(shapes[name]) or tuple(t.shape) != shapes[name]):
            raise ValueError(f"{name} must have shape {shapes[name]} (num_splits first) for out "
                             f"of shape {tuple(out.shape)}, got {tuple(t.shape)}")
    n = out_partial.shape[0]
    if lse_partial.shape[0] != n:
        raise ValueError(f"out_partial has {n} splits but lse_partial {lse_partial.shape[0]}")
    if not 1 <= n <= MAX_SPLITS:
        raise ValueError(f"num_splits (out_partial.shape[0]) must be in [1, {MAX_SPLITS}], got "
                         f"{n}")
    if dv not in HEAD_DIMS:
        raise UnsupportedError(f"the combine runs head dims {HEAD_DIMS}, got dv = {dv}")
    for name, t in (("out_partial", out_partial), ("out", out)):
        bad = [st for st in t.stride()[:-1] if (st * t.element_size()) % 16]
        if t.numel() and (t.stride(-1) != 1 or bad or t.data_ptr() % 16):
            raise ValueError(f"{name} is read and written 16 bytes at a time: it needs a "
                             f"contiguous last dimension, the other strides multiples of 16 "
                             f"bytes and a 16-byte aligned address; got strides {t.stride()}, "
                             f"address % 16 = {t.data_ptr() % 16}")
    for name, t in (("lse_partial", lse_partial), ("lse", lse)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got strides {t.stride()}")
    out_partial, lse_partial, out, lse = _dense_layout(out_partial, lse_partial, out, lse)
    rows = out.shape[0] * out.shape[1] * out.shape[2]
    return out_partial, lse_partial, out, lse, rows


def _dense_layout(out_partial, lse_partial, out, lse) -> tuple:
    """The varlen layout ((total_q, h, dv) out) as the dense one with a batch of one; the
    dense layout as it is."""
    if out.dim() == 3:
        out_partial, lse_partial = out_partial.unsqueeze(1), lse_partial.unsqueeze(1)
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)
    return out_partial, lse_partial, out, lse


def _launch_combine(out_partial, lse_partial, out, lse, target: str) -> None:
    """The combine's compiled kernel for ``out``'s dv and dtype on ``target`` and for the
    split count (Note [Which combine a call runs]), launched on tensors in the dense layout."""
    from fa4_final.common.combine import combine_choice, combine_recipe
    from fa4_final.runtime.compile import compiled

    plan = compiled(combine_recipe, out.shape[-1], DTYPE_NAMES[out.dtype], target, False,
                    *combine_choice(out_partial.shape[0]))
    plan.kernels["main"](out_partial, lse_partial, out, lse)


def combine_splits(out_partial, lse_partial, out, lse, target: str | None = None):
    """Merge split partials into ``out`` and ``lse`` (fa4_final.common.combine's contract, dense
    or varlen layout), on the current stream with no host synchronisation. ``target``: the
    kernels' target ("sm_90a", "sm_100a"); None: the one for out's GPU. Returns (out, lse)."""
    op, lp, o, lse4, rows = _combine_layout(out_partial, lse_partial, out, lse)
    if rows == 0:
        return out, lse
    if target is None:
        from fa4_final.runtime.prologue import device_arch

        target = device_arch(out.device)
    _launch_combine(op, lp, o, lse4, target)
    return out, lse


def combine_own_partials(out_partial, lse_partial, out, lse, target: str) -> None:
    """combine_splits for partials made by partials_like for ``out`` and a non-empty ``out``
    and ``lse`` the caller has checked (shapes, dtypes, device): what the decode path launches
    on every split call, so it skips the checks of four tensors it made or checked, a host cost
    of every step (combine_splits keeps them for any other caller). ``out`` still gets the
    combine's 16-byte rule unless it is contiguous from an aligned address."""
    if not (out.is_contiguous() and out.data_ptr() % 16 == 0 and lse.stride(-1) == 1):
        combine_splits(out_partial, lse_partial, out, lse, target)
        return
    _launch_combine(*_dense_layout(out_partial, lse_partial, out, lse), target)


def partials_like(out, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty float32 (out_partial, lse_partial) for ``num_splits`` splits of ``out`` (dense
    (b, s, h, dv) or varlen (total_q, h, dv)), in the combine's layout."""
    if out.dim() == 4:
        b, sq, h, dv = out.shape
        lse_shape = (num_splits, b, h, sq)
    else:
        total_q, h, dv = out.shape
        lse_shape = (num_splits, h, total_q)
    f32 = dict(dtype=torch.float32, device=out.device)
    return torch.empty((num_splits, *out.shape), **f32), torch.empty(lse_shape, **f32)

