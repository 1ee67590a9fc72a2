"""Combine per-rank profiles into one `PipelineProfile` of the whole pipeline.

First a max over the replicas of this stage — the data-parallel replicas and the
tensor-parallel ranks, which time the same layers differently (the slowest sets the
pace) — then an all-gather over the pipeline group. The result is meant to be equal on
every rank, but it is a measurement combined by floating-point collectives: the
controller still decides from rank 0's copy alone and broadcasts the decision
(`dynmo_plugin.consensus`). Groups are passed in: a repack rebuilds them.
"""
from __future__ import annotations

import torch.distributed as dist

from dynmo_plugin.profiling.records import PipelineProfile

__all__ = ["gather_profile"]


def _max_over(local: PipelineProfile, group) -> PipelineProfile:
    if group is None or dist.get_world_size(group) == 1:
        return local
    replicas = [None] * dist.get_world_size(group)
    dist.all_gather_object(replicas, local.to_dict(), group=group)
    return PipelineProfile.elementwise_max([PipelineProfile.from_dict(r) for r in replicas])


def gather_profile(local: PipelineProfile, pp_group, dp_group, tp_group=None) -> PipelineProfile:
    local = _max_over(_max_over(local, tp_group), dp_group)
    stages = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, local.to_dict(), group=pp_group)
    return PipelineProfile.merge([PipelineProfile.from_dict(s) for s in stages])
