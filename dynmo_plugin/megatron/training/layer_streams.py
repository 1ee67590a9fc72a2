"""Each layer draws its random numbers from streams of its own.

Megatron draws dropout masks (hidden dropout in bias-dropout-add, attention dropout
under the tracker's model-parallel stream) and MoE input jitter from its rank's
generators in the order that rank runs its layers. A migration changes which layers a
rank runs, so after a move every layer of both ranks draws other numbers than in the
never-moved run: the same distribution, not the same bits (survey 22b: hidden dropout
0.1, 5.22531 against 5.22306 at the move).

Here every forward of a decoder layer (and of the MTP block, which moves as one) in
training runs on generators seeded from what does not change with the layout: the run's
seed, the layer's global number, the iteration, the micro-batch's place in the
iteration's global batch (this data-parallel rank's first plus the count of the layer's
forwards so far: replicas draw apart, as their data differs), the stream's name and, for a tracker stream that
Megatron makes differ per rank, the tensor/expert ranks it seeds it with. The rank's
own states are put back after the layer (an exception too). The embedding's dropout
draws from keyed streams too (number 0), so training draws nothing from a rank's own
streams and a resumed run needs no RNG state from its checkpoint (the launcher saves
none: docs/checkpoints.md). A forward
recomputed inside the backward (activation checkpointing) is the k-th recompute of its
layer, that is its k-th micro-batch (each chunk's backwards run in forward order, as the
profiler's probe relies on too), and draws the same masks as the first pass did.

The draws differ from Megatron's own, as they would between two Megatron-LM runs split
differently; `--dynmo-rank-rng` keeps Megatron's (and its masks after a move).
Graph-safe trackers (TE's, --use-cudagraphable-rng) keep generators and are seeded in
place; Megatron's own keeps state tensors, replaced for the layer's forward.
"""
from __future__ import annotations

import hashlib
import struct
import weakref
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from dynmo_plugin.megatron.recompute import in_backward

__all__ = ["LayerStreams", "model_draws", "stream_seed", "stream_salt"]

_DEFAULT = "default"
# Megatron's tracker streams (tensor_parallel.random) and the ranks each is seeded apart by
_TRACKER_RANKS = {"data-parallel-rng": (), "model-parallel-rng": ("tp",),
                  "expert-parallel-rng": ("ep", "expt_tp")}
_ALL_RANKS = ("tp", "ep", "expt_tp")  # a stream this module does not know: apart on each


def model_draws(config) -> bool:
    """Whether a layer of `config` (a TransformerConfig) draws random numbers in training."""
    return bool(config.hidden_dropout or config.attention_dropout
                or getattr(config, "moe_input_jitter_eps", None))


def _mix(data: bytes) -> int:
    """63 well-mixed bits of `data` (nearby keys give unrelated seeds)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def stream_seed(seed: int, layer: int, iteration: int, microbatch: int, salt: int) -> int:
    """The seed of one stream of one layer forward: the forward's key mixed once, then
    apart per stream by `salt` (`stream_salt`): one hash per forward, not per stream."""
    return _mix(struct.pack("<4q", seed, layer, iteration, microbatch)) ^ salt


def stream_salt(stream: str, ranks: tuple[int, ...] = ()) -> int:
    """What sets a stream (and the ranks Megatron seeds it apart on) apart from another."""
    return _mix(stream.encode() + struct.pack(f"<{len(ranks)}q", *ranks))


def _group_rank(groups, name: str) -> int:
    group = getattr(groups, name, None) if groups is not None else None
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return get_cuda_rng_tracker()


class LayerStreams:
    """Seeds each layer's forward in training from its own streams (module docstring).

    `step(iteration)` before every step (and again when Megatron-LM reruns one) starts
    the micro-batch counts over and hooks layers that arrived since (a migration, a
    checkpoint load, a repack's rebuild); a layer keeps its hooks when it moves away and
    is dropped."""

    def __init__(self, stage, seed: int):
        self.stage, self.seed = stage, seed
        self.iteration = 0
        device = torch.device(stage.dims.device)
        self._default = (torch.cuda.default_generators[device.index if device.index is not None
                                                        else torch.cuda.current_device()]
                         if device.type == "cuda" else torch.default_generator)
        self._scratch = torch.Generator(device=device)  # makes tracker state tensors
        groups = stage.dims.groups
        self._ranks = {name: _group_rank(groups, name) for name in _ALL_RANKS}
        self._salts = {_DEFAULT: stream_salt(_DEFAULT)}  # stream name -> its salt on this rank
        self._first = 0  # this data-parallel rank's first micro-batch in the global batch
        self._forwards: dict[int, int] = {}
        self._recomputes: dict[int, int] = {}
        self._saved: list[Optional[tuple]] = []
        # module -> its hooks' handles (a module dropped by a migration goes, hooks and all)
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ---- lifecycle ----------------------------------------------------------------------
    def step(self, iteration: int) -> None:
        self.iteration = iteration
        self._first = self.stage.dims.dp_rank * self.stage.num_microbatches
        self._forwards.clear()
        self._recomputes.clear()
        for number, module in self._units():
            if module not in self._hooked:
                self._hook(number, module)

    def detach(self) -> None:
        for handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked.clear()

    def _units(self) -> Iterable[tuple[int, torch.nn.Module]]:
        """(global number, module) of every unit that draws: decoder layers, the MTP
        block (numbered after the last layer; it moves as one) and the embedding (0: it
        never moves, but keyed draws need no RNG state in a checkpoint to resume)."""
        for chunk in self.stage.chunks:
            if getattr(chunk, "pre_process", False):
                yield 0, chunk.embedding
            for layer in chunk.decoder.layers:
                yield layer.layer_number, layer
            if getattr(chunk, "mtp_process", False):
                yield self.stage.config.num_layers + 1, chunk.mtp

    def _hook(self, number: int, module: torch.nn.Module) -> None:
        def pre(mod, args):
            self._saved.append(self._enter(number) if mod.training else None)

        def post(mod, args, output):
            saved = self._saved.pop()
            if saved is not None:
                self._leave(saved)

        self._hooked[module] = (module.register_forward_pre_hook(pre),
                                module.register_forward_hook(post, always_call=True))

    # ---- one forward --------------------------------------------------------------------
    def _microbatch(self, number: int) -> int:
        counts = self._recomputes if in_backward() else self._forwards
        k = counts.get(number, 0)
        counts[number] = k + 1
        return self._first + k

    def _salt(self, stream: str) -> int:
        salt = self._salts.get(stream)
        if salt is None:
            names = _TRACKER_RANKS.get(stream, _ALL_RANKS)
            salt = self._salts[stream] = stream_salt(stream, tuple(self._ranks[n] for n in names))
        return salt

    def _enter(self, number: int) -> tuple:
        """Keep the rank's states, seed the layer's; returns what `_leave` puts back."""
        key = stream_seed(self.seed, number, self.iteration, self._microbatch(number), 0)
        kept_default = self._default.get_state()
        self._default.manual_seed(key ^ self._salt(_DEFAULT))
        tracker = _tracker()
        states = tracker.get_states() if tracker.is_initialized() else {}
        kept, layer_states = {}, {}
        for name, state in states.items():
            seed = key ^ self._salt(name)
            if isinstance(state, torch.Tensor):  # Megatron's tracker: replaced, not changed
                kept[name] = state
                layer_states[name] = self._scratch.manual_seed(seed).get_state()
            else:  # a graph-safe generator, advanced in place
                kept[name] = state.get_state()
                state.manual_seed(seed)
                layer_states[name] = state
        if states:
            tracker.set_states(layer_states)
        return kept_default, kept, states

    def _leave(self, saved: tuple) -> None:
        kept_default, kept, states = saved
        self._default.set_state(kept_default)
        if not states:
            return
        for name, state in states.items():
            if not isinstance(state, torch.Tensor):
                state.set_state(kept[name])
        _tracker().set_states({name: kept[name] if isinstance(state, torch.Tensor) else state
                               for name, state in states.items()})
