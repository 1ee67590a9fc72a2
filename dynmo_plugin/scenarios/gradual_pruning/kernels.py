"""Gradual global magnitude pruning: schedule, global threshold, masks, sparse linear.

The scenario (DynMo spec, issue 10): every `dt` iterations the target sparsity follows
Zhu & Gupta's cubic schedule; the weights pruned are the globally smallest magnitudes
over all decoder linear weights of all pipeline stages, found as in the paper's
Algorithm 1 (each stage sends its local top-k candidates to one rank, the global
threshold is computed there and sent back). Pruned weights stay exactly zero (masks on
weights and gradients, Adam state zeroed), and a linear whose sparsity is above the
measured crossover runs a CSR kernel, so pruned layers really get cheaper and the
pipeline gets the uneven per-stage load that DynMo rebalances.

Everything here is torch-only and single-process. The collective part of Algorithm 1
is left to the caller, in this order::

    k = num_to_keep(total, s)                    # total = numel over ALL stages
    cand = local_candidates(stage_weights, k)    # on every stage
    # gather every stage's `cand` to one rank (lengths differ: pad or gather_object)
    tau = global_threshold(all_cands, total, s)  # on that rank, then broadcast tau
    mask = old_mask & magnitude_mask(w, tau)     # on every stage, per weight

Not thread-safe in any special way; no global state.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.hooks import RemovableHandle

__all__ = [
    "CHUNK_ROWS",
    "CROSSOVER",
    "CsrPattern",
    "SparseLinearFunction",
    "apply_mask_",
    "cubic_sparsity",
    "global_threshold",
    "is_pruning_step",
    "local_candidates",
    "magnitude_mask",
    "mask_grad_",
    "masked_linear",
    "num_to_keep",
    "register_grad_mask",
    "use_sparse",
    "zero_adam_state_",
]

# Measured on CPU (notes "dynamism-on-cpu", section "Unstructured pruning"): for a full
# training step of one linear (h 256-1024, 512-4096 tokens) the CSR path with
# `SparseLinearFunction` breaks even with a dense masked matmul at ~85% sparsity
# (dense/sparse 1.6x at 90%, 2.3x at 95%; forward alone loses at 75%: 0.64x). Below
# it the dense masked matmul is faster. Re-measure before trusting it on GPU.
CROSSOVER = 0.85

# Rows (tokens) per sparse kernel call; the measured speed-ups above used 512.
CHUNK_ROWS = 512

# Adam(W) state entries that carry a per-element history of the gradient.
_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


# --------------------------------------------------------------------------- schedule

def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"{name} must be an integer, got {value!r}") from e


def _check_schedule(t0: int, n: int, dt: int, s_init: float, s_final: float) -> None:
    if t0 < 0:
        raise ValueError(f"t0 must be >= 0 (first pruning iteration), got {t0}")
    if n < 1:
        raise ValueError(f"n must be >= 1 (number of pruning steps), got {n}")
    if dt < 1:
        raise ValueError(f"dt must be >= 1 (iterations between pruning steps), got {dt}")
    for name, s in (("s_init", s_init), ("s_final", s_final)):
        if not (isinstance(s, (int, float)) and not isinstance(s, bool) and 0.0 <= s <= 1.0):
            raise ValueError(f"{name} must be a sparsity in [0, 1], got {s!r}")
    if s_init > s_final:
        raise ValueError(f"s_init ({s_init}) must be <= s_final ({s_final}): the schedule only "
                         "prunes more, it never regrows weights")


def cubic_sparsity(t: int, t0: int, n: int, dt: int, s_init: float, s_final: float) -> float:
    """Target sparsity at iteration `t` (Zhu & Gupta 2017, "To prune, or not to prune").

    S_t = S_f + (S_i - S_f) * (1 - (t - t0) / (n * dt))**3 for t in {t0, t0+dt, ...,
    t0+n*dt}. Between pruning steps the sparsity of the latest step holds (it only
    changes every `dt` iterations); before `t0` it is `s_init`, after `t0 + n*dt` it
    is `s_final`. Non-decreasing in `t`.

    Raises:
        ValueError: a non-integer `t`/`t0`/`n`/`dt`, `t0 < 0`, `n < 1`, `dt < 1`, a
            sparsity outside [0, 1], or `s_init > s_final`; the message names it.
    """
    t, t0, n, dt = (_as_int(k, v) for k, v in (("t", t), ("t0", t0), ("n", n), ("dt", dt)))
    _check_schedule(t0, n, dt, s_init, s_final)
    if t < t0:
        return float(s_init)
    steps = min(n, (t - t0) // dt)
    if steps == 0:  # exact endpoints (the formula rounds: 0.9 + (0.1 - 0.9) != 0.1)
        return float(s_init)
    if steps == n:
        return float(s_final)
    return float(s_final + (s_init - s_final) * (1.0 - steps / n) ** 3)


def is_pruning_step(t: int, t0: int, n: int, dt: int) -> bool:
    """True at the iterations where the schedule's sparsity changes: t0, t0+dt, ..., t0+n*dt.

    Raises:
        ValueError: as `cubic_sparsity` for `t`, `t0`, `n`, `dt`.
    """
    t, t0, n, dt = (_as_int(k, v) for k, v in (("t", t), ("t0", t0), ("n", n), ("dt", dt)))
    _check_schedule(t0, n, dt, 0.0, 0.0)
    return t0 <= t <= t0 + n * dt and (t - t0) % dt == 0


# ------------------------------------------------------------------ global threshold

def num_to_keep(total: int, sparsity: float) -> int:
    """Weights kept when `sparsity` of `total` are pruned: ceil((1 - sparsity) * total).

    Computed as `total - floor(sparsity * total)`, with `sparsity * total` snapped to
    the nearest integer when it is within float rounding of it (0.7 * 10 keeps 3,
    not 4 as a plain ceil((1 - 0.7) * 10) = ceil(3.0000000000000004) would).

    Raises:
        ValueError: `total < 0` or `sparsity` outside [0, 1].
    """
    total = _as_int("total", total)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if isinstance(sparsity, bool) or not (0.0 <= sparsity <= 1.0):
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    pruned = sparsity * total
    nearest = round(pruned)
    n_pruned = nearest if math.isclose(pruned, nearest, rel_tol=1e-12, abs_tol=1e-9) \
        else math.floor(pruned)
    return total - min(total, max(0, n_pruned))


@torch.no_grad()
def local_candidates(weights: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """The `k` largest |w| of one stage's weights, descending (what a stage sends).

    Fewer than `k` values come back when the stage holds fewer than `k` weights. Pass
    `k = num_to_keep(total, sparsity)` with the GLOBAL total (see `global_threshold`
    for why that is enough). Memory is O(k) per tensor, not O(numel of the stage).

    Raises:
        ValueError: `k < 0`.
    """
    k = _as_int("k", k)
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    per_tensor = []
    for w in weights:
        flat = w.detach().reshape(-1).abs()
        per_tensor.append(torch.topk(flat, min(k, flat.numel()), sorted=False).values)
    if not per_tensor:
        return torch.empty(0)
    merged = torch.cat(per_tensor)
    return torch.topk(merged, min(k, merged.numel()), sorted=True).values


@torch.no_grad()
def global_threshold(candidates: Sequence[torch.Tensor], total: int, sparsity: float) -> float:
    """Magnitude threshold `tau`: weights with |w| < tau are pruned, |w| >= tau kept.

    `candidates` holds every stage's `local_candidates(stage_weights, k)` with
    k = num_to_keep(total, sparsity); `total` is the number of weights over all stages.
    `tau` is the k-th largest |w| over ALL weights, and it is exactly the k-th largest
    value of the gathered candidates:

    * Each member of the global top-k is within its own stage's top-k: at most k-1
      weights anywhere are larger than it, so at most k-1 in its stage are. Hence the
      union of the candidates contains (as a multiset of values) the global top-k, and
      its k-th largest value is >= tau.
    * The candidates are a sub-multiset of all magnitudes, so their k-th largest is
      <= tau. Both together give equality (a stage sending fewer than k values sends
      all of its weights, so the union has at least k values).

    Tie rule: prune STRICTLY BELOW `tau`. Every weight whose magnitude equals `tau` is
    kept, so at least k weights are kept; exactly k when the k-th and (k+1)-th largest
    magnitudes differ. Keeping exactly k under ties would need a global tie-break by
    position across stages; ties are rare for trained float weights and over-keeping a
    few is the safe side. Already-pruned weights are 0, so with tau > 0 they stay
    pruned; AND the new mask with the old one (`old & magnitude_mask(w, tau)`) so a
    tau of 0 (sparsity target below the zeros present) cannot revive them either.

    Returns `math.inf` when nothing is kept (sparsity 1). Send candidates in the
    weights' dtype (or wider) so that `tau` compares exactly against them.

    Raises:
        ValueError: bad `total`/`sparsity` (see `num_to_keep`), or fewer candidate
            values than weights to keep (a stage sent fewer than it should have).
    """
    keep = num_to_keep(total, sparsity)
    if keep == 0:
        return math.inf
    flat = [c.detach().reshape(-1) for c in candidates]
    values = torch.cat(flat) if flat else torch.empty(0)
    if values.numel() < keep:
        raise ValueError(f"got {values.numel()} candidate values but {keep} weights are kept "
                         f"(total {total}, sparsity {sparsity}); every stage must send its "
                         f"local_candidates(weights, k={keep})")
    return float(torch.topk(values, keep, sorted=True).values[-1].item())


@torch.no_grad()
def magnitude_mask(weight: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep-mask (bool, True = kept) for `global_threshold`'s rule: |w| >= threshold."""
    return weight.detach().abs() >= threshold


# ------------------------------------------------------------------- sparse linear

@dataclass(frozen=True, eq=False)
class CsrPattern:
    """The kept positions of a [out, in] weight, in CSR form for W and for W^T.

    Holds structure only (indices), never values: `SparseLinearFunction` gathers the
    current values from the dense weight at every call (`weight.view(-1)[flat]`, one
    index_select of nnz elements). The optimizer updates the dense weight in place
    after every step, so a cached CSR of VALUES would go stale each step; the
    structure changes only when the mask does, so rebuild the pattern with
    `from_mask` at pruning steps only.
    """

    shape: tuple[int, int]
    crow: torch.Tensor     # [out + 1] row pointers of W
    col: torch.Tensor      # [nnz] column of each kept entry of W, row-major order
    flat: torch.Tensor     # [nnz] row * in + col: where each CSR value sits in W
    crow_t: torch.Tensor   # [in + 1] row pointers of W^T
    col_t: torch.Tensor    # [nnz] column of each entry of W^T
    perm_t: torch.Tensor   # [nnz] W^T's CSR values = W's CSR values[perm_t]

    @classmethod
    @torch.no_grad()
    def from_mask(cls, mask: torch.Tensor) -> "CsrPattern":
        """Build from a 2-D keep-mask (nonzero = kept), on the mask's device.

        Raises:
            ValueError: the mask is not 2-D.
        """
        if mask.dim() != 2:
            raise ValueError(f"mask must be 2-D [out, in], got shape {tuple(mask.shape)}")
        out_f, in_f = (int(d) for d in mask.shape)
        flat = mask.reshape(-1).nonzero().reshape(-1)
        rows, cols = flat // in_f, flat % in_f
        crow = torch.zeros(out_f + 1, dtype=torch.int64, device=mask.device)
        crow[1:] = torch.bincount(rows, minlength=out_f).cumsum(0)
        perm_t = torch.argsort(cols * out_f + rows)
        crow_t = torch.zeros(in_f + 1, dtype=torch.int64, device=mask.device)
        crow_t[1:] = torch.bincount(cols, minlength=in_f).cumsum(0)
        return cls((out_f, in_f), crow, cols, flat, crow_t, rows[perm_t], perm_t)

    @property
    def nnz(self) -> int:
        return int(self.flat.numel())

    @property
    def sparsity(self) -> float:
        numel = self.shape[0] * self.shape[1]
        return 1.0 - self.nnz / numel if numel else 0.0

    def csr(self, values: torch.Tensor) -> torch.Tensor:
        """W as a CSR tensor with `values` in this pattern's order."""
        return torch.sparse_csr_tensor(self.crow, self.col, values, self.shape,
                                       check_invariants=False)

    def csr_t(self, values: torch.Tensor) -> torch.Tensor:
        """W^T as a CSR tensor, from W's `values` in this pattern's order."""
        return torch.sparse_csr_tensor(self.crow_t, self.col_t, values[self.perm_t],
                                       (self.shape[1], self.shape[0]), check_invariants=False)


def _sparse_rows(w_csr: torch.Tensor, dense: torch.Tensor, out_cols: int, chunk: int) -> torch.Tensor:
    """dense [N, k] @ w_csr.T -> [N, out_cols], as torch.sparse.mm(W, x.T).T per chunk."""
    out = torch.empty(dense.shape[0], out_cols, dtype=dense.dtype, device=dense.device)
    for s in range(0, dense.shape[0], chunk):
        out[s:s + chunk].copy_(torch.sparse.mm(w_csr, dense[s:s + chunk].T.contiguous()).T)
    return out


class SparseLinearFunction(torch.autograd.Function):
    """y = x @ (W * mask)^T + b with a CSR kernel; W stays a DENSE Parameter.

    `apply(x, weight, bias, pattern, chunk_rows)`: `x` [..., in], `weight` [out, in]
    dense (the Megatron/optimizer Parameter), `bias` [out] or None, `pattern` a
    `CsrPattern` of the mask, `chunk_rows` tokens per kernel call. Entries of
    `weight` outside the pattern are ignored (as if masked).

    * forward: `torch.sparse.mm(W_csr, x.T).T` (the fast CPU form per the notes).
    * input grad: `torch.sparse.mm(Wt_csr, g.T).T` with the CSR of W^T.
    * weight grad: `torch.sparse.sampled_addmm` of g^T @ x on the kept pattern,
      summed over chunks and scattered into a dense zero tensor, so DDP and the
      optimizer see an ordinary dense `.grad` that is exactly zero off the pattern.
    * bias grad: g summed over tokens.

    CSR values are gathered from the dense weight at every forward and backward (see
    `CsrPattern`), so the result is always for the current weight values. Saving the
    weight for backward means an in-place change to it between forward and backward
    (e.g. `apply_mask_`) is caught by autograd's version check. Not twice
    differentiable.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                pattern: CsrPattern, chunk_rows: int) -> torch.Tensor:
        out_f, in_f = pattern.shape
        if tuple(weight.shape) != pattern.shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} != pattern shape {pattern.shape}; "
                             "rebuild the pattern with CsrPattern.from_mask(mask)")
        if x.shape[-1] != in_f:
            raise ValueError(f"input's last dim {x.shape[-1]} != in_features {in_f}")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        x2 = x.reshape(-1, in_f)
        w_csr = pattern.csr(weight.reshape(-1)[pattern.flat])
        y = _sparse_rows(w_csr, x2, out_f, chunk_rows)
        if bias is not None:
            y += bias
        ctx.save_for_backward(x, weight)
        ctx.pattern, ctx.chunk_rows = pattern, chunk_rows
        return y.reshape(*x.shape[:-1], out_f)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        pattern, chunk = ctx.pattern, ctx.chunk_rows
        out_f, in_f = pattern.shape
        g2 = grad_out.reshape(-1, out_f)
        values = weight.reshape(-1)[pattern.flat]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _sparse_rows(pattern.csr_t(values), g2, in_f, chunk).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, in_f)
            w_csr = pattern.csr(values)
            acc = torch.zeros(pattern.nnz, dtype=weight.dtype, device=weight.device)
            if pattern.nnz:
                for s in range(0, x2.shape[0], chunk):
                    acc += torch.sparse.sampled_addmm(w_csr, g2[s:s + chunk].T, x2[s:s + chunk],
                                                      beta=0.0).values()
            grad_w = torch.zeros_like(weight)
            grad_w.view(-1)[pattern.flat] = acc
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None


def use_sparse(sparsity: float) -> bool:
    """Whether a linear at this sparsity should take the CSR path (above `CROSSOVER`)."""
    return sparsity > CROSSOVER


def masked_linear(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                  bias: torch.Tensor | None, sparse: bool, *,
                  pattern: CsrPattern | None = None, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """x @ (weight * mask)^T + bias; dense masked matmul, or the CSR path if `sparse`.

    Pick `sparse=use_sparse(sparsity)`. On the CSR path pass a cached `pattern` (built
    once per mask change); without one it is built from `mask` on every call.
    Gradients w.r.t. `weight` are zero off the mask on both paths.
    """
    if sparse:
        if pattern is None:
            pattern = CsrPattern.from_mask(mask)
        return SparseLinearFunction.apply(x, weight, bias, pattern, chunk_rows)
    return F.linear(x, weight.masked_fill(~mask.bool(), 0), bias)


# ------------------------------------------------------- keeping pruned weights at zero

def _mask_like(mask: torch.Tensor, t: torch.Tensor, what: str) -> torch.Tensor:
    if mask.numel() != t.numel():
        raise ValueError(f"mask has {mask.numel()} elements but {what} has {t.numel()} "
                         f"(shapes {tuple(mask.shape)} vs {tuple(t.shape)})")
    return mask.reshape(t.shape).to(device=t.device, dtype=torch.bool)


@torch.no_grad()
def apply_mask_(param: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero the pruned entries of `param` in place (keep-mask: True = kept); returns it.

    Uses masked_fill (not multiply) so inf/NaN in pruned entries also become 0. Apply
    it to every copy of the weight that the optimizer writes back from (e.g. fp32
    main params of a mixed-precision optimizer) as well.

    Raises:
        ValueError: the mask's element count differs from the param's.
    """
    return param.masked_fill_(~_mask_like(mask, param, "param"), 0)


def register_grad_mask(param: torch.Tensor, mask: torch.Tensor) -> RemovableHandle:
    """Hook that zeroes `param`'s gradient off the mask before it is accumulated.

    The hook reads `mask` at every backward, so update it in place (`mask.copy_(new)`)
    at a pruning step instead of registering a second hook. Returns the handle to
    remove it.

    Raises:
        ValueError: the mask's element count differs from the param's.
    """
    _mask_like(mask, param, "param")

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad.masked_fill(~_mask_like(mask, grad, "grad"), 0)

    return param.register_hook(hook)


@torch.no_grad()
def mask_grad_(param: torch.Tensor, mask: torch.Tensor) -> None:
    """Zero pruned entries of `param.grad` and, if present, Megatron's `param.main_grad`."""
    for name in ("grad", "main_grad"):
        g = getattr(param, name, None)
        if isinstance(g, torch.Tensor):
            g.masked_fill_(~_mask_like(mask, g, f"param.{name}"), 0)


@torch.no_grad()
def zero_adam_state_(state: Mapping[str, object], mask: torch.Tensor) -> tuple[str, ...]:
    """Zero Adam's per-element history (exp_avg, exp_avg_sq, max_exp_avg_sq) off the mask.

    Why it is needed: masking the gradient is not enough. Adam's step is
    lr * m_hat / (sqrt(v_hat) + eps); after pruning, the first moment `m` still holds
    the gradient history from before, and m and v decay at similar rates, so the
    update on a pruned entry stays about lr for many steps, moving it off zero. With
    `weight_decay` (L2 in torch.optim.Adam) the term wd * p is added to the gradient
    INSIDE the optimizer, after any gradient hook: as soon as p is nonzero it feeds m
    and v again and keeps it alive. With m = v = 0 and a zero gradient the update is
    0 / (0 + eps) = 0 exactly and wd * 0 = 0, so a pruned weight stays exactly 0.

    `state` is one parameter's optimizer state (`optimizer.state[param]`); the mask
    may have any shape with the same element count as the state tensors (flattened
    shards: pass the matching slice of `mask.view(-1)`). Returns the keys zeroed
    (empty before the first step, when there is no state yet).

    Raises:
        ValueError: a state tensor's element count differs from the mask's.
    """
    done = []
    for key in _ADAM_STATE_KEYS:
        t = state.get(key)
        if isinstance(t, torch.Tensor):
            t.masked_fill_(~_mask_like(mask, t, f"state[{key!r}]"), 0)
            done.append(key)
    return tuple(done)
