"""NCCL/CUDA safety rules that gloo on CPU can still show (issue 25).

- The control plane (gloo) refuses non-CPU payloads on every rank of the collective.
  A tensor on the 'meta' device stands in for a CUDA one (no GPU here).
- Allocate, agree, then communicate: an allocation failure on ONE data-parallel rank
  (a FaultInjector `allocation_exception`, test-only) ends the migration on every rank
  with the old layout, and training goes on; before, its DP peer waited in the
  all-reduce it never joined.
- A repack gathers the sharded optimizer state while the old DP group is alive (a spy
  on the gather records whether its group is still registered; gloo hides the
  collective over a destroyed group, NCCL errors or hangs).
"""
import json
import os

import numpy as np
import pytest
import torch

from launch import free_port, losses, spawn, train, worker

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--seed", "11", "--dynmo", "--pipeline-model-parallel-size", "2",
         "--bf16", "--use-distributed-optimizer", "--untie-embeddings-and-output-weights",
         "--dynmo-migration-timeout", "60"]
# From Etttt|ttttL: iteration 2 moves layers 5-6 to stage 0, iteration 3 moves 3-6 to stage 1.
MOVES = "2:Etttttt|ttL;3:Ett|ttttttL"


# ---- the control plane refuses non-CPU payloads ---------------------------------------------
def _control_plane_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from dynmo_plugin.consensus import ControlPlane, DecisionFailed, NonCPUPayload
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    control = ControlPlane(timeout_s=60)
    meta = torch.zeros(3, device="meta")  # stands in for a CUDA tensor
    seen = {}

    def attempt(name, fn):
        try:
            seen[name] = ["ok", repr(fn())]
        except (NonCPUPayload, DecisionFailed) as e:
            seen[name] = [type(e).__name__, str(e)]

    attempt("all_gather", lambda: control.all_gather({"x": [meta]} if rank == 1 else 7, "g"))
    attempt("max", lambda: control.max([meta.sum()] if rank == 0 else [1.0], "m"))
    attempt("decide", lambda: control.decide(lambda: (1, meta), "d"))
    attempt("send", lambda: control.send(meta, 1 - rank))
    attempt("cpu", lambda: control.all_gather(torch.tensor([rank]), "cpu"))
    from dynmo_plugin.megatron.training.parallel import supports_shrinking
    seen["shrinks"] = supports_shrinking()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_control_plane_refuses_non_cpu_payloads_on_every_rank(tmp_path):
    spawn(_control_plane_rank, (free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        kind, message = seen["all_gather"]
        assert kind == "NonCPUPayload" and message.startswith("rank 1: control plane phase 'g'")
        assert "meta" in message and ".cpu()" in message
        kind, message = seen["max"]
        assert kind == "NonCPUPayload" and "'m'" in message
        kind, message = seen["decide"]
        assert kind == "DecisionFailed" and "NonCPUPayload" in message and "'d'" in message
        assert seen["send"][0] == "NonCPUPayload"
        assert seen["cpu"] == ["ok", repr([torch.tensor([0]), torch.tensor([1])])]
        assert seen["shrinks"] is False  # gloo: a repack keeps the destroy + rendezvous path


# ---- allocate, agree, then communicate -------------------------------------------------------
def _fault_run(tmp_path, fault: str) -> list[dict]:
    flags = MODEL + ["--train-iters", "5", "--dynmo-forced-layouts", MOVES,
                     "--test-fault", fault, "--test-dump-ranks"]
    worker(4, flags, tmp_path, timeout=600)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.multiproc
@pytest.mark.parametrize("fault, where", [
    ("allocation_exception@1:pack", "pack buffers on stage 1"),      # the optimizer-state gather
    ("allocation_exception@0:staging", "staging buffers on stage 0"),  # receive buffers
])
def test_allocation_failure_on_one_rank_ends_the_migration_everywhere(tmp_path, fault, where):
    """One DP rank of a PP=2 x DP=2 bf16 run with the distributed optimizer fails to
    allocate; every rank abandons that migration with the old layout, the next one
    applies, and all five iterations train."""
    for report in _fault_run(tmp_path, fault):
        first, second = [e for e in report["events"] if e["kind"] == "rebalance"]
        assert not first["applied"]
        assert f"injected out-of-memory allocating the {where}" in first["error"]
        assert first["layout_after"] == first["layout_before"] == "Etttt|ttttL"
        assert second["applied"] and report["layout"] == "Ett|ttttttL"
        assert len(losses(report)) == 5


# ---- repack: capture before the shrink ---------------------------------------------------------
@pytest.mark.multiproc
def test_repack_gathers_sharded_state_only_over_live_groups(tmp_path):
    """PP=2 x DP=2 repacked onto one stage: every optimizer-state gather on the survivors
    (the migration's, the head handoff's, the rebuild's capture) talks over a DP group
    that is still registered, i.e. the capture precedes the shrink."""
    flags = MODEL + ["--train-iters", "3", "--dynmo-repack", "--dynmo-forced-layouts",
                     "2:EttttttttL"]
    report = train(4, flags, tmp_path, module="workers.group_spy_worker", timeout=600)
    assert report["events"][-1]["repack"]["applied"] and report["layout"] == "EttttttttL"
    assert len(losses(report)) == 3
    for rank in range(2):  # the survivors; ranks 2-3 gather in the migration only
        gathers = json.loads((tmp_path / f"gathers_rank{rank}.json").read_text())
        assert len(gathers) >= 2 and all(g["group_live"] for g in gathers), gathers




# ---- the device checksum's bounded temporaries -------------------------------------------------
def _whole_buffer_checksum(raw: torch.Tensor) -> tuple[int, int]:
    """The unchunked formula (what wire.py computed before: ~6-8x the buffer in int64)."""
    words = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).to(torch.int64)
    weights = torch.arange(words.numel(), dtype=torch.int64) % 65521 + 1
    return int(words.sum()), int((words * weights).sum())


@pytest.mark.parametrize("nbytes", [4, 7, 4 * 1000, 4 * 70000 + 8, 1001])
def test_chunked_word_checksum_equals_the_whole_buffer_formula(nbytes):
    """The device checksum runs in chunks of bounded size (the same code on CPU here);
    any chunk size gives the whole-buffer value, and one flipped byte changes it."""
    from dynmo_plugin.migration.wire import checksum_transient_bytes, word_checksum
    g = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    expected = _whole_buffer_checksum(raw)
    for chunk in ((1, 3) if nbytes < 5000 else ()) + (1000, 65521, 1 << 20):
        assert word_checksum(raw, chunk_words=chunk) == expected
    raw[nbytes // 2] ^= 0x01
    assert word_checksum(raw) != expected
    assert checksum_transient_bytes(1 << 40) == checksum_transient_bytes(1 << 30) < 17 << 20


# ---- TE packed sequences: padded boundaries ----------------------------------------------------
def test_packed_micro_batches_carry_padded_boundaries_ending_at_the_row():
    """THD micro-batches give TE `cu_seqlens_*_padded` ending at the row length (the
    trailing padding belongs to the last document), so no position is left outside
    every sequence; the real boundaries are unchanged. An empty row is one empty
    document padded to the row."""
    from dynmo_plugin.data.documents import DocumentStream, LognormalDocuments
    from dynmo_plugin.data.packing import SequentialPacker
    from dynmo_plugin.data.stream import PackedDocuments
    from dynmo_plugin.megatron.attention.varlen import packed_seq_params
    row = 128
    docs = DocumentStream(LognormalDocuments(seed=5, vocab_size=64, median=30, sigma=1.0,
                                             max_length=row, count=200), seed=5, max_length=row)
    stream = PackedDocuments(docs, SequentialPacker(row, 1, 2), row, 1, 2, None)
    plan = stream.plan(1)
    padded_rows = 0
    for ids in (mb[0] for mb in plan.groups):
        batch = stream.build([plan.pieces[s] for s in ids])
        cu, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
        assert cu.tolist() == [0] + list(np.cumsum(batch["lengths"]))
        assert padded[:-1].tolist() == cu[:-1].tolist() and int(padded[-1]) == row
        padded_rows += int(cu[-1]) < row
        params = packed_seq_params(batch)
        assert params.cu_seqlens_q_padded is padded and params.cu_seqlens_kv_padded is padded
    assert padded_rows > 0  # the case that matters occurred
    empty = stream.build([])
    assert empty["cu_seqlens"].tolist() == [0, 0] and empty["cu_seqlens_padded"].tolist() == [0, row]


# ---- determinism settings ----------------------------------------------------------------------
def test_deterministic_mode_follows_the_te_switch(monkeypatch):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (what the GPU checks set, with
    CUBLAS_WORKSPACE_CONFIG) turns on Megatron's deterministic_mode; unset it is off."""
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import transformer_config
    args = ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    layout = Layout.parse("EttL")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    assert not transformer_config(args, layout).deterministic_mode
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert transformer_config(args, layout).deterministic_mode


# ---- item 4: the checksum's transient counts in the gate's migration peak ------------------
def test_checksum_transient_in_the_memory_model_is_the_wires_bound():
    from dynmo_plugin.balancing.profile_problem import CHECKSUM_TRANSIENT_BYTES
    from dynmo_plugin.migration.wire import checksum_transient_bytes
    assert CHECKSUM_TRANSIENT_BYTES == checksum_transient_bytes(1 << 30)
    assert all(checksum_transient_bytes(n) <= CHECKSUM_TRANSIENT_BYTES for n in (4, 4096, 1 << 24))


@pytest.mark.parametrize("chunks", [1, 2])
def test_migration_peak_adds_the_transient_once_per_rank_that_sends_or_receives(chunks):
    """Three ranks; one layer moves from rank 0 to rank 1 (interleaved: between chunks of
    ranks 0 and 1): those two ranks hold the checksum transient once each, rank 2 not."""
    from dynmo_plugin.balancing.metrics import migration_peak_memory
    from dynmo_plugin.balancing.problem import BalanceProblem
    from dynmo_plugin.layout import Layout
    before, after = (("Ett|tt|ttL", "Et|ttt|ttL") if chunks == 1
                     else ("Et|t|t|t|t|tL", "E|tt|t|t|t|tL"))
    before, after = (Layout.parse(x, num_stages=3, num_chunks=chunks) for x in (before, after))
    n = before.num_layers
    kw = dict(costs=[1.0] * n, num_stages=3 * chunks, memory=[10.0] * n, move_bytes=[10.0] * n,
              current=before, allow_empty_stages=True, num_chunks=chunks)
    plain = migration_peak_memory(BalanceProblem(**kw), before, after)
    with_t = migration_peak_memory(BalanceProblem(**kw, transfer_transient_bytes=7.0), before, after)
    assert [b - a for a, b in zip(plain, with_t)] == [7.0, 7.0, 0.0]
