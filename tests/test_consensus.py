"""The control plane (`dynmo_plugin.consensus`) on three real gloo ranks.

Every call is checked against what each rank put in, recorded by the rank itself and
judged here: `decide` runs its function on rank 0 only and hands every rank the same
value (or the same DecisionFailed); `agree` is all-or-none and names every rank's
error; `all_gather` and `max` are rank-ordered and element-wise; a non-CPU payload (a
'meta' tensor stands in for a CUDA one) is refused on every rank, at any depth; the
phase ledger names the ranks that did not reach a phase, and counts only collective
phases. Hung and dead peers in a real training run: tests/run/test_reliability.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from dynmo_plugin.consensus import ControlPlane, DecisionFailed, _non_cpu
from launch import free_port, spawn

pytestmark = pytest.mark.multiproc   # torch.multiprocessing gloo ranks (setup.cfg)
WORLD = 3


def _catch(fn):
    try:
        return ["ok", fn()]
    except Exception as e:  # noqa: BLE001 - the test judges the type and message
        return [type(e).__name__, str(e)]


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    control = ControlPlane(timeout_s=60)
    meta = torch.zeros(2, device="meta")
    seen: dict = {}
    # the ledger before anyone but rank 0 entered a phase (a local one: no sequence step)
    if rank == 0:
        control.enter("first")
    dist.barrier()
    seen["behind_at_start"] = control.ranks_behind()
    dist.barrier()

    calls = []
    seen["decide"] = _catch(lambda: control.decide(lambda: calls.append(rank) or {"r": rank, "v": [1, 2]}))
    seen["decide_calls"] = calls
    seen["decide_fails"] = _catch(lambda: control.decide(lambda: 1 / 0, "div"))
    seen["agree_ok"] = list(control.agree(None, "a"))
    seen["agree_one"] = list(control.agree("boom" if rank == 1 else None, "a1"))
    seen["agree_two"] = list(control.agree(f"e{rank}" if rank != 1 else None, "a2"))
    seen["agree_same"] = list(control.agree("x" if rank != 1 else "y", "a3"))
    seen["gather"] = control.all_gather({"rank": rank, "sq": rank * rank}, "g")
    seen["max"] = control.max([float(rank), -float(rank), 5.0 if rank == 1 else 0.5], "m")
    seen["gather_meta"] = _catch(lambda: control.all_gather({(1, 2): {meta}} if rank == 2 else rank, "gm"))
    seen["max_meta"] = _catch(lambda: control.max([meta.sum()] if rank == 0 else [1.0], "mm"))
    if rank < 2:                                   # point to point, ranks 0 and 1
        buf = torch.full((3,), float(rank))
        if rank == 0:
            control.send(torch.arange(3.0) + 10, 1)
        else:
            control.recv(buf, 0)
            seen["recv"] = buf.tolist()
    # local phases do not advance the sequence; a collective one does
    control.enter("local", collective=False)
    seq_before = control._seq
    if rank != 2:                                  # rank 2 stays behind at 'mm'
        control.enter("ahead", collective=True)
    seen["seq"] = [seq_before, control._seq]
    dist.barrier()
    seen["behind"] = control.ranks_behind()
    seen["describe"] = control.describe_failure("ahead", RuntimeError("link down\nsecond line"))
    dist.barrier()                                 # read before anyone enters another phase

    def inside(error):
        with control.phase("inner"):
            raise error
    seen["phase_runtime"] = _catch(lambda: inside(RuntimeError("gloo: connection reset")))
    seen["phase_decision"] = _catch(lambda: inside(DecisionFailed("as is")))
    seen["phase_other"] = _catch(lambda: inside(KeyError("not a comm error")))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh, default=repr)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("consensus")
    spawn(_rank, (free_port(), str(out)), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_decide_runs_on_rank_zero_and_every_rank_gets_its_value(seen):
    for rank, s in enumerate(seen):
        assert s["decide"] == ["ok", {"r": 0, "v": [1, 2]}]
        assert s["decide_calls"] == ([0] if rank == 0 else [])
        assert s["decide_fails"] == ["DecisionFailed", "ZeroDivisionError: division by zero"]


def test_agree_is_all_or_none_and_names_every_error(seen):
    for s in seen:
        assert s["agree_ok"] == [True, None]
        assert s["agree_one"] == [False, "rank 1: boom"]
        assert s["agree_two"] == [False, "rank 0: e0; rank 2: e2"]
        assert s["agree_same"] == [False, "ranks 0, 2: x; rank 1: y"]  # each cause once


def test_gather_and_max_are_rank_ordered_and_element_wise(seen):
    for s in seen:
        assert s["gather"] == [{"rank": r, "sq": r * r} for r in range(WORLD)]
        assert s["max"] == [2.0, 0.0, 5.0]
    assert seen[1]["recv"] == [10.0, 11.0, 12.0]   # sent by rank 0


def test_a_non_cpu_payload_is_refused_on_every_rank(seen):
    for rank, s in enumerate(seen):
        kind, message = s["gather_meta"]
        assert kind == "NonCPUPayload" and message.startswith("rank 2: control plane phase 'gm'")
        assert "meta" in message and "(2,)" in message
        kind, message = s["max_meta"]
        assert kind == "NonCPUPayload"
        want = ("rank 0: control plane phase 'mm': a () tensor on meta" if rank == 0
                else "control plane phase 'mm': another rank sent a non-CPU tensor")
        assert message.startswith(want), message


def test_the_ledger_names_the_ranks_behind(seen):
    for s in seen:
        assert s["behind_at_start"] == [[1, "(nothing yet)"], [2, "(nothing yet)"]]
    # 10 collective phases (2 decide, 4 agree, 2 gather, 2 max); 'local' counts none,
    # 'ahead' (not on rank 2) one
    assert [s["seq"] for s in seen] == [[10, 11], [10, 11], [10, 10]]
    assert seen[0]["behind"] == seen[1]["behind"] == [[2, "local"]]
    assert seen[2]["behind"] == []
    assert seen[0]["describe"] == ("phase 'ahead' failed on rank 0 after at most 60 s: link down; "
                                   "suspects: rank 2 last entered 'local'")
    assert seen[2]["describe"].endswith("suspects: no rank is behind in the ledger (a link failed, "
                                        "or a rank died after entering this phase)")


def test_phase_turns_communication_errors_into_peer_failures_only(seen):
    for rank, s in enumerate(seen):
        kind, message = s["phase_runtime"]
        assert kind == "PeerFailure" and message.startswith(
            f"phase 'inner' failed on rank {rank} after at most 60 s: gloo: connection reset; suspects: ")
        assert s["phase_decision"] == ["DecisionFailed", "as is"]
        assert s["phase_other"] == ["KeyError", "'not a comm error'"]


META = torch.zeros(1, device="meta")


@pytest.mark.parametrize("payload", [
    META, [1, (2, {META})], {META: 1}, {"k": frozenset({META})}, [[[[{"d": (META,)}]]]]])
def test_non_cpu_finds_a_tensor_at_any_depth(payload):
    why = _non_cpu(payload, "p")
    assert why.startswith("control plane phase 'p': a (1,) tensor on meta") and "tensor.cpu()" in why


@pytest.mark.parametrize("payload", [1, None, torch.ones(2), {"a": [torch.ones(1)], "b": {2, 3}}, "meta"])
def test_non_cpu_lets_cpu_payloads_through(payload):
    assert _non_cpu(payload, "p") is None
