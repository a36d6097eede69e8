"""Chapter 08's exercises replace two methods of fa4_final's Hopper forward: ``turn`` (one
ping-pong turn around a warpgroup's GEMM issue) and ``walk_tiles`` (the persistent tile loop).
Both were drawn out of the kernel's code as pure method extractions: the compiled SASS of the
default kernels (D = 64 and 128, causal and not) and of the builds that run the extracted paths
(fixed zigzag rounds, no intra-warpgroup overlap) is instruction for instruction what the
kernel compiled to before the extraction, whose source git still holds."""

import importlib.util
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FWD = "fa4_final/hopper/fwd.py"
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;")


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def _source_before_seams() -> str:
    """fwd.py as it was in the parent of the commit that added ``walk_tiles``."""
    try:
        added = _git("log", "--format=%H", "-S", "def walk_tiles", "--", FWD).split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    if not added:
        pytest.skip("the extraction is not committed yet")
    return _git("show", f"{added[-1]}^:{FWD}")


def instructions(sass: str) -> list[str]:
    """The SASS's instructions in order, without addresses or symbol names."""
    return [m.group(1) for m in map(_INSTR.search, sass.splitlines()) if m]


def _compile(cls, head_dim, causal, cfg):
    from fa4_final.common.constants import CUTLASS_BY_NAME
    from fa4_final.hopper.host import forward_fake_args
    from fa4_final.runtime.compile import compile_kernel

    kernel = cls(CUTLASS_BY_NAME["bf16"], head_dim, causal, cfg)
    return compile_kernel(kernel, *forward_fake_args("bf16", head_dim, cfg), arch="sm_90a",
                          keep=True)[1].sass


@pytest.fixture(scope="module")
def before(tmp_path_factory):
    path = tmp_path_factory.mktemp("before") / "fwd_before_seams.py"
    path.write_text(_source_before_seams())
    spec = importlib.util.spec_from_file_location("fwd_before_seams", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HopperForward


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("build", ["default", "zigzag rounds", "no overlap"])
def test_extracted_methods_leave_the_sass_unchanged(before, head_dim, causal, build):
    from fa4_final.hopper.config import hopper_fwd_default
    from fa4_final.hopper.fwd import HopperForward

    cfg = hopper_fwd_default(head_dim, causal)
    if build == "zigzag rounds":
        cfg = replace(cfg, schedule="zigzag", l2_sections=False)
    elif build == "no overlap":
        cfg = replace(cfg, intra_wg_overlap=False)
    old = instructions(_compile(before, head_dim, causal, cfg))
    new = instructions(_compile(HopperForward, head_dim, causal, cfg))
    assert old, "no SASS instructions found"
    first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), None)
    assert old == new, (f"{build} D={head_dim} causal={causal}: {len(old)} instructions "
                        f"before, {len(new)} after; first difference at {first}")
