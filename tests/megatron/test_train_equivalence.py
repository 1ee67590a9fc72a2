"""Pipeline runs of any shape train exactly like one process on the same data."""
import pytest

from launch import losses, train

pytestmark = pytest.mark.multiproc

MODEL = ["--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "4", "--lr", "3e-3", "--seed", "7"]


UNEVEN = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttttL"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return losses(train(1, MODEL, tmp_path_factory.mktemp("pp1")))


@pytest.mark.parametrize("nproc,extra", [
    (2, ["--pipeline-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "4"]),
    (2, UNEVEN),
    (4, ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Ettt||ttt|L"]),
    (4, ["--pipeline-model-parallel-size", "2"]),  # PP=2 x DP=2
], ids=["pp2", "pp4", "pp2-uneven", "pp4-empty-stages", "pp2xdp2"])
def test_pipeline_losses_equal_single_process(reference, shared_run, nproc, extra):
    _, report = shared_run(nproc, MODEL + extra, module="dynmo_plugin.train")
    got = losses(report)
    assert len(got) == len(reference) == 4
    for a, b in zip(got, reference):
        assert a == pytest.approx(b, rel=1e-5)
    assert report["world"]["pp"] * report["world"]["dp"] == nproc


def test_report_shape(shared_run):
    """Read from the pp2-uneven run above (one launch for both)."""
    _, report = shared_run(2, MODEL + UNEVEN, module="dynmo_plugin.train")
    assert report["layout"] == report["initial_layout"] == "Et|tttttL"
    assert report["world"] == {"pp": 2, "tp": 1, "dp": 1, "world_size": 2, "backend": "gloo",
                               "history": [{"iteration": 0, "pp": 2, "tp": 1, "dp": 1,
                                            "world_size": 2}]}
    assert report["config"]["model"]["num_layers"] == 6
    assert [it["iteration"] for it in report["iterations"]] == [1, 2, 3, 4]
    assert all(it["time_s"] > 0 for it in report["iterations"])


def test_model_learns_synthetic_data(tmp_path):
    got = losses(train(1, MODEL[:-6] + ["--train-iters", "30", "--lr", "1e-2", "--seed", "7"], tmp_path))
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.1  # deterministic: seeded data and init
