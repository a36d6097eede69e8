"""A small GPT trained a few hundred steps with fa4_final and with SDPA, same weights, same
batches: the loss curves must agree within Note [How close two loss curves must be]
(solutions/ch13_training.py). Needs the backward; the speed table is the driver's job:
    python -m measure.package_training
"""

from dataclasses import replace

import pytest
import torch

from solutions import ch13_training as tr
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


def _backward_missing() -> str | None:
    from fa4_final.runtime.dispatch import module_present

    if module_present("fa4_final.hopper.bwd"):
        return None
    return "this build has no Hopper backward (fa4_final.hopper.bwd)"


needs_backward = pytest.mark.skipif(_backward_missing() is not None,
                                    reason=str(_backward_missing()))


@pytest.fixture(scope="module")
def runs():
    cfg = tr.TrainConfig()
    return cfg, {name: tr.train(name, cfg, "cuda")
                 for name in ("fa4_final", "sdpa_flash", "sdpa_efficient")}


@needs_backward
def test_loss_curves_agree_with_sdpa(runs):
    cfg, got = runs
    verdict = tr.compare(got, cfg)
    print("\n" + tr.report(got, cfg, verdict))
    assert verdict["ok"], tr.report(got, cfg, verdict)


@needs_backward
def test_compiled_training_follows_eager(runs):
    """The same run through torch.compile(fullgraph=True): the custom ops inside an inductor
    graph, forward and backward. Inductor fuses the other ops differently, so the curves are
    held to the same band as two kernels, not to equality."""
    cfg, got = runs
    short = replace(cfg, steps=100)
    compiled = tr.train("fa4_final", short, "cuda", compile=True)
    eager = {"losses": got["fa4_final"]["losses"][:100]}
    assert abs(compiled["losses"][0] - eager["losses"][0]) <= tr.STEP0_TOL
    drift = tr.max_gap(got["sdpa_efficient"]["losses"][:100],
                       got["sdpa_flash"]["losses"][:100], cfg.window)
    gap = tr.max_gap(compiled["losses"], eager["losses"], cfg.window)
    assert gap <= 2 * drift + tr.GAP_ATOL, (gap, drift)
    assert torch.isfinite(torch.tensor(compiled["losses"])).all()
