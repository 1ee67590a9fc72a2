"""Unit tests: problem validation, metrics, each balancer's specifics, plan, gate."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dynmo_plugin.balancing import (BALANCERS, BalanceProblem, GateConfig, InfeasibleError,
                                    ProblemError, attach_gate, evaluate_gate, imbalance,
                                    optimal_bottleneck, predicted_iteration_s, solve,
                                    stage_loads)
from dynmo_plugin.balancing.baselines import solve_parameters
from dynmo_plugin.balancing.memory import StageCalibration
from dynmo_plugin.balancing.diffusion import StageState, exchange
from dynmo_plugin.balancing.mtp import LAST_STAGE_NOTE
from dynmo_plugin.balancing.plan import make_plan
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout


# ---- problem validation -----------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(costs=[1, -2], num_stages=1), r"costs\[1\] = -2"),
    (dict(costs=[1, float("nan")], num_stages=1), r"costs\[1\]"),
    (dict(costs=[], num_stages=1), "empty"),
    (dict(costs=[1, 2], num_stages=0), "num_stages"),
    (dict(costs=[1, 2], num_stages=3), "allow empty stages"),
    (dict(costs=[1, 2], num_stages=1, memory=[1]), "memory has 1 entries"),
    (dict(costs=[1, 2], num_stages=2, extras_cost=[1]), "extras_cost has 1 entries"),
    (dict(costs=[1, 2], num_stages=2, capacity=[1, 2, 3]), "capacity"),
    (dict(costs=[1, 2], num_stages=2, capacity=-5), "capacity"),
    (dict(costs=[1, 2], num_stages=2, num_microbatches=0), "num_microbatches"),
    (dict(costs=[1, 2], num_stages=2, current=Layout((1, 1, 0))), "current layout"),
])
def test_bad_inputs_raise_problem_error(kwargs, match):
    with pytest.raises(ProblemError, match=match):
        BalanceProblem(**kwargs)


def test_problem_errors_are_user_errors_and_extras_over_capacity_is_infeasible():
    assert issubclass(ProblemError, UserError) and issubclass(InfeasibleError, UserError)
    with pytest.raises(InfeasibleError, match="stage 1"):
        BalanceProblem(costs=[1, 2], num_stages=2, capacity=10, extras_memory=[0, 11])


def test_empty_stages_allowed_when_asked():
    pb = BalanceProblem(costs=[5, 1], num_stages=4, allow_empty_stages=True)
    plan = solve(pb, "exact")
    assert plan.bottleneck_after == 5 and plan.layout.num_stages == 4
    assert plan.layout.to_megatron().count("|") == 3


# ---- metrics ------------------------------------------------------------------------
def test_metrics():
    pb = BalanceProblem(costs=[1, 2, 3, 4], num_stages=2, extras_cost=[1, 2])
    assert stage_loads(pb, Layout((2, 2))) == [4.0, 9.0]
    assert imbalance([4, 9]) == pytest.approx(5 / 6.5)
    assert imbalance([0, 0]) == 0.0
    assert predicted_iteration_s([4, 9], 8) == 13 + 7 * 9


# ---- exact ----------------------------------------------------------------------------
def test_exact_beats_deepspeed_on_known_counterexample():
    pb = BalanceProblem(costs=[82, 70, 52, 95, 100, 36], num_stages=5)
    assert solve(pb, "exact").bottleneck_after == 122
    assert solve(pb, "partition").bottleneck_after == 136  # DeepSpeed minimises max-min


def test_exact_respects_memory_and_reports_infeasible():
    pb = BalanceProblem(costs=[1, 1, 1, 10], num_stages=2, memory=[4, 4, 4, 4], capacity=8)
    assert solve(pb, "exact").layout.counts == (2, 2)
    with pytest.raises(InfeasibleError, match="memory caps"):
        solve(BalanceProblem(costs=[1] * 4, num_stages=2, memory=[4] * 4, capacity=7), "exact")


def test_exact_all_zero_costs_keeps_the_current_layout():
    pb = BalanceProblem(costs=[0, 0, 0, 0], num_stages=2, current=Layout((1, 3)))
    plan = solve(pb, "exact")
    assert plan.bottleneck_after == 0 and plan.layout == Layout((1, 3))


def test_exact_prefers_staying_put_among_optimal_layouts():
    pb = BalanceProblem(costs=[1, 0, 0, 1], num_stages=2, memory=[5, 5, 5, 5],
                        current=Layout((3, 1)))
    plan = solve(pb, "exact")
    assert plan.layout == Layout((3, 1)) and plan.moves == []


def test_exact_large_instance_is_optimal_against_lower_bound():
    rng = np.random.default_rng(1)
    costs = rng.lognormal(size=1000)
    pb = BalanceProblem(costs=costs.tolist(), num_stages=128, current=Layout.uniform(1000, 128))
    plan = solve(pb, "exact")
    best = optimal_bottleneck(pb)
    assert plan.bottleneck_after == pytest.approx(best, rel=1e-9)
    assert best >= max(costs.max(), costs.sum() / 128) - pb.load_tol
    # one tolerance step below the optimum is infeasible: nothing better exists
    from dynmo_plugin.balancing.segments import SegmentModel
    assert not SegmentModel(pb).is_feasible(best - 3 * pb.load_tol)


# ---- partition / baselines / diffusion ------------------------------------------------
def test_partition_falls_back_with_a_note_when_memory_is_broken():
    pb = BalanceProblem(costs=[1, 1, 1, 1, 1, 10], num_stages=2, memory=[1, 1, 1, 1, 1, 1], capacity=4)
    plan = solve(pb, "partition")
    assert plan.notes and "fell back" in plan.notes[0]
    assert plan.layout.counts == (4, 2)  # 4 | 11 beats 3 | 12; (5, 1) breaks the cap


def test_uniform_and_parameters_baselines():
    pb = BalanceProblem(costs=[1] * 6, num_stages=3, param_counts=[10, 10, 10, 10, 0, 0])
    assert solve(pb, "uniform").layout.counts == (2, 2, 2)
    counts = solve(pb, "parameters").layout.counts
    assert sum(counts) == 6 and counts[0] <= 2
    with pytest.raises(ProblemError, match="param_counts"):
        solve(BalanceProblem(costs=[1, 2], num_stages=2), "parameters")
    for wrong in ([10] * 5, [10] * 7):   # one count per layer, neither fewer nor more
        with pytest.raises(ProblemError, match="param_counts must be 6 values"):
            solve_parameters(BalanceProblem(costs=[1] * 6, num_stages=3), wrong)
    with pytest.raises(InfeasibleError, match="uniform"):
        solve(BalanceProblem(costs=[1] * 4, num_stages=2, memory=[1, 1, 1, 5], capacity=5), "uniform")


def test_exchange_moves_boundary_layer_only_when_potential_drops():
    left = StageState([1.0, 2.0, 3.0], [1, 1, 1], 6.0, 3, 10)
    right = StageState([1.0], [1], 1.0, 1, 10)
    assert exchange(left, right, 1, 0.0, 0.0, max_moves=5) == 1  # 3 < 6-1; then 2 < 3-4? no
    assert left.costs == [1.0, 2.0] and right.costs == [3.0, 1.0]
    assert exchange(left, right, 1, 0.0, 0.0, max_moves=5) == 0


def test_diffusion_reports_rounds_and_cap():
    pb = BalanceProblem(costs=[10] * 4 + [1] * 12, num_stages=4, current=Layout((4, 4, 4, 4)))
    plan = solve(pb, "diffusion")
    assert plan.rounds and plan.rounds > 0 and plan.bottleneck_after < plan.bottleneck_before
    capped = solve(pb, "diffusion", max_rounds=1)
    assert capped.rounds == 1 and "round cap" in capped.notes[0]


def test_diffusion_repairs_a_start_that_breaks_memory():
    pb = BalanceProblem(costs=[1] * 4, num_stages=2, memory=[3] * 4, capacity=7,
                        current=Layout((3, 1)))
    plan = solve(pb, "diffusion")
    assert plan.layout.counts == (2, 2) and "nearest allowed" in plan.notes[0]


def test_unknown_method_and_option():
    pb = BalanceProblem(costs=[1, 2], num_stages=2)
    with pytest.raises(ProblemError, match="unknown balancing method"):
        solve(pb, "magic")
    with pytest.raises(ProblemError, match="max_rounds"):
        solve(pb, "exact", max_rounds=3)
    assert BALANCERS == ("exact", "partition", "diffusion", "uniform", "parameters")


# ---- plan and gate ----------------------------------------------------------------------
def _plan():
    pb = BalanceProblem(costs=[4, 4, 1, 1], num_stages=2, memory=[1e9] * 4,
                        current=Layout((2, 2)), num_microbatches=8)
    return solve(pb, "exact")


def test_plan_fields_dict_and_str():
    plan = _plan()
    assert plan.layout == Layout((1, 3)) and plan.before == Layout((2, 2))
    assert plan.stage_loads_before == [8, 2] and plan.stage_loads_after == [4, 6]
    assert [(m.layer, m.src, m.dst, m.bytes) for m in plan.moves] == [(2, 0, 1, 1e9)]
    assert plan.predicted_iter_s_before == 10 + 7 * 8 and plan.predicted_iter_s_after == 10 + 7 * 6
    d = json.loads(json.dumps(plan.to_dict()))
    for key in ("layout", "boundaries", "stage_loads", "bottleneck", "imbalance", "moves",
                "method", "solve_seconds", "bottleneck_before", "imbalance_before"):
        assert key in d
    assert d["layout"] == "Et|tttL" and d["boundaries"] == [0, 1, 4]
    text = str(plan)
    assert "Ett|ttL -> Et|tttL" in text and "layer 2: stage 0 -> 1" in text


def test_gate_applies_only_when_saving_beats_migration():
    plan = _plan()  # saves 14 s per iteration, moves 1e9 bytes
    yes = evaluate_gate(plan, GateConfig(iterations_until_next_event=10, bandwidth_bytes_per_s=1e9))
    assert yes.apply and yes.saving_per_iter_s == 14 and yes.migration_s == 1.0
    no = evaluate_gate(plan, GateConfig(iterations_until_next_event=1, bandwidth_bytes_per_s=1e8,
                                        margin=1.0, fixed_overhead_s=5))
    assert not no.apply and no.migration_s == 15.0 and "does not pay" in no.reason
    attach_gate(plan, GateConfig(iterations_until_next_event=10, bandwidth_bytes_per_s=1e9))
    assert plan.to_dict()["gate"]["apply"] is True and "gate: APPLY" in str(plan)
    with pytest.raises(UserError):
        GateConfig(iterations_until_next_event=1, bandwidth_bytes_per_s=0)


def _peak_problem(capacity):
    # Stage 1 is heavy; moving layer 3 (10 bytes of state) to stage 0 balances it.
    return BalanceProblem(costs=[1, 1, 4, 4], num_stages=2, memory=[10, 10, 10, 10],
                          move_bytes=[10, 10, 10, 10], rebuild_bytes=[3, 3, 3, 3],
                          extras_rebuild_bytes=[1, 2], capacity=capacity,
                          current=Layout.parse("Ett|ttL"), num_microbatches=8)


def test_migration_peak_memory_counts_old_state_incoming_twice_and_rebuilt_buffers():
    plan = solve(_peak_problem(None), "exact")
    assert list(plan.layout.counts) == [3, 1]
    # stage 0: 20 before + 2 x 10 incoming + rebuilt 3 layers x 3 + 1 extras = 50
    # stage 1: 20 before + nothing incoming + rebuilt 1 layer x 3 + 2 extras = 25
    assert plan.migration_peak_memory == [50.0, 25.0]


def test_gate_refuses_a_move_whose_transient_peak_exceeds_the_cap():
    gate = GateConfig(iterations_until_next_event=1000, bandwidth_bytes_per_s=1e9)
    fits_after_but_not_during = solve(_peak_problem(40.0), "exact", gate=gate)
    assert max(fits_after_but_not_during.stage_memory_after) <= 40
    assert not fits_after_but_not_during.gate.apply
    assert "migration needs" in fits_after_but_not_during.gate.reason and "stage 0" in fits_after_but_not_during.gate.reason
    assert solve(_peak_problem(50.0), "exact", gate=gate).gate.apply


def test_decide_keeps_the_layout_when_no_plan_can_be_made():
    """Neither a problem the balancer cannot read (no parameter counts for 'parameters')
    nor an infeasible one (a cap every layout breaks) escapes decide: the run keeps its
    layout and the reason names the cause."""
    from dynmo_plugin.balancing.decide import decide
    no_counts = BalanceProblem(costs=[1, 2, 3, 4], num_stages=2, current=Layout((2, 2)))
    gate = GateConfig(iterations_until_next_event=100, bandwidth_bytes_per_s=1e9)
    choice = decide(no_counts, "parameters", gate)
    assert (choice.apply, choice.action, choice.plan) == (False, "none", None)
    assert choice.reason.startswith("no feasible plan: ") and "param_counts" in choice.reason
    capped = BalanceProblem(costs=[1, 2, 3, 4], num_stages=2, memory=[3, 3, 3, 3], capacity=5,
                            current=Layout((2, 2)), allow_empty_stages=False)
    with pytest.raises(InfeasibleError):
        solve(capped, "exact")
    choice = decide(capped, "exact", gate)
    assert not choice.apply and choice.reason.startswith("no feasible plan: ")


@pytest.mark.parametrize("method", ["partition", "diffusion", "uniform"])
def test_the_heuristics_keep_the_mtp_block_on_the_last_stage_and_say_so(method):
    """Only the exact balancer places the MTP block (this heavy one gets its stage to itself,
    'Ett|tttt|mL'); the others fold it into the last stage's extras and the plan's note
    says so."""
    pb = BalanceProblem(costs=[1.0] * 6, num_stages=3, mtp_layers=1, mtp_cost=8.0)
    plan = solve(pb, method)
    assert plan.layout.mtp_stage == 2 and plan.layout.mtp_layers == 1
    assert plan.notes[-1] == LAST_STAGE_NOTE
    assert LAST_STAGE_NOTE not in solve(pb, "exact").notes


def test_the_calibration_factor_is_measured_over_modelled_unless_either_is_zero():
    """A measured peak of 1 byte is a measurement (the factor is for the record; 0 means
    "not measured")."""
    assert StageCalibration(0, 1.0, 4.0, "accounted").factor == 0.25
    assert StageCalibration(0, 6.0, 4.0, "measured").factor == 1.5
    assert StageCalibration(0, 0.0, 4.0, "none").factor == StageCalibration(0, 3.0, 0.0, "none").factor == 1.0


@pytest.mark.parametrize("extras, noted", [
    ([5, 0, 0], False), ([0, 0, 5], False), ([5, 0, 5], False), ([0, 5, 0], True), ([0, 0, 0, 0], False)])
def test_partition_notes_only_the_middle_stages_extras_it_ignores(extras, noted):
    """DeepSpeed's partition folds the first and last stage's extras into their layers
    (deepspeed_partition's weights); only extras on a middle stage are ignored, and noted."""
    pb = BalanceProblem(costs=[1.0] * 8, num_stages=len(extras), extras_cost=extras)
    notes = solve(pb, "partition").notes
    assert ("partition_balanced ignores extras on middle stages" in notes) == noted, notes


def test_an_mtp_block_that_changes_rank_moves_its_bytes_whichever_way_it_goes():
    """Stage 1 -> 2 and 2 -> 1 (v = 1: every stage its own rank): the block's move bytes
    split over its layers; moves of decoder layers keep theirs."""
    pb = BalanceProblem(costs=[1.0] * 6, num_stages=3, memory=[2.0] * 6, mtp_layers=2, mtp_cost=1.0,
                        mtp_memory=3.0, mtp_move_bytes=10.0, allow_empty_stages=True)
    early, last = Layout((3, 3, 0), 1, 2, 1), Layout((2, 2, 2), 1, 2, 2)
    for before, after, src, dst in ((early, last, 1, 2), (last, early, 2, 1)):
        plan = make_plan(dataclasses.replace(pb, current=before), after, "test", 0.0)
        mtp = [(m.layer, m.src, m.dst, m.bytes) for m in plan.moves if m.kind == "mtp"]
        assert mtp == [(1, src, dst, 5.0), (2, src, dst, 5.0)]
