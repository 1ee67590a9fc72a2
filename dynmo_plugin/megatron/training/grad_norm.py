"""An L2 gradient norm whose bits do not depend on which rank holds which gradient.

Megatron's `get_grad_norm_fp32` (megatron.core.optimizer.clip_grads) reduces the rank's
gradients to one fp32 norm, squares it and all-reduces the squares over the grad-stats
group: a float sum grouped by rank. A migration changes which layers a rank holds, so it
regroups that sum and the norm's last bits change; through the clip coefficient
(--clip-grad) a moved run's losses then part from the never-moved run's in the last bits.

`get_grad_norm_fp32` here takes each gradient's own fp32 norm (a function of that tensor
alone), squares it in float64 (exact: a 24-bit significand squared fits in 53 bits),
gathers every rank's squares over the group and sums them with `math.fsum`, which is
exact and correctly rounded. The norm is then a function of the multiset of per-tensor
norms, never of their ranks or order. With the plain optimizer that multiset is the
model's (each parameter's gradient whole on one rank of TP x PP), so the norm is
layout-invariant.

With --use-distributed-optimizer (`install(sharded=True)`) the gradients are shards of
the data-parallel buffer, and where a parameter is cut depends on the layout, so the
per-tensor norms of its pieces would change with a move. There the sum runs over
elements instead, exactly: the group agrees on the largest finite magnitude M (an
all-reduce MAX, exact) and 2^E > M; each element's square, scaled by 2^-2E, is exact in
float64 and below 1, and is cut into two 30-bit limbs on the fixed grid 2^(2E-60) (the
bits below it, < 2^-58 M^2 per element, are dropped: the norm is layout-free, not exact
to the last bit of the true sum). The limbs' sums are integers, exact in any order, so
the total depends only on the multiset of elements; it is rounded once on the host. The
cost: the shard packed into slices of `SLICE` elements, each one copy and nine
elementwise float64 kernels (~136 bytes moved per element where the per-tensor norm
reads 4; on the CPU 8-40x its time, `scripts/bench_grad_norm.py`), and one host
synchronisation more. Both ways, a sum of squares above fp32's largest value reads inf,
as Megatron's fp32 sum does.

`install()` puts it in place of the name megatron.core.optimizer.optimizer calls
(MegatronOptimizer.get_grad_norm and clip_grad_norm, ChainedOptimizer.get_grad_norm);
the launcher installs it always (`parallel.init_parallel`), Megatron-LM's integration
with --dynmo (`megatron_lm.disable()` uninstalls it). A norm other than L2 (`norm_type`
inf; --clip-grad's is L2) and FSDP's DTensor gradients go to Megatron's own function.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist

__all__ = ["install", "uninstall", "get_grad_norm_fp32"]

_installed = False
_sharded = False  # the optimizer's gradients are shards cut by the layout: sum elements
SLICE = 1 << 22  # elements per float64 pass of the exact element sum (CUDA: few launches)
CPU_SLICE = 1 << 16  # on the CPU: the passes stay in cache (4M elements: 2-3.5x faster than 2^22)
_LIMB = 30  # bits per limb: a slice's limbs sum to an integer below 2^52, exact in float64
_FP32_MAX = torch.finfo(torch.float32).max
_VECTOR = 4  # elements per vectorised load of CUDA's norm kernel (kILP)
# Per group: how many squares each rank's packet carries, agreed by every rank of the group
# (each reads the same gathered counts and widens alike); grows to the largest count seen.
# Weak: a group a repack destroyed is forgotten with it.
_width: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(sharded: bool = False) -> None:
    """Megatron's optimizers take their gradient norm from `get_grad_norm_fp32` here;
    `sharded` (--use-distributed-optimizer): summed over elements (module docstring).
    Idempotent."""
    global _installed, _sharded
    from megatron.core.optimizer import optimizer
    optimizer.get_grad_norm_fp32 = get_grad_norm_fp32
    _installed, _sharded = True, bool(sharded)


def uninstall() -> None:
    """Megatron's own function again (the one clip_grads defines). Idempotent."""
    global _installed, _sharded
    if not _installed:
        return
    from megatron.core.optimizer import clip_grads, optimizer
    optimizer.get_grad_norm_fp32 = clip_grads.get_grad_norm_fp32
    _width.clear()
    _installed = _sharded = False


def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """The L2 norm of every rank's `grads_for_norm` over `grad_stats_parallel_group`: what
    Megatron's function of that name returns, summed in no order that depends on the
    layout (module docstring), so any rank may hold any gradient. A rank with none (a stage without trainable parameters)
    sends none; an inf or NaN gradient gives an inf or NaN norm, as Megatron's does."""
    from torch.distributed.tensor import DTensor  # here: its import costs ~0.8 s
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    if float(norm_type) != 2.0 or any(isinstance(g, DTensor) for g in grads):
        from megatron.core.optimizer import clip_grads
        return clip_grads.get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)
    if _sharded:
        total = _element_square_sum(grads, grad_stats_parallel_group)
    else:
        total = math.fsum(_gathered(_squares(grads, _device(grad_stats_parallel_group)),
                                    grad_stats_parallel_group))
    return math.inf if total > _FP32_MAX else math.sqrt(total)  # Megatron sums the squares in fp32


def _element_square_sum(grads: list, group) -> float:
    """The sum of every rank's squared gradient elements, a function of their multiset
    alone (module docstring): inf or NaN where any element is (NaN wins), as Megatron's."""
    device = _device(group)
    grads = [g for g in grads if g.numel()]
    peak = torch.zeros(3, dtype=torch.float64, device=device)  # largest finite |g|, any NaN, any inf
    if grads:
        peaks = torch.stack(torch._foreach_norm(grads, math.inf)).to(device=device, dtype=torch.float64)
        peak[0] = torch.where(peaks.isfinite(), peaks, 0.0).max()
        peak[1], peak[2] = peaks.isnan().any(), peaks.isinf().any()
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    largest, nan, inf = peak.tolist()
    if nan or inf:
        return math.nan if nan else math.inf
    exponent = math.frexp(largest)[1]  # largest < 2^exponent; 0 for none
    limbs = _limbs(grads, 2.0 ** (_LIMB // 2 - exponent), device)
    rows = [limbs]
    if dist.is_initialized():
        rows = [torch.empty_like(limbs) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, limbs, group=group)
    total = sum((top << 2 * _LIMB) + (high << _LIMB) + low
                for low, high, top in torch.stack(rows).cpu().tolist())
    return math.ldexp(float(total), 2 * exponent - 2 * _LIMB)


def _limbs(grads: list, scale: float, device: torch.device) -> torch.Tensor:
    """[low, high, top]: the rank's squares (x scale^2 = 2^30 / 2^2E: each below 2^30),
    each cut into two 30-bit limbs on the grid 2^(2E-60), summed as integers in units of
    2^(2E-60), 2^(2E-30), 2^2E (int64; no part can overflow below 2^33 slices).

    The gradients are packed into slices of `SLICE` elements (`CPU_SLICE` on the CPU; one
    copy kernel however many tensors a slice holds), and each slice costs nine
    elementwise float64 kernels and two sums. Exact: a power-of-two scale, the square of
    a <= 24-bit significand, floor and the subtraction are exact in float64, and a
    slice's limbs are integers whose every partial sum stays below 2^52, so float64 adds
    them exactly in whatever order the kernel does."""
    lows, highs = [], []
    for packed in _slices(grads, SLICE if grads and grads[0].is_cuda else CPU_SLICE):
        y = packed.to(torch.float64).mul_(scale).square_()
        high = y.floor()
        highs.append(high.sum())
        lows.append(y.sub_(high).mul_(2.0 ** _LIMB).floor_().sum())
    if not lows:
        return torch.zeros(3, dtype=torch.int64, device=device)
    low, high = (torch.stack(v).to(device=device, dtype=torch.int64) for v in (lows, highs))
    mask = (1 << _LIMB) - 1  # each slice's sums are < 2^52: split at 2^30 and carried once
    return torch.stack([(low & mask).sum(), (low >> _LIMB).sum() + (high & mask).sum(), (high >> _LIMB).sum()])


def _slices(grads: list, most: int):
    """The gradients' elements as flat tensors of at most `most` elements (a tensor
    alone when it fills one; others packed together by one copy)."""
    batch, size = [], 0
    for g in grads:
        for piece in g.detach().reshape(-1).split(most):
            if size + piece.numel() > most and batch:
                yield batch[0] if len(batch) == 1 else torch.cat(batch)
                batch, size = [], 0
            batch.append(piece)
            size += piece.numel()
    if batch:
        yield batch[0] if len(batch) == 1 else torch.cat(batch)


def _device(group) -> torch.device:
    """Where the group's collectives take tensors: NCCL the current CUDA device, gloo the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _squares(grads: list, device: torch.device) -> torch.Tensor:
    """Each gradient's fp32 norm (as Megatron accumulates), squared in float64, on `device`.

    On CUDA the norm kernel loads 16-byte-aligned tensors vectorised and others element by
    element, in another summation order (ATen's LpNormFunctor; review 23a). A gradient is
    a view into its rank's buffer, packed without padding by the plain optimizer, so its
    address moves with the layers before it: a misaligned one is normed from an aligned
    copy, one at a time (the copy's transient memory: one gradient)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64, device=device)
    aligned, misaligned = [], []
    for g in grads:
        (misaligned if _misaligned(g) else aligned).append(g)
    norms = list(torch._foreach_norm(aligned, 2.0, dtype=torch.float32)) if aligned else []
    norms += [torch._foreach_norm([g.clone()], 2.0, dtype=torch.float32)[0] for g in misaligned]
    return torch.stack(norms).to(device=device, dtype=torch.float64).square()


def _misaligned(g: torch.Tensor) -> bool:
    """Whether CUDA's norm kernel would load `g` element by element (its address not a
    multiple of one vectorised load)."""
    return g.is_cuda and g.data_ptr() % (_VECTOR * g.element_size()) != 0


def _gathered(squares: torch.Tensor, group) -> list[float]:
    """Every rank's squares, zero-padded (a zero changes no exact sum), read to the host once.

    Ranks hold different counts, and all_gather needs one size: each packet is [count,
    squares padded to the group's agreed width]. When some count exceeds the width (the
    first call; a move that gave a rank more tensors) every rank sees it in the same
    gathered counts, widens alike and gathers again."""
    if not dist.is_initialized():
        return squares.tolist()
    group = group if group is not None else dist.group.WORLD
    while True:
        width = _width.get(group, 0)
        packet = torch.zeros(width + 1, dtype=torch.float64, device=squares.device)
        packet[0] = squares.numel()
        if squares.numel() <= width:
            packet[1:1 + squares.numel()] = squares
        rows = [torch.empty_like(packet) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, packet, group=group)
        table = torch.stack(rows).cpu()  # the one host copy (Megatron's .item() costs one)
        needed = int(table[:, 0].max())
        if needed <= width:
            return table[:, 1:].flatten().tolist()
        _width[group] = needed
