"""The %%gpu cell magic: skipped with a visible note where the GPU is missing."""

import pytest

IPython = pytest.importorskip("IPython")


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "utils.notebook")
    return ip


def test_gpu_cell_is_skipped_on_cpu(shell, capsys, monkeypatch):
    monkeypatch.setenv("COURSE_FORCE_CPU", "1")
    shell.run_cell("%%gpu sm_90\nran_on_gpu = True")
    assert "ran_on_gpu" not in shell.user_ns
    assert "[skipped] This cell needs a Hopper GPU" in capsys.readouterr().out


def test_cpu_requirement_runs(shell):
    shell.run_cell("%%gpu sm_80\nx_from_cell = 1")  # skipped on CPU; never an error
    result = shell.run_cell("%%gpu sm_42\npass")
    assert result.error_in_exec is not None and "sm_42" in str(result.error_in_exec)
