"""Documents with an interleaved pipeline (pp = 2, v = 2), packed or in adaptive batches:
the same training, to the last bit, as plain 1F1B on the same model and documents, through
forced migrations across chunks and ranks.

Under interleaving Megatron calls the forward step once per (micro-batch, chunk): every
chunk must read the same packed micro-batch, in order (StageTrainer.train_step gives each
chunk its own iterator over one list). One torchrun pair: the interleaved run with moves
against the never-moved 1F1B run (as tests/megatron/test_interleaved_migration.py does); both fit
the data cost model from the profiler (data.calibration), which must time the layers of
every chunk.

Adaptive micro-batches change shape ([S, B, h] activations, B(S) rows of bucket S), so
Megatron exchanges shapes before tensors (`variable_seq_lengths`). Under interleaving one
p2p call sends a chunk's activation and another chunk's gradient to the same peer when
pp = 2, and Megatron's own shape exchange paired the two shape messages the wrong way
round (gloo: "Received data size doesn't match expected size");
`dynmo_plugin.megatron.training.p2p.PairedShapeP2P` sends the shapes as the tensors are sent.
With Megatron's P2PCommunicator back in `StageTrainer.train_step` the adaptive test fails
with that gloo error. Its cost model is the prior (`power`, no timing fit), so both runs
batch the same documents into the same shapes."""
import argparse

import pytest

from launch import assert_same_training, losses, worker

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--dynmo", "--test-dump-params",
         "--pipeline-model-parallel-size", "2",
         "--data-documents", "lognormal", "--data-lognormal-median", "24",
         "--data-cost-model", "knapformer"]  # fitted at iterations 1-2; sequential packing ignores it
ADAPTIVE = MODEL[:MODEL.index("--data-lognormal-median")] + [
    "--data-lognormal-median", "12", "--data-batching", "adaptive"]
V2 = ["--num-virtual-stages-per-pipeline-rank", "2"]
INTERLEAVED = MODEL + V2
# Start Ett|tt|tt|ttL; iteration 3: layer 2 chunk 0 -> 1 of rank 0 (local), 3, 4, 7 to rank 0;
# iteration 5: back to a balanced layout with local and cross-rank moves.
FORCED = "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"


def _config(*flags):
    from dynmo_plugin.config import add_dynmo_args, add_model_args
    from dynmo_plugin.megatron.training.machine import load_run_config
    parser = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    return load_run_config(parser.parse_args(list(flags)), world_size=2)


def test_packed_documents_and_adaptive_batching_accepted():
    flags = [f for f in INTERLEAVED if f != "--test-dump-params"]
    assert _config(*flags).model.data.packed
    assert _config(*flags, "--data-batching", "adaptive").model.data.batching == "adaptive"


def _shapes(iteration: int) -> set:
    """The token shapes [B, S] of the iteration's adaptive micro-batches (the adaptive
    test's premise: they differ within an iteration)."""
    import torch

    from dynmo_plugin.megatron.data.build import build_packed_documents
    m = _config(*[f for f in ADAPTIVE if f != "--test-dump-params"]).model
    data = build_packed_documents(m.data, m.seed, m.vocab_size, m.seq_length, 1, 4)
    return {tuple(b["tokens"].shape) for b in data.micro_batches(iteration, 0, 1, torch.device("cpu"))}


def test_adaptive_batches_change_shape_within_an_iteration():
    assert all(len(_shapes(it)) >= 2 for it in range(2, 7))


def test_mix_adjusted_profile_keeps_num_chunks():
    """The data cost adjuster rescales layer times; the profile stays a v = 2 profile."""
    from dynmo_plugin.megatron.profiling.calibration import mix_adjusted_profile
    from dynmo_plugin.data.cost_model import KnapFormerCost
    from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile
    layer = LayerProfile(layer=1, stage=0, fwd_s=1.0, bwd_s=2.0, param_bytes=0, grad_bytes=0,
                         optim_bytes=0, act_bytes=0)
    profile = PipelineProfile(layers=[layer], stages=[], num_chunks=2)
    model = KnapFormerCost(k=1.0, gamma=1.0, hidden=32)
    out = mix_adjusted_profile(profile, {1: model}, (2, 64, 2048), (2, 64, 4096))
    assert out.num_chunks == 2 and out.layers[0].fwd_s > 1.0


def _moved_interleaved_equals_1f1b(tmp_path_factory, model: list, name: str) -> dict:
    """The interleaved run with FORCED moves trains as the never-moved 1F1B run, to the
    last bit; returns the interleaved run's report."""
    ref_dir, il_dir = tmp_path_factory.mktemp(f"{name}_1f1b"), tmp_path_factory.mktemp(f"{name}_il")
    ref = worker(2, model, ref_dir)
    il = worker(2, model + V2 + ["--dynmo-forced-layouts", FORCED], il_dir)
    applied = [e["layout_after"] for e in il["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == ["Et||tttttt|tL", "Ettt|t|tt|ttL"]
    assert il["initial_layout"] == "Ett|tt|tt|ttL" and ref["layout"] == "Etttt|ttttL"
    assert_same_training(ref_dir, ref, il_dir, il, range(2))
    assert len(losses(il)) == 6
    return il


@pytest.mark.multiproc
def test_interleaved_packed_documents_equal_1f1b(tmp_path_factory):
    il = _moved_interleaved_equals_1f1b(tmp_path_factory, MODEL, "pk")
    fit = [e for e in il["events"] if e["kind"] == "data_cost_fit"]
    assert sorted(map(int, fit[0]["per_layer_knapformer"])) == list(range(1, 9))  # every chunk's


@pytest.mark.multiproc
def test_interleaved_adaptive_batching_equals_1f1b(tmp_path_factory):
    _moved_interleaved_equals_1f1b(tmp_path_factory, ADAPTIVE, "ad")
