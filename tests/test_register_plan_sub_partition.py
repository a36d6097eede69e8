"""Register plans per SM sub-partition (common.register_plan): every kernel's role table fits
each sub-partition's 512 registers per thread slot, with one setmaxnreg per warpgroup, and the
check refuses the plan the Blackwell backward had before (its MMA warp raised to 160: 592 on
sub-partition 0), naming the sub-partition and its sum. Plain Python: no compile, no GPU."""

import pytest

from fa4_final.blackwell.config import BlackwellFwdConfig, backward_warp_budgets
from fa4_final.blackwell.roles import check_roles
from fa4_final.common import register_plan as rp
from fa4_final.common.constants import CUTLASS_BY_NAME
from solutions.ch09_protocol_probes import OLD_BWD_PLAN, kernel_plans

BF16 = CUTLASS_BY_NAME["bf16"]
OLD_MESSAGE = (r"sub-partition 0 \(warps 0, 4, 8, 12\) needs 592 registers per thread slot, "
               r"more than 512")


@pytest.fixture(scope="module")
def plans():
    return kernel_plans()


def test_sub_partition_every_kernel_plan_fits(plans):
    """The Blackwell forward (1-, 2-CTA) and backward (1-CTA, pair), the Hopper forward with
    1, 2 and 3 consumer warpgroups and the Hopper backward: each sub-partition's sum within
    its room, one budget per warpgroup."""
    assert set(plans) == {"blackwell fwd 1-CTA", "blackwell fwd 2-CTA", "blackwell bwd 1-CTA",
                          "blackwell bwd pair", "hopper fwd 1 consumer",
                          "hopper fwd 2 consumers", "hopper fwd 3 consumers", "hopper bwd"}
    for name, (plan, threads) in plans.items():
        budgets = dict(enumerate(plan))
        assert rp.problems(budgets, threads) == [], (name, rp.plan_lines(budgets, threads))
        for k, warps, total in rp.sub_partition_sums(budgets):
            assert total <= rp.capacity(len(warps), threads) <= 512, (name, k)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sub_partition_blackwell_kernels_at_both_head_dims(head_dim):
    from fa4_final.blackwell.bwd import BlackwellBackward
    from fa4_final.blackwell.bwd_pair import BlackwellBackwardPair
    from fa4_final.blackwell.config import BlackwellBwdConfig
    from fa4_final.blackwell.fwd import BlackwellForward

    for k in (BlackwellForward(BF16, head_dim, False, BlackwellFwdConfig()),
              BlackwellForward(BF16, head_dim, True, BlackwellFwdConfig(two_cta=True)),
              BlackwellBackward(BF16, head_dim, True, BlackwellBwdConfig()),
              BlackwellBackwardPair(BF16, head_dim, False, BlackwellBwdConfig(two_cta=True))):
        budgets = rp.check_role_registers(k.roles, 512)
        sums = {total for _, _, total in rp.sub_partition_sums(budgets)}
        assert sums == {512}, (type(k).__name__, rp.plan_lines(budgets))  # the whole file


def test_sub_partition_backward_plan_is_the_config():
    from fa4_final.blackwell.config import BWD_REGISTERS

    budgets = backward_warp_budgets(BWD_REGISTERS)
    assert [budgets[w] for w in (0, 4, 8, 12)] == [176, 176, 48, 112]
    assert len({budgets[w] for w in range(12, 16)}) == 1  # warpgroup 3: one budget, lowered
    assert budgets[12] < rp.launch_registers(512) == 128


def test_sub_partition_refuses_the_old_backward_plan():
    budgets = dict(enumerate(OLD_BWD_PLAN))
    # its CTA total fits the SM: only the per-sub-partition sum shows the problem
    assert 32 * sum(OLD_BWD_PLAN) <= rp.REGISTER_FILE
    with pytest.raises(rp.RegisterPlanError, match=OLD_MESSAGE):
        rp.check_budgets(budgets, 512)
    assert [t for _, _, t in rp.sub_partition_sums(budgets)] == [592, 480, 456, 456]


def test_sub_partition_check_roles_refuses_the_old_backward_table():
    """The Blackwell kernels' own check (roles.check_roles), given the backward's role table
    with the old budgets."""
    from fa4_final.blackwell.bwd import THREADS, BlackwellBackward
    from fa4_final.blackwell.config import BlackwellBwdConfig

    k = BlackwellBackward(BF16, 128, False, BlackwellBwdConfig())
    old = {"compute0": 176, "compute1": 176, "dq": 80, "mma": 160, "load": 48, "spare": 24}
    roles = {name: dict(r, registers=old[name]) for name, r in k.roles.items()}
    with pytest.raises(rp.RegisterPlanError, match=OLD_MESSAGE):
        check_roles(roles, THREADS, k.TMEM_ROLES)
    check_roles(k.roles, THREADS, k.TMEM_ROLES)  # the kernel's own table passes


def test_sub_partition_refuses_a_mixed_warpgroup():
    """Sums within 512 everywhere, but warpgroup 3's warps run different setmaxnreg."""
    plan = dict(enumerate((176,) * 8 + (48,) * 4 + (112, 112, 96, 112)))
    with pytest.raises(rp.RegisterPlanError, match=r"warpgroup 3 \(warps 12, 13, 14, 15\) runs "
                       r"setmaxnreg 112, 112, 96, 112"):
        rp.check_budgets(plan, 512)
    assert all(t <= 512 for _, _, t in rp.sub_partition_sums(plan))


def test_sub_partition_room_is_what_the_warps_held_at_launch():
    """A 384-thread CTA starts with 168 registers a thread: a sub-partition holds 3 warps, so
    504, not 512 (the Hopper kernels with two MMA warpgroups use all of it)."""
    assert [rp.launch_registers(t) for t in (256, 384, 512)] == [256, 168, 128]
    plan = dict(enumerate((24,) * 4 + (248,) * 8))  # 520 per sub-partition
    with pytest.raises(rp.RegisterPlanError, match=r"sub-partition 0 \(warps 0, 4, 8\) needs "
                       r"520 registers per thread slot, more than 504 \(3 warps x 168"):
        rp.check_budgets(plan, 384)
    rp.check_budgets(dict(enumerate((24,) * 4 + (240,) * 8)), 384)  # the Hopper plan


def test_sub_partition_forward_config_refuses_a_budget_over_the_file():
    with pytest.raises(ValueError, match=r"sub-partition 0 \(warps 0, 4, 8, 12\) needs 528"):
        BlackwellFwdConfig(registers=(200, 80, 48)).check(128)
    BlackwellFwdConfig(registers=(184, 80, 64)).check(128)  # FA4's 2-CTA plan: 512


def test_sub_partition_hopper_kernels_check_their_tables():
    """The Hopper kernels call the same check on their role tables (by warpgroups)."""
    from fa4_final.hopper.fwd import HopperForward

    roles = {"producer": {"warpgroups": (0,), "registers": 24},
             "consumer": {"warpgroups": (1, 2, 3), "registers": 168}}
    with pytest.raises(rp.RegisterPlanError, match=r"needs 528 registers per thread slot"):
        rp.check_role_registers(roles, 512)
    import inspect

    assert "check_role_registers(self.roles" in inspect.getsource(HopperForward.__init__)


def test_sub_partition_setmaxnreg_range():
    with pytest.raises(rp.RegisterPlanError, match="multiple of 8"):
        rp.check_budgets(dict(enumerate((100,) * 4)), 128)
