"""Test infrastructure: torchrun launched from a pre-imported process (a zygote).

A fresh interpreter spends ~1.5 s of CPU importing torch and ~3 s importing
Megatron-Core before a rank does anything; the suite starts ranks several hundred
times, and on the 2-core CI machine those imports were about a third of its time.

The zygote is forked from pytest when the session starts (conftest.py), before any
test has run, so it holds none of the state that tests leave in pytest's process
(Megatron-LM's globals, monkeypatches, the CPU compatibility layer is never applied
there). It imports what the workers import (`PRELOAD`) and then, per launch, forks
an agent that runs torch's own torchrun (`torch.distributed.run.main`: its parser,
rendezvous and agent), whose workers are forked from it in turn: torchrun's
`--run-path SCRIPT --start-method fork`, the script or module run through runpy.

What differs from `python -m torch.distributed.run`: the workers share the zygote's
hash seed and start with its imports done. DYNMO_TEST_FORK_TORCHRUN=0 launches a
fresh torchrun with fresh workers, exactly as a user would (launch.run_torchrun).
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import ROOT
# What every rank of the launcher imports before its first step (measured with
# PYTHONPROFILEIMPORTTIME on a 2-rank run): Megatron-Core alone is ~3 s of CPU per rank.
PRELOAD = ("megatron.core.models.gpt.gpt_layer_specs", "dynmo_plugin.train",
           "dynmo_plugin.assembly", "dynmo_plugin.controller",
           "dynmo_plugin.megatron.training.model", "dynmo_plugin.megatron.training.trainer",
           "dynmo_plugin.megatron.migration.repack", "dynmo_plugin.megatron.profiling.profiler")
_WORD = struct.Struct("q")


class Zygote:
    """The forked launcher process; `run` is subprocess.run of a torchrun command."""

    def __init__(self) -> None:
        requests, self._requests = os.pipe()
        self._replies, replies = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._requests), os.close(self._replies)
            _serve(requests, replies)  # never returns
        os.close(requests), os.close(replies)

    def run(self, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """torchrun ARGS with `env` in cwd ROOT, stdout and stderr captured; on timeout
        the agent is stopped as on a Ctrl-C, then killed with what is left."""
        with tempfile.NamedTemporaryFile() as out, tempfile.NamedTemporaryFile() as err:
            payload = pickle.dumps((args, env, out.name, err.name))
            _write_all(self._requests, _WORD.pack(len(payload)) + payload)
            agent = self._read_word()
            ready, _, _ = select.select([self._replies], [], [], timeout)
            if not ready:
                _stop(agent)
                self._read_word()  # the zygote reaped it
                raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
            status = self._read_word()
            return subprocess.CompletedProcess(
                ["torchrun", *args], os.waitstatus_to_exitcode(status),
                Path(out.name).read_bytes().decode(errors="replace"),
                Path(err.name).read_bytes().decode(errors="replace"))

    def _read_word(self) -> int:
        data = _read_exact(self._replies, _WORD.size)
        if len(data) < _WORD.size:
            raise RuntimeError("the test launcher process (tests/zygote.py) died; run with "
                               "DYNMO_TEST_FORK_TORCHRUN=0 to launch fresh torchruns")
        return _WORD.unpack(data)[0]


def _stop(agent: int) -> None:
    """SIGTERM to the agent (it stops its workers, as on a Ctrl-C), then SIGKILL to what is
    left of its group. Either may find it gone: it can end, and the zygote reap it, just
    as the timeout expires (the caller still reads the status the zygote sent)."""
    try:
        os.kill(agent, signal.SIGTERM)
        time.sleep(5)
        os.killpg(agent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _serve(requests: int, replies: int) -> None:
    """The zygote: import PRELOAD, then one agent per request until pytest closes the
    pipe. Never returns."""
    try:
        _preload()
        while header := _read_exact(requests, _WORD.size):
            args, env, out, err = pickle.loads(_read_exact(requests, _WORD.unpack(header)[0]))
            agent = os.fork()
            if agent == 0:
                os.close(requests), os.close(replies)
                _agent(args, env, out, err)  # never returns
            os.write(replies, _WORD.pack(agent))
            os.write(replies, _WORD.pack(os.waitpid(agent, 0)[1]))
    finally:
        os._exit(0)


def _preload() -> None:
    """Imports only: the CPU compatibility layer and everything else that changes torch's
    state is applied by each worker, never here. A failed import is left to the worker,
    which reports it."""
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the workers import it again and fail loudly
                return


def _agent(args: list[str], env: dict, out: str, err: str) -> None:
    """The forked agent: torchrun's main with `env`, cwd ROOT, stdout/stderr to the files;
    exits with torchrun's status (1 and the traceback when a rank failed, as torchrun)."""
    import traceback
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the agent with what is left
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env)
        os.dup2(os.open(out, os.O_WRONLY), 1)
        os.dup2(os.open(err, os.O_WRONLY), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        _as_fresh_interpreter(env)
        args = fork_workers(args)
        sys.argv = ["torchrun", *args]
        from torch.distributed.run import main
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_workers(args: list[str]) -> list[str]:
    """torchrun ARGS whose workers are forked from the agent instead of started as fresh
    interpreters: torchrun's own `--run-path` with `--start-method fork`; `-m MODULE`
    becomes the module's file (its imports are absolute, so runpy runs it the same)."""
    import importlib.util
    for i, token in enumerate(args):
        if token in ("-m", "--module"):
            path = importlib.util.find_spec(args[i + 1]).origin
            return ["--start-method", "fork", *args[:i], "--run-path", path, *args[i + 2:]]
        if token.endswith(".py"):
            return ["--start-method", "fork", *args[:i], "--run-path", token, *args[i + 1:]]
    raise ValueError(f"no -m MODULE or SCRIPT.py in the torchrun arguments {args}")


def _as_fresh_interpreter(env: dict) -> None:
    """What `python -u -m MODULE` would start with, where a fork of pytest differs:
    sys.path without the folders pytest prepended (ROOT, then PYTHONPATH, then the
    interpreter's own), warnings as PYTHONWARNINGS says instead of pytest's recorder,
    logging without pytest's handlers, no faulthandler on pytest's stderr."""
    import faulthandler
    import logging
    import warnings
    tests = ROOT / "tests"
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    site = [p for p in sys.path if p and Path(p).resolve() != ROOT
            and not Path(p).resolve().is_relative_to(tests)]
    sys.path[:] = [str(ROOT), *extra, *site]
    warnings.resetwarnings()
    warnings.showwarning = warnings._showwarning_orig
    for action in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings.simplefilter(action.split(":")[0])
    faulthandler.disable()
    logging.root.handlers.clear()
    for logger in logging.Logger.manager.loggerDict.values():  # torch's handler, made at import
        for handler in getattr(logger, "handlers", []):
            if type(handler) is logging.StreamHandler:
                handler.setStream(sys.stderr)


def _read_exact(fd: int, n: int) -> bytes:
    """n bytes from the pipe, or fewer when it closed."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
