"""Sparse attention's kernel: fused causal attention on sorted token chunks
(dynmo_plugin/scenarios/sparse_attention/kernels.py), against a reference written
independently (dense attention with a chunk mask), and the work it dispatches.

The semantics are the kernel module's docstring. Tolerances: float64 inputs agree with
the reference to 1e-12 (outputs) and 1e-10 (gradients); bf16 inputs to 3e-2 absolute
(outputs of magnitude <= ~3; bf16 has 8 bits of mantissa, the reference runs in float64
from the same bf16 inputs and the same buckets).

The guards count work instead of timing it (a GPU is not needed): one forward + backward
traced with OpTrace (profiling/op_trace.py) at s and 2s, and each guard also measured on
the kernel this scenario ran before issue 33 (unfused.py), which must violate it (the
guard can fail; 1.70x of dense FlashAttention on an H200).
"""
import math

import numpy as np
import pytest
import torch

from dynmo_plugin.profiling.op_trace import OpTrace
from dynmo_plugin.scenarios.sparse_attention import kernels
from dynmo_plugin.scenarios.sparse_attention.kernels import (chunk_tokens, dense_causal_attention,
                                                             hash_matrix, hash_rotation, lsh_attention)
from dynmo_plugin.scenarios.sparse_attention.unfused import lsh_attention_unfused


# ---- the reference: the same semantics, written out densely ----------------------------------
def reference(q, k, v, buckets, rotations, scale, multiple):
    """Per (sample, head, round): each token's bucket, argmax of (q + k) [R, -R][:, :B] in
    float32, computed as [q | k] [M; M] (kernels.hash_matrix), tokens ranked by (bucket,
    position) with Python's sort, chunk = rank // c; a token attends the tokens of its
    chunk at or before its position; rounds averaged."""
    s, b, n, d = q.shape
    c = chunk_tokens(s, buckets, multiple)
    pos = torch.arange(s)
    out = torch.zeros(s, b, n, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(n):
            rounds = []
            for rot in rotations:
                m = torch.from_numpy(hash_matrix([rot], buckets))
                bucket = (torch.cat([q[:, bi, h], k[:, bi, h]], -1).float() @ m).argmax(-1).tolist()
                ranked = sorted(range(s), key=lambda t: (bucket[t], t))
                chunk = torch.empty(s, dtype=torch.long)
                for rank, t in enumerate(ranked):
                    chunk[t] = rank // c
                allowed = (chunk[:, None] == chunk[None, :]) & (pos[None, :] <= pos[:, None])
                logits = (q[:, bi, h].double() @ k[:, bi, h].double().T * scale)
                weights = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
                rounds.append(weights @ v[:, bi, h].double())
            out[:, bi, h] = sum(rounds) / len(rounds)
    return out.reshape(s, b, n * d)


def _inputs(s, b, n, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, n, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("s,buckets,hashes,multiple", [
    (64, 4, 1, 8), (60, 8, 1, 8), (50, 3, 2, 4), (33, 33, 1, 1), (48, 2, 3, 8), (100, 4, 1, 16),
    (128, 8, 1, 64)])  # the last: c rounded up from 16 to 64 tokens, 2 chunks
def test_kernel_matches_the_dense_reference(s, buckets, hashes, multiple):
    q, k, v = _inputs(s, 2, 3, 8, seed=s)
    rotations = [hash_rotation(7, 3, 11, 0, r, 8, buckets) for r in range(hashes)]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got = lsh_attention(q, k, v, buckets, rotations, 0.3, multiple)
    ref = reference(q, k, v, buckets, rotations, 0.3, multiple)
    assert torch.allclose(got, ref, atol=1e-12, rtol=0)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    assert all(torch.allclose(a, w, atol=1e-10, rtol=0) for a, w in zip(grads, want))


def test_kernel_matches_the_reference_in_bf16():
    q, k, v = _inputs(256, 1, 2, 32, seed=4, dtype=torch.bfloat16)
    rotations = [hash_rotation(1, 2, 3, 0, 0, 32, 4)]
    got = lsh_attention(q, k, v, 4, rotations, 32 ** -0.5)
    assert got.dtype == torch.bfloat16
    err = (got.double() - reference(q, k, v, 4, rotations, 32 ** -0.5, 64)).abs().max()
    assert err < 3e-2, err


def test_qkv_read_in_place_equals_separate_tensors():
    """q, k, v as the adjacent slices of one projection (Megatron's fused QKV, split
    without a copy: the kernel reads its rows in place) give the same outputs and
    gradients, bit for bit, as the same values in three separate tensors (one copy)."""
    s, b, n, d = 192, 2, 3, 16
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(s, b, n, 3 * d, generator=gen).requires_grad_()
    fused = mixed.split(d, -1)
    apart = [x.detach().clone().requires_grad_() for x in fused]
    assert kernels._adjacent(*fused) and not kernels._adjacent(*apart)
    assert not kernels._adjacent(fused[1], fused[0], fused[2])     # order matters
    rot = [hash_rotation(3, 1, 2, 0, r, d, 8) for r in range(2)]
    g = torch.randn(s, b, n * d, generator=gen)
    outs = [lsh_attention(*qkv, 8, rot, 0.25, 16) for qkv in (fused, apart)]
    assert torch.equal(outs[0], outs[1])
    (grad,) = torch.autograd.grad(outs[0], mixed, g)
    assert torch.equal(grad, torch.cat(torch.autograd.grad(outs[1], apart, g), -1))


def test_causal_and_chunked():
    """An output never depends on a later token's value; with one chunk (c = s) it is
    dense causal attention; the bucket's chunk is really a subset (not dense)."""
    q, k, v = _inputs(128, 1, 2, 8, seed=0)
    rot = [hash_rotation(0, 1, 0, 0, 0, 8, 4)]
    base = lsh_attention(q, k, v, 4, rot, 0.35, 8)
    v2 = v.clone()
    v2[80:] -= 3.0
    assert torch.equal(lsh_attention(q, k, v2, 4, rot, 0.35, 8)[:80], base[:80])
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    lsh_attention(q, k, v, 4, rot, 0.35, 8)[:80].square().sum().backward()
    assert all(torch.equal(x.grad[80:], torch.zeros_like(x.grad[80:])) for x in (q, v))
    dense = dense_causal_attention(q, k, v, 0.35)
    assert torch.allclose(lsh_attention(q, k, v, 4, rot, 0.35, 128), dense, atol=1e-12)
    assert not torch.allclose(base, dense, atol=1e-3)


def test_dense_path_is_causal_softmax_attention():
    q, k, v = _inputs(40, 2, 2, 8, seed=1)
    logits = torch.einsum("sbnd,tbnd->bnst", q, k) * 0.3
    logits = logits.masked_fill(torch.triu(torch.ones(40, 40, dtype=torch.bool), 1), -math.inf)
    expected = torch.einsum("bnst,tbnd->sbnd", torch.softmax(logits, -1), v).reshape(40, 2, 16)
    assert torch.allclose(dense_causal_attention(q, k, v, 0.3), expected, atol=1e-12)


def test_hashing_is_the_same_for_any_split_of_heads_and_samples():
    """One rotation for all heads and samples: a TP split of the heads or a different
    micro-batching of the samples computes exactly the same outputs."""
    q, k, v = _inputs(128, 2, 4, 16, seed=2, dtype=torch.float32)
    rot = [hash_rotation(5, 2, 9, 0, 0, 16, 8)]
    whole = lsh_attention(q, k, v, 8, rot, 0.25, 16).view(128, 2, 4, 16)
    heads = torch.cat([lsh_attention(q[:, :, h:h + 2], k[:, :, h:h + 2], v[:, :, h:h + 2], 8, rot, 0.25, 16)
                       .view(128, 2, 2, 16) for h in (0, 2)], 2)
    samples = torch.cat([lsh_attention(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], 8, rot, 0.25, 16)
                         .view(128, 1, 4, 16) for i in (0, 1)], 1)
    assert torch.allclose(heads, whole, atol=1e-6) and torch.allclose(samples, whole, atol=1e-6)


def test_rotation_is_a_pure_function_of_its_seed_tuple():
    a = hash_rotation(1, 2, 3, 4, 0, 8, 16)
    assert a.shape == (8, 8) and a.dtype == np.float32 and np.array_equal(a, hash_rotation(1, 2, 3, 4, 0, 8, 16))
    others = [hash_rotation(*args, 8, 16) for args in
              [(2, 2, 3, 4, 0), (1, 3, 3, 4, 0), (1, 2, 4, 4, 0), (1, 2, 3, 5, 0), (1, 2, 3, 4, 1)]]
    assert not any(np.array_equal(a, o) for o in others)
    m = hash_matrix([a, -a], 5)   # per round [R, -R][:, :B], side by side, stacked twice
    assert m.shape == (16, 10) and np.array_equal(m[:8], m[8:])
    assert np.array_equal(m[:8, :5], np.concatenate([a, -a], 1)[:, :5]) and np.array_equal(m[:8, 5:], -m[:8, :5])


def test_chunk_lengths_are_multiples_of_the_granularity():
    assert [chunk_tokens(8192, b) for b in (1, 2, 16, 64, 128, 1000)] == [8192, 4096, 512, 128, 64, 64]
    assert chunk_tokens(1000, 16) == 64 and chunk_tokens(1000, 3) == 384 and chunk_tokens(40, 4) == 40


# ---- guards: what one forward + backward dispatches (bf16, CPU) -------------------------------
_aten = torch.ops.aten
_SDPA = {"aten._scaled_dot_product_flash_attention_for_cpu",
         "aten._scaled_dot_product_flash_attention_for_cpu_backward"}


class CausalTrace(OpTrace):
    """OpTrace, plus FLOPs for torch's CPU fused attention (which torch's FLOP registry does
    not know): its formula for the CUDA kernels, counting a causal call only for the query-
    key pairs on or below the diagonal - what a causal FlashAttention computes. (Added here:
    OpTrace records no arguments, and a causal flag is one.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func.overloadpacket)
        if name in _SDPA:
            from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
            backward = name.endswith("_backward")
            q, k, v = (args[1:4] if backward else args[:3])
            causal = (args[7] if backward else args[4]) if len(args) > (7 if backward else 4) \
                else (kwargs or {}).get("is_causal", False)
            full = (sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape) if backward
                    else sdpa_flop_count(q.shape, k.shape, v.shape))
            L = q.shape[-2]
            record = self.ops[-1]
            self.ops[-1] = type(record)(**{**record.__dict__,
                                           "flops": full * (L + 1) // (2 * L) if causal else full})
        return out


def trace(kernel, s, buckets, b=1, n=2, d=32, seed=0):
    """(OpTrace of one forward + backward in bf16, element counts of the saved tensors'
    storages) of `kernel` at [s, b, n, d]."""
    q, k, v = (x.requires_grad_() for x in _inputs(s, b, n, d, seed, torch.bfloat16))
    rotations = [hash_rotation(0, 1, 0, 0, 0, d, buckets)]
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes() // t.element_size())
        return t

    with CausalTrace() as tr, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if buckets == 1:
            out = dense_causal_attention(q, k, v, d ** -0.5)
        else:
            out = kernel(q, k, v, buckets, rotations, d ** -0.5)
        out.float().sum().backward()
    return tr, saved


KERNELS = {"chunked": lsh_attention, "unfused (before issue 33)": lsh_attention_unfused}


def _hash_flops(s, b, n, d, buckets):
    """The hash projection's FLOPs: s*b*n rows [q | k] of 2d times [2d, B] (kernels.hash_matrix),
    float32 (4x the minimal (q + k) R: no add and no negation kernels, B/16 of a projection)."""
    return 2 * s * b * n * 2 * d * buckets


def flops_ok(kernel, s=1024, buckets=16):
    """Attention FLOPs <= 1/B of dense causal attention (with 5% for the chunks' own
    diagonals: c(c+1)/2 pairs per chunk against s(s+1)/(2B)) plus the hashing."""
    dense = trace(kernel, s, 1)[0].flops()
    sparse = trace(kernel, s, buckets)[0].flops()
    return sparse <= 1.05 * dense / buckets + _hash_flops(s, 1, 2, 32, buckets), (sparse, dense)


def kernels_ok(kernel, budget=14, buckets=16):
    """Kernels of a forward + backward: at most dense's + `budget`, and the excess the same
    at s and 2s (no per-chunk or per-bucket loop). Measured 14 (q, k, v separate tensors
    here: one concatenation into [q | k | v] rows and three copies into their .grad);
    24 before the hash, sort and gathers were fused (issue 33), 66 for the unfused kernel."""
    extra = [trace(kernel, s, buckets)[0].kernels() - trace(kernel, s, 1)[0].kernels()
             for s in (1024, 2048)]
    return extra[0] == extra[1] <= budget, extra


def saved_ok(kernel, s=2048, buckets=8, b=1, n=2):
    """No saved tensor (its whole storage) holds b*n*s*c elements (c = 256 > 3d = 96 here,
    so the kernel's own [b*n*s, 3d] gathered table is below it)."""
    c = chunk_tokens(s, buckets)
    largest = max(trace(kernel, s, buckets, b, n)[1])
    return largest < b * n * s * c, (largest, b * n * s * c)


def shapes_ok(kernel, s=1000, buckets=16):
    """bf16 matmul dimensions multiples of 8; the fused kernels' sequence lengths (chunk
    lengths) multiples of 64 and head dims of 8. s = 1000: 62.5 tokens per bucket."""
    tr = trace(kernel, s, buckets)[0]
    dims = [d for op in tr.matmuls() if op.dtype == "bfloat16" for shape in op.inputs for d in shape[-2:]]
    fused = [op.inputs[0 if op.name.endswith("_cpu") else 1] for op in tr.ops if op.name in _SDPA]
    bad = [d for d in dims if d % 8] + [sh for sh in fused if sh[-2] % 64 or sh[-1] % 8]
    return not bad and fused != [], bad


def host_reads_ok(kernel, s=1024, buckets=16):
    reads = trace(kernel, s, buckets)[0].host_reads()
    return not reads, reads


GUARDS = {"flops": flops_ok, "kernels": kernels_ok, "saved": saved_ok, "shapes": shapes_ok}


@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_guard_holds_for_the_chunked_kernel_and_fails_the_unfused_one(guard):
    ok, detail = GUARDS[guard](lsh_attention)
    assert ok, detail
    ok, detail = GUARDS[guard](lsh_attention_unfused)
    assert not ok, f"the guard cannot fail: the unfused kernel passes it too ({detail})"


def test_no_host_reads():
    """Nothing the host waits for (shown failing by an `int(bucket.max())` put into
    kernels.token_buckets: 1 read, `aten._local_scalar_dense`)."""
    ok, reads = host_reads_ok(lsh_attention)
    assert ok, reads


def test_dense_is_counted():
    """The FLOP guard's reference is not zero: the CPU fused kernel is counted."""
    tr = trace(lsh_attention, 1024, 1)[0]
    assert tr.flops() == 14 * 2 * 32 * (1024 * 1025 // 2)  # torch: fwd 4 + bwd 10 per pair and dim
