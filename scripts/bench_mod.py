#!/usr/bin/env python
"""Mixture of Depths: one routed layer's fwd+bwd time by capacity, relative to capacity
0.75 (the timing side of tests/scenarios/test_scenario_mod.py's counted work).

A plain layer and a routed one at each capacity are timed in interleaved rounds (plain,
1.0, 0.75, ..., plain, ...), each round the median of `--iters` steps after a warm-up;
printed: milliseconds and each variant / capacity-0.75 ratio as the median of the
per-round ratios with their min-max spread. One process, one thread. The runs' stage 0
measured ~0.45x (0.25), ~1.4x (1.0), ~0.35x (0.125).

Usage: python scripts/bench_mod.py [--hidden 128] [--seq 256] [--batch 2] [--rounds 5] [--iters 5]
                                   [--granularity 32]
(--granularity: the token multiple C is rounded to; 32 keeps every capacity above exact
at 256 tokens.)
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
    return p.parse_args()


def _layers(a):
    """(plain, routed) layers of the run's spec."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    args = ModelArgs(num_layers=2, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, distributed_backend="gloo")
    init_parallel(args)
    cfg = transformer_config(args, Layout.uniform(2, 1))
    spec = mod_spec(layer_spec(), {2: 1.0}, max(8, a.hidden // 8), a.granularity)
    plain, routed = (build_module(spec, config=cfg, layer_number=n) for n in (1, 2))
    routed.mod_context = ModContext(predictor_loss_weight=1.0, grad_scale=1.0)
    return plain, routed


def _step_s(layer, x, mask, rope) -> float:
    start = time.perf_counter()
    layer(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)[0].sum().backward()
    return time.perf_counter() - start


def main() -> None:
    a = _args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    plain, routed = _layers(a)
    s = a.seq
    x = torch.randn(s, a.batch, a.hidden, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    rope = RotaryEmbedding(kv_channels=a.hidden // a.heads, rotary_percent=1.0)(s)
    times = {c: [] for c in (None,) + CAPACITIES}
    for _ in range(a.rounds):
        for c in times:
            layer = plain if c is None else routed
            if c is not None:
                layer.set_capacity(c)
            _step_s(layer, x, mask, rope)  # warm-up
            times[c].append(statistics.median(_step_s(layer, x, mask, rope) for _ in range(a.iters)))
    print(f"one routed layer h{a.hidden} s{s} mb{a.batch} fp32 on cpu; "
          f"{a.rounds} interleaved rounds x {a.iters} steps")
    print(f"{'capacity':<9} {'fwd+bwd ms':>11} {'vs 0.75 (median, min-max)':>30}")
    for c, t in times.items():
        ratios = [v / r for v, r in zip(t, times[0.75])]
        print(f"{'plain' if c is None else c:<9} {1e3 * statistics.median(t):>11.2f} "
              f"{statistics.median(ratios):>14.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
