#!/usr/bin/env python
"""What each layer's own random streams cost (megatron.training.layer_streams).

One GPT layer with hidden dropout 0.1 (fp32, CPU, one thread), forward and backward,
with and without the streams' hooks (seed the layer's generators before its forward,
put the rank's back after), timed in interleaved rounds: per round the median of
`--iters` steps after a warm-up; the ratio is the median of the rounds' ratios with its
min-max spread (a difference inside the spread is no finding). Also the hooks' own
cost per forward, alone, in microseconds. On a GPU the hooks do the same host work (a
CUDA generator's state is its seed and offset, kept on the host) plus one seed per
stream of Megatron's RNG tracker.

Usage: python scripts/bench_layer_streams.py [--hidden 256] [--seq 128] [--rounds 5] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 256), ("heads", 4), ("seq", 128), ("batch", 2),
                          ("rounds", 5), ("iters", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def _layers(a):
    """(plain layer, hooked layer, their LayerStreams, input): one spec and config."""

    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.layer_streams import LayerStreams
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    args = ModelArgs(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, hidden_dropout=0.1, distributed_backend="gloo")
    dims = init_parallel(args)
    cfg = transformer_config(args, Layout.uniform(1, 1))
    plain, hooked = (build_module(layer_spec(), config=cfg, layer_number=1).train() for _ in range(2))
    hooked.load_state_dict(plain.state_dict())
    # the stage members LayerStreams reads, over the one hooked layer (a bench stand-in)
    stage = SimpleNamespace(dims=dims,
                            chunks=[SimpleNamespace(decoder=SimpleNamespace(layers=[hooked]))],
                            config=cfg, num_microbatches=1)
    streams = LayerStreams(stage, args.seed)
    streams.step(1)
    x = torch.randn(a.seq, a.batch, a.hidden, generator=torch.Generator().manual_seed(0))
    return plain, hooked, streams, x


def _step_s(layer, x, mask) -> float:
    start = time.perf_counter()
    out = layer(hidden_states=x.clone().requires_grad_(True), attention_mask=mask)[0]
    out.sum().backward()
    return time.perf_counter() - start


def _hooks_us(streams, n: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        kept = streams._keep()
        streams._seed(1, kept)
        streams._leave(kept)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    a = _args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29536"),
                      RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    plain, hooked, streams, x = _layers(a)
    mask = torch.triu(torch.ones(a.seq, a.seq, dtype=torch.bool), 1)[None, None]
    times = {"plain": [], "streams": []}
    hooks = []
    for _ in range(a.rounds):
        for name, layer in (("plain", plain), ("streams", hooked)):
            _step_s(layer, x, mask)  # warm-up
            times[name].append(statistics.median(_step_s(layer, x, mask) for _ in range(a.iters)))
        hooks.append(_hooks_us(streams))
    ratios = [s / p for s, p in zip(times["streams"], times["plain"])]
    print(f"one GPT layer h{a.hidden} s{a.seq} mb{a.batch} fp32, hidden dropout 0.1, on cpu; "
          f"{a.rounds} interleaved rounds x {a.iters} steps (median, min-max)")
    for name, values in times.items():
        print(f"{name:<8} fwd+bwd {1e3 * statistics.median(values):8.2f} ms")
    print(f"streams / plain, fwd+bwd  {statistics.median(ratios):.3f}x "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    print(f"the hooks alone per forward  {statistics.median(hooks):.1f} us ({min(hooks):.1f}-{max(hooks):.1f})")


if __name__ == "__main__":
    main()
