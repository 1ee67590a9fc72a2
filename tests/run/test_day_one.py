"""What a Megatron user meets on day one (issue 36), through the documented command:
`torchrun --nproc-per-node N -m dynmo_plugin.train ...`, a fresh torchrun (its
`dynmo-validate` handler checks the flags before any worker starts).

Each refusal is exactly one line on stdout + stderr, status 2, and nothing trained
(no report.json anywhere under the test's directory).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from launch import free_port, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "2"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}


def torchrun(tmp_path: Path, flags: list[str], nproc: int = 2, output: str | None = None,
             timeout: int = 300) -> subprocess.CompletedProcess:
    """The documented command, from `tmp_path`; --output defaults to tmp_path/run."""
    out = str(tmp_path / "run") if output is None else output
    return run_torchrun(["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                         str(free_port()), "-m", "dynmo_plugin.train", *flags, "--output", out],
                        _env(), timeout, cwd=tmp_path, fresh=True)


def lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]


def assert_refused(proc: subprocess.CompletedProcess, needle: str, tmp_path: Path) -> str:
    out = lines(proc)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(out) == 1 and out[0].startswith("dynmo-train: error: "), out
    assert needle in out[0], out[0]
    assert not [p for p in tmp_path.rglob("report.json*") if p.is_file()], "it trained"
    return out[0]


# ---- item 1: DynMo settings without --dynmo -----------------------------------------------------
def test_a_dynmo_flag_without_dynmo_is_refused_in_one_line(tmp_path):
    """It trained a static run, exit 0, no word (issue 36 item 1)."""
    line = assert_refused(torchrun(tmp_path, ["--pipeline-model-parallel-size", "2",
                                              "--dynmo-rebalance-interval", "2"]),
                          "flag --dynmo-rebalance-interval: rebalance.interval: set, but DynMo is off",
                          tmp_path)
    assert "add --dynmo" in line


def test_a_yaml_without_dynmo_trains_the_static_baseline_and_says_so(tmp_path):
    """The same file serves the DynMo run and its static baseline: it trains, with one
    notice naming the file, the sections and --dynmo."""
    config = tmp_path / "c.yaml"
    config.write_text("model: {train_iters: 1}\nrebalance: {interval: 2}\nprofiling: {window: 1}\n")
    proc = torchrun(tmp_path, [*TINY, "--dynmo-config", str(config)], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [x for x in lines(proc) if x.startswith("dynmo-train: warning:")]
    assert len(notes) == 1, lines(proc)
    assert f"{config}: profiling, rebalance set, but --dynmo is not given" in notes[0]
    assert "static baseline" in notes[0]
    assert (tmp_path / "run" / "report.json").exists()


def test_megatrons_default_gradient_clipping_trains_on_cpu(tmp_path):
    """--clip-grad 1.0, Megatron-LM's default and the first value a Megatron user brings:
    Megatron's clip_grads asserts CUDA gradient types, which the CPU compatibility layer
    now answers as it does for the optimizer (it was refused: by every worker after its
    model was built, then before any worker started). The norms here are above 1, so the
    clipped run's losses part from the unclipped one's after the first step."""
    runs = {}
    for clip in ("1.0", "0"):
        (tmp_path / clip).mkdir()
        proc = torchrun(tmp_path / clip, [*TINY, "--train-iters", "3", "--clip-grad", clip])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[clip] = ([x for x in lines(proc) if "iteration " in x],
                      [it["loss"] for it in json.loads((tmp_path / clip / "run" / "report.json").read_text())[
                          "iterations"]])
    assert all("| grad norm " in x for x in runs["1.0"][0]) and not any("grad norm" in x for x in runs["0"][0])
    clipped, plain = runs["1.0"][1], runs["0"][1]
    assert clipped[0] == plain[0] and clipped[1:] != plain[1:]


# ---- items 2 and 3: paths and nonsense, before any training ---------------------------------------
@pytest.mark.parametrize("case", ["output under a file", "save under a file", "empty output",
                                  "report.json a directory", "start past the run",
                                  "unreachable min gain", "empty yaml"])
def test_refused_before_training(tmp_path, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    flags, output, needle = [], None, ""
    if case == "output under a file":
        output, needle = str(blocker / "run"), f"flag --output: model.output: cannot write to '{blocker}/run'"
    elif case == "save under a file":
        flags, needle = ["--save", str(blocker / "ck")], f"{blocker} is a file, so nothing can be created"
    elif case == "empty output":
        output, needle = "", "flag --output: model.output: cannot write to '': an empty path"
    elif case == "report.json a directory":
        (tmp_path / "run" / "report.json").mkdir(parents=True)
        needle = "report.json is a directory"
    elif case == "start past the run":
        flags = ["--dynmo", "--pipeline-model-parallel-size", "2", "--dynmo-start-balanced-at", "30"]
        needle = "flag --dynmo-start-balanced-at: profiling.start_at (30) + window (1) ends past --train-iters (2)"
    elif case == "unreachable min gain":
        flags = ["--dynmo", "--pipeline-model-parallel-size", "2", "--dynmo-min-gain", "1.5"]
        needle = "flag --dynmo-min-gain: rebalance.min_gain: expected a number in [0, 1), got 1.5"
    elif case == "empty yaml":
        (tmp_path / "e.yaml").write_text("# nothing yet\n")
        flags, needle = ["--dynmo-config", str(tmp_path / "e.yaml")], "the config file holds no settings"
    # TINY, 2 iterations: where the check is missing it trains, briefly
    assert_refused(torchrun(tmp_path, [*TINY, "--train-iters", "2", *flags], output=output),
                   needle, tmp_path)
