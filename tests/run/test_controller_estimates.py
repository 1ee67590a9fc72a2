"""Cost updates from a scenario's work predictor, without a timing window."""
from dynmo_plugin.controller import scale_profile
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile


def _profile() -> PipelineProfile:
    layers = [LayerProfile(layer=n, stage=(n - 1) // 2, fwd_s=0.01 * n, bwd_s=0.02 * n,
                           param_bytes=100, grad_bytes=100, optim_bytes=200, act_bytes=50)
              for n in range(1, 5)]
    stages = [StageProfile(stage=s, extra_s=0.005, wait_s=0.0, peak_bytes=1000) for s in range(2)]
    return PipelineProfile(layers=layers, stages=stages)


def test_costs_scale_with_work_and_memory_stays():
    base, now = {1: 100, 2: 100, 3: 100, 4: 100}, {1: 100, 2: 50, 3: 200, 4: 100}
    before = _profile()
    after = scale_profile(before, base, now)
    assert [x.cost_s for x in after.layers] == [
        x.cost_s * now[x.layer] / base[x.layer] for x in before.layers]
    assert [x.state_bytes for x in after.layers] == [x.state_bytes for x in before.layers]
    assert after.stages == before.stages
    assert before.layers[1].fwd_s == 0.02  # the measured profile is left as it was
