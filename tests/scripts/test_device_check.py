"""Device handling: --distributed-backend (Megatron's spelling) and more ranks per node
than GPUs, refused with one line and exit 2 before any CUDA call."""
from __future__ import annotations

import pytest
import torch

from dynmo_plugin.config import ConfigError
from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.megatron.training.parallel import resolve_backend
from dynmo_plugin.train import build_parser, main


@pytest.mark.parametrize("requested, gpus, local_ranks, backend", [
    (None, 0, 4, "gloo"), ("gloo", 0, 4, "gloo"),        # CPU: any number of ranks
    (None, 8, 8, "nccl"), ("nccl", 8, 2, "nccl"), (None, 1, 1, "nccl"),
])
def test_backend_fits_the_machine(requested, gpus, local_ranks, backend):
    assert resolve_backend(requested, gpus, local_ranks) == backend


@pytest.mark.parametrize("requested, gpus, local_ranks, message", [
    (None, 1, 2, "2 ranks on this node but 1 CUDA GPU(s) visible"),
    ("nccl", 4, 8, "torchrun --nproc-per-node 4"),
    ("nccl", 0, 1, "nccl needs CUDA GPUs and none is visible"),
    ("gloo", 2, 2, "hide the GPUs (CUDA_VISIBLE_DEVICES=)"),
])
def test_backend_that_cannot_work_is_a_config_error(requested, gpus, local_ranks, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_backend(requested, gpus, local_ranks)


def test_flag_takes_megatrons_two_choices():
    parse = build_parser().parse_args
    assert load_run_config(parse([])).model.distributed_backend is None
    assert load_run_config(parse(["--distributed-backend", "gloo"])).model.distributed_backend == "gloo"
    with pytest.raises(ConfigError, match="distributed_backend: expected one of nccl, gloo, got 'mpi'"):
        load_run_config(parse(["--distributed-backend", "mpi"]))


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_launcher_refuses_nccl_without_gpus(tmp_path, capsys):
    assert main(["--distributed-backend", "nccl", "--output", str(tmp_path)]) == 2
    assert _one_error_line(capsys).startswith("dynmo-train: error: --distributed-backend nccl needs")


def test_launcher_refuses_more_ranks_than_gpus_before_touching_cuda(tmp_path, capsys, monkeypatch):
    """This machine has no GPU: the count is what a 1-GPU node reports, and any CUDA
    call after it (set_device was the raw 'invalid device ordinal' on an H100) fails."""
    def no_cuda_call(*args, **kwargs):
        raise AssertionError("a CUDA call before the device check")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("set_device", "current_device", "is_available", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda_call)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert main(["--output", str(tmp_path)]) == 2
    assert "2 ranks on this node but 1 CUDA GPU(s) visible" in _one_error_line(capsys)


# ---- scripts/device_check.sh: gpu_check.sh + megatron_lm_gpu_check.sh as one device call ----
def _device_check(*argv):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
    return subprocess.run(["bash", str(script), *argv, "--python", sys.executable], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "device_check.sh: error: unknown argument --bogus (see --help)"),
    (["--total-s", "nine"], "device_check.sh: error: --total-s needs a whole number of seconds"),
    (["--total-s", "100"], "device_check.sh: error: --total-s 100 leaves no time for gpu_check.sh (needs > 140)"),
])
def test_device_check_usage_errors_exit_2_with_one_line(argv, message):
    proc = _device_check(*argv)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message]


def test_device_check_plan_is_within_nine_minutes():
    proc = _device_check("--plan")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "device_check.sh, gpu_check.sh --budget-s 400" in lines[0]
    assert lines[3].startswith("install (device_check.sh)") and lines[-2].startswith("megatron_lm_gpu_check.sh")
    total = int(lines[-1].split()[1])
    assert lines[-1] == f"total: {total} s estimated of a 540 s budget" and total <= 540
