"""Early exit (CALM-style) under real torchrun pipeline runs.

Training is bit-deterministic (seeded data and init, one thread), so exit fractions,
confidences and losses are exact facts of these settings; only timings vary. On this
synthetic data (vocabulary 16, uniform confidence 1/16) the exit heads' confidence
rises from ~0.10 to ~0.30 within 36 iterations: with threshold 0.2, exits (allowed
after layer 4) start near iteration 20 and reach ~100% of tokens before layer 8 by
iteration 32.
"""
import pytest

from launch import losses, train

pytestmark = pytest.mark.multiproc

START = 12
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--vocab-size", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "36", "--lr", "1e-2", "--seed", "7",
         "--pipeline-model-parallel-size", "2"]
SCENARIO = ["--dynmo-dynamism", "early_exit", "--dynmo-early-exit-threshold", "0.2",
            "--dynmo-early-exit-loss-weight", "0.5", "--dynmo-early-exit-start", str(START),
            "--dynmo-early-exit-interval", "4", "--dynmo-early-exit-min-layer", "4",
            "--dynmo", "--dynmo-profile-every", "5", "--dynmo-min-gain", "0.02"]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "uniform"],
                 tmp_path_factory.mktemp("static"))


@pytest.fixture(scope="module")
def dynmo(tmp_path_factory):
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "exact"],
                 tmp_path_factory.mktemp("dynmo"))


def _exit_events(report):
    return [e for e in report["events"] if e["kind"] == "dynamism"]


def _profiles(report):
    return [e for e in report["events"] if e.get("profile") and e["profile"].get("layers")]


def _cost(event, layer):
    (x,) = [x for x in event["profile"]["layers"] if x["layer"] == layer]
    return x["fwd_s"] + x["bwd_s"]


def test_tail_layers_get_cheaper_as_tokens_exit(static):
    events = _exit_events(static)
    assert [e["iteration"] for e in events] == list(range(START, 37, 4))
    first, last = events[0]["detail"], events[-1]["detail"]
    assert all(f == 0.0 for f in first["exit_fraction"].values())   # heads still learning
    assert last["exit_fraction"]["8"] >= 0.9                         # nearly all exited
    assert all(last["exit_fraction"][str(n)] == 0.0 for n in range(1, 5))  # min_layer 4
    assert last["confidence"]["4"] > first["confidence"]["4"] + 0.1  # confidence rises
    # per-layer cost, last vs first layer, from the run's own profiles (ratios only)
    ratio = {e["window"][0]: _cost(e, 8) / _cost(e, 1) for e in _profiles(static)}
    before = [r for it, r in ratio.items() if it < START]
    after = [r for it, r in ratio.items() if it >= 33]
    assert before and after, ratio
    assert max(after) < 0.3 * min(before), ratio


def test_dynmo_losses_equal_static_with_early_exit(static, dynmo):
    assert losses(dynmo) == losses(static)
    assert any(max(e["detail"]["exit_fraction"].values()) > 0 for e in _exit_events(dynmo))
    applied = [e for e in dynmo["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied and all(e["trigger"].startswith("event:early_exit@") for e in applied)
    assert dynmo["layout"] != dynmo["initial_layout"]
    assert not [e for e in static["events"] if e["kind"] == "rebalance" and e["applied"]]


def test_threshold_one_never_exits_and_changes_nothing(tmp_path):
    """threshold 1.0 (strict >) never exits; with loss weight 0 the heads cannot touch
    the backbone, so the losses equal a run without the scenario bit for bit (exit
    flags ride in extra activation rows across the stage boundary, so this also checks
    that carrying them changes nothing)."""
    small = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "4", "--seed", "7",
             "--pipeline-model-parallel-size", "2"]
    plain = train(2, small, tmp_path / "plain")
    never = train(2, small + ["--dynmo-dynamism", "early_exit", "--dynmo-early-exit-threshold", "1.0",
                              "--dynmo-early-exit-loss-weight", "0", "--dynmo-early-exit-start", "1",
                              "--dynmo-early-exit-interval", "1"], tmp_path / "never")
    events = _exit_events(never)
    assert [e["iteration"] for e in events] == [1, 2, 3, 4]
    assert all(f == 0.0 for e in events for f in e["detail"]["exit_fraction"].values())
    assert all(0 < c < 1 for e in events for c in e["detail"]["confidence"].values())
    assert losses(never) == losses(plain)
