"""Reading the Nsight Compute profile of fa4_final's Hopper forward (measured by
``python -m measure.profile_fa4_final`` on a GPU): chapter 05's reading, on the final kernel.

Everything is chapter 05's (``solutions.ch05_profile``, on ``solutions.ch04_profile``'s
readers): the counters, the sections, the role split by SASS position, the steady KV turn
between its two ``wait_group``s. Only the kernel differs: the one
``fa4_final.api.interface.attention`` launches at the same headline shape (D = 128, 16 heads of
16384 queries and keys, bf16, non-causal) with its default configuration (two consumer warpgroups in
ping-pong, persistent CTAs, O in its own buffer, O rescaled at the next P V). Its SASS, compiled
for sm_90a on a CPU, keeps the landmarks that reading relies on: one ``setmaxnreg.dec`` opens the
producer's code and one ``setmaxnreg.inc`` the consumers' (both warpgroups share it), the
mbarrier retry loops sit after the last EXIT, and the steady KV loop is the innermost loop around
the one ``wait_group(1)``; the persistent tile loops enclose these and change none of them.
Saved as results/<gpu>/fa4_final_profile.json, the same rows as ch05_profile.json with impl
"fa4_final".
"""

from __future__ import annotations

from solutions import ch05_profile as ch05p

RESULTS = "fa4_final_profile"
IMPL = "fa4_final"
SHAPE = ch05p.SHAPE
# ncu's kernel names carry the class: kernel_cutlass_kernel_fa4_finalhopperfwdHopperForward_...
KERNEL_REGEX = "regex:HopperForward"


def build_rows(raw_text: str, source_text: str, config_label: str) -> list[dict]:
    return ch05p.build_rows(raw_text, source_text, config_label, impl=IMPL)


def default_config():
    from fa4_final.hopper.config import hopper_fwd_default

    return hopper_fwd_default(SHAPE["d"], SHAPE["causal"])


def config_label(cfg) -> str:
    """'128x128 wg2 k3 v2 overlap pingpong persistent': the tile and schedule profiled."""
    flags = [name for name, on in (("overlap", cfg.intra_wg_overlap), ("pingpong", cfg.pingpong),
                                   ("persistent", cfg.persistent)) if on]
    return " ".join([f"{cfg.tile_m}x{cfg.tile_n} wg{cfg.num_consumer_wgs} k{cfg.stages_k} "
                     f"v{cfg.stages_v}", *flags])
