#!/usr/bin/env python
"""What reducing data-parallel gradients in rank order costs (megatron.training.grad_reduce).

Spawns `--ranks` gloo processes (one thread each) and times, per bucket size, Megatron's
collective (`all_reduce`; `reduce_scatter_tensor` for the distributed optimizer) against
the ordered one (`grad_reduce.all_reduce` / `reduce_scatter`) on the same fp32 bucket, in
interleaved rounds: per round the median of `--iters` calls after a warm-up (rank 0's
wall time; every call ends in a barrier so ranks start together). The ratio is the median
of the rounds' ratios with its min-max spread; a difference inside the spread is no
finding. On a GPU the ordered reduction moves the same bytes as a ring all-reduce (an
all_to_all, then an all-gather) plus one elementwise add per rank; it has not been timed
on NCCL here.

Usage: python scripts/bench_grad_reduce.py [--ranks 3] [--sizes 1000000,4000000] [--rounds 5] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--sizes", default="1000000,4000000", help="bucket sizes in elements, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    return p.parse_args()


def _timed(call, bucket: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        data = bucket.clone()
        dist.barrier()
        start = time.perf_counter()
        call(data)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _calls(world: int) -> dict:
    from dynmo_plugin.megatron.training import grad_reduce
    group = dist.group.WORLD

    def native_scatter(data):
        out = data.view(world, -1)[dist.get_rank()]
        dist.reduce_scatter_tensor(out, data)

    return {"all-reduce": (lambda d: dist.all_reduce(d), lambda d: grad_reduce.all_reduce(d, group)),
            "reduce-scatter": (native_scatter, lambda d: grad_reduce.reduce_scatter(d, group))}


def _rank(rank: int, a, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for size in (int(s) for s in a.sizes.split(",")):
        size -= size % a.ranks  # the distributed optimizer's buckets split evenly
        bucket = torch.randn(size, generator=g)
        for kind, (native, ordered) in _calls(a.ranks).items():
            ms = {"native": [], "ordered": []}
            for _ in range(a.rounds):
                ms["native"].append(1e3 * _timed(native, bucket, a.iters))
                ms["ordered"].append(1e3 * _timed(ordered, bucket, a.iters))
            ratios = [o / n for o, n in zip(ms["ordered"], ms["native"])]
            rows.append((kind, size, statistics.median(ms["native"]), statistics.median(ms["ordered"]),
                         statistics.median(ratios), min(ratios), max(ratios)))
    if rank == 0:
        print(f"gloo, {a.ranks} ranks (one thread each), fp32 buckets; {a.rounds} interleaved rounds "
              f"x {a.iters} calls (median, min-max)")
        print(f"{'collective':<15} {'elements':>10} {'native ms':>10} {'ordered ms':>11} {'ordered/native':>15}")
        for kind, size, native, ordered, ratio, lo, hi in rows:
            print(f"{kind:<15} {size:>10} {native:>10.2f} {ordered:>11.2f} {ratio:>7.3f}x ({lo:.3f}-{hi:.3f})")
    dist.destroy_process_group()


def main() -> None:
    a = _args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(a, port), nprocs=a.ranks)


if __name__ == "__main__":
    main()
