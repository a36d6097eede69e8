"""Benchmark the forward at the features models use: head dims 96, 192 (dv 128) and 256,
softcap and learnable sinks at D = 128; and the backward at head dim 96, at 192 with dv = 128,
and at D = dv = 192 and 256; fa4_final beside its peers in one run.

    python -m measure.features                               # the forward grid, both modes
    python -m measure.features --cases d192_dv128 --seqlens 4096 --causal 1
    python -m measure.features --deadline 500
    python -m measure.features --name features_bwd --cases bwd_d96 --deadline 500
    python -m measure.features --name features_bwd_d192 --cases bwd_d192 --deadline 500
    python -m measure.features --name features_bwd_swapped --cases bwd_d192v192 bwd_d256 \
        --deadline 500

Cases (``--cases``):
  d96, d192_dv128, d192, d256     head dims (D, dv): (96, 96), (192, 128), (192, 192), (256, 256)
  softcap, sink, softcap_sink     D = 128 with softcap 30 (Gemma 2's), a float32 sink per head
                                  (gpt-oss), or both
  bwd_d96, bwd_d192                the backward at D = dv = 96 and at D = 192, dv = 128
  bwd_d192v192, bwd_d256           the backward at D = dv = 192 and 256 (dK and dV swapped)
                                  (``pass`` "bwd"; not in the default --cases, which are the
                                  forward's)
Shapes: ``--seqlens`` S (queries = keys), batch x S = ``--tokens`` (16384), ``--heads`` 16
query heads over as many KV heads, causal (``--causal 0 1``), bf16.

Rows, on the same q, k, v (and sink) of a shape, interleaved in ``--rounds`` rounds
(utils.bench.interleaved, each round in the other direction from the last):
  fa4_final     the Hopper forward launched directly (fa4_final.hopper.host.forward_recipe and
                launch_forward with head_dim_v, softcap, sink_dtype): what the API's call with
                these arguments runs.
  fa4_final_64_keys   at D = dv = 192 and 256, the same kernel with the tile compiling alone
                picks there (64 keys, three K stages), beside the default, which takes the FA4
                package's tile_n (112 and 80 keys, two K and two V stages; P converted pair by
                pair: Note [Pairwise conversion]) since a run of this driver timed both.
                results/h200/features_more.json holds that run, whose rows were named for the
                default then: fa4_final (64 keys) and fa4_final_fa4_tile (FA4's tile).
  fa4_final_3wg   at D = dv = 96, the same kernel with three consumer warpgroups (192-row
                tiles, as the FA4 package runs D = 96) of 96 keys in three K stages, P converted
                pair by pair: the dense default at D = 96 since results/h100/features_d96.json
                timed it beside two warpgroups (the row then equals fa4_final)
  fa4_package   the FA4 package's flash_attn_func with the same arguments
  sdpa_flash, sdpa_cudnn    PyTorch SDPA with one backend each, where it takes the case (no
                softcap, no sink: those rows are not built, and say so)
Before timing, every row's output is compared with float64 on a slice of the batch
(``max_diff``): a wrong kernel is not timed in silence, and the peers' errors are the yardstick
of a bf16 kernel's. A row's ``vs_best_peer`` is its TFLOP/s over the fastest peer of its shape
and mode; FLOPs are 2 x (D + dv) per query-key pair, halved by the causal mask.

The backward cases (BWD_CASES) time the backward alone, as utils.bench does: each
implementation's forward runs once on the same q, k, v (requiring grad), then
torch.autograd.grad of its out with the graph kept is the timed call. Rows: fa4_final through
the public flash_attn_func, the FA4 package's flash_attn_func, sdpa_flash and sdpa_cudnn (a
backend that does not run the shape gets a row saying so). ``max_diff`` is then the largest
|error| of dq, dk, dv against float64 on one head of the first sequence (every query and key
row, so dk and dv are whole); FLOPs are 2 x (3 D + 2 dv) per pair (five GEMMs), halved by the
causal mask.

Two modes (``mode``): ``flush`` (the L2 overwritten before every call) and ``back_to_back``.
``--deadline`` seconds: the run stops after the shape that passes it and says so.
Writes results/<gpu>/<name>.json (utils.results.save, with provenance).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

import torch

from measure._modes import (
    add_timing_args,
    check_timing_args,
    deadline_note,
    past_deadline,
    rows_in_modes,
)
from utils import bench, results

PRODUCES = [
    ("results/h200/features.json", "python -m measure.features --deadline 540",
     "the forward at D = 96, 192 (dv 128 and 192) and 256, and with softcap / learnable sinks "
     "at D = 128: fa4_final's Hopper kernel launched directly (checked against float64 first) "
     "beside the FA4 package, SDPA flash and cuDNN; S = 4096 and 16384, causal or not, L2 "
     "flushed and back to back (the stored run: S = 4096, four cases, three rounds)"),
    ("results/h200/features_more.json", "python -m measure.features --name features_more "
     "--cases d192 softcap sink d96 d192_dv128 d256 --seqlens 16384 4096 --rounds 3",
     "the same at six cases, S = 16384 and 4096; at D = dv = 192 and 256 the FA4 package's "
     "tile and the 64-key tile side by side (read by chapter 08's prediction 08.p4 and the "
     "head-dims lab; the package's default there follows it)"),
    ("results/h100/features.json", "python -m measure.features --deadline <now + 455>",
     "an H100 visit (no H200 was lent): the forward grid of the first row, every case, S = 4096 "
     "and 16384"),
    ("results/h100/features_bwd.json", "python -m measure.features --name features_bwd "
     "--cases bwd_d96 bwd_d192 --deadline 240",
     "an H100 visit: the backward at D = 96 and at D = 192 with dv = 128 beside the FA4 "
     "package, SDPA flash and cuDNN (where they run it), S = 4096 and 16384, causal or not"),
    ("results/h100/features_bwd_swapped.json", "python -m measure.features --name "
     "features_bwd_swapped --cases bwd_d192v192 bwd_d256 --deadline 500",
     "an H100 visit: the backward at D = dv = 192 and 256 (dK and dV swapped, lse and delta "
     "read before the GEMM waits) beside the FA4 package, SDPA flash and cuDNN"),
    ("results/h100/features_d96.json", "python -m measure.features --name features_d96 "
     "--cases d96 --deadline 110", "an H100 visit: the forward at D = 96 with the three-"
     "consumer-warpgroup candidate (fa4_final_3wg) beside the default and the peers"),
    ("results/h100/features_d96_default.json", "python -m measure.features --name "
     "features_d96_default --cases d96 --deadline 100", "the same visit, after three warpgroups "
     "became the D = 96 default: fa4_final and fa4_final_3wg are then one kernel, so their "
     "difference is the run's noise"),
]

# name: (D, dv, softcap, sink)
CASES = {
    "d96": (96, 96, 0.0, False),
    "d192_dv128": (192, 128, 0.0, False),
    "d192": (192, 192, 0.0, False),
    "d256": (256, 256, 0.0, False),
    "softcap": (128, 128, 30.0, False),
    "sink": (128, 128, 0.0, True),
    "softcap_sink": (128, 128, 30.0, True),
    "bwd_d96": (96, 96, 0.0, False),
    "bwd_d192": (192, 128, 0.0, False),
    "bwd_d192v192": (192, 192, 0.0, False),
    "bwd_d256": (256, 256, 0.0, False),
}
# the backward (pass "bwd"): fa4_final through the public flash_attn_func
BWD_CASES = ("bwd_d96", "bwd_d192", "bwd_d192v192", "bwd_d256")
FWD_CASES = tuple(c for c in CASES if c not in BWD_CASES)  # the default --cases
PEERS = ("fa4_package", "sdpa_flash", "sdpa_cudnn")
# the cases whose default is a timed tile (fa4_final.hopper.config.MEASURED_TILE_N, the FA4
# package's own sm90 tile_n): the compile-only tile is timed beside it as a second row
COMPILE_FIT_CASES = ("d192", "d256")
THREE_WG_CASES = ("d96",)  # a candidate default: three consumer warpgroups (fa4_final_3wg)


@dataclass(frozen=True)
class FeatureShape:
    case: str
    b: int
    s: int
    h: int
    causal: bool

    @property
    def dims(self) -> tuple[int, int]:
        return CASES[self.case][:2]

    @property
    def pass_(self) -> str:
        return "bwd" if self.case in BWD_CASES else "fwd"

    def flops(self) -> float:
        """2 x (D + dv) a visible pair forward (S = Q K^T, O = P V); the backward's five GEMMs
        2 x (3 D + 2 dv) (S, dK, dQ over D; dP, dV over dv)."""
        d, dv = self.dims
        pairs = self.b * self.h * self.s * self.s * (0.5 if self.causal else 1.0)
        if self.pass_ == "bwd":
            return 2.0 * pairs * (3 * d + 2 * dv)
        return 2.0 * pairs * (d + dv)


def grid(cases, seqlens, causal, tokens: int, heads: int) -> list[FeatureShape]:
    return [FeatureShape(c, max(1, tokens // s), s, heads, bool(ca))
            for c, s, ca in itertools.product(cases, seqlens, causal)]


def row_fields(shape: FeatureShape) -> dict:
    d, dv, softcap, sink = CASES[shape.case]
    return {"pass": shape.pass_, "dtype": "bf16", "case": shape.case, "b": shape.b, "s": shape.s,
            "h": shape.h, "d": d, "dv": dv, "causal": shape.causal, "softcap": softcap,
            "sink": sink, "flops": shape.flops()}


def reference_slice(q, k, v, sink, causal, scale, softcap):
    """(the slice's inputs, its float64 out): the first sequence's last 512 query rows over all
    its keys (causal is bottom-right aligned, so those rows see every key); the reference's
    memory grows with S x S."""
    from utils.reference import attention_reference_features

    rows = min(512, q.shape[1])
    sl = slice(q.shape[1] - rows, q.shape[1])
    ref, _ = attention_reference_features(q[:1, sl], k[:1], v[:1], causal, scale, softcap, sink)
    return sl, ref


def max_diff(out, sl, ref) -> float:
    """max |out - float64| over the reference slice."""
    return float((out[:1, sl].double() - ref).abs().max())


def three_wg_config(shape: FeatureShape):
    """Our default config at D = dv = 96 with three consumer warpgroups (tile_m 192) of 96 keys
    in three K stages: what the FA4 package's D = 96 tile suggests, within our 128-key cap."""
    from dataclasses import replace

    from fa4_final.hopper.config import hopper_fwd_default

    d, dv = shape.dims
    cfg = replace(hopper_fwd_default(d, shape.causal, head_dim_v=dv), num_consumer_wgs=3,
                  tile_n=96, stages_k=3, stages_v=2)
    cfg.check(d, dv)
    return cfg


def shape_rows(res, case: str, s: int, causal: bool, mode: str = "flush") -> dict:
    """{impl: row} of one shape and mode of a stored run of this driver."""
    return {r["impl"]: r for r in res.rows if r.get("case") == case and r.get("s") == s
            and bool(r.get("causal")) == causal and r.get("mode") == mode}


def tile_pair(rows: dict):
    """(FA4's tile row, the 64-key row) of one shape at D = dv = 192 or 256: a run whose default
    was the 64-key tile names them fa4_final_fa4_tile and fa4_final; a run whose default is
    FA4's tile (MEASURED_TILE_N) names them fa4_final and fa4_final_64_keys."""
    if "fa4_final_64_keys" in rows:
        return rows.get("fa4_final"), rows["fa4_final_64_keys"]
    return rows.get("fa4_final_fa4_tile"), rows.get("fa4_final")


def tile_ratio(res, case: str, s: int, causal: bool, mode: str = "flush"):
    """FA4's tile over the 64-key tile at one shape and mode (tile_pair), by median time; None
    if either was not timed."""
    tile, keys64 = tile_pair(shape_rows(res, case, s, causal, mode))
    cmp = bench.compare(tile, keys64) if tile and keys64 else None
    return None if cmp is None else cmp.ratio


def compile_fit_config(shape: FeatureShape):
    """Our default config with the tile compiling alone picks at D = dv = 192 and 256: 64 keys,
    three K and two V stages, O over Q when O's own buffer does not fit."""
    from dataclasses import replace

    from fa4_final.common.constants import SM90_SMEM_BYTES
    from fa4_final.hopper.config import hopper_fwd_default

    d, dv = shape.dims
    cfg = replace(hopper_fwd_default(d, shape.causal, head_dim_v=dv), tile_n=64, stages_k=3,
                  stages_v=2, separate_o=True)
    if cfg.smem_bytes(d, head_dim_v=dv) > SM90_SMEM_BYTES:
        cfg = replace(cfg, separate_o=False)
    cfg.check(d, dv)
    return cfg


def bwd_reference(q, k, v, dout, causal, scale):
    """float64 (dq, dk, dv) of one head of the first sequence, every row: what each backward
    row's gradients are compared with (``bwd_max_diff``)."""
    from utils.reference import causal_mask

    leaves = [t[:1, :, :1].detach().double().requires_grad_(True) for t in (q, k, v)]
    qf, kf, vf = (t.transpose(1, 2) for t in leaves)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    out = (torch.softmax(s, -1) @ vf).transpose(1, 2)
    return torch.autograd.grad(out, leaves, dout[:1, :, :1].double())


def bwd_max_diff(grads, ref) -> float:
    """max |grad - float64| over dq, dk, dv on bwd_reference's head."""
    return max(float((g[:1, :, :1].double() - r).abs().max()) for g, r in zip(grads, ref))


def _bwd_calls(shape: FeatureShape, device="cuda"):
    """({name: zero-argument backward call}, {name: extra row fields}): each implementation's
    forward once, then torch.autograd.grad of its out (graph kept) is the timed call."""
    d, dv = shape.dims
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(shape.b, shape.s, shape.h, d, device=device, dtype=dt, generator=g)
    k = torch.randn(shape.b, shape.s, shape.h, d, device=device, dtype=dt, generator=g)
    v = torch.randn(shape.b, shape.s, shape.h, dv, device=device, dtype=dt, generator=g)
    dout = torch.randn(shape.b, shape.s, shape.h, dv, device=device, dtype=dt, generator=g)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    scale = d ** -0.5
    forwards, extra = {}, {}
    try:
        from fa4_final import flash_attn_func as ours

        forwards["fa4_final"] = lambda: ours(q, k, v, softmax_scale=scale, causal=shape.causal)
    except Exception as exc:
        extra["fa4_final"] = {"error": bench.error_text(exc)}
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # the FA4 package is not installed here: its rows are left out
        pass
    else:
        forwards["fa4_package"] = lambda: flash_attn_func(q, k, v, softmax_scale=scale,
                                                          causal=shape.causal)
    for name in ("sdpa_flash", "sdpa_cudnn"):
        fn = bench.peers()[name]
        forwards[name] = lambda fn=fn: fn(q, k, v, causal=shape.causal, softmax_scale=scale)
    ref = bwd_reference(q, k, v, dout, shape.causal, scale)
    calls = {}
    for name, forward in forwards.items():
        try:
            out = forward()
            out = out[0] if isinstance(out, tuple) else out

            def backward(out=out):
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            grads = backward()
            torch.cuda.synchronize()
            extra.setdefault(name, {})["max_diff"] = bwd_max_diff(grads, ref)
            calls[name] = backward
        except Exception as exc:  # recorded (e.g. a backend that does not run D = 96)
            extra.setdefault(name, {})["error"] = bench.error_text(exc)
    return calls, extra


def _calls(shape: FeatureShape, device="cuda"):
    """({name: zero-argument forward call}, {name: extra row fields}); the backward cases'
    are _bwd_calls'."""
    if shape.pass_ == "bwd":
        return _bwd_calls(shape, device)
    d, dv, softcap, with_sink = CASES[shape.case]
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(shape.b, shape.s, shape.h, d, device=device, dtype=dt, generator=g)
    k = torch.randn(shape.b, shape.s, shape.h, d, device=device, dtype=dt, generator=g)
    v = torch.randn(shape.b, shape.s, shape.h, dv, device=device, dtype=dt, generator=g)
    sink = (torch.randn(shape.h, device=device, generator=g) + 1.0) if with_sink else None
    scale = d ** -0.5
    calls, extra = {}, {}
    try:
        from fa4_final.hopper.host import forward_recipe, launch_forward
        from fa4_final.runtime.compile import compiled

        configs = {"fa4_final": None}
        if shape.case in COMPILE_FIT_CASES:
            configs["fa4_final_64_keys"] = compile_fit_config(shape)
        if shape.case in THREE_WG_CASES:
            configs["fa4_final_3wg"] = three_wg_config(shape)
        for name, cfg in configs.items():
            plan = compiled(forward_recipe, d, "bf16", shape.causal, cfg, False, False, False,
                            False, "sm_90a", softcap, "fp32" if with_sink else None, dv)
            out = torch.full((shape.b, shape.s, shape.h, dv), float("nan"), device=device,
                             dtype=dt)
            lse = torch.empty(shape.b, shape.h, shape.s, device=device, dtype=torch.float32)

            def ours(plan=plan, out=out, lse=lse):
                launch_forward(plan, q, k, v, out, lse, shape.causal, scale, None,
                               0 if shape.causal else None, sink)
                return out
            calls[name] = ours
            extra[name] = {"config": repr(plan.config)}
    except Exception as exc:  # recorded as the row's error; the peers are still timed
        extra.setdefault("fa4_final", {})["error"] = bench.error_text(exc)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # the FA4 package is not installed here: its rows are left out
        pass
    else:
        kw = {"softcap": softcap} if softcap else {}
        if with_sink:
            kw["learnable_sink"] = sink
        calls["fa4_package"] = lambda: flash_attn_func(q, k, v, softmax_scale=scale,
                                                       causal=shape.causal, **kw)
    for name in ("sdpa_flash", "sdpa_cudnn"):
        if softcap or with_sink:
            extra[name] = {"error": "not built: SDPA takes neither a softcap nor a sink"}
            continue
        fn = bench.peers()[name]
        calls[name] = lambda fn=fn: fn(q, k, v, causal=shape.causal, softmax_scale=scale)
    # every implementation's error on the same float64 slice, before timing: a wrong kernel is
    # not timed in silence, and the peers' errors say what a bf16 kernel's error is
    sl, ref = reference_slice(q, k, v, sink, shape.causal, scale, softcap)
    for name, fn in list(calls.items()):
        try:
            got = fn()
            got = got[0] if isinstance(got, tuple) else got
            torch.cuda.synchronize()
            extra.setdefault(name, {})["max_diff"] = max_diff(got, sl, ref)
        except Exception as exc:  # recorded, left out of the timing
            extra.setdefault(name, {})["error"] = bench.error_text(exc)
            del calls[name]
    return calls, extra


def attach_ratios(rows: list[dict]) -> list[dict]:
    key = ("mode", "pass", "case", "b", "s", "h", "causal")
    for row in rows:
        if not row.get("tflops"):
            continue
        same = [r for r in rows if r["impl"] in PEERS and r.get("tflops") and r is not row
                and all(r.get(k_) == row.get(k_) for k_ in key)]
        if same:
            best = max(same, key=lambda r: r["tflops"])
            row.update(best_peer=best["impl"], best_peer_tflops=best["tflops"],
                       best_peer_spread=best.get("spread"),
                       vs_best_peer=row["tflops"] / best["tflops"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--name", default="features")
    ap.add_argument("--cases", nargs="+", default=list(FWD_CASES), choices=list(CASES))
    ap.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    add_timing_args(ap)
    args = ap.parse_args(argv)
    check_timing_args(ap, args)
    if not torch.cuda.is_available():
        print("features: needs a CUDA GPU", file=sys.stderr)
        return 2

    start = time.monotonic()
    shapes = grid(args.cases, args.seqlens, args.causal, args.tokens, args.heads)
    rows, done = [], 0
    for shape in shapes:
        if past_deadline(args, start):
            break
        fields = row_fields(shape)
        calls, extra = _calls(shape)
        rows += rows_in_modes(calls, extra, fields, shape.flops(), args)
        del calls
        torch.cuda.empty_cache()
        done += 1
        print(f"[{time.monotonic() - start:.0f} s] {shape}", flush=True)
    rows = attach_ratios(rows)
    note = deadline_note(args, done, len(shapes))
    path = results.save(args.name, rows, command="python -m measure.features " + " ".join(
        argv if argv is not None else sys.argv[1:]) + f"  [{note}]")
    print(f"wrote {path}: {note}")
    for r in rows:
        if r["impl"].startswith("fa4_final"):
            verdict = (f"{r['vs_best_peer']:.2f}x {r['best_peer']} (spreads "
                       f"{r.get('spread') or 0:.1%} / {r.get('best_peer_spread') or 0:.1%})"
                       if r.get("vs_best_peer") else r.get("error", "no peer"))
            print(f"{r['impl']:19s} {r['case']:13s} {r['mode']:12s} S={r['s']} "
                  f"causal={r['causal']}: {verdict}; max_diff "
                  f"{r.get('max_diff', float('nan')):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
