"""Every scheme's GEMM granularity (config.fields.multiple_of_8): a value that is not a
positive multiple of 8 is refused in one line naming the key, and the default is one."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dynmo_plugin.config import ConfigError, add_dynmo_args, add_model_args
from dynmo_plugin.megatron.training.machine import load_run_config

ROOT = Path(__file__).resolve().parents[2]
# (config file, flag, the key's section under dynamism, the key, its default)
KEYS = [("gradual_pruning.yaml", "--dynmo-pruning-width-multiple", "pruning", "width_multiple", 128),
        ("early_exit.yaml", "--dynmo-early-exit-token-multiple", "early_exit", "token_multiple", 64),
        ("mod.yaml", "--dynmo-mod-granularity", "mod", "granularity", 64),
        ("moe.yaml", "--dynmo-moe-granularity", "moe", "granularity", 64),
        ("sparse_attention.yaml", "--dynmo-sparse-attention-chunk-multiple", "sparse_attention",
         "chunk_multiple", 64)]


def _parser() -> argparse.ArgumentParser:
    return add_dynmo_args(add_model_args(argparse.ArgumentParser()))


@pytest.mark.parametrize("value", ["100", "60", "0", "-8"])
@pytest.mark.parametrize("config,flag,section,key,default", KEYS, ids=[k[3] + "-" + k[2] for k in KEYS])
def test_a_granularity_not_a_multiple_of_8_is_one_line_naming_the_key(config, flag, section, key,
                                                                       default, value):
    args = _parser().parse_args(["--dynmo-config", str(ROOT / "configs" / config), flag, value])
    with pytest.raises(ConfigError, match=rf"dynamism\.{section}\.{key}: expected a positive "
                                          r"multiple of 8") as error:
        load_run_config(args, world_size=2)
    assert "\n" not in str(error.value)
    defaults = load_run_config(_parser().parse_args([]), world_size=1).dynmo.dynamism
    assert getattr(getattr(defaults, section), key) == default
