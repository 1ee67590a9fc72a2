"""The four functions of `megatron.training.training` that `megatron_lm.enable()` wraps
(each calls the original; their state is `megatron_lm_hooks.hooks`):

  initialize_megatron       - the plugin's flags chained into the caller's provider, the
                              saved layout and the MoE spec set before validate_args, the
                              plugin's config validated once
  setup_model_and_optimizer - the run (`make_run`: `megatron_lm._Run`) built on what it
                              returns
  train_step                - the run's before_step/after_step around every step
  train                     - the run finished (report, writers) when train() ends
"""
from __future__ import annotations

import inspect
from typing import Callable

from dynmo_plugin.integrations.megatron_lm_args import load_plugin_config, use_native_moe_spec
from dynmo_plugin.integrations.megatron_lm_checkpoint import refuse_scenario_resume, restore_saved_layout
from dynmo_plugin.integrations.megatron_lm_flags import chain_flags
from dynmo_plugin.integrations.megatron_lm_hooks import hooks as _hooks

__all__ = ["wrappers"]


def wrappers(make_run: Callable) -> dict[str, Callable]:
    """For each wrapped function's name, what makes its wrapper from the original;
    `make_run(cfg, args, model, optimizer, scheduler)` builds the run the hooks drive."""
    return {"initialize_megatron": _wrap_initialize,
            "setup_model_and_optimizer": lambda original: _wrap_setup(original, make_run),
            "train_step": _wrap_train_step, "train": _wrap_train}


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
        model, optimizer, scheduler = original(*a, **kw)
        cfg = _hooks.cfg
        if cfg is not None and cfg.dynmo.enabled and optimizer is not None:
            from megatron.training import get_args
            _hooks.run = make_run(cfg, get_args(), model, optimizer, scheduler)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _wrap_train_step(original):
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        run = _hooks.run
        if run is None or iteration is None:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                            config, forward_backward_func, iteration=iteration)
        n = iteration + 1  # Megatron-LM passes the iterations done; the plugin numbers from 1
        run.before_step(n, model, optimizer)
        result = original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                          config, forward_backward_func, iteration=iteration)
        run.after_step(n, result)
        return result
    return train_step


def _wrap_train(original):
    def train(*a, **kw):
        try:
            return original(*a, **kw)
        finally:
            if _hooks.run is not None:
                _hooks.run.finish()
    return train
