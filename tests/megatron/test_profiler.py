"""Per-layer profiling of live Megatron training (real torchrun gloo runs)."""
import json

import pytest

from launch import torchrun, worker

pytestmark = pytest.mark.multiproc

H = 128
RUN = ["--num-layers", "4", "--num-attention-heads", "4",
       "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--train-iters", "3", "--dynmo", "--dynmo-profile-every", "2",
       "--dynmo-profile-window", "2"]
MODEL = ["--hidden-size", str(H), *RUN]
# The heavy-layer fixture compares times: its layers are large enough (several ms each)
# that the OS descheduling a rank on a loaded 2-core machine cannot invert a ratio.
HEAVY_H = 512


def _profile(report):
    events = [e for e in report["events"] if e["kind"] == "profile"]
    assert len(events) == 1 and events[0]["window"] == [2, 3]
    return events[0]["profile"]


@pytest.fixture(scope="module")
def pp2_heavy(tmp_path_factory):
    out = tmp_path_factory.mktemp("heavy")
    return worker(2, ["--hidden-size", str(HEAVY_H), *RUN, "--pipeline-model-parallel-size", "2",
                      "--test-heavy-layer", "2", "--test-heavy-factor", "3"], out)


def test_heavy_layer_costs_k_times_its_neighbours(pp2_heavy):
    """What the profiler itself measures (issue 26 keeps this one): each rank's one
    thread's CPU time, which does not count while the OS runs other work, attributes the
    3x work of layer 2 to layer 2. The band (1.8x-4.5x, was 3x +-25%) is wide because CPU
    time still stretches with cache and memory-bandwidth contention from neighbours, and
    only has to tell 3x from what a wrong attribution gives: ~1x (the work booked to a
    neighbour or spread out) or ~6x and more (a span counted twice, a neighbour's inside)."""
    layers = {x["layer"]: x["fwd_s"] + x["bwd_s"] for x in _profile(pp2_heavy)["layers"]}
    neighbours = (layers[1] + layers[3] + layers[4]) / 3
    assert 1.8 < layers[2] / neighbours < 4.5, layers


def test_layer_sums_agree_with_schedule_timers(pp2_heavy):
    """The layers' spans plus the stage's extras account for the schedule's compute
    timers, both one thread's CPU time on the same thread (measured 1% apart), so load
    moves both alike. The band (+-20%, was 15%) still catches any one layer missed
    (stage 0: the light one is 25% of its layers' time; stage 1: ~45%) or counted twice."""
    for stage in _profile(pp2_heavy)["stages"]:
        assert stage["clock"] == "cpu_thread_time"
        assert stage["profiled_s"] == pytest.approx(stage["compute_s"], rel=0.2), stage
        assert stage["extra_s"] > 0


def test_the_stage_behind_the_heavy_one_waits(pp2_heavy):
    """Stage 1 cannot start a micro-batch before stage 0 has run layers 1-2 on it, so its
    receives block and the profile records a wait; both stages record one. How the two
    waits compare is wall-clock time on a shared machine, so that relation is measured by
    scripts/bench_profiler.py --part 3, not asserted here."""
    first, second = _profile(pp2_heavy)["stages"]
    assert second["wait_s"] > 0
    assert first["wait_s"] >= 0


def test_memory_bytes_are_exact(pp2_heavy):
    params = 12 * HEAVY_H * HEAVY_H + 13 * HEAVY_H          # qkv, proj, fc1, fc2 with biases; two layer norms
    for x in _profile(pp2_heavy)["layers"]:
        assert x["param_bytes"] == 4 * params
        assert x["grad_bytes"] == 4 * params                   # fp32 main_grad views
        assert x["optim_bytes"] == 2 * 4 * params + 12 * 4     # exp_avg, exp_avg_sq, step x 12 tensors



def test_cpu_peak_is_static_state_plus_in_flight_activations(pp2_heavy):
    """On CPU the peak is accounted, not measured: check it against independent
    arithmetic — analytic parameter counts of layers and extras, fp32 Adam (param,
    grad, two moments, a 4-byte step per tensor), and the 1F1B warm-up depth times the
    layers' activation bytes."""
    h = HEAVY_H
    vocab, seq, p_layer = 256, 64, 12 * h * h + 13 * h
    # Stage 0: word + position embeddings. Stage 1: final layer norm (weight, bias) and
    # the tied output layer's own copy of the word embeddings.
    extras = {0: vocab * h + seq * h, 1: 2 * h + vocab * h}
    tensors = {0: 2, 1: 3}
    profile = _profile(pp2_heavy)
    for stage in profile["stages"]:
        s = stage["stage"]
        layers = [x for x in profile["layers"] if x["stage"] == s]
        static = len(layers) * (16 * p_layer + 12 * 4) + 16 * extras[s] + 4 * tensors[s]
        in_flight = min(2 - s, 4)  # PP - stage, at most the micro-batches
        assert stage["peak_source"] == "accounted"
        assert stage["static_bytes"] == static
        assert stage["peak_bytes"] == static + in_flight * (sum(x["act_bytes"] for x in layers)
                                                            + stage["extra_act_bytes"])


@pytest.mark.parametrize("nproc,pp,tp", [(1, 1, 1), (2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 2, 2)],
                         ids=["pp1", "pp2", "pp4", "pp2xdp2", "pp2xtp2"])
def test_every_rank_holds_the_same_profile(tmp_path, nproc, pp, tp):
    worker(nproc, MODEL + ["--pipeline-model-parallel-size", str(pp),
                           "--tensor-model-parallel-size", str(tp), "--test-dump-ranks"], tmp_path)
    profiles = [_profile(json.loads((tmp_path / f"rank{r}.json").read_text())) for r in range(nproc)]
    assert all(p == profiles[0] for p in profiles)
    layers = profiles[0]["layers"]
    assert [x["layer"] for x in layers] == [1, 2, 3, 4]
    per_stage = 4 // pp
    assert [x["stage"] for x in layers] == [i // per_stage for i in range(4)]
    assert [s["stage"] for s in profiles[0]["stages"]] == list(range(pp))
    assert all(x["fwd_s"] > 0 and x["bwd_s"] > 0 for x in layers)


def test_activation_bytes_match_autograd(tmp_path):
    torchrun(1, ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32"], tmp_path,
             module="workers.activation_worker")
    result = json.loads((tmp_path / "activations.json").read_text())
    assert len(result) == 2
    for layer, r in result.items():
        assert r["autograd"] > 0
        assert r["probe"] == pytest.approx(r["autograd"], rel=0.10), (layer, r)
