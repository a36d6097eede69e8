"""solutions/ch12_host.py on a CPU: its profile of the host path (kernels as no-ops) runs, counts
the checks and launches of a call, stores valid rows, and leaves fa4_final as it found it."""

import torch

import fa4_final.backward as fb
from fa4_final import checks, dispatch, ops, run
from fa4_final.hopper import launch
from solutions import ch12_host
from utils import results


def test_profile_counts_one_check_and_four_launches_per_training_call():
    before = (dispatch.backend_for, run.backend_for, launch.compile_forward, launch._num_sms,
              fb.compile_backward, checks.check_inputs, ops.EAGER_DEVICE_TYPES)
    rows = ch12_host.profile("test", "abc", n=5, repeats=1, save=False)
    counts = {r["metric"]: r["value"] for r in rows if r["unit"] == "calls"}
    assert counts["check_inputs per call fwd"] == 1
    assert counts["check_inputs per call fwd+bwd"] == 1
    assert counts["kernel launches per call fwd"] == 1
    assert counts["kernel launches per call fwd+bwd"] == 4  # forward, bwd_pre, bwd, bwd_post
    metrics = {r["metric"] for r in rows}
    assert {"host_us fwd", "host_us fwd+bwd", "host_us fwd+bwd by part"} <= metrics
    assert all(r["variant"] == "test" and r["fa4_final_commit"] == "abc" for r in rows)
    results.validate({"provenance": results.collect_provenance("test"), "rows": rows})
    after = (dispatch.backend_for, run.backend_for, launch.compile_forward, launch._num_sms,
             fb.compile_backward, checks.check_inputs, ops.EAGER_DEVICE_TYPES)
    assert before == after


def test_gpu_mode_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        return
    assert ch12_host.main(["--gpu", "--no-save"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_stored_cpu_profile_says_what_it_measured():
    stored = results.load("ch12_host", gpu="cpu")
    assert stored.provenance["gpu"] == "cpu"
    variants = {r["variant"] for r in stored.rows}
    assert {"before", "after"} <= variants
    assert all("no-ops" in r["setup"] for r in stored.rows)
