"""Chapter 04's tile sweep: every tile of ``SWEEP_CONFIGS`` checked against float64, then timed
next to SDPA's flash backend, cuDNN and the FA4 package in interleaved rounds, with what ptxas made
of each kernel that ran; read in labs/ch04_tuning.ipynb.

    python -m measure.ch04_sweep                 # results/<gpu>/ch04_sweep.json
    python -m measure.ch04_sweep --check         # ... then chapter 04's CHECK_CASES, same process

Two rows per ablated tile are not attention: the same kernel with its softmax cut down
(``SoftmaxLeftOut``, Note [What the softmax costs]), timed to see what the softmax adds.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch

from solutions import ch04_flash_ampere as fa
from utils import checks

_RUN = "python -m measure.ch04_sweep --check"

SWEEP_RESULTS = "ch04_sweep"
SWEEP_SEQLEN, SWEEP_HEADS = 16384, 16  # batch * seqlen = 16384 tokens, as in results/*/ch04_fwd
# (head_dim, causal) -> which tiles of SWEEP_CONFIGS[head_dim] to time there (None: all)
SWEEP_PLAN = {
    (128, False): None,
    (128, True): (fa.DEFAULT_CONFIGS[128], fa.SM90_D128_TILE,
                  fa.TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=4),
                  fa.TileConfig(128, 64, 128, smem_layout="swizzled", qk_unroll=8)),
    (64, False): None,
}


def sweep(plan=None, seqlen=SWEEP_SEQLEN, heads=SWEEP_HEADS, rep=30, save=True,
          rounds=3) -> list[dict]:
    """Each (head_dim, causal, tile) of ``plan``: checked once against float64 on an awkward
    shape (fresh inputs, NaN-poisoned outputs), then timed at (batch, seqlen, heads) =
    (16384 // seqlen, seqlen, heads) in ``rounds`` interleaved rounds (utils.bench.interleaved:
    every tile, the SoftmaxLeftOut ablations and the peers SDPA flash, cuDNN and the FA4
    package on the same inputs, once per round; L2 flushed, median of ``rep`` calls per round).
    A tile that fails its check is not timed. Each row also records the registers, stack bytes
    and spill instructions of the kernel that ran, SDPA's flash backend (FlashAttention-2) and
    the fastest peer of the same inputs (``sdpa_flash_tflops``, ``best_peer``). Prints a table;
    saves SWEEP_RESULTS."""
    from utils import bench as ub
    from utils import results
    from utils.reference import random_qkv

    plan = SWEEP_PLAN if plan is None else plan
    batch = max(1, 16384 // seqlen)
    arch = fa.device_arch("cuda")
    rows, calls, flops_of = [], {}, {}
    for (head_dim, causal), configs in plan.items():
        configs = fa.SWEEP_CONFIGS[head_dim] if configs is None else configs
        q, k, v, seed = random_qkv(batch, seqlen, heads, head_dim, device="cuda")
        group = (head_dim, causal)
        flops_of[group] = ub.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
        for peer, call in ub.peer_calls(q, k, v, causal).items():
            calls[(group, ub.PEER_KEY, peer)] = call
        for config in configs:
            t0 = time.perf_counter()
            try:  # one broken tile must not cost the rest of a rare GPU session
                ok, line = fa.check_case(1, 1000, 1100, 4, 2, head_dim, causal, torch.bfloat16,
                                      config)
            except Exception as exc:  # reported in the row and the table; the run goes on
                ok, line = False, f"FAIL d={head_dim} causal={causal} {config}: {exc!r}"
            res = fa.launched_resources(head_dim, causal, config, sass=True)
            row = {
                "impl": "flash_ampere", "pass": "fwd", "dtype": "bf16", "b": batch,
                "s": seqlen, "h": heads, "d": head_dim, "causal": causal,
                "m_block": config.m_block, "n_block": config.n_block,
                "num_threads": config.num_threads, "num_stages": config.num_stages,
                "smem_layout": config.smem_layout, "qk_unroll": config.qk_unroll,
                "skip_rescale": config.skip_rescale,
                "default": config == fa.default_config(head_dim, causal, arch, "bf16"),
                "portable_default": config == fa.DEFAULT_CONFIGS[head_dim],
                "smem_bytes": config.smem_bytes(head_dim), "verified": ok, "seed": seed,
                "ms": None, "tflops": None, **config.accumulator_registers(head_dim),
                "registers": res and res.registers, "stack_bytes": res and res.frame_bytes,
                "spill_instructions": res and res.spill_instructions,
            }
            rows.append(row)
            if ok:
                calls[(group, fa.config_label(config))] = partial(fa.attention, q, k, v, causal,
                                                               config=config)
            else:
                print(line, flush=True)
            print(f"  {'ok  ' if ok else 'FAIL'} d={head_dim} causal={causal} {fa.tile_name(row)}: "
                  f"checked [{time.perf_counter() - t0:.1f} s]", flush=True)
            if (head_dim, causal) == (128, False) and config in fa.ABLATION_CONFIGS:
                out = torch.empty_like(q)
                lse = torch.empty(batch, heads, seqlen, dtype=torch.float32, device="cuda")
                calls[(group, fa.config_label(config), fa.ABLATION_IMPL)] = partial(
                    fa._launch, q, k, v, out, lse, causal, None, config, fa.SoftmaxLeftOut)
                rows.append({**row, "impl": fa.ABLATION_IMPL, "verified": None, "default": False,
                             "portable_default": False, "registers": None, "stack_bytes": None,
                             "spill_instructions": None})
    measured = ub.interleaved(calls, rounds=rounds, rep=rep,
                              progress=lambda line: print("  " + line, flush=True))
    for row in rows:
        group = (row["d"], row["causal"])
        peers = {key[2]: m for key, m in measured.items()
                 if key[0] == group and key[1:2] == (ub.PEER_KEY,)}
        ablation = (fa.ABLATION_IMPL,) if row["impl"] == fa.ABLATION_IMPL else ()
        key = (group, fa.tile_name(row)) + ablation
        if row["verified"] is not False and key in measured:
            row.update(measured[key].fields(flops_of[group]))
        row.update(ub.peer_fields(peers, flops_of[group]))
        # the chapter's yardstick, FlashAttention-2, under the name older sweeps used
        row["sdpa_flash_tflops"] = row["peers_tflops"].get("sdpa_flash")
    print(format_sweep(rows), flush=True)
    if save:
        path = results.save(SWEEP_RESULTS, rows,
                            command=_RUN)
        failed = sum(r["verified"] is False for r in rows)  # ablation rows are never checked
        print(f"wrote {path}" + (f" ({failed} tiles FAILED their check)" if failed else ""))
    return rows


def format_sweep(rows: list[dict]) -> str:
    """The rows of ``sweep`` as a table (speed relative to the default tile, with
    ``utils.bench.compare``'s verdict, and to SDPA's flash backend; registers, stack bytes and
    spill instructions of the kernel that ran; the fastest peer of the same run), then per
    (D, causal) the fastest tile whose kernel has no stack frame, i.e. spills nothing."""
    from utils.bench import compare, row_spread, spread_note, vs_best_peer

    def cell(value, width):
        return f"{'-' if value is None else value:>{width}}"

    lines = [f"{'d':>3s} {'causal':6s} {'tile':31s} {'ms':>7s} {'TFLOP/s':>7s} {'spread':>6s} "
             f"{'vs def':>6s} {'':12s} {'vs SDPA':>7s} {'regs':>4s} {'stack':>5s} {'spills':>6s}"
             "  vs best peer"]
    kernel_rows = [r for r in rows if r.get("impl") != fa.ABLATION_IMPL]
    for r in rows:
        tile = fa.tile_name(r) + (" *" if r["default"] else "")
        if r.get("impl") == fa.ABLATION_IMPL:
            tile = fa.tile_name(r) + " no softmax"
        res = " ".join(cell(r[k], w) for k, w in
                       (("registers", 4), ("stack_bytes", 5), ("spill_instructions", 6)))
        if not r["ms"]:
            lines.append(f"{r['d']:3d} {r['causal']!s:6s} {tile:31s} {'check FAILED':>30s} {res}")
            continue
        base = [b for b in kernel_rows if b["default"] and b["ms"]
                and (b["d"], b["causal"]) == (r["d"], r["causal"])]
        vs_def = f"{base[0]['ms'] / r['ms']:5.3f}x" if base else ""
        verdict = compare(r, base[0]).verdict if base and base[0] is not r else ""
        spread = row_spread(r)
        spread = f"{spread:6.1%}" if spread is not None else ""
        peer = r["sdpa_flash_tflops"]
        vs_sdpa = f"{r['tflops'] / peer:6.3f}x" if peer else ""
        lines.append(f"{r['d']:3d} {r['causal']!s:6s} {tile:31s} {r['ms']:7.3f} "
                     f"{r['tflops']:7.1f} {spread:>6s} {vs_def:>6s} {verdict:12s} {vs_sdpa:>7s} "
                     f"{res}  {vs_best_peer(r)}".rstrip())
    for d, causal in dict.fromkeys((r["d"], r["causal"]) for r in rows):
        timed = [r for r in kernel_rows if (r["d"], r["causal"]) == (d, causal) and r["ms"]]
        if not timed:
            continue
        peer = timed[0]["sdpa_flash_tflops"]
        line = f"d={d} causal={causal}: SDPA flash {peer or float('nan'):.1f} TFLOP/s; "
        clean = [r for r in timed if r["stack_bytes"] == 0]
        if clean:
            best = max(clean, key=lambda r: r["tflops"])
            line += (f"fastest spill-free {fa.tile_name(best)}"
                     f"{' (the default)' if best['default'] else ''} {best['tflops']:.1f}"
                     + (f" = {best['tflops'] / peer:.3f}x SDPA flash" if peer else ""))
        else:
            line += "no spill-free tile was timed"
        fastest = max(timed, key=lambda r: r["tflops"])
        if fastest["stack_bytes"] != 0:
            line += (f"; fastest overall {fa.tile_name(fastest)} {fastest['tflops']:.1f} "
                     f"(stack {fastest['stack_bytes']} B)")
        if timed[0].get("best_peer"):
            line += (f"; fastest peer {timed[0]['best_peer']} "
                     f"{timed[0]['best_peer_tflops']:.1f}")
        lines.append(line)
    if any("ms_rounds" in r or "ms_min" in r for r in rows):  # measured rows, not made up
        lines.append(spread_note([r for r in rows if r["ms"]]))
    return "\n".join(lines)


PRODUCES = [(f"results/h200/{SWEEP_RESULTS}.json", _RUN,
             "chapter 04's tiles, each checked then timed in rounds beside SDPA flash, cuDNN and "
             "the FA4 package, with registers, stack and spills; two softmax-less ablation rows")]


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="after the sweep, chapter 04's CHECK_CASES in the same process")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, so a round's spread can be told from an effect")
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured")
        return 1
    failures = sum(r["verified"] is False for r in sweep(rounds=args.rounds))
    if args.check:
        failures += checks.run_cases(fa.check_case, [(case, None) for case in fa.CHECK_CASES])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
