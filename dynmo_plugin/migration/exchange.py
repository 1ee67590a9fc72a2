"""Move packed layers between pipeline stages: headers on the control plane, data by p2p.

Every rank learns all headers through one all-gather on the control plane (no pairwise
ordering, so no deadlock however moves cross), then posts all its sends and receives
in one batch_isend_irecv on the pipeline group and waits for them with a timeout.
Groups are passed in explicitly; peers are the global ranks of the source and
destination stages.
"""
from __future__ import annotations

import datetime
import torch
import torch.distributed as dist

from dynmo_plugin.migration.result import MigrationError
from dynmo_plugin.migration.wire import Header

__all__ = ["exchange_headers", "exchange_buffers", "TransferError", "TIMEOUT_MARK"]

TIMEOUT_MARK = "[transfer timed out]"


class TransferError(MigrationError):
    """A point-to-point transfer failed or timed out; the message names the peers."""


def exchange_headers(outgoing: list[Header], control, pp_ranks: list[int]) -> list[Header]:
    """All headers of this rank's pipeline (global ranks `pp_ranks`, in stage order)."""
    gathered = control.all_gather(outgoing, "headers")
    return [h for r in pp_ranks for h in gathered[r]]


def exchange_buffers(headers: list[Header], sending: dict[int, list[torch.Tensor]], my_stage: int,
                     pp_group, timeout_s: float, receive_into: dict[int, list[torch.Tensor]]
                     ) -> dict[int, list[torch.Tensor]]:
    """Send this stage's packed layers and receive the ones addressed to it, into
    `receive_into` ({layer: buffers}, from a StagingPool or `empty_buffers`).

    Allocates nothing: the caller allocates the receive buffers and agrees with every
    rank that all allocations succeeded BEFORE calling this. Allocating here, after the
    peers posted their sends, would leave them waiting on a rank that failed (on NCCL
    until the watchdog kills the job).

    Returns {layer: received buffers}.

    Raises:
        TransferError: a transfer failed; its message starts with TIMEOUT_MARK when it
            timed out (the operation then stays pending: torch cannot cancel it).
    """
    ops, received, peers = [], {}, set()
    for h in headers:
        if h.src == my_stage:
            peer = dist.get_global_rank(pp_group, h.dst)
            ops += [dist.P2POp(dist.isend, b, peer, group=pp_group) for b in sending[h.layer]]
        elif h.dst == my_stage:
            peer = dist.get_global_rank(pp_group, h.src)
            received[h.layer] = receive_into[h.layer]
            ops += [dist.P2POp(dist.irecv, b, peer, group=pp_group) for b in received[h.layer]]
        else:
            continue
        peers.add(peer)
    if not ops:
        return received
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        mark = TIMEOUT_MARK + " " if "timed out" in str(e).lower() or "timeout" in str(e).lower() else ""
        raise TransferError(f"{mark}p2p with rank(s) {sorted(peers)} failed: {first}") from e
    return received
