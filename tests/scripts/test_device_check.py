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
def _device_check(*argv, after=()):
    """device_check.sh ARGV --python THIS [-- AFTER] (AFTER: gpu_check.py's flags)."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
    return subprocess.run(["bash", str(script), *argv, "--python", sys.executable, *(("--", *after) if after else ())],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "device_check.sh: error: unknown argument --bogus (see --help)"),
    (["--total-s", "nine"], "device_check.sh: error: --total-s needs a whole number of seconds"),
    (["--total-s", "100"], "device_check.sh: error: --total-s 100 leaves no time for gpu_check.sh (needs > 180)"),
])
def test_device_check_usage_errors_exit_2_with_one_line(argv, message):
    proc = _device_check(*argv)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message]


def test_device_check_plan_is_within_nine_minutes():
    proc = _device_check("--plan")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "device_check.sh, gpu_check.sh --budget-s 360" in lines[0]
    assert lines[3].startswith("install (device_check.sh)") and lines[-2].startswith("megatron_lm_gpu_check.sh")
    total = int(lines[-1].split()[1])
    second = sum(int(x.split("|")[2]) for x in lines  # gpu_check_plan.SECOND_CALL's groups
                 if x.startswith(("scenario_cost[", "bf16_vs_fp32_speed ")))
    assert lines[-1].startswith(f"total: {total} s estimated of a 540 s budget") and total - second <= 540


def test_device_check_plan_of_issue34s_set_is_within_seven_minutes():
    """`--plan -- --set issue34`: the plan of that call, every group of it printed with its
    seconds, at most ~420 s (the constants' estimate) of the 540 s call."""
    proc = _device_check("--plan", after=("--set", "issue34"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "--only machine,packages,precision_flag,shape,mlm,throughput" in lines[0]
    groups = {x.split("|")[0].strip(): int(x.split("|")[2]) for x in lines[3:-1]}
    assert list(groups) == ["install (device_check.sh)", "start", "shape[host]", "shape[gpu]", "mlm[host]",
                            "mlm[gpu]", "megatron_lm_gpu_check.sh"]
    total = int(lines[-1].split()[1])
    assert lines[-1] == f"total: {total} s estimated of a 540 s budget" and total <= 420


# ---- everything comes back: one archive of every log and report (issue 34) ----
def _pack_module():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_pack.py"
    spec = importlib.util.spec_from_file_location("gpu_check_pack", path)
    module = importlib.util.module_from_spec(spec)
    import sys
    sys.modules["gpu_check_pack"] = module
    spec.loader.exec_module(module)
    return module


def _members(archive) -> dict:
    import tarfile
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_pack_keeps_logs_cuts_huge_ones_excludes_checkpoints_and_drops_the_biggest_to_fit(tmp_path):
    pack = _pack_module()
    root = tmp_path / "gpu_check"
    (root / "shape_host").mkdir(parents=True)
    (root / "shape_host" / "stderr.log").write_text("line\n" * 100)
    (root / "shape_host" / "report.json").write_text('{"events": []}')
    (root / "ckpt" / "iter_0000010").mkdir(parents=True)
    (root / "ckpt" / "iter_0000010" / "common.pt").write_bytes(b"x" * 10)
    (root / "static_fp32").mkdir()
    (root / "static_fp32" / "params_rank0.pt").write_bytes(b"\0" * (2 << 20))   # a big dump
    (root / "static_fp32" / "params_rank1.pt").write_bytes(b"\0" * 1000)        # a small one stays
    huge = bytes(range(256)) * (12 << 10)                                         # 3 MiB, cap 1 MiB
    (root / "worker.log").write_bytes(huge)
    entries = {e.name: e.status for e in pack.pack(tmp_path / "logs.tar.gz", [root, tmp_path / "absent"],
                                                      cap=1 << 20)}
    assert entries["gpu_check/ckpt/iter_0000010/common.pt"] == "excluded: checkpoint"
    assert entries["gpu_check/static_fp32/params_rank0.pt"] == "excluded: checkpoint"
    assert entries["gpu_check/static_fp32/params_rank1.pt"] == "kept"
    assert entries["gpu_check/worker.log"].startswith("truncated to 1048576 of 3145728")
    members = _members(tmp_path / "logs.tar.gz")
    assert members["gpu_check/shape_host/stderr.log"] == b"line\n" * 100
    assert members["gpu_check/worker.log"].startswith(huge[:1000]) and b"cut 2097152 bytes" in members[
        "gpu_check/worker.log"]
    assert "gpu_check/ckpt/iter_0000010/common.pt  excluded: checkpoint" in members["MANIFEST.txt"].decode()
    # over the limit: the biggest files go first, each named in the manifest
    random_bytes = __import__("os").urandom(300_000)  # incompressible
    (root / "big.log").write_bytes(random_bytes)
    entries = {e.name: e.status for e in pack.pack(tmp_path / "small.tar.gz", [root], limit=200_000)}
    assert entries["gpu_check/big.log"] == "dropped: over the archive limit"
    assert entries["gpu_check/shape_host/stderr.log"] == "kept"
    assert (tmp_path / "small.tar.gz").stat().st_size <= 200_000
    assert "big.log  dropped: over the archive limit" in _members(tmp_path / "small.tar.gz")["MANIFEST.txt"].decode()


def test_pack_survives_files_removed_while_it_packs_and_replaces_the_archive_whole(tmp_path):
    """device_check.sh packs after each part, maybe while a killed run's save is still
    removing files: such a file is named in the manifest, the rest is packed, and the
    archive is renamed into place only when whole (a kill mid-write left a cut one)."""
    pack = _pack_module()
    root = tmp_path / "megatron_lm"
    (root / "ckpt_tmp").mkdir(parents=True)
    (root / "train.log").write_text("iteration 1\n")
    (root / "going.log").write_text("soon removed\n")
    archive = tmp_path / "logs.tar.gz"
    archive.write_bytes(b"the previous archive")
    entries = pack.collect([root])
    (root / "going.log").unlink()
    pack._write(tmp_path / "direct.tar.gz", entries, 1 << 20)
    status = {e.name: e.status for e in entries}
    assert status["megatron_lm/going.log"] == "vanished while packing: FileNotFoundError"
    assert _members(tmp_path / "direct.tar.gz")["megatron_lm/train.log"] == b"iteration 1\n"
    pack.pack(archive, [root])
    assert sorted(_members(archive)) == ["MANIFEST.txt", "megatron_lm/train.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct.tar.gz", "logs.tar.gz", "megatron_lm"]


@pytest.mark.multiproc
def test_dry_run_lays_out_out_as_the_gpu_call_would(tmp_path):
    """`OUT=DIR device_check.sh --dry-run` on this machine (no GPU): the CPU part runs (here
    only the heavy-layer row, to keep the test short) and DIR holds what one device call
    brings back: at most 8 files, none in a folder, one archive <= 16 MiB holding every
    run's log and report, the worker's log and the progress log."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(script), "--dry-run", "--python", sys.executable, "--",
                           "--only", "profile_heavy_layer"], env=env, capture_output=True, text=True,
                          timeout=600)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert files == ["device_check.txt", "gpu_check.json", "gpu_check.log", "gpu_check.txt", "logs.tar.gz",
                     "megatron_lm.txt"], (files, proc.stderr[-3000:])
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert (out / "logs.tar.gz").stat().st_size <= 16 << 20
    members = _members(out / "logs.tar.gz")
    for name in ("gpu_check/worker.log", "gpu_check/heavy/stderr.log", "gpu_check/heavy/report.json",
                 "gpu_check/gpu_check.log", "gpu_check/gpu_check.json", "MANIFEST.txt"):
        assert name in members, sorted(members)
    assert b"profile_heavy_layer" in members["gpu_check/gpu_check.log"]
    text = (out / "device_check.txt").read_text()
    assert "--dry-run" in text and "logs.tar.gz: " in text
    assert "not run: --dry-run" in (out / "megatron_lm.txt").read_text()


def test_an_interpreter_without_torch_is_one_line_and_exit_2(tmp_path):
    """Before any run: an interpreter that cannot import torch (a fresh machine's
    python3 given to a dry run) is named in one line, exit 2, not a traceback
    minutes later from inside gpu_check.py."""
    import os
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
    proc = subprocess.run(["bash", str(script), "--dry-run", "--python", "/bin/false"],
                          env={**os.environ, "OUT": str(tmp_path / "out")}, capture_output=True, text=True,
                          timeout=60)
    line = ("device_check.sh: error: /bin/false cannot import torch within 120 s: pass --python with one that can "
            "(here: make install, then --python .venv/bin/python)")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [line]
    assert (tmp_path / "out" / "device_check.txt").read_text() == line + "\n"  # only $OUT comes back


def test_an_import_of_torch_that_hangs_ends_the_call_at_its_limit(tmp_path):
    """The first `import torch` on the GPU machine has a limit (DEVICE_SETUP_S, default
    120 s): a hung one is one line and exit 2, not the whole device call spent."""
    import os
    import subprocess
    import time
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"
    hangs = tmp_path / "python3"
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(script), "--python", str(hangs)], capture_output=True, text=True,
                          env={**os.environ, "OUT": str(tmp_path / "out"), "DEVICE_SETUP_S": "2"}, timeout=60)
    assert proc.returncode == 2 and time.monotonic() - start < 20
    assert proc.stderr.strip().splitlines()[-1].startswith(f"device_check.sh: error: {hangs} cannot import torch within 2 s")


def test_a_failed_install_of_the_carried_wheels_is_written_beside_the_table(tmp_path):
    """On the GPU machine only $OUT comes back: an install that fails (here a real pip on a
    wheel that is not one) leaves its line in OUT/device_check.txt, exit 2."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh", tree / "scripts")
    (tree / "runs" / "device" / "wheels").mkdir(parents=True)
    (tree / "runs" / "device" / "wheels" / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(tree / "scripts" / "device_check.sh"), "--python", sys.executable],
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=120)
    line = f"device_check.sh: error: installing {tree}/runs/device/wheels failed or took over 120 s"
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-2000:]
    assert (out / "device_check.txt").read_text() == line + "\n"


# ---- scripts/device_rehearsal.sh: the call on the machines' Python and torch, on CPU ----------
@pytest.mark.parametrize("argv, py312, message", [
    (["--bogus"], None, "device_rehearsal.sh: error: unknown argument --bogus (see --help)"),
    (["--torch"], None, "device_rehearsal.sh: error: --torch needs a version, e.g. 2.11.0"),
    ([], "/nonexistent/python3.12", "device_rehearsal.sh: error: PY312=/nonexistent/python3.12 is not a "
                                    "Python 3.12 interpreter (the lent machines run 3.12)"),
])
def test_device_rehearsal_usage_errors_exit_2_with_one_line(argv, py312, message):
    """Refused before anything is downloaded (the rehearsal itself needs a registry and
    5 GB: docs/gpu.md, run by hand)."""
    import os
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "device_rehearsal.sh"
    env = {**os.environ, **({"PY312": py312} if py312 else {})}
    proc = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [message], proc.stderr
