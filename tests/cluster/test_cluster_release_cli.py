"""`dynmo cluster release` with no usable cluster: its outcome once, in one clear line
(issue 28: printed twice, with "replicas 0" and "ranks []", and a KUBECONFIG holding a
JSON list leaked "list indices must be integers or slices, not str")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["cluster", "release", "--strategy", "statefulset-scale", "--namespace", "ml",
        "--name", "train", "--keep", "1"]


def _release(tmp_path, kubeconfig_text: str | None) -> subprocess.CompletedProcess:
    """As a user runs it: a real process, outside any pod."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    if kubeconfig_text is not None:
        (tmp_path / "kc.json").write_text(kubeconfig_text)
        env["KUBECONFIG"] = str(tmp_path / "kc.json")
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", *ARGV], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("text,needle", [
    (None, "no kubeconfig at"),
    ("[1, 2]", "a kubeconfig is a mapping (apiVersion, clusters, contexts, users), this file holds a list"),
])
def test_no_cluster_one_line(tmp_path, text, needle):
    proc = _release(tmp_path, text)
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert proc.returncode == 3
    assert len(lines) == 1 and needle in lines[0], lines
    assert "replicas 0" not in lines[0] and "ranks []" not in lines[0]
    assert "list indices" not in lines[0]
