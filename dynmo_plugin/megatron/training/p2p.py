"""Megatron's pipeline P2P communicator with a shape exchange that pairs like its data.

Micro-batches of changing shape (`variable_seq_lengths`: adaptive batching, early exit)
make Megatron send each tensor's shape before the tensor. Its `_communicate_shapes`
posts one batched exchange in the order send-prev, recv-prev, send-next, recv-next.
Under the interleaved schedule one call sends a chunk's activation forward and another
chunk's gradient backward; with pp = 2 the previous and the next rank are the same
rank, and gloo pairs the messages between two ranks in posting order, so the peer's
recv-prev (the activation's shape) got the gradient's shape and the other way round.
The data that followed then did not fit its buffer (measured, pp = 2, v = 2, adaptive
batches: gloo "Received data size doesn't match expected size. 12288 vs 8192": an
activation [32, 3, 32] received into a gradient-sized [64, 1, 32] buffer).

`PairedShapeP2P` sends the shapes through Megatron's own unbatched data path
(`_p2p_ops`: send-next before send-prev, recv-prev before recv-next, the same groups),
so every shape message pairs exactly as the tensor after it does (the plugin runs
interleaved pp = 2 unbatched for the same reason: `model.transformer_config`).
"""
from __future__ import annotations

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops

__all__ = ["PairedShapeP2P"]


class PairedShapeP2P(P2PCommunicator):
    """P2PCommunicator whose shape exchange posts in the data exchange's order and groups."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        """(shape received from the previous rank, from the next rank); [0, 0, 0] where
        nothing is received, as Megatron's."""
        device = torch.cuda.current_device()  # the CPU layer maps it to "cpu" (cpu_compat)

        def shape_of(t):
            return None if t is None else torch.tensor(t.size(), device=device, dtype=torch.int64)

        def slot(on):
            return torch.empty((3,), device=device, dtype=torch.int64) if on else None

        got_prev, got_next = slot(recv_prev), slot(recv_next)
        send_prev, send_next = shape_of(tensor_send_prev), shape_of(tensor_send_next)  # alive until waited
        reqs = _p2p_ops(tensor_send_prev=send_prev, tensor_recv_prev=got_prev,
                        tensor_send_next=send_next, tensor_recv_next=got_next,
                        group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                        next_pipeline_rank=self.next_rank)
        for req in reqs.values():
            req.wait()
        return ([0, 0, 0] if got_prev is None else got_prev.tolist(),
                [0, 0, 0] if got_next is None else got_next.tolist())
