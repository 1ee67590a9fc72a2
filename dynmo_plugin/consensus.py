"""The control plane: decisions taken once, agreement, and naming a peer that failed.

A rank that decides differently from its peers enters a different collective (or none)
and the job hangs, which on a thousand GPUs is the worst outcome there is. So
everything that leads to a collective (apply a plan or not, the new layout, repack or
not, a dynamism decision) is computed on ONE rank and broadcast (`decide`), never
recomputed per rank from measurements that may differ (TP and DP ranks time
differently).

The control plane runs on its own gloo group over all ranks, with the plugin's own
timeout (`rebalance.migration_timeout_s`), separate from training's groups: a peer
that hangs makes these calls fail after that timeout instead of the process group's
(30 min by default), and on NCCL jobs the small control messages stay off the GPU.

Every payload must be on the CPU (plain data, or CPU tensors): the control plane is
gloo, and a CUDA tensor in it either fails there or, pickled, drags a device copy and a
host synchronisation through every rank. A non-CPU payload is refused with
`NonCPUPayload` on EVERY rank of the collective (never on one rank only: its peers
would wait in a collective it skipped).

Every rank also writes the phase it enters to the rendezvous store (torchrun's
TCPStore; a few hundred bytes per phase). When a collective fails, the ranks that
are behind in that ledger are the dead or hung peers, and `PeerFailure` names them.
"""
from __future__ import annotations

import datetime
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from dynmo_plugin.errors import DecisionFailed

__all__ = ["ControlPlane", "PeerFailure", "DecisionFailed", "NonCPUPayload", "agent_store"]

logger = logging.getLogger(__name__)
_LEDGER = "dynmo/phase/{}"


class PeerFailure(RuntimeError):
    """A collective of the plugin failed because some rank died, hung or lost its link.

    Training cannot continue in this world (torch.distributed has no way to cancel
    the pending operations); the message names the phase and the suspected ranks.
    """


class NonCPUPayload(TypeError):
    """A control-plane payload held a tensor that is not on the CPU (a caller's bug)."""


@dataclass(frozen=True)
class _Failed:
    message: str


def _non_cpu(payload: Any, phase: str) -> Optional[str]:
    """Why `payload` may not travel on the control plane (a tensor in it, at any depth of
    lists, tuples, sets and dicts, is not on the CPU), or None."""
    stack = [payload]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item) and item.device.type != "cpu":
            return (f"control plane phase '{phase}': a {tuple(item.shape)} tensor on "
                    f"{item.device} in the payload; the control plane is gloo on the CPU: "
                    "move it there first (tensor.cpu())")
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return None


class ControlPlane:
    """Decide / agree / reduce over all ranks on a dedicated gloo group."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._store = _default_store()
        self._seq = 0

    # ---- decisions ------------------------------------------------------------------
    def decide(self, fn: Callable[[], Any], phase: str = "decision") -> Any:
        """Run `fn` on rank 0 only; every rank returns its result (pickled, so plain data).

        Raises:
            DecisionFailed: on every rank, if `fn` raised on rank 0.
            PeerFailure: the broadcast failed (a peer is gone).
        """
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = fn()
                bad = _non_cpu(payload[0], phase)
                if bad:
                    raise NonCPUPayload(bad)
            except Exception as e:  # noqa: BLE001 - every rank must learn it, not only rank 0
                payload[0] = _Failed(f"{type(e).__name__}: {e}")
        with self.phase(phase):
            dist.broadcast_object_list(payload, src=0, group=self.group)
        if isinstance(payload[0], _Failed):
            raise DecisionFailed(payload[0].message)
        return payload[0]

    def agree(self, error: Optional[str], phase: str) -> tuple[bool, Optional[str]]:
        """All ranks proceed or none does. Returns (ok, every rank's error joined)."""
        with self.phase(phase):
            flag = torch.tensor([0 if error else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            if flag.item():
                return True, None
            errors: list = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self.group)
        return False, _by_cause(errors)

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        """Every rank's `obj` (plain data or CPU tensors).

        Raises:
            NonCPUPayload: on every rank, if any rank's `obj` holds a non-CPU tensor.
        """
        bad = _non_cpu(obj, phase)
        with self.phase(phase):
            out: list = [None] * self.world_size
            dist.all_gather_object(out, _Failed(bad) if bad else obj, group=self.group)
        _raise_refused([(r, o) for r, o in enumerate(out) if isinstance(o, _Failed)])
        return out

    def max(self, values: list[float], phase: str) -> list[float]:
        """Element-wise maximum over ranks of `values` (Python numbers or CPU tensors).

        Raises:
            NonCPUPayload: on every rank, if any rank passed a non-CPU tensor.
        """
        bad = _non_cpu(values, phase)
        with self.phase(phase):  # slot 0: how many ranks were refused
            buf = torch.tensor([float(bool(bad))] + ([0.0] * len(values) if bad else values),
                               dtype=torch.float64)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        if buf[0]:
            _raise_refused([(self.rank, _Failed(bad))] if bad else [],
                           f"control plane phase '{phase}': another rank sent a non-CPU tensor")
        return buf[1:].tolist()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point on the control group (e.g. variable-sized data gathered to rank
        0); the receiver must `recv` a CPU tensor of the same size and dtype.

        Raises:
            NonCPUPayload: `tensor` is not on the CPU (before anything is sent).
        """
        _raise_refused([(self.rank, _Failed(bad))] if (bad := _non_cpu(tensor, "send")) else [])
        dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into the CPU `tensor` from `src` (see `send`)."""
        _raise_refused([(self.rank, _Failed(bad))] if (bad := _non_cpu(tensor, "recv")) else [])
        dist.recv(tensor, src=src, group=self.group)

    # ---- the phase ledger -----------------------------------------------------------
    def enter(self, phase: str, collective: bool = False) -> None:
        """Record that this rank entered `phase` (also before local work that may hang).

        Only collective phases advance the sequence number: every rank passes through
        the same collectives in the same order, while local phases may be skipped."""
        self._seq += int(collective)
        if self._store is not None:
            try:
                self._store.set(_LEDGER.format(self.rank), f"{self._seq}|{phase}")
            except Exception:  # noqa: BLE001 - the ledger is diagnostic only
                self._store = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Enter `name`; a communication error inside becomes a `PeerFailure` naming the
        ranks that did not get this far."""
        self.enter(name, collective=True)
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, (PeerFailure, DecisionFailed)):
                raise
            raise PeerFailure(self.describe_failure(name, e)) from e

    def describe_failure(self, phase: str, error: BaseException) -> str:
        behind = self.ranks_behind()
        who = (", ".join(f"rank {r} last entered '{p}'" for r, p in behind)
               if behind else "no rank is behind in the ledger (a link failed, or a rank died "
                              "after entering this phase)")
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"phase '{phase}' failed on rank {self.rank} after at most {self.timeout_s:g} s: "
                f"{first}; suspects: {who}")

    def ranks_behind(self) -> list[tuple[int, str]]:
        """(rank, last phase) of every rank whose ledger entry trails this rank's."""
        if self._store is None:
            return []
        out = []
        for r in range(self.world_size):
            key = _LEDGER.format(r)
            try:
                if not self._store.check([key]):
                    out.append((r, "(nothing yet)"))
                    continue
                seq, phase = self._store.get(key).decode().split("|", 1)
            except Exception:  # noqa: BLE001 - diagnostic only
                return out
            if int(seq) < self._seq:
                out.append((r, phase))
        return out


def _raise_refused(failed: list[tuple[int, "_Failed"]], fallback: str = "") -> None:
    if failed:
        raise NonCPUPayload("; ".join(f"rank {r}: {f.message}" for r, f in failed))
    if fallback:
        raise NonCPUPayload(fallback)


def _default_store():
    """The store the default group rendezvoused on (torchrun's TCPStore), if reachable."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it failures name no peer
        logger.warning("rendezvous store not reachable: a failed collective will not name its peer")
        return None


def agent_store(timeout_s: float) -> dist.TCPStore:
    """A client of torchrun's store (the agent's TCPStore at MASTER_ADDR:MASTER_PORT).

    It outlives every process group, so ranks can still meet on it while the world is
    torn down and rebuilt (a repack), and after some ranks have left."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _by_cause(errors: list) -> str:
    """Every rank's error, each cause once with the ranks that hit it ("ranks 0, 1: X";
    on 64 ranks one line, not 64 copies)."""
    ranks: dict[str, list[int]] = {}
    for r, e in enumerate(errors):
        if e:
            ranks.setdefault(e, []).append(r)
    return "; ".join(f"rank {rs[0]}: {e}" if len(rs) == 1 else f"ranks {_span(rs)}: {e}"
                     for e, rs in ranks.items())


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
