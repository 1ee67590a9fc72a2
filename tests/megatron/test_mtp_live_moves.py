"""The MTP block moves live between ranks, bit-exact (real torchrun/gloo runs).

A live move carries the block with its embedding module (the word-embedding copy the
first stage's gradients keep equal, the MTP stage's own position table), gradients and
optimizer state, switches the embedding all-reduce to the group of the new rank
(pre-created at start) and, with MTP, the decoder's final norm that Megatron keeps
beside the last decoder layer (megatron/migration/mtp_move.py). Untied embeddings:
the bit-exact case (docs/mtp.md). At PP=2 the block cannot change rank (Megatron
forbids it on the first rank): the PP=2 moves are in test_mtp_runs.py and the repack
tests.
"""
import json
import shutil

import pytest
import torch

from dynmo_plugin.layout import Layout
from launch import assert_same_training, load_params, losses, torchrun, worker

from test_mtp_runs import MTP

pytestmark = pytest.mark.multiproc

PP4 = MTP + ["--pipeline-model-parallel-size", "4"]
STANDALONE = ["--pipeline-model-parallel-layout", "Ett|ttt|tttm|L"]


def _rebalances(report):
    return [e for e in report["events"] if e["kind"] == "rebalance"]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    """The never-moved PP=4 run, the block standalone on rank 2."""
    out = tmp_path_factory.mktemp("mtp_static")
    return out, worker(4, PP4 + STANDALONE, out)


def test_pp4_forced_block_moves_are_bit_exact(static, tmp_path):
    """Standalone on rank 2 -> the last rank -> with the last decoder layer (and the
    final norm beside it) on the last rank -> back to rank 2, saved after the moves."""
    forced = "3:Ett|ttt|ttt|mL;4:Ett|ttt|tt|tmL;5:Ett|tt|ttttm|L"
    moved = worker(4, PP4 + STANDALONE + ["--dynmo-forced-layouts", forced,
                                          "--save", str(tmp_path / "ckpt"), "--save-interval", "5"],
                   tmp_path)
    events = _rebalances(moved)
    assert [(e["applied"], e["layout_after"]) for e in events] == [
        (True, "Ett|ttt|ttt|mL"), (True, "Ett|ttt|tt|tmL"), (True, "Ett|tt|ttttm|L")]
    units = [[m["layer"] for m in e["moves"] if isinstance(m["layer"], str)] for e in events]
    assert units == [["mtp"], ["final_layernorm"], ["mtp", "final_layernorm"]]
    static_dir, report = static
    assert_same_training(static_dir, report, tmp_path, moved, range(4))


def test_a_checkpoint_saved_after_a_live_block_move_resumes_under_another_layout(static, tmp_path):
    """Saved at iteration 5 after the block moved live, resumed with it on the last rank."""
    run = tmp_path / "run"
    worker(4, PP4 + STANDALONE + ["--dynmo-forced-layouts", "3:Ett|ttt|ttt|mL;4:Ett|tt|tttt|mL",
                                  "--save", str(run / "ckpt"), "--save-interval", "5"], run)
    root = tmp_path / "load"
    shutil.copytree(run / "ckpt" / "iter_0000005", root / "iter_0000005")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    resumed = worker(4, PP4 + ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tmL",
                               "--load", str(root)], tmp_path / "out")
    assert [it["iteration"] for it in resumed["iterations"]] == [6]
    assert losses(resumed) == losses(static[1])[5:]


def test_pp4_decided_move_puts_the_block_where_the_exact_balancer_says(tmp_path_factory):
    """With a large vocabulary the last rank's output layer (run for the main and the MTP
    loss) is the bottleneck whatever else it holds: the controller (block unpinned)
    decides on the measured profile to take the block off it, bit-exact."""
    static_dir, moved_dir = (tmp_path_factory.mktemp(n) for n in ("d_static", "d_moved"))
    flags = PP4 + ["--vocab-size", "16384", "--pipeline-model-parallel-layout", "Ett|ttt|tt|tmL"]
    static = worker(4, flags, static_dir)
    moved = worker(4, flags + ["--dynmo-rebalance-interval", "3", "--dynmo-profile-window", "1",
                               "--dynmo-min-gain", "0", "--dynmo-gate-margin", "0"], moved_dir)
    first = _rebalances(moved)[0]
    assert first["trigger"] == "rebalance_interval" and first["applied"], first.get("reason")
    assert Layout.parse(first["layout_after"]).mtp_rank != 3
    assert any(m["layer"] == "mtp" for m in first["moves"])
    assert_same_training(static_dir, static, moved_dir, moved, range(4))


def test_a_live_repack_carries_the_block_onto_the_last_surviving_rank(static, tmp_path):
    """PP=4 -> PP=2 at iteration 3: the block, standalone on rank 2, lands on the new last
    rank with the decoder layers around it; losses and parameters as the never-repacked run."""
    proc = torchrun(4, PP4 + STANDALONE + ["--dynmo-repack", "--dynmo-forced-layouts",
                                           "3:Etttt|ttttmL"], tmp_path, module="workers.train_worker")
    assert "released by a repack to 2 stages" in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (event,) = _rebalances(report)
    assert event["applied"] and event["repack"]["applied"], event.get("error")
    assert report["layout"] == "Etttt|ttttmL"
    assert any(m["layer"] == "mtp" and (m["src"], m["dst"]) == (2, 1)
               for m in event["migration"]["moves"])
    static_dir, static_report = static
    assert losses(report) == losses(static_report)
    a, b = load_params(tmp_path, range(2)), load_params(static_dir, range(4))
    assert a.keys() == b.keys() and [n for n in a if not torch.equal(a[n], b[n])] == []


def test_a_repack_that_leaves_the_block_standalone_is_refused_in_one_line(tmp_path):
    proc = torchrun(4, PP4 + STANDALONE + ["--dynmo-repack", "--dynmo-forced-layouts",
                                           "3:Ettt|tttttm|L"], tmp_path, check=False,
                    module="workers.train_worker")
    assert proc.returncode != 0
    assert "a repack lands it on the last surviving rank (2): end the layout with 'mL'" in (
        proc.stderr + proc.stdout)


def test_block_moves_with_data_parallel_replicas_and_the_distributed_optimizer(tmp_path_factory):
    """PP=3 x DP=2: one embedding group per pipeline and candidate rank (made at start by
    every rank), the block's optimizer state gathered over DP and re-sharded."""
    static_dir, moved_dir = (tmp_path_factory.mktemp(n) for n in ("dp_static", "dp_moved"))
    flags = MTP + ["--pipeline-model-parallel-size", "3", "--use-distributed-optimizer",
                   "--pipeline-model-parallel-layout", "Ett|ttt|tttmL"]
    static = worker(6, flags, static_dir)
    moved = worker(6, flags + ["--dynmo-forced-layouts", "3:Ett|ttttttm|L;5:Ett|ttt|tttmL"], moved_dir)
    assert [(e["applied"], e["layout_after"]) for e in _rebalances(moved)] == [
        (True, "Ett|ttttttm|L"), (True, "Ett|ttt|tttmL")]
    assert_same_training(static_dir, static, moved_dir, moved, range(6))


def test_tied_embeddings_block_moves_agree_up_to_rounding(tmp_path_factory):
    """Tied: while the block is on the last rank its embedding copy is that rank's output
    weight; when it leaves, the output weight takes over the copy's values and state and
    the embedding all-reduce adds one more copy's gradient (first + MTP + last): the same
    numbers in another grouping, equal up to rounding, not bit for bit."""
    static_dir, moved_dir = (tmp_path_factory.mktemp(n) for n in ("t_static", "t_moved"))
    tied = [f for f in PP4 if f != "--untie-embeddings-and-output-weights"] + STANDALONE
    static = worker(4, tied, static_dir)
    moved = worker(4, tied + ["--dynmo-forced-layouts", "3:Ett|ttt|ttt|mL;5:Ett|tt|ttttm|L"],
                   moved_dir)
    assert [(e["applied"], e["layout_after"]) for e in _rebalances(moved)] == [
        (True, "Ett|ttt|ttt|mL"), (True, "Ett|tt|ttttm|L")]
    assert losses(moved) == pytest.approx(losses(static), rel=1e-5, abs=0)
    a, b = load_params(static_dir, range(4)), load_params(moved_dir, range(4))
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-5)] == []
