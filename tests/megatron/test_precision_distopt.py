"""Mixed precision (--bf16/--fp16) and the distributed optimizer keep live migration exact.

Each case compares a run with forced migrations against a run that never moved
anything, with the same precision and optimizer: identical losses to the last bit,
identical final weights and identical optimizer state (fp32 master weights, Adam
moments, step), as `stage_state.capture` reads them at the end, by global name
(tests/workers/state_worker.py).

The interleaved cases (pp = 2, v = 2 virtual stages per rank) share the never-moved
plain-1F1B run of the same precision (module fixtures): never-moved interleaved training
equals plain 1F1B to the last bit in bf16 and fp16 too (measured, docs/interleaved.md), so
one comparison checks the interleaved schedule in half precision and the moves, one
torchrun run per case.
"""
import argparse
from pathlib import Path

import pytest
import torch

from dynmo_plugin.config import ConfigError, add_dynmo_args, add_model_args
from dynmo_plugin.megatron.training.machine import load_run_config
from launch import SMALL_MODEL, in_megatron_process, losses, train

MODEL = SMALL_MODEL + ["--train-iters", "6", "--dynmo",
         "--pipeline-model-parallel-size", "2"]
# From Etttt|ttttL. Iteration 2: layers 5-6 go 1->0; iteration 3: layers 3-6 go 0->1.
MOVES = "2:Etttttt|ttL;3:Ett|ttttttL"
# Interleaved, virtual stage s on rank s % 2, from Ett|tt|tt|ttL = rank 0 {1,2 | 5,6},
# rank 1 {3,4 | 7,8}. Iteration 3: layer 2 goes chunk 0 -> 1 of rank 0 (local, 0 bytes),
# 3, 4 and 7 go rank 1 -> rank 0; iteration 5: 2, 3 go chunk 1 -> 0 of rank 0 (local), 4
# and 7 go rank 0 -> rank 1.
INTERLEAVED = ["--num-virtual-stages-per-pipeline-rank", "2",
               "--dynmo-forced-layouts", "3:Et||tttttt|tL;5:Ettt|t|tt|ttL"]
FP16 = ["--fp16", "--initial-loss-scale", str(2**20)]
BF16_DISTOPT = ["--bf16", "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]


def _parse(argv):
    return load_run_config(add_dynmo_args(add_model_args(argparse.ArgumentParser())).parse_args(argv))


def test_precision_flags_are_validated():
    cfg = _parse(["--fp16", "--loss-scale", "1024", "--use-distributed-optimizer"])
    assert (cfg.model.fp16, cfg.model.bf16, cfg.model.loss_scale) == (True, False, 1024.0)
    assert cfg.model.use_distributed_optimizer and cfg.model.initial_loss_scale == 2.0**32
    with pytest.raises(ConfigError, match="--bf16 and --fp16 both set; choose one precision"):
        _parse(["--bf16", "--fp16"])
    with pytest.raises(ConfigError, match="--loss-scale 8.0 needs --fp16"):
        _parse(["--bf16", "--loss-scale", "8"])
    for flags in (FP16, BF16_DISTOPT):  # interleaved pipelines take them
        cfg = _parse(MODEL + flags + INTERLEAVED)
        assert cfg.model.num_virtual_stages_per_pipeline_rank == 2


def _check_type_spelling(args):
    """The CUDA spelling of Tensor.type() reaches Megatron's optimizers only."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from dynmo_plugin.megatron.migration.optim_state import megatron_optimizers
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


@pytest.fixture(scope="module")
def fp16_static(tmp_path_factory):
    """The never-moved fp16 run (PP=2, plain 1F1B)."""
    return _run(tmp_path_factory.mktemp("fp16"), "static", 2, FP16)


@pytest.fixture(scope="module")
def bf16_distopt_static(tmp_path_factory):
    """The never-moved bf16 + distributed-optimizer run (PP=2 x DP=2, plain 1F1B)."""
    return _run(tmp_path_factory.mktemp("bf16"), "static", 4, BF16_DISTOPT)


@pytest.mark.multiproc
def test_fp16_with_loss_scaler_migrates_bit_exact(tmp_path, fp16_static):
    """Float16OptimizerWithFloat16Params: fp32 master weights move with the fp16 ones.
    The initial scale overflows in the first iterations (skipped steps, the scale backs
    off across the first migration): the scaler must be carried, not restarted."""
    static_dir, static = fp16_static
    moved_dir, moved = _run(tmp_path, "moved", 2, FP16 + ["--dynmo-forced-layouts", MOVES])
    assert [e["applied"] for e in moved["events"]] == [True, True]
    assert moved["layout"] == "Ett|ttttttL" and moved["config"]["model"]["fp16"]
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(2)), _state(moved_dir, range(2)), torch.float16)


@pytest.mark.multiproc
def test_bf16_distributed_optimizer_migrates_and_repacks_bit_exact(tmp_path, bf16_distopt_static):
    """PP=2 x DP=2, bf16, optimizer state and fp32 master weights sharded over DP: two
    migrations, then a live repack onto one stage (PP=1 x DP=2: the head handoff and the
    rebuild capture and restore the sharded state). Untied embeddings: with PP=1 the tied
    weight's two bf16 gradients are summed in bf16 by autograd, with PP=2 in fp32 by the
    embedding all-reduce, which differs without any migration (docs/precision.md)."""
    static_dir, static = bf16_distopt_static
    moved_dir, moved = _run(tmp_path, "moved", 4, BF16_DISTOPT + [
        "--dynmo-repack", "--dynmo-forced-layouts", MOVES + ";5:EttttttttL"])
    assert [e["applied"] for e in moved["events"]] == [True, True, True]
    assert moved["events"][-1]["repack"]["applied"] and moved["layout"] == "EttttttttL"
    assert moved["world"]["dp"] == 2
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(4)), _state(moved_dir, range(2)), torch.bfloat16)


def _assert_interleaved_moves(report: dict) -> None:
    """Both forced migrations applied, each with chunk-local (0 bytes) and cross-rank moves."""
    events = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert [(e["applied"], e["layout_after"]) for e in events] == [
        (True, "Et||tttttt|tL"), (True, "Ettt|t|tt|ttL")]
    sent = [{(m["layer"], m["src"], m["dst"]): m["bytes"] for m in e["migration"]["moves"]}
            for e in events]
    assert sent[0].keys() == {(2, 0, 2), (3, 1, 2), (4, 1, 2), (7, 3, 2)}
    assert sent[1].keys() == {(2, 2, 0), (3, 2, 0), (4, 2, 1), (7, 2, 3)}
    assert sent[0][(2, 0, 2)] == sent[1][(2, 2, 0)] == sent[1][(3, 2, 0)] == 0
    assert min(sent[0][(3, 1, 2)], sent[0][(7, 3, 2)], sent[1][(4, 2, 1)]) > 0
    assert report["initial_layout"] == "Ett|tt|tt|ttL"


@pytest.mark.multiproc
def test_fp16_interleaved_migrates_bit_exact(tmp_path, fp16_static):
    """fp16, pp = 2, v = 2: fp32 master weights and Adam state follow layers across ranks
    and between chunks of a rank; the loss scaler (which skipped steps and backed off
    before the first migration) carries over."""
    static_dir, static = fp16_static
    moved_dir, moved = _run(tmp_path, "il_moved", 2, FP16 + INTERLEAVED)
    _assert_interleaved_moves(moved)
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(2)), _state(moved_dir, range(2)), torch.float16)


@pytest.mark.multiproc
def test_bf16_distributed_optimizer_interleaved_migrates_bit_exact(tmp_path, bf16_distopt_static):
    """bf16 + distributed optimizer, pp = 2 x DP = 2, v = 2: one distributed optimizer over
    both chunks' DDPs; its sharded state is gathered over DP, moved and re-cut."""
    static_dir, static = bf16_distopt_static
    moved_dir, moved = _run(tmp_path, "il_moved", 4, BF16_DISTOPT + INTERLEAVED)
    _assert_interleaved_moves(moved)
    assert moved["world"]["dp"] == 2
    assert losses(static) == losses(moved)
    _assert_same_state(_state(static_dir, range(4)), _state(moved_dir, range(4)), torch.bfloat16)
