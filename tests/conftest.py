import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import PP4_STATIC, worker  # noqa: E402  (needs the path above)


@pytest.fixture(scope="session")
def pp4_static(tmp_path_factory):
    """The never-moved 4-stage baseline (directory, report), launched once per test session
    and shared by every module that compares a moved or repacked run against it."""
    out = tmp_path_factory.mktemp("pp4_static")
    return out, worker(4, PP4_STATIC, out)
