"""Checkpoints keyed by global parameter name, loadable into any pipeline split.

What a checkpoint-based repack needs (save, restart with fewer ranks, load into the
new layout), and no more: one file per (tensor-parallel rank, pipeline stage) holding
that stage's `StageState` (parameters, buffers, frozen flags, optimizer state, all by
global name; one data-parallel replica saves, the others are identical), plus
`meta.json` (iteration, layout, scheduler steps, the dynamism scenario's own state and,
after a checkpoint repack, the layout to restart with). Loading merges every stage
file of the rank's TP index and keeps what the new stage needs, so the restart may
have any number of stages. The directory uses Megatron-LM's
`latest_checkpointed_iteration.txt` / `iter_NNNNNNN` naming; the format inside is
this plugin's (not loadable by Megatron-LM's `load_checkpoint`).

A checkpoint is written to `iter_N.tmp` and renamed by rank 0 only once every rank
saved: a crash mid-save never leaves a partial checkpoint that looks complete.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from dynmo_plugin.megatron.stage_state import StageState, capture

__all__ = ["save_checkpoint", "read_meta", "load_stage_state", "CheckpointError"]

FORMAT = "dynmo-stage-state/1"
_LATEST = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _stage_file(tp_rank: int, stage: int) -> str:
    return f"tp{tp_rank:02d}_stage{stage:03d}.pt"


def save_checkpoint(root: str, iteration: int, trainer, control, meta: dict) -> str:
    """Collective: every rank calls it between iterations. Returns the directory.

    Raises:
        CheckpointError: on every rank, if any rank failed to write its part.
    """
    d = trainer.dims
    final, tmp = _iter_dir(root, iteration), _iter_dir(root, iteration) + ".tmp"
    error = None
    if d.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"rank 0: cannot create {tmp}: {e}"
    ok, error = control.agree(error, "checkpoint-mkdir")
    if not ok:
        raise CheckpointError(f"checkpoint at iteration {iteration} not written: {error}")
    try:
        if d.dp_rank == 0:
            tp_rank = dist.get_rank(d.groups.tp)
            state = capture(trainer.model, trainer.optimizer)
            torch.save({"tensors": state.tensors, "optim": state.optim, "frozen": sorted(state.frozen)},
                       os.path.join(tmp, _stage_file(tp_rank, d.pp_rank)))
    except Exception as e:  # noqa: BLE001 - every rank must learn it
        error = f"rank {d.rank}: {e!r}"
    ok, error = control.agree(error, "checkpoint-saved")
    if not ok:
        raise CheckpointError(f"checkpoint at iteration {iteration} not written: {error}")
    if d.rank == 0:
        full = {"format": FORMAT, "iteration": iteration, "layout": str(trainer.layout),
                "pp": d.pp, "tp": d.tp, "dp": d.dp,
                "scheduler": {"num_steps": trainer.scheduler.num_steps}, **meta}
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as fh:
            json.dump(full, fh, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(root, _LATEST), "w", encoding="utf-8") as fh:
            fh.write(str(iteration))
    control.agree(None, "checkpoint-done")
    return final


def read_meta(root: str) -> Optional[dict]:
    """The latest checkpoint's meta.json, or None when `root` holds none yet."""
    latest = os.path.join(root, _LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest, encoding="utf-8") as fh:
        iteration = int(fh.read().strip())
    path = os.path.join(_iter_dir(root, iteration), "meta.json")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is incomplete") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_stage_state(root: str, meta: dict, tp_rank: int) -> StageState:
    """Every stage's state for TP index `tp_rank`, merged (the caller keeps what it needs)."""
    d = _iter_dir(root, meta["iteration"])
    state = StageState()
    for stage in range(meta["pp"]):
        path = os.path.join(d, _stage_file(tp_rank, stage))
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: cannot load ({e})") from e
        state.merge(StageState(data["tensors"], data["optim"], set(data["frozen"])))
    return state
