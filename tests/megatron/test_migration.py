"""Live layer migration: bit-exact training across moves, atomic on failure."""
import pytest
import torch

from dynmo_plugin.migration.pool import StagingPool
from dynmo_plugin.migration.wire import pack, unpack
from launch import SMALL_MODEL, assert_same_training, load_params, losses, worker

pytestmark = pytest.mark.multiproc

MODEL = SMALL_MODEL + ["--train-iters", "6", "--dynmo", "--test-dump-params"]
# Iteration 3: layer 2 goes 0->1, 5-6 go 2->1, 7 goes 3->1 (across two stages), stage 2 empties.
# Iteration 5: 2-3 go back 1->0, 5-6 go 1->2, 7 goes 1->3 (across two stages).
PP4_FORCED = "3:Et|tttttt||tL;5:Ettt|t|tt|ttL"
PP2_FORCED = "3:Etttttt|ttL;5:Et|tttttttL"
# Stage 0 receives layer 5, then layer 6 into the same staging pool while layer 5 trains on
# (state that still pointed into the pool would be overwritten), then stage 1 receives 2-6.
PP2_REUSE = "3:Ettttt|tttL;4:Etttttt|ttL;5:Et|tttttttL"


def _assert_same_training(a_dir, a, b_dir, b, ranks):
    assert len(assert_same_training(a_dir, a, b_dir, b, ranks)) > 8 * 12


def test_pp4_migrations_are_bit_exact(pp4_static, tmp_path):
    report = worker(4, MODEL + ["--pipeline-model-parallel-size", "4",
                                "--dynmo-forced-layouts", PP4_FORCED], tmp_path)
    events = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert [e["applied"] for e in events] == [True, True]
    assert [e["layout_after"] for e in events] == ["Et|tttttt||tL", "Ettt|t|tt|ttL"]
    assert {(m["layer"], m["src"], m["dst"]) for m in events[0]["moves"]} == {
        (2, 0, 1), (5, 2, 1), (6, 2, 1), (7, 3, 1)}
    assert all(m["bytes"] > 0 for m in events[0]["moves"])
    assert events[0]["migration"]["bandwidth_bytes_per_s"] > 0
    assert events[0]["migration"]["staging_pool_bytes"] >= max(m["bytes"] for m in events[0]["moves"])
    assert report["initial_layout"] == "Ett|tt|tt|ttL" and report["layout"] == "Ettt|t|tt|ttL"
    _assert_same_training(pp4_static[0], pp4_static[1], tmp_path, report, range(4))


def test_receiver_failure_keeps_old_layout(pp4_static, tmp_path):
    report = worker(4, MODEL + ["--pipeline-model-parallel-size", "4",
                                "--dynmo-forced-layouts", PP4_FORCED,
                                "--test-fault", "receiver_exception@1"], tmp_path)
    first, second = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert not first["applied"] and "injected receiver failure on stage 1" in first["error"]
    assert first["layout_after"] == first["layout_before"] == "Ett|tt|tt|ttL"
    assert second["applied"]  # the injector fires once; later migrations work
    _assert_same_training(pp4_static[0], pp4_static[1], tmp_path, report, range(4))


def test_corrupted_transfer_is_detected(pp4_static, tmp_path):
    report = worker(4, MODEL + ["--pipeline-model-parallel-size", "4",
                                "--dynmo-forced-layouts", PP4_FORCED.split(";")[0],
                                "--test-fault", "corrupt_buffer@1"], tmp_path)
    (event,) = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert not event["applied"] and "checksum mismatch" in event["error"]
    assert report["layout"] == "Ett|tt|tt|ttL"
    _assert_same_training(pp4_static[0], pp4_static[1], tmp_path, report, range(4))


def test_pp2_dp2_migrations_are_bit_exact(tmp_path_factory):
    """With dropout 0.1: each layer draws its masks from its own streams, keyed by the
    global micro-batch (megatron.training.layer_streams), so a moved layer draws what it
    drew where it was (from the rank's streams, the draws after the move differed)."""
    static_dir, moved_dir = tmp_path_factory.mktemp("dp_static"), tmp_path_factory.mktemp("dp_moved")
    flags = MODEL + ["--pipeline-model-parallel-size", "2", "--hidden-dropout", "0.1"]
    static = worker(4, flags, static_dir)
    moved = worker(4, flags + ["--dynmo-forced-layouts", PP2_REUSE], moved_dir)
    assert [e["applied"] for e in moved["events"]] == [True, True, True]
    pools = [e["migration"]["staging_pool_bytes"] for e in moved["events"]]
    assert 0 < pools[0] == pools[1] < pools[2]  # layer 6 reused layer 5's buffer; 2-6 grew it
    assert moved["world"]["dp"] == 2
    _assert_same_training(static_dir, static, moved_dir, moved, range(4))


def test_pp2_tp2_migrations_are_bit_exact(tmp_path_factory):
    """TP=2 makes stale tensor-parallel group references observable (TP=1 groups never
    talk). Dropout 0.1: both tensor ranks of a layer draw one mask (its output is
    replicated over them), wherever the layer runs."""
    static_dir, moved_dir = tmp_path_factory.mktemp("tp_static"), tmp_path_factory.mktemp("tp_moved")
    flags = MODEL + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                     "--hidden-dropout", "0.1"]
    static = worker(4, flags, static_dir)
    moved = worker(4, flags + ["--dynmo-forced-layouts", PP2_FORCED], moved_dir)
    assert [e["applied"] for e in moved["events"]] == [True, True]
    assert [e["layout_after"] for e in moved["events"]] == ["Etttttt|ttL", "Et|tttttttL"]
    assert moved["layout"] == "Et|tttttttL"
    assert moved["world"]["tp"] == 2
    assert losses(static) == losses(moved)
    for tp_ranks in ([0, 2], [1, 3]):  # Megatron orders TP fastest: ranks r, r+2 share a shard
        a, b = load_params(static_dir, tp_ranks), load_params(moved_dir, tp_ranks)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a)


# ---- the staging pool (in process) ----------------------------------------------------------
def _headers(*layers):
    tensors = {"w": torch.randn(33), "step": torch.tensor(3.0), "x": torch.randn(5).double(),
               "h": torch.randn(7).to(torch.bfloat16)}
    return [pack(n, 0, 1, tensors, torch.device("cpu"))[0] for n in layers], tensors


def test_pool_views_hold_every_buffer_and_are_reused():
    (h3, h4), tensors = _headers(3, 4)
    pool = StagingPool(torch.device("cpu"), release_after=2)
    views = pool.take([h3, h4])
    assert [[(v.dtype, v.numel()) for v in views[n]] for n in (3, 4)] == [
        [(torch.float32, 34), (torch.float64, 5), (torch.bfloat16, 7)]] * 2
    ptrs = [v.data_ptr() for n in (3, 4) for v in views[n]]
    assert len(set(ptrs)) == 6 and all(p % 64 == 0 for p in ptrs)
    _, buffers = pack(3, 0, 1, tensors, torch.device("cpu"))
    for view, buf in zip(views[3], buffers):
        view.copy_(buf)
    assert all(torch.equal(tensors[k], v) for k, v in unpack(h3, views[3]).items())
    held, grown = pool.nbytes, pool.grown
    again = pool.take([h4])  # smaller: no new memory, same pages
    assert pool.nbytes == held and pool.grown == grown and again[4][0].data_ptr() == ptrs[0]
    assert pool.take([]) == {} and pool.nbytes == held  # one idle migration: kept
    assert pool.take([]) == {} and pool.nbytes == 0     # release_after=2 idle ones: released
    big, _ = _headers(5, 6, 7)
    pool.take(big)
    assert pool.nbytes > held and pool.grown == grown + 1
