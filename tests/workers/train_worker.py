"""torchrun worker for tests: the real launcher, plus test-only switches.

--test-heavy-layer N --test-heavy-factor K: layer N runs its whole forward K times
(a test-only layer spec), so its true cost is K x its neighbours'.
--test-dump-ranks: every rank writes its report (with its in-memory events) to
<output>/rank<R>.json, to check that all ranks agree.
"""
import json
import os
import sys

from dynmo_plugin.config import load_config
from dynmo_plugin.train import build_parser, run


def heavy_spec(layer_number: int, factor: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class RepeatedLayer(TransformerLayer):
        """Test-only: the target layer applies itself `factor` times."""

        def forward(self, *args, **kwargs):
            repeats = factor if self.layer_number == layer_number else 1
            out = None
            for _ in range(repeats):
                out = super().forward(*args, **kwargs)
                kwargs["hidden_states"] = out[0]
            return out

    spec = get_gpt_layer_local_spec()
    spec.module = RepeatedLayer
    return spec


def main():
    parser = build_parser()
    parser.add_argument("--test-heavy-layer", type=int, default=0)
    parser.add_argument("--test-heavy-factor", type=int, default=1)
    parser.add_argument("--test-dump-ranks", action="store_true")
    parser.add_argument("--test-dump-params", action="store_true")
    parser.add_argument("--test-fault", default=None, help="KIND@STAGE, e.g. receiver_exception@1")
    args = parser.parse_args()
    cfg = load_config(args, world_size=int(os.environ["WORLD_SIZE"]))
    spec = heavy_spec(args.test_heavy_layer, args.test_heavy_factor) if args.test_heavy_layer else None
    fault = None
    if args.test_fault:
        from dynmo_plugin.migration.faults import FaultInjector
        kind, stage = args.test_fault.split("@")
        fault = FaultInjector(kind=kind, stage=int(stage))
    rank = os.environ["RANK"]

    def dump_params(trainer):
        import torch
        from dynmo_plugin.megatron.model import global_named_parameters
        params = {n: p.detach().clone() for n, p in global_named_parameters(trainer.model)}
        torch.save(params, os.path.join(cfg.model.output, f"params_rank{rank}.pt"))

    report = run(cfg, layer_spec=spec, fault=fault,
                 on_finish=dump_params if args.test_dump_params else None)
    if args.test_dump_ranks:
        with open(os.path.join(cfg.model.output, f"rank{rank}.json"), "w") as fh:
            json.dump(report, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
