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
from typing import Optional

from dynmo_plugin.config import (ConfigError, RunConfig, add_dynmo_args, add_model_args, check_paths,
                                 load_config)
from dynmo_plugin.config.flags import OneLineParser
from dynmo_plugin.errors import USER_ERROR_EXIT, UserError

__all__ = ["main", "build_parser", "run", "exit_on_peer_failure", "validate", "LAUNCH_ENV",
           "SignalStop", "resume_line"]

logger = logging.getLogger("dynmo_plugin.train")

# What torchrun (or any env:// launcher) sets for every worker; without them
# torch.distributed cannot start, ~30 s later, with a traceback.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = ("run it under torchrun: torchrun --nproc-per-node N -m dynmo_plugin.train ... "
               "(N = TP x PP x DP; docs/usage.md \"Launch\")")
# an error every rank agreed on is printed by rank 0 (`run`): the others wait this long before
# they exit, as torchrun stops every rank once one has exited
AGREED_GRACE_S = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dynmo-train", description=__doc__.splitlines()[0])
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
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.migration.repack import RankRetired
    from dynmo_plugin.session import Stopped, StopTraining, TrainingSession

    dims = init_parallel(cfg.model, native_grad_reduce=cfg.dynmo.native_grad_reduce)
    session = None
    try:
        session = TrainingSession(cfg, dims, layer_spec, fault, profile_noise)
        if on_start is not None:
            on_start(session.trainer)
        try:
            for iteration in range(session.start_iteration + 1, cfg.model.train_iters + 1):
                session.step(iteration)
            session.save_last()
        except RankRetired:
            return None  # this rank's stage was released by a repack: exit 0, no report
        except StopTraining:
            pass         # a checkpoint repack: every rank ends here, the job restarts smaller
        except Stopped as stop:  # SIGINT/SIGTERM: the report as it stands, then one line
            try:
                session.close()  # a window the stop cut is in the report as cancelled
            finally:
                session.report.layout = str(session.trainer.layout)
                session.report.write()
            raise SignalStop(stop.signum, stop.iteration, stop.checkpoint) from None
        session.finish()
        if on_finish is not None:
            on_finish(session.trainer)
        if dims.rank == 0:
            logger.info("report written to %s", session.report.path)
        return session.report.to_dict()
    except UserError as e:
        if e.agreed and dims.rank == 0:  # said before the teardown: torchrun stops rank 0 as
            _say(e)                      # soon as another rank's exit 2 reaches it
        raise
    finally:
        try:
            if session is not None:
                session.close()
        finally:
            destroy_parallel()


def _say(error: UserError) -> None:
    """The one line of a user error, once (`main` prints what was not said yet)."""
    if not getattr(error, "said", False):
        error.said = True
        print(f"dynmo-train: error: {error}", file=sys.stderr, flush=True)


class SignalStop(Exception):
    """The run stopped on a signal at an iteration boundary (`main` exits 128 + signum)."""

    def __init__(self, signum: int, iteration: int, checkpoint: Optional[str]):
        super().__init__(f"signal {signum}")
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint


def resume_line(stop: SignalStop, save: Optional[str], argv: list[str]) -> str:
    """The one line a stopped run prints: where it stopped, the last checkpoint and the
    command that resumes from it (this command line, with --load set to --save)."""
    import shlex
    import signal as _signal
    name = _signal.Signals(stop.signum).name
    last = _last_checkpoint(save)
    if last is None:
        return (f"dynmo-train: stopped by {name} after iteration {stop.iteration}; no checkpoint "
                "(give --save DIR --exit-signal-handler to save on a signal, or --save-interval N)")
    kept, skip = [], False
    for token in argv:  # this command line without its --load
        if skip:
            skip = False
            continue
        if token == "--load":
            skip = True
            continue
        if not token.startswith("--load="):
            kept.append(token)
    nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    return (f"dynmo-train: stopped by {name} after iteration {stop.iteration}; last checkpoint "
            f"{last}; resume with: torchrun --nproc-per-node {nproc} -m dynmo_plugin.train "
            f"{shlex.join(kept)} --load {shlex.quote(save)}")


def _last_checkpoint(save: Optional[str]) -> Optional[str]:
    if not save:
        return None
    from dynmo_plugin.megatron.checkpoint.directory import latest_checkpoint
    try:
        return latest_checkpoint(save)
    except (OSError, ValueError):
        return None


def validate(args: argparse.Namespace, world_size: int | None, in_launcher: bool = False) -> RunConfig:
    """Everything that can be checked before a process group exists: the flags and YAML
    (load_config), the launcher's paths, and whether --load holds a usable checkpoint.
    Nothing is created. `in_launcher` (torchrun's own process, dynmo_plugin.torchrun_check)
    leaves out what would import Transformer Engine or Megatron there: whether TE
    imports (each worker checks it). The checkpoint's files are plain JSON and names.

    Raises:
        UserError: the first problem, one line naming the key and the fix.
    """
    from dynmo_plugin.megatron.training import machine  # imports torch, TE and Megatron only when asked
    cfg = load_config(args, world_size=world_size, cuda_devices=machine.cuda_device_count,
                      te_problem=(lambda: None) if in_launcher else machine.transformer_engine_problem)
    check_paths(cfg.model)
    load = cfg.model.load
    from dynmo_plugin.megatron.checkpoint import directory as checkpoint
    checkpoint.check_save_is_this_runs(cfg.model.save, load)
    if load:
        checkpoint.check_same_model(load, cfg.model)
        meta = checkpoint.read_meta(load, resume_if_absent=checkpoint.resumes_its_save(load, cfg.model.save))
        _check_resume_blocks(cfg.model, meta)
    return cfg


def _check_resume_blocks(m, meta: dict | None) -> None:
    """Without a layout flag a resume takes the checkpoint's layout
    (`directory.resume_layout`); under uniform recompute in chunks of N it must hold whole
    chunks too, which one saved under other recompute settings need not."""
    from dynmo_plugin.config.checks import recompute_block, split_blocks
    from dynmo_plugin.megatron.checkpoint.directory import resume_layout
    block = recompute_block(m)
    if block == 1 or meta is None or m.pipeline_model_parallel_layout:
        return
    layout = resume_layout(meta, m.pipeline_model_parallel_size, m.num_virtual_stages_per_pipeline_rank,
                           m.num_layers, m.mtp_num_layers or 0)
    why = split_blocks(layout, block) if layout is not None else None
    if why:
        raise ConfigError(f"--load {m.load}: its saved layout {layout}: {why}; give a "
                          "--pipeline-model-parallel-layout of whole chunks, or another "
                          "--recompute-num-layers")


def nothing_to_balance(cfg: RunConfig) -> str | None:
    """A warning when the run has one pipeline stage yet asks for balancing or a
    scenario: it trains, but no layer can move (docs/usage.md, "Dynamism scenarios")."""
    m, kind = cfg.model, cfg.dynmo.dynamism.kind
    if m.pipeline_model_parallel_size * m.num_virtual_stages_per_pipeline_rank > 1:
        return None
    if kind == "none" and not cfg.dynmo.enabled:
        return None
    what = f"dynamism.kind {kind}" if kind != "none" else "--dynmo"
    return (f"{what} with --pipeline-model-parallel-size 1: one stage, nothing to balance; the "
            "run trains as a static baseline (give --pipeline-model-parallel-size >= 2 to balance)")


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
    """The `dynmo-train` command. Bad input ends in one line and status 2, printed by
    rank 0 only (every rank finds the same problem). From the command line (`argv`
    None) without torchrun's environment it says how to launch, before anything heavy
    is imported; called from Python with `argv`, the caller owns that environment."""
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    # the solver's own "balancing exact: A -> B" line said B before the decision kept A;
    # the controller's one line per decision says what was considered and why
    logging.getLogger("dynmo_plugin.balancing.solve").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    # torch.distributed.checkpoint's, at every load of Megatron's dist_checkpointing format
    # (its ShardedTensor metadata): about torch's API, nothing a user's checkpoint can fix
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
    args = build_parser().parse_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    try:
        cfg = validate(args, world_size=world if argv is None else (world or 1))
        missing = [v for v in LAUNCH_ENV if v not in os.environ]
        if argv is None and missing:
            raise UserError(f"{', '.join(missing)} not set: dynmo-train is a torchrun worker; "
                            f"{LAUNCH_HINT}")
    except UserError as e:
        if rank == 0:
            print(f"dynmo-train: error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    for warning in [*cfg.notices, nothing_to_balance(cfg)]:
        if warning and rank == 0:
            print(f"dynmo-train: warning: {warning}", file=sys.stderr, flush=True)
    try:
        return exit_on_peer_failure(run, cfg)
    except SignalStop as stop:
        if rank == 0:
            print(resume_line(stop, cfg.model.save, sys.argv[1:] if argv is None else argv),
                  file=sys.stderr, flush=True)
        return 128 + stop.signum
    except UserError as e:  # found while building (a checkpoint's TP, the GPUs): each rank
        if rank == 0 or not e.agreed:  # says its own, once where every rank holds every cause
            _say(e)
        else:  # rank 0 says it: leave it the moment torchrun would take by stopping it
            time.sleep(AGREED_GRACE_S)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
