"""Megatron marks a tensor-parallel weight (`tensor_model_parallel`, `partition_dim`,
`partition_stride`) only while it initialises it; the launcher builds its stages and the
layers a migration receives without Megatron's initialisation (init_by_global_name sets
the values), so `model.mark_tensor_parallel` marks them. Unmarked, Megatron counted each
such weight on TP rank 0 alone: the gradient norm that clipping divides by, the params
norm and the zeros count left out every other rank's shard (review 22c)."""
from __future__ import annotations

import re

import pytest
import torch
from launch import in_megatron_process, torchrun
from test_profiling_rest import _one_rank_trainer

from dynmo_plugin.config import ModelArgs


def _marks(args):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    trainer = _one_rank_trainer(args)
    seen = {}
    for name, m in trainer.chunks[0].named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and m.weight is not None:
            w = m.weight
            seen[name] = (getattr(w, "tensor_model_parallel", None), getattr(w, "partition_dim", None),
                          getattr(w, "partition_stride", None))
    assert seen and all(mark[0] is True for mark in seen.values()), seen
    assert {n.split(".")[-1]: mark[1:] for n, mark in seen.items()} == {
        "word_embeddings": (0, 1), "linear_qkv": (0, 1), "linear_proj": (1, 1), "linear_fc1": (0, 1),
        "linear_fc2": (1, 1), "output_layer": (0, 1)}


def test_the_launchers_tensor_parallel_weights_are_marked_as_megatron_marks_them():
    in_megatron_process(_marks, ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                          untie_embeddings_and_output_weights=True))


_NORM = re.compile(r"iteration +(\d+)/\d+ .*\| grad norm ([0-9.]+)")
FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--clip-grad", "1.0"]


def _norms(tmp_path, nproc: int, flags: list[str]) -> list[float]:
    proc = torchrun(nproc, [*FLAGS, *flags], tmp_path)
    found = [(int(i), float(v)) for i, v in _NORM.findall(proc.stderr)]
    assert [i for i, _ in found] == [1, 2, 3, 4], proc.stderr[-3000:]
    return [v for _, v in found]


@pytest.mark.multiproc
def test_a_moved_layer_keeps_its_tensor_parallel_shards_in_the_clipped_gradient_norm(tmp_path):
    """TP 2 x PP 2, layer 2 moved to stage 1 at iteration 2, against the never-moved run:
    the gradient norm Megatron clips by is the same (to the 3 decimals the log prints: a
    move regroups the sum, docs/megatron-lm.md). Unmarked, the received layer's shards on
    TP rank 1 left the norm."""
    split = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    static = _norms(tmp_path / "static", 4, split)
    moved = _norms(tmp_path / "moved", 4, [*split, "--dynmo", "--dynmo-forced-layouts", "2:Et|tttL"])
    assert torch.allclose(torch.tensor(moved), torch.tensor(static), atol=2e-3), (static, moved)
