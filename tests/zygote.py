"""Test infrastructure: torchrun launched from a pre-imported process (a zygote), with
every fork made by a single-threaded process.

A fresh interpreter spends ~1.5 s of CPU importing torch and ~3 s importing
Megatron-Core before a rank does anything; the suite starts ranks several hundred
times, and on the 2-core CI machine those imports were about a third of its time.

The zygote is forked from pytest when the session starts (conftest.py), before any
test has run, so it holds none of the state that tests leave in pytest's process
(Megatron-LM's globals, monkeypatches, the CPU compatibility layer is never applied
there). It imports what the workers import (`PRELOAD`), then forks two kinds of child:
  - once, a fork server (multiprocessing's own `forkserver.main`) that forks the workers;
  - per launch, an agent that runs torch's own torchrun (`torch.distributed.run.main`:
    its parser, rendezvous and agent) with `--start-method forkserver --run-path`, its
    fork server being the zygote's (tests/zygote_worker.py carries the agent's
    environment, stdout and stderr over to each worker).
The agent starts threads (its TCPStore server, its monitors); a fork of it could copy a
lock one of them held, held forever in the child (a rank hung 300 s in
_create_c10d_store that way). So the agent never forks: the zygote and the fork server
never start a thread, and tests/fork_guard.py refuses a fork from any of these three
while a second thread runs (the workers, the program under test, fork as they would
under a plain torchrun).

A launch whose ranks have not all joined their process group `DYNMO_TEST_RENDEZVOUS_S`
(60) seconds after the first one entered it is stopped with the ranks that did not join
named and the stacks of every rank (RendezvousTimeout), instead of waiting out its timeout.

What differs from `python -m torch.distributed.run`: the workers share the zygote's
hash seed and start with its imports done (Megatron-LM's training package included, where
DYNMO_MEGATRON_LM names a checkout). DYNMO_TEST_FORK_TORCHRUN=0 launches a
fresh torchrun with fresh workers, exactly as a user would (launch.run_torchrun).
"""
from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fork_guard
from launch import ROOT
from zygote_worker import PRELOADED_PATHS, RendezvousWatch, Worker, as_fresh_interpreter

# What every rank of the launcher imports before its first step (measured with
# PYTHONPROFILEIMPORTTIME on a 2-rank run): Megatron-Core alone is ~3 s of CPU per rank.
PRELOAD = ("megatron.core.models.gpt.gpt_layer_specs", "dynmo_plugin.train",
           "dynmo_plugin.assembly", "dynmo_plugin.controller",
           "dynmo_plugin.megatron.training.model", "dynmo_plugin.megatron.training.trainer",
           "dynmo_plugin.megatron.migration.repack", "dynmo_plugin.megatron.profiling.profiler",
           "torch.distributed.run")
# Megatron-LM's training package, where a checkout is given (DYNMO_MEGATRON_LM): its import
# was ~2.5 s of CPU per rank of each launch of tests/integrations/megatron_lm_harness.py's
# harness. Its root goes on the zygote's sys.path for the import and off the workers'
# (zygote_worker.PRELOADED_PATHS): the harness puts it there itself, as a fresh one does.
MEGATRON_LM_PRELOAD = ("dynmo_plugin.integrations.megatron_lm", "megatron.training.training",
                       "megatron.training.initialize", "gpt_builders", "model_provider")
_WORD = struct.Struct("q")


def rendezvous_deadline() -> float:
    return float(os.environ.get("DYNMO_TEST_RENDEZVOUS_S", "60"))


class RendezvousTimeout(subprocess.TimeoutExpired):
    """A launch stopped because its ranks did not all join their process group in time."""

    def __init__(self, cmd: list[str], timeout: float, line: str, stdout: str, stderr: str) -> None:
        super().__init__(cmd, timeout, stdout, stderr)
        self.line = line

    def __str__(self) -> str:
        return f"{self.line}\n{self.stderr[-30000:]}"


class Zygote:
    """The forked launcher process; `run` is subprocess.run of a torchrun command."""

    def __init__(self) -> None:
        requests, self._requests = os.pipe()
        self._replies, replies = os.pipe()
        self.pid = fork_guard.fork()  # refused if pytest runs a second thread
        if self.pid == 0:
            os.close(self._requests), os.close(self._replies)
            _serve(requests, replies)  # never returns
        os.close(requests), os.close(replies)

    def run(self, args: list[str], env: dict, timeout: float,
            rendezvous_s: float | None = None) -> subprocess.CompletedProcess:
        """torchrun ARGS with `env` in cwd ROOT, stdout and stderr captured; on timeout
        the agent is stopped as on a Ctrl-C, then killed with what is left. A rendezvous
        that does not complete in `rendezvous_s` raises RendezvousTimeout."""
        folder = Path(tempfile.mkdtemp(prefix="dynmo-launch-"))
        try:
            out, err = folder / "stdout", folder / "stderr"
            out.touch(), err.touch()
            payload = pickle.dumps((args, env, str(out), str(err), str(folder)))
            _write_all(self._requests, _WORD.pack(len(payload)) + payload)
            agent = self._read_word()
            watch = RendezvousWatch(folder, rendezvous_deadline() if rendezvous_s is None else rendezvous_s)
            try:
                status, late = self._wait(agent, watch, time.monotonic() + timeout)
            except BaseException:
                # interrupted before the agent's status was read (pytest-timeout's alarm,
                # Ctrl-C): stop it and read that status, or the next launch would read it
                _stop(agent)
                self._read_word()
                raise
            text = [p.read_bytes().decode(errors="replace") for p in (out, err)]
            if status is None:
                raise subprocess.TimeoutExpired(["torchrun", *args], timeout, *text)
            if late is not None:
                raise RendezvousTimeout(["torchrun", *args], timeout, late, *text)
            return subprocess.CompletedProcess(["torchrun", *args], os.waitstatus_to_exitcode(status), *text)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait(self, agent: int, watch: RendezvousWatch, deadline: float) -> tuple[int | None, str | None]:
        """(the agent's wait status or None if it ran past the deadline, the rendezvous
        line if it was stopped for that)."""
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(0.0, min(1.0, left)))
            if ready:  # each return reads the status last: nothing can interrupt after it
                return self._read_word(), None
            if left <= 0:
                _stop(agent)
                self._read_word()  # the zygote reaped it
                return None, None
            if (late := watch.overdue()) is not None:
                watch.dump_stacks()
                time.sleep(3)  # faulthandler writes at once; leave the loaded machine time
                _stop(agent)
                return self._read_word(), late

    def _read_word(self) -> int:
        data = _read_exact(self._replies, _WORD.size)
        if len(data) < _WORD.size:
            raise RuntimeError("the test launcher process (tests/zygote.py) died; run with "
                               "DYNMO_TEST_FORK_TORCHRUN=0 to launch fresh torchruns")
        return _WORD.unpack(data)[0]


def _stop(agent: int) -> None:
    """SIGTERM to the agent (it stops its workers, as on a Ctrl-C), then SIGKILL to what is
    left of its group (the workers joined it). Either may find it gone: it can end, and the
    zygote reap it, just as the timeout expires (the caller still reads the status the
    zygote sent)."""
    try:
        os.kill(agent, signal.SIGTERM)
        time.sleep(5)
        os.killpg(agent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _serve(requests: int, replies: int) -> None:
    """The zygote: import PRELOAD, start the fork server, then one agent per request until
    pytest closes the pipe. Never returns; a failure is printed to pytest's stderr (the
    launches then raise 'the test launcher process died')."""
    fork_guard.install()
    # torch starts an OpenMP thread as it loads unless OMP_NUM_THREADS is 1, and a zygote
    # running two threads may not fork (a plain `pytest` without it left none): loaded
    # with one, as every launch's workers run (launch.torchrun's environment)
    os.environ["OMP_NUM_THREADS"] = "1"
    server = None
    try:
        _preload()
        server = _start_worker_server(close=(requests, replies))
        while header := _read_exact(requests, _WORD.size):
            args, env, out, err, folder = pickle.loads(_read_exact(requests, _WORD.unpack(header)[0]))
            agent = os.fork()
            if agent == 0:
                os.close(requests), os.close(replies)
                _agent(args, env, out, err, folder)  # never returns
            os.write(replies, _WORD.pack(agent))
            os.write(replies, _WORD.pack(os.waitpid(agent, 0)[1]))
    except BaseException:  # noqa: BLE001 - printed, then the zygote ends
        import traceback
        traceback.print_exc()
    finally:
        if server is not None:
            shutil.rmtree(os.path.dirname(server), ignore_errors=True)
        os._exit(0)


def _preload() -> None:
    """Imports only: the CPU compatibility layer and everything else that changes torch's
    state is applied by each worker, never here. A failed import is left to the worker,
    which reports it."""
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for name in PRELOAD:
                importlib.import_module(name)
            if source := os.environ.get("DYNMO_MEGATRON_LM"):
                from dynmo_plugin.integrations import megatron_lm
                PRELOADED_PATHS.append(megatron_lm.use_source(source))
                for name in MEGATRON_LM_PRELOAD:
                    importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the workers import it again and fail loudly
            return


def _start_worker_server(close: tuple[int, ...]) -> str:
    """Fork multiprocessing's fork server from the zygote (it inherits the imports) and
    make it this process's - and so every agent's - `forkserver` start method. The
    resource tracker (named semaphores of torchrun's queues) is started once here too.
    Returns the server's socket address."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker
    resource_tracker.ensure_running()  # fork+exec, as subprocess does: no Python fork
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                fork_guard.install()  # it forks the workers
                for fd in (*close, alive_w):
                    os.close(fd)
                forkserver.main(listener.fileno(), alive_r, [])  # until the zygote ends
            finally:
                os._exit(0)
        os.close(alive_r)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return address


def _agent(args: list[str], env: dict, out: str, err: str, folder: str) -> None:
    """The forked agent: torchrun's main with `env`, cwd ROOT, stdout/stderr to the files;
    exits with torchrun's status (1 and the traceback when a rank failed, as torchrun)."""
    import traceback
    from multiprocessing import util
    code = 1
    try:
        fork_guard.install()  # it runs threads: a fork (--start-method fork) is refused
        os.setpgid(0, 0)  # its own group, which the workers join: a timeout kills them all
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env)
        os.dup2(os.open(out, os.O_WRONLY), 1)
        os.dup2(os.open(err, os.O_WRONLY), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        as_fresh_interpreter(env)
        _workers_from_the_server(folder)
        args = worker_args(args)
        sys.argv = ["torchrun", *args]
        from torch.distributed.run import main
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        traceback.print_exc()
    finally:
        util._run_finalizers(0)  # unlink the named semaphores of torchrun's queues
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _workers_from_the_server(folder: str) -> None:
    """In the agent: the `forkserver` start method uses the zygote's fork server (the
    agent is not its parent, so it is checked with a signal 0, not waitpid), and torchrun's
    entrypoint reaches each worker wrapped in zygote_worker.Worker."""
    import types
    from multiprocessing import forkserver, resource_tracker

    from torch.distributed.elastic.agent.server import local_elastic_agent
    server = forkserver._forkserver

    def ensure_running() -> None:
        resource_tracker.ensure_running()
        try:
            os.kill(server._forkserver_pid, 0)
        except ProcessLookupError:
            raise RuntimeError("the launcher's fork server (tests/zygote.py) died; run with "
                               "DYNMO_TEST_FORK_TORCHRUN=0 to launch fresh torchruns") from None
    server.ensure_running = ensure_running
    # what spawn.get_preparation_data sends: no __main__ to re-import in the workers
    sys.modules["__main__"] = types.ModuleType("__main__")
    start_processes = local_elastic_agent.start_processes

    def start_with_workers(**kwargs):
        keys = frozenset().union(*kwargs["envs"].values())  # torchrun's per-rank variables
        # the agent's environment now, as a fork would copy it (torchrun may have set
        # OMP_NUM_THREADS in it)
        kwargs["entrypoint"] = Worker(kwargs["entrypoint"], dict(os.environ), keys, os.getpid(), folder)
        return start_processes(**kwargs)
    local_elastic_agent.start_processes = start_with_workers


def worker_args(args: list[str]) -> list[str]:
    """torchrun ARGS whose workers come from the fork server instead of fresh interpreters:
    torchrun's own `--run-path` with `--start-method forkserver`; `-m MODULE` becomes the
    module's file (its imports are absolute, so runpy runs it the same)."""
    import importlib.util
    for i, token in enumerate(args):
        if token in ("-m", "--module"):
            path = importlib.util.find_spec(args[i + 1]).origin
            return ["--start-method", "forkserver", *args[:i], "--run-path", path, *args[i + 2:]]
        if token.endswith(".py"):
            return ["--start-method", "forkserver", *args[:i], "--run-path", token, *args[i + 1:]]
    raise ValueError(f"no -m MODULE or SCRIPT.py in the torchrun arguments {args}")


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
