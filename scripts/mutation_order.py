"""scripts/mutation.py's pytest plugin (copied into each tree as `_mutation_order.py`):
which tests run which lines of the mutated modules, and those tests first.

Only the order changes: every test of the command still runs for a mutant no test kills,
so a survivor is what it was; a kill comes sooner. The unmutated run traces the target
files (DYNMO_MUTATION_TRACE_FILES, `os.pathsep`-separated; sys.settrace on Python 3.11,
a line tracer only in their frames) and writes {nodeid: [seconds, {file: [lines]}]} to
DYNMO_MUTATION_TRACE. A mutant's run reads DYNMO_MUTATION_FIRST, a JSON
{"first": [node ids], "limits": {node id: seconds}}: the node ids to put first (the rest
keep the command's order; lines run only at import, defaults and decorators, are covered
by no test, so such a mutant keeps the command's order), and each test's time limit
(pytest-timeout's marker: a mutant that hangs one test is stopped at that test's limit,
not at the whole command's).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

_FILES = {os.path.realpath(f) for f in os.environ.get("DYNMO_MUTATION_TRACE_FILES", "").split(os.pathsep)
          if f}
_OUT = os.environ.get("DYNMO_MUTATION_TRACE")
_FIRST = os.environ.get("DYNMO_MUTATION_FIRST")
_ours: dict[str, bool] = {}
_hits: set[tuple[str, int]] = set()
_tests: dict[str, list] = {}


def _line(frame, event, _arg):
    if event == "line":
        _hits.add((frame.f_code.co_filename, frame.f_lineno))
    return _line


def _call(frame, _event, _arg):
    name = frame.f_code.co_filename
    ours = _ours.get(name)
    if ours is None:
        ours = _ours[name] = os.path.realpath(name) in _FILES
    if not ours:
        return None
    _hits.add((name, frame.f_lineno))
    return _line


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _OUT:
        yield
        return
    _hits.clear()
    start = time.perf_counter()
    threading.settrace(_call)
    sys.settrace(_call)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        lines: dict[str, list[int]] = {}
        for name, row in _hits:
            lines.setdefault(os.path.realpath(name), []).append(row)
        _tests[item.nodeid] = [time.perf_counter() - start, lines]


def pytest_sessionfinish(session):
    if _OUT:
        with open(_OUT, "w") as out:
            json.dump(_tests, out)


def pytest_collection_modifyitems(session, config, items):
    if not _FIRST:
        return
    with open(_FIRST) as f:
        plan = json.load(f)
    rank = {nodeid: i for i, nodeid in enumerate(plan["first"])}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))
    for item in items:
        if item.nodeid in plan["limits"]:
            item.add_marker(pytest.mark.timeout(plan["limits"][item.nodeid]))
