"""GPU release against a real Kubernetes API server (kube-apiserver v1.20.2 + etcd +
kube-controller-manager, tests/kube_cluster.py): every strategy, the project's Role,
403/422 answers, retries on an unreachable API, the Event and annotation, the CLI.

The only fake is `FaultProxy`, named as such: it answers 409/429/503 in front of the
real server, faults the real server cannot be made to produce on demand.
"""
from __future__ import annotations

import http.client
import http.server
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
import kube_cluster as kc
from kube_cluster import DEPLOY, free_port, write_kubeconfig

from dynmo_plugin.cluster import ReleaseRequest, release
from dynmo_plugin.cluster.record import ANNOTATION
from dynmo_plugin.config import ClusterConfig

REPO = Path(__file__).resolve().parents[2]
kube_cluster, kube_namespace = kc.kube_cluster, kc.kube_namespace  # the fixtures (ruff-proof import)
REQ = ReleaseRequest(keep=2, current=4, released_ranks=(4, 5, 6, 7),
                     reason="repack 4->2 stages at iteration 40: predicted 0.21 s -> 0.20 s per iteration")


def cfg_for(kubeconfig, namespace: str, name: str, strategy: str, fallback: str = "none",
            **kw) -> ClusterConfig:
    return ClusterConfig(strategy=strategy, fallback=fallback, namespace=namespace, name=name,
                         kubeconfig=str(kubeconfig), **kw)


def annotation(kube_cluster, kind: str, namespace: str, name: str) -> dict:
    from kubernetes import client

    read = {"StatefulSet": client.AppsV1Api(kube_cluster.api()).read_namespaced_stateful_set,
            "Job": client.BatchV1Api(kube_cluster.api()).read_namespaced_job}[kind]
    return json.loads(read(name, namespace).metadata.annotations[ANNOTATION])


def assert_recorded(kube_cluster, out, kind: str, namespace: str, name: str) -> None:
    """The release left an Event and an annotation saying what went and why."""
    assert out.recorded["event"].startswith("Event "), out.recorded
    assert out.recorded["annotation"].startswith(ANNOTATION), out.recorded
    events = [e for e in kube_cluster.events(namespace, name) if e.reason == "DynmoReleasedGPUs"]
    assert len(events) == 1 and REQ.reason in events[0].message and "ranks 4-7" in events[0].message
    assert events[0].involved_object.kind == kind
    if kind != "Pod":
        note = annotation(kube_cluster, kind, namespace, name)
        assert note["released_ranks"] == [4, 5, 6, 7] and note["reason"] == REQ.reason
        assert note["outcome"] == "released" and note["replicas_after"] == 2


# ---- strategies -----------------------------------------------------------------------------
def test_statefulset_scale_removes_the_highest_ordinals(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "train", "statefulset-scale"), REQ)
    assert (out.outcome, out.strategy, out.replicas_before, out.replicas_after) == \
        ("released", "statefulset-scale", 4, 2), out
    assert out.server_version == "v1.20.2"  # GET /version, as a client sees it
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})
    assert kube_cluster.replicas(ns, "train") == 2
    assert out.attempts == len(out.status_codes) and set(out.status_codes) <= {200, 201}
    assert_recorded(kube_cluster, out, "StatefulSet", ns, "train")


def test_job_parallelism_leaves_two_pods(kube_cluster, kube_namespace):
    from kubernetes import client

    ns = kube_namespace
    kube_cluster.create_job(ns, "train", 4)
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "train", "job-parallelism"), REQ)
    assert (out.outcome, out.replicas_before, out.replicas_after) == ("released", 4, 2), out
    kube_cluster.wait_pods(ns, "job-name=train", 2)
    job = client.BatchV1Api(kube_cluster.api()).read_namespaced_job("train", ns)
    assert job.spec.parallelism == 2
    assert_recorded(kube_cluster, out, "Job", ns, "train")


def test_delete_pods_deletes_the_named_pods(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_pods(ns, "worker", 4)
    req = ReleaseRequest(keep=2, current=4, released_ranks=REQ.released_ranks, reason=REQ.reason,
                         grace_period_s=0)  # no kubelet will ever confirm a graceful delete
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "worker", "delete-pods"), req)
    assert out.outcome == "released" and "worker-2, worker-3" in out.message, out
    assert kube_cluster.pod_names(ns, "app=worker") == {"worker-0", "worker-1"}
    assert_recorded(kube_cluster, out, "Pod", ns, "worker-0")


def test_delete_pods_refuses_pods_a_controller_recreates(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "train", "delete-pods",
                          fallback="statefulset-scale"), REQ)
    assert (out.outcome, out.strategy, out.fell_back_from) == \
        ("released", "statefulset-scale", "delete-pods"), out
    assert "managed by StatefulSet train" in out.message
    assert "nothing deleted" in out.message
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})


def test_patch_pod_resources_gets_422_and_falls_back(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "train", "patch-pod-resources",
                          fallback="statefulset-scale"), REQ)
    assert (out.outcome, out.strategy, out.fell_back_from) == \
        ("released", "statefulset-scale", "patch-pod-resources"), out
    assert 422 in out.status_codes
    assert "pod updates may not change fields" in out.message  # the server's own words
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})


def test_patch_pod_resources_without_fallback_is_rejected(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    out = release(cfg_for(kube_cluster.admin_kubeconfig, ns, "train", "patch-pod-resources"), REQ)
    assert (out.outcome, out.strategy, out.fell_back_from) == ("rejected", "patch-pod-resources", None)
    assert out.status_codes.count(422) == 1 and "422 Unprocessable" in out.message
    assert kube_cluster.replicas(ns, "train") == 4 and len(kube_cluster.pod_names(ns, "app=train")) == 4
    events = [e for e in kube_cluster.events(ns, "train-0") if e.reason == "DynmoReleaseRejected"]
    assert len(events) == 1 and events[0].type == "Warning"  # on the leader's pod: nothing was freed


# ---- RBAC -----------------------------------------------------------------------------------
def test_project_role_allows_every_strategy_and_nothing_else(kube_cluster, kube_namespace):
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    ns = kube_namespace
    role = kube_cluster.role_kubeconfig(ns)  # applies deploy/kubernetes/rbac.yaml
    kube_cluster.create_statefulset(ns, "sts", 4)
    kube_cluster.create_job(ns, "job", 4)
    kube_cluster.create_pods(ns, "bare", 4)
    kube_cluster.create_statefulset(ns, "paper", 4)
    zero = ReleaseRequest(keep=2, current=4, released_ranks=(4, 5, 6, 7), reason=REQ.reason, grace_period_s=0)
    for name, strategy, fallback in (("sts", "statefulset-scale", "none"), ("job", "job-parallelism", "none"),
                                     ("bare", "delete-pods", "none"),
                                     ("paper", "patch-pod-resources", "statefulset-scale")):
        out = release(cfg_for(role, ns, name, strategy, fallback), zero)
        assert out.outcome == "released" and 403 not in out.status_codes, out
        assert not any(v.startswith("not recorded") for v in out.recorded.values()), out.recorded
    kube_cluster.wait_pods(ns, "app=sts", {"sts-0", "sts-1"})
    kube_cluster.wait_pods(ns, "job-name=job", 2)

    api = config.new_client_from_config(str(role))
    try:
        for call in (lambda: client.CoreV1Api(api).list_namespaced_secret(ns),
                     lambda: client.AppsV1Api(api).delete_namespaced_stateful_set("sts", ns),
                     lambda: client.AppsV1Api(api).read_namespaced_stateful_set("sts", ns),
                     lambda: client.CoreV1Api(api).list_namespaced_pod("default")):
            with pytest.raises(ApiException) as e:
                call()
            assert e.value.status == 403
    finally:
        api.close()


def test_forbidden_names_the_missing_verb_and_resource(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    nobody = kube_cluster.unbound_kubeconfig(ns)
    out = release(cfg_for(nobody, ns, "train", "statefulset-scale", fallback="delete-pods"), REQ)
    assert (out.outcome, out.strategy, out.fell_back_from) == ("rejected", "delete-pods", "statefulset-scale")
    assert out.status_codes.count(403) >= 2, out.status_codes
    assert 'lacks verb "get" on resource "statefulsets/scale" in API group apps' in out.message
    assert 'lacks verb "get" on resource "pods"' in out.message
    assert "system:serviceaccount:" in out.message  # the server's own words follow
    assert "not recorded: create event" in out.recorded["event"] and "403" in out.recorded["event"]
    assert kube_cluster.replicas(ns, "train") == 4


# ---- an API that does not answer -------------------------------------------------------------
def test_closed_port_fails_within_the_retry_bound(kube_cluster, tmp_path):
    kcfg = write_kubeconfig(tmp_path / "closed", f"https://127.0.0.1:{free_port()}", kube_cluster.ca_file,
                          kube_cluster.admin_token, "admin")
    t0 = time.monotonic()
    out = release(cfg_for(kcfg, "ns", "train", "statefulset-scale", fallback="delete-pods",
                          retries=3, backoff_s=0.2, timeout_s=2.0), REQ)
    elapsed = time.monotonic() - t0
    assert (out.outcome, out.attempts, out.status_codes) == ("failed", 3, [0, 0, 0]), out
    # Two back-offs were slept (a lower bound the clock guarantees); the upper bound only
    # says the loop is bounded, loose enough for a loaded machine.
    assert 0.2 + 0.4 <= elapsed < 30.0, elapsed
    assert out.fell_back_from is None  # the same API would not answer a fallback either
    assert "no usable answer after 3 attempt(s)" in out.message
    assert out.recorded == {"event": "skipped: the API did not answer",
                            "annotation": "skipped: the API did not answer"}


def test_silent_server_is_bounded_by_the_request_timeout(kube_cluster, tmp_path):
    with socket.socket() as silent:  # accepts connections (kernel backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        kcfg = write_kubeconfig(tmp_path / "silent", f"https://127.0.0.1:{silent.getsockname()[1]}",
                              kube_cluster.ca_file, kube_cluster.admin_token, "admin")
        t0 = time.monotonic()
        out = release(cfg_for(kcfg, "ns", "train", "statefulset-scale", retries=2, backoff_s=0.1,
                              timeout_s=0.5), REQ)
        elapsed = time.monotonic() - t0
    assert (out.outcome, out.attempts, out.status_codes) == ("failed", 2, [0, 0]), out
    assert 1.0 <= elapsed < 30.0, elapsed  # two 0.5 s timeouts; bounded, not hanging


class FaultProxy:
    """FAKE, named as such: a TLS proxy in front of the real API server that answers
    the first requests with the given statuses (409, 429 with Retry-After, 503; 200: a
    body that is not JSON) and forwards every later request unchanged."""

    def __init__(self, cluster, faults: list[int]):
        self.faults, self.seen = list(faults), []
        upstream_port = int(cluster.server.rsplit(":", 1)[1])
        upstream_ctx = ssl.create_default_context(cafile=str(cluster.ca_file))
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.faults:
                    status = proxy.faults.pop(0)
                    proxy.seen.append(status)
                    data = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                       "message": f"injected {status}", "code": status}).encode()
                    if status == 200:
                        data = b"<html>a proxy's login page</html>"
                    self.send_response(status)
                    if status == 429:
                        self.send_header("Retry-After", "1")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                conn = http.client.HTTPSConnection("127.0.0.1", upstream_port, context=upstream_ctx, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                proxy.seen.append(resp.status)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cluster.dir / "server.crt", cluster.dir / "server.key")
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_retries_409_429_503_then_releases(kube_cluster, kube_namespace, tmp_path):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    proxy = FaultProxy(kube_cluster, [409, 503, 429])
    try:
        kcfg = write_kubeconfig(tmp_path / "proxy", proxy.url, kube_cluster.ca_file, kube_cluster.admin_token, "admin")
        t0 = time.monotonic()
        out = release(cfg_for(kcfg, ns, "train", "statefulset-scale", retries=4, backoff_s=0.1), REQ)
        elapsed = time.monotonic() - t0
    finally:
        proxy.close()
    assert out.outcome == "released", out
    assert out.status_codes[:4] == [409, 503, 429, 200] and out.attempts == len(out.status_codes)
    assert 1.0 + 0.1 + 0.2 <= elapsed < 30.0, elapsed  # the 429's Retry-After (1 s) was honoured
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})


def test_503_until_the_retries_run_out_fails(kube_cluster, tmp_path):
    proxy = FaultProxy(kube_cluster, [503] * 10)
    try:
        kcfg = write_kubeconfig(tmp_path / "proxy", proxy.url, kube_cluster.ca_file, kube_cluster.admin_token, "admin")
        out = release(cfg_for(kcfg, "ns", "train", "statefulset-scale", retries=3, backoff_s=0.05), REQ)
    finally:
        proxy.close()
    assert (out.outcome, out.status_codes) == ("failed", [503, 503, 503]), out
    assert "injected 503" in out.message


def test_unreadable_answer_fails_without_raising(kube_cluster, tmp_path):
    proxy = FaultProxy(kube_cluster, [200] * 10)
    try:
        kcfg = write_kubeconfig(tmp_path / "proxy", proxy.url, kube_cluster.ca_file, kube_cluster.admin_token,
                                "admin")
        out = release(cfg_for(kcfg, "ns", "train", "statefulset-scale", retries=2), REQ)
    finally:
        proxy.close()
    assert out.outcome == "failed" and "unexpected error" in out.message, out


# ---- the example deployment and the CLI ------------------------------------------------------
def test_example_statefulset_releases_from_inside_a_pod(kube_cluster, kube_namespace):
    """The deploy/kubernetes YAML as shipped; the release finds namespace and name from the
    pod's downward-API env, as the leader does, with the Role's token."""
    ns = kube_namespace
    role = kube_cluster.role_kubeconfig(ns)
    kube_cluster.apply(DEPLOY / "statefulset.yaml", ns)
    names = {f"dynmo-train-{i}" for i in range(4)}
    kube_cluster.wait_pods(ns, "app=dynmo-train", names)
    docs = list(yaml.safe_load_all((DEPLOY / "statefulset.yaml").read_text()))
    settings = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["dynmo.yaml"])
    cfg = ClusterConfig(**settings["cluster"], kubeconfig=str(role))
    out = release(cfg, REQ, env={"POD_NAME": "dynmo-train-0", "POD_NAMESPACE": ns})
    assert (out.outcome, out.namespace, out.name) == ("released", ns, "dynmo-train"), out
    kube_cluster.wait_pods(ns, "app=dynmo-train", {"dynmo-train-0", "dynmo-train-1"})


def dynmo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "cluster", "release", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_release_json(kube_cluster, kube_namespace):
    ns = kube_namespace
    kube_cluster.create_statefulset(ns, "train", 4)
    common = ["--namespace", ns, "--keep", "2", "--kubeconfig", str(kube_cluster.admin_kubeconfig), "--json"]
    r = dynmo("--strategy", "statefulset-scale", "--name", "train", "--ranks", "4-7", *common)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # exactly one document on stdout
    assert (doc["outcome"], doc["replicas_after"], doc["released_ranks"]) == ("released", 2, [4, 5, 6, 7])
    kube_cluster.wait_pods(ns, "app=train", {"train-0", "train-1"})

    r = dynmo("--strategy", "statefulset-scale", "--name", "absent", *common)
    assert r.returncode == 4 and json.loads(r.stdout)["outcome"] == "rejected"
    assert "404 Not Found" in json.loads(r.stdout)["message"]

    r = dynmo("--strategy", "patch-pod-resources", "--fallback", "statefulset-scale", "--name", "train",
              "--current", "2", "--keep", "1", "--namespace", ns,
              "--kubeconfig", str(kube_cluster.admin_kubeconfig))  # text, not --json
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fell back from patch-pod-resources" in r.stdout and "422" in r.stdout
    assert "event: Event" in r.stdout and "annotation: dynmo-plugin/last-release" in r.stdout
    kube_cluster.wait_pods(ns, "app=train", {"train-0"})

    r = dynmo("--strategy", "none", "--name", "train", *common)
    assert r.returncode == 5 and json.loads(r.stdout)["outcome"] == "logged"


def test_cli_unreachable_exits_3(kube_cluster, tmp_path):
    kcfg = write_kubeconfig(tmp_path / "closed", f"https://127.0.0.1:{free_port()}", kube_cluster.ca_file,
                          kube_cluster.admin_token, "admin")
    r = dynmo("--strategy", "job-parallelism", "--namespace", "ns", "--name", "train", "--keep", "1",
              "--kubeconfig", str(kcfg), "--retries", "2", "--backoff-s", "0", "--json")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["outcome"], doc["attempts"], doc["status_codes"]) == ("failed", 2, [0, 0])
    assert "attempt 1 of 2" in r.stderr  # the retries are logged on stderr
