"""What the balancer takes of the profile's prediction (balancing/profile_problem.py):
m x load = `StageProfile.predicted_s` less the rest of the step and the host's waits on
the layout profiled; the optimizer step's share moves with each trainable layer."""
from __future__ import annotations

import pytest

from dynmo_plugin.balancing.metrics import stage_loads
from dynmo_plugin.balancing.profile_problem import problem_from_profile, step_shares
from dynmo_plugin.balancing.solve import solve
from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile, stage_prediction

M = 4
MB = 10**6


def _layer(n: int, stage: int, cost: float = 0.010, grad: int = MB) -> LayerProfile:
    return LayerProfile(layer=n, stage=stage, fwd_s=cost / 3, bwd_s=2 * cost / 3, param_bytes=MB,
                        grad_bytes=grad, optim_bytes=2 * grad, act_bytes=10**4)


def _stage(s: int, *, source: str = "span", step: float = 0.0, rest: float = 0.0, rest_gpu: float = 0.0,
           waits: float = 0.0, extra_grad: int = 0, extra_s: float = 0.002) -> StageProfile:
    return StageProfile(stage=s, extra_s=extra_s, wait_s=0.0, peak_bytes=0, num_microbatches=M,
                        cost_source=source, step_s=step, rest_s=rest, rest_gpu_s=rest_gpu,
                        host_waits_s=waits, extra_grad_bytes=extra_grad)


def _predicted(profile: PipelineProfile) -> list[float]:
    """Each stage's prediction as the profiler makes it (`stage_prediction`, the MTP
    block's micro-batches added on its stage), less what stays with the stage: its rest
    of the step and its host's waits."""
    out = []
    for s in profile.stages:
        p = stage_prediction(s, [x for x in profile.layers if x.stage == s.stage], M)
        if profile.mtp is not None and profile.mtp.stage == s.stage:
            p += M * profile.mtp.cost_s
        out.append(p - s.counted_rest_s - M * s.host_waits_s)
    return out


def _profile(frozen: int = 0) -> PipelineProfile:
    """3 stages x 3 layers: costs, steps, rests and sources that all differ; the first
    `frozen` layers have no gradient (no optimizer state)."""
    costs = [0.010, 0.012, 0.008, 0.011, 0.009, 0.013, 0.010, 0.007, 0.012]
    layers = [_layer(n, (n - 1) // 3, c, 0 if n <= frozen else MB) for n, c in enumerate(costs, 1)]
    stages = [_stage(0, source="span", step=0.006, rest=0.020, waits=0.0003, extra_grad=2 * MB),
              _stage(1, source="host_cpu", step=0.003, rest=0.008, rest_gpu=0.001),
              _stage(2, source="gpu_kernels", step=0.005, rest=0.030, rest_gpu=0.004, extra_grad=3 * MB)]
    return PipelineProfile(layers, stages)


@pytest.mark.parametrize("frozen", [0, 2, 3])
def test_m_times_the_stage_load_is_the_prediction_less_what_stays_with_the_stage(frozen):
    profile = _profile(frozen)
    current = Layout((3, 3, 3))
    problem = problem_from_profile(profile, current, DynmoConfig(), M)
    assert [M * x for x in stage_loads(problem, current)] == pytest.approx(_predicted(profile), rel=1e-12)


def test_the_prediction_holds_with_an_mtp_block_on_its_stage():
    profile = _profile()
    profile.mtp = _layer(1, 2, cost=0.006, grad=MB // 2)
    current = Layout((3, 3, 3), mtp_layers=1, mtp_stage=2)
    problem = problem_from_profile(profile, current, DynmoConfig(), M)
    assert [M * x for x in stage_loads(problem, current)] == pytest.approx(_predicted(profile), rel=1e-12)
    rate = 0.005 / (3 * MB + 3 * MB + MB // 2)  # stage 2's step over its gradient bytes
    assert problem.mtp_cost == pytest.approx(0.006 + rate * (MB // 2) / M)


def test_a_layer_carries_its_share_of_the_step_and_a_frozen_one_none():
    """Stage 0: 6 ms of optimizer step over 1 + 1 + 1 (layers) + 2 (embedding) MB of
    gradients: 1.2 ms per trainable layer per iteration, 2.4 ms stays with the stage."""
    for frozen, share in ((0, 0.0012), (1, 0.0)):
        shares = step_shares(_profile(frozen), M)
        assert shares.layers[0] == pytest.approx(share / M)
        assert shares.layers[1] == pytest.approx(0.006 / (2 + 3 - frozen) / M)
    shares = step_shares(_profile(), M)
    assert shares.stages[0] == pytest.approx(0.0024 / M)
    assert shares.stages[1] == 0.0  # no extras


def test_a_rank_with_nothing_trainable_keeps_its_step_as_its_own():
    profile = _profile(frozen=3)
    profile.stages[0].extra_grad_bytes = 0
    shares = step_shares(profile, M)
    assert shares.layers[:3] == (0.0, 0.0, 0.0)
    assert shares.stages[0] == pytest.approx(0.006 / M)


def test_a_profile_without_a_step_is_balanced_on_its_layers_and_extras_alone():
    """Simulated profiles and reports written before the step was profiled; the rest of
    the step and the host's waits stay with the stage."""
    profile = PipelineProfile([_layer(n, (n - 1) // 3) for n in range(1, 7)],
                              [_stage(0, rest=0.030, waits=0.001), _stage(1)])
    problem = problem_from_profile(profile, Layout((3, 3)), DynmoConfig(), M)
    assert problem.costs == tuple(x.cost_s for x in profile.layers)
    assert problem.extras_cost == (0.002, 0.002)


def test_the_step_moves_with_the_trainable_layers_and_the_split_follows():
    """Twelve layers of equal fwd+bwd, 6 | 6, the first six frozen (no gradient, no
    step): balanced on their costs alone (62 / 62 ms per micro-batch). Stage 1's 120 ms
    optimizer step is its six layers' (5 ms each per micro-batch): 62 / 92, and the
    exact split moves one trainable layer with its share (7 | 5: 77 / 77)."""
    def profile(step: float) -> PipelineProfile:
        layers = [_layer(n, (n - 1) // 6, grad=0 if n <= 6 else MB) for n in range(1, 13)]
        return PipelineProfile(layers, [_stage(0), _stage(1, step=step)])
    current = Layout((6, 6))
    assert solve(problem_from_profile(profile(0.0), current, DynmoConfig(), M), "exact").layout == current
    problem = problem_from_profile(profile(0.120), current, DynmoConfig(), M)
    assert problem.costs[:6] == (0.010,) * 6
    assert problem.costs[6] == pytest.approx(0.015)
    assert solve(problem, "exact").layout == Layout((7, 5))


def test_interleaved_the_step_is_shared_over_the_ranks_chunks():
    """pp = 2, v = 2: the profiler records each chunk's step as the rank's over v; the
    per-byte rate is the rank's, so each rank's chunks sum to its prediction less its
    rest."""
    sizes = {0: MB, 1: 3 * MB, 2: 2 * MB, 3: MB}  # virtual stage -> a layer's gradient bytes
    layers = [_layer(n, (n - 1) // 2, grad=sizes[(n - 1) // 2]) for n in range(1, 9)]
    stages = [_stage(s, step=0.004, rest=0.002, extra_grad=MB if s in (0, 3) else 0) for s in range(4)]
    profile = PipelineProfile(layers, stages, num_chunks=2)
    current = Layout((2, 2, 2, 2), num_chunks=2)
    problem = problem_from_profile(profile, current, DynmoConfig(), M)
    loads, predicted = stage_loads(problem, current), _predicted(profile)
    for rank in (0, 1):
        assert M * sum(loads[rank::2]) == pytest.approx(sum(predicted[rank::2]), rel=1e-12)
    rate0 = 0.008 / (2 * MB + 2 * 2 * MB + MB)  # rank 0: virtual stages 0 and 2
    assert step_shares(profile, M).layers[0] == pytest.approx(rate0 * MB / M)


def test_a_step_spread_over_fewer_micro_batches_weighs_more_on_each():
    """A grow with the plain optimizer: each replica keeps the whole step and runs M / 2
    micro-batches, so each one carries twice the step's share; layers and extras
    otherwise as profiled (controller.DynMo._freed_choice)."""
    profile = _profile()
    base = problem_from_profile(profile, Layout((3, 3, 3)), DynmoConfig(), M)
    grown = problem_from_profile(profile, Layout((3, 3, 3)), DynmoConfig(), M, step_microbatches=M // 2)
    shares = step_shares(profile, M)  # at M: the difference M / 2 adds
    assert [b - a for a, b in zip(base.costs, grown.costs)] == pytest.approx(list(shares.layers), rel=1e-9)
    assert grown.extras_cost[0] - base.extras_cost[0] == pytest.approx(shares.stages[0])
    assert grown.num_microbatches == M


def test_memory_is_calibrated_at_the_micro_batches_of_the_moment_and_capped_at_the_peak():
    """A batch ramping up (Megatron-LM's --rampup-batch-size): profiled at 1 micro-batch
    per iteration, each of the 3 stages held one micro-batch's activations; at the whole
    batch (M = 4) each holds up to 3. The calibration (each measured peak against the
    model at 1) is the moment's; the bytes checked against the cap are at the peak. A cap
    that the profiled split (3 like layers a stage) fits with one more micro-batch's
    activations to spare admits it at the moment's count; at the peak a stage of 3 needs
    two more, so no stage takes 3 and no split of 9 layers fits."""
    from dataclasses import replace

    from dynmo_plugin.balancing import InfeasibleError
    from dynmo_plugin.balancing.profile_problem import memory_calibration
    from dynmo_plugin.config import RebalanceConfig
    base = _profile()
    stages = [replace(s, peak_bytes=14 * MB, num_microbatches=1) for s in base.stages]
    profile = PipelineProfile(base.layers, stages)
    now, calibration = memory_calibration(profile, 3, 1)
    peak, at_peak = memory_calibration(profile, 3, 1, peak_microbatches=M)
    assert at_peak == calibration and calibration.overhead[0] > 0
    act = base.layers[0].act_bytes
    assert len(set(now)) == 1 and [b - a for a, b in zip(now, peak)] == [2 * act] * 9  # min(3, 4) - min(3, 1)
    current = Layout((3, 3, 3))
    cap = calibration.calibrated([3 * now[0]] * 3)[0] + 3 * act
    config = DynmoConfig(rebalance=RebalanceConfig(memory_cap_gb=cap / 1e9))
    assert solve(problem_from_profile(profile, current, config, 1), "exact").layout == current
    with pytest.raises(InfeasibleError):
        solve(problem_from_profile(profile, current, config, 1, peak_microbatches=M), "exact")


def test_at_the_peak_extras_activations_grow_with_their_stage_depth_and_chunks_with_the_schedule():
    """Ramping from 1 micro-batch to M = 4 over 3 stages: the extras' activations of the
    moment are in the calibrated overhead; at the peak stage s holds min(3 - s, 4) of
    them against the moment's 1: 2, 1 and 0 more `extra_act_bytes`.
    Interleaved (pp 2 x v 2), the profiler records each chunk's depth at the moment and
    at the peak (`peak_in_flight`): layers count at the deepest chunk's peak depth, each
    chunk's extras at its own growth; a profile without the peak's depths counts the
    profiled ones."""
    from dataclasses import replace

    from dynmo_plugin.balancing.profile_problem import memory_calibration
    base = _profile()
    stages = [replace(s, extra_bytes=5 * MB, extra_act_bytes=MB, in_flight=1, num_microbatches=1)
              for s in base.stages]
    profile = PipelineProfile(base.layers, stages)
    current = Layout((3, 3, 3))
    now = problem_from_profile(profile, current, DynmoConfig(), 1)
    peak = problem_from_profile(profile, current, DynmoConfig(), 1, peak_microbatches=M)
    assert list(now.extras_memory_arr) == [5 * MB] * 3
    assert list(peak.extras_memory_arr) == [7 * MB, 6 * MB, 5 * MB]
    assert list(peak.memory_overhead) == list(now.memory_overhead)  # calibrated at the moment

    depths = [(2, 4), (2, 3), (2, 2), (1, 1)]  # (now, peak) per virtual stage: Megatron's schedule at 2 and 4
    v_stages = [replace(stages[0], stage=s, in_flight=d, peak_in_flight=p, extra_act_bytes=MB * (s in (0, 3)))
                for s, (d, p) in enumerate(depths)]
    v_layers = [replace(x, stage=min(i // 2, 3)) for i, x in enumerate(base.layers[:8])]
    interleaved = replace(profile, layers=v_layers, stages=v_stages, num_chunks=2)
    layout = Layout((2, 2, 2, 2), num_chunks=2)
    at_now, _ = memory_calibration(interleaved, 4, 2)
    at_peak, _ = memory_calibration(interleaved, 4, 2, peak_microbatches=M)
    act = base.layers[0].act_bytes
    assert [b - a for a, b in zip(at_now, at_peak)] == [(4 - 2) * act] * 8
    grown = problem_from_profile(interleaved, layout, DynmoConfig(), 2, peak_microbatches=M)
    assert list(grown.extras_memory_arr) == [7 * MB, 5 * MB, 5 * MB, 5 * MB]  # chunk 0: 2 more; the head's chunk: none
    unramped = replace(interleaved, stages=[replace(s, peak_in_flight=0) for s in v_stages])
    assert memory_calibration(unramped, 4, 2, peak_microbatches=M)[0] == at_now  # not recorded: as profiled
