"""Guard: the simulator stays pure; reporting never pulls torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import importlib, json, sys, pkgutil
import dynmo_plugin.{pkg} as pkg
for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("pkg,forbidden", [
    ("sim", ("torch", "megatron")),
    ("reporting", ("torch", "megatron")),
])
def test_package_imports_no_torch_or_megatron(pkg, forbidden):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(pkg=pkg)], capture_output=True,
                         text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    bad = [m for m in loaded if m.split(".")[0] in forbidden]
    assert not bad, f"dynmo_plugin.{pkg} imported {bad[:5]}"
