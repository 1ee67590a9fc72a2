"""Process groups for one training run: torch.distributed + Megatron's parallel_state.

`init_parallel` is the only place the backend is chosen (`--distributed-backend`, by
default nccl with CUDA, gloo without; `resolve_backend` checks the choice against the
machine before any CUDA call) and the only caller of the CPU compatibility layer; it also
gives the launcher's optimizers the gradient norm a move cannot change (`grad_norm`) and
its DDP the data-parallel reduction a move cannot change (`grad_reduce`). The resulting
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

from dynmo_plugin.config import ConfigError, ModelArgs
from dynmo_plugin.consensus import agent_store
from dynmo_plugin.megatron.training import grad_norm, grad_reduce
from dynmo_plugin.megatron.training.mtp import embedding_ranks_for

__all__ = ["ParallelDims", "init_parallel", "current_dims", "destroy_parallel", "shrink_world",
           "survives", "resolve_backend", "supports_shrinking"]

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


def resolve_backend(requested: str | None, cuda_devices: int, local_world_size: int) -> str:
    """The backend to use: `requested` (--distributed-backend) or, if None, nccl where
    CUDA GPUs are visible, else gloo. Pure, so it runs before any CUDA call.

    Raises:
        ConfigError: nccl without GPUs; gloo with GPUs visible (the launcher's CUDA path
            needs nccl: gloo cannot send CUDA tensors between pipeline stages); more
            ranks on this node than GPUs (one GPU per rank: NCCL refuses a shared GPU).
    """
    backend = requested or ("nccl" if cuda_devices > 0 else "gloo")
    if backend == "nccl" and cuda_devices == 0:
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and none is visible here; "
                          "use --distributed-backend gloo (the default without GPUs) to train on CPU")
    if backend == "gloo" and cuda_devices > 0:
        raise ConfigError(f"--distributed-backend gloo with {cuda_devices} CUDA GPU(s) visible: the "
                          "launcher trains on GPUs over nccl only (gloo cannot send CUDA tensors "
                          "between pipeline stages); use nccl, or hide the GPUs "
                          "(CUDA_VISIBLE_DEVICES=) to train on CPU")
    if backend == "nccl" and local_world_size > cuda_devices:
        raise ConfigError(f"{local_world_size} ranks on this node but {cuda_devices} CUDA GPU(s) "
                          f"visible: each rank needs its own GPU; start at most {cuda_devices} per "
                          f"node (torchrun --nproc-per-node {cuda_devices}) or make more GPUs "
                          "visible (CUDA_VISIBLE_DEVICES)")
    return backend


def init_parallel(args: ModelArgs, native_grad_reduce: bool = False) -> ParallelDims:
    """Initialise torch.distributed (env:// from torchrun) and Megatron's groups; the
    optimizers' gradient norm summed in no layout's order (`grad_norm`) and, unless
    `native_grad_reduce` (--dynmo-native-grad-reduce), DDP's buckets reduced in rank
    order (`grad_reduce`): either way a move cannot change them.

    Raises:
        ConfigError: the backend does not fit the machine (see `resolve_backend`).
    """
    # device_count asks NVML where it can: no CUDA context exists before this check
    backend = resolve_backend(args.distributed_backend, torch.cuda.device_count(),
                              int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    cuda = backend == "nccl"
    if not dist.is_initialized():
        if cuda:
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            # Binding the device lets new_group/split_group use ncclCommSplit.
            dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group(backend)
    if not cuda:
        from dynmo_plugin.megatron.training import cpu_compat
        cpu_compat.apply()
        torch.set_num_threads(1)  # CPU-time profiling needs one thread per rank
    # --clip-grad: the same norm whichever stage holds a layer, shards cut anywhere
    grad_norm.install(sharded=args.use_distributed_optimizer)
    grad_reduce.choose(native_grad_reduce)  # DP >= 3: the same sums wherever a layer sits
    return _model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.seed, embedding_ranks_for(args))


def _model_parallel(tp: int, pp: int, seed: int, embedding_ranks=None) -> ParallelDims:
    """Megatron's groups over the current world (pipeline rank varies slowest);
    `embedding_ranks`: Megatron's `get_embedding_ranks` (default: first and last)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             get_embedding_ranks=embedding_ranks)
    # each pipeline rank's streams apart, as Megatron-LM's _set_random_seed (seed + 100 x
    # pp rank): what --dynmo-rank-rng draws from (the layers' own streams read no rank's;
    # weights are drawn per global name, so nothing else here draws from these)
    rank_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(rank_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)
    return current_dims()


def current_dims() -> ParallelDims:
    """This rank's `ParallelDims`, read from Megatron's groups as they are initialised
    (by `init_parallel` and `shrink_world` in the launcher, by Megatron-LM's own
    initialize_megatron under it): the one place a ParallelDims is made."""
    cuda = torch.cuda.is_available()
    return ParallelDims(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        dp=parallel_state.get_data_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
        groups=ProcessGroupCollection.use_mpu_process_groups(),
    )


def survives(dims: ParallelDims, new_pp: int) -> bool:
    """Whether this rank keeps its place when the pipeline shrinks to `new_pp` stages.

    The lowest pipeline stages survive. Megatron orders ranks tp-cp-ep-dp-pp (the
    pipeline rank varies slowest), so the survivors are exactly global ranks
    0 .. new_world-1: they keep their rank numbers, torchrun's RANK stays true, and the
    highest ranks (a StatefulSet's highest ordinals, the ones it removes first) leave.
    """
    survivor = dims.pp_rank < new_pp
    if survivor != (dims.rank < dims.tp * new_pp * dims.dp):
        raise RuntimeError(f"rank {dims.rank} (pipeline stage {dims.pp_rank}) breaks the "
                           "pipeline-slowest rank order that shrinking relies on")
    return survivor


def supports_shrinking(group=None) -> bool:
    """Whether `group` (default: the world) can shrink in place with
    `torch.distributed.shrink_group`: NCCL's communicator shrink (ncclCommShrink, NCCL
    >= 2.27), which torch reports per backend as `supports_shrinking` and reaches through
    the group's bound device (init_parallel binds it on NCCL). gloo cannot."""
    if not hasattr(dist, "shrink_group") or not dist.is_initialized():
        return False
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    device = getattr(pg, "bound_device_id", None)
    if device is None:
        return False
    try:
        return bool(pg._get_backend(device).supports_shrinking)
    except (RuntimeError, AttributeError):
        return False


def shrink_world(dims: ParallelDims, new_pp: int, generation: int, seed: int,
                 timeout_s: float) -> ParallelDims:
    """Survivors only (the retiring ranks have destroyed their groups): a new default
    group over ranks 0..new_world-1 and Megatron's groups with `new_pp` stages.

    `initialize_model_parallel` reads the WORLD size, so the world itself must shrink.
    Where the backend supports it (NCCL, see `supports_shrinking`) the world
    communicator shrinks in place, survivors only, excluding the retired ranks; torch
    then destroys every other group (Megatron's, the control plane's: the caller
    rebuilds the control plane). Elsewhere (gloo) the world is destroyed and a fresh
    rendezvous on torchrun's store under a new prefix per repack (`generation`) makes
    the new one. Either way every Megatron subgroup made afterwards on NCCL comes from
    ncclCommSplit of the new world communicator (the device stays bound).
    """
    backend, world = dims.backend, dims.tp * new_pp * dims.dp
    parallel_state.destroy_model_parallel()
    if world < dims.world_size and supports_shrinking():  # equal: a grow (megatron.repack)
        logger.info("shrinking the %s world %d -> %d ranks in place (shrink_group)", backend,
                    dims.world_size, world)
        dist.shrink_group(list(range(world, dims.world_size)))
    else:
        _rendezvous_world(backend, dims.rank, world, generation, timeout_s)
    os.environ["WORLD_SIZE"] = str(world)
    return _model_parallel(dims.tp, new_pp, seed)


def _rendezvous_world(backend: str, rank: int, world: int, generation: int,
                      timeout_s: float) -> None:
    """Destroy the world and rendezvous a new one of `world` ranks on torchrun's store."""
    dist.destroy_process_group()
    store = agent_store(timeout_s)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=dist.PrefixStore(f"dynmo/repack{generation}/", store),
                            rank=rank, world_size=world, **kwargs)


def destroy_parallel() -> None:
    """Tear down Megatron's groups, then the default group (order matters for gloo)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
