"""Benchmark attention at decode shapes: a few query tokens against a long KV cache.

    python -m measure.decode                                  # the whole grid, both modes
    python -m measure.decode --dims 128 --batch 32 --keys 8192 --tokens 1   # one shape
    python -m measure.decode --name decode_d64 --dims 64 --deadline 500

Shapes: ``--tokens`` query tokens per sequence (1, 4, 16), ``--keys`` cached keys (1k-128k),
``--batch`` sequences (1, 32, 128), ``--heads`` query/KV head pairs (32/8, 64/8: GQA 4 and 8),
``--dims`` (128, 64), bf16. Every query token sees the whole cache (no mask): SDPA aligns a
causal mask to the top left, so with more than one query token its causal call would compute
something else than a decoder's bottom-right one; a mask changes the bytes read by at most
``tokens`` keys.

Rows, all on the same q, k, v of a shape, interleaved in ``--rounds`` rounds (utils.bench):
  fa4_final           fa4_final.flash_attn_func (what a call of the package runs at the run's
                      commit: the decode kernel at a decode shape that needs no gradient,
                      Note [Decode through the API], since the decode row left the gate)
  fa4_final_paged     fa4_final.flash_attn_varlen_func with a page table over the same cache
                      (both with FA4's default num_splits = 1: one split)
  fa4_final_splits (and _paged_splits)   the same two calls with num_splits=0, the split
                      heuristic (Note [Split count]), as the FA4 package's _splits/_paged rows
  fa4_final_decode    the Hopper decode kernel (fa4_final.hopper.decode) launched directly
                      with the config the package gives a contiguous cache
                      (hopper.config.hopper_decode_contiguous, one consumer warpgroup),
                      ``--splits`` splits (0: the split heuristic's count, stored as ``splits``)
                      merged by the combine; before timing its output is compared with SDPA
                      flash's (``max_diff``)
  fa4_final_decode_paged   the same through the page table; ``bitwise_equal``: equal bit for bit
                      to the contiguous kernel on the cache in table order
  fa4_final_decode_keys_on_m (and _paged)   the same kernel with the keys on the wgmma M and
                      the packed rows on N (HopperDecodeConfig.swap_ab, rows_n from
                      hopper.config.hopper_decode_keys_on_m; Note [Keys on M]), a candidate
                      no call of the package reaches: ``max_diff`` to the 64-row kernel's out,
                      ``bitwise_equal`` as above
  fa4_package         the FA4 package's flash_attn_func as a user calls it (num_splits=1)
  fa4_package_splits  the same with num_splits=0 (its split heuristic)
  fa4_package_paged   its flash_attn_varlen_func with the page table (num_splits=0)
  sdpa_flash, sdpa_cudnn   PyTorch SDPA with one backend each (enable_gqa)
The page table maps each sequence's ``keys / page`` pages to a random permutation of the cache's
pages (a view of the same memory, ``--page`` keys per page), as a serving engine's allocator
leaves them; the contiguous rows read the cache in order.

Modes (the column ``mode``): ``flush``, the L2 overwritten before every call (one decode step at
a time, as a model runs it between other layers), and ``back_to_back`` (calls one after another
with nothing between; a cache that fits in L2 may then be read from it). At batch 1 and short
caches a call back to back waits for the host (the Python of its API, its launches); opt-in
``--modes graph`` times each call captured once in a CUDA graph and replayed back to back, as
a serving engine replays a decode step: no host work in the time, and a call that cannot be
captured gets a row saying why (measure._modes.graphed).

Bytes and the memory roofline: a row's ``kv_bytes`` is what the cache holds for the shape (K and
V, every sequence and KV head); ``read_tbps`` = kv_bytes / time, and ``of_copy`` divides it by the
copy rate measured in the same run (``copy`` rows: a device-to-device copy of ``--copy-gib``
GiB, read + written bytes over time, in each mode). A row's ``vs_best_peer`` is its TFLOP/s over
the fastest peer row of its shape and mode (fa4_final rows are not peers).

``--rows``: time only the rows named (a grid too large for one visit). Where the cache in table
order (a second copy) does not fit beside the cache, the paged kernel row is timed unchecked
(``bitwise_equal`` None, ``unchecked`` says why) and the keys-on-M rows are error rows saying so.

Shapes whose cache is larger than ``--max-gb`` are recorded as skipped. ``--deadline`` seconds:
the run stops after the shape that passes it and stores what it measured, saying so.
Writes results/<gpu>/<name>.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass, replace

import torch

from measure._modes import (
    MODES,
    add_timing_args,
    capture_in_graph,
    check_timing_args,
    deadline_note,
    past_deadline,
    rows_in_modes,
)
from utils import bench, results

PRODUCES = [
    ("results/h200/decode.json", "python -m measure.decode --dims 128 --deadline 540",
     "decode shapes at D = 128 (1-16 query tokens, 1k-128k cached keys, batch 1-128, GQA 4 and "
     "8): fa4_final's call as it is and its decode kernel (split-KV, packed GQA, contiguous and "
     "paged, checked against SDPA before timing), beside cuDNN, SDPA flash and the FA4 package "
     "with and without splits and a page table; L2 flushed and back to back; the run's copy "
     "rate"),
    ("results/h200/decode_d64.json", "python -m measure.decode --name decode_d64 --dims 64 "
     "--deadline 540", "the same at D = 64"),
    ("results/h100/decode.json", "python -m measure.decode --dims 128 --batch 32 --tokens 1 4 16 "
     "--keys 1024 8192 32768 131072 --heads 32/8 64/8 --deadline <now + 500>",
     "an H100 visit (no H200 was lent): batch 32 at D = 128, every token and key count, GQA 4 "
     "and 8, fa4_final's call, its decode kernel and the peers"),
    ("results/h100/decode_graph.json", "python -m measure.decode --name decode_graph --dims 128 "
     "--batch 1 32 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph "
     "back_to_back --no-keys-on-m --rows <the grid's rows> --deadline 375",
     "an H100 visit: the decode calls replayed from CUDA graphs beside the same calls back to "
     "back, batch 1 and 32, every peer in the same run"),
    ("results/h100/decode_graph_repeated.json", "FA4_FINAL_PENDING=repeated_decode python -m "
     "measure.decode --name decode_graph_repeated --dims 128 --batch 1 --tokens 1 16 --keys 1024 "
     "8192 --heads 32/8 --modes back_to_back graph --rounds 5 --no-keys-on-m --rows "
     "fa4_final_splits fa4_final_paged_splits fa4_final_decode sdpa_cudnn sdpa_flash fa4_package "
     "--deadline 90", "an H100 visit: the batch-1 calls with Note [A repeated decode call] "
     "listed (then pending), back to back and replayed, beside the peers"),
    ("results/h100/decode_combine.json", "python -m measure.decode --name decode_combine "
     "--dims 128 --batch 1 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph "
     "back_to_back --variants c8 c16 c4p c16p --no-keys-on-m --rows fa4_final_splits "
     "fa4_final_decode fa4_final_decode_c8 fa4_final_decode_c16 fa4_final_decode_c4p "
     "fa4_final_decode_c16p sdpa_cudnn sdpa_flash fa4_package --deadline 280",
     "an H100 visit: the combine's candidates at batch 1 (Note [Splits in flight], Note [The "
     "first splits before the weights]) beside the call and the peers. In this file the call "
     "(fa4_final_decode, fa4_final_splits) runs the plain combine, 4 splits a pass, nothing "
     "loaded early: its rows carry no unroll field; this run chose Note [Which combine a call "
     "runs]. The candidates' rows call the combine's plan directly (no layout checks), so only "
     "the graph rows compare them with the call"),
    ("results/h100/decode_short_keys.json", "python -m measure.decode --name "
     "decode_short_keys --dims 128 --batch 1 --tokens 1 16 --keys 1024 2048 --heads 32/8 "
     "--modes graph --variants split2 n64s3 n64s4 --no-keys-on-m --rows fa4_final_decode "
     "fa4_final_decode_split2 fa4_final_decode_n64s3 fa4_final_decode_n64s4 sdpa_cudnn "
     "sdpa_flash fa4_package --deadline 200", "an H100 visit: batch 1 with 1k and 2k keys "
     "replayed from graphs, the call (with Note [Which combine a call runs]) beside twice the "
     "splits, 64-key tiles and the peers"),
    ("results/h100/decode_b128_splits.json", "python -m measure.decode --name "
     "decode_b128_splits --dims 128 --batch 128 --tokens 1 16 --keys 8192 --heads 32/8 --modes "
     "back_to_back --variants split2 split3 split5 n64s3b32 --no-keys-on-m --rows ... "
     "--deadline 250", "the same visit: batch 128, the call beside 2, 3 and 5 splits where the "
     "heuristic makes none, 64-key tiles in boxes of 32, the FA4 package and cuDNN"),
    ("results/h100/decode_b128_variants.json", "python -m measure.decode --name "
     "decode_b128_variants --dims 128 --batch 128 --tokens 1 16 --keys 8192 131072 --heads 32/8 "
     "--variants n128s2 n128s2b32 n64s3b32 --no-keys-on-m --rows ... --deadline 355",
     "the same visit: batch 128, where the call trails the FA4 package, the decode kernel with "
     "two stages or two CTAs an SM beside the default and the peers"),
    ("results/h100/decode_pdl.json", "python -m measure.decode --name decode_pdl --dims 128 "
     "--batch 1 32 --tokens 1 16 --keys 1024 8192 131072 --heads 32/8 --modes graph "
     "back_to_back --variants nopdl --no-keys-on-m --rows <the grid's rows> "
     "fa4_final_decode_nopdl --deadline 475", "an H100 visit: Note [The combine launches early] "
     "measured. In this file every split row (fa4_final_decode, fa4_final_splits and the paged "
     "ones) launches the combine early, and the row fa4_final_decode_nopdl is the decode kernel "
     "with the ordinary combine launch, as the package launches it; that row calls the combine's "
     "plan directly (no layout checks), so only the graph rows compare the two launches"),
    ("results/h100/decode_grid*_h100.json", "python -m measure.decode --name decode_grid_h100 "
     "--dims 128 --heads 32/8 --no-keys-on-m --rows fa4_final_splits fa4_final_paged_splits "
     "fa4_final_decode fa4_final_decode_paged fa4_package fa4_package_splits fa4_package_paged "
     "sdpa_flash sdpa_cudnn --deadline 440 (h64: --heads 64/8; d64: --dims 64)",
     "an H100 visit: issue 32's grid (batch 1, 32, 128; 1, 4, 16 tokens; 1k-128k keys) at "
     "D = 128 with GQA 4 and 8 and at D = 64 with GQA 4, the calls with the split heuristic, "
     "the kernel launched directly and every peer"),
    ("results/h100/decode_keys_on_m.json", "python -m measure.decode --name decode_keys_on_m "
     "--dims 128 --batch 1 32 --tokens 1 4 --keys 1024 8192 32768 --heads 32/8 64/8 "
     "--deadline <now + 330>", "the same H100 visit: the decode kernel with the keys on the "
     "wgmma M (Note [Keys on M]) beside the 64-row kernel and the peers"),
    ("results/h100/decode_grid2.json", "python -m measure.decode --name decode_grid2 --dims 64 "
     "128 --batch 1 128 --tokens 1 16 --keys 8192 131072 --heads 32/8 --deadline <now + 200>",
     "the same H100 visit: batch 1 and 128 at D = 64 and 128"),
    ("results/h200/decode_variants.json", "python -m measure.decode --name decode_variants "
     "--dims 128 --batch 1 32 --tokens 1 4 --keys 8192 131072 --heads 32/8 --variants n64s3 "
     "n64s4 n128s2 split2 --no-keys-on-m --deadline 500", "the decode kernel's config "
     "candidates (VARIANTS) beside the default and the peers, at the shapes where it trails"),
    ("results/h200/decode_split_floor.json", "python -m measure.decode --name decode_split_floor "
     "--dims 128 --batch 1 --keys 131072 --tokens 1 --heads 32/8 64/8 --no-keys-on-m "
     "--deadline 30", "an H200 visit's last minutes: batch 1 at 128k keys, one token, with the "
     "split count rounded down to whole waves (Note [Split count]), the call as it is beside "
     "the decode kernel and the peers"),
    ("results/h200/decode_wg2_probe.json", "python -m measure.decode --name decode_wg2_probe "
     "--dims 128 --batch 32 --keys 8192 --tokens 16 --heads 64/8 --variants wg2 --no-keys-on-m "
     "--deadline 10", "the same visit: one shape of 128 packed rows a KV head (16 tokens at "
     "GQA 8), the kernel with two consumer warpgroups (wg2) beside the default and the peers"),
    ("results/h100/decode_wg2.json", "python -m measure.decode --name decode_wg2 --dims 128 64 "
     "--batch 32 1 --tokens 16 --keys 8192 131072 32768 --heads 64/8 128/8 --variants wg2 "
     "--no-keys-on-m --deadline 470", "an H100 visit: 16 tokens at GQA 8 and 16 (128 and 256 "
     "packed rows), the decode kernel with one consumer warpgroup (fa4_final_decode, then the "
     "default) and with two (wg2) beside the peers: what made two the default above 64 rows"),
    ("results/h100/decode_pair.json", "python -m measure.decode --name decode_pair --dims 128 "
     "--batch 32 --tokens 16 --keys 8192 131072 --heads 128/8 --variants pair --no-keys-on-m "
     "--deadline 90", "an H100 visit: 256 packed rows a KV head (16 tokens at GQA 16), D = 128, "
     "the pair of CTAs sharing each K/V tile (pair) beside the call and the peers"),
    ("results/h100/decode_pair_d64.json", "python -m measure.decode --name decode_pair_d64 "
     "--dims 64 --batch 32 --tokens 16 --keys 8192 131072 --heads 128/8 --variants pair "
     "--no-keys-on-m --deadline 90", "the same visit: the same at D = 64"),
    ("results/h100/decode_variants.json", "python -m measure.decode --name decode_variants "
     "--dims 128 --batch 32 --tokens 1 --keys 8192 131072 --heads 32/8 --variants n64s3 n64s4 "
     "n128s2 split2 --no-keys-on-m --deadline 120", "the same visit: the config candidates at "
     "batch 32, one token"),
    ("results/h100/decode_api_checked.json", "python -m measure.decode --name decode_api "
     "--dims 128 --batch 1 32 --tokens 1 16 --keys 8192 131072 --heads 32/8 --no-keys-on-m "
     "--deadline 150", "an H100 visit, the run before the next row's: the same calls while a "
     "paged call still read its page table's extremes back to the host on every call (stored "
     "under this name; the run wrote decode_api)"),
    ("results/h100/decode_api.json", "python -m measure.decode --name decode_api --dims 128 "
     "--batch 1 32 --tokens 1 16 --keys 8192 131072 --heads 32/8 --no-keys-on-m --deadline 110",
     "an H100 visit: the calls through the API, paged and not, one split and the heuristic's, "
     "after the paged call stopped reading its page table back (Note [Paged KV checks])"),
    ("results/h100/decode_boxes_b32.json", "python -m measure.decode --name decode_boxes_b32 "
     "--dims 128 --batch 32 --tokens 1 --keys 8192 131072 --heads 32/8 --variants b32 b16 "
     "n128s2 --no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 "
     "fa4_final_decode_b16 fa4_final_decode_n128s2 fa4_package sdpa_cudnn --deadline 129",
     "an H100 visit: the tile read in boxes of 32 and 16 keys from a contiguous cache "
     "(Note [Boxes of a contiguous cache]) and two stages beside the default and the peers, "
     "batch 32, one token"),
    ("results/h100/decode_boxes_b1.json", "python -m measure.decode --name decode_boxes_b1 "
     "--dims 128 --batch 1 --tokens 1 --keys 131072 --heads 32/8 --variants b32 n128s2 "
     "--no-keys-on-m --rows fa4_final_decode fa4_final_decode_b32 fa4_final_decode_n128s2 "
     "fa4_package_splits sdpa_cudnn --deadline 20", "the same visit's last minute: batch 1, "
     "128k keys"),
    ("results/h100/decode_boxes.json", "python -m measure.decode --name decode_boxes --dims 128 "
     "--batch 32 1 --tokens 1 16 --keys 8192 131072 --heads 32/8 --variants b32 b16 n128s2 "
     "--no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 "
     "fa4_final_decode_b16 fa4_final_decode_n128s2 fa4_package fa4_package_splits sdpa_cudnn "
     "--deadline 500", "an H100 visit, its fa4_final_decode row and the call reading one box a "
     "tile: boxes of 32 and 16 keys and two stages beside them and the peers, batch 32 "
     "and 1, one and 16 tokens, 8k and 128k keys (what made boxes of 32 the contiguous "
     "default at D = 128)"),
    ("results/h100/decode_boxes_wg2.json", "python -m measure.decode --name decode_boxes_wg2 "
     "--dims 128 --batch 32 1 --tokens 16 --keys 8192 131072 --heads 64/8 --variants wg2b32 "
     "--no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_wg2b32 "
     "fa4_package fa4_package_splits sdpa_cudnn --deadline 240", "the same visit: 128 packed "
     "rows (16 tokens at GQA 8), two consumers with boxes of 32 beside the call (two "
     "consumers, one box a tile) and the one-consumer kernel"),
    ("results/h100/decode_boxes_d64.json", "python -m measure.decode --name decode_boxes_d64 "
     "--dims 64 --batch 32 1 --tokens 1 16 --keys 8192 131072 --heads 32/8 --variants b32 "
     "--no-keys-on-m --rows fa4_final_splits fa4_final_decode fa4_final_decode_b32 "
     "fa4_package fa4_package_splits sdpa_cudnn --deadline 240", "the same visit at D = 64: "
     "boxes of 32 beside one box a tile"),
]

PEERS = ("fa4_package", "fa4_package_splits", "fa4_package_paged", "sdpa_flash", "sdpa_cudnn")
DECODE_KERNEL = ("fa4_final_decode", "fa4_final_decode_paged", "fa4_final_decode_keys_on_m",
                 "fa4_final_decode_keys_on_m_paged")
# Config candidates of the decode kernel (``--variants``), each timed on the contiguous
# cache as fa4_final_decode_<name> beside the default, its max_diff taken to the default's out:
# (tile_n, stages, split factor over the heuristic's count, consumer warpgroups, CTAs a
# cluster, keys a TMA box or None for one box a tile). What each tests:
#   n64s3: 64-key tiles, three stages: 113 KB of shared memory at D = 128, so two CTAs share an
#          SM (the default's 209 KB allows one) with the same 96 KB of K/V in flight each
#   n64s4: 64-key tiles, four stages (145 KB, one CTA): the same bytes in flight as n128s2 in
#          smaller steps
#   n128s2: the default's tile with two stages (145 KB, one CTA): fewer bytes in flight
#   split2: the default config, twice the heuristic's split count (more CTAs at small grids)
#   split3, split5: three and five times it: at batch 128 (no split) the 1,024 CTAs of GQA 32/8
#          fill 7.76 waves of 132 SMs, and 5 splits would fill 38.8. The hypothesis that the
#          last wave's idle SMs are what the call trails the FA4 package by there did not hold
#          on an H100 (results/h100/decode_b128_splits.json): 2 to 5 splits within 1% of the
#          call at one token, slower at 16 tokens
#   wg2:   the default tile and stages with two consumer warpgroups, 128 packed rows a CTA
#          (Note [Two consumer warpgroups]): one CTA reads each K/V tile for 128 rows where the
#          default takes two; the split heuristic counts its CTAs at tile_m = 128. Only
#          meaningful when a KV head has more than 64 packed rows (16 tokens at GQA 8)
#   pair:  wg2 in clusters of two CTAs that multicast each K/V tile into both
#          (Note [A pair of CTAs shares the cache]): at 256 packed rows (16 tokens at
#          GQA 16) the tile leaves memory once for both 128-row m-blocks; splits as wg2's
#   b32, b16: the default tile and stages, each tile filled from boxes of 32 (16) keys, both
#          64-column halves of a box's rows requested back to back
#          (Note [Boxes of a contiguous cache] in fa4_final.hopper.decode): the same bits out;
#          b32 is the config a contiguous cache gets at D = 128 (hopper_decode_contiguous)
#   wg2b32: wg2 with boxes of 32, the config of 128 packed rows and more at D = 128
#   onebox: the default tile and stages in one box a tile (what a contiguous cache gets at
#          D = 64, and what every variant above without a box reads)
#   n128s2b32, n64s3b32: n128s2 and n64s3 filled from boxes of 32 keys as the contiguous
#          config is: candidates at batch 128, where the default trails the FA4 package by
#          about 3% at the copy rate (two stages, or two CTAs an SM)
#   pdl:   the default config and splits, its combine launched early, as a programmatic
#          dependent of the split kernel (Note [The combine launches early] in
#          fa4_final.common.combine): what launching early saves where a call takes microseconds
#   c8, c16: the default config and splits, its combine loading 8 (16) splits' partials
#          together instead of 4 (Note [Splits in flight] in fa4_final.common.combine): the
#          combine's latency at batch 1, where it has few rows
#   c4p, c16p: 4 and 16 splits a pass with the first pass's partials loaded before the
#          weights (Note [The first splits before the weights]): the lse and the partials'
#          round trips overlapped; the call runs one of them (Note [Which combine a call runs])
#   c4:    the plain combine (4 a pass, nothing loaded early), for comparison
VARIANTS = {"n64s3": (64, 3, 1, 1, 1, None), "n64s4": (64, 4, 1, 1, 1, None),
            "n128s2": (128, 2, 1, 1, 1, None), "split2": (128, 3, 2, 1, 1, None),
            "split3": (128, 3, 3, 1, 1, None), "split5": (128, 3, 5, 1, 1, None),
            "wg2": (128, 3, 1, 2, 1, None), "pair": (128, 3, 1, 2, 2, None),
            "b32": (128, 3, 1, 1, 1, 32), "b16": (128, 3, 1, 1, 1, 16),
            "wg2b32": (128, 3, 1, 2, 1, 32), "onebox": (128, 3, 1, 1, 1, None),
            "n128s2b32": (128, 2, 1, 1, 1, 32), "n64s3b32": (64, 3, 1, 1, 1, 32),
            "pdl": None, "c4": None, "c8": None, "c16": None, "c4p": None, "c16p": None}
# the variants that change only the combine (None above): combine_recipe's keywords
COMBINE_VARIANTS = {"pdl": {"pdl": True}, "c4": {"unroll": 4}, "c8": {"unroll": 8},
                    "c16": {"unroll": 16},
                    "c4p": {"unroll": 4, "prefetch": True},
                    "c16p": {"unroll": 16, "prefetch": True}}
OURS = ("fa4_final", "fa4_final_paged", "fa4_final_splits", "fa4_final_paged_splits",
        *DECODE_KERNEL, *(f"fa4_final_decode_{name}" for name in VARIANTS))


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    tokens: int
    keys: int
    heads: int
    heads_kv: int
    d: int

    def kv_bytes(self, elem_bytes: int = 2) -> int:
        """K and V of every sequence and KV head: what one decode step must read at least."""
        return 2 * self.batch * self.keys * self.heads_kv * self.d * elem_bytes

    def flops(self) -> float:
        """Two GEMMs of 2 flops per multiply-add: Q K^T and P V, every query row every key."""
        return 4.0 * self.batch * self.heads * self.tokens * self.keys * self.d


def grid(tokens, keys, batches, heads, dims) -> list[DecodeShape]:
    return [DecodeShape(b, t, s, h, hk, d)
            for d, (h, hk), b, s, t in itertools.product(dims, heads, batches, keys, tokens)]


def random_page_table(batch: int, keys: int, page: int, generator=None) -> torch.Tensor:
    """(batch, keys // page) int32: sequence b's page i lives in cache page table[b, i], a random
    permutation of all batch * keys // page pages."""
    if keys % page:
        raise ValueError(f"keys ({keys}) must be a multiple of the page size ({page})")
    pages = batch * (keys // page)
    return torch.randperm(pages, generator=generator, dtype=torch.int64).to(
        torch.int32).reshape(batch, keys // page)


def row_fields(shape: DecodeShape, page: int) -> dict:
    """A row's shape in the results files' attention keys (utils.results): b sequences, s cached
    keys, s_q query tokens, h query heads over h_kv KV heads."""
    return {"pass": "fwd", "dtype": "bf16", "b": shape.batch, "s": shape.keys,
            "s_q": shape.tokens, "h": shape.heads, "h_kv": shape.heads_kv, "d": shape.d,
            "causal": False, "page": page, "kv_bytes": shape.kv_bytes(), "flops": shape.flops()}


def split_count(shape: DecodeShape, requested: int, tile_m: int, tile_n: int) -> int:
    """``requested`` as FA4 reads num_splits (< 1: the heuristic), through the runtime's rule."""
    from fa4_final.runtime.decode import choose_num_splits

    return choose_num_splits(requested, batch=shape.batch, heads_kv=shape.heads_kv,
                             packed_rows=shape.tokens * (shape.heads // shape.heads_kv),
                             key_tiles=-(-shape.keys // tile_n),
                             num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                             tile_m=tile_m, tile_n=tile_n)


def _second_copy_fits(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a copy of the cache (k and v) fits in 80% of the GPU's free memory; always on
    the CPU (the tests' stand-ins)."""
    free = torch.cuda.mem_get_info()[0] if k.is_cuda else float("inf")
    return 2 * (k.numel() + v.numel()) * k.element_size() <= 0.8 * free


def _kernel_calls(shape, q, k, v, k_cache, v_cache, table, used, requested_splits,
                  variants=(), keys_on_m=True):
    """The Hopper decode kernel launched directly (fa4_final.hopper.host.launch_decode, the
    partials merged by runtime.decode.combine_splits), contiguous and paged, with the extra row
    fields: its split count, max |difference| to SDPA flash on the same logical cache, and
    whether paged equals contiguous bit for bit (the contiguous kernel run on the cache in table
    order does the same arithmetic in the same order)."""
    from fa4_final.common.combine import UNROLL, combine_choice, combine_recipe
    from fa4_final.hopper.config import (
        hopper_decode_contiguous,
        hopper_decode_for_page,
        hopper_decode_keys_on_m,
    )
    from fa4_final.hopper.host import decode_recipe, launch_decode
    from fa4_final.runtime.compile import compiled
    from fa4_final.runtime.decode import combine_splits, partials_like

    cfg = hopper_decode_contiguous(shape.d)
    splits = split_count(shape, requested_splits, cfg.tile_m, cfg.tile_n)
    rows = shape.tokens * (shape.heads // shape.heads_kv)
    swapped = hopper_decode_keys_on_m(shape.d, rows)  # Note [Keys on M]
    swapped_splits = split_count(shape, requested_splits, swapped.tile_m, swapped.tile_n)

    def runner(paged: bool, kk, vv, keys_on_m: bool = False, variant=None, combine=None):
        # pages smaller than the tile: the same tile and stages, gathered (hopper_decode_for_page)
        own = hopper_decode_for_page(shape.d, kk.shape[1]) if paged else cfg
        splits_ = splits
        if variant is not None:  # a config candidate (VARIANTS), contiguous cache only
            own, splits_ = variant
        if keys_on_m:
            own = hopper_decode_keys_on_m(shape.d, rows, kk.shape[1] if paged else None)
            splits_ = swapped_splits
        plan = compiled(decode_recipe, shape.d, "bf16", False, paged, paged, splits_ > 1, own)
        out = torch.empty_like(q)
        lse = torch.empty(shape.batch, shape.heads, shape.tokens, dtype=torch.float32,
                          device=q.device)
        out_p, lse_p = partials_like(out, splits_)
        tt, uu = (table, used) if paged else (None, None)
        # a combine candidate (COMBINE_VARIANTS): its plan on the dense layout directly
        own_combine = None if combine is None else compiled(
            combine_recipe, shape.d, "bf16", "sm_90a", combine.get("pdl", False),
            combine.get("unroll", UNROLL), combine.get("prefetch", False))

        def run():
            if splits_ == 1:
                launch_decode(plan, q, kk, vv, out, lse, tt, uu)
            else:
                launch_decode(plan, q, kk, vv, out_p, lse_p, tt, uu)
                if own_combine is None:
                    combine_splits(out_p, lse_p, out, lse)
                else:
                    own_combine.kernels["main"](out_p, lse_p, out, lse)
            return out
        return run

    calls = {"fa4_final_decode": runner(False, k, v),
             "fa4_final_decode_paged": runner(True, k_cache, v_cache)}
    sdpa = bench.peers()["sdpa_flash"]
    contiguous = calls["fa4_final_decode"]().float()
    paged = calls["fa4_final_decode_paged"]().clone()
    extra = {"fa4_final_decode": {"splits": splits, "max_diff": float(
        (contiguous - sdpa(q, k, v)[0].float()).abs().max())}}
    if splits > 1:  # the combine the call runs (Note [Which combine a call runs])
        unroll, prefetch = combine_choice(splits)
        extra["fa4_final_decode"].update(unroll=unroll, prefetch=prefetch)
    # the cache in table order is a second copy of it; where it does not fit beside the first,
    # the paged row is still timed, unchecked, and the keys-on-M rows (which need it) say why
    no_copy = (None if _second_copy_fits(k, v)
               else "the cache in table order (a copy) does not fit beside the cache")
    if no_copy:
        extra["fa4_final_decode_paged"] = {"splits": splits, "bitwise_equal": None,
                                           "unchecked": no_copy}
    else:
        k_in_order = k_cache[table.long()].reshape(k.shape)  # sequence b's keys in table order
        v_in_order = v_cache[table.long()].reshape(v.shape)
        in_order = runner(False, k_in_order, v_in_order)()
        extra["fa4_final_decode_paged"] = {
            "splits": splits, "max_diff": float(
                (paged.float() - sdpa(q, k_in_order, v_in_order)[0].float()).abs().max()),
            "bitwise_equal": bool(torch.equal(in_order, paged))}
    # config candidates: each its own error row if it fails, the others still timed
    for name in variants:
        if VARIANTS[name] is None:  # the default kernel, a combine candidate
            row = f"fa4_final_decode_{name}"
            call = runner(False, k, v, combine=COMBINE_VARIANTS[name])
            calls[row] = call
            extra[row] = {"splits": splits, **COMBINE_VARIANTS[name],
                          "max_diff": float((call().float() - contiguous).abs().max())}
            continue
        tile_n, stages, factor, consumers, cluster, box = VARIANTS[name]
        own = replace(cfg, tile_n=tile_n, stages=stages, consumers=consumers, cluster=cluster,
                      page_box=box)
        own_splits = split_count(shape, requested_splits, own.tile_m, tile_n) * factor
        row = f"fa4_final_decode_{name}"
        try:
            call = runner(False, k, v, variant=(own, own_splits))
            got = call().float()
        except Exception as exc:
            extra[row] = {"error": bench.error_text(exc)}
        else:
            calls[row] = call
            extra[row] = {"splits": own_splits, "tile_n": tile_n, "stages": stages,
                          "consumers": consumers, "cluster": cluster, "page_box": box,
                          "max_diff": float((got - contiguous).abs().max())}
    # the keys-on-M candidate: its own error rows if it fails, the 64-row rows still timed
    names = ("fa4_final_decode_keys_on_m", "fa4_final_decode_keys_on_m_paged")
    if not keys_on_m:
        return calls, extra
    if no_copy:
        extra.update({name: {"error": f"not run: {no_copy}"} for name in names})
        return calls, extra
    try:
        ours = dict(zip(names, (runner(False, k, v, True),
                                runner(True, k_cache, v_cache, True))))
        swapped_out = ours[names[0]]().float()
        swapped_paged = ours[names[1]]().clone()
        swapped_in_order = runner(False, k_in_order, v_in_order, True)()
    except Exception as exc:
        extra.update({name: {"error": bench.error_text(exc)} for name in names})
    else:
        calls.update(ours)
        # against the 64-row kernel on the same cache (contiguous; paged: in table order)
        extra[names[0]] = {"splits": swapped_splits, "rows_n": swapped.rows_n,
                           "max_diff": float((swapped_out - contiguous).abs().max())}
        extra[names[1]] = {
            "splits": swapped_splits, "rows_n": swapped.rows_n,
            "max_diff": float((swapped_paged.float() - in_order.float()).abs().max()),
            "bitwise_equal": bool(torch.equal(swapped_in_order, swapped_paged))}
    return calls, extra


def _calls(shape: DecodeShape, page: int, requested_splits: int = 0, device="cuda",
           variants=(), keys_on_m=True):
    """({name: zero-argument forward call}, {name: extra row fields}) of every implementation
    found, on one set of inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(shape.batch, shape.tokens, shape.heads, shape.d, device=device, dtype=dt,
                    generator=g)
    k = torch.randn(shape.batch, shape.keys, shape.heads_kv, shape.d, device=device, dtype=dt,
                    generator=g)
    v = torch.randn(k.shape, device=device, dtype=dt, generator=g)
    pages = shape.batch * shape.keys // page
    k_cache = k.view(pages, page, shape.heads_kv, shape.d)  # the same memory, paged
    v_cache = v.view(pages, page, shape.heads_kv, shape.d)
    table = random_page_table(shape.batch, shape.keys, page).to(device)
    used = torch.full((shape.batch,), shape.keys, dtype=torch.int32, device=device)
    calls, extra = {}, {}

    import fa4_final
    calls["fa4_final"] = lambda: fa4_final.flash_attn_func(q, k, v)
    calls["fa4_final_paged"] = lambda: fa4_final.flash_attn_varlen_func(
        q, k_cache, v_cache, page_table=table, seqused_k=used)
    # FA4's default num_splits = 1 is one split (what the two calls above ask); num_splits = 0
    # asks for the heuristic (Note [Split count]), as the FA4 package's _splits and _paged rows
    calls["fa4_final_splits"] = lambda: fa4_final.flash_attn_func(q, k, v, num_splits=0)
    calls["fa4_final_paged_splits"] = lambda: fa4_final.flash_attn_varlen_func(
        q, k_cache, v_cache, page_table=table, seqused_k=used, num_splits=0)
    try:
        ours, extra = _kernel_calls(shape, q, k, v, k_cache, v_cache, table, used,
                                    requested_splits, variants, keys_on_m)
    except Exception as exc:  # recorded as the rows' error, the peers still timed
        extra = {name: {"error": bench.error_text(exc)} for name in DECODE_KERNEL}
    else:
        calls.update(ours)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # the FA4 package is not installed here: its rows are left out
        pass
    else:
        calls["fa4_package"] = lambda: flash_attn_func(q, k, v)
        calls["fa4_package_splits"] = lambda: flash_attn_func(q, k, v, num_splits=0)
        calls["fa4_package_paged"] = lambda: flash_attn_varlen_func(
            q, k_cache, v_cache, page_table=table, seqused_k=used, num_splits=0)
    for name in ("sdpa_flash", "sdpa_cudnn"):
        fn = bench.peers()[name]
        calls[name] = lambda fn=fn: fn(q, k, v)
    return calls, extra


def _copy_rows(gib: float, rounds: int, modes=MODES) -> list[dict]:
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    rows = []
    for mode in modes:
        copy = lambda a=src, b=dst: b.copy_(a)  # noqa: E731
        copy = capture_in_graph(copy) if mode == "graph" else copy
        m = bench.interleaved({"copy": copy}, rounds=rounds, rep=20,
                              flush_l2=(mode == "flush"))["copy"]
        tbps = 2 * n / (m.median_ms * 1e-3) / 1e12 if m.median_ms else None
        rows.append({"impl": "copy", "metric": "copy_rate", "value": tbps, "unit": "TB/s",
                     "mode": mode, "bytes": 2 * n, **m.fields()})
    del src, dst
    torch.cuda.empty_cache()
    return rows


def attach_roofline(rows: list[dict]) -> list[dict]:
    """Add read_tbps, of_copy (over the same mode's copy rate) and vs_best_peer to timed rows."""
    copy = {r["mode"]: r.get("value") for r in rows if r["impl"] == "copy"}
    key = ("mode", "b", "s_q", "s", "h", "h_kv", "d")
    for row in rows:
        if row["impl"] == "copy" or not row.get("ms"):
            continue
        row["read_tbps"] = row["kv_bytes"] / (row["ms"] * 1e-3) / 1e12
        if copy.get(row["mode"]):
            row["of_copy"] = row["read_tbps"] / copy[row["mode"]]
        same = [r for r in rows if r["impl"] in PEERS and r.get("ms") and r is not row
                and all(r.get(k_) == row.get(k_) for k_ in key)]
        if same:
            best = min(same, key=lambda r: r["ms"])
            row.update(best_peer=best["impl"], best_peer_ms=best["ms"],
                       vs_best_peer=best["ms"] / row["ms"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--name", default="decode")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--keys", nargs="+", type=int, default=[1024, 8192, 32768, 131072])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 32, 128])
    ap.add_argument("--heads", nargs="+", default=["32/8", "64/8"],
                    help="query heads / KV heads")
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--page", type=int, default=128, help="keys per page of the paged rows")
    ap.add_argument("--splits", type=int, default=0,
                    help="num_splits of the decode kernel's rows (< 1: the heuristic)")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="config candidates of the decode kernel to time beside its default")
    ap.add_argument("--no-keys-on-m", action="store_true",
                    help="leave out the keys-on-M kernel's rows (Note [Keys on M])")
    ap.add_argument("--rows", nargs="+", default=None, choices=[*OURS, *PEERS],
                    help="time only these rows (default: every row the shape has)")
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--max-gb", type=float, default=80.0, help="largest cache to allocate (GB)")
    add_timing_args(ap)
    args = ap.parse_args(argv)
    check_timing_args(ap, args)
    try:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    except ValueError:
        ap.error(f"--heads: pairs like 32/8, got {args.heads}")
    if any(len(h) != 2 or h[0] % h[1] for h in heads):
        ap.error(f"--heads: query heads must be a multiple of KV heads, got {args.heads}")
    if not torch.cuda.is_available():
        print("decode: needs a CUDA GPU", file=sys.stderr)
        return 2

    start = time.monotonic()
    rows = _copy_rows(args.copy_gib, args.rounds, args.modes)
    shapes = grid(args.tokens, args.keys, args.batch, heads, args.dims)
    done = 0
    for shape in shapes:
        if past_deadline(args, start):
            break
        fields = row_fields(shape, args.page)
        if shape.kv_bytes() > args.max_gb * 1e9 or shape.keys % args.page:
            why = (f"cache of {shape.kv_bytes() / 1e9:.1f} GB > --max-gb {args.max_gb}"
                   if shape.kv_bytes() > args.max_gb * 1e9
                   else f"keys not a multiple of --page {args.page}")
            rows.append({"impl": "skipped", **fields, "ms": None, "tflops": None, "error": why})
            done += 1
            continue
        try:
            calls, extra = _calls(shape, args.page, args.splits, variants=args.variants,
                                  keys_on_m=not args.no_keys_on_m)
        except torch.cuda.OutOfMemoryError as exc:
            rows.append({"impl": "skipped", **fields, "ms": None, "tflops": None,
                         "error": bench.error_text(exc)})
            torch.cuda.empty_cache()
            done += 1
            continue
        if args.rows:  # only the rows asked for are timed (and stored)
            calls = {name: fn for name, fn in calls.items() if name in args.rows}
            extra = {name: fx for name, fx in extra.items() if name in args.rows}
        rows += rows_in_modes(calls, extra, fields, shape.flops(), args)
        del calls
        torch.cuda.empty_cache()
        done += 1
        print(f"[{time.monotonic() - start:.0f} s] {shape}", flush=True)
    rows = attach_roofline(rows)
    note = deadline_note(args, done, len(shapes))
    path = results.save(args.name, rows, command="python -m measure.decode " + " ".join(
        argv if argv is not None else sys.argv[1:]) + f"  [{note}]")
    print(f"wrote {path}: {note}")
    for r in rows:
        if r["impl"] in OURS and r.get("vs_best_peer"):
            print(f"{r['impl']:22s} {r['mode']:12s} b={r['b']} t={r['s_q']} "
                  f"s={r['s']} {r['h']}/{r['h_kv']} d={r['d']}: "
                  f"{r['vs_best_peer']:.2f}x {r['best_peer']}, {r.get('of_copy', 0):.0%} of copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
