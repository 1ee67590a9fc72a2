"""Each layer draws its random numbers from streams of its own.

Megatron draws dropout masks (hidden dropout in bias-dropout-add, attention dropout
under the tracker's model-parallel stream) and MoE input jitter from its rank's
generators in the order that rank runs its layers. A migration changes which layers a
rank runs, so after a move every layer of both ranks draws other numbers than in the
never-moved run: the same distribution, not the same bits (survey 22b: hidden dropout
0.1, 5.22531 against 5.22306 at the move).

Here every unit that draws runs each forward in training on generators seeded from what
does not change with the layout: the decoder layers, the MTP block (it moves as one) and
the embedding (number 0: it never moves, but keyed draws need no RNG state in a
checkpoint to resume, and the launcher saves none: docs/checkpoints.md). The seed mixes
the run's seed, the unit's global number, the iteration, a micro-batch index (this
data-parallel rank's first, `dp_rank x micro-batches`, plus the count of the unit's
forwards so far: unique per replica and micro-batch, whatever the layout), the stream's
name and, for a tracker stream Megatron makes differ per rank, the tensor/expert ranks it
seeds it apart on; under sequence parallelism the default stream too differs per tensor
rank, as Megatron's does there (each rank holds its own slice of the sequence). The
rank's own states, and the tracker's open fork, are put back after the unit, an
exception included; during it no fork is open, so a fork the layer opens (attention
dropout) switches to the layer's stream whether or not the block runs inside the
sequence-parallel fork (the first pass does, a recompute does not). A unit called inside
another's forward (the embedding the MTP block calls at PP 1) draws from the enclosing
unit's streams. A forward recomputed inside the backward (activation checkpointing) is
the k-th recompute of its layer, that is its k-th micro-batch (each chunk's backwards
run in forward order, as the profiler's probe relies on too), and draws what the first
pass drew.

The draws differ from Megatron's own, as they would between two Megatron-LM runs split
differently; `--dynmo-rank-rng` keeps Megatron's (and a move then changes them). Only
Megatron's own tracker (state tensors) is supported: a graph-safe one (--te-rng-tracker;
CUDA graphs', which --dynmo refuses anyway) lets the default generator share a stream's
state inside a fork, and is refused with the streams on (megatron_lm_args).
"""
from __future__ import annotations

import hashlib
import struct
import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from dynmo_plugin.megatron.recompute import in_backward

__all__ = ["LayerStreams", "model_draws"]

_DEFAULT = "default"
# Megatron's tracker streams (tensor_parallel.random) and the ranks each is seeded apart by
_TRACKER_RANKS = {"data-parallel-rng": (), "model-parallel-rng": ("tp",),
                  "expert-parallel-rng": ("ep", "expt_tp")}
_ALL_RANKS = ("tp", "ep", "expt_tp")  # a stream this module does not know: apart on each
_NO_FORK = "default-rng"  # Megatron's tracker's name for "no fork open"


def model_draws(config) -> bool:
    """Whether a layer of `config` (a TransformerConfig, or Megatron-LM's args, which spell
    these alike) draws random numbers in training: dropout, MoE input jitter, the MoE
    router's random logits of --moe-router-force-load-balancing."""
    return bool(getattr(config, "hidden_dropout", 0) or getattr(config, "attention_dropout", 0)
                or getattr(config, "moe_input_jitter_eps", None)
                or getattr(config, "moe_router_force_load_balancing", False))


def _mix(data: bytes) -> int:
    """63 well-mixed bits of `data` (nearby keys give unrelated seeds)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def _forward_key(seed: int, layer: int, iteration: int, microbatch: int) -> int:
    """One unit forward's key, mixed once; each stream's seed is it XOR the stream's salt
    (`_stream_salt`): one hash per forward, not per stream."""
    return _mix(struct.pack("<4q", seed, layer, iteration, microbatch))


def _stream_salt(stream: str, ranks: tuple[int, ...] = ()) -> int:
    """What sets a stream (and the ranks Megatron seeds it apart on) apart from another."""
    return _mix(stream.encode() + struct.pack(f"<{len(ranks)}q", *ranks))


def _group_rank(groups, name: str) -> int:
    group = getattr(groups, name, None) if groups is not None else None
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


@dataclass
class _Kept:
    """A rank's random state around one unit's forward (what `_leave` puts back)."""

    default: torch.Tensor  # the default generator's state
    states: dict           # the tracker's streams (its own dict's copy: state tensors)
    fork: Optional[str]    # the tracker's open fork ("default-rng": none)


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
        self._salts: dict[str, int] = {}  # stream name -> its salt on this rank
        # Under sequence parallelism Megatron runs the layers inside the model-parallel
        # fork (TransformerBlock.forward): their default draws differ per tensor rank, as
        # each holds its own slice of the sequence; so do the layer's here
        self._default_ranks = ("tp",) if getattr(stage.config, "sequence_parallel", False) else ()
        self._first = 0  # this data-parallel rank's first micro-batch in the global batch
        self._forwards: dict[int, int] = {}
        self._recomputes: dict[int, int] = {}
        # (unit, its kept states; None: it drew nothing of its own) per open forward
        self._saved: list[tuple[torch.nn.Module, Optional[_Kept]]] = []
        # module -> its hooks' handles (a module dropped by a migration goes, hooks and all)
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ---- lifecycle ----------------------------------------------------------------------
    def step(self, iteration: int) -> None:
        """Raises:
            RuntimeError: the RNG tracker is a graph-safe one (module docstring)."""
        tracker = _tracker()
        states = tracker.get_states() if tracker.is_initialized() else {}
        if any(not isinstance(state, torch.Tensor) for state in states.values()):
            raise RuntimeError("dynmo: the layers' own random streams need Megatron's RNG tracker with "
                               "state tensors, not a graph-safe one (--te-rng-tracker): add "
                               "--dynmo-rank-rng")
        self.iteration = iteration
        self._first = self.stage.dims.dp_rank * self.stage.num_microbatches
        self._forwards.clear()
        self._recomputes.clear()
        self._saved.clear()  # a step that ended in an exception past a post-hook (^C) left its entry
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
        """Each entry of the stack names its module, so a post-hook that runs without its
        pre-hook (torch calls it when an earlier pre-hook raised) takes nothing of
        another's; the states are kept before anything is seeded, so a raise while
        seeding still puts them back."""
        def pre(mod, args):
            inside = any(kept is not None for _, kept in self._saved)
            self._saved.append((mod, None))
            if mod.training and not inside:  # inside another (the embedding the MTP block calls): its streams
                kept = self._saved[-1] = (mod, self._keep())
                self._seed(number, kept[1])

        def post(mod, args, output):
            if self._saved and self._saved[-1][0] is mod:
                kept = self._saved.pop()[1]
                if kept is not None:
                    self._leave(kept)

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
            names = self._default_ranks if stream == _DEFAULT else _TRACKER_RANKS.get(stream, _ALL_RANKS)
            salt = self._salts[stream] = _stream_salt(stream, tuple(self._ranks[n] for n in names))
        return salt

    def _keep(self) -> _Kept:
        """The rank's states as they are: its default generator's, the tracker's streams
        and the fork open around the layer (Megatron's `_current_state_name`)."""
        tracker = _tracker()
        states = tracker.get_states() if tracker.is_initialized() else {}
        return _Kept(self._default.get_state(), states, getattr(tracker, "_current_state_name", None))

    def _seed(self, number: int, kept: _Kept) -> None:
        """The layer's streams in place of the rank's, and no fork open: a fork the layer
        opens (attention dropout) then switches to the layer's stream in the first pass
        and in a recompute alike (the sequence-parallel fork around the block is open in
        the first only, so nested there it would continue the default one)."""
        key = _forward_key(self.seed, number, self.iteration, self._microbatch(number))
        self._default.manual_seed(key ^ self._salt(_DEFAULT))
        if not kept.states:
            return
        tracker = _tracker()
        tracker.set_states({name: self._scratch.manual_seed(key ^ self._salt(name)).get_state()
                            for name in kept.states})
        if kept.fork is not None:
            tracker._current_state_name = _NO_FORK

    def _leave(self, kept: _Kept) -> None:
        self._default.set_state(kept.default)
        if kept.states:
            tracker = _tracker()
            tracker.set_states(kept.states)
            if kept.fork is not None:
                tracker._current_state_name = kept.fork
