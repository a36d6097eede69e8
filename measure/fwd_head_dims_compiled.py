"""The Hopper forward at head dims 96, 192 and 256 and dv != D, ours and the FA4 package's,
compiled on a CPU the same way: tiles, buffers, registers, spills, and whether ptxas had to
serialise the wgmma (Note [Head dims] in fa4_final.hopper.config).

    python -m measure.fwd_head_dims_compiled --write          # ours and FA4's (about 6 min)
    python -m measure.fwd_head_dims_compiled --write --ours   # ours only, FA4's rows kept

writes ``results/compile/hopper_fwd_head_dims.json`` (rows of impl, config, metric, value,
unit; read by labs/hopper_head_dims_compiled.ipynb). No GPU: fake tensors, sm_90a.

Three groups of rows:
  ``default``    our default config per (D, dv, causal) and FA4's own kernel at the same shape
  ``tile_n``     our D = 128 and D = dv = 256 builds at every tile_n that fits, P converted
                 pair by pair where tile_n is no multiple of 64 (the kernel's way)
  ``tile_n, P as one vector``   the same builds with P converted as one vector everywhere
                 (a subclass of the kernel): which tiles ptxas then serialises
                 (Note [Pairwise conversion] in fa4_final.common.fragments)
``injected arrives`` is the number of warpgroup.arrive in the SASS beyond the PTX's
wgmma.fence: ptxas adds them when a wgmma's register operands are written between the fence
and the wgmma ("to allow use of registers in GMMA", info C7519), and each one waits for the
wgmma in flight. FA4's counts come from its own sm90 forward (4.0.0b36, flash_fwd_sm90).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

from utils import results

NAME = "hopper_fwd_head_dims"
FOLDER = "compile"
SMS = 132
PRODUCES = [(f"results/{FOLDER}/{NAME}.json",
             "python -m measure.fwd_head_dims_compiled --write",
             "the sm_90a forward at D = 96, 192 (dv 128, 192) and 256, ours (default config) "
             "and the FA4 package's, compiled on a CPU: tile, stages, O buffer, shared memory, "
             "registers, spills, wgmma shapes, warpgroup.arrive injected by ptxas; and ours at "
             "every tile_n that fits D = 128 and 256")]

DEFAULTS = [(96, 96, False), (96, 96, True), (192, 128, False), (192, 128, True),
            (192, 192, False), (256, 256, False), (256, 256, True)]
TILE_N_SWEEP = [(128, 128), (256, 256)]

# quack's autotuner imports triton, which a CPU machine may lack and a compile never calls: a
# stand-in module with the two names quack's kernels import from it
FA4_NO_TRITON = r'''
import types
if "triton" not in sys.modules:
    try:
        import triton  # noqa: F401
    except ImportError:
        _tuner = types.ModuleType("quack.autotuner")
        _tuner.autotune = lambda *a, **k: (lambda f: f)
        _tuner.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda s, *a, **k: None})
        sys.modules["quack.autotuner"] = _tuner
'''


def config_name(d: int, dv: int, causal: bool) -> str:
    return f"d{d} dv{dv} {'causal' if causal else 'non-causal'}"


def injected_arrives(ptx: str, sass: str) -> int:
    """warpgroup.arrive in the SASS beyond the PTX's wgmma.fence (ptxas's C7519 additions)."""
    return len(re.findall(r"WARPGROUP\.ARRIVE", sass)) - len(
        re.findall(r"wgmma\.fence\.sync\.aligned", ptx))


def wgmma_shapes(ptx: str) -> str:
    return ", ".join(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                                           ptx))))


def common_metrics(ptx: str, sass: str, registers: int, spills: int) -> dict:
    inc = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)
    return {"registers (launch)": registers,
            "setmaxnreg inc (consumers)": int(inc[0]) if inc else None,
            "spill instructions": spills,
            "injected arrives": injected_arrives(ptx, sass),
            "wgmma shapes": wgmma_shapes(ptx),
            "MUFU.EX2 (static)": len(re.findall(r"MUFU\.EX2", sass)),
            "SASS instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))}


def _vector_p_kernel(d: int, dv: int, causal: bool, cfg):
    """The forward with P converted as one vector at every tile_n (the kernel's store_p
    before Note [Pairwise conversion])."""
    import cutlass.cute as cute

    from fa4_final.common.fragments import acc_as_a_operand
    from fa4_final.hopper.host import forward_kernel

    kernel = forward_kernel("bf16", d, causal, False, False, cfg, head_dim_v=dv)

    class VectorP(type(kernel)):
        @cute.jit
        def store_p(self, s, tOrP):
            tOrP.store(acc_as_a_operand(s).load().to(self.dtype))

    return VectorP(kernel.dtype, d, causal, cfg, head_dim_v=dv)


def our_metrics(d: int, dv: int, causal: bool, config=None, vector_p: bool = False) -> dict:
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.host import forward_fake_args, forward_recipe
    from fa4_final.runtime.compile import artifacts, compile_kernel

    cfg = config or hopper_fwd_default(d, causal, head_dim_v=dv)
    if vector_p:
        _, art = compile_kernel(_vector_p_kernel(d, dv, causal, cfg),
                                *forward_fake_args("bf16", d, cfg, head_dim_v=dv),
                                arch="sm_90a", keep=True)
    else:
        art = artifacts(forward_recipe(d, "bf16", causal, config=cfg, head_dim_v=dv))["main"]
    return {"tile (m x n)": f"{cfg.tile_m} x {cfg.tile_n}",
            "stages (K, V)": f"{cfg.stages_k}, {cfg.stages_v}",
            "O buffer": "own" if cfg.separate_o else "over Q",
            "shared memory bytes": cfg.smem_bytes(d, head_dim_v=dv),
            **common_metrics(art.ptx, art.sass, art.registers, art.spills)}


def fa4_metrics(d: int, dv: int, causal: bool, site) -> dict:
    from solutions.ch09_compare import FA4_FWD_DRIVER, compile_fa4

    driver = FA4_FWD_DRIVER.replace("import cutlass.utils\n",
                                    FA4_NO_TRITON + "import cutlass.utils\n", 1)
    ptx, sass, registers, spills, _ = compile_fa4(
        driver, "FlashAttentionForwardSm90", "sm_90a", SMS, d,
        causal, site, FA4_HEAD_DIM_V=str(dv))
    return common_metrics(ptx, sass, registers, spills)


def _flat(impl: str, group: str, config: str, metrics: dict) -> list[dict]:
    units = {"shared memory bytes": "bytes", "SASS instructions": "instructions",
             "injected arrives": "instructions", "spill instructions": "instructions",
             "MUFU.EX2 (static)": "instructions"}
    return [{"impl": impl, "group": group, "config": config, "metric": k, "value": v,
             "unit": units.get(k, "-")} for k, v in metrics.items()]


def build_rows(ours_only: bool, site) -> list[dict]:
    from fa4_final.common.constants import SM90_SMEM_BYTES
    from fa4_final.hopper.config import FWD_TILE_NS, hopper_fwd_default

    rows = []
    for d, dv, causal in DEFAULTS:
        rows += _flat("fa4_final", "default", config_name(d, dv, causal),
                      our_metrics(d, dv, causal))
        if not ours_only:
            rows += _flat("fa4_package", "default", config_name(d, dv, causal),
                          fa4_metrics(d, dv, causal, site))
    for d, dv in TILE_N_SWEEP:
        base = hopper_fwd_default(d, head_dim_v=dv)
        for tile_n in FWD_TILE_NS:
            cfg = None
            for stages_k in (3, 2):  # the deepest K ring that fits
                c = replace(base, tile_n=tile_n, stages_k=stages_k, stages_v=2)
                if c.smem_bytes(d, head_dim_v=dv) <= SM90_SMEM_BYTES:
                    cfg = c
                    break
            if cfg is not None:
                name = f"d{d} dv{dv} tile_n {tile_n}"
                rows += _flat("fa4_final", "tile_n", name, our_metrics(d, dv, False, cfg))
                rows += _flat("fa4_final", "tile_n, P as one vector", name,
                              our_metrics(d, dv, False, cfg, vector_p=True))
    return rows


def path() -> Path:
    return results.RESULTS_DIR / FOLDER / f"{NAME}.json"


def load_table() -> results.Results:
    return results.load(NAME, gpu=FOLDER)


def write(ours_only: bool, site) -> Path:
    from solutions.ch09_compare import FA4_VERSION

    command = "python -m measure.fwd_head_dims_compiled --write" + (
        " --ours" if ours_only else "")
    rows = build_rows(ours_only, site)
    if ours_only and path().exists():  # FA4's rows kept from the file
        rows += [r for r in load_table().rows if r["impl"] == "fa4_package"]
    prov = results.collect_provenance(command)
    prov.update(gpu="none: compile-only for sm_90a on a CPU", driver="none",
                fa4_version=FA4_VERSION, mode="compile-only (fake tensors)")
    return results.save(NAME, rows, command, gpu=FOLDER, provenance=prov)


def main(argv=None) -> None:
    from solutions.ch09_compare import DEFAULT_FA4_SITE

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--ours", action="store_true", help="only our rows; FA4's kept")
    ap.add_argument("--fa4-site", nargs="+", default=["/tmp/fa4src/x", *DEFAULT_FA4_SITE])
    args = ap.parse_args(argv)
    if args.write:
        print(write(args.ours, tuple(args.fa4_site)))
    else:
        for row in build_rows(True, ()):
            print(row)


if __name__ == "__main__":
    main()
