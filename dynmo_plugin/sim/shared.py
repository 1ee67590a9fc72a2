"""P pipeline ranks time-sharing C CPU cores: the simulator's 1F1B under processor sharing.

The dedicated simulator (`sim.iteration`) gives every stage its own device. On a CPU
box with fewer cores than ranks (this machine: 4 ranks on 2 cores) the ranks share the
cores, and a pipeline bubble is no longer idle hardware: another rank runs in it. This
model keeps Megatron's 1F1B orders and dependencies (`sim.schedule.rank_orders`) and
shares the cores fairly among the ranks with a ready op (the OS scheduler idealised: no
context-switch or cache cost). scripts/validate_sim.py measured it against real runs
(docs/simulator.md, "Validation on this machine"); `sim.run_replay` predicts a run's
iterations with it (`dynmo simulate --from-run RUN_DIR --cores N`).

Data parallelism: `dp` identical replicas of the pipeline share the cores evenly, so
each runs as one pipeline on `cores / dp` cores (exact for the idealised fair share of
identical replicas); the gradient all-reduce follows (`ring_allreduce_s` on `dp_link`).
Pure: numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.cost import PipelineCosts, ring_allreduce_s
from dynmo_plugin.sim.schedule import BACKWARD, FORWARD, rank_orders

__all__ = ["SharedResult", "shared_iteration_s", "simulate_shared"]


@dataclass(frozen=True)
class SharedResult:
    iteration_s: float
    pipeline_s: float
    finish_s: np.ndarray     # per rank, end of its tail
    blocked_s: np.ndarray    # per rank, wall seconds with no runnable op before its last op


def simulate_shared(costs: PipelineCosts, cores: float, background: float = 0.0) -> SharedResult:
    """Megatron's 1F1B orders and dependencies (as dynmo_plugin.sim.engine), the ranks
    sharing `cores` processors: every runnable rank progresses at
    min(1, cores / (n + background)) CPU-seconds per second, n = runnable ranks,
    `background` = other processes' runnable threads (a fair scheduler's equal shares);
    the tail (optimizer) follows each rank's last op. With cores >= pp and no
    background this is the dedicated engine."""
    p, m = costs.num_stages, costs.num_microbatches
    if costs.num_chunks != 1:
        raise ValueError("simulate_shared models the non-interleaved 1F1B schedule only")
    orders = rank_orders(p, m)
    transfer = costs.p2p.transfer_s(costs.act_bytes) if p > 1 else 0.0
    fwd, bwd = np.asarray(costs.fwd_s), np.asarray(costs.bwd_s)
    tail = np.asarray(costs.tail_s)
    done: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p
    left = [None] * p            # CPU seconds left of the op in progress
    blocked = np.zeros(p)
    pipe_end = np.zeros(p)
    finish = np.full(p, np.nan)
    t = 0.0

    def ready_at(r: int) -> float:
        if nxt[r] >= len(orders[r]):
            return t  # the tail has no dependency
        op = orders[r][nxt[r]]
        if op.kind == FORWARD:
            dep = None if r == 0 else (FORWARD, r - 1)
        else:
            dep = (FORWARD, r) if r == p - 1 else (BACKWARD, r + 1)
        if dep is None:
            return t
        end = done.get((dep[0], dep[1], op.microbatch))
        hop = transfer if dep[1] != r else 0.0  # own forward: no transfer
        return np.inf if end is None else end + hop

    def work(r: int) -> float:
        if nxt[r] >= len(orders[r]):
            return float(tail[r])
        op = orders[r][nxt[r]]
        return float((fwd if op.kind == FORWARD else bwd)[r, op.microbatch])

    while np.isnan(finish).any():
        live = [r for r in range(p) if np.isnan(finish[r])]
        ready = {r: ready_at(r) for r in live if left[r] is None}
        for r, at in ready.items():
            if at <= t + 1e-15:
                left[r] = work(r)
        running = [r for r in live if left[r] is not None]
        arrivals = [at for r, at in ready.items() if left[r] is None and np.isfinite(at)]
        if not running and not arrivals:
            raise RuntimeError(f"shared-core schedule deadlocked at {nxt}")
        rate = min(1.0, cores / (len(running) + background)) if running else 0.0
        dt = min([left[r] / rate for r in running] + [at - t for at in arrivals])
        for r in live:
            if left[r] is None and nxt[r] < len(orders[r]):
                blocked[r] += dt
        for r in running:
            left[r] -= rate * dt
        t += dt
        for r in running:
            if left[r] <= 1e-12:
                left[r] = None
                if nxt[r] >= len(orders[r]):
                    finish[r] = t
                    continue
                op = orders[r][nxt[r]]
                done[(op.kind, r, op.microbatch)] = t
                nxt[r] += 1
                if nxt[r] == len(orders[r]):
                    pipe_end[r] = t
    return SharedResult(float(finish.max()), float(pipe_end.max()), finish, blocked)


def shared_iteration_s(costs: PipelineCosts, cores: float) -> float:
    """Seconds of one iteration of `costs.dp` replicas on `cores` cores (module
    docstring): one replica on cores / dp, then the slowest rank's all-reduce.

    Raises:
        UserError: cores not a positive number.
    """
    if not cores > 0:
        raise UserError(f"cores must be > 0, got {cores}")
    shared = simulate_shared(costs, cores / costs.dp)
    grads = np.asarray(costs.grad_bytes, dtype=float)
    allreduce = max((ring_allreduce_s(b, costs.dp, costs.dp_link) for b in grads), default=0.0)
    return shared.iteration_s + allreduce
