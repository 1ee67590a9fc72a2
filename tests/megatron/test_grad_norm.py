"""The gradient norm that --clip-grad divides by does not depend on which rank holds which
gradient (`megatron.training.grad_norm`). Megatron's own `get_grad_norm_fp32` sums each
rank's squares in fp32, then the ranks' sums, so a migration regrouped the sum: the launcher
at PP 2 with --clip-grad 1.0 read 5.446037531 against 5.446037471 at iteration 7, moved
against never moved (docs/megatron-lm.md, "What a move changes")."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from launch import assert_same_training, free_port, spawn, worker

pytestmark = pytest.mark.multiproc

SIZES = [1000, 37, 500, 3, 2000, 64]
SCALES = [1.0, 1e-3, 3.0, 0.5, 1e-2, 7.0]
# Which of the six tensors each of the two ranks holds, in that order.
SPLITS = {"halves": ([0, 1, 2], [3, 4, 5]), "interleaved, reordered": ([5, 3, 1], [4, 0, 2]),
          "one rank holds all, the other none": ([2, 0, 5, 1, 4, 3], [])}


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(23)
    return [torch.randn(n, generator=g) * s for n, s in zip(SIZES, SCALES)]


def _split_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from dynmo_plugin.megatron.training import cpu_compat, grad_norm
    cpu_compat.apply()  # Megatron's own function allocates on 'cuda'
    from megatron.core.optimizer import clip_grads, optimizer
    tensors, seen = _tensors(), {}
    for name, split in SPLITS.items():
        mine = [tensors[i] for i in split[rank]]
        seen[name] = {"ours": grad_norm.get_grad_norm_fp32(mine).hex(),
                      "megatron": clip_grads.get_grad_norm_fp32(mine).hex()}
    halves = [tensors[i] for i in SPLITS["halves"][rank]]  # Megatron's inf norm needs a tensor
    seen["inf"] = [grad_norm.get_grad_norm_fp32(halves, norm_type=math.inf),
                   clip_grads.get_grad_norm_fp32(halves, norm_type=math.inf)]
    seen["megatron's name before"] = optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32
    grad_norm.install()
    grad_norm.install()
    seen["installed"] = optimizer.get_grad_norm_fp32 is grad_norm.get_grad_norm_fp32
    grad_norm.uninstall()
    grad_norm.uninstall()
    seen["uninstalled"] = optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_the_norm_is_the_same_however_the_tensors_are_split_over_the_ranks(tmp_path):
    """Six tensors of unlike scales split over two gloo ranks three ways (one rank holding
    none): the same bits on every rank and every split, the float64 norm of all of them
    to 1e-6; Megatron's own function gives other bits for one split (so the splits
    regroup its fp32 sum visibly); the inf norm is Megatron's (the largest magnitude); install() puts the function
    under the name Megatron's optimizer calls, uninstall() gives Megatron's back (each
    twice: idempotent)."""
    spawn(_split_rank, (free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    seen = ranks[0]
    ours = {seen[name]["ours"] for name in SPLITS}
    assert len(ours) == 1, seen
    reference = torch.cat(_tensors()).double().norm().item()
    assert math.isclose(float.fromhex(ours.pop()), reference, rel_tol=1e-6)
    assert len({seen[name]["megatron"] for name in SPLITS}) > 1, seen
    assert seen["inf"] == [max(t.abs().max().item() for t in _tensors())] * 2, seen
    assert (seen["megatron's name before"], seen["installed"], seen["uninstalled"]) == (True, True, True)


# Where three data-parallel ranks' shards of one 100000-element buffer are cut (the
# distributed optimizer cuts it where the layout puts the parameters); each shard is two tensors.
CUTS = ((0, 30000, 70000, 100000), (0, 33333, 66666, 100000), (0, 1, 99999, 100000), (0, 50000, 50001, 100000))


def _buffer() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-4, 3, (100_000,), generator=g).float()


def _sharded_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    from dynmo_plugin.megatron.training import grad_norm
    full, seen = _buffer(), {"per_tensor": [], "sharded": []}
    for cuts in CUTS:
        a, b = cuts[rank], cuts[rank + 1]
        mine = [t for t in (full[a:(a + b) // 2], full[(a + b) // 2:b]) if t.numel()]
        grad_norm.install()
        seen["per_tensor"].append(grad_norm.get_grad_norm_fp32(mine).hex())
        grad_norm.install(sharded=True)
        seen["sharded"].append(grad_norm.get_grad_norm_fp32(mine).hex())
    grad_norm.CPU_SLICE = 777  # the float64 passes in slices: the same sum
    seen["sliced"] = grad_norm.get_grad_norm_fp32([full[CUTS[0][rank]:CUTS[0][rank + 1]]]).hex()
    seen["inf"] = grad_norm.get_grad_norm_fp32([torch.tensor([1.0, math.inf])] if rank == 1 else [])
    seen["nan"] = repr(grad_norm.get_grad_norm_fp32([torch.tensor([math.nan, math.inf])] if rank == 2 else []))
    seen["nan and inf apart"] = repr(grad_norm.get_grad_norm_fp32(
        [torch.tensor([math.nan])] if rank == 0 else [torch.tensor([math.inf])] if rank == 1 else []))
    seen["zero"] = grad_norm.get_grad_norm_fp32([torch.zeros(5), torch.zeros(0)] if rank == 0 else [torch.zeros(0)])
    big = [torch.tensor([1e20])] if rank == 2 else []  # its square is above fp32's largest value
    seen["overflow"] = [grad_norm.get_grad_norm_fp32(big)]
    grad_norm.install()
    seen["overflow"].append(grad_norm.get_grad_norm_fp32(big))
    grad_norm.install(sharded=True)
    grad_norm.uninstall()
    seen["uninstalled"] = grad_norm._sharded
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)
    dist.destroy_process_group()


def test_with_sharded_gradients_the_norm_is_the_same_wherever_the_shards_are_cut(tmp_path):
    """The distributed optimizer's shards: one buffer of 100000 elements of unlike scales
    cut over three gloo ranks four ways. Summed over elements (install(sharded=True)) the
    norm has the same bits for every cut, in slices too, and equals the float64 norm
    (math.fsum of the squares) to the last bit here; per-tensor norms of the pieces give
    other bits for every cut (what a move changed). An inf or NaN element anywhere gives
    inf or NaN (NaN first, also from another rank than the inf), all zeros 0 (empty
    tensors welcome); a sum of squares above fp32's largest value inf, both ways, as
    Megatron's fp32 sum; uninstall() leaves the mode off."""
    spawn(_sharded_rank, (free_port(), str(tmp_path)), nprocs=3)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert ranks[0] == ranks[1] == ranks[2]
    seen = ranks[0]
    reference = math.sqrt(math.fsum(v * v for v in _buffer().double().tolist()))
    assert set(seen["sharded"]) == {seen["sliced"]} == {reference.hex()}, seen
    assert len(set(seen["per_tensor"])) == len(CUTS), seen
    assert (seen["inf"], seen["nan"], seen["nan and inf apart"], seen["zero"], seen["uninstalled"]) == (
        math.inf, "nan", "nan", 0.0, False), seen
    assert seen["overflow"] == [math.inf, math.inf], seen


REPRO = ["--pipeline-model-parallel-size", "2", "--train-iters", "8", "--clip-grad", "1.0", "--dynmo",
         "--dynmo-profile-every", "2", "--test-dump-params"]


def test_a_clipped_run_with_a_move_trains_as_the_never_moved_one_bit_for_bit(tmp_path):
    """The launcher at PP 2 with --clip-grad 1.0, layer 4 moved to stage 1 at iteration 3,
    against the never-moved run: the same loss every iteration, to the last bit, and the
    same final parameters. With Megatron's own norm iteration 7 read 5.446037531 moved,
    5.446037471 not."""
    static = worker(2, REPRO, tmp_path / "static")
    moved = worker(2, [*REPRO, "--dynmo-forced-layouts", "3:Ettt|tttttL"], tmp_path / "moved")
    assert [(e["iteration"], e["layout_after"]) for e in moved["events"] if e["kind"] == "rebalance"] == [
        (3, "Ettt|tttttL")]
    assert len(static["iterations"]) == len(moved["iterations"]) == 8
    assert_same_training(tmp_path / "static", static, tmp_path / "moved", moved, range(2))
