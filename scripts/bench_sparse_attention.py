#!/usr/bin/env python
"""Sparse (LSH) attention, timed: the kernel against dense attention and the old kernel,
and (--run) a real run's profiles against the work model.

Default, the kernel: one forward + backward of the core attention (bf16 by default,
[s, b, heads, head_dim]) for dense causal SDPA, the chunked kernel
(kernels.lsh_attention: fused causal attention on sorted chunks of round_up(s/B, 64)
tokens) and the unfused kernel it replaced (unfused.py), timed in interleaved rounds
(each round times all three, the order rotated, so load bursts hit them alike; CPU-time
clock, one thread). Prints per kernel the median ms and, for chunked/dense and
chunked/unfused, the median ratio of the same round's pair with its min-max spread.
A CPU benchmark is only indicative: a CPU has no FlashAttention tiles, launches nothing,
and runs bf16 matmuls at a fraction of fp32's speed; the GPU figures are in
docs/scenarios/sparse_attention.md (H200: unfused 1.70x dense in the layer, chunked SDPA
0.387x dense in a pure-torch probe).

--run: a 4-layer GPT, 1024-token samples, 2 pipeline stages under torchrun; layer 1
pinned at 4 buckets, layer 2 dense, layers 3-4 going 1 -> 8 -> 64 buckets. From the
profile windows after the last change (fwd+bwd per micro-batch, medians) it prints

* sparse/4-bucket: the 64-bucket layers over the 4-bucket layer;
* sparse/dense:    the 64-bucket layers over the dense layer;
* measured/predicted: that ratio over the work model's.

Usage: python scripts/bench_sparse_attention.py [--seq 4096 --buckets 16 --heads 8
       --head-dim 64 --dtype bf16 --repeats 7 --device cpu] [--run [--iters 8]] [--json]
On a GPU (the note's probe shape): --device cuda --seq 8192 --heads 8 --head-dim 128
--repeats 20.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import torchrun  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "2",
         "--seq-length", "1024", "--vocab-size", "256", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--seed", "3", "--pipeline-model-parallel-size", "2"]
SCENARIO = ["--dynmo-dynamism", "sparse_attention", "--dynmo-sparse-attention-buckets", "1",
            "--dynmo-sparse-attention-final-buckets", "64", "--dynmo-sparse-attention-rounds", "2",
            "--dynmo-sparse-attention-start", "2", "--dynmo-sparse-attention-interval", "2",
            "--dynmo-sparse-attention-buckets-per-layer", "1:4,2:1",
            "--dynmo", "--dynmo-profile-every", "2", "--dynmo-balancer", "uniform"]


def final_costs(report: dict, after: int) -> dict[int, list[float]]:
    """{layer: [fwd+bwd s of each profile window starting at or after `after`]}."""
    out: dict[int, list[float]] = {}
    for e in report["events"]:
        if e.get("profile") and e["profile"].get("layers") and e["window"][0] >= after:
            for x in e["profile"]["layers"]:
                out.setdefault(x["layer"], []).append(x["fwd_s"] + x["bwd_s"])
    return out


def ratios(report: dict) -> dict:
    costs = final_costs(report, after=5)
    work = [e for e in report["events"] if e["kind"] == "dynamism"][-1]["work"]
    sparse = statistics.median(costs[3] + costs[4])
    dense, four = statistics.median(costs[2]), statistics.median(costs[1])
    return {"windows": len(costs[1]), "sparse_over_4_buckets": sparse / four,
            "sparse_over_dense": sparse / dense,
            "measured_over_predicted": (sparse / dense) / (work["3"] / work["2"])}


def kernel_ratios(s: int, b: int, heads: int, head_dim: int, buckets: int, dtype: str,
                  repeats: int, device: str = "cpu") -> dict:
    """Interleaved timings of dense, chunked and unfused attention (module docstring)."""
    import torch

    from dynmo_plugin.scenarios.sparse_attention.kernels import (dense_causal_attention, hash_rotation,
                                                                 lsh_attention)
    from dynmo_plugin.scenarios.sparse_attention.unfused import lsh_attention_unfused
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    kind = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    q, k, v = (torch.randn(s, b, heads, head_dim, generator=gen).to(device, kind).requires_grad_()
               for _ in range(3))
    cuda = torch.device(device).type == "cuda"
    rot, scale = [hash_rotation(0, 1, 0, 0, 0, head_dim, buckets)], head_dim ** -0.5
    kernels = {"dense": lambda: dense_causal_attention(q, k, v, scale),
               "chunked": lambda: lsh_attention(q, k, v, buckets, rot, scale),
               "unfused": lambda: lsh_attention_unfused(q, k, v, buckets, rot, scale)}

    def once(fn) -> float:
        if cuda:  # device time of the whole forward + backward
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn().float().sum().backward()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        else:
            start = time.thread_time()
            fn().float().sum().backward()
            elapsed = time.thread_time() - start
        for x in (q, k, v):
            x.grad = None
        return elapsed

    names = list(kernels)
    for name in names:  # warm-up
        once(kernels[name])
    times: dict = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(once(kernels[name]))

    def ratio(a: str, b: str) -> dict:
        values = sorted(x / y for x, y in zip(times[a], times[b]))
        return {"median": statistics.median(values), "min": values[0], "max": values[-1]}

    return {"shape": f"s{s} b{b} heads{heads} d{head_dim} {dtype}, {buckets} buckets, {device}",
            "repeats": repeats,
            "ms": {n: round(1e3 * statistics.median(t), 2) for n, t in times.items()},
            "chunked_over_dense": ratio("chunked", "dense"),
            "chunked_over_unfused": ratio("chunked", "unfused"),
            "unfused_over_dense": ratio("unfused", "dense")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--run", action="store_true", help="a torchrun training run's profiles instead")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", help="cuda: wall time between synchronisations")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    a = p.parse_args()
    if not a.run:
        result = kernel_ratios(a.seq, a.batch, a.heads, a.head_dim, a.buckets, a.dtype, a.repeats,
                               a.device)
        if a.json:
            print(json.dumps(result))
            return
        clock = "wall time" if a.device.startswith("cuda") else "CPU time (indicative only)"
        print(f"{result['shape']}, {result['repeats']} interleaved rounds, {clock}")
        print("median ms  " + "  ".join(f"{n} {v}" for n, v in result["ms"].items()))
        for key in ("chunked_over_dense", "chunked_over_unfused", "unfused_over_dense"):
            r = result[key]
            print(f"{key:22s} {r['median']:.3f}x  (spread {r['min']:.3f}-{r['max']:.3f})")
        return
    with tempfile.TemporaryDirectory() as out:
        torchrun(2, ["-m", "dynmo_plugin.train", *MODEL, *SCENARIO, "--train-iters", str(a.iters),
                     "--output", out])
        result = ratios(json.loads((Path(out) / "report.json").read_text()))
    if a.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:26s} {value:.3f}" if isinstance(value, float) else f"{key:26s} {value}")


if __name__ == "__main__":
    main()
