"""Guard: the balancing package stays pure (no torch, torch.distributed, megatron)."""
from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "torch.distributed", "megatron", "deepspeed")

PROBE = """
import sys
import dynmo_plugin.balancing as b
import dynmo_plugin.cli.plan
pb = b.BalanceProblem(costs=[1, 2, 3, 4, 5], num_stages=2, memory=[1] * 5, capacity=4)
for method in ("exact", "diffusion", "uniform"):
    b.solve(pb, method)
print(",".join(sorted(m for m in sys.modules
                      if m.split(".")[0] in ("torch", "megatron", "deepspeed"))))
"""


def test_balancing_imports_no_torch_distributed_or_megatron():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    loaded = [m for m in out.stdout.strip().split(",") if m]
    assert not [m for m in loaded if m in FORBIDDEN or m.startswith(("megatron", "torch."))], loaded
    assert loaded == []
