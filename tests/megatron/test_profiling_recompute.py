"""Activation recompute under the probe (Megatron's --recompute-granularity full): the
forward `tensor_parallel.checkpoint` runs again inside the backward is the layer's
backward cost, not a forward of another micro-batch, and what the layer holds between its
forward and backward is its kept input. Real Megatron-Core stage and schedule (one gloo
rank); the clock is a fault, named as such, that reads only the work the test counts."""
from __future__ import annotations

import pytest

import torch

from launch import in_megatron_process

from dynmo_plugin.config import ModelArgs
from dynmo_plugin.profiling.clock import CpuThreadClock

ARGS = ModelArgs(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                 global_batch_size=4)


class WorkClock(CpuThreadClock):
    """A fault, named as such: time is the work the test counts, 1 per forward of a layer's
    first MLP projection and 2 per backward of it, nothing else; so a span reads exactly
    the passes inside it, plus `constant` for every span (its start reads that much early,
    as a span's fixed cost does on a GPU)."""

    name = "work"

    def __init__(self, constant: float = 0.0):
        self.work, self.constant = 0.0, constant

    def mark(self) -> float:
        return self.work

    def begin(self) -> float:
        return self.work - self.constant


class RangeRecorder:
    """A stand-in for `kernels.KernelBusy` (no CUDA profiler here): the spans' ranges in
    the order the probe opens and closes them."""

    def __init__(self):
        self.log: list[tuple[str, str, int]] = []

    def open(self, key: str, mb: int) -> None:
        self.log.append(("open", key, mb))

    def close(self, key: str, mb: int) -> None:
        self.log.append(("close", key, mb))

    def next_iteration(self) -> None:
        pass


def _count_work(trainer, clock: WorkClock) -> None:
    def add(amount: float):
        def hook(*_):
            clock.work += amount
        return hook

    def forward(module, args, output):
        add(1.0)()
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:  # not in a forward without autograd (the first under recompute)
            out.register_hook(add(2.0))
    for chunk in trainer.chunks:
        for layer in chunk.decoder.layers:
            layer.mlp.linear_fc1.register_forward_hook(forward)


def _evaluate(trainer) -> None:
    """As Megatron-LM's evaluate(): every chunk in eval mode, Megatron's forward-only
    schedule under no_grad, through the same config and timers."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    batches = list(trainer.data.micro_batches(99, 0, 1, trainer.dims.device))
    for ddp in trainer.ddps:
        ddp.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=trainer._forward_step, data_iterator=iter(batches),
                                    model=trainer.ddps, num_microbatches=trainer.num_microbatches,
                                    seq_length=trainer.args.seq_length, micro_batch_size=trainer.args.micro_batch_size,
                                    forward_only=True)
    for ddp in trainer.ddps:
        ddp.train()


def _profile(args, recompute, evaluate: bool = False, dropout: float = 0.0):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    from dynmo_plugin.megatron.training.parallel import ParallelDims
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    dims = ParallelDims(rank=0, world_size=1, tp=1, pp=1, dp=1, pp_rank=0, dp_rank=0,
                        device=torch.device("cpu"), groups=ProcessGroupCollection.use_mpu_process_groups())
    trainer = StageTrainer(args, dims, Layout.uniform(args.num_layers, 1))
    if recompute:  # what Megatron-LM's --recompute-* flags set on the config TransformerBlock reads
        cfg = trainer.config
        cfg.recompute_granularity, (cfg.recompute_method, cfg.recompute_num_layers) = "full", recompute
    for layer in trainer.layers:  # each layer took it from the config when built
        layer.hidden_dropout = dropout
    clock = WorkClock()
    _count_work(trainer, clock)
    trainer.train_step(1)
    window = ProfileWindow(trainer, clock=clock, outside_s=[1.0, 1.0])
    for it in (2, 3):
        window.before_iteration()
        trainer.train_step(it)
        window.after_iteration()
        if evaluate:  # between two window steps, as Megatron-LM's evaluate() can fall
            _evaluate(trainer)
    (probe,) = window.probes
    return window.close(), probe, trainer.num_microbatches


def _check(args):
    hidden = args.seq_length * args.micro_batch_size * args.hidden_size * 4  # one fp32 hidden state
    plain, plain_probe, m = _profile(args, None)
    assert [(x.fwd_s, x.bwd_s) for x in plain.layers] == [(1.0, 2.0)] * 4
    assert all(x.act_bytes > 4 * hidden for x in plain.layers)  # the layer's activations
    full, probe, _ = _profile(args, ("uniform", 1))
    # the recomputed forward is part of the backward: 1 + 2, each micro-batch once
    assert [(x.fwd_s, x.bwd_s) for x in full.layers] == [(1.0, 3.0)] * 4
    assert all(len(probe.samples[f"{way}/{n}"]) == 2 * m for way in ("fwd", "bwd", "cpu/bwd") for n in range(1, 5))
    assert [x.act_bytes for x in full.layers] == [hidden] * 4  # what the checkpoint keeps
    # chunks of 2 layers: the checkpoint keeps each chunk's input, the inner layer's none
    chunked, _, _ = _profile(args, ("uniform", 2))
    assert [x.act_bytes for x in chunked.layers] == [hidden, 0, hidden, 0]
    # Megatron's bias-dropout-add runs with grad on inside the checkpoint's first pass: its
    # dropout masks live until the chunk ends, not until the backward
    dropped, _, _ = _profile(args, ("uniform", 2), dropout=0.1)
    assert [x.act_bytes for x in dropped.layers] == [hidden, 0, hidden, 0]
    assert [(x.fwd_s, x.bwd_s) for x in chunked.layers] == [(1.0, 3.0)] * 4
    assert full.stages[0].predicted_s > plain.stages[0].predicted_s
    # only the first 2 layers recomputed: the balancer sees them dearer than the rest
    block, _, _ = _profile(args, ("block", 2))
    assert [(x.fwd_s, x.bwd_s) for x in block.layers] == [(1.0, 3.0)] * 2 + [(1.0, 2.0)] * 2
    assert [x.act_bytes for x in block.layers[:2]] == [hidden] * 2
    assert all(x.act_bytes > 4 * hidden for x in block.layers[2:])
    # an evaluation inside the window (its forwards through the probe's hooks, the
    # schedule's timers and the extras' hooks) is no training step's cost
    evaluated, probe, _ = _profile(args, ("uniform", 1), evaluate=True)
    assert evaluated.layers == full.layers and all(len(v) == 2 * m for k, v in probe.samples.items()
                                                   if k.startswith(("fwd/", "bwd/", "extra")))
    keep = ("compute_s", "extra_s", "extra_act_bytes", "num_microbatches")
    assert [getattr(evaluated.stages[0], k) for k in keep] == [getattr(full.stages[0], k) for k in keep]


def test_a_recomputed_forward_is_its_layers_backward_cost_and_the_kept_input_its_memory():
    in_megatron_process(_check, ARGS)


class _Layer(torch.nn.Module):
    def __init__(self, number: int, clock: WorkClock):
        super().__init__()
        self.layer_number, self.linear, self.clock = number, torch.nn.Linear(4, 4), clock

    def forward(self, hidden_states, **_):
        self.clock.work += 1.0
        inner = self.linear(hidden_states)
        if inner.requires_grad:  # its gradient arrives inside the layer's backward
            inner.register_hook(lambda g: setattr(self.clock, "work", self.clock.work + 2.0))
        return inner.relu(), None


class _Model(torch.nn.Module):
    """What StageProbe reads of a stage: `decoder.layers`, numbered."""

    def __init__(self, clock: WorkClock):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer(n, clock) for n in (1, 2))


@pytest.mark.parametrize("reentrant,early_stop", [(True, True), (False, True), (False, False)])
def test_torchs_checkpoint_of_either_kind_counts_the_recompute_once_in_the_backward(reentrant, early_stop):
    """torch's reentrant checkpoint recomputes before the layer's gradients arrive (a
    segment of its own, as Megatron's); the non-reentrant one when the backward first
    needs a saved tensor, inside the span already open (not a second segment), and by
    default stops it once it has what it needs (the layer's post-hook never runs). Without
    activation counting: SavedBytes' hooks, inner to the non-reentrant checkpoint's,
    would keep the tensors and leave nothing to recompute (docs/profiling.md)."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    from dynmo_plugin.megatron.profiling.probe import StageProbe
    clock, ranges = WorkClock(constant=10.0), RangeRecorder()
    model = _Model(clock)
    probe = StageProbe(model, clock, count_activations=False, span_constant=3, busy=ranges)
    probe.attach()
    for _ in range(2):  # micro-batches
        h = torch.ones(3, 4, requires_grad=True)
        with set_checkpoint_early_stop(early_stop):
            for layer in model.decoder.layers:
                h, _ = checkpoint(layer, h, use_reentrant=reentrant)
            h.sum().backward()
    model.eval()  # an evaluation inside the window: not a training step's cost
    with torch.no_grad():
        model.decoder.layers[0](torch.ones(3, 4))
    model.train()
    probe.end_iteration()
    probe.detach()
    # every span 10 over its work, every segment calibrated once: the work is left
    for n in (1, 2):
        for clock_ in ("", "host/", "cpu/"):
            assert probe.samples[f"{clock_}fwd/{n}"] == [1.0, 1.0], dict(probe.samples)
            assert probe.samples[f"{clock_}bwd/{n}"] == [3.0, 3.0], dict(probe.samples)
    # the recompute's kernels go to the layer's backward: a range of its own where it is a
    # segment (reentrant), none inside the backward's own range (non-reentrant)
    opened = [(k, mb) for what, k, mb in ranges.log if what == "open" and k == "bwd/1"]
    assert opened == ([("bwd/1", 0)] * 2 + [("bwd/1", 1)] * 2 if reentrant else [("bwd/1", 0), ("bwd/1", 1)])
    assert sorted(x for x in ranges.log if x[0] == "open") == sorted(("open", k, mb) for _, k, mb in ranges.log
                                                                   if _ == "close")


@pytest.mark.parametrize("inside", [False, True])
def test_a_recompute_the_backward_starts_itself_stays_inside_its_span(inside):
    """torch's non-reentrant checkpoint recomputes when the backward first needs a saved
    tensor, inside the span already open: no second segment (counted once)."""
    from dynmo_plugin.megatron.profiling.probe import _Spans
    spans = _Spans()
    spans.start[0], spans.end[0] = 10.0, 13.0
    if not inside:
        spans.before[0].append((4.0, 5.0))
    clock = CpuThreadClock()
    assert spans.seconds(clock) == [3.0 if inside else 4.0] and spans.segments() == [1 if inside else 2]
    assert spans.occupied(clock) == (3.0 if inside else 4.0)


def test_the_launcher_moves_recomputed_layers_bit_exact(tmp_path):
    """--recompute-granularity full in the launcher. Every layer recomputed (uniform, chunks
    of 1): a forced move of layer 5 to stage 0 before iteration 4 changes no loss of the
    never-moved run under the block method (the first 2 layers of each stage; recompute
    changes no number), whose profile counts each recomputed layer's kept hidden state
    and the rest's activations. The block method is refused where layers move (its
    recomputed layers are the first of each stage, whichever they are: a moved layer's
    cost and memory change with its place). Uniform chunks of 2: every stage holds whole
    chunks (a count that is not a multiple made Megatron's uniform recompute index past
    the stage: 'index 5 is out of range'), so the balancer places blocks of 2 (the
    profile-only plans) and a forced move of a block is bit-exact too. A forced layout,
    an even split or a resumed layout that splits a chunk, and recompute beside a
    scenario, are refused in one line."""
    from launch import losses, train

    from dynmo_plugin.config import ConfigError
    from dynmo_plugin.train import build_parser, validate
    flags = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
             "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
             "--recompute-method", "block", "--recompute-num-layers", "2", "--dynmo", "--dynmo-profile-every", "2"]
    saved = tmp_path / "moved_ckpt"
    uniform = [*flags, "--recompute-method", "uniform"]
    moved = train(2, [*uniform, "--recompute-num-layers", "1", "--dynmo-forced-layouts", "4:Ettttt|tttL",
                      "--save", str(saved), "--save-interval", "6"], tmp_path / "moved")
    static = train(2, [*flags, "--dynmo-balancer", "uniform"], tmp_path / "static")
    # a wide head (vocabulary 32768, ~2 layers' work): without blocks the first profile's
    # best split is 5|3 (as measured here), which the plans must not take
    wide = [*uniform, "--vocab-size", "32768"]
    blocks = train(2, [*wide, "--dynmo-forced-layouts", "4:Etttttt|ttL"], tmp_path / "blocks")
    blocks_static = train(2, wide, tmp_path / "blocks_static")
    applied = [e["layout_after"] for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == ["Ettttt|tttL"] and static["layout"] == "Etttt|ttttL"
    assert losses(moved) == losses(static) and len(losses(moved)) == 6
    assert losses(blocks) == losses(blocks_static) and len(losses(blocks)) == 6
    hidden = 16 * 2 * 32 * 4
    first = [e["profile"]["layers"] for e in static["events"] if e["kind"] == "profile"][0]
    acts = [x["act_bytes"] for x in first]
    assert acts[:2] == acts[4:6] == [hidden] * 2 and all(a > 4 * hidden for a in acts[2:4] + acts[6:])
    assert {x["act_bytes"] for e in moved["events"] if e["kind"] == "profile" for x in e["profile"]["layers"]} \
        == {hidden}
    with pytest.raises(ConfigError, match="--recompute-method block with --dynmo moving layers: Megatron "
                                          "recomputes the first N layers of each stage"):
        validate(build_parser().parse_args([*flags, "--dynmo-forced-layouts", "4:Ettttt|tttL"]), 2)
    _check_blocks_of_two(blocks, hidden)
    with pytest.raises(ConfigError, match="with dynamism 'early_exit' is not supported yet"):
        validate(build_parser().parse_args([*uniform, "--dynmo-dynamism", "early_exit"]), 2)
    with pytest.raises(ConfigError, match=r"layout 'Ettttt\|tttL': stage 0 holds 5, stage 1 holds 3 "
                                          "layers, not a multiple of --recompute-num-layers 2"):
        validate(build_parser().parse_args([*uniform, "--dynmo-forced-layouts", "4:Ettttt|tttL"]), 2)
    with pytest.raises(ConfigError, match=r"even split of --num-layers 6 \(Ettt\|tttL\): stage 0 holds 3"):
        validate(build_parser().parse_args([*uniform, "--num-layers", "6"]), 2)
    validate(build_parser().parse_args([*uniform, "--num-layers", "6", "--recompute-num-layers", "3"]), 2)
    with pytest.raises(ConfigError, match="Megatron's MTP recompute asserts 'recompute_num_layers must be 1'"):
        validate(build_parser().parse_args([*uniform, "--mtp-num-layers", "1"]), 2)
    # chunks of 8 fill 1 of 2 stages: every decision would have found no plan
    with pytest.raises(ConfigError, match="--num-layers 8 in chunks of 8 fill at most 1 of the 2 stages"):
        validate(build_parser().parse_args([*uniform, "--recompute-num-layers", "8",
                                            "--pipeline-model-parallel-layout", "Etttttttt|L"]), 2)
    # a resume takes the saved layout, which the forced move left at 5|3
    with pytest.raises(ConfigError, match=r"--load .*moved_ckpt: its saved layout Ettttt\|tttL: stage 0 holds 5"):
        validate(build_parser().parse_args([*uniform, "--load", str(saved)]), 2)
    validate(build_parser().parse_args([*uniform, "--load", str(saved), "--pipeline-model-parallel-layout",
                                        "Etttt|ttttL"]), 2)


def _check_blocks_of_two(run: dict, hidden: int) -> None:
    """Uniform recompute in chunks of 2: layout 'Etttttt|ttL' after the forced move; each
    profile-only plan (the exact balancer on the window's profile) in whole blocks, and
    the same as the balancer gives that profile in blocks of 2; a chunk keeps its first
    layer's input only, wherever its stage starts."""
    from dynmo_plugin.balancing import solve
    from dynmo_plugin.balancing.profile_problem import problem_from_profile
    from dynmo_plugin.config import DynmoConfig
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.profiling.records import PipelineProfile
    assert run["layout"] == "Etttttt|ttL"
    profiles = [e for e in run["events"] if e["kind"] == "profile"]
    assert [e["layout"] for e in profiles] == ["Etttt|ttttL", "Etttttt|ttL", "Etttttt|ttL"]
    for event in profiles:
        planned = Layout.parse(event["planned_layout"])
        problem = problem_from_profile(PipelineProfile.from_dict(event["profile"]), Layout.parse(event["layout"]),
                                       DynmoConfig(), 4, layer_block=2)
        assert all(c % 2 == 0 for c in planned.counts) and planned == solve(problem, "exact").layout
    assert [x["act_bytes"] for x in profiles[-1]["profile"]["layers"]][:6] == [hidden, 0] * 3
