"""Adaptive batching (`--data-batching adaptive`) with an interleaved pipeline (pp = 2,
v = 2): the same training, to the last bit, as plain 1F1B on the same model and
documents, through forced migrations across chunks and ranks.

Adaptive micro-batches change shape ([S, B, h] activations, B(S) rows of bucket S), so
Megatron exchanges shapes before tensors (`variable_seq_lengths`). Under interleaving one
p2p call sends a chunk's activation and another chunk's gradient to the same peer when
pp = 2, and Megatron's own shape exchange paired the two shape messages the wrong way
round (gloo: "Received data size doesn't match expected size");
`dynmo_plugin.megatron.p2p.PairedShapeP2P` sends the shapes as the tensors are sent.
With Megatron's P2PCommunicator back in `StageTrainer.train_step` this test fails with
that gloo error. The cost model is the prior (`power`, no timing fit), so both runs
batch the same documents into the same shapes."""
import pytest

from launch import assert_same_training, losses, worker

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--dynmo", "--test-dump-params",
         "--pipeline-model-parallel-size", "2", "--data-batching", "adaptive",
         "--data-documents", "lognormal", "--data-lognormal-median", "12"]
INTERLEAVED = MODEL + ["--num-virtual-stages-per-pipeline-rank", "2"]
# Start Ett|tt|tt|ttL; iteration 3: layer 2 chunk 0 -> 1 of rank 0 (local), 3, 4, 7 to rank 0;
# iteration 5: back to a balanced layout with local and cross-rank moves.
FORCED = "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"


def _shapes(iteration: int) -> set:
    """The token shapes [B, S] of the iteration's adaptive micro-batches (the test's premise:
    they differ within an iteration)."""
    import argparse

    import torch

    from dynmo_plugin.config import add_dynmo_args, add_model_args, load_config
    from dynmo_plugin.data.build import build_packed_documents
    flags = [f for f in MODEL if f != "--test-dump-params"]
    m = load_config(add_dynmo_args(add_model_args(argparse.ArgumentParser())).parse_args(flags),
                    world_size=2).model
    data = build_packed_documents(m.data, m.seed, m.vocab_size, m.seq_length, 1, 4)
    return {tuple(b["tokens"].shape) for b in data.micro_batches(iteration, 0, 1, torch.device("cpu"))}


def test_adaptive_batches_change_shape_within_an_iteration():
    assert all(len(_shapes(it)) >= 2 for it in range(2, 7))


@pytest.mark.multiproc
def test_interleaved_adaptive_batching_equals_1f1b(tmp_path_factory):
    ref_dir, il_dir = tmp_path_factory.mktemp("ad_1f1b"), tmp_path_factory.mktemp("ad_il")
    ref = worker(2, MODEL, ref_dir)
    il = worker(2, INTERLEAVED + ["--dynmo-forced-layouts", FORCED], il_dir)
    applied = [e["layout_after"] for e in il["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == ["Et||tttttt|tL", "Ettt|t|tt|ttL"]
    assert il["initial_layout"] == "Ett|tt|tt|ttL" and ref["layout"] == "Etttt|ttttL"
    assert_same_training(ref_dir, ref, il_dir, il, range(2))
    assert len(losses(il)) == 6
