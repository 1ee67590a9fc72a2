"""Repack a live pipeline onto its lowest K stages and shrink the world to match.

Collective over every rank, in four parts (the report times each):
  1. migration - the layers of the released stages move to the survivors with the
                 migration engine: a normal two-phase migration to the intermediate
                 layout (the final split followed by empty stages). If it fails,
                 nothing moved and training goes on as before.
  2. handoff   - the old last stage sends its head (final norm, output layer, their
                 optimizer state) to the new last stage; then every rank agrees. If
                 that fails, training goes on with the intermediate layout (empty
                 stages still hold the head): nothing is lost.
     ---- point of no return ----
  3. regroup   - retiring ranks destroy their process groups, mark themselves
                 retired on torchrun's store and leave (`RankRetired`; the launcher
                 exits 0). Survivors (global ranks 0..K*tp*dp-1) rendezvous a new,
                 smaller world and rebuild Megatron's groups with PP = K.
  4. rebuild   - survivors build their stage anew for the new layout (a middle stage
                 may become the last), load everything by global name (parameters,
                 buffers, frozen flags, optimizer state), then carry the scheduler,
                 per-group settings and loss scaler over.
A failure in 3-4 leaves no way back (the old world is gone): it ends the run with a
traceback, like any broken world would.

A grow (`repack.freed`, balancing/grow.py) runs 1-2 the same; then nobody retires: the
world regroups at its own size with PP = K and DP x P/K, every rank receives its new
stage's state from a survivor that holds it (`_spread`), and 4 builds it on every rank.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dynmo_plugin.consensus import ControlPlane
from dynmo_plugin.layout import Layout
from dynmo_plugin.megatron.migration.optim_state import carry_optimizer_state, megatron_optimizers
from dynmo_plugin.megatron.training.parallel import destroy_parallel, shrink_world, survives
from dynmo_plugin.megatron.migration.stage_state import StageState, capture
from dynmo_plugin.migration.exchange import exchange_buffers, exchange_headers
from dynmo_plugin.migration.result import MigrationResult
from dynmo_plugin.migration.wire import checksum, empty_buffers, pack, unpack
from dynmo_plugin.releases import mark_retired

__all__ = ["RankRetired", "RepackResult", "Repacker", "StageParts"]

logger = logging.getLogger(__name__)
HEAD = 0                      # the head travels under this pseudo layer number (layers are 1-based)


class RankRetired(Exception):
    """This rank's stage was released by a repack; it has left the world cleanly."""


@dataclass
class RepackResult:
    """What one repack did, for the report (`events[].repack`)."""

    applied: bool
    stages_before: int
    stages_after: int
    layout_after: str
    ranks_released: list[int] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)  # migration, handoff, regroup, rebuild
    error: Optional[str] = None
    migration: Optional[MigrationResult] = None
    world_size_before: int = 0
    world_size_after: int = 0
    generation: int = 0          # repacks so far, this one included (store key prefix)
    dp_before: int = 0
    dp_after: int = 0            # larger than dp_before when the freed ranks grew DP

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["migration"] = self.migration.to_dict() if self.migration is not None else None
        return out


@dataclass
class StageParts:
    """The objects a live stage runs with, which a repack replaces: its trainer (a
    `StageTrainer`), its control plane and its migrator."""

    trainer: Any
    control: ControlPlane
    migrator: Any


class Repacker:
    """Shrinks (or regroups) a live run onto fewer pipeline stages.

    Holds nothing of its caller: each `run` is handed the stage's current `StageParts`
    and returns the rebuilt ones, which the caller switches to (`TrainingSession.rebind`).
    Only the repack generation outlives a call (it names the process groups and the
    retirement records of each repack).
    """

    def __init__(self, seed: int, timeout_s: float):
        self.seed, self.timeout_s = seed, timeout_s
        self.generation = 0
        self.s: Optional[StageParts] = None  # the parts of the call in progress

    def run(self, parts: StageParts, layout: Layout,
            info: dict) -> tuple[dict, RepackResult, Optional[StageParts]]:
        """Repack onto `layout` (fewer stages); returns the event's `repack` record (the
        result plus `info`: how it was decided), the result, and the rebuilt parts (None
        when nothing was applied). `info["freed"]` (a `balancing.grow.FreedChoice` dict,
        absent: release) says what the freed ranks do: release (they leave), grow (they
        stay as DP replicas) or refuse (nothing moves; its reason is the event's error).

        Raises:
            RankRetired: on the ranks whose stages it releases.
        """
        self.s, dims = parts, parts.trainer.dims
        try:
            intermediate = layout.padded(dims.pp)
            freed = info.get("freed") or {}
            refused = _mtp_refusal(layout)
            if freed.get("choice") == "refuse" or refused:
                result = RepackResult(False, dims.pp, layout.num_ranks, str(parts.trainer.layout),
                                      error=refused or freed["reason"], world_size_before=dims.world_size,
                                      world_size_after=dims.world_size, dp_before=dims.dp,
                                      dp_after=dims.dp)
                rebuilt = None
            elif freed.get("choice") == "grow":
                result, rebuilt = self.grow(layout, intermediate, freed["dp_grow"])
            else:
                result, rebuilt = self.repack(layout, intermediate)
        finally:
            self.s = None
        record = {**result.to_dict(), **info, "cluster": None}
        del record["migration"]  # the event holds it
        return record, result, rebuilt if result.applied else None

    def repack(self, layout_after: Layout,
               intermediate: Layout) -> tuple[RepackResult, Optional[StageParts]]:
        s = self.s
        dims = s.trainer.dims
        k = layout_after.num_ranks  # pipeline ranks (interleaved: each keeps its v chunks)
        result, state = self._consolidate(layout_after, intermediate, dims.dp)
        if result.error:
            return result, None
        world = dims.tp * k * dims.dp
        result.ranks_released = list(range(world, dims.world_size))
        if state is None:
            self._retire(k)
        start = time.perf_counter()
        new_dims = shrink_world(dims, k, self.generation, self.seed, self.timeout_s)
        result.phase_s["regroup"] = time.perf_counter() - start
        start = time.perf_counter()
        rebuilt = self._rebuild(new_dims, layout_after, state)
        result.phase_s["rebuild"] = time.perf_counter() - start
        result.applied, result.layout_after = True, str(layout_after)
        result.world_size_after = world
        return result, rebuilt

    def grow(self, layout_after: Layout, intermediate: Layout,
             new_dp: int) -> tuple[RepackResult, Optional[StageParts]]:
        """Like `repack` up to the point of no return; then every rank stays: the world
        regroups with PP = K and DP = `new_dp`, each rank receives its new stage's state
        from a survivor of that stage (`_spread`), and the stage is built from it."""
        dims = self.s.trainer.dims
        result, state = self._consolidate(layout_after, intermediate, new_dp)
        if result.error:
            return result, None
        start = time.perf_counter()
        new_dims = shrink_world(dataclasses.replace(dims, dp=new_dp), layout_after.num_ranks,
                                self.generation, self.seed, self.timeout_s)
        result.phase_s["regroup"] = time.perf_counter() - start
        start = time.perf_counter()
        state = _spread(dims, new_dims, state, self.timeout_s)
        result.phase_s["spread"] = time.perf_counter() - start
        start = time.perf_counter()
        rebuilt = self._rebuild(new_dims, layout_after, state)
        result.phase_s["rebuild"] = time.perf_counter() - start
        result.applied, result.layout_after, result.dp_after = True, str(layout_after), new_dp
        return result, rebuilt

    def _consolidate(self, layout_after: Layout, intermediate: Layout,
                     new_dp: int) -> tuple[RepackResult, Optional[StageState]]:
        """Migration to `intermediate`, head handoff and, on the surviving stages, the
        capture of their state (up to the point of no return; `result.error` set when
        it stopped before it, with nothing lost)."""
        s = self.s
        dims, before = s.trainer.dims, s.trainer.layout
        k = layout_after.num_ranks
        result = RepackResult(False, dims.pp, k, str(before), world_size_before=dims.world_size,
                              world_size_after=dims.world_size, dp_before=dims.dp, dp_after=dims.dp)
        micro = s.trainer.num_microbatches * dims.dp // new_dp  # per replica after
        if layout_after.num_chunks > 1 and (k < 2 or micro % k):
            result.error = (f"interleaved schedule cannot run {micro} "
                            f"micro-batches on {k} pipeline rank(s); nothing moved")
            return result, None  # config.py refuses such layouts at start; a last guard
        start = time.perf_counter()
        migration = s.migrator.migrate(intermediate)
        result.migration, result.phase_s["migration"] = migration, time.perf_counter() - start
        if not migration.applied:
            result.error = f"migration to {intermediate} abandoned: {migration.error}"
            return result, None
        result.layout_after = str(intermediate)
        start = time.perf_counter()
        head, error = self._hand_over_head(k - 1)
        # Capture BEFORE the world shrinks: with the distributed optimizer it gathers the
        # sharded state over the old DP group, which the shrink destroys (NCCL then
        # errors or hangs, past the point of no return). Whole stages retire, so every
        # DP group is either all survivors (they capture) or all retirees (they do not).
        state, captured = self._capture(head) if survives(dims, k) else (None, None)
        ok, error = s.control.agree(error or captured, "agree-shrink")
        result.phase_s["handoff"] = time.perf_counter() - start
        if not ok:
            result.error = f"head handoff failed, kept {intermediate}: {error}"
            return result, None
        self.generation += 1
        result.generation = self.generation
        return result, state

    def _capture(self, head: Optional[StageState]) -> tuple[Optional[StageState], Optional[str]]:
        """The surviving stage's whole state by global name, with the head if it came
        here (collective over the DP group with the distributed optimizer; a failure
        to allocate raises on every DP rank of the stage, see optim_state)."""
        t = self.s.trainer
        try:
            state = StageState()
            for chunk in t.chunks:  # global keys: every chunk's state in one
                state.merge(capture(chunk, t.optimizer))
            return (state.merge(head) if head is not None else state), None
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            return None, f"capture on stage {t.dims.pp_rank}: {e!r}"

    # ---- 2. the head ----------------------------------------------------------------------
    def _hand_over_head(self, new_last: int) -> tuple[Optional[StageState], Optional[str]]:
        """Old last stage -> `new_last` (collective on every rank of the old world).
        Interleaved: the head is in the last chunk of either rank."""
        t = self.s.trainer
        dims = t.dims
        old_last = dims.pp - 1
        if new_last == old_last:
            return None, None
        error, outgoing, sending, receive_into = None, [], {}, {}
        try:
            if dims.pp_rank == old_last:
                head = capture(t.chunks[-1], t.optimizer).select(
                    lambda k: not k.startswith("decoder.layers."))
                header, buffers = pack(HEAD, old_last, new_last, _flatten(head), dims.device,
                                       tuple(sorted(head.frozen)))
                outgoing, sending = [header], {HEAD: buffers}
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            error = f"head handoff on stage {dims.pp_rank}: {e!r}"
        headers = exchange_headers(outgoing, self.s.control, self.s.migrator.pp_ranks())
        try:  # allocate, agree, then communicate (see exchange_buffers)
            receive_into = {h.layer: empty_buffers(h, dims.device) for h in headers
                            if h.dst == dims.pp_rank}
        except Exception as e:  # noqa: BLE001
            error = error or f"head handoff on stage {dims.pp_rank}: {e!r}"
        ok, error = self.s.control.agree(error, "agree-handoff")
        if not ok:
            return None, error
        try:
            received = exchange_buffers(headers, sending, dims.pp_rank, dims.groups.pp,
                                        self.timeout_s, receive_into)
            if dims.pp_rank != new_last:
                return None, None
            (header,) = [h for h in headers if h.dst == new_last]
            for (_, _, expected), buf in zip(header.buffers, received[HEAD]):
                if checksum(buf) != expected:
                    raise RuntimeError(f"checksum mismatch in the head from stage {old_last}")
            return _unflatten(unpack(header, received[HEAD]), set(header.frozen)), None
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            return None, f"head handoff on stage {dims.pp_rank}: {e!r}"

    # ---- 3. retire / regroup ---------------------------------------------------------------
    def _retire(self, k: int) -> None:
        """Leave cleanly: free the stage, destroy every process group, tell the leader."""
        from dynmo_plugin.megatron.migration.migrate import retire_ddp
        s = self.s
        rank, stage = s.trainer.dims.rank, s.trainer.dims.pp_rank
        s.control.enter("retired")
        for ddp in s.trainer.ddps:  # drop the stage's buffers before leaving
            retire_ddp(ddp)
        destroy_parallel()  # exiting with live subgroups aborts the process (and the job)
        mark_retired(self.generation, rank, self.timeout_s)
        logger.warning("rank %d: pipeline stage %d released by a repack to %d stages; leaving "
                       "the job (exit 0)", rank, stage, k)
        raise RankRetired(f"rank {rank} (stage {stage}) released")

    # ---- 4. rebuild --------------------------------------------------------------------------
    def _rebuild(self, dims, layout: Layout, state: StageState) -> StageParts:
        """Build the stage for `layout` from `state` (captured before the shrink), with
        its own control plane and migrator, for the caller to switch to. The old stage's gradients and sharded optimizer state
        are released first: past the point of no return nothing reads them, and the new
        stage is built while only the old parameters (which `state` references) and the
        gathered full optimizer state are still alive. A grow's freed ranks carry the
        per-group settings from their emptied stage's optimizer: its groups stepped with
        the same scheduler (tests/megatron/test_grow_dp.py runs a cosine schedule)."""
        from dynmo_plugin.megatron.migration.migrate import LayerMigrator
        from dynmo_plugin.megatron.training.trainer import StageTrainer
        s = self.s
        old = s.trainer
        _release_training_state(old)
        args = dataclasses.replace(old.args, pipeline_model_parallel_size=layout.num_ranks,
                                   pipeline_model_parallel_layout=layout.to_megatron())
        trainer = StageTrainer(args, dims, layout, spec=old.spec, state=state,
                               configure=old.configure)
        carry_optimizer_state(old.optimizer, trainer.optimizer)
        trainer.scheduler.num_steps = old.scheduler.num_steps
        control = ControlPlane(s.control.timeout_s)
        migrator = LayerMigrator(trainer, control, s.migrator.timeout_s, s.migrator.fault)
        return StageParts(trainer, control, migrator)


def _mtp_refusal(layout: Layout) -> Optional[str]:
    """Why a repack onto `layout` cannot carry the MTP block (None: it can). The block
    lands on the last surviving rank: the intermediate layout moves it there live
    (megatron.migration.mtp_move), and the rebuilt world's default embedding group
    (first and last rank) is then the block's."""
    if layout.has_mtp and layout.mtp_rank != layout.num_ranks - 1:
        return (f"a repack onto {layout} leaves the MTP block standalone on rank "
                f"{layout.mtp_rank}; it lands on the last surviving rank; nothing moved")
    return None


def _release_training_state(old) -> None:
    """Drop the old stage's gradient buffers and per-parameter optimizer state (its
    shards with the distributed optimizer; what `capture` took by reference stays
    alive through the captured state). Per-group settings and the loss scaler, which
    `carry_optimizer_state` reads, are kept."""
    from dynmo_plugin.megatron.migration.migrate import retire_ddp
    for ddp in old.ddps:
        retire_ddp(ddp)
    for chunk in old.chunks:
        for p in chunk.parameters():
            p.grad = None
            if getattr(p, "main_grad", None) is not None:
                p.main_grad = None
    for opt in megatron_optimizers(old.optimizer):
        opt.optimizer.state.clear()


def _source(old, new, rank: int) -> int:
    """The old global rank that holds new rank `rank`'s stage (a survivor of that stage,
    its DP rank spread over the old replicas). Megatron's order tp-cp-ep-dp-pp:
    rank = tp_rank + tp x (dp_rank + dp x pp_rank)."""
    tp_rank, rest = rank % new.tp, rank // new.tp
    dp_rank, pp_rank = rest % new.dp, rest // new.dp
    return tp_rank + old.tp * (dp_rank % old.dp + old.dp * pp_rank)


def _spread(old, new, state: Optional[StageState], timeout_s: float) -> StageState:
    """Every rank of the grown world gets the state of its new stage (collective over
    the new world): each survivor packs what it captured, the headers go round, and
    each rank receives from `_source` (checksummed), unless that is itself."""
    rank = new.rank
    header, buffers = None, []
    if state is not None:
        header, buffers = pack(HEAD, rank, -1, _flatten(state), new.device, tuple(sorted(state.frozen)))
    headers: list = [None] * new.world_size
    torch.distributed.all_gather_object(headers, header)
    src = _source(old, new, rank)
    ops, mine = [], None
    for dst in range(new.world_size):
        if dst != rank and _source(old, new, dst) == rank:
            ops += [torch.distributed.P2POp(torch.distributed.isend, b, dst) for b in buffers]
    if src != rank:
        mine = empty_buffers(headers[src], new.device)
        ops += [torch.distributed.P2POp(torch.distributed.irecv, b, src) for b in mine]
    for work in torch.distributed.batch_isend_irecv(ops) if ops else []:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    if src == rank:
        return state
    for (_, _, expected), buf in zip(headers[src].buffers, mine):
        if checksum(buf) != expected:
            raise RuntimeError(f"checksum mismatch in the stage state from rank {src}")
    return _unflatten(unpack(headers[src], mine), set(headers[src].frozen))


def _flatten(state: StageState) -> dict[str, torch.Tensor]:
    tensors = {f"state/{k}": v for k, v in state.tensors.items()}
    for name, optim in state.optim.items():
        tensors.update({f"optim/{name}/{k}": v for k, v in optim.items()})
    return tensors


def _unflatten(tensors: dict[str, torch.Tensor], frozen: set[str]) -> StageState:
    state = StageState(frozen=frozen)
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "state":
            state.tensors[rest] = value.clone()
        else:
            name, _, leaf = rest.rpartition("/")
            state.optim.setdefault(name, {})[leaf] = value.clone()
    return state
