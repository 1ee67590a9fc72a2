"""Move packed layers between pipeline stages: headers by one collective, data by p2p.

Every rank of the pipeline group learns all headers through one all_gather_object (no
pairwise ordering, so no deadlock however moves cross), then posts all its sends and
receives in one batch_isend_irecv and waits for them with a timeout. Groups are passed
in explicitly; peers are the global ranks of the source and destination stages.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from dynmo_plugin.migration.wire import Header, empty_buffers

__all__ = ["exchange_headers", "exchange_buffers"]


def exchange_headers(outgoing: list[Header], pp_group) -> list[Header]:
    """All headers of this migration, on every rank of the pipeline group."""
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, outgoing, group=pp_group)
    return [h for part in gathered for h in part]


def exchange_buffers(headers: list[Header], sending: dict[int, list[torch.Tensor]], my_stage: int,
                     pp_group, device: torch.device, timeout_s: float) -> dict[int, list[torch.Tensor]]:
    """Send this stage's packed layers and receive the ones addressed to it.

    Returns {layer: received buffers}. Raises on a failed or timed-out transfer.
    """
    ops, received = [], {}
    for h in headers:
        if h.src == my_stage:
            peer = dist.get_global_rank(pp_group, h.dst)
            ops += [dist.P2POp(dist.isend, b, peer, group=pp_group) for b in sending[h.layer]]
        elif h.dst == my_stage:
            peer = dist.get_global_rank(pp_group, h.src)
            received[h.layer] = empty_buffers(h, device)
            ops += [dist.P2POp(dist.irecv, b, peer, group=pp_group) for b in received[h.layer]]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    return received
