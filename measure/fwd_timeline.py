"""The in-kernel timeline of CTA 0 of fa4_final's Hopper forward (common.timeline), for the
Gantt chart of chapter 08: the default, and the same kernel with chapter 05's schedule.

    python -m measure.fwd_timeline      # results/<gpu>/ch08_timeline.json

A debug build (``timeline=True``) stamps the SM's cycle counter at each phase of each KV step of
each consumer warpgroup of CTA 0's first tile. Rows: (impl, role, step, the stamps in cycles
relative to the run's first stamp).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace

RESULTS = "ch08_timeline"
SHAPE = (4, 4096, 16, 128)  # batch, seqlen, heads, head dim; non-causal
PRODUCES = [(f"results/h200/{RESULTS}.json", "python -m measure.fwd_timeline",
             "phase stamps of CTA 0's first tile: fa4_final and chapter 05's schedule")]


def plans() -> dict:
    """Name -> config: the default at D = 128, and chapter 05's schedule in the same kernel as
    far as its knobs go (no ping-pong, one tile per CTA, two K stages; the O rescale's place and
    O over Q were knobs once, deleted since: this kernel keeps its own)."""
    from fa4_final.hopper.config import hopper_fwd_default

    base = hopper_fwd_default(128, False)
    return {"fa4_final": base,
            "chapter 05 schedule": replace(base, pingpong=False, schedule="grid",
                                           stages_k=2, stages_v=2)}


def timeline(save: bool = True) -> list[dict]:
    from fa4_final.common.timeline import MARKS, Mark
    from fa4_final.runtime.prologue import forward, forward_timeline
    from utils import results
    from utils.reference import random_qkv

    b, s, h, d = SHAPE
    q, k, v, seed = random_qkv(b, s, h, d, device="cuda")
    rows = []
    for name, cfg in plans().items():
        for _ in range(3):  # warm: compiled, clocks up
            forward(q, k, v, config=replace(cfg, timeline=True))
        tl = forward_timeline(q, k, v, config=cfg)
        t0 = int(tl[tl > 0].min())
        for role in range(tl.shape[0]):
            for step in range(tl.shape[1]):
                stamps = [int(x) - t0 if x > 0 else None for x in tl[role, step].tolist()]
                if any(x is not None for x in stamps):
                    rows.append({"impl": name, "role": role, "step": step,
                                 "metric": "phase stamps", "unit": "cycles",
                                 "value": dict(zip([m.name for m in Mark], stamps)),
                                 "seed": seed, "knobs": asdict(cfg)})
    assert MARKS == len(Mark)
    if save:
        print("wrote", results.save(RESULTS, rows, command="python -m measure.fwd_timeline"))
    return rows


def main(argv=None) -> int:
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90); the stored results are in results/h200/")
        return 0
    timeline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
