"""A Megatron core-attention module doing hash-bucketed (LSH) causal attention.

`LSHCoreAttention` replaces Megatron's `DotProductAttention` as the
`core_attention` submodule of a layer's self-attention (`lsh_attention_spec`) and is
called like it: query/key/value `[s, b, heads, head_dim]`, a causal attention mask,
returns `[s, b, heads * head_dim]`. It holds its bucket count in a buffer
(`buckets`), so a migrated or repacked layer keeps its density:

* `buckets == 1`: dense causal attention through torch's fused
  `scaled_dot_product_attention` (SDPA) - the baseline, one bucket holds every key;
* `buckets == B > 1`: tokens hashed into B buckets (Reformer's angular LSH, one random
  rotation per round), sorted by bucket, cut into chunks of round_up(s/B, chunk_multiple)
  tokens, and fused causal attention (SDPA / FlashAttention) run inside each chunk:
  `kernels.lsh_attention`, whose docstring states the exact semantics.

The rotation is drawn from a generator seeded by (seed, global layer number,
iteration, global micro-batch index, hash round) and shared by all heads, so hashing
is identical on every rank, for every pipeline split and TP split, and a layer that
moved to another stage hashes exactly as it would have on its old one. The scenario
(dynmo_plugin.scenarios.sparse_attention.live) calls `begin_iteration` on every layer's
module before each step; micro-batches are counted in forward-call order (1F1B runs a
stage's forwards in micro-batch order).
"""
from __future__ import annotations

import copy
import functools
import math
import time
from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from dynmo_plugin.megatron.training.scratch import rng_streams_kept
from dynmo_plugin.megatron.attention.core import CausalCoreAttention
from dynmo_plugin.scenarios.sparse_attention.kernels import (CHUNK_MULTIPLE, dense_causal_attention,
                                                             hash_rotation, lsh_attention)

__all__ = ["LSHCoreAttention", "lsh_attention", "dense_causal_attention", "hash_rotation",
           "lsh_attention_spec", "core_attentions", "time_attention", "time_layer"]


# ---- the Megatron module ----------------------------------------------------------------------
class LSHCoreAttention(CausalCoreAttention):
    """Core attention with a per-layer bucket count (1 = dense SDPA); see module docstring.

    Built by Megatron's Attention like DotProductAttention (keyword arguments below up
    to `pg_collection`); `seed`, `initial_buckets` ({global layer: buckets}) and
    `hashes` and `chunk_multiple` (tokens per chunk rounded to it) come from the spec
    (`lsh_attention_spec`)."""

    kind = "LSH attention"

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, *, seed: int, initial_buckets: dict, hashes: int = 1,
                 chunk_multiple: int = CHUNK_MULTIPLE):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)
        if hashes < 1 or chunk_multiple < 1:
            raise ValueError(f"hashes and chunk_multiple must be >= 1, got {hashes}, {chunk_multiple}")
        self.seed, self.hashes, self.chunk_multiple = seed, hashes, chunk_multiple
        self._buckets = int(initial_buckets.get(self.layer_number, 1))  # the host's copy
        self.register_buffer("buckets", torch.tensor(self._buckets, dtype=torch.int64))
        self._iteration: Optional[int] = None
        self._microbatch = 0
        self._causal: Optional[torch.Tensor] = None
        self._verified: tuple = (None, -1)  # the last mask found causal, and its version
        self._pass_values = False  # time_layer only: no attention, the values pass through

    def begin_iteration(self, iteration: int, first_microbatch: int = 0) -> None:
        """The next forward calls are micro-batches first_microbatch, +1, ... of `iteration`."""
        self._iteration, self._microbatch = iteration, first_microbatch

    def set_buckets(self, buckets: int) -> None:
        if buckets < 1:
            raise ValueError(f"layer {self.layer_number}: buckets must be >= 1, got {buckets}")
        self._buckets = int(buckets)
        self.buckets.fill_(self._buckets)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A migration or checkpoint brings the count: refresh the host's copy (one read
        per load; forward reads no device tensor)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "buckets" in state_dict:
            self._buckets = int(state_dict[prefix + "buckets"])

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("LSH attention supports neither packed sequences nor attention bias")
        if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            raise NotImplementedError(f"LSH attention is causal only, got {attn_mask_type or self.attn_mask_type}")
        self._check_causal(attention_mask, query.shape[0])
        n = query.shape[2]
        if key.shape[2] != n:  # grouped-query attention: repeat keys/values per query head
            key = key.repeat_interleave(n // key.shape[2], dim=2)
            value = value.repeat_interleave(n // value.shape[2], dim=2)
        if self._pass_values:
            return value.reshape(value.shape[0], value.shape[1], -1)
        buckets = self._buckets
        if buckets == 1:
            return dense_causal_attention(query, key, value, self.softmax_scale)
        if self._iteration is None:
            raise RuntimeError(f"layer {self.layer_number}: LSH attention needs begin_iteration() "
                               "before a forward (the sparse_attention scenario calls it)")
        mb = self._microbatch
        self._microbatch += 1
        rotations = [hash_rotation(self.seed, self.layer_number, self._iteration, mb, r,
                                   query.shape[3], buckets) for r in range(self.hashes)]
        return lsh_attention(query, key, value, buckets, rotations, self.softmax_scale,
                             self.chunk_multiple)

    def _check_causal(self, mask: Optional[torch.Tensor], s: int) -> None:
        """The mask must be the plain causal one (True = masked) or None: padding masks
        would need per-key masking inside the blocks, which is not implemented."""
        if mask is None or (mask is self._verified[0] and mask._version == self._verified[1]):
            return  # the same mask tensor as last time, unchanged
        if self._causal is None or self._causal.shape[-1] != s or self._causal.device != mask.device:
            self._causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=mask.device), 1)
        problem = (f"layer {self.layer_number}: LSH attention takes only a causal attention mask "
                   "(no padding masks)")
        if mask.shape[-2:] != (s, s):
            raise ValueError(problem)
        # checked where the mask lives (at once on CPU, a device-side assert on a GPU):
        # reading the answer back would stall the host in every layer
        try:
            torch._assert_async((mask == self._causal).all(), problem)
        except RuntimeError as e:
            raise ValueError(problem) from e
        self._verified = (mask, mask._version)  # holding it: its memory cannot be reused


def lsh_attention_spec(spec: ModuleSpec, seed: int, initial_buckets: dict, hashes: int,
                       chunk_multiple: int = CHUNK_MULTIPLE) -> ModuleSpec:
    """`spec` (a TransformerLayer spec) whose self-attention's core attention is
    LSHCoreAttention; the rest of the layer is untouched."""
    try:
        attention = spec.submodules.self_attention
        sub = attention.submodules
        sub.core_attention  # noqa: B018 - raises AttributeError on other layer kinds
    except AttributeError as e:
        raise ValueError(f"sparse attention needs a layer spec with self_attention.submodules."
                         f"core_attention, got {spec.module!r}") from e
    out = copy.copy(spec)
    out.submodules = copy.copy(spec.submodules)
    out.submodules.self_attention = copy.copy(attention)
    out.submodules.self_attention.submodules = copy.copy(sub)
    out.submodules.self_attention.submodules.core_attention = functools.partial(
        LSHCoreAttention, seed=seed, initial_buckets=dict(initial_buckets), hashes=hashes,
        chunk_multiple=chunk_multiple)
    return out


def core_attentions(model: torch.nn.Module) -> list[LSHCoreAttention]:
    """The LSHCoreAttention modules of a stage's decoder layers, in layer order."""
    return [layer.self_attention.core_attention for layer in model.decoder.layers
            if isinstance(getattr(layer.self_attention, "core_attention", None), LSHCoreAttention)]


# ---- timing (the work model's calibration) ----------------------------------------------------
def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.thread_time()  # CPU time of this thread: robust to other processes' load
    fn()
    return time.thread_time() - start


def _median_seconds(fns: dict, repeats: int, device: torch.device) -> dict:
    """{key: median seconds of fns[key]()}, measured round-robin (a burst of load on a
    shared machine then hits every key alike), after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            times[key].append(_timed(fn, device))
    return {key: sorted(v)[len(v) // 2] for key, v in times.items()}


def time_attention(s: int, b: int, heads: int, head_dim: int, buckets: int, hashes: int = 1,
                   repeats: int = 3, device: torch.device | str = "cpu",
                   chunk_multiple: int = CHUNK_MULTIPLE) -> float:
    """Median seconds of one forward + backward of the core attention at this shape."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, heads, head_dim, generator=gen).to(device).requires_grad_()
               for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    rotations = [hash_rotation(0, 1, 0, 0, r, head_dim, buckets) for r in range(hashes)]

    def step():
        if buckets == 1:
            out = dense_causal_attention(q, k, v, scale)
        else:
            out = lsh_attention(q, k, v, buckets, rotations, scale, chunk_multiple)
        out.backward(torch.ones_like(out))
        for x in (q, k, v):
            x.grad = None

    return _median_seconds({0: step}, repeats, device)[0]


@rng_streams_kept()
def time_layer(spec: ModuleSpec, config, pg_collection, vp_stage, s: int, b: int,
               buckets: list[int], repeats: int = 5, device: torch.device | str = "cpu",
               seed: int = 0) -> dict[int, float]:
    """{buckets: median seconds of one forward + backward of a whole layer}: a throwaway
    layer built from `spec` (an LSH attention spec; weights N(0, 0.02), norms 1, biases
    0), run at each bucket count on a random [s, b, hidden] input with the causal mask.
    Key 0: the layer without attention (the core attention passes the values through),
    i.e. its linear part."""
    from dynmo_plugin.megatron.training.scratch import build_scratch_layer, scratch_input
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    layer = build_scratch_layer(spec, config, 1, pg_collection, vp_stage, device, gen)  # run's dtype
    attention = layer.self_attention.core_attention
    if not isinstance(attention, LSHCoreAttention):
        raise ValueError(f"time_layer needs an LSH attention spec, got {type(attention).__name__}")
    x = scratch_input((s, b, config.hidden_size), config, device, gen, requires_grad=True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None]
    attention.begin_iteration(0)

    def step(count: int):
        attention.set_buckets(max(count, 1))
        attention._pass_values = count == 0
        try:
            out, _ = layer(hidden_states=x, attention_mask=mask)
            out.backward(torch.ones_like(out))
        finally:
            attention._pass_values = False
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return _median_seconds({count: functools.partial(step, count) for count in [0, *buckets]},
                           repeats, device)
