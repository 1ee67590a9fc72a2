"""The unfused LSH kernel this scenario ran before issue 33, kept only as a comparison.

Queries and keys sorted separately (SMYRF's balanced clusters), blocks of c = ceil(s/B),
scores of each block materialised as `[b, n, B, c, c + 1]` (own key appended), a masked
fp32 softmax and a matmul on a c-column slice: ~25 kernels, the probabilities kept for
the backward. On an H200 (h1024 s8192, 16 buckets) it cost 1.70x dense causal
FlashAttention (../shared/notes/h200-acceptance-1.md). The scenario's kernel is
`kernels.lsh_attention`; scripts/bench_sparse_attention.py times both, and
tests/scenarios/test_scenario_sparse_attention.py shows the work guards failing on this one.
"""
from __future__ import annotations

import torch

from dynmo_plugin.scenarios.sparse_attention.kernels import _to_device

__all__ = ["lsh_attention_unfused"]


def _round(table: torch.Tensor, s: int, b: int, n: int, d: int, buckets: int,
           rotation, scale: float, want_lse: bool):
    """One hash round over `table` = [q | k | v] rows in (position, batch, head) order.
    Returns (out [rows, d], lse [rows] or None), rows in the same order."""
    rows = s * b * n
    c = -(-s // buckets)
    S = c * buckets
    with torch.no_grad():
        qk = table[:rows, :2 * d].view(rows, 2, d)
        proj = qk.float() @ _to_device(torch.as_tensor(rotation), table.device)         # [rows, 2, ceil(B/2)]
        bucket = torch.cat([proj, -proj], -1)[..., :buckets].argmax(-1)  # [rows, 2]
        bucket = bucket.view(s, b, n, 2).permute(1, 2, 3, 0)            # [b, n, 2, s]
        pos = torch.arange(s, device=table.device)
        perm = torch.argsort(bucket * s + pos, dim=-1)                  # positions, sorted
        group = (torch.arange(b, device=table.device)[:, None] * n
                 + torch.arange(n, device=table.device)[None, :])[..., None, None]
        flat = perm * (b * n) + group                                   # row ids
        if S > s:  # pad to B whole blocks with a zero row that is never a valid key
            flat = torch.cat([flat, flat.new_full((b, n, 2, S - s), rows)], -1)
            perm = torch.cat([perm, perm.new_full((b, n, 2, S - s), 2**40)], -1)
        pq, pk = perm[:, :, 0], perm[:, :, 1]
        fq, fk = flat[:, :, 0].reshape(-1), flat[:, :, 1].reshape(-1)
        masked = ~(pk.view(b, n, buckets, 1, c) < pq.view(b, n, buckets, c, 1))
        inverse = torch.empty(rows + 1, dtype=torch.long, device=table.device)
        inverse[fq] = torch.arange(b * n * S, device=table.device)
        inverse = inverse[:rows]
    gq = table.index_select(0, fq).view(b, n, buckets, c, 3 * d)      # query, own key, own value
    gk = table[:, d:].index_select(0, fk).view(b, n, buckets, c, 2 * d)  # key block, value block
    q, k_self, v_self = gq.split(d, -1)
    k, v = gk.split(d, -1)
    scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill(masked, float("-inf"))
    logits = torch.cat([scores, (q * k_self).sum(-1, keepdim=True)], -1) * scale
    wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # softmax in fp32 at least
    if want_lse:
        lse = torch.logsumexp(wide, -1, keepdim=True)
        probs = torch.exp(wide - lse).to(table.dtype)
    else:
        lse, probs = None, torch.softmax(wide, -1).to(table.dtype)
    out = torch.matmul(probs[..., :c], v) + probs[..., c:] * v_self    # [b, n, B, c, d]
    out = out.reshape(b * n * S, d).index_select(0, inverse)
    if lse is not None:
        lse = lse.reshape(b * n * S).index_select(0, inverse)
    return out, lse


def lsh_attention_unfused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: int,
                  rotations: list, scale: float) -> torch.Tensor:
    """Hash-bucketed causal attention (module docstring) on `[s, b, n, d]` inputs ->
    `[s, b, n * d]`; one round per rotation (each `[d, ceil(buckets/2)]`)."""
    s, b, n, d = q.shape
    table = torch.cat([q, k, v], -1).reshape(s * b * n, 3 * d)
    if -(-s // buckets) * buckets > s:
        table = torch.cat([table, table.new_zeros(1, 3 * d)])
    if len(rotations) == 1:
        out, _ = _round(table, s, b, n, d, buckets, rotations[0], scale, want_lse=False)
    else:
        parts = [_round(table, s, b, n, d, buckets, r, scale, want_lse=True) for r in rotations]
        weights = torch.softmax(torch.stack([lse for _, lse in parts]), 0).to(q.dtype)
        out = sum(w[:, None] * o for w, (o, _) in zip(weights, parts))
    return out.view(s, b, n * d)
