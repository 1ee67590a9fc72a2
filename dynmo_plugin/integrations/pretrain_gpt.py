"""`python -m dynmo_plugin.integrations.pretrain_gpt <Megatron-LM flags> --dynmo ...`

Runs Megatron-LM's own pretrain_gpt.py, unchanged, with the plugin hooked into its
pretrain() (dynmo_plugin.integrations.megatron_lm.enable). The Megatron-LM checkout
(tag core_v0.16.1) is $DYNMO_MEGATRON_LM, else the current directory. Launch it as
Megatron-LM's script is launched, e.g. under torchrun. A bad flag or an unknown
Megatron-LM version or a machine without CUDA exits 2 with one line.
"""
from __future__ import annotations

import os
import runpy
import sys

from dynmo_plugin.errors import USER_ERROR_EXIT, UserError
from dynmo_plugin.integrations import megatron_lm

__all__ = ["main"]


def main() -> None:
    try:
        root = os.environ.get(megatron_lm.SOURCE_ENV) or os.getcwd()
        if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
            raise megatron_lm.MegatronLMError(
                f"no pretrain_gpt.py in {root}: set {megatron_lm.SOURCE_ENV} to the root of a "
                f"Megatron-LM checkout at tag {megatron_lm.SUPPORTED_TAG}")
        root = megatron_lm.use_source(root)
        import torch
        if not torch.cuda.is_available():
            raise megatron_lm.MegatronLMError(
                "no CUDA GPU here: Megatron-LM's pretrain() asserts CUDA; on CPU train with the "
                "plugin's own launcher (python -m dynmo_plugin.train, docs/usage.md)")
        megatron_lm.enable()
        script = os.path.join(root, "pretrain_gpt.py")
        sys.argv[0] = script
        runpy.run_path(script, run_name="__main__")
    except UserError as e:
        print(f"dynmo_plugin: {e}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
