"""Where the decode kernel's last few percent of bandwidth go: Nsight Compute on one launch of
fa4_final's Hopper decode kernel and one of cuDNN's SDPA kernel, same shape, same process kind.

    python -m measure.profile_decode                   # GPU and ncu: profile both, save the JSON
    python -m measure.profile_decode --raw-dir DIR     # ... and keep ncu's CSV exports in DIR
    python -m measure.profile_decode --from-raw DIR    # re-read DIR (any machine, no GPU)

The shapes are where fa4_final's decode trails the best peer in results/h100/decode.json while
both are bound by memory: batch 32, one query token, 32 query heads over 8 KV heads, D = 128,
bf16, 8k and 128k cached keys (fa4_final reads the cache at 0.94-0.95 and 1.00-1.01 of the copy
rate there, the best peer at 0.97-0.98 and 1.02-1.03); and 16 query tokens of 64 heads at 8k
keys, 128 packed rows a KV head, where the two-consumer kernel runs
(Note [Two consumer warpgroups] in fa4_final.hopper.decode) and ours trails by more. fa4_final
is called as a user calls it with the split heuristic (``num_splits=0``); cuDNN through SDPA's
cuDNN backend.

Rows (``impl`` fa4_final_splits or sdpa_cudnn, ``s_q`` tokens, ``s`` keys): duration, DRAM bytes
read and the DRAM throughput's share of its peak, the L2 hit rate, the grid (CTAs, threads a
CTA, shared memory a CTA), issue slots busy, warps a scheduler and the stall reasons (chapter
04's counters). ncu runs with ``--clock-control none``: the GPU's own clocks, as the benchmarks run,
so the durations compare with each other; the kernel is its second launch in the process (the
first compiles). Saved as results/<gpu>/decode_profile.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from measure import _ncu as ncu
from measure._ncu import ProfileSpec, run_ncu
from solutions import ch04_profile as core

RESULTS = "decode_profile"
SHAPE = {"b": 32, "h_kv": 8, "d": 128}
# (query tokens, cached keys, query heads): GQA 4 at one token (32 packed rows a KV head), GQA 8
# at 16 tokens (128 packed rows: the two-consumer kernel)
CASES = ((1, 8192, 32), (1, 131072, 32), (16, 8192, 64))
HEADS = {tokens: heads for tokens, _, heads in CASES}
# impl -> ncu's kernel filter: ours is a CuTe kernel of class HopperDecode; cuDNN's SDPA kernels
# carry "sdpa" in their names
VARIANTS = {"fa4_final_splits": "regex:HopperDecode", "sdpa_cudnn": "regex:sdpa"}
SECTIONS = (*core.SECTIONS[:-1], "MemoryWorkloadAnalysis")  # no SASS source: cuDNN's is closed
EXTRA_METRICS = (
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "launch__grid_size",
    "launch__block_size",
    "launch__shared_mem_per_block",
    "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
)
RAW_METRICS = (
    ("duration_ms", "gpu__time_duration.sum", "ms"),
    ("dram_read_gb", "dram__bytes_read.sum", "GB"),
    ("dram_throughput_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%"),
    ("l2_hit_rate_pct", "lts__t_sector_hit_rate.pct", "%"),
    ("ctas", "launch__grid_size", "CTAs"),
    ("threads_per_cta", "launch__block_size", "threads"),
    ("smem_per_cta", "launch__shared_mem_per_block", "bytes"),
    ("issue_slots_busy_pct", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", "%"),
    ("achieved_warps_per_sm", "sm__warps_active.avg.per_cycle_active", "warps"),
)
PRODUCES = [(f"results/h100/{RESULTS}.json", "python -m measure.profile_decode --raw-dir DIR",
             "an H100 visit (the kernel reading one box a tile): Nsight Compute on "
             "one launch of fa4_final's decode call and one of cuDNN's SDPA kernel at the "
             "memory-bound shapes where fa4_final trails: DRAM bytes and throughput, L2 hit "
             "rate, grid, stalls"),
            (f"results/h200/{RESULTS}.json", "python -m measure.profile_decode --raw-dir DIR",
             "the same on an H200 (owed)")]


def build_rows(raw_text: str, impl: str, keys: int, tokens: int = 1) -> list[dict]:
    """Result rows of one ncu raw export: the counters above, with the read rate the duration
    and the bytes give (``dram_read_tbps``); the query heads are the case's (``HEADS``)."""
    rows = core.raw_rows(core.parse_raw(raw_text), RAW_METRICS)
    got = {r["metric"]: r["value"] for r in rows}
    if got.get("duration_ms") and got.get("dram_read_gb") is not None:
        rows.append({"metric": "dram_read_tbps", "unit": "TB/s",
                     "value": got["dram_read_gb"] / got["duration_ms"]})
    return [{"impl": impl, **SHAPE, "h": HEADS[tokens], "s_q": tokens, "s": keys, **r}
            for r in rows]


def _case_dir(impl: str, tokens: int, keys: int) -> str:
    return f"{impl}_t{tokens}_{keys}"


def _run_target(impl: str, keys: int, tokens: int) -> None:
    import torch

    import fa4_final
    from utils import bench

    g = torch.Generator(device="cuda").manual_seed(0)
    b, hk, d = (SHAPE[k] for k in ("b", "h_kv", "d"))
    t, h = tokens, HEADS[tokens]
    q = torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, keys, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    if impl == "fa4_final_splits":
        call = lambda: fa4_final.flash_attn_func(q, k, v, num_splits=0)  # noqa: E731
    else:
        fn = bench.peers()[impl]
        call = lambda: fn(q, k, v)  # noqa: E731
    for _ in range(2):
        call()
    torch.cuda.synchronize()


def main(argv=None) -> int:
    from utils import results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", nargs=3, metavar=("IMPL", "TOKENS", "KEYS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--raw-dir", type=Path, help="also keep ncu's CSV exports here")
    ap.add_argument("--from-raw", type=Path, help="rebuild the JSON from a --raw-dir folder")
    args = ap.parse_args(argv)
    if args.target:
        impl, tokens, keys = args.target
        if impl not in VARIANTS or int(tokens) not in HEADS:
            ap.error(f"--target: impl must be one of {sorted(VARIANTS)} and tokens one of "
                     f"{sorted(HEADS)}, got {impl!r} {tokens!r}")
        _run_target(impl, int(keys), int(tokens))
        return 0
    if args.from_raw:
        meta = ncu.read_meta(args.from_raw)
        rows = []
        for impl in VARIANTS:
            for tokens, keys, _ in CASES:
                case = _case_dir(impl, tokens, keys)
                raw, _ = ncu.read_exports(args.from_raw, case, source=False)
                rows += build_rows(raw, impl, keys, tokens)
        provenance = ncu.reread_provenance(meta)
        command = provenance["command"]
    else:
        command = "python -m measure.profile_decode"
        provenance = results.collect_provenance(command)
        rows = []
        for impl, regex in VARIANTS.items():
            spec = ProfileSpec(RESULTS, "measure.profile_decode", regex, SECTIONS,
                               EXTRA_METRICS, None)
            for tokens, keys, _ in CASES:
                raw, _ = run_ncu(spec, target_args=(impl, str(tokens), str(keys)),
                                 source=False, ncu_args=("--clock-control", "none"))
                ncu.keep_exports(args.raw_dir, _case_dir(impl, tokens, keys), raw)
                rows += build_rows(raw, impl, keys, tokens)
        ncu.keep_meta(args.raw_dir, provenance)
    path = results.save(RESULTS, rows, command=command, provenance=provenance)
    table = results.load(RESULTS, gpu=path.parent.name)
    print(table.table(["impl", "s_q", "h", "s", "metric", "value", "unit"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
