"""Checkpoints (Megatron dist_checkpointing) resume under any layout and pipeline size.

One PP=2 run under `Ettt|tttL`, layers 2 and 5 frozen, saves every 2 iterations and is
rebalanced by a forced migration before iteration 4. Resumed runs must continue it
exactly: same losses to the last bit, and the same final checkpoint — weights AND
optimizer state (Adam moments, step), compared key by key in Megatron's global keys,
which do not depend on the split. The frozen layers come back frozen from the checkpoint
(the resumed runs are not told), and their optimizer state is saved as zeros: a save
with frozen parameters once hung, Megatron's sharding check failing on rank 0 only.

Interleaved pipelines (two more runs): the plain run's iteration-2 checkpoint resumed
under pp=2 x v=2 (migrated there, saving), whose iteration-4 checkpoint is resumed
under pp=4; both end with the plain run's losses and final checkpoint.
"""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from launch import ROOT, free_port, in_megatron_process, losses, run_torchrun, worker

MODEL = ["--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--save-interval", "2",
         # no RNG state is saved: the layers' and the embedding's dropout draw from streams
         # keyed by iteration and micro-batch (layer_streams), wherever and whenever they run
         "--hidden-dropout", "0.1"]
REBALANCED = "Ett|ttttL"
INTERLEAVED = "Et|tt|tt|tL"  # pp=2 x v=2: rank 0 holds layers 1 and 4-5, rank 1 2-3 and 6


def _only(src, iteration: int, dst):
    """A checkpoint root holding only `src`'s iteration `iteration` (copied)."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(src / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _final_state(root) -> dict:
    """Every tensor of the run's last checkpoint, by global key."""
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import read_tensors
    return read_tensors(str(root / "iter_0000006"))


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert {k.split(".")[2] for k in a if k.startswith("optimizer.state.")} == {
        "exp_avg", "exp_avg_sq", "common_step"}
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    frozen_rows = a["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"][[1, 4]]
    assert not frozen_rows.any()  # the placeholder of frozen layers 2 and 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """PP=2 under Ettt|tttL, rebalanced to Ett|ttttL before iteration 4; checkpoints
    at 2 (old layout), 4 (rebalanced) and 6."""
    out = tmp_path_factory.mktemp("saved")
    report = worker(2, MODEL + ["--pipeline-model-parallel-size", "2",
                                "--pipeline-model-parallel-layout", "Ettt|tttL", "--dynmo",
                                "--dynmo-forced-layouts", f"4:{REBALANCED}",
                                "--test-freeze-layers", "2,5", "--save", str(out / "ckpt")], out)
    return out, report, _final_state(out / "ckpt")


def _resume(tmp_path, saved, iteration: int, nproc: int, flags: list, src=None,
            save_interval: int = 6) -> tuple[dict, dict]:
    """Resume `src` (default: the saved run's checkpoints) at `iteration`; the losses and
    the final checkpoint must be the uninterrupted saved run's."""
    out, report, final = saved
    root = _only(src or out / "ckpt", iteration, tmp_path / "load")
    resumed = worker(nproc, MODEL + flags + ["--load", str(root), "--save", str(tmp_path / "ckpt"),
                                             "--save-interval", str(save_interval)], tmp_path)
    assert [it["iteration"] for it in resumed["iterations"]] == list(range(iteration + 1, 7))
    assert losses(resumed) == losses(report)[iteration:]
    _assert_same_state(_final_state(tmp_path / "ckpt"), final)
    return report, resumed


@pytest.mark.multiproc
def test_saved_layout_and_rebalanced_layout_are_recorded(saved):
    out, report, _ = saved
    assert [e["layout_after"] for e in report["events"] if e.get("applied")] == [REBALANCED]
    metas = [json.loads((out / f"ckpt/iter_{i:07d}/meta.json").read_text()) for i in (2, 4)]
    assert [(m["iteration"], m["layout"], m["pp"]) for m in metas] == [
        (2, "Ettt|tttL", 2), (4, REBALANCED, 2)]
    assert metas[0]["scheduler"] == {"num_steps": 2}
    assert {name.split(".")[2] for name in metas[0]["frozen"]} == {"1", "4"}  # layers 2, 5
    assert all(name.startswith("decoder.layers.") for name in metas[0]["frozen"])
    assert (out / "ckpt/latest_checkpointed_iteration.txt").read_text() == "6"
    assert not list((out / "ckpt").glob("*.tmp"))


@pytest.mark.multiproc
def test_resume_under_pp4(saved, tmp_path):
    """Saved by 2 stages under Ettt|tttL, resumed by 4 (Megatron's uniform split)."""
    _, resumed = _resume(tmp_path, saved, 2, 4, ["--pipeline-model-parallel-size", "4"])
    assert resumed["initial_layout"] == "Ett|tt|t|tL"


@pytest.mark.multiproc
def test_resume_under_another_pp2_layout(saved, tmp_path):
    """Saved under Ettt|tttL, resumed under the layout the flag gives (the flag wins)."""
    _, resumed = _resume(tmp_path, saved, 2, 2, ["--pipeline-model-parallel-size", "2",
                                                 "--pipeline-model-parallel-layout", "Ettttt|tL"])
    assert resumed["initial_layout"] == "Ettttt|tL"


@pytest.mark.multiproc
def test_rebalanced_run_resumes_balanced(saved, tmp_path):
    """Saved after the migration: decoder layers of other stages' numbers were on each
    stage. Resumed without a layout flag, the saved (rebalanced) layout is restored. It
    saves every 4 iterations and ends at 6: the last iteration is saved too, as
    Megatron-LM's pretrain() does (only a multiple of the interval was: no iteration 6
    to compare with the uninterrupted run's)."""
    _, resumed = _resume(tmp_path, saved, 4, 2, ["--pipeline-model-parallel-size", "2"], save_interval=4)
    assert resumed["initial_layout"] == REBALANCED
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["iter_0000006",
                                                                      "latest_checkpointed_iteration.txt"]


@pytest.fixture(scope="module")
def interleaved(saved, tmp_path_factory):
    """The plain (v=1) checkpoint of iteration 2 resumed under pp=2 x v=2: its 2-stage
    layout does not fit 4 virtual stages, so the run starts from the uniform split; forced
    to INTERLEAVED before iteration 4 (frozen layer 2 crosses ranks, layer 4 lands in
    chunk 1 of rank 0); saves at 4 and 6. Interleaved training is bit-identical to 1F1B,
    so the uninterrupted plain run is its reference."""
    out = tmp_path_factory.mktemp("interleaved")
    _, resumed = _resume(out, saved, 2, 2, ["--pipeline-model-parallel-size", "2",
                                            "--num-virtual-stages-per-pipeline-rank", "2", "--dynmo",
                                            "--dynmo-forced-layouts", f"4:{INTERLEAVED}"],
                         save_interval=2)
    return out, resumed


@pytest.mark.multiproc
def test_plain_checkpoint_resumes_interleaved(saved, interleaved):
    """Losses and final weights/optimizer state checked by the fixture; here the layouts
    and what the interleaved checkpoint records."""
    out, resumed = interleaved
    assert resumed["initial_layout"] == "Ett|tt|t|tL"
    assert [e["layout_after"] for e in resumed["events"] if e.get("applied")] == [INTERLEAVED]
    meta = json.loads((out / "ckpt/iter_0000004/meta.json").read_text())
    saved_meta = json.loads((saved[0] / "ckpt/iter_0000004/meta.json").read_text())
    assert (meta["layout"], meta["pp"], meta["vp"]) == (INTERLEAVED, 2, 2)
    assert meta["frozen"] == saved_meta["frozen"]  # layer 2 in chunk 0, layer 5 in chunk 1


@pytest.mark.multiproc
def test_interleaved_checkpoint_resumes_under_pp4(saved, interleaved, tmp_path):
    """Saved by pp=2 x v=2 after a migration, resumed by pp=4 x v=1: the saved layout has
    the 4 stages this run has, so it is restored (virtual stages become ranks)."""
    _, resumed = _resume(tmp_path, saved, 4, 4, ["--pipeline-model-parallel-size", "4"],
                         src=interleaved[0] / "ckpt")
    assert resumed["initial_layout"] == INTERLEAVED


@pytest.mark.multiproc
def test_corrupt_checkpoint_exits_2_with_one_line(saved, tmp_path):
    """Damaged shards, which only the workers find, under the documented command (a fresh
    torchrun, 2 ranks): one line, rank 0's, naming each cause once and the fix, and
    status 2. Each rank printed the same line, then torchrun's ChildFailedError traceback
    followed, status 1."""
    root = _only(saved[0] / "ckpt", 2, tmp_path / "load")
    for data in (root / "iter_0000002").glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])
    args = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "dynmo_plugin.train", *MODEL, "--pipeline-model-parallel-size", "2", "--load", str(root),
            "--output", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = run_torchrun(args, env, timeout=300, fresh=True)
    lines = [line for line in proc.stderr.splitlines() if "rror" in line or "Traceback" in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"dynmo-train: error: {root / 'iter_0000002'}: cannot load ("
                                                   "ranks 0, 1: "), lines
    assert lines[0].endswith("--load another checkpoint directory, or write an earlier saved iteration into "
                             "its latest_checkpointed_iteration.txt")


# ---- no processes: reading the directory, and which layout a resumed run takes ----------

def _meta_dir(tmp_path, **meta):
    from dynmo_plugin.megatron.checkpoint.directory import FORMAT
    d = tmp_path / "iter_0000003"
    d.mkdir(parents=True)
    for name in ("metadata.json", "common.pt", ".metadata"):
        (d / name).write_text("x")
    (d / "meta.json").write_text(json.dumps({"format": FORMAT, "iteration": 3, **meta}))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    return d


def test_read_meta_names_what_is_missing_or_broken(tmp_path):
    from dynmo_plugin.megatron.checkpoint.directory import CheckpointError, read_meta
    from dynmo_plugin.errors import UserError
    assert issubclass(CheckpointError, UserError)  # the launcher's exit 2
    with pytest.raises(CheckpointError, match=r"the directory does not exist; give a directory"):
        read_meta(str(tmp_path / "nowhere"))
    assert read_meta(str(tmp_path / "nowhere"), resume_if_absent=True) is None
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no latest_checkpointed"):
        read_meta(str(tmp_path))
    d = _meta_dir(tmp_path, layout="Et|tL")
    assert read_meta(str(tmp_path))["layout"] == "Et|tL"
    (d / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000003: \.metadata missing; the checkpoint is incomplete"):
        read_meta(str(tmp_path))
    (d / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"meta.json: unreadable"):
        read_meta(str(tmp_path))
    (d / "meta.json").write_text(json.dumps({"format": "dynmo-stage-state/1"}))
    with pytest.raises(CheckpointError, match=r"format 'dynmo-stage-state/1', expected 'dynmo-dist-ckpt/1'"):
        read_meta(str(tmp_path))
    (d / "meta.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"meta.json: holds list, not the checkpoint's record"):
        read_meta(str(tmp_path))
    # torchrun's own process reads it too (plain JSON and names): one line, before any worker
    from dynmo_plugin.train import build_parser, validate
    with pytest.raises(CheckpointError, match=r"meta.json: holds list"):
        validate(build_parser().parse_args(["--load", str(tmp_path)]), 2, in_launcher=True)


def test_layout_precedence():
    """Flag > the layout a checkpoint repack chose for this PP > the saved layout if it
    has pp x v stages > Megatron's uniform split."""
    from dynmo_plugin.session import _initial_layout
    meta = {"pp": 2, "layout": REBALANCED, "next": {"pp": 1, "layout": "EttttttL"}}

    def layout(pp, flag=None, m=meta, v=1):
        args = SimpleNamespace(pipeline_model_parallel_layout=flag, num_layers=6,
                               num_virtual_stages_per_pipeline_rank=v)
        chosen = _initial_layout(args, SimpleNamespace(pp=pp), m)
        assert chosen.num_chunks == v
        return str(chosen)

    assert layout(2, flag="Etttt|ttL") == "Etttt|ttL"
    assert layout(1) == "EttttttL"
    assert layout(2) == REBALANCED
    assert layout(2, m=None) == "Ettt|tttL" and layout(4) == "Ett|tt|t|tL"
    # interleaved: a layout fits when it has pp x v stages, whatever pp and v saved it
    assert layout(2, v=2) == "Ett|tt|t|tL"  # REBALANCED has 2 stages, not 4: uniform
    assert layout(2, v=2, flag="Ettt|t|t|tL") == "Ettt|t|t|tL"
    il = {"pp": 2, "vp": 2, "layout": INTERLEAVED}
    assert layout(2, v=2, m=il) == layout(4, m=il) == INTERLEAVED
    assert layout(2, m=il) == "Ettt|tttL"  # 4 stages do not fit pp=2 x v=1: uniform


def _check_distopt_step(args):
    """Two trainers on one gloo rank: one trains 2 iterations and saves, the other loads;
    both train iterations 3-4."""
    import tempfile

    from megatron.core.process_groups_config import ProcessGroupCollection

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import check_sharding, load_sharded, save_sharded, sharded_state
    from dynmo_plugin.megatron.training.parallel import ParallelDims
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    dims = ParallelDims(rank=0, world_size=1, tp=1, pp=1, dp=1, pp_rank=0, dp_rank=0,
                        device=torch.device("cpu"), groups=ProcessGroupCollection.use_mpu_process_groups())
    saved, resumed = (StageTrainer(args, dims, Layout.uniform(args.num_layers, 1)) for _ in range(2))
    for it in (1, 2):
        saved.train_step(it)
    with tempfile.TemporaryDirectory() as d:
        state = sharded_state(saved, loading=False)
        check_sharding(state, False)
        save_sharded(state, d)
        load_sharded(resumed, sharded_state(resumed, loading=True), d)
    resumed.scheduler.num_steps = saved.scheduler.num_steps
    resumed.scheduler.step(increment=0)
    assert [resumed.train_step(it) for it in (3, 4)] == [saved.train_step(it) for it in (3, 4)]


def test_distributed_optimizer_resumes_with_one_adam_step_per_parameter():
    """Megatron's distributed optimizer (no Apex/TE) loads Adam's step as ONE tensor shared
    by every parameter, which torch Adam increments once per parameter: the second resumed
    iteration's bias correction was wrong (one process, no torchrun)."""
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_distopt_step, ModelArgs(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
        global_batch_size=4, lr=3e-3, use_distributed_optimizer=True))


class _OneRank:
    """Stand-in, named as such, for the control plane of a one-rank run: what `agree`
    answers when this rank is the only one (its own error, as `_by_cause` joins it)."""

    @staticmethod
    def agree(error, phase):
        return (error is None, None if error is None else f"rank 0: {error}")


def test_a_load_that_fails_for_the_files_is_bad_input_and_any_other_failure_a_fault():
    """Damaged or foreign files are bad input with the fix (exit 2); a fault of the code or
    the machine (an AttributeError of a rebuilt stage, an out-of-memory) stays one: it read
    'its files are damaged ... --load another checkpoint directory' (review 22c)."""
    from dynmo_plugin.megatron.checkpoint.directory import CheckpointError, _agreed_steps

    def fails(e):
        def step():
            raise e
        return step
    for cause in (EOFError(), FileNotFoundError(2, "No such file"), KeyError("decoder.layers.3")):
        with pytest.raises(CheckpointError, match="cannot load .* fix it"):
            _agreed_steps(_OneRank, [("checkpoint-loaded", fails(cause))], "X: cannot load", "; fix it")
    for cause in (AttributeError("'NoneType' object has no attribute 'main_grad'"),
                  RuntimeError("CUDA out of memory")):
        with pytest.raises(RuntimeError, match=r"X: cannot load \(rank 0: \(a fault, not the files\) ") as e:
            _agreed_steps(_OneRank, [("checkpoint-loaded", fails(cause))], "X: cannot load", "; fix it")
        assert not isinstance(e.value, CheckpointError) and "fix it" not in str(e.value)
