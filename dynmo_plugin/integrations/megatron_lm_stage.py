"""The stage handle over Megatron-LM's model: `MegatronLMStage`, what the controller,
migrator, profiler and scenarios drive inside Megatron-LM's train() (the launcher's is
`StageTrainer`), and the layout it reads from the layers Megatron-LM built.
"""
from __future__ import annotations

from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
from dynmo_plugin.layout import Layout

__all__ = ["MegatronLMStage"]

# what Megatron-LM's save_checkpoint caches in train()'s checkpointing context from one
# save to the next: the save strategy (its plans), the local checkpoints' metadata and the
# load strategy, whose read metadata a new save strategy reuses
_CACHED_SAVE_PLANS = ("save_strategy", "local_checkpoint_cache", "load_strategy")


class MegatronLMStage:
    """The `dynmo_plugin.stage.StageHandle` under Megatron-LM (the launcher's is
    StageTrainer): what the controller, migrator, profiler and scenarios drive, built over
    the objects Megatron-LM's train() holds: `model_list` (train()'s list
    of DDP model chunks, updated in place; more than one with virtual pipeline stages),
    `optimizer` (a ChainedOptimizer over all chunks, kept as the same object), `scheduler`
    and the model's TransformerConfig. With --use-distributed-optimizer
    the ChainedOptimizer chains DistributedOptimizers: the migrator finds them through
    `optimizer` and moves their sharded state with optim_state, as in the launcher.
    The MTP block moves live (`mtp_moves_live`) once every rank has batches
    (megatron_lm_data: pretrain_gpt.py builds them on the first, last and MTP ranks only,
    unless the plugin builds them everywhere); until then it stays on its rank.
    `checkpointing_context`: train()'s (set when it starts), whose cached save plans
    `install_wrappers` drops."""

    def __init__(self, chunks: list, optimizer, scheduler, args):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import ChainedOptimizer
        from megatron.core.utils import get_model_config
        from megatron.training.utils import unwrap_model

        if not chunks or not all(isinstance(c, DistributedDataParallel) for c in chunks):
            raise MegatronLMError(f"--dynmo needs Megatron DDP model chunks; got "
                                  f"{[type(c).__name__ for c in chunks]} (FSDP is not supported)")
        if not isinstance(optimizer, ChainedOptimizer):
            raise MegatronLMError(f"--dynmo needs Megatron's ChainedOptimizer, got {type(optimizer).__name__}")
        self.model_list, self._optimizer, self.scheduler, self.args = chunks, optimizer, scheduler, args
        self.mtp_moves_live = False  # set when the data iterators are built (_Run.data_built)
        self.checkpointing_context: dict | None = None
        self.chunks = [unwrap_model(c) for c in chunks]  # the GPTModels: a migration keeps them
        bad = [type(m).__name__ for m in self.chunks if not isinstance(m, GPTModel)]
        if bad:
            raise MegatronLMError(f"--dynmo supports GPTModel, got {', '.join(bad)}")
        self.model = self.chunks[0]
        self.num_chunks = len(chunks)
        self.config = get_model_config(chunks[0])
        self.spec = _layer_spec(self.chunks)
        from dynmo_plugin.megatron.training.parallel import current_dims
        self.dims = current_dims()
        self.layout = _current_layout(self.chunks, self.dims)

    @property
    def layers(self) -> list:
        """This rank's decoder layers over all its model chunks, in layer order (what a
        scenario walks; read afresh after a migration)."""
        return [layer for chunk in self.chunks for layer in chunk.decoder.layers]

    @property
    def ddp(self):
        """The DDP of chunk 0 (of the only chunk without virtual pipeline stages)."""
        return self.model_list[0]

    @property
    def ddps(self) -> list:
        """The DDP of every model chunk, chunk 0 first."""
        return list(self.model_list)

    @property
    def module(self):
        """What chunk 0's DDP wraps: the GPTModel, or its Float16Module with --bf16/--fp16."""
        return self.ddp.module

    @property
    def ddp_config(self):
        return self.ddp.ddp_config

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def num_microbatches(self) -> int:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        return get_num_microbatches()

    @property
    def peak_microbatches(self) -> int:
        """The count at the whole --global-batch-size (a --rampup-batch-size run reaches
        it at the ramp's end), or the current one where that is more."""
        whole = self.args.global_batch_size // (self.args.micro_batch_size * self.args.data_parallel_size)
        return max(whole, self.num_microbatches)

    def build_ddp(self, chunk: int = 0):
        """A Megatron DDP over model chunk `chunk`'s module as it is now, configured as
        Megatron-LM's get_model configured the live one (no bucketing past chunk 0;
        local; the live one is untouched)."""
        from megatron.core.distributed import DistributedDataParallel
        return DistributedDataParallel(
            config=self.config, ddp_config=self.ddp_config, module=self.model_list[chunk].module,
            disable_bucketing=chunk > 0 or bool(getattr(
                self.args, "overlap_param_gather_with_optimizer_step", False)))

    def build_optimizer(self, ddp):
        """A fresh optimizer over `ddp` (with virtual pipeline stages: the list of every
        chunk's DDP), made as Megatron-LM's setup_model_and_optimizer makes it (collective)."""
        from megatron.core.optimizer import ChainedOptimizer
        from megatron.training import get_timers
        import megatron.training.training as mtt
        config, overrides = mtt.get_megatron_optimizer_config(self.args)
        config.timers = get_timers()
        optimizer = mtt.get_megatron_optimizer(
            config, ddp if isinstance(ddp, list) else [ddp], config_overrides=overrides,
            use_gloo_process_groups=self.args.enable_gloo_process_groups)
        if not isinstance(optimizer, ChainedOptimizer):
            raise MegatronLMError(f"get_megatron_optimizer returned {type(optimizer).__name__}, "
                                  "not a ChainedOptimizer")
        return optimizer

    def install_wrappers(self, ddp, optimizer) -> None:
        """Switch train() to `ddp` (a list with virtual pipeline stages) and `optimizer`
        without changing what it holds: the same list gets the new chunks, the same
        ChainedOptimizer object takes the new
        inner optimizers (re-initialised in place, as its constructor builds it), so the
        scheduler and config.grad_scale_func (bound to it) stay valid. The DDP-bound sync
        functions train() set are re-pointed. The save plans Megatron-LM cached in train()'s
        checkpointing context name the old model's and optimizer's shards (moved layers,
        pruned shapes, a frozen layer's absent optimizer state; with --ckpt-assume-constant-
        structure they are reused unchecked): dropped, so the next save plans anew.
        Reference updates only: cannot fail."""
        from megatron.core.optimizer import ChainedOptimizer
        ddps = ddp if isinstance(ddp, list) else [ddp]
        self.model_list[:] = ddps
        if optimizer is not self._optimizer:
            ChainedOptimizer.__init__(self._optimizer, list(optimizer.chained_optimizers))
        cfg = self.config  # train() binds these to the chunks only with --overlap-grad-reduce
        if cfg.no_sync_func is not None:
            cfg.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
        if cfg.grad_sync_func is not None:
            cfg.grad_sync_func = ([d.start_grad_sync for d in ddps] if len(ddps) > 1
                                  else ddps[0].start_grad_sync)
        for key in _CACHED_SAVE_PLANS:
            (self.checkpointing_context or {}).pop(key, None)


def _layer_spec(models: list):
    """The TransformerLayer spec arriving layers are built from: the decoders', which must
    be one spec for all their layers (heterogeneous blocks cannot be migrated)."""
    specs = [s for m in models for s in m.decoder.submodules.layer_specs]
    if any(s != specs[0] for s in specs[1:]):
        raise MegatronLMError("--dynmo needs one TransformerLayer spec for every decoder layer "
                              "(this model mixes layer kinds); run without --dynmo")
    return specs[0] if specs else None


def _current_layout(models: list, dims) -> Layout:
    """The split Megatron-LM built, read from the layers each (virtual) stage holds (it
    may come from a layout string, a uniform split or first/last-stage counts); virtual
    stage s is chunk s // pp of rank s % pp, as in Megatron."""
    import torch.distributed as dist
    numbers = [[layer.layer_number for layer in m.decoder.layers] for m in models]
    mtp = [len(m.mtp.layers) if getattr(m, "mtp_process", False) else 0 for m in models]
    held: list = [None] * dims.pp
    dist.all_gather_object(held, (numbers, mtp), group=dims.groups.pp)
    v = len(models)
    stages = [held[s % dims.pp][0][s // dims.pp] for s in range(dims.pp * v)]
    blocks = [held[s % dims.pp][1][s // dims.pp] for s in range(dims.pp * v)]
    k = max(blocks)
    layout = Layout(tuple(len(n) for n in stages), v, k, blocks.index(k) if k else None)
    if [n for stage in stages for n in stage] != list(range(1, layout.num_layers + 1)):
        raise MegatronLMError(f"decoder layers per (virtual) stage {stages} are not one "
                              "contiguous split")
    return layout
