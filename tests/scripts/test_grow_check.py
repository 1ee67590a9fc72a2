"""scripts/grow_check.py's LoadSampler: the foreign load per iteration (no launch).

Arithmetic on samples written here, then the sampler on this machine: a child
process burning CPU is its own work, never counted as foreign.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "grow_check.py"


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("grow_check", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grow_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("grow_check", None)


def test_foreign_cores_per_iteration(gc, tmp_path):
    """(time, machine busy s, own s, iteration): iteration 1 for 2 s with the machine
    busy 3 core-s of which 1 ours -> 1.0 foreign core; iteration 2: 1 s, 1.5 busy, 1.5
    ours -> 0; an interval where own CPU time fell (a rank exited) is left out."""
    s = gc.LoadSampler(tmp_path)
    s.samples = [(0.0, 0.0, 0.0, 1), (1.0, 1.5, 0.5, 1), (2.0, 3.0, 1.0, 2), (3.0, 4.5, 2.5, 3),
                 (4.0, 5.0, 1.0, 3)]
    assert s.foreign_cores() == pytest.approx({1: 1.0, 2: 0.0})


def test_a_child_burning_cpu_is_own_work(gc, tmp_path):
    log = tmp_path / "report.jsonl"
    log.write_text('{"kind": "header"}\n{"kind": "iteration", "record": {}}\n')
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
    mine = time.process_time()
    with gc.LoadSampler(tmp_path, period_s=0.1) as sampler:
        subprocess.run([sys.executable, "-I", "-S", "-c", burn], check=True)  # no site: no imports
        time.sleep(0.2)
    mine = time.process_time() - mine  # this process (the sampler's thread included)
    assert {it for *_, it in sampler.samples} == {2}  # one iteration logged: the 2nd runs
    # the child's CPU time is in the samples while it lives (it leaves with it: the
    # intervals where own time falls are dropped, test above)
    # >=: the test session's zygote (tests/zygote.py, another child) may be busy too
    own = max(x[2] for x in sampler.samples) - sampler.samples[0][2]
    assert own - mine >= 0.7  # its second, in ticks of 10 ms; missed, this would be ~0
