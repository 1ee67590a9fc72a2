"""Megatron linears that carry a pruning mask and run a CSR kernel once sparse enough.

`prunable_layer_spec(spec, sparse_threshold)` rewrites a local GPT layer spec so that
linear_qkv, linear_proj, linear_fc1 and linear_fc2 are `PrunableColumnParallelLinear` /
`PrunableRowParallelLinear`. Each holds a bool buffer `weight_mask` (True = kept), all
ones at construction, so it is part of the layer's state_dict: a migration moves it
with the layer, and a layer built on the receiving stage from the same spec already
has the buffer that `load_state_dict` fills.

Forward (only `_forward_impl`, the matmul, is overridden; Megatron's TP regions,
bias handling and output gathering are untouched):
* mask all ones: Megatron's own path, unchanged (bit-identical to an unpruned model);
* sparsity <= threshold: Megatron's path on `weight.masked_fill(~mask, 0)`, so the
  gradient of pruned entries is exactly zero;
* sparsity > threshold: `SparseLinearFunction` (CSR forward, CSR input grad, weight
  grad on the kept pattern only), the dense weight Parameter stays what DDP and the
  optimizer see.
The CSR pattern is rebuilt lazily whenever the mask tensor changed (its version
counter moves on every in-place write, `load_state_dict` included).

Structured (`granularity: structured`): `neuron_prunable_layer_spec` makes linear_fc1 /
linear_fc2 `NeuronPrunable*` linears whose masks remove whole FFN neurons (rows of fc1
and its bias, columns of fc2). Masked, their forward gathers the kept rows / columns;
physical (the default, `_NeuronMasked`), the scenario rebuilds them with the kept
neurons only, so weights, gradients and optimizer state shrink with the GEMMs — what
saves time on GPUs, where unstructured sparsity does not
(../shared/notes/h100-measured.md). With `pruning.heads`, `head_prunable_layer_spec` does
the same to attention heads: linear_qkv / linear_proj become the same neuron-prunable
linears (a head is 3 * head_dim rows of qkv, [q, k, v], and head_dim columns of proj),
and `HeadPrunableSelfAttention` sets its head counts from the rows qkv keeps before each
forward, so a masked, a shrunk and a received layer all run with their kept heads.

Tensor parallelism: each TP rank holds a slice of the weight and the mask of that
slice. Magnitude pruning is elementwise, so per-shard masks under one GLOBAL threshold
are exactly the global mask; each shard picks its own kernel from its own sparsity.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache, partial

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from dynmo_plugin.config import ConfigError
from dynmo_plugin.scenarios.gradual_pruning.kernels import CHUNK_ROWS, CROSSOVER, CsrPattern, SparseLinearFunction

__all__ = ["PrunableColumnParallelLinear", "PrunableRowParallelLinear", "prunable_layer_spec",
           "NeuronPrunableColumnParallelLinear", "NeuronPrunableRowParallelLinear",
           "neuron_prunable_layer_spec", "HeadPrunableSelfAttention", "head_prunable_layer_spec",
           "prunable_linears", "PRUNED_LINEARS", "csr_supported"]

# The decoder linears whose weights are pruned, as (parent attribute, linear attribute).
PRUNED_LINEARS = (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                  ("mlp", "linear_fc1"), ("mlp", "linear_fc2"))


class _MaskedLinear:
    """Mixin for a Megatron Column/RowParallelLinear: mask buffer, kernel choice."""

    sparse_threshold: float = CROSSOVER
    chunk_rows: int = CHUNK_ROWS

    def _init_mask(self) -> None:
        if self.weight is None:
            raise ConfigError("gradual_pruning: a prunable linear needs its own weight "
                              "(skip_weight_param_allocation is not supported)")
        if self.gradient_accumulation_fusion:
            raise ConfigError("gradual_pruning: gradient_accumulation_fusion must be off (the "
                              "masked weight is not the Parameter that owns main_grad)")
        self.register_buffer("weight_mask", torch.ones(self.weight.shape, dtype=torch.bool,
                                                       device=self.weight.device))
        # what an all-ones mask gives, known without reading it back
        self._sparsity = 0.0
        self._pattern: CsrPattern | None = None
        self._cache_key: tuple | None = self._key()

    def _key(self) -> tuple:
        """What identifies the mask's current values, read on the host only (its version
        counter moves on every in-place write, `load_state_dict` included)."""
        mask = self.weight_mask
        return mask._version, mask.data_ptr(), mask.device

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.refresh()  # the loaded mask's kernels now, not in the next forward

    def refresh(self) -> None:
        """Recompute sparsity and the CSR pattern if the mask changed since last time.

        This reads the mask back to the host (a device sync on a GPU): everything that
        writes a mask (construction, `load_state_dict`, a pruning round) refreshes at once,
        so a forward finds it current and reads nothing (tests/scenarios/test_scenario_host_sync.py)."""
        mask = self.weight_mask
        key = self._key()
        if key == self._cache_key:
            return
        kept = int(mask.sum())
        self._sparsity = 1.0 - kept / mask.numel() if mask.numel() else 0.0
        sparse = self._sparsity > self.sparse_threshold and _csr_supported(self.weight)
        self._pattern = CsrPattern.from_mask(mask) if sparse else None
        self._cache_key = key

    @property
    def sparsity(self) -> float:
        """Fraction of this (shard's) weight that is pruned."""
        self.refresh()
        return self._sparsity

    @property
    def uses_sparse_kernel(self) -> bool:
        self.refresh()
        return self._pattern is not None

    def _forward_impl(self, input, weight, *args, **kwargs):
        self.refresh()
        if weight is not self.weight or self._sparsity == 0.0:
            return super()._forward_impl(input, weight, *args, **kwargs)
        sp = kwargs.get("sequence_parallel", False)
        if self._pattern is None or args or sp or kwargs.get("grad_output_buffer") is not None:
            return super()._forward_impl(input, weight.masked_fill(~self.weight_mask, 0),
                                         *args, **kwargs)
        if kwargs.get("allreduce_dgrad"):  # Megatron's function all-reduces dgrad over TP
            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        return SparseLinearFunction.apply(input, weight, kwargs.get("bias"), self._pattern,
                                          self.chunk_rows)


def _csr_supported(weight: torch.Tensor) -> bool:
    return csr_supported(weight.device.type, weight.dtype)


def csr_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch has the CSR kernels `SparseLinearFunction` needs for a weight of this
    device type and dtype: fp32/fp64 only, on any device. bf16/fp16 fail on CPU in the
    forward (MKL: "addmm_out_sparse_csr_impl_mkl not implemented") and in the backward's
    `sampled_addmm` on every device ("Expected self to be a floating-point or complex
    tensor, but got BFloat16": the input check shared by the CPU and CUDA kernels in torch
    2.13; cuSPARSE's SDDMM dispatch there is float/double/complex only). Above the
    threshold such a weight keeps the dense masked matmul."""
    del device_type  # the same answer on CPU and CUDA in torch 2.13
    return dtype in (torch.float32, torch.float64)


class PrunableColumnParallelLinear(_MaskedLinear, ColumnParallelLinear):
    """ColumnParallelLinear with a `weight_mask` buffer and a CSR path above the threshold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_mask()


class PrunableRowParallelLinear(_MaskedLinear, RowParallelLinear):
    """RowParallelLinear with a `weight_mask` buffer and a CSR path above the threshold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_mask()


class _NeuronMasked(_MaskedLinear):
    """Whole FFN neurons pruned: `axis` 0 = fc1 (a neuron is a row, plus its bias entry),
    1 = fc2 (a neuron is a column).

    `weight_mask` always has the FULL width (every neuron the layer was built with), so
    it says which neurons a layer keeps whatever its weight's present width. The weight
    holds the neurons in `present` (full-width indices, None = all of them):

    * masked: the weight keeps its full width and the kept neurons are gathered into a
      smaller dense weight at every call (`index_select`'s backward scatters gradients
      back, zero for pruned ones);
    * physical (`shrink`): the weight, its bias and everything keyed by them (gradient,
      DDP buffer, fp32 master, Adam moments) hold the kept neurons only, and the forward
      is Megatron's plain matmul. A layer built from the spec (a migration's receiver,
      a repack) takes the width of the state it loads (`_load_from_state_dict`), and a
      checkpoint stores the full width with zeros at pruned neurons (`sharded_state_dict`),
      what the masked form stores: any layout or pipeline size reads it back."""

    axis: int = 0
    _present: torch.Tensor | None = None

    def _init_mask(self) -> None:
        super()._init_mask()
        # every neuron kept: the plain matmul, no index (known without reading the mask)
        self._kept, self._kept_count, self._gathers = None, int(self.weight.shape[self.axis]), False

    def _key(self) -> tuple:
        return super()._key() + (tuple(self.weight.shape),)

    @property
    def neuron_params(self) -> tuple[str, ...]:
        """The parameters with one entry per neuron along `axis`."""
        return ("weight", "bias") if self.axis == 0 and self.bias is not None else ("weight",)

    @property
    def full_width(self) -> int:
        return int(self.weight_mask.shape[self.axis])

    @property
    def physical(self) -> bool:
        """Whether the weight holds fewer neurons than the layer was built with."""
        return int(self.weight.shape[self.axis]) < self.full_width

    def kept_neurons(self) -> torch.Tensor:
        """Bool [full width]: the neurons the mask keeps."""
        return self.weight_mask.any(dim=1 - self.axis)

    def local_mask(self) -> torch.Tensor:
        """The mask over the neurons the weight holds (the weight's shape)."""
        if self._present is None:
            return self.weight_mask
        return self.weight_mask.index_select(self.axis, self._present)

    def shrink_index(self) -> torch.Tensor:
        """Positions, along `axis` of the present weight, of the neurons still kept."""
        return self.local_mask().any(dim=1 - self.axis).nonzero().squeeze(1)

    def refresh(self) -> None:
        key = self._key()
        if key == self._cache_key:
            return
        self._kept = self.shrink_index()
        self._kept_count = int(self._kept.numel())  # host copies: a forward reads these
        kept = int(self.kept_neurons().sum())
        self._sparsity = 1.0 - kept / self.full_width if self.full_width else 0.0
        self._gathers = self._kept_count < int(self.weight.shape[self.axis])
        self._pattern = None
        self._cache_key = key

    def _forward_impl(self, input, weight, *args, **kwargs):
        self.refresh()
        dense = super(_MaskedLinear, self)._forward_impl  # Megatron's own matmul
        if weight is not self.weight or not self._gathers:
            return dense(input, weight, *args, **kwargs)
        if self.axis == 0 and kwargs.get("bias") is not None:
            kwargs["bias"] = kwargs["bias"].index_select(0, self._kept)
        return dense(input, weight.index_select(self.axis, self._kept), *args, **kwargs)

    # ---- the width travels with the state ------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Take the neuron width of the incoming state (smaller after a physical shrink)
        before loading it, so a layer built from the spec can receive a pruned layer."""
        weight = state_dict.get(prefix + "weight")
        mask = state_dict.get(prefix + "weight_mask")
        if (torch.is_tensor(weight) and torch.is_tensor(mask) and weight.dim() == 2
                and tuple(mask.shape) == tuple(self.weight_mask.shape)):
            width, present = int(weight.shape[self.axis]), None
            if width < self.full_width:
                present = mask.to(self.weight_mask.device).any(dim=1 - self.axis).nonzero().squeeze(1)
                if present.numel() != width:
                    raise ValueError(f"{prefix}weight holds {width} neurons but its mask keeps "
                                     f"{present.numel()}: a physically pruned state must be "
                                     "shrunk to its mask")
            if width != int(self.weight.shape[self.axis]):
                self.resize_neurons(width, present)
            else:  # same width (a live module): its parameters stay, DDP and optimizer hold them
                self._present, self._cache_key = present, None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def resize_neurons(self, width: int, present: torch.Tensor | None) -> None:
        """New (uninitialised) neuron parameters of `width` neurons; `present` their
        full-width indices (None: all). Only for a module no DDP/optimizer holds yet."""
        for name in self.neuron_params:
            old = getattr(self, name)
            shape = list(old.shape)
            shape[self.axis if name == "weight" else 0] = width
            new = torch.nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device),
                                     requires_grad=old.requires_grad)
            for attr, value in vars(old).items():  # Megatron's TP / allreduce attributes
                if not torch.is_tensor(value) and attr != "grad_added_to_main_grad":
                    setattr(new, attr, value)
            setattr(self, name, new)
        self._present = present
        self._cache_key = None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's sharded state; when physically pruned, the neuron parameters (and,
        through Megatron's optimizer, their Adam moments and masters) as factories that
        write the FULL width (zeros at pruned neurons) and read the present neurons back."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.physical:
            return sharded
        state = self.state_dict(prefix="", keep_vars=True)
        full = {name: _scatter(state[name], self._present, self._dim(name), self.full_width)
                for name in self.neuron_params}
        template = make_sharded_tensors_for_checkpoint(
            {**state, **full}, prefix, {"weight": self.axis, "bias": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        for name in self.neuron_params:
            t = template[prefix + name]
            sharded[prefix + name] = ShardedTensorFactory(
                t.key, state[name], partial(_build_full, t, self._present, self._dim(name), self.full_width),
                partial(_merge_present, self._present, self._dim(name)), t.replica_id)
        mask = sharded[prefix + "weight_mask"]  # sharded like the full-width weight
        sharded[prefix + "weight_mask"] = dataclasses.replace(
            template[prefix + "weight"], key=mask.key, data=mask.data, dtype=mask.dtype)
        return sharded

    def _dim(self, name: str) -> int:
        return self.axis if name == "weight" else 0


def _scatter(t: torch.Tensor, present: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """`t` (present neurons along `dim`) at full `width`, zeros at the others."""
    shape = list(t.shape)
    shape[dim] = width
    return torch.zeros(shape, dtype=t.dtype, device=t.device).index_copy_(dim, present, t.detach())


def _build_full(template, present, dim, width, key, data, replica_id, flattened_range):
    if flattened_range is not None:
        raise ValueError(f"{key}: a flattened physically pruned tensor cannot be checkpointed")
    full = _scatter(data, present, dim, width)
    return dataclasses.replace(template, key=key, data=full, dtype=full.dtype, replica_id=replica_id)


def _merge_present(present, dim, loaded: torch.Tensor) -> torch.Tensor:
    return loaded.index_select(dim, present.to(loaded.device))


class NeuronPrunableColumnParallelLinear(_NeuronMasked, ColumnParallelLinear):
    """linear_fc1 with structured neuron pruning: outputs only the kept neurons."""

    axis = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_mask()

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        if bias is not None and self._gathers:  # skip_bias_add: the MLP adds it
            bias = bias.index_select(0, self._kept)
        return output, bias


class NeuronPrunableRowParallelLinear(_NeuronMasked, RowParallelLinear):
    """linear_fc2 with structured neuron pruning: reads only the kept neurons."""

    axis = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_mask()


@lru_cache(maxsize=None)
def _with_threshold(base: type, threshold: float) -> type:
    """A subclass of `base` whose kernel switch sits at `threshold` (cached: one class
    per threshold, so layers built by a migration get the same class)."""
    if threshold == base.sparse_threshold:
        return base
    return type(base.__name__, (base,), {"sparse_threshold": threshold,
                                         "__module__": base.__module__})


def _replace(spec: ModuleSpec, where: str, **fields) -> ModuleSpec:
    sub = spec.submodules
    for name, want in fields.items():
        have = getattr(sub, name, None)
        if not (isinstance(have, type) and issubclass(have, (ColumnParallelLinear, RowParallelLinear))):
            raise ConfigError(f"gradual_pruning: {where}.{name} is {have!r}; pruning needs the local "
                              "layer spec (Megatron Column/RowParallelLinear), not Transformer Engine's")
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **fields))


def prunable_layer_spec(spec: ModuleSpec, sparse_threshold: float = CROSSOVER) -> ModuleSpec:
    """`spec` (a TransformerLayer spec) with the four decoder linears made prunable.

    Raises:
        ConfigError: the spec's linears are not Megatron's local Column/RowParallelLinear
            (e.g. Transformer Engine's fused layer-norm linears).
    """
    column = _with_threshold(PrunableColumnParallelLinear, float(sparse_threshold))
    row = _with_threshold(PrunableRowParallelLinear, float(sparse_threshold))
    sub = spec.submodules
    attn = _replace(sub.self_attention, "self_attention", linear_qkv=column, linear_proj=row)
    mlp = _replace(sub.mlp, "mlp", linear_fc1=column, linear_fc2=row)
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp))


def neuron_prunable_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """`spec` with linear_fc1 / linear_fc2 pruned by whole FFN neurons.

    Raises:
        ConfigError: a gated MLP (SwiGLU: fc1 rows are pairs of neurons) or a spec whose
            linears are not Megatron's local ones.
    """
    sub = spec.submodules
    mlp = _replace(sub.mlp, "mlp", linear_fc1=NeuronPrunableColumnParallelLinear,
                   linear_fc2=NeuronPrunableRowParallelLinear)
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, mlp=mlp))


class HeadPrunableSelfAttention(SelfAttention):
    """Standard multi-head self-attention (one query group per head) whose heads are
    pruned as neurons of linear_qkv (axis 0: a head's q, k, v rows, contiguous) and
    linear_proj (axis 1: its head_dim columns). The head counts Megatron's reshapes read
    follow the rows qkv keeps, set before every forward."""

    @property
    def head_dim(self) -> int:
        return int(self.hidden_size_per_attention_head)

    @property
    def full_heads(self) -> int:
        """Heads of this partition as built (the masks' full width)."""
        return self.linear_proj.full_width // self.head_dim

    def kept_heads(self) -> torch.Tensor:
        """Bool [full_heads]: the heads the masks keep."""
        return self.linear_proj.kept_neurons().view(self.full_heads, self.head_dim).any(1)

    def sync_heads(self) -> int:
        """Set this module's and core attention's head counts to the heads qkv outputs."""
        qkv = self.linear_qkv
        qkv.refresh()
        heads = qkv._kept_count // (3 * self.head_dim)  # a host copy: no read back
        core = self.core_attention
        self.num_attention_heads_per_partition = self.num_query_groups_per_partition = heads
        core.num_attention_heads_per_partition = core.num_query_groups_per_partition = heads
        core.hidden_size_per_partition = heads * self.head_dim
        return heads

    def forward(self, *args, **kwargs):
        self.sync_heads()
        return super().forward(*args, **kwargs)


def head_prunable_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """`spec` with whole attention heads prunable (see HeadPrunableSelfAttention).

    Raises:
        ConfigError: the attention is not Megatron's SelfAttention with local linears.
    """
    sub = spec.submodules
    attn = sub.self_attention
    if not (isinstance(attn, ModuleSpec) and attn.module is SelfAttention):
        raise ConfigError(f"dynamism.pruning.heads: self_attention is {getattr(attn, 'module', attn)!r}; "
                          "head pruning needs Megatron's SelfAttention (local layer spec)")
    attn = _replace(attn, "self_attention", linear_qkv=NeuronPrunableColumnParallelLinear,
                    linear_proj=NeuronPrunableRowParallelLinear)
    attn = dataclasses.replace(attn, module=HeadPrunableSelfAttention)
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, self_attention=attn))


def prunable_linears(layer: torch.nn.Module) -> list[tuple[str, _MaskedLinear]]:
    """(name, module) of a built layer's prunable linears, in PRUNED_LINEARS order."""
    out = []
    for parent, name in PRUNED_LINEARS:
        module = getattr(getattr(layer, parent, None), name, None)
        if isinstance(module, _MaskedLinear):
            out.append((f"{parent}.{name}", module))
    return out
