"""No fork from a multi-threaded process in the test launcher (tests/fork_guard.py), a
rendezvous that does not complete is stopped with the ranks named (tests/zygote_worker.py),
and a launch whose port was taken is relaunched (tests/launch.py).

The guard runs in a fresh interpreter (installing it in pytest's own process would
guard every later test); the launches run through the real zygote and torchrun."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from launch import free_port, run_torchrun
from zygote import RendezvousTimeout

TESTS = Path(__file__).resolve().parent
needs_zygote = pytest.mark.skipif(launch.ZYGOTE is None, reason="no zygote (DYNMO_TEST_FORK_TORCHRUN=0)")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"})


def test_a_fork_after_starting_a_thread_raises_with_one_line():
    """A Python thread is running: os.fork raises before any child exists; once it has
    ended, the same process forks."""
    proc = _python(
        "import os, threading, fork_guard\n"
        "fork_guard.install()\n"
        "stop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait, name='monitor'); t.start()\n"
        "try:\n"
        "    pid = os.fork()\n"
        "    print('forked', pid, flush=True)\n"
        "    os._exit(0) if pid == 0 else os.waitpid(pid, 0)\n"
        "except fork_guard.ForkWithThreadsError as e:\n"
        "    print(e)\n"
        "stop.set(); t.join()\n"
        "import time; time.sleep(0.2)\n"
        "pid = os.fork()\n"
        "os._exit(7) if pid == 0 else print('after', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == "after 7", lines
    assert lines[0].startswith("fork refused in pid ") and "2 native threads (2 Python: main, monitor)" in lines[0]
    assert "forked" not in proc.stdout


def test_a_native_thread_python_does_not_know_is_counted():
    """A TCPStore server (what torchrun's agent runs) starts a C++ thread that
    threading.active_count() does not see; /proc/self/task does, and the fork is refused."""
    proc = _python(
        "import os, threading, fork_guard\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "fork_guard.install()\n"
        "store = dist.TCPStore('127.0.0.1', 0, 1, True, timedelta(seconds=30))\n"
        "print(threading.active_count())\n"
        "try:\n"
        "    pid = os.fork()\n"
        "    os._exit(0) if pid == 0 else print('forked')\n"
        "except fork_guard.ForkWithThreadsError as e:\n"
        "    print(e)\n")
    assert proc.returncode == 0, proc.stderr
    python_threads, line = proc.stdout.splitlines()
    assert python_threads == "1" and line.startswith("fork refused in pid ") and "(1 Python: main)" in line


def test_a_fork_that_bypasses_os_fork_aborts_with_the_line():
    """A subprocess with preexec_fn forks in C (not through os.fork): the at-fork handler
    cannot stop it, so the process aborts, the line on its stderr, no child started."""
    proc = _python(
        "import subprocess, threading, fork_guard\n"
        "fork_guard.install()\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "subprocess.run(['echo', 'child ran'], preexec_fn=lambda: None)\n")
    assert proc.returncode == -6, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines()[0].startswith("fork refused in pid "), proc.stderr
    assert "child ran" not in proc.stdout


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.py"
    script.write_text(body)
    return script


def _args(script: Path, *torchrun: str) -> list[str]:
    return [*torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(script)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@needs_zygote
@pytest.mark.multiproc
def test_the_agent_forking_its_workers_is_refused(tmp_path):
    """The design this launcher replaced - torchrun's agent (its TCPStore server and
    monitors running) forking the workers, `--start-method fork` - fails at once with the
    guard's line instead of risking a copied lock; the next launch runs."""
    script = _script(tmp_path, "import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    refused = run_torchrun(_args(script, "--start-method", "fork"), ENV, timeout=120)
    assert refused.returncode == 1 and "fork refused in pid " in refused.stderr, refused.stderr[-3000:]
    assert refused.stdout == ""
    ok = run_torchrun(_args(script), ENV, timeout=120)
    assert ok.returncode == 0 and sorted(ok.stdout.splitlines()) == ["rank 0", "rank 1"], ok.stderr[-3000:]


@needs_zygote
@pytest.mark.multiproc
def test_workers_are_forked_by_a_single_threaded_process(tmp_path):
    """Each worker's parent (the fork server) runs one thread; the agent - the leader of
    the worker's process group - runs several, and is not the parent."""
    script = _script(tmp_path, (
        "import os\n"
        "parent, agent = os.getppid(), os.getpgid(0)\n"
        "print(os.environ['RANK'], len(os.listdir(f'/proc/{parent}/task')), parent != agent,\n"
        "      len(os.listdir(f'/proc/{agent}/task')) > 1, flush=True)\n"))
    proc = run_torchrun(_args(script), ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.splitlines()) == ["0 1 True True", "1 1 True True"]


@needs_zygote
@pytest.mark.multiproc
def test_a_rank_that_does_not_join_ends_the_launch_with_its_name_and_every_stack(tmp_path, monkeypatch):
    """Rank 1 sleeps before init_process_group while rank 0 waits inside it: 5 s after rank
    0 entered (DYNMO_TEST_RENDEZVOUS_S=5), the launch is stopped - not at its 300 s timeout - with
    one line naming rank 1 and both ranks' stacks (faulthandler on SIGUSR1)."""
    monkeypatch.setenv("DYNMO_TEST_RENDEZVOUS_S", "5")
    script = _script(tmp_path, (
        "import os, time\n"
        "import torch.distributed as dist\n"
        "def late_rank():\n"
        "    time.sleep(600)\n"
        "if os.environ['RANK'] == '1':\n"
        "    late_rank()\n"
        "dist.init_process_group('gloo')\n"))
    with pytest.raises(RendezvousTimeout) as stopped:
        run_torchrun(_args(script), ENV, timeout=300)
    message = str(stopped.value)
    assert message.splitlines()[0] == (
        "rendezvous incomplete after 5 s: rank(s) [1] of 2 never reached init_process_group (waiting "
        "inside it: [0]; joined: []); the stacks of every rank follow (DYNMO_TEST_RENDEZVOUS_S sets "
        "the deadline)")
    dumps = stopped.value.stderr
    assert dumps.count("most recent call first") >= 2, dumps[-3000:]
    assert "in late_rank" in dumps and "in init_process_group" in dumps, dumps[-3000:]


@pytest.mark.multiproc
def test_a_launch_whose_port_was_taken_is_relaunched_on_another(tmp_path, capsys):
    """Another process binds the port free_port() found before torchrun's store does (a
    listening socket here): the store fails with EADDRINUSE before any worker starts, and
    the launch runs again on a new port, the reason printed."""
    script = _script(tmp_path, "import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = _args(script)
        args[args.index("--master-port") + 1] = str(port)
        proc = run_torchrun(args, ENV, timeout=120)
    assert proc.returncode == 0 and sorted(proc.stdout.splitlines()) == ["rank 0", "rank 1"], proc.stderr[-3000:]
    logged = capsys.readouterr().err.splitlines()
    assert len(logged) == 1 and logged[0].startswith(f"tests/launch.py: torchrun's store could not bind port {port} ")


@needs_zygote
@pytest.mark.multiproc
def test_a_worker_running_threads_forks_as_under_a_plain_torchrun(tmp_path):
    """The guard is the launcher's: a worker is the program under test, and one running
    threads may fork as under a plain torchrun (Megatron-Core's checkpoint writer does)."""
    script = _script(tmp_path, (
        "import multiprocessing as mp, os, threading\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "child = mp.get_context('fork').Process(target=print, args=('child of', os.environ['RANK']))\n"
        "child.start(); child.join()\n"
        "print('rank', os.environ['RANK'], child.exitcode, flush=True)\n"))
    proc = run_torchrun(_args(script), ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.splitlines()) == ["child of 0", "child of 1", "rank 0 0", "rank 1 0"]


@needs_zygote
@pytest.mark.multiproc
def test_the_zygote_forks_when_pytest_runs_without_omp_num_threads(tmp_path):
    """torch starts an OpenMP thread as it loads unless OMP_NUM_THREADS=1: a zygote that
    imported it so could not fork its fork server, and every launch of a plain `pytest`
    (no OMP_NUM_THREADS) failed with 'the test launcher process died'."""
    script = _script(tmp_path, "import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    code = ("import os, launch\n"
            "os.environ.pop('OMP_NUM_THREADS')\n"
            "launch.start_zygote()\n"
            f"proc = launch.run_torchrun({_args(script)!r}, dict(os.environ), 120)\n"
            "print(proc.returncode, sorted(proc.stdout.split()), flush=True)\n")
    proc = _python(code)
    assert proc.stdout.splitlines() == ["0 ['0', '1', 'rank', 'rank']"], proc.stderr[-3000:]
