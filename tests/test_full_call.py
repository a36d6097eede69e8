"""Note [Trailing defaults] (fa4_final.runtime.compile): a plan's kernel is called with every
run-time parameter, so one loaded from the disk cache (a bare positional function) takes the
same call as one freshly compiled. No GPU: the compiled function is a recorder."""

import pytest

from fa4_final.hopper.host import backward_recipe, forward_recipe
from fa4_final.runtime.compile import FullCall


class Recorder:
    def __init__(self):
        self.args = None

    def __call__(self, *args):
        self.args = args


@pytest.mark.parametrize("given", [19, 20, 21])
def test_forward_gets_the_sink_and_seqused_q_places(given):
    kernel = forward_recipe(128, "bf16", True, sink_dtype="fp32").kernels["main"]
    fn = Recorder()
    FullCall(fn, kernel)(*range(given))
    assert len(fn.args) == 21  # 19 inputs, mSink, mSeqUsedQ; the stream is the environment's
    assert fn.args[:given] == tuple(range(given))
    assert all(a is None for a in fn.args[given:])


def test_backward_pre_and_main_get_their_trailing_defaults():
    recipe = backward_recipe(128, "bf16", False, varlen=True, has_seqused_q=True)
    pre = FullCall(Recorder(), recipe.kernels["pre"])
    pre(*range(8))
    assert pre.fn.args == (*range(8), None, None)  # mdLSE, mSeqUsedQ
    main = FullCall(Recorder(), recipe.kernels["main"])
    main(*range(16))
    assert main.fn.args == (*range(16), None)


def test_too_many_or_too_few_arguments_say_which():
    kernel = backward_recipe(128, "bf16", False).kernels["pre"]
    call = FullCall(Recorder(), kernel)
    with pytest.raises(TypeError, match="takes 8 arguments"):
        call(*range(9))
    with pytest.raises(TypeError, match="mTurn have no default"):
        call(*range(6))
