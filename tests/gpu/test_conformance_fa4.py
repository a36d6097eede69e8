"""A short conformance run on the GPU (measure/conformance.py): fa4_final and the FA4 package on
the same random calls, no mismatch. The full run is ``python -m measure.conformance``; this
one takes other seeds, so it sees calls the stored run did not."""

import pytest

from measure import conformance as conf
from utils.hardware import missing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(missing("sm_90") is not None, reason=str(missing("sm_90"))),
]


@pytest.mark.parametrize("seed", [11, 12])
def test_conformance_sample_has_no_mismatch(seed):
    import fa4_final

    packages = {"fa4_final": fa4_final}
    try:
        from flash_attn import cute as fa4

        packages["fa4"] = fa4
    except ImportError:
        pass
    rows = [conf.run_case(c, packages) for c in conf.make_cases(16, seed)]
    bad = [(r["case"], r["fa4_final"]) for r in rows if r["verdict"] == "MISMATCH"]
    assert not bad, bad
