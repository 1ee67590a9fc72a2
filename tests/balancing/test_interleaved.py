"""The descent on the interleaved iteration time (balancing/interleaved.py): what it scores
is what the gate predicts, its incremental evaluation of every move equals scoring the
moved layouts one by one, and its move set is the one documented.

The oracle does its own arithmetic in plain Python (virtual stage s on rank s % p; F = m x
the busiest rank's chunks + (p - 1) x the busiest virtual stage); where the descent as a
whole is judged against brute force: tests/run/test_interleaved_layout.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import BalanceProblem, InfeasibleError
from dynmo_plugin.balancing.interleaved import MAX_SHIFT, Moves, evaluate, scores
from dynmo_plugin.balancing.metrics import predicted_iteration_s, stage_loads
from dynmo_plugin.layout import Layout

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    """A problem and a layout that may break its caps (the evaluation must say so)."""
    p, v = draw(st.integers(1, 4)), draw(st.integers(2, 3))
    k = p * v
    empty = draw(st.booleans())
    n = draw(st.integers(1 if empty else k, 3 * k + 2))
    floats = lambda size: st.lists(st.floats(0, 10, allow_nan=False), min_size=size, max_size=size)  # noqa: E731
    ints = lambda size, hi: st.lists(st.integers(0, hi), min_size=size, max_size=size)  # noqa: E731
    costs, extras = draw(floats(n)), draw(floats(k))
    memory, extras_memory = draw(ints(n, 9)), draw(ints(k, 3))
    capacity = draw(st.none() | st.lists(st.integers(3 * v, 30), min_size=p, max_size=p))
    low = 0 if empty else 1
    cuts = sorted(draw(st.lists(st.integers(low, n - low), min_size=k - 1, max_size=k - 1)
                       if empty else st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1)))
    try:
        pb = BalanceProblem(costs=costs, num_stages=k, num_chunks=v, memory=memory,
                            capacity=capacity, extras_cost=extras, extras_memory=extras_memory,
                            allow_empty_stages=empty, num_microbatches=draw(st.integers(1, 8)))
    except InfeasibleError:   # a rank's extras alone exceed its cap
        pb = BalanceProblem(costs=costs, num_stages=k, num_chunks=v, memory=memory,
                            extras_cost=extras, allow_empty_stages=empty)
    return pb, (0, *cuts, n)


def _oracle(pb: BalanceProblem, bounds) -> tuple[bool, float, float]:
    """(admissible, F, spread) by hand."""
    p, k = pb.num_ranks, pb.num_stages
    segment = lambda values, s: sum(values[bounds[s]:bounds[s + 1]])  # noqa: E731
    extras = pb.extras_cost or [0.0] * k
    loads = [extras[s] + segment(pb.costs, s) for s in range(k)]
    ranks = [sum(loads[r::p]) for r in range(p)]
    memory = pb.memory or [0] * pb.num_layers
    extras_memory = pb.extras_memory or [0] * k
    rank_memory = [sum(extras_memory[s] + segment(memory, s) for s in range(r, k, p)) for r in range(p)]
    caps = pb.capacity or [float("inf")] * p
    ok = (all(b - a >= pb.min_layers_per_stage for a, b in zip(bounds, bounds[1:]))
          and bounds[0] == 0 and bounds[-1] == pb.num_layers
          and all(m <= c + 1e-9 * (sum(memory) + sum(extras_memory)) for m, c in zip(rank_memory, caps)))
    f = pb.num_microbatches * max(ranks) + (p - 1) * max(loads)
    return ok, f, sum(x * x for x in ranks) + sum(x * x for x in loads)


@SETTINGS
@given(problems())
def test_every_move_is_scored_as_the_moved_layout_would_be(case):
    pb, bounds = case
    moves = Moves.all(pb.num_stages, pb.num_ranks)
    ok, fs, spreads = evaluate(pb, np.asarray(bounds), moves)
    for i in range(moves.d.size):
        moved = moves.apply(np.asarray(bounds), i).tolist()
        want_ok, want_f, want_spread = _oracle(pb, moved)
        assert ok[i] == want_ok, (moved, moves.first[i], moves.last[i], moves.d[i])
        if want_ok:
            assert fs[i] == pytest.approx(want_f, rel=1e-9, abs=1e-9)
            assert spreads[i] == pytest.approx(want_spread, rel=1e-9, abs=1e-9)


@SETTINGS
@given(problems())
def test_the_descent_scores_what_the_gate_predicts(case):
    pb, bounds = case
    layout = Layout.from_boundaries(list(bounds), pb.num_chunks)
    f, spread = scores(pb, np.asarray([bounds]))
    gate = predicted_iteration_s(stage_loads(pb, layout), pb.num_microbatches, pb.num_chunks)
    assert f[0] == pytest.approx(gate, rel=1e-12, abs=1e-12)
    assert (f[0], spread[0]) == pytest.approx(_oracle(pb, bounds)[1:], rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("stages, ranks", [(4, 2), (6, 3), (8, 2), (9, 3)])
def test_the_moves_are_the_documented_runs(stages, ranks):
    """Runs of 1..p boundaries by 0 < |d| <= MAX_SHIFT, longer runs by |d| = 1; each once."""
    moves = Moves.all(stages, ranks)
    got = sorted(zip(moves.first.tolist(), moves.last.tolist(), moves.d.tolist()))
    want = sorted((f, last, d) for f in range(1, stages) for last in range(f, stages)
                  for d in range(-MAX_SHIFT, MAX_SHIFT + 1)
                  if d and (last - f + 1 <= ranks or abs(d) == 1))
    assert got == want
    bounds = np.arange(stages + 1) * 10
    i = list(zip(moves.first.tolist(), moves.last.tolist(), moves.d.tolist())).index((2, 3, -1))
    row = moves.apply(bounds, i)
    assert row.tolist() == [0, 10, 19, 29, *range(40, 10 * stages + 1, 10)]
