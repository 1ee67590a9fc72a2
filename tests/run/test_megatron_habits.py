"""Megatron-LM's habits in `dynmo-train` (issue 36 items 5-6): no abbreviations, an
unknown flag in one line, defaults in --help, Megatron-LM flags honoured or refused in
one line, Megatron-LM's log line, Ctrl-C at an iteration boundary with the resume
command, and a checkpoint of another model refused in one line naming the setting.
Through the documented command (a fresh torchrun), as in tests/run/test_day_one.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_day_one import TINY, _env, assert_refused, lines, torchrun

from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.train import build_parser

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flags,needle", [
    (["--num-layer", "6"], "dynmo-train: error: unrecognized arguments: --num-layer 6"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag (`dynmo-train --help` lists"),
    (["--eval-interval", "10"], "flag --eval-interval: dynmo-train has no evaluation loop"),
    (["--tensorboard-dir", "tb"], "flag --tensorboard-dir: dynmo-train writes no TensorBoard events"),
    (["--num-query-groups", "2"], "flag --num-query-groups: dynmo-train's GPT has multi-head attention only"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "3 must divide --num-layers (2)"),
])
def test_megatron_lm_flags_refused_in_one_line(tmp_path, flags, needle):
    """An unknown flag printed 103 lines of usage; `--num-layer 6` trained 6 layers."""
    assert_refused(torchrun(tmp_path, [*TINY, "--train-iters", "2", *flags]), needle, tmp_path)


def test_honoured_megatron_lm_flags_and_help_defaults():
    cfg = load_run_config(build_parser().parse_args(
        ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "2", "--weight-decay", "0.1"]), world_size=2)
    assert cfg.model.num_virtual_stages_per_pipeline_rank == 2 and cfg.model.weight_decay == 0.1
    text = subprocess.run([sys.executable, "-m", "dynmo_plugin.train", "--help"], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120).stdout
    flat = " ".join(text.split())
    assert "Adam learning rate (default: 0.001)" in flat
    assert "(default: 0.05)" in flat.split("--dynmo-min-gain MIN_GAIN")[-1][:400]


def test_the_log_line_is_megatron_lms(tmp_path):
    """Loss averaged over --log-interval, learning rate, tokens/s, time left."""
    proc = torchrun(tmp_path, [*TINY, "--train-iters", "4", "--log-interval", "2",
                               "--weight-decay", "0.1", "--lr-decay-style", "linear"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [x for x in lines(proc) if " | lm loss " in x]
    assert [int(re.search(r"iteration +(\d+)/4", x).group(1)) for x in logged] == [2, 4], logged
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    losses = [it["loss"] for it in report["iterations"]]
    for line, pair in zip(logged, (losses[:2], losses[2:])):
        assert f"lm loss {sum(pair) / 2:.6E} (avg of 2)" in line, (line, pair)
        assert re.search(r"\| lr \d\.\d{3}E[-+]\d\d \|", line) and "tokens/s " in line
        assert "time left 0:00:" in line
    assert "lr 7.500E-04" in logged[0]  # linear decay: step 2 of 4 applies 1e-3 x (1 - 1/4)


def _stopped_run(tmp_path: Path, flags: list[str], at: int, signum: int) -> tuple[int, str, str]:
    """A long run, then `signum` to torchrun's process group once iteration `at` is logged
    (what Ctrl-C in a terminal does): (exit code, the output before, the output after)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(_port()), "-m", "dynmo_plugin.train", *TINY,
           "--train-iters", "100000", *flags]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        seen.append(line)
        if re.search(rf"iteration +{at}/", line) or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signum)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen), rest


def _one_line(code: int, before: str, rest: str, signum: int) -> str:
    """Besides rank 0's log (iterations, "checkpoint saved"): exactly one line, no traceback."""
    after = [x for x in rest.splitlines() if x.strip() and not x.startswith("[rank0] ")]
    assert code == 128 + signum, before[-500:] + rest[-3000:]
    assert "Traceback" not in rest and len(after) == 1, rest[-3000:]
    return after[0]


def test_ctrl_c_stops_at_an_iteration_boundary_then_another_model_is_refused(tmp_path):
    """Ctrl-C printed ~176 lines, three tracebacks, exit 1. Now: the terminal's SIGINT to
    torchrun's process group; the run saves (--exit-signal-handler), prints one line with
    the last checkpoint and the resume command, and exits 130. Then that checkpoint under
    another --num-layers: one line naming the setting (it was ~50 lines, every rank). A
    profiling window open since iteration 1 is in the report, cancelled at the stop."""
    ck, out = tmp_path / "ck", tmp_path / "run"
    window = ["--dynmo", "--dynmo-profile-every", "1", "--dynmo-profile-window", "1000"]
    line = _one_line(*_stopped_run(tmp_path, [*window, "--save", str(ck), "--exit-signal-handler",
                                              "--output", str(out)], 3, signal.SIGINT), signal.SIGINT)
    stopped = int(re.search(r"stopped by SIGINT after iteration (\d+); last checkpoint ", line).group(1))
    assert line.endswith(f"--output {out} --load {ck}") and "--train-iters 100000" in line
    assert (ck / f"iter_{stopped:07d}" / "meta.json").exists()
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    report = json.loads((out / "report.json").read_text())
    assert report["iterations"][-1]["iteration"] == stopped and report["complete"] is False
    assert [(e["window"], e.get("cancelled")) for e in report["events"]] == [
        ([1, stopped], "the run ended inside the window")]
    # the same checkpoint under another model
    other = [*TINY, "--num-layers", "4", "--train-iters", "2", "--load", str(ck)]
    (tmp_path / "x").mkdir()
    assert_refused(torchrun(tmp_path / "x", other),
                   f"--load {ck}: the checkpoint is of another model: num_layers 2 in the checkpoint",
                   tmp_path / "x")


@settings(max_examples=4, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(signum=st.sampled_from([signal.SIGINT, signal.SIGTERM]), at=st.integers(1, 3),
       save=st.booleans(), dynmo=st.booleans())
def test_signals_stop_at_a_boundary_with_one_line(tmp_path_factory, signum, at, save, dynmo):
    """Fuzz of stops: either signal, at any iteration, with or without a save on signal and
    the plugin. The oracle: exit 128 + signal, one line naming the signal and the iteration
    the report ends at, a checkpoint of exactly that iteration and the resume command when
    saving, else the line saying how to get one."""
    tmp = tmp_path_factory.mktemp("stop")
    ck, out = tmp / "ck", tmp / "run"
    flags = ["--output", str(out)] + (["--save", str(ck), "--exit-signal-handler"] if save else []) + (
        ["--dynmo"] if dynmo else [])
    line = _one_line(*_stopped_run(tmp, flags, at, signum), signum)
    name = signal.Signals(signum).name
    stopped = int(re.search(rf"^dynmo-train: stopped by {name} after iteration (\d+); ", line).group(1))
    report = json.loads((out / "report.json").read_text())
    assert stopped >= at and report["iterations"][-1]["iteration"] == stopped and report["complete"] is False
    if save:
        assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
        assert line.endswith(f"--load {ck}"), line
    else:
        assert "; no checkpoint (give --save DIR --exit-signal-handler" in line and not ck.exists(), line


def _port() -> int:
    from launch import free_port
    return free_port()
