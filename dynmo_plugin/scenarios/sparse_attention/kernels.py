"""Hash-bucketed causal attention through fused attention on sorted token chunks.

Pure torch (no Megatron): the kernel `LSHCoreAttention` (layer.py) calls, on Megatron's
`[s, b, heads, head_dim]` query/key/value.

Semantics (one hash round, B > 1 buckets, chunk length c):

1. every token of each (sample, head) gets ONE bucket: Reformer's angular LSH,
   argmax([xR, -xR]) over the first B entries, of x = q + k, the sum of the token's
   query and key, in float32 (with tied queries and keys, Reformer's shared-QK, it is
   exactly Reformer's hash; one shared sort needs one bucket per token);
2. the tokens are stably sorted by (bucket, position) and cut into consecutive chunks of
   c = round_up(s / B, multiple) tokens (`chunk_tokens`; the last chunk padded with
   tokens that are never attended), and inside each chunk re-ordered by position;
3. a token attends the tokens of its own chunk at its position or before (itself
   included, so no row is empty): fused causal attention (SDPA; FlashAttention on a
   GPU) on [b * heads * chunks, c, head_dim], one call for all chunks.

Step 2's re-ordering makes "before in the chunk" the same as "before in the sequence", so
the causal flag of the fused kernel is exact causality even where a chunk holds the tail
of one bucket and the head of the next. Cost: the chunks' causal attention, ~ s * c / 2
query-key pairs per (sample, head) (1/B of dense causal attention when c = s/B), plus
O(s d) for hashing, two sorts of s integers and the gathers. Nothing of size s * c is
kept for the backward: the fused kernel keeps its inputs, output and log-sum-exp.

Several rounds (`rotations`): every round sorts and chunks independently; all rounds run
in the same fused call and their outputs are averaged (not Reformer's log-sum-exp
weighting, which needs the gradient of each round's softmax normaliser; a fused kernel
does not return one that autograd can differentiate).
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from dynmo_plugin.scenarios.shapes import round_up

__all__ = ["CHUNK_MULTIPLE", "chunk_tokens", "hash_rotation", "dense_causal_attention",
           "lsh_attention", "token_buckets"]

CHUNK_MULTIPLE = 64  # tokens: a multiple of FlashAttention's tile rows and of 8 (bf16 GEMMs)


def chunk_tokens(s: int, buckets: int, multiple: int = CHUNK_MULTIPLE) -> int:
    """Tokens per chunk: s/B rounded up to `multiple`, at most s (one chunk = dense)."""
    return round_up(s / max(buckets, 1), multiple, s)


def hash_rotation(seed: int, layer: int, iteration: int, microbatch: int, round_: int,
                  head_dim: int, buckets: int) -> torch.Tensor:
    """The random rotation `[head_dim, ceil(buckets/2)]` (float32, CPU) of one hash round."""
    key = f"lsh/{seed}/{layer}/{iteration}/{microbatch}/{round_}".encode()
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % 2**63
    gen = torch.Generator().manual_seed(value)
    return torch.randn(head_dim, (buckets + 1) // 2, generator=gen, device="cpu")


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


def token_buckets(q: torch.Tensor, k: torch.Tensor, rotations: list[torch.Tensor],
                  buckets: int) -> torch.Tensor:
    """Semantics step 1 for every round: `[s, b, n, rounds]` bucket ids (int64), hashed in
    float32 from the detached inputs (hashing has no gradient)."""
    with torch.no_grad():
        x = (q + k).float()
        rot = _to_device(torch.cat(rotations, 1), q.device)            # [d, rounds * half]
        proj = (x @ rot).unflatten(-1, (len(rotations), -1))           # [s, b, n, rounds, half]
        return torch.cat([proj, -proj], -1)[..., :buckets].argmax(-1)


def _slots(bucket: torch.Tensor, c: int) -> torch.Tensor:
    """Semantics step 2: `[b, n, rounds, S]` positions (S = chunks * c), chunk after chunk,
    each chunk in position order; padding positions s..S-1 close the last chunk."""
    s = bucket.shape[0]
    order = bucket.permute(1, 2, 3, 0).sort(dim=-1, stable=True).indices  # (bucket, position)
    S = -(-s // c) * c
    if S > s:
        pad = torch.arange(s, S, device=order.device).expand(*order.shape[:-1], S - s)
        order = torch.cat([order, pad], -1)
    return order.unflatten(-1, (S // c, c)).sort(-1).values.flatten(-2)


class _PermuteRows(torch.autograd.Function):
    """x.index_select(0, index) whose backward is a gather too: `index` holds every row of x
    `copies` times and `inverse` is where each (copy, row) went, so the gradient is
    g.index_select(0, inverse) summed over the copies, with no scatter-add (index_add:
    atomics on a GPU, and a sort-based kernel under deterministic mode)."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies: int):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        grad = g.index_select(0, inverse)
        if ctx.copies > 1:
            grad = grad.view(ctx.copies, -1, *g.shape[1:]).sum(0)
        return grad, None, None, None


def lsh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: int,
                  rotations: list[torch.Tensor], scale: float,
                  multiple: int = CHUNK_MULTIPLE) -> torch.Tensor:
    """Hash-bucketed causal attention (module docstring) on `[s, b, n, d]` inputs ->
    `[s, b, n * d]`; one round per rotation (each `[d, ceil(buckets/2)]`), chunks of
    `chunk_tokens(s, buckets, multiple)` tokens."""
    s, b, n, d = q.shape
    rounds, c = len(rotations), chunk_tokens(s, buckets, multiple)
    S = -(-s // c) * c
    with torch.no_grad():
        slots = _slots(token_buckets(q, k, rotations, buckets), c)     # [b, n, rounds, S]
        head = torch.arange(b * n, device=q.device).view(b, n, 1, 1)
        rows = slots * (b * n) + head                                   # table rows, sorted
        # where each (round, table row) went in the sorted order (the inverse permutation):
        # the un-sort's gather
        tagged = rows if rounds == 1 else rows + torch.arange(
            0, rounds * S * b * n, S * b * n, device=q.device).view(rounds, 1)
        tagged = tagged.flatten()
        unsort = tagged.argsort()
    # one [S * b * n, 3d] table in Megatron's (position, sample, head) order, zero rows as
    # the padding positions: gathers and the un-sort are row index_selects, no transposes
    table = torch.cat([q, k, v], -1).reshape(s * b * n, 3 * d)
    if S > s:
        table = torch.cat([table, table.new_zeros((S - s) * b * n, 3 * d)])
    chunks = _PermuteRows.apply(table, rows.flatten(), unsort, rounds).view(b * n * rounds * (S // c), c, 3 * d)
    qc, kc, vc = (x.unsqueeze(1) for x in chunks.split(d, -1))         # [chunks, 1, c, d]
    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
    out = _PermuteRows.apply(out.reshape(-1, d), unsort, tagged, 1).view(rounds, S * b * n, d)
    if S > s:
        out = out[:, :s * b * n]
    return (out.view(s * b * n, d) if rounds == 1 else out.mean(0)).view(s, b, n * d)
