"""The CPU harness around Megatron-LM's own train(), and what its tests share.

Megatron-LM's `megatron.training` is not on PyPI: the tests read the root of a
Megatron-LM checkout at tag core_v0.16.1 from $DYNMO_MEGATRON_LM and skip without it (its
imports also need six, regex and triton; `SKIP_REASON`). On CPU they run Megatron-LM's
real parse_args, setup_model_and_optimizer (model from pretrain_gpt.py's model_provider),
mock-data iterators, forward_step and train() loop — only pretrain()'s CUDA-only start-up
(initialize_megatron's CUDA assert, torch.distributed/MPU set-up, CUDA streams) is
replaced by `harness()`, run as `python tests/integrations/megatron_lm_harness.py` under
torchrun (`train_in_megatron_lm`). Its tests: test_megatron_lm.py and test_megatron_lm_mtp.py; the CPU
rows of scripts/gpu_checks use the same harness. No pytest here: scripts import it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
from pathlib import Path

from dynmo_plugin.integrations import megatron_lm as ml

SOURCE = os.environ.get(ml.SOURCE_ENV)
_MISSING = [m for m in ("six", "regex", "triton", "tensorboard") if importlib.util.find_spec(m) is None]
# why the tests that need the source skip here; None: they run
SKIP_REASON = (
    f"{ml.SOURCE_ENV} is unset: point it at a Megatron-LM checkout at tag "
    f"{ml.SUPPORTED_TAG} (megatron.training is not on PyPI)" if not SOURCE else
    f"Megatron-LM's imports (and the writer checks) need {', '.join(_MISSING)}: pip install -e .[megatron_lm]"
    if _MISSING else None)

# A small GPT that Megatron-LM builds without Transformer Engine or Apex, on CPU.
MODEL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--clip-grad", "0", "--eval-iters", "0",
    "--eval-interval", "1000", "--rerun-mode", "disabled", "--log-interval", "1", "--seed", "7",
    # no DataLoader workers: they would be forked from a rank already running gloo's threads
    "--num-workers", "0"]


def megatron_like(**overrides) -> argparse.Namespace:
    """Megatron-LM-shaped args with the plugin's flags (`argv`) and the attributes the plugin
    reads, without Megatron-LM's parse_args: the pure tests' input."""
    parser = ml.add_args(argparse.ArgumentParser())
    args = parser.parse_args(overrides.pop("argv", []))
    base = dict(num_layers=4, pipeline_model_parallel_size=2, tensor_model_parallel_size=1,
                hidden_size=64, num_attention_heads=4, micro_batch_size=2, global_batch_size=8,
                save=None, train_iters=10, pipeline_model_parallel_layout=None,
                virtual_pipeline_model_parallel_size=None, use_distributed_optimizer=False,
                optimizer="adam")
    for k, v in {**base, **overrides}.items():
        setattr(args, k, v)
    return args


def train_in_megatron_lm(tmp: Path, extra: list[str], ranks: int = 2,
                         length: tuple[str, ...] = ("--train-iters", "6")) -> tuple[dict, dict]:
    """torchrun of this file (the harness below) as launch.torchrun does it, 6 iterations
    (or `length`): torch's launcher forked by tests/zygote.py (DYNMO_TEST_FORK_TORCHRUN=0: a
    fresh one)."""
    from launch import ROOT, free_port, run_torchrun
    out = tmp / "out"
    args = ["--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            __file__, *MODEL_FLAGS, *length, "--pipeline-model-parallel-size", "2",
            "--dynmo-output", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DYNMO_TEST_LOSSES": str(tmp),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = run_torchrun(args, env, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads((out / "report.json").read_text())
    return report, json.loads((tmp / "losses.json").read_text())


def check_forced_move(report: dict, after: str, num_layers: int) -> None:
    """Layer 2 moved from stage 0 to 1 at iteration 4, and the profiles (2, 4, 6) timed
    every layer where it was: first on the uniform split (2 layers per stage, virtual
    stages included), then with layer 2 on stage 1."""
    events = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert [(e["iteration"], e["applied"], e["layout_after"]) for e in events] == [(4, True, after)]
    assert [(m["layer"], m["src"], m["dst"]) for m in events[0]["moves"]] == [(2, 0, 1)]
    assert report["layout"] == after
    profiles = [e for e in report["events"] if e["kind"] == "profile"]
    assert [e["iteration"] for e in profiles] == [2, 4, 6]
    before = [(n, (n - 1) // 2) for n in range(1, num_layers + 1)]
    moved = [(n, 1 if n == 2 else s) for n, s in before]
    stages = [[(x["layer"], x["stage"]) for x in e["profile"]["layers"]] for e in profiles]
    assert stages == [before, moved, moved]


# ---- the harness torchrun runs ------------------------------------------------------------------
def _cpu_streams() -> None:
    """get_model wraps DDP construction in CUDA streams; on CPU they are no-ops."""
    import torch

    class _Stream:
        def wait_stream(self, other):
            pass
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    # Megatron-LM's checkpoints save and restore the CUDA generator's state next to the CPU one's
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None


def _cpu_device_arch() -> None:
    """validate_args reads the GPU's architecture when TP > 1 (what CUDA_DEVICE_MAX_CONNECTIONS
    must be): on CPU the harness answers Hopper's (9), and the env sets it to 1 as Megatron-LM
    asks there."""
    import megatron.training.arguments as arguments
    arguments.get_device_arch_version = lambda: 9


def _gloo_interleaved_p2p(config) -> None:
    """Interleaved 1F1B on 2 pipeline ranks over gloo: Megatron-LM sets batch_p2p_comm =
    not overlap_p2p_comm, and both choices break on gloo here (the batched exchange pairs
    the activation and gradient sent to the one peer by posting order, swapping them; the
    overlapped one gave NaN losses that changed from run to run). Megatron's unbatched,
    non-overlapped path (what the launcher uses, dynmo_plugin/megatron/training/model.py) is exact."""
    config.batch_p2p_comm = config.overlap_p2p_comm = False


def _record_losses(mtt, folder: str) -> None:
    """Every iteration's loss as Megatron-LM's train_step returns it (last stage), exact;
    beside it, the gradient norm it returns (grad_norms.json: None without --clip-grad)."""
    inner, losses, norms = mtt.train_step, [], []

    def train_step(*a, **kw):
        result = inner(*a, **kw)
        if "lm loss" in result[0]:
            losses.append(float(result[0]["lm loss"]))
            norms.append(result[5])
            Path(folder, "losses.json").write_text(json.dumps(losses))
            Path(folder, "grad_norms.json").write_text(json.dumps(norms))
        return result
    mtt.train_step = train_step


def harness() -> None:
    """pretrain() without its CUDA-only start-up: Megatron-LM's parse/validate (through
    the hooked initialize_megatron), gloo and MPU groups, the CPU compatibility layer,
    then Megatron-LM's setup_model_and_optimizer, data iterators and train()."""
    from functools import partial

    import torch
    import torch.distributed as dist
    ml.use_source(SOURCE)
    ml.enable()
    import megatron.training.training as mtt
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    _cpu_device_arch()
    mtt.initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    args = get_args()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(  # as initialize_megatron's _initialize_distributed
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size, context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp")
    from dynmo_plugin.megatron.training import cpu_compat
    cpu_compat.apply()
    _cpu_streams()
    torch.set_num_threads(1)
    from megatron.training.initialize import _set_random_seed
    _set_random_seed(args.seed, args.data_parallel_random_init)  # as finish_mpu_init does
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    _record_losses(mtt, os.environ["DYNMO_TEST_LOSSES"])
    import runpy
    pretrain_gpt = runpy.run_path(os.path.join(SOURCE, "pretrain_gpt.py"), run_name="pretrain_gpt")
    from gpt_builders import gpt_builder
    from model_provider import model_provider
    model, optimizer, scheduler = mtt.setup_model_and_optimizer(
        partial(model_provider, gpt_builder), ModelType.encoder_or_decoder)
    if args.virtual_pipeline_model_parallel_size is not None:
        _gloo_interleaved_p2p(get_model_config(model[0]))
    provider = pretrain_gpt["train_valid_test_datasets_provider"]
    provider.is_distributed = True
    if args.virtual_pipeline_model_parallel_size is None:
        train_iter, valid_iter, _ = mtt.build_train_valid_test_data_iterators(provider)
    else:  # one iterator per model chunk, as pretrain() builds them
        train_iter, valid_iter = [], []
        for vp_stage in range(len(model)):
            chunk_provider = partial(provider, vp_stage=vp_stage)
            chunk_provider.is_distributed = True
            iterators = mtt.build_train_valid_test_data_iterators(chunk_provider)
            train_iter.append(iterators[0])
            valid_iter.append(iterators[1])
    config = get_model_config(model[0])
    mtt.train(pretrain_gpt["forward_step"], model, optimizer, scheduler, train_iter, valid_iter,
              None, config, {}, None)
    _record_sync_bindings(config, model, os.environ["DYNMO_TEST_LOSSES"])
    _record_params(model, os.environ["DYNMO_TEST_LOSSES"])
    dist.destroy_process_group()


def _record_params(model: list, folder: str) -> None:
    """The parameters of the chunks train() holds at its end, by global name (decoder
    layers by global number; `@tp<rank>` under tensor parallelism, whose ranks hold other
    shards), one file per rank (`params_rank<rank>.pt`, read by launch.load_params): a
    state fingerprint, since equal losses can hide parameters that already differ."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training.utils import unwrap_model

    from dynmo_plugin.megatron.training.model import global_named_parameters
    tp = parallel_state.get_tensor_model_parallel_world_size()
    suffix = f"@tp{parallel_state.get_tensor_model_parallel_rank()}" if tp > 1 else ""
    params = {f"{name}{suffix}": p.detach().clone() for chunk in unwrap_model(model)
              for name, p in global_named_parameters(chunk)}
    torch.save(params, Path(folder, f"params_rank{dist.get_rank()}.pt"))


def _record_sync_bindings(config, model: list, folder: str) -> None:
    """Which of train()'s DDP-bound sync functions (--overlap-grad-reduce) are bound to
    the chunks train() holds at its end (after any migration): a function bound to a
    replaced chunk still runs, on buffers nothing reads, so no loss would show it. One
    file per rank (`sync_bindings_<rank>.json`)."""
    def bound(funcs) -> bool | None:
        if funcs is None:
            return None
        funcs = funcs if isinstance(funcs, list) else [funcs]
        return len(funcs) == len(model) and all(f.__self__ is m for f, m in zip(funcs, model))
    import torch.distributed as dist
    Path(folder, f"sync_bindings_{dist.get_rank()}.json").write_text(json.dumps(
        {"no_sync": bound(config.no_sync_func), "grad_sync": bound(config.grad_sync_func)}))


if __name__ == "__main__":
    harness()
