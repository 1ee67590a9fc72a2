"""A run killed and resumed into the same --output keeps every logged iteration
(issue 28: the restart truncated report.jsonl, iterations 1-8 of the killed run gone)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dynmo_plugin.report import RunReport, read_report, replay_log

from launch import ROOT, free_port


def _torchrun(flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "dynmo_plugin.train", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=False)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own,
    so killing torchrun's process group leaves them running)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.isdigit():
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _logged_iterations(log: Path) -> list[int]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a line cut short
        if obj.get("kind") == "iteration":
            out.append(obj["record"]["iteration"])
    return out


def test_killed_run_resumed_into_the_same_output_keeps_both_segments(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    flags = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--save", str(ckpt),
             "--output", str(out)]
    # 400 iterations: far more than run in the moment between seeing iteration 5 and the kill
    proc = _torchrun([*flags, "--train-iters", "400", "--save-interval", "2"])
    log = out / "report.jsonl"
    try:
        while proc.poll() is None and max(_logged_iterations(log), default=0) < 5:
            time.sleep(0.05)
        for pid in [*_descendants(proc.pid), proc.pid]:  # both workers, then torchrun, mid-run
            os.kill(pid, signal.SIGKILL)
    finally:
        proc.communicate()
    killed = _logged_iterations(log)
    assert killed and max(killed) < 400, "the first run finished before it was killed"

    proc = _torchrun([*flags, "--train-iters", "30", "--save-interval", "100", "--load", str(ckpt)])
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    (resume,) = [e for e in report["events"] if e["kind"] == "resume"]
    at = resume["iteration"]
    assert 2 <= at < max(killed) and at % 2 == 0
    first = [r for r in report["iterations"] if r.get("segment", 0) == 0]
    second = [r for r in report["iterations"] if r.get("segment") == 1]
    assert [r["iteration"] for r in first] == killed            # nothing of the killed run lost
    assert [r["iteration"] for r in second] == list(range(at + 1, 31))
    assert [r["iteration"] for r in first if r.get("repeated")] == [i for i in killed if i > at]
    assert resume["repeated"] == ([at + 1, max(killed)] if max(killed) > at else None)
    # the log replays to the same iterations (a reader of an unfinished run sees the same)
    assert replay_log(log)["iterations"] == report["iterations"]
    assert read_report(out)["iterations"] == report["iterations"]


def test_a_fresh_run_moves_an_old_log_aside(tmp_path):
    path = str(tmp_path / "report.json")
    world = {"pp": 1, "history": [{"iteration": 0, "pp": 1, "world_size": 1}]}
    first = RunReport(path=path, config={}, world=world, initial_layout="EttL")
    first.add_iteration(1, 1.0, 0.1)
    first.close()
    RunReport(path=path, config={}, world=dict(world), initial_layout="EttL").close()
    assert _logged_iterations(tmp_path / "report.jsonl.1") == [1]
    assert _logged_iterations(tmp_path / "report.jsonl") == []
