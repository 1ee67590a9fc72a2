"""The five functions of `megatron.training.training` and the one of its checkpointing
that `megatron_lm.enable()` wraps (each calls the original; their state is
`megatron_lm_hooks.hooks`):

  initialize_megatron       - the plugin's flags chained into the caller's provider, the
                              saved layout and the MoE spec set before validate_args, the
                              plugin's config validated once
  setup_model_and_optimizer - the run (`make_run`: `megatron_lm._Run`) built on what it
                              returns; with --dynmo, the optimizers' gradient norm
                              summed exactly, whichever rank holds which gradient
                              (grad_norm), and the data-parallel gradients reduced
                              in rank order (grad_reduce)
  build_train_valid_test_data_iterators
                            - with MTP on three or more pipeline ranks, the datasets
                              built on every rank (megatron_lm_data), so the block can
                              move live
  train_step                - the run's before_step/after_step around every step, and
                              its rerun_started when Megatron runs a step again in place
  train                     - its checkpointing context handed to the stage (a move
                              or rebuild drops the save plans cached there); its forward step
                              reads in lockstep on every rank where the data is there
                              (megatron_lm_data); the run finished (report, writers)
                              when train() ends
  checkpointing.generate_state_dict
                            - what a save writes: frozen parameters' optimizer rows
                              filled, Adam's step on a wholly frozen stage too
                              (megatron_lm_checkpoint)
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable

from dynmo_plugin.integrations.megatron_lm_args import load_plugin_config, use_native_moe_spec
from dynmo_plugin.integrations.megatron_lm_checkpoint import (frozen_optimizer_state, refuse_scenario_resume,
                                                              restore_saved_layout, steps_everywhere)
from dynmo_plugin.integrations.megatron_lm_data import (data_everywhere, every_rank_builds,
                                                        feeds_every_rank, lockstep)
from dynmo_plugin.integrations.megatron_lm_flags import chain_flags
from dynmo_plugin.integrations.megatron_lm_hooks import hooks as _hooks

__all__ = ["wrappers"]


def wrappers(make_run: Callable) -> dict[str, Callable]:
    """For each wrapped function's name, what makes its wrapper from the original;
    `make_run(cfg, args, model, optimizer, scheduler)` builds the run the hooks drive."""
    return {"initialize_megatron": _wrap_initialize,
            "setup_model_and_optimizer": lambda original: _wrap_setup(original, make_run),
            "build_train_valid_test_data_iterators": _wrap_data_iterators,
            "train_step": _wrap_train_step, "train": _wrap_train,
            "checkpointing.generate_state_dict": _wrap_generate_state_dict}


def _wrap_initialize(original):
    signature = inspect.signature(original)

    def initialize_megatron(*a, **kw):
        bound = signature.bind(*a, **kw)
        bound.apply_defaults()
        given = bound.arguments
        if not getattr(given["extra_args_provider"], "dynmo_chained", False):
            given["extra_args_provider"] = chain_flags(given["extra_args_provider"])
        if given["parsed_args"] is None:  # parsed here so the saved layout can join them
            from megatron.training.arguments import parse_args  # before validate_args
            given["parsed_args"] = parse_args(given["extra_args_provider"],
                                              given["ignore_unknown_args"])
        restore_saved_layout(given["parsed_args"])
        use_native_moe_spec(given["parsed_args"])
        out = original(*bound.args, **bound.kwargs)
        from megatron.training import get_args
        _hooks.cfg = load_plugin_config(get_args())
        refuse_scenario_resume(get_args(), _hooks.cfg)
        return out
    return initialize_megatron


def _wrap_setup(original, make_run: Callable):
    def setup_model_and_optimizer(*a, **kw):
        _hooks.run = None  # a run of an earlier pretrain() in this process is over
        model, optimizer, scheduler = original(*a, **kw)
        cfg = _hooks.cfg
        if cfg is not None and cfg.dynmo.enabled and optimizer is not None:
            from megatron.training import get_args

            from dynmo_plugin.megatron.training import grad_norm, grad_reduce
            # --clip-grad: the same norm whichever stage holds a layer, shards cut anywhere
            grad_norm.install(sharded=get_args().use_distributed_optimizer)
            grad_reduce.choose(cfg.dynmo.native_grad_reduce)  # DP >= 3: the same sums wherever a layer sits
            _hooks.run = make_run(cfg, get_args(), model, optimizer, scheduler)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _wrap_data_iterators(original):
    def build_train_valid_test_data_iterators(provider):
        run = _hooks.run
        if run is None or not feeds_every_rank(run.stage):
            return original(provider)
        with every_rank_builds(provider):
            iterators = original(provider)
        run.data_built(data_everywhere(iterators[0], run.stage.dims.device))
        return iterators
    return build_train_valid_test_data_iterators


def _wrap_train_step(original):
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        run = _hooks.run
        if run is None or iteration is None:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                            config, forward_backward_func, iteration=iteration)
        n = iteration + 1  # Megatron-LM passes the iterations done; the plugin numbers from 1
        run.before_step(n, model, optimizer)
        with _reruns_told(lambda: run.rerun_started(n)):
            result = original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                              config, forward_backward_func, iteration=iteration)
        run.after_step(n, result)
        return result
    return train_step


@contextlib.contextmanager
def _reruns_told(started: Callable[[], None]):
    """Around one train_step: `started()` each time Megatron's rerun state machine runs the
    step's forward and backward again in place (--rerun-mode validate_results, whenever a
    check such as --check-for-spiky-loss fires: the rerun is its reproducibility test):
    what the step counted so far (router tokens, a window's times) ran once already.
    train_step asks the machine `should_run_forward_backward` before every run of it."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    machine = get_rerun_state_machine()
    ask, runs = machine.should_run_forward_backward, 0

    def counted(data_iterator) -> bool:
        nonlocal runs
        again = ask(data_iterator)
        runs += again
        if again and runs > 1:
            started()
        return again
    machine.should_run_forward_backward = counted
    try:
        yield
    finally:
        del machine.should_run_forward_backward  # the class's method again


def _wrap_train(original):
    signature = inspect.signature(original)

    def train(*a, **kw):
        run = _hooks.run
        try:
            if run is not None:
                bound = signature.bind(*a, **kw)
                run.stage.checkpointing_context = bound.arguments["checkpointing_context"]
                if run.stage.mtp_moves_live:
                    bound.arguments["forward_step_func"] = lockstep(
                        bound.arguments["forward_step_func"], run.stage)
                    a, kw = bound.args, bound.kwargs
            return original(*a, **kw)
        finally:
            if _hooks.run is not None:
                _hooks.run.finish()
    return train


def _wrap_generate_state_dict(original):
    def generate_state_dict(args, model, optimizer, *a, **kw):
        run = _hooks.run
        if run is None or (kw.get("optim_sd_kwargs") or {}).get("is_loading"):
            return original(args, model, optimizer, *a, **kw)  # a load: nothing frozen yet
        with steps_everywhere(run.control, args, optimizer):
            state = original(args, model, optimizer, *a, **kw)
        state.update(frozen_optimizer_state(run.stage, args, state))
        return state
    return generate_state_dict
