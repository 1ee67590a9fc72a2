"""Repacking live training onto fewer pipeline stages (real torchrun gloo runs).

Every check compares against a run that never repacked: same losses to the last bit,
same final parameters. Initialisation by global parameter name and data keyed by
iteration make that comparison exact for any split.
"""
import json

import pytest
import torch

from launch import ROOT, SMALL_MODEL, load_params, losses, torchrun, train, worker

pytestmark = pytest.mark.multiproc

MODEL = SMALL_MODEL + ["--train-iters", "6", "--dynmo", "--test-dump-params"]
REPACK = ["--dynmo-repack", "--dynmo-forced-layouts"]


def _report(out) -> dict:
    return json.loads((out / "report.json").read_text())


def _same_params(a_dir, a_ranks, b_dir, b_ranks) -> None:
    a, b = load_params(a_dir, a_ranks), load_params(b_dir, b_ranks)
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []


def _repack_event(report: dict) -> dict:
    (event,) = [e for e in report["events"] if e["kind"] == "rebalance"]
    return event


def test_live_repack_4_to_2_is_bit_exact(pp4_static, tmp_path):
    proc = torchrun(4, MODEL + ["--pipeline-model-parallel-size", "4", *REPACK, "3:Etttt|ttttL"],
                    tmp_path, module="workers.train_worker")
    for rank, stage in ((2, 2), (3, 3)):
        assert (f"rank {rank}: pipeline stage {stage} released by a repack to 2 stages; "
                "leaving the job (exit 0)") in proc.stderr
    report = _report(tmp_path)
    assert losses(report) == losses(pp4_static[1])
    _same_params(tmp_path, range(2), pp4_static[0], range(4))
    assert not (tmp_path / "params_rank2.pt").exists()  # retirees leave before the end
    event = _repack_event(report)
    assert event["applied"] and event["layout_after"] == "Etttt|ttttL" == report["layout"]
    repack = event["repack"]
    assert repack["applied"] and (repack["stages_before"], repack["stages_after"]) == (4, 2)
    assert repack["ranks_released"] == [2, 3] and repack["error"] is None
    assert set(repack["phase_s"]) == {"migration", "handoff", "regroup", "rebuild"}
    assert repack["cluster"]["strategy"] == "none" and repack["cluster"]["outcome"] == "logged"
    assert {(m["layer"], m["src"], m["dst"]) for m in event["moves"]} == {
        (3, 1, 0), (4, 1, 0), (5, 2, 1), (6, 2, 1), (7, 3, 1), (8, 3, 1)}
    assert [(h["iteration"], h["pp"], h["world_size"]) for h in report["world"]["history"]] == [
        (0, 4, 4), (3, 2, 2)]
    assert report["gpus"] == [{"iteration": 0, "gpus": 4}, {"iteration": 3, "gpus": 2},
                              {"iteration": 6, "gpus": 2}]


def test_checkpoint_repack_restarts_smaller_and_matches(pp4_static, tmp_path):
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir(), second.mkdir()
    train(4, MODEL + ["--pipeline-model-parallel-size", "4", *REPACK, "4:Etttt|ttttL",
                      "--dynmo-repack-mode", "checkpoint", "--save", str(ckpt)],
          first, module="workers.train_worker")
    stopped = _report(first)
    assert [it["iteration"] for it in stopped["iterations"]] == [1, 2, 3]
    repack = _repack_event(stopped)["repack"]
    assert repack["mode"] == "checkpoint" and repack["next_layout"] == "Etttt|ttttL"
    meta = json.loads((ckpt / "iter_0000003" / "meta.json").read_text())
    assert meta["next"] == {"layout": "Etttt|ttttL", "pp": 2, "world_size": 2}
    resumed = train(2, MODEL + ["--pipeline-model-parallel-size", "2", "--load", str(ckpt)],
                    second, module="workers.train_worker")
    assert resumed["initial_layout"] == "Etttt|ttttL"
    assert [it["iteration"] for it in resumed["iterations"]] == [4, 5, 6]
    assert losses(stopped) + losses(resumed) == losses(pp4_static[1])
    _same_params(second, range(2), pp4_static[0], range(4))


@pytest.mark.parametrize("grid", [["--tensor-model-parallel-size", "2"], []], ids=["tp2", "dp2"])
def test_repack_2_to_1_with_replicas_or_shards(tmp_path, grid):
    """TP=2 / DP=2 (stale process groups would show here: size-1 groups never talk).

    Down to ONE stage, the tied output weight stops being a separate copy whose gradient
    is all-reduced with the embedding's and becomes the embedding itself: the same sum in
    another order, so a never-repacked PP=2 run agrees to float rounding only (as PP=1 vs
    PP=2 always does, see test_train_equivalence). The exact reference is a PP=1 run
    resumed from the PP=2 run's checkpoint at the repack point."""
    saved, resumed, repacked, ckpt = (tmp_path / n for n in ("saved", "resumed", "repacked", "ckpt"))
    for d in (saved, resumed, repacked):
        d.mkdir()
    flags = MODEL + [*grid]
    worker(4, flags + ["--pipeline-model-parallel-size", "2", "--train-iters", "2",
                       "--save", str(ckpt), "--save-interval", "2"], saved)
    reference = worker(2, flags + ["--pipeline-model-parallel-size", "1", "--load", str(ckpt)], resumed)
    report = worker(4, flags + ["--pipeline-model-parallel-size", "2", *REPACK, "3:EttttttttL"],
                    repacked)
    event = _repack_event(report)
    assert event["repack"]["ranks_released"] == [2, 3] and report["layout"] == "EttttttttL"
    assert losses(report)[2:] == losses(reference)
    for rank in range(2):  # TP shards differ per rank: compare each with its twin
        _same_params(repacked, [rank], resumed, [rank])


def test_failed_repack_migration_keeps_every_rank(pp4_static, tmp_path):
    report = worker(4, MODEL + ["--pipeline-model-parallel-size", "4", *REPACK, "3:Etttt|ttttL",
                                "--test-fault", "receiver_exception@0"], tmp_path)
    event = _repack_event(report)
    assert not event["applied"] and not event["repack"]["applied"]
    assert "injected receiver failure on stage 0" in event["error"]
    assert report["layout"] == "Ett|tt|tt|ttL" and len(report["world"]["history"]) == 1
    assert losses(report) == losses(pp4_static[1])
    _same_params(tmp_path, range(4), pp4_static[0], range(4))


def test_repack_demo_config_shrinks_4_to_2_like_a_run_that_never_did(tmp_path, shared_run):
    """configs/repack_demo.yaml through the real launcher, as the README runs it."""
    config = str(ROOT / "configs" / "repack_demo.yaml")
    flags = ["--pipeline-model-parallel-size", "4", "--dynmo", "--dynmo-config", config,
             "--train-iters", "30"]
    repacked = tmp_path / "repacked"
    proc = torchrun(4, flags, repacked)
    assert "leaving the job (exit 0)" in proc.stderr
    report = _report(repacked)
    (repack,) = [e for e in report["events"] if e.get("repack")]
    assert (repack["repack"]["stages_before"], repack["repack"]["stages_after"]) == (4, 2)
    assert repack["trigger"].startswith("event:layer_freezing@")
    assert report["world"]["history"][-1]["world_size"] == 2
    from dynmo_plugin.cli import main as dynmo
    assert dynmo(["report", str(repacked)]) == 0
    assert (repacked / "gpus.png").stat().st_size > 0
    assert "GPUs in use: 4 → 2" in (repacked / "summary.md").read_text()
    # without --dynmo: the same freezing on the static 4-stage split, never repacked
    # (launched once per session: test_grow_dp.py compares against it too)
    _, never = shared_run(4, ["--pipeline-model-parallel-size", "4", "--dynmo-config", config,
                              "--train-iters", "30"], module="dynmo_plugin.train")
    assert losses(report) == losses(never)
