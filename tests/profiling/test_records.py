"""profiling/records.py: folding the replicas of a stage (data- and tensor-parallel ranks)."""
from __future__ import annotations

import itertools

from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile


def _replica(cost_source: str, predicted: float, peak: int, peak_source: str, rest: float,
             rest_gpu: float) -> PipelineProfile:
    layer = LayerProfile(layer=1, stage=0, fwd_s=predicted / 10, bwd_s=0.0, param_bytes=0,
                         grad_bytes=0, optim_bytes=0, act_bytes=0)
    stage = StageProfile(stage=0, extra_s=0.0, wait_s=0.0, peak_bytes=peak, peak_source=peak_source,
                         cost_source=cost_source, clock=f"clock of {cost_source}",
                         predicted_s=predicted, rest_s=rest, rest_gpu_s=rest_gpu)
    return PipelineProfile([layer], [stage])


def test_a_label_goes_with_the_number_it_describes_whatever_the_replica_order():
    """The slower replica is host-bound, the other GPU-bound with the larger peak: the
    fold is host-bound (its rest is the host's) and its peak is the measured one."""
    gpu_bound = _replica("gpu_kernels", predicted=10.0, peak=700, peak_source="measured",
                         rest=4.0, rest_gpu=1.0)
    host_bound = _replica("host_cpu", predicted=12.0, peak=500, peak_source="accounted",
                          rest=3.0, rest_gpu=0.5)
    for order in itertools.permutations([gpu_bound, host_bound]):
        [stage] = PipelineProfile.elementwise_max(list(order)).stages
        assert (stage.cost_source, stage.clock) == ("host_cpu", "clock of host_cpu")
        assert (stage.predicted_s, stage.peak_bytes, stage.peak_source) == (12.0, 700, "measured")
        assert stage.counted_rest_s == 4.0  # the host's rest (the larger of the two replicas')


def test_the_other_threads_cpu_is_averaged_over_replicas_not_maxed():
    """`threads_s` takes cores from every rank (sim.run_replay: mean x ranks): two DP
    replicas' 10 and 30 ms fold to 20 ms, where the max would count 60 ms for 40."""
    a, b = (_replica("host_cpu", 1.0, 0, "measured", 0.0, 0.0) for _ in range(2))
    a.stages[0].threads_s, b.stages[0].threads_s = 0.010, 0.030
    [stage] = PipelineProfile.elementwise_max([a, b]).stages
    assert stage.threads_s == 0.020
