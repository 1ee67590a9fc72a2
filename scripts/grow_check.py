#!/usr/bin/env python
"""The simulator's grow prediction against a live 4-rank CPU run (issue 38).

Launches configs/grow_check.yaml on 4 ranks (torchrun, gloo): an 8-layer GPT on 4
stages freezes layers 1-6 at iteration 6, runs frozen on 4 stages, and at iteration 13
repacks onto 2 stages whose freed ranks grow data parallelism to 2. Then replays the
run with the simulator (`dynmo simulate --from-run DIR --cores N`, sim.run_replay)
and prints tokens/s after the grow over before it, predicted and measured.

This machine is shared: other sessions' work takes cores from the run, and more in
one stretch than in another. While the run goes, a sampler (LoadSampler) reads every
0.2 s the machine's busy CPU time (/proc/stat), the CPU time of this process and its
descendants (the run's ranks; the process tree rescanned every second, ~4 ms of CPU
each) and the iteration in progress (report.jsonl's lines);
the difference is the foreign load per iteration, and the replay predicts each
iteration on the cores it left (a stretch: the median, as measured). Both figures are printed: the plain one (what
`dynmo simulate --from-run DIR --cores 2` prints) and the load-corrected one.

    .venv/bin/python scripts/grow_check.py                 # ~1 min; prints the ratio
    .venv/bin/python scripts/grow_check.py --keep DIR --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import descendants  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grow_check.yaml"
TOLERANCE = 0.25
"""|predicted ratio / measured ratio - 1| the check accepts (docs/simulator.md says why)."""
_TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds every core spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


def _cpu_s(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (float(fields[11]) + float(fields[12])) / _TICK  # utime, stime
    return total


class LoadSampler:
    """Foreign load per iteration of a run writing `run_dir`/report.jsonl (module
    docstring). Own work: this process and its descendants (the run's ranks)."""

    def __init__(self, run_dir: str | Path, period_s: float = 0.2):
        self.log = Path(run_dir) / "report.jsonl"
        self.samples: list[tuple[float, float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _iteration(self) -> int:
        try:
            return 1 + sum('"kind": "iteration"' in line for line in self.log.read_text().splitlines())
        except OSError:
            return 0

    def _loop(self, period_s: float) -> None:
        me, own, scanned = os.getpid(), set(), -1.0
        while True:
            if time.monotonic() - scanned >= 1.0:  # a /proc scan: ~4 ms CPU; ranks come rarely
                own, scanned = {*descendants(me), me}, time.monotonic()
            self.samples.append((time.monotonic(), machine_busy_s(), _cpu_s(own), self._iteration()))
            if self._stop.wait(period_s):
                return

    def foreign_cores(self) -> dict[int, float]:
        """Iteration -> mean cores busy with work not this process tree's during it. An
        interval counts for every iteration in progress in it (from the one at its start
        to the one at its end: a short iteration, or a starved sampler, may fall between
        two samples)."""
        busy: dict[int, list[float]] = {}
        for (t0, m0, o0, i0), (t1, m1, o1, i1) in zip(self.samples, self.samples[1:]):
            if i0 > 0 and t1 > t0 and o1 >= o0:  # a rank that exited takes its CPU time along
                for it in range(i0, max(i0, i1) + 1):
                    acc = busy.setdefault(it, [0.0, 0.0])
                    acc[0] += (m1 - m0) - (o1 - o0)
                    acc[1] += t1 - t0
        return {it: max(0.0, f / t) for it, (f, t) in busy.items() if t > 0}


def launch(run_dir: Path, port: int) -> LoadSampler:
    """The grow run, sampled; raises SystemExit when the launcher fails."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "dynmo_plugin.train",
           "--dynmo", "--dynmo-config", str(CONFIG), "--output", str(run_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with LoadSampler(run_dir) as sampler:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"launcher failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return sampler


def main(argv: list[str] | None = None) -> int:
    from dynmo_plugin.cli._simulate_run import render
    from dynmo_plugin.sim.run_replay import replay_run

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cores", type=float, default=float(len(os.sched_getaffinity(0))))
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="write the run here, with the sampler's load_samples.json (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="grow_check_") as tmp:
        run_dir = Path(a.keep or tmp)
        sampler = launch(run_dir, a.port)
        (run_dir / "load_samples.json").write_text(json.dumps(sampler.samples))
        plain = replay_run(run_dir, cores=a.cores)
        loaded = replay_run(run_dir, cores=a.cores, foreign_cores=sampler.foreign_cores())
    if a.json:
        print(json.dumps({"plain": plain.as_dict(), "load_corrected": loaded.as_dict(),
                          "tolerance": TOLERANCE}, indent=1, allow_nan=False))
    else:
        print(render(plain))
        print("\n== the same, each stretch predicted on the cores other processes left ==")
        print(render(loaded))
        print(f"tolerance: |predicted / measured - 1| <= {TOLERANCE:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
