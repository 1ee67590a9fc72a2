"""What a micro-batch of documents costs: one model fitted from profiled samples (pure numpy).

A sample is one micro-batch through one layer (or a whole stage): the lengths of the
documents it packs, the positions it carries (`tokens`, padding included: linear
layers pay for padding, per-document attention does not) and its forward + backward
seconds. Three forms are fitted by least squares:

* `KnapFormerCost` (KnapFormer, per layer): t = k (24 T d^2 + gamma 4 d sum l^2) with
  T the positions and d the hidden size; no intercept. Its WLB-LLM coefficients are
  beta = 24 k d^2 per position and alpha = 4 k gamma d per squared document length.
* `AdaptiveLoadCost` (AdaptiveLoad): t = a + b sum l^p, p searched on a grid in
  [1.6, 2.4] for the best R^2 (for B equal sequences of length S, sum l^p = B S^p).
* `TokenCost`: t = a + b T, the token-count baseline both are compared with.
* `PowerCost`: sum l^p, the prior a run balances by before anything is fitted.

`held_out_error` reports the mean absolute relative error on samples not fitted
(`fit_all` fits all three and reports each). The same fitted model serves the packers
(`doc_workload`), the DP redistribution and AdaptiveLoad's batch sizes
(`adaptive_batch_sizes`); per-layer KnapFormer fits re-cost the layer balancer's
profile for the run's length mix (data.calibration). `model_to_dict`/`model_from_dict`
keep a model in checkpoints and reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

__all__ = ["CostSample", "CostModel", "PowerCost", "KnapFormerCost", "AdaptiveLoadCost",
           "TokenCost", "fit_knapformer", "fit_adaptiveload", "fit_tokens", "fit_all",
           "held_out_error", "adaptive_batch_size", "adaptive_batch_sizes", "sequence_cost",
           "samples_from_probe", "model_to_dict",
           "model_from_dict", "FORMS"]

FORMS = ("knapformer", "adaptiveload", "tokens")


@dataclass(frozen=True)
class CostSample:
    lengths: tuple[int, ...]   # document lengths packed in the micro-batch
    tokens: int                # positions the micro-batch carries, padding included
    seconds: float             # measured forward + backward time


class CostModel(Protocol):
    def predict(self, lengths: Sequence[int], tokens: int) -> float: ...

    def doc_workload(self, length: int) -> float:
        """The part of the cost a document adds beyond the positions it fills
        (what a packer balances when micro-batches are padded to one shape)."""


def _sq(lengths: Sequence[int]) -> float:
    return float(np.sum(np.asarray(lengths, dtype=np.float64) ** 2))


@dataclass(frozen=True)
class PowerCost:
    """The prior before anything is measured: a document costs length^p (p = 2: with
    rows padded to one shape only the attention part differs between micro-batches)."""

    p: float = 2.0

    def predict(self, lengths: Sequence[int], tokens: int) -> float:
        return float(np.sum(np.asarray(lengths, dtype=np.float64) ** self.p))

    def doc_workload(self, length: int) -> float:
        return float(length) ** self.p


@dataclass(frozen=True)
class KnapFormerCost:
    k: float
    gamma: float
    hidden: int

    def predict(self, lengths: Sequence[int], tokens: int) -> float:
        d = self.hidden
        return self.k * (24 * tokens * d * d + self.gamma * 4 * d * _sq(lengths))

    def doc_workload(self, length: int) -> float:
        return self.alpha * length * length

    @property
    def alpha(self) -> float:
        return 4 * self.k * self.gamma * self.hidden

    @property
    def beta(self) -> float:
        return 24 * self.k * self.hidden ** 2


@dataclass(frozen=True)
class AdaptiveLoadCost:
    a: float
    b: float
    p: float
    r2: float

    def predict(self, lengths: Sequence[int], tokens: int) -> float:
        return self.a + self.b * float(np.sum(np.asarray(lengths, dtype=np.float64) ** self.p))

    def doc_workload(self, length: int) -> float:
        return self.b * float(length) ** self.p


@dataclass(frozen=True)
class TokenCost:
    a: float
    b: float

    def predict(self, lengths: Sequence[int], tokens: int) -> float:
        return self.a + self.b * float(sum(lengths))

    def doc_workload(self, length: int) -> float:
        return self.b * length


def _check(samples: Sequence[CostSample], need: int) -> None:
    if len(samples) < need:
        raise ValueError(f"a cost fit needs at least {need} samples, got {len(samples)}")


def fit_knapformer(samples: Sequence[CostSample], hidden: int) -> KnapFormerCost:
    """Least squares of seconds on [24 T d^2, 4 d sum l^2], no intercept."""
    _check(samples, 2)
    d = float(hidden)
    X = np.array([[24 * s.tokens * d * d, 4 * d * _sq(s.lengths)] for s in samples])
    y = np.array([s.seconds for s in samples])
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    (c1, c2), *_ = np.linalg.lstsq(X / scale, y, rcond=None)
    k, kg = c1 / scale[0], c2 / scale[1]
    if k <= 0:
        raise ValueError("the fitted linear coefficient k is not positive: the samples do not "
                         "vary the positions per micro-batch enough, or are too noisy")
    return KnapFormerCost(k=float(k), gamma=float(kg / k), hidden=hidden)


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - pred) ** 2)) / ss if ss > 0 else 1.0


def fit_adaptiveload(samples: Sequence[CostSample],
                     grid: Sequence[float] = tuple(np.round(np.arange(1.6, 2.401, 0.05), 2))
                     ) -> AdaptiveLoadCost:
    """a + b sum l^p by least squares for each p on the grid; the best R^2 wins."""
    _check(samples, 3)
    y = np.array([s.seconds for s in samples])
    best = None
    for p in grid:
        f = np.array([float(np.sum(np.asarray(s.lengths, dtype=np.float64) ** p)) for s in samples])
        scale = f.max() or 1.0
        A = np.stack([np.ones_like(f), f / scale], axis=1)
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        r2 = _r2(y, A @ np.array([a, b]))
        if best is None or r2 > best.r2:
            best = AdaptiveLoadCost(a=float(a), b=float(b / scale), p=float(p), r2=r2)
    return best


def fit_tokens(samples: Sequence[CostSample]) -> TokenCost:
    """a + b (real tokens): the baseline that ignores how tokens are split into documents."""
    _check(samples, 2)
    f = np.array([float(sum(s.lengths)) for s in samples])
    A = np.stack([np.ones_like(f), f], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.array([s.seconds for s in samples]), rcond=None)
    return TokenCost(a=float(a), b=float(b))


def samples_from_probe(probe_samples: dict, layer: int, lengths: Sequence[Sequence[int]],
                       tokens: int | Sequence[int]) -> list[CostSample]:
    """CostSamples of one layer from the profiler's per-micro-batch times
    (megatron.probe.StageProbe.samples: "fwd/N" and "bwd/N" lists, one entry per
    micro-batch in order) and the document lengths of those micro-batches; `tokens`:
    the positions of every micro-batch, or one count per micro-batch."""
    fwd, bwd = probe_samples[f"fwd/{layer}"], probe_samples[f"bwd/{layer}"]
    if not (len(fwd) == len(bwd) == len(lengths)):
        raise ValueError(f"layer {layer}: {len(fwd)} forward and {len(bwd)} backward times "
                         f"for {len(lengths)} micro-batches")
    per_mb = [tokens] * len(lengths) if isinstance(tokens, int) else list(tokens)
    return [CostSample(tuple(ls), t, f + b) for ls, t, f, b in zip(lengths, per_mb, fwd, bwd)]


_CLASSES = {"power": PowerCost, "knapformer": KnapFormerCost, "adaptiveload": AdaptiveLoadCost,
            "tokens": TokenCost}


def model_to_dict(model: CostModel) -> dict:
    """Plain data (JSON): {"form": name, **fields}; `model_from_dict` reads it back."""
    form = next(k for k, c in _CLASSES.items() if isinstance(model, c))
    return {"form": form, **{k: getattr(model, k) for k in model.__dataclass_fields__}}


def model_from_dict(data: dict) -> CostModel:
    fields = {k: v for k, v in data.items() if k != "form"}
    return _CLASSES[data["form"]](**fields)


def fit_all(samples: Sequence[CostSample], hidden: int) -> dict:
    """The three forms fitted on the even samples, held-out error on the odd ones, and
    each form refitted on all samples: {"models": {form: model}, "held_out_error":
    {form: error}, "samples": n}. Raises ValueError when there are too few samples."""
    fit_set, held = list(samples[0::2]), list(samples[1::2])
    _check(held, 2)
    fits = {"knapformer": lambda s: fit_knapformer(s, hidden), "adaptiveload": fit_adaptiveload,
            "tokens": fit_tokens}
    errors = {k: held_out_error(f(fit_set), held) for k, f in fits.items()}
    return {"models": {k: f(samples) for k, f in fits.items()}, "held_out_error": errors,
            "samples": len(samples)}


def held_out_error(model: CostModel, samples: Sequence[CostSample]) -> float:
    """Mean |predicted - measured| / measured over `samples`."""
    errs = [abs(model.predict(s.lengths, s.tokens) - s.seconds) / s.seconds for s in samples]
    return float(np.mean(errs))


def adaptive_batch_size(seq_len: int, p: float, mem_tokens: float, comp_budget: float) -> int:
    """AdaptiveLoad: B = max(1, min(floor(M_mem / S), floor(M_comp / S^p))) for bucket S.

    `mem_tokens` (M_mem): tokens that fit in memory; `comp_budget` (M_comp): (T_target -
    a) / b of a fitted AdaptiveLoadCost, in units of S^p."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be positive, got {seq_len}")
    return max(1, min(math.floor(mem_tokens / seq_len), math.floor(comp_budget / seq_len ** p)))


def sequence_cost(model: CostModel, length: int) -> float:
    """What one sequence of `length` positions adds to a micro-batch (the model's cost of
    it, less the intercept every micro-batch pays)."""
    return model.predict([length], length) - model.predict([], 0)


def adaptive_batch_sizes(model: CostModel, buckets: Sequence[int], mem_tokens: int,
                         target_length: int) -> dict[int, int]:
    """{S: B} for every bucket: AdaptiveLoad's B = max(1, min(floor(M_mem / S),
    floor(M_comp / cost(S)))) with M_comp the cost of one `target_length` sequence, so a
    micro-batch of any bucket predicts about the time of one full row. For an
    AdaptiveLoadCost (cost(S) = b S^p) this is `adaptive_batch_size(S, p, M_mem,
    target^p)`."""
    budget = sequence_cost(model, target_length)
    out = {}
    for S in buckets:
        one = sequence_cost(model, S)
        comp = math.floor(budget / one + 1e-9) if one > 0 else mem_tokens
        out[int(S)] = max(1, min(mem_tokens // S, comp))
    return out
