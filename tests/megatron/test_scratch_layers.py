"""dynmo_plugin/megatron/training/scratch.py: a calibration's throw-away layers are built
from the run's spec and run forward and backward, but leave the run's random streams as
they were. Megatron draws from them when it builds a module where the config says
`perform_initialization` (Megatron-LM's pretrain_gpt.py; torch's CPU generator under
--use-cpu-initialization, as here; the CUDA RNG tracker's streams on a GPU) and in a
layer's dropout (Megatron-LM's default 0.1): else a --dynmo run's dropout masks would
differ from the same run's without the plugin."""
from __future__ import annotations

import copy

import pytest
import torch

from launch import in_megatron_process


class _TrackerStandIn:
    """Stand-in, named as such, for Megatron's CUDA RNG tracker (it needs CUDA): states as
    Megatron's own keeps them (a tensor per stream, replaced by `fork`) and as a
    CUDA-graph-safe one does (a generator per stream, advanced in place)."""

    def __init__(self):
        self.states_ = {"model-parallel-rng": torch.get_rng_state(),
                        "expert-parallel-rng": torch.Generator().manual_seed(3)}

    def is_initialized(self):
        return True

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = states

    def draw(self):  # what a forked dropout does to each kind of stream
        self.states_["model-parallel-rng"] = torch.randint(0, 255, (8,), dtype=torch.uint8)
        torch.rand(4, generator=self.states_["expert-parallel-rng"])


def test_every_stream_is_put_back_whichever_way_the_tracker_keeps_it(monkeypatch):
    from dynmo_plugin.megatron.training import scratch
    tracker = _TrackerStandIn()
    monkeypatch.setattr(scratch, "_tracker", lambda: tracker)
    before = {"cpu": torch.get_rng_state(), "mp": tracker.states_["model-parallel-rng"].clone(),
              "ep": tracker.states_["expert-parallel-rng"].get_state()}
    with scratch.rng_streams_kept():
        torch.rand(3)
        tracker.draw()
    assert torch.equal(torch.get_rng_state(), before["cpu"])
    assert torch.equal(tracker.states_["model-parallel-rng"], before["mp"])
    assert torch.equal(tracker.states_["expert-parallel-rng"].get_state(), before["ep"])


def _stage(args):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import ParallelDims
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    dims = ParallelDims(rank=0, world_size=1, tp=1, pp=1, dp=1, pp_rank=0, dp_rank=0,
                        device=torch.device("cpu"), groups=ProcessGroupCollection.use_mpu_process_groups())
    return StageTrainer(args, dims, Layout.uniform(args.num_layers, 1))


def _check_the_build_leaves_the_runs_random_streams(args):
    from dynmo_plugin.megatron.training.scratch import build_scratch_layer
    trainer = _stage(args)
    decoder = trainer.model.decoder
    config = copy.copy(trainer.config)  # as Megatron-LM's: weights drawn at construction
    config.perform_initialization = config.use_cpu_initialization = True
    cpu = torch.get_rng_state()
    layer = build_scratch_layer(trainer.spec, config, 1, decoder.pg_collection, decoder.vp_stage,
                                trainer.dims.device, torch.Generator().manual_seed(0))
    assert sum(p.numel() for p in layer.parameters()) > 0
    assert torch.equal(torch.get_rng_state(), cpu), "the scratch layer's build moved torch's CPU generator"


def _check_a_calibration_with_dropout_leaves_the_runs_random_streams(args):
    """Sparse attention's calibration (the MoE and MoD ones run inside the same context)
    times a scratch layer forward and backward at each bucket count, dropout on."""
    from dynmo_plugin.megatron.training.model import layer_spec
    from dynmo_plugin.scenarios.sparse_attention.layer import lsh_attention_spec, time_layer
    trainer = _stage(args)
    config = copy.copy(trainer.config)
    config.hidden_dropout = 0.1  # Megatron-LM pretrain_gpt.py's default (LSH attention has no attention dropout)
    spec = lsh_attention_spec(layer_spec("local"), seed=1, initial_buckets={1: 4}, hashes=1)
    cpu = torch.get_rng_state()
    seconds = time_layer(spec, config, trainer.model.decoder.pg_collection, trainer.model.decoder.vp_stage,
                         s=32, b=2, buckets=[1, 4], repeats=1)
    assert sorted(seconds) == [0, 1, 4]
    assert torch.equal(torch.get_rng_state(), cpu), "the calibration's dropout moved torch's CPU generator"


@pytest.mark.parametrize("check", [_check_the_build_leaves_the_runs_random_streams,
                                   _check_a_calibration_with_dropout_leaves_the_runs_random_streams])
def test_a_calibration_leaves_the_runs_random_streams_as_they_were(check):
    in_megatron_process(check)
