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

Activation recompute (Megatron's `--recompute-granularity full`: `tensor_parallel.checkpoint`
runs a layer's forward without autograd, keeps its input, and runs the forward again
inside the backward): the first forward is the layer's forward span; the recomputed one
is part of its backward, a segment of the backward span of the same micro-batch (the
k-th recompute of a layer is its k-th micro-batch: each chunk's backwards run in forward
order), timed and calibrated like a span (the forward's constant), never a forward of
another micro-batch. A forward in evaluation (`module.training` off: Megatron-LM's
evaluate() inside a window) is not timed: no training step pays it. What
the layer holds between its forward and backward is then its kept input, not what the
recomputed forward saves for the moment of its own backward: counted for every layer
whose forward runs without autograd on an input that needs gradients, except an input
that is the previous layer's output inside the same checkpointed chunk
(`--recompute-num-layers` N > 1: only the chunk's input is kept; `_inside_chunk`). The
first layer of each chunk holds the chunk's hidden state, the others none.

Every span opens with `clock.begin()` (on CUDA: the device is drained first, so the span
holds that region's work only; `profiling.clock`) and closes with `clock.mark()`; the
host's time between the same marks is kept beside it ("host/fwd/7").
Hooks exist only between `attach()` and `detach()`: zero cost outside a window.

The span constant (issue 34): a span also holds a fixed cost of the measurement itself
(the drain before it, the hooks, the idle GPU until the first kernel arrives): on an
H200 ~1.0-1.2 ms per span at both shapes, so a layer of 3x the FLOPs read 2.63-2.73x.
With `span_constant=K` the probe runs K EMPTY layers after each window iteration through
the very same hooks (`_EmptyLayer`: one elementwise kernel forward and backward, layer
number 0) and subtracts the median of their spans, per direction and per clock (device,
host), from every span of that iteration (clamped at 0): what is left is the layer's
own work. The constants are kept ("constant/fwd", "constant/host/bwd", ...).
With a `KernelBusy` every span is also a profiler range, so the kernels each layer
launched are summed per layer (`profiling.kernels`: GPU busy time, no constant at all).
"""
from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from typing import Callable

import torch

from dynmo_plugin.megatron.recompute import in_backward
from dynmo_plugin.profiling.clock import Clock
from dynmo_plugin.profiling.records import median

__all__ = ["StageProbe", "SavedBytes"]


class SavedBytes:
    """Counts distinct non-parameter storages saved for backward while active."""

    def __init__(self, param_ptrs: set[int], counted_elsewhere: set[int] | None = None):
        self._param_ptrs = param_ptrs
        # storages another counter holds (read at each save: it may grow meanwhile)
        self._elsewhere = counted_elsewhere if counted_elsewhere is not None else set()
        self._seen: set[int] = set()
        self.nbytes = 0
        self._ctx = None
        self.active = False  # entered, not yet exited: its hooks are on torch's stack
        self.in_backward = False  # entered inside a backward (`__enter__`)

    def count(self, t: torch.Tensor, share: int = 1) -> None:
        """Count `t`'s storage once, unless it is a parameter's; `share`: kept split over
        that many ranks (each holds its part)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._param_ptrs and ptr not in self._seen and ptr not in self._elsewhere:
            self._seen.add(ptr)
            self.nbytes += storage.nbytes() // share

    def no_longer_elsewhere(self, ptr: int) -> None:
        """A storage another counter held is gone (its address may come back for another)."""
        self._elsewhere.discard(ptr)

    def _pack(self, t: torch.Tensor):
        self.count(t)
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        # entered inside a backward (a forward recomputed by activation checkpointing):
        # torch keeps that stack per graph task and drops it when the node ends
        self.in_backward = in_backward()
        self.active = True
        return self

    def abandon(self) -> None:
        """Its forward raised before the exit: pop its hooks from the stack they are still
        on (the main thread's; one left inside a backward went with its graph task, and
        a pop there would take another's hook, or assert on an empty stack)."""
        if self.active and self.in_backward:
            self.active = False
        self.__exit__(None, None, None)

    def __exit__(self, *exc):
        if self.active:
            self.active = False
            self._ctx.__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Its hooks off torch's stack, then back on: what autograd saves meanwhile is
        saved as is (`distributed_saves` says who needs that). They must be the stack's
        top: a pop would take a hook pushed above them instead."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] != self._pack:
            raise RuntimeError("dynmo: a saved_tensors_hooks pair sits above the profiler's; "
                               "it cannot step aside for the save that needs it")
        self.__exit__(None, None, None)
        try:
            yield
        finally:
            self.__enter__()


class _Spans:
    """Per micro-batch start/end marks of one timed region."""

    def __init__(self):
        self.start: dict[int, object] = {}
        self.end: dict[int, object] = {}
        # (start, end) marks of earlier segments of a micro-batch's span: a backward's
        # recomputed forward (module docstring), which ran before its gradients arrived
        self.before: dict[int, list[tuple[object, object]]] = defaultdict(list)

    def _each(self, between: Callable[[object, object], float]) -> list[float]:
        return [between(self.start[mb], self.end[mb]) + sum(between(a, b) for a, b in self.before.get(mb, ()))
                for mb in sorted(self.start) if mb in self.end]

    def segments(self) -> list[int]:
        """Marked intervals per micro-batch (each pays the span constant once)."""
        return [1 + len(self.before.get(mb, ())) for mb in sorted(self.start) if mb in self.end]

    def seconds(self, clock: Clock) -> list[float]:
        return self._each(clock.seconds)

    def host_cpu_seconds(self, clock: Clock) -> list[float]:
        """The thread's CPU time between the same marks (waits for the GIL left out)."""
        return self._each(clock.host_cpu_seconds)

    def host_seconds(self, clock: Clock) -> list[float]:
        """The host's time between the same marks (on CUDA: launching the region)."""
        return self._each(clock.host_seconds)

    def occupied(self, clock: Clock) -> float:
        """What the spans took of the host timeline, drains included (`Clock.occupied`)."""
        return sum(self._each(clock.occupied))


class _EmptyLayer(torch.nn.Module):
    """A layer with no work: what a span costs when the layer inside it costs nothing."""

    layer_number = 0

    def forward(self, hidden_states, **kwargs):
        return hidden_states * 1.0, None


def _calibrated(values: list[float], constant: float, segments: list[int], earlier: float) -> list[float]:
    """`values` less the span constant, and `earlier` for each earlier segment (a
    recomputed forward's: the forward constant), clamped at 0."""
    return [max(0.0, v - constant - (n - 1) * earlier) for v, n in zip(values, segments)]


class StageProbe:
    """Times each layer of `model` (one pipeline stage; interleaved: one model chunk, i.e.
    one virtual stage, and the profiler attaches one probe per chunk) per micro-batch."""

    def __init__(self, model: torch.nn.Module, clock: Clock, count_activations: bool = True,
                 span_constant: int = 0, busy=None):
        """count_activations=False skips the saved-tensor accounting, which is most of
        the probe's cost (scripts/bench_profiler.py); act_bytes are then 0.
        span_constant: empty spans per iteration to calibrate the span constant (module
        docstring; 0: none). busy: a `profiling.kernels.KernelBusy` (GPU kernel time)."""
        self.model, self.clock, self.count_activations = model, clock, count_activations
        self.span_constant, self.busy = span_constant, busy
        self._empty = _EmptyLayer() if span_constant else None
        self.layers = list(model.decoder.layers)
        self._handles: list = []
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # "fwd/7", "bwd/7", "extra"; "host/fwd/7", "host/bwd/7": the host's time beside them
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.act_bytes: dict[int, list[int]] = defaultdict(list)
        # the storages of the inputs checkpoints keep, counted by their layers: the
        # checkpoint saves them after the layer's hooks, inside the stage's own counter
        # (the profiler's `_ExtraActivations`, which holds this set and empties it at each
        # micro-batch), which must not count them again
        self.kept_inputs: set[int] = set()
        self._reset_iteration()

    # ---- lifecycle ----------------------------------------------------------------------
    def attach(self) -> None:
        for layer in self.layers:
            self._hook_layer(layer)
        if getattr(self.model, "pre_process", False):
            self._hook_embedding(self.model.embedding)
        if getattr(self.model, "post_process", False):
            self._hook_head()
        if getattr(self.model, "mtp_process", False):
            self._hook_mtp(self.model.mtp)
        if self._empty is not None:
            self._hook_layer(self._empty)

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """The extras' span names this chunk times (the embedding's on the first virtual
        stage, the output layer's on the last): also the names of their kernel ranges,
        which are per rank, not per chunk, so another chunk of the rank must not read
        them as its own."""
        return ((("emb_fwd", "emb_bwd") if getattr(self.model, "pre_process", False) else ())
                + (("head_fwd", "head_bwd") if getattr(self.model, "post_process", False) else ()))

    def detach(self) -> None:
        """Remove the hooks; a forward that raised (its post-hook never ran) left its
        saved-tensor hooks on torch's stack, which would count every later tensor saved
        in the process: popped here (`SavedBytes.abandon`), last entered first."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for saved in reversed([*self._saved.values(), *self._mtp_saved.values()]):
            saved.abandon()

    def _reset_iteration(self) -> None:
        self._spans: dict[str, _Spans] = defaultdict(_Spans)
        self._counters: dict[str, int] = defaultdict(int)
        self._saved: dict[tuple[int, int], SavedBytes] = {}
        self._ends_at_weights: set[tuple[int, int]] = set()  # (layer, mb) with no input grad
        self._bwd_running: dict[int, int] = {}  # layer -> micro-batch whose backward started last
        # layer -> (micro-batch, the segment's start mark) of a forward being recomputed
        self._recomputing: dict[int, tuple[int, object]] = {}
        self._mtp_saved: dict[int, SavedBytes] = {}
        # the output (and its autograd node) of the last layer forward run without autograd
        # in training (a checkpoint's first pass): the chunk's next layer takes it
        self._unsaved_output: tuple[Callable[[], object], type] = (lambda: None, type(None))

    def occupied_s(self) -> float:
        """This iteration's spans on the host timeline so far (before `end_iteration`: its
        empty spans are the window's, not the step's); nested MTP spans count once, in
        the head's."""
        nested = set(self._mtp_nested())
        return sum(spans.occupied(self.clock) for key, spans in self._spans.items()
                   if key not in ("fwd/0", "bwd/0") and not (nested and key.startswith("mtp/")))

    def end_iteration(self) -> float:
        """Resolve marks into seconds (one device sync); returns the iteration's profiled
        compute: layers + extras summed over its micro-batches, span constants removed."""
        self._run_empty_spans()
        self.clock.resolve()
        const = self._constants()
        total = 0.0
        extras = defaultdict(float)
        nested = self._mtp_nested()
        for key, spans in self._spans.items():
            way = "bwd" if "bwd" in key else "fwd"
            if key in ("fwd/0", "bwd/0"):
                continue
            n = spans.segments()
            secs = _calibrated(spans.seconds(self.clock), const[way], n, const["fwd"])
            if key in ("head_fwd", "head_bwd"):  # the MTP block ran inside: its own unit
                mtp = dict(zip(sorted(nested[key].start), nested[key].seconds(self.clock))) \
                    if key in nested else {}
                secs = [max(0.0, s - mtp.get(mb, 0.0)) for mb, s in zip(sorted(spans.start), secs)]
            total += sum(secs)
            if key.startswith(("mtp/fwd", "mtp/bwd")):
                self.samples[key].extend(secs)
            elif key.startswith(("fwd/", "bwd/")):
                self.samples[key].extend(secs)
                self.samples[f"host/{key}"].extend(_calibrated(spans.host_seconds(self.clock),
                                                               const[f"host/{way}"], n, const["host/fwd"]))
                self.samples[f"cpu/{key}"].extend(_calibrated(spans.host_cpu_seconds(self.clock),
                                                              const[f"cpu/{way}"], n, const["cpu/fwd"]))
            else:
                for mb, s in zip(sorted(spans.start), secs):
                    extras[mb] += s
        self.samples["extra"].extend(extras.values())
        for (number, _mb), saved in self._saved.items():
            if number:
                self.act_bytes[number].append(saved.nbytes)
        for saved in self._mtp_saved.values():
            self.act_bytes["mtp"].append(saved.nbytes)
        if self.busy is not None:
            self.busy.next_iteration()
        self._reset_iteration()
        return total

    def _run_empty_spans(self) -> None:
        """`span_constant` forward+backward passes of the empty layer, through the hooks."""
        if self._empty is None:
            return
        param = next(self.model.parameters())
        with torch.enable_grad():
            for _ in range(self.span_constant):
                x = torch.zeros(1, 1, 8, device=param.device, dtype=param.dtype, requires_grad=True)
                out, _ = self._empty(hidden_states=x)
                out.sum().backward()

    def _constants(self) -> dict[str, float]:
        """This iteration's span constants (median empty span), 0.0 without calibration."""
        const = {}
        for way in ("fwd", "bwd"):
            spans = self._spans.get(f"{way}/0") if self._empty is not None else None
            device = median(spans.seconds(self.clock)) if spans is not None else 0.0
            host = median(spans.host_seconds(self.clock)) if spans is not None else 0.0
            cpu = median(spans.host_cpu_seconds(self.clock)) if spans is not None else 0.0
            const[way], const[f"host/{way}"], const[f"cpu/{way}"] = device, host, cpu
            if self._empty is not None:
                self.samples[f"constant/{way}"].append(device)
                self.samples[f"constant/host/{way}"].append(host)
                self.samples[f"constant/cpu/{way}"].append(cpu)
        return const

    # ---- hooks --------------------------------------------------------------------------
    def _next_mb(self, key: str) -> int:
        mb = self._counters[key]
        self._counters[key] += 1
        return mb

    def _grad_mark(self, key: str, which: str, mb: int) -> Callable:
        """A gradient hook marking the start (`clock.begin`: drains the device) or the
        end of a backward span."""
        spans = self._spans[key]

        def hook(grad):
            if which == "start":
                spans.start[mb] = self.clock.begin()
                self._range(key, mb, True)
            else:
                self._range(key, mb, False)
                spans.end[mb] = self.clock.mark()
        return hook

    @staticmethod
    def _at_grad(tensor: torch.Tensor, hook: Callable, ends_a_span: bool) -> None:
        """Run `hook` when `tensor`'s gradient arrives, every span's end before any
        span's start. One tensor is where a backward span ends and the next begins (a
        layer's input is the previous layer's output, the embedding's, the final norm's
        input the last layer's), and tensor hooks run in registration order: the next
        span's start, registered first (in the earlier module's forward), drained the
        device inside the span still open, which then held that drain (on a GPU the wait
        for its own kernels' tail) in its host time. So each tensor gets one hook that
        runs the ends, then the starts."""
        hooks = getattr(tensor, "_dynmo_grad_hooks", None)
        if hooks is None:
            hooks = tensor._dynmo_grad_hooks = ([], [])

            def run(grad):
                for h in hooks[0] + hooks[1]:
                    h(grad)
            tensor.register_hook(run)
        hooks[0 if ends_a_span else 1].append(hook)

    def _range(self, key, mb: int, opening: bool) -> None:
        """The span's profiler range (`profiling.kernels`), where kernels are timed."""
        if self.busy is None or key is None:
            return
        (self.busy.open if opening else self.busy.close)(key, mb)

    def _hook_layer(self, layer: torch.nn.Module) -> None:
        number = layer.layer_number
        fwd_key, bwd_key = f"fwd/{number}", f"bwd/{number}"

        def pre(module, args, kwargs):
            if not module.training:  # evaluation: no training cost (nor backward) to time
                return
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if in_backward():
                self._recompute_begins(number, hidden)
                return
            mb = self._next_mb(f"layer/{number}")
            if torch.is_grad_enabled():  # else a checkpoint's first pass: its recompute marks the backward
                self._backward_ends(number, mb, hidden)
            if self.count_activations:
                saved = SavedBytes(self._param_ptrs)
                self._saved[(number, mb)] = saved
                if torch.is_grad_enabled():
                    saved.__enter__()
                elif torch.is_tensor(hidden) and hidden.requires_grad and not self._inside_chunk(hidden):
                    # training without autograd, a checkpoint's first pass: it keeps its input
                    # only (module docstring); what the pass saves for a moment (dropout masks
                    # of the bias-dropout-add it runs with grad on) is freed with the chunk
                    saved.count(hidden, self._kept_input_share)
                    self.kept_inputs.add(hidden.untyped_storage().data_ptr())
            self._spans[fwd_key].start[mb] = self.clock.begin()
            self._range(fwd_key, mb, True)

        def post(module, args, kwargs, output):
            if not module.training:
                return
            if in_backward():
                mb = self._recompute_ends(number)
                if mb is None:
                    return
            else:
                mb = self._counters[f"layer/{number}"] - 1
                self._range(fwd_key, mb, False)
                self._spans[fwd_key].end[mb] = self.clock.mark()
                if self.count_activations:
                    self._saved[(number, mb)].__exit__(None, None, None)
            out = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(out) and not torch.is_grad_enabled():  # (its node's kind: no graph kept)
                self._unsaved_output = (weakref.ref(out), type(out.grad_fn))
            # not after a checkpoint's first pass: its output, marked as needing gradients
            # (make_viewless_tensor), becomes the checkpoint's own and loses the hooks on it
            if torch.is_tensor(out) and out.requires_grad and torch.is_grad_enabled():
                self._at_grad(out, self._grad_mark(bwd_key, "start", mb), False)
                self._at_grad(out, lambda grad: self._bwd_running.__setitem__(number, mb), False)

        def accumulated(param):
            mb = self._bwd_running.get(number)
            if mb is not None and (number, mb) in self._ends_at_weights:
                self._range(bwd_key, mb, False)
                self._spans[bwd_key].end[mb] = self.clock.mark()

        self._handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(layer.register_forward_hook(post, with_kwargs=True))
        self._handles += [p.register_post_accumulate_grad_hook(accumulated)
                          for p in layer.parameters() if p.requires_grad]

    def _inside_chunk(self, hidden) -> bool:
        """Whether `hidden` is the previous layer's output within one checkpointed chunk
        (--recompute-num-layers > 1): the checkpoint keeps the chunk's input only. The
        output still has the kind of autograd node its layer gave it (Megatron's
        bias-dropout-add runs with grad enabled: AddBackward0 or a compiled function's, or
        none); the chunk's output, by the time the next chunk takes it, has the
        checkpoint's backward node instead (by kind: a node's Python wrapper, and so its
        id, need not outlive the hook on every torch)."""
        output, kind = self._unsaved_output
        return output() is hidden and type(hidden.grad_fn) is kind

    @property
    def _kept_input_share(self) -> int:
        """The ranks a checkpoint's kept input is split over: Megatron's
        distribute_saved_activations keeps 1/TP of it on each tensor-parallel rank."""
        config = getattr(self.model, "config", None)
        return (getattr(config, "tensor_model_parallel_size", 1) or 1) if getattr(
            config, "distribute_saved_activations", False) else 1

    def _backward_ends(self, number: int, mb: int, hidden) -> None:
        """Mark where the layer's backward of `mb` ends: its input's gradient, or, where
        the input needs none (after a frozen prefix), its last weight gradient."""
        if torch.is_tensor(hidden) and hidden.requires_grad:
            self._ends_at_weights.discard((number, mb))
            self._at_grad(hidden, self._grad_mark(f"bwd/{number}", "end", mb), True)
        else:
            self._ends_at_weights.add((number, mb))

    def _recompute_begins(self, number: int, hidden) -> None:
        """A layer's forward run again inside the backward (module docstring): the next
        segment of its micro-batch's backward span, unless that span is already open (a
        recompute started by the backward itself, inside the span)."""
        bwd_key = f"bwd/{number}"
        mb = self._next_mb(f"recompute/{number}")
        spans = self._spans[bwd_key]
        if mb in spans.start and mb not in spans.end:  # counted in the span; its end is marked
            return
        self._backward_ends(number, mb, hidden)
        self._recomputing[number] = (mb, self.clock.begin())
        self._range(bwd_key, mb, True)

    def _recompute_ends(self, number: int):
        """Close a recompute's segment; its micro-batch, or None where it opened none (a
        recompute inside the span, which torch may also stop before the layer's end)."""
        started = self._recomputing.pop(number, None)
        if started is None:
            return None
        mb, start = started
        self._range(f"bwd/{number}", mb, False)
        self._spans[f"bwd/{number}"].before[mb].append((start, self.clock.mark()))
        return mb

    def _hook_embedding(self, embedding: torch.nn.Module) -> None:
        # Spans are looked up on each call: _reset_iteration replaces the dict.
        def pre(module, args):
            if not module.training:  # evaluation (as the layers')
                return
            mb = self._next_mb("emb")
            self._spans["emb_fwd"].start[mb] = self.clock.begin()
            self._range("emb_fwd", mb, True)

        def post(module, args, output):
            if not module.training:
                return
            mb = self._counters["emb"] - 1
            self._range("emb_fwd", mb, False)
            self._spans["emb_fwd"].end[mb] = self.clock.mark()
            if output.requires_grad:
                self._at_grad(output, self._grad_mark("emb_bwd", "start", mb), False)

        def accumulated(param):  # the last embedding weight grad ends the stage backward
            spans = self._spans["emb_bwd"]
            pending = [mb for mb in spans.start if mb not in spans.end]
            if pending:
                self._range("emb_bwd", min(pending), False)
                spans.end[min(pending)] = self.clock.mark()

        self._handles.append(embedding.register_forward_pre_hook(pre))
        self._handles.append(embedding.register_forward_hook(post))
        weight = embedding.word_embeddings.weight
        if weight.requires_grad:
            self._handles.append(weight.register_post_accumulate_grad_hook(accumulated))

    def _mtp_nested(self) -> dict[str, "_Spans"]:
        """The MTP spans inside the head's (the last stage runs the block within GPTModel's
        post-processing), by head key; {} where the stage has no head."""
        if not getattr(self.model, "post_process", False):
            return {}
        return {"head_fwd": self._spans["mtp/fwd"], "head_bwd": self._spans["mtp/bwd"]}

    def _hook_mtp(self, block: torch.nn.Module) -> None:
        """The MTP block as one unit (`MultiTokenPredictionBlock`, called with keyword
        arguments): forward by module hooks, backward from the gradient at its output to
        the gradient at its input `hidden_states`; its embedding use falls inside."""
        def pre(module, args, kwargs):
            if not module.training:  # evaluation (as the layers')
                return
            mb = self._next_mb("mtp")
            hidden = kwargs.get("hidden_states")
            if torch.is_tensor(hidden) and hidden.requires_grad:
                self._at_grad(hidden, self._grad_mark("mtp/bwd", "end", mb), True)
            if self.count_activations:
                saved = SavedBytes(self._param_ptrs)
                self._mtp_saved[mb] = saved
                saved.__enter__()
            self._spans["mtp/fwd"].start[mb] = self.clock.begin()
            self._range("mtp/fwd", mb, True)  # its kernels are the block's, not the head's

        def post(module, args, kwargs, output):
            if not module.training:
                return
            mb = self._counters["mtp"] - 1
            self._range("mtp/fwd", mb, False)
            self._spans["mtp/fwd"].end[mb] = self.clock.mark()
            if self.count_activations:
                self._mtp_saved[mb].__exit__(None, None, None)
            if torch.is_tensor(output) and output.requires_grad:
                self._at_grad(output, self._grad_mark("mtp/bwd", "start", mb), False)

        self._handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(block.register_forward_hook(post, with_kwargs=True))

    def _hook_head(self) -> None:
        norm = getattr(self.model.decoder, "final_layernorm", None)
        start_module = norm if norm is not None else self.model.output_layer

        def pre(module, args):
            if not module.training:  # evaluation (as the layers')
                return
            mb = self._next_mb("head")
            self._spans["head_fwd"].start[mb] = self.clock.begin()
            self._range("head_fwd", mb, True)
            hidden = args[0] if args else None
            if torch.is_tensor(hidden) and hidden.requires_grad:
                self._at_grad(hidden, self._grad_mark("head_bwd", "end", mb), True)

        def post(module, args, output):
            if not module.training:
                return
            mb = self._counters["head"] - 1
            self._range("head_fwd", mb, False)
            self._spans["head_fwd"].end[mb] = self.clock.mark()
            if torch.is_tensor(output) and output.requires_grad:
                self._at_grad(output, self._grad_mark("head_bwd", "start", mb), False)

        self._handles.append(start_module.register_forward_pre_hook(pre))
        self._handles.append(self.model.register_forward_hook(post))
