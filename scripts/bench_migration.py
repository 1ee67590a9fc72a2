#!/usr/bin/env python
"""Migration bandwidth vs. raw send/recv of the same bytes, side by side in one run.

Launches itself under torchrun (PP=2, gloo on CPU; NCCL where CUDA exists): for N
layers, moves them stage 0 -> 1 and back with the real LayerMigrator (weights, grads,
Adam state, checksums, DDP/optimizer rebuild) and times a raw p2p send of exactly the
same bytes between the same ranks. Then runs the launcher once with an interval
rebalance on an unbalanced start and prints the time split of that rebalance and the
predicted vs measured iteration time before and after it.
With --precision instead: tokens/s of fp32 vs bf16 training of the same model (PP=2,
one rank per core), and the time of a migration with and without the distributed
optimizer (PP=2 x DP=2: the distributed optimizer gathers and re-shards state over DP).
Usage: python scripts/bench_migration.py [--hidden 512] [--repeats 7] [--no-rebalance]
       python scripts/bench_migration.py --precision [--hidden 512] [--repeats 5]
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

from dynmo_plugin.report import read_report

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


class _NoPool:
    """Stands in for the migrator's StagingPool: receive into new buffers, as before it."""

    nbytes = 0

    def take(self, headers):
        return None

    def release(self) -> None:
        pass


def worker(hidden: int, layers: int, repeats: int) -> None:
    import torch.distributed as dist
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.consensus import ControlPlane
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.migrate import LayerMigrator
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.training.trainer import StageTrainer

    args = ModelArgs(num_layers=layers, hidden_size=hidden, num_attention_heads=8, seq_length=64,
                     micro_batch_size=1, global_batch_size=2, pipeline_model_parallel_size=2)
    dims = init_parallel(args)
    base = Layout.uniform(layers, 2)
    trainer = StageTrainer(args, dims, base)
    trainer.train_step(1)  # optimizer state exists from here on
    migrator = LayerMigrator(trainer, ControlPlane(300.0))
    rows = []
    for n in (1, 2, layers // 2 - 1):
        moved = Layout((base.counts[0] - n, base.counts[1] + n))
        # the first move of a new size grows the receivers' staging pools (touching their
        # pages while the senders wait in the transfer): timed apart, as "first"
        first = migrator.migrate(moved)
        migrator.migrate(base)
        runs = []
        for _ in range(repeats):  # interleaved, so load drifts hit every column alike
            there, back = migrator.migrate(moved), migrator.migrate(base)
            pool, migrator.pool = migrator.pool, _NoPool()
            unpooled = migrator.migrate(moved)
            migrator.migrate(base)
            migrator.pool = pool
            runs.append({"transfer_s": there.transfer_s, "total_s": there.total_s,
                         "no_pool_transfer_s": unpooled.transfer_s,
                         "staging_s": there.phase_s["staging"], "back_transfer_s": back.transfer_s,
                         "raw_s": _raw_send_s(there.bytes_moved, dims, 1, fresh=False),
                         "raw_fresh_s": _raw_send_s(there.bytes_moved, dims, 1, fresh=True),
                         "pool_bytes": there.staging_pool_bytes})
        rows.append({"layers": n, "bytes": there.bytes_moved, "runs": runs,
                     "first_transfer_s": first.transfer_s, "first_staging_s": first.phase_s["staging"],
                     **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                     "xfer_over_raw": statistics.median(r["raw_s"] / r["transfer_s"] for r in runs),
                     "no_pool_over_raw": statistics.median(r["raw_s"] / r["no_pool_transfer_s"]
                                                           for r in runs)})
    if dist.get_rank() == 0:
        print_result(rows)
    destroy_parallel()


# ---- --precision (runs under torchrun) ---------------------------------------------------
PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp32+distopt": {"use_distributed_optimizer": True},
              "bf16+distopt": {"bf16": True, "use_distributed_optimizer": True}}


def precision_worker(hidden: int, layers: int, repeats: int, mode: str) -> None:
    """mode 'throughput' (PP=2): seconds per training iteration of fp32 and bf16 trainers
    of the same model, interleaved. mode 'migration' (PP=2 x DP=2): seconds of moving
    two layers there and back, per optimizer kind, interleaved. Max over ranks."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.consensus import ControlPlane
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.migrate import LayerMigrator
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.training.trainer import StageTrainer

    args = ModelArgs(num_layers=layers, hidden_size=hidden, num_attention_heads=8, seq_length=128,
                     micro_batch_size=2, global_batch_size=8, pipeline_model_parallel_size=2)
    dims = init_parallel(args)
    base = Layout.uniform(layers, 2)
    names = ("fp32", "bf16") if mode == "throughput" else ("fp32", "fp32+distopt", "bf16+distopt")
    trainers = {n: StageTrainer(dataclasses.replace(args, **PRECISIONS[n]), dims, base) for n in names}
    for t in trainers.values():
        t.train_step(1)  # optimizer state exists from here on
    moved = Layout((base.counts[0] - 2, base.counts[1] + 2))
    migrators = {n: LayerMigrator(t, ControlPlane(300.0)) for n, t in trainers.items()}
    if mode == "migration":
        for m in migrators.values():  # the first move grows the staging pools: not timed
            m.migrate(moved), m.migrate(base)
    runs = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotated order
            dist.barrier()
            start = time.perf_counter()
            if mode == "throughput":
                trainers[n].train_step(2 + r)
                row = {}
            else:
                there, back = migrators[n].migrate(moved), migrators[n].migrate(base)
                row = {"bytes": there.bytes_moved, **{f"{k}_s": v for k, v in there.phase_s.items()},
                       "there_s": there.total_s, "back_s": back.total_s}
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            runs[n].append({"s": float(elapsed), **row})
    if dist.get_rank() == 0:
        print_result({n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in runs.items()})
    destroy_parallel()


def _precision_tables(a) -> None:
    common = ["--hidden", str(a.hidden), "--layers", str(a.layers), "--repeats", str(a.repeats)]
    speed = read_result(torchrun(2, [__file__, "--worker", "--precision", "throughput", *common]))
    tokens = 8 * 128  # global batch x sequence length
    print(f"hidden {a.hidden}, {a.layers} layers, seq 128, global batch 8 (mbs 2), PP=2, "
          f"median of {a.repeats} interleaved iterations; load avg {os.getloadavg()[0]:.1f}")
    print("| precision | s/iteration | tokens/s | vs fp32 |\n|---|---|---|---|")
    for n, r in speed.items():
        print(f"| {n} | {r['s']:.3f} | {tokens / r['s']:.0f} | {speed['fp32']['s'] / r['s']:.2f}x |")
    moves = read_result(torchrun(4, [__file__, "--worker", "--precision", "migration", *common]))
    print(f"\nmigration of 2 layers stage 0 -> 1 (PP=2 x DP=2, 4 ranks on this machine), median of "
          f"{a.repeats}; load avg {os.getloadavg()[0]:.1f}")
    print("| optimizer | MB moved | total ms | pack ms | transfer ms | prepare ms | optimizer ms |"
          "\n|---|---|---|---|---|---|---|")
    for n, r in moves.items():
        print(f"| {n} | {r['bytes'] / 1e6:.1f} | {1e3 * r['there_s']:.0f} | {1e3 * r['pack_s']:.0f} "
              f"| {1e3 * r['transfer_s']:.0f} | {1e3 * r['prepare_s']:.0f} | {1e3 * r['optimizer_s']:.0f} |")
    print("pack includes the distributed optimizer's gather of full state over DP; optimizer:\n"
          "building the new optimizer and putting state into it (re-sharding with distopt).")


# ---- driver -------------------------------------------------------------------------------
def _time_split(out: Path) -> dict:
    torchrun(2, ["-m", "dynmo_plugin.train", "--num-layers", "8", "--hidden-size", "128",
               "--seq-length", "64", "--train-iters", "16", "--pipeline-model-parallel-size", "2",
               "--pipeline-model-parallel-layout", "Ettttttt|tL", "--dynmo",
               "--dynmo-rebalance-interval", "4", "--output", str(out)])
    report = read_report(out)
    return next(e for e in report["events"] if e["kind"] == "rebalance" and e.get("applied"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json-rows", default=None, metavar="FILE", help="also write the rows (every repeat) to FILE")
    ap.add_argument("--no-rebalance", action="store_true", help="skip the launcher run's time split")
    ap.add_argument("--precision", nargs="?", const="tables", default=None,
                    help="fp32 vs bf16 tokens/s, and migration with/without the distributed optimizer")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker and a.precision:
        precision_worker(a.hidden, a.layers, a.repeats, a.precision)
        return 0
    if a.worker:
        worker(a.hidden, a.layers, a.repeats)
        return 0
    if a.precision:
        _precision_tables(a)
        return 0
    stdout = torchrun(2, [__file__, "--worker", "--hidden", str(a.hidden), "--layers", str(a.layers),
                        "--repeats", str(a.repeats)])
    rows = read_result(stdout)
    if a.json_rows:
        Path(a.json_rows).write_text(json.dumps(rows))
    print(f"hidden {a.hidden}, PP=2, median of {a.repeats} interleaved repeats; GB/s = bytes / "
          f"seconds (max over ranks); load avg {os.getloadavg()[0]:.1f}")
    print("| layers | MB | raw GB/s | raw,fresh | xfer | xfer/raw | xfer, no pool | no pool/raw "
          "| staging ms | total | total/raw | pool MB | first: xfer GB/s, staging ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        raw, fresh, xfer, unpooled, total = (
            r["bytes"] / r[k] / 1e9 for k in ("raw_s", "raw_fresh_s", "transfer_s",
                                              "no_pool_transfer_s", "total_s"))
        print(f"| {r['layers']} | {r['bytes'] / 1e6:.1f} | {raw:.2f} | {fresh:.2f} | {xfer:.2f} "
              f"| {r['xfer_over_raw']:.2f} | {unpooled:.2f} | {r['no_pool_over_raw']:.2f} "
              f"| {1e3 * r['staging_s']:.1f} "
              f"| {total:.2f} | {total / raw:.2f} | {r['pool_bytes'] / 1e6:.1f} "
              f"| {r['bytes'] / r['first_transfer_s'] / 1e9:.2f}, {1e3 * r['first_staging_s']:.0f} |")
    print("raw: one send/recv into a warm buffer; raw,fresh: into a new buffer.\n"
          "xfer: the migration's batched p2p phase, receiving into the staging pool; xfer/raw:\n"
          "median of the per-repeat ratios; no pool: the same migration receiving into new\n"
          "buffers. staging: taking the receive buffers from the pool. total adds packing,\n"
          "checksums, building and loading the layers, the all-rank agreement and the\n"
          "DDP/optimizer rebuild. pool: bytes the pool holds after the move (max over ranks).\n"
          "first: the first move of that size, which grows the pools and touches their pages\n"
          "while the senders wait (not in the medians).")
    if a.no_rebalance:
        return 0
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
