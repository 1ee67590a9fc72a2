"""Checkpoints in Megatron-Core's `dist_checkpointing` format, loadable into any split.

A directory in Megatron-LM's layout: `latest_checkpointed_iteration.txt` names the
newest `iter_NNNNNNN/`, which holds Megatron's sharded checkpoint of every stage's
model and optimizer (megatron.dist_ckpt: keyed by global layer, so it loads under any
layout and pipeline size) and this plugin's `meta.json`: iteration, the layout in
force (a rebalanced run resumes balanced), the world shape, the scheduler's step,
frozen parameters (not part of Megatron's state dicts), the scenario's and the data
stream's state and, after a checkpoint repack, the layout to restart with.

A checkpoint is written to `iter_N.tmp` and renamed by rank 0 only once every rank
wrote its shards and meta.json is complete; the tracker file is replaced atomically
after the rename. A crash mid-save never leaves a checkpoint that looks complete.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import traceback
from typing import Optional

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout, LayoutError

__all__ = ["save_checkpoint", "read_meta", "load_checkpoint", "resume_layout", "CheckpointError",
           "FORMAT", "check_same_model", "check_save_is_this_runs", "resumes_its_save", "latest_iteration",
           "latest_checkpoint", "model_record", "MODEL_KEYS"]

FORMAT = "dynmo-dist-ckpt/1"
# what a complete torch_dist checkpoint directory holds besides its data files (here, not
# beside the writer: read_meta runs in torchrun's own process too, which imports no torch)
REQUIRED_FILES = ("metadata.json", "common.pt", ".metadata")
_LATEST = "latest_checkpointed_iteration.txt"

logger = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint could not be written or read; the message names the path and why."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int:
    """The iteration the tracker file in `root` names (the newest complete checkpoint).

    Raises:
        OSError: no readable tracker. ValueError: it does not hold an iteration number.
    """
    with open(os.path.join(root, _LATEST), encoding="utf-8") as fh:
        return int(fh.read().strip())


def latest_checkpoint(root: str) -> str:
    """The folder of the newest checkpoint in `root` (`latest_iteration`'s errors)."""
    return _iter_dir(root, latest_iteration(root))


def _frozen_names(trainer) -> list[str]:
    """Global names of the rank's frozen parameters, over every model chunk."""
    from dynmo_plugin.megatron.training.model import global_named_parameters
    return sorted(name for chunk in trainer.chunks
                  for name, p in global_named_parameters(chunk) if not p.requires_grad)


def _one_line(e: BaseException, frames=None) -> str:
    """`Type: first line of the message`, or where it was raised when it has none (a
    bare assert inside Megatron). torch.distributed.checkpoint's CheckpointException
    (every rank raises it when one failed) is reported by its first rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException
    if isinstance(e, CheckpointException) and e.failures:
        rank, (inner, trace) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        return f"{_one_line(inner, trace)} (rank {rank}'s part)"
    text = str(e).strip()
    if text:
        return f"{type(e).__name__}: {text.splitlines()[0]}"
    frames = frames or traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__
    return f"{type(e).__name__} at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


_FAULT = "(a fault, not the files) "  # marks a rank's cause in the agreement


def _agreed_steps(control, steps, failed: str, fix: str = "") -> None:
    """Run each (phase, step) on every rank with an agreement after each: a step that
    failed on one rank raises on every rank, rather than leaving the others alone inside
    the next collective: CheckpointError(f"{failed} ({first line}){fix}") where the
    checkpoint's files (or a model they do not fit) are the cause, else RuntimeError (a
    fault of this code or the machine: its traceback logged where it happened; it read
    as damaged files, exit 2, review 22c)."""
    from torch.distributed.checkpoint.api import CheckpointException
    for phase, step in steps:
        error = None
        try:
            step()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn it
            files = _from_the_files(e)
            logger.log(logging.DEBUG if files else logging.WARNING, "%s failed", phase, exc_info=True)
            error = ("" if files else _FAULT) + _one_line(e)
        ok, error = control.agree(error, phase)
        if not ok and _FAULT in error:
            raise RuntimeError(f"{failed} ({error}); the traceback is in the log of the rank named")
        if not ok:
            agreed = CheckpointError(f"{failed} ({error}){fix}")
            agreed.agreed = True  # every rank's cause, on every rank: printed once
            raise agreed


def _from_the_files(e: BaseException) -> bool:
    """Whether a checkpoint's files can have caused `e` (unreadable, cut short, or
    another model's keys and shapes), rather than this code or the machine."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException
    if isinstance(e, CheckpointException) and e.failures:
        return all(_from_the_files(inner) for inner, _ in e.failures.values())
    if isinstance(e, (OSError, EOFError, pickle.UnpicklingError, KeyError, CheckpointingException,
                      CheckpointError)):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in ("PytorchStreamReader", "size mismatch",
                                                                     "shape"))


def save_checkpoint(root: str, iteration: int, trainer, control, meta: dict) -> str:
    """Collective: every rank calls it between iterations. Returns the directory.

    Raises:
        CheckpointError: on every rank, if any rank failed to write its part.
    """
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import (agreed_steps, check_sharding, local_steps,
                                                 save_sharded, sharded_state)
    d = trainer.dims
    final, tmp = _iter_dir(root, iteration), _iter_dir(root, iteration) + ".tmp"
    built, steps = [], control.all_gather(local_steps(trainer.optimizer), "checkpoint-steps")

    def build() -> None:  # local, before any collective
        built.append(sharded_state(trainer, loading=False, steps=agreed_steps(steps)))
        if d.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    _agreed_steps(control, (("checkpoint-built", build),
                            ("checkpoint-checked", lambda: check_sharding(built[0], False)),
                            ("checkpoint-saved", lambda: save_sharded(built[0], tmp))),
                  f"checkpoint at iteration {iteration} not written")
    frozen = sorted(set().union(*control.all_gather(_frozen_names(trainer), "checkpoint-frozen")))
    if d.rank == 0:
        full = {"format": FORMAT, "iteration": iteration, "layout": str(trainer.layout),
                "pp": d.pp, "vp": trainer.layout.num_chunks, "tp": d.tp, "dp": d.dp, "frozen": frozen,
                "scheduler": {"num_steps": trainer.scheduler.num_steps}, **meta}
        _write_atomic(os.path.join(tmp, "meta.json"), json.dumps(full, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, _LATEST), str(iteration))
    control.agree(None, "checkpoint-done")
    return final


def resume_layout(meta: dict, pp: int, v: int, num_layers: int,
                  mtp_layers: int = 0) -> Optional[Layout]:
    """The layout a resumed run takes from its checkpoint when no layout flag is given:
    the one a checkpoint repack chose, else the saved one (a rebalanced run resumes
    rebalanced), if it has this run's `pp x v` (virtual) stages, whatever pp and v it was
    saved with: a layout string lists (virtual) stages in layer order, so one of 4 stages
    is a split for pp=4 as for pp=2 x v=2. None when neither fits (the caller takes
    Megatron's uniform split, as for a changed pipeline size); logged on rank 0.
    The MTP block (`mtp_layers`, this run's --mtp-num-layers) keeps its saved stage where
    that is allowed under this run's v; else (or saved without it) it goes on the last
    stage, Megatron's default."""
    stages = pp * v
    nxt = meta.get("next")
    for text in ([nxt["layout"]] if nxt else []) + [meta["layout"]]:
        layout = Layout.parse(text, None, num_layers)
        if layout.num_stages == stages:
            try:
                if layout.mtp_layers == mtp_layers:
                    return layout.with_chunks(v)
            except LayoutError:
                pass
            return Layout(layout.counts, v, mtp_layers)
    logger.info("saved layout %s has %d (virtual) stages, this run has pp x v = %d x %d = %d: "
                "starting from the uniform split", meta["layout"], Layout.parse(meta["layout"]).num_stages,
                pp, v, stages)
    return None


def read_meta(root: str, resume_if_absent: bool = False) -> Optional[dict]:
    """The latest checkpoint's meta.json after checking the checkpoint is complete.

    `resume_if_absent` (--load is also --save): a directory without a checkpoint yet,
    or not there at all, returns None — a job restarted after a failure resumes, a
    first run starts fresh.

    Raises:
        CheckpointError: no such directory, no checkpoint in it, or an incomplete,
            unreadable or foreign one (the message names the file).
    """
    latest = os.path.join(root, _LATEST)
    if not os.path.exists(latest):
        if resume_if_absent:
            return None
        what = "holds no checkpoint (no " + _LATEST + ")" if os.path.isdir(root) else "does not exist"
        raise CheckpointError(f"--load {root}: the directory {what}; give a directory that "
                              "--save wrote, or drop --load to start from scratch")
    try:
        iteration = latest_iteration(root)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{latest}: unreadable ({e}); the checkpoint is corrupt") from e
    directory = _iter_dir(root, iteration)
    path = os.path.join(directory, "meta.json")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is incomplete") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: holds {type(meta).__name__}, not the checkpoint's record; "
                              "the checkpoint is corrupt")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} "
                              "(written by another version of dynmo_plugin)")
    missing = [f for f in REQUIRED_FILES if not os.path.exists(os.path.join(directory, f))]
    if missing:
        raise CheckpointError(f"{directory}: {', '.join(missing)} missing; the checkpoint is incomplete")
    return meta


# The settings that fix the shape of the saved weights: a checkpoint loads only into the
# same model (the pipeline split, TP aside, may change).
MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
              "max_position_embeddings", "untie_embeddings_and_output_weights")


def model_record(args) -> dict:
    """What a checkpoint's meta.json records of the model (`MODEL_KEYS`), as resolved:
    ffn_hidden_size and max_position_embeddings by their defaults when not given."""
    out = {k: getattr(args, k, None) for k in MODEL_KEYS}
    out["ffn_hidden_size"] = out["ffn_hidden_size"] or 4 * out["hidden_size"]
    out["max_position_embeddings"] = out["max_position_embeddings"] or getattr(args, "seq_length", None)
    return out


def check_same_model(root: str, args) -> None:
    """Before anything is built (dynmo_plugin.train.validate, torchrun's own process
    included: plain JSON, no torch): the checkpoint in --load is of this model, else one
    line naming the first setting that differs, checkpoint vs command line. Checkpoints
    saved before meta.json recorded the model are not checked here.

    Raises:
        CheckpointError: the model differs.
    """
    try:
        path = os.path.join(latest_checkpoint(root), "meta.json")
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh).get("model")
    except (OSError, ValueError, AttributeError):
        return  # absent or unreadable: read_meta says what is wrong with it
    if not isinstance(saved, dict):
        return
    now = model_record(args)
    for key in MODEL_KEYS:
        if key in saved and saved[key] != now[key]:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"--load {root}: the checkpoint is of another model: {key} "
                                  f"{saved[key]} in the checkpoint ({path}), {now[key]} here "
                                  f"({flag}); give {flag} {saved[key]} to resume it, or another "
                                  "--load (or none) to train this model")


def resumes_its_save(load: Optional[str], save: Optional[str]) -> bool:
    """--load and --save name the same directory (a job that restarts itself), however
    they are spelled (`./ckpt` and `ckpt`)."""
    return bool(load and save) and os.path.realpath(load) == os.path.realpath(save)


def check_save_is_this_runs(save: Optional[str], load: Optional[str]) -> None:
    """Before anything is built: --save may hold checkpoints only where this run resumes
    them (--load the same directory). An earlier run's there would be overwritten
    iteration by iteration, and its tracker moved back to this run's latest: a later
    --load would resume this run and the earlier one's newer iterations are orphaned.

    Raises:
        CheckpointError: --save holds a checkpoint and --load is not that directory.
    """
    if not save or not os.path.exists(os.path.join(save, _LATEST)) or resumes_its_save(load, save):
        return
    try:
        held = f"iteration {latest_iteration(save)}"
    except (OSError, ValueError):
        held = "a checkpoint"
    raise CheckpointError(f"--save {save} already holds an earlier run's checkpoints ({held}), which "
                          f"this run would overwrite; resume that run with --load {save}, or give "
                          "another --save")


def _freeze(trainer, frozen: set) -> None:
    """Collective: freeze the parameters named `frozen` (global names) in every model
    chunk and rebuild each chunk's DDP and the one optimizer without them."""
    from dynmo_plugin.megatron.migration.migrate import retire_ddp
    from dynmo_plugin.megatron.training.model import global_named_parameters
    for chunk in trainer.chunks:
        for name, p in global_named_parameters(chunk):
            p.requires_grad_(name not in frozen)
    for ddp in trainer.ddps:
        retire_ddp(ddp)
    ddps = [trainer.build_ddp(c) for c in range(len(trainer.chunks))]
    ddp = ddps if len(ddps) > 1 else ddps[0]
    trainer.install_wrappers(ddp, trainer.build_optimizer(ddp))


def load_checkpoint(root: str, meta: dict, trainer, control) -> None:
    """Collective: restore the stage's weights, frozen flags and optimizer state.

    Frozen parameters are frozen first and, if any, DDP and the optimizer rebuilt
    without them (the optimizer state is matched to the parameters it manages).

    Raises:
        CheckpointError: on every rank, when the sharded data cannot be read or does not
            fit this model (one line: the first line of Megatron's message).
    """
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import check_sharding, load_sharded, sharded_state
    frozen = set(meta.get("frozen", []))
    if frozen:
        _freeze(trainer, frozen)
    directory, built = _iter_dir(root, meta["iteration"]), []
    _agreed_steps(control, (
        ("checkpoint-built", lambda: built.append(sharded_state(trainer, loading=True))),
        ("checkpoint-checked", lambda: check_sharding(built[0], True)),  # rank 0 raises
        ("checkpoint-loaded", lambda: load_sharded(trainer, built[0], directory))),
        f"{directory}: cannot load",
        "; its files are damaged, incomplete or another model's: --load another checkpoint "
        f"directory, or write an earlier saved iteration into its {_LATEST}")
