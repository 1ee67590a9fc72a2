"""The repack planner (`dynmo_plugin.balancing.repack`): unit tests, property tests
against brute force, and `dynmo plan --repack`.

The brute-force oracle is independent of the production code: it keeps the drawn
inputs raw (`Case`), enumerates every contiguous split of the layers over every stage
count with itertools, and does its own arithmetic (extras of the shrunk pipeline,
loads, memory with the margin, 1F1B time, moves, the migration's transient peak, the
live rebuild's peak).
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import (BalanceProblem, GateConfig, InfeasibleError, ProblemError,
                                    RepackCriteria, RepackPlan, first_fit_repack, metrics,
                                    plan_repack, shrink_problem)
from dynmo_plugin.cli import main
from dynmo_plugin.config import RepackConfig
from dynmo_plugin.layout import Layout

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
REL_TOL = 1e-9  # the documented tolerance (balancing/problem.py), restated

# 8 layers on 4 stages, all once cost 3; then 6 of them got 3x cheaper.
SHRUNK = [1, 1, 1, 1, 1, 1, 3, 3]


def shrunk_problem(**kw) -> BalanceProblem:
    base = dict(costs=SHRUNK, num_stages=4, current=Layout((2, 2, 2, 2)), num_microbatches=8)
    base.update(kw)
    return BalanceProblem(**base)


# ---- unit tests ----------------------------------------------------------------------------
def test_shrinking_profile_repacks_4_to_2():
    plan = plan_repack(shrunk_problem(), RepackCriteria(min_stages=2))
    assert plan.apply and plan.method == "dynmo"
    assert (plan.stages_before, plan.stages_after) == (4, 2)
    assert plan.layout_after.to_megatron() == "Etttttt|ttL"
    # 1F1B: 4 stages of 2|2|2|6 -> 12 + 7 * 6; 2 stages of 6|6 -> 12 + 7 * 6: no slower.
    assert plan.predicted_iter_s_before == plan.predicted_iter_s_after == 54
    assert plan.released_stages == [2, 3]


def test_interleaved_repack_keeps_the_chunks_per_rank():
    """pp = 4, v = 2 (one layer per virtual stage) onto 2 ranks x 2 chunks. Interleaved
    time: m x busiest rank + (pp - 1) x heaviest virtual stage. Now ranks {1,1}, {1,1},
    {1,3}, {1,3}: 8 x 4 + 3 x 3 = 41 s (164 GPU-s); K = 2: 3|3|3|3, 8 x 6 + 1 x 3 = 51 s
    (102 GPU-s); K = 1 and K = 3 cannot run the interleaved schedule on 8 micro-batches."""
    problem = shrunk_problem(num_stages=8, num_chunks=2, current=Layout((1,) * 8, 2),
                             memory=[10.0] * 8)
    plan = plan_repack(problem, RepackCriteria(objective="throughput_per_gpu", max_slowdown=1.3))
    assert plan.apply and (plan.stages_before, plan.stages_after) == (4, 2)
    assert str(plan.layout_after) == "Ettt|ttt|t|tL" and plan.layout_after.num_chunks == 2
    assert (plan.predicted_iter_s_before, plan.predicted_iter_s_after) == (41, 51)
    assert str(plan.intermediate_layout()) == "Ettt|ttt|||t|t||L" and plan.released_stages == [2, 3]
    assert [c.stages for c in plan.candidates if "interleaved schedule" in c.reason] == [1, 3]
    assert {(m.layer, m.src, m.dst): m.bytes for m in plan.moves} == {
        (2, 1, 0): 10, (3, 2, 0): 10, (4, 3, 1): 10, (5, 4, 1): 10, (6, 5, 1): 0,
        (7, 6, 4): 10, (8, 7, 5): 10}
    assert RepackPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert not plan_repack(problem, RepackCriteria(min_stages=2)).apply  # 51 s > 41 s
    assert plan_repack(problem, RepackCriteria(min_stages=2, max_slowdown=1.3)).stages_after == 2
    with pytest.raises(ProblemError, match="use plan_repack"):
        first_fit_repack(problem, RepackCriteria())


def test_interleaved_repack_is_refused_when_its_rebuild_overflows():
    """The plan above (each rank 4 layers of 10 bytes, all state) under a 60-byte cap: 40
    bytes fit in training, the rebuild holds 80 (interleaved: checked, no other split)."""
    problem = shrunk_problem(num_stages=8, num_chunks=2, current=Layout((1,) * 8, 2),
                             memory=[10.0] * 8, capacity=60)
    plan = plan_repack(problem, RepackCriteria(objective="throughput_per_gpu", max_slowdown=1.3,
                                               memory_margin=0))
    assert not plan.apply and plan.reason == (
        "refused for rebuild memory: K = 2 (Ettt|ttt|t|tL) qualifies, but the rebuild needs 80 B "
        "on rank 0 while its old stage and the new one coexist, above its cap 60 B")


def test_max_slowdown_is_respected():
    strict = plan_repack(shrunk_problem(), RepackCriteria(max_slowdown=1.0))
    assert strict.stages_after == 2  # one stage would take 12 + 7 * 12 = 96 s > 54 s
    assert strict.candidates[0].stages == 1 and not strict.candidates[0].fits
    loose = plan_repack(shrunk_problem(), RepackCriteria(max_slowdown=2.0))
    assert loose.stages_after == 1 and loose.predicted_iter_s_after == 96
    for plan, limit in ((strict, 1.0), (loose, 2.0)):
        assert plan.predicted_iter_s_after <= limit * plan.predicted_iter_s_before


def test_memory_caps_force_more_stages():
    """8 layers of 1 byte, 3 bytes per stage: 1 or 2 stages cannot hold them."""
    loose = RepackCriteria(max_slowdown=2.0, memory_margin=0)
    uncapped = plan_repack(shrunk_problem(memory=[1] * 8, move_bytes=[0.25] * 8), loose)
    capped = plan_repack(shrunk_problem(memory=[1] * 8, move_bytes=[0.25] * 8, capacity=3), loose)
    assert uncapped.stages_after == 1
    assert capped.apply and capped.stages_after == 3 and capped.layout_after.counts == (3, 3, 2)
    assert [c.fits for c in capped.candidates] == [False, False, True]
    assert "does not fit" in capped.candidates[0].reason  # recorded, not raised


def test_memory_margin_shrinks_the_caps():
    """A stage fits if memory x (1 + margin) <= cap: 4 bytes with margin 0.5 hold 2 layers."""
    pb = shrunk_problem(memory=[1] * 8, move_bytes=[0.25] * 8, capacity=4)
    assert plan_repack(pb, RepackCriteria(max_slowdown=2.0, memory_margin=0)).stages_after == 2
    with_margin = plan_repack(pb, RepackCriteria(max_slowdown=2.0, memory_margin=0.5))
    assert with_margin.stages_after == 4 and not with_margin.apply  # nothing smaller fits


def test_throughput_per_gpu_objective_matches_brute_force():
    pb = shrunk_problem()
    plan = plan_repack(pb, RepackCriteria(objective="throughput_per_gpu", max_slowdown=2.0))
    # per K: the best 1F1B time over every contiguous split; GPU-seconds = time x K
    best = {k: min(iteration(pb.costs, [0] * k, b, 8) for b in splits(8, k, False)) for k in (1, 2, 3)}
    expected = min(best, key=lambda k: (best[k] * k, k))
    assert best[expected] * expected < 54 * 4
    assert plan.apply and plan.stages_after == expected == 1
    chosen = [c for c in plan.candidates if c.stages == expected][0]
    assert chosen.tokens_per_gpu_s_rel == pytest.approx(1 / (best[expected] * expected))


def test_survivors_are_the_lowest_stages():
    pb = shrunk_problem(costs=[3, 3, 1, 1, 1, 1, 1, 1])  # the heavy layers at the front
    plan = plan_repack(pb, RepackCriteria(min_stages=2))
    k = plan.stages_after
    assert k == 2 and plan.released_stages == list(range(k, 4))
    assert all(m.dst < k for m in plan.moves)
    assert {m.layer for m in plan.moves} >= {5, 6, 7, 8}  # everything on stages 2-3 leaves


def test_intermediate_layout_keeps_released_stages_empty():
    plan = plan_repack(shrunk_problem(), RepackCriteria(min_stages=2))
    mid = plan.intermediate_layout()
    assert mid.counts == (6, 2, 0, 0) and mid.num_stages == plan.stages_before
    assert mid.to_megatron() == "Etttttt|tt||L"
    assert Layout.parse(mid.to_megatron()) == mid
    moved = {(layer, src, dst) for layer, src, dst in plan.layout_before.moved_layers(mid)}
    assert moved == {(m.layer, m.src, m.dst) for m in plan.moves}


def _gb_problem() -> BalanceProblem:
    """The shrunk profile in 10 ms units, 1 GB per layer to move."""
    return shrunk_problem(costs=[c / 100 for c in SHRUNK], memory=[1e9] * 8)


def test_gate_applies_when_the_saving_pays():
    gate = GateConfig(iterations_until_next_event=1000, bandwidth_bytes_per_s=1e9, margin=1.2)
    plan = plan_repack(_gb_problem(), RepackCriteria(min_stages=2, rebuild_s=10), gate)
    before, after = plan.predicted_iter_s_before, plan.predicted_iter_s_after
    assert plan.apply and "pays" in plan.reason
    assert plan.cost_s == pytest.approx(6e9 / 1e9 + 10)  # 6 layers move, then the rebuild
    assert plan.saving_gpu_s == pytest.approx(1000 * (4 * before - 2 * after))
    assert plan.saving_gpu_s > 1.2 * 4 * plan.cost_s


@pytest.mark.parametrize("horizon, bandwidth", [(1, 1e9), (0, 1e9), (1000, 1e3)],
                         ids=["tiny-horizon", "no-horizon", "tiny-bandwidth"])
def test_gate_refuses_when_the_move_does_not_pay(horizon, bandwidth):
    gate = GateConfig(iterations_until_next_event=horizon, bandwidth_bytes_per_s=bandwidth)
    plan = plan_repack(_gb_problem(), RepackCriteria(min_stages=2), gate)
    assert not plan.apply and "does not pay" in plan.reason
    assert plan.stages_after == plan.stages_before == 4 and plan.layout_after == plan.layout_before
    assert plan.moves == [] and plan.released_stages == [] and plan.bytes_moved == 0
    assert plan.saving_gpu_s <= 1.2 * 4 * plan.cost_s


def test_gate_refuses_a_migration_whose_transient_peak_overflows():
    """5 bytes per stage: 2 stages are too slow (best 5|3 layers: 61 s), 3 stages fit as
    4|3|1, but stage 0 would hold 2 own + 2 x 2 x 0.6 incoming + 4 x 0.4 rebuilt gradients
    = 6 bytes while migrating. (Each layer's state is 0.6 of its byte, so the rebuild
    after the shrink, 2 x 4 x 0.6 = 4.8 bytes on rank 0, fits: the migration refuses.)"""
    plan = plan_repack(shrunk_problem(memory=[1] * 8, move_bytes=[0.6] * 8, rebuild_bytes=[0.4] * 8,
                                      capacity=5),
                       RepackCriteria(min_stages=2, memory_margin=0))
    assert not plan.apply and "migration needs 6 B on stage 0" in plan.reason
    assert plan.candidates[-1].fits and plan.candidates[-1].layout.counts == (4, 3, 1)


def test_rebuild_memory_counts_the_old_and_the_new_stage_and_the_head_twice():
    """Survivor r at the rebuild: its intermediate stage's extras + its layers' state, the
    new stage's (shrunk) extras + the same layers' state, and on the new last rank the
    head it received. Extras: embedding 10 on stage 0, head 20 on stage 3, 1 and 3 in
    the middle (shrunk to K = 2: 10 | 20)."""
    pb = BalanceProblem(costs=[1] * 6, num_stages=4, memory=[50] * 6, move_bytes=[1, 2, 3, 4, 5, 6],
                        extras_memory=[10, 1, 3, 20], current=Layout((2, 2, 1, 1)))
    two = Layout((3, 3))
    assert metrics.repack_rebuild_memory(pb, shrink_problem(pb, 2), two) == [
        (10 + 6) + (10 + 6), (1 + 15) + (20 + 15) + 20]
    one = Layout((6,))  # K = 1: the new stage holds embedding and head
    assert metrics.repack_rebuild_memory(pb, shrink_problem(pb, 1), one) == [(10 + 21) + (30 + 21) + 20]


def test_rebuild_memory_interleaved_is_per_rank():
    """pp = 4, v = 2 onto 2 ranks x 2 chunks: rank 0 keeps chunks with layers 1-2 and 5-6,
    rank 1 with 3-4 and 7-8 (move bytes = layer number); embedding 10 on the first
    virtual stage, head 20 on the last."""
    pb = BalanceProblem(costs=[1] * 8, num_stages=8, num_chunks=2, move_bytes=list(range(1, 9)),
                        extras_memory=[10, 0, 0, 0, 0, 0, 0, 20], current=Layout((1,) * 8, 2))
    layout = Layout((2, 2, 2, 2), 2)
    assert metrics.repack_rebuild_memory(pb, shrink_problem(pb, 2), layout) == [
        (10 + 14) + (10 + 14), 22 + (20 + 22) + 20]


def test_a_rebuild_that_overflows_makes_the_planner_take_more_stages():
    """1.5 bytes per layer in training, 1 of it state; 11 bytes per stage. K = 2 splits 6|2:
    9 bytes on stage 0 fit, and so does the migration (3 own + 2 x 4 incoming = 11), but the
    rebuild holds stage 0's six layers twice: 12 bytes. K = 3 (4|3|1) fits all three."""
    pb = shrunk_problem(memory=[1.5] * 8, move_bytes=[1] * 8, capacity=11)
    two = Layout((6, 2))
    assert metrics.memory_violations(shrink_problem(pb, 2), two) == []
    assert max(metrics.migration_peak_memory(pb, pb.current, two.padded(4))) == 11
    plan = plan_repack(pb, RepackCriteria(min_stages=2, memory_margin=0))
    assert plan.apply and plan.stages_after == 3 and plan.layout_after.counts == (4, 3, 1)
    k2 = plan.candidates[0]
    assert k2.stages == 2 and not k2.fits and k2.layout == two
    assert k2.reason == ("rebuild does not fit: the rebuild needs 12 B on rank 0 while its old "
                         "stage and the new one coexist, above its cap 11 B")
    assert any(line.split()[:1] == ["2"] and "rebuild needs 12 B" in line for line in str(plan).splitlines())
    assert metrics.repack_rebuild_memory(pb, shrink_problem(pb, 3), plan.layout_after) == [8, 6, 2]


def test_a_rebuild_that_overflows_makes_the_planner_take_a_slower_split_of_the_same_k():
    """As above with max_slowdown 1.2: the fastest 2-stage split 6|2 overflows the rebuild
    (12 > 11 bytes), 5|3 fits it (10 and 6 bytes) and takes 12 + 7 x 7 = 61 s <= 1.2 x 54:
    2 stages still, not 3, and the table says why the split is not the fastest."""
    pb = shrunk_problem(memory=[1.5] * 8, move_bytes=[1] * 8, capacity=11)
    plan = plan_repack(pb, RepackCriteria(min_stages=2, memory_margin=0, max_slowdown=1.2))
    assert plan.apply and plan.stages_after == 2 and plan.layout_after.counts == (5, 3)
    assert plan.predicted_iter_s_after == 61
    (k2,) = plan.candidates
    assert k2.fits and k2.reason.endswith(
        "split chosen for the rebuild, the fastest one would not fit it: Etttttt|ttL: the rebuild "
        "needs 12 B on rank 0 while its old stage and the new one coexist, above its cap 11 B")
    assert metrics.repack_rebuild_memory(pb, shrink_problem(pb, 2), plan.layout_after) == [10, 6]


def test_a_rebuild_that_overflows_refuses_the_repack_with_one_reason():
    """2 stages onto 1: 4 layers of 1.5 bytes (1 of it state) fit 7 bytes, the migration
    too (3 own + 2 x 2 incoming = 7), the rebuild (2 x 4) does not: no repack, and the
    decision line says why."""
    pb = BalanceProblem(costs=[1] * 4, num_stages=2, memory=[1.5] * 4, move_bytes=[1] * 4,
                        capacity=7, current=Layout((2, 2)))
    plan = plan_repack(pb, RepackCriteria(memory_margin=0))
    assert not plan.apply and plan.stages_after == 2 and plan.moves == []
    assert plan.reason == ("refused for rebuild memory: K = 1 (EttttL) qualifies, but the rebuild "
                           "needs 8 B on rank 0 while its old stage and the new one coexist, above "
                           "its cap 7 B")
    assert str(plan).splitlines()[-1].startswith(f"decision: keep - {plan.reason}  [")
    ff = first_fit_repack(pb, RepackCriteria(memory_margin=0))  # the baseline is refused too
    assert not ff.apply and ff.reason == ("2 -> 1 stages: refused: the rebuild needs 8 B on rank 0 "
                                          "while its old stage and the new one coexist, above its cap 7 B")


def test_first_fit_merges_only_adjacent_whole_stages():
    """Counts 3|2|2|1 at 1 byte per layer, 4 bytes per stage: first fit packs 3 | 2+2 | 1,
    while the exact split needs only 2 stages (4|4)."""
    pb = BalanceProblem(costs=[1] * 8, num_stages=4, current=Layout((3, 2, 2, 1)), memory=[1] * 8,
                        move_bytes=[0.1] * 8, capacity=4)
    criteria = RepackCriteria(max_slowdown=10, memory_margin=0)
    ff = first_fit_repack(pb, criteria)
    ours = plan_repack(pb, criteria)
    assert ff.method == "first_fit" and ff.apply and ff.layout_after.counts == (3, 4, 1)
    # stage 2 joins stage 1; stage 3 becomes survivor 2 (survivors are the lowest ranks)
    assert [(m.layer, m.src, m.dst) for m in ff.moves] == [(6, 2, 1), (7, 2, 1), (8, 3, 2)]
    assert ours.apply and ours.layout_after.counts == (4, 4)


def test_first_fit_without_room_keeps_the_pipeline():
    pb = BalanceProblem(costs=[1] * 4, num_stages=2, current=Layout((2, 2)), memory=[1] * 4,
                        capacity=3)
    plan = first_fit_repack(pb, RepackCriteria(memory_margin=0))
    assert not plan.apply and "merges no stages" in plan.reason and plan.stages_after == 2


@pytest.mark.parametrize("make", [
    lambda: plan_repack(shrunk_problem(), RepackCriteria(min_stages=2)),
    lambda: plan_repack(_gb_problem(), RepackCriteria(), GateConfig(iterations_until_next_event=1,
                                                                    bandwidth_bytes_per_s=1e9)),
    lambda: plan_repack(shrunk_problem(), RepackCriteria(min_stages=4)),
    lambda: first_fit_repack(shrunk_problem(memory=[1] * 8, capacity=9), RepackCriteria()),
], ids=["applied", "refused", "nothing", "first-fit"])
def test_to_dict_round_trips_and_is_json(make):
    plan = make()
    text = json.dumps(plan.to_dict(), allow_nan=False)
    back = RepackPlan.from_dict(json.loads(text))
    assert back == plan
    assert back.to_dict() == plan.to_dict()


def test_from_dict_rejects_other_dicts():
    with pytest.raises(ProblemError, match="not a repack plan"):
        RepackPlan.from_dict({"method": "exact"})


def test_str_is_readable():
    text = str(plan_repack(shrunk_problem(), RepackCriteria()))
    lines = text.splitlines()
    assert lines[0].startswith("repack (dynmo): 4 -> 2 stages") and "Etttttt|tt||L" in lines[0]
    assert any(line.split()[:1] == ["1"] and "exceeds max_slowdown" in line for line in lines)
    assert any(line.split()[:1] == ["2"] and "Etttttt|ttL" in line for line in lines)
    assert "moves: 6 layer(s)" in text and lines[-1].startswith("decision: REPACK")
    kept = str(plan_repack(shrunk_problem(), RepackCriteria(min_stages=4)))
    assert kept.splitlines()[0].startswith("repack (dynmo): keep 4 stages")
    assert "decision: keep" in kept


def test_shrink_problem_extras():
    pb = BalanceProblem(costs=[1] * 6, num_stages=5, extras_cost=[2, 1, 3, 0, 5],
                        extras_memory=[4, 0, 0, 2, 6], extras_rebuild_bytes=[1, 1, 1, 1, 1],
                        capacity=[10, 20, 30, 40, 50], current=Layout.uniform(6, 5))
    three = shrink_problem(pb, 3)
    assert three.extras_cost == (2, 1, 5)  # median of the middle extras 1, 3, 0
    assert three.extras_memory == (4, 0, 6) and three.extras_rebuild_bytes == (1, 1, 1)
    assert three.capacity == (10, 20, 30) and three.current is None
    assert three.costs == pb.costs and three.num_microbatches == pb.num_microbatches
    assert shrink_problem(pb, 2).extras_cost == (2, 5)
    assert shrink_problem(pb, 1).extras_cost == (7,) and shrink_problem(pb, 1).extras_memory == (10,)
    assert shrink_problem(pb, 5).extras_cost == pb.extras_cost
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ProblemError):
            shrink_problem(pb, bad)


def test_shrink_problem_reports_extras_that_do_not_fit():
    pb = BalanceProblem(costs=[1] * 3, num_stages=3, extras_memory=[6, 0, 6], capacity=10)
    with pytest.raises(InfeasibleError):
        shrink_problem(pb, 1)


def test_plan_needs_the_current_layout():
    with pytest.raises(ProblemError, match="current layout"):
        plan_repack(BalanceProblem(costs=[1, 2], num_stages=2), RepackCriteria())


def test_nothing_to_consider_below_min_stages_or_on_one_stage():
    for pb, criteria in ((shrunk_problem(), RepackCriteria(min_stages=4)),
                         (BalanceProblem(costs=[1], num_stages=1, current=Layout((1,))), RepackCriteria())):
        for plan in (plan_repack(pb, criteria), first_fit_repack(pb, criteria)):
            assert not plan.apply and plan.candidates == [] and "nothing to consider" in plan.reason


def test_criteria_validation_and_from_config():
    assert RepackCriteria.from_config(RepackConfig()) == RepackCriteria()
    cfg = RepackConfig(min_stages=2, max_slowdown=1.1, objective="throughput_per_gpu",
                       memory_margin=0.2, rebuild_s=3.0)
    assert RepackCriteria.from_config(cfg) == RepackCriteria(
        min_stages=2, max_slowdown=1.1, objective="throughput_per_gpu", memory_margin=0.2, rebuild_s=3.0)
    for bad in (dict(min_stages=0), dict(max_slowdown=0), dict(max_slowdown=math.nan),
                dict(objective="fastest"), dict(memory_margin=-0.1), dict(rebuild_s=math.inf)):
        with pytest.raises(ProblemError):
            RepackCriteria(**bad)


# ---- the oracle -------------------------------------------------------------------------------
Bounds = tuple[int, ...]


def splits(n: int, k: int, allow_empty: bool) -> Iterator[Bounds]:
    """Every contiguous split of n layers over k stages."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = (0, *cuts, n)
        if allow_empty or all(b > a for a, b in zip(bounds, bounds[1:])):
            yield bounds


def per_stage(values: Sequence[float], extras: Sequence[float], bounds: Bounds) -> list[float]:
    return [extras[s] + sum(values[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]


def iteration(costs: Sequence[float], extras: Sequence[float], bounds: Bounds, m: int) -> float:
    loads = per_stage(costs, extras, bounds)
    return sum(loads) + (m - 1) * max(loads)


def shrunk_extras(values: Sequence[float], k: int) -> list[float]:
    """The documented rule: first, median of the old middles (0 if none), last; k = 1 sums
    first and last; k = P keeps them."""
    p = len(values)
    if k == p:
        return list(values)
    if k == 1:
        return [values[0] + values[-1]]
    middle = statistics.median(values[1:-1]) if p > 2 else 0
    return [values[0], *[middle] * (k - 2), values[-1]]


def assignment(bounds: Bounds) -> list[int]:
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


@dataclass(frozen=True)
class Case:
    costs: tuple[int, ...]
    memory: tuple[int, ...]
    move_bytes: tuple[int, ...]
    extras_cost: tuple[int, ...]
    extras_memory: tuple[int, ...]
    capacity: tuple[int, ...] | None
    current: Bounds
    allow_empty: bool
    microbatches: int
    min_stages: int
    max_slowdown: float
    objective: str
    margin: float

    @property
    def n(self) -> int:
        return len(self.costs)

    @property
    def p(self) -> int:
        return len(self.current) - 1

    def problem(self) -> BalanceProblem:
        counts = tuple(b - a for a, b in zip(self.current, self.current[1:]))
        return BalanceProblem(costs=self.costs, num_stages=self.p, memory=self.memory,
                              move_bytes=self.move_bytes, capacity=self.capacity,
                              extras_cost=self.extras_cost, extras_memory=self.extras_memory,
                              current=Layout(counts), allow_empty_stages=self.allow_empty,
                              num_microbatches=self.microbatches)

    def criteria(self) -> RepackCriteria:
        return RepackCriteria(min_stages=self.min_stages, max_slowdown=self.max_slowdown,
                              objective=self.objective, memory_margin=self.margin)

    def caps(self, k: int) -> list[float]:
        return [math.inf] * k if self.capacity is None else list(self.capacity[:k])

    def fits(self, bounds: Bounds) -> bool:
        """Every stage's memory x (1 + margin) within its cap (k = len(bounds) - 1 stages)."""
        k = len(bounds) - 1
        mem = per_stage(self.memory, shrunk_extras(self.extras_memory, k), bounds)
        return all(x * (1 + self.margin) <= c * (1 + REL_TOL) for x, c in zip(mem, self.caps(k)))

    def time(self, bounds: Bounds) -> float:
        k = len(bounds) - 1
        return iteration(self.costs, shrunk_extras(self.extras_cost, k), bounds, self.microbatches)

    def bottleneck(self, bounds: Bounds) -> float:
        k = len(bounds) - 1
        return max(per_stage(self.costs, shrunk_extras(self.extras_cost, k), bounds))

    def moved(self, bounds: Bounds) -> tuple[int, int]:
        """(bytes, layers) leaving their current stage for `bounds` (padded with empty stages)."""
        layers = [i for i, (a, b) in enumerate(zip(assignment(self.current), assignment(bounds)))
                  if a != b]
        return sum(self.move_bytes[i] for i in layers), len(layers)

    def peak_fits(self, bounds: Bounds) -> bool:
        """The migration to `bounds` (+ empty released stages): each stage holds its memory
        before plus twice what it receives, within its cap."""
        if self.capacity is None:
            return True
        before = per_stage(self.memory, self.extras_memory, self.current)
        for i, (a, b) in enumerate(zip(assignment(self.current), assignment(bounds))):
            if a != b:
                before[b] += 2 * self.move_bytes[i]
        return all(x <= c * (1 + REL_TOL) for x, c in zip(before, self.capacity))

    def rebuild_fits(self, bounds: Bounds) -> bool:
        """The live rebuild onto `bounds` (k < p stages): survivor r holds its old stage's
        state (its current extras and its layers' move bytes, no activations) and the new
        stage's (the shrunk extras and the same layers again), and the new last stage also
        the head it received (the old last stage's extras); within its cap, no margin."""
        if self.capacity is None:
            return True
        k = len(bounds) - 1
        new_extras = shrunk_extras(self.extras_memory, k)
        for r in range(k):
            state = sum(self.move_bytes[bounds[r]:bounds[r + 1]])
            held = self.extras_memory[r] + state + new_extras[r] + state
            if r == k - 1:
                held += self.extras_memory[-1]
            if held > self.capacity[r] * (1 + REL_TOL):
                return False
        return True


@dataclass
class Best:
    """Per K: the best split's time and bottleneck, and the fewest (bytes, layers) moved
    among the splits with that bottleneck; None when nothing fits. A split fits when
    every stage's memory (with the margin) and the live rebuild fit their caps."""

    time: float | None
    bottleneck: float | None
    moved: tuple[int, int] | None


def brute(case: Case, k: int) -> Best:
    ok = [b for b in splits(case.n, k, case.allow_empty) if case.fits(b) and case.rebuild_fits(b)]
    if not ok:
        return Best(None, None, None)
    best = min(case.bottleneck(b) for b in ok)
    optimal = [b for b in ok if case.bottleneck(b) <= best * (1 + REL_TOL)]
    return Best(min(case.time(b) for b in ok), best, min(case.moved(b) for b in optimal))


def expected_k(case: Case) -> int | None:
    """The stage count the criteria ask for, by brute force over every K."""
    now = iteration(case.costs, case.extras_cost, case.current, case.microbatches)
    best = {k: brute(case, k) for k in range(case.min_stages, case.p)}
    ok = {k: b.time for k, b in best.items() if b.time is not None}
    if case.objective == "min_stages":
        within = [k for k, t in ok.items() if t <= case.max_slowdown * now * (1 + REL_TOL)]
        return min(within, default=None)
    ok = {k: t for k, t in ok.items() if t <= case.max_slowdown * now * (1 + REL_TOL)}
    if not ok:  # max_slowdown bounds every objective
        return None
    k = min(ok, key=lambda k: (ok[k] * k, k))
    return k if ok[k] * k < now * case.p * (1 - REL_TOL) else None


@st.composite
def cases(draw, tight: bool = False) -> Case:
    """`tight`: always capped, all memory state, small caps: the rebuild often binds."""
    p = draw(st.integers(2, 4))
    allow_empty = draw(st.booleans())
    n = draw(st.integers(1 if allow_empty else p, 8))
    ints = lambda hi, size: st.lists(st.integers(0, hi), min_size=size, max_size=size)  # noqa: E731
    per_stage_caps = st.lists(st.integers(2, 30), min_size=p, max_size=p).map(tuple)
    capacity = draw(st.one_of(st.none(), st.integers(4, 30).map(lambda c: (c,) * p), per_stage_caps)
                    if not tight else st.integers(4, 16).map(lambda c: (c,) * p) | per_stage_caps)
    memory = tuple(draw(ints(5, n)))
    # half the time all of a layer's memory is state (what a costs file without move_bytes
    # means): the rebuild's peak, which counts state twice, is then often the binding cap
    state_only = tight or draw(st.booleans())
    return Case(
        costs=tuple(draw(ints(9, n))), memory=memory,
        move_bytes=memory if state_only else tuple(draw(ints(2, n))),
        extras_cost=tuple(draw(st.one_of(st.just([0] * p), ints(6, p)))),
        extras_memory=tuple(draw(st.one_of(st.just([0] * p), ints(3, p)))),
        capacity=capacity, current=draw(st.sampled_from(list(splits(n, p, allow_empty)))),
        allow_empty=allow_empty, microbatches=draw(st.integers(1, 4)),
        min_stages=draw(st.integers(1, p)), max_slowdown=draw(st.sampled_from([1.0, 1.25, 1.5, 2.0, 4.0])),
        objective=draw(st.sampled_from(["min_stages", "throughput_per_gpu"])),
        margin=draw(st.sampled_from([0.0, 0.25, 0.5])))


def build(case: Case) -> BalanceProblem:
    try:
        return case.problem()
    except InfeasibleError:  # the current stages' extras alone overflow: not a repack question
        assume(False)
        raise


# ---- property tests ----------------------------------------------------------------------------
@given(case=cases())
@SETTINGS
def test_plan_repack_matches_brute_force(case):
    check_against_brute_force(case)


@given(case=cases(tight=True))
@SETTINGS
def test_plan_repack_matches_brute_force_when_the_rebuild_binds(case):
    check_against_brute_force(case)


def check_against_brute_force(case: Case) -> None:
    plan = plan_repack(build(case), case.criteria())
    k = expected_k(case)
    chosen = [c for c in plan.candidates if c.fits]
    if case.objective == "min_stages":
        assert [c.stages for c in chosen] == ([] if k is None else [k])
        assert [c.stages for c in plan.candidates] == list(range(case.min_stages, k + 1 if k else case.p))
    if k is None:
        assert not plan.apply and plan.stages_after == case.p and plan.moves == []
        return
    cand = [c for c in chosen if c.stages == k]
    assert cand, (k, plan.candidates)
    best = brute(case, k)
    bounds = (0, *itertools.accumulate(cand[0].layout.counts))
    assert case.fits(bounds)
    assert case.bottleneck(bounds) == pytest.approx(best.bottleneck, abs=1e-9)
    assert cand[0].predicted_iter_s == pytest.approx(best.time, abs=1e-9)
    assert case.moved(bounds) == best.moved  # fewest bytes, then layers, among optimal splits
    assert plan.apply == case.peak_fits(bounds)  # no gate: only the transient peak can refuse
    if plan.apply:
        assert plan.stages_after == k and plan.layout_after == cand[0].layout
        assert plan.released_stages == list(range(k, case.p))
        assert plan.bytes_moved == case.moved(bounds)[0]
        assert all(m.dst < k for m in plan.moves)


@given(case=st.one_of(cases(), cases(tight=True)))
@SETTINGS
def test_every_applied_repack_fits_its_rebuild_and_migration_peaks(case):
    """Whatever plans a repack, its transients fit every cap (the oracle's own arithmetic):
    the migration to the intermediate layout and the rebuild after the shrink; a plan
    refused for rebuild memory names a K whose split the rebuild indeed overflows."""
    pb = build(case)
    for plan in (plan_repack(pb, case.criteria()), first_fit_repack(pb, case.criteria())):
        if plan.apply:
            bounds = (0, *itertools.accumulate(plan.layout_after.counts))
            assert case.rebuild_fits(bounds) and case.peak_fits(bounds), plan
        elif plan.reason.startswith("refused for rebuild memory"):
            (named,) = [c for c in plan.candidates if c.reason.startswith("rebuild does not fit")][:1]
            assert not case.rebuild_fits((0, *itertools.accumulate(named.layout.counts)))


@given(case=cases())
@SETTINGS
def test_first_fit_never_reorders_and_respects_the_cap(case):
    pb = build(case)
    plan = first_fit_repack(pb, case.criteria())
    if not plan.candidates:
        assert not plan.apply and plan.stages_after == case.p
        return
    (cand,) = plan.candidates
    k = cand.stages
    bounds = (0, *itertools.accumulate(cand.layout.counts))
    assert case.min_stages <= k < case.p and case.fits(bounds)
    assert set(bounds) <= set(case.current)  # whole stages merged: every new boundary was one
    old, new = assignment(case.current), assignment(bounds)
    assert all(new[i] <= new[i + 1] for i in range(case.n - 1))  # layer order kept
    assert all(new[i] <= old[i] for i in range(case.n))  # layers only move to lower stages
    assert all(m.dst < m.src for m in plan.moves)
    # ours, with time unconstrained, never needs more stages than first fit to fit memory
    # (a K ours refuses only for the rebuild's peak fits memory: both plans face that check)
    free = RepackCriteria(min_stages=case.min_stages, max_slowdown=1e9, memory_margin=case.margin)
    ours = [c for c in plan_repack(pb, free).candidates
            if c.fits or c.reason.startswith("rebuild does not fit")]
    assert ours and ours[0].stages <= k


# ---- dynmo plan --repack ------------------------------------------------------------------------
def _costs_file(tmp_path, doc=None) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc if doc is not None else {"costs": SHRUNK, "memory": [1] * 8}))
    return str(path)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_repack_readable(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", _costs_file(tmp_path),
                          "--current-layout", "Ett|tt|tt|ttL", "--microbatches", "8", "--repack",
                          "--min-stages", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("repack (dynmo): 4 -> 2 stages")
    assert "decision: REPACK" in out.stdout


def test_cli_repack_json_is_one_document(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", _costs_file(tmp_path),
                          "--current-layout", "Ett|tt|tt|ttL", "--microbatches", "8", "--repack",
                          "--max-slowdown", "2", "--objective", "min_stages", "--json",
                          "--gate-iterations", "1000", "--bandwidth", "1GB"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["apply"] and plan["stages_after"] == 1 and plan["layout_after"] == "EttttttttL"
    assert plan["intermediate_layout"] == "Etttttttt|||L"
    assert RepackPlan.from_dict(plan).stages_after == 1


def test_cli_repack_options(tmp_path):
    costs = _costs_file(tmp_path)
    code, out, _ = _cli("plan", "--costs", costs, "--stages", "4", "--microbatches", "8", "--repack",
                        "--objective", "throughput_per_gpu", "--max-slowdown", "2", "--json")
    assert code == 0 and json.loads(out)["stages_after"] == 1  # uniform current split assumed
    capped = ("--current-layout", "Ett|tt|tt|ttL", "--repack", "--capacity", "3", "--memory-margin",
              "0", "--max-slowdown", "4", "--rebuild-s", "0", "--microbatches", "8")
    # 3 x 3 stages fit 3 bytes; each layer's whole byte is state (move_bytes = memory), so
    # survivor 0 would hold its 3 layers twice while rebuilding: 6 bytes
    code, out, _ = _cli("plan", costs, *capped)
    assert code == 0 and "keep 4 stages" in out
    assert out.splitlines()[-1].startswith("decision: keep - refused for rebuild memory: K = 3 "
                                           "(Ettt|ttt|ttL) qualifies, but the rebuild needs 6 B on rank 0")
    # with 0.4 of each byte state the rebuild fits (2.4 bytes), the migration does not
    light = _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * 8, "move_bytes": [0.4] * 8})
    code, out, _ = _cli("plan", light, *capped)
    assert code == 0 and "keep 4 stages" in out and "migration needs 4 B on stage 1" in out
    code, out, _ = _cli("plan", costs, "--stages", "2", "--method", "exact")  # the positional file
    assert code == 0 and out.startswith("plan (exact)")


@pytest.mark.parametrize("args, message", [
    (["--repack", "--min-stages", "0"], "--min-stages must be an integer between 1"),
    (["--repack", "--max-slowdown", "0"], "--max-slowdown must be a finite number > 0"),
    (["--repack", "--max-slowdown", "nan"], "--max-slowdown"),
    (["--repack", "--memory-margin", "-1"], "--memory-margin"),
    (["--repack", "--rebuild-s", "inf"], "--rebuild-s"),
    (["--repack", "--method", "diffusion"], "exact solver"),
    (["--repack", "--max-rounds", "3"], "--max-rounds"),
    (["--min-stages", "2", "--method", "exact"], "--min-stages only applies with --repack"),
    ([], "--method is required"),
    (["--repack", "--current-layout", "Et|tL"], "has 2 stages but the pipeline has 4"),
])
def test_cli_repack_bad_input_is_one_line_exit_2(tmp_path, args, message):
    code, out, err = _cli("plan", _costs_file(tmp_path), "--stages", "4", *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and err.startswith("dynmo plan: error:"), err


def test_cli_needs_one_costs_file_and_a_stage_count(tmp_path):
    costs = _costs_file(tmp_path)
    for argv, message in ((["--repack", "--stages", "4"], "no costs file"),
                          ([costs, "--costs", costs + "x", "--repack", "--stages", "4"], "two costs files"),
                          ([costs, "--repack"], "give --stages or --current-layout")):
        code, _, err = _cli("plan", *argv)
        assert code == 2 and message in err and err.count("\n") == 1, err


_FLAG_VALUES = {
    "--min-stages": st.sampled_from(["1", "2", "3", "0", "-1", "x", "99999999"]),
    "--max-slowdown": st.sampled_from(["1", "1.5", "0", "-1", "nan", "inf", "x"]),
    "--objective": st.sampled_from(["min_stages", "throughput_per_gpu", "bogus"]),
    "--memory-margin": st.sampled_from(["0", "0.1", "-0.5", "nan"]),
    "--rebuild-s": st.sampled_from(["0", "10", "-1", "inf"]),
    "--capacity": st.sampled_from(["2", "4", "8", "1e9", "0"]),
    "--gate-iterations": st.sampled_from(["0", "10", "100000"]),
    "--stages": st.sampled_from(["1", "2", "4", "9", "0"]),
    "--current-layout": st.sampled_from(["Ett|tt|tt|ttL", "EttttttttL", "Et|tL", "E|ttttttt|tL"]),
    "--microbatches": st.sampled_from(["1", "4", "0"]),
}


# Values outside the range each flag states (dynmo plan --help, cli/plan.py): whatever else
# is given, the command must refuse them (exit 2). The rest may plan or be refused for how
# they combine (a layout of other layers, a cap no split fits): either outcome is checked
# for its form only.
_OUT_OF_RANGE = {
    "--min-stages": {"0", "-1", "x", "99999999"},          # an integer in [1, 100000]
    "--max-slowdown": {"0", "-1", "nan", "inf", "x"},      # finite, > 0
    "--objective": {"bogus"},
    "--memory-margin": {"-0.5", "nan"},                    # finite, >= 0
    "--rebuild-s": {"-1", "inf"},                          # finite, >= 0
    "--capacity": {"0"},                                   # a positive byte count
    "--stages": {"0"},                                     # an integer >= 1
    "--microbatches": {"0"},                               # an integer >= 1
}


@pytest.mark.parametrize("flag, value", sorted((f, v) for f, bad in _OUT_OF_RANGE.items() for v in bad))
def test_cli_repack_refuses_each_out_of_range_value_alone(tmp_path, flag, value):
    """Each value of the fuzzer's out-of-range table, among flags that plan otherwise: exit
    2 (the fuzzer draws them mixed with others, some never alone)."""
    argv = {"--stages": "4", flag: value}
    code, out, err = _cli("plan", _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * len(SHRUNK)}),
                          "--repack", *itertools.chain(*argv.items()))
    assert code == 2 and out == "", (flag, value, out)
    assert _cli("plan", _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * len(SHRUNK)}),
                "--repack", "--stages", "4")[0] == 0


@given(data=st.data())
@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_cli_repack_fuzz(tmp_path, data):
    """Any mix of flags: exit 0 with output (one JSON document with --json), or exit 2
    with one line (or argparse's usage + error for a value argparse itself rejects); exit 2
    whenever a value is outside its flag's stated range."""
    costs = data.draw(st.sampled_from([SHRUNK, [1, 2], [0, 0, 0, 0], [5]]))
    argv = ["plan", _costs_file(tmp_path, {"costs": costs, "memory": [1] * len(costs)}), "--repack"]
    for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True, max_size=5)):
        argv += [flag, data.draw(_FLAG_VALUES[flag])]
    argv += [f for f in ("--json", "--allow-empty-stages") if data.draw(st.booleans())]
    code, out, err = _cli(*argv)
    assert code in (0, 2), (argv, err)
    flags = dict(zip(argv[3::2], argv[4::2]))
    out_of_range = any(flags.get(flag) in bad for flag, bad in _OUT_OF_RANGE.items())
    assert code == (2 if out_of_range else code), (argv, out)   # either, unless a value is out of range
    if code == 0:
        assert json.loads(out) if "--json" in argv else out.strip()
    elif not err.startswith("usage:"):
        assert err.count("\n") == 1 and err.startswith("dynmo plan: error:") and out == "", err
