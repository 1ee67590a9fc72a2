import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import PP4_STATIC, run_key, start_zygote, train, worker  # noqa: E402  (needs the path above)


def pytest_sessionstart(session):
    """Fork the torchrun launcher (tests/zygote.py) before any test runs or is collected."""
    start_zygote()


@pytest.fixture(scope="session")
def pp4_static(tmp_path_factory):
    """The never-moved 4-stage baseline (directory, report), launched once per test session
    and shared by every module that compares a moved or repacked run against it."""
    out = tmp_path_factory.mktemp("pp4_static")
    return out, worker(4, PP4_STATIC, out)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(nproc, flags, module=...)` -> (directory, report): a run that several
    modules compare against, launched once per test session per configuration
    (launch.run_key); each caller gets its own copy of the report, the directory is
    shared (read it, never write into it)."""
    done: dict = {}

    def run(nproc: int, flags: list[str], module: str = "workers.train_worker"):
        key = run_key(nproc, flags, module)
        if key not in done:
            out = tmp_path_factory.mktemp("shared")
            done[key] = out, train(nproc, flags, out, module=module)
        out, report = done[key]
        return out, copy.deepcopy(report)

    return run
