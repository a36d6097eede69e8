"""What one decode call of fa4_final's API costs the host (the CPU), the kernels made no-ops.

    python -m measure.decode_host --label after
    PYTHONPATH=/path/to/other/checkout python -m measure.decode_host --label before \
        --fa4-commit <that checkout's commit>

measure.package_host's ``--profile`` method (its ``noop_kernels``: the dispatch to the Hopper
row, every compiled kernel a no-op, the SM count fixed at 132; its ``time_host``: the fastest of
``--repeats`` batches of ``--calls`` calls) at a decode step on CPU tensors: batch 1, one query
token, 32 query heads over 8 KV heads, D = 128, 8,192 cached keys, bf16. Four calls:
flash_attn_func on the contiguous cache and flash_attn_varlen_func with a page table of
128-key pages and seqused_k, each with num_splits = 1 (one split: no combine) and 0 (the
heuristic: 16 splits here, so the float32 partials and the combine's launch). The paged
calls run with FA4_FINAL_VARLEN_CHECKS=0, so no host check of the table's values runs: on a GPU
none runs by default (Note [Paged KV checks] in fa4_final.runtime.decode), and off one they
would. At batch 1 a decode step's kernels take 30-200 us on an H100 (results/h100/
decode_api.json), so a call's host time is what a step back to back waits for.

Rows (results/cpu/decode_host.json, one ``variant`` per ``--label``; rows of other labels are
kept, each row with its CPU and date: measure.package_host's store): ``host_us <call>``,
microseconds per call, with the median and slowest batch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from utils import results

RESULTS = "decode_host"
PENDING_ENV = "FA4_FINAL_PENDING"  # fa4_final.runtime.pending.ENV
PRODUCES = [("results/cpu/decode_host.json", "python -m measure.decode_host --label after",
             "host microseconds per decode call (batch 1, one token, GQA 4, D 128, 8k keys) "
             "with every kernel a no-op: dense and paged, one split and the heuristic's; one "
             "variant per fa4_final tree measured on that CPU (--label, --fa4-commit)"),
            ("results/h*/decode_host_gpu*.json", "python -m measure.decode_host --gpu",
             "the same calls on a GPU with their kernels and the kernel launched directly: host "
             "microseconds per call beside the GPU's per call back to back, and where the host "
             "time of a split call goes, by function; _before_memo: the run of a tree without "
             "Note [A repeated decode call], kept under that name")]
SETUP = ("this CPU, no GPU: CPU tensors, b=1, one query token, 32/8 heads, D=128, 8192 keys "
         "(paged: 128-key pages, seqused_k), bf16; every kernel launch and the GPU lookups "
         "replaced by no-ops; FA4_FINAL_VARLEN_CHECKS=0, FA4_FINAL_PENDING=repeated_decode "
         "(a tree without that gate ignores it)")
SETUP_GPU = ("the same calls on GPU tensors with their kernels (no value check runs on a GPU "
             "by default), and the decode kernel and combine launched directly on "
             "preallocated outputs; host time without synchronisation, GPU time by CUDA events "
             "around the same number of calls back to back")


def decode_calls(device: str = "cpu") -> dict:
    """{name: zero-argument call}: the four decode calls on one set of tensors (CPU tensors
    for the no-op profile; ``--gpu`` makes them on the GPU)."""
    import fa4_final

    g = torch.Generator().manual_seed(0)
    b, h, hk, d, keys, page = 1, 32, 8, 128, 8192, 128
    q, k, v = (torch.randn(b, n, heads, d, generator=g).to(device, torch.bfloat16)
               for n, heads in ((1, h), (keys, hk), (keys, hk)))
    k_cache, v_cache = k.view(-1, page, hk, d), v.view(-1, page, hk, d)
    table = torch.arange(b * keys // page, dtype=torch.int32, device=device).view(b, -1)
    used = torch.full((b,), keys, dtype=torch.int32, device=device)
    calls = {}
    for splits in (1, 0):
        calls[f"dense num_splits={splits}"] = (
            lambda s=splits: fa4_final.flash_attn_func(q, k, v, num_splits=s))
        calls[f"paged num_splits={splits}"] = (
            lambda s=splits: fa4_final.flash_attn_varlen_func(
                q, k_cache, v_cache, page_table=table, seqused_k=used, num_splits=s))
    return calls


@contextlib.contextmanager
def decode_environment(varlen_checks_off: bool = True):
    """FA4_FINAL_PENDING=repeated_decode (Note [A repeated decode call], while it is pending)
    and, unless told otherwise, FA4_FINAL_VARLEN_CHECKS=0 for the measured calls; restored
    after."""
    values = {PENDING_ENV: "repeated_decode"}
    if varlen_checks_off:
        values["FA4_FINAL_VARLEN_CHECKS"] = "0"
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure(label: str, fa4_commit: str | None, n: int, repeats: int) -> list[dict]:
    import fa4_final
    from measure.package_host import noop_kernels, time_host

    common = {"impl": "fa4_final", "variant": label,
              "fa4_final_commit": fa4_commit or results._git_commit(),
              "fa4_final_path": str(fa4_final.__file__), "setup": SETUP}
    rows = []
    with decode_environment(), noop_kernels():
        for name, fn in decode_calls().items():
            t = time_host(fn, n=n, repeats=repeats)
            rows.append({**common, "metric": f"host_us {name}", "unit": "us", **t})
            print(f"{label:8s} {name:22s} {t['value']:7.1f} us per call (median "
                  f"{t['median']:.1f}, slowest {t['max']:.1f})")
    return rows


# --gpu: the same calls with real kernels, the host's time beside the GPU's

def _kernel_call(q, k, v) -> callable:
    """The decode kernel and the combine launched directly on preallocated outputs (as
    measure.decode's fa4_final_decode row): the host cost of the two launches alone."""
    from fa4_final.hopper.host import launch_decode
    from fa4_final.runtime import decode_entry
    from fa4_final.runtime.compile import compiled
    from fa4_final.runtime.decode import combine_own_partials, partials_like

    splits, args = decode_entry.decode_plan_args(q, k, None, None, None, None, False, None, 0,
                                                 decode_entry.num_sms(q.device))
    plan = compiled(decode_entry.decode_recipe, *args)
    out, lse = decode_entry.fresh_outputs(q, v, False)
    out_p, lse_p = partials_like(out, splits)
    scale = q.shape[-1] ** -0.5

    def run():
        launch_decode(plan, q, k, v, out_p, lse_p, None, None, scale)
        combine_own_partials(out_p, lse_p, out, lse, "sm_90a")
    return run


def measure_gpu(n: int, repeats: int) -> list[dict]:
    """Host microseconds per call (time_host: no synchronisation inside a batch) and GPU
    microseconds per call (CUDA events around a batch of the same calls back to back) for the
    four API calls and the kernel launched directly, then where the host time of the dense
    call with the heuristic's splits goes (cProfile's own time by function, scaled)."""
    import cProfile
    import pstats

    from measure.package_host import time_host

    calls = decode_calls("cuda")
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16)
    calls["kernel dense num_splits=0"] = _kernel_call(q, k, k.clone())
    common = {"impl": "fa4_final", "setup": SETUP_GPU}
    rows = []
    for name, fn in calls.items():
        t = time_host(fn, n=n, repeats=repeats)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        gpu_us = start.elapsed_time(end) * 1e3 / n
        rows.append({**common, "metric": f"host_us {name}", "unit": "us", **t,
                     "gpu_us_per_call_back_to_back": gpu_us})
        print(f"{name:26s} host {t['value']:7.1f} us per call (median {t['median']:.1f}), "
              f"back to back {gpu_us:7.1f} us per call", flush=True)
    for name in ("dense num_splits=0", "kernel dense num_splits=0"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            calls[name]()
        prof.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(prof).stats
        total = sum(st[2] for st in stats.values()) or 1.0
        us = next(r["value"] for r in rows if r["metric"] == f"host_us {name}")
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
        print(f"\nwhere the host's {us:.0f} us of '{name}' go (cProfile own time, scaled):")
        for (filename, line, func), st in top:
            part = us * st[2] / total
            where = f"{filename.split('site-packages/')[-1].split('/work/')[-1]}:{line} {func}"
            rows.append({**common, "metric": f"host_us {name} by function", "part": where,
                         "value": part, "unit": "us"})
            print(f"  {part:6.1f} us  {where}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true",
                    help="on a GPU, real kernels: results/<gpu>/decode_host_gpu.json")
    ap.add_argument("--label", default="after")
    ap.add_argument("--fa4-commit", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if args.gpu:
        if not torch.cuda.is_available():
            print("measure.decode_host --gpu: needs a CUDA GPU", file=sys.stderr)
            return 2
        with decode_environment(varlen_checks_off=False):  # a GPU's default checks stand
            rows = measure_gpu(args.calls, args.repeats)
        print("stored", results.save(RESULTS + "_gpu", rows,
                                     command="python -m measure.decode_host --gpu"))
        return 0
    from measure.package_host import _save_merged

    rows = measure(args.label, args.fa4_commit, args.calls, args.repeats)
    _save_merged(rows, args.label, f"python -m measure.decode_host --label {args.label}",
                 name=RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
