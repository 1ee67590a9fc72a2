"""Make every pipeline rank hold the same `PipelineProfile`.

First a max over the data-parallel replicas of this stage (the slowest replica sets the
pace), then an all-gather over the pipeline group. Groups are passed in: a repack
rebuilds them.
"""
from __future__ import annotations

import torch.distributed as dist

from dynmo_plugin.profiling.records import PipelineProfile

__all__ = ["gather_profile"]


def gather_profile(local: PipelineProfile, pp_group, dp_group) -> PipelineProfile:
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        replicas = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(replicas, local.to_dict(), group=dp_group)
        local = PipelineProfile.elementwise_max([PipelineProfile.from_dict(r) for r in replicas])
    stages = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, local.to_dict(), group=pp_group)
    return PipelineProfile.merge([PipelineProfile.from_dict(s) for s in stages])
