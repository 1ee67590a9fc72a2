"""The estimator and the gate's noise floor on injected dispersion (pure: no torch).

A layer's profiled cost is the median of its per-micro-batch samples; the profile keeps
their relative dispersion, and the gate refuses a predicted gain inside that measured
dispersion (never below `min_relative_gain`, its fallback when nothing was measured)."""
from __future__ import annotations

import pytest

from dynmo_plugin.balancing import BalanceProblem, GateConfig, evaluate_gate, solve
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, cost_spread, median, spread

SIGMA = 1.4826  # MAD -> standard deviation of normal samples


def test_median_ignores_a_descheduled_micro_batch_and_spread_is_robust():
    samples = [1.0, 1.1, 0.9, 1.0, 5.0]          # one outlier (a descheduled micro-batch)
    assert median(samples) == 1.0
    assert spread(samples) == pytest.approx(SIGMA * 0.1)   # deviations 0 .1 .1 0 4 -> MAD 0.1
    assert spread([2.0] * 6) == 0.0
    assert spread([3.0]) == spread([]) == 0.0               # nothing known


def test_cost_spread_pairs_forward_and_backward_per_micro_batch():
    fwd, bwd = [1.0, 1.1, 0.9, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0, 2.0]
    assert cost_spread(fwd, bwd) == pytest.approx(SIGMA * 0.1 / 3.0)   # sums 3 3.1 2.9 3 7
    # anti-correlated halves cancel in the sums: paired, not added
    assert cost_spread([1.0, 2.0, 1.0, 2.0], [2.0, 1.0, 2.0, 1.0]) == 0.0
    # a layer with no backward spans: the forward's spread alone
    assert cost_spread(fwd, []) == pytest.approx(spread(fwd))


def _layer(n: int, stage: int, cost: float, spread_: float) -> LayerProfile:
    return LayerProfile(layer=n, stage=stage, fwd_s=cost / 3, bwd_s=2 * cost / 3, param_bytes=0,
                        grad_bytes=0, optim_bytes=0, act_bytes=0, spread=spread_)


def test_profile_dispersion_is_the_cost_weighted_spread_and_survives_the_wire():
    profile = PipelineProfile([_layer(1, 0, 1.0, 0.10), _layer(2, 0, 3.0, 0.02)])
    assert profile.dispersion() == pytest.approx((1.0 * 0.10 + 3.0 * 0.02) / 4.0)
    again = PipelineProfile.from_dict(profile.to_dict())
    assert again.dispersion() == pytest.approx(profile.dispersion())
    old = profile.to_dict()  # a profile written before dispersion was recorded
    for x in old["layers"]:
        del x["spread"], x["host_s"]
    assert PipelineProfile.from_dict(old).dispersion() == 0.0
    replicas = PipelineProfile.elementwise_max([profile, PipelineProfile(
        [_layer(1, 0, 1.0, 0.30), _layer(2, 0, 3.0, 0.01)])])
    assert [x.spread for x in replicas.layers] == [0.30, 0.02]  # the noisier replica


def _plan():
    # Moving one layer gains ~23% of the predicted iteration time.
    problem = BalanceProblem(costs=[1.0, 1.0, 1.0, 1.02], num_stages=2, current=Layout((1, 3)),
                             num_microbatches=4)
    plan = solve(problem, "exact")
    assert plan.moves
    return plan, (plan.predicted_iter_s_before - plan.predicted_iter_s_after) / plan.predicted_iter_s_before


GATE = dict(iterations_until_next_event=1000, bandwidth_bytes_per_s=1e12, margin=1.0,
            min_relative_gain=0.05)


def test_gate_refuses_a_gain_inside_the_measured_dispersion_and_accepts_one_above():
    plan, gain = _plan()
    assert 0.1 < gain < 0.5
    inside = evaluate_gate(plan, GateConfig(**GATE, measured_dispersion=1.1 * gain))
    assert not inside.apply
    assert "below the noise floor" in inside.reason and "measured dispersion" in inside.reason
    above = evaluate_gate(plan, GateConfig(**GATE, measured_dispersion=0.9 * gain))
    assert above.apply and above.reason.startswith("pays")


def test_gate_floor_never_drops_below_min_relative_gain():
    plan, gain = _plan()
    quiet = GateConfig(**{**GATE, "min_relative_gain": 1.1 * gain}, measured_dispersion=0.001)
    assert quiet.noise_floor == pytest.approx(1.1 * gain)
    verdict = evaluate_gate(plan, quiet)
    assert not verdict.apply and "min_relative_gain" in verdict.reason
    assert GateConfig(**GATE).noise_floor == 0.05  # no dispersion known: the configured floor
    assert GateConfig(**GATE, measured_dispersion=0.04, dispersion_factor=2.0).noise_floor == 0.08


def test_min_relative_gain_zero_switches_the_floor_off():
    """--dynmo-min-gain 0 (tests that force a move use it): the prediction alone decides."""
    plan, gain = _plan()
    off = GateConfig(**{**GATE, "min_relative_gain": 0.0}, measured_dispersion=2 * gain)
    assert off.noise_floor == 0.0 and evaluate_gate(plan, off).apply


def test_gate_follows_the_dispersion_a_profile_measured():
    """End to end on data: per-micro-batch samples -> profile -> gate."""
    plan, gain = _plan()
    noisy = [10.0, 10.0 + 2 / SIGMA, 10.0 - 2 / SIGMA, 10.0]  # median 10, MAD 1/SIGMA: spread 0.1
    layers = [LayerProfile(layer=n, stage=0, fwd_s=median(noisy), bwd_s=0.0, param_bytes=0,
                           grad_bytes=0, optim_bytes=0, act_bytes=0, spread=cost_spread(noisy, []))
              for n in (1, 2)]
    dispersion = PipelineProfile(layers).dispersion()
    assert dispersion == pytest.approx(0.1)
    calm = evaluate_gate(plan, GateConfig(**GATE, measured_dispersion=dispersion))
    assert calm.apply  # a 10% dispersion, a ~23% gain: it stands out
    loud = evaluate_gate(plan, GateConfig(**GATE, measured_dispersion=dispersion,
                                          dispersion_factor=3.0))
    assert not loud.apply


@pytest.mark.parametrize("field, value", [("measured_dispersion", -0.1), ("measured_dispersion", float("nan")),
                                          ("dispersion_factor", -1.0)])
def test_gate_refuses_a_bad_dispersion_setting(field, value):
    with pytest.raises(UserError, match=field):
        GateConfig(**GATE, **{field: value})
