#!/usr/bin/env python
"""The timing side of two counted-work tests: a frozen layer's backward and a layer whose
tokens exited early, against the same layer at full work.

* freezing (tests/scenarios/test_scenario_freezing.py): one GPT layer, trainable vs frozen as the
  scenario freezes it (set_frozen, weights requires_grad False): forward and backward
  milliseconds, frozen / trainable per phase (the runs' profiles: backward < 0.1x,
  forward ~1x);
* early exit (tests/scenarios/test_scenario_early_exit.py): the last early-exit layer with no token
  exited vs 90% of each sample's tokens exited before it: fwd+bwd, exited / none (the
  runs' profiles: layer 8 / layer 1 fell below 0.3x of its value before exits).
Variants are timed in interleaved rounds, each round the median of `--iters` steps after
a warm-up; ratios are the median of per-round ratios with their min-max spread. One
process, one thread, CPU.

Usage: python scripts/bench_layer_work.py [--hidden 64] [--seq 64] [--rounds 5] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 64), ("heads", 4), ("seq", 64), ("batch", 2),
                          ("rounds", 5), ("iters", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def _timed(step) -> tuple[float, float]:
    """(forward, backward) seconds of `step()`, which returns (output, backward fn)."""
    start = time.perf_counter()
    out, backward = step()
    mid = time.perf_counter()
    backward(out)
    return mid - start, time.perf_counter() - mid


def _variants(a):
    """{name: step} sharing one config; each step runs one forward, returns its backward."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.scenarios.early_exit.layer import ExitContext, early_exit_spec, encode_exited
    from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
    args = ModelArgs(num_layers=8, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, distributed_backend="gloo")
    init_parallel(args)
    cfg = transformer_config(args, Layout.uniform(8, 1))
    s, b, h = a.seq, a.batch, a.hidden
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, h, generator=gen)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    trainable, frozen = (build_module(freezable_spec(layer_spec()), config=cfg, layer_number=1)
                         for _ in range(2))
    frozen.set_frozen(True)
    for p in frozen.parameters():
        p.requires_grad_(False)
    exit_layer = build_module(early_exit_spec(layer_spec(), 16), config=cfg, layer_number=8)
    exit_layer.exit_context = ExitContext(
        seq_length=s, token_multiple=8, threshold=0.2, min_layer=4, exits_on=True, loss_weight=0.5, grad_scale=1.0,
        labels=[torch.randint(16, (s, b), generator=gen)], loss_masks=[torch.ones(s, b)])
    exited = torch.zeros(s, b, dtype=torch.bool)
    some = exited.clone()
    for j in range(b):
        some[torch.randperm(s, generator=gen)[:s - s // 10], j] = True

    def plain(layer):
        return lambda: (layer(hidden_states=x.clone().requires_grad_(True), attention_mask=mask)[0],
                        lambda out: out.sum().backward())

    def exiting(flags):
        def step():
            exit_layer.reset_exit_stats()
            hidden = torch.cat([x, encode_exited(flags, h, x.dtype)]).requires_grad_(True)
            return exit_layer(hidden_states=hidden, attention_mask=mask)[0], lambda out: out[:s].sum().backward()
        return step
    return {"trainable": plain(trainable), "frozen": plain(frozen),
            "exit_none": exiting(exited), "exit_90%": exiting(some)}


def _ratio_line(name, num, den) -> str:
    ratios = [n / d for n, d in zip(num, den)]
    return f"{name:<28} {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def main() -> None:
    a = _args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29535"),
                      RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    steps = _variants(a)
    fwd = {n: [] for n in steps}
    bwd = {n: [] for n in steps}
    for _ in range(a.rounds):
        for name, step in steps.items():
            _timed(step)  # warm-up
            runs = [_timed(step) for _ in range(a.iters)]
            fwd[name].append(statistics.median(f for f, _ in runs))
            bwd[name].append(statistics.median(b for _, b in runs))
    total = {n: [f + b for f, b in zip(fwd[n], bwd[n])] for n in steps}
    print(f"one GPT layer h{a.hidden} s{a.seq} mb{a.batch} fp32 on cpu; "
          f"{a.rounds} interleaved rounds x {a.iters} steps (median, min-max)")
    for name in steps:
        print(f"{name:<10} fwd {1e3 * statistics.median(fwd[name]):8.2f} ms   "
              f"bwd {1e3 * statistics.median(bwd[name]):8.2f} ms")
    print(_ratio_line("frozen / trainable, fwd", fwd["frozen"], fwd["trainable"]))
    print(_ratio_line("frozen / trainable, bwd", bwd["frozen"], bwd["trainable"]))
    print(_ratio_line("90% exited / none, fwd+bwd", total["exit_90%"], total["exit_none"]))


if __name__ == "__main__":
    main()
