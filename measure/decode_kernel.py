"""Time the Hopper decode kernel itself at decode shapes, beside the peers of measure.decode.

    python -m measure.decode_kernel                                   # the default grid
    python -m measure.decode_kernel --batch 32 --keys 8192 --tokens 1 # one shape

The kernel (fa4_final.hopper.decode) is launched through fa4_final.hopper.host.launch_decode,
its split partials merged by fa4_final.runtime.decode.combine_splits: what a decode call will
run once the runtime routes decode shapes to it, timed before that routing exists. Rows:
  fa4_final_decode        the contiguous cache (b, keys, h_kv, D)
  fa4_final_decode_paged  the same memory through a page table (``--page`` keys a page, pages
                          in a random order), with seqused_k
  sdpa_flash, sdpa_cudnn, fa4_package, fa4_package_splits, fa4_package_paged   the peers, called
                          as measure.decode calls them (whichever are installed)
Each of ours runs ``--splits`` splits, or (0, the default) the count of
fa4_final.runtime.decode.choose_num_splits (the split heuristic); the row stores it. No mask,
as in measure.decode (every query token sees the whole cache). Before timing, each of our
outputs is compared with SDPA's flash output on the same inputs (``max_diff``), and the paged
one with the contiguous one (``bitwise_equal``).

Shapes, modes (L2 flushed or back to back), the copy rate of the run, bytes read, ``of_copy``
and ``vs_best_peer`` as in measure.decode, whose helpers this driver uses. The default grid (1, 4
and 16 query tokens, 8k and 32k keys, batch 1 and 32, GQA 32/8, D = 128) takes a few minutes on
an H200. Writes results/<gpu>/<name>.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from measure.decode import (
    MODES,
    DecodeShape,
    _copy_rows,
    attach_roofline,
    grid,
    random_page_table,
    row_fields,
)
from utils import bench, results

PRODUCES = [
    ("results/h200/decode_kernel.json", "python -m measure.decode_kernel",
     "the Hopper decode kernel launched directly (contiguous and paged, the split heuristic's "
     "count, the combine), beside cuDNN, SDPA flash and the FA4 package at 1-16 query tokens, "
     "8k and 32k keys, batch 1 and 32, GQA 32/8, D = 128; L2 flushed and back to back"),
]

OURS = ("fa4_final_decode", "fa4_final_decode_paged")


def split_count(shape: DecodeShape, requested: int, tile_m: int, tile_n: int) -> int:
    """``requested`` as FA4 reads num_splits (< 1: the heuristic), through the runtime's rule."""
    from fa4_final.runtime.decode import choose_num_splits

    group = shape.heads // shape.heads_kv
    return choose_num_splits(requested, batch=shape.batch, heads_kv=shape.heads_kv,
                             packed_rows=shape.tokens * group,
                             key_tiles=-(-shape.keys // tile_n),
                             num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                             tile_m=tile_m, tile_n=tile_n)


def _calls(shape: DecodeShape, page: int, requested_splits: int, device="cuda"):
    """({name: zero-argument call}, {name: extra row fields}) on one set of inputs."""
    from fa4_final.hopper.config import hopper_decode_default
    from fa4_final.hopper.host import decode_recipe, launch_decode
    from fa4_final.runtime.compile import compiled
    from fa4_final.runtime.decode import combine_splits, partials_like

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
    # sequence b's page i holds its keys i * page ..: the contiguous view of the paged cache
    k_paged = k_cache[table.long()].reshape(k.shape)
    v_paged = v_cache[table.long()].reshape(v.shape)
    used = torch.full((shape.batch,), shape.keys, dtype=torch.int32, device=device)

    cfg = hopper_decode_default(shape.d)
    splits = split_count(shape, requested_splits, cfg.tile_m, cfg.tile_n)
    out = torch.empty_like(q)
    lse = torch.empty(shape.batch, shape.heads, shape.tokens, dtype=torch.float32,
                      device=device)
    out_p, lse_p = partials_like(out, splits)

    def ours(paged: bool):
        plan = compiled(decode_recipe, shape.d, "bf16", False, paged, paged, splits > 1, cfg)
        kk, vv, tt, uu = (k_cache, v_cache, table, used) if paged else (k, v, None, None)

        def run():
            if splits == 1:
                launch_decode(plan, q, kk, vv, out, lse, tt, uu)
            else:
                launch_decode(plan, q, kk, vv, out_p, lse_p, tt, uu)
                combine_splits(out_p, lse_p, out, lse)
            return out
        return run

    calls = {"fa4_final_decode": ours(False), "fa4_final_decode_paged": ours(True)}
    peers = bench.peers()
    for name in ("sdpa_flash", "sdpa_cudnn"):
        calls[name] = lambda fn=peers[name]: fn(q, k, v)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:  # the FA4 package is not installed here: its rows are left out
        pass
    else:
        calls["fa4_package"] = lambda: flash_attn_func(q, k, v)
        calls["fa4_package_splits"] = lambda: flash_attn_func(q, k, v, num_splits=0)
        calls["fa4_package_paged"] = lambda: flash_attn_varlen_func(
            q, k_cache, v_cache, page_table=table, seqused_k=used, num_splits=0)

    # correctness before timing: ours against SDPA's flash output on the same (logical) cache
    want = peers["sdpa_flash"](q, k, v)[0].float()
    extra = {}
    contiguous = calls["fa4_final_decode"]().clone()
    want_paged = peers["sdpa_flash"](q, k_paged, v_paged)[0].float()
    paged = calls["fa4_final_decode_paged"]().clone()
    extra["fa4_final_decode"] = {"splits": splits, "max_diff": float(
        (contiguous.float() - want).abs().max())}
    extra["fa4_final_decode_paged"] = {"splits": splits, "max_diff": float(
        (paged.float() - want_paged).abs().max())}
    # the paged cache read in table order is k_paged: with the contiguous kernel on k_paged the
    # two launches do the same arithmetic, so their outputs must agree bit for bit
    plan = compiled(decode_recipe, shape.d, "bf16", False, False, False, splits > 1, cfg)
    reference = torch.empty_like(q)
    if splits == 1:
        launch_decode(plan, q, k_paged, v_paged, reference, torch.empty_like(lse))
    else:
        rp, rl = partials_like(reference, splits)
        launch_decode(plan, q, k_paged, v_paged, rp, rl)
        combine_splits(rp, rl, reference, torch.empty_like(lse))
    extra["fa4_final_decode_paged"]["bitwise_equal"] = bool(torch.equal(reference, paged))
    return calls, extra


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--name", default="decode_kernel")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--keys", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--heads", nargs="+", default=["32/8"], help="query heads / KV heads")
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--page", type=int, default=128, help="keys per page of the paged rows")
    ap.add_argument("--splits", type=int, default=0, help="num_splits (< 1: the heuristic)")
    ap.add_argument("--rounds", type=int, default=bench.MIN_ROUNDS)
    ap.add_argument("--rep", type=int, default=20, help="timed calls per round at most")
    ap.add_argument("--max-seconds", type=float, default=0.25)
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--deadline", type=float, default=None, help="seconds; stop after a shape")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args(argv)
    if args.rounds < bench.MIN_ROUNDS:
        ap.error(f"--rounds: at least {bench.MIN_ROUNDS}")
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads]
    if not torch.cuda.is_available():
        print("decode_kernel: needs a CUDA GPU", file=sys.stderr)
        return 2

    start = time.monotonic()
    rows = _copy_rows(args.copy_gib, args.rounds)
    shapes = grid(args.tokens, args.keys, args.batch, heads, args.dims)
    done = 0
    for shape in shapes:
        if args.deadline is not None and time.monotonic() - start > args.deadline:
            break
        fields = row_fields(shape, args.page)
        calls, extra = _calls(shape, args.page, args.splits)
        for mode in args.modes:
            measured = bench.interleaved(calls, rounds=args.rounds, rep=args.rep,
                                         max_seconds=args.max_seconds,
                                         flush_l2=(mode == "flush"))
            for name, m in measured.items():
                rows.append({"impl": name, "mode": mode, **fields, **extra.get(name, {}),
                             **m.fields(shape.flops())})
        del calls
        torch.cuda.empty_cache()
        done += 1
        print(f"[{time.monotonic() - start:.0f} s] {shape} {extra}", flush=True)
    rows = attach_roofline(rows)
    note = (f"{done} of {len(shapes)} shapes" + ("" if done == len(shapes) else
            f" (stopped at --deadline {args.deadline} s)"))
    path = results.save(args.name, rows, command="python -m measure.decode_kernel " + " ".join(
        argv if argv is not None else sys.argv[1:]) + f"  [{note}]")
    print(f"wrote {path}: {note}")
    for r in rows:
        if r["impl"] in OURS and r.get("ms"):
            print(f"{r['impl']:24s} {r['mode']:12s} b={r['b']} t={r['s_q']} s={r['s']} "
                  f"{r['h']}/{r['h_kv']} d={r['d']} splits={r.get('splits')}: {r['ms']:.4f} ms, "
                  f"{r.get('vs_best_peer', 0):.2f}x {r.get('best_peer')}, "
                  f"{r.get('of_copy', 0):.0%} of copy, max_diff {r.get('max_diff'):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
