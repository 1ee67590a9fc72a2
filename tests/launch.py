"""Test infrastructure: run the real launcher under torchrun and read its report."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The small GPT most multi-process tests train (8 layers, hidden 32): one place for its flags.
SMALL_MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--lr", "3e-3", "--seed", "11"]
# The 4-stage never-moved run that migration, repack and reliability tests compare against
# (launched once per test session by conftest.py's `pp4_static`).
PP4_STATIC = SMALL_MODEL + ["--train-iters", "6", "--dynmo", "--test-dump-params",
                            "--pipeline-model-parallel-size", "4"]


# Ports handed to torchrun stores come from below the kernel's ephemeral range (32768-60999
# here): port 0 picks from that range, where every outgoing connection (gloo's, other
# sessions') also takes its local port, so a port found free was taken before torchrun bound
# it (CI run of 2026-11-28: EADDRINUSE in a day-one test). Below it only another free_port()
# drawing the same random port can collide.
_PORTS = range(20000, 32768)
_RANDOM = random.SystemRandom()


def free_port() -> int:
    """A port nobody listens on now, drawn at random below the ephemeral range."""
    for _ in range(100):
        port = _RANDOM.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, flags: list[str], output: Path, timeout: int = 300,
             check: bool = True, module: str = "dynmo_plugin.train") -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m MODULE FLAGS --output OUTPUT` (MODULE: the launcher,
    or the test worker `workers.train_worker` that adds test-only switches)."""
    args = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), "-m", module, *flags, "--output", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = run_torchrun(args, env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


# The zygote (tests/zygote.py) that forks torchrun agents and, through its fork server,
# their workers; conftest.py starts it when the session starts. None: every launch is a
# fresh `python -m torch.distributed.run`.
ZYGOTE = None
# The last line torchrun's agent prints when its store could not bind the port it was given.
PORT_TAKEN = "The server socket has failed to listen on any local network address"
PORT_TRIES = 3


def run_torchrun(args: list[str], env: dict, timeout: float, cwd: Path = ROOT,
                 fresh: bool = False) -> subprocess.CompletedProcess:
    """torchrun ARGS from `cwd` with `env`, output captured: forked by the zygote, or a
    fresh `python -m torch.distributed.run` (`fresh`: the documented command as a user
    types it; no zygote; or DYNMO_TEST_FORK_TORCHRUN=0; the zygote runs from ROOT).
    free_port() closes the port it found before torchrun binds it, so another process can
    take it in between: a launch whose store could not bind its --master-port (no worker
    has started then) is relaunched on a new port, the reason printed to stderr."""
    proc = _run_torchrun_once(args, env, timeout, cwd, fresh)
    for attempt in range(2, PORT_TRIES + 1):
        if not port_taken(proc) or "--master-port" not in args:
            break
        at = args.index("--master-port") + 1
        port, args = args[at], [*args[:at], str(free_port()), *args[at + 1:]]
        print(f"tests/launch.py: torchrun's store could not bind port {port} (EADDRINUSE: taken "
              f"since free_port() found it); relaunching on port {args[at]} (try {attempt} of "
              f"{PORT_TRIES})", file=sys.stderr, flush=True)
        proc = _run_torchrun_once(args, env, timeout, cwd, fresh)
    return proc


def port_taken(proc: subprocess.CompletedProcess) -> bool:
    """Did the launch fail because its store's port was taken (and so before any worker)?"""
    last = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    return proc.returncode != 0 and bool(last) and PORT_TAKEN in last[0] and "EADDRINUSE" in last[0]


def _run_torchrun_once(args: list[str], env: dict, timeout: float, cwd: Path = ROOT,
                       fresh: bool = False) -> subprocess.CompletedProcess:
    if ZYGOTE is not None and not fresh and Path(cwd) == ROOT:
        return ZYGOTE.run(args, env, timeout)
    return run_group([sys.executable, "-m", "torch.distributed.run", *args], cwd, env, timeout)


def run_group(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run of a torchrun that, on timeout, stops its workers before it goes:
    SIGTERM first (torchrun's agent stops its workers, each in a session of its own, as
    on a Ctrl-C), SIGKILL to its group after 15 s. subprocess.run's SIGKILL to torchrun
    alone left the workers running without it (an orphaned 2-rank run went on for
    minutes and made other tests time out)."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_zygote() -> None:
    """Fork the zygote now (before any test has run), unless DYNMO_TEST_FORK_TORCHRUN=0."""
    global ZYGOTE
    if os.environ.get("DYNMO_TEST_FORK_TORCHRUN", "1") == "1" and hasattr(os, "fork"):
        from zygote import Zygote
        ZYGOTE = Zygote()


def worker(nproc: int, flags: list[str], output: Path, **kw) -> dict:
    """Run the test worker; returns rank 0's report."""
    return train(nproc, flags, output, module="workers.train_worker", **kw)


def train(nproc: int, flags: list[str], output: Path, **kw) -> dict:
    torchrun(nproc, flags, output, **kw)
    return json.loads((output / "report.json").read_text())


def run_key(nproc: int, flags: list[str], module: str) -> tuple:
    """What identifies a run for sharing: the rank count, the module and the flags as a
    set of (option, values) - so two modules that list the same flags in another order
    share one run. A repeated option keeps the literal order (the last one wins there)."""
    pairs: list[tuple] = []
    for token in flags:
        if token.startswith("--") or not pairs:
            pairs.append((token,))
        else:
            pairs[-1] += (token,)
    options = [p[0] for p in pairs]
    if len(set(options)) != len(options):
        return nproc, module, tuple(flags)
    return nproc, module, tuple(sorted(pairs))


def losses(report: dict) -> list[float]:
    return [it["loss"] for it in report["iterations"]]


def load_params(path: Path, ranks) -> dict:
    """Global-named parameters dumped by the test worker (`--test-dump-params`) on `ranks`,
    merged; copies held by several ranks (tied embeddings, DP replicas) must agree exactly."""
    import torch
    merged: dict = {}
    for r in ranks:
        for name, value in torch.load(path / f"params_rank{r}.pt").items():
            merged.setdefault(name, value)
            assert torch.equal(merged[name], value), name
    return merged


def assert_same_training(a_dir: Path, a: dict, b_dir: Path, b: dict, ranks) -> dict:
    """Identical losses (to the last bit) and identical final parameters; returns run a's
    parameters for further checks."""
    import torch
    assert losses(a) == losses(b)
    pa, pb = load_params(a_dir, ranks), load_params(b_dir, ranks)
    assert pa.keys() == pb.keys()
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []
    return pa


def _megatron_process(rank: int, port: int, check, args) -> None:
    import torch.distributed as dist

    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dims = init_parallel(args)
    try:
        check(args)
    finally:
        if dist.is_initialized():
            destroy_parallel()
        del dims


def spawn(fn, args: tuple = (), nprocs: int = 1, timeout: int = 600) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` for the tests: `fn(rank, *args)` in
    `nprocs` processes (`fn` module-level: it is pickled), as the ranks of a torchrun of
    tests/workers/spawn_worker.py forked by the zygote, their imports done (a spawned
    interpreter spent ~3-5 s of CPU importing torch and Megatron-Core, ~5-10 s on the
    loaded CI machine, per process); without the zygote (DYNMO_TEST_FORK_TORCHRUN=0),
    spawned. A rank that raises fails the launch: AssertionError with its traceback."""
    if ZYGOTE is None:
        import torch.multiprocessing as mp
        mp.spawn(fn, args=args, nprocs=nprocs)
        return
    import pickle
    import tempfile
    tests = str(ROOT / "tests")
    paths = [p for p in sys.path if p == tests or p.startswith(tests + os.sep)]  # pytest's rootdirs
    with tempfile.TemporaryDirectory(prefix="dynmo-spawn-") as folder:
        job = Path(folder) / "job.pkl"
        job.write_bytes(pickle.dumps((paths, pickle.dumps((fn, args)))))
        torchrun(nprocs, [str(job)], Path(folder), timeout=timeout, module="workers.spawn_worker")


def in_megatron_process(check, args=None) -> None:
    """Run `check(model_args)` in ONE gloo rank of its own (`spawn`) with Megatron's groups
    and the CPU compatibility layer — which patches torch, so it must never run inside
    pytest's own process. `check` must be a module-level function (it is pickled)."""
    from dynmo_plugin.config import ModelArgs
    args = args or ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        try:
            return spawn(_megatron_process, (port, check, args))
        except AssertionError as e:  # the rank's process-group port, taken since free_port()
            if "EADDRINUSE" not in str(e) or attempt == PORT_TRIES:  # found it (CI run 60)
                raise
            print(f"tests/launch.py: the rank's process group could not bind port {port} "
                  f"(EADDRINUSE); relaunching on another (try {attempt + 1} of {PORT_TRIES})",
                  file=sys.stderr, flush=True)
