"""DP redistribution: the planner (pure) evens replica workloads without losing documents;
route/reverse_route on 2 gloo ranks (uneven splits) give back losses and gradients
exactly."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from launch import free_port

from dynmo_plugin.data.redistribute import plan_redistribution, replica_workloads
from dynmo_plugin.data.route import reverse_route, route


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.lists(st.lists(st.integers(1, 40), max_size=4), min_size=2, max_size=3),
                        min_size=1, max_size=4))
def test_planner_keeps_documents_and_caps_and_never_raises_the_peak(lengths):
    groups, length, sid = [], {}, 0
    for mb in lengths:
        row = []
        for docs in mb:
            ids = []
            for n in docs:
                length[sid] = n
                ids.append(sid)
                sid += 1
            row.append(ids)
        dp = max(len(m) for m in lengths)
        groups.append(row + [[] for _ in range(dp - len(row))])
    w = lambda n: float(n * n)  # noqa: E731
    new, moves = plan_redistribution(groups, length, w, max_seqlen=160)
    flat = lambda g: sorted(s for mb in g for ids in mb for s in ids)  # noqa: E731
    assert flat(new) == flat(groups)
    assert all(sum(length[s] for s in ids) <= max(160, sum(length[s] for s in old))
               for mb, omb in zip(new, groups) for ids, old in zip(mb, omb))
    assert max(replica_workloads(new, length, w)) <= max(replica_workloads(groups, length, w))


def _ranks(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        gen = torch.Generator().manual_seed(rank)
        n = 5 if rank == 0 else 2                      # uneven: 5 rows here, 2 there
        x = torch.randn(n, 3, generator=gen, requires_grad=True)
        dest = torch.tensor([1, 0, 1, 1, 0][:n]) if rank == 0 else torch.tensor([0, 0])
        moved, routing = route(x, dest)
        per_row = (moved ** 2).sum(1) * (1 + dist.get_rank())   # "losses" where rows landed
        back = reverse_route(per_row, routing)
        scale = torch.tensor([1 + int(d) for d in dest], dtype=x.dtype)
        assert torch.equal(back, (x.detach() ** 2).sum(1) * scale)   # exact: same ops
        back.sum().backward()
        assert torch.equal(x.grad, 2 * x.detach() * scale[:, None])
    finally:
        dist.destroy_process_group()


def test_route_then_reverse_returns_losses_and_gradients_exactly():
    mp.spawn(_ranks, args=(free_port(),), nprocs=2)
