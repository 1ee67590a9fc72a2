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
    """(time, machine busy s, own s, iteration at the sample), one interval a second:
    0-1 s iteration 1, 1.0 foreign core; 1-2 s iterations 1 and 2, 1.0; 2-3 s iterations
    2, 3 and 4 (3 fell between two samples), 0; 3-4 s iteration 4, 1.0; 4-5 s iterations 4
    and 5, 1.0; 5-6 s own CPU time fell (a rank exited, taking its time along): left out.
    Per iteration, the mean over the intervals it was in progress in."""
    s = gc.LoadSampler(tmp_path)
    s.samples = [(0.0, 0.0, 0.0, 1), (1.0, 1.5, 0.5, 1), (2.0, 3.0, 1.0, 2), (3.0, 4.5, 2.5, 4),
                 (4.0, 6.5, 3.5, 4), (5.0, 8.5, 4.5, 5), (6.0, 9.0, 1.0, 5)]
    assert s.foreign_cores() == pytest.approx({1: 1.0, 2: 0.5, 3: 0.0, 4: 2 / 3, 5: 1.0})


def test_a_child_burning_cpu_is_own_work(gc, tmp_path):
    log = tmp_path / "report.jsonl"
    log.write_text('{"kind": "header"}\n{"kind": "iteration", "record": {}}\n')
    # 3 s: the sampler rescans the process tree once a second, so a 1 s child could live
    # and die between two rescans and go unseen (CI run 3 of 2026-11-27: own 0.03 s)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 3.0: pass\n"
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
