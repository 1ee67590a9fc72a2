"""Each layer's own random streams (megatron.training.layer_streams), in one process.

The runs that move layers with dropout on check the outcome (tests/megatron/test_migration.py,
tests/integrations/test_megatron_lm.py); these check the parts a CPU run does not reach:
Megatron's RNG tracker as it runs on a GPU (on CPU the run's tracker is a no-op one),
its forks (attention dropout's, the sequence-parallel one around the block), tensor and
expert ranks, and the rank's streams put back. The tracker here is Megatron's own with
its CUDA-state functions bound to the CPU generator (what they do with the CUDA one on
a GPU); the stage is a stand-in holding the members LayerStreams reads.
"""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from dynmo_plugin.megatron.training.layer_streams import LayerStreams, model_draws

NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")


class _Layer(torch.nn.Module):
    """Draws as a Megatron layer does: hidden dropout from the default generator, attention
    dropout inside the tracker's model-parallel fork."""

    layer_number = 3

    def forward(self, x):
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        hidden = torch.nn.functional.dropout(x, 0.5, self.training)
        with get_cuda_rng_tracker().fork():
            attention = torch.nn.functional.dropout(x, 0.5, self.training)
        return torch.stack([hidden, attention])


def _streams(tp: int = 0, ep: int = 0, sequence_parallel: bool = False, units=None) -> LayerStreams:
    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=units or [_Layer()]))
    stage = SimpleNamespace(dims=SimpleNamespace(device="cpu", groups=None, dp_rank=0), chunks=[chunk],
                            config=SimpleNamespace(sequence_parallel=sequence_parallel, num_layers=8),
                            num_microbatches=2)
    streams = LayerStreams(stage, seed=1234)
    streams._ranks.update(tp=tp, ep=ep)  # as a tensor / expert rank of a larger run
    streams.step(7)
    return streams


def _layer(streams):
    return streams.stage.chunks[0].decoder.layers[0]


@pytest.fixture
def tracker(monkeypatch):
    """Megatron's own tracker, its CUDA generator calls on the CPU one (as on a GPU with
    the CUDA one), seeded per tensor rank 0; the process's tracker is put back after."""
    from megatron.core.tensor_parallel import random as mp_random
    monkeypatch.setattr(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mp_random, "_set_cuda_rng_state", lambda s, *a, **k: torch.set_rng_state(s))
    kept = mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    mp_random.initialize_rng_tracker(force_reset=True)
    t = mp_random.get_cuda_rng_tracker()
    t.set_states({name: torch.Generator().manual_seed(i).get_state() for i, name in enumerate(NAMES)})
    yield t
    mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = kept


def test_a_layer_draws_the_same_whatever_its_rank_drew_before_and_puts_the_rank_s_streams_back(tracker):
    streams = _streams()
    x = torch.ones(64)
    torch.manual_seed(1)
    expected, states = torch.rand(4), tracker.get_states()
    torch.manual_seed(1)
    first = _layer(streams)(x)
    assert torch.equal(torch.rand(4), expected), "the layer's forward moved the rank's stream"
    assert all(tracker.get_states()[n] is states[n] for n in NAMES)  # the very tensors back
    streams.step(7)  # the same step again
    torch.manual_seed(2)
    torch.rand(3)  # the rank drew elsewhere meanwhile
    assert torch.equal(_layer(streams)(x), first)


def _draws(tp: int, sequence_parallel: bool, inside_fork: bool, tracker, ep: int = 0) -> torch.Tensor:
    streams = _streams(tp, ep, sequence_parallel)
    if not inside_fork:
        return _layer(streams)(torch.ones(64))
    with tracker.fork():  # TransformerBlock.forward under --sequence-parallel (the first pass)
        return _layer(streams)(torch.ones(64))


def test_tensor_ranks_draw_attention_dropout_apart_and_hidden_dropout_alike_unless_sequence_parallel(tracker):
    """Megatron's split: the default stream (hidden dropout) is one per tensor group, as
    the activations it masks are replicated; under sequence parallelism each rank holds
    its own slice, and the block's fork makes the draws differ per rank. Attention dropout
    (per-rank heads) always differs. A layer inside the block's fork (the first pass) and
    outside it (a recompute in the backward) draws the same (it drew the default stream's
    numbers inside, and the layer's own outside: review 23a)."""
    for sp in (False, True):
        tp0, tp1 = (_draws(tp, sp, inside_fork=sp, tracker=tracker) for tp in (0, 1))
        assert torch.equal(tp0[0], tp1[0]) is not sp, f"hidden dropout, sequence parallel {sp}"
        assert not torch.equal(tp0[1], tp1[1]), f"attention dropout, sequence parallel {sp}"
        assert torch.equal(_draws(1, sp, inside_fork=not sp, tracker=tracker), tp1)  # the recompute's draws
    states = tracker.get_states()
    with tracker.fork():
        _layer(_streams(sequence_parallel=True))(torch.ones(64))
        assert tracker._current_state_name == "model-parallel-rng"  # the block's fork is still open
    assert all(tracker.get_states()[n] is not states[n] for n in ("model-parallel-rng",))  # the fork's own write


class _Recorded(_Layer):
    """A layer with a weight, that keeps the masks of every forward it runs."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))
        self.masks = []

    def forward(self, x):
        out = super().forward(x * self.weight)
        self.masks.append(out.detach().clone())
        return out.sum(0)


def test_a_layer_megatron_recomputes_in_the_backward_draws_its_first_pass_s_masks(tracker):
    """Megatron's own reentrant checkpoint (`tensor_parallel.checkpoint`, full recompute),
    through the backward; the first pass inside the block's sequence-parallel fork and the
    recompute outside it (the attention masks parted there, as Megatron's own do)."""
    from megatron.core.tensor_parallel.random import checkpoint
    for sp in (False, True):
        streams = _streams(sequence_parallel=sp, units=[_Recorded()])
        layer = _layer(streams)
        x = torch.ones(64, requires_grad=True)
        with tracker.fork() if sp else contextlib.nullcontext():
            out = checkpoint(layer, False, x)
        out.sum().backward()
        first, recomputed = layer.masks
        assert torch.equal(first, recomputed), f"sequence parallel {sp}"
        assert layer.weight.grad is not None


def test_tracker_streams_are_the_layer_s_during_its_forward_and_set_apart_by_the_ranks_megatron_seeds_them_by(tracker):
    inside = {}
    for tp, ep in ((0, 0), (1, 0), (0, 1)):
        streams = _streams(tp, ep)
        kept = streams._keep()
        streams._seed(3, kept)
        inside[tp, ep] = {n: s.clone() for n, s in tracker.get_states().items()}
        streams._leave(kept)
    same = {n for n in NAMES if torch.equal(inside[0, 0][n], inside[1, 0][n])}
    assert same == {"data-parallel-rng", "expert-parallel-rng"}  # the tensor rank sets the TP stream apart
    same = {n for n in NAMES if torch.equal(inside[0, 0][n], inside[0, 1][n])}
    assert same == {"data-parallel-rng", "model-parallel-rng"}  # the expert rank sets the expert one apart


def test_a_graph_safe_tracker_is_refused_in_one_line(tracker):
    tracker.set_states({name: torch.Generator().manual_seed(i) for i, name in enumerate(NAMES)})
    with pytest.raises(RuntimeError, match="not a graph-safe one .*: add --dynmo-rank-rng"):
        _streams()


def test_the_k_th_forward_of_a_step_draws_the_k_th_micro_batch_s_masks_every_step_alike(tracker):
    streams = _streams()
    layer, x = _layer(streams), torch.ones(64)
    step = [layer(x) for _ in range(2)]
    assert not torch.equal(step[0], step[1])
    streams.step(7)  # the same step again (Megatron-LM's rerun)
    assert all(torch.equal(layer(x), m) for m in step)
    streams.step(8)
    assert not torch.equal(layer(x), step[0])
    layer.eval()
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(layer(x), torch.stack([x, x]))  # evaluation: no dropout, the rank's stream untouched
    assert torch.equal(torch.rand(2), expected)


class _Outer(torch.nn.Module):
    """A unit that calls another hooked unit (the MTP block and the embedding at PP 1)."""

    layer_number = 5

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.cat([torch.nn.functional.dropout(x, 0.5, True)[None], self.inner(x)])


def test_a_unit_called_inside_another_draws_from_the_enclosing_unit_s_streams(tracker):
    inner = _Layer()
    streams = _streams(units=[inner, _Outer(inner)])
    x = torch.ones(64)
    alone = inner(x)  # the inner unit's first forward of the step: micro-batch 0
    streams.step(7)
    outer = streams.stage.chunks[0].decoder.layers[1](x)
    assert not torch.equal(outer[1:], alone)  # inside, it drew from the outer unit's streams
    assert torch.equal(inner(x), alone)  # and its count did not advance there: still micro-batch 0


def test_a_post_hook_without_its_pre_hook_takes_nothing_of_another_unit(tracker):
    """torch calls an always-call post-hook even when an earlier pre-hook raised: it must not
    pop (and restore) the entry of the unit around it."""
    streams = _streams()
    layer = _layer(streams)
    failing = torch.nn.Linear(2, 2)
    streams._hook(9, failing)
    failing.register_forward_pre_hook(lambda *a: 1 / 0, prepend=True)  # raises before ours
    outer_kept = streams._keep()
    streams._saved.append((layer, outer_kept))
    with pytest.raises(ZeroDivisionError):
        failing(torch.ones(2))
    assert streams._saved == [(layer, outer_kept)]


def test_only_a_model_that_draws_gets_streams():
    base = dict(hidden_dropout=0.0, attention_dropout=0.0, moe_input_jitter_eps=None)
    assert not model_draws(SimpleNamespace(**base))
    for key, value in (("hidden_dropout", 0.1), ("attention_dropout", 0.1), ("moe_input_jitter_eps", 0.01),
                       ("moe_router_force_load_balancing", True)):
        assert model_draws(SimpleNamespace(**{**base, key: value}))
