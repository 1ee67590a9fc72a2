"""Megatron-LM flags the launcher meets on a Megatron user's command line.

Where `dynmo-train` can honour a Megatron-LM flag with Megatron-LM's meaning it is a
schema field (`--weight-decay`, `--exit-signal-handler`); the flags below it cannot
honour are accepted by the parser only to be refused in one line that says what to use
instead (argparse alone would print its whole usage for an unknown flag, or, with
abbreviations on, take `--num-layer` for `--num-layers`). `--num-layers-per-virtual-
pipeline-stage` is Megatron-LM's older spelling of the virtual pipeline size: it is
translated to --num-virtual-stages-per-pipeline-rank. Pure: standard library only.
"""
from __future__ import annotations

import argparse
from typing import Any

from dynmo_plugin.config.fields import ConfigError

__all__ = ["add_megatron_compat_args", "apply_megatron_compat"]

# flag -> (argparse type, what to use instead)
REFUSED = {
    "--eval-interval": (int, "dynmo-train has no evaluation loop; drop it, or train with Megatron-LM's "
                             "pretrain_gpt.py and megatron_lm.enable() (docs/megatron-lm.md)"),
    "--eval-iters": (int, "dynmo-train has no evaluation loop; drop it, or train with Megatron-LM's "
                          "pretrain_gpt.py and megatron_lm.enable() (docs/megatron-lm.md)"),
    "--tensorboard-dir": (str, "dynmo-train writes no TensorBoard events; its per-iteration record "
                               "is --output DIR/report.json (plots: dynmo report DIR), or train with "
                               "Megatron-LM's pretrain_gpt.py and megatron_lm.enable()"),
    "--num-query-groups": (int, "dynmo-train's GPT has multi-head attention only (no grouped-query "
                                "attention); drop it, or train with Megatron-LM's pretrain_gpt.py "
                                "and megatron_lm.enable()"),
    "--group-query-attention": (None, "dynmo-train's GPT has multi-head attention only; drop it, or "
                                      "train with Megatron-LM's pretrain_gpt.py and megatron_lm.enable()"),
}


def _dest(flag: str) -> str:
    return "megatron__" + flag[2:].replace("-", "_")


def add_megatron_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM flags dynmo-train refuses (saying what to use)")
    for flag, (kind, _) in REFUSED.items():
        kw: dict[str, Any] = {"action": "store_true"} if kind is None else {"type": kind}
        group.add_argument(flag, dest=_dest(flag), default=None, help=argparse.SUPPRESS, **kw)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        dest=_dest("--num-layers-per-virtual-pipeline-stage"), metavar="N",
                        help="Megatron-LM's older spelling: layers per virtual stage, i.e. "
                             "--num-virtual-stages-per-pipeline-rank = num_layers / (pp x N)")


def apply_megatron_compat(args: argparse.Namespace) -> None:
    """Refuse what cannot be honoured; translate the virtual-stage spelling in place.

    Raises:
        ConfigError: one line naming the flag and what to use.
    """
    for flag, (_, instead) in REFUSED.items():
        if getattr(args, _dest(flag), None) not in (None, False):
            raise ConfigError(f"flag {flag}: {instead}")
    per = getattr(args, _dest("--num-layers-per-virtual-pipeline-stage"), None)
    if per is None:
        return
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None) is not None:
        raise ConfigError("flag --num-layers-per-virtual-pipeline-stage: give it or "
                          "--num-virtual-stages-per-pipeline-rank, not both")
    layers, pp = args.num_layers, args.pipeline_model_parallel_size or 1
    if layers is None or per <= 0 or layers % (pp * per):
        raise ConfigError(f"flag --num-layers-per-virtual-pipeline-stage: {per} must divide "
                          f"--num-layers ({layers}) / --pipeline-model-parallel-size ({pp}); give "
                          "--num-layers explicitly, or --num-virtual-stages-per-pipeline-rank V")
    args.num_virtual_stages_per_pipeline_rank = layers // (pp * per)
