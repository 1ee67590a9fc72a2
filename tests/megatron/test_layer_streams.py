"""Each layer's own random streams (megatron.training.layer_streams), in one process.

The runs that move layers with dropout on check the outcome (tests/megatron/test_migration.py,
tests/integrations/test_megatron_lm.py); these check the parts a CPU run does not reach:
Megatron's RNG tracker (a no-op on CPU, its streams used on a GPU), both kinds of it
(state tensors; a graph-safe one's generators), and the rank's streams put back.
The stage is a stand-in holding the members LayerStreams reads (the device, no groups).
"""
from types import SimpleNamespace

import pytest
import torch

from dynmo_plugin.megatron.training.layer_streams import LayerStreams, model_draws

NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")


def _streams(tp: int = 0, ep: int = 0) -> LayerStreams:
    layer = torch.nn.Dropout(0.5)
    layer.layer_number = 3
    stage = SimpleNamespace(dims=SimpleNamespace(device="cpu", groups=None, dp_rank=0), config=None,
                            chunks=[SimpleNamespace(decoder=SimpleNamespace(layers=[layer]))],
                            num_microbatches=2)
    streams = LayerStreams(stage, seed=1234)
    streams._ranks.update(tp=tp, ep=ep)  # as a tensor / expert rank of a larger run
    streams.step(7)
    return streams


@pytest.fixture
def tracker():
    """Megatron's own tracker (CPU state tensors stand for the CUDA ones); the process's
    tracker (the CPU layer's no-op one, in a run) is put back after."""
    from megatron.core.tensor_parallel import random as mp_random
    kept = mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    mp_random.initialize_rng_tracker(force_reset=True)
    t = mp_random.get_cuda_rng_tracker()
    t.set_states({name: torch.Generator().manual_seed(i).get_state() for i, name in enumerate(NAMES)})
    yield t
    mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = kept


def test_a_layer_draws_the_same_whatever_its_rank_drew_before_and_puts_the_rank_s_stream_back(tracker):
    streams = _streams()
    layer = streams.stage.chunks[0].decoder.layers[0]
    x = torch.ones(64)
    torch.manual_seed(1)
    expected = torch.rand(4)  # the rank's stream without the layer
    torch.manual_seed(1)
    first = layer(x)
    assert torch.equal(torch.rand(4), expected), "the layer's forward moved the rank's stream"
    streams.step(7)  # the same step again
    torch.manual_seed(2)
    torch.rand(3)  # the rank drew elsewhere meanwhile
    assert torch.equal(layer(x), first)


def test_tracker_streams_are_the_layer_s_during_its_forward_and_the_rank_s_after(tracker):
    before = tracker.get_states()
    inside = {}
    for tp, ep in ((0, 0), (1, 0), (0, 1)):
        streams = _streams(tp, ep)
        saved = streams._enter(3)
        inside[tp, ep] = {n: s.clone() for n, s in tracker.get_states().items()}
        streams._leave(saved)
        assert all(tracker.get_states()[n] is before[n] for n in NAMES)  # the very tensors back
    assert all(not torch.equal(inside[0, 0][n], before[n]) for n in NAMES)
    same = {n for n in NAMES if torch.equal(inside[0, 0][n], inside[1, 0][n])}
    assert same == {"data-parallel-rng", "expert-parallel-rng"}  # the tensor rank sets the TP stream apart
    same = {n for n in NAMES if torch.equal(inside[0, 0][n], inside[0, 1][n])}
    assert same == {"data-parallel-rng", "model-parallel-rng"}  # the expert rank sets the expert one apart


def test_a_graph_safe_tracker_s_generators_are_seeded_in_place_and_put_back(tracker):
    gens = {name: torch.Generator().manual_seed(10 + i) for i, name in enumerate(NAMES)}
    tracker.set_states(gens)
    kept = {n: g.get_state() for n, g in gens.items()}
    streams = _streams()
    saved = streams._enter(3)
    assert all(tracker.get_states()[n] is gens[n] for n in NAMES)
    drawn = {n: torch.rand(2, generator=g) for n, g in gens.items()}
    streams._leave(saved)
    assert all(torch.equal(gens[n].get_state(), kept[n]) for n in NAMES)
    again = _streams()  # the same forward's streams again: the same draws
    saved = again._enter(3)
    assert all(torch.equal(torch.rand(2, generator=gens[n]), drawn[n]) for n in NAMES)
    again._leave(saved)


def test_the_k_th_forward_of_a_step_draws_the_k_th_micro_batch_s_masks_every_step_alike(tracker):
    streams = _streams()
    layer = streams.stage.chunks[0].decoder.layers[0]
    x = torch.ones(64)
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
    assert torch.equal(layer(x), x)  # evaluation: no dropout, the rank's stream untouched
    assert torch.equal(torch.rand(2), expected)


def test_only_a_model_that_draws_gets_streams():
    base = dict(hidden_dropout=0.0, attention_dropout=0.0, moe_input_jitter_eps=None)
    assert not model_draws(SimpleNamespace(**base))
    for key, value in (("hidden_dropout", 0.1), ("attention_dropout", 0.1), ("moe_input_jitter_eps", 0.01)):
        assert model_draws(SimpleNamespace(**{**base, key: value}))
