#!/usr/bin/env python
"""What the exact element sum of the gradient norm costs (megatron.training.grad_norm).

One process, one thread, a one-rank gloo group: the norm of `--tensors` fp32 gradients of
`--elements` elements in all, per-tensor (the plain optimizer's: each tensor's fp32 norm,
squared in float64, `math.fsum`) against summed over elements (the distributed
optimizer's shards: two 31-bit integer limbs per square on a fixed grid), and Megatron's
own `get_grad_norm_fp32` for scale, in interleaved rounds: per round the median of
`--iters` calls after a warm-up. Ratios are medians of the rounds' ratios with their
min-max spread; a difference inside the spread is no finding. On a GPU both are
memory-bound passes: the element sum reads the shard once in fp32 and streams float64
temporaries (in slices of `grad_norm.SLICE` elements).

Usage: python scripts/bench_grad_norm.py [--elements 4000000] [--tensors 40] [--rounds 5] [--iters 5]
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
    for name, default in (("elements", 4_000_000), ("tensors", 40), ("rounds", 5), ("iters", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def _ms(norm, grads, iters: int) -> float:
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        start = time.perf_counter()
        norm(grads)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    a = _args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29537"))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.optimizer import clip_grads

    from dynmo_plugin.megatron.training import cpu_compat, grad_norm
    cpu_compat.apply()  # Megatron's own function allocates on 'cuda'
    g = torch.Generator().manual_seed(0)
    grads = list(torch.randn(a.elements, generator=g).chunk(a.tensors))

    def sharded(gs):
        grad_norm.install(sharded=True)
        try:
            return grad_norm.get_grad_norm_fp32(gs)
        finally:
            grad_norm.uninstall()

    calls = {"megatron": clip_grads.get_grad_norm_fp32, "per-tensor": grad_norm.get_grad_norm_fp32,
             "element sum": sharded}
    ms: dict = {name: [] for name in calls}
    for _ in range(a.rounds):
        for name, call in calls.items():
            ms[name].append(_ms(call, grads, a.iters))
    print(f"{a.elements} fp32 gradient elements in {a.tensors} tensors, cpu, one thread; "
          f"{a.rounds} interleaved rounds x {a.iters} calls (median, min-max)")
    for name in calls:
        ratios = [x / y for x, y in zip(ms[name], ms["per-tensor"])]
        print(f"{name:<12} {statistics.median(ms[name]):8.2f} ms   / per-tensor {statistics.median(ratios):6.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
