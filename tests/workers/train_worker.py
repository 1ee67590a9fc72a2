"""torchrun worker for tests: the real launcher, plus test-only switches.

--test-heavy-layer N --test-heavy-factor K: layer N runs its whole forward K times
(a test-only layer spec), so its true cost is K x its neighbours'.
--test-dump-ranks: every rank writes its report (with its in-memory events) to
<output>/rank<R>.json, to check that all ranks agree.
--test-fault KIND@STAGE[:PHASE]: a FaultInjector (dynmo_plugin.faults) for the first migration.
--test-profile-noise SIGMA: per-rank multiplicative timing noise (ProfileNoise).
--test-freeze-layers 1,2: freeze these layers (and the embedding with layer 1) at start.
--test-dump-dtypes: every rank writes <output>/dtypes_rank<R>.json at the end: the dtypes
of the stage's parameters, of the optimizer's main parameters and of its state (what
trained, not what the flags asked for).
"""
import json
import os
import sys

from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.train import build_parser, exit_on_peer_failure, run


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
    parser.add_argument("--test-dump-dtypes", action="store_true")
    parser.add_argument("--test-fault", default=None, help="KIND@STAGE[:PHASE], e.g. receiver_exception@1")
    parser.add_argument("--test-profile-noise", type=float, default=0.0)
    parser.add_argument("--test-freeze-layers", default="")
    args = parser.parse_args()
    cfg = load_run_config(args, world_size=int(os.environ["WORLD_SIZE"]))
    spec = heavy_spec(args.test_heavy_layer, args.test_heavy_factor) if args.test_heavy_layer else None
    fault = noise = None
    if args.test_fault:
        from dynmo_plugin.faults import FaultInjector
        kind, where = args.test_fault.split("@")
        stage, _, phase = where.partition(":")
        fault = FaultInjector(kind=kind, stage=int(stage), phase=phase or "transfer")
    if args.test_profile_noise:
        from dynmo_plugin.faults import ProfileNoise
        noise = ProfileNoise(sigma=args.test_profile_noise, seed=cfg.model.seed)
    frozen = {int(x) for x in args.test_freeze_layers.split(",") if x}
    rank = os.environ["RANK"]

    def dump_params(trainer):
        import torch
        from dynmo_plugin.megatron.training.model import global_named_parameters
        params = {n: p.detach().clone() for chunk in trainer.chunks  # interleaved: several
                  for n, p in global_named_parameters(chunk)}
        torch.save(params, os.path.join(cfg.model.output, f"params_rank{rank}.pt"))

    def dump_dtypes(trainer):
        import torch
        names = lambda tensors: sorted({str(t.dtype).removeprefix("torch.") for t in tensors})  # noqa: E731
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # Megatron wraps torch's
        main = [p for group in inner.param_groups for p in group["params"]]
        state = [v for st in inner.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        dtypes = {"params": names(p for c in trainer.chunks for p in c.parameters()),
                  "main_params": names(main), "optimizer_state": names(state)}
        with open(os.path.join(cfg.model.output, f"dtypes_rank{rank}.json"), "w") as fh:
            json.dump(dtypes, fh)

    def finish(trainer):
        if args.test_dump_params:
            dump_params(trainer)
        if args.test_dump_dtypes:
            dump_dtypes(trainer)

    def freeze(trainer):
        from dynmo_plugin.megatron.migration.migrate import retire_ddp
        for layer in trainer.model.decoder.layers:
            if layer.layer_number in frozen:
                layer.requires_grad_(False)
        if 1 in frozen and trainer.dims.is_first_stage:
            trainer.model.embedding.requires_grad_(False)
        retire_ddp(trainer.ddp)
        ddp = trainer.build_ddp()
        trainer.install_wrappers(ddp, trainer.build_optimizer(ddp))

    def train():
        report = run(cfg, layer_spec=spec, fault=fault, profile_noise=noise,
                     on_start=freeze if frozen else None,
                     on_finish=finish)
        if args.test_dump_ranks:
            with open(os.path.join(cfg.model.output, f"rank{rank}.json"), "w") as fh:
                json.dump(report, fh)

    return exit_on_peer_failure(train)


if __name__ == "__main__":
    sys.exit(main())
