"""Interleaved pipeline (pp = 2, v = 2 virtual stages per rank): forced migrations across
chunks and ranks are bit-exact against a never-moved run.

The never-moved reference is the same model under plain 1F1B (pp = 2): never-moved
interleaved training equals it to the last bit (measured: same losses and parameters),
so one comparison checks both that the interleaved schedule trains correctly (a swapped
activation/gradient on 2 ranks did not) and that the moves change nothing, in two
torchrun runs instead of three."""
import pytest

from launch import assert_same_training, losses, worker

pytestmark = pytest.mark.multiproc

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--dynmo", "--test-dump-params",
         "--pipeline-model-parallel-size", "2"]
INTERLEAVED = MODEL + ["--num-virtual-stages-per-pipeline-rank", "2"]
# Virtual stage s runs on rank s % 2. Start: Ett|tt|tt|ttL = rank 0 {1,2 | 5,6}, rank 1 {3,4 | 7,8}.
# Iteration 3: layer 2 goes chunk 0 -> chunk 1 of rank 0 (local: no bytes), 3, 4 and 7 go
# rank 1 -> rank 0 (sent); virtual stage 1 empties.
# Iteration 5: 2, 3 go back chunk 1 -> chunk 0 of rank 0 (local), 4 and 7 go rank 0 -> rank 1.
FORCED = "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"


def test_interleaved_migrations_are_bit_exact(tmp_path_factory):
    static_dir, moved_dir = tmp_path_factory.mktemp("il_static"), tmp_path_factory.mktemp("il_moved")
    static = worker(2, MODEL, static_dir)
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
