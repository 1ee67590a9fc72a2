"""One rank's training run: the stage, the control plane, the controller, the scenario.

`TrainingSession` glues them in the order dynmo_plugin.scenarios.base describes, and
owns what outlives any one of them: the report, checkpoints (`--save`/`--load`, any
pipeline split) and repacks, after which it switches every part to the stage rebuilt
in the smaller world (`rebind`).
"""
from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import Optional

from dynmo_plugin.config import ConfigError, RunConfig
from dynmo_plugin.layout import Layout

__all__ = ["TrainingSession", "StopTraining"]

logger = logging.getLogger("dynmo_plugin.train")


class StopTraining(Exception):
    """Every rank ends the run after this iteration (a checkpoint repack: restart smaller)."""


class TrainingSession:
    def __init__(self, cfg: RunConfig, dims, layer_spec=None, fault=None, profile_noise=None):
        from dynmo_plugin.assembly import assemble
        from dynmo_plugin.scenarios import build_scenario
        from dynmo_plugin.megatron.training.model import layer_spec as default_spec
        from dynmo_plugin.megatron.migration.repack import Repacker
        from dynmo_plugin.megatron.training.trainer import StageTrainer
        from dynmo_plugin.report import RunReport

        args, self.cfg = cfg.model, cfg
        meta = self._checkpoint(dims)
        layout = _initial_layout(args, dims, meta)
        self.scenario = build_scenario(cfg.dynmo.dynamism)
        spec = layer_spec if layer_spec is not None else default_spec(args.transformer_impl)
        if self.scenario is not None:
            spec = self.scenario.layer_spec(spec, args)
        configure = self.scenario.configure_model if self.scenario is not None else None
        self.trainer = StageTrainer(args, dims, layout, spec=spec, configure=configure)
        self.start_iteration = meta["iteration"] if meta else 0
        self.repacker = Repacker(args.seed, cfg.dynmo.rebalance.migration_timeout_s)
        report = partial(RunReport, path=os.path.join(args.output, "report.json"),
                         config=cfg.to_dict())
        parts = assemble(cfg.dynmo, self.trainer, report, iteration=self.start_iteration,
                         scenario=self.scenario, repacker=self._repack, releases=True,
                         on_control=None if meta is None else partial(self._load, meta),
                         fault=fault, profile_noise=profile_noise)
        self.control, self.migrator, self.report = parts.control, parts.migrator, parts.report
        self.dynmo, self.releases = parts.dynmo, parts.releases
        if meta is not None:
            self._resume(meta)
        from dynmo_plugin.megatron.profiling.calibration import CostCalibration, mix_adjuster
        self.data_fit = CostCalibration.for_run(args.data, self.trainer.data, self.start_iteration)
        if args.data.packed:  # the layer balancer's costs for the run's document-length mix
            self.dynmo.cost_adjuster = mix_adjuster(lambda: self.trainer.data)
        self.stop_after: Optional[int] = None
        self._completed = self.start_iteration

    # ---- checkpoints ------------------------------------------------------------------------
    def _checkpoint(self, dims) -> Optional[dict]:
        """The meta of the checkpoint to resume from, or None. --load equal to --save
        (a job that restarts itself) starts from scratch while nothing is saved there."""
        from dynmo_plugin.megatron.checkpoint.directory import read_meta
        args = self.cfg.model
        root = args.load
        meta = read_meta(root, resume_if_absent=root == args.save) if root else None
        if meta is None:
            if root:
                logger.warning("--load %s: no checkpoint there yet; starting from scratch", root)
            return None
        if meta["tp"] != dims.tp:
            raise ConfigError(f"--load {root}: saved with TP={meta['tp']}, this run has TP={dims.tp}; "
                              "only the pipeline split may change on restart")
        return meta

    def _load(self, meta: dict, control) -> None:
        """The checkpoint's weights and optimizer state into the stage, over `control`."""
        from dynmo_plugin.megatron.checkpoint.directory import load_checkpoint
        start = time.perf_counter()
        load_checkpoint(self.cfg.model.load, meta, self.trainer, control)
        meta["load_s"] = time.perf_counter() - start

    def _resume(self, meta: dict) -> None:
        scheduler = self.trainer.scheduler
        scheduler.num_steps = meta["scheduler"]["num_steps"]
        scheduler.step(increment=0)  # the learning rate of that step, in every param group
        if self.scenario is not None:
            self.scenario.load_state_dict(meta.get("scenario", {}))
        if "data" in meta:  # the data stream's position, outlier queues, cost model
            try:
                self.trainer.data.load_state_dict(meta["data"])
            except ValueError as e:
                raise ConfigError(f"--load {self.cfg.model.load}: {e}") from e
        if self.trainer.dims.rank == 0:
            logger.info("resumed from %s at iteration %d (saved with layout %s), layout %s; "
                        "loaded in %.2f s", self.cfg.model.load, meta["iteration"], meta["layout"],
                        self.trainer.layout, meta["load_s"])

    def save(self, iteration: int, next_layout: Optional[Layout] = None,
             next_world: Optional[int] = None) -> str:
        """Checkpoint now; `next_layout`/`next_world` (default tp x dp x its ranks): what a
        checkpoint repack restarts with (a grow keeps every rank)."""
        from dynmo_plugin.megatron.checkpoint.directory import save_checkpoint
        d = self.trainer.dims
        meta = {"scenario": self.scenario.state_dict() if self.scenario is not None else {},
                "data": self.trainer.data.state_dict(),
                "next": None if next_layout is None else {
                    "layout": str(next_layout), "pp": next_layout.num_ranks,
                    "world_size": next_world or d.tp * d.dp * next_layout.num_ranks}}
        start = time.perf_counter()
        path = save_checkpoint(self.cfg.model.save, iteration, self.trainer, self.control, meta)
        if d.rank == 0:
            logger.info("checkpoint saved: %s in %.2f s", path, time.perf_counter() - start)
        return path

    # ---- repacks ----------------------------------------------------------------------------
    def _repack(self, layout: Layout, iteration: int, info: dict):
        if self.cfg.dynmo.repack.mode == "live":
            return self._live_repack(layout, iteration, info)
        return self._checkpoint_repack(layout, iteration, info)

    def _live_repack(self, layout: Layout, iteration: int, info: dict):
        """Repack the running job (megatron.migration.repack); survivors switch to the
        rebuilt stage (`rebind`) and record the new world (`repacked`)."""
        from dynmo_plugin.megatron.migration.repack import StageParts
        parts = StageParts(self.trainer, self.control, self.migrator)
        record, result, rebuilt = self.repacker.run(parts, layout, info)
        if rebuilt is not None:
            self.rebind(rebuilt.trainer, rebuilt.control, rebuilt.migrator)
            self.repacked(iteration, record, result)
        return record, result

    def _checkpoint_repack(self, layout: Layout, iteration: int, info: dict):
        """Save with the new layout recorded, then every rank ends after this iteration;
        the job restarts with PP = layout.num_ranks and `--load` (a grow: on all its ranks,
        DP x P/K; a refused grow saves nothing and goes on)."""
        from dynmo_plugin.megatron.migration.repack import RepackResult
        d, start = self.trainer.dims, time.perf_counter()
        freed = info.get("freed") or {}
        grow = freed.get("choice") == "grow"
        world = d.world_size if grow else d.tp * d.dp * layout.num_ranks
        iteration = self._completed  # decided before a step (forced) or after it
        result = RepackResult(freed.get("choice") != "refuse", d.pp, layout.num_ranks,
                              str(self.trainer.layout), ranks_released=list(range(world, d.world_size)),
                              world_size_before=d.world_size, world_size_after=world,
                              generation=self.repacker.generation + 1, dp_before=d.dp,
                              dp_after=freed["dp_grow"] if grow else d.dp)
        if not result.applied:
            result.error, result.world_size_after = freed["reason"], d.world_size
            record = {**result.to_dict(), **info, "mode": "checkpoint", "cluster": None}
            del record["migration"]
            return record, result
        path = self.save(iteration, next_layout=layout, next_world=world)
        result.phase_s["save"] = time.perf_counter() - start
        vp = (f" --num-virtual-stages-per-pipeline-rank {layout.num_chunks}"
              if layout.num_chunks > 1 else "")
        restart = (f"torchrun --nproc-per-node <ranks per node> ... --pipeline-model-parallel-size "
                   f"{layout.num_ranks}{vp} --load {self.cfg.model.save}")
        record = {**result.to_dict(), **info, "mode": "checkpoint", "checkpoint": path,
                  "next_layout": str(layout), "restart": restart, "cluster": None}
        del record["migration"]
        self.stop_after, self._checkpoint_result = iteration, (record, result)
        if d.rank == 0:
            logger.info("checkpoint repack: stopping after iteration %d; restart %d ranks with: %s",
                        iteration, world, restart)
        return record, result

    def rebind(self, trainer, control, migrator) -> None:
        """Switch everything to the stage a repack rebuilt (megatron.migration.repack)."""
        from dynmo_plugin.scenarios import Runtime
        trainer.data.load_state_dict(self.trainer.data.state_dict())  # same stream, same place
        self.trainer, self.control, self.migrator = trainer, control, migrator
        if self.data_fit is not None:
            self.data_fit.cancel()  # it timed the old stage's layers
        self.dynmo.rebind(trainer, control, migrator)
        if self.scenario is not None:
            self.scenario.attach(Runtime(trainer, control, migrator))

    def repacked(self, iteration: int, record: dict, result) -> None:
        """Survivors, after a live repack: the world's new size in the report; the leader
        hands the released replicas back to the cluster in the background."""
        d = self.trainer.dims
        self.report.world["history"].append({"iteration": iteration, "pp": d.pp, "tp": d.tp,
                                             "dp": d.dp, "world_size": d.world_size,
                                             "released_ranks": result.ranks_released})
        if self.releases is not None and result.ranks_released:  # a grow keeps every rank
            self.releases.start(record, result)

    def finish(self) -> None:
        """After the last iteration: a checkpoint repack's retirees leave and the leader
        releases them; outstanding releases end; the report is final."""
        from dynmo_plugin.releases import mark_retired
        if self.stop_after is not None:
            record, result = self._checkpoint_result
            if self.trainer.dims.rank in result.ranks_released:
                mark_retired(result.generation, self.trainer.dims.rank,
                             self.cfg.dynmo.rebalance.migration_timeout_s)
            elif self.releases is not None and result.ranks_released:
                self.releases.start(record, result)
        if self.releases is not None:
            self.releases.join()
        self.report.layout = str(self.trainer.layout)
        self.report.close()

    # ---- the loop -------------------------------------------------------------------------------
    def step(self, iteration: int) -> None:
        """One iteration with everything around it.

        Raises:
            RankRetired: this rank's stage was released by a live repack.
            StopTraining: after a checkpoint repack.
        """
        start = time.perf_counter()
        self._completed = iteration - 1
        self.dynmo.before_step(iteration)
        if self.stop_after is not None:
            raise StopTraining(f"checkpoint repack after iteration {self.stop_after}")
        if self.scenario is not None:
            self.scenario.before_step(iteration)
        if self.data_fit is not None:
            self.data_fit.before_step(self.trainer, iteration)
        step_start = time.perf_counter()
        loss = self.trainer.train_step(iteration)
        self._completed = iteration
        step_end = time.perf_counter()
        if self.data_fit is not None:
            fitted = self.data_fit.after_step(self.trainer, self.control, iteration)
            if fitted is not None:
                self.report.add_event(fitted)
        if self.scenario is not None:
            event = self.scenario.after_step(iteration)
            if event is not None:
                self.report.add_event(event)
                if event.rebalance:
                    self.dynmo.notify_event(event.name, event.work)
        scenario_end = time.perf_counter()
        self.dynmo.after_step(iteration)
        elapsed = time.perf_counter() - start
        # dynmo_s: the controller's own time (windows, decisions, migration); scenario_s:
        # the dynamism scheme's own work (pruning rounds, freezing checks), paid by static too
        self.report.add_iteration(iteration, loss, elapsed,
                                  dynmo_s=elapsed - (scenario_end - step_start),
                                  scenario_s=scenario_end - step_end)
        args = self.cfg.model
        if iteration % args.log_interval == 0:
            logger.info("iteration %4d/%d | loss %.6f | %.1f ms | layout %s", iteration,
                        args.train_iters, loss, elapsed * 1e3, self.trainer.layout)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            self.save(iteration)
        if self.stop_after is not None:
            raise StopTraining(f"checkpoint repack after iteration {iteration}")


def _initial_layout(args, dims, meta: Optional[dict]) -> Layout:
    """An explicit --pipeline-model-parallel-layout; else, resuming, the layout a checkpoint
    repack chose or the saved one, if it has this run's pp x v stages
    (megatron.checkpoint.resume_layout); else Megatron's uniform split."""
    v = args.num_virtual_stages_per_pipeline_rank
    if args.pipeline_model_parallel_layout:
        return Layout.parse(args.pipeline_model_parallel_layout, dims.pp, args.num_layers, v)
    if meta is not None:
        from dynmo_plugin.megatron.checkpoint.directory import resume_layout
        layout = resume_layout(meta, dims.pp, v, args.num_layers)
        if layout is not None:
            return layout
    return Layout.uniform(args.num_layers, dims.pp * v, v)
