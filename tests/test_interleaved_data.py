"""Packed documents with an interleaved pipeline (pp = 2, v = 2): the same training, to the
last bit, as plain 1F1B on the same model and documents, through forced migrations across
chunks and ranks.

Under interleaving Megatron calls the forward step once per (micro-batch, chunk): every
chunk must read the same packed micro-batch, in order (StageTrainer.train_step gives each
chunk its own iterator over one list). One torchrun pair: the interleaved run with moves
against the never-moved 1F1B run (as tests/test_interleaved_migration.py does); both fit
the data cost model from the profiler (data.calibration), which must time the layers of
every chunk."""
import argparse

import pytest

from launch import assert_same_training, losses, worker

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--dynmo", "--test-dump-params",
         "--pipeline-model-parallel-size", "2",
         "--data-documents", "lognormal", "--data-lognormal-median", "24",
         "--data-cost-model", "knapformer"]  # fitted at iterations 1-2; sequential packing ignores it
INTERLEAVED = MODEL + ["--num-virtual-stages-per-pipeline-rank", "2"]
# Start Ett|tt|tt|ttL; iteration 3: layer 2 chunk 0 -> 1 of rank 0 (local), 3, 4, 7 to rank 0;
# iteration 5: back to a balanced layout with local and cross-rank moves.
FORCED = "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"


def _config(*flags):
    from dynmo_plugin.config import add_dynmo_args, add_model_args, load_config
    parser = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    return load_config(parser.parse_args(list(flags)), world_size=2)


def test_packed_documents_and_adaptive_batching_accepted():
    flags = [f for f in INTERLEAVED if f != "--test-dump-params"]
    assert _config(*flags).model.data.packed
    assert _config(*flags, "--data-batching", "adaptive").model.data.batching == "adaptive"


def test_mix_adjusted_profile_keeps_num_chunks():
    """The data cost adjuster rescales layer times; the profile stays a v = 2 profile."""
    from dynmo_plugin.data.calibration import mix_adjusted_profile
    from dynmo_plugin.data.cost_model import KnapFormerCost
    from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile
    layer = LayerProfile(layer=1, stage=0, fwd_s=1.0, bwd_s=2.0, param_bytes=0, grad_bytes=0,
                         optim_bytes=0, act_bytes=0)
    profile = PipelineProfile(layers=[layer], stages=[], num_chunks=2)
    model = KnapFormerCost(k=1.0, gamma=1.0, hidden=32)
    out = mix_adjusted_profile(profile, {1: model}, (2, 64, 2048), (2, 64, 4096))
    assert out.num_chunks == 2 and out.layers[0].fwd_s > 1.0


@pytest.mark.multiproc
def test_interleaved_packed_documents_equal_1f1b(tmp_path_factory):
    ref_dir, il_dir = tmp_path_factory.mktemp("pk_1f1b"), tmp_path_factory.mktemp("pk_il")
    ref = worker(2, MODEL, ref_dir)
    il = worker(2, INTERLEAVED + ["--dynmo-forced-layouts", FORCED], il_dir)
    applied = [e["layout_after"] for e in il["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == ["Et||tttttt|tL", "Ettt|t|tt|ttL"]
    assert il["initial_layout"] == "Ett|tt|tt|ttL" and ref["layout"] == "Etttt|ttttL"
    fit = [e for e in il["events"] if e["kind"] == "data_cost_fit"]
    assert sorted(map(int, fit[0]["per_layer_knapformer"])) == list(range(1, 9))  # every chunk's
    assert_same_training(ref_dir, ref, il_dir, il, range(2))
    assert len(losses(il)) == 6
