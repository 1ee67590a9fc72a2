#!/usr/bin/env python
"""Migration bandwidth vs. raw send/recv of the same bytes, side by side in one run.

Launches itself under torchrun (PP=2, gloo on CPU; NCCL where CUDA exists): for N
layers, moves them stage 0 -> 1 and back with the real LayerMigrator (weights, grads,
Adam state, checksums, DDP/optimizer rebuild) and times a raw p2p send of exactly the
same bytes between the same ranks. Then runs the launcher once with an interval
rebalance on an unbalanced start and prints the time split of that rebalance and the
predicted vs measured iteration time before and after it.
Usage: python scripts/bench_migration.py [--hidden 512] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _torchrun import print_result, read_result, torchrun

# ---- worker (runs under torchrun) ---------------------------------------------------------
def _raw_send_s(nbytes: int, dims, repeats: int, fresh: bool) -> float:
    """Median seconds of one send/recv of `nbytes` from stage 0 to 1. fresh=True receives
    into a newly allocated buffer, as a migration must (first-touch page faults)."""
    import torch
    import torch.distributed as dist
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dims.device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if dims.pp_rank == 0:
            dist.send(buf, dist.get_global_rank(dims.groups.pp, 1), group=dims.groups.pp)
        else:
            target = torch.empty_like(buf) if fresh else buf
            dist.recv(target, dist.get_global_rank(dims.groups.pp, 0), group=dims.groups.pp)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times)


def worker(hidden: int, layers: int, repeats: int) -> None:
    import torch.distributed as dist
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migrate import LayerMigrator
    from dynmo_plugin.megatron.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.trainer import StageTrainer

    args = ModelArgs(num_layers=layers, hidden_size=hidden, num_attention_heads=8, seq_length=64,
                     micro_batch_size=1, global_batch_size=2, pipeline_model_parallel_size=2)
    dims = init_parallel(args)
    base = Layout.uniform(layers, 2)
    trainer = StageTrainer(args, dims, base)
    trainer.train_step(1)  # optimizer state exists from here on
    migrator = LayerMigrator(trainer)
    rows = []
    for n in (1, 2, layers // 2 - 1):
        moved = Layout((base.counts[0] - n, base.counts[1] + n))
        results = []
        for _ in range(repeats):
            results.append(migrator.migrate(moved))
            migrator.migrate(base)
        nbytes = results[0].bytes_moved
        rows.append({"layers": n, "bytes": nbytes,
                     "transfer_s": statistics.median(r.transfer_s for r in results),
                     "total_s": statistics.median(r.total_s for r in results),
                     "raw_s": _raw_send_s(nbytes, dims, repeats, fresh=False),
                     "raw_fresh_s": _raw_send_s(nbytes, dims, repeats, fresh=True)})
    if dist.get_rank() == 0:
        print_result(rows)
    destroy_parallel()


# ---- driver -------------------------------------------------------------------------------
def _time_split(out: Path) -> dict:
    torchrun(2, ["-m", "dynmo_plugin.train", "--num-layers", "8", "--hidden-size", "128",
               "--seq-length", "64", "--train-iters", "16", "--pipeline-model-parallel-size", "2",
               "--pipeline-model-parallel-layout", "Ettttttt|tL", "--dynmo",
               "--dynmo-rebalance-interval", "4", "--output", str(out)])
    report = json.loads((out / "report.json").read_text())
    return next(e for e in report["events"] if e["kind"] == "rebalance" and e.get("applied"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.hidden, a.layers, a.repeats)
        return 0
    stdout = torchrun(2, [__file__, "--worker", "--hidden", str(a.hidden), "--layers", str(a.layers),
                        "--repeats", str(a.repeats)])
    rows = read_result(stdout)
    print(f"hidden {a.hidden}, PP=2, median of {a.repeats}; GB/s = bytes / seconds (max over ranks)")
    print(f"{'layers':>6s} {'MB':>7s} {'raw':>6s} {'raw,fresh':>9s} {'xfer':>6s} {'xfer/raw':>8s} "
          f"{'xfer/fresh':>10s} {'total':>6s} {'total/raw':>9s}")
    for r in rows:
        raw, fresh, xfer, total = (r["bytes"] / r[k] / 1e9
                                   for k in ("raw_s", "raw_fresh_s", "transfer_s", "total_s"))
        print(f"{r['layers']:6d} {r['bytes'] / 1e6:7.1f} {raw:6.2f} {fresh:9.2f} {xfer:6.2f} "
              f"{xfer / raw:8.2f} {xfer / fresh:10.2f} {total:6.2f} {total / raw:9.2f}")
    print("raw: one send/recv into a warm buffer; raw,fresh: into a new buffer, as a migration "
          "must.\nxfer: the migration's batched p2p phase; total adds packing, checksums, "
          "building and\nloading the layers, the all-rank agreement and the DDP/optimizer rebuild.")
    with tempfile.TemporaryDirectory() as tmp:
        event = _time_split(Path(tmp))
    o = event["overhead_s"]
    print(f"\none rebalance ({event['layout_before']} -> {event['layout_after']}, "
          f"{event['migration']['bytes_moved'] / 1e6:.1f} MB):")
    for k in ("profiling", "decision", "migration"):
        print(f"  {k:10s} {1e3 * o.get(k, 0.0):8.1f} ms")
    pb, pa = event["predicted_iter_s_before"], event["predicted_iter_s_after"]
    mb, ma = event.get("measured_iter_s_before"), event.get("measured_iter_s_after")
    print(f"  predicted iteration (CPU-time costs): {1e3 * pb:.1f} -> {1e3 * pa:.1f} ms ({pa / pb:.2f}x)")
    if mb and ma:
        print(f"  measured iteration (wall, PP=2):      {1e3 * mb:.1f} -> {1e3 * ma:.1f} ms ({ma / mb:.2f}x)")
    print(f"  load average: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
