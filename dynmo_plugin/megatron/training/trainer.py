"""One pipeline stage's training machinery: GPTModel + Megatron DDP + optimizer + 1F1B.

Mirrors Megatron-LM's `train_step` (zero grad buffers, forward_backward_func,
optimizer.step, learning-rate scheduler step) on megatron.core APIs alone, since the
PyPI wheel has no megatron.training. The stage's model, DDP wrapper and optimizer are
attributes that a migration may rebuild, in two steps so that a failure can be undone:
`build_ddp` (local) and `build_optimizer` (collective) make the new wrappers without
touching the live ones; `install_wrappers` switches to them and cannot fail.

With --bf16/--fp16 each GPTModel is wrapped in Megatron's Float16Module (half-precision
weights, fp32 logits) and the optimizer keeps fp32 master weights; DDP wraps that
module. `model` stays the GPTModel itself (what layers, profiling and migration use);
`modules` are what the DDPs wrap (per chunk, the GPTModel or its Float16Module). With
--use-distributed-optimizer the optimizer state and master weights are sharded over DP.

Interleaved pipelines (`layout.num_chunks` = v > 1): the rank holds v model chunks
(`chunks`, one GPTModel per virtual stage with its `vp_stage`), a Float16Module around
each in half precision, one DDP each (`ddps`) and ONE Megatron optimizer over all the
DDPs (`get_megatron_optimizer` over the list of chunks, as Megatron-LM builds it: one
mixed-precision or distributed optimizer whose groups and buffers span every chunk);
Megatron's interleaved 1F1B runs them.
"""
from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core import parallel_state
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from dynmo_plugin.config import ConfigError, ModelArgs
from dynmo_plugin.data import SyntheticTokens
from dynmo_plugin.megatron.data.build import build_packed_documents
from dynmo_plugin.layout import Layout
from dynmo_plugin.megatron.training.model import (build_stage_model, layer_spec, params_dtype,
                                         transformer_config)
from dynmo_plugin.megatron.training.p2p import PairedShapeP2P
from dynmo_plugin.megatron.training.parallel import ParallelDims
from dynmo_plugin.megatron.migration.stage_state import restore_model, restore_optimizer
from dynmo_plugin.megatron.attention.varlen import packed_seq_params, varlen_attention_spec

__all__ = ["StageTrainer"]

logger = logging.getLogger(__name__)


def _packed_forward_step(data_iterator, model):
    """A packed micro-batch (data.stream.PackedDocuments): THD, per-document attention."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed_seq_params(batch))
    return output, partial(_packed_loss_func, batch["loss_mask"])


def _batched_forward_step(data_iterator, model):
    """An adaptive micro-batch (AdaptiveLoad): [B, S] rows of one document each, padded;
    B and S differ between micro-batches (the pipeline exchanges shapes)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_packed_loss_func, batch["loss_mask"])


def _packed_loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Mean over the micro-batch's document positions (none: a padding-only row, loss 0)."""
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    loss = (per_token_loss.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place


class StageTrainer:
    """Trains this rank's pipeline stage; every rank of the run holds one.

    The launcher's `dynmo_plugin.stage.StageHandle` (what the controller, migrator,
    profiler, checkpoints, repacks and scenarios use), plus what the launcher alone
    needs: the data stream (`data`) and the step (`train_step`)."""

    def __init__(self, args: ModelArgs, dims: ParallelDims, layout: Layout, spec=None,
                 state=None, configure=None):
        """`state` (a megatron.stage_state.StageState): start from it instead of the
        initial weights — parameters, buffers, frozen flags and optimizer state.
        `configure(transformer_config)`: a scenario's changes to the config, applied
        before the model is built (kept, so a rebuilt stage gets them too)."""
        self.args, self.dims, self.layout = args, dims, layout
        self.config = transformer_config(args, layout)
        self.configure = configure
        if configure is not None:
            configure(self.config)
        self.spec = spec if spec is not None else layer_spec()
        if args.data.packed:
            try:
                self.spec = varlen_attention_spec(self.spec)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        self.num_chunks = v = layout.num_chunks
        if v > 1:  # Megatron's layer-count helpers and schedule read these globals
            parallel_state.set_virtual_pipeline_model_parallel_world_size(v)
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        self.chunks = [build_stage_model(args, self.config, self.spec,
                                         dims.is_first_stage and c == 0,
                                         dims.is_last_stage and c == v - 1,
                                         vp_stage=c if v > 1 else None) for c in range(v)]
        self.model = self.chunks[0]  # the stage's model; interleaved: chunk 0 (see `chunks`)
        if state is not None:  # before DDP: it only wraps trainable params
            for chunk in self.chunks:
                restore_model(chunk, state)
        # Float16Module casts each chunk (norms built in fp32 included): exact for restored
        # half-precision values, and init_by_global_name drew fp32 values then cast them.
        # Its vp_stage (read off the chunk) makes it cast inputs on the first virtual stage
        # only and outputs on the last only.
        self.modules = [Float16Module(self.config, c) if args.bf16 or args.fp16 else c
                        for c in self.chunks]
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer)
        self.optimizer_config = OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, clip_grad=args.clip_grad,
            weight_decay=args.weight_decay,
            bf16=args.bf16, fp16=args.fp16, params_dtype=params_dtype(args),
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            use_distributed_optimizer=args.use_distributed_optimizer)
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * dims.dp)
        self.peak_microbatches = self.num_microbatches  # the launcher's batch never ramps
        self.data, self._forward_step = self._build_data(args, dims)
        self.ddp = [self.build_ddp(c) for c in range(v)] if v > 1 else self.build_ddp()
        self.optimizer = self.build_optimizer(self.ddp)
        if state is not None:
            for chunk in self.chunks:
                restore_optimizer(chunk, self.optimizer, state)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
            min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=args.lr_decay_iters or args.train_iters,
            lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
            end_wd=args.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")
        self.install_wrappers(self.ddp, self.optimizer)
        # the last step's learning rate and gradient norm (None: not computed), for the log
        self.last_step: dict = {"lr": args.lr, "grad_norm": None, "skipped": False}

    def _build_data(self, args: ModelArgs, dims: ParallelDims):
        """(the data stream, the schedule's forward-step function): the synthetic token
        stream, or packed documents (args.data) with per-document attention."""
        if args.data.packed:
            data = build_packed_documents(args.data, args.seed, args.vocab_size, args.seq_length,
                                          dims.dp, self.num_microbatches)
            if data.adaptive:
                self.config.variable_seq_lengths = True  # micro-batch shapes differ
                return data, _batched_forward_step
            return data, _packed_forward_step
        return SyntheticTokens(seed=args.seed, vocab_size=args.vocab_size,
                               seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                               micro_batch_size=args.micro_batch_size), _forward_step

    def build_ddp(self, chunk: int = 0) -> DistributedDataParallel:
        """A Megatron DDP wrapper over the stage model (interleaved: model chunk `chunk`)
        as it is now (local, may raise).

        It allocates new gradient buffers and re-points every trainable parameter's
        `main_grad` at them (with the distributed optimizer also `param.data`, into a new
        parameter buffer); the caller restores the old views if it abandons it.
        """
        module = self.modules[chunk]
        if self.ddp_config.use_distributed_optimizer:
            for p in module.parameters():  # Megatron asserts a param owns its storage
                if p.data._base is not None:
                    p.data = p.data.clone()
        return DistributedDataParallel(self.config, self.ddp_config, module)

    def build_optimizer(self, ddp):
        """A fresh Megatron optimizer over `ddp` (interleaved: the list of the chunks'
        DDPs) (collective: it gathers param-group keys over the world, so every rank
        must call it)."""
        return get_megatron_optimizer(self.optimizer_config, ddp if isinstance(ddp, list) else [ddp])

    @property
    def ddps(self) -> list:
        """The DDP of every model chunk (one when not interleaved)."""
        return self.ddp if isinstance(self.ddp, list) else [self.ddp]

    @property
    def layers(self) -> list:
        """This rank's decoder layers over ALL its model chunks, in layer order (chunk 0's,
        then chunk 1's, ...): what a dynamism scenario walks (`model` is chunk 0 alone when
        interleaved). Read it afresh after a migration: chunks' layer lists are replaced."""
        return [layer for chunk in self.chunks for layer in chunk.decoder.layers]

    def install_wrappers(self, ddp, optimizer) -> None:
        """Switch training to `ddp` (interleaved: a list, one per chunk) and `optimizer`
        (reference updates only: cannot fail)."""
        self.ddp, self.optimizer = ddp, optimizer
        self.scheduler.optimizer = optimizer
        self.config.no_sync_func = [d.no_sync for d in ddp] if isinstance(ddp, list) else ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = optimizer.scale_loss

    def train_step(self, iteration: int) -> float:
        """One global batch: 1F1B over this stage, all-reduce, optimizer step.

        Returns the iteration's mean loss, known on every rank.
        """
        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Built up front so data generation stays outside the schedule's compute timers.
        batches = list(self.data.micro_batches(iteration, self.dims.dp_rank, self.dims.dp,
                                               self.dims.device))
        if self.num_chunks > 1:  # each chunk reads every micro-batch once, in order;
            # PairedShapeP2P: Megatron's shape exchange mispairs at pp = 2 (megatron/training/p2p.py)
            data, schedule = [iter(batches) for _ in self.ddps], partial(
                get_forward_backward_func(self.dims.pp, self.num_chunks),
                p2p_communicator=PairedShapeP2P(self.dims.groups.pp, self.config),
                pg_collection=self.dims.groups)
        else:
            data, schedule = iter(batches), get_forward_backward_func()
        losses = schedule(
            forward_step_func=self._forward_step, data_iterator=data, model=self.ddps,
            num_microbatches=self.num_microbatches, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
        ok, grad_norm, _ = self.optimizer.step()
        measured = grad_norm is not None and self.args.clip_grad > 0  # Megatron computes it only to clip
        self.last_step = {"lr": lr, "grad_norm": float(grad_norm) if measured else None,
                          "skipped": not ok}
        if ok:
            self.scheduler.step(increment=1)
        else:
            logger.warning("iteration %d: optimizer step skipped", iteration)
        return self._global_loss(losses)

    def _global_loss(self, losses: list[dict]) -> float:
        """Mean over micro-batches on the last stage, averaged over DP, sent to every rank."""
        value = torch.zeros(1, dtype=torch.float64, device=self.dims.device)
        if self.dims.is_last_stage and losses:
            value += torch.stack([d["lm loss"].double() for d in losses]).mean() / self.dims.dp
        dist.all_reduce(value)
        return float(value) / self.dims.tp
