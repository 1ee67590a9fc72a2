"""Move TransformerLayers between live pipeline stages with all their training state.

A migration is collective over every rank (data-parallel replicas migrate their own
copies the same way) and atomic:
  1. pack    - each source packs every tensor of each outgoing layer: weights, biases,
               norms (its state_dict), the gradient (DDP's main_grad) and optimizer
               state (Adam moments, step, fp32 master copy in bf16/fp16);
  2. exchange- headers by one all-gather, buffers by batched p2p;
  3. stage   - each receiver builds the layer (with the new layout on the config, so
               its global layer number is right), verifies checksums, loads state;
  4. agree   - an all-reduce of "ok" over all ranks; any exception, checksum mismatch
               or timeout anywhere -> every rank drops what it staged and keeps the
               old layout (nothing was removed yet);
  5. commit  - swap layers in TransformerBlock, retire the old DDP (its hooks stay on
               the parameters' AccumulateGrad nodes otherwise), wrap anew, rebuild the
               optimizer and put every parameter's state back.
Local failures never skip a collective, so a failing rank cannot hang the others.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.spec_utils import build_module

from dynmo_plugin.layout import Layout
from dynmo_plugin.megatron.optim_state import param_state, state_owner
from dynmo_plugin.migration.exchange import exchange_buffers, exchange_headers
from dynmo_plugin.migration.faults import FaultInjector
from dynmo_plugin.migration.result import MigrationError, MigrationResult
from dynmo_plugin.migration.wire import Header, checksum, pack, unpack

__all__ = ["LayerMigrator"]

logger = logging.getLogger(__name__)


def _main_grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class LayerMigrator:
    """Applies new layouts to the stage owned by `trainer` (same call on every rank)."""

    def __init__(self, trainer, timeout_s: float = 300.0, fault: Optional[FaultInjector] = None):
        self.trainer, self.timeout_s, self.fault = trainer, timeout_s, fault

    # ---- entry point ------------------------------------------------------------------
    def migrate(self, new: Layout) -> MigrationResult:
        t = self.trainer
        old, stage = t.layout, t.dims.pp_rank
        start = time.perf_counter()
        moves = old.moved_layers(new)
        out_layers = {n for n, src, _ in moves if src == stage}
        error: Optional[str] = None
        try:
            outgoing, sending = self._pack(moves, stage)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error, outgoing, sending = f"pack on stage {stage}: {e!r}", [], {}
        headers = exchange_headers(outgoing, t.dims.groups.pp)  # also syncs the pipeline
        t_x = time.perf_counter()
        received = {}
        try:
            received = exchange_buffers(headers, sending, stage, t.dims.groups.pp,
                                        t.dims.device, self.timeout_s)
        except Exception as e:  # noqa: BLE001
            error = error or f"transfer on stage {stage}: {e!r}"
        transfer_s = time.perf_counter() - t_x
        staged, error = self._stage(new, headers, received, stage, error)
        ok, error = self._agree(error)
        if ok:
            self._commit(new, staged, out_layers)
        else:
            self._set_config_layout(old)
            logger.error("migration %s -> %s abandoned, old layout kept: %s", old, new, error)
        transfer_s, total_s = self._max_over_ranks(transfer_s, time.perf_counter() - start)
        return MigrationResult(
            applied=ok, layout_before=str(old), layout_after=str(new if ok else old),
            moves=[{"layer": h.layer, "src": h.src, "dst": h.dst, "bytes": h.nbytes} for h in headers],
            bytes_moved=sum(h.nbytes for h in headers), transfer_s=transfer_s, total_s=total_s,
            error=None if ok else error)

    # ---- phases -------------------------------------------------------------------------
    def _pack(self, moves, stage: int) -> tuple[list[Header], dict[int, list[torch.Tensor]]]:
        by_number = {layer.layer_number: layer for layer in self.trainer.model.decoder.layers}
        outgoing, sending = [], {}
        for number, src, dst in moves:
            if src != stage:
                continue
            header, buffers = pack(number, src, dst, self._layer_tensors(by_number[number]),
                                   self.trainer.dims.device)
            outgoing.append(header)
            sending[number] = buffers
        return outgoing, sending

    def _layer_tensors(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = {f"state/{k}": v for k, v in layer.state_dict().items() if torch.is_tensor(v)}
        for name, p in layer.named_parameters():
            grad = _main_grad(p)
            if grad is not None:
                out[f"grad/{name}"] = grad
            for key, value in param_state(self.trainer.optimizer, p).items():
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
                staged[h.layer] = (self._build_layer(h.layer, new, stage, tensors), tensors)
        except Exception as e:  # noqa: BLE001 - reported to every rank by _agree
            return {}, f"stage {stage}: {e!r}"
        return staged, None

    def _build_layer(self, number: int, new: Layout, stage: int, tensors: dict) -> torch.nn.Module:
        t = self.trainer
        decoder = t.model.decoder
        layer = build_module(t.spec, config=t.config, layer_number=number - new.offset(stage),
                             pg_collection=decoder.pg_collection, vp_stage=decoder.vp_stage)
        if layer.layer_number != number:
            raise MigrationError(f"built layer {layer.layer_number}, expected {number}")
        layer.to(t.dims.device)
        state = {k.removeprefix("state/"): v for k, v in tensors.items() if k.startswith("state/")}
        missing, unexpected = layer.load_state_dict(state, strict=False)
        if unexpected or any(not k.endswith("_extra_state") for k in missing):
            raise MigrationError(f"layer {number}: state mismatch (missing {missing}, unexpected {unexpected})")
        return layer

    def _agree(self, error: Optional[str]) -> tuple[bool, Optional[str]]:
        """All ranks commit or none does; on failure every rank learns every cause."""
        flag = torch.tensor([1 if error is None else 0], dtype=torch.int32,
                            device=self.trainer.dims.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            return True, None
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return False, "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)

    def _max_over_ranks(self, *values: float) -> list[float]:
        buf = torch.tensor(values, dtype=torch.float64, device=self.trainer.dims.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return buf.tolist()

    def _set_config_layout(self, layout: Layout) -> None:
        cfg = self.trainer.config
        parsed = PipelineParallelLayerLayout(layout.to_megatron(), layout.num_stages)
        parsed.validate_layer_layout(num_layers=cfg.num_layers, mtp_num_layers=None)
        cfg.pipeline_model_parallel_layout = parsed

    # ---- commit -------------------------------------------------------------------------
    def _commit(self, new: Layout, staged: dict, out_layers: set[int]) -> None:
        t = self.trainer
        decoder = t.model.decoder
        keep = [layer for layer in decoder.layers if layer.layer_number not in out_layers]
        saved = {p: (_main_grad(p), param_state(t.optimizer, p))
                 for layer in keep for p in layer.parameters()}
        layer_params = {p for layer in decoder.layers for p in layer.parameters()}
        saved.update({p: (_main_grad(p), param_state(t.optimizer, p))
                      for p in t.model.parameters() if p not in layer_params})
        for layer, tensors in staged.values():
            for name, p in layer.named_parameters():
                state = {k.rsplit("/", 1)[-1]: v.clone() for k, v in tensors.items()
                         if k.startswith(f"optim/{name}/")}
                saved[p] = (tensors.get(f"grad/{name}"), state)
        decoder.layers = torch.nn.ModuleList(
            sorted(keep + [layer for layer, _ in staged.values()], key=lambda m: m.layer_number))
        decoder.num_layers_per_pipeline_rank = len(decoder.layers)
        self._retire_ddp()
        t.rebuild_wrappers()  # collective: get_megatron_optimizer gathers over WORLD
        self._restore(saved)
        t.layout = new

    def _retire_ddp(self) -> None:
        """Silence the old DDP: its grad hooks live on AccumulateGrad nodes that only its
        `grad_accs` list keeps alive, and fire only for params in param_to_bucket_group."""
        old = self.trainer.ddp
        old.param_to_bucket_group = {}
        old.grad_accs.clear()
        for p in old.module.parameters():
            if hasattr(p, "main_grad"):
                del p.main_grad

    def _restore(self, saved: dict) -> None:
        t = self.trainer
        with torch.no_grad():
            for p, (grad, state) in saved.items():
                if grad is not None and getattr(p, "main_grad", None) is not None:
                    p.main_grad.copy_(grad)
                if not state:
                    continue
                state = dict(state)
                inner, key = state_owner(t.optimizer, p)
                main = state.pop("main_param", None)
                if main is not None:
                    key.data.copy_(main)
                inner.state[key] = state
