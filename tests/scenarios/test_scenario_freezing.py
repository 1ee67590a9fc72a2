"""Layer freezing (dynamism.kind layer_freezing) on real torchrun runs, 2 pipeline stages.

The model is small but really learns the synthetic data (vocabulary 32: loss 3.40 ->
~2.9 in 32 iterations) and the learning rate decays (cosine over 40 iterations, fixed
by --lr-decay-iters so a shorter run trains identically), so every layer's plasticity
falls: ~0.7 of its reference at iteration 12, ~0.5 at 16, ~0.33 at 20, ~0.26 at 24.
With threshold 0.3, layers 1-8 freeze at iteration 24 (the prefix reaches into stage 1)
and 9-11 at 28 (measured; the tests rely only on "at least one freeze"). 12 layers so
that one layer is a fine enough step for the balancer to act on. Tied embeddings (the
default) throughout.
"""
import json
import shutil

import pytest
import torch

from dynmo_plugin.scenarios.layer_freezing.live import combine_shards, freeze_limit, frozen_prefix, plasticity
from launch import in_megatron_process, load_params, losses, worker

MODEL = ["--num-layers", "12", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "3e-3", "--lr-decay-style", "cosine",
         "--min-lr", "1e-4", "--lr-decay-iters", "40", "--seed", "11",
         "--pipeline-model-parallel-size", "2", "--dynmo", "--dynmo-min-gain", "0",
         "--dynmo-dynamism", "layer_freezing", "--dynmo-freezing-start", "4",
         "--dynmo-freezing-interval", "4", "--dynmo-freezing-threshold", "0.3",
         "--dynmo-profile-every", "4", "--test-dump-params"]
ITERS = 32
STATIC = ["--dynmo-balancer", "uniform", "--use-distributed-optimizer"]
SAVED = 26  # the DynMo run's checkpoint: after the first freeze (24), before the second (28)


# ---- pure decision logic ----------------------------------------------------------------------
def test_prefix_is_contiguous_and_capped():
    converged = {1: True, 2: True, 3: False, 4: True}
    assert frozen_prefix(converged, 0, 7) == 2
    assert frozen_prefix({1: False, 2: True}, 0, 7) == 0      # front to back only
    assert frozen_prefix({n: True for n in range(1, 9)}, 0, freeze_limit(8, 0)) == 7  # never the last
    assert frozen_prefix({n: True for n in range(1, 9)}, 1, freeze_limit(8, 3)) == 3  # max_layers
    assert frozen_prefix({3: True, 4: False}, 2, 7) == 3       # grows from the current prefix


def test_shards_summed_replicas_read_once():
    gathered = [{"dp": 0, "tp": 1, "layers": {1: (1.0, 4.0, 0.5)}},
                {"dp": 0, "tp": 0, "layers": {1: (3.0, 12.0, 0.5)}},
                {"dp": 1, "tp": 0, "layers": {1: (99.0, 1.0, 0.5)}}]
    assert combine_shards(gathered) == {1: (4.0, 16.0, 0.5)}
    assert plasticity(4.0, 16.0) == 0.5 and plasticity(1.0, 0.0) == 0.0


# ---- real runs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DynMo (exact balancer), static (uniform balancer: its plan is the uniform layout,
    so nothing moves; Megatron's distributed optimizer, which at DP=1 updates exactly as
    the others' Adam; saves a checkpoint at SAVED into <its dir>/ckpt) and a static run
    that stops at the iteration of the first freeze."""
    out = {}
    for name, flags in [("dynmo", ["--dynmo-balancer", "exact", "--test-dump-ranks"]),
                        ("static", STATIC + ["--save-interval", str(SAVED)])]:
        path = tmp_path_factory.mktemp(name)
        save = ["--save", str(path / "ckpt")] if name == "static" else []
        out[name] = (path, worker(2, MODEL + flags + save + ["--train-iters", str(ITERS)], path))
    first = _freezes(out["dynmo"][1])[0]["iteration"]
    path = tmp_path_factory.mktemp("stop")
    out["stop"] = (path, worker(2, MODEL + ["--dynmo-balancer", "uniform",
                                            "--train-iters", str(first)], path))
    return out


def _freezes(report):
    return [e for e in report["events"] if e["kind"] == "dynamism"]


def _decisions(report):
    """What was decided (timings of the rebuild left out: they differ between runs)."""
    return [(e["iteration"], e["detail"]["frozen_layers"], e["detail"]["plasticity"])
            for e in _freezes(report)]


def _profiles(report):
    return [(e["iteration"], e["profile"]) for e in report["events"]
            if e["kind"] in ("profile", "rebalance") and e.get("profile")]


def _params(path):
    """Every rank's parameters by global name; the two copies of the tied word embeddings
    (stage 0's embedding, the last stage's output layer) must be equal."""
    return load_params(path, range(2))


@pytest.mark.multiproc
def test_plasticity_falls_and_prefix_freezes(runs):
    path, report = runs["dynmo"]
    freezes = _freezes(report)
    assert freezes, "no layer froze: plasticity never fell below threshold x reference"
    first = freezes[0]["detail"]
    assert first["frozen_layers"][0] == 1 and first["newly_frozen"] == first["frozen_layers"]
    assert all(first["plasticity"][str(n)] < 0.3 * first["references"][str(n)]
               for n in first["newly_frozen"])
    loss = losses(report)
    assert loss[-1] < loss[0] - 0.3, "the data must be learnable"
    ranks = [json.loads((path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [_decisions(r) for r in ranks] == [_decisions(report)] * 2  # the same on every rank


@pytest.mark.multiproc
def test_moved_run_trains_exactly_like_static(runs):
    (_, dynmo), (_, static) = runs["dynmo"], runs["static"]
    assert _decisions(dynmo) and _decisions(static) == _decisions(dynmo)
    rebalances = [e for e in dynmo["events"] if e["kind"] == "rebalance"]
    assert any(e["applied"] and e["trigger"].startswith("event:layer_freezing") for e in rebalances)
    assert not any(e["applied"] for e in static["events"] if e["kind"] == "rebalance")
    assert losses(dynmo) == losses(static)
    pa, pb = _params(runs["dynmo"][0]), _params(runs["static"][0])
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []


@pytest.mark.multiproc
def test_frozen_prefix_skips_backward_keeps_forward(runs):
    report = runs["dynmo"][1]
    freeze = _freezes(report)[0]
    frozen = set(freeze["detail"]["frozen_layers"])
    after = next(p for it, p in _profiles(report) if it > freeze["iteration"])
    layers = {x["layer"]: x for x in after["layers"]}
    assert all(x["bwd_s"] > 0 for n, x in layers.items() if n not in frozen)  # incl. the first one after the prefix
    assert all(layers[n]["grad_bytes"] == 0 and layers[n]["optim_bytes"] == 0 for n in frozen)
    # what the profile timed (frozen bwd_s < 0.1x a trainable layer's, fwd_s unchanged),
    # counted: test_frozen_layer_does_forward_work_and_no_backward_work; timed:
    # scripts/bench_layer_work.py


@pytest.mark.multiproc
def test_frozen_layer_does_forward_work_and_no_backward_work():
    in_megatron_process(_check_frozen_work)


def _layer_flops(layer, x) -> tuple[int, int]:
    """(forward, backward) FLOPs of the layer on `x`, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode
    s = x.shape[0]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with FlopCounterMode(display=False) as fwd:
        out, _ = layer(hidden_states=x, attention_mask=mask)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _check_frozen_work(args):
    """The real freezable layer frozen as the scenario freezes it (set_frozen, weights
    requires_grad False) does exactly the trainable layer's forward matmuls and none in
    the backward, where the trainable one does about twice its forward; the input still
    gets its (zero) gradient, so the schedule upstream runs unchanged."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    layer = build_module(freezable_spec(layer_spec()), config=cfg, layer_number=1)
    x = torch.randn(args.seq_length, 2, args.hidden_size, requires_grad=True)
    fwd, bwd = _layer_flops(layer, x)
    assert fwd > 0 and bwd > 1.5 * fwd, (fwd, bwd)
    layer.set_frozen(True)
    for p in layer.parameters():
        p.requires_grad_(False)
    x.grad = None
    assert _layer_flops(layer, x) == (fwd, 0)
    assert x.grad is not None and not x.grad.any()


@pytest.mark.multiproc
def test_frozen_parameters_never_change(runs):
    first = _freezes(runs["dynmo"][1])[0]
    frozen = first["detail"]["frozen_layers"]
    at_freeze, end = _params(runs["stop"][0]), _params(runs["dynmo"][0])
    frozen_names = [n for n in end if n.startswith("embedding.")
                    or any(n.startswith(f"decoder.layers.{k - 1}.") for k in frozen)]
    assert "embedding.word_embeddings.weight" in frozen_names  # the tied copy included
    assert [n for n in frozen_names if not torch.equal(at_freeze[n], end[n])] == []
    last = [n for n in end if n.startswith("decoder.layers.11.")]
    assert any(not torch.equal(at_freeze[n], end[n]) for n in last)  # the rest still trains


@pytest.mark.multiproc
def test_resumed_after_a_freeze_trains_on_exactly(runs, tmp_path):
    """The static run's checkpoint after the first freeze, resumed: the frozen prefix
    (the embedding, its tied copy on the last stage, and every layer of the first stage
    under the uniform split Etttttt|ttttttL) comes back frozen, the scenario decides
    the next freeze as the uninterrupted run did, and the losses and final parameters
    are that run's to the last bit. A first stage with nothing to train holds no Adam
    step, and rank 0 alone writes Megatron's common state: the step was missing from
    the checkpoint and the resume failed (KeyError 'step'; the distributed optimizer
    failed the save: an assertion) until ranks agreed on it."""
    path, report = runs["static"]
    ckpt = path / "ckpt"
    meta = json.loads((ckpt / f"iter_{SAVED:07d}/meta.json").read_text())
    assert meta["layout"] == "Etttttt|ttttttL"
    first_stage = {f"decoder.layers.{n}." for n in range(6)} | {"embedding."}
    assert {prefix for prefix in first_stage
            if any(name.startswith(prefix) for name in meta["frozen"])} == first_stage
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(ITERS)  # the last is saved too
    load = tmp_path / "load"  # the checkpoint at SAVED alone
    shutil.copytree(ckpt / f"iter_{SAVED:07d}", load / f"iter_{SAVED:07d}")
    (load / "latest_checkpointed_iteration.txt").write_text(str(SAVED))
    resumed = worker(2, MODEL + STATIC + ["--train-iters", str(ITERS), "--load", str(load)],
                     tmp_path)
    assert [it["iteration"] for it in resumed["iterations"]] == list(range(SAVED + 1, ITERS + 1))
    assert _decisions(resumed) == [d for d in _decisions(report) if d[0] > SAVED] != []
    assert losses(resumed) == losses(report)[SAVED:]
    pa, pb = load_params(tmp_path, range(2)), _params(path)
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []


def test_shipped_config_is_valid():
    """configs/layer_freezing.yaml loads (the run itself: docs/scenarios/layer_freezing.md)."""
    from dynmo_plugin.megatron.training.machine import load_run_config
    from dynmo_plugin.train import build_parser
    from launch import ROOT
    args = build_parser().parse_args(["--dynmo", "--dynmo-config", str(ROOT / "configs/layer_freezing.yaml")])
    cfg = load_run_config(args, world_size=2)
    f = cfg.dynmo.dynamism.freezing
    assert cfg.dynmo.dynamism.kind == "layer_freezing"
    assert f.start + 2 * f.interval <= cfg.model.train_iters  # a reference, then a verdict
