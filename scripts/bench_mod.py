#!/usr/bin/env python
"""Mixture of Depths: one routed layer's fwd+bwd time by capacity, relative to a PLAIN
TransformerLayer of the same shape (the timing side of the counted work in
tests/scenarios/test_scenario_mod.py and tests/scenarios/test_scheme_gpu_shapes.py).

A plain layer and a routed one at each capacity are timed in interleaved rounds (plain,
1.0, 0.75, ..., plain, ...), each round the median of `--iters` steps after a warm-up;
printed: milliseconds and each variant / plain ratio as the median of the per-round
ratios with their min-max spread, and the tokens each capacity ran (rounded to
`--granularity`). On CPU: one process, one thread, fp32 unless --bf16. On a GPU
(--device cuda, NCCL group of one): each step between two synchronisations, so a step
is max(GPU time, host launch time). The CPU runs' stage 0 measured ~0.45x (0.25),
~1.4x (1.0), ~0.35x (0.125) of capacity 0.75.

Usage: python scripts/bench_mod.py [--hidden 128] [--heads 4] [--seq 256] [--batch 2]
                                   [--rounds 5] [--iters 5] [--granularity 32]
                                   [--device cpu|cuda] [--bf16]
                                   [--attention-backend unfused|sdpa]
The issue-33 GPU-bound shape (one H100/H200):
    python scripts/bench_mod.py --device cuda --bf16 --hidden 4096 --heads 32 --seq 2048 \\
        --batch 1 --granularity 64
The scenario row's layer (scripts/gpu_checks/rows_scenarios.py: micro-batch 4, SDPA):
    python scripts/bench_mod.py --device cuda --bf16 --hidden 4096 --heads 32 --seq 4096 \\
        --batch 4 --granularity 64 --attention-backend sdpa
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
CAPACITIES = (1.0, 0.75, 0.5, 0.25, 0.125)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 128), ("heads", 4), ("seq", 256), ("batch", 2),
                          ("rounds", 5), ("iters", 5), ("granularity", 32)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--attention-backend", choices=("unfused", "sdpa"), default="unfused")
    return p.parse_args()


def _layers(a, device: torch.device, dtype: torch.dtype):
    """(plain, routed) layers of the run's spec, weights N(0, 0.02), on `device`."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    args = ModelArgs(num_layers=2, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, bf16=a.bf16, transformer_impl="local",
                     distributed_backend="nccl" if device.type == "cuda" else "gloo")
    init_parallel(args)
    cfg = transformer_config(args, Layout.uniform(2, 1))
    spec = mod_spec(layer_spec("local", a.attention_backend), {2: 1.0}, max(8, a.hidden // 8), a.granularity)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n in (1, 2):
        layer = build_module(spec, config=cfg, layer_number=n)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1
                        else torch.full(p.shape, 1.0 if name.endswith("weight") else 0.0))
        layers.append(layer.to(device=device, dtype=dtype))
    layers[1].mod_context = ModContext(predictor_loss_weight=0.01, grad_scale=1.0)
    return layers


def _step_s(layer, x, mask, sync) -> float:
    sync()
    start = time.perf_counter()
    inp = x.detach().requires_grad_(True)
    layer(hidden_states=inp, attention_mask=mask)[0].float().sum().backward()
    sync()
    return time.perf_counter() - start


def main() -> None:
    a = _args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain, routed = _layers(a, device, dtype)
    s = a.seq
    x = torch.randn(s, a.batch, a.hidden, dtype=dtype, device=device)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]
    times = {c: [] for c in (None,) + CAPACITIES}
    for _ in range(a.rounds):
        for c in times:
            layer = plain if c is None else routed
            if c is not None:
                layer.set_capacity(c)
            _step_s(layer, x, mask, sync)  # warm-up
            times[c].append(statistics.median(_step_s(layer, x, mask, sync) for _ in range(a.iters)))
    print(f"one routed layer h{a.hidden} s{s} mb{a.batch} {str(dtype).removeprefix('torch.')} "
          f"on {device.type}; {a.rounds} interleaved rounds x {a.iters} steps; "
          f"granularity {a.granularity}; {a.attention_backend} attention")
    print(f"{'capacity':<9} {'tokens':>7} {'fwd+bwd ms':>11} {'vs plain (median, min-max)':>30}")
    for c, t in times.items():
        ratios = [v / r for v, r in zip(t, times[None])]
        if c is not None:
            routed.set_capacity(c)
        tokens = s if c is None else routed.tokens(s)
        print(f"{'plain' if c is None else c:<9} {tokens:>7} {1e3 * statistics.median(t):>11.2f} "
              f"{statistics.median(ratios):>14.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
