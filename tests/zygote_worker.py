"""Test infrastructure: the worker side of the test launcher (tests/zygote.py).

torchrun's agent asks the launcher's fork server for each worker (the `forkserver` start
method); the fork server is a single-threaded fork of the zygote, so a worker starts with
the imports done and no lock copied from another thread. What a worker forked by the
agent would have inherited, `Worker` carries over: the agent's environment, its stdout
and stderr (passed as file descriptors), its process group (a timed-out launch is killed
as one group).

Each worker also leaves markers in the launch's folder - its pid, and when it entered and
left its first init_process_group - and dumps every thread's stack on SIGUSR1; the
launcher reads the markers (`RendezvousWatch`) to stop a rendezvous that does not
complete, naming the ranks that did not join, instead of waiting out the test's timeout.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders the zygote put on its sys.path to preload from (a Megatron-LM checkout): not on a
# worker's, which a fresh interpreter would not have either.
PRELOADED_PATHS: list[str] = []


class Worker:
    """torchrun's entrypoint as run in a worker of the fork server (pickled by the agent)."""

    def __init__(self, fn, env: dict, rank_keys: frozenset, agent: int, folder: str,
                 stdout=None, stderr=None) -> None:
        self.fn, self.env, self.rank_keys, self.agent, self.folder = fn, env, rank_keys, agent, folder
        self.stdout, self.stderr = stdout, stderr
        # torchrun names the failed function in its summary ("run_script_path FAILED")
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __reduce__(self):
        """The agent's stdout and stderr go with it as file descriptors (the fork server
        passes them over its socket: multiprocessing's DupFd)."""
        from multiprocessing import reduction
        return (_rebuild, (self.fn, self.env, self.rank_keys, self.agent, self.folder,
                           reduction.DupFd(1), reduction.DupFd(2)))

    def __call__(self, *args):
        try:
            os.setpgid(0, self.agent)  # the agent's group: stopping the launch kills it too
        except OSError:
            pass
        for fd, target in ((self.stdout, 1), (self.stderr, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # torchrun's _wrap has set this rank's variables; everything else is the agent's
        env = {**self.env, **{k: os.environ[k] for k in self.rank_keys if k in os.environ}}
        os.environ.clear()
        os.environ.update(env)
        as_fresh_interpreter(env)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        _mark_rendezvous(Path(self.folder))
        return self.fn(*args)


def _rebuild(fn, env, rank_keys, agent, folder, stdout, stderr) -> Worker:
    return Worker(fn, env, rank_keys, agent, folder, stdout.detach(), stderr.detach())


def _mark_rendezvous(folder: Path) -> None:
    """rank{R}.pid now (pid and world size), rank{R}.entered and rank{R}.joined around the
    first init_process_group of this worker."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    rank = os.environ.get("RANK", "0")
    (folder / f"rank{rank}.pid").write_text(f"{os.getpid()} {os.environ.get('WORLD_SIZE', '1')}")
    original = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        c10d.init_process_group = dist.init_process_group = original  # the first one only
        (folder / f"rank{rank}.entered").touch()
        result = original(*args, **kwargs)
        (folder / f"rank{rank}.joined").touch()
        return result
    c10d.init_process_group = dist.init_process_group = init_process_group


class RendezvousWatch:
    """Reads the markers of one launch: `overdue()` says (one line) when ranks have not
    all joined their process group `deadline_s` after the first one entered it."""

    def __init__(self, folder: Path, deadline_s: float) -> None:
        self.folder, self.deadline_s = folder, deadline_s
        self.first_entry: float | None = None
        self.done = False

    def ranks(self) -> dict[int, tuple[int, int]]:
        """rank -> (pid, world size) of the workers started so far."""
        found = {}
        for marker in self.folder.glob("rank*.pid"):
            try:
                pid, world = marker.read_text().split()
            except ValueError:  # being written
                continue
            found[int(marker.name[4:-4])] = int(pid), int(world)
        return found

    def _with(self, suffix: str) -> set[int]:
        return {int(m.name[4:-len(suffix) - 1]) for m in self.folder.glob(f"rank*.{suffix}")}

    def overdue(self) -> str | None:
        if self.done:
            return None
        entered, joined, ranks = self._with("entered"), self._with("joined"), self.ranks()
        if not entered:
            return None
        world = max((w for _, w in ranks.values()), default=len(entered))
        if len(joined) >= world:
            self.done = True
            return None
        now = time.monotonic()
        if self.first_entry is None:
            self.first_entry = now
        if now - self.first_entry < self.deadline_s:
            return None
        waiting = sorted(entered - joined)
        absent = [r for r in range(world) if r not in entered]
        what = (f"rank(s) {absent} of {world} never reached init_process_group (waiting inside "
                f"it: {waiting}" if absent else
                f"rank(s) {waiting} of {world} entered init_process_group but did not join (")
        return (f"rendezvous incomplete after {self.deadline_s:.0f} s: {what}; joined: "
                f"{sorted(joined)}); the stacks of every rank follow (DYNMO_TEST_RENDEZVOUS_S "
                "sets the deadline)")

    def dump_stacks(self) -> None:
        """SIGUSR1 to every worker, one rank at a time: faulthandler writes its threads'
        stacks to its stderr, which the ranks share, so dumps at once interleave by the
        character (a CI run lost "in late_rank" that way)."""
        for _, (pid, _) in sorted(self.ranks().items()):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(0.5)   # faulthandler writes from the signal handler, at once


def as_fresh_interpreter(env: dict) -> None:
    """What `python -u -m MODULE` would start with, where a fork of pytest differs:
    sys.path without the folders pytest prepended or the zygote preloaded from (ROOT,
    then PYTHONPATH, then the interpreter's own), warnings as PYTHONWARNINGS says instead
    of pytest's recorder, logging without pytest's handlers, no faulthandler on pytest's
    stderr, and
    multiprocessing's start method not chosen yet.

    The start method: a worker of the fork server is made by multiprocessing's spawn
    preparation, which sets the agent's start method (`forkserver`) as the worker's
    default, where a fresh `python script.py` has none (so `fork` on Linux). Left so,
    every DataLoader of the program under test (Megatron-LM's: 2 persistent workers
    per iterator) started a fresh fork server interpreter that imported the script
    as __main__ (Megatron-LM and all) and unpickled each data worker: ~35 s of a
    Megatron-LM launch's start-up, where a fork of the rank takes well under 1 s."""
    import logging
    import multiprocessing
    import warnings
    tests = ROOT / "tests"
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    site = [p for p in sys.path if p and Path(p).resolve() != ROOT
            and not Path(p).resolve().is_relative_to(tests) and p not in PRELOADED_PATHS]
    sys.path[:] = [str(ROOT), *extra, *site]
    warnings.resetwarnings()
    warnings.showwarning = warnings._showwarning_orig
    for action in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings.simplefilter(action.split(":")[0])
    faulthandler.disable()
    multiprocessing.set_start_method(None, force=True)
    logging.root.handlers.clear()
    for logger in logging.Logger.manager.loggerDict.values():  # torch's handler, made at import
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler:
                handler.setStream(sys.stderr)
