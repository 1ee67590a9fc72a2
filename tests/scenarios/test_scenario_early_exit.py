"""Early exit (CALM-style) under real torchrun pipeline runs.

Training is bit-deterministic (seeded data and init, one thread), so exit fractions,
confidences and losses are exact facts of these settings; only timings vary. On this
synthetic data (vocabulary 16, uniform confidence 1/16) the exit heads' confidence
rises from ~0.10 to ~0.30 within 36 iterations: with threshold 0.2, exits (allowed
after layer 4) start near iteration 20 and reach ~100% of tokens before layer 8 by
iteration 32. A layer gathers the tokens active one layer earlier (the bound it knows
without a host read: docs/scenarios/early_exit.md), so layer 5 (the first on stage 2)
saves nothing and layers 6-8 are cheap from ~iteration 30 on: the profile of iteration
35 drives the decision at 37, hence 40 iterations.
"""
import pytest
import torch

from dynmo_plugin.config import ModelArgs
from launch import in_megatron_process, losses, train

pytestmark = pytest.mark.multiproc

START = 12
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--vocab-size", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "40", "--lr", "1e-2", "--seed", "7",
         "--pipeline-model-parallel-size", "2"]
SCENARIO = ["--dynmo-dynamism", "early_exit", "--dynmo-early-exit-threshold", "0.2",
            "--dynmo-early-exit-loss-weight", "0.5", "--dynmo-early-exit-start", str(START),
            "--dynmo-early-exit-interval", "4", "--dynmo-early-exit-min-layer", "4",
            "--dynmo", "--dynmo-profile-every", "5",
            "--dynmo-early-exit-token-multiple", "8",  # s = 64: the default 64 would gather all
            # the gate's floor off: the move's predicted gain (~12-16%) is within the noise
            # floor a busy machine measures (10-14%); the floor has its own tests
            "--dynmo-min-gain", "0"]


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "uniform"],
                 tmp_path_factory.mktemp("static"))


@pytest.fixture(scope="module")
def dynmo(tmp_path_factory):
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "exact"],
                 tmp_path_factory.mktemp("dynmo"))


def _exit_events(report):
    return [e for e in report["events"] if e["kind"] == "dynamism"]


def test_tail_layers_get_cheaper_as_tokens_exit(static):
    events = _exit_events(static)
    assert [e["iteration"] for e in events] == list(range(START, 41, 4))
    first, last = events[0]["detail"], events[-1]["detail"]
    assert all(f == 0.0 for f in first["exit_fraction"].values())   # heads still learning
    assert last["exit_fraction"]["8"] >= 0.9                         # nearly all exited
    assert all(last["exit_fraction"][str(n)] == 0.0 for n in range(1, 5))  # min_layer 4
    assert last["confidence"]["4"] > first["confidence"]["4"] + 0.1  # confidence rises
    # layer 8 counted the tokens it ran (exit_fraction = 1 - its active / seen): >= 90%
    # fewer; that running 10% of the tokens is < 0.3x the work, counted:
    # test_layer_with_exited_tokens_does_less_work (timed: scripts/bench_layer_work.py)


def test_layer_with_exited_tokens_does_less_work():
    in_megatron_process(_check_exit_work, ModelArgs(num_layers=8, hidden_size=64,
                                                     num_attention_heads=4, seq_length=64))


def _exit_layer_flops(layer, ctx, exited) -> int:
    """FLOPs of one forward + backward of `layer` on the runs' shape with `exited` [s, b]
    tokens flagged in the carrier rows, counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    from dynmo_plugin.scenarios.early_exit.layer import encode_exited
    s, b, h = ctx.seq_length, exited.shape[1], layer.config.hidden_size
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(0))
    hidden = torch.cat([x, encode_exited(exited, h, x.dtype)]).requires_grad_(True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    layer.reset_exit_stats()
    with FlopCounterMode(display=False) as counter:
        out, _ = layer(hidden_states=hidden, attention_mask=mask)
        out[:s].sum().backward()
    return counter.get_total_flops()


def _check_exit_work(args):
    """The last layer (8) with 90% of each sample's tokens exited before it runs the
    other 10% only (gathered), the exit head included: under 0.3x the work of the same
    layer with no token exited (the runs' profiles measured layer 8 / layer 1 fall
    below 0.3x of its value before exits)."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.early_exit.layer import ExitContext, early_exit_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    layer = build_module(early_exit_spec(layer_spec(), 16), config=cfg, layer_number=8)
    s, b = args.seq_length, 2
    gen = torch.Generator().manual_seed(1)
    layer.exit_context = ctx = ExitContext(
        seq_length=s, threshold=0.2, min_layer=4, exits_on=True, loss_weight=0.5, grad_scale=1.0,
        labels=[torch.randint(16, (s, b), generator=gen)] * 2, loss_masks=[torch.ones(s, b)] * 2,
        token_multiple=8)  # 6 active tokens gathered as 8
    exited = torch.zeros(s, b, dtype=torch.bool)
    full = _exit_layer_flops(layer, ctx, exited)
    for j in range(b):
        exited[torch.randperm(s, generator=gen)[:s - s // 10], j] = True
    assert layer.tokens_active == s * b
    few = _exit_layer_flops(layer, ctx, exited)
    assert layer.tokens_active == (s // 10) * b
    assert 0 < few < 0.3 * full, (few, full)


def test_dynmo_losses_equal_static_with_early_exit(static, dynmo):
    assert losses(dynmo) == losses(static)
    assert any(max(e["detail"]["exit_fraction"].values()) > 0 for e in _exit_events(dynmo))
    applied = [e for e in dynmo["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied and all(e["trigger"].startswith("event:early_exit@") for e in applied)
    assert dynmo["layout"] != dynmo["initial_layout"]
    assert not [e for e in static["events"] if e["kind"] == "rebalance" and e["applied"]]


def test_threshold_one_never_exits_and_changes_nothing(tmp_path):
    """threshold 1.0 (strict >) never exits; with loss weight 0 the heads cannot touch
    the backbone, so the losses equal a run without the scenario bit for bit (exit
    flags ride in extra activation rows across the stage boundary, so this also checks
    that carrying them changes nothing)."""
    small = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--train-iters", "4", "--seed", "7",
             "--pipeline-model-parallel-size", "2"]
    plain = train(2, small, tmp_path / "plain")
    never = train(2, small + ["--dynmo-dynamism", "early_exit", "--dynmo-early-exit-threshold", "1.0",
                              "--dynmo-early-exit-loss-weight", "0", "--dynmo-early-exit-start", "1",
                              "--dynmo-early-exit-interval", "1"], tmp_path / "never")
    events = _exit_events(never)
    assert [e["iteration"] for e in events] == [1, 2, 3, 4]
    assert all(f == 0.0 for e in events for f in e["detail"]["exit_fraction"].values())
    assert all(0 < c < 1 for e in events for c in e["detail"]["confidence"].values())
    assert losses(never) == losses(plain)
