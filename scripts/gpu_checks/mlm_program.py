"""Megatron-LM's pretrain_gpt.py taking turns on the GPU (scripts/gpu_checks/baton.py).

    torchrun ... scripts/gpu_checks/mlm_program.py <pretrain_gpt.py flags>     # on CUDA
    torchrun ... scripts/gpu_checks/mlm_program.py --cpu-harness <flags>       # on CPU

Runs what `python -m dynmo_plugin.integrations.pretrain_gpt` runs (Megatron-LM's own
script, the plugin hooked in by `megatron_lm.enable`), with one addition: right after
`enable()`, Megatron-LM's `train_step` is wrapped by the baton of $DYNMO_CHECK_BATON, so
train() waits for its turn at each round's first iteration. In the --dynmo program the
baton's `alternate` has the plugin bypassed on alternate iterations (Megatron-LM's own
train_step runs them: BatonSpec.plugin_runs), its cost per step timed within one process. The wrapper is the outermost
one (outside the plugin's before/after_step: a profile window never contains a wait);
the wait still falls inside Megatron-LM's logged time of that iteration, which is why
every round's first iteration (and its last, which holds the hand-over's sync) is left out
of the timings (BatonSpec.edges).
--cpu-harness: the same around the CPU harness of tests/integrations/megatron_lm_harness.py
(Megatron-LM's real train() on gloo; pretrain() itself asserts CUDA), for the dry run.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_checks.baton import ENV, BatonClient, BatonSpec  # noqa: E402


def wrap_train_step(mtt, client: BatonClient) -> None:
    """Megatron-LM's train_step(…, iteration=k) runs iteration k + 1 (k counts those done).
    Where the plugin does not run (BatonSpec.plugin_runs), the step is Megatron-LM's own:
    `enable()` wrapped it with functools.wraps, which keeps it as `__wrapped__`."""
    inner = mtt.train_step
    bare = getattr(inner, "__wrapped__", None)
    if client.spec.alternate and bare is None:
        raise RuntimeError("the plugin's train_step wrapper keeps no __wrapped__: its on/off "
                           "comparison cannot bypass it (dynmo_plugin.integrations.megatron_lm.enable)")

    @functools.wraps(inner)
    def train_step(*args, **kwargs):
        iteration = kwargs["iteration"] + 1
        client.before(iteration)
        step = inner if client.spec.plugin_runs(iteration) else bare
        result = step(*args, **kwargs)
        client.after(iteration)
        return result
    mtt.train_step = train_step


def install(spec: BatonSpec) -> None:
    """Wrap train_step as soon as the plugin's `enable()` has wrapped it (outermost)."""
    from dynmo_plugin.integrations import megatron_lm
    enable, client = megatron_lm.enable, BatonClient(spec)

    def enable_then_baton() -> None:
        enable()
        import megatron.training.training as mtt
        wrap_train_step(mtt, client)
    megatron_lm.enable = enable_then_baton


def main() -> None:
    install(BatonSpec.from_env(os.environ[ENV]))
    if sys.argv[1:2] == ["--cpu-harness"]:
        del sys.argv[1]
        sys.path.insert(0, str(ROOT / "tests"))
        sys.path.insert(0, str(ROOT / "tests" / "integrations"))
        import megatron_lm_harness
        megatron_lm_harness.harness()
        return
    from dynmo_plugin.integrations.pretrain_gpt import main as pretrain_gpt
    pretrain_gpt()


if __name__ == "__main__":
    main()
