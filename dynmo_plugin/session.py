"""One rank's training run: the stage, the control plane, the controller, the scenario.

`TrainingSession` glues them in the order dynmo_plugin.scenarios.base describes, and
owns what outlives any one of them: the report, checkpoints (`--save`/`--load`, any
pipeline split) and repacks, after which it switches every part to the stage rebuilt
in the smaller world (`rebind`).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from functools import partial
from typing import Optional

from dynmo_plugin.config import ConfigError, RunConfig
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.collector import CollectorPause

__all__ = ["TrainingSession", "StopTraining", "Stopped"]

logger = logging.getLogger("dynmo_plugin.train")


class StopTraining(Exception):
    """Every rank ends the run after this iteration (a checkpoint repack: restart smaller)."""


class Stopped(Exception):
    """Every rank stops after this iteration: a SIGINT/SIGTERM reached some rank (Ctrl-C,
    a scheduler's preemption). `signum`: the signal; `checkpoint`: saved on the way out
    (--exit-signal-handler with --save) or None."""

    def __init__(self, signum: int, iteration: int, checkpoint: Optional[str]):
        super().__init__(f"signal {signum} after iteration {iteration}")
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint


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
        spec = layer_spec if layer_spec is not None else default_spec(args.transformer_impl, args.attention_backend)
        if self.scenario is not None:
            spec = self.scenario.layer_spec(spec, args)
        configure = self.scenario.configure_model if self.scenario is not None else None
        self.trainer = StageTrainer(args, dims, layout, spec=spec, configure=configure)
        self.start_iteration = meta["iteration"] if meta else 0
        self.repacker = Repacker(args.seed, cfg.dynmo.rebalance.migration_timeout_s)
        if dims.rank == 0:
            _move_earlier_run(args.output, resuming=meta is not None)
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
        self._interval: list[tuple[float, float]] = []  # (loss, seconds) since the last log line
        self.signal_received = 0
        self._signal_handlers: dict = {}   # the ones this session replaced, for close
        if threading.current_thread() is threading.main_thread():
            self._signal_handlers = {sig: signal.signal(sig, self._on_signal)
                                     for sig in (signal.SIGINT, signal.SIGTERM)}
        # last: a constructor that raised above leaves the collector as it found it
        self._manual_gc = _ManualCollection(args.manual_gc_interval) if args.manual_gc else None

    def close(self) -> None:
        """On every way out of the run, as a process that trains again needs it
        (scripts/gpu_check_worker.py runs scenario after scenario): a profiling window a
        failed step left open ends (its hooks, CUDA profiler and collector pause), the
        collector --manual-gc turned off is back on, and SIGINT/SIGTERM go back to the
        handlers this session replaced, as its own handler holds the session and so the
        model."""
        try:
            self.dynmo.finish(self._completed)
        finally:
            if self._manual_gc is not None:
                self._manual_gc.release()
            for sig, handler in self._signal_handlers.items():
                signal.signal(sig, handler)
            self._signal_handlers = {}

    def _on_signal(self, signum, frame) -> None:
        """Note it; the run stops at the end of the iteration (`_check_signal`). Repeats
        are ignored: Ctrl-C under torchrun reaches a worker twice (the terminal's SIGINT,
        then the agent's), and the agent kills what has not ended after its timeout."""
        self.signal_received = self.signal_received or signum

    def _check_signal(self, iteration: int) -> None:
        """Stop every rank after the same iteration when any rank got a signal (one
        max over the control plane per iteration; Megatron-LM's --exit-signal-handler
        gathers the same flag each iteration). Saves first with --exit-signal-handler.

        Raises:
            Stopped: on every rank, after the iteration a signal arrived in.
        """
        signum = int(self.control.max([float(self.signal_received)], "signal")[0])
        if not signum:
            return
        args = self.cfg.model
        path = self.save(iteration) if args.exit_signal_handler and args.save else None
        raise Stopped(signum, iteration, path)

    # ---- checkpoints ------------------------------------------------------------------------
    def _checkpoint(self, dims) -> Optional[dict]:
        """The meta of the checkpoint to resume from, or None. --load equal to --save
        (a job that restarts itself) starts from scratch while nothing is saved there."""
        from dynmo_plugin.megatron.checkpoint.directory import read_meta, resumes_its_save
        args = self.cfg.model
        root = args.load
        meta = read_meta(root, resume_if_absent=resumes_its_save(root, args.save)) if root else None
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
        from dynmo_plugin.megatron.checkpoint.directory import model_record
        meta = {"model": model_record(self.cfg.model),
                "scenario": self.scenario.state_dict() if self.scenario is not None else {},
                "data": self.trainer.data.state_dict(),
                "next": None if next_layout is None else {
                    "layout": str(next_layout), "pp": next_layout.num_ranks,
                    "world_size": next_world or d.world_size // d.pp * next_layout.num_ranks}}
        start = time.perf_counter()
        path = save_checkpoint(self.cfg.model.save, iteration, self.trainer, self.control, meta)
        if d.rank == 0:
            logger.info("checkpoint saved: %s in %.2f s", path, time.perf_counter() - start)
        return path

    def save_last(self) -> None:
        """After the last iteration, as Megatron-LM's pretrain(): saved unless the interval
        already saved it (--save-interval 0: only a checkpoint repack saves)."""
        args, last = self.cfg.model, self._completed
        if args.save and args.save_interval and last > self.start_iteration and last % args.save_interval:
            self.save(last)

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
        world = d.world_size if grow else d.world_size // d.pp * layout.num_ranks  # each stage's ranks
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

    def _log_line(self, iteration: int) -> str:
        """Megatron-LM's log line: the loss averaged over the --log-interval iterations
        since the last line, the learning rate and gradient norm of the last step (the
        norm only where Megatron computes it: --clip-grad > 0), tokens/s and the time left
        at the interval's pace."""
        args, step = self.cfg.model, self.trainer.last_step
        losses, times = [x for x, _ in self._interval], [t for _, t in self._interval]
        per_iter = sum(times) / len(times)
        tokens = args.global_batch_size * args.seq_length
        norm = f" | grad norm {step['grad_norm']:.3f}" if step.get("grad_norm") is not None else ""
        over = f" (avg of {len(losses)})" if len(losses) > 1 else ""
        return (f"iteration {iteration:4d}/{args.train_iters} | lm loss {sum(losses) / len(losses):.6E}"
                f"{over} | lr {step['lr']:.3E}{norm} | {per_iter * 1e3:.1f} ms/iter | "
                f"tokens/s {tokens / per_iter:.0f} | time left "
                f"{_clock(per_iter * (args.train_iters - iteration))} | layout {self.trainer.layout}")

    def finish(self) -> None:
        """After the last iteration: a checkpoint repack's retirees leave and the leader
        releases them; outstanding releases end; the report is final."""
        try:
            self.dynmo.finish(self._completed)
        finally:
            self._release_and_close()

    def _release_and_close(self) -> None:
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
        self.dynmo.step_done()
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
        collected_s = self._manual_gc.after_step(iteration) if self._manual_gc is not None else 0.0
        elapsed = time.perf_counter() - start
        # dynmo_s: the controller's own time (windows, decisions, migration); scenario_s:
        # the dynamism scheme's own work (pruning rounds, freezing checks), paid by static
        # too; a --manual-gc collection is neither (the iteration's, as in Megatron-LM)
        self.report.add_iteration(iteration, loss, elapsed,
                                  dynmo_s=elapsed - (scenario_end - step_start) - collected_s,
                                  scenario_s=scenario_end - step_end)
        self._interval.append((loss, elapsed))
        args = self.cfg.model
        if iteration % args.log_interval == 0:
            logger.info("%s", self._log_line(iteration))
            self._interval.clear()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            self.save(iteration)
        self._check_signal(iteration)
        if self.stop_after is not None:
            raise StopTraining(f"checkpoint repack after iteration {iteration}")


class _ManualCollection:
    """--manual-gc, as Megatron-LM's train(): the cyclic collector off for the run, one
    collection now and then one every `interval` iterations (0: none) between steps, so
    every rank collects at the same iteration rather than where its own allocations
    decide (a generation-2 collection took 190-260 ms of CPU in grow_check's ranks:
    dynmo_plugin/profiling/collector.py). Profiling windows find it off and leave it off."""

    def __init__(self, interval: int):
        self.interval, self._pause = interval, CollectorPause()
        gc.collect()

    def after_step(self, iteration: int) -> float:
        """Collect if this iteration is due; the seconds it took."""
        if not (self.interval and iteration % self.interval == 0):
            return 0.0
        start = time.perf_counter()
        gc.collect()
        return time.perf_counter() - start

    def release(self) -> None:
        """The collector back as the run found it (idempotent)."""
        self._pause.release()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _move_earlier_run(output: str, resuming: bool) -> Optional[str]:
    """A restart never overwrites what a run wrote before, nor leaves it beside the new
    report: a fresh run moves an earlier run's files (report, log, summary, plots) into
    `<output>/earlier-N/`; a resumed one continues the report and log, and moves only the
    summary and plots rendered from the stopped run (`dynmo report` renders them anew).
    Returns the directory used, or None when there was nothing to move."""
    from dynmo_plugin.config.checks import OUTPUT_FILES
    names = [n for n in OUTPUT_FILES if (not resuming or not n.startswith("report."))
             and os.path.isfile(os.path.join(output, n))]
    if not names:
        return None
    n = 1
    while os.path.exists(os.path.join(output, f"earlier-{n}")):
        n += 1
    target = os.path.join(output, f"earlier-{n}")
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(output, name), os.path.join(target, name))
    what = "the stopped run's summary and plots" if resuming else "an earlier run's files"
    logger.warning("--output %s held %s (%s); moved them to %s", output, what, ", ".join(names), target)
    return target


def _initial_layout(args, dims, meta: Optional[dict]) -> Layout:
    """An explicit --pipeline-model-parallel-layout; else, resuming, the layout a checkpoint
    repack chose or the saved one, if it has this run's pp x v stages
    (megatron.checkpoint.resume_layout); else Megatron's uniform split. MTP layers
    (--mtp-num-layers) as the layout places them, else on the last stage."""
    v = args.num_virtual_stages_per_pipeline_rank
    mtp = getattr(args, "mtp_num_layers", None) or 0  # args: ModelArgs, or a namespace without it
    if args.pipeline_model_parallel_layout:
        return Layout.parse(args.pipeline_model_parallel_layout, dims.pp, args.num_layers, v, mtp)
    if meta is not None:
        from dynmo_plugin.megatron.checkpoint.directory import resume_layout
        layout = resume_layout(meta, dims.pp, v, args.num_layers, mtp)
        if layout is not None:
            return layout
    return Layout.uniform(args.num_layers, dims.pp * v, v, mtp)
