"""Moving rows (tokens of whole documents) between DP replicas and back, with autograd.

One `all_to_all_single` (torch.distributed.nn's autograd version, which works on gloo
with uneven splits) sends each row to its destination rank; `reverse_route` undoes it
(e.g. per-token losses computed where a document was moved go back to the rank that
owns the document), and gradients flow back through both. Split sizes are exchanged
first with one small all_to_all_single of counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

__all__ = ["Routing", "route", "reverse_route"]


@dataclass
class Routing:
    order: torch.Tensor        # local rows sorted by destination
    send: list[int]            # rows sent to each rank
    recv: list[int]            # rows received from each rank


def route(rows: torch.Tensor, dest: torch.Tensor, group=None) -> tuple[torch.Tensor, Routing]:
    """Send row i of `rows` to rank dest[i] of `group`; returns (received rows, routing).
    Received rows come grouped by source rank, each source's rows in their order."""
    world = dist.get_world_size(group)
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=world).to(torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_l, recv_l = send.tolist(), recv.tolist()
    out = rows.new_empty((sum(recv_l), *rows.shape[1:]))
    out = all_to_all_single(out, rows[order].contiguous(), recv_l, send_l, group=group)
    return out, Routing(order, send_l, recv_l)


def reverse_route(rows: torch.Tensor, routing: Routing, group=None) -> torch.Tensor:
    """The inverse of `route`: rows received there go back, in their original order."""
    back = rows.new_empty((sum(routing.send), *rows.shape[1:]))
    back = all_to_all_single(back, rows.contiguous(), routing.send, routing.recv, group=group)
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(len(routing.order))
    return back[inverse]
