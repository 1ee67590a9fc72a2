"""Shared by the benchmark scripts: run a command under torchrun on loopback, and read
the one `RESULT <json>` line a worker prints."""
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


def torchrun(nproc: int, args: list[str]) -> str:
    """`torchrun --nproc-per-node NPROC ARGS` from the repository root; returns stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout


def print_result(value) -> None:
    print("RESULT " + json.dumps(value))


def read_result(stdout: str):
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
