"""Hooks on one stage's GPTModel that time every TransformerLayer and the stage extras.

Forward: pre/post module hooks (TransformerBlock calls layers with keyword arguments
only, so `register_full_backward_hook` cannot be used). Backward: tensor hooks — the
gradient arriving at a layer's output marks the start of its backward, the gradient
of its input `hidden_states` marks the end; where the input needs no gradient (the
first trainable layer after a frozen prefix), its last weight-gradient accumulation
does. A layer that needs neither records no backward span (0 s). Extras are timed by
their own hooks, never as a residual of the schedule's timers (which they are
cross-checked against): embedding forward by module hooks, embedding backward from the
gradient of its output to the accumulation of its weight gradient; head (final norm, output layer, loss)
forward from the final norm's pre-hook to the end of GPTModel.forward, backward from
the gradient of the model's output to the gradient of the final norm's input.
Activation bytes: `saved_tensors_hooks` around each layer forward, counting the
distinct storages autograd keeps that are not parameters.

Every span opens with `clock.begin()` (on CUDA: the device is drained first, so the span
holds that region's work only; `profiling.clock`) and closes with `clock.mark()`; the
host's time between the same marks is kept beside it ("host/fwd/7").
Hooks exist only between `attach()` and `detach()`: zero cost outside a window.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from dynmo_plugin.profiling.clock import Clock

__all__ = ["StageProbe", "SavedBytes"]


class SavedBytes:
    """Counts distinct non-parameter storages saved for backward while active."""

    def __init__(self, param_ptrs: set[int]):
        self._param_ptrs = param_ptrs
        self._seen: set[int] = set()
        self.nbytes = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += storage.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


class _Spans:
    """Per micro-batch start/end marks of one timed region."""

    def __init__(self):
        self.start: dict[int, object] = {}
        self.end: dict[int, object] = {}

    def seconds(self, clock: Clock) -> list[float]:
        return [clock.seconds(self.start[mb], self.end[mb])
                for mb in sorted(self.start) if mb in self.end]

    def host_seconds(self, clock: Clock) -> list[float]:
        """The host's time between the same marks (on CUDA: launching the region)."""
        return [clock.host_seconds(self.start[mb], self.end[mb])
                for mb in sorted(self.start) if mb in self.end]


class StageProbe:
    """Times each layer of `model` (one pipeline stage; interleaved: one model chunk, i.e.
    one virtual stage, and the profiler attaches one probe per chunk) per micro-batch."""

    def __init__(self, model: torch.nn.Module, clock: Clock, count_activations: bool = True):
        """count_activations=False skips the saved-tensor accounting, which is most of
        the probe's cost (scripts/bench_profiler.py); act_bytes are then 0."""
        self.model, self.clock, self.count_activations = model, clock, count_activations
        self.layers = list(model.decoder.layers)
        self._handles: list = []
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # "fwd/7", "bwd/7", "extra"; "host/fwd/7", "host/bwd/7": the host's time beside them
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.act_bytes: dict[int, list[int]] = defaultdict(list)
        self._reset_iteration()

    # ---- lifecycle ----------------------------------------------------------------------
    def attach(self) -> None:
        for layer in self.layers:
            self._hook_layer(layer)
        if getattr(self.model, "pre_process", False):
            self._hook_embedding(self.model.embedding)
        if getattr(self.model, "post_process", False):
            self._hook_head()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reset_iteration(self) -> None:
        self._spans: dict[str, _Spans] = defaultdict(_Spans)
        self._counters: dict[str, int] = defaultdict(int)
        self._saved: dict[tuple[int, int], SavedBytes] = {}
        self._ends_at_weights: set[tuple[int, int]] = set()  # (layer, mb) with no input grad
        self._bwd_running: dict[int, int] = {}  # layer -> micro-batch whose backward started last

    def end_iteration(self) -> float:
        """Resolve marks into seconds (one device sync); returns the iteration's profiled
        compute: layers + extras summed over its micro-batches."""
        self.clock.resolve()
        total = 0.0
        extras = defaultdict(float)
        for key, spans in self._spans.items():
            secs = spans.seconds(self.clock)
            total += sum(secs)
            if key.startswith(("fwd/", "bwd/")):
                self.samples[key].extend(secs)
                self.samples[f"host/{key}"].extend(spans.host_seconds(self.clock))
            else:
                for mb, s in zip(sorted(spans.start), secs):
                    extras[mb] += s
        self.samples["extra"].extend(extras.values())
        for (number, _mb), saved in self._saved.items():
            self.act_bytes[number].append(saved.nbytes)
        self._reset_iteration()
        return total

    # ---- hooks --------------------------------------------------------------------------
    def _next_mb(self, key: str) -> int:
        mb = self._counters[key]
        self._counters[key] += 1
        return mb

    def _grad_mark(self, spans: _Spans, which: str, mb: int) -> Callable:
        """A gradient hook marking the start (`clock.begin`: drains the device) or the
        end of a backward span."""
        mark = self.clock.begin if which == "start" else self.clock.mark

        def hook(grad):
            getattr(spans, which)[mb] = mark()
        return hook

    def _hook_layer(self, layer: torch.nn.Module) -> None:
        number = layer.layer_number
        fwd_key, bwd_key = f"fwd/{number}", f"bwd/{number}"

        def pre(module, args, kwargs):
            mb = self._next_mb(f"layer/{number}")
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if torch.is_tensor(hidden) and hidden.requires_grad:
                hidden.register_hook(self._grad_mark(self._spans[bwd_key], "end", mb))
            else:  # e.g. after a frozen prefix: the last weight gradient ends the backward
                self._ends_at_weights.add((number, mb))
            if self.count_activations:
                saved = SavedBytes(self._param_ptrs)
                self._saved[(number, mb)] = saved
                saved.__enter__()
            self._spans[fwd_key].start[mb] = self.clock.begin()

        def post(module, args, kwargs, output):
            mb = self._counters[f"layer/{number}"] - 1
            self._spans[fwd_key].end[mb] = self.clock.mark()
            if self.count_activations:
                self._saved[(number, mb)].__exit__(None, None, None)
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(out) and out.requires_grad:
                out.register_hook(self._grad_mark(self._spans[bwd_key], "start", mb))
                out.register_hook(lambda grad: self._bwd_running.__setitem__(number, mb))

        def accumulated(param):
            mb = self._bwd_running.get(number)
            if mb is not None and (number, mb) in self._ends_at_weights:
                self._spans[bwd_key].end[mb] = self.clock.mark()

        self._handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(layer.register_forward_hook(post, with_kwargs=True))
        self._handles += [p.register_post_accumulate_grad_hook(accumulated)
                          for p in layer.parameters() if p.requires_grad]

    def _hook_embedding(self, embedding: torch.nn.Module) -> None:
        # Spans are looked up on each call: _reset_iteration replaces the dict.
        def pre(module, args):
            self._spans["emb_fwd"].start[self._next_mb("emb")] = self.clock.begin()

        def post(module, args, output):
            mb = self._counters["emb"] - 1
            self._spans["emb_fwd"].end[mb] = self.clock.mark()
            if output.requires_grad:
                output.register_hook(self._grad_mark(self._spans["emb_bwd"], "start", mb))

        def accumulated(param):  # the last embedding weight grad ends the stage backward
            spans = self._spans["emb_bwd"]
            pending = [mb for mb in spans.start if mb not in spans.end]
            if pending:
                spans.end[min(pending)] = self.clock.mark()

        self._handles.append(embedding.register_forward_pre_hook(pre))
        self._handles.append(embedding.register_forward_hook(post))
        weight = embedding.word_embeddings.weight
        if weight.requires_grad:
            self._handles.append(weight.register_post_accumulate_grad_hook(accumulated))

    def _hook_head(self) -> None:
        norm = getattr(self.model.decoder, "final_layernorm", None)
        start_module = norm if norm is not None else self.model.output_layer

        def pre(module, args):
            mb = self._next_mb("head")
            self._spans["head_fwd"].start[mb] = self.clock.begin()
            hidden = args[0] if args else None
            if torch.is_tensor(hidden) and hidden.requires_grad:
                hidden.register_hook(self._grad_mark(self._spans["head_bwd"], "end", mb))

        def post(module, args, output):
            mb = self._counters["head"] - 1
            self._spans["head_fwd"].end[mb] = self.clock.mark()
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(self._grad_mark(self._spans["head_bwd"], "start", mb))

        self._handles.append(start_module.register_forward_pre_hook(pre))
        self._handles.append(self.model.register_forward_hook(post))
