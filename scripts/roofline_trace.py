"""Tracing a Megatron-Core layer's forward + backward at a real shape on a CPU, for
scripts/roofline.py: on the fake device (FakeTensorMode), or, where a layer's sizes
depend on values, for real at short sequences extrapolated in s, or at a narrow hidden
size widened to the real one. docs/roofline.md."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dynmo_plugin.profiling.op_trace import MATMULS, OpRecord, OpTrace  # noqa: E402

log = logging.getLogger("roofline")
BF16 = torch.bfloat16

@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    seq: int
    batch: int
    ffn: Optional[int] = None

    @property
    def label(self) -> str:
        return f"h{self.hidden} s{self.seq} mb{self.batch}"


GPU_BOUND = Shape(4096, 32, 2048, 1)       # 7.28 ms of kernels on an H200 (layer_probe)
ATTENTION = Shape(1024, 8, 8192, 1)        # scenario_cost[sparse_attention]


@dataclass
class Case:
    """A built layer and how to run it: `run(layer, x)` -> output to backpropagate
    (None: forward only). `real`: needs real values (host reads) -> extrapolated trace."""

    layer: torch.nn.Module
    run: Callable
    backward: bool = True
    real: bool = False
    note: str = ""
    input_rows: Callable[[Shape], int] = lambda shape: shape.seq


# ---- Megatron in this process ---------------------------------------------------------------
def megatron_process() -> None:
    """One gloo rank with Megatron's groups and the CPU compatibility layer (world size 1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.megatron.training.parallel import init_parallel
    init_parallel(ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                            bf16=True, transformer_impl="local", distributed_backend="gloo"))


def config_for(shape: Shape, num_layers: int = 8, **extra):
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import transformer_config
    args = ModelArgs(num_layers=num_layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                     num_attention_heads=shape.heads, seq_length=shape.seq, bf16=True,
                     transformer_impl="local")
    cfg = transformer_config(args, Layout.uniform(num_layers, 1))
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


ATTENTION_BACKEND = "unfused"   # --attention-backend of the layers built (layer_probe sets it)


def base_spec():
    from dynmo_plugin.megatron.training.model import layer_spec
    return layer_spec("local", ATTENTION_BACKEND)


def build(spec, cfg, number: int = 5) -> torch.nn.Module:
    from megatron.core.transformer.spec_utils import build_module
    return build_module(spec, config=cfg, layer_number=number).to(BF16)


def causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]


def plain_run(layer, x, s):
    out, _ = layer(hidden_states=x, attention_mask=causal_mask(s))
    return out


# ---- tracing --------------------------------------------------------------------------------
def trace_case(case: Case, shape: Shape) -> list[OpRecord]:
    """OpTrace of one forward (+ backward) of `case` at `shape`, on the fake device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(case.input_rows(shape), shape.batch, shape.hidden, dtype=BF16,
                            requires_grad=case.backward)
            return _traced(case, x, shape)
    finally:
        _drop_global_buffers()


def _drop_global_buffers() -> None:
    """Megatron's global memory buffer (the unfused attention's score scratch) keeps the
    tensors it allocated: after a fake trace they are fake, and a later real run would
    compute into them. Start every trace with an empty one."""
    from megatron.core import parallel_state
    parallel_state.get_global_memory_buffer().buffer.clear()


class Bf16MatmulInFp32(TorchDispatchMode):
    """Real CPU traces only: a bf16 matrix product computed in fp32 and rounded to bf16
    once, as a GPU's bf16 GEMM accumulates. A CPU without native bf16 (no AVX512-BF16 or
    AMX, e.g. AMD Zen 3) runs torch's bf16 GEMM ~145x slower than fp32 (512x2048 @
    2048x2048: 13 s against 91 ms, one thread, 2026-11-28), and the real traces then
    outlast --calibrate's 10 minutes. Entered outside OpTrace, so the trace records the
    bf16 op as the layer dispatched it, not the fp32 one computed here."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in MATMULS and any(
                isinstance(t, torch.Tensor) and t.dtype is BF16 for t in args):
            up = [t.float() if isinstance(t, torch.Tensor) and t.dtype is BF16 else t for t in args]
            return func(*up, **kwargs).to(BF16)
        return func(*args, **kwargs)


def _traced(case: Case, x: torch.Tensor, shape: Shape) -> list[OpRecord]:
    real = not isinstance(x, FakeTensor)
    with Bf16MatmulInFp32() if real else contextlib.nullcontext():
        with OpTrace() as forward:
            out = case.run(case.layer, x, shape)
        if not case.backward:
            return forward.ops
        grad = torch.ones_like(out)  # outside the traces: the harness's, not the layer's
        with OpTrace() as backward:
            torch.autograd.backward(out, grad)
    return forward.ops + backward.ops


class NotExtrapolable(RuntimeError):
    """The layer's work is not a quadratic in the sequence length (sizes that depend on
    values, e.g. tokens per expert): a real trace cannot be scaled to the real shape."""


def trace_real_extrapolated(make: Callable[[Shape], Case], shape: Shape,
                            divisors=(128, 64, 32, 16)) -> list[OpRecord]:
    """Real CPU traces at seq s/d for each divisor; each op's FLOPs, bytes and shape
    dimensions fitted as a quadratic in s through the first three and evaluated at
    `shape.seq`. The runs must dispatch the same ops in the same order, and the fit
    must predict the last run (s/16) exactly, else NotExtrapolable."""
    torch.manual_seed(0)
    _drop_global_buffers()
    runs, seqs = [], []
    for d in divisors:
        small = dataclasses.replace(shape, seq=max(8, shape.seq // d))
        case = make(small)
        with torch.no_grad():
            for p in case.layer.parameters():
                p.normal_(0, 0.02)
        x = torch.randn(case.input_rows(small), small.batch, small.hidden, dtype=BF16,
                        requires_grad=case.backward)
        runs.append(_traced(case, x, small))
        seqs.append(small.seq)
        del case, x
        gc.collect()
    names = [[op.name for op in ops] for ops in runs]
    if any(n != names[0] for n in names):
        raise NotExtrapolable("real traces at different sequence lengths dispatch different ops")
    check, runs, seqs = runs[-1], runs[:-1], seqs[:-1]
    last = dataclasses.replace(shape, seq=max(8, shape.seq // divisors[-1])).seq
    for got, ops in zip(check, zip(*runs)):
        want = _extrapolate(ops, seqs, last)
        fields = ("flops", "bytes", "inputs", "strides")
        if any(getattr(want, f) != getattr(got, f) for f in fields):
            raise NotExtrapolable(f"{got.name}: the quadratic through s={seqs} predicts "
                                  f"{[getattr(want, f) for f in fields]} at s={last}; the trace has "
                                  f"{[getattr(got, f) for f in fields]}")
    return [_extrapolate(ops, seqs, shape.seq) for ops in zip(*runs)]


def _quad(xs, ys, x) -> float:
    """The quadratic through three points, at x (Lagrange)."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    return (y0 * (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
            + y1 * (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
            + y2 * (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1)))


def _extrapolate(ops: tuple[OpRecord, ...], seqs, s: int) -> OpRecord:
    def num(values):
        return max(0, round(_quad(seqs, list(values), s)))

    def grown(field):
        first = getattr(ops[0], field)
        if any(len(getattr(o, field)) != len(first) or any(
                len(a) != len(b) for a, b in zip(getattr(o, field), first)) for o in ops):
            return first  # a different rank at another length: keep the first
        return tuple(tuple(num(getattr(o, field)[i][j] for o in ops) for j in range(len(first[i])))
                     for i in range(len(first)))
    return dataclasses.replace(ops[0], flops=num(o.flops for o in ops), bytes=num(o.bytes for o in ops),
                               inputs=grown("inputs"), outputs=grown("outputs"), strides=grown("strides"))


NARROW_HIDDEN = 160   # 5 per head at 32 heads: a size no other dimension of these layers takes


def trace_real_narrow(make: Callable[[Shape], Case], shape: Shape) -> list[OpRecord]:
    """A real CPU trace at the real sequence and batch but a narrow hidden size (FFN 4x
    that, the same heads), every dimension equal to the narrow hidden size, FFN width or
    head size then widened to the real one and each op's FLOPs and bytes recomputed. For
    layers whose sizes depend on values (tokens per expert): those are real here.
    Assumes the FFN width is 4x the hidden size and no other dimension equals the
    narrow sizes (checked: the widened plain layer equals its fake trace, --calibrate)."""
    narrow = dataclasses.replace(shape, hidden=NARROW_HIDDEN, ffn=None)
    ffn = shape.ffn or 4 * shape.hidden
    if ffn != 4 * shape.hidden or NARROW_HIDDEN % shape.heads:
        raise NotExtrapolable(f"narrow trace needs ffn = 4h and heads dividing {NARROW_HIDDEN}")
    head, narrow_head = shape.hidden // shape.heads, NARROW_HIDDEN // shape.heads
    widen = {NARROW_HIDDEN: shape.hidden, 4 * NARROW_HIDDEN: ffn, 3 * NARROW_HIDDEN: 3 * shape.hidden,
             narrow_head: head, 3 * narrow_head: 3 * head}   # hidden, FFN, fused QKV, per head
    if len(set(widen)) < len(widen):
        raise NotExtrapolable(f"narrow sizes collide for {shape.heads} heads: {widen}")
    _drop_global_buffers()
    torch.manual_seed(0)
    case = make(narrow)
    with torch.no_grad():
        for p in case.layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(case.input_rows(narrow), narrow.batch, narrow.hidden, dtype=BF16,
                    requires_grad=case.backward)
    ops = _traced(case, x, narrow)
    del case, x
    gc.collect()
    return [_widen(op, widen) for op in ops]


def _widen(op: OpRecord, widen: dict[int, int]) -> OpRecord:
    from torch.utils import flop_counter as fc

    def grow(shapes):
        return tuple(tuple(widen.get(d, d) for d in sh) for sh in shapes)

    def numel(shapes):
        return sum(math.prod(sh) for sh in shapes)
    inputs, outputs = grow(op.inputs), grow(op.outputs)
    strides = tuple(_grow_strides(old, st, new) for old, st, new in
                    zip(op.inputs + op.outputs, op.strides, inputs + outputs))
    before = numel(op.inputs) + numel(op.outputs)
    nbytes = round(op.bytes * (numel(inputs) + numel(outputs)) / before) if before else op.bytes
    flops = op.flops
    if op.flops:
        formula = {"aten.mm": fc.mm_flop, "aten.bmm": fc.bmm_flop, "aten.addmm": fc.addmm_flop,
                   "aten.baddbmm": fc.baddbmm_flop}.get(op.name)
        if formula is not None:
            flops = formula(*inputs)
        elif op.is_attention:
            flops = (fc.sdpa_backward_flop_count(*inputs[:4]) if "backward" in op.name
                     else fc.sdpa_flop_count(*inputs[:3]))
        else:
            raise NotExtrapolable(f"{op.name}: no FLOP formula to widen")
    return dataclasses.replace(op, inputs=inputs, outputs=outputs, flops=int(flops), bytes=nbytes,
                               strides=strides)


def _grow_strides(old_shape, old_strides, new_shape) -> tuple[int, ...]:
    """Strides of the same layout (dimension order, padding between rows, broadcast
    dimensions) at the widened shape."""
    order = sorted(range(len(old_shape)), key=lambda i: (old_strides[i], old_shape[i]))
    new, step_old, step_new = [0] * len(old_shape), 1, 1
    for i in order:
        if old_strides[i] == 0:
            continue
        new[i] = max(1, round(step_new * old_strides[i] / step_old))
        step_old, step_new = old_strides[i] * old_shape[i], new[i] * new_shape[i]
    return tuple(new)


def trace_scheme(make: Callable[[Shape], Case], shape: Shape) -> tuple[list[OpRecord], str, int]:
    """(ops, how, passes): fake-device trace, or the real extrapolated one where the layer
    needs values (Case.real, or a fake trace that failed on a data-dependent op)."""
    case = make(shape)
    note, real, passes = case.note, case.real, 2 if case.backward else 1
    if not real:
        try:
            return trace_case(case, shape), note, passes
        except Exception as e:  # data-dependent op under FakeTensorMode: real values needed
            log.info("fake trace failed (%s: %s); extrapolating real traces", type(e).__name__, e)
    del case
    gc.collect()
    try:
        return (trace_real_extrapolated(make, shape),
                f"{note}; real CPU at s/128, s/64, s/32 (checked at s/16), extrapolated", passes)
    except NotExtrapolable as e:
        log.info("not extrapolable in s (%s); a narrow real trace, widened", e)
    return (trace_real_narrow(make, shape),
            f"{note}; real CPU at hidden {NARROW_HIDDEN}, widened to {shape.hidden}", passes)
