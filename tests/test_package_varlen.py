"""measure/package_varlen.py: the length list and the per-sequence FLOPs (no GPU)."""

from measure.package_varlen import draw_lengths, varlen_flops
from utils.bench import attention_flops


def test_lengths_are_seeded_in_range_and_about_the_total():
    lengths = draw_lengths(32, 64, 8192, 65536, seed=0)
    assert lengths == draw_lengths(32, 64, 8192, 65536, seed=0)
    assert len(lengths) == 32 and all(64 <= n <= 8192 for n in lengths)
    assert abs(sum(lengths) - 65536) < 0.1 * 65536


def test_flops_are_counted_per_sequence():
    assert varlen_flops([100, 300], 16, 128, False) == (
        attention_flops(1, 16, 100, 100, 128) + attention_flops(1, 16, 300, 300, 128))
    assert varlen_flops([100, 300], 16, 128, True) == varlen_flops([100, 300], 16, 128, False) / 2
    # more than the dense count at the mean length: the mean square exceeds the squared mean
    assert varlen_flops([100, 300], 1, 64, False) > attention_flops(2, 1, 200, 200, 64)


def test_backward_flops_and_passes():
    from measure.package_varlen import PASSES

    assert PASSES == ("fwd", "bwd", "fwd+bwd")
    assert varlen_flops([100, 300], 16, 128, True, "bwd") == 2.5 * varlen_flops(
        [100, 300], 16, 128, True)
    assert varlen_flops([100, 300], 16, 128, False, "fwd+bwd") == 3.5 * varlen_flops(
        [100, 300], 16, 128, False)


def test_grad_runners_time_the_backward_on_a_kept_graph(monkeypatch):
    """On a CPU stand-in: "bwd" records its forward once and differentiates it again each call;
    "fwd+bwd" runs both every call; the loop's rows call backward_loop on forward_loop's out."""
    import torch

    from fa4_final.runtime import varlen
    from measure import package_varlen as vb

    q, k, v = (torch.randn(10, 2, 8, requires_grad=True) for _ in range(3))
    dout, cu = torch.randn(10, 2, 8), torch.tensor([0, 4, 10])
    forwards = []

    def ours(causal):
        forwards.append(causal)
        return q * k + v

    calls = []
    monkeypatch.setattr(varlen, "forward_loop", lambda *a, **kw: (calls.append("fwd")
                                                                  or (q.detach(), None)))
    monkeypatch.setattr(varlen, "backward_loop", lambda *a, **kw: calls.append("bwd")
                        or (q.detach(), k.detach(), v.detach()))
    fns = vb._grad_runners({"fa4_final_varlen": ours, "fa4_final_loop": None}, q, k, v, cu,
                           dout)
    assert set(fns) == {(n, p) for n in ("fa4_final_varlen", "fa4_final_loop")
                        for p in ("bwd", "fwd+bwd")}
    for _ in range(3):
        dq, dk, dv = fns[("fa4_final_varlen", "bwd")](True)
    assert forwards == [True] and torch.allclose(dq, dout * k)
    fns[("fa4_final_varlen", "fwd+bwd")](True)
    assert forwards == [True, True]
    fns[("fa4_final_loop", "bwd")](False)
    fns[("fa4_final_loop", "bwd")](False)
    fns[("fa4_final_loop", "fwd+bwd")](False)
    assert calls == ["fwd", "bwd", "bwd", "fwd", "bwd"]
