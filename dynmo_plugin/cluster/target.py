"""Which workload to shrink: namespace and name from the config, else from the pod itself.

A training pod learns its own name and namespace from downward-API env (POD_NAME,
POD_NAMESPACE, see deploy/kubernetes/statefulset.yaml); its StatefulSet is the pod name
without the ordinal (train-3 -> train), an indexed Job's the name without index and
random suffix (train-3-x7k2p -> train). A config value always wins.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["Target", "resolve_target", "SERVICE_ACCOUNT_NAMESPACE"]

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_STATEFULSET_POD = re.compile(r"^(?P<name>.+)-\d+$")
_JOB_POD = re.compile(r"^(?P<name>.+)-\d+-[a-z0-9]{5}$")


@dataclass(frozen=True)
class Target:
    """The workload a release acts on; `problem` says why it is unusable (else "")."""

    namespace: str
    name: str
    problem: str = ""


def workload_name(pod_name: str) -> str:
    """The StatefulSet or indexed Job that owns a pod of this name ("" if unrecognisable)."""
    for pattern in (_JOB_POD, _STATEFULSET_POD):
        m = pattern.match(pod_name)
        if m:
            return m["name"]
    return ""


def resolve_target(namespace: str, name: str, env: Mapping[str, str] | None = None,
                   sa_namespace_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> Target:
    """Namespace: config, POD_NAMESPACE, the service account's; name: config, else from
    POD_NAME. Never raises: what is missing goes into `Target.problem`."""
    env = os.environ if env is None else env
    ns = namespace or env.get("POD_NAMESPACE", "")
    if not ns:
        try:
            ns = sa_namespace_file.read_text().strip()
        except OSError:
            ns = ""
    pod = env.get("POD_NAME", "")
    nm = name or workload_name(pod)
    missing = []
    if not ns:
        missing.append("namespace (set cluster.namespace, or POD_NAMESPACE from the downward API)")
    if not nm:
        missing.append("name (set cluster.name, or POD_NAME from the downward API"
                       + (f"; cannot derive it from POD_NAME={pod!r})" if pod else ")"))
    return Target(ns, nm, "no " + " and no ".join(missing) if missing else "")
