#!/usr/bin/env python
"""One process for many one-rank launcher runs: the start-up a GPU check pays once.

Started by scripts/gpu_check.py (class Worker there), never by hand. Each torchrun launch
costs 25-40 s of start-up on the lent GPU machines (../shared/notes/h200-measured.md:
interpreter, torch, Megatron-Core, the CUDA context); the one-GPU rows need a dozen PP=1
runs. Here they run one after another in one process: every run is the test worker
(tests/workers/train_worker.py: the real launcher plus its test switches) with its own
process group (a fresh env:// rendezvous on a free port, destroyed at the run's end by
`dynmo_plugin.train.run`), its own model and optimizer; the process, the imports and the
CUDA context are shared.

Protocol: one JSON request per line on stdin, {"flags": [...], "output": DIR, and
optionally "baton": a gpu_checks.baton.BatonSpec as a dict: the run waits for its turns
(`with_baton`)}; one JSON
reply per request on the original stdout, {"ok": bool, "error": str, "seconds": float,
"cuda_allocated": int, "live_parameters": int} (bytes still allocated and parameters
still alive after the run: a run that leaks its model into the next shows here). Every
other output (Megatron's prints included) goes to stderr. EOF on stdin ends the process.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    sys.path.insert(0, str(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEAVY_FLAG = "--gpu-check-heavy"  # LAYER:FACTOR,...: several test layers repeat their forward


def heavy_layers_spec(factors: dict[int, int]):
    """Like the test worker's `heavy_spec`, for several layers at once (e.g. layer 3 at 3x
    and layer 5 at 2x: the slope and the intercept of cost against work, issue 34)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class RepeatedLayers(TransformerLayer):
        def forward(self, *args, **kwargs):
            out = None
            for _ in range(factors.get(self.layer_number, 1)):
                out = super().forward(*args, **kwargs)
                kwargs["hidden_states"] = out[0]
            return out

    spec = get_gpt_layer_local_spec()
    spec.module = RepeatedLayers
    return spec


def take_heavy(flags: list[str]) -> tuple[list[str], dict[int, int]]:
    """(the flags without HEAVY_FLAG, its layer -> factor map)."""
    if HEAVY_FLAG not in flags:
        return flags, {}
    at = flags.index(HEAVY_FLAG)
    pairs = [x.split(":") for x in flags[at + 1].split(",") if x]
    return flags[:at] + flags[at + 2:], {int(a): int(b) for a, b in pairs}


def with_baton(spec: dict | None):
    """A context in which every launcher step waits for its turn (scripts/gpu_checks/baton.py):
    TrainingSession.step is wrapped, outside the step's own timing, for this run only."""
    import contextlib
    if not spec:
        return contextlib.nullcontext()
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_checks.baton import BatonClient, BatonSpec
    from dynmo_plugin.session import TrainingSession
    client, step = BatonClient(BatonSpec(**spec)), TrainingSession.step

    def baton_step(self, iteration: int) -> None:
        client.before(iteration)
        step(self, iteration)
        client.after(iteration)

    @contextlib.contextmanager
    def patched():
        TrainingSession.step = baton_step
        try:
            yield
        finally:
            TrainingSession.step = step
    return patched()


def run_one(flags: list[str], output: str, baton: dict | None = None) -> dict:
    """One launcher run in this process, as `torchrun --nproc-per-node 1 -m
    workers.train_worker FLAGS --output OUTPUT` would do it (HEAVY_FLAG: several heavy
    test layers, through the test worker's own switch; `baton`: in turns with other
    programs)."""
    import torch
    from workers import train_worker
    flags, heavy = take_heavy(flags)
    saved_spec = train_worker.heavy_spec
    if heavy:
        train_worker.heavy_spec = lambda *_: heavy_layers_spec(heavy)
        flags = [*flags, "--test-heavy-layer", str(min(heavy)), "--test-heavy-factor", str(heavy[min(heavy)])]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    sys.argv = ["train_worker", *flags, "--output", output]
    start, error = time.perf_counter(), ""
    try:
        with with_baton(baton):
            status = train_worker.main()
        error = "" if status == 0 else f"exit {status}"
    except SystemExit as e:  # argparse or a user error: the launcher's status
        error = f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 - the run's failure is its reply; the process goes on
        traceback.print_exc()
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        _teardown()
    finally:
        train_worker.heavy_spec = saved_spec
    gc.collect()  # the run's model and optimizer, before the next run allocates its own
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.empty_cache()
    live = sum(1 for x in gc.get_objects() if isinstance(x, torch.nn.Parameter))
    return {"ok": not error, "error": error, "seconds": round(time.perf_counter() - start, 3),
            "cuda_allocated": torch.cuda.memory_allocated() if cuda else 0, "live_parameters": live}


def _teardown() -> None:
    """What `train.run`'s own teardown did not reach (an error before it started)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # prints of the runs go to stderr: stdout carries the replies only
    import torch  # noqa: F401 - the imports every run needs, while the parent gets ready
    from workers import train_worker  # noqa: F401
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        print(f"[gpu_check_worker] run: {' '.join(request['flags'])}", file=sys.stderr, flush=True)
        result = run_one(request["flags"], request["output"], request.get("baton"))
        print(f"[gpu_check_worker] end of run: {result}", file=sys.stderr, flush=True)
        reply.write(json.dumps(result) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
