"""Leaving a trace in the cluster: a Kubernetes Event and an annotation on the workload.

`kubectl describe statefulset train` then shows what was released, when and why, next
to the controller's own events; the annotation keeps the last release on the object
itself. Both are best effort: a failure is reported in the outcome, never raised.
"""
from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone

from dynmo_plugin.cluster.api import Api, Op, Rejected, Unreachable
from dynmo_plugin.cluster.strategies import MERGE_PATCH, ObjectRef

__all__ = ["ANNOTATION", "EVENT_REASONS", "record"]

ANNOTATION = "dynmo-plugin/last-release"
EVENT_REASONS = {"released": "DynmoReleasedGPUs", "rejected": "DynmoReleaseRejected"}
_COMPONENT = "dynmo-plugin"
_MAX_MESSAGE = 1024


def record(api: Api, ref: ObjectRef, summary: dict) -> dict[str, str]:
    """Create the Event and patch the annotation; returns what happened to each.

    summary: the outcome's fields (strategy, outcome, message, reason, released_ranks,
    replicas_before/after); the annotation holds it as JSON.
    """
    return {"event": _event(api, ref, summary), "annotation": _annotate(api, ref, summary)}


def _event(api: Api, ref: ObjectRef, summary: dict) -> str:
    from kubernetes import client

    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    ranks = summary["released_ranks"]
    text = (f"{summary['strategy']}: {summary['outcome']}: {summary['message']}; ranks "
            f"{_ranks(ranks)} retired; why: {summary['reason'] or 'not given'}")
    body = {
        "metadata": {"generateName": f"{ref.name}.dynmo-", "namespace": ref.namespace},
        "involvedObject": {"kind": ref.kind, "apiVersion": ref.api_version, "name": ref.name,
                           "namespace": ref.namespace, **({"uid": ref.uid} if ref.uid else {})},
        "reason": EVENT_REASONS[summary["outcome"]],
        "message": text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "...",
        "type": "Normal" if summary["outcome"] == "released" else "Warning",
        "source": {"component": _COMPONENT},
        "reportingComponent": _COMPONENT,
        "reportingInstance": os.environ.get("POD_NAME") or socket.gethostname(),
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    core = client.CoreV1Api(api.client)
    try:
        event = api.call(Op("create", "events", "", f"event in {ref.namespace}"),
                         core.create_namespaced_event, ref.namespace, body)
    except (Rejected, Unreachable) as e:
        return f"not recorded: {e}"
    return f"Event {ref.namespace}/{event.metadata.name} on {ref.kind} {ref.name}"


def _annotate(api: Api, ref: ObjectRef, summary: dict) -> str:
    from kubernetes import client

    value = json.dumps({**summary, "released_ranks": list(summary["released_ranks"]),
                        "time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")})
    body = {"metadata": {"annotations": {ANNOTATION: value}}}
    method = {"StatefulSet": lambda: client.AppsV1Api(api.client).patch_namespaced_stateful_set,
              "Job": lambda: client.BatchV1Api(api.client).patch_namespaced_job,
              "Pod": lambda: client.CoreV1Api(api.client).patch_namespaced_pod}[ref.kind]()
    what = f"{ref.kind.lower()} {ref.namespace}/{ref.name}"
    try:
        api.call(Op("patch", ref.resource, ref.group, what), method, ref.name, ref.namespace, body,
                 _content_type=MERGE_PATCH)
    except (Rejected, Unreachable) as e:
        return f"not recorded: {e}"
    return f"{ANNOTATION} on {ref.kind} {ref.namespace}/{ref.name}"


def _ranks(ranks) -> str:
    """[8, 9, 10, 11] -> "8-11"; short lists as they are."""
    ranks = sorted(ranks)
    if not ranks:
        return "(none given)"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
