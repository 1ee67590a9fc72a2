"""torchrun worker (1 process): probe activation bytes vs. what autograd really saved.

The reference walks each layer's autograd graph from its output back to its input and
sums the distinct non-parameter storages held in the nodes' `_saved_*` attributes: a
different mechanism from the probe's saved_tensors_hooks.
"""
import json
import os
import sys

import torch

from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.layout import Layout
from dynmo_plugin.train import build_parser


def saved_bytes_in_graph(output: torch.Tensor, stop: torch.Tensor, param_ptrs: set) -> int:
    stop_node = stop.grad_fn
    seen_nodes, seen_storages, total = set(), set(), 0
    frontier = [output.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is None or node in seen_nodes or node is stop_node:
            continue
        seen_nodes.add(node)
        for attr in dir(node):  # built-in ops: _saved_*; custom autograd.Functions: saved_tensors
            if not (attr.startswith("_saved_") or attr == "saved_tensors"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:
                continue
            for t in (value if isinstance(value, (tuple, list)) else [value]):
                if torch.is_tensor(t):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in param_ptrs and ptr not in seen_storages:
                        seen_storages.add(ptr)
                        total += t.untyped_storage().nbytes()
        frontier.extend(n for n, _ in node.next_functions)
    return total


def main():
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.profiling.probe import StageProbe
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    from dynmo_plugin.profiling.clock import CpuThreadClock

    args = build_parser().parse_args()
    cfg = load_run_config(args, world_size=1)
    dims = init_parallel(cfg.model)
    trainer = StageTrainer(cfg.model, dims, Layout.uniform(cfg.model.num_layers, 1))
    model = trainer.model
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    io = {}
    for layer in model.decoder.layers:
        layer.register_forward_hook(
            lambda m, a, kw, out: io.__setitem__(m.layer_number, (kw["hidden_states"], out[0])),
            with_kwargs=True)
    probe = StageProbe(model, CpuThreadClock())
    probe.attach()
    batch = next(trainer.data.micro_batches(1, 0, 1))
    loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    probe.detach()
    result = {}
    for number, (inp, out) in io.items():
        result[number] = {"probe": probe._saved[(number, 0)].nbytes,
                          "autograd": saved_bytes_in_graph(out, inp, param_ptrs)}
    loss.sum().backward()
    with open(os.path.join(cfg.model.output, "activations.json"), "w") as fh:
        json.dump(result, fh)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    os.makedirs(sys.argv[sys.argv.index("--output") + 1], exist_ok=True)
    sys.exit(main())
