"""measure/package_host.py on a CPU: its profile of the host path (kernels as no-ops) runs, counts
the checks and launches of a call, stores valid rows, and leaves fa4_final as it found it."""

import torch

from fa4_final.api import interface, ops
from fa4_final.hopper import host
from fa4_final.runtime import checks, dispatch, pending, prologue
from fa4_final.runtime import compile as compile_path
from measure import package_host
from utils import results


def _patched_names():
    """What the profile swaps for its no-op kernels (package_host.noop_kernels)."""
    return (dispatch.backend_for, prologue.backend_for, compile_path.cached, host.num_sms,
            checks.check_inputs, prologue.check_inputs, interface.check_inputs,
            ops.EAGER_DEVICE_TYPES)


def test_profile_counts_one_check_and_four_launches_per_training_call():
    before = _patched_names()
    rows = package_host.profile("test", "abc", n=5, repeats=1, save=False)
    counts = {r["metric"]: r["value"] for r in rows if r["unit"] == "calls"}
    # the forward's tiny shape needs no gradient and is a decode shape: repeated under Note [A
    # repeated decode call], it checks only what depends on the tensors
    assert counts["check_inputs per call fwd"] == (0 if pending.listed("repeated_decode") else 1)
    assert counts["check_inputs per call fwd+bwd"] == 1
    assert counts["kernel launches per call fwd"] == 1
    assert counts["kernel launches per call fwd+bwd"] == 4  # forward, bwd_pre, bwd, bwd_post
    metrics = {r["metric"] for r in rows}
    assert {"host_us fwd", "host_us fwd+bwd", "host_us fwd+bwd by part"} <= metrics
    assert all(r["variant"] == "test" and r["fa4_final_commit"] == "abc" for r in rows)
    results.validate({"provenance": results.collect_provenance("test"), "rows": rows})
    assert _patched_names() == before


def test_gpu_mode_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        return
    assert package_host.main(["--gpu", "--no-save"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_stored_cpu_profile_says_what_it_measured():
    stored = results.load("package_host", gpu="cpu")
    assert stored.provenance["gpu"] == "cpu"
    variants = {r["variant"] for r in stored.rows}
    assert {"before", "after"} <= variants  # two trees of the package on the same CPU
    assert all("no-ops" in r["setup"] for r in stored.rows)


def test_gpu_rows_are_valid_results(monkeypatch):
    """--gpu's plumbing with the GPU parts replaced: one row per impl, shape and pass, the
    attention keys filled from the wall time, an impl that fails recorded with its error."""
    impls = {"fa4_final": None, "fa4_final_op": None, "sdpa_flash": None}
    monkeypatch.setattr(package_host, "implementations", lambda: impls)
    monkeypatch.setattr(package_host, "_path_fields",
                        lambda: {"eager_path": True, "dlpack_c_exchange_api": True})

    def timed_call(fn, shape, pass_, dtype):
        if pass_ == "fwd+bwd" and shape.s == 512:
            raise RuntimeError("no such kernel")
        return lambda: None

    monkeypatch.setattr(package_host.bench, "_timed_call", timed_call)
    monkeypatch.setattr(package_host, "measure_call", lambda fn, calls, rounds: {
        "host_us": 50.0, "wall_us": 80.0, "kernel_us": 70.0, "gpu_ops_per_call": 4.0,
        "host_bound": False, "gpu_idle_us": 10.0})
    monkeypatch.setattr(package_host, "tvm_ffi_launch_us", lambda: [
        {"impl": "fa4_final", "metric": "tvm_ffi_launch_us", "value": 5.0, "unit": "us"}])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = package_host.gpu([256, 512], [64], calls=2, rounds=1, tokens=1024)
    results.validate({"provenance": results.collect_provenance("test"), "rows": rows})
    timed = [r for r in rows if "pass" in r]
    assert len(timed) == 3 * 2 * 2 * 2  # impls x seqlens x causal x passes
    failed = [r for r in timed if "error" in r]
    assert len(failed) == 3 * 2 and all(r["ms"] is None for r in failed)
    ok = next(r for r in timed if r["impl"] == "fa4_final" and "error" not in r)
    assert ok["ms"] == 0.08 and ok["eager_path"] and ok["b"] == 4
    assert "eager_path" not in next(r for r in timed if r["impl"] == "sdpa_flash")
    assert rows[-1]["metric"] == "tvm_ffi_launch_us"
