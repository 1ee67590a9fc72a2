#!/usr/bin/env python
"""Profiler overhead, measured side by side in one run of this script.

Part 1 (wall clock, PP=2 launcher runs, one rank per core): the plugin disabled vs.
enabled with a one-iteration profiling window every N iterations, alternated ROUNDS
times. Reports the noise floor (spread between the disabled rounds), iterations
outside windows vs. disabled (should sit within that floor: hooks are detached), the
profiled step vs. the same run's unprofiled iterations, and the window's open/close
cost (summary + gather), which the report records separately as `dynmo_s`.
Part 2 (thread CPU time, one process, no pipeline noise): the training step with no
hooks, with timing hooks only, with timing + activation accounting, and with timing +
the window's kernel profiler (`kernels.KernelBusy` on the host: user-scope ranges only,
as it runs, against every host op recorded, as it ran on the H200 of 2026-11-27), with
the profiler's close (stop + attribution) timed apart.
Part 3 (wall clock, PP=2): stage 0 holds a layer three times heavier than the rest, so
stage 1 should spend more of each iteration blocked in receives than stage 0 does. The
profile's per-stage `wait_s` is wall-clock time, so this relation is a measurement, not
a unit test (tests/megatron/test_profiler.py only checks that the receiving stage records a wait):
it prints stage 1's wait over stage 0's for each round.
Part 4 (thread CPU time, one process): the stage prediction (`StageProfile.predicted_s`)
against the same trainer's unprofiled step, each round 3 plain steps then a 3-step
window (`ProfileWindow`, as the controller drives it), at three model sizes; printed
with and without the rest of the step (`rest_s`: the step's time outside every span),
the median and range of the rounds' ratios.
Usage: python scripts/bench_profiler.py [--rounds 3] [--iters 40] [--every 5] [--part N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _torchrun import ROOT, print_result, read_result, torchrun

MODEL = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16"]


def _launch(flags: list[str], out: Path) -> list[dict]:
    torchrun(2, ["-m", "dynmo_plugin.train", *MODEL, "--pipeline-model-parallel-size", "2",
                  *flags, "--output", str(out)])
    return json.loads((out / "report.json").read_text())["iterations"]


def pipeline_overhead(rounds: int, iters: int, every: int, warm: int = 3) -> None:
    off_rounds, outside, inside, closing, ratios = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            its = _launch(["--train-iters", str(iters)], Path(tmp) / f"off{r}")
            off_rounds.append(statistics.median(i["time_s"] for i in its if i["iteration"] > warm))
            its = _launch(["--train-iters", str(iters), "--dynmo", "--dynmo-profile-every", str(every)],
                          Path(tmp) / f"on{r}")
            run_out, run_in = [], []
            for i in its:
                if i["iteration"] <= warm:
                    continue
                if i["iteration"] % every == 0:
                    run_in.append(i["time_s"] - i["dynmo_s"])
                    closing.append(i["dynmo_s"])
                else:
                    run_out.append(i["time_s"])
            outside += run_out
            inside += run_in
            ratios.append(statistics.median(run_in) / statistics.median(run_out))
    ref = statistics.median(off_rounds)
    print(f"Part 1: PP=2 wall clock, {rounds} rounds x {iters} iterations, window every {every}")
    print(f"  noise floor: disabled rounds' medians span {min(off_rounds) / ref:.3f}-"
          f"{max(off_rounds) / ref:.3f} x their median ({1e3 * ref:.1f} ms)")
    print(f"  outside windows vs disabled:           {statistics.median(outside) / ref:.3f} x")
    print(f"  profiled step vs same run, unprofiled: {statistics.median(ratios):.3f} x "
          f"(per round: {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"  window open + close (summary, gather): {1e3 * statistics.median(closing):.1f} ms "
          f"= {statistics.median(closing) / ref:.3f} x an iteration, once per window")


def _cpu_worker(steps: int, rounds: int) -> None:
    import time

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.profiling import probe
    from dynmo_plugin.megatron.profiling.kernels import KernelBusy
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    from dynmo_plugin.profiling.clock import CpuThreadClock

    args = ModelArgs(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64,
                     micro_batch_size=2, global_batch_size=16)
    trainer = StageTrainer(args, init_parallel(args), Layout.uniform(8, 1))

    closes: dict[str, list[float]] = {"kineto_user": [], "kineto_all": []}

    def timed(variant: str) -> float:
        p = busy = None
        if variant.startswith("kineto"):
            busy = KernelBusy(True, device="cpu", every_op=variant == "kineto_all")
        if variant != "off":
            p = probe.StageProbe(trainer.model, CpuThreadClock(), count_activations=variant == "full",
                                 busy=busy)
            p.attach()
        samples = []
        for i in range(steps):
            start = time.thread_time()
            trainer.train_step(i + 1)
            samples.append(time.thread_time() - start)
            if p is not None:
                p.end_iteration()
        if p is not None:
            p.detach()
        if busy is not None:
            start = time.perf_counter()
            busy.stop()
            closes[variant].append(time.perf_counter() - start)
        return statistics.median(samples)

    timed("off")
    results = {"off": [], "timing": [], "full": [], "kineto_user": [], "kineto_all": []}
    for _ in range(rounds):
        for variant in results:
            results[variant].append(timed(variant))
    out = {k: statistics.median(v) for k, v in results.items()}
    out.update({f"close_{k}": statistics.median(v) for k, v in closes.items()})
    out["spread_off"] = max(results["off"]) / min(results["off"])
    print_result(out)
    destroy_parallel()


def cpu_overhead(steps: int, rounds: int) -> None:
    out = torchrun(1, [__file__, "--cpu-worker", "--steps", str(steps), "--rounds", str(rounds)])
    res = read_result(out)
    print(f"Part 2: one process, thread CPU time per training step ({rounds} rounds x {steps} steps)")
    print(f"  noise floor: the no-hook rounds span {res['spread_off']:.3f} x")
    for name, label in (("off", "no hooks"), ("timing", "timing hooks"),
                        ("full", "timing + activation accounting"),
                        ("kineto_user", "timing + kernel profiler (ours)"),
                        ("kineto_all", "timing + profiler, every host op")):
        close = f"  close {1e3 * res['close_' + name]:.1f} ms" if "close_" + name in res else ""
        print(f"  {label:32s} {1e3 * res[name]:7.1f} ms  {res[name] / res['off']:.3f} x{close}")


PREDICTION_SHAPES = ((2, 64), (8, 64), (6, 256))  # (layers, hidden): rest large to small


def _prediction_worker(rounds: int) -> None:
    import time

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.training.trainer import StageTrainer

    out = {}
    for layers, hidden in PREDICTION_SHAPES:
        args = ModelArgs(num_layers=layers, hidden_size=hidden, num_attention_heads=4, seq_length=64,
                         micro_batch_size=2, global_batch_size=8)
        trainer = StageTrainer(args, init_parallel(args), Layout.uniform(layers, 1))
        it = 1
        trainer.train_step(it)
        rows = []
        for _ in range(rounds):
            plain = []
            for it in range(it + 1, it + 4):
                start = time.thread_time()
                trainer.train_step(it)
                plain.append(time.thread_time() - start)
            window = ProfileWindow(trainer)
            for it in range(it + 1, it + 4):
                window.before_iteration()
                trainer.train_step(it)
                window.after_iteration()
            (stage,) = window.close().stages
            rows.append((stage.predicted_s, stage.rest_s, statistics.median(plain)))
        out[f"{layers}L h{hidden}"] = rows
        destroy_parallel()
    print_result(out)


def prediction(rounds: int) -> None:
    res = read_result(torchrun(1, [__file__, "--prediction-worker", "--rounds", str(rounds)]))
    print(f"Part 4: one process, thread CPU time, m = 4; predicted stage time / plain step ({rounds} rounds)")
    print(f"  {'model':10s} {'plain ms':>9s} {'rest ms':>8s}  {'with rest':>22s}  {'without rest':>22s}")
    for name, rows in res.items():
        with_rest = [p / plain for p, _, plain in rows]
        without = [(p - r) / plain for p, r, plain in rows]
        cells = [f"{statistics.median(v):.3f}x ({min(v):.3f}-{max(v):.3f})" for v in (with_rest, without)]
        print(f"  {name:10s} {1e3 * statistics.median(r[2] for r in rows):9.1f} "
              f"{1e3 * statistics.median(r[1] for r in rows):8.1f}  {cells[0]:>22s}  {cells[1]:>22s}")


def wait_relation(rounds: int) -> None:
    flags = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "4",
             "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", "3", "--dynmo", "--dynmo-profile-every", "2",
             "--dynmo-profile-window", "2", "--pipeline-model-parallel-size", "2",
             "--test-heavy-layer", "2", "--test-heavy-factor", "3"]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            out = Path(tmp) / f"wait{r}"
            torchrun(2, ["-m", "workers.train_worker", *flags, "--output", str(out)])
            events = json.loads((out / "report.json").read_text())["events"]
            first, second = next(e for e in events if e["kind"] == "profile")["profile"]["stages"]
            ratios.append(second["wait_s"] / max(first["wait_s"], 1e-9))
    print(f"Part 3: PP=2, heavy layer on stage 0, {rounds} rounds")
    print(f"  stage 1 wait / stage 0 wait: median {statistics.median(ratios):.2f} x "
          f"(per round: {', '.join(f'{x:.2f}' for x in ratios)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--part", type=int, choices=(1, 2, 3, 4), help="run one part only")
    ap.add_argument("--cpu-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prediction-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cpu_worker:
        _cpu_worker(a.steps, a.rounds)
        return 0
    if a.prediction_worker:
        _prediction_worker(a.rounds)
        return 0
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    if a.part in (None, 1):
        pipeline_overhead(a.rounds, a.iters, a.every)
    if a.part in (None, 2):
        cpu_overhead(a.steps, a.rounds)
    if a.part in (None, 3):
        wait_relation(a.rounds)
    if a.part in (None, 4):
        prediction(max(a.rounds, 4))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
