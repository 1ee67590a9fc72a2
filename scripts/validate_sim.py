#!/usr/bin/env python
"""Predicted (simulator) versus measured (real launcher run) iteration time on this CPU.

1. Runs the launcher: `torchrun --nproc-per-node P -m dynmo_plugin.train ...` (PP=P),
   and reads the measured iteration times from its report.json (median, warm-up
   iterations dropped).
2. Stage costs: from the report's profile events when the profiler wrote them;
   otherwise measured here in one process: each stage's GPTModel (same builder, same
   layout, same shapes) timed for forward and backward of one micro-batch with
   `time.thread_time` and `torch.set_num_threads(1)` (median of repeats), plus its
   Adam step.
3. Feeds them into the simulator (1F1B, gloo loopback p2p) and prints the comparison.

PP=2 gives one rank per core here, so wall-clock and CPU-time agree; with PP=4 four
ranks share two cores and the measured wall time also contains time-sharing, which
the simulator (one device per stage) does not model; the script then also prints the
prediction scaled by ranks/cores as a bound. Usage:

    .venv/bin/python scripts/validate_sim.py [--pp 2] [--layers 8] [--hidden 256] ...
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

from dynmo_plugin.layout import Layout
from dynmo_plugin.sim import Link, PipelineCosts, simulate_iteration

# gloo over loopback TCP on this machine: ~100 us per message, ~1 GB/s (assumed).
P2P = Link(latency_s=1e-4, bandwidth_Bps=1e9)


def _launcher_args(a: argparse.Namespace, out: str) -> list[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs),
            "--train-iters", str(a.iters), "--pipeline-model-parallel-size", str(a.pp),
            "--vocab-size", str(a.vocab), "--output", out]


def run_launcher(a: argparse.Namespace, out: str) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(a.pp), "--master-port", str(a.port),
           "-m", "dynmo_plugin.train", *_launcher_args(a, out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"launcher failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads((Path(out) / "report.json").read_text())


def measured_iteration_s(report: dict, warmup: int) -> float:
    times = [r["time_s"] for r in report["iterations"] if r["iteration"] > warmup]
    return statistics.median(times)


def costs_from_profile(report: dict, pp: int) -> tuple[list[float], list[float]] | None:
    """Per-stage fwd/bwd from the last profile event, if the profiler wrote one."""
    profiles = [e["profile"] for e in report.get("events", []) if isinstance(e.get("profile"), dict)]
    if not profiles:
        return None
    fwd, bwd = [0.0] * pp, [0.0] * pp
    for layer in profiles[-1].get("layers", []):
        fwd[layer["stage"]] += layer["fwd_s"]
        bwd[layer["stage"]] += layer["bwd_s"]
    for stage in profiles[-1].get("stages", []):
        fwd[stage["stage"]] += stage.get("extra_s", 0.0)  # extras attributed to forward
    return fwd, bwd


def _median_thread_time(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples)


def measure_stage_costs(a: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    """Per-stage fwd, bwd seconds per micro-batch and optimizer seconds, one process."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.megatron import cpu_compat
    from dynmo_plugin.megatron.model import build_stage_model, layer_spec, transformer_config

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port + 1))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu_compat.apply()
    layout = Layout.uniform(a.layers, a.pp)
    fwd, bwd, opt = [], [], []
    try:
        for stage, count in enumerate(layout.counts):
            first, last = stage == 0, stage == a.pp - 1
            args = ModelArgs(num_layers=count, hidden_size=a.hidden, num_attention_heads=a.heads,
                             seq_length=a.seq, vocab_size=a.vocab, micro_batch_size=a.mbs,
                             global_batch_size=a.gbs)
            model = build_stage_model(args, transformer_config(args, Layout.uniform(count, 1)),
                                      layer_spec(), first, last)
            f, b, o = _time_stage(model, a, first, last, torch)
            fwd.append(f), bwd.append(b), opt.append(o)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return fwd, bwd, opt


def _time_stage(model, a, first: bool, last: bool, torch) -> tuple[float, float, float]:
    s, b, h = a.seq, a.mbs, a.hidden
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (b, s), generator=gen)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
    state: dict = {}

    def forward():
        inp = None
        if not first:
            inp = torch.randn(s, b, h, generator=gen, requires_grad=True)
            model.set_input_tensor(inp)
        out = model(tokens if first else None, pos, mask, labels=tokens if last else None)
        state["out"] = out.float().mean() if last else out

    def backward():
        out = state.pop("out")
        if last:
            out.backward()
        else:
            out.backward(torch.ones_like(out) * 1e-3)

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    fwd_samples, bwd_samples, opt_samples = [], [], []
    for _ in range(a.repeats + 1):  # the first round warms up and is dropped
        fwd_samples.append(_median_thread_time(forward, 1))
        bwd_samples.append(_median_thread_time(backward, 1))
        opt_samples.append(_median_thread_time(optimizer.step, 1))
        optimizer.zero_grad(set_to_none=False)
    return tuple(statistics.median(x[1:]) for x in (fwd_samples, bwd_samples, opt_samples))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="iterations dropped from the median")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=29623)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        report = run_launcher(a, out)
    measured = measured_iteration_s(report, a.warmup)
    m = a.gbs // a.mbs
    profile = costs_from_profile(report, a.pp)
    if profile is not None:
        (fwd, bwd), tail, source = profile, [0.0] * a.pp, "report.json profile events"
    else:
        fwd, bwd, tail = measure_stage_costs(a)
        source = "single-process thread_time of each stage model"
    costs = PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=m, act_bytes=4.0 * a.seq * a.mbs * a.hidden,
                          p2p=P2P, tail_s=tail)
    predicted = simulate_iteration(costs)
    err = predicted.iteration_s / measured - 1
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, mbs {a.mbs}, "
          f"{m} micro-batches, PP={a.pp}; stage costs from {source}")
    for s in range(a.pp):
        print(f"  stage {s}: fwd {fwd[s] * 1e3:8.1f} ms  bwd {bwd[s] * 1e3:8.1f} ms  "
              f"optimizer {tail[s] * 1e3:6.1f} ms per micro-batch/step")
    print(f"predicted iteration: {predicted.iteration_s:.3f} s (bubble {predicted.bubble_ratio:.1%})")
    print(f"measured  iteration: {measured:.3f} s (median of {a.iters - a.warmup} launcher iterations)")
    print(f"agreement: predicted/measured - 1 = {err:+.1%}  (1-min load average "
          f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after, on {a.cores} cores:"
          " other processes inflate the measured wall time)")
    if a.pp > a.cores:
        shared = predicted.iteration_s * a.pp / a.cores
        print(f"note: {a.pp} ranks on {a.cores} cores; time-sharing bound "
              f"{shared:.3f} s ({shared / measured - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
