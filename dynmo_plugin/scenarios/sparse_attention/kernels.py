"""Hash-bucketed causal attention through fused attention on sorted token chunks.

Pure torch (no Megatron): the kernel `LSHCoreAttention` (layer.py) calls, on Megatron's
`[s, b, heads, head_dim]` query/key/value.

Semantics (one hash round, B > 1 buckets, chunk length c):

1. every token of each (sample, head) gets ONE bucket: Reformer's angular LSH,
   argmax(x [R, -R]) over the first B columns, of x = q + k, the sum of the token's query
   and key, in float32 (computed as [q | k] [M; M] with M = [R, -R][:, :B]: one matmul
   over the token's query and key as they lie in the QKV projection's output; with tied
   queries and keys, Reformer's shared-QK, it is exactly Reformer's hash; one shared sort
   needs one bucket per token);
2. the tokens are stably sorted by (bucket, position) and cut into consecutive chunks of
   c = round_up(s / B, multiple) tokens (`chunk_tokens`; the last chunk padded with
   tokens that are never attended), and inside each chunk re-ordered by position;
3. a token attends the tokens of its own chunk at its position or before (itself
   included, so no row is empty): fused causal attention (SDPA; FlashAttention on a
   GPU) on [chunks, b * heads, c, head_dim], one call for all chunks.

Step 2's re-ordering makes "before in the chunk" the same as "before in the sequence", so
the causal flag of the fused kernel is exact causality even where a chunk holds the tail
of one bucket and the head of the next. Cost: the chunks' causal attention, ~ s * c / 2
query-key pairs per (sample, head) (1/B of dense causal attention when c = s/B), plus
O(s d) for hashing, two sorts of s integers, one gather and one scatter. Nothing of size
s * c is kept for the backward: the fused kernel keeps its inputs, output and
log-sum-exp.

Kernels (a GPU host enqueues each one: at long sequences the layer is host-bound unless
they are few): forward the hash matmul's fp32 copy, the matmul, argmax, two sorts, one
gather of [q | k | v] rows into sorted order, the fused attention and one scatter back;
backward a gather, the fused attention's backward, one concatenation of its three
gradients and one scatter. No transposes: the gathers and scatters index Megatron's own
(position, sample, head) row order, and the attention reads its chunks as strided views
(batch = chunks, heads = sample x head). Where q, k and v are the adjacent slices of
Megatron's fused QKV projection (multi-head attention without rotary embeddings) the
[q | k | v] rows are that output itself, with no copy.

Several rounds (`rotations`): every round sorts and chunks independently; all rounds run
in the same fused call and their outputs are averaged (not Reformer's log-sum-exp
weighting, which needs the gradient of each round's softmax normaliser; a fused kernel
does not return one that autograd can differentiate).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dynmo_plugin.scenarios.shapes import round_up

__all__ = ["CHUNK_MULTIPLE", "chunk_tokens", "hash_rotation", "hash_matrix", "dense_causal_attention",
           "lsh_attention", "qkv_table", "token_buckets"]

CHUNK_MULTIPLE = 64  # tokens: a multiple of FlashAttention's tile rows and of 8 (bf16 GEMMs)


def chunk_tokens(s: int, buckets: int, multiple: int = CHUNK_MULTIPLE) -> int:
    """Tokens per chunk: s/B rounded up to `multiple`, at most s (one chunk = dense)."""
    return round_up(s / max(buckets, 1), multiple, s)


def hash_rotation(seed: int, layer: int, iteration: int, microbatch: int, round_: int,
                  head_dim: int, buckets: int) -> np.ndarray:
    """The random rotation `[head_dim, ceil(buckets/2)]` (float32) of one hash round, drawn
    on the host with numpy: a pure function of its arguments, and no device or dispatcher
    work in the layer's forward (a torch draw there is an op the host dispatches)."""
    key = f"lsh/{seed}/{layer}/{iteration}/{microbatch}/{round_}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(value).standard_normal((head_dim, (buckets + 1) // 2), dtype=np.float32)


def hash_matrix(rotations: Sequence[np.ndarray], buckets: int) -> np.ndarray:
    """`[2 * head_dim, rounds * buckets]` float32: per round M = [R, -R][:, :buckets], the
    rounds side by side, stacked twice so that [q | k] @ it = (q + k) @ M (semantics 1)."""
    m = np.concatenate([np.concatenate([r, -r], 1)[:, :buckets] for r in map(np.asarray, rotations)], 1)
    return np.ascontiguousarray(np.concatenate([m, m], 0), dtype=np.float32)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """SDPA causal on `[s, b, n, d]` inputs -> `[s, b, n * d]`."""
    s, b, n, d = q.shape
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                         v.permute(1, 2, 0, 3), is_causal=True, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory without waiting (a plain
    copy from pageable memory synchronises the host in every layer)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _adjacent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q, k, v are the slices [q | k | v] of each row of one tensor (Megatron's
    fused QKV projection, split without a copy): same base, strides and shape, k right
    after q and v right after k, and (sample, head) mergeable into one dimension."""
    base = q._base
    if base is None or k._base is not base or v._base is not base:
        return False
    s, b, n, d = q.shape
    st = q.stride()
    return (k.shape == q.shape == v.shape and k.stride() == st == v.stride() and st[3] == 1
            and st[2] == 3 * d and st[1] == n * st[2]
            and k.storage_offset() == q.storage_offset() + d
            and v.storage_offset() == q.storage_offset() + 2 * d)


def qkv_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`[s, b * n, 3d]` rows [q | k | v] in Megatron's (position, sample, head) order,
    detached: a view of the fused QKV projection where q, k, v are its adjacent slices,
    else one concatenation."""
    s, b, n, d = q.shape
    if _adjacent(q, k, v):
        return q.detach().as_strided((s, b * n, 3 * d), (q.stride(0), 3 * d, 1))
    with torch.no_grad():
        return torch.cat([q, k, v], -1).view(s, b * n, 3 * d)


def token_buckets(table: torch.Tensor, rotations: Sequence[np.ndarray], buckets: int) -> torch.Tensor:
    """Semantics step 1 for every round: `[s, b * n, rounds]` bucket ids (int64) of the
    rows of `qkv_table`, in float32 (hashing has no gradient)."""
    s, bn, d3 = table.shape
    with torch.no_grad():
        m = _to_device(torch.from_numpy(hash_matrix(rotations, buckets)), table.device)
        x = table[..., :2 * d3 // 3].reshape(s * bn, 2 * d3 // 3).float()
        return (x @ m).view(s, bn, len(rotations), buckets).argmax(-1)


def _sorted_positions(bucket: torch.Tensor, c: int) -> torch.Tensor:
    """Semantics step 2: `[b * n, rounds, S]` positions (S = chunks * c), chunk after chunk,
    each chunk in position order; padding positions s..S-1 close the last chunk."""
    s = bucket.shape[0]
    order = bucket.permute(1, 2, 0).sort(dim=-1, stable=True).indices  # (bucket, position)
    S = -(-s // c) * c
    if S > s:
        pad = torch.arange(s, S, device=order.device).expand(*order.shape[:-1], S - s)
        order = torch.cat([order, pad], -1)
    return order.unflatten(-1, (S // c, c)).sort(-1).values.flatten(-2)


def _words(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as 8-byte words along its last dimension where its layout allows (a bf16
    row of 3d values is 3d/4 words): the gathers and scatters below move rows, not
    values, and a GPU gather/scatter costs an index read per element it moves."""
    ratio = 8 // t.element_size()
    if ratio <= 1 or t.stride(-1) != 1 or t.shape[-1] % ratio or t.storage_offset() % ratio \
            or any(st % ratio for st in t.stride()[:-1]):
        return t
    return t.view(torch.int64)


def _index(rank: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The sorted positions `rank` [rounds * S, bn, 1] expanded over `t`'s last dimension."""
    return rank.expand(-1, -1, t.shape[-1])


class _Gather(torch.autograd.Function):
    """Rows of the (padded) `table` [S, bn, 3d] into sorted order, `[rounds * S, bn, 3d]`:
    one gather. Its backward is one scatter (each row goes to exactly one place per round,
    so no scatter-add: no atomics on a GPU), summed over the rounds; the gradients of q, k
    and v are views of it (Megatron's split backward concatenates them, as for dense)."""

    @staticmethod
    def forward(ctx, table, rank, s: int, rounds: int, q, k, v):
        ctx.save_for_backward(rank)
        ctx.rounds, ctx.shape = rounds, q.shape
        words = _words(table)
        return words.gather(0, _index(rank, words)).view(table.dtype)

    @staticmethod
    def backward(ctx, g):
        (rank,) = ctx.saved_tensors
        rounds, (s, b, n, d) = ctx.rounds, ctx.shape
        words = _words(g.contiguous())
        index = _index(rank, words)
        S = g.shape[0] // rounds
        if rounds == 1:
            grad = words.new_empty(words.shape).scatter_(0, index, words).view(g.dtype)
        else:
            shape = (rounds, S, *words.shape[1:])
            grad = words.new_empty(shape).scatter_(1, index.view(shape), words.view(shape)) \
                .view(g.dtype).sum(0)
        grad = grad[:s].view(s, b, n, 3 * d)
        return None, None, None, None, grad[..., :d], grad[..., d:2 * d], grad[..., 2 * d:]


class _Scatter(torch.autograd.Function):
    """The attention's output `[rounds * S, bn, d]` (sorted order) back to `[s, bn, d]`
    (averaged over rounds): one scatter; its backward one gather."""

    @staticmethod
    def forward(ctx, out, rank, s: int, rounds: int):
        ctx.save_for_backward(rank)
        ctx.s, ctx.rounds = s, rounds
        words = _words(out.contiguous())
        index = _index(rank, words)
        if rounds == 1:
            return words.new_empty(words.shape).scatter_(0, index, words).view(out.dtype)[:s]
        shape = (rounds, words.shape[0] // rounds, *words.shape[1:])
        return words.new_empty(shape).scatter_(1, index.view(shape), words.view(shape)) \
            .view(out.dtype).mean(0)[:s]

    @staticmethod
    def backward(ctx, g):
        (rank,) = ctx.saved_tensors
        s, rounds = ctx.s, ctx.rounds
        S = rank.shape[0] // rounds
        if S > s:  # padding positions: their outputs were dropped
            g = F.pad(g, (0, 0, 0, 0, 0, S - s))
        if rounds > 1:
            g = g / rounds
        words = _words(g.contiguous())
        index = _index(rank, words)
        if rounds == 1:
            return words.gather(0, index).view(g.dtype), None, None, None
        shape = (rounds, S, *words.shape[1:])
        grad = words.unsqueeze(0).expand(shape).gather(1, index.view(shape))
        return grad.view(g.dtype).flatten(0, 1), None, None, None


def lsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: int,
                  rotations: Sequence[np.ndarray], scale: float,
                  multiple: int = CHUNK_MULTIPLE) -> torch.Tensor:
    """Hash-bucketed causal attention (module docstring) on `[s, b, n, d]` inputs ->
    `[s, b, n * d]`; one round per rotation (each `[d, ceil(buckets/2)]`), chunks of
    `chunk_tokens(s, buckets, multiple)` tokens."""
    s, b, n, d = q.shape
    bn, rounds, c = b * n, len(rotations), chunk_tokens(s, buckets, multiple)
    S = -(-s // c) * c
    table = qkv_table(q, k, v)
    with torch.no_grad():
        pos = _sorted_positions(token_buckets(table, rotations, buckets), c)   # [bn, rounds, S]
        if S > s:  # zero rows for the padding positions (never attended)
            table = torch.cat([table, table.new_zeros(S - s, bn, 3 * d)])
    rank = pos.reshape(bn, rounds * S).t().unsqueeze(-1)                      # [rounds*S, bn, 1]
    rows = _Gather.apply(table, rank, s, rounds, q, k, v)
    # [chunks, bn, c, d] strided views: batch = chunks, heads = (sample, head)
    qc, kc, vc = (x.unflatten(0, (-1, c)).transpose(1, 2) for x in rows.split(d, -1))
    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
    out = out.transpose(1, 2).flatten(0, 1)                                    # [rounds*S, bn, d]
    return _Scatter.apply(out, rank, s, rounds).view(s, b, n * d)
