"""dynmo_plugin/megatron/training/scratch.py: a calibration's throw-away layer is built
from the run's spec, but leaves the run's random streams as they were (Megatron draws a
new module's initial weights from them where the config says `perform_initialization`,
as Megatron-LM's pretrain_gpt.py does: torch's CPU generator under
--use-cpu-initialization, as here; the CUDA RNG tracker's streams on a GPU)."""
from __future__ import annotations

import copy

import torch

from launch import in_megatron_process


def _check_the_build_leaves_the_runs_random_streams(args):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import ParallelDims
    from dynmo_plugin.megatron.training.scratch import build_scratch_layer
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    dims = ParallelDims(rank=0, world_size=1, tp=1, pp=1, dp=1, pp_rank=0, dp_rank=0,
                        device=torch.device("cpu"), groups=ProcessGroupCollection.use_mpu_process_groups())
    trainer = StageTrainer(args, dims, Layout.uniform(args.num_layers, 1))
    decoder, tracker = trainer.model.decoder, get_cuda_rng_tracker()
    config = copy.copy(trainer.config)  # as Megatron-LM's: weights drawn at construction
    config.perform_initialization = config.use_cpu_initialization = True
    cpu = torch.get_rng_state()
    streams = {k: v.clone() for k, v in tracker.get_states().items()} if tracker.is_initialized() else {}
    layer = build_scratch_layer(trainer.spec, config, 1, decoder.pg_collection, decoder.vp_stage,
                                dims.device, torch.Generator().manual_seed(0))
    assert sum(p.numel() for p in layer.parameters()) > 0
    assert torch.equal(torch.get_rng_state(), cpu), "the scratch layer's build moved torch's CPU generator"
    after = tracker.get_states() if tracker.is_initialized() else {}
    assert sorted(after) == sorted(streams) and all(torch.equal(after[k], streams[k]) for k in streams)


def test_a_scratch_layer_leaves_the_runs_random_streams_as_they_were():
    in_megatron_process(_check_the_build_leaves_the_runs_random_streams)
