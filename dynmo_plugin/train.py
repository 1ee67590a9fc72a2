"""`dynmo-train` / `python -m dynmo_plugin.train`: Megatron-Core GPT pipeline training.

Run under torchrun. Parse flags (Megatron-LM spellings) and the plugin's YAML, validate
once, build the stage, train, write the report. User errors exit 2 with one line.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

from dynmo_plugin.config import RunConfig, add_dynmo_args, add_model_args, load_config
from dynmo_plugin.errors import USER_ERROR_EXIT, UserError
from dynmo_plugin.layout import Layout

__all__ = ["main", "build_parser", "run", "exit_on_peer_failure"]

logger = logging.getLogger("dynmo_plugin.train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynmo-train", description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_dynmo_args(parser)
    return parser


def run(cfg: RunConfig, layer_spec=None, fault=None, profile_noise=None, on_start=None,
        on_finish=None) -> dict:
    """Train as configured; returns the report (as a dict) on every rank, or None on a
    rank that a repack released (it has left the world; its launcher exits 0).

    `layer_spec` (a Megatron ModuleSpec) replaces the default TransformerLayer spec,
    for models with custom layers. `fault` and `profile_noise` are test-only fakes
    (dynmo_plugin.faults); `on_start(trainer)` runs after the stage is built,
    `on_finish(trainer)` before teardown.

    Raises:
        PeerFailure: a peer died or hung during a plugin collective (see consensus).
    """
    from dynmo_plugin.megatron.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.repack import RankRetired

    dims = init_parallel(cfg.model)
    try:
        session = _Session(cfg, dims, layer_spec, fault, profile_noise)
        if on_start is not None:
            on_start(session.trainer)
        try:
            for iteration in range(1, cfg.model.train_iters + 1):
                session.step(iteration)
        except RankRetired:
            return None  # this rank's stage was released by a repack: exit 0, no report
        session.finish_releases()
        session.report.layout = str(session.trainer.layout)
        session.report.write()
        if on_finish is not None:
            on_finish(session.trainer)
        if dims.rank == 0:
            logger.info("report written to %s", session.report.path)
        return session.report.to_dict()
    finally:
        destroy_parallel()


class _Session:
    """One rank's training run: stage trainer, control plane, migrator, controller and
    the dynamism scenario, glued in the order dynmo_plugin.dynamism.base describes."""

    def __init__(self, cfg: RunConfig, dims, layer_spec, fault, profile_noise):
        from dynmo_plugin.consensus import ControlPlane
        from dynmo_plugin.controller import DynMo
        from dynmo_plugin.dynamism import Runtime, build_scenario
        from dynmo_plugin.megatron.migrate import LayerMigrator
        from dynmo_plugin.megatron.model import layer_spec as default_spec
        from dynmo_plugin.megatron.repack import Repacker
        from dynmo_plugin.releases import Releases
        from dynmo_plugin.megatron.trainer import StageTrainer
        from dynmo_plugin.report import RunReport

        args, self.cfg = cfg.model, cfg
        layout = (Layout.parse(args.pipeline_model_parallel_layout, dims.pp, args.num_layers)
                  if args.pipeline_model_parallel_layout
                  else Layout.uniform(args.num_layers, dims.pp))
        self.scenario = build_scenario(cfg.dynmo.dynamism)
        spec = layer_spec if layer_spec is not None else default_spec()
        if self.scenario is not None:
            spec = self.scenario.layer_spec(spec, args)
        self.trainer = StageTrainer(args, dims, layout, spec=spec)
        timeout = cfg.dynmo.rebalance.migration_timeout_s
        self.control = ControlPlane(timeout)
        self.migrator = LayerMigrator(self.trainer, self.control, timeout, fault)
        shape = {"pp": dims.pp, "tp": dims.tp, "dp": dims.dp, "world_size": dims.world_size}
        self.report = RunReport(path=os.path.join(args.output, "report.json"), config=cfg.to_dict(),
                                world={**shape, "backend": dims.backend,
                                       "history": [{"iteration": 0, **shape}]},
                                initial_layout=str(layout), enabled=dims.rank == 0)
        self.releases = Releases(cfg.dynmo.cluster, timeout) if dims.rank == 0 else None
        repacker = (Repacker(self, args.seed, timeout).run
                    if cfg.dynmo.enabled and cfg.dynmo.repack.enabled else None)
        self.dynmo = DynMo(cfg.dynmo, self.trainer, self.control, self.migrator, self.report,
                           profile_noise=profile_noise, repacker=repacker)
        if self.scenario is not None:
            self.scenario.attach(Runtime(self.trainer, self.control, self.migrator))
            self.dynmo.add_layout_listener(self.scenario.after_layout_change)

    # ---- what a repack (dynmo_plugin.megatron.repack) needs from the session ------------
    def rebind(self, trainer, control, migrator) -> None:
        """Switch everything to the stage rebuilt in the shrunk world."""
        self.trainer, self.control, self.migrator = trainer, control, migrator
        self.dynmo.rebind(trainer, control, migrator)
        if self.scenario is not None:
            from dynmo_plugin.dynamism import Runtime
            self.scenario.attach(Runtime(trainer, control, migrator))

    def release_stage(self) -> None:
        """A retiring rank drops its stage's buffers before leaving."""
        from dynmo_plugin.megatron.migrate import retire_ddp
        retire_ddp(self.trainer.ddp)

    def repacked(self, iteration: int, record: dict, result) -> None:
        """Survivors, after a repack: the world's new size in the report; the leader hands
        the released replicas back to the cluster in the background."""
        d = self.trainer.dims
        self.report.world["history"].append({"iteration": iteration, "pp": d.pp, "tp": d.tp,
                                             "dp": d.dp, "world_size": d.world_size,
                                             "released_ranks": result.ranks_released})
        if self.releases is not None:
            self.releases.start(record, result)

    def finish_releases(self) -> None:
        if self.releases is not None:
            self.releases.join()

    def step(self, iteration: int) -> None:
        start = time.perf_counter()
        self.dynmo.before_step(iteration)
        if self.scenario is not None:
            self.scenario.before_step(iteration)
        step_start = time.perf_counter()
        loss = self.trainer.train_step(iteration)
        step_end = time.perf_counter()
        if self.scenario is not None:
            event = self.scenario.after_step(iteration)
            if event is not None:
                self.report.add_event(event)
                if event.rebalance:
                    self.dynmo.notify_event(event.name)
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


def exit_on_peer_failure(fn, *args) -> int:
    """Run `fn(*args)`; a lost peer ends this rank with one line and status 1, so
    torchrun (or Kubernetes) sees the failure and stops or restarts the job."""
    from dynmo_plugin.consensus import PeerFailure
    try:
        fn(*args)
    except PeerFailure as e:
        print(f"dynmo-train: fatal: rank {os.environ.get('RANK', 0)}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args, world_size=int(os.environ.get("WORLD_SIZE", 1)))
        return exit_on_peer_failure(run, cfg)
    except UserError as e:
        print(f"dynmo-train: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
