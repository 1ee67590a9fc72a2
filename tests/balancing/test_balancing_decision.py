"""The fast decision path of `exact`: the bitset oracle and the banded tie-break
(`SegmentModel`) against the vectorised reference (`NumpySegmentModel`), the warm start
against the cold start (`solve_exact_reference`), and the plan's bookkeeping.

The brute-force oracle in test_balancing_properties.py judges optimality on small
instances; here the two implementations must return the *same* answers, exactly, also
on instances far too large for brute force. No timings are asserted (see
scripts/bench_balancers.py); the warm start is checked by counting oracle calls.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from test_balancing_properties import SETTINGS, build, cases

from dynmo_plugin.balancing import BalanceProblem, GateConfig, InfeasibleError, solve
from dynmo_plugin.balancing.exact import (_reference_bottleneck, optimal_bottleneck,
                                          reference_boundaries, solve_exact,
                                          solve_exact_reference)
from dynmo_plugin.balancing.metrics import migration_peak_memory, moved_layers
from dynmo_plugin.balancing import segments
from dynmo_plugin.balancing.segments import NumpySegmentModel, SegmentModel, _runs
from dynmo_plugin.layout import Layout


def candidates(pb: BalanceProblem) -> list[float]:
    """Every candidate bottleneck e_s + (P[j] - P[i]), as the solver computes it."""
    pre = pb.cost_prefix.tolist()
    return sorted({e + (pre[j] - pre[i]) for e in set(pb.extras_cost_arr.tolist())
                   for i in range(len(pre)) for j in range(i, len(pre))})


def same_answers(pb: BalanceProblem, thresholds: list[float]) -> None:
    fast, ref = SegmentModel(pb), NumpySegmentModel(pb)
    reference = reference_boundaries(pb)
    for t in thresholds:
        assert fast.is_feasible(t) == ref.is_feasible(t), t
        assert fast.closest(t, reference) == ref.closest(t, reference), t


# ---- small instances: every candidate threshold ------------------------------------------
@SETTINGS
@given(cases())
def test_bitset_oracle_and_tie_break_equal_the_numpy_reference_at_every_candidate(case):
    pb = build(case)
    if pb is None:
        return
    values = candidates(pb)
    tol = pb.load_tol
    same_answers(pb, values + [v - 3 * tol for v in values[::3]] + [-1.0, float("inf")])


@SETTINGS
@given(cases())
def test_warm_start_returns_the_cold_start_bottleneck_and_layout(case):
    pb = build(case)
    if pb is None:
        return
    try:
        cold = _reference_bottleneck(pb, NumpySegmentModel(pb))
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_exact(pb)
        return
    assert optimal_bottleneck(pb) == cold
    assert solve_exact(pb) == solve_exact_reference(pb)


# ---- large instances: far beyond brute force ------------------------------------------------
def _instance(rng: np.random.Generator, n: int, p: int, kind: str) -> BalanceProblem:
    """Shapes that stress different parts: holes (layers that fit no stage with big
    extras), tight memory, empty stages, zero and tied costs, warm and cold starts."""
    costs = rng.lognormal(0.0, 0.5, n)
    memory = rng.uniform(0.5, 1.5, n)
    extras = [0.0] * p
    extras[0], extras[-1] = 1.5, 2.0
    kw: dict = {}
    if kind == "holes":  # a few layers heavier than what the extras stages can take
        costs[rng.choice(n, max(2, n // 16), replace=False)] *= 12.0
        extras = rng.uniform(0, 3 * costs.mean() * n / p, p).tolist()
    elif kind == "memcap":
        kw = dict(memory=memory.tolist(), capacity=1.1 * memory.sum() / p + 1.0,
                  extras_memory=[1.0] + [0.0] * (p - 2) + [1.0])
    elif kind == "empty":
        kw = dict(allow_empty_stages=True)
        costs[: n // 2] = 0.0
    elif kind == "ties":
        costs = rng.integers(0, 3, n).astype(float)
        kw = dict(move_bytes=rng.integers(0, 4, n).tolist())
    base = BalanceProblem(costs=costs.tolist(), num_stages=p, extras_cost=extras, **kw)
    warm = solve_exact_reference(base)  # the layout running before the costs drift
    drifted = (costs * rng.uniform(0.9, 1.1, n)).tolist() if kind != "ties" else costs.tolist()
    current = {0: warm, 1: Layout.uniform(n, p), 2: None}[int(rng.integers(3))]
    return BalanceProblem(costs=drifted, num_stages=p, extras_cost=extras, current=current,
                          num_microbatches=2 * p, **kw)


@pytest.mark.parametrize("banded", [True, None], ids=["banded-dp", "dp-by-band-width"])
@pytest.mark.parametrize("kind", ["plain", "holes", "memcap", "empty", "ties"])
@pytest.mark.parametrize("n, p", [(48, 16), (256, 16), (300, 40)])
def test_large_instances_match_the_reference(kind, n, p, banded, monkeypatch):
    if banded:  # the banded DP however wide the band (else it may hand over to numpy)
        monkeypatch.setattr(segments, "_numpy_dp_is_faster", lambda *_: False)
    rng = np.random.default_rng(n * 1000 + p + len(kind))
    for _ in range(3):
        pb = _instance(rng, n, p, kind)
        try:
            best = _reference_bottleneck(pb, NumpySegmentModel(pb))
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_exact(pb)
            continue
        assert optimal_bottleneck(pb) == best
        assert solve_exact(pb) == solve_exact_reference(pb)
        tol = pb.load_tol
        same_answers(pb, [best, best - 3 * tol, best * 1.05, float("inf")])


def test_reachable_sets_with_holes_still_match():
    # At T = 8 stage 1's extras leave room for 3 light layers and not for layer 2 (cost
    # 6): after two stages positions 2 and 4..6 are reachable, 3 is not.
    pb = BalanceProblem(costs=[1, 1, 6, 1, 1, 1, 1, 1], num_stages=3, extras_cost=[0, 5, 0])
    model = SegmentModel(pb)
    budgets = model._budgets(8.0)
    reach = model._forward(budgets, model._fits(budgets))
    assert list(_runs(reach[2])) == [(2, 2), (4, 6)]
    same_answers(pb, candidates(pb))
    assert solve_exact(pb) == solve_exact_reference(pb)


def test_a_wide_band_hands_the_tie_break_to_numpy_with_the_same_answer():
    # One layer costs as much as all others: every split of the rest is optimal.
    pb = BalanceProblem(costs=[1.0] * 199 + [400.0], num_stages=8, current=Layout.uniform(200, 8))
    model = SegmentModel(pb)
    best = optimal_bottleneck(pb, model)
    with mock.patch.object(NumpySegmentModel, "closest", autospec=True,
                           side_effect=NumpySegmentModel.closest) as vectorised:
        layout = model.closest(best, pb.current.boundaries)
    assert vectorised.called
    with mock.patch.object(segments, "_numpy_dp_is_faster", lambda *_: False):
        assert model.closest(best, pb.current.boundaries) == layout
    assert Layout.from_boundaries(layout) == solve_exact_reference(pb)


class _Counting(SegmentModel):
    calls = 0

    def is_feasible(self, threshold: float) -> bool:
        type(self).calls += 1
        return super().is_feasible(threshold)


def test_warm_start_proves_an_optimal_current_layout_with_few_oracle_calls():
    rng = np.random.default_rng(7)
    costs = rng.lognormal(0.0, 0.5, 256).tolist()
    pb = BalanceProblem(costs=costs, num_stages=16, extras_cost=[1.0] + [0.0] * 14 + [2.0])
    optimal = solve_exact(pb)
    again = BalanceProblem(costs=costs, num_stages=16, extras_cost=pb.extras_cost, current=optimal)
    _Counting.calls = 0
    assert optimal_bottleneck(again, _Counting(again)) == optimal_bottleneck(pb)
    assert _Counting.calls <= 3  # the current bottleneck, the lower bound, the next candidate
    _Counting.calls = 0
    _reference_bottleneck(pb, _Counting(pb))
    assert _Counting.calls > 6  # what a cold start needs for the same answer
    plan = solve(again, "exact", gate=GateConfig(iterations_until_next_event=1,
                                                 bandwidth_bytes_per_s=1e9))
    assert plan.layout == optimal and plan.moves == [] and not plan.gate.apply


# ---- plan bookkeeping ----------------------------------------------------------------------
def test_moved_layers_from_boundaries_equal_layout_moved_layers():
    rng = np.random.default_rng(3)
    for _ in range(2000):
        n, p = int(rng.integers(0, 30)), int(rng.integers(1, 8))
        a, b = (Layout(tuple(int(c) for c in rng.multinomial(n, np.ones(p) / p))) for _ in "ab")
        assert moved_layers(a, b) == a.moved_layers(b)


def test_migration_peak_memory_with_and_without_precomputed_parts():
    pb = BalanceProblem(costs=[1, 1, 4, 4, 2], num_stages=3, memory=[10, 11, 12, 13, 14],
                        rebuild_bytes=[3, 3, 3, 3, 3], extras_rebuild_bytes=[1, 2, 3],
                        current=Layout((2, 2, 1)))
    after = Layout((3, 1, 1))
    plain = migration_peak_memory(pb, pb.current, after)
    assert plain == migration_peak_memory(pb, pb.current, after,
                                          moved=moved_layers(pb.current, after),
                                          memory_before=[21.0, 25.0, 14.0])
    assert plain == [21.0 + 2 * 12 + 9 + 1, 25.0 + 3 + 2, 14.0 + 3 + 3]
