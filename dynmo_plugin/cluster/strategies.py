"""The release strategies, one function each: (api, target, request) -> Step.

What frees a GPU on Kubernetes is a pod going away; a running pod's resources are
immutable (docs/cluster.md). So the strategies that work remove pods: scaling a
StatefulSet down (its controller deletes the highest ordinals, which are the retired
ranks' pods: survivors are always the lowest), lowering a Job's parallelism, or
deleting named pods that no controller recreates. `patch-pod-resources` does what the
DynMo paper describes and reports the server's refusal (422). A strategy raises
`api.Rejected` / `api.Unreachable` for the caller to turn into an outcome.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from dynmo_plugin.cluster.api import Api, Op, Rejected
from dynmo_plugin.cluster.request import ReleaseRequest
from dynmo_plugin.cluster.target import Target

__all__ = ["ObjectRef", "Step", "STRATEGY_FUNCTIONS", "workload_ref"]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class ObjectRef:
    """The object a release's Event and annotation are about."""

    kind: str
    api_version: str
    resource: str  # RBAC resource for the annotation patch
    group: str
    namespace: str
    name: str
    uid: str | None = None


@dataclass
class Step:
    """One strategy's result, "released" or "rejected", in words."""

    outcome: str
    message: str
    replicas_before: int
    replicas_after: int | None
    record_on: ObjectRef | None = None


def workload_ref(strategy: str, t: Target) -> ObjectRef:
    """Where a strategy's release is recorded: the StatefulSet or Job it shrinks; for the
    pod strategies, pod <name>-0, the survivor that hosts the leader."""
    if strategy == "statefulset-scale":
        return ObjectRef("StatefulSet", "apps/v1", "statefulsets", "apps", t.namespace, t.name)
    if strategy == "job-parallelism":
        return ObjectRef("Job", "batch/v1", "jobs", "batch", t.namespace, t.name)
    return ObjectRef("Pod", "v1", "pods", "", t.namespace, f"{t.name}-0")


def _unchanged(before: int, req: ReleaseRequest, ref: ObjectRef) -> Step:
    return Step("released", f"already at {before} replica(s), not above keep={req.keep}: "
                            "nothing to change (never scales up)", before, before, ref)


def scale_statefulset(api: Api, t: Target, req: ReleaseRequest) -> Step:
    """Patch the scale subresource; the controller deletes ordinals keep..before-1."""
    from kubernetes import client

    apps = client.AppsV1Api(api.client)
    what = f"statefulset {t.namespace}/{t.name}"
    scale = api.call(Op("get", "statefulsets/scale", "apps", what),
                     apps.read_namespaced_stateful_set_scale, t.name, t.namespace)
    before = int(scale.spec.replicas or 0)
    ref = replace(workload_ref("statefulset-scale", t), uid=scale.metadata.uid)
    if before <= req.keep:
        return _unchanged(before, req, ref)
    new = api.call(Op("patch", "statefulsets/scale", "apps", what),
                   apps.patch_namespaced_stateful_set_scale, t.name, t.namespace,
                   {"spec": {"replicas": req.keep}}, _content_type=MERGE_PATCH)
    after = int(new.spec.replicas)
    return Step("released", f"scaled {what} from {before} to {after} replicas; its controller "
                            f"deletes pods {_ordinals(t.name, after, before)}", before, after, ref)


def lower_job_parallelism(api: Api, t: Target, req: ReleaseRequest) -> Step:
    """Lower the Job's parallelism; for an indexed Job whose completions equal its
    parallelism, lower completions too (elastic indexed Job, Kubernetes >= 1.27: the
    controller then removes exactly the indexes >= keep). Servers that keep completions
    immutable answer 422; parallelism alone is lowered then, and the controller picks
    which active pods to delete (the message says so)."""
    from kubernetes import client

    batch = client.BatchV1Api(api.client)
    what = f"job {t.namespace}/{t.name}"
    job = api.call(Op("get", "jobs", "batch", what), batch.read_namespaced_job, t.name, t.namespace)
    before = int(job.spec.parallelism if job.spec.parallelism is not None else 1)
    ref = replace(workload_ref("job-parallelism", t), uid=job.metadata.uid)
    if before <= req.keep:
        return _unchanged(before, req, ref)
    patch = Op("patch", "jobs", "batch", what)
    note = ""
    if getattr(job.spec, "completion_mode", None) == "Indexed" and job.spec.completions == before:
        try:
            new = api.call(patch, batch.patch_namespaced_job, t.name, t.namespace,
                           {"spec": {"parallelism": req.keep, "completions": req.keep}},
                           _content_type=MERGE_PATCH)
            return Step("released", f"lowered parallelism and completions of {what} from {before} "
                                    f"to {req.keep}; its controller removes indexes >= {req.keep}",
                        before, int(new.spec.parallelism), ref)
        except Rejected as e:
            if e.status != 422:
                raise
            note = f"completions cannot change on this server ({e}); "
    new = api.call(patch, batch.patch_namespaced_job, t.name, t.namespace,
                   {"spec": {"parallelism": req.keep}}, _content_type=MERGE_PATCH)
    after = int(new.spec.parallelism)
    return Step("released", f"{note}lowered parallelism of {what} from {before} to {after}; the "
                            "Job controller chooses which active pods to delete", before, after, ref)


def delete_pods(api: Api, t: Target, req: ReleaseRequest) -> Step:
    """Delete pods <name>-keep .. <name>-(current-1). Pods a controller owns are refused
    (it would recreate them, and the GPUs with them): scale their owner instead."""
    from kubernetes import client

    if not req.current:
        return _needs_current("delete-pods", t)
    core = client.CoreV1Api(api.client)
    names = [f"{t.name}-{i}" for i in range(req.keep, req.current)]
    present = []
    for name in names:
        pod = _read_pod(api, core, t.namespace, name)
        if pod is None:
            continue
        owner = next((o for o in pod.metadata.owner_references or [] if o.controller), None)
        if owner is not None:
            return Step("rejected", f"pod {t.namespace}/{name} is managed by {owner.kind} "
                                    f"{owner.name}, which would recreate it: release with "
                                    f"{_owner_strategy(owner.kind)} instead; nothing deleted",
                        req.current, None, workload_ref("delete-pods", t))
        present.append(name)
    for name in present:
        try:
            api.call(Op("delete", "pods", "", f"pod {t.namespace}/{name}"),
                     core.delete_namespaced_pod, name, t.namespace,
                     grace_period_seconds=req.grace_period_s)
        except Rejected as e:
            if e.status != 404:
                raise
    gone = len(names) - len(present)
    return Step("released", f"deleted pods {', '.join(present) or '(none)'}"
                            + (f"; {gone} already gone" if gone else ""),
                req.current, req.keep, workload_ref("delete-pods", t))


def patch_pod_resources(api: Api, t: Target, req: ReleaseRequest) -> Step:
    """Lower the GPU request of the retired pods to 0, as the DynMo paper words it.
    Kubernetes keeps a pod's resources immutable (in-place resize, where it exists,
    covers cpu and memory only), so the server answers 422 and `Rejected` carries it."""
    from kubernetes import client

    if not req.current:
        return _needs_current("patch-pod-resources", t)
    core = client.CoreV1Api(api.client)
    names = [f"{t.name}-{i}" for i in range(req.keep, req.current)]
    for name in names:
        pod = _read_pod(api, core, t.namespace, name)
        if pod is None:
            continue
        containers = [{"name": c.name, "resources": {"limits": dict.fromkeys(_gpu_keys(c), "0"),
                                                     "requests": dict.fromkeys(_gpu_keys(c), "0")}}
                      for c in pod.spec.containers]
        api.call(Op("patch", "pods", "", f"pod {t.namespace}/{name}"), core.patch_namespaced_pod,
                 name, t.namespace, {"spec": {"containers": containers}}, _content_type=STRATEGIC_PATCH)
    return Step("released", f"set the GPU requests of pods {', '.join(names)} to 0",
                req.current, req.keep, workload_ref("patch-pod-resources", t))


def _needs_current(strategy: str, t: Target) -> Step:
    return Step("rejected", f"{strategy} needs the replica count before the release (current) to "
                            f"name the pods {t.name}-<keep> .. to act on; nothing done", 0, None,
                workload_ref(strategy, t))


def _read_pod(api: Api, core, namespace: str, name: str):
    """The pod, or None if it is already gone."""
    try:
        return api.call(Op("get", "pods", "", f"pod {namespace}/{name}"),
                        core.read_namespaced_pod, name, namespace)
    except Rejected as e:
        if e.status == 404:
            return None
        raise


def _gpu_keys(container) -> list[str]:
    limits = (container.resources.limits if container.resources else None) or {}
    return [k for k in limits if k.endswith("/gpu")] or [GPU_RESOURCE]


def _owner_strategy(kind: str) -> str:
    return {"StatefulSet": "statefulset-scale", "Job": "job-parallelism"}.get(kind, f"its {kind}")


def _ordinals(name: str, lo: int, hi: int) -> str:
    return f"{name}-{lo}" if hi - lo == 1 else f"{name}-{lo} .. {name}-{hi - 1}"


STRATEGY_FUNCTIONS: dict[str, Callable[[Api, Target, ReleaseRequest], Step]] = {
    "statefulset-scale": scale_statefulset,
    "job-parallelism": lower_job_parallelism,
    "delete-pods": delete_pods,
    "patch-pod-resources": patch_pod_resources,
}
