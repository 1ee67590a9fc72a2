"""Batches on every pipeline rank, so the MTP block can move live inside Megatron-LM.

pretrain_gpt.py builds its datasets on the first, last and MTP ranks only
(`is_dataset_built_on_rank`) and its `get_batch` reads a micro-batch there only, deciding
the MTP rank from its args on every call. A block moved live to another rank would find
no data iterator there, or one still at the first batch. With MTP and three or more
pipeline ranks (where the block can change rank; never the first, Megatron's rule) the
plugin therefore:

- builds the datasets on every rank of tensor rank 0 (`every_rank_builds`: the script's
  `is_dataset_built_on_rank` replaced while Megatron-LM builds them, then restored);
- reads every micro-batch on every such rank (`lockstep`): a rank whose forward would not
  read one (neither first, last nor MTP) draws it and drops it, so each rank's iterator
  stands at the same batch and the block's new rank continues with the right one. Every
  read goes through Megatron-LM's own iterator (its RerunDataIterator replays alike);
- updates Megatron-LM's args at a move (`_Run._layout_changed`), from which get_batch
  reads the new MTP rank.

The cost: each rank of tensor rank 0 loads every micro-batch (the first and last ranks
did already), once per micro-batch, beside the GPU work. A provider other than
pretrain_gpt.py's keeps its own rule: the block then moves live only if the data turns
out to be on every rank (`data_everywhere`), and a forced layout that moves it is refused
in one line.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

__all__ = ["feeds_every_rank", "every_rank_builds", "data_everywhere", "lockstep"]

_RULE = "is_dataset_built_on_rank"  # pretrain_gpt.py's function, read at build time


def feeds_every_rank(stage) -> bool:
    """Whether this run may move the MTP block live, so every rank needs the batches:
    MTP, one model chunk per rank (Megatron-LM refuses MTP with virtual stages under
    --dynmo), at least three pipeline ranks."""
    layout = stage.layout
    return layout.has_mtp and layout.num_chunks == 1 and layout.num_ranks >= 3


@contextmanager
def every_rank_builds(provider: Callable):
    """While Megatron-LM builds the datasets, pretrain_gpt.py's `is_dataset_built_on_rank`
    (first, last or MTP rank, and tensor rank 0) reads 'tensor rank 0' only: every pipeline
    rank builds them. A provider without that function is left alone."""
    fn = provider.func if isinstance(provider, functools.partial) else provider
    names = getattr(fn, "__globals__", {})
    original = names.get(_RULE)
    if original is None:
        yield
        return

    def is_dataset_built_on_rank(vp_stage=None):
        from megatron.core import parallel_state
        return parallel_state.get_tensor_model_parallel_rank() == 0

    names[_RULE] = is_dataset_built_on_rank
    try:
        yield
    finally:
        names[_RULE] = original


def data_everywhere(train_iterator, device) -> bool:
    """Whether every rank of tensor rank 0 holds a training iterator (the same answer on
    every rank: a collective over the world)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    fed = parallel_state.get_tensor_model_parallel_rank() != 0 or train_iterator is not None
    flag = torch.tensor([int(fed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def reads_batch(stage) -> bool:
    """Whether pretrain_gpt.py's get_batch reads a micro-batch on this rank now: on the
    first and last ranks and on the block's (one chunk per rank)."""
    rank, layout = stage.dims.pp_rank, stage.layout
    return rank in (0, layout.num_ranks - 1) or rank == layout.mtp_rank


def lockstep(forward_step_func: Callable, stage) -> Callable:
    """`forward_step_func` that first draws (and drops) the micro-batch on a rank whose
    forward will not read it, so every rank's iterator stays at the same batch."""
    @functools.wraps(forward_step_func)
    def forward_step(data_iterator, model, *args, **kwargs):
        if data_iterator is not None and not reads_batch(stage):
            next(data_iterator)
        return forward_step_func(data_iterator, model, *args, **kwargs)
    return forward_step
