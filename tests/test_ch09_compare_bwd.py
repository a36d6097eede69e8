"""The stored side-by-side of our sm100 backward with FA4's (results/compile/sm100_bwd_vs_fa4.json),
checked without a compile: our structural rows are what the kernel declares now (roles'
budgets, TMEM plan, stages, shared memory), the per-role attribution adds up, the five GEMMs of a
step are there on both sides, and every note's figures are the rows'."""

import pytest

from measure import sm100_vs_fa4 as W
from solutions import ch09_compare as C


@pytest.fixture(scope="module")
def table():
    return C.load_bwd_table()


def test_bwd_table_structure_is_what_the_kernel_declares(table):
    for c in C.BWD_CONFIGS:
        if not c["ours"]:
            continue
        st = C.our_bwd_structure(c["d"], c["causal"], c["two_cta"])
        roles = st.pop("role registers")
        for metric, want in st.items():
            assert C.value(table, "fa4_final", c["config"], metric) == want, (c, metric)
        assert C.value(table, "fa4_final", c["config"], "registers: compute") == \
            roles["compute0"] == roles["compute1"]
        assert C.value(table, "fa4_final", c["config"], "registers: dQ") == roles["dq"]
        # the PTX's setmaxnreg values are the declared budgets
        seen = set(C.value(table, "fa4_final", c["config"], "setmaxnreg inc")) | \
            set(C.value(table, "fa4_final", c["config"], "setmaxnreg dec"))
        assert seen == set(roles.values())


def test_bwd_table_has_both_sides_and_the_five_gemms(table):
    for c in C.BWD_CONFIGS:
        impls = ["fa4"] + (["fa4_final"] if c["ours"] else [])
        for impl in impls:
            val = lambda m, impl=impl, c=c: C.value(table, impl, c["config"], m)  # noqa: E731
            # S^T, dP^T (K = D), dV, dK, dQ (K = 128): D/16 + D/16 + 3 * 8 per step; FA4's
            # code holds every GEMM twice (prologue + loop + tail), ours once
            per_step = 2 * c["d"] // 16 + 3 * 128 // 16
            copies = 2 if impl == "fa4" else 1
            if impl == "fa4_final" and c["two_cta"]:  # our pair's dQ runs over 256 keys
                per_step += 128 // 16
            assert val("UTC*MMA (tcgen05.mma)") == copies * per_step, (impl, c["config"])
            assert val("spill instructions") == 0 or (impl, c["two_cta"]) == ("fa4", True)
            assert val("TMEM columns allocated") == [512]
            assert val("shared memory bytes") <= 227 * 1024
            # the role attribution covers every MMA of the kernel
            groups = {r["metric"].split(":")[0] for r in table.where(impl=impl,
                                                                     config=c["config"])
                      if r["metric"].endswith(": UTC*MMA (tcgen05.mma)")}
            assert sum(val(f"{g}: UTC*MMA (tcgen05.mma)") for g in groups) == \
                val("UTC*MMA (tcgen05.mma)")
    # FA4's own choice at D = 128 is 2-CTA; its 1-CTA rows were compiled with FA_DISABLE_2CTA=1
    assert C.value(table, "fa4", "d128 non-causal 2-CTA", "cta_group::2") > 0
    assert C.value(table, "fa4", "d128 non-causal 1-CTA", "cta_group::2") == 0


def test_bwd_table_notes_quote_the_rows(table):
    notes = table.where(impl="note")
    assert len(notes) == len(W.BWD_NOTES)
    assert notes == W.bwd_notes([r for r in table.rows if r["impl"] != "note"])


def test_bwd_table_pair_halves_our_dq_adds(table):
    """Our 2-CTA rows beside our 1-CTA ones: every MMA cta_group::2, half the bulk dQ adds per
    CTA, the pair's shared memory within the limit, no spills; FA4's 2-CTA beside it."""
    for causal in ("non-causal", "causal"):
        one, two = f"d128 {causal} 1-CTA", f"d128 {causal} 2-CTA"
        ours = lambda cfg, m: C.value(table, "fa4_final", cfg, m)  # noqa: E731
        assert ours(two, "cta_group::2") > 0 and ours(one, "cta_group::2") == 0
        assert 2 * ours(two, "UBLKRED (bulk reduction)") == ours(one, "UBLKRED (bulk reduction)")
        assert ours(two, "spill instructions") == 0
        assert ours(two, "shared memory bytes") == 231424 <= 232448
        assert C.value(table, "fa4", two, "cta_group::2") > 0
