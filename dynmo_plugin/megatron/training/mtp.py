"""Multi-Token Prediction (MTP) in the launcher's GPT: Megatron-Core's own block.

`--mtp-num-layers k` builds Megatron-Core 0.16.1's `MultiTokenPredictionBlock` on the
stage the layout's 'm' names (`get_gpt_mtp_block_spec`: k `MultiTokenPredictionLayer`s
of the decoder's layer spec, with `--transformer-impl local` Megatron's local modules),
passed to `GPTModel(mtp_block_spec=...)`; GPTModel then gives that stage an embedding
copy and the block's hidden states go on to the last stage, whose output layer
computes the MTP losses (`MTPLossAutoScaler`).

The embedding copy on the MTP stage is kept equal to the first stage's by Megatron's
embedding group (its gradients are all-reduced there, as pretrain_gpt.py's
`get_embedding_ranks` arranges): `embedding_ranks_for` adds the MTP rank to the
first (and, with tied weights, last) rank. The MTP stage's position-embedding copy is
not in any group (Megatron's default position-embedding group is the first rank alone),
so it trains on the MTP loss alone; it is named `mtp.position_embeddings.weight`
globally (`global_name`), so it never collides with the first stage's table in
initialisation or checkpoints.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

from dynmo_plugin.layout import Layout

__all__ = ["embedding_ranks_for", "mtp_block_spec", "global_name", "MTP_POSITION_NAME",
           "mtp_rank_of", "EmbeddingGroups", "with_embedding_group"]

MTP_POSITION_NAME = "mtp.position_embeddings.weight"


def mtp_rank_of(args) -> Optional[int]:
    """The pipeline rank the layout (or Megatron's default: the last) puts MTP on."""
    k, pp = getattr(args, "mtp_num_layers", None) or 0, args.pipeline_model_parallel_size
    if not k:
        return None
    text = args.pipeline_model_parallel_layout
    if not text:
        return pp - 1
    v = args.num_virtual_stages_per_pipeline_rank
    return Layout.parse(text, pp, args.num_layers, v, k).mtp_rank


def embedding_ranks_for(args) -> Optional[Callable[[list[int]], list[int]]]:
    """Megatron's `get_embedding_ranks` for this run: None (Megatron's first + last)
    without MTP, else first, last when tied, and the MTP rank (pretrain_gpt.py's rule)."""
    rank = mtp_rank_of(args)
    if rank is None:
        return None
    tied = not args.untie_embeddings_and_output_weights

    def ranks(pp_ranks: list[int], *_: object) -> list[int]:
        out = {pp_ranks[0]}
        if len(pp_ranks) > 1:
            out.add(pp_ranks[rank])
            if tied:
                out.add(pp_ranks[-1])
        return sorted(out)
    return ranks


def mtp_block_spec(config, spec, impl: str, vp_stage: Optional[int]):
    """Megatron's MTP block spec for this stage (None where the layout puts no 'm')."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=impl == "transformer_engine",
                                  vp_stage=vp_stage)


def global_name(name: str, model) -> str:
    """`name` as initialisation and checkpoints know it: the MTP stage's own position
    table is the MTP block's (module docstring)."""
    if (name == "embedding.position_embeddings.weight" and getattr(model, "mtp_process", False)
            and not getattr(model, "pre_process", False)):
        return MTP_POSITION_NAME
    return name


class EmbeddingGroups:
    """One embedding group per pipeline rank the MTP block may live on (a live move
    switches which one the word-embedding gradient all-reduce uses).

    Megatron's embedding group holds the first rank, the MTP rank (and the last with
    tied weights); it is made once at start for the block's first rank. The groups for
    the other candidate ranks (1..pp-1) are made here, at start, by every rank of the
    world in the same order (`new_group` is collective over the world: NCCL needs that),
    one per pipeline group; each rank keeps the ones it belongs to. `initial` (Megatron's
    group) serves the block's starting rank, so a never-moved run uses Megatron's own
    group throughout."""

    def __init__(self, initial, start_rank: int, pp_ranks: list[int], tied: bool):
        import torch.distributed as dist

        self.start_rank, self.tied = start_rank, tied
        self._groups = {start_rank: initial}
        pipelines: list = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, list(pp_ranks))
        for rank in range(1, len(pp_ranks)):
            if rank == start_rank:
                continue
            for ranks in sorted({tuple(p) for p in pipelines}):
                members = sorted({ranks[0], ranks[rank]} | ({ranks[-1]} if tied else set()))
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    self._groups[rank] = group

    def for_rank(self, mtp_rank: int):
        """The embedding group when the block is on pipeline rank `mtp_rank` (`NO_GROUP`
        where this rank is in no such group)."""
        return self._groups.get(mtp_rank) or NO_GROUP


class _NoGroup:
    """No embedding group for this rank: Megatron's finalize_model_grads skips a group of
    size 1, but looks its global one up for None (which, on a rank the block left, is
    the group it was in)."""

    @staticmethod
    def size() -> int:
        return 1


NO_GROUP = _NoGroup()


def with_embedding_group(finalize, group):
    """`finalize` (Megatron's finalize_model_grads, or a wrapper of it) with the
    embedding gradient all-reduce over `group`: the group is passed explicitly in the
    process-group collection the schedule hands it (Megatron's own lookup, when it is
    handed none), never through parallel_state's global."""
    base = getattr(finalize, "dynmo_base", finalize)

    def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        groups = copy.copy(pg_collection)
        groups.embd = group
        return base(model, num_tokens, pg_collection=groups, force_all_reduce=force_all_reduce)

    finalize_model_grads.dynmo_base = base
    return finalize_model_grads
