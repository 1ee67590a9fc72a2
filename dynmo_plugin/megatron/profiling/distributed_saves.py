"""A checkpoint that keeps 1/TP of its input saves it outside the window's hooks.

With `distribute_saved_activations` (Megatron-LM's `--distribute-saved-activations`, full
recompute at TP > 1) Megatron's reentrant `CheckpointFunction` swaps the data of its
input for the rank's 1/TP slice in place, saves it, and in the backward swaps the
gathered whole back into the tensor autograd hands it. That is the caller's own tensor
only when autograd saved it as is. Under any `saved_tensors_hooks` autograd unpacks a new
tensor that shares the storage (torch's `SavedVariable::unpack`), so the whole went to
that copy, and the caller's tensor stayed a flat slice. On the stages after the first that
is the activation received from the previous stage, whose gradient the schedule
accumulates: "The size of tensor a (2048) must match the size of tensor b (64)".

So while a window is open the checkpoint's forward runs with the stage's counter
(`profiler._ExtraActivations`, the only hooks on torch's stack there: the layers' are
pushed and popped inside each layer, and Megatron refuses its CPU offloading hooks with
recompute) taken off the stack. The counter is then given what the checkpoint saved: its
other inputs (mask, rotary embeddings). The input itself is the first layer's, counted
there at its 1/TP share (`StageProbe._kept_input_share`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dynmo_plugin.megatron.profiling.probe import SavedBytes

__all__ = ["DistributedSaves"]


class DistributedSaves:
    """Wraps Megatron's `CheckpointFunction.apply` until `close()` (autograd packs what a
    Function saves after its `forward` returns, inside `apply`). `open_counter()`: the
    stage counter open now (None outside a training forward)."""

    def __init__(self, open_counter: Callable[[], Optional[SavedBytes]]):
        from megatron.core.tensor_parallel import random as tp_random
        self._cls = cls = tp_random.CheckpointFunction
        self._own = cls.__dict__.get("apply")  # None: inherited from torch's Function
        original = cls.apply

        def apply(klass, run_function, distribute_saved_activations, *args):
            counter = open_counter() if distribute_saved_activations else None
            if counter is None or not counter.active:
                return original(run_function, distribute_saved_activations, *args)
            whole = args[0].untyped_storage().data_ptr()  # the first layer records it as kept
            with counter.paused():
                outputs = original(run_function, distribute_saved_activations, *args)
            counter.no_longer_elsewhere(whole)  # swapped for the slice: freed, its address reusable
            for t in args[1:]:
                if torch.is_tensor(t):
                    counter.count(t)
            return outputs

        cls.apply = classmethod(apply)
        self._installed = True

    def close(self) -> None:
        if self._installed:
            self._installed = False
            if self._own is None:
                del self._cls.apply
            else:
                self._cls.apply = self._own
