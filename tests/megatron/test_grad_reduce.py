"""Data-parallel gradients reduced in rank order (`megatron.training.grad_reduce`): an
element's reduced value does not depend on where it sits in its bucket. gloo's ring
all-reduce sums an element in an order set by its offset, so at DP 3 a move changed the
reduced gradients: the launcher at PP 2 x DP 3, layer 4 moved at iteration 3, read
5.509746075 against 5.509746154 at iteration 4 (docs/megatron-lm.md, "What a move
changes")."""
from __future__ import annotations

import json
import os

import pytest
import torch
from launch import assert_same_training, free_port, spawn, worker

pytestmark = pytest.mark.multiproc

WORLD = 3
OFFSETS = (0, 5, 333)  # where the same values sit in the bucket


def _values(rank: int, n: int = 1001) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g).float()


def _in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from dynmo_plugin.megatron.training import grad_reduce
    group, x = dist.group.WORLD, _values(rank)
    expected = _in_order([_values(r) for r in range(WORLD)])
    seen: dict = {"ordered": [], "gloo": []}
    for offset in OFFSETS:
        for async_op, slice_ in ((False, grad_reduce.SLICE), (False, 7), (True, grad_reduce.SLICE)):
            grad_reduce.SLICE, saved = slice_, grad_reduce.SLICE
            bucket = torch.cat([torch.zeros(offset), x])
            pending = grad_reduce.all_reduce(bucket, group, async_op=async_op)
            if pending is not None:
                pending.finish()
                pending.finish()  # idempotent: no second gather
            grad_reduce.SLICE = saved
            seen["ordered"].append(int((bucket[offset:] != expected).sum()))
        bucket = torch.cat([torch.zeros(offset), x])
        dist.all_reduce(bucket, group=group)
        seen["gloo"].append(int((bucket[offset:] != expected).sum()))
    n = 300 * WORLD  # reduce-scatter: this rank's chunk summed, the others untouched
    y, chunk = _values(rank, n), slice(rank * 300, (rank + 1) * 300)
    total = _in_order([_values(r, n) for r in range(WORLD)])
    shard = y.clone()
    grad_reduce.reduce_scatter(shard, group)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[chunk] = False
    seen["scatter"] = [bool(torch.equal(shard[chunk], total[chunk])),
                       bool(torch.equal(shard[untouched], y[untouched]))]
    mean = y.clone()
    grad_reduce.all_reduce(mean, group, average=True)
    seen["average"] = bool(torch.equal(mean, total / WORLD))
    tiny = x[:2].clone()  # fewer elements than ranks: the tail alone, overlapped
    grad_reduce.all_reduce(tiny, group, async_op=True).finish()
    seen["tiny"] = bool(torch.equal(tiny, expected[:2]))
    shard = y.clone()
    grad_reduce.reduce_scatter(shard, group, async_op=True).finish()
    seen["scatter overlapped"] = bool(torch.equal(shard[chunk], total[chunk]))
    try:
        grad_reduce.reduce_scatter(torch.zeros(n + 1), group)
    except ValueError as e:
        seen["uneven"] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_an_element_reduces_to_the_same_bits_wherever_it_sits_in_the_bucket(tmp_path):
    """Three gloo ranks all-reduce the same values at offsets 0, 5 and 333 of a bucket of
    1001 + offset elements (not a multiple of 3: a tail): synchronously, in slices of 7
    elements per rank and asynchronously, always exactly the rank-ordered sum, while gloo's
    own all-reduce gives other bits at some offset (the values are ones where order
    shows). reduce_scatter sums only the rank's own chunk and leaves the rest; average
    divides the ordered sum; a bucket of fewer elements than ranks (the tail alone) and an
    overlapped reduce-scatter too; a bucket that does not split evenly is refused."""
    spawn(_rank, (free_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for seen in ranks:
        assert seen["ordered"] == [0] * 3 * len(OFFSETS), seen
        assert any(seen["gloo"]), seen
        assert seen["scatter"] == [True, True] and seen["average"] is True, seen
        assert seen["tiny"] is True and seen["scatter overlapped"] is True, seen
        assert "do not split over 3 ranks" in seen["uneven"], seen


def _tensor_rank(rank: int, port: int, out: str) -> None:
    """Megatron's own `_allreduce_non_tensor_model_parallel_grads` over a 3-rank tensor
    group, through the installed swap: a module whose q/k layernorm gradients it sums and
    one whose gradient it averages (average_gradients_across_tp_domain)."""
    import importlib
    from types import SimpleNamespace

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from dynmo_plugin.megatron.training import grad_reduce
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    native = dist.all_reduce
    chunk = torch.nn.Module()  # a model chunk as Megatron's function reads it
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    chunk.q_layernorm = torch.nn.LayerNorm(333)
    chunk.router = torch.nn.Linear(5, 7, bias=False)
    chunk.router.weight.average_gradients_across_tp_domain = True
    for offset, (name, p) in enumerate(chunk.named_parameters()):
        p.main_grad = _values(rank + 10 * offset, p.numel()).view_as(p)
    config = SimpleNamespace(sequence_parallel=False, qk_layernorm=True)
    grad_reduce.install()
    seen = {}
    finalize._allreduce_non_tensor_model_parallel_grads([chunk], config, dist.group.WORLD)
    for offset, (name, p) in enumerate(chunk.named_parameters()):
        total = _in_order([_values(r + 10 * offset, p.numel()) for r in range(WORLD)])
        want = total / WORLD if name == "router.weight" else total
        seen[name] = bool(torch.equal(p.main_grad.view(-1), want))
    seen["restored"] = dist.all_reduce is native

    def broken(*a, **k):
        raise RuntimeError("a fault inside Megatron's function")
    grad_reduce._originals["_allreduce_non_tensor_model_parallel_grads"], saved = (
        broken, grad_reduce._originals["_allreduce_non_tensor_model_parallel_grads"])
    try:
        grad_reduce._non_tensor_parallel_grads([chunk], config, dist.group.WORLD)
    except RuntimeError:
        seen["restored after a fault"] = dist.all_reduce is native
    grad_reduce._originals["_allreduce_non_tensor_model_parallel_grads"] = saved
    grad_reduce.uninstall()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_the_tensor_group_s_flattened_gradients_reduce_in_rank_order(tmp_path):
    """Megatron's function that all-reduces the stage's flattened norm gradients over the
    tensor group, installed over 3 gloo ranks: the q/k layernorm's weight and bias come
    out as the rank-ordered sums, a gradient Megatron averages (AVG) as their mean, and
    torch's all_reduce is back after the call, after a fault inside it too."""
    spawn(_tensor_rank, (free_port(), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == {"q_layernorm.weight": True, "q_layernorm.bias": True, "router.weight": True,
                        "restored": True, "restored after a fault": True}, seen


def _expert_bias_rank(rank: int, port: int, out: str) -> None:
    """Megatron's `_update_router_expert_bias` over 3 data-parallel ranks, the layer under
    test at each of 4 places in the stage's stack; its counts' exact totals are equal
    (2^25 + 3 for both experts), so the bias must not move, but their float32 sum is
    2^25 or 2^25 + 4 by the order of the additions."""
    import importlib
    from types import SimpleNamespace

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from dynmo_plugin.megatron.training import grad_reduce
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    config = SimpleNamespace(moe_router_bias_update_rate=1e-3)

    def layer(counts):  # an MoE router as finalize_model_grads finds it
        m = torch.nn.Module()
        m.register_buffer("expert_bias", torch.zeros(2))
        m.register_buffer("local_tokens_per_expert", torch.tensor(counts, dtype=torch.float32))
        return m

    def bias_at(place: int) -> list:
        layers = [layer([float(rank + 1), float(rank + 2)]) for _ in range(4)]
        layers[place] = layer([[2.0 ** 25, 1.0, 2.0][rank], [2.0 ** 25, 0.0, 3.0][rank]])
        chunk = torch.nn.Module()
        chunk.layers = torch.nn.ModuleList(layers)
        finalize._update_router_expert_bias([chunk], config)
        return layers[place].expert_bias.tolist()

    seen = {"megatron": [bias_at(p) for p in range(4)]}
    grad_reduce.install()
    seen["installed"] = [bias_at(p) for p in range(4)]
    grad_reduce.uninstall()
    parallel_state.destroy_model_parallel()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_the_expert_bias_counts_reduce_exactly_wherever_the_layer_sits(tmp_path):
    """--moe-router-enable-expert-bias: the stage's MoE layers' token counts are stacked and
    all-reduced (float32 in Megatron), and the bias moves by the sign of the average minus
    the count. A layer whose two experts' exact totals are equal keeps its bias at every
    place in the stack once installed (the counts summed in float64); with Megatron's
    float32 sum it moved at some places (the order of the additions follows the place)."""
    spawn(_expert_bias_rank, (free_port(), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["installed"] == [[0.0, 0.0]] * 4, seen
        assert any(b != [0.0, 0.0] for b in seen["megatron"]), seen  # the counts can show it


def test_install_swaps_megatron_s_reductions_and_uninstall_gives_them_back():
    import importlib

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    from dynmo_plugin.megatron.training import grad_reduce
    def current():
        return (Group.start_grad_sync, finalize._allreduce_non_tensor_model_parallel_grads,
                finalize.get_updated_expert_bias)
    megatron_s = current()
    grad_reduce.install()
    grad_reduce.install()
    assert current() == (grad_reduce._start_grad_sync, grad_reduce._non_tensor_parallel_grads,
                         grad_reduce._updated_expert_bias)
    grad_reduce.uninstall()
    grad_reduce.uninstall()
    assert current() == megatron_s


DP3 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "12", "--train-iters", "6",
       "--dynmo", "--dynmo-profile-every", "2", "--test-dump-params"]


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer", "--clip-grad", "0.05"]],
                         ids=["plain", "distributed"])
def test_a_move_at_dp_3_trains_as_the_never_moved_run_bit_for_bit(tmp_path, optimizer):
    """The launcher at PP 2 x DP 3 (one bucket per stage, not a multiple of 3 elements),
    layer 4 moved to stage 1 at iteration 3: every loss and the final parameters equal the
    never-moved run's; with the distributed optimizer (a reduce-scatter, shards cut where
    the layout puts them) and clipping too. With gloo's own all-reduce
    (--dynmo-native-grad-reduce) iteration 4 read 5.509746075 moved against 5.509746154."""
    static = worker(6, [*DP3, *optimizer], tmp_path / "static")
    moved = worker(6, [*DP3, *optimizer, "--dynmo-forced-layouts", "3:Ettt|tttttL"], tmp_path / "moved")
    assert moved["world"]["dp"] == 3
    assert [(e["iteration"], e["layout_after"]) for e in moved["events"] if e["kind"] == "rebalance"] == [
        (3, "Ettt|tttttL")]
    assert len(static["iterations"]) == len(moved["iterations"]) == 6
    assert_same_training(tmp_path / "static", static, tmp_path / "moved", moved, range(6))
