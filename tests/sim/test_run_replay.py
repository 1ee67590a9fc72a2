"""sim.run_replay (`dynmo simulate --from-run`) on a report written here: pure, no launch.

The report: 4 layers (forward 1 ms, backward 2 ms per micro-batch, no extras, no
gradient bytes, nccl so no per-message latency, a link so fast that
transfers take no time) on 2 stages, 8 micro-batches; layers
1-2 freeze at iteration 3 (profiled at 4-5, after the freeze), and at iteration 6 a
repack onto 1 stage grows data parallelism to 2 (4 micro-batches per replica). Every
predicted figure below is counted by hand from those costs.
"""
from __future__ import annotations

import json

import pytest

from dynmo_plugin.cli import main as dynmo
from dynmo_plugin.errors import UserError
from dynmo_plugin.sim import PipelineCosts
from dynmo_plugin.sim.run_replay import MIN_CORES, _shared_s, replay_report, replay_run
from dynmo_plugin.sim.shared import shared_iteration_s, simulate_shared

MS = 1e-3


def _profile(frozen: set[int]) -> dict:
    layers = [{"layer": i, "stage": (i - 1) // 2, "fwd_s": 1 * MS,
               "bwd_s": 0.0 if i in frozen else 2 * MS, "param_bytes": 0} for i in range(1, 5)]
    stages = [{"stage": s, "extra_s": 0.0, "extra_grad_bytes": 0, "num_microbatches": 8} for s in (0, 1)]
    return {"layers": layers, "stages": stages}


def _report() -> dict:
    model = {"seq_length": 16, "micro_batch_size": 1, "hidden_size": 8, "global_batch_size": 8}
    iterations = [{"iteration": i, "time_s": t, "dynmo_s": 0.0} for i, t in enumerate(
        [0.9, 0.9, 0.9, 0.06, 0.9, 0.9, 0.9, 0.05, 0.03, 0.04], start=1)]
    events = [
        {"kind": "dynamism", "iteration": 3, "detail": {"frozen_layers": [1, 2]}},
        {"kind": "rebalance", "iteration": 5, "window": [4, 5], "applied": False,
         "layout_after": "Ett|ttL", "profile": _profile({1, 2})},
        {"kind": "rebalance", "iteration": 6, "applied": True, "layout_after": "EttttL",
         "repack": {"applied": True, "dp_before": 1, "dp_after": 2}},
    ]
    world = {"pp": 2, "dp": 1, "backend": "nccl",
             "history": [{"iteration": 0, "pp": 2, "dp": 1}, {"iteration": 6, "pp": 1, "dp": 2}]}
    return {"config": {"model": model, "dynmo": {"rebalance": {"bandwidth_gbps": 1e9}}},
            "world": world, "initial_layout": "Ett|ttL", "iterations": iterations, "events": events}


def _rows(replay):
    return [(s.first, s.last, s.layout, s.pp, s.dp, s.num_microbatches, s.frozen, s.counted)
            for s in replay.segments]


def test_segments_follow_layout_world_and_freezing_and_measure_clean_iterations_only():
    replay = replay_report(_report())
    assert replay.profile_iteration == 4
    assert _rows(replay) == [
        (1, 3, "Ett|ttL", 2, 1, 8, (), ()),              # 1-2 warm-up, 3 the freeze event
        (4, 6, "Ett|ttL", 2, 1, 8, (1, 2), ()),          # 4-5 profiled, 6 the repack
        (7, 10, "EttttL", 1, 2, 4, (1, 2), (7, 8, 9, 10))]
    after = replay.segments[2]
    assert after.measured_s == pytest.approx(0.045)  # median of 0.9, 0.05, 0.03, 0.04
    assert after.tokens_per_iteration == 8 * 16


def test_predictions_count_the_work_of_each_segment():
    """On one core a pipeline is never idle: an iteration is its whole work. Dense
    (segment 1): 8 micro-batches x 4 layers x 3 ms, the frozen layers' backward
    restored from the profiled ratio (2 ms / 1 ms of the training layers). Frozen
    (segment 2): layers 1-2 forward only. Grown (segment 3): each replica 4 micro-
    batches on half the core. Dedicated, one replica of 1 stage: 4 x 8 ms."""
    one = replay_report(_report(), cores=1.0)
    assert [s.predicted_s for s in one.segments] == pytest.approx([96 * MS, 64 * MS, 64 * MS])
    dedicated = replay_report(_report())
    assert dedicated.segments[2].predicted_s == pytest.approx(32 * MS)
    assert [s.dedicated_s for s in one.segments] == [s.predicted_s for s in dedicated.segments]
    # stage 0 of the frozen pipeline: 2 ms per micro-batch, stage 1: 6 ms
    assert dedicated.segments[1].predicted_s == pytest.approx(2 * MS + 8 * 6 * MS)


def _with_step_and_rest(report: dict, distributed: bool = False) -> dict:
    """The profile with an optimizer step and a rest of the step: layers 3-4 train with
    1000 gradient bytes each (500 parameter bytes: ratio 2; frozen layers 1-2 hold 500
    parameter bytes and no gradient), stage 1 steps them in 4 ms (2 us a byte), stage 0
    has nothing to step; the rest is 8 ms on stage 0 and 16 ms on stage 1 over 8
    micro-batches: 1.5 ms a micro-batch on the mean."""
    profile = report["events"][1]["profile"]
    for x in profile["layers"]:
        x["param_bytes"], x["grad_bytes"] = 500, (0 if x["layer"] in (1, 2) else 1000)
    for st, step, rest in zip(profile["stages"], (0.0, 4 * MS), (8 * MS, 16 * MS)):
        st["step_s"], st["rest_s"] = step, rest
    report["config"]["model"]["use_distributed_optimizer"] = distributed
    return report


def test_the_step_goes_with_the_trained_bytes_and_the_rest_with_each_micro_batch():
    """Per micro-batch the rest adds 0.5 ms forward, 1 ms backward to every stage.
    Frozen (segment 2): stage 0 2.5 + 1, stage 1 2.5 + 5 ms; stage 1 never waits:
    2.5 + 8 x 7.5 = 62.5 ms, then its 4 ms step. Dense (segment 1): both stages 7.5 ms,
    stage 0's last backward ends at 67.5 ms, then its step: layers 1-2 train 2 x 1000
    bytes (500 x the ratio 2) at 2 us a byte, 4 ms. Grown (segment 3, one stage, 4
    micro-batches): 4 x 9.5 + 4 ms of step; with the distributed optimizer each of the
    2 replicas steps half: 2 ms."""
    replay = replay_report(_with_step_and_rest(_report()))
    assert [s.predicted_s for s in replay.segments] == pytest.approx([71.5 * MS, 66.5 * MS, 42 * MS])
    sharded = replay_report(_with_step_and_rest(_report(), distributed=True))
    assert sharded.segments[2].predicted_s == pytest.approx(40 * MS)


def test_the_grow_ratio_and_its_error():
    replay = replay_report(_report(), cores=1.0)
    g = replay.grow
    assert (g.iteration, g.before.first, g.after.first) == (6, 4, 7)
    assert g.ratio() == pytest.approx(1.0)  # one core: the same work before and after
    assert g.ratio("dedicated") == pytest.approx(50 / 32)
    assert g.ratio("measured") is None and g.error is None  # no clean iteration before it
    report = _report()
    report["events"][1]["window"] = [5, 5]  # iteration 4 now measured: 0.06 s
    g = replay_report(report, cores=1.0).grow
    assert g.before.counted == (4,)
    assert g.ratio("measured") == pytest.approx(0.06 / 0.045)
    assert g.error == pytest.approx(1.0 / (0.06 / 0.045) - 1)


def test_foreign_load_leaves_fewer_cores():
    """Two cores of which other processes kept one busy: the one-core prediction."""
    foreign = {i: 1.0 for i in range(1, 11)}
    loaded = replay_report(_report(), cores=2.0, foreign_cores=foreign)
    one = replay_report(_report(), cores=1.0)
    assert [s.cores for s in loaded.segments] == [1.0, 1.0, 1.0]
    assert [s.predicted_s for s in loaded.segments] == pytest.approx([s.predicted_s for s in one.segments])
    with pytest.raises(UserError, match="needs the cores"):
        replay_report(_report(), foreign_cores=foreign)


def test_each_iteration_is_predicted_on_its_own_cores():
    """The grown stretch (7-10) on 2 cores, others holding 1 core during 7 and 10 and
    none during 8-9: 64, 32, 32, 64 ms, median 48 ms, as the measured median is taken
    (the mean load, 1.5 cores left, would say 42.7 ms)."""
    loaded = replay_report(_report(), cores=2.0, foreign_cores={7: 1.0, 8: 0.0, 9: 0.0, 10: 1.0})
    after = loaded.segments[2]
    assert after.predicted_s == pytest.approx(48 * MS) and after.cores == pytest.approx(1.5)


def test_the_ranks_other_threads_take_cores_from_them():
    """Each rank's other threads (gloo's transport) used 8 ms of CPU per iteration in the
    window (`threads_s`). On one core, always busy, every segment is its work plus the
    2 ranks' 16 ms; on two cores the grown stretch (two replicas, 32 ms each) is
    (2 x 32 + 16) / 2. One device per rank (dedicated) does not share: unchanged."""
    report = _report()
    for stage in report["events"][1]["profile"]["stages"]:
        stage["threads_s"] = 8 * MS
    one = replay_report(report, cores=1.0)
    assert [s.predicted_s for s in one.segments] == pytest.approx([112 * MS, 80 * MS, 80 * MS], rel=1e-4)
    assert replay_report(report, cores=2.0).segments[2].predicted_s == pytest.approx(40 * MS, rel=1e-4)
    assert [s.dedicated_s for s in one.segments] == [s.dedicated_s for s in replay_report(_report(), cores=1.0).segments]
    # threads as heavy as the ranks' own work (48 ms a rank, 96 ms in all, on the 96 ms
    # segment): 96 / (1 - 96 / T) = T at T = 192 ms, where a fixed-point iteration oscillated
    for stage in report["events"][1]["profile"]["stages"]:
        stage["threads_s"] = 48 * MS
    assert replay_report(report, cores=1.0).segments[0].predicted_s == pytest.approx(192 * MS, rel=1e-4)


def test_threads_never_make_fewer_cores_than_the_floor_faster():
    """Below MIN_CORES the threads cannot take cores (the floor would give more): the
    prediction is the cores' own, never faster."""
    costs = PipelineCosts(fwd_s=[0.002, 0.003], bwd_s=[0.004, 0.005], num_microbatches=4)
    few = MIN_CORES / 2
    assert _shared_s(costs, few, threads_s=0.05) == shared_iteration_s(costs, few)


def test_replicas_split_the_cores():
    costs = PipelineCosts(fwd_s=[0.002, 0.003], bwd_s=[0.004, 0.005], num_microbatches=4, dp=2)
    assert shared_iteration_s(costs, 2.0) == pytest.approx(simulate_shared(costs, 1.0).iteration_s)
    assert shared_iteration_s(costs, 2.0) == pytest.approx(4 * 0.014)


def test_cli_from_run(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    assert dynmo(["simulate", "--from-run", str(tmp_path), "--cores", "1"]) == 0
    out = capsys.readouterr().out
    assert "grow at iteration 6 (pp 2 -> 1, dp 1 -> 2): tokens/s after / before: predicted 1.000x; not measured" in out
    assert "one device per rank would give 1.563x" in out
    assert dynmo(["simulate", "--from-run", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["grow"]["ratio_predicted"] == pytest.approx(50 / 32) and doc["cores"] is None
    assert replay_run(tmp_path).as_dict() == doc


@pytest.mark.parametrize("argv, message", [
    (["--from-run", "RUN", "--pp", "2"], "--from-run replays the run's own model, cluster and schedule; drop --pp"),
    (["--from-run", "RUN", "--scenario", "moe", "--repack"], "drop --repack, --scenario"),
    (["--from-run", "RUN", "--cores", "0"], "--cores must be a number of CPU cores in (0, 8192], got 0.0"),
    (["--from-run", "NOPE"], "--from-run 'NOPE': cannot read"),
    (["--scenario", "moe", "--pp", "2"], "dynmo simulate needs --layers, --dp (or --from-run RUN_DIR"),
    (["--scenario", "moe", "--layers", "4", "--dp", "1", "--pp", "2", "--cores", "2"],
     "--cores applies only to --from-run RUN_DIR; drop it"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    argv = [str(tmp_path) if a == "RUN" else str(tmp_path / "nope") if a == "NOPE" else a for a in argv]
    message = message.replace("'NOPE'", repr(str(tmp_path / "nope")))
    assert dynmo(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_no_profile_is_one_clear_error():
    report = _report()
    del report["events"][1]["profile"]
    with pytest.raises(UserError, match="holds no per-layer profile; train with --dynmo"):
        replay_report(report, "RUN")


def _mangled(report: dict) -> dict:
    report["events"][1]["profile"]["layers"] = [[1, 2], [3, 4]]
    return report


def _text_fwd(report: dict) -> dict:
    report["events"][1]["profile"]["layers"][2]["fwd_s"] = "1 ms"
    return report


def _no_model(report: dict) -> dict:
    del report["config"]["model"]
    return report


_COSTS_FROM = ["simulate", "--scenario", "moe", "--layers", "8", "--dp", "1", "--pp", "2", "--costs-from"]
_READERS = [["simulate", "--json", "--from-run"], ["plan", "--json", "--from-run"], _COSTS_FROM]


@pytest.mark.parametrize("content, message", [
    (b"[]", "report.json is not a run's report: it holds a list, not an object; pass the report.json"),
    (b'{"events": {}}', "report.json is not a run's report: events is an object, not a list"),
    (b'{"events": [3]}', "report.json is not a run's report: events[0] is 3, not an object"),
    (b"\xff\xfe", "report.json is not UTF-8 text (invalid start byte at byte 0)"),
    (json.dumps(_mangled(_report())).encode(),
     "report.json is not a run's report: events[1].profile.layers[0] is a list, not an object"),
    (json.dumps(_text_fwd(_report())).encode(),
     "events[1].profile.layers[2].fwd_s is a string, not a number >= 0"),
])
@pytest.mark.parametrize("reader", _READERS, ids=["simulate --from-run", "plan --from-run", "--costs-from"])
def test_a_report_that_is_not_one_is_one_line_for_every_reader(tmp_path, capsys, content, message, reader):
    """Read in one place (`sim.from_run.read_run_report`): every reader of a run's report
    names the flag, the file and the bad field; exit 2, nothing on stdout (it raised
    TypeError, AttributeError, UnicodeDecodeError)."""
    (tmp_path / "report.json").write_bytes(content)
    assert dynmo([*reader, str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    flag = reader[-1]
    assert out == "" and err.count("\n") == 1, err
    assert f"error: {flag} {str(tmp_path)!r}: {tmp_path / 'report.json'}" in err and message in err, err


@pytest.mark.parametrize("reader", _READERS[::2], ids=["simulate --from-run", "--costs-from"])
def test_a_report_without_its_model_is_one_line(tmp_path, capsys, reader):
    (tmp_path / "report.json").write_text(json.dumps(_no_model(_report())))
    assert dynmo([*reader, str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "lacks or mangles" in err and "'model'" in err, err


@pytest.mark.parametrize("cores", ["inf", "1e308", "nan", "-1", "8193"])
def test_cores_are_finite_and_bounded(tmp_path, capsys, cores):
    """--cores inf failed in the JSON writer and 1e308 overflowed the mean of the cores
    left; a rank uses at most one core, so MAX_CORES bounds what a replay can use."""
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    assert dynmo(["simulate", "--from-run", str(tmp_path), "--cores", cores, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"--cores must be a number of CPU cores in (0, 8192], got {float(cores)}" in err
    assert dynmo(["simulate", "--from-run", str(tmp_path), "--cores", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cores"] == 8192
