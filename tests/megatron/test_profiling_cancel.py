"""A window cancelled after a step that raised inside a layer's forward leaves nothing
behind (ProfileWindow.cancel, StageProbe.detach).

The layer's forward pre-hook pushed its saved-tensor hooks (activation counting) and its
post-hook, which pops them, never ran. Left on torch's stack they would count every
tensor saved for backward in the process from then on: scripts/gpu_check_worker.py
catches a failed run (a CUDA out-of-memory in attention) and trains the next scenario in
the same process. A real one-rank Megatron stage; the raise is a test-only fault (a
failing forward cannot be produced on demand otherwise)."""
from __future__ import annotations

import gc

import torch
from launch import in_megatron_process
from test_profiling_rest import _one_rank_trainer

from dynmo_plugin.config import ModelArgs


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
        trainer.train_step(2)
        raise AssertionError("the step did not raise")
    except _ForwardFails:
        pass
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
