"""A live repack hands its released replicas to a real Kubernetes API server.

The training run is real (torchrun, 4 gloo ranks, PP=4 -> 2); the cluster is the real
kube-apiserver + controller-manager of tests/kube_cluster.py, reached with the token of
the project's own Role (deploy/kubernetes/rbac.yaml). Each rank stands for one pod of a
StatefulSet (`--dynmo-cluster-ranks-per-replica 1`).
"""
from __future__ import annotations

import json

import kube_cluster as kc
import pytest
from kube_cluster import free_port, write_kubeconfig

from launch import SMALL_MODEL, losses, torchrun

pytestmark = pytest.mark.multiproc
kube_cluster, kube_namespace = kc.kube_cluster, kc.kube_namespace  # the fixtures

MODEL = SMALL_MODEL + ["--train-iters", "6", "--pipeline-model-parallel-size", "4",
         "--dynmo", "--dynmo-repack", "--dynmo-forced-layouts", "3:Etttt|ttttL",
         "--dynmo-cluster-ranks-per-replica", "1"]


def _run(tmp_path, cluster_flags: list[str]) -> tuple[dict, dict]:
    torchrun(4, MODEL + cluster_flags, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    (event,) = [e for e in report["events"] if e.get("repack")]
    return report, event["repack"]["cluster"]


@pytest.fixture(scope="module")
def released(kube_cluster, tmp_path_factory):
    ns = kube_cluster.create_namespace("repack")
    kube_cluster.create_statefulset(ns, "train", replicas=4)
    kubeconfig = kube_cluster.role_kubeconfig(ns)
    report, cluster = _run(tmp_path_factory.mktemp("released"), [
        "--dynmo-cluster-strategy", "statefulset-scale", "--dynmo-cluster-namespace", ns,
        "--dynmo-cluster-name", "train", "--dynmo-cluster-kubeconfig", str(kubeconfig)])
    yield ns, report, cluster
    kube_cluster.delete_namespace(ns)


def test_statefulset_ends_at_two_replicas(kube_cluster, released):
    ns, _, cluster = released
    assert cluster["outcome"] == "released", cluster
    assert (cluster["replicas_before"], cluster["replicas_after"]) == (4, 2)
    assert cluster["released_ranks"] == [2, 3] and cluster["retirees_confirmed"]
    assert kube_cluster.replicas(ns, "train") == 2
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})  # the controller removed -2, -3
    reasons = " ".join(e.message for e in kube_cluster.events(ns, "train"))
    assert "ranks [2, 3]" in reasons


def test_unreachable_api_never_stops_training(kube_cluster, released, tmp_path):
    """A kubeconfig whose server is gone: bounded retries in the background, training
    unchanged to the last bit."""
    _, reference, _ = released
    dead = write_kubeconfig(tmp_path / "dead.kubeconfig", f"https://127.0.0.1:{free_port()}",
                            kube_cluster.ca_file, "token", "nobody")
    out = tmp_path / "run"
    out.mkdir()
    report, cluster = _run(out, [
        "--dynmo-cluster-strategy", "statefulset-scale", "--dynmo-cluster-namespace", "gone",
        "--dynmo-cluster-name", "train", "--dynmo-cluster-kubeconfig", str(dead),
        "--dynmo-cluster-retries", "3", "--dynmo-cluster-backoff-s", "0.05"])
    assert cluster["outcome"] == "failed" and cluster["attempts"] == 3
    assert cluster["status_codes"] == [0, 0, 0]
    assert [it["iteration"] for it in report["iterations"]] == list(range(1, 7))
    assert losses(report) == losses(reference)

