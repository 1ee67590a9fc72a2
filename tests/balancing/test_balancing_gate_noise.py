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
