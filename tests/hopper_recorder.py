"""The Hopper runners of fa4_final.runtime.dispatch with compile and launch replaced by records:
what the CPU tests of compile keys and launch arguments read (nothing is built or launched)."""

from fa4_final.runtime import dispatch

LAUNCHES = ("launch_forward", "launch_backward", "launch_varlen_forward",
            "launch_varlen_backward")


def record_hopper_runs(monkeypatch) -> list:
    """The list the patched runners append to, in call order: ("compiled", recipe name, args)
    for each compile, (launch name, args, kwargs) for each launch."""
    calls = []

    class Plan:
        config = None

    def compiled(recipe_fn, *args):
        calls.append(("compiled", recipe_fn.__name__, args))
        return Plan()

    monkeypatch.setattr(dispatch, "compiled", compiled)
    host = dispatch.HOPPER.host
    for name in LAUNCHES:
        monkeypatch.setattr(host, name, lambda *a, name=name, **kw: calls.append((name, a, kw)))
    return calls
