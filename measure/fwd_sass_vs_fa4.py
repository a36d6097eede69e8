"""Our sm_90a forward and FA4's own, compiled on a CPU the same way, side by side per KV step
(read by ``solutions.ch08_compare``; labs/the_last_three_percent.ipynb).

    python -m measure.fwd_sass_vs_fa4 --write          # both sides (FA4 importable: --fa4-site)
    python -m measure.fwd_sass_vs_fa4 --write --ours   # our rows only, FA4's kept from the file

writes ``results/compile/sm90_fwd_vs_fa4.json``. No GPU: fake tensors, ``CUTE_DSL_ARCH=sm_90a``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from solutions.ch08_compare import (
    CONFIGS,
    FA4_TILES,
    FOLDER,
    NAME,
    SMS,
    config_name,
    kernel_metrics,
    load_table,
    our_metrics,
    path,
    side_by_side,
)
from solutions.ch09_compare import DEFAULT_FA4_SITE, FA4_FWD_DRIVER, FA4_VERSION, compile_fa4
from utils import results

PRODUCES = [(f"results/{FOLDER}/{NAME}.json", "python -m measure.fwd_sass_vs_fa4 --write --ours",
             "the steady KV step of our sm_90a forward and FA4's, compiled on a CPU: "
             "instruction classes and schedule, per configuration and knob")]


def fa4_metrics(d: int, causal: bool, site=DEFAULT_FA4_SITE) -> dict:
    """FA4's sm90 forward (bf16, 2 x 4096 x 16 heads, fake CUDA tensors), compiled in a fresh
    process with its PTX and cubin dumped; the same metrics."""
    ptx, sass, registers, spills, _ = compile_fa4(
        FA4_FWD_DRIVER, "FlashAttentionForwardSm90", "sm_90a", SMS, d, causal, site)
    tile_m, tile_n, _ = FA4_TILES[d]
    out = kernel_metrics(ptx, sass, registers, spills, tile_m, tile_n)
    out["stages (K, V)"] = "2, 2"  # flash_fwd_sm90: num_stages=2, one state for K and V
    return out


def knob_rows(d: int, causal: bool) -> list[dict]:
    """Our steady-step counts for every knob variant of measure.fwd_knobs at (d, causal)."""
    from measure.fwd_knobs import compile_knob_configs

    rows = []
    for name, cfg in compile_knob_configs(d, causal).items():
        m = our_metrics(d, causal, cfg)
        m["knobs"] = json.dumps({k: v for k, v in asdict(cfg).items()})
        rows += _flat(f"fa4_final [{name}]", config_name(d, causal), m)
    return rows


def build_rows(ours_only: bool, site=DEFAULT_FA4_SITE, knobs: bool = True) -> list[dict]:
    rows = []
    stored = load_table().rows if ours_only and path().exists() else []
    for d, causal in CONFIGS:
        name = config_name(d, causal)
        rows += _flat("fa4_final", name, our_metrics(d, causal))
        if ours_only:
            rows += [r for r in stored if r["impl"] == "fa4" and r["config"] == name]
        else:
            rows += _flat("fa4", name, fa4_metrics(d, causal, site))
        if knobs:
            rows += [r for r in knob_rows(d, causal) if "[default]" not in r["impl"]]
    return rows


def _flat(impl: str, config: str, metrics: dict, units: dict | None = None) -> list[dict]:
    """Table rows (impl, config, metric, value, unit); a step's dict becomes 'step: name'.
    ``units``: the unit of a plain metric by name ("-" for the others)."""
    rows = []
    for metric, value in metrics.items():
        if isinstance(value, dict):
            rows += [{"impl": impl, "config": config, "metric": f"{metric}: {k}", "value": v,
                      "unit": "SASS instructions" if isinstance(v, int) else "-"}
                     for k, v in value.items()]
        else:
            rows.append({"impl": impl, "config": config, "metric": metric, "value": value,
                         "unit": (units or {}).get(metric, "-")})
    return rows


def write(ours_only: bool = False, site=DEFAULT_FA4_SITE, knobs: bool = True) -> Path:
    command = "python -m measure.fwd_sass_vs_fa4 --write" + (" --ours" if ours_only else "")
    rows = build_rows(ours_only, site, knobs)
    prov = results.collect_provenance(command)
    prov.update(gpu="none: compile-only for sm_90a on a CPU", driver="none",
                fa4_version=FA4_VERSION, mode="compile-only (fake tensors)")
    if ours_only and path().exists():
        old = load_table().provenance  # where FA4's rows were compiled, kept over rewrites
        prov["fa4_rows_from"] = old.get("fa4_rows_from") or (
            f"{old.get('commit', '?')[:10]} {old.get('date', '?')}")
    return results.save(NAME, rows, command, gpu=FOLDER, provenance=prov)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--ours", action="store_true", help="regenerate our rows only")
    ap.add_argument("--no-knobs", action="store_true", help="skip the knob variants' rows")
    ap.add_argument("--fa4-site", nargs="*", default=list(DEFAULT_FA4_SITE))
    args = ap.parse_args(argv)
    if args.write:
        print(write(args.ours, tuple(args.fa4_site), knobs=not args.no_knobs))
    print(side_by_side(load_table()))


if __name__ == "__main__":
    main()
