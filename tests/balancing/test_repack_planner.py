"""The repack planner (`dynmo_plugin.balancing.repack`): unit tests.

The property tests against brute force are in test_repack_brute_force.py, and
`dynmo plan --repack` in tests/cli/test_plan_repack.py.
"""
from __future__ import annotations

import json
import math

import pytest

from dynmo_plugin.balancing import (BalanceProblem, GateConfig, InfeasibleError, ProblemError,
                                    RepackCriteria, RepackPlan, first_fit_repack, metrics,
                                    plan_repack, shrink_problem)
from dynmo_plugin.config import RepackConfig
from dynmo_plugin.layout import Layout

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
