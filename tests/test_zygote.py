"""The test launcher (tests/zygote.py): torchrun runs whose workers are forked from a
pre-imported process train exactly as fresh interpreters do, fail as they do, and a
launch that runs past its timeout is stopped without leaving the launcher out of step."""
import os
import signal
import subprocess
import time

import pytest

import launch
from launch import SMALL_MODEL, assert_same_training, free_port, run_torchrun, worker

FLAGS = SMALL_MODEL + ["--train-iters", "5", "--dynmo", "--test-dump-params",
                       "--pipeline-model-parallel-size", "2",
                       "--dynmo-forced-layouts", "3:Etttttt|ttL"]

needs_zygote = pytest.mark.skipif(launch.ZYGOTE is None, reason="no zygote (DYNMO_TEST_FORK_TORCHRUN=0)")


@needs_zygote
@pytest.mark.multiproc
def test_forked_workers_train_like_fresh_interpreters(tmp_path, monkeypatch):
    """A migration run (2 stages, a forced move at iteration 3): the same losses to the
    last bit, the same parameters and the same moves from both launchers."""
    forked = worker(2, FLAGS, tmp_path / "forked")
    monkeypatch.setattr(launch, "ZYGOTE", None)  # run_torchrun: `python -m torch.distributed.run`
    fresh = worker(2, FLAGS, tmp_path / "fresh")
    assert_same_training(tmp_path / "forked", forked, tmp_path / "fresh", fresh, ranks=(0, 1))
    moves = [[(m["layer"], m["src"], m["dst"]) for m in e.get("moves", [])] for e in forked["events"]]
    assert moves == [[(m["layer"], m["src"], m["dst"]) for m in e.get("moves", [])]
                     for e in fresh["events"]]
    assert forked["layout"] == fresh["layout"] == "Etttttt|ttL"


def _sleeper(tmp_path):
    """torchrun arguments (a fresh port each call) for a 2-rank script: each rank prints,
    then sleeps, or with --fail waits until both ranks printed (a file each) and exits 3.
    The wait: torchrun stops the other rank at the first failure, which under load came
    before rank 1 had printed (CI run of 2026-11-28: ['', 'rank 0'])."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nfrom pathlib import Path\n"
                      "print('rank', os.environ['RANK'], flush=True)\n"
                      "if sys.argv[1:] != ['--fail']:\n    time.sleep(600)\n"
                      f"Path({str(tmp_path)!r}, 'printed' + os.environ['RANK']).touch()\n"
                      f"while len(list(Path({str(tmp_path)!r}).glob('printed*'))) < 2:\n"
                      "    time.sleep(0.05)\n"
                      "sys.exit(3)\n")

    def args(*extra):
        return ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), str(script), *extra]
    return args


@needs_zygote
@pytest.mark.multiproc
def test_a_launch_past_its_timeout_is_stopped_and_the_next_one_runs(tmp_path):
    args, env = _sleeper(tmp_path), {**os.environ, "PYTHONWARNINGS": "ignore"}
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(args(), env, timeout=3)
    failed = run_torchrun(args("--fail"), env, timeout=120)
    assert failed.returncode == 1 and "exitcode  : 3" in failed.stderr, failed.stderr[-2000:]
    assert sorted(failed.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]


class Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise Interrupted


@needs_zygote
@pytest.mark.multiproc
def test_a_launch_interrupted_by_an_alarm_leaves_the_next_one_in_step(tmp_path):
    """pytest-timeout stops a test with SIGALRM raising in the main thread, which may be
    waiting on a launch: that launch is stopped and its status read, so the next launch
    reads its own (it read the stale one: a wrong pid and exit code)."""
    args, env = _sleeper(tmp_path), {**os.environ, "PYTHONWARNINGS": "ignore"}
    previous = signal.signal(signal.SIGALRM, _interrupt)
    started = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, 3)  # pytest-timeout's own alarm, if any
    try:
        with pytest.raises(Interrupted):
            run_torchrun(args(), env, timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:  # give pytest-timeout its alarm back
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - started), 0.01))
    failed = run_torchrun(args("--fail"), env, timeout=120)
    assert failed.returncode == 1 and "exitcode  : 3" in failed.stderr, failed.stderr[-2000:]


@needs_zygote
@pytest.mark.multiproc
def test_a_workers_multiprocessing_starts_as_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """A worker of the fork server is made by multiprocessing's spawn preparation, which
    gave it the agent's start method (forkserver) as its default: every DataLoader of the
    program under test then started a fresh fork server interpreter importing the script
    (Megatron-LM's 2 persistent data workers per iterator: ~35 s of a Megatron-LM launch).
    With no start method chosen, as in a fresh `python script.py`, a Process of the
    default context is a fork of the rank itself, in both launchers."""
    script = tmp_path / "children.py"
    script.write_text(
        "import multiprocessing as mp, os\n"
        "chosen = mp.get_start_method(allow_none=True)\n"
        "child = mp.Process(target=os._exit, args=(0,)); child.start(); child.join()\n"
        # one write per line: torchrun runs its workers unbuffered (python -u), where print
        # writes each piece apart and two ranks' lines interleaved ('rankrank 1 ...')
        "os.write(1, f\"rank {os.environ['RANK']} {chosen} {mp.get_start_method()} child exit "
        "{child.exitcode}\\n\".encode())\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def launch_children() -> list[str]:
        proc = run_torchrun(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                             str(free_port()), str(script)], env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return sorted(proc.stdout.splitlines())
    forked = launch_children()
    monkeypatch.setattr(launch, "ZYGOTE", None)  # a fresh `python -m torch.distributed.run`
    assert forked == launch_children() == [f"rank {r} None fork child exit 0" for r in (0, 1)]
