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
temporaries: synchronously, one slice of at most `SLICE` elements at a time (a send copy
and a receive buffer); with --overlap-grad-reduce the bucket itself is sent and one
receive buffer the bucket's size is in flight, and a bucket group's sums are queued when
the next group starts, which frees its buffer, so at most two groups' buffers live at once.
Overlapped on CUDA the sums and the all-gather run on a side stream (`_Reduction`): the
compute stream waits only where Megatron's finish_grad_sync waits. Megatron's NCCL user
buffers (`nccl_ub`) are not registered for the all_to_all's receive buffers.

The tensor-parallel group has the same hazard: `finalize_model_grads` flattens the
gradients Megatron all-reduces over the tensor ranks (the sequence-parallel norms and
biases, the MoE router's weights, the q/k layernorms of every layer the stage holds)
into one buffer, so a move changes each layer's offset there (survey 24, PP 2 x TP 3 with
--qk-layernorm: 43 of 256 reduced elements differed at the first step after a move).
That all-reduce goes through `all_reduce` here too. And the MoE expert-bias update
(--moe-router-enable-expert-bias) all-reduces the token counts of every MoE layer the
stage holds, stacked, in float32, whose sums of integers are exact only below 2^24
(survey 24: 3 gloo ranks, counts near 3e7 at other stack positions, 4-8 of 64 differed);
here the counts are all-reduced in float64, exact to 2^53 in any order.

`install()` replaces `_ParamAndGradBucketGroup.start_grad_sync` (Megatron-Core's
param_and_grad_buffer) and finalize_model_grads' `_allreduce_non_tensor_model_parallel_grads`;
the replacements take Megatron's own path where the order cannot matter or this module
does not reach: a group of <= 2 ranks, several distributed-optimizer instances (their
second all-reduce), `reduce_scatter_with_fp32_accumulation` (Megatron's own all_to_all,
summed by `torch.sum(dim=0)`, whose order on the CPU depends on the column at >= 5
ranks: survey 24). The launcher installs it unless --dynmo-native-grad-reduce,
Megatron-LM's integration with --dynmo alike; `megatron_lm.disable()` uninstalls it.
"""
from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed as dist

__all__ = ["install", "uninstall", "choose", "reduce_scatter", "all_reduce", "SLICE"]

SLICE = 1 << 24  # elements per rank's share of one synchronous all_to_all slice
_originals: dict = {}  # Megatron's functions while installed
_in_flight: list["_Reduction"] = []  # started with --overlap-grad-reduce, not yet finished
_streams: dict = {}  # device -> the side stream of the overlapped reductions


def _homes():
    """(owner, attribute, replacement) of each Megatron function this module replaces."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    # the module (the package exports its function of the same name)
    finalize_model_grads = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    return ((_ParamAndGradBucketGroup, "start_grad_sync", _start_grad_sync),
            (finalize_model_grads, "_allreduce_non_tensor_model_parallel_grads", _non_tensor_parallel_grads),
            (finalize_model_grads, "get_updated_expert_bias", _updated_expert_bias))


def install() -> None:
    """Megatron's DDP buckets and the stage's flattened tensor-parallel gradients reduce in
    rank order (module docstring). Idempotent."""
    if _originals:
        return
    for owner, name, replacement in _homes():
        _originals[name] = getattr(owner, name)
        setattr(owner, name, replacement)


def choose(native: bool) -> None:
    """Megatron's own collectives (`native`: --dynmo-native-grad-reduce) or this module's."""
    if native:
        uninstall()
    else:
        install()


def uninstall() -> None:
    """Megatron's own functions again. Idempotent."""
    if not _originals:
        return
    for owner, name, _ in _homes():
        setattr(owner, name, _originals.pop(name))
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
    """One flat buffer's ordered reduction, in three steps: the exchange (started on
    construction), `reduce()` (the sums once the exchange arrived, then the all-gather
    started) and `finish()` (waits for all of it); each idempotent. Synchronous: every
    slice is exchanged and summed before the next is sent, the temporaries within one
    slice. Overlapped (`async_op`) on CUDA, the sums and the all-gather are queued on a
    side stream, so the compute stream waits only in `finish()`, as for Megatron's
    collective."""

    def __init__(self, data: torch.Tensor, group, gather: bool, average: bool, async_op: bool):
        self.group, self.gather, self.average, self.async_op = group, gather, average, async_op
        world, n = group.size(), data.numel()
        chunk = n // world
        if not gather and chunk * world != n:
            raise ValueError(f"reduce_scatter: {n} elements do not split over {world} ranks")
        self.body = data[:chunk * world].view(world, chunk)
        self.mine = self.body[group.rank()]
        self.tail = data[chunk * world:]
        self.tails = self.tail_work = self.gather_work = self.summed = None
        self.side = _side_stream(data.device) if async_op and data.is_cuda else None
        if self.tail.numel():  # gather only: the last n mod P elements, summed on every rank
            self.tails = torch.empty(world * self.tail.numel(), dtype=data.dtype, device=data.device)
            self.tail_work = dist.all_gather_into_tensor(self.tails, self.tail.contiguous(),
                                                         group=group, async_op=async_op)
        self.slices = []  # (start, end, receive buffer, work) still to sum
        step = max(1, chunk if async_op else SLICE // world)
        for k0 in range(0, chunk, step):
            k1 = min(k0 + step, chunk)
            send = self.body[:, k0:k1].contiguous()  # the whole body: no copy
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
            if async_op:
                self.slices.append((k0, k1, recv, work))
            else:
                _ordered_sum(recv, self.mine[k0:k1], average)
        self.reduced = self.finished = False

    def reduce(self) -> None:
        if self.reduced:
            return
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            for k0, k1, recv, work in self.slices:
                work.wait()  # on CUDA: the side stream waits for the exchange, not the host
                _ordered_sum(recv, self.mine[k0:k1], self.average)
                self._used_here(recv)
            if self.tails is not None:
                if self.tail_work is not None:
                    self.tail_work.wait()
                _ordered_sum(self.tails.view(-1, self.tail.numel()), self.tail, self.average)
                self._used_here(self.tails)
            if self.gather and self.body.numel():
                self.gather_work = dist.all_gather_into_tensor(self.body.view(-1), self.mine, group=self.group,
                                                               async_op=self.async_op)
            if self.side is not None:  # what finish() waits for: this reduction, not later ones
                self.summed = torch.cuda.Event()
                self.summed.record(self.side)
        self.slices, self.tails, self.reduced = [], None, True

    def finish(self) -> None:
        if self.finished:
            return
        self.reduce()
        if self.gather_work is not None:
            self.gather_work.wait()
        if self.side is not None:
            torch.cuda.current_stream().wait_event(self.summed)
        self.finished = True

    def _used_here(self, buffer: torch.Tensor) -> None:
        """A temporary the side stream read: the allocator must not hand its memory to
        the compute stream before the side stream is done with it."""
        if self.side is not None:
            buffer.record_stream(self.side)


def _side_stream(device: torch.device):
    """One stream per device for the overlapped reductions' sums and all-gathers."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device=device)
    return _streams[device]


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
        return _originals["start_grad_sync"](self, force_all_reduce)
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
    if async_op:  # bound the temporaries: the groups before this one sum now (queued, on CUDA)
        for earlier in _in_flight:
            earlier.reduce()
    reduce = reduce_scatter if config.use_distributed_optimizer and not force_all_reduce else all_reduce
    group = _group(self)
    started = [reduce(b.grad_data, group, config.average_in_collective, async_op) for b in self.buckets]
    if async_op:
        _in_flight.extend(started)
        self.grad_reduce_handle = _Handle(started)
    else:
        self.grad_reduce_handle = None
    return None


def _non_tensor_parallel_grads(model, config, tp_group=None):
    """Megatron-Core's `_allreduce_non_tensor_model_parallel_grads` (finalize_model_grads,
    core_v0.16.1) with its all-reduces over 3 or more tensor ranks in rank order (module
    docstring). Megatron's function still chooses, flattens and copies back the gradients:
    only the all-reduce it calls is swapped, for the call, and only on the tensor group."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none
    megatron_s = _originals["_allreduce_non_tensor_model_parallel_grads"]
    group = get_tensor_model_parallel_group_if_none(tp_group)
    if group.size() < 3:
        return megatron_s(model, config, tp_group)
    native = dist.all_reduce

    def in_rank_order(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is not tensor_group or async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return native(tensor, op=op, group=group, async_op=async_op)
        return all_reduce(tensor.view(-1), tensor_group, average=op == dist.ReduceOp.AVG)

    tensor_group = group
    dist.all_reduce = in_rank_order
    try:
        return megatron_s(model, config, tp_group)
    finally:
        dist.all_reduce = native


def _updated_expert_bias(tokens_per_expert, expert_bias, expert_bias_update_rate):
    """Megatron-Core's `get_updated_expert_bias` (moe_utils, as finalize_model_grads calls
    it) on the counts in float64: they are integers, so their all-reduce is exact in any
    order up to 2^53 (float32: 2^24), wherever a layer sits in the stage's stack. The
    bias comes back in its own dtype."""
    megatron_s = _originals["get_updated_expert_bias"]
    updated = megatron_s(tokens_per_expert.to(torch.float64), expert_bias, expert_bias_update_rate)
    return updated.to(expert_bias.dtype)
