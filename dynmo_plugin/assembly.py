"""The parts of one rank's run around its stage, wired in one place.

The launcher's `session.TrainingSession` and the Megatron-LM integration
(`integrations.megatron_lm`) each own a stage (`stage.StageHandle`) and need the same
parts around it, in the same order: the control plane, the layer migrator, the report,
the controller, the scenario attached to the stage, the layout listeners. `assemble`
builds them; what differs between the two (the report's path, config and sink, a
checkpoint to load, the repack, test-only fakes) comes in as arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.report import RunReport
from dynmo_plugin.stage import StageDims, StageHandle

if TYPE_CHECKING:  # the heavy parts are imported when assembled, not with this module
    from dynmo_plugin.consensus import ControlPlane
    from dynmo_plugin.controller import DynMo
    from dynmo_plugin.scenarios import Scenario
    from dynmo_plugin.megatron.migration.migrate import LayerMigrator
    from dynmo_plugin.releases import Releases

__all__ = ["RunParts", "assemble", "world_record"]


@dataclass
class RunParts:
    """What `assemble` built around a stage; its owner keeps them (and swaps `control`
    and `migrator` when a repack rebuilds the stage)."""

    control: ControlPlane
    migrator: LayerMigrator
    report: RunReport
    dynmo: DynMo
    scenario: Optional[Scenario]
    releases: Optional[Releases]  # the leader's cluster releases (rank 0 only), if asked


def world_record(dims: StageDims, iteration: int) -> dict:
    """The report's `world`: the grid now, and the first line of its history (the
    iteration the run starts from; repacks append theirs)."""
    shape = {"pp": dims.pp, "tp": dims.tp, "dp": dims.dp, "world_size": dims.world_size}
    return {**shape, "backend": dims.backend, "history": [{"iteration": iteration, **shape}]}


def layer_streams(config: DynmoConfig, stage: StageHandle):
    """Each layer's own random streams (megatron.training.layer_streams), where the model
    draws any in its layers (dropout, MoE input jitter) and `rank_rng` keeps Megatron's
    per-rank draws off; else None: nothing to hook."""
    from dynmo_plugin.megatron.training.layer_streams import LayerStreams, model_draws
    if config.rank_rng or not model_draws(stage.config):
        return None
    return LayerStreams(stage, stage.args.seed)


def assemble(config: DynmoConfig, stage: StageHandle, new_report: Callable[..., RunReport], *,
             iteration: int, scenario: Optional[Scenario] = None, repacker=None,
             layout_listeners: Iterable[Callable[[], None]] = (), on_control=None,
             releases: bool = False, fault=None, profile_noise=None) -> RunParts:
    """The parts around `stage`, in the order they depend on each other.

    `new_report(world=, initial_layout=, enabled=)` makes the report (the caller binds
    its path, config and any sink); `iteration`: the last one done (0, or a resumed
    checkpoint's); `scenario`: built, not yet attached (attached here, after the
    controller, and told of every layout change after `layout_listeners`);
    `repacker(layout, iteration, info)`: handed to the controller when the config turns
    repacking on; `on_control(control)`: runs as soon as the control plane exists, before
    anything else uses the stage (the launcher loads its checkpoint there); `releases`:
    rank 0 hands released replicas back to the cluster; `fault`, `profile_noise`:
    test-only fakes (dynmo_plugin.faults).
    """
    from dynmo_plugin.consensus import ControlPlane
    from dynmo_plugin.controller import DynMo
    from dynmo_plugin.scenarios import Runtime
    from dynmo_plugin.megatron.migration.migrate import LayerMigrator
    from dynmo_plugin.releases import Releases

    timeout, dims = config.rebalance.migration_timeout_s, stage.dims
    control = ControlPlane(timeout)
    if on_control is not None:
        on_control(control)
    migrator = LayerMigrator(stage, control, timeout, fault)
    report = new_report(world=world_record(dims, iteration), initial_layout=str(stage.layout),
                        enabled=dims.rank == 0)
    leader_releases = Releases(config.cluster, timeout) if releases and dims.rank == 0 else None
    repack_on = config.enabled and config.repack.enabled
    dynmo = DynMo(config, stage, control, migrator, report, profile_noise=profile_noise,
                  streams=layer_streams(config, stage),
                  repacker=repacker if repack_on else None)
    for listener in layout_listeners:
        dynmo.add_layout_listener(listener)
    if scenario is not None:
        scenario.attach(Runtime(stage, control, migrator))
        dynmo.add_layout_listener(scenario.after_layout_change)
    return RunParts(control, migrator, report, dynmo, scenario, leader_releases)
