"""dynmo_plugin.cluster without a server: requests, targets from downward-API env, the
local `none` strategy, bad configuration, CLI input checks, the deploy Role, purity."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dynmo_plugin.cli import main
from dynmo_plugin.cli.cluster import parse_ranks
from dynmo_plugin.cluster import STRATEGIES, ReleaseOutcome, ReleaseRequest, exit_status, release
from dynmo_plugin.cluster.api import Op, describe, server_message
from dynmo_plugin.cluster.target import resolve_target, workload_name
from dynmo_plugin.config import CLUSTER_STRATEGIES, ClusterConfig
from dynmo_plugin.errors import UserError

REPO = Path(__file__).resolve().parents[2]
REQ = ReleaseRequest(keep=2, current=4, released_ranks=(4, 5, 6, 7), reason="repack 4->2")


def test_strategies_match_the_config():
    assert set(STRATEGIES) == set(CLUSTER_STRATEGIES)


@pytest.mark.parametrize("kw", [{"keep": 0, "current": 4}, {"keep": -1, "current": 4},
                                {"keep": 1.5, "current": 4}, {"keep": True, "current": 4},
                                {"keep": 2, "current": -1}, {"keep": 2, "current": 4, "grace_period_s": -1}])
def test_request_rejects_impossible_values(kw):
    with pytest.raises(ValueError):
        ReleaseRequest(**kw)


def test_outcome_to_dict_is_json():
    out = ReleaseOutcome(strategy="statefulset-scale", outcome="released", status_codes=[200],
                         attempts=1, released_ranks=(4, 5), replicas_before=4, replicas_after=2)
    doc = json.loads(json.dumps(out.to_dict()))
    assert doc["released_ranks"] == [4, 5] and doc["replicas_after"] == 2 and exit_status(out) == 0
    assert "statefulset-scale: released" in str(out)


@pytest.mark.parametrize("pod,name", [("train-3", "train"), ("my-train-12", "my-train"),
                                      ("train-3-x7k2p", "train"), ("train", "")])
def test_workload_name_from_pod_name(pod, name):
    assert workload_name(pod) == name


def test_target_from_downward_api_env(tmp_path):
    t = resolve_target("", "", {"POD_NAME": "train-1", "POD_NAMESPACE": "ml"}, tmp_path / "none")
    assert (t.namespace, t.name, t.problem) == ("ml", "train", "")
    t = resolve_target("other", "job", {"POD_NAME": "train-1", "POD_NAMESPACE": "ml"}, tmp_path / "none")
    assert (t.namespace, t.name) == ("other", "job")  # the config wins
    (tmp_path / "ns").write_text("from-sa\n")
    assert resolve_target("", "x", {}, tmp_path / "ns").namespace == "from-sa"
    t = resolve_target("", "", {}, tmp_path / "none")
    assert "no namespace" in t.problem and "POD_NAME" in t.problem


def test_none_strategy_logs_and_calls_nothing(caplog):
    with caplog.at_level("INFO", logger="dynmo_plugin.cluster"):
        out = release(ClusterConfig(), REQ, env={})
    assert (out.outcome, out.strategy, out.attempts, out.status_codes) == ("logged", "none", 0, [])
    assert "[4, 5, 6, 7]" in caplog.text  # which ranks were released
    assert exit_status(out) == 5


def test_freed_ranks_in_no_whole_replica_say_so_under_every_strategy(caplog):
    """A repack of 4 ranks in one pod onto 2: the line said 'none: logged / replicas 1:
    ... released ranks only logged', as if something had been released."""
    request = ReleaseRequest(keep=1, current=1, released_ranks=(2, 3))
    with caplog.at_level("INFO", logger="dynmo_plugin.cluster"):
        out = release(ClusterConfig(), request, env={})
    assert (out.outcome, out.attempts) == ("logged", 0)
    assert str(out) == ("none: logged (replicas 1): keep=1 >= current=1: nothing to release (the freed "
                        "ranks fill no whole replica)")
    assert "cluster release: ranks [2, 3]: none: logged (replicas 1): keep=1" in caplog.text


def test_nothing_to_release_makes_no_call():
    out = release(ClusterConfig(strategy="statefulset-scale", namespace="ns", name="x",
                                kubeconfig="/nonexistent"), ReleaseRequest(keep=4, current=4), env={})
    assert out.outcome == "logged" and out.attempts == 0 and "nothing to release" in out.message


def test_unknown_target_and_bad_kubeconfig_fail_without_raising(tmp_path):
    out = release(ClusterConfig(strategy="statefulset-scale"), REQ, env={})
    assert out.outcome == "failed" and "no namespace" in out.message
    bad = tmp_path / "kubeconfig"
    bad.write_text("this: [is not a kubeconfig")
    for kubeconfig in (str(bad), str(tmp_path / "absent")):
        out = release(ClusterConfig(strategy="job-parallelism", namespace="ns", name="x",
                                    kubeconfig=kubeconfig), REQ, env={})
        assert out.outcome == "failed" and "no usable Kubernetes configuration" in out.message, out
        assert exit_status(out) == 3


def test_forbidden_message_names_verb_and_resource():
    op = Op("patch", "statefulsets/scale", "apps", "statefulset ml/train")
    body = json.dumps({"kind": "Status", "message": 'statefulsets.apps "train" is forbidden: ...\ndetail'})
    text = describe(op, 403, server_message(body))
    assert 'lacks verb "patch" on resource "statefulsets/scale" in API group apps' in text
    assert text.endswith("is forbidden: ...")  # the server's first line, not the diff after it


def test_deploy_role_grants_only_release_verbs():
    docs = list(yaml.safe_load_all((REPO / "deploy/kubernetes/rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {("apps", "statefulsets/scale", "get"), ("apps", "statefulsets/scale", "patch"),
                       ("apps", "statefulsets", "patch"), ("batch", "jobs", "get"),
                       ("batch", "jobs", "patch"), ("", "pods", "get"), ("", "pods", "delete"),
                       ("", "pods", "patch"), ("", "events", "create")}
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    sa = next(d for d in docs if d["kind"] == "ServiceAccount")
    assert binding["subjects"][0]["name"] == sa["metadata"]["name"]


def test_example_statefulset_uses_static_nnodes_and_downward_api():
    docs = list(yaml.safe_load_all((REPO / "deploy/kubernetes/statefulset.yaml").read_text()))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(container["args"])
    assert f"--nnodes {sts['spec']['replicas']} " in command and "--node-rank" in command
    assert "-m dynmo_plugin.train" in command and "--dynmo-config" in command
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert sts["spec"]["template"]["spec"]["serviceAccountName"] == "dynmo-train"


@pytest.mark.parametrize("argv,expected", [
    (["--keep", "0"], "--keep 0"),
    (["--keep", "4", "--current", "4"], "nothing to release"),
    (["--strategy", "delete-pods"], "needs --current"),
    (["--namespace", "Bad_NS"], "--namespace"),
    (["--name", "UPPER"], "--name"),
    (["--kubeconfig", "/nonexistent/kc"], "--kubeconfig"),
    (["--retries", "0"], "--retries 0"),
    (["--timeout-s", "0"], "--timeout-s 0"),
    (["--ranks", "7-3"], "--ranks"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, expected, capsys):
    base = {"--strategy": "statefulset-scale", "--namespace": "ml", "--name": "train", "--keep": "2"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    args = [a for kv in base.items() for a in kv]
    assert main(["cluster", "release", *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert expected in captured.err


def test_parse_ranks():
    assert parse_ranks("16-19,24") == (16, 17, 18, 19, 24) and parse_ranks("") == ()
    with pytest.raises(UserError):
        parse_ranks("a")


def test_importing_the_cluster_wing_is_cheap():
    probe = ("import sys, dynmo_plugin.cluster, dynmo_plugin.cli.cluster; "
             "print(sorted({m.split('.')[0] for m in sys.modules}))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    for heavy in ("torch", "megatron", "kubernetes", "urllib3"):
        assert f"'{heavy}'" not in loaded, heavy
