"""The gate's noise floor: small predicted gains are not worth a migration."""
from dynmo_plugin.balancing import BalanceProblem, GateConfig, evaluate_gate, solve
from dynmo_plugin.layout import Layout


def _plan():
    # Moving one layer gains ~23% of predicted iteration time: above no floor, below a 50% one.
    problem = BalanceProblem(costs=[1.0, 1.0, 1.0, 1.02], num_stages=2, current=Layout((1, 3)),
                             num_microbatches=4)
    return solve(problem, "exact")


def test_gain_below_floor_is_rejected():
    plan = _plan()
    assert plan.moves
    cfg = dict(iterations_until_next_event=1000, bandwidth_bytes_per_s=1e12, margin=1.0)
    assert evaluate_gate(plan, GateConfig(**cfg)).apply
    verdict = evaluate_gate(plan, GateConfig(**cfg, min_relative_gain=0.5))
    assert not verdict.apply and "noise floor" in verdict.reason


def test_a_slower_plan_does_not_pay_and_is_not_called_noise():
    """A plan predicted slower (DeepSpeed's parameter split from a balanced layout) saves
    a negative time: refused because it does not pay, not because its 'gain' is below the
    noise floor."""
    problem = BalanceProblem(costs=[0.01, 0.01, 0.01, 0.0102], num_stages=2, current=Layout((2, 2)),
                             num_microbatches=4, param_counts=[100, 0, 0, 0])
    slower = solve(problem, "parameters")
    assert slower.moves and slower.predicted_iter_s_after > slower.predicted_iter_s_before
    verdict = evaluate_gate(slower, GateConfig(iterations_until_next_event=1000,
                                               bandwidth_bytes_per_s=1e12, min_relative_gain=0.5))
    assert not verdict.apply and verdict.reason.startswith("does not pay: "), verdict.reason


def test_margin_and_overhead_accept_zero_and_fractions_refuse_negatives():
    """The documented range is >= 0: a margin of 0.5 (apply when the saving covers half
    the migration) is a legal setting."""
    import pytest

    from dynmo_plugin.errors import UserError
    base = dict(iterations_until_next_event=10, bandwidth_bytes_per_s=1e9)
    for margin, overhead in ((0.0, 0.0), (0.5, 0.25), (3.0, 2.0)):
        cfg = GateConfig(**base, margin=margin, fixed_overhead_s=overhead)
        assert (cfg.margin, cfg.fixed_overhead_s) == (margin, overhead)
    for margin, overhead in ((-0.5, 0.0), (1.0, -0.1), (float("nan"), 0.0)):
        with pytest.raises(UserError, match="must be >= 0"):
            GateConfig(**base, margin=margin, fixed_overhead_s=overhead)
