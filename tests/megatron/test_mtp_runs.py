"""Multi-Token Prediction in real torchrun/gloo runs of the launcher.

Megatron-Core's MultiTokenPredictionBlock (`--mtp-num-layers 1`, `--transformer-impl
local`) trains on the last rank or standalone; decoder layers migrate around it
bit-exact (forced and decided); the MTP block moves between ranks through a checkpoint
(saved under one layout, resumed under another) bit-exact against the never-moved run;
the profiler measures it as its own unit. Untied embeddings: with tied ones the last
rank's output weight and the MTP stage's embedding copy are one tensor when MTP is on
the last rank and two when it is standalone, so the embedding gradient's all-reduce
adds the same numbers in another grouping (equal up to rounding, not bit for bit).
"""
import pytest

from dynmo_plugin.layout import Layout
from launch import SMALL_MODEL, assert_same_training, losses, worker

pytestmark = pytest.mark.multiproc

MTP = SMALL_MODEL + ["--train-iters", "6", "--dynmo", "--test-dump-params", "--mtp-num-layers", "1",
                     "--untie-embeddings-and-output-weights", "--transformer-impl", "local"]


def _rebalances(report):
    return [e for e in report["events"] if e["kind"] == "rebalance"]


def test_mtp_trains_and_its_placement_does_not_change_the_numbers(tmp_path_factory):
    """The same model with the block on the last rank and standalone: the same losses and
    final parameters to the last bit; and without MTP the training differs."""
    last_dir, alone_dir, plain_dir = (tmp_path_factory.mktemp(n) for n in ("last", "alone", "plain"))
    pp3 = ["--pipeline-model-parallel-size", "3", "--dynmo-profile-every", "0"]
    last = worker(3, MTP + pp3 + ["--pipeline-model-parallel-layout", "Ett|ttt|tttmL"], last_dir)
    alone = worker(3, MTP + pp3 + ["--pipeline-model-parallel-layout", "Ettt|tttttm|L"], alone_dir)
    assert_same_training(last_dir, last, alone_dir, alone, range(3))
    plain = worker(3, [f for f in MTP if f not in ("--mtp-num-layers", "1")] + pp3, plain_dir)
    assert losses(plain)[0] == losses(last)[0] and losses(plain)[1:] != losses(last)[1:]


def test_pp2_decoder_moves_around_the_mtp_block_are_bit_exact(tmp_path_factory):
    static_dir, moved_dir = tmp_path_factory.mktemp("static"), tmp_path_factory.mktemp("moved")
    flags = MTP + ["--pipeline-model-parallel-size", "2"]
    static = worker(2, flags, static_dir)
    moved = worker(2, flags + ["--dynmo-forced-layouts", "3:Etttttt|ttmL;5:Et|tttttttmL"], moved_dir)
    assert [e["layout_after"] for e in _rebalances(moved)] == ["Etttttt|ttmL", "Et|tttttttmL"]
    assert all(e["applied"] for e in _rebalances(moved))
    assert_same_training(static_dir, static, moved_dir, moved, range(2))


PP4 = MTP + ["--pipeline-model-parallel-size", "4"]


@pytest.fixture(scope="module")
def pp4_mtp_static(tmp_path_factory):
    """The never-moved PP=4 run, MTP standalone on rank 2, checkpoints every 2 iterations."""
    out = tmp_path_factory.mktemp("pp4_static")
    report = worker(4, PP4 + ["--pipeline-model-parallel-layout", "Ett|ttt|tttm|L",
                              "--save", str(out / "ckpt"), "--save-interval", "2"], out)
    return out, report


def test_pp4_forced_decoder_moves_around_a_standalone_mtp_block(pp4_mtp_static, tmp_path):
    static_dir, static = pp4_mtp_static
    moved = worker(4, PP4 + ["--pipeline-model-parallel-layout", "Ett|ttt|tttm|L",
                             "--dynmo-forced-layouts", "3:Et|tttt|tttm|L;5:Ettt|tt|tttm|L"], tmp_path)
    assert [(e["applied"], e["layout_after"]) for e in _rebalances(moved)] == [
        (True, "Et|tttt|tttm|L"), (True, "Ettt|tt|tttm|L")]
    assert_same_training(static_dir, static, tmp_path, moved, range(4))


def test_the_block_moves_through_a_checkpoint_bit_exact(pp4_mtp_static, tmp_path):
    """Saved at iteration 4 with the block standalone on rank 2, resumed with it on the
    last rank (and the decoder split changed): iterations 5-6 as the never-moved run."""
    import shutil
    static_dir, static = pp4_mtp_static
    root = tmp_path / "load"
    shutil.copytree(static_dir / "ckpt" / "iter_0000004", root / "iter_0000004")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = worker(4, PP4 + ["--pipeline-model-parallel-layout", "Et|ttt|ttt|tmL",
                               "--load", str(root)], tmp_path / "out")
    assert resumed["initial_layout"] == "Et|ttt|ttt|tmL"
    assert [it["iteration"] for it in resumed["iterations"]] == [5, 6]
    assert losses(resumed) == losses(static)[4:]


def test_decided_rebalance_profiles_the_block_and_keeps_it_while_decoders_move(tmp_path_factory):
    """From a lopsided start the controller decides a move on the measured profile; the
    profile holds the MTP block as its own unit (time, bytes), the plan keeps it on its
    rank, and training stays bit-exact against the never-moved run."""
    static_dir, moved_dir = tmp_path_factory.mktemp("d_static"), tmp_path_factory.mktemp("d_moved")
    flags = MTP + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                   "Et|tttttttmL"]
    static = worker(2, flags, static_dir)
    moved = worker(2, flags + ["--dynmo-rebalance-interval", "3", "--dynmo-profile-window", "1",
                               "--dynmo-min-gain", "0", "--dynmo-gate-margin", "0"], moved_dir)
    first = _rebalances(moved)[0]
    assert first["trigger"] == "rebalance_interval" and first["applied"], first.get("reason")
    after = Layout.parse(first["layout_after"])
    assert after.mtp_stage == 1 and after.counts[0] > 1
    mtp = first["profile"]["mtp"]
    assert (mtp["layer"], mtp["stage"]) == (1, 1)
    assert mtp["fwd_s"] > 0 and mtp["bwd_s"] > 0 and mtp["param_bytes"] > 0 and mtp["act_bytes"] > 0
    # its bytes hold its decoder layer and the word-embedding copy it brings to the rank
    # (vocabulary 256 x hidden 32, fp32), not only its own layer's
    layer = first["profile"]["layers"][-1]
    assert mtp["param_bytes"] >= layer["param_bytes"] + 256 * 32 * 4, (mtp, layer)
    assert first["plan"]["notes"] and "MTP block" in " ".join(first["plan"]["notes"])
    assert_same_training(static_dir, static, moved_dir, moved, range(2))


@pytest.mark.parametrize("pp, v, mtp, want", [
    (4, 1, 1, "Ett|ttt|tttm|L"),   # the saved standalone block, restored
    (2, 2, 1, "Ett|ttt|ttt|mL"),   # its stage is rank 0's chunk under v = 2: last stage
    (4, 1, 0, "Ett|ttt|ttt|L"),    # resumed without MTP
])
def test_a_resume_without_a_layout_flag_keeps_the_saved_mtp_stage_where_it_can(pp, v, mtp, want):
    from dynmo_plugin.megatron.checkpoint.directory import resume_layout
    assert str(resume_layout({"layout": "Ett|ttt|tttm|L"}, pp, v, 8, mtp)) == want


def test_interleaved_decoder_moves_around_the_mtp_block_are_bit_exact(tmp_path_factory):
    """pp=2 x v=2: the block in rank 1's last chunk; a forced layout moves decoder layers
    between chunks and ranks around it."""
    static_dir, moved_dir = tmp_path_factory.mktemp("v_static"), tmp_path_factory.mktemp("v_moved")
    flags = MTP + ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    static = worker(2, flags, static_dir)
    moved = worker(2, flags + ["--dynmo-forced-layouts", "3:Et|ttt|ttt|tmL"], moved_dir)
    assert [(e["applied"], e["layout_after"]) for e in _rebalances(moved)] == [(True, "Et|ttt|ttt|tmL")]
    assert static["layout"] == "Ett|tt|tt|ttmL"
    assert_same_training(static_dir, static, moved_dir, moved, range(2))
