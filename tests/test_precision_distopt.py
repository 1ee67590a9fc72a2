"""Mixed precision (--bf16/--fp16) and the distributed optimizer keep live migration exact.

Each case compares a run with forced migrations against a run that never moved
anything, with the same precision and optimizer: identical losses to the last bit,
identical final weights and identical optimizer state (fp32 master weights, Adam
moments, step), as `stage_state.capture` reads them at the end, by global name
(tests/workers/state_worker.py).
"""
import argparse
from pathlib import Path

import pytest
import torch

from dynmo_plugin.config import ConfigError, add_dynmo_args, add_model_args, load_config
from launch import in_megatron_process, losses, train

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "6", "--lr", "3e-3", "--seed", "11", "--dynmo"]
# Iteration 2: layer 3 goes 1->0; iteration 3: layers 2-3 go 0->1.
MOVES = "2:Ettt|tL;3:Et|tttL"


def _parse(argv):
    return load_config(add_dynmo_args(add_model_args(argparse.ArgumentParser())).parse_args(argv))


def test_precision_flags_are_validated():
    cfg = _parse(["--fp16", "--loss-scale", "1024", "--use-distributed-optimizer"])
    assert (cfg.model.fp16, cfg.model.bf16, cfg.model.loss_scale) == (True, False, 1024.0)
    assert cfg.model.use_distributed_optimizer and cfg.model.initial_loss_scale == 2.0**32
    with pytest.raises(ConfigError, match="--bf16 and --fp16 both set; choose one precision"):
        _parse(["--bf16", "--fp16"])
    with pytest.raises(ConfigError, match="--loss-scale 8.0 needs --fp16"):
        _parse(["--bf16", "--loss-scale", "8"])


def _check_type_spelling(args):
    """The CUDA spelling of Tensor.type() reaches Megatron's optimizers only."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from dynmo_plugin.megatron.optim_state import megatron_optimizers
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float16).dtype == torch.float16
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                            params_dtype=torch.bfloat16)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  torch.nn.Linear(8, 8).bfloat16())
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, bf16=True,
                                                 params_dtype=torch.bfloat16), [ddp])
    (inner,) = megatron_optimizers(opt)
    assert inner.fp32_from_float16_groups[0][0].dtype == torch.float32


@pytest.mark.multiproc
def test_cpu_compat_spells_cuda_types_for_megatron_optimizers_only():
    in_megatron_process(_check_type_spelling)


def _state(out: Path, ranks) -> tuple[dict, dict]:
    """(weights, optimizer state) of every stage by global name, merged over `ranks`;
    copies on several ranks (DP replicas, tied embeddings) must agree to the bit."""
    tensors, optim = {}, {}
    for r in ranks:
        data = torch.load(out / f"state_rank{r}.pt", weights_only=True)
        for key, value in data["tensors"].items():
            assert torch.equal(tensors.setdefault(key, value), value), key
        for key, state in data["optim"].items():
            mine = optim.setdefault(key, state)
            assert mine.keys() == state.keys() and all(torch.equal(mine[s], state[s]) for s in state), key
    return tensors, optim


def _assert_same_state(a: tuple, b: tuple, dtype: torch.dtype) -> None:
    (ta, oa), (tb, ob) = a, b
    assert ta.keys() == tb.keys() and oa.keys() == ob.keys() and oa
    assert {v.dtype for k, v in ta.items() if k in oa} == {dtype}
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    assert {frozenset(s) for s in oa.values()} == {frozenset({"exp_avg", "exp_avg_sq", "step", "main_param"})}
    assert {s["main_param"].dtype for s in oa.values()} == {torch.float32}
    assert [(k, s) for k in oa for s in oa[k] if not torch.equal(oa[k][s], ob[k][s])] == []


def _run(tmp: Path, name: str, nproc: int, flags: list) -> tuple[Path, dict]:
    out = tmp / name
    out.mkdir()
    return out, train(nproc, MODEL + flags, out, module="workers.state_worker")


@pytest.mark.multiproc
def test_fp16_with_loss_scaler_migrates_bit_exact(tmp_path):
    """Float16OptimizerWithFloat16Params: fp32 master weights move with the fp16 ones.
    The initial scale overflows in the first iterations (skipped steps, the scale backs
    off across the first migration): the scaler must be carried, not restarted."""
    flags = ["--pipeline-model-parallel-size", "2", "--fp16", "--initial-loss-scale", str(2**20)]
    static_dir, static = _run(tmp_path, "static", 2, flags)
    moved_dir, moved = _run(tmp_path, "moved", 2, flags + ["--dynmo-forced-layouts", MOVES])
    assert [e["applied"] for e in moved["events"]] == [True, True]
    assert moved["layout"] == "Et|tttL" and moved["config"]["model"]["fp16"]
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(2)), _state(moved_dir, range(2)), torch.float16)


@pytest.mark.multiproc
def test_bf16_distributed_optimizer_migrates_and_repacks_bit_exact(tmp_path):
    """PP=2 x DP=2, bf16, optimizer state and fp32 master weights sharded over DP: two
    migrations, then a live repack onto one stage (PP=1 x DP=2: the head handoff and the
    rebuild capture and restore the sharded state). Untied embeddings: with PP=1 the tied
    weight's two bf16 gradients are summed in bf16 by autograd, with PP=2 in fp32 by the
    embedding all-reduce, which differs without any migration (docs/precision.md)."""
    flags = ["--pipeline-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer",
             "--untie-embeddings-and-output-weights"]
    static_dir, static = _run(tmp_path, "static", 4, flags)
    moved_dir, moved = _run(tmp_path, "moved", 4, flags + [
        "--dynmo-repack", "--dynmo-forced-layouts", MOVES + ";5:EttttL"])
    assert [e["applied"] for e in moved["events"]] == [True, True, True]
    assert moved["events"][-1]["repack"]["applied"] and moved["layout"] == "EttttL"
    assert moved["world"]["dp"] == 2
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(4)), _state(moved_dir, range(2)), torch.bfloat16)

