"""Pipelines as data: one ``PipelineSpec`` per pipeline of a warp-specialised kernel, on Hopper
and on Blackwell alike.

A kernel lists its pipelines in ``pipelines()``; it builds its cutlass pipelines (mbarriers,
stage counts, arrival counts) from that table, and the CPU tests and the pipeline simulators
read the same table. ``full`` completes when the producer side has arrived ``full_arrivals``
times (a TMA load also counts its bytes); ``empty`` when the consumer side has arrived
``empty_arrivals`` times.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.pipeline as pipeline


@dataclass(frozen=True)
class PipelineSpec:
    """One pipeline: what flows, between which roles, and the arrivals that complete each of its
    barriers. ``per_q_stage``: stage i belongs to Q tile i and is addressed by that index, not
    walked as a ring (the Blackwell forward's Note [Pipelines])."""

    name: str
    what: str
    # cutlass class: "tma_async" (TMA -> threads, Hopper), "tma_umma" (TMA -> MMA), "umma_async"
    # (MMA commit -> threads), "async" (threads -> threads); the pair backward's own: "local",
    # "peer", "relay"
    kind: str
    stages: int
    producer: str
    consumer: str
    full_arrivals: int
    empty_arrivals: int
    per_q_stage: bool = False


def pipeline_args(spec: PipelineSpec, barriers) -> dict:
    """The arguments every cutlass pipeline of a ``pipelines()`` entry ``spec`` takes: its
    mbarriers (``barriers``, a storage field) and stages, producer and consumer groups of
    ``spec.full_arrivals`` and ``spec.empty_arrivals`` thread arrivals per phase, and the
    barriers' initialisation left to the kernel's own fence (defer_sync)."""
    return dict(
        barrier_storage=barriers.data_ptr(), num_stages=spec.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, spec.full_arrivals),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, spec.empty_arrivals),
        defer_sync=True)


def tma_async_pipeline(spec: PipelineSpec, barriers, tx_count: int, tidx=None,
                       cluster: int = 1):
    """The Hopper kernels' TMA ring of ``spec`` (kind "tma_async"): the producer's one arrive
    carries ``tx_count`` bytes; ``tidx``: the signalling lane, when the kernel pins it.
    ``cluster`` > 1: CTAs along M that fill each stage together by multicast, so a consumer
    warp's release arrives on the stage's EMPTY barrier in each of them (lane r for CTA r)."""
    assert spec.kind == "tma_async", spec
    extra = {}
    if cluster > 1:
        extra["cta_layout_vmnk"] = cute.make_layout((1, cluster, 1, 1))
    return pipeline.PipelineTmaAsync.create(tx_count=tx_count, tidx=tidx,
                                            **pipeline_args(spec, barriers), **extra)
