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
import os
import sys

import torch

from utils import results

RESULTS = "decode_host"
PRODUCES = [("results/cpu/decode_host.json", "python -m measure.decode_host --label after",
             "host microseconds per decode call (batch 1, one token, GQA 4, D 128, 8k keys) "
             "with every kernel a no-op: dense and paged, one split and the heuristic's; one "
             "variant per fa4_final tree measured on that CPU (--label, --fa4-commit)")]
SETUP = ("this CPU, no GPU: CPU tensors, b=1, one query token, 32/8 heads, D=128, 8192 keys "
         "(paged: 128-key pages, seqused_k), bf16; every kernel launch and the GPU lookups "
         "replaced by no-ops; FA4_FINAL_VARLEN_CHECKS=0")


def decode_calls() -> dict:
    """{name: zero-argument call}: the four decode calls on one set of CPU tensors."""
    import fa4_final

    g = torch.Generator().manual_seed(0)
    b, h, hk, d, keys, page = 1, 32, 8, 128, 8192, 128
    q = torch.randn(b, 1, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, keys, hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, keys, hk, d, generator=g).to(torch.bfloat16)
    k_cache, v_cache = k.view(-1, page, hk, d), v.view(-1, page, hk, d)
    table = torch.arange(b * keys // page, dtype=torch.int32).view(b, -1)
    used = torch.full((b,), keys, dtype=torch.int32)
    calls = {}
    for splits in (1, 0):
        calls[f"dense num_splits={splits}"] = (
            lambda s=splits: fa4_final.flash_attn_func(q, k, v, num_splits=s))
        calls[f"paged num_splits={splits}"] = (
            lambda s=splits: fa4_final.flash_attn_varlen_func(
                q, k_cache, v_cache, page_table=table, seqused_k=used, num_splits=s))
    return calls


def measure(label: str, fa4_commit: str | None, n: int, repeats: int) -> list[dict]:
    import fa4_final
    from measure.package_host import noop_kernels, time_host

    common = {"impl": "fa4_final", "variant": label,
              "fa4_final_commit": fa4_commit or results._git_commit(),
              "fa4_final_path": str(fa4_final.__file__), "setup": SETUP}
    rows = []
    before = os.environ.get("FA4_FINAL_VARLEN_CHECKS")
    os.environ["FA4_FINAL_VARLEN_CHECKS"] = "0"
    try:
        with noop_kernels():
            for name, fn in decode_calls().items():
                t = time_host(fn, n=n, repeats=repeats)
                rows.append({**common, "metric": f"host_us {name}", "unit": "us", **t})
                print(f"{label:8s} {name:22s} {t['value']:7.1f} us per call (median "
                      f"{t['median']:.1f}, slowest {t['max']:.1f})")
    finally:
        if before is None:
            os.environ.pop("FA4_FINAL_VARLEN_CHECKS", None)
        else:
            os.environ["FA4_FINAL_VARLEN_CHECKS"] = before
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--fa4-commit", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    from measure.package_host import _save_merged

    rows = measure(args.label, args.fa4_commit, args.calls, args.repeats)
    _save_merged(rows, args.label, f"python -m measure.decode_host --label {args.label}",
                 name=RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
