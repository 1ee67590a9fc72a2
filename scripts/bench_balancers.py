#!/usr/bin/env python
"""Benchmark the balancers side by side: solution quality and solve time.

Quality = bottleneck / optimum (the `exact` bottleneck, proven optimal), so 1.000 is
best. Times are wall-clock seconds of `solve(...)` measured in this one run, on this
machine, with DeepSpeed imported beforehand (its import is not charged). DeepSpeed's
partition_balanced is O(n^2 m) pure Python, so it is skipped where one call would take
more than ~10 s (n^2 m > 9M); those cells say "skip".

The "decision" table times what the controller runs on every rebalance decision,
`solve(problem, "exact", gate=...)` (solve, plan, gate; the problem is built before
the clock starts, its build time is shown apart), on live-training problems at 48 and
256 layers over 16 stages, against `solve_exact_reference` (the implementation before
the warm start, run through the same plan and gate) on the same problems.

    python scripts/bench_balancers.py [--quick] [--decision [--repeats N]]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dynmo_plugin.balancing import BalanceProblem, GateConfig, InfeasibleError, solve
from dynmo_plugin.layout import Layout

METHODS = ("exact", "partition", "diffusion", "uniform")
DS_LIMIT = 9_000_000  # n^2 * m above which DeepSpeed is skipped


@dataclass
class Cell:
    ratios: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    fallbacks: int = 0
    infeasible: int = 0
    skipped: int = 0


def _problem(costs: np.ndarray, p: int, memory: np.ndarray | None = None,
             capacity: float | None = None) -> BalanceProblem:
    n = costs.size
    mean = float(costs.mean())
    extras = [0.0] * p
    extras[0] += 1.5 * mean           # embedding
    extras[-1] += 2.0 * mean          # output layer + loss
    return BalanceProblem(costs=costs.tolist(), num_stages=p, extras_cost=extras,
                          memory=None if memory is None else memory.tolist(), capacity=capacity,
                          current=Layout.uniform(n, p), num_microbatches=4 * p)


def random_costs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.lognormal(mean=0.0, sigma=0.5, size=n)


def frozen_front(rng, n):    # first 40% frozen: forward only (~1/3 of fwd+bwd)
    c = 1.0 + 0.05 * rng.standard_normal(n)
    c[: int(0.4 * n)] /= 3.0
    return np.abs(c)


def early_exit(rng, n):      # tokens leave after the middle: tail cost decays
    x = np.arange(n) / n
    c = np.where(x < 0.5, 1.0, np.exp(-4.0 * (x - 0.5)))
    return c * (1.0 + 0.05 * rng.standard_normal(n)).clip(0.5)


def pruned(rng, n):          # uneven sparsity per layer, 0-90%
    return 1.0 - rng.uniform(0.0, 0.9, size=n)


def moe_heavy(rng, n):       # a few layers with hot experts cost 4-8x
    c = 1.0 + 0.05 * rng.standard_normal(n)
    hot = rng.choice(n, size=max(2, n // 64), replace=False)
    c[hot] *= rng.uniform(4.0, 8.0, size=hot.size)
    return c


SCENARIOS: dict[str, Callable] = {"frozen": frozen_front, "early-exit": early_exit,
                                  "pruned": pruned, "moe": moe_heavy}


def run_methods(pb: BalanceProblem, cells: dict[str, Cell]) -> None:
    optimum = solve(pb, "exact").bottleneck_after
    for method in METHODS:
        cell = cells.setdefault(method, Cell())
        if method == "partition" and pb.num_layers ** 2 * pb.num_stages > DS_LIMIT:
            cell.skipped += 1
            continue
        try:
            plan = solve(pb, method)
        except InfeasibleError:
            cell.infeasible += 1
            continue
        cell.ratios.append(plan.bottleneck_after / optimum)
        cell.seconds.append(plan.solve_seconds)
        cell.fallbacks += any("fell back" in n for n in plan.notes)
        if plan.rounds is not None:
            cell.rounds.append(plan.rounds)


def fmt_row(name: str, shape: str, method: str, cell: Cell) -> str:
    if not cell.ratios:
        what = "skip" if cell.skipped else "infeasible"
        return f"{name:<14} {shape:>9} {method:<10} {what:>17} {'':>10} {'':>10}"
    extra = []
    if cell.rounds:
        extra.append(f"rounds {statistics.median(cell.rounds):.0f}")
    if cell.fallbacks:
        extra.append(f"{cell.fallbacks} fallback(s) to exact")
    if cell.infeasible:
        extra.append(f"{cell.infeasible} infeasible")
    return (f"{name:<14} {shape:>9} {method:<10} {statistics.mean(cell.ratios):>8.4f} "
            f"{max(cell.ratios):>8.4f} {statistics.median(cell.seconds) * 1e3:>10.2f} "
            f"{max(cell.seconds) * 1e3:>10.2f}  {', '.join(extra)}")


def table(rows: list[tuple[str, int, int, int, Callable]], rng) -> dict:
    print(f"{'instance':<14} {'layers/pp':>9} {'method':<10} {'ratio avg':>8} {'worst':>8} "
          f"{'median ms':>10} {'max ms':>10}")
    results = {}
    for name, n, p, seeds, make in rows:
        cells: dict[str, Cell] = {}
        for _ in range(seeds):
            run_methods(make(rng, n, p), cells)
        for method in METHODS:
            print(fmt_row(name, f"{n}/{p}", method, cells[method]))
        results[(name, n, p)] = cells
        sys.stdout.flush()
    return results


def deepspeed_suboptimality(rng, count: int) -> tuple[int, int, float]:
    """(suboptimal, total, worst ratio) of partition_balanced on small random instances."""
    bad, worst = 0, 1.0
    for _ in range(count):
        n, p = int(rng.integers(8, 49)), int(rng.integers(2, 9))
        pb = BalanceProblem(costs=random_costs(rng, n).tolist(), num_stages=p)
        ratio = solve(pb, "partition").bottleneck_after / solve(pb, "exact").bottleneck_after
        bad += ratio > 1 + 1e-9
        worst = max(worst, ratio)
    return bad, count, worst


# ---- the decision the controller takes on every rebalance --------------------------------
DECISION_SHAPES = ((48, 16), (256, 16))
DECISION_TARGET_MS = {(48, 16): 2.0, (256, 16): 5.0}
DECISION_CASES = ("steady", "event", "memcap")
DECISION_GATE = GateConfig(iterations_until_next_event=100, bandwidth_bytes_per_s=25e9,
                           margin=1.2, min_relative_gain=0.02)


def decision_problem(rng: np.random.Generator, n: int, p: int, case: str) -> BalanceProblem:
    """One decision as `controller.problem_from_profile` builds it: per-layer seconds
    (~2 ms), state bytes (params, grads, Adam: ~1.9 GB) plus the activations of the
    in-flight micro-batches, move bytes = state, rebuild bytes = grads, embedding /
    output extras, a memory cap (1.5 x the uniform split's largest stage), and the
    running layout as `current`.

    steady: the running layout is the optimum of the previous profile; the new one
        differs by measurement noise (3%), as when deciding every iteration.
    event: a dynamism event (frozen front, early exit, pruning or hot MoE experts,
        drawn) has just changed the costs; the running layout is the optimum before it.
    memcap: steady, with a cap 2% above the uniform split's largest stage, so memory
        shapes the layout.
    """
    scale, m = 2e-3, 4 * p
    before = (1.0 + 0.05 * rng.standard_normal(n)).clip(0.5) * scale
    if case == "event":
        after = SCENARIOS[str(rng.choice(list(SCENARIOS)))](rng, n) * scale
    else:
        after = before * (1.0 + 0.03 * rng.standard_normal(n)).clip(0.5)
    params = rng.uniform(0.9, 1.1, n) * 1.2e8
    state, grads = 16.0 * params, 2.0 * params
    memory = state + min(p, m) * rng.uniform(0.9, 1.1, n) * 3e8
    extras_cost = [0.0] * p
    extras_cost[0], extras_cost[-1] = 1.5 * scale, 2.0 * scale
    extras_memory = [0.0] * p
    extras_memory[0], extras_memory[-1] = 2e9, 3e9
    uniform = Layout.uniform(n, p).boundaries
    pre = np.concatenate(([0.0], np.cumsum(memory)))
    largest = max(x + pre[j] - pre[i] for x, i, j in zip(extras_memory, uniform, uniform[1:]))
    capacity = (1.02 if case == "memcap" else 1.5) * largest
    common = dict(num_stages=p, memory=memory.tolist(), move_bytes=state.tolist(), capacity=capacity,
                  extras_cost=extras_cost, extras_memory=extras_memory, num_microbatches=m,
                  param_counts=params.tolist(), rebuild_bytes=grads.tolist(),
                  extras_rebuild_bytes=[1e8] * p)
    running = solve(BalanceProblem(costs=before.tolist(), current=Layout.uniform(n, p), **common),
                    "exact").layout
    return BalanceProblem(costs=after.tolist(), current=running, **common)


def reference_decision(problem: BalanceProblem, gate: GateConfig):
    """`solve(problem, "exact", gate=gate)` with the solver before the warm start."""
    from dynmo_plugin.balancing.exact import solve_exact_reference
    from dynmo_plugin.balancing.gate import attach_gate
    from dynmo_plugin.balancing.plan import make_plan

    start = time.perf_counter()
    layout = solve_exact_reference(problem)
    plan = make_plan(problem, layout, "exact_reference", time.perf_counter() - start)
    return attach_gate(plan, gate)


def _timed(fn: Callable, problem: BalanceProblem) -> tuple[float, float, float, object]:
    """(build s, call wall s, call CPU s, result) on a freshly built copy of `problem`
    (nothing cached from an earlier call, as for a new profile). CPU time is this
    thread's: on a shared machine it shows the work apart from waiting for a core."""
    t0 = time.perf_counter()
    fresh = dataclasses.replace(problem)
    t1, c1 = time.perf_counter(), time.thread_time()
    out = fn(fresh)
    return t1 - t0, time.perf_counter() - t1, time.thread_time() - c1, out


def decision_table(rng: np.random.Generator, repeats: int) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ndecision (solve + gate) = solve(problem, 'exact', gate=...), ms: wall median "
          f"(p90) and CPU median of {repeats} decisions per row; load average {load:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'layers/pp':>9} {'case':<7} {'new wall':>15} {'cpu':>6} {'reference wall':>17} "
          f"{'cpu':>6} {'speed-up':>8} {'build':>6} {'target':>7}")
    new = lambda pb: solve(pb, "exact", gate=DECISION_GATE)  # noqa: E731
    ref = lambda pb: reference_decision(pb, DECISION_GATE)  # noqa: E731
    med = statistics.median
    p90 = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
    for n, p in DECISION_SHAPES:
        for case in DECISION_CASES:
            problems = [decision_problem(rng, n, p, case) for _ in range(min(repeats, 20))]
            build, fast, fast_cpu, slow, slow_cpu = [], [], [], [], []
            for k in range(repeats):
                pb = problems[k % len(problems)]
                b, wall, cpu, plan = _timed(new, pb)
                _, ref_wall, ref_cpu, check = _timed(ref, pb)
                if plan.layout != check.layout or plan.gate.apply != check.gate.apply:
                    raise RuntimeError(f"exact and exact_reference disagree on {n}/{p} {case}")
                build.append(b)
                fast.append(wall)
                fast_cpu.append(cpu)
                slow.append(ref_wall)
                slow_cpu.append(ref_cpu)
            target = DECISION_TARGET_MS[(n, p)]
            print(f"{f'{n}/{p}':>9} {case:<7} {med(fast) * 1e3:>7.2f} ({p90(fast) * 1e3:>5.2f}) "
                  f"{med(fast_cpu) * 1e3:>6.2f} {med(slow) * 1e3:>8.2f} ({p90(slow) * 1e3:>6.2f}) "
                  f"{med(slow_cpu) * 1e3:>6.2f} {med(slow) / med(fast):>7.1f}x "
                  f"{med(build) * 1e3:>6.2f} {'<' if med(fast) * 1e3 < target else '>='} {target:g}")
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds, small sizes only")
    parser.add_argument("--decision", action="store_true",
                        help="only the decision (solve + gate) table; no DeepSpeed needed")
    parser.add_argument("--repeats", type=int, default=200,
                        help="decisions timed per row of the decision table (default 200)")
    args = parser.parse_args()
    rng = np.random.default_rng(2024)
    solve(BalanceProblem(costs=[1.0, 2.0], num_stages=2), "exact")  # warm numpy
    if args.decision:
        decision_table(rng, args.repeats)
        return
    import deepspeed.runtime.utils  # noqa: F401  (import cost not charged to `partition`)

    rand = lambda rng, n, p: _problem(random_costs(rng, n), p)  # noqa: E731
    sizes = [(64, 8, 5), (256, 16, 5)] + ([] if args.quick else
                                          [(512, 32, 1), (1000, 64, 2), (1000, 128, 2)])
    rows = [("random", n, p, s, rand) for n, p, s in sizes]
    for name, gen in SCENARIOS.items():
        rows.append((name, 256, 16, 2 if args.quick else 3, lambda rng, n, p, g=gen: _problem(g(rng, n), p)))
        if not args.quick:
            rows.append((name, 1000, 128, 1, lambda rng, n, p, g=gen: _problem(g(rng, n), p)))
    rows.append(("moe+memcap", 256, 16, 3, lambda rng, n, p: _capped(moe_heavy(rng, n), p)))
    results = table(rows, rng)

    ex = results[("random", 256, 16)]
    speedup = statistics.median(ex["partition"].seconds) / statistics.median(ex["exact"].seconds)
    print(f"\nexact vs DeepSpeed partition_balanced at 256 layers / 16 stages (random, median of "
          f"{len(ex['exact'].seconds)}): {speedup:.0f}x faster")
    ds_runs = [r for cells in results.values() for r in cells["partition"].ratios]
    ds_bad = sum(r > 1 + 1e-9 for r in ds_runs)
    print(f"DeepSpeed suboptimal on {ds_bad}/{len(ds_runs)} benchmark instances above "
          "(fallbacks to exact count as optimal)")
    bad, total, worst = deepspeed_suboptimality(rng, 100 if args.quick else 300)
    print(f"DeepSpeed suboptimal on {bad}/{total} = {100 * bad / total:.1f}% of small random "
          f"instances (8-48 layers, 2-8 stages, no extras); worst ratio {worst:.3f}")
    decision_table(rng, 50 if args.quick else args.repeats)


def _capped(costs: np.ndarray, p: int) -> BalanceProblem:
    memory = np.full(costs.size, 1e9)          # 1 GB per layer
    capacity = 1.15 * costs.size * 1e9 / p     # 15% headroom over an even split
    return _problem(costs, p, memory, capacity)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total bench time {time.perf_counter() - t0:.0f} s")
