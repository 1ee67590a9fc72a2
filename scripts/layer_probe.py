"""Time the roofline's own layers on a GPU: the measured side of scripts/roofline.py.

Each case is one of `scripts/roofline.py`'s scheme layers (the same builder, so the same
module the scheme runs) at a shape; on one CUDA device it runs forward + backward and
prints, side by side:

* `gpu_ms`   the GPU's busy time: the sum of the step's kernel durations (torch.profiler,
             CUDA activity), i.e. what the step costs when the host keeps up;
* `host_ms`  the host's time to enqueue the step (no synchronisation inside it, unless the
             layer itself reads a value back);
* `wall_ms`  CUDA events around the step: max(GPU, host) plus any bubbles;
* `kernels`  kernel launches per step.

Ratios are taken against the case's reference at the same shape, in one process, with the
cases interleaved over `--rounds` (the spread is printed). This is a measurement script
for a lent GPU (scripts/device_check.sh runs it); it does nothing useful on a CPU.

    python scripts/layer_probe.py [--cases NAME,...] [--rounds 3] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

log = logging.getLogger("layer_probe")


def cases():
    """(name, builder, shape, reference name) in the order they run."""
    import roofline as rf
    from roofline_trace import ATTENTION, GPU_BOUND, Shape
    big = Shape(8192, 64, 4096, 1)
    out = []
    for shape in (GPU_BOUND, big):
        tag = shape.label
        out += [
            (f"plain {tag}", rf.plain, shape, f"plain {tag}"),
            (f"frozen {tag}", rf.frozen, shape, f"plain {tag}"),
            (f"pruned67/128 {tag}", rf.pruned(0.33, 128), shape, f"plain {tag}"),
            (f"mod0.125 {tag}", rf.mod(0.125), shape, f"plain {tag}"),
            (f"early_exit75 {tag}", rf.early_exit(0.75), shape, f"plain {tag}"),
            (f"moe1.0 {tag}", rf.moe(1.0), shape, f"plain {tag}"),
            (f"moe0.5 {tag}", rf.moe(0.5), shape, f"moe1.0 {tag}"),
        ]
    sdpa = Shape(4096, 32, 4096, 2)   # the scenario rows' shape, --attention-backend sdpa
    tag = f"{sdpa.label} sdpa"
    out += [(f"plain {tag}", rf.plain, sdpa, f"plain {tag}"),
            (f"frozen {tag}", rf.frozen, sdpa, f"plain {tag}"),
            (f"pruned67/128 {tag}", rf.pruned(0.33, 128), sdpa, f"plain {tag}"),
            (f"mod0.125 {tag}", rf.mod(0.125), sdpa, f"plain {tag}"),
            (f"early_exit75 {tag}", rf.early_exit(0.75), sdpa, f"plain {tag}"),
            (f"moe1.0 {tag}", rf.moe(1.0), sdpa, f"plain {tag}"),
            (f"moe0.5 {tag}", rf.moe(0.5), sdpa, f"moe1.0 {tag}")]
    mb4 = Shape(4096, 32, 4096, 4)    # Mixture of Depths' scenario row (micro-batch 4)
    tag = f"{mb4.label} sdpa"
    out += [(f"plain {tag}", rf.plain, mb4, f"plain {tag}"),
            (f"mod0.125 {tag}", rf.mod(0.125), mb4, f"plain {tag}")]
    for seq in (8192, 16384, 32768):
        shape = Shape(ATTENTION.hidden, ATTENTION.heads, seq, 1)
        tag = shape.label
        out += [(f"lsh1 {tag}", rf.lsh(1), shape, f"lsh1 {tag}"),
                (f"lsh16 {tag}", rf.lsh(16), shape, f"lsh1 {tag}")]
    return out


def setup() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.megatron.training.te_names import bind_missing_te_names
    init_parallel(ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                            bf16=True, transformer_impl="local", distributed_backend="nccl"))
    bind_missing_te_names()
    _masks_on_cuda()


def _masks_on_cuda() -> None:
    """The roofline's harness builds its causal masks on the CPU (it traces there); here
    they live on the GPU, built once per length. No global default device: the schemes
    draw some values on the CPU on purpose (sparse attention's seeded rotations)."""
    import functools

    import roofline
    import roofline_trace

    @functools.lru_cache(maxsize=8)
    def causal_mask(s: int) -> torch.Tensor:
        return torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)[None, None]
    roofline_trace.causal_mask = roofline.causal_mask = causal_mask


class Probe:
    """One built case, steppable."""

    def __init__(self, make, shape, attention: str):
        import roofline_trace
        from roofline_trace import BF16
        roofline_trace.ATTENTION_BACKEND = "sdpa" if attention == "sdpa" else "unfused"
        with torch.device("cuda"):  # the case's own tensors (labels, flags) on the GPU
            self.case = make(shape)
        self.case.layer.cuda()
        self.shape = shape
        self.x = torch.randn(self.case.input_rows(shape), shape.batch, shape.hidden, dtype=BF16,
                             device="cuda", requires_grad=self.case.backward)

    def step(self) -> None:
        reset = getattr(self.case.layer, "reset_exit_stats", None)
        if reset is not None:  # early exit: one micro-batch per step, as its scenario resets it
            reset()
        out = self.case.run(self.case.layer, self.x, self.shape)
        if self.case.backward:
            out.backward(torch.ones_like(out))
        self.case.layer.zero_grad(set_to_none=True)
        self.x.grad = None

    def timed(self) -> tuple[float, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        self.step()
        end.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return host * 1e3, start.elapsed_time(end)

    def kernel_time(self, steps: int = 2) -> tuple[float, float]:
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                self.step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(getattr(e, "device_time", None) or e.cuda_time for e in kernels)
        return busy_us / 1e3 / steps, len(kernels) / steps


def measure(name, make, shape, rounds: int) -> dict:
    probe = Probe(make, shape, "sdpa" if name.endswith(" sdpa") else "unfused")
    for _ in range(2):
        probe.step()
    gpu_ms, kernels = probe.kernel_time()
    hosts, walls = [], []
    for _ in range(rounds):
        h, w = probe.timed()
        hosts.append(h)
        walls.append(w)
    row = {"case": name, "shape": shape.label, "note": probe.case.note, "gpu_ms": gpu_ms,
           "host_ms": statistics.median(hosts), "wall_ms": statistics.median(walls),
           "wall_spread": (max(walls) / min(walls)) if walls else None, "kernels": kernels,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del probe
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="comma-separated name prefixes (default all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=120.0, help="stop starting cases after this")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[layer_probe] %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print("layer_probe: error: no CUDA device (this script measures on a GPU)", file=sys.stderr)
        return 2
    setup()
    wanted = tuple(x.strip() for x in args.cases.split(",") if x.strip())
    t0, rows = time.monotonic(), {}
    for name, make, shape, ref in cases():
        if wanted and not name.startswith(wanted):
            continue
        if time.monotonic() - t0 > args.budget_s:
            rows[name] = {"case": name, "error": "skipped: budget"}
            continue
        try:
            rows[name] = measure(name, make, shape, args.rounds) | {"reference": ref}
        except Exception as e:  # one case's failure must not lose the others
            rows[name] = {"case": name, "error": f"{type(e).__name__}: {e}"[:300]}
            torch.cuda.empty_cache()
        log.info("%s: %s", name, rows[name])
    print(f"{'case':34} {'GPU ms':>8} {'host ms':>8} {'wall ms':>8} {'kern':>5} {'GPU x':>6} {'wall x':>6}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:34} {r['error'][:100]}")
            continue
        ref = rows.get(r["reference"], {})
        gx = r["gpu_ms"] / ref["gpu_ms"] if "gpu_ms" in ref else float("nan")
        wx = r["wall_ms"] / ref["wall_ms"] if "wall_ms" in ref else float("nan")
        print(f"{name:34} {r['gpu_ms']:8.2f} {r['host_ms']:8.2f} {r['wall_ms']:8.2f} "
              f"{r['kernels']:5.0f} {gx:6.3f} {wx:6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "torch": torch.__version__, "rows": list(rows.values())},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
