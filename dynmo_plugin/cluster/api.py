"""Calls to the Kubernetes API with bounded retries, and answers turned into plain words.

Every call names the RBAC verb and resource it needs (`Op`), so a 403 can say exactly
what the Role lacks. 409, 429 and 5xx answers and connection failures are retried up to
`retries` attempts per call, the delay doubling from `backoff_s` (a 429's Retry-After
wins when longer, capped); any other 4xx is the server's final word (`Rejected`). The
`kubernetes` package is imported here, lazily, so `import dynmo_plugin.cluster` stays
cheap for training processes that never release anything.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Op", "Api", "Rejected", "Unreachable", "connect", "check_kubeconfig", "check_named_kubeconfig", "RETRYABLE"]

log = logging.getLogger(__name__)

RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})
_MAX_DELAY_S = 30.0


@dataclass(frozen=True)
class Op:
    """One API call as RBAC sees it: `verb` on `resource` (group "" is core)."""

    verb: str
    resource: str
    group: str
    what: str  # the object, for messages: "statefulset ns/train"

    def rbac(self) -> str:
        group = self.group or '"" (core)'
        return f'verb "{self.verb}" on resource "{self.resource}" in API group {group}'


class Rejected(Exception):
    """The server answered no (a 4xx other than 409/429): retrying cannot help."""

    def __init__(self, op: Op, status: int, message: str):
        super().__init__(message)
        self.op, self.status = op, status


class Unreachable(Exception):
    """No usable answer within the retries: no connection, or only 409/429/5xx."""

    def __init__(self, op: Op, status: int, message: str):
        super().__init__(message)
        self.op, self.status = op, status


def connect(kubeconfig: str) -> Any:
    """An ApiClient of its own (the package's global default is left alone): the given
    kubeconfig file, else in-cluster config inside a pod, else $KUBECONFIG or
    ~/.kube/config. urllib3's own retries are off: `Api.call` does the retrying.

    Raises:
        kubernetes.config.ConfigException, OSError: no usable configuration.
    """
    from kubernetes import client, config

    conf = client.Configuration()
    if kubeconfig:
        kubeconfig = os.path.expanduser(kubeconfig)  # `~/.kube/config` in a YAML, as kubectl reads it
        check_kubeconfig([kubeconfig], "--kubeconfig")
        config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=conf)
    else:
        env = os.environ.get("KUBECONFIG", "")
        paths = [p for p in env.split(os.pathsep) if p] or [os.path.expanduser("~/.kube/config")]
        check_kubeconfig(paths, "$KUBECONFIG" if env else "~/.kube/config")
        config.load_kube_config(client_configuration=conf)
    conf.retries = False
    return client.ApiClient(conf)


def check_named_kubeconfig(path: str, where: str) -> None:
    """A kubeconfig the user named (`--kubeconfig`, `cluster.kubeconfig`) is read before
    anything runs: a bad one is bad input, not a failed release at the first event.

    Raises:
        ValueError: one line that starts with `where`.
    """
    full = os.path.expanduser(path)  # as the kubernetes client reads it
    if os.path.islink(full) and not os.path.exists(full):
        raise ValueError(f"{where}: kubeconfig {path} is a symbolic link to {os.readlink(full)}, which "
                         "does not exist; give the kubeconfig file")
    if not os.path.exists(full):
        raise ValueError(f"{where}: kubeconfig {path} does not exist; give the kubeconfig file, or "
                         "leave it out (in-cluster config, else $KUBECONFIG)")
    check_kubeconfig([full], where)


def check_kubeconfig(paths: list[str], source: str) -> None:
    """Name what the kubernetes client would trip over with a Python error ("list
    indices must be integers"): no file at all, a directory, or a file that is not a
    YAML mapping. Reads the files only: no cluster is contacted.

    Raises:
        ValueError: the problem and where the path came from, in one line.
    """
    import yaml

    for path in paths:
        if os.path.isdir(path):
            raise ValueError(f"{path} ({source}) is a directory; give the kubeconfig file "
                             f"(e.g. {os.path.join(path, 'config')})")
    present = [p for p in paths if os.path.isfile(p)]
    if not present:
        raise ValueError(f"no kubeconfig at {', '.join(paths)} ({source}) and not inside a pod; "
                         "give --kubeconfig FILE or set KUBECONFIG")
    for path in present:
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{path} ({source}): not a readable kubeconfig: {_why(e)}; "
                             "fix or replace the file") from e
        if data is None and len(present) == 1:
            raise ValueError(f"{path} ({source}) is empty; a kubeconfig holds apiVersion, "
                             "clusters, contexts and users")
        if data is not None and not isinstance(data, dict):
            raise ValueError(f"{path} ({source}): a kubeconfig is a mapping (apiVersion, clusters, "
                             f"contexts, users), this file holds a {type(data).__name__}")
        why = _unusable(data, os.path.dirname(path)) if isinstance(data, dict) and len(present) == 1 else None
        if why:
            raise ValueError(f"{path} ({source}): {why}")


def _unusable(data: dict, base: str) -> str | None:
    """What the kubernetes client's loader would refuse in a kubeconfig of one file
    ("Invalid kube-config file. Expected key current-context", "File does not exist"),
    read from the mapping and the files it names: no cluster, identity provider or exec
    plugin is asked. Several files merge ($KUBECONFIG=a:b) and are left to the loader."""
    name = data.get("current-context")
    if not name:
        return "has no current-context; set one (kubectl config use-context NAME)"
    context = _named(data.get("contexts"), name)
    if context is None:
        return f"its current-context {name!r} is not among its contexts"
    cluster_name = (context.get("context") or {}).get("cluster")
    cluster = _named(data.get("clusters"), cluster_name)
    if cluster is None:
        return f"context {name!r} names cluster {cluster_name!r}, which the file does not hold"
    if not (cluster.get("cluster") or {}).get("server"):
        return f"cluster {cluster_name!r} has no server"
    user = _named(data.get("users"), (context.get("context") or {}).get("user")) or {}
    for where, entry, key in (("cluster", cluster.get("cluster") or {}, "certificate-authority"),
                              ("user", user.get("user") or {}, "client-certificate"),
                              ("user", user.get("user") or {}, "client-key"),
                              ("user", user.get("user") or {}, "tokenFile")):
        file = entry.get(key)
        if isinstance(file, str) and file and not os.path.isfile(os.path.join(base, file)):
            return f"its {where}'s {key} {file} does not exist (paths are relative to the kubeconfig)"
    return None


def _named(entries, name) -> dict | None:
    """The entry of a kubeconfig list (contexts, clusters) called `name`."""
    if not isinstance(entries, list):
        return None
    return next((e for e in entries if isinstance(e, dict) and e.get("name") == name), None)


def _why(e: Exception) -> str:
    """An OSError's or YAML error's gist in one line, with the line of the file it is on."""
    mark = getattr(e, "problem_mark", None)
    if getattr(e, "problem", None) and mark is not None:
        return f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
    text = getattr(e, "strerror", None) or str(e)
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class Api:
    """An ApiClient plus the retry policy and the record of every status seen."""

    client: Any
    retries: int
    backoff_s: float
    timeout_s: float
    status_codes: list[int] = field(default_factory=list)
    sleep: Callable[[float], None] = time.sleep

    @property
    def attempts(self) -> int:
        return len(self.status_codes)

    def call(self, op: Op, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` (a generated client method) with retries; returns its
        data.

        Raises:
            Rejected: a final 4xx answer; the message names the RBAC verb for a 403.
            Unreachable: `retries` attempts without an answer that is not retryable.
        """
        with_info = getattr(method.__self__, method.__name__ + "_with_http_info")
        retries = max(1, self.retries)
        for attempt in range(1, retries + 1):
            answer = self._attempt(with_info, args, kwargs)
            if 200 <= answer.status < 300:
                return answer.data
            if answer.status not in RETRYABLE and answer.status != 0:
                raise Rejected(op, answer.status, describe(op, answer.status, answer.detail))
            log.warning("cluster: %s %s: %s (attempt %d of %d)", op.verb, op.what,
                        answer.short(), attempt, retries)
            if attempt < retries:
                backoff = min(self.backoff_s * 2 ** (attempt - 1), _MAX_DELAY_S)
                self.sleep(max(answer.retry_after_s or 0.0, backoff))
        raise Unreachable(op, answer.status, f"{op.verb} {op.what}: no usable answer after "
                                             f"{retries} attempt(s); last: {answer.short()}")

    def _attempt(self, with_info: Callable[..., Any], args: tuple, kwargs: dict) -> _Answer:
        """One request; its status (0: no connection or a timeout) joins `status_codes`."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = with_info(*args, _request_timeout=self.timeout_s, **kwargs)
        except ApiException as e:
            answer = _Answer(int(e.status or 0), None, server_message(e.body) or str(e.reason),
                             _retry_after(e.headers))
        except (HTTPError, OSError) as e:
            answer = _Answer(0, None, f"{type(e).__name__}: {e}")
        else:  # (data, status, headers), or an ApiResponse in other client generations
            data, status = response[:2] if isinstance(response, tuple) else (response.data,
                                                                             response.status_code)
            answer = _Answer(int(status), data)
        self.status_codes.append(answer.status)
        return answer


@dataclass
class _Answer:
    status: int
    data: Any
    detail: str = ""
    retry_after_s: float | None = None

    def short(self) -> str:
        text = self.detail if len(self.detail) <= 200 else self.detail[:197] + "..."
        return f"{self.status or 'no connection'}: {text}"


def server_message(body: Any, limit: int = 500) -> str:
    """The server's own words: the `message` of a Kubernetes Status body (else the body),
    first line only: a 422 on a pod appends a multi-line diff of the whole PodSpec."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if not body:
        return ""
    try:
        text = str(json.loads(body).get("message") or body)
    except (ValueError, AttributeError):
        text = str(body)
    text = text.strip().splitlines()[0] if text.strip() else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(op: Op, status: int, detail: str) -> str:
    """A final 4xx in plain words; a 403 names what the Role must grant."""
    head = f"{op.verb} {op.what}: {status}"
    if status == 403:
        return f"{head} Forbidden: the service account lacks {op.rbac()}; server: {detail}"
    if status == 401:
        return f"{head} Unauthorized: the credentials were not accepted; server: {detail}"
    if status == 404:
        return f"{head} Not Found: server: {detail}"
    if status == 422:
        return f"{head} Unprocessable: the server refused the change; server: {detail}"
    return f"{head}: server: {detail}"


def _retry_after(headers: Any) -> float | None:
    """A Retry-After header in seconds (the delta form, which the API server sends)."""
    try:
        value = float((headers or {}).get("Retry-After"))
    except (TypeError, ValueError):
        return None
    return min(max(value, 0.0), _MAX_DELAY_S)
