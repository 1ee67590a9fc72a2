"""Build one pipeline stage of a Megatron-Core GPT, initialised by global parameter name.

Every parameter is drawn from a generator seeded by (seed, its *global* name), where a
decoder layer is named by its global layer number. So any pipeline split — and any
later migration or repack — starts from identical weights, which is what makes runs
of different shapes comparable bit for bit.
"""
from __future__ import annotations

import logging
import os
import re
import zlib
from typing import Iterator, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from dynmo_plugin.config import ModelArgs, resolve_transformer_impl
from dynmo_plugin.megatron.training.machine import transformer_engine_problem
from dynmo_plugin.megatron.training.mtp import global_name, mtp_block_spec
from dynmo_plugin.megatron.training.te_names import bind_missing_te_names
from dynmo_plugin.layout import Layout

__all__ = ["transformer_config", "deterministic_kernels", "params_dtype", "layer_spec", "build_stage_model",
           "mark_tensor_parallel", "global_named_parameters",
           "init_by_global_name", "INIT_STD"]

logger = logging.getLogger(__name__)
INIT_STD = 0.02
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def params_dtype(args: ModelArgs) -> torch.dtype:
    """The dtype of weights and activations: bf16, fp16 (--bf16/--fp16) or fp32."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def deterministic_kernels() -> bool:
    """Whether this process asked for deterministic GPU kernels: the switch Transformer
    Engine reads, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (set it together with
    CUBLAS_WORKSPACE_CONFIG=:4096:8 for cuBLAS). Bit-exact GPU comparisons need it; it
    costs speed (TE's deterministic attention backward, the embedding's indexed backward),
    so it is off by default. Megatron refuses deterministic_mode with TE attention
    unless that variable is 0, so the one variable drives both."""
    return os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1").strip() == "0"


def transformer_config(args: ModelArgs, layout: Layout) -> TransformerConfig:
    """A deterministic TransformerConfig with the given pipeline layout, in fp32 or (with
    --bf16/--fp16) in half precision: weights, activations and pipeline messages. With
    virtual stages, Megatron sets virtual_pipeline_model_parallel_size from the layout.
    Megatron's `deterministic_mode` (deterministic kernels on GPU) follows
    `deterministic_kernels()`."""
    dtype = params_dtype(args)
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_model_parallel_layout=layout.to_megatron(),
        mtp_num_layers=layout.mtp_layers or None,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        deterministic_mode=deterministic_kernels(),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        hidden_dropout=args.hidden_dropout,  # drawn per layer: megatron.training.layer_streams
        attention_dropout=0.0,  # the project's own core attentions have none
        use_cpu_initialization=True,
        perform_initialization=False,  # init_by_global_name does it, identically for any split
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Interleaved on 2 ranks: each rank's previous and next rank are the same one, and a
        # batched exchange would pair the activation and the gradient sent in one call by
        # posting order (measured: swapped on gloo). Megatron's unbatched path sends the two
        # directions on different groups when the pipeline group has 2 ranks.
        batch_p2p_comm=not (layout.num_chunks > 1 and layout.num_ranks == 2),
    )


def layer_spec(impl: Optional[str] = None, attention: str = "unfused") -> ModuleSpec:
    """Megatron's GPT layer spec for `impl` (--transformer-impl: "transformer_engine" or
    "local"), which `load_config` resolved and checked against the machine and scenario;
    None (a stage built without load_config) resolves the same way, with no scenario.
    `attention` (--attention-backend): the local spec's core attention, "unfused"
    (Megatron's DotProductAttention) or "sdpa" (megatron.attention.sdpa)."""
    if impl is None:
        impl, note = resolve_transformer_impl(None, torch.cuda.device_count(), "none",
                                              transformer_engine_problem)
        if note:
            logger.warning("%s", note)
    if impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)
        return get_gpt_layer_with_transformer_engine_spec()
    if impl != "local":
        raise ValueError(f"transformer_impl {impl!r}: expected local or transformer_engine")
    spec = get_gpt_layer_local_spec()
    if attention == "sdpa":
        from dynmo_plugin.megatron.attention.sdpa import sdpa_attention_spec
        spec = sdpa_attention_spec(spec)
    return spec


def build_stage_model(args: ModelArgs, config: TransformerConfig, spec: ModuleSpec,
                      pre_process: bool, post_process: bool, vp_stage: int | None = None) -> GPTModel:
    """The GPTModel shell of the current pipeline stage (layout taken from `config`);
    `vp_stage`: which model chunk of this rank, for an interleaved pipeline."""
    bind_missing_te_names()  # MoE's router reads te_general_gemm, unbound without TE (CUDA too)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
        vp_stage=vp_stage,
        mtp_block_spec=mtp_block_spec(config, spec, args.transformer_impl or "local", vp_stage),
    )
    init_by_global_name(model, args.seed)
    mark_tensor_parallel(model, config)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def mark_tensor_parallel(module: torch.nn.Module, config) -> None:
    """What Megatron gives a tensor-parallel weight only while it initialises it
    (`tensor_model_parallel`, `partition_dim`, `partition_stride`), on the weights of a
    module built with `perform_initialization=False` (the launcher's stages, whose values
    init_by_global_name sets, and the layers a migration builds into them). Without it
    Megatron counts such a weight on TP rank 0 alone (`param_is_not_tensor_parallel_
    duplicate`): the gradient norm that clipping divides by, the params norm and the
    zeros count left out every other rank's shard (review 22c). Marked ones are kept."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding,
                                                      set_tensor_model_parallel_attributes)
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(m, RowParallelLinear):
            dim = 1
        elif isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        else:
            continue
        # Megatron's MLP builds fc1 with stride 2 under a gated linear unit (mlp.py)
        stride = 2 if name.split(".")[-1] == "linear_fc1" and config.gated_linear_unit else 1
        set_tensor_model_parallel_attributes(weight, True, dim, stride)


def global_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter): decoder layers renamed by global layer number (0-based),
    and a tied output weight named after the embedding it mirrors."""
    layer_numbers = [layer.layer_number for layer in model.decoder.layers]
    for name, p in model.named_parameters():
        m = _LOCAL_LAYER.match(name)
        if m:
            name = f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}." + name[m.end():]
        elif name == "output_layer.weight" and getattr(p, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"
        yield global_name(name, model), p


def _init_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and leaf in ("weight", "layer_norm_weight"):
        return torch.ones(shape)
    if leaf.endswith("bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen) * INIT_STD


@torch.no_grad()
def init_by_global_name(model: torch.nn.Module, seed: int) -> None:
    """Norm weights 1, biases 0, other weights N(0, INIT_STD) seeded by global name."""
    for name, p in global_named_parameters(model):
        p.copy_(_init_value(name, p.shape, seed))
