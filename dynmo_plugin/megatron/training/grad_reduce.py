"""A data-parallel gradient reduction whose bits do not depend on where a gradient sits.

Megatron's DDP reduces each bucket of a stage's gradient buffer with one all-reduce
(with the distributed optimizer, one reduce-scatter) over the data-parallel group. The
ring algorithms of NCCL and gloo cut the buffer into chunks and start each chunk's sum at
another rank, so an element is summed in an order set by its offset in the buffer. A
migration changes which layers a stage holds, and with them every later gradient's
offset: at DP >= 3 (at DP 2 the one addition commutes) the reduced gradients' last bits
change, and a moved run parts from the never-moved one (measured, the launcher at PP 2 x
DP 3, a layer moved at iteration 3: iteration 4's loss 5.509746075 against 5.509746154).

Here a bucket is reduced in three steps, each element in data-parallel rank order:
1. an all_to_all hands rank r chunk r of every rank's bucket (chunk r is the shard the
   distributed optimizer gives rank r);
2. rank r sums them, g_0 + g_1 + ... + g_{P-1}, one elementwise kernel per rank, so
   each element's sum is a function of its P values alone;
3. for an all-reduce, an in-place all_gather of the summed chunks (a bucket whose size
   is no multiple of P also gathers its last < P elements and sums them on every rank).
The bytes on the wire are a ring all-reduce's (a reduce-scatter and an all-gather). The
temporaries: the all_to_all's send and receive buffers, in slices of at most `SLICE`
elements per rank when the reduction runs synchronously; with --overlap-grad-reduce a
bucket's slices are all in flight at once (twice the bucket), and a bucket group still in
flight is finished when the next one starts, so at most two groups' temporaries live.

`install()` replaces `_ParamAndGradBucketGroup.start_grad_sync` (Megatron-Core's
param_and_grad_buffer); the replacement takes Megatron's own path where the order cannot
matter or this module does not reach: a group of <= 2 ranks, several distributed-optimizer
instances (their second all-reduce), `reduce_scatter_with_fp32_accumulation` (Megatron's
own all_to_all). The launcher installs it unless --dynmo-native-grad-reduce, Megatron-LM's
integration with --dynmo alike; `megatron_lm.disable()` uninstalls it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["install", "uninstall", "reduce_scatter", "all_reduce", "SLICE"]

SLICE = 1 << 24  # elements per rank's share of one synchronous all_to_all slice
_original = None
_in_flight: list["_Reduction"] = []  # started with --overlap-grad-reduce, not yet finished


def install() -> None:
    """Megatron's DDP buckets reduce in rank order (module docstring). Idempotent."""
    global _original
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    if _original is None:
        _original = _ParamAndGradBucketGroup.start_grad_sync
        _ParamAndGradBucketGroup.start_grad_sync = _start_grad_sync


def uninstall() -> None:
    """Megatron's own `start_grad_sync` again. Idempotent."""
    global _original
    if _original is None:
        return
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    _ParamAndGradBucketGroup.start_grad_sync = _original
    _original = None
    _in_flight.clear()


def reduce_scatter(data: torch.Tensor, group, average: bool = False, async_op: bool = False):
    """Rank r's chunk r of the flat `data` (its numel a multiple of the group size) becomes
    the rank-ordered sum of every rank's chunk r (`average`: divided by the group size);
    the other chunks are left as they were. Returns the pending reduction (`finish()`)
    when `async_op`, else None."""
    return _start(data, group, gather=False, average=average, async_op=async_op)


def all_reduce(data: torch.Tensor, group, average: bool = False, async_op: bool = False):
    """The flat `data` becomes the rank-ordered sum of every rank's `data` (`average`:
    divided by the group size). Returns the pending reduction when `async_op`, else None."""
    return _start(data, group, gather=True, average=average, async_op=async_op)


def _start(data, group, gather: bool, average: bool, async_op: bool):
    reduction = _Reduction(data, group, gather, average, async_op)
    if async_op:
        return reduction
    reduction.finish()
    return None


def _ordered_sum(parts: torch.Tensor, out: torch.Tensor, average: bool) -> None:
    """out = parts[0] + parts[1] + ... in that order (`average`: / len(parts))."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    if average:
        out.div_(parts.shape[0])


class _Reduction:
    """One flat buffer's ordered reduction; started on construction, completed by
    `finish()` (idempotent). Synchronous: each slice is exchanged and summed before the
    next one is sent, so the temporaries stay within one slice."""

    def __init__(self, data: torch.Tensor, group, gather: bool, average: bool, async_op: bool):
        self.group, self.gather, self.average = group, gather, average
        world, n = group.size(), data.numel()
        chunk = n // world
        if not gather and chunk * world != n:
            raise ValueError(f"reduce_scatter: {n} elements do not split over {world} ranks")
        self.body = data[:chunk * world].view(world, chunk)
        self.mine = self.body[group.rank()]
        self.tail = data[chunk * world:]
        self.tails = self.tail_work = None
        if self.tail.numel():  # gather only: the last n mod P elements, summed on every rank
            self.tails = torch.empty(world * self.tail.numel(), dtype=data.dtype, device=data.device)
            self.tail_work = dist.all_gather_into_tensor(self.tails, self.tail.contiguous(),
                                                         group=group, async_op=async_op)
        self.slices = []  # (start, end, receive buffer, work)
        step = chunk if async_op else max(1, SLICE // world)
        for k0 in range(0, chunk, step):
            k1 = min(k0 + step, chunk)
            send = self.body[:, k0:k1].contiguous()  # the whole body: no copy
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
            if async_op:
                self.slices.append((k0, k1, recv, work))
            else:
                _ordered_sum(recv, self.mine[k0:k1], average)
        self.done = False

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        for k0, k1, recv, work in self.slices:
            work.wait()
            _ordered_sum(recv, self.mine[k0:k1], self.average)
        self.slices = []
        if self.tails is not None:
            if self.tail_work is not None:
                self.tail_work.wait()
            _ordered_sum(self.tails.view(-1, self.tail.numel()), self.tail, self.average)
            self.tails = None
        if self.gather and self.body.numel():
            dist.all_gather_into_tensor(self.body.view(-1), self.mine, group=self.group)


class _Handle:
    """What Megatron's finish_grad_sync waits on under --overlap-grad-reduce."""

    def __init__(self, reductions: list[_Reduction]):
        self.reductions = reductions

    def wait(self) -> None:
        for reduction in self.reductions:
            reduction.finish()
            if reduction in _in_flight:
                _in_flight.remove(reduction)


def _group(bucket_group):
    """The group Megatron reduces the bucket group over (`start_grad_sync`'s)."""
    if bucket_group.ddp_config.use_distributed_optimizer:
        return bucket_group.intra_distributed_optimizer_instance_group
    return bucket_group.data_parallel_group


def _ordered(bucket_group) -> bool:
    """Whether this module reduces the bucket group (module docstring), else Megatron."""
    config = bucket_group.ddp_config
    return (config.num_distributed_optimizer_instances == 1
            and not config.reduce_scatter_with_fp32_accumulation
            and _group(bucket_group).size() >= 3)


def _start_grad_sync(self, force_all_reduce: bool = False):
    """Megatron-Core's `_ParamAndGradBucketGroup.start_grad_sync` (core_v0.16.1) with the
    buckets reduced in rank order: its first-batch rule, NaN/large-gradient checks and
    gradient scaling as there, then `reduce_scatter` (distributed optimizer) or
    `all_reduce` per bucket instead of the coalesced NCCL/gloo collective."""
    if not _ordered(self):
        return _original(self, force_all_reduce)
    if self.is_first_batch and self.grad_reduce_handle is not None:
        return None
    assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
    config = self.ddp_config
    if config.check_for_nan_in_grad or config.check_for_large_grads:
        self.check_grads(check_for_nan_or_inf=config.check_for_nan_in_grad,
                         check_for_large=config.check_for_large_grads)
    for bucket in self.buckets:
        if bucket.gradient_scaling_factor != 1.0:
            bucket.grad_data *= bucket.gradient_scaling_factor
    async_op = config.overlap_grad_reduce
    if async_op:  # bound the temporaries: the group before this one completes now
        _Handle(list(_in_flight)).wait()
    reduce = reduce_scatter if config.use_distributed_optimizer and not force_all_reduce else all_reduce
    group = _group(self)
    started = [reduce(b.grad_data, group, config.average_in_collective, async_op) for b in self.buckets]
    if async_op:
        _in_flight.extend(started)
        self.grad_reduce_handle = _Handle(started)
    else:
        self.grad_reduce_handle = None
    return None
