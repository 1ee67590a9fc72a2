"""A window cancelled after a step that raised inside a layer's forward leaves nothing
behind (ProfileWindow.cancel, StageProbe.detach).

The layer's forward pre-hook pushed its saved-tensor hooks (activation counting) and its
post-hook, which pops them, never ran. Left on torch's stack they would count every
tensor saved for backward in the process from then on: scripts/gpu_check_worker.py
catches a failed run (a CUDA out-of-memory in attention) and trains the next scenario in
the same process. A real one-rank Megatron stage; the raise is a test-only fault (a
failing forward cannot be produced on demand otherwise)."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from launch import in_megatron_process
from test_profiling_rest import _one_rank_trainer

from dynmo_plugin.config import ModelArgs
from dynmo_plugin.megatron.profiling.probe import SavedBytes


class _ForwardFails(Exception):
    pass


def _saved_tensor_hooks_on_the_stack() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _check_a_failed_forward_leaves_no_hooks(args):
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    trainer = _one_rank_trainer(args)
    trainer.train_step(1)
    timers, layer = trainer.config.timers, trainer.chunks[0].decoder.layers[1]
    window = ProfileWindow(trainer, outside_s=[0.5])
    window.before_iteration()
    forward = layer.forward

    def failing(*a, **kw):  # test-only fault, after the pre-hook ran
        raise _ForwardFails("test-only: a layer's forward that raises inside a window")
    layer.forward = failing
    try:
        with pytest.raises(_ForwardFails, match="inside a window"):
            trainer.train_step(2)
    finally:
        layer.forward = forward
    assert _saved_tensor_hooks_on_the_stack()  # the premise: the failed forward left them
    window.cancel()
    assert not _saved_tensor_hooks_on_the_stack()
    assert trainer.config.timers is timers and gc.isenabled()
    trainer.train_step(3)  # trains on, unprofiled


def test_a_window_cancelled_after_a_failed_forward_leaves_no_saved_tensor_hooks():
    in_megatron_process(_check_a_failed_forward_leaves_no_hooks,
                        ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                  micro_batch_size=1, global_batch_size=2))


class _RecomputeFails(torch.nn.Module):
    """A layer under activation checkpointing (Megatron-LM's --recompute-granularity full
    re-runs each layer inside backward) whose pre-hook's SavedBytes is entered in every
    forward and whose recomputed forward raises (test-only fault; an out-of-memory in
    recompute is the real case) before the exit."""

    def __init__(self):
        super().__init__()
        self.linear, self.entered, self.calls = torch.nn.Linear(4, 4), [], 0

    def forward(self, x):
        saved = SavedBytes(set()).__enter__()
        self.entered.append(saved)
        self.calls += 1
        if self.calls == 2:
            raise _ForwardFails("test-only: the recomputed forward raises")
        out = self.linear(x).relu()
        saved.__exit__(None, None, None)
        return out


def test_a_saved_bytes_left_open_inside_a_backward_pops_nothing_at_abandon():
    """Torch drops the hooks a backward node pushed when the node ends: abandoning that
    SavedBytes must not pop the main thread's stack (empty: torch's internal assert; a
    user's hook on it: taken away), while one left open in a plain forward is popped."""
    layer = _RecomputeFails()
    x = torch.ones(2, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # the user's
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        with pytest.raises(_ForwardFails, match="recomputed forward raises"):
            out.sum().backward()
        inside = layer.entered[-1]
        assert inside.active and inside.in_backward
        inside.abandon()
        assert _saved_tensor_hooks_on_the_stack()  # the user's hook is still there
        assert not inside.active
    assert not _saved_tensor_hooks_on_the_stack()
    plain = SavedBytes(set()).__enter__()
    assert not plain.in_backward
    plain.abandon()
    assert not _saved_tensor_hooks_on_the_stack() and not plain.active


class _KeepsHalf(torch.autograd.Function):
    """As Megatron's distributed checkpoint: the input's data swapped in place for a slice,
    saved, and swapped back whole in the backward into the tensor autograd hands back."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.data.shape
        whole = x.data.clone()
        x.data = x.data.flatten()[: x.numel() // 2].clone()
        ctx.whole = whole
        ctx.save_for_backward(x)
        return whole * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.data = ctx.whole
        return grad * 2


def test_a_paused_saved_bytes_lets_a_function_save_its_input_as_is():
    """Under saved-tensor hooks autograd hands a Function's backward a new tensor, so an
    in-place swap there misses the caller's (torch's SavedVariable::unpack): the tensor
    stays a slice. Paused (`profiling.distributed_saves`), the save is the caller's own;
    pausing under a foreign hook is refused, not done to the foreign one."""
    def run(pause: bool):
        x = torch.ones(4, 2, requires_grad=True)
        counter = SavedBytes(set()).__enter__()
        with counter.paused() if pause else contextlib.nullcontext():
            out = _KeepsHalf.apply(x)
        counter.__exit__(None, None, None)
        out.sum().backward()
        return x
    assert run(pause=True).shape == (4, 2)
    with pytest.raises(RuntimeError, match="must match the size"):  # as on stage 1 under Megatron-LM
        run(pause=False)  # the gradient (4, 2) met the leaf still holding its slice (4,)
    counter = SavedBytes(set()).__enter__()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(RuntimeError, match="sits above the profiler's"):
            with counter.paused():
                pass
    assert counter.active
    counter.__exit__(None, None, None)
    assert not _saved_tensor_hooks_on_the_stack()
