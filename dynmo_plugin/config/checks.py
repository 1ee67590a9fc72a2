"""Checks across fields, run once by `config.load.load_config` after every value passed its
own field check: the model's shape against the world, precision, forced layouts, the
scenario's keys, repacking, packed data, and which transformer implementation to build.

What the machine offers (CUDA GPUs, whether Transformer Engine imports) is probed in
`dynmo_plugin.megatron.training.machine` and comes in as arguments; the dataset's vocabulary is
read by `dynmo_plugin.data.tokenizer`. Each problem is one `ConfigError` line naming
where the value came from and the fix.
"""
from __future__ import annotations

import logging
import os
import tempfile
from typing import Callable, Optional

from dynmo_plugin.config.fields import ConfigError
from dynmo_plugin.config.schema import ModelArgs, RunConfig
from dynmo_plugin.data.tokenizer import TokenizerError, dataset_vocab_size
from dynmo_plugin.layout import Layout, LayoutError
from dynmo_plugin.scenarios import SCENARIOS

__all__ = ["check_run", "check_shape", "check_paths", "check_transformer_impl", "recompute_block",
           "split_blocks", "check_forced_blocks", "check_chunks_fill", "MTP_CHUNKS_WHY",
           "BLOCK_MOVES_WHY", "block_recompute_moves",
           "resolve_transformer_impl", "check_dynmo_off", "PLUGIN_SECTIONS"]

# The sections that only act with --dynmo (dynamism runs in a static baseline too).
PLUGIN_SECTIONS = ("profiling", "rebalance", "repack", "cluster")

logger = logging.getLogger(__name__)


def check_run(cfg: RunConfig, given: dict[str, str], where: str, world_size: Optional[int]) -> None:
    """Every cross-field check of a resolved `cfg` but the machine's (`check_transformer_impl`,
    which `load_config` runs last), in the order its errors are reported.
    `given`: dotted key -> where it was set (file or flag); `where`: the config file, else
    "command line"; `world_size`: checked against TP x PP when known.

    Raises:
        ConfigError: the first problem.
    """
    check_shape(cfg.model, where, world_size)
    _check_precision(cfg, given)
    _check_manual_gc(cfg.model, given)
    _check_forced_layouts(cfg, where)
    _check_recompute(cfg, given)
    _check_mtp_repack(cfg, where)
    _check_dynamism(cfg, given)
    _check_repack(cfg, given)
    _check_interleaved_repack(cfg, where, world_size)
    _check_data(cfg, given)
    cfg.notices += filter(None, [check_dynmo_off(cfg, given)])
    _check_never(cfg, given)


def _check_never(cfg: RunConfig, given: dict[str, str]) -> None:
    """Settings that can never act in this run: the start profile past the last iteration
    is refused (the user asked for a balanced start and would get none); an interval
    longer than the run is a notice (a sweep may keep one interval over short runs)."""
    m, d = cfg.model, cfg.dynmo
    start = d.profiling.start_at
    if start and start + d.profiling.window - 1 > m.train_iters:
        where = given.get("profiling.start_at", "profiling.start_at")
        fix = (f"give --dynmo-start-balanced-at <= {m.train_iters - d.profiling.window + 1} or more "
               "--train-iters" if d.profiling.window <= m.train_iters else
               f"give --dynmo-profile-window <= {m.train_iters} or more --train-iters")
        raise ConfigError(f"{where}: profiling.start_at ({start}) + window ({d.profiling.window}) "
                          f"ends past --train-iters ({m.train_iters}): the run ends before the start "
                          f"profile closes; {fix}")
    if (m.save and not m.save_interval and not m.exit_signal_handler
            and not (d.repack.enabled and d.repack.mode == "checkpoint")):
        cfg.notices.append(f"{given.get('model.save', 'flag --save')}: --save-interval is 0: nothing is "
                           "saved (only a checkpoint repack or a signal with --exit-signal-handler saves "
                           "then); give --save-interval N to save every N iterations and the last, as "
                           "Megatron-LM does")
    for key, value, flag in (("rebalance.interval", d.rebalance.interval, "--dynmo-rebalance-interval"),
                             ("profiling.every", d.profiling.every, "--dynmo-profile-every")):
        if d.enabled and value > m.train_iters:
            cfg.notices.append(f"{given.get(key, key)}: {key} ({value}) is longer than --train-iters "
                               f"({m.train_iters}): {flag} never fires in this run")


def check_dynmo_off(cfg: RunConfig, given: dict[str, str]) -> Optional[str]:
    """Plugin settings while the plugin is off (no --dynmo, no `enabled: true`).

    A flag (`--dynmo-rebalance-interval 2` without --dynmo) is refused, as Megatron-LM's
    validate_args refuses a setting its feature is not on for: the user typed it for a run
    that would never read it. The same keys from the YAML file give a notice: one file
    serves a DynMo run and its static baseline (the same file without --dynmo, as
    tests/megatron/test_repack.py and scripts/bench_e2e.py compare them), so the run goes
    on, but not silently. `enabled: false` in the file says so on purpose: no notice.

    Raises:
        ConfigError: a plugin flag given without --dynmo.
    """
    if cfg.dynmo.enabled or "enabled" in given:
        return None
    keys = [k for k in given if k.split(".")[0] in PLUGIN_SECTIONS]
    for key in keys:
        if given[key].startswith("flag "):
            raise ConfigError(f"{given[key]}: {key}: set, but DynMo is off (no --dynmo): the run "
                              "would never read it; add --dynmo, or drop the flag for a static run")
    if keys:
        sections = sorted({k.split(".")[0] for k in keys})
        return (f"{given[keys[0]]}: {', '.join(sections)} set, but --dynmo is not given: DynMo is "
                "off and this run trains a static baseline (add --dynmo to profile and balance)")
    return None


def check_shape(m: ModelArgs, where: str, world_size: int | None = None) -> None:
    """Cross-field checks: layout vs layers, batch divisibility, world shape."""
    pp, tp = m.pipeline_model_parallel_size, m.tensor_model_parallel_size
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"{where}: --hidden-size ({m.hidden_size}) must be divisible by "
                          f"--num-attention-heads ({m.num_attention_heads})")
    v = m.num_virtual_stages_per_pipeline_rank
    if m.pipeline_model_parallel_layout is not None:
        try:
            Layout.parse(m.pipeline_model_parallel_layout, pp, m.num_layers, v,
                         m.mtp_num_layers or 0)
        except LayoutError as e:
            raise ConfigError(f"{where}: --pipeline-model-parallel-layout: {e}") from e
    elif m.num_layers < pp * v:
        raise ConfigError(f"{where}: --num-layers ({m.num_layers}) is smaller than "
                          f"--pipeline-model-parallel-size ({pp}) x "
                          f"--num-virtual-stages-per-pipeline-rank ({v}); give a layout with "
                          "empty stages")
    if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"{where}: model.seq_length ({m.seq_length}) exceeds "
                          f"model.max_position_embeddings ({m.max_position_embeddings}): "
                          "positions past the table have no embedding; raise "
                          "--max-position-embeddings or lower --seq-length")
    _check_schedule(m, where)
    if world_size is None:
        return
    _check_interleaved(m, where, world_size)
    if world_size % (tp * pp):
        raise ConfigError(f"{where}: world size {world_size} is not a multiple of TP({tp}) x PP({pp}); "
                          f"launch a multiple of {tp * pp} ranks (torchrun --nproc-per-node x --nnodes) "
                          "or change --pipeline-model-parallel-size / --tensor-model-parallel-size")
    dp = world_size // (tp * pp)
    if m.global_batch_size % (m.micro_batch_size * dp):
        raise ConfigError(f"{where}: --global-batch-size ({m.global_batch_size}) must be a multiple "
                          f"of --micro-batch-size ({m.micro_batch_size}) x DP ({dp})")


def _check_interleaved(m: ModelArgs, where: str, world_size: int) -> None:
    """Megatron's interleaved 1F1B runs micro-batches in groups of pp (its default
    microbatch_group_size_per_vp_stage) and refuses a partial last group."""
    pp, v = m.pipeline_model_parallel_size, m.num_virtual_stages_per_pipeline_rank
    if v == 1:
        return
    if pp < 2:
        raise ConfigError(f"{where}: --num-virtual-stages-per-pipeline-rank {v} needs "
                          "--pipeline-model-parallel-size >= 2 (Megatron interleaves only "
                          "across pipeline ranks)")
    micro = m.global_batch_size // (m.micro_batch_size * (world_size // (m.tensor_model_parallel_size * pp)))
    if micro % pp:
        raise ConfigError(f"{where}: the interleaved schedule (--num-virtual-stages-per-"
                          f"pipeline-rank {v}) needs the number of micro-batches ({micro} = "
                          f"--global-batch-size / (--micro-batch-size x DP)) to be a multiple "
                          f"of --pipeline-model-parallel-size ({pp}); change the batch sizes")


def _check_schedule(m: ModelArgs, where: str) -> None:
    decay = m.lr_decay_iters or m.train_iters
    if m.lr_warmup_iters >= decay:
        raise ConfigError(f"{where}: --lr-warmup-iters ({m.lr_warmup_iters}) must be smaller than "
                          f"the decay length ({decay}: --lr-decay-iters, else --train-iters)")
    if m.min_lr > m.lr:
        raise ConfigError(f"{where}: --min-lr ({m.min_lr}) must not exceed --lr ({m.lr})")


# What a run writes into --output (dynmo_plugin.report, `dynmo report`): each must be a file.
OUTPUT_FILES = ("report.json", "report.jsonl", "summary.md", "stage_loads.png", "training.png",
                "gpus.png")


def _unwritable(path: str) -> Optional[str]:
    """Why directory `path` cannot be created or written, or None. Nothing is left
    behind: the nearest existing ancestor must be a writable directory on a writable file
    system (statvfs: root ignores permission bits, not a read-only mount) in which a
    directory can be made (and is removed at once)."""
    if not path.strip():
        return "an empty path (the report would land in the working directory)"
    if "\0" in path:
        return "a path with a NUL byte"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return (f"{probe} is a file, not a directory" if probe == os.path.abspath(path) else
                f"{probe} is a file, so nothing can be created under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return f"{probe} is on a read-only file system"
        os.rmdir(tempfile.mkdtemp(prefix=".dynmo-probe-", dir=probe))  # what the bits do not
    except OSError as e:  # say: procfs, sysfs, FUSE and object-store mounts that refuse mkdir
        return f"{probe} refuses a new directory ({e.strerror})"
    return None


def check_paths(model: ModelArgs, extra: tuple = ()) -> None:
    """Every path the run will write, before anything is built or trained: --output (and
    the report files in it) and --save must be directories that exist or can be created
    and written; --load must not be a file. `extra`: (flag, key, directory) more (e.g.
    --tensorboard-dir). Whether --load holds a checkpoint is read_meta's question:
    dynmo_plugin.train asks it just as early.

    Raises:
        ConfigError: a path that training would fail on later, named with the fix.
    """
    for flag, key, path in (("--output", "model.output", model.output),
                            ("--save", "model.save", model.save), *extra):
        if path is None:
            continue
        why = _unwritable(path)
        if why:
            raise ConfigError(f"flag {flag}: {key}: cannot write to {path!r}: {why}; give a "
                              "writable directory (it is created if missing)")
    for name in OUTPUT_FILES:
        target = os.path.join(model.output, name)
        if os.path.isdir(target):
            raise ConfigError(f"flag --output: model.output: {target} is a directory, but the run "
                              f"writes its {name} there; remove it or give another --output")
    if model.load and os.path.exists(model.load) and not os.path.isdir(model.load):
        raise ConfigError(f"flag --load: model.load: {model.load} is a file, not a directory; "
                          "give the directory --save wrote (it holds "
                          "latest_checkpointed_iteration.txt)")


def resolve_transformer_impl(requested: Optional[str], cuda_devices: int, scenario: str,
                             te_problem: Callable[[], Optional[str]],
                             where: str = "--transformer-impl") -> tuple[str, Optional[str]]:
    """(implementation, a note to log or None) for --transformer-impl on this machine.

    Default: transformer_engine where CUDA GPUs are visible, TE imports (`te_problem()`
    is None, called only when it matters) and the scenario's layers support it; local
    otherwise, with a note when TE was usable but the scenario needs local layers.

    Raises:
        ConfigError: transformer_engine asked for without CUDA GPUs, without an
            importable TE, or with a local-only scenario (its registry entry's `local_only`).
    """
    local_only = SCENARIOS[scenario].local_only if scenario in SCENARIOS else None
    if requested == "local" or (requested is None and cuda_devices == 0):
        return "local", None
    if requested is None:
        problem = te_problem()
        if problem is not None:
            return "local", f"Transformer Engine does not import ({problem}); using local layers"
        if local_only:
            return "local", (f"scenario {scenario}: {local_only}; using local layers "
                             "(--transformer-impl local)")
        return "transformer_engine", None
    if cuda_devices == 0:
        raise ConfigError(f"{where}: transformer_engine needs CUDA GPUs and none is visible "
                          "here; use --transformer-impl local (the default without GPUs)")
    if local_only:
        raise ConfigError(f"{where}: transformer_engine cannot build the {scenario} scenario's "
                          f"layers ({local_only}); use --transformer-impl local")
    problem = te_problem()
    if problem is not None:
        raise ConfigError(f"{where}: transformer_engine does not import here ({problem}); "
                          "install it (pip install -c constraints.txt 'transformer-engine[pytorch]' "
                          "or the NGC image, docs/docker.md) or use --transformer-impl local")
    return "transformer_engine", None


def check_transformer_impl(cfg: RunConfig, given: dict[str, str], cuda_devices: int,
                           te_problem: Callable[[], Optional[str]]) -> None:
    """Fix model.transformer_impl once, so the report records what was built. The
    machine's answers (`megatron.machine`) come in as arguments: config/ probes nothing."""
    source = given.get("model.transformer_impl", "flag --transformer-impl")
    where = source if source.startswith("flag ") else f"{source}: model.transformer_impl"
    impl, note = resolve_transformer_impl(cfg.model.transformer_impl, cuda_devices,
                                          cfg.dynmo.dynamism.kind, te_problem, where)
    if note:
        logger.info("%s", note)
    cfg.model.transformer_impl = impl


def _check_precision(cfg: RunConfig, given: dict[str, str]) -> None:
    """One training precision; loss scaling only where it means something (fp16)."""
    m = cfg.model
    if m.bf16 and m.fp16:
        raise ConfigError(f"{given.get('model.fp16', 'command line')}: --bf16 and --fp16 both set; "
                          "choose one precision")
    if m.loss_scale is not None and not m.fp16:
        raise ConfigError(f"{given.get('model.loss_scale', 'command line')}: --loss-scale "
                          f"{m.loss_scale} needs --fp16 (bf16 and fp32 train unscaled)")


def _check_manual_gc(m: ModelArgs, given: dict[str, str]) -> None:
    """A collection interval only where the run, not the allocations, collects."""
    if m.manual_gc_interval and not m.manual_gc:
        raise ConfigError(f"{given.get('model.manual_gc_interval', 'command line')}: "
                          f"--manual-gc-interval {m.manual_gc_interval} does nothing without "
                          "--manual-gc (Megatron-LM ignores it there too): add --manual-gc")


def recompute_block(args) -> int:
    """Layers every (virtual) stage must hold a multiple of: N under Megatron's full
    recompute in uniform chunks of N (`--recompute-method uniform --recompute-num-layers
    N`: it checkpoints a stage's layers N at a time from its first, stepping N up to the
    stage's count, and indexes past a count that is not a multiple), else 1. The
    balancers keep to it (`BalanceProblem.layer_block`). `args`: Megatron-LM's or the
    launcher's ModelArgs, which name the settings alike."""
    if (getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "uniform"):
        return max(int(getattr(args, "recompute_num_layers", None) or 1), 1)
    return 1


# Megatron's block recompute checkpoints the first N layers of each stage, whichever they
# are: a layer's cost and memory belong to its place, which a move changes and the
# balancer's per-layer model does not follow (measured: +-563200 bytes a stage after a move)
BLOCK_MOVES_WHY = ("--recompute-method block with --dynmo moving layers: Megatron recomputes the first "
                   "N layers of each stage, whichever they are, so a moved layer's cost and memory "
                   "change with its place, which the balancer does not model")


def layers_may_move(args, cfg: RunConfig) -> bool:
    """--dynmo with a rebalance interval, a balanced start, a forced layout, a repack or a
    scenario whose events rebalance. Profile-only runs (--dynmo-profile-every) move
    nothing. Not the balancer's name: the uniform one moves layers too where the start is
    not uniform."""
    d = cfg.dynmo
    return d.enabled and bool(d.rebalance.interval or d.profiling.start_at or d.rebalance.forced_layouts
                              or d.repack.enabled or d.dynamism.kind != "none"
                              or getattr(args, "num_experts", None))


def block_recompute_moves(args, cfg: RunConfig) -> bool:
    """Block recompute in a run whose layers may move (`BLOCK_MOVES_WHY`)."""
    return (getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "block" and layers_may_move(args, cfg))


# Megatron's MTP block recomputes its layers one at a time only (it asserts otherwise)
MTP_CHUNKS_WHY = ("--mtp-num-layers with --recompute-method uniform --recompute-num-layers > 1: "
                  "Megatron's MTP recompute asserts 'recompute_num_layers must be 1'")


def split_blocks(layout: Layout, block: int) -> Optional[str]:
    """Why `layout` cannot run under uniform recompute in chunks of `block`, or None."""
    split = [(s, c) for s, c in enumerate(layout.counts) if c % block]
    if not split:
        return None
    shown = ", ".join(f"stage {s} holds {c}" for s, c in split[:4])
    return (f"{shown} layers, not a multiple of --recompute-num-layers {block} (Megatron's uniform "
            f"recompute checkpoints a stage's layers {block} at a time and indexes past the "
            "last)")


def check_forced_blocks(cfg: RunConfig, block: int, where: str) -> None:
    """Every forced layout keeps whole blocks of `block` layers on each stage (`recompute_block`)."""
    m = cfg.model
    for it, text in cfg.dynmo.rebalance.forced_layouts.items() if block > 1 else ():
        why = split_blocks(Layout.parse(text, None, m.num_layers, m.num_virtual_stages_per_pipeline_rank,
                                        m.mtp_num_layers or 0), block)
        if why:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: layout {text!r}: {why}; "
                              f"give every stage a multiple of {block} layers")


def _check_recompute_chunks(cfg: RunConfig, block: int, where: str) -> None:
    """Uniform recompute in chunks of `block` > 1 (`recompute_block`): every stage of the
    starting split and of each forced layout holds whole chunks, the balancers can fill
    every stage with them, and no MTP block (Megatron's MTP recompute asserts)."""
    m = cfg.model
    if block == 1:
        return
    if m.mtp_num_layers:
        raise ConfigError(f"{where}: {MTP_CHUNKS_WHY}; give --recompute-num-layers 1 or "
                          "--recompute-method block")
    v, text = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_layout
    start = (Layout.parse(text, None, m.num_layers, v) if text
             else Layout.uniform(m.num_layers, m.pipeline_model_parallel_size * v, v))
    why = split_blocks(start, block)
    if why:
        what = (f"--pipeline-model-parallel-layout {text}" if text else
                f"Megatron's even split of --num-layers {m.num_layers} ({start})")
        raise ConfigError(f"{where}: {what}: {why}; give every stage a multiple of {block} layers, "
                          "or another --recompute-num-layers")
    check_forced_blocks(cfg, block, where)
    check_chunks_fill(cfg, block, start.num_stages, where)


def check_chunks_fill(cfg: RunConfig, block: int, stages: int, where: str) -> None:
    """With --dynmo, whole chunks of `block` layers can fill every one of `stages` (virtual)
    stages, or empty stages are allowed: otherwise every decision would find no plan."""
    n = cfg.model.num_layers
    if block > 1 and cfg.dynmo.enabled and not cfg.dynmo.rebalance.allow_empty_stages and n // block < stages:
        raise ConfigError(f"{where}: --num-layers {n} in chunks of {block} fill at most {n // block} "
                          f"of the {stages} stages, so no balanced layout leaves none empty; add "
                          "--dynmo-allow-empty-stages, or give fewer stages or another "
                          "--recompute-num-layers")


def _check_recompute(cfg: RunConfig, given: dict[str, str]) -> None:
    """Megatron-LM's recompute flags, as its validate_args pairs them; only under models
    of standard layers (the scenarios' layers and a frozen prefix, whose checkpointed
    layers Megatron gives no gradient, are not run under recompute)."""
    m = cfg.model
    where = lambda key: given.get(f"model.{key}", "command line")  # noqa: E731
    full = m.recompute_granularity == "full"
    if full and (m.recompute_method is None or m.recompute_num_layers is None):
        raise ConfigError(f"{where('recompute_granularity')}: --recompute-granularity full needs "
                          "--recompute-method (uniform or block) and --recompute-num-layers N")
    if not full and (m.recompute_method is not None or m.recompute_num_layers is not None):
        raise ConfigError(f"{where('recompute_method')}: --recompute-method and --recompute-num-layers "
                          "go with --recompute-granularity full; add it, or drop them")
    _check_recompute_chunks(cfg, recompute_block(m), where("recompute_num_layers"))
    if block_recompute_moves(m, cfg):
        raise ConfigError(f"{where('recompute_method')}: {BLOCK_MOVES_WHY}; use --recompute-method "
                          "uniform (the balancers move whole chunks), or profile only "
                          "(--dynmo-profile-every N without rebalancing)")
    kind = cfg.dynmo.dynamism.kind
    if m.recompute_granularity and kind != "none":
        raise ConfigError(f"{where('recompute_granularity')}: --recompute-granularity with dynamism "
                          f"'{kind}' is not supported yet (its layers and frozen prefixes are not run "
                          "under recompute); drop one of them")


def _check_data(cfg: RunConfig, given: dict[str, str]) -> None:
    """Packed documents: one packed row per micro-batch, scenarios that keep Megatron's
    attention, and the vocabulary of the dataset's tokenizer."""
    m, d = cfg.model, cfg.model.data
    where = lambda key: given.get(f"model.{key}", key)  # noqa: E731
    if d.path and d.documents != "none":
        raise ConfigError(f"{where('data.documents')}: --data-documents {d.documents} and "
                          "--data-path both choose the documents; give one")
    if not d.packed:
        if d.batching == "adaptive":
            raise ConfigError(f"{where('data.batching')}: --data-batching adaptive batches "
                              "documents by length; give --data-path or --data-documents lognormal")
        return
    if m.micro_batch_size != 1:
        raise ConfigError(f"{where('micro_batch_size')}: packed documents put one row of "
                          f"--seq-length positions in each micro-batch; use --micro-batch-size 1 "
                          f"(got {m.micro_batch_size}) and set --global-batch-size to DP x micro-batches")
    kind = cfg.dynmo.dynamism.kind
    why = SCENARIOS[kind].packed_refused if kind in SCENARIOS else None
    if why:
        raise ConfigError(f"{where('data.path') if d.path else where('data.documents')}: packed "
                          f"documents cannot train with dynamism {cfg.dynmo.dynamism.kind!r}: "
                          f"{why}; train it on the synthetic token stream (drop "
                          "--data-path/--data-documents)")
    if d.batching == "adaptive":
        packing = [f for f, on in (("--data-packer wlb", d.packer == "wlb"),
                                   ("--data-outlier-thresholds", bool(d.thresholds())),
                                   ("--data-redistribute", d.redistribute)) if on]
        if packing:
            raise ConfigError(f"{where('data.batching')}: --data-batching adaptive does not "
                              f"pack documents; {', '.join(packing)} apply to packed batching only")
        if d.mem_tokens and d.mem_tokens < m.seq_length:
            raise ConfigError(f"{where('data.mem_tokens')}: --data-mem-tokens ({d.mem_tokens}) "
                              f"must hold one row of --seq-length ({m.seq_length})")
    too_long = [t for t in d.thresholds() if t > m.seq_length]
    if too_long:
        raise ConfigError(f"{where('data.outlier_thresholds')}: thresholds {too_long} exceed "
                          f"--seq-length ({m.seq_length}); no document piece is that long")
    if d.path:
        try:
            vocab = dataset_vocab_size(d.path)
        except TokenizerError as e:
            raise ConfigError(f"{where('data.path')}: {e}") from e
        if "model.vocab_size" in given and m.vocab_size < vocab:
            raise ConfigError(f"{where('vocab_size')}: --vocab-size ({m.vocab_size}) is smaller "
                              f"than the dataset tokenizer's ({vocab}); drop --vocab-size")
        m.vocab_size = max(m.vocab_size, vocab) if "model.vocab_size" in given else vocab


def _check_repack(cfg: RunConfig, given: dict[str, str]) -> None:
    rp, cl, pp = cfg.dynmo.repack, cfg.dynmo.cluster, cfg.model.pipeline_model_parallel_size
    if rp.enabled and rp.min_stages > pp:
        raise ConfigError(f"{given.get('repack.min_stages', 'repack.min_stages')}: min_stages "
                          f"({rp.min_stages}) exceeds --pipeline-model-parallel-size ({pp})")
    if rp.enabled and rp.mode == "checkpoint" and not cfg.model.save:
        raise ConfigError(f"{given.get('repack.mode', 'repack.mode')}: mode checkpoint saves the "
                          "state for the restart: give --save DIR")
    if cl.fallback != "none" and cl.fallback == cl.strategy:
        raise ConfigError(f"{given.get('cluster.fallback', 'cluster.fallback')}: the fallback "
                          f"({cl.fallback}) is the strategy itself; choose another or none")
    if cl.kubeconfig:  # read now, not at the first release (which would train on with the GPUs)
        from dynmo_plugin.cluster.api import check_named_kubeconfig
        try:
            check_named_kubeconfig(cl.kubeconfig, given.get("cluster.kubeconfig", "cluster.kubeconfig"))
        except ValueError as e:
            raise ConfigError(str(e)) from e


def _check_dynamism(cfg: RunConfig, given: dict[str, str]) -> None:
    """A scenario's keys only make sense with that scenario chosen."""
    kind = cfg.dynmo.dynamism.kind
    for key, where in given.items():
        parts = key.split(".")
        if parts[0] != "dynamism" or len(parts) < 3:
            continue
        if kind not in SCENARIOS or SCENARIOS[kind].section != parts[1]:
            raise ConfigError(f"{where}: {key}: set, but dynamism.kind is {kind!r}; choose the "
                              f"scenario with --dynmo-dynamism or dynamism.kind, or drop the key")
    p = cfg.dynmo.dynamism.pruning
    if kind == "gradual_pruning" and p.initial_sparsity > p.final_sparsity:
        raise ConfigError(f"{given.get('dynamism.pruning.initial_sparsity', 'dynamism.pruning')}: "
                          f"initial_sparsity ({p.initial_sparsity}) exceeds final_sparsity "
                          f"({p.final_sparsity})")


def _check_interleaved_repack(cfg: RunConfig, where: str, world_size: Optional[int]) -> None:
    """Interleaved repacks keep v chunks per rank on fewer ranks, so Megatron's
    interleaved schedule must still run there: k >= 2 ranks and the micro-batches a
    multiple of k (checked when the world size is known) for forced layouts; the repack
    planner skips such k itself."""
    m, rp = cfg.model, cfg.dynmo.repack
    v, pp = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_size
    if v == 1 or not rp.enabled:
        return
    micro = None if world_size is None else m.global_batch_size // (
        m.micro_batch_size * (world_size // (m.tensor_model_parallel_size * pp)))
    fewer = {it: text for it, text in cfg.dynmo.rebalance.forced_layouts.items()
             if Layout.parse(text, None, m.num_layers, v).num_ranks < pp}
    for it, text in fewer.items():
        k = Layout.parse(text, None, m.num_layers, v).num_ranks
        if k < 2 or (micro is not None and micro % k):
            raise ConfigError(
                f"{where}: rebalance.forced_layouts.{it}: layout {text!r} repacks onto {k} "
                f"pipeline rank(s) keeping {v} virtual stages each; Megatron's interleaved "
                f"schedule needs >= 2 ranks and the micro-batches ({micro}) a multiple of the "
                "ranks; give a layout with more ranks, or run without "
                "--num-virtual-stages-per-pipeline-rank")


def _check_forced_layouts(cfg: RunConfig, where: str) -> None:
    m = cfg.model
    pp = m.pipeline_model_parallel_size * m.num_virtual_stages_per_pipeline_rank
    sizes = ("--pipeline-model-parallel-size" if m.num_virtual_stages_per_pipeline_rank == 1 else
             f"--pipeline-model-parallel-size {m.pipeline_model_parallel_size} x "
             f"--num-virtual-stages-per-pipeline-rank {m.num_virtual_stages_per_pipeline_rank}")
    for it, text in cfg.dynmo.rebalance.forced_layouts.items():
        try:
            layout = Layout.parse(text, None, m.num_layers, m.num_virtual_stages_per_pipeline_rank,
                                  m.mtp_num_layers or 0)
        except LayoutError as e:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: {e}") from e
        if layout.num_stages > pp or (layout.num_stages < pp and not cfg.dynmo.repack.enabled):
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: layout {text!r} has "
                              f"{layout.num_stages} stages but the pipeline has {pp} ({sizes}); "
                              "fewer stages force a repack, "
                              "which needs repack.enabled (--dynmo-repack)")
        if it > m.train_iters:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: iteration is past "
                              f"--train-iters ({m.train_iters})")
        _check_mtp_stays(m, where, it, text, layout)
        if layout.has_mtp and layout.num_stages < pp and layout.mtp_rank != layout.num_ranks - 1:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: layout {text!r} repacks "
                              f"with the MTP block on rank {layout.mtp_rank}; a repack lands it on "
                              f"the last surviving rank ({layout.num_ranks - 1}): end the layout "
                              "with 'mL'")


def _check_mtp_repack(cfg: RunConfig, where: str) -> None:
    """A repack carries the MTP block onto the last surviving rank, live, as a live move
    does (one chunk per rank, untied embeddings)."""
    m = cfg.model
    if not (m.mtp_num_layers and cfg.dynmo.repack.enabled):
        return
    why = ("virtual pipeline stages" if m.num_virtual_stages_per_pipeline_rank > 1 else
           "tied embeddings" if not m.untie_embeddings_and_output_weights else
           "--dynmo-repack-mode checkpoint" if cfg.dynmo.repack.mode != "live" else None)
    if why:
        raise ConfigError(f"{where}: repack.enabled with --mtp-num-layers and {why}: a repack "
                          "carries the MTP block live only (one chunk per rank, untied "
                          "embeddings, --dynmo-repack-mode live); rebalance without --dynmo-repack")


def _check_mtp_stays(m: ModelArgs, where: str, it: int, text: str, layout: Layout) -> None:
    """A forced layout may move the MTP block to another rank live with one chunk per rank
    (megatron.migration.mtp_move); otherwise it keeps the block on the rank it starts on
    (a checkpoint moves it: save, --load under a new layout)."""
    if not m.mtp_num_layers:
        return
    pp, v = m.pipeline_model_parallel_size, m.num_virtual_stages_per_pipeline_rank
    start = (Layout.parse(m.pipeline_model_parallel_layout, pp, m.num_layers, v, m.mtp_num_layers)
             .mtp_rank if m.pipeline_model_parallel_layout else pp - 1)
    why = "virtual pipeline stages" if v > 1 else None
    if layout.mtp_rank != start and why:
        raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: layout {text!r} puts the MTP "
                          f"block on rank {layout.mtp_rank} but it starts on rank {start}; with "
                          f"{why} live migration moves decoder layers only (move the block "
                          "through a checkpoint: --save, then --load with the new "
                          "--pipeline-model-parallel-layout)")
