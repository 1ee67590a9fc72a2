"""The MTP block as a migration unit: what moves with it and how a stage's shell changes.

The block's rank holds more than its layers (docs/mtp.md): Megatron gives the MTP stage
an embedding module whose word weights are a copy of the first stage's (kept equal by
the embedding group's gradient all-reduce) and, with learned positions, its own
position table (`mtp.position_embeddings.weight`). A live move therefore carries one
unit: `mtp.*` and `embedding.*` of the old MTP rank (weights, gradients, optimizer
state), sent under the pseudo layer number `MTP_UNIT`. The copy of the word weights
and its optimizer state are the first stage's bit for bit (one all-reduced gradient,
one Adam update), so the new MTP rank continues exactly where the old one was.

The shells change in place (`install` / `remove`): the receiving GPTModel gets the
block and the embedding module and `mtp_process = True` (what its forward reads), the
sending one loses both. Rebuilding the GPTModel instead would run its constructor's
collective (the embedding all-reduce of `setup_embeddings_and_output_layer`) on two
ranks only. The first rank never holds the block (Megatron's rule), so its embedding
never moves. With tied embeddings the last rank's output weight is its embedding copy
while it holds the block; when the block leaves, its output weight takes over the
copy's values and state (`adopted`); equal up to rounding, not bit for bit: the
embedding all-reduce then adds one more copy's gradient (docs/mtp.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynmo_plugin.layout import Layout
from dynmo_plugin.megatron.training.model import mark_tensor_parallel
from dynmo_plugin.megatron.training.scratch import rng_streams_kept

__all__ = ["MTP_UNIT", "FINAL_NORM", "UNIT_NAMES", "moves_refused", "unit_moves", "container",
           "build", "install", "remove", "Shell", "adopted"]

# pseudo layer numbers the units travel under (layers are 1-based, a repack's head 0)
MTP_UNIT, FINAL_NORM = -1, -2
UNIT_NAMES = {MTP_UNIT: "mtp", FINAL_NORM: "final_layernorm"}


def _last_layer_stage(layout: Layout) -> int:
    return layout.assignment()[-1]


def moves_refused(trainer, old: Layout, new: Layout) -> Optional[str]:
    """Why this stage cannot move the block live from `old` to `new` (None: it can).
    The same on every rank (it reads the layouts and the run's flags only)."""
    if old.mtp_layers != new.mtp_layers:
        return f"{old} -> {new} changes the number of MTP layers"
    if old.has_mtp and old.num_chunks > 1 and _last_layer_stage(old) != _last_layer_stage(new):
        return (f"{old} -> {new} moves the last decoder layer to another virtual stage; with "
                "MTP Megatron puts the final norm beside it, and interleaved moves carry "
                "decoder layers only")
    if not old.mtp_moved(new):
        return None
    if old.num_chunks > 1:
        return (f"{old} -> {new} moves the MTP block to another rank with virtual pipeline "
                "stages; live MTP moves need one chunk per rank")
    if not getattr(trainer, "mtp_moves_live", True):
        return (f"{old} -> {new} moves the MTP block to another rank, which this stage handle "
                "cannot feed there (Megatron-LM: its data provider left some rank without batches)")
    return None


def unit_moves(old: Layout, new: Layout) -> list[tuple[int, int, int]]:
    """(unit, source rank, destination rank) of the units that change rank, one chunk per
    rank: the MTP block, and the decoder's final norm, which Megatron puts with the last
    decoder layer when the model has MTP (`TransformerBlock.has_final_layernorm_in_this_stage`)."""
    if not old.has_mtp or old.num_chunks > 1:
        return []
    out = []
    if old.mtp_moved(new):
        out.append((MTP_UNIT, old.mtp_rank, new.mtp_rank))
    src, dst = old.rank_of(_last_layer_stage(old)), new.rank_of(_last_layer_stage(new))
    if src != dst:
        out.append((FINAL_NORM, src, dst))
    return out


def container(unit: int, chunk) -> torch.nn.ModuleDict:
    """The unit on `chunk`, as one module whose parameter names are unique within the
    unit ("mtp.…", "embedding.…"; "final_layernorm.…")."""
    if unit == MTP_UNIT:
        return torch.nn.ModuleDict({"mtp": chunk.mtp, "embedding": chunk.embedding})
    return torch.nn.ModuleDict({"final_layernorm": chunk.decoder.final_layernorm})


def build(unit: int, trainer, chunk, tensors: dict) -> torch.nn.ModuleDict:
    """A new `unit` for `chunk` (on its new rank; the config already holds the new
    layout), loaded from the received tensors. Nothing live is touched."""
    from dynmo_plugin.megatron.migration.extra_state import loadable_state

    built = _build_mtp(trainer, chunk) if unit == MTP_UNIT else _build_norm(trainer, chunk)
    mark_tensor_parallel(built, trainer.config)  # where it was built uninitialised (the launcher)
    built.to(trainer.dims.device)
    if trainer.config.bf16 or trainer.config.fp16:  # as Float16Module cast the stage's own
        built.to(trainer.config.params_dtype)
    missing, unexpected = built.load_state_dict(loadable_state(tensors), strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):
        raise RuntimeError(f"{UNIT_NAMES[unit]}: state mismatch (missing {missing}, "
                           f"unexpected {unexpected})")
    if unit == MTP_UNIT:
        weight = built["embedding"].word_embeddings.weight
        weight.shared = weight.shared_embedding = True  # as setup_embeddings_and_output_layer
    return built


def _build_norm(trainer, chunk) -> torch.nn.ModuleDict:
    from megatron.core.transformer.spec_utils import build_module

    config = trainer.config
    with rng_streams_kept():
        norm = build_module(_norm_spec(trainer, chunk), config=config,
                            hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
    return torch.nn.ModuleDict({"final_layernorm": norm})


def _norm_spec(trainer, chunk):
    """The decoder's final-norm module: its block spec's, or where the stage was built
    without decoder layers (Megatron-LM's block spec then names none) the backend's, as
    Megatron's GPT block specs pick it (TENorm, else LNImpl)."""
    spec = chunk.decoder.submodules.layer_norm
    if spec is not None:
        return spec
    rms = trainer.config.normalization == "RMSNorm"
    if _impl(trainer) == "transformer_engine":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        return TESpecProvider().layer_norm(rms_norm=rms)
    from megatron.core.models.backends import LocalSpecProvider
    return LocalSpecProvider().layer_norm(rms_norm=rms)


def _impl(trainer) -> str:
    """--transformer-impl of the run (the launcher's args and Megatron-LM's both name it)."""
    return getattr(getattr(trainer, "args", None), "transformer_impl", None) or "local"


def _build_mtp(trainer, chunk) -> torch.nn.ModuleDict:
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

    from dynmo_plugin.megatron.training.mtp import mtp_block_spec

    config = trainer.config
    spec = mtp_block_spec(config, trainer.spec, _impl(trainer), chunk.vp_stage)
    if spec is None:
        raise RuntimeError("the new layout puts no MTP block on this rank")
    with rng_streams_kept():
        unit = torch.nn.ModuleDict({
            "mtp": MultiTokenPredictionBlock(config=config, spec=spec, vp_stage=chunk.vp_stage),
            "embedding": LanguageModelEmbedding(
                config=config, vocab_size=chunk.vocab_size,
                max_sequence_length=chunk.max_sequence_length,
                position_embedding_type=chunk.position_embedding_type,
                tp_group=chunk.pg_collection.tp)})
    unit.spec = spec
    return unit


@dataclass
class Shell:
    """What `install` / `remove` changed on a GPTModel, to undo it."""

    chunk: object
    mtp: object
    embedding: object
    mtp_process: bool
    mtp_block_spec: object
    final_layernorm: object
    output_marks: dict  # the tied output weight's `shared` / `shared_embedding` marks

    @classmethod
    def of(cls, chunk) -> "Shell":
        weight = _tied_output(chunk)
        marks = {} if weight is None else {k: getattr(weight, k, None) for k in _MARKS}
        return cls(chunk, getattr(chunk, "mtp", None), getattr(chunk, "embedding", None),
                   chunk.mtp_process, chunk.mtp_block_spec, chunk.decoder.final_layernorm, marks)

    def restore(self) -> None:
        c = self.chunk
        for name, module in (("mtp", self.mtp), ("embedding", self.embedding)):
            if module is None:
                if hasattr(c, name):
                    delattr(c, name)
            else:
                setattr(c, name, module)
        c.mtp_process, c.mtp_block_spec = self.mtp_process, self.mtp_block_spec
        c.decoder.final_layernorm = self.final_layernorm
        weight = _tied_output(c)
        for key, value in self.output_marks.items():
            if value is None:
                weight.__dict__.pop(key, None)
            else:
                setattr(weight, key, value)


_MARKS = ("shared", "shared_embedding")


def _tied_output(chunk) -> Optional[torch.nn.Parameter]:
    """The last stage's output weight with tied embeddings (None elsewhere). While the
    block is on the last rank the forward uses the embedding copy as the output weight
    (GPTModel.shared_embedding_or_output_weight) and this one is unused; otherwise it is
    the output weight, marked as the shared copy."""
    if chunk.post_process and chunk.share_embeddings_and_output_weights and not chunk.pre_process:
        return chunk.output_layer.weight
    return None


def adopted(unit: int, chunk):
    """(output weight, embedding copy) where the block leaves the last rank with tied
    embeddings: the output weight takes over the copy's values, gradient and optimizer
    state (the caller moves them), else None."""
    weight = _tied_output(chunk) if unit == MTP_UNIT else None
    return None if weight is None else (weight, chunk.embedding.word_embeddings.weight)


def install(unit: int, chunk, built: torch.nn.ModuleDict) -> Shell:
    """Give `chunk` (a GPTModel) the unit. The MTP block: its forward then runs it
    (`mtp_process`) with the unit's embedding; the final norm: its decoder applies it."""
    shell = Shell.of(chunk)
    if unit == MTP_UNIT:
        chunk.mtp, chunk.embedding = built["mtp"], built["embedding"]
        chunk.mtp_process, chunk.mtp_block_spec = True, built.spec
        weight = _tied_output(chunk)  # the embedding copy is the output weight now
        if weight is not None:
            weight.shared = weight.shared_embedding = False
    else:
        chunk.decoder.final_layernorm = built["final_layernorm"]
    return shell


def remove(unit: int, chunk) -> Shell:
    """Take the unit off `chunk` (the MTP block: never on the first stage, whose
    embedding stays)."""
    shell = Shell.of(chunk)
    if unit == FINAL_NORM:
        chunk.decoder.final_layernorm = None
        return shell
    if chunk.pre_process:
        raise RuntimeError("the first stage never holds the MTP block")
    delattr(chunk, "mtp")
    delattr(chunk, "embedding")
    chunk.mtp_process, chunk.mtp_block_spec = False, None
    weight = _tied_output(chunk)  # the output weight is the shared copy again
    if weight is not None:
        weight.shared = weight.shared_embedding = True
    return shell
