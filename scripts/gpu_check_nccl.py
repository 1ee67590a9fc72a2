#!/usr/bin/env python
"""Issue 25's one-GPU checks of the NCCL/CUDA paths, one row each (standalone; wired
into scripts/gpu_check.py as a subprocess through the JSON contract below).

    python scripts/gpu_check_nccl.py [--cpu] [--json] [--only NAME,...]

Rows (item numbers of issue 25; "world 1" = a single-process NCCL world bound to the
GPU with init_process_group(device_id=...)):
  nccl_shrink_support      (10) NCCL version; whether the world can shrink in place
                           (`supports_shrinking`); gloo must say no
  nccl_destroyed_group     (1)  a collective on a destroyed NCCL subgroup errors or hangs
                           (why a repack captures before the shrink)
  nccl_cpu_tensor          (5)  NCCL refuses a CPU tensor; the optimizer-state gather's
                           collective device is CUDA even with no managed parameter
  rebuild_distopt_bf16     (1,3,5) LayerMigrator.rebuild() at PP=1, bf16, distributed
                           optimizer: applied, training goes on, a gather over parameters
                           the optimizer does not manage works (world 1; gloo on --cpu)
  wire_checksum_peak       (4)  pack/unpack/checksum on CUDA: exact round trip, allocator
                           peak of the checksum within `checksum_transient_bytes`
                           (on --cpu: the chunked checksum equals the whole-buffer one)
  control_plane_cuda_state (2)  two processes sharing the GPU over gloo: the control plane
                           refuses a CUDA payload on both ranks ('meta' stands in on --cpu)
  sampled_addmm_bf16       (6)  probe: sampled_addmm with bf16 CSR on CUDA (fp32 must work)
  layer_streams            a layer's keyed random streams on the device: its draws (default
                           generator and Megatron's RNG tracker) the same whatever the rank
                           drew before, the rank's streams back after, no host sync
  grad_norm                the order-free gradient norm over the device's collective (NCCL):
                           float64's value, the same bits in any order and at any address
                           alignment (torch's own at both printed), empty and inf ranks;
                           sharded (distributed optimizer): one norm for three cuts
  grad_reduce              the rank-ordered data-parallel reduction on the device's
                           collective: all_to_all, adds, in-place all-gather, sync and
                           overlapped, no host sync, temporaries freed (order: CPU tests)
  determinism_bitwise      (9)  two identical PP=1 bf16 runs: losses and weights bitwise
                           equal, with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 and
                           CUBLAS_WORKSPACE_CONFIG=:4096:8 (set here for every row)
  sync_free[SCENARIO]      (7)  two PP=1 steps per scenario, host synchronisations counted
                           in every decoder layer's forward (set_sync_debug_mode "warn"):
                           none allowed, early exit one by design (SYNC_BUDGET)

--cpu hides CUDA: CUDA rows say "skipped: no CUDA", the rest runs on CPU.
--json prints exactly one JSON document {"rows": [{"check", "result", "detail",
"seconds"}]} on stdout; logs go to stderr. Exit status 1 if any row is FAIL.
The rows run in child processes (`--row NAME[,NAME...]`), all started at once, each with
a timeout (capped by --deadline-s): the rows that cannot hang or poison a process share
one (SHARED: one CUDA context, one one-rank NCCL world); a collective on a destroyed group,
the control plane's own processes, the two determinism runs and each sync_free scenario
get their own, so an NCCL hang or a poisoned CUDA context stays in its row. Estimated at
about a minute on one H100/H200 (docs/gpu.md, "Budget"); not yet run on one.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NO_CUDA = "skipped: no CUDA"
DETERMINISM_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "3e-3", "--seed", "11", "--train-iters", "4"]
SCENARIOS = {
    "none": [],
    "layer_freezing": ["--dynmo", "--dynmo-dynamism", "layer_freezing", "--dynmo-freezing-start", "1",
                       "--dynmo-freezing-interval", "1", "--dynmo-freezing-threshold", "0.3"],
    "early_exit": ["--dynmo", "--dynmo-dynamism", "early_exit", "--dynmo-early-exit-start", "1",
                   "--dynmo-early-exit-interval", "1", "--dynmo-early-exit-min-layer", "2"],
    "moe": ["--dynmo", "--dynmo-dynamism", "moe", "--dynmo-moe-num-experts", "4",
            "--dynmo-moe-top-k", "2", "--dynmo-moe-every", "2", "--dynmo-moe-start", "1",
            "--dynmo-moe-capacity-factor", "1.0"],  # padded: no host reads (unpadded: 2)
    "mixture_of_depths": ["--dynmo", "--dynmo-dynamism", "mixture_of_depths", "--dynmo-mod-every", "1",
                          "--dynmo-mod-capacity", "0.5"],
    "sparse_attention": ["--dynmo", "--dynmo-dynamism", "sparse_attention",
                         "--dynmo-sparse-attention-buckets", "2"],
    "gradual_pruning": ["--dynmo", "--dynmo-dynamism", "gradual_pruning", "--dynmo-pruning-start", "1",
                        "--dynmo-pruning-interval", "1", "--dynmo-pruning-rounds", "2",
                        "--dynmo-pruning-initial-sparsity", "0.5", "--dynmo-pruning-final-sparsity", "0.9",
                        "--dynmo-pruning-sparse-threshold", "0.6"],
    "packed_documents": ["--data-documents", "lognormal", "--micro-batch-size", "1",
                         "--global-batch-size", "2"],
}
CUDA_ROWS = {"nccl_shrink_support", "nccl_destroyed_group", "nccl_cpu_tensor",
             "sampled_addmm_bf16", "determinism_bitwise", "sync_free"}


class CheckFailed(Exception):
    """The row's verdict is FAIL; the message is its detail."""


def _log(msg: str) -> None:
    print(f"[gpu_check_nccl] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- helpers that run inside a row's child process ----------------------------------------
def _world_one(backend: str):
    """A one-rank world (env:// as torchrun sets it), NCCL bound to GPU 0."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():  # an earlier row of the same child made it
        return dist
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if backend == "nccl":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")
    return dist


def _session(flags: list[str]):
    """A real TrainingSession (one rank, PP=1) configured by launcher `flags`."""
    from dynmo_plugin.megatron.training.machine import load_run_config
    from dynmo_plugin.megatron.training.parallel import init_parallel
    from dynmo_plugin.session import TrainingSession
    from dynmo_plugin.train import build_parser
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    out = tempfile.mkdtemp(prefix="gpu_check_nccl_")
    cfg = load_run_config(build_parser().parse_args(MODEL + flags + ["--output", out]), world_size=1)
    return TrainingSession(cfg, init_parallel(cfg.model))


def _raises(fn: Callable[[], object], wait_s: float = 30.0) -> str:
    """'error: ...', 'hang' (still running after `wait_s`) or 'returned'."""
    box: dict = {}

    def call():
        try:
            fn()
            box["r"] = "returned"
        except Exception as e:  # noqa: BLE001 - the outcome is the measurement
            box["r"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(wait_s)
    return box.get("r", "hang")


# ---- rows (each returns its detail, raises CheckFailed for FAIL) ---------------------------
def row_nccl_shrink_support() -> str:
    import torch
    from dynmo_plugin.megatron.training.parallel import supports_shrinking
    dist = _world_one("nccl")
    v = torch.cuda.nccl.version()
    version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    shrinks = supports_shrinking()
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda", 0))
    if shrinks != bool(getattr(backend, "supports_shrinking", False)):
        raise CheckFailed(f"supports_shrinking()={shrinks} disagrees with the NCCL backend")
    path = "shrink_group" if shrinks else "destroy + rendezvous"
    return f"NCCL {version}; supports_shrinking={shrinks}: a repack takes the {path} path"


def row_nccl_destroyed_group() -> str:
    import torch
    dist = _world_one("nccl")
    group = dist.new_group([0])
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    dist.destroy_process_group(group)
    outcome = _raises(lambda: (dist.all_reduce(t, group=group), torch.cuda.synchronize()), 20.0)
    if outcome == "returned":
        raise CheckFailed("an all-reduce on a destroyed NCCL group worked: issue 25 item 1's "
                          "premise does not hold on this stack (the capture order is still right)")
    return f"all-reduce on a destroyed NCCL subgroup: {outcome} (a repack captures before the shrink)"


def row_nccl_cpu_tensor() -> str:
    import torch
    from dynmo_plugin.megatron.migration.optim_state import _collective_device
    dist = _world_one("nccl")
    cpu = _raises(lambda: dist.all_reduce(torch.ones(2)), 20.0)
    device = _collective_device(dist.group.WORLD, [])
    if device.type != "cuda":
        raise CheckFailed(f"the gather's collective device with no managed parameter is {device}")
    flag = torch.ones(1, dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag) != 1:
        raise CheckFailed("the agreement flag all-reduce on CUDA gave a wrong value")
    return f"CPU tensor on the NCCL group: {cpu}; gather device with nothing managed: {device}"


def row_rebuild_distopt_bf16() -> str:
    import torch
    from dynmo_plugin.megatron.migration.optim_state import gather_param_states
    session = _session(["--bf16", "--use-distributed-optimizer",
                        "--untie-embeddings-and-output-weights"])
    t = session.trainer
    before = t.train_step(1)
    result = session.migrator.rebuild()
    if not result.applied:
        raise CheckFailed(f"rebuild abandoned: {result.error}")
    after = t.train_step(2)
    if not (torch.isfinite(torch.tensor([before, after])).all()):
        raise CheckFailed(f"losses not finite after the rebuild: {before}, {after}")
    foreign = torch.nn.Parameter(torch.zeros(3, device=t.dims.device, dtype=torch.bfloat16))
    states = gather_param_states(t.optimizer, [foreign])  # nothing managed (item 5)
    if states != {foreign: {}}:
        raise CheckFailed(f"gather over an unmanaged parameter gave {states}")
    return (f"{t.dims.backend}: rebuild applied (peak {result.peak_extra_bytes / 2**20:.1f} MiB "
            f"{result.peak_source}), losses {before:.4f} -> {after:.4f}; unmanaged gather ok")


def row_wire_checksum_peak() -> str:
    import torch
    from dynmo_plugin.migration.wire import checksum, checksum_transient_bytes, pack, unpack, word_checksum
    if not torch.cuda.is_available():
        raw = torch.randint(0, 256, (4 * 300_001,), dtype=torch.uint8)
        whole = word_checksum(raw, chunk_words=raw.numel())
        if word_checksum(raw, chunk_words=4096) != whole:
            raise CheckFailed("chunked checksum differs from the whole-buffer one")
        return "CPU: chunked word checksum equals the whole-buffer formula (CUDA peak not measured)"
    dev = torch.device("cuda", 0)
    tensors = {"w": torch.randn(64 << 20, device=dev, dtype=torch.bfloat16),
               "m": torch.randn(8 << 20, device=dev)}
    header, buffers = pack(1, 0, 1, tensors, dev)
    out = unpack(header, buffers)
    if any(not torch.equal(out[k], v) for k, v in tensors.items()):
        raise CheckFailed("pack/unpack round trip is not exact on CUDA")
    buf = max(buffers, key=lambda b: b.numel() * b.element_size())
    nbytes = buf.numel() * buf.element_size()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    value = checksum(buf)
    peak = torch.cuda.max_memory_allocated() - base
    bound = checksum_transient_bytes(nbytes) + (2 << 20)  # + allocator rounding/workspace
    if value != checksum(buf.clone()):
        raise CheckFailed("checksum is not reproducible")
    if peak > bound:
        raise CheckFailed(f"checksum of {nbytes / 2**20:.0f} MiB peaked at {peak / 2**20:.1f} MiB, "
                          f"above the bound {bound / 2**20:.1f} MiB")
    return (f"round trip exact; checksum of a {nbytes / 2**20:.0f} MiB buffer peaked at "
            f"{peak / 2**20:.1f} MiB extra (bound {bound / 2**20:.1f} MiB; whole-buffer "
            f"version ~{6 * nbytes / 2**20:.0f} MiB)")


def _control_plane_rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from dynmo_plugin.consensus import ControlPlane, NonCPUPayload
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    control = ControlPlane(timeout_s=60)
    device = "cuda" if torch.cuda.is_available() else "meta"
    state = torch.ones(4, device=device)  # CUDA-resident state (meta stands in on CPU)
    verdict = {"device": device}
    try:
        control.all_gather({"state": state} if rank == 1 else {"state": None}, "cuda-payload")
        verdict["refused"] = False
    except NonCPUPayload as e:
        verdict["refused"] = str(e)
    gathered = control.all_gather({"state": state.cpu() if device == "cuda" else torch.ones(4)}, "cpu")
    verdict["cpu_ok"] = all(torch.equal(g["state"], torch.ones(4)) for g in gathered)
    Path(out, f"rank{rank}.json").write_text(json.dumps(verdict))
    dist.destroy_process_group()


def row_control_plane_cuda_state() -> str:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_control_plane_rank, args=(_free_port(), out), nprocs=2)
        verdicts = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    if not all(v["refused"] and "rank 1" in v["refused"] for v in verdicts):
        raise CheckFailed(f"a non-CPU payload was not refused on every rank: {verdicts}")
    if not all(v["cpu_ok"] for v in verdicts):
        raise CheckFailed("the same payload moved to the CPU did not travel")
    return f"{verdicts[0]['device']} payload refused on both ranks; its CPU copy travels"


def row_sampled_addmm_bf16() -> str:
    import torch
    dev = torch.device("cuda", 0)
    a, b = torch.randn(64, 32, device=dev), torch.randn(32, 48, device=dev)
    mask = (torch.rand(64, 48, device=dev) > 0.5).float().to_sparse_csr()
    fp32 = torch.sparse.sampled_addmm(mask, a, b)
    if fp32.values().numel() == 0:
        raise CheckFailed("fp32 sampled_addmm gave no values")
    bf16 = _raises(lambda: torch.sparse.sampled_addmm(mask.to(torch.bfloat16), a.bfloat16(), b.bfloat16()))
    item = "confirmed" if bf16.startswith("error") else "refuted on this torch"
    return f"fp32 works; bf16 CSR: {bf16} (issue 25 item 6 {item}; the fix is the pruning helper's)"


def row_layer_streams() -> str:
    """Each layer's own random streams on this device (megatron.training.layer_streams):
    a layer's draws from the default generator and Megatron's RNG tracker (CUDA states
    on a GPU; a no-op tracker on CPU) are the same whatever the rank drew before, the
    rank's own come back after, and seeding syncs nothing with the GPU."""
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    session = _session(["--hidden-dropout", "0.1"])
    streams, dev = session.dynmo.streams, session.trainer.dims.device
    if streams is None:
        raise CheckFailed("a run with --hidden-dropout 0.1 has no layer streams")
    session.step(1)  # hooks the layers; trains one step with dropout
    tracker = get_cuda_rng_tracker()

    def draws() -> list:
        streams.step(1)
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            kept = streams._keep()
            streams._seed(1, kept)
            drawn = [torch.rand(4, device=dev)]
            with tracker.fork():
                drawn.append(torch.rand(4, device=dev))
            streams._leave(kept)
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        return drawn

    rank_state = (torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state())
    states = tracker.get_states()
    first = draws()
    after = (torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state())
    if not torch.equal(after, rank_state):
        raise CheckFailed("the layer's forward left the rank's default generator moved")
    if any(tracker.get_states().get(n) is not v for n, v in states.items()):
        raise CheckFailed("the tracker's streams did not come back after the layer")
    torch.rand(16, device=dev)  # the rank draws elsewhere
    if not all(torch.equal(a, b) for a, b in zip(first, draws())):
        raise CheckFailed("a layer's draws depended on what the rank drew before")
    return (f"{dev.type}: draws keyed, rank streams back, no sync; tracker streams "
            f"{sorted(states) or 'none (CPU)'}")


def row_grad_norm() -> str:
    """The order-free gradient norm (megatron.training.grad_norm) on this device's
    collective (NCCL on a GPU): the float64 norm's value, the same bits for the same
    gradients in any order, a rank without gradients welcome, inf passed on."""
    import math

    import torch
    from dynmo_plugin.megatron.training.grad_norm import get_grad_norm_fp32
    dist = _world_one("nccl" if torch.cuda.is_available() else "gloo")
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    grads = [(torch.randn(n, generator=gen) * 10.0 ** k).to(dev) for n, k in ((4096, -3), (77, 2), (1 << 16, 0))]
    norm = get_grad_norm_fp32(grads, 2, dist.group.WORLD)
    again = get_grad_norm_fp32(grads[::-1], 2, dist.group.WORLD)
    exact = math.sqrt(math.fsum(float(g.double().square().sum()) for g in grads))
    if norm != again or abs(norm - exact) > 1e-6 * exact:
        raise CheckFailed(f"norm {norm!r}, reversed {again!r}, float64 {exact!r}")
    if get_grad_norm_fp32([], 2, dist.group.WORLD) != 0.0:
        raise CheckFailed("a rank without gradients did not read 0")
    if not math.isinf(get_grad_norm_fp32([*grads, torch.full((3,), math.inf, device=dev)], 2, dist.group.WORLD)):
        raise CheckFailed("an inf gradient did not give an inf norm")
    # the same values 4 bytes further (a gradient after an odd-sized one in the buffer)
    x = grads[2]
    shifted = torch.zeros(x.numel() + 1, device=dev)[1:].copy_(x)
    raw = torch.equal(torch._foreach_norm([x])[0], torch._foreach_norm([shifted])[0])
    if get_grad_norm_fp32([shifted], 2, dist.group.WORLD) != get_grad_norm_fp32([x], 2, dist.group.WORLD):
        raise CheckFailed(f"a gradient 4 bytes off its alignment gave another norm (torch's own equal: {raw})")
    from dynmo_plugin.megatron.training import grad_norm
    grad_norm.install(sharded=True)  # the distributed optimizer's shards: summed over elements
    try:
        flat = torch.cat(grads)
        cuts = [get_grad_norm_fp32(list(flat.split(n)), 2, dist.group.WORLD) for n in (flat.numel(), 999, 4097)]
    finally:
        grad_norm.uninstall()
    if len(set(cuts)) != 1 or abs(cuts[0] - exact) > 1e-12 * exact:
        raise CheckFailed(f"sharded norms {cuts!r} for three cuts of the same elements, float64 {exact!r}")
    return (f"{dev.type}: {norm:.9g} (float64 {exact:.9g}), order-free, empty and inf alike; "
            f"alignment-free (torch's own norm at another alignment equal: {raw}); sharded: one "
            f"norm for three cuts, {cuts[0]:.12g}")


def row_grad_reduce() -> str:
    """The rank-ordered data-parallel reduction (megatron.training.grad_reduce) on this
    device's collective: its all_to_all, adds and in-place all-gather on CUDA over NCCL,
    synchronous (in slices) and overlapped, without a host synchronisation, the bucket's
    values back (a one-rank world sums one term; the order itself is a CPU test's, at 3
    ranks) and the temporaries freed."""
    import torch
    from dynmo_plugin.megatron.training import grad_reduce
    dist = _world_one("nccl" if torch.cuda.is_available() else "gloo")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    bucket = torch.randn(100_003, generator=torch.Generator().manual_seed(5)).to(dev)
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    saved, grad_reduce.SLICE = grad_reduce.SLICE, 4096
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        data = bucket.clone()
        grad_reduce.all_reduce(data, dist.group.WORLD)
        pending = grad_reduce.all_reduce(data, dist.group.WORLD, async_op=True)
        pending.finish()
        grad_reduce.reduce_scatter(data, dist.group.WORLD, average=True)
    finally:
        grad_reduce.SLICE = saved
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    if not torch.equal(data, bucket):
        raise CheckFailed("a one-rank reduction changed the bucket")
    del data, pending
    left = (torch.cuda.memory_allocated(dev) - before) if cuda else 0
    if left > 0:
        raise CheckFailed(f"{left} bytes of temporaries still allocated after the reductions")
    return f"{dev.type}: sync in slices, overlapped and scatter: values back, no host sync, temporaries freed"


def _fingerprint(trainer) -> str:
    import hashlib
    h = hashlib.sha256()
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def row_determinism_run() -> str:
    """Child of `determinism_bitwise`: a short bf16 run; its losses and weights' hash."""
    session = _session(["--bf16"])
    losses = [session.trainer.train_step(i) for i in range(1, 5)]
    return json.dumps({"losses": losses, "weights": _fingerprint(session.trainer)})


# Host reads a layer forward may make by design. Early exit: a stage's first layer reads the
# bound on its active tokens from the carrier, once per micro-batch after exits begin; the
# stage's later layers wait for a staged copy instead (docs/scenarios/early_exit.md, "Host
# synchronisation"); every other scenario: none.
SYNC_BUDGET = {"early_exit": 1}
# What c10 warns at a synchronizing call in sync-debug "warn" mode. torch also warns once,
# when the mode is first set, that the mode "is a prototype feature ..." (raised by
# set_sync_debug_mode itself, torch/cuda/__init__.py): not a synchronisation. The first
# H200 run counted it as one in every scenario (../shared/notes/h200-acceptance-1.md).
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(caught: list) -> list:
    """The caught warnings that are host synchronisations (SYNC_WARNING), nothing else."""
    return [w for w in caught if SYNC_WARNING in str(w.message) and "prototype" not in str(w.message)]


def row_sync_free(scenario: str) -> str:
    """Two PP=1 steps of `scenario` with each decoder layer's forward in sync-debug 'warn'
    (torch warns "called a synchronizing CUDA operation"): the calls inside one layer
    forward are counted, and a forward with more than the scenario's budget
    (SYNC_BUDGET, else 0) fails the row naming the first offending line."""
    import warnings

    import torch
    session = _session(SCENARIOS[scenario])
    budget, worst, hooked = SYNC_BUDGET.get(scenario, 0), [0], set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def strict(*_):
            caught.clear()
            torch.cuda.set_sync_debug_mode("warn")

        def relaxed(*_):
            torch.cuda.set_sync_debug_mode("default")
            syncs = host_syncs(caught)
            worst[0] = max(worst[0], len(syncs))
            if len(syncs) > budget:
                raise RuntimeError(f"{len(syncs)} host synchronisation(s) in one layer forward "
                                   f"(budget {budget}); first at {syncs[0].filename}:{syncs[0].lineno}")
        for it in (1, 2):
            for layer in session.trainer.layers:  # scenarios may replace layers between steps
                if id(layer) not in hooked:
                    layer.register_forward_pre_hook(strict)
                    layer.register_forward_hook(relaxed)
                    hooked.add(id(layer))
            try:
                session.step(it)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return (f"{scenario}: 2 steps, {len(hooked)} layer(s); at most {worst[0]} host sync(s) in "
            f"one layer forward (budget {budget})")


ROWS: dict[str, Callable[[], str]] = {
    "nccl_shrink_support": row_nccl_shrink_support,
    "nccl_destroyed_group": row_nccl_destroyed_group,
    "nccl_cpu_tensor": row_nccl_cpu_tensor,
    "rebuild_distopt_bf16": row_rebuild_distopt_bf16,
    "wire_checksum_peak": row_wire_checksum_peak,
    "control_plane_cuda_state": row_control_plane_cuda_state,
    "sampled_addmm_bf16": row_sampled_addmm_bf16,
    "layer_streams": row_layer_streams,
    "grad_norm": row_grad_norm,
    "grad_reduce": row_grad_reduce,
}


# ---- the parent: children in parallel, rows that can share one process in one --------------
# One child runs these one after another (one CUDA context, one one-rank NCCL world): none
# can hang or poison its process. A collective on a destroyed group can (it runs alone),
# the control plane starts processes of its own (alone too), and the determinism and
# sync rows need fresh processes (two identical runs; one session per scenario), and so
# does the layer streams' session (a second session in one process cannot start).
# In this order: the rows that matter most first, the bf16 CSR probe (an op that may fail
# on CUDA) last.
SHARED = ("wire_checksum_peak", "rebuild_distopt_bf16", "nccl_shrink_support", "nccl_cpu_tensor",
          "grad_norm", "grad_reduce", "sampled_addmm_bf16")
ALONE = ("nccl_destroyed_group", "control_plane_cuda_state", "layer_streams")
ROW_TIMEOUT_S, SHARED_TIMEOUT_S = 120.0, 240.0
_START = time.perf_counter()


def row_names() -> list[str]:
    """Every row this script reports, in its order (gpu_check.py plans them)."""
    return [*ROWS, "determinism_bitwise", *(f"sync_free[{s}]" for s in SCENARIOS)]


def _child(args: list[str], env: dict) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _collect(names: list[str], proc: subprocess.Popen, start: float, timeout_s: float) -> list[dict]:
    """One row per name from the child's JSON lines; a name without its line is a FAIL
    that says why (the child hung in it, or in an earlier row of the same child, or died)."""
    hung = False
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        hung = True
    sys.stderr.write(err[-4000:] if proc.returncode or hung else "")
    got = {r["check"]: r for r in (json.loads(x) for x in out.splitlines() if x.startswith("{"))}
    tail = (err.strip().splitlines() or ["no output"])[-1][:300]
    rows, first_missing = [], None
    for name in names:
        if name in got:
            rows.append({"seconds": round(time.perf_counter() - start, 1), **got[name], "check": name})
            continue
        if first_missing is None:
            first_missing = name
            why = f"no end after {timeout_s:.0f} s (a hang?)" if hung else f"exit {proc.returncode}: {tail}"
        else:
            why = f"not run: its shared process ended in {first_missing}"
        rows.append(_row(name, "FAIL", why, start))
    return rows


def _row(check: str, result: str, detail: str, start: float) -> dict:
    return {"check": check, "result": result, "detail": detail,
            "seconds": round(time.perf_counter() - start, 1)}


def run_rows(cuda: bool, env: dict, deadline_s: float = math.inf, only=None) -> list[dict]:
    """Every row (`only`: those named, of `row_names()`); all children start at once (small
    models share the GPU) and each has a timeout, capped at `deadline_s` from now."""
    start = time.perf_counter()
    limit = lambda t: min(t, deadline_s)  # noqa: E731 - one line, used below only
    wanted = lambda n: only is None or n in only  # noqa: E731
    skipped = [_row(n, NO_CUDA, "", start) for n in ROWS if n in CUDA_ROWS and not cuda and wanted(n)]
    if not cuda:
        skipped += [_row(f"sync_free[{s}]", NO_CUDA, "", start) for s in SCENARIOS if wanted(f"sync_free[{s}]")]
    shared = [n for n in SHARED if (cuda or n not in CUDA_ROWS) and wanted(n)]
    alone = [n for n in ALONE if (cuda or n not in CUDA_ROWS) and wanted(n)]
    jobs = [([",".join(shared)], shared, limit(SHARED_TIMEOUT_S))] if shared else []
    jobs += [([n], [n], limit(ROW_TIMEOUT_S)) for n in alone]
    if cuda and wanted("determinism_bitwise"):
        jobs += [(["determinism_run", "--scenario", str(i)], [f"determinism_run_{i}"], limit(150.0))
                 for i in range(2)]
    if cuda:
        jobs += [(["sync_free", "--scenario", s], [f"sync_free[{s}]"], limit(150.0))
                 for s in SCENARIOS if wanted(f"sync_free[{s}]")]
    procs = [(names, _child(["--row", *args], env), timeout) for args, names, timeout in jobs]
    _log(f"{len(procs)} child processes: {', '.join(n for names, _, _ in procs for n in names)}")
    rows = skipped + [r for names, p, t in procs for r in _collect(names, p, start, t)]
    if wanted("determinism_bitwise"):
        rows = _determinism(cuda, rows, start) + [r for r in rows if not r["check"].startswith("determinism_run")]
    order = {n: i for i, n in enumerate(row_names())}
    return sorted(rows, key=lambda r: order.get(r["check"], len(order)))


def _determinism(cuda: bool, rows: list[dict], start: float) -> list[dict]:
    """The row from the two runs' rows (their details hold losses and a weights hash)."""
    if not cuda:
        return [{**_row("determinism_bitwise", NO_CUDA, "", start), "seconds": 0.0}]
    runs = [r for r in rows if r["check"].startswith("determinism_run")]
    if any(r["result"] != "pass" for r in runs):
        return [_row("determinism_bitwise", "FAIL", "; ".join(r["detail"] for r in runs), start)]
    a, b = (json.loads(r["detail"]) for r in runs)
    if a != b:
        return [_row("determinism_bitwise", "FAIL", f"runs differ: losses {a['losses']} vs "
                     f"{b['losses']}, weights equal: {a['weights'] == b['weights']}", start)]
    return [_row("determinism_bitwise", "pass", f"2 runs x 4 bf16 steps bitwise equal "
                 f"(losses and weights) with {DETERMINISM_ENV}", start)]


def _run_one(names: str, scenario: str) -> int:
    """Child mode: run the rows (comma-separated) one after another, each printed as one
    JSON line as soon as it ends."""
    last = _START
    for name in names.split(","):
        try:
            if name == "sync_free":
                detail, check = row_sync_free(scenario), f"sync_free[{scenario}]"
            elif name == "determinism_run":
                detail, check = row_determinism_run(), f"determinism_run_{scenario}"
            else:
                detail, check = ROWS[name](), name
            result = "pass"
        except CheckFailed as e:
            result, detail, check = "FAIL", str(e), name
        except Exception as e:  # noqa: BLE001 - a crash is this row's FAIL, with its line
            result, check = "FAIL", name
            detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        check = {"sync_free": f"sync_free[{scenario}]",
                 "determinism_run": f"determinism_run_{scenario}"}.get(name, check)
        now = time.perf_counter()
        print(json.dumps({"check": check, "result": result, "detail": detail,
                          "seconds": round(now - last, 1)}), flush=True)
        last = now
    os._exit(0)  # skip teardown of half-broken NCCL state (a destroyed group's hang)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="hide CUDA; run what runs on CPU")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--deadline-s", type=float, default=math.inf,
                        help="cap every child's timeout at this many seconds from the start")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help="run only these rows (names as the JSON gives them)")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        return _run_one(args.row, args.scenario)
    env = {**os.environ, **DETERMINISM_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cuda = not args.cpu and _cuda_visible()
    only = None
    if args.only:
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(only - set(row_names()))
        if unknown:
            parser.error(f"--only: no row {', '.join(unknown)} (rows: {', '.join(row_names())})")
    rows = run_rows(cuda, env, args.deadline_s, only)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        width = max(len(r["check"]) for r in rows)
        for r in rows:
            print(f"{r['check']:<{width}}  {r['result']:<16} {r['seconds']:>6.1f} s  {r['detail']}")
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


def _cuda_visible() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
