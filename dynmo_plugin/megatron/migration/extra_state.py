"""A layer's `_extra_state` entries carried through a migration as tensors.

`module.state_dict()` holds, besides parameters and buffers, one `<prefix>_extra_state`
entry per module that defines `get_extra_state`. What it is depends on the module:
  - Megatron's local Column/RowParallelLinear: None (kept only so TE checkpoints load);
  - Transformer Engine (recent): a uint8 tensor of pickled fp8 metadata (scales, amax
    history, recipe), empty when the module keeps no fp8 state;
  - Transformer Engine (older): an io.BytesIO written by torch.save.
The migration wire (dynmo_plugin.migration.wire) moves tensors only, so these helpers
turn a layer's state_dict into tensors and back, losing nothing a receiver needs:
  - a tensor travels as is under "state/<key>";
  - io.BytesIO travels as its bytes (uint8) under "state_bytes/<key>" and becomes an
    io.BytesIO again, so the module reads exactly what it wrote;
  - None, and an empty tensor (TE: "no fp8 state"), are not sent: a layer freshly built
    from the same spec already holds that state, and a zero-length buffer on the
    pipeline group buys nothing;
  - anything else is refused (ExtraStateError names the key and type) rather than
    silently dropped: a migration that loses fp8 scaling state would not be bit-exact.
"""
from __future__ import annotations

import io
from typing import Any

import torch

from dynmo_plugin.migration.result import MigrationError

__all__ = ["ExtraStateError", "carried_state", "loadable_state", "STATE", "STATE_BYTES"]

STATE = "state/"
STATE_BYTES = "state_bytes/"


class ExtraStateError(MigrationError):
    """A layer's extra state has a form a migration cannot carry faithfully."""


def _bytes_tensor(buf: io.BytesIO) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def carried_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`layer.state_dict()` as tensors keyed "state/<key>" or "state_bytes/<key>".

    Raises:
        ExtraStateError: an `_extra_state` entry that is neither a tensor, io.BytesIO
            nor None.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in layer.state_dict().items():
        if torch.is_tensor(value):
            if not (key.endswith("_extra_state") and value.numel() == 0):
                out[STATE + key] = value
        elif isinstance(value, io.BytesIO):
            out[STATE_BYTES + key] = _bytes_tensor(value)
        elif value is not None:
            raise ExtraStateError(f"layer {getattr(layer, 'layer_number', '?')}: {key} is a "
                                  f"{type(value).__name__}; a migration carries extra state "
                                  "only as a tensor or io.BytesIO (what Transformer Engine writes)")
    return out


def loadable_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `carried_state` over received tensors (other keys are ignored):
    a state dict for `layer.load_state_dict(..., strict=False)`."""
    state: dict[str, Any] = {}
    for key, value in tensors.items():
        if key.startswith(STATE):
            state[key[len(STATE):]] = value
        elif key.startswith(STATE_BYTES):
            state[key[len(STATE_BYTES):]] = io.BytesIO(value.cpu().numpy().tobytes())
    return state
