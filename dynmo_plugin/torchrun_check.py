"""Check `dynmo-train`'s input inside torchrun, before it spawns a worker.

torchrun reports any failed worker by raising ChildFailedError: a bad flag would print
one line per rank and then torchrun's traceback. Its only hook that runs before the
workers start is the entry-point group `torchrun.handlers` (out-of-tree rendezvous
backends), loaded when torchrun imports its rendezvous registry. The package declares
`handler` there (setup.cfg). In a torchrun process whose training module is
`dynmo_plugin.train` it validates the training flags exactly as a worker would
(`dynmo_plugin.train.validate`, world size = nodes x processes per node when fixed) and
ends torchrun with one line and status 2 (a SystemExit, which torchrun's `@record`
passes through without a traceback). Anywhere else it does nothing. It registers no
usable backend: asking for `--rdzv-backend dynmo-validate` is refused.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["handler", "training_argv", "world_size"]

_MODULE = "dynmo_plugin.train"


def _is_torchrun(argv0: str) -> bool:
    path = argv0.replace(os.sep, "/")
    return os.path.basename(path) == "torchrun" or path.endswith("torch/distributed/run.py")


def training_argv(argv: list[str]) -> Optional[tuple[list[str], list[str]]]:
    """(torchrun's options, dynmo-train's flags) when `argv` is a torchrun command line
    that starts dynmo_plugin.train (`-m dynmo_plugin.train` as in docs/usage.md, the
    `dynmo-train` script with --no-python, or the train.py path), else None (then the
    workers check, and torchrun adds its traceback)."""
    if not argv or not _is_torchrun(argv[0]):
        return None
    for i, token in enumerate(argv[1:], 1):
        module = token == _MODULE and argv[i - 1] in ("-m", "--module")
        script = (os.path.basename(token) == "dynmo-train"
                  or token.replace(os.sep, "/").endswith("dynmo_plugin/train.py"))
        if module or script:
            return argv[1:i], argv[i + 1:]
    return None


def _option(options: list[str], *names: str) -> Optional[str]:
    value = None
    for i, token in enumerate(options):
        name, eq, rest = token.partition("=")
        if name in names:
            value = rest if eq else (options[i + 1] if i + 1 < len(options) else None)
    return value


def world_size(options: list[str]) -> Optional[int]:
    """nodes x processes per node from torchrun's options (or its PET_* variables), or
    None when elastic (a node range) or chosen by torchrun (gpu, cpu, auto)."""
    nproc = _option(options, "--nproc-per-node", "--nproc_per_node") or os.environ.get(
        "PET_NPROC_PER_NODE", "1")
    nnodes = _option(options, "--nnodes") or os.environ.get("PET_NNODES", "1")
    low, _, high = nnodes.partition(":")
    if not nproc.isdigit() or not low.isdigit() or (high and high != low):
        return None
    return int(nproc) * int(low)


def _refuse_backend(params):
    raise ValueError("dynmo-validate is not a rendezvous backend (dynmo_plugin uses it to check "
                     "dynmo-train's flags before workers start); use c10d or static")


def handler():
    """The `torchrun.handlers` entry point: validate, then register nothing usable."""
    found = training_argv(sys.argv)
    if found is not None:
        from dynmo_plugin.errors import USER_ERROR_EXIT, UserError
        from dynmo_plugin.train import build_parser, validate
        options, flags = found
        try:
            validate(build_parser().parse_args(flags), world_size(options), in_launcher=True)
        except UserError as e:
            print(f"dynmo-train: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(USER_ERROR_EXIT) from None
        except Exception:  # noqa: BLE001 - a fault in the check, not in the input: the
            return _refuse_backend  # workers run it again and report it (torchrun would log a warning)
        _quiet_endings()
    return _refuse_backend


def _quiet_endings() -> None:
    """Two endings whose cause a worker has already said in one line, where torchrun's
    agent would add a warning, ChildFailedError's traceback and exit 1:
    - Ctrl-C (or SIGTERM): the workers stop at an iteration boundary and rank 0 prints
      the resume command (dynmo_plugin.train); torchrun ends with the signal's status
      (128 + signal), as a shell reports a job ended by a signal;
    - bad input only a worker can find (a checkpoint's damaged shards, the GPUs): the
      first worker to fail exited 2 after its line (rank 0's, where every rank holds every
      cause); torchrun ends with 2 too, the status the check above gives."""
    import logging

    from dynmo_plugin.errors import USER_ERROR_EXIT

    def drop(record: logging.LogRecord) -> bool:  # the agent's chatter about those two
        text = str(record.msg)
        bad_input = (text.startswith("failed (exitcode") and bool(record.args)
                     and record.args[0] == USER_ERROR_EXIT)
        return "death signal" not in text and "closing signal" not in text and not bad_input
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(drop)  # torch sets their levels on import: filter
    previous = sys.excepthook

    def hook(kind, value, tb):
        sigval = getattr(value, "sigval", None)
        if type(value).__name__ == "SignalException" and sigval is not None:
            _end(128 + int(sigval))
        if (type(value).__name__ == "ChildFailedError"
                and value.get_first_failure()[1].exitcode == USER_ERROR_EXIT):
            _end(USER_ERROR_EXIT)
        previous(kind, value, tb)

    sys.excepthook = hook


def _end(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
