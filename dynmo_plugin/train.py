"""`dynmo-train` / `python -m dynmo_plugin.train`: Megatron-Core GPT pipeline training.

Run under torchrun. Parse flags (Megatron-LM spellings) and the plugin's YAML, validate
once, build the stage, train, write the report. User errors exit 2 with one line.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from dynmo_plugin.config import RunConfig, add_dynmo_args, add_model_args, load_config
from dynmo_plugin.errors import USER_ERROR_EXIT, UserError

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
    from dynmo_plugin.session import StopTraining, TrainingSession

    dims = init_parallel(cfg.model)
    try:
        session = TrainingSession(cfg, dims, layer_spec, fault, profile_noise)
        if on_start is not None:
            on_start(session.trainer)
        try:
            for iteration in range(session.start_iteration + 1, cfg.model.train_iters + 1):
                session.step(iteration)
        except RankRetired:
            return None  # this rank's stage was released by a repack: exit 0, no report
        except StopTraining:
            pass         # a checkpoint repack: every rank ends here, the job restarts smaller
        session.finish()
        if on_finish is not None:
            on_finish(session.trainer)
        if dims.rank == 0:
            logger.info("report written to %s", session.report.path)
        return session.report.to_dict()
    finally:
        destroy_parallel()


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
