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

from typing import Callable, Optional

from dynmo_plugin.layout import Layout

__all__ = ["embedding_ranks_for", "mtp_block_spec", "global_name", "MTP_POSITION_NAME",
           "mtp_rank_of"]

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
