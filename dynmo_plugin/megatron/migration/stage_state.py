"""A stage's training state keyed by GLOBAL names: what a repack and a checkpoint carry.

Local names depend on the split (`decoder.layers.0` is layer 1 on stage 0 and layer 5
on stage 1), global ones do not: a decoder layer is named by its global index, every
other key keeps Megatron's name (`embedding.*` on the first stage, `decoder.
final_layernorm.*` and `output_layer.*` on the last). So a state captured under one
layout loads into a stage of any other layout, which is what repacking onto fewer
stages and restarting from a checkpoint with fewer ranks both need.

A `StageState` holds the model's `state_dict` (parameters and buffers, so what a
dynamism scenario keeps in its layers travels too), the optimizer state of each
parameter (Adam moments, step; the fp32 master copy in bf16/fp16) and which
parameters are frozen. Gradients are not kept: they are captured between iterations,
and the next step zeroes them first.

With the distributed optimizer the optimizer state is kept whole here too:
`capture` gathers it over the DP group (so every DP rank of a stage must call it) and
`restore_optimizer` keeps each DP rank's shard of it, so a state captured under one
DP size and layout restores under another.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from dynmo_plugin.megatron.migration.optim_state import gather_param_states, put_param_state

__all__ = ["StageState", "capture", "restore_model", "restore_optimizer", "global_key"]

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class StageState:
    """Global-keyed tensors of one stage (or of several, merged)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)

    def merge(self, other: "StageState") -> "StageState":
        """Both states' keys; a key present in both must hold equal values (tied copies)."""
        for key, value in other.tensors.items():
            mine = self.tensors.setdefault(key, value)
            if mine is not value and not torch.equal(mine, value):
                raise ValueError(f"two different values for {key}")
        for key, value in other.optim.items():
            self.optim.setdefault(key, value)
        self.frozen |= other.frozen
        return self

    def select(self, keep: Callable[[str], bool]) -> "StageState":
        """The part whose global keys satisfy `keep`."""
        return StageState({k: v for k, v in self.tensors.items() if keep(k)},
                          {k: v for k, v in self.optim.items() if keep(k)},
                          {k for k in self.frozen if keep(k)})

    def nbytes(self) -> int:
        tensors = list(self.tensors.values()) + [t for s in self.optim.values() for t in s.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def global_key(local: str, layer_numbers: list[int]) -> str:
    """`decoder.layers.<local index>.x` -> `decoder.layers.<global index>.x` (0-based)."""
    m = _LOCAL_LAYER.match(local)
    if m is None:
        return local
    return f"decoder.layers.{layer_numbers[int(m.group(1))] - 1}." + local[m.end():]


def _layer_numbers(model) -> list[int]:
    return [layer.layer_number for layer in model.decoder.layers]


def capture(model, optimizer) -> StageState:
    """The stage's state now (references, not copies: capture between iterations).
    Collective over the DP group with the distributed optimizer (it gathers the shards)."""
    numbers = _layer_numbers(model)
    state = StageState()
    for key, value in model.state_dict(keep_vars=True).items():
        if torch.is_tensor(value):
            state.tensors[global_key(key, numbers)] = value.detach()
    named = list(model.named_parameters())
    optim_states = gather_param_states(optimizer, [p for _, p in named])
    for name, p in named:
        key = global_key(name, numbers)
        if not p.requires_grad:
            state.frozen.add(key)
        optim = optim_states[p]
        if optim:
            state.optim[key] = optim
    return state


def restore_model(model, state: StageState) -> None:
    """Load every key this stage needs from `state` and re-apply frozen flags.

    Call before DDP and the optimizer are built: they only manage trainable parameters.

    Raises:
        KeyError: `state` lacks a key the stage needs (names it).
    """
    numbers = _layer_numbers(model)
    local = {}
    missing = []
    for key, value in model.state_dict(keep_vars=True).items():
        g = global_key(key, numbers)
        if g in state.tensors:
            local[key] = state.tensors[g]
        elif torch.is_tensor(value) and not key.endswith("_extra_state"):
            missing.append(g)
    if missing:
        raise KeyError(f"the carried state lacks {len(missing)} keys this stage needs, "
                       f"e.g. {missing[:3]}")
    model.load_state_dict(local, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad_(global_key(name, numbers) not in state.frozen)


def restore_optimizer(model, optimizer, state: StageState) -> int:
    """Put each parameter's carried optimizer state into `optimizer` (copies; with the
    distributed optimizer this DP rank's shard of it); returns how many parameters
    received state here (parameters that never stepped have none)."""
    numbers = _layer_numbers(model)
    restored = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            carried = state.optim.get(global_key(name, numbers))
            if carried:
                restored += put_param_state(optimizer, p, carried)
    return restored


def param_keys(model) -> Iterable[str]:
    numbers = _layer_numbers(model)
    return (global_key(n, numbers) for n, _ in model.named_parameters())
