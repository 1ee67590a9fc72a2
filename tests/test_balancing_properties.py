"""Property tests: every balancer against brute force over all contiguous layouts.

Small random instances (<= 9 layers, <= 4 stages), with and without memory caps,
empty stages and extras. Integer costs/bytes make exact ties common, which is what
the tie-break needs to be tested on.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import (BalanceProblem, InfeasibleError, solve, stage_loads,
                                    stage_memory)
from dynmo_plugin.layout import Layout

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def compositions(n: int, p: int, min_part: int):
    """All layouts of n layers over p stages with >= min_part layers each."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1):
        bounds = [0, *cuts, n]
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if min(counts) >= min_part:
            yield Layout(tuple(counts))


@dataclass
class Brute:
    optimum: float | None
    best_moves: tuple[float, int] | None  # (bytes, layers) among optimal layouts


def allowed(pb: BalanceProblem, layout: Layout) -> bool:
    return all(m <= c + pb.mem_tol for m, c in zip(stage_memory(pb, layout), pb.capacity_arr))


def moved(pb: BalanceProblem, layout: Layout) -> tuple[float, int]:
    ref = pb.current or Layout.uniform(pb.num_layers, pb.num_stages)
    layers = [l for l, _, _ in ref.moved_layers(layout)]
    return sum(round(pb.move_bytes_arr[l - 1]) for l in layers), len(layers)


def brute(pb: BalanceProblem) -> Brute:
    ok = [L for L in compositions(pb.num_layers, pb.num_stages, pb.min_layers_per_stage)
          if allowed(pb, L)]
    if not ok:
        return Brute(None, None)
    best = min(max(stage_loads(pb, L)) for L in ok)
    optimal = [L for L in ok if max(stage_loads(pb, L)) <= best + pb.load_tol]
    return Brute(best, min(moved(pb, L) for L in optimal))


@st.composite
def problems(draw, integer_costs: bool = True, tied: bool = False) -> BalanceProblem:
    """Random instances; `tied` = few distinct costs, so many layouts are optimal."""
    p = draw(st.integers(1, 4))
    allow_empty = draw(st.booleans())
    n = draw(st.integers(1 if allow_empty else p, 9))
    if integer_costs:
        top = 2 if tied else draw(st.sampled_from([3, 12]))
        costs = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
    else:
        costs = draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n))
    memory = draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))
    move = draw(st.one_of(st.none(), st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    extras = draw(st.one_of(st.none(), st.lists(st.integers(0, 8), min_size=p, max_size=p)))
    extras_mem = draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=p, max_size=p)))
    capacity = draw(st.one_of(st.none(), st.integers(4, 60),
                              st.lists(st.integers(4, 60), min_size=p, max_size=p)))
    current = draw(st.sampled_from(list(compositions(n, p, 0))))
    if tied:
        return BalanceProblem(costs=costs, num_stages=p, memory=memory, move_bytes=move,
                              capacity=capacity, extras_cost=extras, current=current,
                              allow_empty_stages=allow_empty)
    return BalanceProblem(costs=costs, num_stages=p, memory=memory, move_bytes=move,
                          capacity=capacity, extras_cost=extras, extras_memory=extras_mem,
                          current=draw(st.one_of(st.none(), st.just(current))),
                          allow_empty_stages=allow_empty)


@SETTINGS
@given(st.data())
def test_exact_equals_brute_force_and_minimises_moves(data):
    try:
        pb = data.draw(problems())
    except InfeasibleError:  # extras alone exceed a capacity: rejected up front
        return
    ref = brute(pb)
    if ref.optimum is None:
        with pytest.raises(InfeasibleError):
            solve(pb, "exact")
        return
    plan = solve(pb, "exact")
    assert allowed(pb, plan.layout)
    assert min(plan.layout.counts) >= pb.min_layers_per_stage
    assert plan.bottleneck_after == pytest.approx(ref.optimum, abs=2 * pb.load_tol + 1e-12)
    assert moved(pb, plan.layout) == ref.best_moves


@SETTINGS
@given(st.data())
def test_exact_tie_break_is_min_bytes_then_layers_among_optimal(data):
    try:
        pb = data.draw(problems(tied=True))
    except InfeasibleError:
        return
    ref = brute(pb)
    assume(ref.optimum is not None)
    plan = solve(pb, "exact")
    assert plan.bottleneck_after == pytest.approx(ref.optimum, abs=2 * pb.load_tol + 1e-12)
    assert moved(pb, plan.layout) == ref.best_moves
    assert plan.bytes_moved == ref.best_moves[0] and len(plan.moves) == ref.best_moves[1]


@SETTINGS
@given(st.data())
def test_exact_is_optimal_with_float_costs(data):
    try:
        pb = data.draw(problems(integer_costs=False))
    except InfeasibleError:
        return
    ref = brute(pb)
    if ref.optimum is None:
        with pytest.raises(InfeasibleError):
            solve(pb, "exact")
        return
    plan = solve(pb, "exact")
    assert allowed(pb, plan.layout)
    assert plan.bottleneck_after <= ref.optimum + 2 * pb.load_tol + 1e-12


def check_heuristic(pb: BalanceProblem, method: str) -> None:
    ref = brute(pb)
    if ref.optimum is None:
        with pytest.raises(InfeasibleError):
            solve(pb, method)
        return
    plan = solve(pb, method)
    layout = plan.layout
    assert (layout.num_layers, layout.num_stages) == (pb.num_layers, pb.num_stages)
    assert allowed(pb, layout), plan.notes
    assert min(layout.counts) >= pb.min_layers_per_stage
    assert plan.bottleneck_after >= ref.optimum - 2 * pb.load_tol - 1e-12
    # order preserved: every layer's stage is non-decreasing in layer number
    assert layout.assignment() == sorted(layout.assignment())
    if pb.current is not None:
        assert [(m.layer, m.src, m.dst) for m in plan.moves] == pb.current.moved_layers(layout)


@SETTINGS
@given(st.data())
def test_partition_is_feasible_and_never_beats_exact(data):
    try:
        pb = data.draw(problems())
    except InfeasibleError:
        return
    check_heuristic(pb, "partition")


@SETTINGS
@given(st.data())
def test_diffusion_is_feasible_and_never_beats_exact(data):
    try:
        pb = data.draw(problems())
    except InfeasibleError:
        return
    check_heuristic(pb, "diffusion")


def potential(loads) -> float:
    return sum(abs(a - b) for a, b in itertools.combinations(loads, 2))


@SETTINGS
@given(st.data())
def test_diffusion_never_raises_bottleneck_or_potential_from_an_allowed_start(data):
    try:
        pb = data.draw(problems())
    except InfeasibleError:
        return
    start = pb.current or Layout.uniform(pb.num_layers, pb.num_stages)
    assume(allowed(pb, start) and min(start.counts) >= pb.min_layers_per_stage)
    plan = solve(pb, "diffusion")
    before = stage_loads(pb, start)
    assert plan.bottleneck_after <= max(before) + pb.load_tol
    assert potential(plan.stage_loads_after) <= potential(before) + 10 * pb.load_tol
    assert not plan.notes  # converged, no repair needed
