"""Move TransformerLayers between live pipeline stages with all their training state.

A migration is collective over every rank (data-parallel and tensor-parallel replicas
migrate their own copies the same way) and atomic: every rank commits or none does.
Everything that can fail happens BEFORE the point of no return, on new objects only:
  1. pack     - every rank takes the full optimizer state of its stage (with the
                distributed optimizer: unsharded over DP, see optim_state); each source
                packs every tensor of each outgoing layer: weights, biases, norms (its
                state_dict), the gradient (DDP's main_grad), optimizer state (Adam
                moments, step, fp32 master copy in bf16/fp16) and which of its
                parameters are frozen;
  2. headers  - all-gather of headers on the control plane;
     staging  - receivers take their receive buffers from a StagingPool (kept between
                migrations on CPU: fresh host memory halves the receive bandwidth);
  3. transfer - buffers by batched p2p on the pipeline group, with a timeout;
  4. stage    - receivers build the layers (the new layout on the config gives them
                their global numbers), verify checksums, load state;
  5. prepare  - install the new layer list and build a new DDP (new gradient buffers,
                hooks) beside the old one;                       -> agree
  6. optimizer- build the new optimizer (collective), carry per-group state and the
                loss scaler, put every parameter's state into it (each DP rank keeps
                its new shard when the optimizer is distributed); -> agree
  7. commit   - switch the trainer to the new wrappers: reference updates only.
On a failed agreement every rank undoes step 5 (old layer list, old gradient views and
hooks) and keeps training on the old layout.
Interleaved pipelines (v model chunks per rank): only layers that change RANK are packed
and sent (headers name ranks); a layer that changes chunk on its rank is the same module
re-parented in step 5, its gradient and optimizer state (fp32 master copy in bf16/fp16;
gathered over DP with the distributed optimizer, which spans all chunks) carried like a
kept layer's. A rank that dies or hangs makes the control plane raise `PeerFailure`
(naming it) after `timeout_s`, on every survivor.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import build_module

from dynmo_plugin.consensus import ControlPlane, PeerFailure
from dynmo_plugin.layout import Layout
from dynmo_plugin.megatron.migration import mtp_move
from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
from dynmo_plugin.megatron.migration.optim_state import (carry_optimizer_state, gather_param_states,
                                               put_param_state)
from dynmo_plugin.megatron.training.model import mark_tensor_parallel
from dynmo_plugin.megatron.training.scratch import rng_streams_kept
from dynmo_plugin.megatron.training.mtp import EmbeddingGroups, with_embedding_group
from dynmo_plugin.migration.exchange import (TIMEOUT_MARK, exchange_buffers, exchange_headers)
from dynmo_plugin.migration.pool import StagingPool
from dynmo_plugin.migration.result import MigrationError, MigrationResult
from dynmo_plugin.migration.wire import Header, checksum, empty_buffers, pack, unpack

__all__ = ["LayerMigrator", "retire_ddp"]

logger = logging.getLogger(__name__)
# Every rank reports every phase (0 s where it skipped one): reductions need equal lengths.
PHASES = ("pack", "headers", "staging", "transfer", "stage", "prepare", "optimizer")


def _main_grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Prepared:
    """What step 5 changed, to commit or to undo."""

    old_layers: list  # per model chunk, its decoder's ModuleList
    old_main_grads: dict
    old_data: dict  # param -> its .data (a view of DDP's parameter buffer when sharded)
    saved: dict = field(default_factory=dict)  # param -> (grad, optimizer state)
    shells: list = field(default_factory=list)  # mtp_move.Shell: units installed or removed
    ddp: object = None
    optimizer: object = None


class LayerMigrator:
    """Applies new layouts to the stage owned by `trainer` (same call on every rank)."""

    def __init__(self, trainer, control: ControlPlane, timeout_s: float = 300.0, fault=None):
        self.trainer, self.control, self.timeout_s, self.fault = trainer, control, timeout_s, fault
        self._phase_s: dict[str, float] = {}
        self._extra_bytes = 0
        self._states: dict = {}  # param -> full optimizer state, taken at pack time
        # Receive buffers: kept between migrations on CPU (first-touch page faults would
        # halve gloo's bandwidth); on CUDA released after each one (device memory has no
        # first-touch cost and the caching allocator recycles it).
        self.pool = StagingPool(trainer.dims.device)
        self.embedding_groups = _embedding_groups(trainer, self.pp_ranks())

    # ---- entry point ------------------------------------------------------------------
    def rebuild(self, reshape=None) -> MigrationResult:
        """Remake DDP and the optimizer over the current layers, keeping every gradient and
        optimizer state: what a changed trainable set (frozen layers) needs. Atomic like
        a migration (it is one that moves nothing). `reshape(layer, tensors)` may return
        changed packed tensors of a layer of this rank (structured pruning drops neurons):
        that layer is then rebuilt from them as a received one would be."""
        return self.migrate(self.trainer.layout, reshape)

    def migrate(self, new: Layout, reshape=None) -> MigrationResult:
        t = self.trainer
        old, stage = t.layout, t.dims.pp_rank
        start = time.perf_counter()
        self._phase_s, self._extra_bytes = {}, 0
        if self.fault is not None:
            self.fault.begin_migration()
        if t.dims.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if t.dims.device.type == "cuda" else 0
        refused = mtp_move.moves_refused(t, old, new)
        if refused is not None:  # every rank sees the same two layouts: all refuse here
            raise MigrationError(refused)
        moves = old.moved_layers(new)
        # what crosses ranks (for one chunk per rank: every move; stages are ranks), then
        # the MTP block and the final norm Megatron keeps beside the last decoder layer
        remote = [(n, old.rank_of(s), new.rank_of(d)) for n, s, d in moves
                  if old.rank_of(s) != new.rank_of(d)] + mtp_move.unit_moves(old, new)
        error, headers, prepared = None, [], None
        with self._phase("pack"):
            try:  # the gather inside raises on every DP rank of a stage or on none
                params = [p for chunk in t.chunks for p in chunk.parameters()]
                self._states = gather_param_states(t.optimizer, params,
                                                   self._allocated_hook("pack"))
                if t.ddp_config.use_distributed_optimizer:
                    self._extra_bytes += _nbytes(v for s in self._states.values() for v in s.values())
                outgoing, sending = self._pack(remote, stage)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                error, outgoing, sending = f"pack on stage {stage}: {e!r}", [], {}
        with self._phase("headers"):
            headers = exchange_headers(outgoing, self.control, self.pp_ranks())
        receive_into, error = self._staging(headers, stage, error)
        # allocate, agree, then communicate: nobody posts a send to a rank that failed
        ok, error = self.control.agree(error, "agree-transfer")
        if ok:
            received, error = self._transfer(headers, sending, stage, receive_into)
            self._extra_bytes += _nbytes(b for bufs in received.values() for b in bufs)
            with self._phase("stage"):
                staged, error = self._stage(new, headers, received, stage, error)
                if error is None and reshape is not None:
                    reshaped, error = self._try(self._reshape, reshape, new, stage)
                    staged.update(reshaped or {})
            if error is None:
                with self._phase("prepare"):
                    prepared, error = self._try(self._prepare, staged, new, stage)
        ok, error = self.control.agree(error, "agree-prepare")
        if ok:
            with self._phase("optimizer"):
                _, error = self._try(self._build_optimizer, prepared, stage)
            ok, error = self.control.agree(error, "agree-commit")
        if ok:
            self._commit(prepared, new)
        else:
            self._abandon(prepared, old, new, error)
        self._states = {}  # unsharded copies (distributed optimizer) are freed here
        if t.dims.device.type == "cuda":
            self.pool.release()
        peak = (torch.cuda.max_memory_allocated() - base if t.dims.device.type == "cuda"
                else self._extra_bytes)
        return self._result(old, new, ok, error, headers, start, peak, moves)

    def _staging(self, headers: list[Header], stage: int, error: Optional[str]
                 ) -> tuple[dict, Optional[str]]:
        """Receive buffers for every layer addressed to this stage (phase 'staging'),
        from the pool or, where the pool cannot grow, fresh: all allocated BEFORE any
        peer posts a send, so a failure here is agreed on instead of leaving senders
        waiting. What is received are views of the pool: used up (copied into layers,
        gradients and optimizer state) before `migrate` returns."""
        incoming = [h for h in headers if h.dst == stage]
        with self._phase("staging"):
            try:
                try:
                    receive_into = self.pool.take(incoming)
                except Exception as e:  # noqa: BLE001 - an out-of-memory pool: fresh buffers then
                    logger.warning("staging pool on stage %d: %r; receiving into new buffers", stage, e)
                    self.pool.release()
                    receive_into = {h.layer: empty_buffers(h, self.trainer.dims.device) for h in incoming}
                self._allocated_hook("staging")()
                return receive_into, error
            except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
                return {}, error or f"staging on stage {stage}: {e!r}"

    def _transfer(self, headers: list[Header], sending: dict, stage: int,
                  receive_into: dict) -> tuple[dict, Optional[str]]:
        """The p2p exchange (phase 'transfer') into the buffers `_staging` allocated."""
        t = self.trainer
        with self._phase("transfer"):
            try:
                return exchange_buffers(headers, sending, stage, t.dims.groups.pp,
                                        self.timeout_s, receive_into), None
            except Exception as e:  # noqa: BLE001
                return {}, f"transfer on stage {stage}: {e}"

    def _allocated_hook(self, phase: str):
        """Called where `phase` has allocated its buffers (a test's fault injection)."""
        fault, dims = self.fault, self.trainer.dims
        if fault is None:
            return lambda: None
        return lambda: fault.on_allocated(phase, dims.pp_rank, dims.dp_rank)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        self.control.enter(name)
        if self.fault is not None:
            self.fault.on_phase(name, self.trainer.dims.pp_rank)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._phase_s[name] = self._phase_s.get(name, 0.0) + time.perf_counter() - start

    def _try(self, fn, *args):
        try:
            return fn(*args), None
        except Exception as e:  # noqa: BLE001 - reported to every rank by the next agreement
            return None, f"{fn.__name__.strip('_')} on stage {self.trainer.dims.pp_rank}: {e!r}"

    def pp_ranks(self) -> list[int]:
        pp = self.trainer.dims.groups.pp
        return [dist.get_global_rank(pp, s) for s in range(dist.get_world_size(pp))]

    # ---- pack / stage -------------------------------------------------------------------
    def _pack(self, moves, stage: int) -> tuple[list[Header], dict[int, list[torch.Tensor]]]:
        by_number = {layer.layer_number: layer for chunk in self.trainer.chunks
                     for layer in chunk.decoder.layers}
        outgoing, sending = [], {}
        for number, src, dst in moves:
            if src != stage:
                continue
            layer = (by_number[number] if number in by_number
                     else mtp_move.container(number, self.trainer.chunks[0]))
            frozen = tuple(n for n, p in layer.named_parameters() if not p.requires_grad)
            header, buffers = pack(number, src, dst, self._layer_tensors(layer),
                                   self.trainer.dims.device, frozen)
            outgoing.append(header)
            sending[number] = buffers
        return outgoing, sending

    def _layer_tensors(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = carried_state(layer)  # state/ tensors, TE's io.BytesIO extra state as bytes
        for name, p in layer.named_parameters():
            grad = _main_grad(p)
            if grad is not None:
                out[f"grad/{name}"] = grad
            for key, value in self._states.get(p, {}).items():
                out[f"optim/{name}/{key}"] = value
        return out

    def _stage(self, new: Layout, headers: list[Header], received: dict, stage: int,
               error: Optional[str]) -> tuple[dict, Optional[str]]:
        """Build, verify and load incoming layers; nothing live is touched."""
        staged: dict[int, tuple[torch.nn.Module, dict]] = {}
        self._set_config_layout(new)
        if error is not None:
            return staged, error
        try:
            if self.fault is not None:
                self.fault.on_received(stage, received)
            for h in headers:
                if h.dst != stage:
                    continue
                for (_, _, expected), buf in zip(h.buffers, received[h.layer]):
                    if checksum(buf) != expected:
                        raise MigrationError(f"checksum mismatch for layer {h.layer} from stage {h.src}")
                tensors = unpack(h, received[h.layer])
                layer = (mtp_move.build(h.layer, self.trainer, self.trainer.chunks[0], tensors)
                         if h.layer in mtp_move.UNIT_NAMES else
                         self._build_layer(h.layer, new, stage, tensors))
                for name in h.frozen:
                    layer.get_parameter(name).requires_grad_(False)
                self._extra_bytes += _nbytes(layer.parameters())
                staged[h.layer] = (layer, tensors)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            return {}, f"stage {stage}: {e!r}"
        return staged, None

    def _reshape(self, reshape, new: Layout, stage: int) -> dict:
        """This rank's layers that `reshape` changed, built like received ones."""
        staged = {}
        for layer in [layer for chunk in self.trainer.chunks for layer in chunk.decoder.layers]:
            tensors = reshape(layer, self._layer_tensors(layer))
            if tensors is not None:
                built = self._build_layer(layer.layer_number, new, stage, tensors)
                for name, p in layer.named_parameters():
                    built.get_parameter(name).requires_grad_(p.requires_grad)
                self._extra_bytes += _nbytes(built.parameters())
                staged[layer.layer_number] = (built, tensors)
        return staged

    def _build_layer(self, number: int, new: Layout, stage: int, tensors: dict) -> torch.nn.Module:
        t = self.trainer
        vstage = new.assignment()[number - 1]  # = stage with one chunk per rank
        decoder = t.chunks[new.chunk_of(vstage)].decoder
        with rng_streams_kept():  # the state below fills it; the run's streams stay as they were
            layer = build_module(t.spec, config=t.config, layer_number=number - new.offset(vstage),
                                 pg_collection=decoder.pg_collection, vp_stage=decoder.vp_stage)
        mark_tensor_parallel(layer, t.config)  # where it was built uninitialised (the launcher)
        if layer.layer_number != number:
            raise MigrationError(f"built layer {layer.layer_number}, expected {number}")
        layer.to(t.dims.device)
        if t.config.bf16 or t.config.fp16:  # as Float16Module cast the stage's own layers
            layer.to(t.config.params_dtype)
        state = loadable_state(tensors)
        missing, unexpected = layer.load_state_dict(state, strict=False)
        if unexpected or any(not k.endswith("_extra_state") for k in missing):
            raise MigrationError(f"layer {number}: state mismatch (missing {missing}, unexpected {unexpected})")
        return layer

    def _set_config_layout(self, layout: Layout) -> None:
        cfg = self.trainer.config
        parsed = PipelineParallelLayerLayout(layout.to_megatron(), layout.num_ranks)
        # the schedule exchanges activation shapes when the block is standalone (its
        # output is 1 + k sequences long): Megatron reads that from the config
        cfg.mtp_standalone = parsed.validate_layer_layout(num_layers=cfg.num_layers,
                                                          mtp_num_layers=cfg.mtp_num_layers)
        cfg.pipeline_model_parallel_layout = parsed

    # ---- prepare: new layer list and DDP beside the old ones ------------------------------
    def _prepare(self, staged: dict, new: Layout, stage: int) -> _Prepared:
        t = self.trainer
        chunks = t.chunks
        params = [p for c in chunks for p in c.parameters()]
        prepared = _Prepared(old_layers=[c.decoder.layers for c in chunks], old_main_grads={
            p: p.main_grad for p in params if getattr(p, "main_grad", None) is not None},
            old_data={p: p.data for p in params})
        here = {layer.layer_number: layer for c in chunks for layer in c.decoder.layers}
        staying = set(new.rank_layers(stage))  # kept, possibly in another chunk of this rank
        keep = [layer for number, layer in here.items() if number in staying]
        leaving = [u for u, src, _ in mtp_move.unit_moves(t.layout, new) if src == stage]
        layer_params = {p for layer in here.values() for p in layer.parameters()}
        layer_params |= {p for u in leaving for p in mtp_move.container(u, chunks[0]).parameters()}
        kept = [p for layer in keep for p in layer.parameters()]
        kept += [p for p in params if p not in layer_params]
        prepared.saved = {p: (_main_grad(p), self._states.get(p, {})) for p in kept}
        for layer, tensors in staged.values():
            for name, p in layer.named_parameters():
                state = {k.rsplit("/", 1)[-1]: v.clone() for k, v in tensors.items()
                         if k.startswith(f"optim/{name}/")}
                self._extra_bytes += _nbytes(state.values())
                prepared.saved[p] = (tensors.get(f"grad/{name}"), state)
        here.update((number, layer) for number, (layer, _) in staged.items()
                    if number not in mtp_move.UNIT_NAMES)
        for pair in filter(None, (mtp_move.adopted(u, chunks[0]) for u in leaving)):
            output, copy = pair  # tied: the output weight takes over the leaving copy
            prepared.saved[output] = (_main_grad(copy), self._states.get(copy, {}))
            output.data = copy.data.clone()  # `_undo` puts the old .data back
        try:
            for ddp in t.ddps:
                _detach_hooks(ddp)  # the new DDPs must hook fresh grad accumulators
            prepared.shells += [mtp_move.remove(u, chunks[0]) for u in leaving]
            prepared.shells += [mtp_move.install(u, chunks[0], staged[u][0])
                                for u in mtp_move.UNIT_NAMES if u in staged]
            for c, chunk in enumerate(chunks):
                numbers = new.layers_of(new.stage_of(stage, c))
                chunk.decoder.layers = torch.nn.ModuleList(here[n] for n in numbers)
                chunk.decoder.num_layers_per_pipeline_rank = len(numbers)
            prepared.ddp = built = []  # filled one by one: `_undo` retires what was built
            for c in range(len(chunks)):
                built.append(t.build_ddp(c))
                self._extra_bytes += _ddp_buffer_bytes(built[-1])
            prepared.ddp = built if len(built) > 1 else built[0]
            if self.fault is not None:
                self.fault.on_prepared(stage)
        except Exception:
            self._undo(prepared)
            raise
        return prepared

    def _build_optimizer(self, prepared: _Prepared, stage: int) -> None:
        """Collective (every rank reaches it once the prepare agreement passed)."""
        t = self.trainer
        prepared.optimizer = t.build_optimizer(prepared.ddp)
        carry_optimizer_state(t.optimizer, prepared.optimizer)
        with torch.no_grad():
            for p, (grad, state) in prepared.saved.items():
                if grad is not None and getattr(p, "main_grad", None) is not None:
                    p.main_grad.copy_(grad)
                put_param_state(prepared.optimizer, p, state, copy=False)
        if self.fault is not None:
            self.fault.on_restored(stage)

    # ---- commit / undo ----------------------------------------------------------------------
    def _commit(self, prepared: _Prepared, new: Layout) -> None:
        """Reference updates only: nothing here allocates or communicates."""
        t = self.trainer
        for ddp in t.ddps:
            retire_ddp(ddp)
        t.install_wrappers(prepared.ddp, prepared.optimizer)
        if self.embedding_groups is not None:  # the embedding all-reduce follows the block
            t.config.finalize_model_grads_func = with_embedding_group(
                t.config.finalize_model_grads_func, self.embedding_groups.for_rank(new.mtp_rank))
        t.layout = new

    def _abandon(self, prepared: Optional[_Prepared], old: Layout, new: Layout, error: str) -> None:
        if prepared is not None:
            self._undo(prepared)
        self._set_config_layout(old)
        if TIMEOUT_MARK in (error or ""):
            raise PeerFailure(f"migration {old} -> {new}: {error}. A timed-out transfer cannot be "
                              "cancelled and would corrupt later pipeline traffic; stopping")
        logger.error("migration %s -> %s abandoned, old layout kept: %s", old, new, error)

    def _undo(self, prepared: _Prepared) -> None:
        """Back to the old layer list, gradient views and DDP hooks."""
        t = self.trainer
        if prepared.ddp is not None:
            for ddp in prepared.ddp if isinstance(prepared.ddp, list) else [prepared.ddp]:
                retire_ddp(ddp)
            prepared.ddp = prepared.optimizer = None
        for shell in reversed(prepared.shells):
            shell.restore()
        prepared.shells = []
        for chunk, layers in zip(t.chunks, prepared.old_layers):
            chunk.decoder.layers = layers
            chunk.decoder.num_layers_per_pipeline_rank = len(layers)
        for p, data in prepared.old_data.items():
            p.data = data
        for p, grad in prepared.old_main_grads.items():
            p.main_grad = grad
        for ddp in t.ddps:
            if not ddp.grad_accs:
                _attach_hooks(ddp)

    # ---- result -----------------------------------------------------------------------------
    def _result(self, old, new, ok, error, headers, start, peak, moves) -> MigrationResult:
        names = PHASES
        total = time.perf_counter() - start
        values = self.control.max([total, float(peak), float(self.pool.nbytes)]
                                  + [self._phase_s.get(n, 0.0) for n in names], "result")
        total_s, peak_max, pool = values[0], int(values[1]), int(values[2])
        phases = dict(zip(names, values[3:]))
        return MigrationResult(
            applied=ok, layout_before=str(old), layout_after=str(new if ok else old),
            moves=_moves(old, headers, moves),
            bytes_moved=sum(h.nbytes for h in headers), transfer_s=phases.get("transfer", 0.0),
            total_s=total_s, error=None if ok else error, phase_s=phases,
            peak_extra_bytes=peak_max, staging_pool_bytes=pool,
            peak_source="measured" if self.trainer.dims.device.type == "cuda" else "accounted")


def _moves(old: Layout, headers: list[Header], moves) -> list[dict]:
    """The report's moves: one per header (src/dst: stages = ranks); interleaved, one per
    moved layer with (virtual) stages, 0 bytes for a move between chunks of a rank."""
    if not old.interleaved:
        return [{"layer": mtp_move.UNIT_NAMES.get(h.layer, h.layer), "src": h.src, "dst": h.dst,
                 "bytes": h.nbytes} for h in headers]
    sent = {h.layer: h.nbytes for h in headers}
    return [{"layer": n, "src": s, "dst": d, "bytes": sent.get(n, 0)} for n, s, d in moves]


def _embedding_groups(trainer, pp_ranks: list[int]):
    """The embedding groups of every rank the MTP block may move to (made at start, by
    every rank: training.mtp.EmbeddingGroups); None where live block moves cannot happen
    (no MTP, virtual stages, one candidate rank). Made before the stage handle knows
    whether it can feed the block elsewhere (Megatron-LM's learns it when its data
    iterators are built: `mtp_moves_live`)."""
    layout = trainer.layout
    if not layout.has_mtp or layout.num_chunks > 1 or layout.num_ranks < 3:
        return None
    from megatron.core import parallel_state
    return EmbeddingGroups(parallel_state.get_embedding_group(check_initialized=False),
                           layout.mtp_rank, pp_ranks,
                           tied=trainer.chunks[0].share_embeddings_and_output_weights)


# ---- Megatron DDP internals (megatron-core 0.16) ------------------------------------------------
def _ddp_buffer_bytes(ddp) -> int:
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return sum(_nbytes(t for t in (b.grad_data, getattr(b, "param_data", None)) if t is not None)
               for b in buffers)


def _detach_hooks(ddp) -> None:
    """Drop the DDP's grad-accumulator references: its hooks live on AccumulateGrad nodes
    that only `grad_accs` keeps alive, so they die with the list."""
    ddp.grad_accs.clear()


def _attach_hooks(ddp) -> None:
    """Re-register the DDP's backward hooks, as its constructor does."""
    for param in ddp.module.parameters():
        if param.requires_grad:
            grad_acc = param.expand_as(param).grad_fn.next_functions[0][0]
            grad_acc.register_hook(ddp._make_backward_post_hook(param))
            ddp.grad_accs.append(grad_acc)


def retire_ddp(ddp) -> None:
    """Silence a DDP for good: no hooks, no bucket lookups, buffers released."""
    _detach_hooks(ddp)
    ddp.param_to_bucket_group = {}
    for name in ("buffers", "expert_parallel_buffers", "bucket_groups",
                 "expert_parallel_bucket_groups"):
        if isinstance(getattr(ddp, name, None), list):
            setattr(ddp, name, [])
