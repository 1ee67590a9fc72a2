"""What one forward + backward dispatches, op by op.

A GPU runs each aten op that computes as one (or a few) kernels: their number is the
host's cost (a launch each), their FLOPs and bytes the device's. Recording them on CPU,
or on the meta device at a real shape, lets a machine without a GPU check what a GPU run
will pay: the shape guards (every matmul dimension a multiple of 8), the FLOP and
kernel-count budgets of the scenario layers, the host reads that would stall a stream,
and the roofline estimate all read this one record.

    with OpTrace() as trace:
        out, _ = layer(hidden_states=x, attention_mask=mask)
        out.float().sum().backward()
    trace.flops(), trace.kernels(), trace.matmul_dims(), trace.host_reads()
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["MATMULS", "OpRecord", "OpTrace"]

_aten = torch.ops.aten
# Ops that allocate or describe memory without running a kernel on its values.
_NO_KERNEL = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
              _aten.new_empty_strided, _aten.detach, _aten.alias, _aten._unsafe_view,
              _aten.lift_fresh, _aten.sym_size, _aten.sym_stride, _aten.sym_numel,
              _aten.sym_storage_offset, _aten.is_same_size, _aten.set_}
# Ops whose result the host must wait for: a value read back (`item`, `bool`, `int`) or an
# output whose size depends on the values.
HOST_READS = {_aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.unique_dim,
              _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.equal}
# Matrix products, with the (M, N, K)-style dimensions their kernels tile.
MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm}
# Fused attention kernels (one launch for a whole softmax(QK^T)V and its backward).
ATTENTION = {"aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
             "aten._scaled_dot_product_cudnn_attention", "aten._flash_attention_forward",
             "aten._efficient_attention_forward", "aten._scaled_dot_product_flash_attention_for_cpu",
             "aten._scaled_dot_product_flash_attention_backward",
             "aten._scaled_dot_product_efficient_attention_backward",
             "aten._scaled_dot_product_cudnn_attention_backward", "aten._flash_attention_backward",
             "aten._efficient_attention_backward",
             "aten._scaled_dot_product_flash_attention_for_cpu_backward"}


def _cpu_flash_flops(packet, args) -> int | None:
    """FLOPs of the CPU flash-attention kernels (the ones SDPA picks on CPU and under
    FakeTensorMode on a CPU device), which torch's flop_registry leaves out: counted
    as the GPU flash kernels are, so a CPU trace sees the FLOPs a GPU run does."""
    if packet is _aten._scaled_dot_product_flash_attention_for_cpu:
        return sdpa_flop_count(*(tuple(t.shape) for t in args[:3]))
    if packet is _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return sdpa_backward_flop_count(*(tuple(t.shape) for t in args[:4]))
    return None


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op: its name, the shapes it read and wrote, and its work."""

    name: str
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    dtype: str
    flops: int
    bytes: int         # read and written by the kernel (0 where no kernel runs)
    kernel: bool       # runs a kernel (views, allocations and metadata do not)
    host_read: bool    # the host waits for the device's result
    causal: bool = False  # an attention kernel called with is_causal=True (skips half the work)
    # strides of `inputs` then `outputs`, in that order: a matmul's leading dimensions
    strides: tuple[tuple[int, ...], ...] = ()

    @property
    def is_matmul(self) -> bool:
        return self.name in {str(m) for m in MATMULS}

    def leading_dims(self) -> list[int]:
        """Leading dimension of each 2-D+ operand and result of this op (from `strides`):
        the larger of the two inner strides where the other is 1; both where neither is
        (a strided view, which the kernel reads with that pitch). Empty when not recorded."""
        out = []
        for st in self.strides:
            inner = st[-2:]
            if len(inner) < 2:
                continue
            if 1 in inner:
                out.append(max(inner))
            else:
                out.extend(inner)
        return out

    @property
    def is_attention(self) -> bool:
        """A fused attention kernel (SDPA flash / memory-efficient / cuDNN, fwd or bwd)."""
        return self.name in ATTENTION


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_causal(func, args, kwargs) -> bool:
    """The op's `is_causal` argument, by name in its schema (False where it has none)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            value = kwargs.get("is_causal", args[i] if i < len(args) and not arg.kwarg_only else False)
            return bool(value)
    return False


class OpTrace(TorchDispatchMode):
    """Records every aten op dispatched inside the `with` block, backward included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        flops = _cpu_flash_flops(packet, args)
        if flops is None:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        # prim.* ops (device, layout queries that FakeTensorMode answers) launch nothing
        view = bool(getattr(func, "is_view", False)) or func.namespace == "prim"
        kernel = not view and packet not in _NO_KERNEL and packet is not _aten._local_scalar_dense
        first = (ins + outs)[0] if ins or outs else None
        self.ops.append(OpRecord(
            name=str(packet), inputs=tuple(tuple(t.shape) for t in ins),
            outputs=tuple(tuple(t.shape) for t in outs),
            dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
            flops=flops, bytes=sum(map(_nbytes, ins + outs)) if kernel else 0, kernel=kernel,
            host_read=packet in HOST_READS, causal=_is_causal(func, args, kwargs),
            strides=tuple(tuple(t.stride()) for t in ins + outs) if packet in MATMULS else ()))
        return out

    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def kernels(self) -> int:
        """Ops that launch work on the device: the host's per-op cost, counted."""
        return sum(op.kernel for op in self.ops)

    def host_reads(self) -> list[str]:
        """Reads that reach aten. `Tensor.tolist()` and `bool()` of a CPU tensor read the
        values in C++ without dispatching (on CUDA they copy to the host first): a
        TorchFunctionMode sees those (tests/scenarios/test_scenario_host_sync.py)."""
        return [op.name for op in self.ops if op.host_read]

    def matmuls(self) -> list[OpRecord]:
        return [op for op in self.ops if op.is_matmul]

    def leading_dims(self) -> list[int]:
        """The leading dimension (row pitch, in elements) of every matmul operand and
        result: what a bf16 GEMM needs a multiple of 8 (16 bytes) of to use its fast
        kernels. A count of rows (e.g. tokens) never is one; a width always is."""
        return [ld for op in self.matmuls() for ld in op.leading_dims()]

    def matmul_dims(self) -> list[int]:
        """Every dimension of every matmul operand: a bf16 GEMM runs its fast kernels only
        where each is a multiple of 8 (16 bytes)."""
        return [d for op in self.matmuls() for shape in op.inputs for d in shape[-2:]]
