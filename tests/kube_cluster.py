"""A real Kubernetes control plane for tests: etcd, kube-apiserver (v1.20.2) and
kube-controller-manager on free loopback ports, one per test session.

    from kube_cluster import kube_cluster, kube_namespace   # pytest fixtures

    def test_x(kube_cluster, kube_namespace):
        kube_cluster.create_statefulset(kube_namespace, "train", 4)     # waits for 4 pods
        ... release(ClusterConfig(..., kubeconfig=str(kube_cluster.admin_kubeconfig)), ...)
        kube_cluster.wait_pods(kube_namespace, "app=train", {"train-0", "train-1"})
        assert kube_cluster.replicas(kube_namespace, "train") == 2

No kubelet and no scheduler run: pods stay Pending, but the StatefulSet, Job,
namespace and garbage-collector controllers create and delete pod objects as on a
real cluster. The binaries come from $DYNMO_KUBE_BIN (default
~/.cache/dynmo-kube/bin; built by scripts/build_kube.sh when absent), etcd from PATH.
`python tests/kube_cluster.py` starts one by hand and prints its admin kubeconfig.
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy" / "kubernetes"
KUBE_BIN = Path(os.environ.get("DYNMO_KUBE_BIN") or Path.home() / ".cache/dynmo-kube/bin")
RELEASE_SERVICE_ACCOUNT = "dynmo-train"  # bound to the Role in deploy/kubernetes/rbac.yaml
_BINARIES = ("kube-apiserver", "kube-controller-manager")

__all__ = ["KubeCluster", "kube_cluster", "kube_namespace", "ensure_binaries", "free_port"]


# ---- binaries and certificates ------------------------------------------------------------
def ensure_binaries() -> dict[str, str]:
    """Paths of etcd, kube-apiserver and kube-controller-manager. scripts/build_kube.sh
    decides whether the cached binaries will do (instant) or builds them (~7 min once).

    Raises:
        pytest.skip.Exception: the build is impossible here (no apt-get to install its tools).
        RuntimeError: the build ran and failed (its log tail is in the message).
    """
    build = subprocess.run(["bash", str(REPO / "scripts" / "build_kube.sh")], capture_output=True,
                           text=True, env={**os.environ, "DYNMO_KUBE_BIN": str(KUBE_BIN)})
    bins = {b: str(KUBE_BIN / b) for b in _BINARIES if os.access(KUBE_BIN / b, os.X_OK)}
    etcd = shutil.which("etcd")
    if build.returncode == 0 and etcd and len(bins) == 2:
        return {**bins, "etcd": etcd}
    if not shutil.which("apt-get"):
        pytest.skip(f"kube-apiserver is not built in {KUBE_BIN} and cannot be built here: no apt-get "
                    f"to install etcd-server/golang-go (docs/cluster.md): {build.stderr[-300:]}")
    raise RuntimeError(f"scripts/build_kube.sh failed ({build.returncode}):\n{build.stderr[-3000:]}")


def free_port() -> int:
    """A loopback port nobody listens on now (the servers bind it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a serving certificate for 127.0.0.1 signed by it, and the service-account
    signing key pair, as files in `d` (P-256 keys: RSA ones took ~1.5 s of the start)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-days", "2", "-subj", "/CN=dynmo-test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    _openssl("req", *ec, "-subj", "/CN=kube-apiserver", "-keyout", "server.key", "-out", "server.csr", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", "server.crt", cwd=d)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=d)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "{server}", certificate-authority: "{ca_file}"}}
users:
- name: {user}
  user: {{token: "{token}"}}
contexts:
- name: test
  context: {{cluster: test, user: {user}}}
current-context: test
""")
    return path


# ---- the control plane --------------------------------------------------------------------
class KubeCluster:
    """etcd + kube-apiserver + kube-controller-manager, started by `start()`, stopped by
    `stop()` (by the PIDs it recorded), plus helpers the tests use as an admin."""

    def __init__(self, workdir: Path, bins: dict[str, str]):
        self.dir, self.bins = workdir, bins
        self.port = free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.ca_file = workdir / "ca.crt"
        self.admin_token = secrets.token_hex(16)
        self.admin_kubeconfig = workdir / "admin.kubeconfig"
        self._procs: dict[str, subprocess.Popen] = {}
        self._client: Any = None
        self.start_s: float | None = None

    # -- processes
    def start(self) -> None:
        t0 = time.monotonic()
        make_pki(self.dir)
        (self.dir / "tokens.csv").write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        write_kubeconfig(self.admin_kubeconfig, self.server, self.ca_file, self.admin_token, "admin")
        etcd_port, peer_port = free_port(), free_port()
        self._spawn("etcd", [
            self.bins["etcd"], "--data-dir", str(self.dir / "etcd"), "--unsafe-no-fsync",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"])
        d = self.dir
        self._spawn("kube-apiserver", [
            self.bins["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--secure-port={self.port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            "--insecure-port=0", f"--cert-dir={d}", f"--tls-cert-file={d / 'server.crt'}",
            f"--tls-private-key-file={d / 'server.key'}", f"--token-auth-file={d / 'tokens.csv'}",
            "--authorization-mode=RBAC", f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
            "--disable-admission-plugins=ServiceAccount", "--enable-priority-and-fairness=false",
            "--profiling=false"])
        self._wait_ready()
        self._spawn("kube-controller-manager", [
            self.bins["kube-controller-manager"], f"--kubeconfig={self.admin_kubeconfig}",
            "--controllers=statefulset,job,garbagecollector,namespace", "--leader-elect=false",
            "--port=0", "--secure-port=0", "--profiling=false"])
        self.start_s = time.monotonic() - t0

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        (self.dir / f"{name}.pid").write_text(str(self._procs[name].pid))

    def _wait_ready(self, timeout_s: float = 90.0) -> None:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        req = urllib.request.Request(f"{self.server}/readyz",
                                     headers={"Authorization": f"Bearer {self.admin_token}"})
        deadline = time.monotonic() + timeout_s
        while True:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}): {self.log_tail(name)}")
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready in {timeout_s} s: {self.log_tail('kube-apiserver')}")
            time.sleep(0.2)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM each recorded PID (newest first), SIGKILL what is left after 10 s."""
        if self._client is not None:
            self._client.close()
            self._client = None
        for name, p in reversed(list(self._procs.items())):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs.clear()

    # -- clients and credentials
    def api(self) -> Any:
        """The admin's ApiClient (shared; closed by `stop()`)."""
        if self._client is None:
            from kubernetes import client, config

            conf = client.Configuration()
            config.load_kube_config(str(self.admin_kubeconfig), client_configuration=conf)
            self._client = client.ApiClient(conf)
        return self._client

    def create_namespace(self, prefix: str = "t") -> str:
        from kubernetes import client

        stem = re.sub(r"[^a-z0-9-]+", "-", prefix.lower())[:40].strip("-") or "t"
        name = f"{stem}-{secrets.token_hex(3)}"
        client.CoreV1Api(self.api()).create_namespace({"metadata": {"name": name}})
        return name

    def delete_namespace(self, namespace: str) -> None:
        """Ask for deletion; the namespace controller empties it in the background."""
        from kubernetes import client

        client.CoreV1Api(self.api()).delete_namespace(namespace)

    def apply(self, yaml_file: Path, namespace: str) -> None:
        """Create every object of a YAML file in `namespace` (as `kubectl create -n`)."""
        from kubernetes import utils

        utils.create_from_yaml(self.api(), yaml_file=str(yaml_file), namespace=namespace)

    def token_kubeconfig(self, namespace: str, service_account: str) -> Path:
        """A kubeconfig holding a token of `service_account` (TokenRequest API; the service
        account must exist), so calls are authorised by its RoleBindings alone."""
        from kubernetes import client

        tr = client.CoreV1Api(self.api()).create_namespaced_service_account_token(
            service_account, namespace, {"spec": {"expirationSeconds": 3600}})
        path = self.dir / f"{namespace}-{service_account}.kubeconfig"
        return write_kubeconfig(path, self.server, self.ca_file, tr.status.token, service_account)

    def role_kubeconfig(self, namespace: str) -> Path:
        """Apply deploy/kubernetes/rbac.yaml (ServiceAccount, Role, RoleBinding) in
        `namespace` and return a kubeconfig for the service account it binds."""
        self.apply(DEPLOY / "rbac.yaml", namespace)
        return self.token_kubeconfig(namespace, RELEASE_SERVICE_ACCOUNT)

    def unbound_kubeconfig(self, namespace: str, service_account: str = "nobody") -> Path:
        """A kubeconfig for a fresh service account with no RoleBinding at all."""
        from kubernetes import client

        client.CoreV1Api(self.api()).create_namespaced_service_account(
            namespace, {"metadata": {"name": service_account}})
        return self.token_kubeconfig(namespace, service_account)

    # -- workloads (pods never run: there is no kubelet)
    def create_statefulset(self, namespace: str, name: str, replicas: int, gpus: int = 1,
                           wait: bool = True) -> None:
        """A StatefulSet of `replicas` pods labelled app=<name> (Parallel pod management:
        OrderedReady would wait forever for pod 0 to become Ready)."""
        from kubernetes import client

        client.AppsV1Api(self.api()).create_namespaced_stateful_set(namespace, {
            "metadata": {"name": name},
            "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {"app": name}},
                     "template": _pod_template(name, gpus)}})
        if wait:
            self.wait_pods(namespace, f"app={name}", {f"{name}-{i}" for i in range(replicas)})

    def create_job(self, namespace: str, name: str, parallelism: int, gpus: int = 1,
                   wait: bool = True) -> None:
        """An indexed Job (completions = parallelism). Servers before 1.21 drop
        completionMode, so on the 1.20 test server it is a plain parallel Job."""
        from kubernetes import client

        client.BatchV1Api(self.api()).create_namespaced_job(namespace, {
            "metadata": {"name": name},
            "spec": {"parallelism": parallelism, "completions": parallelism,
                     "completionMode": "Indexed",
                     "template": {**_pod_template(name, gpus), "spec": {
                         **_pod_template(name, gpus)["spec"], "restartPolicy": "Never"}}}})
        if wait:
            self.wait_pods(namespace, f"job-name={name}", parallelism)

    def create_pods(self, namespace: str, prefix: str, count: int, gpus: int = 1) -> list[str]:
        """Bare pods <prefix>-0 .. <prefix>-(count-1), owned by no controller."""
        from kubernetes import client

        core = client.CoreV1Api(self.api())
        names = [f"{prefix}-{i}" for i in range(count)]
        for n in names:
            core.create_namespaced_pod(namespace, {"metadata": {"name": n, "labels": {"app": prefix}},
                                                   "spec": _pod_template(prefix, gpus)["spec"]})
        return names

    def replicas(self, namespace: str, name: str) -> int:
        """The StatefulSet's spec.replicas."""
        from kubernetes import client

        return int(client.AppsV1Api(self.api()).read_namespaced_stateful_set(name, namespace).spec.replicas)

    def pod_names(self, namespace: str, selector: str = "") -> set[str]:
        """Names of the pods that exist and are not being deleted."""
        from kubernetes import client

        pods = client.CoreV1Api(self.api()).list_namespaced_pod(namespace, label_selector=selector)
        return {p.metadata.name for p in pods.items if p.metadata.deletion_timestamp is None}

    def wait_pods(self, namespace: str, selector: str, expected: set[str] | int,
                  timeout_s: float = 30.0) -> set[str]:
        """Poll until the pods matching `selector` are `expected` (names, or a count)."""
        def done(names: set[str]) -> bool:
            return len(names) == expected if isinstance(expected, int) else names == expected
        return wait_for(lambda: self.pod_names(namespace, selector), done, timeout_s,
                        f"pods {selector} in {namespace} to be {expected}")

    def events(self, namespace: str, involved_name: str) -> list[Any]:
        from kubernetes import client

        return [e for e in client.CoreV1Api(self.api()).list_namespaced_event(namespace).items
                if e.involved_object.name == involved_name]


def _pod_template(app: str, gpus: int) -> dict:
    return {"metadata": {"labels": {"app": app}},
            "spec": {"containers": [{"name": "trainer", "image": "dynmo-plugin:test",
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def wait_for(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float, what: str) -> Any:
    """Poll `read()` every 0.2 s until `done(value)`; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {value}")
        time.sleep(0.2)


# ---- pytest fixtures ----------------------------------------------------------------------
_shared: dict[str, Any] = {"cluster": None, "users": 0}


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """One control plane per test session (start ~5 s once the binaries exist).

    Each test module that imports this fixture gets its own session-scoped instance
    from pytest; they share one running cluster here, stopped when the last lets go.
    """
    if _shared["cluster"] is None:
        cluster = KubeCluster(Path(tempfile.mkdtemp(prefix="dynmo-kube-")), ensure_binaries())
        atexit.register(_stop, cluster)  # also on an interrupted session
        try:
            cluster.start()
        except BaseException:
            _stop(cluster)
            raise
        _shared["cluster"] = cluster
    _shared["users"] += 1
    try:
        yield _shared["cluster"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            _stop(_shared["cluster"])
            _shared["cluster"] = None


def _stop(cluster: KubeCluster) -> None:
    cluster.stop()
    shutil.rmtree(cluster.dir, ignore_errors=True)


@pytest.fixture
def kube_namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted (in the background) afterwards."""
    ns = kube_cluster.create_namespace(request.node.name.removeprefix("test_")[:30])
    yield ns
    kube_cluster.delete_namespace(ns)


if __name__ == "__main__":
    c = KubeCluster(Path(tempfile.mkdtemp(prefix="dynmo-kube-")), ensure_binaries())
    c.start()
    print(f"ready in {c.start_s:.1f} s; KUBECONFIG={c.admin_kubeconfig} (Ctrl-C stops it)", file=sys.stderr)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
