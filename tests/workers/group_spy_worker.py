"""torchrun worker for tests: the test worker with a SPY on the sharded optimizer-state
gather (test-only, named as such).

Every call of `optim_state._gather_sharded` records whether the DP group it is about to
talk over is still registered with torch.distributed (a destroyed group is not) into
<output>/gathers_rank<R>.json. gloo keeps a destroyed group's connections working, so
only this record shows a collective over a destroyed group there; NCCL errors or hangs.
"""
import json
import os
import sys

from dynmo_plugin.megatron.migration import optim_state
from workers import train_worker

_records: list = []


def _spy_gather(real):
    def gather(opt, params, *args, **kwargs):
        from torch.distributed.distributed_c10d import _world
        _records.append({"group_live": opt.data_parallel_group in _world.pg_map})
        return real(opt, params, *args, **kwargs)
    return gather


def _output_dir() -> str:
    return sys.argv[sys.argv.index("--output") + 1]


def main() -> int:
    optim_state._gather_sharded = _spy_gather(optim_state._gather_sharded)
    rank = os.environ["RANK"]
    try:
        return train_worker.main()
    finally:
        with open(os.path.join(_output_dir(), f"gathers_rank{rank}.json"), "w") as fh:
            json.dump(_records, fh)


if __name__ == "__main__":
    sys.exit(main())
