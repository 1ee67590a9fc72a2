"""scripts/megatron_lm_gpu_check.sh's --deadline-s (scripts/device_check.sh passes what its
total leaves): a run is cut to what is left, one that would get under DYNMO_MLM_MIN_RUN_S
is not started, and a run the deadline stopped ends the script with 124 (the caller's
budget) or 1 where a check had already failed.

The script's runs need CUDA (Megatron-LM's pretrain() asserts it), so a run that outlives
its deadline cannot be produced on CPU: the interpreter given with --python is a named
stand-in (fault injection) that answers the script's probes, makes the first run's
checkpoint folder and sleeps where pretrain_gpt.py would train. The checks after a run
are the script's own, on what the stand-in wrote (nothing: they fail)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_lm_gpu_check.sh"
STAND_IN = """#!/bin/bash
# stand-in interpreter for megatron_lm_gpu_check.sh (tests/scripts/test_megatron_lm_gpu_check.py)
case "$1" in
  -c) exit 0 ;;  # the CUDA, dynmo_plugin and package probes
  -) cat >/dev/null; exit 1 ;;  # a check on the run's files: there are none
  -m) [[ -z ${STAND_IN_RUNS_FAIL:-} ]] || exit 1
      args=("$@"); save=""; half=""
      for ((i = 0; i < ${#args[@]}; i++)); do
        [[ ${args[i]} == --save ]] && save="${args[i+1]}"
        [[ ${args[i]} == --save-interval ]] && half="${args[i+1]}"
      done
      if [[ -n $save ]]; then
        mkdir -p "$save/iter_$(printf %07d "$half")"
        [[ -n ${STAND_IN_FIRST_RUN_HANGS:-} ]] || exit 0
      fi
      exec sleep 120 ;;  # training that outlives any deadline the tests give
esac
exit 3
"""


def _run(tmp_path, deadline_s: int, first_run_hangs: bool, runs_fail: bool = False):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    source = tmp_path / "megatron-lm"
    source.mkdir()
    (source / "pretrain_gpt.py").write_text("")
    env = {**os.environ, "DYNMO_MLM_MIN_RUN_S": "5", **({"STAND_IN_FIRST_RUN_HANGS": "1"} if first_run_hangs else {}),
           **({"STAND_IN_RUNS_FAIL": "1"} if runs_fail else {})}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), str(source), "--python", str(stand_in), "--no-install",
                           "--out", str(tmp_path / "out"), "--deadline-s", str(deadline_s)],
                          env=env, capture_output=True, text=True, timeout=90)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("first_run_hangs, exit_code, line", [
    (True, 124, "stopped at the deadline after"),       # the budget, not a failure
    (False, 1, "stopped at the deadline after"),        # the first run's check had failed
])
def test_a_run_the_deadline_stops_ends_the_script_within_it(tmp_path, first_run_hangs, exit_code, line):
    proc, took = _run(tmp_path, 18, first_run_hangs)
    assert proc.returncode == exit_code, proc.stderr[-2000:]
    assert line in proc.stderr and took < 18, (took, proc.stderr[-2000:])
    assert ("1/3" in proc.stderr) and (("2/3" in proc.stderr) != first_run_hangs)


def test_a_run_that_would_get_less_than_the_minimum_is_not_started(tmp_path):
    proc, took = _run(tmp_path, 14, True)  # 14 - 10 s for the kill and checks: 4 s < 5
    assert proc.returncode == 124 and took < 5, (took, proc.stderr[-2000:])
    assert "no time left for" in proc.stderr and not (tmp_path / "out" / "ckpt").exists()


def test_a_failed_run_does_not_stop_the_runs_after_it(tmp_path):
    """One device call is all there is: the MoE run (3/3) is tried after 1/3 failed; 2/3,
    which resumes 1/3's checkpoint, is not run without it."""
    proc, _ = _run(tmp_path, 60, False, runs_fail=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.count("the run failed (exit 1)") == 2
    assert "2/3 not run" in proc.stderr and "3/3 Megatron-LM's own MoE" in proc.stderr
