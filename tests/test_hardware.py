import pytest

from utils.hardware import PER_SM, Machine, describe, detect, gpu_slug


def test_cpu_machine(monkeypatch):
    monkeypatch.setenv("COURSE_FORCE_CPU", "1")
    m = detect()
    assert not m.has_gpu and m.arch == "cpu"
    assert m.can_run("cpu") and not m.can_run("sm_80")
    assert "No CUDA GPU" in describe(m)


def test_arch_requirements():
    h200 = Machine("NVIDIA H200", (9, 0), "sm_90", 132, "580", 140.0)
    assert h200.can_run("sm_80") and h200.can_run("sm_90") and not h200.can_run("sm_100")
    b200 = Machine("NVIDIA B200", (10, 0), "sm_100", 148, "580", 180.0)
    assert b200.can_run("sm_100") and not b200.can_run("sm_90")
    with pytest.raises(ValueError, match="unknown requirement"):
        h200.can_run("sm_70")


def test_table_matches_anchors():
    assert PER_SM["sm_90"].mma_flops_per_clk == 4096
    assert PER_SM["sm_100"].mma_flops_per_clk == 8192
    assert PER_SM["sm_103"].exp2_per_clk == 2 * PER_SM["sm_100"].exp2_per_clk
    assert {a.fma_per_clk for a in PER_SM.values()} == {128}
    assert PER_SM["sm_100"].tmem_bytes == 128 * 512 * 4


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA GB200") == "gb200"
    assert gpu_slug(None) == "cpu"


def test_device_arch_of_a_cpu_tensor_is_none():
    import torch

    from utils.hardware import device_arch

    assert device_arch("cpu") is None and device_arch(torch.zeros(1).device) is None
