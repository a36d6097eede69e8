"""Chapter 07's measurement: chapter 05's kernel with the rescale threshold off (tau = 0) and on
(tau = 8), on random inputs and on the adversarial ones whose maxima grow at every tile, causal
and not, each verified against the float64 reference, then timed in interleaved rounds beside
the peers (which run the same instructions whatever the data: the control for the inputs).

    python -m measure.rescale_knob --save          # on an H100/H200: verify, time, save
    python -m measure.rescale_knob --rounds 5

How the rows are read: ``solutions.ch07_rescaling`` (format_knob_rows, the claims).
"""

from __future__ import annotations

import sys

import torch

from solutions.ch07_rescaling import (
    FA4_RESCALE_THRESHOLD,
    RESULTS_NAME,
    format_knob_rows,
    knob_configs,
    o_multiply_share,
    pattern_qkv,
)

COMMAND = "python -m measure.rescale_knob --save"
PRODUCES = [(f"results/h200/{RESULTS_NAME}.json", COMMAND,
             "chapter 05's kernel with tau = 0 and tau = 8 on random and adversarial inputs, "
             "causal and not, verified then timed beside the peers, with the model's share of "
             "O multiplies")]


def _bench_inputs(pattern: str, batch: int, seqlen: int, heads: int, dim: int, tau: float,
                  tile_n: int):
    """bf16 CUDA q, k, v (batch, seqlen, heads, dim) and a seed: fresh N(0, 1) ("random") or
    ``adversarial_qkv`` per head for the kernel's tile_n and reverse order ("adversarial")."""
    from utils.reference import random_qkv

    if pattern == "random":
        q, k, v, seed = random_qkv(batch, seqlen, heads, dim, device="cuda")
        return q, k, v, seed
    qkv = [pattern_qkv("adversarial", seqlen, seqlen, heads, dim, seed=b, tile_n=tile_n,
                       tau=tau, kv_order="reverse") for b in range(batch)]
    q, k, v = (torch.cat([t[i] for t in qkv]).to("cuda", torch.bfloat16) for i in range(3))
    return q, k, v, 0


def benchmark_knob(seqlen: int = 16384, heads: int = 16, dim: int = 128,
                   tau: float = FA4_RESCALE_THRESHOLD, rep: int = 30,
                   causal_modes=(False, True), rounds: int = 3) -> list[dict]:
    """Chapter 05's forward with the knob off (tau = 0) and on, on random inputs (the max
    settles: the vote skips almost every O rescale) and on adversarial ones (every tile
    rescales: the vote is pure overhead), causal and not. Every (inputs, causal, config) is
    first checked against the float64 reference on a small awkward shape (NaN-poisoned
    outputs, ``ch05.run_and_compare``); a failure raises AssertionError before any timing.

    Then everything is timed in ``rounds`` interleaved rounds (``utils.bench.interleaved``):
    both configs and the peers (SDPA flash, cuDNN, the FA4 package) on both inputs, causal and
    not, once per round. The peers are the control for the inputs: they run the same
    instructions whatever the data, so a difference they show between random and adversarial
    inputs comes from the hardware (clock, power), not from a kernel's branches. Needs a Hopper
    GPU; returns rows for utils.results with the median over rounds, the per-round values,
    the spread, the SM clock and power of each round, the peers of the same inputs
    (``peers_tflops``, ``best_peer``), and the model's share of O multiplies
    (``o_multiply_share``) next to each time."""
    from solutions import ch05_flash_hopper as ch05
    from utils import bench as ub

    off, on = knob_configs(dim, tau)
    batch = max(1, 16384 // seqlen)
    rows, calls, flops_of = [], {}, {}
    for pattern in ("random", "adversarial"):
        q, k, v, seed = _bench_inputs(pattern, batch, seqlen, heads, dim, tau, off.tile_n)
        for causal in causal_modes:
            group = (pattern, causal)
            flops_of[group] = ub.attention_flops(batch, heads, seqlen, seqlen, dim, causal)
            for cfg in (off, on):
                small = _bench_inputs(pattern, 1, 1031, 2, dim, tau, cfg.tile_n)[:3]
                ok, line = ch05.run_and_compare(*small, causal, config=cfg,
                                                label=f"{pattern} tau={cfg.rescale_threshold:g}")
                print(line, flush=True)
                if not ok:
                    raise AssertionError(line)
                name = f"tau={cfg.rescale_threshold:g}"
                calls[(group, name)] = lambda q=q, k=k, v=v, c=causal, cfg=cfg: ch05.attention(
                    q, k, v, c, config=cfg)
                rows.append({
                    "impl": "flash_hopper", "config": name,
                    "pass": "fwd", "dtype": "bf16", "b": batch, "s": seqlen, "h": heads, "d": dim,
                    "causal": causal, "ms": None, "tflops": None,
                    "inputs": pattern, "rescale_threshold": cfg.rescale_threshold,
                    "o_multiply_share_model": o_multiply_share(q, k, causal,
                                                               cfg.rescale_threshold, cfg.tile_n),
                    "seed": seed, "verified": True,
                })
            for peer, call in ub.peer_calls(q, k, v, causal).items():
                calls[(group, ub.PEER_KEY, peer)] = call
    measured = ub.interleaved(calls, rounds=rounds, rep=rep,
                              progress=lambda line: print("  " + line, flush=True))
    for row in rows:
        group = (row["inputs"], row["causal"])
        row.update(measured[(group, row["config"])].fields(flops_of[group]))
        row.update(ub.peer_fields({key[2]: m for key, m in measured.items()
                                   if key[0] == group and key[1:2] == (ub.PEER_KEY,)},
                                  flops_of[group]))
    return rows


def main(argv=None) -> int:
    """``python -m measure.rescale_knob [--save]`` on a Hopper GPU: chapter 05's kernel with the
    knob off and on, random and adversarial inputs, causal and not; --save writes
    results/<gpu>/ch07_rescale.json."""
    import argparse

    from utils import results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--save", action="store_true", help=f"write results/<gpu>/{RESULTS_NAME}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds: at least 3, so a round's spread can be told from an effect")
    if not torch.cuda.is_available():
        print("no CUDA GPU here; the stored figures: utils.results.load('ch07_rescale')")
        return 0
    rows = benchmark_knob(seqlen=args.seqlen, rounds=args.rounds)
    print(format_knob_rows(rows))
    if args.save:
        command = COMMAND
        if args.seqlen != 16384:
            command += f" --seqlen {args.seqlen}"
        if args.rounds != 3:
            command += f" --rounds {args.rounds}"
        print("wrote", results.save(RESULTS_NAME, rows, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
