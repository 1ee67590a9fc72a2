"""Bad input to the documented launcher ends in one line, under torchrun too.

torchrun raises ChildFailedError (a traceback) for any failed worker, so the flags are
checked in torchrun itself before it spawns one (dynmo_plugin.torchrun_check, the
`torchrun.handlers` entry point). These tests run the real torchrun and count lines.
"""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from dynmo_plugin.torchrun_check import training_argv, world_size
from dynmo_plugin.train import main

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "dynmo-validate = dynmo_plugin.torchrun_check:handler"


def _env(tmp_path: Path) -> dict:
    """The test tree first on the path, and the entry point declared even where the
    installed package metadata predates it (an editable install made before it)."""
    paths = [str(ROOT)]
    installed = [e for e in metadata.entry_points(group="torchrun.handlers") if e.name == "dynmo-validate"]
    if not installed:
        info = tmp_path / "ep" / "dynmo_validate_hook-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dynmo-validate-hook\nVersion: 0\n")
        (info / "entry_points.txt").write_text(f"[torchrun.handlers]\n{ENTRY}\n")
        paths.insert(0, str(tmp_path / "ep"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}


def _torchrun() -> str:
    script = Path(sys.executable).with_name("torchrun")
    return str(script) if script.exists() else "torchrun"


def test_entry_point_is_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert ENTRY in cfg["options.entry_points"]["torchrun.handlers"]


@pytest.mark.parametrize("flags,needle", [
    (["--seq-length", "32", "--max-position-embeddings", "8"], "model.seq_length (32) exceeds"),
    (["--pipeline-model-parallel-size", "3"], "world size 2 is not a multiple"),
])
def test_torchrun_prints_one_line_and_no_traceback(tmp_path, flags, needle):
    """The documented command with a bad input: one line in all of stdout + stderr."""
    from launch import run_group
    proc = run_group([_torchrun(), "--nproc-per-node", "2", "-m", "dynmo_plugin.train", *flags,
                      "--output", str(tmp_path / "run")], tmp_path, _env(tmp_path), timeout=300)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("dynmo-train: error: ") and needle in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_without_torchrun_one_line_before_megatron_is_imported(tmp_path):
    """`python -m dynmo_plugin.train` alone: one line saying how to launch; -X importtime
    shows that megatron was never imported (it was a 30 s, 29-line traceback)."""
    env = _env(tmp_path)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dynmo_plugin.train",
                           "--output", str(tmp_path / "run")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    imports = [x for x in proc.stderr.splitlines() if x.startswith("import time:")]
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("import time:")]
    assert proc.returncode == 2
    assert len(lines) == 1 and "torchrun --nproc-per-node N -m dynmo_plugin.train" in lines[0], lines
    assert not [x for x in imports if x.split("|")[-1].strip().split(".")[0] == "megatron"]


def test_ranks_other_than_0_stay_silent(tmp_path, capsys, monkeypatch):
    """Without the entry point (an old install), each worker finds the error: only rank
    0 prints it."""
    monkeypatch.setenv("RANK", "1")
    assert main(["--lr", "inf", "--output", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["--lr", "inf", "--output", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("dynmo-train: error: flag --lr: model.lr: expected a "
                                               "finite number, got inf")


def test_torchrun_command_lines_are_recognised():
    assert training_argv(["/x/torchrun", "--nproc-per-node=4", "-m", "dynmo_plugin.train", "--lr", "1"]) == (
        ["--nproc-per-node=4", "-m"], ["--lr", "1"])
    assert training_argv(["/x/torchrun", "-m", "other.train", "dynmo_plugin.train"]) is None
    assert training_argv(["/x/pytest", "-m", "dynmo_plugin.train"]) is None
    assert training_argv(["/t/torch/distributed/run.py", "--no-python", "dynmo-train", "--a"])[1] == ["--a"]
    assert world_size(["--nproc-per-node", "4", "--nnodes", "2"]) == 8
    assert world_size(["--nproc_per_node=gpu"]) is None
    assert world_size(["--nproc-per-node", "2", "--nnodes", "1:4"]) is None


def test_a_fault_in_the_check_itself_is_left_to_the_workers(monkeypatch):
    """Fault injected (validate raising something other than bad input cannot be produced
    from flags): torchrun's registry would log it as a failed handler; the handler
    leaves it to the workers, which run the same check and report it."""
    import dynmo_plugin.train as train
    from dynmo_plugin import torchrun_check

    monkeypatch.setattr(sys, "argv", ["/x/torchrun", "--nproc-per-node", "2", "-m", "dynmo_plugin.train"])
    monkeypatch.setattr(torchrun_check, "_quiet_endings", lambda: None)

    def broken(*args, **kwargs):
        raise RuntimeError("a fault in validate")
    monkeypatch.setattr(train, "validate", broken)
    backend = torchrun_check.handler()
    with pytest.raises(ValueError, match="dynmo-validate is not a rendezvous backend"):
        backend(None)


def test_an_error_every_rank_agreed_on_is_printed_by_rank_0_alone(tmp_path, capsys, monkeypatch):
    """Found by the workers after the start (a checkpoint's damaged shards): where every
    rank holds every rank's cause (`UserError.agreed`) rank 0 alone prints it; a rank's
    own problem (its GPU) each rank prints. Fault injected: the run raises at once."""
    import dynmo_plugin.train as train
    from dynmo_plugin.errors import UserError

    def failing(agreed: bool):
        def run(*args, **kwargs):
            error = UserError("ranks 0, 1: damaged")
            error.agreed = agreed
            raise error
        return run
    for rank, agreed, printed in (("1", True, False), ("0", True, True), ("1", False, True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(train, "exit_on_peer_failure", failing(agreed))
        assert main(["--output", str(tmp_path / rank)]) == 2
        err = capsys.readouterr().err
        assert (err == "dynmo-train: error: ranks 0, 1: damaged\n") is printed, (rank, agreed, err)
