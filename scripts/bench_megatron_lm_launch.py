"""Time launches of the Megatron-LM test harness (tests/integrations/megatron_lm_harness.py:
Megatron-LM's own train(), 2 ranks PP=2, 6 iterations) under the test launcher's three
ways of starting ranks, interleaved (each repeat runs every way, in a rotated order):

  forked     workers of the zygote's fork server, Megatron-LM's training package preloaded
  forked-bare  the same without Megatron-LM preloaded (the zygote started without
             DYNMO_MEGATRON_LM in its environment)
  fresh      a fresh `python -m torch.distributed.run` (DYNMO_TEST_FORK_TORCHRUN=0)

Not part of CI. Most of such a launch is start-up (its iterations take ~0.1 s), so this is
where a start-up regression of the launcher shows: one made each forked launch slower than
a fresh torchrun (every DataLoader of Megatron-LM started a fresh fork server interpreter
that imported the harness; tests/zygote_worker.as_fresh_interpreter).

    DYNMO_MEGATRON_LM=/path/to/megatron-lm OMP_NUM_THREADS=1 python scripts/bench_megatron_lm_launch.py [--repeats 5]

Prints one line per launch, then one JSON record per way: wall seconds per launch and
CPU seconds per launch (user + system of every process of the launch: a loaded machine
disturbs it far less than wall time), median, min and max, and each median's ratio to
fresh's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integrations"), str(ROOT / "scripts")]

import launch  # noqa: E402  (needs the path above)
from stress_launch import launcher_cpu_s  # noqa: E402

SOURCE_ENV = "DYNMO_MEGATRON_LM"


def start_zygotes() -> dict:
    """way -> the zygote (None: fresh torchruns); forked-bare's is forked with the source
    hidden from its environment, so it preloads no Megatron-LM."""
    from zygote import Zygote
    source = os.environ.pop(SOURCE_ENV)
    try:
        bare = Zygote()
    finally:
        os.environ[SOURCE_ENV] = source
    return {"forked": Zygote(), "forked-bare": bare, "fresh": None}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_launch(zygote, folder: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one harness launch through `zygote` (None: a fresh torchrun)."""
    import megatron_lm_harness
    launch.ZYGOTE = zygote

    def cpu() -> float:
        return launcher_cpu_s() if zygote is not None else children_cpu_s()
    t0, c0 = time.perf_counter(), cpu()
    megatron_lm_harness.train_in_megatron_lm(folder, ["--dynmo"])
    return time.perf_counter() - t0, cpu() - c0


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    if not os.environ.get(SOURCE_ENV):
        print(f"bench_megatron_lm_launch: set {SOURCE_ENV} to a Megatron-LM checkout", file=sys.stderr)
        return 2
    zygotes = start_zygotes()
    ways = list(zygotes)
    wall: dict = {w: [] for w in ways}
    cpu: dict = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ways:  # warm-up, not counted: the zygotes' preloads, the page cache
            one_launch(zygotes[way], Path(tmp) / f"warm-{way}")
        for r in range(opts.repeats):
            for way in ways[r % len(ways):] + ways[:r % len(ways)]:
                w, c = one_launch(zygotes[way], Path(tmp) / f"{r}-{way}")
                wall[way].append(w)
                cpu[way].append(c)
                print(f"repeat {r} {way}: {w:.1f} s wall, {c:.1f} s CPU", flush=True)
    fresh_wall, fresh_cpu = statistics.median(wall["fresh"]), statistics.median(cpu["fresh"])
    for way in ways:
        print(json.dumps({"way": way, "repeats": opts.repeats, "wall_s": summary(wall[way]),
                          "cpu_s": summary(cpu[way]),
                          "wall_vs_fresh": round(statistics.median(wall[way]) / fresh_wall, 2),
                          "cpu_vs_fresh": round(statistics.median(cpu[way]) / fresh_cpu, 2),
                          "loadavg": [round(x, 1) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
