"""Test infrastructure: run the real launcher under torchrun and read its report."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, flags: list[str], output: Path, timeout: int = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m dynmo_plugin.train FLAGS --output OUTPUT`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "dynmo_plugin.train", *flags, "--output", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def train(nproc: int, flags: list[str], output: Path, **kw) -> dict:
    torchrun(nproc, flags, output, **kw)
    return json.loads((output / "report.json").read_text())


def losses(report: dict) -> list[float]:
    return [it["loss"] for it in report["iterations"]]
