#!/usr/bin/env python
"""Structured pruning: one GPT layer's fwd+bwd time and parameter bytes, dense vs masked
vs physical, at a fraction of FFN neurons pruned (default 0.67).

* dense:    Megatron's local layer, unpruned;
* masked:   `--dynmo-pruning-structured masked`: full-size weights, kept neurons
            gathered into smaller GEMMs at every call;
* physical: the default: the layer rebuilt with the kept neurons only (what a pruning
            round does, through `shrunk_tensors`), at the kept width rounded to the
            nearest `--width-multiple` (default 128, what a round keeps since issue 33);
* unaligned: the same at the unrounded width (what a round kept before: e.g. 676 of
            2048, no multiple of 8; a bf16 GPU GEMM at such a width is slow), timed
            only when the rounding changes the width;
* csr:      unstructured magnitude-style pruning at `--sparsity` (default 0.98, the
            final sparsity of tests/scenarios/test_scenario_pruning.py's runs) on the CSR kernels
            (fp32; the timing side of test_pruned_layers_do_less_work's FLOP count).
The four are timed in interleaved rounds (dense, masked, physical, dense, ...), each
round the median of `--iters` steps after a warm-up; the script prints per-layer
milliseconds, parameter bytes, and masked/dense, physical/dense ratios as the median
of the per-round ratios with their min-max spread. One process, one thread.
On CUDA (`--device cuda`) steps are timed with CUDA events around synchronised steps.

Usage: python scripts/bench_pruning.py [--hidden 512] [--seq 512] [--batch 2]
       [--pruned 0.67] [--width-multiple 128] [--sparsity 0.98] [--rounds 5] [--iters 10] [--dtype fp32|bf16] [--device cpu|cuda]
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


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--pruned", type=float, default=0.67)
    p.add_argument("--width-multiple", type=int, default=128,
                   help="kept FFN width rounded to the nearest multiple (the scenario's width_multiple)")
    p.add_argument("--sparsity", type=float, default=0.98)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p.parse_args()


def _layers(a):
    """(dense, masked, physical) layers with the same weights."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.scenarios.gradual_pruning.live import shrunk_tensors
    from dynmo_plugin.scenarios.gradual_pruning.kernels import apply_mask_
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.scenarios.gradual_pruning.layer import (neuron_prunable_layer_spec, prunable_layer_spec,
                                                              prunable_linears)
    from dynmo_plugin.scenarios.gradual_pruning.widths import aligned_width
    args = ModelArgs(num_layers=1, hidden_size=a.hidden, num_attention_heads=a.heads,
                     seq_length=a.seq, bf16=a.dtype == "bf16",
                     distributed_backend="nccl" if a.device == "cuda" else "gloo")
    init_parallel(args)
    cfg = transformer_config(args, Layout.uniform(1, 1))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32

    def build(spec):
        layer = build_module(spec, config=cfg, layer_number=1).to(a.device, dtype)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        return layer

    def pruned(kept: int):
        """(masked, physical) layers keeping `kept` FFN neurons (a seeded random choice)."""
        masked = build(neuron_prunable_layer_spec(layer_spec("local")))
        fc1, fc2 = masked.mlp.linear_fc1, masked.mlp.linear_fc2
        ffn = fc1.weight.shape[0]
        keep = torch.ones(ffn, dtype=torch.bool, device=a.device)
        keep[torch.randperm(ffn, generator=torch.Generator().manual_seed(1))[:ffn - kept].to(a.device)] = False
        with torch.no_grad():
            fc1.weight_mask &= keep[:, None]
            fc2.weight_mask &= keep[None, :]
            apply_mask_(fc1.weight, fc1.weight_mask)
            apply_mask_(fc1.bias, keep)
            apply_mask_(fc2.weight, fc2.weight_mask)
        fc1.refresh()
        fc2.refresh()
        physical = build(neuron_prunable_layer_spec(layer_spec("local")))
        physical.load_state_dict(loadable_state(shrunk_tensors(masked, carried_state(masked))))
        return masked, physical

    ffn = cfg.ffn_hidden_size
    kept = ffn - round(a.pruned * ffn)
    aligned = aligned_width(kept, a.width_multiple, ffn, ffn)
    masked, physical = pruned(aligned)
    layers = {"dense": build(layer_spec("local")), "masked": masked, "physical": physical}
    if aligned != kept:
        layers["unaligned"] = pruned(kept)[1]
    print(f"FFN width {ffn}: kept {aligned} (multiple {a.width_multiple}); unaligned {kept}")
    if a.dtype == "fp32":  # the CSR kernels take fp32 only
        layers["csr"] = csr = build(prunable_layer_spec(layer_spec("local"), 0.5))
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for _, m in prunable_linears(csr):
                m.weight_mask.copy_(torch.rand(m.weight.shape, generator=gen) >= a.sparsity)
                apply_mask_(m.weight, m.weight_mask)
    return layers, dtype


def _step_s(layer, x, mask, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out, _ = layer(hidden_states=x, attention_mask=mask)
    out.float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    a = _args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"),
                      RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    layers, dtype = _layers(a)
    x = torch.randn(a.seq, a.batch, a.hidden, device=a.device, dtype=dtype, requires_grad=True)
    s = a.seq
    mask = torch.ones(s, s, dtype=torch.bool, device=a.device).triu(1).view(1, 1, s, s)
    times = {name: [] for name in layers}
    for _ in range(a.rounds):
        for name, layer in layers.items():
            for _ in range(2):  # warm-up
                _step_s(layer, x, mask, a.device)
            times[name].append(statistics.median(_step_s(layer, x, mask, a.device)
                                                 for _ in range(a.iters)))
    print(f"one GPT layer h{a.hidden} s{a.seq} mb{a.batch} {a.dtype} on {a.device}, "
          f"{a.pruned:.0%} of FFN neurons pruned; {a.rounds} interleaved rounds x {a.iters} steps")
    print(f"{'variant':<9} {'fwd+bwd ms':>11} {'param bytes':>12} {'vs dense (median, min-max)':>30}")
    for name, layer in layers.items():
        nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        ratios = [t / d for t, d in zip(times[name], times["dense"])]
        print(f"{name:<9} {1e3 * statistics.median(times[name]):>11.2f} {nbytes:>12,} "
              f"{statistics.median(ratios):>14.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
