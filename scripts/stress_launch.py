"""Stress the test launcher (tests/launch.py, tests/zygote.py): N back-to-back launches of
a tiny gloo job (or, with --train, of the real training launcher), counting the launches
that hung, failed or passed. Not part of CI: a hang that shows once in a few hundred
launches needs hundreds of launches to be seen.

    python scripts/stress_launch.py [--launches 200] [--nproc 4] [--timeout 120] [--train]

A hang is a launch that ran past --timeout (or, with the rendezvous deadline of the
launcher, one it stopped with the ranks that did not join named). The last line is a JSON
record (launches, ok, hangs, failures, total_s, per_launch_s: median, min, max, and
cpu_per_launch_s: the CPU seconds the zygote and what it forked - agents, fork server,
workers - spent per launch, which a loaded machine disturbs far less than wall time).
DYNMO_TEST_FORK_TORCHRUN=0 measures fresh torchruns instead of the zygote.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this tree's dynmo_plugin, not an installed one

import launch  # noqa: E402  (needs the path above)

# A rendezvous and a collective: what every multi-process test starts with.
TINY = """\
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
assert t.tolist() == [n * (n + 1) / 2] * 4, t
dist.barrier()
dist.destroy_process_group()
print("rank", os.environ["RANK"], "ok", flush=True)
"""
TRAIN = launch.SMALL_MODEL + ["--train-iters", "1", "--pipeline-model-parallel-size", "2"]


def launch_once(nproc: int, timeout: float, script: Path, out: Path, train: bool) -> tuple[str, str]:
    """('ok' | 'hang' | 'failed', detail) of one launch."""
    try:
        if train:
            proc = launch.torchrun(nproc, TRAIN, out, timeout=timeout, check=False)
        else:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            proc = launch.run_torchrun(launch_args(nproc, script), env, timeout)
    except subprocess.TimeoutExpired as e:
        return "hang", str(e).splitlines()[0]
    if proc.returncode != 0:
        return "failed", f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    if not train and sorted(proc.stdout.splitlines()) != [f"rank {r} ok" for r in range(nproc)]:
        return "failed", f"stdout of the ranks missing: {proc.stdout!r}"
    return "ok", ""


def launcher_cpu_s() -> float:
    """CPU seconds (user + system) of the zygote, of its live children (the fork server)
    and of every process they reaped (agents, workers), from /proc; 0 without a zygote."""
    if launch.ZYGOTE is None:
        return 0.0
    zygote = launch.ZYGOTE.pid
    try:
        children = Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split()
    except OSError:
        return 0.0
    total = 0
    for pid in [zygote, *map(int, children)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # an agent that just ended
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def launch_args(nproc: int, script: Path) -> list[str]:
    return ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(launch.free_port()), str(script)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a launch counts as hung")
    parser.add_argument("--train", action="store_true", help="launch dynmo_plugin.train (1 iteration, PP=2)")
    opts = parser.parse_args()
    launch.start_zygote()
    counts = {"ok": 0, "hang": 0, "failed": 0}
    times: list[float] = []
    cpu: list[float] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "tiny_rendezvous.py"
        script.write_text(TINY)
        for i in range(opts.launches):
            t0, c0 = time.perf_counter(), launcher_cpu_s()
            outcome, detail = launch_once(opts.nproc, opts.timeout, script, Path(tmp) / f"run{i}", opts.train)
            times.append(time.perf_counter() - t0)
            cpu.append(launcher_cpu_s() - c0)
            counts[outcome] += 1
            if outcome != "ok":
                print(f"launch {i}: {outcome} after {times[-1]:.1f} s: {detail}", file=sys.stderr, flush=True)
            if (i + 1) % 10 == 0:
                print(f"{i + 1} launches: {counts}", flush=True)
    total = time.perf_counter() - start
    record = {"launches": opts.launches, "nproc": opts.nproc, "train": opts.train,
              "zygote": launch.ZYGOTE is not None, **counts, "hangs": counts.pop("hang"),
              "total_s": round(total, 1),
              "per_launch_s": {"median": round(statistics.median(times), 3),
                               "min": round(min(times), 3), "max": round(max(times), 3)},
              "cpu_per_launch_s": {"median": round(statistics.median(cpu[1:] or cpu), 3),
                                   "min": round(min(cpu[1:] or cpu), 3)},
              "loadavg": os.getloadavg()}
    record.pop("hang", None)
    print(json.dumps(record))
    return 0 if record["hangs"] == record["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
