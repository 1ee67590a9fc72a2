#!/usr/bin/env python
"""Profiler overhead, side by side in one run: plugin off vs. on (windows every N).

The profiled iteration is split into the training step with hooks active and the
controller's own time (opening the window, summarising and gathering at its close).

Runs the launcher (torchrun, PP=2, gloo) alternately with the plugin disabled and with
periodic profiling windows, ROUNDS times each, and compares median iteration time of
(a) iterations outside windows vs. the disabled run, (b) profiled iterations vs. the
disabled run. Prints a table of ratios (1.00 = no overhead). Wall clock, PP=2 = one
rank per core here. Usage: python scripts/bench_profiler.py [--rounds 3] [--iters 40]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--pipeline-model-parallel-size", "2"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(flags: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_port()), "-m", "dynmo_plugin.train", *MODEL, *flags,
           "--output", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return json.loads((out / "report.json").read_text())["iterations"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    a = ap.parse_args()
    base = ["--train-iters", str(a.iters)]
    off, outside, inside, closing = [], [], [], []
    warm = 3  # first iterations include allocator warm-up in both modes
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            its = run(base, Path(tmp) / f"off{r}")
            off += [i["time_s"] for i in its if i["iteration"] > warm]
            its = run(base + ["--dynmo", "--dynmo-profile-every", str(a.every)], Path(tmp) / f"on{r}")
            for i in its:
                if i["iteration"] <= warm:
                    continue
                if i["iteration"] % a.every == 0:  # hooks active; the window also closes here
                    inside.append(i["time_s"] - i["dynmo_s"])
                    closing.append(i["dynmo_s"])
                else:
                    outside.append(i["time_s"])
    ref = statistics.median(off)
    rows = [("plugin disabled", off), ("enabled, outside windows", outside),
            ("enabled, profiled step (hooks)", inside),
            ("window open+close (gather)", closing)]
    print(f"{'iterations':32s} {'n':>4s} {'median ms':>10s} {'ratio':>7s}")
    for name, xs in rows:
        print(f"{name:32s} {len(xs):4d} {1e3 * statistics.median(xs):10.1f} "
              f"{statistics.median(xs) / ref:7.3f}")
    print(f"profiled-iteration slowdown: {100 * (statistics.median(inside) / ref - 1):+.1f}% "
          f"(goal < 10% on CPU); outside windows: {100 * (statistics.median(outside) / ref - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
