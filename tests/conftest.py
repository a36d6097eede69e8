"""GPU-marked tests are skipped, with the reason, where no suitable GPU is present."""

import pytest

from utils.hardware import detect

_MACHINE = detect()


def pytest_collection_modifyitems(config, items):
    if _MACHINE.has_gpu:
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: this machine has none (run `make gpu-test` on a GPU machine)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
