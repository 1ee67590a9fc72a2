"""Test worker: the launcher with a busy layer (tests/megatron/test_memory_calibration.py).

`--test-busy-layer N --test-busy-repeats R`: layer N runs R extra forwards under no_grad
first, work that costs time and saves nothing for backward.
"""
from __future__ import annotations

import os
import sys


def busy_spec(layer_number: int, repeats: int):
    """Test-only: layer `layer_number` runs `repeats` extra forwards under no_grad first
    (work that costs time and saves nothing for backward)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class BusyLayer(TransformerLayer):
        def forward(self, *args, **kwargs):
            if self.layer_number == layer_number:
                with torch.no_grad():
                    for _ in range(repeats):
                        super().forward(*args, **kwargs)
            return super().forward(*args, **kwargs)

    spec = get_gpt_layer_local_spec()
    spec.module = BusyLayer
    return spec


def main() -> int:
    from dynmo_plugin.train import build_parser, exit_on_peer_failure, run
    from dynmo_plugin.megatron.training.machine import load_run_config
    parser = build_parser()
    parser.add_argument("--test-busy-layer", type=int, default=0)
    parser.add_argument("--test-busy-repeats", type=int, default=0)
    args = parser.parse_args()
    cfg = load_run_config(args, world_size=int(os.environ["WORLD_SIZE"]))
    spec = busy_spec(args.test_busy_layer, args.test_busy_repeats)
    return exit_on_peer_failure(lambda: run(cfg, layer_spec=spec))


if __name__ == "__main__":
    sys.exit(main())
