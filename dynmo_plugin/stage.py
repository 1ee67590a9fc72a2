"""The stage contract: what the plugin uses on one rank's pipeline stage.

Two classes own a stage: the launcher's `megatron.trainer.StageTrainer` (it builds the
model, DDP, optimizer and steps them itself) and the Megatron-LM integration's
`integrations.megatron_lm.MegatronLMStage` (a handle over what Megatron-LM's own
`train()` holds). The controller, the migrator, the profiler, checkpoints, repacks and
the dynamism scenarios take either one and use only the members of `StageHandle`, so
both implement exactly that (tests/megatron/test_stage_contract.py checks member by member).

What is NOT in the contract: the data stream (`data`) and the training step
(`train_step`). The launcher owns both; under Megatron-LM its `train()` does, so code
that needs them (the launcher's session, data-cost calibration, early exit) runs in the
launcher only.

Ground floor: nothing here imports torch or Megatron. Their types appear under the
names below (aliases of `Any`), which say what each member holds.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Union, runtime_checkable

from dynmo_plugin.layout import Layout

__all__ = ["StageHandle", "StageDims", "ModelFlags", "STAGE_MEMBERS"]

Module = Any           # torch.nn.Module: a GPTModel (one model chunk) or a TransformerLayer
DDP = Any              # megatron.core.distributed.DistributedDataParallel over one chunk
Optimizer = Any        # megatron.core.optimizer.MegatronOptimizer over every chunk's DDP
Scheduler = Any        # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
TransformerConfig = Any  # megatron.core.transformer.TransformerConfig (model-wide, shared)
ModuleSpec = Any       # megatron.core.transformer.spec_utils.ModuleSpec of one decoder layer
Device = Any           # torch.device
Groups = Any           # megatron.core.process_groups_config.ProcessGroupCollection


@runtime_checkable
class StageDims(Protocol):
    """This rank's place in the TP x PP x DP grid and its process groups
    (`megatron.parallel.ParallelDims` is the one implementation)."""

    rank: int  # names this process in the report, the phase ledger and retirements
    world_size: int  # what a repack shrinks (or keeps, growing data parallelism)
    tp: int  # the replicas a profile is reduced over (max), with dp
    pp: int  # the stages a layout spreads the layers over
    dp: int
    pp_rank: int  # which stage of the layout this rank runs
    dp_rank: int
    device: Device  # where received layers and staging buffers are allocated
    groups: Groups  # what profiling gathers over and migration sends over

    @property
    def is_first_stage(self) -> bool: ...

    @property
    def is_last_stage(self) -> bool: ...

    @property
    def backend(self) -> str: ...


@runtime_checkable
class ModelFlags(Protocol):
    """The model settings shared code reads off a stage, in Megatron-LM's spellings: the
    launcher's `config.ModelArgs` and Megatron-LM's parsed args both carry them."""

    seq_length: int
    micro_batch_size: int
    hidden_size: int
    seed: int
    bf16: bool
    fp16: bool
    use_distributed_optimizer: bool
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]


@runtime_checkable
class StageHandle(Protocol):
    """One rank's pipeline stage as the plugin drives it.

    The model, its DDP wrappers and its optimizer can be rebuilt under a live run (a
    migration, a checkpoint load, a frozen layer): members are read afresh on every use,
    never cached by the caller. Rebuilding goes in two steps so that a failure can be
    undone: `build_ddp` and `build_optimizer` make new wrappers beside the live ones,
    `install_wrappers` switches to them and cannot fail.
    """

    @property
    def dims(self) -> StageDims:
        """Its rank, grid and process groups: every collective of the plugin takes its
        group from here (pipeline transfers, DP-sharded optimizer state, profiles), and a
        repack's rebuilt stage carries the new world's."""

    @property
    def layout(self) -> Layout:
        """The pipeline split the stage holds now: what the controller plans from, the
        profiler maps chunks to virtual stages with and a checkpoint records. The
        migrator sets it when a migration commits (hence writable)."""

    @layout.setter
    def layout(self, value: Layout) -> None: ...

    @property
    def args(self) -> ModelFlags:
        """The run's model flags: the hidden state a stage sends (the repack's iteration
        model), sequence and batch sizes (scenarios' cost models, scratch layers), the
        seed of calibration layers, the precision (checkpoint keys), the recompute chunk
        every stage's layer count keeps to (`config.checks.recompute_block`)."""

    @property
    def config(self) -> TransformerConfig:
        """The model-wide TransformerConfig: arriving layers are built from it, the
        migrator sets its pipeline layout, the profiler taps its `timers`, scenarios read
        sizes and switch schedule options (`variable_seq_lengths`) on it."""

    @property
    def spec(self) -> Optional[ModuleSpec]:
        """The decoder layer's spec: what the migrator builds an arriving layer from and
        scenarios build their scratch calibration layers from."""

    @property
    def chunks(self) -> list[Module]:
        """This rank's GPTModel per model chunk (one without virtual stages), chunk 0
        first: the migrator swaps their `decoder.layers`, the profiler probes each,
        checkpoints save and load each."""

    @property
    def model(self) -> Module:
        """Chunk 0's GPTModel: its decoder's process groups and virtual-stage number,
        which scratch layers built outside the model need."""

    @property
    def layers(self) -> list[Module]:
        """This rank's decoder layers over all chunks, in layer order: what a scenario
        walks. Replaced by a migration, so read afresh after one."""

    @property
    def ddps(self) -> list[DDP]:
        """The DDP wrapper of every chunk, chunk 0 first: the migrator detaches their
        gradient hooks and retires them, a checkpoint load rebuilds them, freezing
        re-hooks them."""

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer over every chunk: the migrator and a repack carry its state to
        the rebuilt one, checkpoints save it, pruning masks its moments, the profiler
        counts its bytes."""

    @property
    def scheduler(self) -> Scheduler:
        """The learning-rate scheduler: checkpoints and repacks carry its step count."""

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration on this DP rank: the planner's and the profiler's
        memory model (in-flight activations), the interleaved-schedule check of a repack,
        scenarios' per-micro-batch loss scaling."""

    @property
    def peak_microbatches(self) -> int:
        """The most micro-batches an iteration of this run will run on this DP rank:
        more than `num_microbatches` while Megatron-LM's --rampup-batch-size grows the
        batch. The planner checks memory at this count, so a plan chosen during the ramp
        still fits once the batch is whole."""

    def build_ddp(self, chunk: int = 0) -> DDP:
        """A new DDP wrapper over model chunk `chunk` as its layers are now, beside the
        live one (local; may raise; the caller retires it if it abandons it)."""

    def build_optimizer(self, ddp: Union[DDP, list[DDP]]) -> Optimizer:
        """A new optimizer over `ddp` (a list, one per chunk, with virtual stages),
        beside the live one. Collective: every rank calls it."""

    def install_wrappers(self, ddp: Union[DDP, list[DDP]], optimizer: Optimizer) -> None:
        """Switch training to `ddp` and `optimizer`: reference updates only, so it cannot
        fail (the commit step of a migration or a checkpoint load)."""


def _members(protocol: type) -> tuple[str, ...]:
    """The public members a protocol class defines itself, in definition order."""
    return tuple(n for n in vars(protocol) if not n.startswith("_"))


STAGE_MEMBERS = _members(StageHandle)
"""Every member of the stage contract, by name."""
