"""Test infrastructure: run the real launcher under torchrun and read its report."""
from __future__ import annotations

import json
import os
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


def free_port() -> int:
    with socket.socket() as s:
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


def run_torchrun(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """torchrun ARGS from ROOT with `env`, output captured: forked from this process
    (`_forked_torchrun`), or a fresh `python -m torch.distributed.run` with
    DYNMO_TEST_FORK_TORCHRUN=0."""
    if os.environ.get("DYNMO_TEST_FORK_TORCHRUN", "1") == "1" and hasattr(os, "fork"):
        return _forked_torchrun(args, env, timeout)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _forked_torchrun(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """torch's own torchrun (torch.distributed.run.main) in a fork of this process, which
    has imported torch already: a fresh `python -m torch.distributed.run` spends ~1.7 s of
    CPU importing torch before it starts any rank, on every launch of the suite. The
    workers are fresh processes as before (the agent spawns them); stdout and stderr come
    back as from subprocess.run. DYNMO_TEST_FORK_TORCHRUN=0 launches a fresh torchrun."""
    import signal
    import tempfile
    import time
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the agent: never returns into pytest
            _agent(args, env, out.fileno(), err.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGTERM)  # the agent stops its workers, as on a Ctrl-C
                time.sleep(5)
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
            time.sleep(0.05)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(["torchrun", *args], os.waitstatus_to_exitcode(status),
                                           out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def _agent(args: list[str], env: dict, out_fd: int, err_fd: int) -> None:
    """The forked child: torchrun's main with `env`, cwd ROOT, stdout/stderr to the files;
    exits with torchrun's status (1 and the traceback when a rank failed, as torchrun)."""
    import traceback
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the agent with what is left
        os.chdir(ROOT)
        os.environ.clear()
        os.environ.update(env)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # not pytest's capture
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.argv = ["torchrun", *args]
        import faulthandler
        import logging
        faulthandler.disable()  # pytest's, on its own stderr
        logging.root.handlers.clear()  # pytest's capture: the agent logs to stderr as torchrun does
        for logger in logging.Logger.manager.loggerDict.values():  # torch's handler, made at import
            for handler in getattr(logger, "handlers", []):
                if type(handler) is logging.StreamHandler:
                    handler.setStream(sys.stderr)
        from torch.distributed.run import main
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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


def in_megatron_process(check, args=None) -> None:
    """Run `check(model_args)` in ONE spawned gloo rank with Megatron's groups and the CPU
    compatibility layer — which patches torch, so it must never run inside pytest's own
    process. `check` must be a module-level function (it is pickled)."""
    import torch.multiprocessing as mp

    from dynmo_plugin.config import ModelArgs
    args = args or ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    mp.spawn(_megatron_process, args=(free_port(), check, args), nprocs=1)
