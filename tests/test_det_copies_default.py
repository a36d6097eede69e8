"""The deterministic backward's config with dQ accumulator copies (hopper_bwd_det_copies,
Note [dQ copies] in fa4_final.common.bwd_tiles) behind the gate of Note [Pending features]
(det_copies): which config each deterministic call asks the compile path for, with the gate
closed (the verified deterministic default, exactly as before) and open. CPU only: compile and
launch are recorded, nothing is built (tests/hopper_recorder.py)."""

from dataclasses import replace

import pytest
import torch

from fa4_final.hopper.config import hopper_bwd_default, hopper_bwd_det_copies
from fa4_final.runtime import dispatch, pending
from tests.hopper_recorder import record_hopper_runs
from tests.test_pending_features import dense


def _configs(monkeypatch, calls_args):
    """The config each backward call hands the compile path, in call order."""
    calls = record_hopper_runs(monkeypatch)
    runners = dispatch.runners(dispatch.HOPPER.host, dispatch.HOPPER.features)
    for kind, d, causal, left, right, kw in calls_args:
        q, k, v = dense(d=d)
        out, lse = torch.zeros_like(q), torch.zeros(2, 4, 24)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        if kind == "dense":
            runners["backward"](q, k, v, out, lse, out, *grads, causal, 0.125, left, right,
                                **kw)
        else:
            runners["varlen_backward"](q[0], k[0], v[0], out[0], lse[0], out[0], grads[0][0],
                                       grads[1][0], grads[2][0], None, None, None, 24, 40,
                                       causal, 0.125, left, right, **kw)
    return [c[2][3] for c in calls if c[0] == "compiled"]


CALLS = [("dense", 64, False, None, None, {"deterministic": True}),
         ("dense", 64, True, None, 0, {"deterministic": True}),
         ("dense", 128, False, None, None, {"deterministic": True}),
         ("dense", 128, True, None, 0, {"deterministic": True}),
         ("varlen", 64, False, None, None, {"deterministic": True}),
         ("dense", 64, False, 100, None, {"deterministic": True}),  # a left window: masked
         ("dense", 64, False, None, None, {}),  # not deterministic
         ("dense", 64, False, None, None, {"deterministic": True, "softcap": 5.0}),
         ("dense", 96, False, None, None, {"deterministic": True})]


def test_without_the_gate_a_deterministic_call_keeps_the_verified_config(monkeypatch):
    monkeypatch.delenv(pending.ENV, raising=False)
    assert "det_copies" in pending.PENDING
    assert _configs(monkeypatch, CALLS) == [None] * len(CALLS)


def test_through_the_gate_the_copies_where_they_were_measured(monkeypatch):
    monkeypatch.setenv(pending.ENV, "det_copies")
    got = _configs(monkeypatch, CALLS)
    want = [hopper_bwd_det_copies(64, False), hopper_bwd_det_copies(64, True),
            hopper_bwd_det_copies(128, False), None, hopper_bwd_det_copies(64, False),
            hopper_bwd_det_copies(64, True), None, None, None]
    assert got == want
    c4, c2 = got[0], got[1]
    assert (c4.dq_copies, c2.dq_copies, got[2].dq_copies) == (4, 2, 2)
    assert all(c.dq_first_store and c.dq_buffers == 2 and c.dq_adds_overlap
               for c in (c4, c2, got[2]))
    # the candidates measure.bwd_phases timed: the deterministic default with the copies
    assert got[2] == replace(hopper_bwd_default(128, False, True), dq_copies=2,
                             dq_first_store=True)
    assert got[2].tile_m == 64


def test_a_given_config_is_never_replaced(monkeypatch):
    monkeypatch.setenv(pending.ENV, "det_copies")
    mine = hopper_bwd_default(64, False, True)
    assert _configs(monkeypatch, [("dense", 64, False, None, None,
                                   {"deterministic": True, "config": mine})]) == [mine]


@pytest.mark.parametrize("d,masked", [(64, False), (64, True), (128, False)])
def test_the_copies_configs_are_accepted_and_fit(d, masked):
    cfg = hopper_bwd_det_copies(d, masked)
    cfg.check(d)
    assert cfg.deterministic and cfg.dq_copies in (2, 4)


def test_no_copies_where_none_were_measured():
    assert hopper_bwd_det_copies(128, True) is None
    assert hopper_bwd_det_copies(96, False) is None
    assert hopper_bwd_det_copies(192, False, 128) is None
    assert hopper_bwd_det_copies(64, False, 128) is None
