"""Our sm_90a backward and FA4's own (4.0.0b36, flash_bwd_sm90), compiled on a CPU the same way,
side by side: resources, instruction classes per role, dQ accumulation, and the step of the
inner loop (one query tile against the CTA's KV tile).

    python -m measure.bwd_sass_vs_fa4 --write          # both sides (FA4 importable: --fa4-site)
    python -m measure.bwd_sass_vs_fa4 --write --ours   # our rows only, FA4's kept from the file

writes ``results/compile/hopper_bwd_vs_fa4.json`` (rows of impl, config, metric, value, unit;
read by labs/hopper_backward_compiled.ipynb). No GPU: fake tensors, ``CUTE_DSL_ARCH=sm_90a``.

Both kernels give one CTA a KV tile and walk the query tiles in an inner loop; the ``step``
rows count that loop's body (the innermost backward branch whose span holds HGMMA and
MUFU.EX2, as solutions.ch08_compare finds the forward's KV step), run once per query tile by
each MMA warpgroup. The role rows attribute every instruction to the setmaxnreg that precedes
it in the listing: ``producer`` after the decrease (TMA warp and dQ-store warp), ``mma`` after
an increase. Counts are static (each body once): they compare code shapes, not run time.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from measure.fwd_sass_vs_fa4 import _flat
from solutions.ch08_compare import by_mask, kv_loops, order
from solutions.ch09_compare import (
    DEFAULT_FA4_SITE,
    FA4_DRIVER_HEAD,
    FA4_VERSION,
    sass_opcodes,
    setmaxnreg_values,
)
from utils import results

NAME = "hopper_bwd_vs_fa4"
FOLDER = "compile"
SMS = 132  # H100 / H200
FA4_SITE = ("/tmp/fa4src/x",) + DEFAULT_FA4_SITE
CONFIGS = [(d, causal, det) for d in (64, 128) for causal in (False, True)
           for det in (False, True)]

PRODUCES = [(f"results/{FOLDER}/{NAME}.json", "python -m measure.bwd_sass_vs_fa4 --write --ours",
             "our sm_90a backward (main, pre, post) and FA4's, compiled on a CPU: registers per "
             "role, shared memory, spills, instruction classes per role and per query-tile step, "
             "tiles, stages and dQ accumulation, per configuration")]

# (label, regex on the opcode with its modifiers)
CLASSES = [
    ("HGMMA", r"^HGMMA"),
    ("MUFU.EX2", r"^MUFU\.EX2"),
    ("FFMA", r"^FFMA"),
    ("FMUL", r"^FMUL"),
    ("FADD", r"^FADD"),
    ("F2FP (fp32 -> 16-bit pairs)", r"^F2FP"),
    ("LDS", r"^LDS\b|^LDS\."),
    ("STS", r"^STS\b|^STS\."),
    ("LDSM", r"^LDSM"),
    ("STSM", r"^STSM"),
    ("UTMA* (TMA)", r"^UTMA"),
    ("UBLKRED (bulk reduction)", r"^UBLKRED"),
    ("UBLKCP (bulk copy)", r"^UBLKCP"),
    ("RED/ATOM (global atomics)", r"^(RED|REDG|ATOM|ATOMG)(\.|$)"),
    ("BAR (named barriers)", r"^BAR\b|^BAR\."),
    ("SYNCS (mbarrier)", r"^SYNCS"),
    ("WARPSYNC", r"^WARPSYNC"),
    ("WARPGROUP.ARRIVE", r"^WARPGROUP\.ARRIVE"),
    ("WARPGROUP.DEPBAR", r"^WARPGROUP\.DEPBAR"),
    ("SHFL", r"^SHFL"),
    ("FSEL", r"^FSEL"),
    ("LDG", r"^LDG"),
    ("STG", r"^STG"),
    ("LDL/STL (spills)", r"^(LDL|STL)\b"),
]
_INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def classes(ops: list[str]) -> dict[str, int]:
    out = {label: sum(1 for op in ops if re.match(rx, op)) for label, rx in CLASSES}
    out["instructions"] = len(ops)
    return out


def hgmma_shapes(lines: list[str]) -> str:
    """HGMMA count by shape (m x n x k) in SASS lines, e.g. '8x 64x128x16, 4x 64x64x16'."""
    shapes = Counter(m.group(1) for line in lines
                     if (m := re.search(r"\bHGMMA\.(\d+x\d+x\d+)", line)))
    return ", ".join(f"{n}x {s}" for s, n in sorted(shapes.items(), key=lambda x: -x[1]))


def by_setmaxnreg(sass: str) -> dict[str, list[str]]:
    """Opcodes per role: each instruction goes to the setmaxnreg that precedes it in the
    listing (DEALLOC: the producer warpgroup; ALLOC: the MMA warpgroups); approximate where
    ptxas interleaves blocks."""
    groups = {"producer": [], "mma": []}
    current = None
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL", line)
        if m:
            current = "producer" if m.group(1) == "DEALLOC" else "mma"
            continue
        op = _INSTR.match(line)
        if op and current:
            groups[current].append(op.group(1))
    return groups


def step_rows(body: list[str]) -> dict:
    ops = [m.group(1) for line in body if (m := _INSTR.match(line))]
    out = classes(ops)
    out["HGMMA shapes"] = hgmma_shapes(body)
    out["order"] = order(ops)
    return out


def kernel_metrics(ptx: str, sass: str, registers: int, spills: int) -> dict:
    """Everything stored for one main kernel, from its PTX and SASS."""
    ops = sass_opcodes(sass)
    regs = setmaxnreg_values(ptx)
    threads = re.search(r"\.reqntid\s+(\d+)", ptx) or re.search(r"\.maxntid\s+(\d+)", ptx)
    out = {
        "registers (launch)": registers,
        "spill instructions": spills,
        "setmaxnreg inc (mma warpgroups)": regs["inc"],
        "setmaxnreg dec (producer)": regs["dec"],
        "threads per CTA": int(threads.group(1)) if threads else None,
        "kernel": classes(ops),
        "kernel HGMMA shapes": hgmma_shapes(sass.splitlines()),
    }
    for role, role_ops in by_setmaxnreg(sass).items():
        out[f"role {role}"] = classes(role_ops)
    loops = kv_loops(sass)
    out["step loops"] = len(loops)
    if loops:
        ordered = by_mask(loops)
        out["step"] = step_rows(ordered[0])
        if len(loops) > 1:
            out["masked step"] = step_rows(ordered[-1])
    return out


def small_kernel_metrics(ptx: str, sass: str, registers: int, spills: int) -> dict:
    """Pre/post kernels: resources, threads, and the classes that move data."""
    c = classes(sass_opcodes(sass))
    threads = re.search(r"\.reqntid\s+(\d+)", ptx) or re.search(r"\.maxntid\s+(\d+)", ptx)
    widths = Counter(m.group(1) for line in sass.splitlines() if (m := re.search(
        r"\b((?:LDGSTS|LDG|STG|LDS|STS|LDSM|STSM|RED|ATOM|UBLKRED|UTMA)(?:\.[A-Z0-9_]+)*)\b",
        line)))
    keep = ("instructions", "LDG", "STG", "LDS", "STS", "UTMA* (TMA)", "UBLKRED (bulk reduction)",
            "RED/ATOM (global atomics)", "FFMA", "FMUL", "FADD")
    return {"registers": registers, "spill instructions": spills,
            "threads per CTA": int(threads.group(1)) if threads else None,
            **{k: c[k] for k in keep},
            "memory instructions (with width)": ", ".join(
                f"{op} x{n}" for op, n in sorted(widths.items(), key=lambda x: -x[1]))}


def config_name(d: int, causal: bool, det: bool) -> str:
    return f"d{d} {'causal' if causal else 'non-causal'}{' det' if det else ''}"


def our_structure(d: int, causal: bool, det: bool) -> dict:
    """What our backward declares (no compile): tiles, stages, shared memory, dQ's path."""
    from fa4_final.hopper.host import backward_config

    cfg = backward_config(d, causal, det, None)
    dq_bytes = cfg.tile_m * d * 4
    return {
        "tile (m x n)": f"{cfg.tile_m}x{cfg.tile_n}",
        "stages (Q, dO, dS)": f"{cfg.stages_q}, {cfg.stages_q}, {cfg.stages_ds}",
        "swaps": "dQ" if cfg.dq_swap_ab else "none",
        "mma warpgroups": 2,
        "shared memory bytes": cfg.smem_bytes(d),
        "dQ accumulation": (f"bulk float32 add (cp.reduce.async.bulk) by the producer's dQ warp, "
                            f"{dq_bytes} B per query tile in 2 x {dq_bytes // 2} B"
                            + (", in turns (semaphore per query tile)" if det else "")),
    }


def our_metrics(d: int, causal: bool, det: bool) -> dict:
    from fa4_final.hopper.host import backward_recipe
    from fa4_final.runtime.compile import artifacts

    arts = artifacts(backward_recipe(d, "bf16", causal, deterministic=det))
    main = arts["main"]
    out = kernel_metrics(main.ptx, main.sass, main.registers, main.spills)
    out.update(our_structure(d, causal, det))
    for role in ("pre", "post"):
        a = arts[role]
        out[role] = small_kernel_metrics(a.ptx, a.sass, a.registers, a.spills)
    out["compile seconds"] = round(sum(a.compile_seconds for a in arts.values()), 1)
    return out


# FA4's backward on (2, 4096, 16, d) bf16 fake tensors: the call compiles pre, main and post
# (each kernel's cubin dumped), then ends on fake tensors. The kernel object reports its knobs.
_TRITON_STUB = r'''
import sys, types
try:
    import triton  # noqa: F401
except ImportError:  # quack's autotuner needs triton; no kernel compiled here autotunes
    a = types.ModuleType("quack.autotuner")
    a.autotune = lambda *args, **kw: (lambda fn: fn)
    a.AutotuneConfig = type("AutotuneConfig", (), {"__init__": lambda self, *x, **k: None})
    a.Autotuner = type("Autotuner", (), {})
    sys.modules["quack.autotuner"] = a
try:
    import einops  # noqa: F401
except ImportError:  # flash_attn.cute.testing's references need it; the compile does not
    e = types.ModuleType("einops")
    e.rearrange = e.repeat = e.reduce = None
    sys.modules["einops"] = e
'''
_FA4_BWD_DRIVER = _TRITON_STUB + FA4_DRIVER_HEAD + r'''
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90 as K
det = os.environ.get("FA4_DET") == "1"
made, sizes = [], []
init, shared = K.__init__, K._get_shared_storage_cls
def record(self, *a, **kw):
    init(self, *a, **kw)
    made.append(self)
def storage(self):
    cls = shared(self)
    sizes.append(cls.size_in_bytes())
    return cls
K.__init__, K._get_shared_storage_cls = record, storage
zeros = torch.zeros  # the deterministic call's semaphores: fake CUDA zeros need CUDA's fill
torch.zeros = lambda *a, **kw: torch.empty(*a, **kw) if kw.get("device") else zeros(*a, **kw)
torch.cuda.current_device = lambda: 0  # the semaphores go through dlpack, which asks for it
with FakeTensorMode():
    b, s, h = 2, 4096, 16
    q, k, v, o, do = (torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
                      for _ in range(5))
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    t0 = time.time()
    try:
        interface._flash_attn_bwd(q, k, v, o, do, lse, causal=causal, deterministic=det)
    except Exception as exc:  # fake tensors end the call after the compile
        print("call ended with", type(exc).__name__, exc)
    print("compile seconds", round(time.time() - t0, 1))
x = made[-1]
print("FA4BWD " + json.dumps({
    "tile_m": x.tile_m, "tile_n": x.tile_n, "Q_stage": x.Q_stage, "dO_stage": x.dO_stage,
    "PdS_stage": x.PdS_stage, "SdP_swapAB": x.SdP_swapAB, "dKV_swapAB": x.dKV_swapAB,
    "dQ_swapAB": x.dQ_swapAB, "num_wg_mma": x.num_wg_mma, "num_wg_dQ": x.num_wg_dQ,
    "mma_dkv_is_rs": x.mma_dkv_is_rs, "smem": sizes[-1] if sizes else None,
    "regs": [x.num_producer_regs, x.num_mma_regs_wg0, x.num_mma_regs_wg1],
    "tile_hdim": x.tile_hdim, "deterministic": x.deterministic}))
'''


def _fa4_compile(d, causal, det, site):
    """FA4's pre, main and post kernels compiled by one call in a fresh process (as
    solutions.ch09_compare.compile_fa4 does for one kernel): ({role: (ptx, sass, registers,
    spill instructions)}, the driver's stdout)."""
    import os
    import subprocess
    import sys
    import tempfile

    from fa4_final.runtime.compile import disassemble, kernel_resources

    with tempfile.TemporaryDirectory(prefix="fa4_sm90_bwd_") as dump:
        env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a",
                   FLASH_ATTENTION_NUM_SMS=str(SMS), CUTE_DSL_KEEP_PTX="1",
                   CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=dump,
                   FA4_SITE=json.dumps(list(site)), FA4_DET="1" if det else "0")
        with tempfile.NamedTemporaryFile("w", suffix="_fa4_driver.py", delete=False) as f:
            f.write(_FA4_BWD_DRIVER)
        try:
            run = subprocess.run([sys.executable, f.name, str(d), str(int(causal))], env=env,
                                 capture_output=True, text=True, timeout=1800)
        finally:
            os.unlink(f.name)
        out = {}
        for role, word in (("main", "FlashAttentionBackwardSm90"),
                           ("pre", "FlashAttentionBackwardPreprocess"),
                           ("post", "FlashAttentionBackwardPostprocess")):
            ptxs = sorted(Path(dump).glob(f"*{word}*.ptx"))
            cubins = sorted(Path(dump).glob(f"*{word}*.cubin"))
            if not cubins:
                if role == "main":
                    raise RuntimeError(f"FA4 produced no {word}: {run.stdout[-1500:]}"
                                       f"{run.stderr[-1500:]}")
                continue
            sass = disassemble(cubins[-1].read_bytes())
            res = kernel_resources(cubins[-1].read_bytes(), sass)
            out[role] = (ptxs[-1].read_text() if ptxs else "", sass,
                         max(k.registers for k in res), sum(k.spill_instructions for k in res))
    return out, run.stdout


def fa4_metrics(d: int, causal: bool, det: bool, site=FA4_SITE) -> dict:
    """FA4's sm90 backward (bf16, 2 x 4096 x 16 heads, fake CUDA tensors) and its pre/post."""
    kernels, stdout = _fa4_compile(d, causal, det, site)
    found = re.search(r"^FA4BWD (.*)$", stdout, re.M)
    if not found:
        raise RuntimeError("FA4's backward driver did not report its kernel object")
    info = json.loads(found.group(1))
    assert info["deterministic"] == det, info
    ptx, sass, registers, spills = kernels["main"]
    out = kernel_metrics(ptx, sass, registers, spills)
    swaps = [n for n in ("SdP", "dKV", "dQ") if info[f"{n}_swapAB"]]
    tm, hd = info["tile_m"], info["tile_hdim"]
    out.update({
        "tile (m x n)": f"{tm}x{info['tile_n']}",
        "stages (Q, dO, dS)": f"{info['Q_stage']}, {info['dO_stage']}, {info['PdS_stage']}",
        "swaps": ", ".join(swaps) or "none",
        "mma warpgroups": info["num_wg_mma"],
        "shared memory bytes": info["smem"],
        "dQ accumulation": (f"bulk float32 add (cp.reduce.async.bulk) by the producer's dQ warp, "
                            f"{tm * hd * 4} B per query tile in {info['num_wg_dQ']} x "
                            f"{tm * hd * 4 // info['num_wg_dQ']} B"
                            + (", in turns (semaphore per query tile)" if det else "")),
        "role budgets (producer, wg0, wg1)": info["regs"],
        "dK/dV GEMMs with P/dS from registers": info["mma_dkv_is_rs"],
    })
    for role in ("pre", "post"):
        if role in kernels:
            out[role] = small_kernel_metrics(*kernels[role])
    m = re.search(r"compile seconds ([\d.]+)", stdout)
    out["compile seconds"] = float(m.group(1)) if m else None
    return out


def flatten(impl: str, config: str, metrics: dict) -> list[dict]:
    """Rows (impl, config, metric, value, unit); a nested dict becomes 'name: key'."""
    return _flat(impl, config, metrics, {"shared memory bytes": "bytes", "compile seconds": "s"})


def path() -> Path:
    return results.RESULTS_DIR / FOLDER / f"{NAME}.json"


def load_table() -> results.Results:
    return results.load(NAME, gpu=FOLDER)


def build_rows(ours_only: bool, site=FA4_SITE, configs=CONFIGS) -> list[dict]:
    rows = []
    stored = load_table().rows if ours_only and path().exists() else []
    for d, causal, det in configs:
        name = config_name(d, causal, det)
        print("compiling", name, flush=True)
        rows += flatten("fa4_final", name, our_metrics(d, causal, det))
        if ours_only:
            rows += [r for r in stored if r["impl"] == "fa4" and r["config"] == name]
        else:
            rows += flatten("fa4", name, fa4_metrics(d, causal, det, site))
    return rows


def write(ours_only: bool = False, site=FA4_SITE) -> Path:
    command = "python -m measure.bwd_sass_vs_fa4 --write" + (" --ours" if ours_only else "")
    rows = build_rows(ours_only, site)
    prov = results.collect_provenance(command)
    prov.update(gpu="none: compile-only for sm_90a on a CPU", driver="none",
                fa4_version=FA4_VERSION, mode="compile-only (fake tensors)")
    if ours_only and path().exists():
        old = load_table().provenance  # where FA4's rows were compiled, kept over rewrites
        prov["fa4_rows_from"] = old.get("fa4_rows_from") or (
            f"{old.get('commit', '?')[:10]} {old.get('date', '?')}")
    return results.save(NAME, rows, command, gpu=FOLDER, provenance=prov)


SUMMARY = ["registers (launch)", "setmaxnreg inc (mma warpgroups)", "setmaxnreg dec (producer)",
           "spill instructions", "shared memory bytes", "tile (m x n)", "stages (Q, dO, dS)",
           "swaps", "step: instructions", "step: HGMMA", "step: HGMMA shapes", "step: MUFU.EX2",
           "step: FFMA", "step: FMUL", "step: FADD", "step: F2FP (fp32 -> 16-bit pairs)",
           "step: LDS", "step: STS", "step: LDSM", "step: STSM", "step: SHFL",
           "step: BAR (named barriers)", "step: SYNCS (mbarrier)", "step: WARPSYNC",
           "step: WARPGROUP.DEPBAR", "role producer: UBLKRED (bulk reduction)",
           "role producer: UTMA* (TMA)", "role mma: RED/ATOM (global atomics)",
           "pre: instructions", "pre: threads per CTA", "post: instructions",
           "post: threads per CTA",
           "pre: memory instructions (with width)", "post: memory instructions (with width)"]


def value(res: results.Results, impl: str, config: str, metric: str):
    rows = res.where(impl=impl, config=config, metric=metric)
    return rows[0]["value"] if rows else "-"


def side_by_side(res: results.Results, config: str, metrics=SUMMARY) -> str:
    """One configuration: metric, ours, FA4's."""
    lines = [f"{config:40s}{'fa4_final':>26s}{'fa4':>26s}"]
    for m in metrics:
        a, b = (str(value(res, i, config, m)) for i in ("fa4_final", "fa4"))
        lines.append(f"{m[:40]:40s}{a[:25]:>26s}{b[:25]:>26s}")
    return "\n".join(lines)


def differences(res: results.Results, config: str, prefix: str = "step: ") -> list[tuple]:
    """(metric, ours, FA4's, ours - FA4's) of the integer metrics under ``prefix`` that differ
    between the two sides in ``config``, largest difference first."""
    out = []
    for r in res.where(impl="fa4_final", config=config):
        m, ours = r["metric"], r["value"]
        if not m.startswith(prefix) or not isinstance(ours, int) or isinstance(ours, bool):
            continue
        theirs = value(res, "fa4", config, m)
        if isinstance(theirs, int) and theirs != ours:
            out.append((m.removeprefix(prefix), ours, theirs, ours - theirs))
    return sorted(out, key=lambda x: -abs(x[3]))


def print_differences(res: results.Results, configs=None, prefix: str = "step: ") -> None:
    """``differences`` of each configuration, one block each."""
    for d, causal, det in configs or CONFIGS:
        name = config_name(d, causal, det)
        print(f"{name}  ({prefix.rstrip(': ') or 'kernel'}; ours, FA4's, difference)")
        for m, a, b, diff in differences(res, name, prefix):
            print(f"    {m[:38]:38s}{a:>8}{b:>8}{diff:>+8}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--ours", action="store_true", help="regenerate our rows only")
    ap.add_argument("--fa4-site", nargs="*", default=list(FA4_SITE))
    args = ap.parse_args(argv)
    if args.write:
        print(write(args.ours, tuple(args.fa4_site)))
    res = load_table()
    for d, causal, det in CONFIGS:
        print(side_by_side(res, config_name(d, causal, det)), "\n")


if __name__ == "__main__":
    main()
