"""`diffusion`: the DynMo paper's decentralised balancer, order-preserving.

Each stage talks only to its pipeline neighbours. Rounds alternate the even edges
(0-1, 2-3, ...) and the odd edges (1-2, 3-4, ...), so each stage is in one exchange at
a time, as a distributed version would run it. In an exchange the more loaded stage
hands its boundary layer (its last layer to the right neighbour, its first to the
left) to the other stage, so layer order always holds.

Acceptance is the paper's Lyapunov test: a move must lower the potential
Phi = sum over all stage pairs |L_a - L_b|. For a move of a layer of cost c from a
stage with load L_hi to one with load L_lo, Phi strictly decreases iff 0 < c < L_hi -
L_lo (a Robin Hood transfer: the pair's gap shrinks, and every third stage's two gaps
to the pair never grow; with c >= L_hi - L_lo the pair's values only spread or swap).
So the global test is decided from the two neighbours' own state, and the bottleneck
never grows (both new loads are below L_hi). The receiver must also stay within its
memory cap, and the giver keep a layer unless empty stages are allowed. Phi strictly
decreases with every move over a finite set of layouts, so the process stops; a round
cap bounds the time anyway.

If the starting layout itself breaks a cap, it is first repaired to the allowed
layout that moves the fewest bytes (the exact solver's tie-break DP with no load
limit), and the plan says so.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from dynmo_plugin.balancing.metrics import feasibility_problems
from dynmo_plugin.balancing.plan import Outcome
from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.balancing.segments import SegmentModel
from dynmo_plugin.layout import Layout

__all__ = ["solve_diffusion", "StageState", "exchange"]

log = logging.getLogger(__name__)


@dataclass
class StageState:
    """What one stage knows about itself (and shares with its neighbours)."""

    costs: list[float]       # its layers' costs, in order
    memory: list[float]      # its layers' bytes, in order
    load: float              # extras + sum(costs)
    used: float              # extras memory + sum(memory)
    capacity: float


def exchange(left: StageState, right: StageState, min_layers: int, load_tol: float,
             mem_tol: float, max_moves: int) -> int:
    """Move boundary layers between neighbours `left` and `right` (in place).

    Returns the signed number of layers moved (+ = left to right). Uses only the two
    stages' state, so each pair can decide on its own in a distributed run.
    """
    moved = 0
    while abs(moved) < max_moves:
        to_right = left.load > right.load
        giver, taker = (left, right) if to_right else (right, left)
        if len(giver.costs) <= min_layers:
            break
        idx = -1 if to_right else 0
        c, m = giver.costs[idx], giver.memory[idx]
        if not (load_tol < c < giver.load - taker.load - load_tol):
            break
        if taker.used + m > taker.capacity + mem_tol:
            break
        giver.costs.pop(idx), giver.memory.pop(idx)
        if to_right:
            taker.costs.insert(0, c), taker.memory.insert(0, m)
        else:
            taker.costs.append(c), taker.memory.append(m)
        giver.load, taker.load = giver.load - c, taker.load + c
        giver.used, taker.used = giver.used - m, taker.used + m
        moved += 1 if to_right else -1
    return moved


def _states(problem: BalanceProblem, layout: Layout) -> list[StageState]:
    costs, mem = list(problem.costs), problem.memory_arr.tolist()
    out = []
    for s, (lo, hi) in enumerate(zip(layout.boundaries, layout.boundaries[1:])):
        c, m = costs[lo:hi], mem[lo:hi]
        out.append(StageState(c, m, float(problem.extras_cost_arr[s]) + sum(c),
                              float(problem.extras_memory_arr[s]) + sum(m),
                              float(problem.capacity_arr[s])))
    return out


def _start(problem: BalanceProblem, notes: list[str]) -> Layout:
    start = problem.current or Layout.uniform(problem.num_layers, problem.num_stages)
    broken = feasibility_problems(problem, start)
    if not broken:
        return start
    bounds = SegmentModel(problem).closest(float("inf"), start.boundaries)
    if bounds is None:
        raise InfeasibleError(f"no layout of {problem.num_layers} layers on {problem.num_stages} "
                              "stages fits the memory caps; raise --capacity or add stages")
    repaired = Layout.from_boundaries(bounds)
    notes.append(f"start layout {start} is not allowed ({'; '.join(broken)}); diffusion started "
                 f"from the nearest allowed layout {repaired}")
    return repaired


def solve_diffusion(problem: BalanceProblem, max_rounds: int | None = None,
                    max_moves_per_exchange: int = 1) -> Outcome:
    """Diffuse load from the current layout (else the uniform split) until no move helps.

    `rounds` in the outcome counts rounds that moved at least one layer.

    Raises:
        ProblemError: a non-positive round cap or moves per exchange.
        InfeasibleError: no layout at all satisfies the memory caps.
    """
    cap = 10 * (problem.num_layers + problem.num_stages) if max_rounds is None else max_rounds
    if cap < 0 or max_moves_per_exchange < 1:
        raise ProblemError(f"max_rounds ({cap}) must be >= 0 and max_moves_per_exchange "
                           f"({max_moves_per_exchange}) >= 1")
    notes: list[str] = []
    states = _states(problem, _start(problem, notes))
    args = (problem.min_layers_per_stage, problem.load_tol, problem.mem_tol, max_moves_per_exchange)
    rounds, converged = 0, False
    while rounds < cap:
        moved = False
        for parity in (0, 1):
            for s in range(parity, problem.num_stages - 1, 2):
                moved |= exchange(states[s], states[s + 1], *args) != 0
        if not moved:
            converged = True
            break
        rounds += 1
    if not converged:
        notes.append(f"diffusion stopped at the round cap ({cap}) before converging")
    log.debug("diffusion: %d rounds, converged=%s", rounds, converged)
    return Outcome(Layout(tuple(len(st.costs) for st in states)), notes, rounds)
