"""Interleaved pipeline (pp = 2, v = 2 virtual stages per rank): forced migrations across
chunks and ranks are bit-exact against a never-moved run.

The never-moved reference is the same model under plain 1F1B (pp = 2): never-moved
interleaved training equals it to the last bit (measured: same losses and parameters),
so one comparison checks both that the interleaved schedule trains correctly (a swapped
activation/gradient on 2 ranks did not) and that the moves change nothing, in two
torchrun runs instead of three. The same reference checks an interleaved repack (pp = 4
-> 2, v = 2 kept)."""
import json

import pytest

from launch import SMALL_MODEL, assert_same_training, losses, torchrun, worker

pytestmark = pytest.mark.multiproc

MODEL = SMALL_MODEL + ["--train-iters", "6", "--dynmo", "--test-dump-params",
         "--pipeline-model-parallel-size", "2"]
INTERLEAVED = MODEL + ["--num-virtual-stages-per-pipeline-rank", "2"]
# Virtual stage s runs on rank s % 2. Start: Ett|tt|tt|ttL = rank 0 {1,2 | 5,6}, rank 1 {3,4 | 7,8}.
# Iteration 3: layer 2 goes chunk 0 -> chunk 1 of rank 0 (local: no bytes), 3, 4 and 7 go
# rank 1 -> rank 0 (sent); virtual stage 1 empties.
# Iteration 5: 2, 3 go back chunk 1 -> chunk 0 of rank 0 (local), 4 and 7 go rank 0 -> rank 1.
FORCED = "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The never-moved reference: plain 1F1B, pp = 2 (directory, report)."""
    out = tmp_path_factory.mktemp("il_static")
    return out, worker(2, MODEL, out)


def test_interleaved_migrations_are_bit_exact(plain, tmp_path_factory):
    static_dir, static = plain
    moved_dir = tmp_path_factory.mktemp("il_moved")
    moved = worker(2, INTERLEAVED + ["--dynmo-forced-layouts", FORCED], moved_dir)
    events = [e for e in moved["events"] if e["kind"] == "rebalance"]
    assert [(e["applied"], e["layout_after"]) for e in events] == [
        (True, "Et||tttttt|tL"), (True, "Ettt|t|tt|ttL")]
    first = {(m["layer"], m["src"], m["dst"]): m["bytes"] for m in events[0]["migration"]["moves"]}
    assert first.keys() == {(2, 0, 2), (3, 1, 2), (4, 1, 2), (7, 3, 2)}
    assert first[(2, 0, 2)] == 0 and all(first[k] > 0 for k in [(3, 1, 2), (4, 1, 2), (7, 3, 2)])
    second = {(m["layer"], m["src"], m["dst"]): m["bytes"] for m in events[1]["migration"]["moves"]}
    assert second.keys() == {(2, 2, 0), (3, 2, 0), (4, 2, 1), (7, 2, 3)}
    assert second[(2, 2, 0)] == second[(3, 2, 0)] == 0 < second[(4, 2, 1)]
    assert moved["initial_layout"] == "Ett|tt|tt|ttL" and static["layout"] == "Etttt|ttttL"
    params = assert_same_training(static_dir, static, moved_dir, moved, range(2))
    assert len(params) > 8 * 12 and len(losses(moved)) == 6


# pp = 4, v = 2 starts one layer per virtual stage: rank r holds layers r + 1 (chunk 0) and
# r + 5 (chunk 1). At iteration 3 it repacks onto pp = 2, v = 2 `Ettttt|t|t|tL`: rank 0
# {1-5 | 7}, rank 1 {6 | 8}. Over the old 4 ranks (the intermediate `Ettttt|t|||t|t||L`,
# virtual stage s on rank s % 4, chunk s // 4) 5 moves chunk 1 -> 0 on rank 0 and 6 chunk
# 1 -> 0 on rank 1 (local, no bytes); 2, 3, 4, 7 and 8 cross ranks; ranks 2 and 3 leave.
REPACKED = "Ettttt|t|t|tL"


def test_interleaved_repack_4_to_2_ranks_is_bit_exact(plain, tmp_path):
    flags = list(INTERLEAVED)
    flags[flags.index("--pipeline-model-parallel-size") + 1] = "4"
    proc = torchrun(4, flags + ["--dynmo-repack", "--dynmo-forced-layouts", f"3:{REPACKED}"],
                    tmp_path, module="workers.train_worker")
    for rank in (2, 3):
        assert (f"rank {rank}: pipeline stage {rank} released by a repack to 2 stages; "
                "leaving the job (exit 0)") in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["initial_layout"] == "Et|t|t|t|t|t|t|tL"
    static_dir, static = plain
    assert_same_training(static_dir, static, tmp_path, report, range(2))
    assert not (tmp_path / "params_rank2.pt").exists()  # retirees leave before the end
    (event,) = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert event["applied"] and event["layout_after"] == REPACKED == report["layout"]
    repack = event["repack"]
    assert repack["applied"] and (repack["stages_before"], repack["stages_after"]) == (4, 2)
    assert repack["ranks_released"] == [2, 3] and repack["error"] is None
    moves = {(m["layer"], m["src"], m["dst"]): m["bytes"] for m in event["moves"]}
    assert moves.keys() == {(2, 1, 0), (3, 2, 0), (4, 3, 0), (5, 4, 0), (6, 5, 1), (7, 6, 4),
                            (8, 7, 5)}
    assert moves[(5, 4, 0)] == moves[(6, 5, 1)] == 0 < min(moves[(2, 1, 0)], moves[(8, 7, 5)])
    assert [(h["iteration"], h["pp"], h["world_size"]) for h in report["world"]["history"]] == [
        (0, 4, 4), (3, 2, 2)]
