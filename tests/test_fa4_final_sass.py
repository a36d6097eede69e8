"""Every default kernel of fa4_final compiles to the SASS it compiled to before the package was
restructured (tests/data/sass_digests.json, with the commit the digests came from): moves and
knob deletions must leave the generated code alone. A change that means to alter a kernel
regenerates its digest (``python -m tests.fa4_final_sass --write NAME``) and says so.
Slow: about a minute of compiling per kernel on a CPU."""

import pytest

from tests import fa4_final_sass as sass

pytestmark = pytest.mark.slow
STORED = sass.stored()


def test_the_digests_say_where_they_come_from():
    assert len(STORED["commit"]) == 40 and set(STORED["kernels"]) == set(sass.kernels())


@pytest.mark.parametrize("name", sorted(STORED["kernels"]))
def test_the_default_kernel_compiles_to_the_stored_sass(name):
    assert sass.compute([name])[name] == STORED["kernels"][name]
