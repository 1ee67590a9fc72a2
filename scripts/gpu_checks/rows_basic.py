"""Rows on the machine, the packages, the heavy-layer profile on CPU, Transformer
Engine, speed, bit-exact migration and repack."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from gpu_checks.common import CheckFailed, FORCED, HEAVY_FACTOR, HEAVY_LAYER, HEAVY_TOLERANCE, Machine, NO_CUDA, Row, Sizes, compare_params, heavy_layer_verdict, last_profile, load_params
from gpu_checks.launching import launch, losses, tokens_per_s


# ---- the checks -------------------------------------------------------------------------------
def probe_machine(cpu_mode: bool) -> Machine:
    import torch

    from dynmo_plugin.megatron.training.machine import transformer_engine_problem
    from dynmo_plugin.train import build_parser
    count = 0 if cpu_mode else torch.cuda.device_count()
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    return Machine(gpus=[torch.cuda.get_device_name(i) for i in range(count)],
                   torch=torch.__version__, cuda=torch.version.cuda,
                   te_problem=transformer_engine_problem() if count else "no CUDA",
                   bf16="--bf16" in flags, cpu_mode=cpu_mode)


def check_machine(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    if m.cpu_mode:
        return Row("machine", NO_CUDA, f"--cpu/--dry-run; torch {m.torch}")
    if not m.gpus:
        raise CheckFailed(f"no CUDA GPU visible (torch {m.torch}, built for CUDA {m.cuda}); "
                          "run on a GPU machine, or --dry-run to check this script on CPU")
    names = sorted(set(m.gpus))
    return Row("machine", "pass", f"{len(m.gpus)} x {', '.join(names)}; torch {m.torch}, CUDA {m.cuda}")


def check_packages(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    """megatron-core imports (not only its metadata: the carried wheel installed with
    --no-deps may lack a dependency), and Transformer Engine's state."""
    from importlib.metadata import version
    try:
        import megatron.core  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is this row's verdict
        raise CheckFailed(f"megatron-core does not import: {type(e).__name__}: {e}"[:300]) from e
    te = ("transformer_engine imports: default --transformer-impl transformer_engine"
          if m.te_problem is None else f"Transformer Engine not usable ({m.te_problem}): local layers")
    return Row("packages", "pass", f"megatron-core {version('megatron-core')} imports; {te}")


def check_precision_flag(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    if m.bf16:
        return Row("precision_flag", "pass", "the launcher takes --bf16")
    raise CheckFailed("the launcher's parser has no --bf16: every timing row would run fp32, "
                      "which no row's bound is for")


def _precision(m: Machine) -> list[str]:
    return ["--bf16"] if m.bf16 and not m.cpu_mode else []


def check_profile_heavy_layer(m: Machine, sizes: Sizes, out: Path) -> Row:
    # through the launcher worker's own switch, the one the GPU shape rows use (CI runs it)
    flags = [*sizes.heavy, "--dynmo", "--transformer-impl", "local", *_precision(m),
             "--gpu-check-heavy", f"{HEAVY_LAYER}:{HEAVY_FACTOR}"]
    report = launch(1, flags, out / "heavy")
    detail = heavy_layer_verdict(last_profile(report), HEAVY_LAYER, HEAVY_FACTOR, HEAVY_TOLERANCE)
    precision = "bf16" if _precision(m) else "fp32"
    return Row("profile_heavy_layer", "pass", f"PP=1 {precision}: {detail}")


def check_transformer_engine(m: Machine, sizes: Sizes, out: Path) -> Row:
    if not m.gpus:
        return Row("transformer_engine", NO_CUDA)
    if m.te_problem is not None:
        return Row("transformer_engine", f"skipped: TE not usable ({m.te_problem})")
    report = launch(1, [*sizes.heavy, "--dynmo", "--transformer-impl", "transformer_engine",
                        *_precision(m)], out / "te")
    got = losses(report)
    if not all(math.isfinite(x) for x in got):
        raise CheckFailed(f"non-finite loss with TE layers: {got}")
    layers = last_profile(report)["layers"]
    if len(layers) != report["config"]["model"]["num_layers"] or min(x["fwd_s"] for x in layers) <= 0:
        raise CheckFailed(f"the profile of TE layers is incomplete: {len(layers)} layers")
    return Row("transformer_engine", "pass", f"loss {got[0]:.3f} -> {got[-1]:.3f}; "
               f"{len(layers)} TE layers profiled")


def check_speed(m: Machine, sizes: Sizes, out: Path) -> Row:
    if not m.gpus:
        return Row("bf16_vs_fp32_speed", NO_CUDA)
    fp32 = launch(1, sizes.speed, out / "speed_fp32")
    impl = fp32["config"]["model"].get("transformer_impl", "?")
    t32 = tokens_per_s(fp32)
    if not m.bf16:
        return Row("bf16_vs_fp32_speed", "skipped: launcher has no --bf16",
                   f"fp32 only: {t32:,.0f} tokens/s ({impl} layers)")
    t16 = tokens_per_s(launch(1, [*sizes.speed, "--bf16"], out / "speed_bf16"))
    detail = f"fp32 {t32:,.0f} | bf16 {t16:,.0f} tokens/s = {t16 / t32:.2f}x ({impl} layers)"
    if t16 <= t32:
        raise CheckFailed(detail + "; bf16 is not faster: is --bf16 applied?")
    return Row("bf16_vs_fp32_speed", "pass", detail)


def _bitexact(name: str, a_dir: Path, a: dict, b_dir: Path, b: dict, a_ranks, b_ranks) -> None:
    if losses(a) != losses(b):
        raise CheckFailed(f"{name}: losses differ: {losses(a)} vs {losses(b)}")
    differ = compare_params(load_params(a_dir, a_ranks), load_params(b_dir, b_ranks))
    if differ:
        raise CheckFailed(f"{name}: {len(differ)} parameters differ, e.g. {differ[:3]}")


def check_migration(m: Machine, sizes: Sizes, out: Path, precision: str) -> Row:
    name = f"migration_bitexact[{precision}]"
    if len(m.gpus) < 2:
        return Row(name, NO_CUDA if not m.gpus else f"skipped: needs 2 GPUs ({len(m.gpus)} visible)")
    flags = [*sizes.exact, "--pipeline-model-parallel-size", "2"]
    flags += ["--bf16"] if precision == "bf16" else []
    static = launch(2, flags, out / f"static_{precision}", deterministic=True)
    moved = launch(2, [*flags, "--dynmo-forced-layouts", FORCED], out / f"moved_{precision}", deterministic=True)
    applied = [e.get("applied") for e in moved["events"] if e.get("kind") == "rebalance"]
    if applied != [True, True]:
        errors = [e.get("error") for e in moved["events"] if e.get("kind") == "rebalance"]
        raise CheckFailed(f"forced migrations applied {applied}: {errors}")
    _bitexact(name, out / f"static_{precision}", static, out / f"moved_{precision}", moved,
              range(2), range(2))
    moves = sum(len(e["moves"]) for e in moved["events"] if e.get("kind") == "rebalance")
    seconds = [e["migration"]["total_s"] for e in moved["events"] if e.get("kind") == "rebalance"]
    return Row(name, "pass", f"{moves} layer moves in 2 migrations ({', '.join(f'{s:.3f}' for s in seconds)} s); "
               f"{len(losses(moved))} losses and all parameters bit-exact "
               f"({moved['config']['model'].get('transformer_impl', '?')} layers)")


def check_repack(m: Machine, sizes: Sizes, out: Path) -> Row:
    if len(m.gpus) < 2:
        return Row("repack_2_to_1", NO_CUDA if not m.gpus else f"skipped: needs 2 GPUs ({len(m.gpus)} visible)")
    ckpt = out / "repack_ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)  # this row's own scratch from an earlier --out run
    launch(2, [*sizes.exact, "--pipeline-model-parallel-size", "2", "--train-iters", "2",
               "--save", str(ckpt), "--save-interval", "2"], out / "repack_saved", deterministic=True)
    resumed = launch(1, [*sizes.exact, "--pipeline-model-parallel-size", "1", "--load", str(ckpt)],
                     out / "repack_resumed", deterministic=True)
    repacked = launch(2, [*sizes.exact, "--pipeline-model-parallel-size", "2", "--dynmo-repack",
                          "--dynmo-forced-layouts", "3:EttttttttL"], out / "repacked", deterministic=True)
    (event,) = [e for e in repacked["events"] if e.get("kind") == "rebalance"]
    rp = event.get("repack") or {}
    if not rp.get("applied") or repacked["layout"] != "EttttttttL":
        raise CheckFailed(f"repack not applied: {event.get('error') or rp.get('error')}")
    if losses(repacked)[2:] != losses(resumed):
        raise CheckFailed(f"losses after the repack differ: {losses(repacked)[2:]} vs {losses(resumed)}")
    differ = compare_params(load_params(out / "repacked", [0]), load_params(out / "repack_resumed", [0]))
    if differ:
        raise CheckFailed(f"{len(differ)} parameters differ after the repack, e.g. {differ[:3]}")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in rp.get("phase_s", {}).items())
    return Row("repack_2_to_1", "pass", f"ranks released {rp.get('ranks_released')}; phases (s): "
               f"{phases}; losses and parameters equal to the resumed PP=1 run")
