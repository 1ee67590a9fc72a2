"""carry_optimizer_state on real Megatron optimizers (single process, gloo, CPU).

Megatron's fp16/bf16 optimizer refuses CPU tensors ("Wrapped parameters must be one of
torch.cuda.FloatTensor ..."), and TE/Apex FusedAdam need CUDA, so on CPU the per-group
`step` that fused Adam keeps and the loss scaler of the mixed-precision optimizer are
put on real fp32 Megatron optimizers by hand (named below); the carry code path is the
same one the GPU classes take.
"""
import torch

from launch import in_megatron_process


def _optimizer(model, distributed: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  model)
    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0,
                                                  use_distributed_optimizer=distributed), [ddp])


def _check_carry(args):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from dynmo_plugin.megatron.migration.optim_state import carry_optimizer_state, megatron_optimizers
    old, new = _optimizer(torch.nn.Linear(8, 8)), _optimizer(torch.nn.Linear(8, 8))
    (old_inner,), (new_inner,) = megatron_optimizers(old), megatron_optimizers(new)
    assert len(old_inner.optimizer.param_groups) == len(new_inner.optimizer.param_groups) > 0
    for i, group in enumerate(old_inner.optimizer.param_groups):
        group["lr"] = 1e-5 * (i + 1)                # as a scheduler in warm-up leaves it
        group["step"] = torch.tensor(41.0 + i)      # fused Adam's per-group step (hand-set)
    scaler = DynamicGradScaler(initial_scale=2.0**12, min_scale=1.0, growth_factor=2.0,
                               backoff_factor=0.5, growth_interval=100, hysteresis=2)
    old_inner.grad_scaler = scaler                  # the mixed-precision optimizer's (hand-set)
    carry_optimizer_state(old, new)
    for i, group in enumerate(new_inner.optimizer.param_groups):
        assert group["lr"] == 1e-5 * (i + 1)
        assert torch.equal(group["step"], torch.tensor(41.0 + i))
        assert group["step"] is not old_inner.optimizer.param_groups[i]["step"]
        assert group["params"] is not old_inner.optimizer.param_groups[i]["params"]
    assert new_inner.grad_scaler is scaler


def _check_frozen(args):
    from dynmo_plugin.megatron.migration.optim_state import param_state, state_owner
    model = torch.nn.Linear(8, 8)
    model.bias.requires_grad_(False)
    opt = _optimizer(model)
    assert state_owner(opt, model.bias) is None and param_state(opt, model.bias) == {}
    assert state_owner(opt, model.weight) is not None


def test_group_settings_and_loss_scaler_are_carried():
    in_megatron_process(_check_carry)


def _check_lookup(args):
    _check_frozen(args)
    _check_pieces(args)


def test_frozen_parameters_have_no_state_and_pruning_masks_plain_and_sharded_state():
    in_megatron_process(_check_lookup)  # one spawned process for both (~10-20 s each)


def _check_pieces(args):
    """fp32 weights: the plain optimizer's one piece is keyed by the weight itself (no
    master); the distributed one's (DP = 1: one shard of the whole buffer range) is a
    1-D shard main param. Pruning's masking zeroes moments (and the shard) off the mask
    in both."""
    from dynmo_plugin.scenarios.gradual_pruning.live import _mask_optimizer_state
    from dynmo_plugin.megatron.migration.optim_state import local_state_pieces
    for distributed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = _optimizer(model, distributed)
        model(torch.randn(4, 8)).sum().backward()  # DDP's hooks fill main_grad
        opt.step()
        ((state, master, piece),) = local_state_pieces(opt, model.weight)
        assert (piece.stop - piece.start, set(state)) == (64, {"exp_avg", "exp_avg_sq", "step"})
        assert (master is None) != distributed and (not distributed or master.shape == (64,))
        mask = torch.rand(8, 8) > 0.5
        _mask_optimizer_state(opt, model.weight, mask)
        off = ~mask.reshape(-1)[piece]
        for t in [state["exp_avg"], state["exp_avg_sq"]] + ([master] if distributed else []):
            assert not t.reshape(-1)[off].any() and t.reshape(-1)[~off].all()
