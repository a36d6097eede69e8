"""GPU-marked tests are skipped, with the reason, where no suitable GPU is present; fixtures
that several test files use."""

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


@pytest.fixture
def cpu_kernels():
    """fa4_final's kernels replaced by the CPU reference (tests.fa4_cpu_reference) for the test:
    every layer above the kernels runs as on the GPU."""
    from tests import fa4_cpu_reference as ref

    with ref.active():
        yield


@pytest.fixture
def no_pending(monkeypatch):
    """FA4_FINAL_PENDING unset: the gate as a user without it meets it (a file asks for it with
    ``pytestmark = pytest.mark.usefixtures("no_pending")``)."""
    from fa4_final.runtime import pending

    monkeypatch.delenv(pending.ENV, raising=False)
