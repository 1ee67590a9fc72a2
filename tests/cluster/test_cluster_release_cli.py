"""`dynmo cluster release` with no usable cluster: its outcome once, in one clear line
(issue 28: printed twice, with "replicas 0" and "ranks []", and a KUBECONFIG holding a
JSON list leaked "list indices must be integers or slices, not str"). A bad --kubeconfig
file is bad input: exit 2 and one line on stderr, before any cluster is contacted."""
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


_GOOD_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.mark.parametrize("kind,needle", [
    ("missing", "kc does not exist; give the kubeconfig file, or leave it out"),
    ("directory", "is a directory; give the kubeconfig file"),
    ("malformed", "not a readable kubeconfig: expected the node content"),
    ("not utf-8", "not a readable kubeconfig"),
    ("empty", "is empty"),
    ("a list", "a kubeconfig is a mapping"),
    ("no current-context", "has no current-context; set one (kubectl config use-context NAME)"),
    ("a missing CA file", "its cluster's certificate-authority /nonexistent/ca.crt does not exist"),
])
def test_bad_kubeconfig_flag_is_one_line_exit_2(tmp_path, capsys, kind, needle):
    """Was exit 3 with the failure on stdout only (a directory passed os.access; the file
    was never parsed before the release tried to connect; a mapping without a
    current-context or naming a missing CA file failed only in the client's loader)."""
    from dynmo_plugin.cli import main

    path = tmp_path / "kc"
    if kind == "directory":
        path.mkdir()
    elif kind != "missing":
        path.write_bytes({"malformed": b"apiVersion: v1\nclusters: [\n  - name: x\n",
                          "not utf-8": b"\xff\xfe", "empty": b"", "a list": b"[1, 2]",
                          "no current-context": _GOOD_KUBECONFIG.replace("current-context: x\n", "").encode(),
                          "a missing CA file": _GOOD_KUBECONFIG.replace(
                              '"https://127.0.0.1:1"', '"https://127.0.0.1:1", certificate-authority: /nonexistent/ca.crt'
                          ).encode()}[kind])
    code = main([*ARGV, "--kubeconfig", str(path), "--json"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and out == "", (code, out)
    assert len(lines) == 1 and lines[0].startswith("dynmo cluster release: error: "), err
    assert needle in lines[0], lines[0]


def test_good_kubeconfig_no_server_stays_exit_3(tmp_path, capsys):
    """A usable kubeconfig whose server does not answer is a failed release (3), not bad input."""
    from dynmo_plugin.cli import main

    (tmp_path / "kc").write_text(_GOOD_KUBECONFIG)
    code = main([*ARGV, "--kubeconfig", str(tmp_path / "kc"), "--retries", "1", "--backoff-s", "0",
                 "--json"])
    out, _ = capsys.readouterr()
    assert code == 3 and '"outcome": "failed"' in out, out
