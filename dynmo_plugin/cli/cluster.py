"""`dynmo cluster release`: give GPUs back to Kubernetes by hand, as a repack would.

    dynmo cluster release --strategy statefulset-scale --namespace ml --name train --keep 2
                          [--current 4] [--kubeconfig F] [--fallback S] [--retries R]
                          [--ranks 16-31] [--reason TEXT] [--grace-period S] [--json]

Keeps replicas 0 .. KEEP-1 (pods NAME-0 .. NAME-(KEEP-1)) and releases the rest with the
strategy; if the server rejects it, the fallback runs. Records a Kubernetes Event and
the annotation dynmo-plugin/last-release on the workload. --current is required by
delete-pods and patch-pod-resources (they act on pods NAME-KEEP .. NAME-(CURRENT-1));
statefulset-scale and job-parallelism read it from the server.

Exit status: 0 released; 2 bad input; 3 failed (API unreachable, or only 409/429/5xx
within the retries); 4 rejected by the server (the message quotes it; with a fallback,
both were); 5 only logged (strategy none).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from typing import Any

from dynmo_plugin.cli._output import show, third_party_output_to_stderr
from dynmo_plugin.cluster.release import STRATEGIES
from dynmo_plugin.errors import UserError

__all__ = ["add_parser", "run"]

_NEEDS_CURRENT = ("delete-pods", "patch-pod-resources")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_MAX_REPLICAS = 100_000


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("cluster", help="release GPUs to the cluster scheduler (Kubernetes)",
                              description=__doc__.splitlines()[0])
    actions = p.add_subparsers(dest="cluster_command", required=True, metavar="{release}")
    r = actions.add_parser("release", help="shrink a StatefulSet/Job or delete pods above --keep",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--strategy", required=True, choices=STRATEGIES)
    r.add_argument("--namespace", required=True, help="namespace of the workload")
    r.add_argument("--name", required=True, help="StatefulSet/Job name (pod prefix for the pod strategies)")
    r.add_argument("--keep", required=True, type=int, help="replicas to keep (>= 1; the lowest ordinals)")
    r.add_argument("--current", type=int, default=0, help="replicas now (default: the server's count)")
    r.add_argument("--kubeconfig", default="", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    r.add_argument("--fallback", default="none", choices=STRATEGIES, help="strategy to run if the server rejects the first (none: no fallback)")
    r.add_argument("--retries", type=int, default=5, help="attempts per API call on 409/429/5xx/unreachable")
    r.add_argument("--backoff-s", type=float, default=0.5, help="first retry delay, doubling (0.5)")
    r.add_argument("--timeout-s", type=float, default=10.0, help="seconds per API request (10)")
    r.add_argument("--grace-period", type=int, default=None,
                   help="delete-pods: termination grace period in seconds (default: the pod's own)")
    r.add_argument("--ranks", default="", help="released training ranks for the record, e.g. 16-31 or 4,5")
    r.add_argument("--reason", default="operator request (dynmo cluster release)", help="why, for the record")
    r.add_argument("--json", action="store_true", help="print the outcome as one JSON document")
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynmo_plugin.cluster import ReleaseRequest, exit_status, release
    from dynmo_plugin.config import ClusterConfig

    _check(args)
    cfg = ClusterConfig(strategy=args.strategy, fallback=args.fallback, namespace=args.namespace,
                        name=args.name, kubeconfig=args.kubeconfig, retries=args.retries,
                        backoff_s=args.backoff_s, timeout_s=args.timeout_s)
    request = ReleaseRequest(keep=args.keep, current=args.current, released_ranks=parse_ranks(args.ranks),
                             reason=args.reason, grace_period_s=args.grace_period)
    release_log = logging.getLogger("dynmo_plugin.cluster.release")
    level, release_log.level = release_log.level, logging.ERROR  # the outcome is printed below
    try:
        with third_party_output_to_stderr():
            outcome = release(cfg, request, env={})  # the operator's flags, never this shell's POD_*
    finally:
        release_log.setLevel(level)
    if args.json:
        print(json.dumps(outcome.to_dict()))
    else:
        print(outcome)
        for what, result in outcome.recorded.items():
            print(f"  {what}: {result}")
    return exit_status(outcome)


def _check(args: argparse.Namespace) -> None:
    """Every flag the release cannot use, as a UserError naming it.

    Raises:
        UserError: a bad name, count, delay or kubeconfig path.
    """
    if not _DNS_LABEL.match(args.namespace):
        raise UserError(f"--namespace {show(args.namespace)}: not a Kubernetes namespace name "
                        "(lower-case letters, digits and '-', at most 63)")
    if not _DNS_SUBDOMAIN.match(args.name):
        raise UserError(f"--name {show(args.name)}: not a Kubernetes object name "
                        "(lower-case letters, digits, '-' and '.')")
    for flag, value, low in (("--keep", args.keep, 1), ("--current", args.current, 0),
                             ("--retries", args.retries, 1)):
        if not low <= value <= _MAX_REPLICAS:
            raise UserError(f"{flag} {value}: expected an integer from {low} to {_MAX_REPLICAS}")
    if args.current and args.current <= args.keep:
        raise UserError(f"--keep {args.keep} with --current {args.current}: nothing to release; "
                        "--keep must be below --current")
    if not args.current and (args.strategy in _NEEDS_CURRENT or args.fallback in _NEEDS_CURRENT):
        used = args.strategy if args.strategy in _NEEDS_CURRENT else args.fallback
        raise UserError(f"{used} needs --current: it acts on pods {args.name}-{args.keep} .. "
                        f"{args.name}-(CURRENT-1)")
    for flag, value in (("--backoff-s", args.backoff_s), ("--timeout-s", args.timeout_s)):
        if not 0 <= value <= 3600 or (flag == "--timeout-s" and value == 0):
            raise UserError(f"{flag} {value}: expected seconds in (0, 3600]"
                            if flag == "--timeout-s" else f"{flag} {value}: expected seconds in [0, 3600]")
    if args.grace_period is not None and not 0 <= args.grace_period <= 86_400:
        raise UserError(f"--grace-period {args.grace_period}: expected seconds from 0 to 86400")
    if args.kubeconfig:
        from dynmo_plugin.cluster.api import check_named_kubeconfig
        try:  # read now: a bad file is bad input (exit 2), not a failed release (exit 3)
            check_named_kubeconfig(args.kubeconfig, "--kubeconfig")
        except ValueError as e:
            raise UserError(str(e)) from e


def parse_ranks(text: str) -> tuple[int, ...]:
    """"16-19,24" -> (16, 17, 18, 19, 24).

    Raises:
        UserError: anything else.
    """
    ranks: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d{1,6})(?:-(\d{1,6}))?", part)
        if not m or (m[2] and int(m[2]) < int(m[1])):
            raise UserError(f"--ranks {show(text)}: expected ranks like 16-31 or 4,5,6")
        ranks.extend(range(int(m[1]), int(m[2] or m[1]) + 1))
    if len(ranks) > _MAX_REPLICAS:
        raise UserError(f"--ranks {show(text)}: more than {_MAX_REPLICAS} ranks")
    return tuple(ranks)
