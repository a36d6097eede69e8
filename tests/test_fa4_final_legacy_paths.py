"""The old module paths stay importable until the course has moved to the new ones
(fa4_final/_legacy_paths.py): an alias is the new module itself, a split module re-exports the
names it had, and the names the Blackwell kernel modules and the package's top level used to
define are there again."""

import importlib
import sys

import pytest

from fa4_final import _legacy_paths as legacy

OLD_NAMES = {
    "fa4_final.run": ["forward", "forward_into", "backward_into", "forward_checked"],
    "fa4_final.interface": ["attention", "compile_only", "forward", "forward_timeline",
                            "l2_section_pairs", "_normalise_window", "compile_forward"],
    "fa4_final.backward": ["backward", "backward_into", "compile_only", "compile_backward",
                           "launch_backward", "_config", "_fake_args"],
    "fa4_final.varlen_backward": ["varlen_backward_launch", "workspace_shapes", "compile_only"],
    "fa4_final.hopper.launch": ["compile_forward", "forward_args", "forward_into",
                                "varlen_forward_into", "l2_section_pairs", "tile_costs",
                                "host_table", "_fwd_fake_args", "_COMPILED", "_PLANS"],
    "fa4_final.config": ["HopperFwdConfig", "hopper_fwd_default", "HEAD_DIMS", "ZIGZAG_ROUNDS"],
    "fa4_final.compile": ["compile_kernel", "Artifacts", "fake_tensor", "disassemble"],
    "fa4_final.checks": ["check_inputs", "_normalise_window", "check_varlen_values"],
}


@pytest.mark.parametrize("old", legacy.LEGACY_PATHS)
def test_every_legacy_path_imports(old):
    importlib.import_module(old)


@pytest.mark.parametrize("old, new", sorted(legacy.ALIASES.items()))
def test_an_alias_is_the_new_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new) is sys.modules[old]


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_a_split_module_keeps_its_names(old):
    module = importlib.import_module(old)
    assert [n for n in OLD_NAMES[old] if not hasattr(module, n)] == []


def test_the_attached_names_are_back():
    for module, names in legacy.ATTACHED.items():
        assert all(hasattr(importlib.import_module(module), n) for n in names), module


def test_the_zigzag_rounds_are_a_schedule_now():
    from dataclasses import replace

    from fa4_final.config import ZIGZAG_ROUNDS, hopper_fwd_default

    cfg = replace(hopper_fwd_default(128, True), **ZIGZAG_ROUNDS)
    assert (cfg.schedule, cfg.l2_sections) == ("zigzag", False)
