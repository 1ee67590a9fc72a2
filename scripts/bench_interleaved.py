#!/usr/bin/env python
"""The exact balancer on interleaved pipelines: how close to the least predicted iteration.

Quality: seeded random problems small enough to enumerate (every split of n layers over
p * v virtual stages), each scored by the gate's interleaved iteration time
(`metrics.predicted_iteration_s`); the brute-force optimum against (a) the layout with
the optimal bottleneck over virtual stages (`exact.bottleneck_layout`, what the solver
returned before 2026-11-28) and (b) the solver's layout after the descent
(`solve(problem, "exact")`, balancing/interleaved.py). Half the problems have a cheap
first half (frozen or pruned layers), like the live scenarios.

Time: seconds per `solve(problem, "exact")` at sizes that cannot be enumerated, median
and range over --repeats interleaved repeats, in this one run.

    python scripts/bench_interleaved.py [--cases 300] [--seed 0] [--repeats 5]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from dynmo_plugin.balancing import BalanceProblem, solve
from dynmo_plugin.balancing.exact import bottleneck_layout
from dynmo_plugin.balancing.metrics import predicted_iteration_s, stage_loads
from dynmo_plugin.layout import Layout


def small_problem(rng: np.random.Generator, p: int, v: int) -> BalanceProblem:
    k = p * v
    n = int(rng.integers(k, k + 6))
    costs = rng.integers(1, 20, n).astype(float)
    if rng.random() < 0.5:
        costs[: n // 2] = rng.integers(1, 4, n // 2)
    extras = np.zeros(k)
    extras[0], extras[-1] = rng.integers(0, 5), rng.integers(0, 15)
    return BalanceProblem(costs=costs.tolist(), num_stages=k, num_chunks=v,
                          extras_cost=extras.tolist(), current=Layout.uniform(n, k, v),
                          num_microbatches=int(rng.choice([1, 2, 4, 8, 16])))


def iteration(pb: BalanceProblem, layout: Layout) -> float:
    return predicted_iteration_s(stage_loads(pb, layout), pb.num_microbatches, pb.num_chunks)


def brute_force(pb: BalanceProblem) -> float:
    n, k = pb.num_layers, pb.num_stages
    return min(iteration(pb, Layout.from_boundaries([0, *cuts, n], pb.num_chunks))
               for cuts in itertools.combinations(range(1, n), k - 1))


def quality(cases: int, seed: int) -> None:
    print("| p x v | cases | layout | optimal | mean gap | p95 gap | max gap |")
    print("|---|---|---|---|---|---|---|")
    for p, v in ((2, 2), (3, 2), (2, 3)):
        rng = np.random.default_rng(seed)
        gaps = {"optimal bottleneck": [], "descent (solver)": []}
        for _ in range(cases):
            pb = small_problem(rng, p, v)
            best = brute_force(pb)
            gaps["optimal bottleneck"].append(iteration(pb, bottleneck_layout(pb)[0]) / best - 1)
            gaps["descent (solver)"].append(solve(pb, "exact").predicted_iter_s_after / best - 1)
        for name, g in gaps.items():
            g = np.asarray(g)
            print(f"| {p} x {v} | {cases} | {name} | {np.mean(g < 1e-9):.1%} | {g.mean():.2%} | "
                  f"{np.quantile(g, 0.95):.2%} | {g.max():.2%} |")


def timing(repeats: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = [(64, 8, 2, 16), (128, 32, 4, 32), (128, 64, 4, 32), (256, 128, 8, 64), (1024, 64, 4, 32)]
    problems = [BalanceProblem(costs=rng.random(n).tolist(), num_stages=k, num_chunks=v,
                               current=Layout.uniform(n, k, v), num_microbatches=m)
                for n, k, v, m in sizes]
    seconds: list[list[float]] = [[] for _ in problems]
    for _ in range(repeats):  # interleaved: every size once per repeat
        for pb, out in zip(problems, seconds):
            start = time.perf_counter()
            solve(pb, "exact")
            out.append(time.perf_counter() - start)
    print("\n| layers | virtual stages (p x v) | m | solve median | range |")
    print("|---|---|---|---|---|")
    for (n, k, v, m), s in zip(sizes, seconds):
        print(f"| {n} | {k} ({k // v} x {v}) | {m} | {1e3 * statistics.median(s):.1f} ms | "
              f"{1e3 * min(s):.1f}-{1e3 * max(s):.1f} ms |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    quality(args.cases, args.seed)
    timing(args.repeats, args.seed)


if __name__ == "__main__":
    main()
