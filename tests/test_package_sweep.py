"""measure/package_sweep.py on the CPU: its rows are storable, its errors are right."""

import torch

from measure import package_sweep
from utils import results
from utils.reference import attention_reference

PROVENANCE = dict.fromkeys(results.PROVENANCE_KEYS, "test")


def test_accuracy_rows_are_storable_and_measure_the_error():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(4))
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref_out = attention_reference(*leaves, causal=True)[0]
    ref = (ref_out.detach(), *torch.autograd.grad(ref_out, leaves, dout.double()))

    def float32_attention(q, k, v, causal=False):
        return attention_reference(q, k, v, causal=causal, dtype=torch.float32)

    rows = package_sweep._errors(float32_attention, q, k, v, dout, True, ref)
    assert [r["tensor"] for r in rows] == ["out", "dq", "dk", "dv"]
    assert all(r["finite"] and 0 < r["value"] < 1e-4 for r in rows)
    results.validate({"provenance": PROVENANCE, "rows": [{"impl": "f32", **r} for r in rows]},
                     "package_accuracy")


def test_the_sweep_needs_something_to_measure(capsys):
    try:
        package_sweep.main([])
    except SystemExit as exc:
        assert exc.code == 2
    assert "--sweep, --accuracy and/or --memory" in capsys.readouterr().err
