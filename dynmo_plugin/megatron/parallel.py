"""Process groups for one training run: torch.distributed + Megatron's parallel_state.

`init_parallel` is the only place the backend is chosen (nccl with CUDA, gloo
without) and the only caller of the CPU compatibility layer. The resulting
`ParallelDims` carries the groups explicitly; code below it takes them from there
rather than reading module globals, so a repack can rebuild them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from dynmo_plugin.config import ModelArgs

__all__ = ["ParallelDims", "init_parallel", "destroy_parallel"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the TP x PP x DP grid and the groups it talks over."""

    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    groups: ProcessGroupCollection

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def backend(self) -> str:
        return dist.get_backend()


def init_parallel(args: ModelArgs) -> ParallelDims:
    """Initialise torch.distributed (env:// from torchrun) and Megatron's groups."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            # Binding the device lets new_group/split_group use ncclCommSplit.
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    if not cuda:
        from dynmo_plugin.megatron import cpu_compat
        cpu_compat.apply()
        torch.set_num_threads(1)  # CPU-time profiling needs one thread per rank
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    world = dist.get_world_size()
    return ParallelDims(
        rank=dist.get_rank(), world_size=world, tp=tp, pp=pp, dp=world // (tp * pp),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        groups=ProcessGroupCollection.use_mpu_process_groups(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups, then the default group (order matters for gloo)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
