"""torchrun worker for tests: the real launcher; at the end every rank writes the full
training state of its stage (interleaved: of all its model chunks) as
`stage_state.capture` sees it — weights by global name and each parameter's optimizer
state (fp32 master weights, Adam moments, step), gathered over DP with the distributed
optimizer — to <output>/state_rank<R>.pt."""
import os
import sys

from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.train import build_parser, exit_on_peer_failure, run


def main():
    cfg = load_run_config(build_parser().parse_args(), world_size=int(os.environ["WORLD_SIZE"]))

    def dump_state(trainer):
        import torch
        from dynmo_plugin.megatron.migration.stage_state import StageState, capture
        state = StageState()  # interleaved: every model chunk of the rank
        for chunk in trainer.chunks:
            state.merge(capture(chunk, trainer.optimizer))  # collective over DP
        torch.save({"tensors": {k: v.clone() for k, v in state.tensors.items()},
                    "optim": {k: {s: v.clone() for s, v in o.items()} for k, o in state.optim.items()}},
                   os.path.join(cfg.model.output, f"state_rank{os.environ['RANK']}.pt"))

    return exit_on_peer_failure(run, cfg, None, None, None, None, dump_state)


if __name__ == "__main__":
    sys.exit(main())
