"""Dispatch by architecture: each GPU family gets its row of the table or an error naming what
runs; the README's support table is the one the table prints."""

from pathlib import Path

import pytest
import torch

from fa4_final import __main__ as cli
from fa4_final.common.errors import UnsupportedError
from fa4_final.hopper import host as hopper_host
from fa4_final.runtime import dispatch

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture
def gpu(monkeypatch):
    """Pretend torch sees a GPU of the given compute capability."""

    def set_capability(cap, name="NVIDIA Test GPU"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return set_capability


def test_readme_support_table_is_current():
    text = README.read_text()
    assert dispatch.render(text) == text, \
        "run `python -m fa4_final support-table --write README.md`"


def test_hopper_runs_the_hopper_kernels(gpu):
    gpu((9, 0), "NVIDIA H200")
    b = dispatch.backend_for(torch.device("cuda", 0))
    assert b.family == "Hopper" and b.target == "sm_90a" and b.host is hopper_host
    assert b.varlen_forward is not None and b.varlen_backward is not None


def test_blackwell_is_one_entry_that_says_it_is_not_wired(gpu):
    gpu((10, 0), "NVIDIA B200")
    b = dispatch.backend_for(torch.device("cuda"))
    assert b.family == "Blackwell" and b.target == "sm_100a" and not b.wired
    for run in (b.forward, b.backward):
        with pytest.raises(UnsupportedError, match="compiled .* never run on one.*Hopper"):
            run()


@pytest.mark.parametrize("cap, name", [((8, 0), "NVIDIA A100"), ((10, 3), "NVIDIA B300"),
                                       ((12, 0), "NVIDIA RTX PRO 6000"), ((8, 9), "NVIDIA L40S")])
def test_other_gpus_get_an_error_naming_what_runs(gpu, cap, name):
    gpu(cap, name)
    with pytest.raises(UnsupportedError, match=rf"no kernels for {name} \(compute capability "
                                               rf"{cap[0]}\.{cap[1]}.*Hopper \(H100, H200"):
        dispatch.backend_for(torch.device("cuda"))


def test_a_cpu_tensor_is_refused():
    with pytest.raises(UnsupportedError, match="runs on CUDA GPUs: Hopper.*got a tensor on cpu"):
        dispatch.backend_for(torch.device("cpu"))


def test_a_target_by_name_runs_a_row_that_is_not_wired():
    blackwell = dispatch.backend_for_target("sm_100a")
    assert not blackwell.wired and dispatch.wired(blackwell).wired
    assert dispatch.wired(blackwell).forward is not blackwell.forward
    assert dispatch.wired(dispatch.HOPPER) is dispatch.HOPPER
    with pytest.raises(UnsupportedError, match="sm_80"):
        dispatch.backend_for_target("sm_80")


def test_table_states_follow_the_modules_of_the_build(monkeypatch):
    present = {"fa4_final.hopper.fwd", "fa4_final.hopper.bwd", "fa4_final.blackwell.fwd"}
    monkeypatch.setattr(dispatch, "module_present", lambda m: m in present)
    rows = {line.split(" |")[0]: line for line in dispatch.support_table().splitlines()}
    dims = ("forward: D and dv each 64, 96, 128, 192, 256; backward (D, dv): (64, 64), "
            "(96, 96), (128, 128), (192, 128), (192, 192), (256, 256) |")
    assert f"| yes | yes | {dims}" in rows["| Hopper (H100, H200)"]
    assert "| compiled, not yet run on a GPU | not in this build | - |" in rows[
        "| Blackwell (B200, GB200)"]
    present.discard("fa4_final.hopper.bwd")
    rows = {line.split(" |")[0]: line for line in dispatch.support_table().splitlines()}
    assert f"| yes | not in this build | {dims}" in rows["| Hopper (H100, H200)"]


def test_render_needs_the_markers():
    with pytest.raises(ValueError, match="markers"):
        dispatch.render("no table here")


def test_cli(capsys, tmp_path):
    assert cli.main(["support-table"]) == 0
    assert "| Hopper (H100, H200) |" in capsys.readouterr().out
    page = tmp_path / "README.md"
    page.write_text(f"before\n{dispatch.START}\nold\n{dispatch.END}\nafter\n")
    assert cli.main(["support-table", "--write", str(page)]) == 0
    assert page.read_text() == dispatch.render(page.read_text()) and "old" not in page.read_text()
    assert cli.main(["nonsense"]) == 2
