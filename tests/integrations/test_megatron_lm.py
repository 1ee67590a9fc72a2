"""The plugin inside Megatron-LM's own pretrain() machinery (dynmo_plugin.integrations.megatron_lm).

The pure parts (flag validation, event scalars) run everywhere; the rest needs a
Megatron-LM checkout ($DYNMO_MEGATRON_LM) and runs its real parse_args and train() under
torchrun through megatron_lm_harness.py (which says what it replaces on CPU). The
Multi-Token Prediction runs are in test_megatron_lm_mtp.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import pytest
from megatron_lm_harness import (MODEL_FLAGS, SKIP_REASON, SOURCE, check_forced_move, megatron_like,
                                 train_in_megatron_lm)

from dynmo_plugin.config import ConfigError
from dynmo_plugin.integrations import megatron_lm as ml

needs_source = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


# ---- everywhere: the plugin's config from Megatron-LM-shaped args, event scalars ----------------
def test_plugin_config_reads_megatron_lm_args_and_refuses_what_it_cannot_follow():
    cfg = ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "3:Et|tttL"]))
    assert cfg.dynmo.enabled and cfg.dynmo.rebalance.forced_layouts == {3: "Et|tttL"}
    with pytest.raises(ConfigError, match="past --train-iters"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "11:Et|tttL"]))
    with pytest.raises(ConfigError, match="support: --overlap-param-gather"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], use_distributed_optimizer=True,
                                             overlap_param_gather=True))
    # validate_args maps the deprecated --enable-cuda-graph / --external-cuda-graph onto it
    for impl in ("local", "transformer_engine"):
        with pytest.raises(ConfigError, match=f"support: --cuda-graph-impl {impl} .graphs are captured once"):
            ml.load_plugin_config(megatron_like(argv=["--dynmo"], cuda_graph_impl=impl))
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo"], cuda_graph_impl="none")).dynmo.enabled
    with pytest.raises(ConfigError, match="support: --overlap-moe-expert-parallel-comm .Megatron then runs each "
                                          "layer's attention and MLP through its fine-grained callables"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], overlap_moe_expert_parallel_comm=True))
    # TE's graph-safe RNG tracker: refused where the layers draw from their own streams only
    with pytest.raises(ConfigError, match="support: --te-rng-tracker with dropout or MoE input jitter .* add "
                                          "--dynmo-rank-rng"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], te_rng_tracker=True, hidden_dropout=0.1))
    for fine in (dict(hidden_dropout=0.0, attention_dropout=0.0), dict(hidden_dropout=0.1, argv=["--dynmo", "--dynmo-rank-rng"])):
        assert ml.load_plugin_config(megatron_like(**{"argv": ["--dynmo"], "te_rng_tracker": True, **fine})).dynmo.enabled
    with pytest.raises(ConfigError, match="support: --dynmo-repack with --use-tp-pp-dp-mapping"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-repack", "--dynmo-repack-mode", "checkpoint"],
                                             use_tp_pp_dp_mapping=True, save="/tmp/x"))
    # uniform recompute in chunks of 2: a forced layout keeps whole chunks on every stage (an
    # odd count indexes past the stage's last layer); the balancers keep to them themselves
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    with pytest.raises(ConfigError, match=r"--dynmo-forced-layouts: rebalance.forced_layouts.3: layout "
                                          r"'Et\|tttL': stage 0 holds 1, stage 1 holds 3 layers, not a "
                                          "multiple of --recompute-num-layers 2"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "3:Et|tttL"], **recompute))
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "3:E|ttttL"],
                                               **recompute)).dynmo.enabled
    with pytest.raises(ConfigError, match="support: --mtp-num-layers with --recompute-method uniform "
                                          "--recompute-num-layers > 1: Megatron's MTP recompute asserts"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], mtp_num_layers=1, **recompute))
    with pytest.raises(ConfigError, match="--recompute-num-layers: --num-layers 4 in chunks of 4 fill at most 1 "
                                          "of the 2 stages"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], **{**recompute, "recompute_num_layers": 4}))
    # the profiler steps aside for Megatron's own checkpoint's 1/TP swap, not for TE's (fp8/fp4)
    distribute = dict(distribute_saved_activations=True, **recompute)
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo"], **distribute)).dynmo.enabled
    with pytest.raises(ConfigError, match="support: --distribute-saved-activations with --fp8-format or "
                                          "--fp4-format .Megatron then checkpoints through Transformer Engine"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], fp8="hybrid", **distribute))
    with pytest.raises(ConfigError, match="support: --distribute-saved-activations with --mtp-num-layers"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], mtp_num_layers=1,
                                            **{**distribute, "recompute_num_layers": 1}))
    # Megatron's own hang (its checkpoint of a biased MLP chains each backward into the last step's)
    mlp = dict(recompute_granularity="selective", recompute_modules=["mlp"], transformer_impl="local")
    with pytest.raises(ConfigError, match="support: --recompute-modules mlp with bias linears"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], add_bias_linear=True, **mlp))
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo"], add_bias_linear=False, **mlp)).dynmo.enabled
    # the block method recomputes the first N layers of each stage, whichever they are: refused
    # where layers may move (a moved layer's cost and memory go with its place; the uniform
    # balancer moves them too from a start that is not uniform), kept where none can
    block = {**recompute, "recompute_method": "block"}
    for moving in (["--dynmo-rebalance-interval", "2"], ["--dynmo-rebalance-interval", "2", "--dynmo-balancer",
                                                        "uniform"], ["--dynmo-start-balanced-at", "2"]):
        with pytest.raises(ConfigError, match="support: --recompute-method block with --dynmo moving layers"):
            ml.load_plugin_config(megatron_like(argv=["--dynmo", *moving], **block))
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-profile-every", "2"], **block)).dynmo.enabled
    # full recompute under layer freezing: a frozen prefix left layer 2's checkpointed input without
    # gradient and layer 2 untrained (layer 1 frozen at 6: the loss at 8 parted from the run's
    # without recompute); selective recompute kept them equal
    freezing = ["--dynmo", "--dynmo-dynamism", "layer_freezing"]
    with pytest.raises(ConfigError, match="support: --recompute-granularity full with --dynmo-dynamism layer_freezing"):
        ml.load_plugin_config(megatron_like(argv=freezing, spec=[ml.SPEC_MODULE, "layer_freezing"], **recompute))
    assert ml.load_plugin_config(megatron_like(argv=freezing, spec=[ml.SPEC_MODULE, "layer_freezing"],
                                               recompute_granularity="selective")).dynmo.enabled
    with pytest.raises(ConfigError, match="support: --recompute-modules layernorm with --dynmo-dynamism layer_freezing"):
        ml.load_plugin_config(megatron_like(argv=freezing, spec=[ml.SPEC_MODULE, "layer_freezing"],
                                            recompute_granularity="selective", recompute_modules=["layernorm"]))
    # MTP with virtual stages, however they were asked for (validate_args' count)
    with pytest.raises(ConfigError, match="support: --mtp-num-layers with virtual pipeline stages"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], mtp_num_layers=1, num_layers=8,
                                             virtual_pipeline_model_parallel_size=2))
    # repacking restarts from Megatron-LM's checkpoint: checkpoint mode, with --save
    with pytest.raises(ConfigError, match="--dynmo-repack-mode live .* --dynmo-repack-mode checkpoint"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-repack"], save="ckpt"))
    with pytest.raises(ConfigError, match="give --save DIR"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-repack", "--dynmo-repack-mode",
                                                   "checkpoint"]))
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-repack", "--dynmo-repack-mode",
                                                      "checkpoint"], save="ckpt")).dynmo.repack.enabled
    # virtual pipeline stages and the distributed optimizer are followed (the migration
    # test runs them): a forced layout then has pp x v stages
    interleaved = dict(use_distributed_optimizer=True, virtual_pipeline_model_parallel_size=2)
    cfg = ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "4:Et|t|tt|L"],
                                               **interleaved))
    assert cfg.model.num_virtual_stages_per_pipeline_rank == 2
    with pytest.raises(ConfigError, match="has 2 stages but the pipeline has 4"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo", "--dynmo-forced-layouts", "4:Et|tttL"],
                                             **interleaved))
    # without --dynmo nothing is refused, not even a layout that does not fit the flags
    # (an MTP layer without --mtp-num-layers): the hooks pass every call through
    mtp = dict(pipeline_model_parallel_layout="Ett|tt|mL", num_layers=4, pipeline_model_parallel_size=3)
    assert not ml.load_plugin_config(megatron_like(use_distributed_optimizer=True, **mtp)).dynmo.enabled
    with pytest.raises(ConfigError, match=r"holds 1 MTP layers \('m'\) but --mtp-num-layers is 0"):
        ml.load_plugin_config(megatron_like(argv=["--dynmo"], **mtp))
    # with it, MTP is followed (one chunk per rank)
    assert ml.load_plugin_config(megatron_like(argv=["--dynmo"], mtp_num_layers=1, **mtp)).dynmo.enabled


def test_a_run_whose_layers_may_move_says_what_a_move_changes():
    """Megatron-LM's dropout 0.1 where the layers draw from the rank's streams
    (--dynmo-rank-rng) and --dynmo-native-grad-reduce at a data-parallel size >= 3 make a
    moved run equal the never-moved one in distribution only, and a per-rank checkpoint
    saved after a move needs --dynmo to resume: said once at the start, where layers may
    move. Neither otherwise (the layers' own streams; the gradients reduced in rank
    order), nor clipping 1.0, with the distributed optimizer too (the exact norm)."""
    defaults = dict(hidden_dropout=0.1, attention_dropout=0.1, clip_grad=1.0, save="/tmp/x", ckpt_format="torch")
    moving = megatron_like(argv=["--dynmo", "--dynmo-rebalance-interval", "10"], **defaults)
    notes = ml.move_notes(moving, ml.load_plugin_config(moving))
    assert len(notes) == 1 and notes[0].startswith("--ckpt-format torch numbers layers"), notes
    rank_rng = megatron_like(argv=["--dynmo", "--dynmo-rebalance-interval", "10", "--dynmo-rank-rng"],
                             use_distributed_optimizer=True, **defaults)
    notes = ml.move_notes(rank_rng, ml.load_plugin_config(rank_rng))
    assert len(notes) == 2 and "with --hidden-dropout 0.1, --attention-dropout 0.1 a moved run " \
        "equals the never-moved one in distribution, not to the bit" in notes[0], notes
    assert notes[1].startswith("--ckpt-format torch numbers layers within each stage: resume a checkpoint saved "
                               "after a move with --dynmo")
    profiling = megatron_like(argv=["--dynmo", "--dynmo-profile-every", "5"], **defaults)
    assert ml.move_notes(profiling, ml.load_plugin_config(profiling)) == []  # nothing moves
    exact = megatron_like(argv=["--dynmo", "--dynmo-rebalance-interval", "10"], hidden_dropout=0.0,
                          attention_dropout=0.0, clip_grad=0.0, save=None)
    assert ml.move_notes(exact, ml.load_plugin_config(exact)) == []
    for dp, cp, native, instances, said in ((3, 1, True, 1, "--dynmo-native-grad-reduce at data-parallel size 3"),
                                            (1, 4, True, 1, "--dynmo-native-grad-reduce at data-parallel size 4"),
                                            (2, 1, True, 1, None), (3, 1, False, 1, None),
                                            (6, 1, False, 2, "--num-distributed-optimizer-instances 2"),
                                            (4, 1, False, 2, None)):  # both reductions over 2 ranks
        args = megatron_like(argv=["--dynmo", "--dynmo-rebalance-interval", "10",
                                   *(["--dynmo-native-grad-reduce"] if native else [])],
                             hidden_dropout=0.0, attention_dropout=0.0, clip_grad=0.0, data_parallel_size=dp,
                             context_parallel_size=cp, num_distributed_optimizer_instances=instances)
        notes = ml.move_notes(args, ml.load_plugin_config(args))
        assert notes == ([f"layers may move in this run: with {said} a moved run equals the never-moved one in "
                          "distribution, not to the bit (each rank draws and sums in its own order: "
                          "docs/megatron-lm.md \"What a move changes\")"] if said else []), (dp, cp, native, notes)


def test_a_layout_is_the_only_split_left_in_megatron_lms_args():
    """After a move, and when a resume restores a saved layout, the layout is the args'
    one split: the others go (TransformerConfig refuses the first four beside a layout,
    validate_args the virtual-stage counts; --use-checkpoint-args validates saved args
    again). A saved layout fits a resume whose virtual stages validate_args counts with
    the embedding and the loss in the split: 6 layers + 2 over PP=2 x 2 a stage is 2."""
    from types import SimpleNamespace

    from dynmo_plugin.integrations.megatron_lm_args import set_layout
    from dynmo_plugin.integrations.megatron_lm_checkpoint import _virtual_stages
    args = megatron_like(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3,
                         account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
                         num_layers_per_virtual_pipeline_stage=2, num_virtual_stages_per_pipeline_rank=2)
    set_layout(args, "Et|tttL")
    assert args.pipeline_model_parallel_layout == "Et|tttL"
    assert [args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split,
            args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank] == [
        None, None, False, False, None, None]
    vp = dict(num_layers=6, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
              num_virtual_stages_per_pipeline_rank=None)
    assert _virtual_stages(SimpleNamespace(**vp, account_for_embedding_in_pipeline_split=True,
                                           account_for_loss_in_pipeline_split=True)) == 2
    assert _virtual_stages(SimpleNamespace(**vp)) == 1


def test_a_checkpoint_repack_restarts_with_every_rank_of_each_stage_context_parallel_ones_too():
    """A checkpoint repack's restart keeps each stage's ranks (TP x CP x DP): with CP=2,
    which Megatron's data-parallel size leaves out, 8 ranks at PP=4 restart as 4 at PP=2
    (the line said 2, and Megatron-LM would have halved DP)."""
    from types import SimpleNamespace

    from dynmo_plugin.layout import Layout
    dims = SimpleNamespace(world_size=8, tp=1, dp=1, pp=4)
    run = SimpleNamespace(stage=SimpleNamespace(dims=dims, layout=Layout.parse("Et|t|t|tL")),
                          args=SimpleNamespace(save="ckpt"), iteration=5)
    record, result = ml._Run._checkpoint_repack(run, Layout.parse("Ett|ttL"), 5, {})
    assert (record["world_size_after"], record["ranks_released"]) == (4, [4, 5, 6, 7])
    assert "4 ranks in all" in record["restart"] and "--pipeline-model-parallel-size 2" in record["restart"]


def test_event_scalars_for_the_writers():
    profile = {"layers": [{"layer": 1, "stage": 0, "fwd_s": 0.002, "bwd_s": 0.004},
                          {"layer": 2, "stage": 1, "fwd_s": 0.001, "bwd_s": 0.001}],
               "stages": [{"stage": 0, "extra_s": 0.0}, {"stage": 1, "extra_s": 0.002}]}
    out = ml.event_scalars({"iteration": 4, "kind": "rebalance", "trigger": "forced", "applied": True,
                            "moves": [{"layer": 2}], "imbalance_after": 0.1, "profile": profile,
                            "overhead_s": {"migration": 0.5, "decision": 0.01}})
    assert out["dynmo/layer_1_fwd_ms"] == pytest.approx(2.0)
    assert out["dynmo/layer_2_bwd_ms"] == pytest.approx(1.0)
    assert out["dynmo/imbalance"] == pytest.approx((0.006 - 0.004) / 0.005)  # loads 6 ms, 4 ms
    assert out["dynmo/migration_s"] == 0.5 and out["dynmo/rebalance_applied"] == 1.0
    assert out["dynmo/moved_layers"] == 1.0 and out["dynmo/imbalance_after"] == 0.1
    # the scenarios' events and a checkpoint repack get theirs too
    repack = ml.event_scalars({"iteration": 4, "kind": "rebalance", "applied": False, "moves": [],
                               "repack": {"mode": "checkpoint", "stages_after": 2, "world_size_after": 2}})
    assert repack["dynmo/repack_stages_after"] == 2.0 and repack["dynmo/repack_world_size_after"] == 2.0
    events = [{"kind": "dynamism", "scenario": "layer_freezing", "iteration": 6,
               "detail": {"frozen_layers": [1, 2]}},
              {"kind": "dynamism", "scenario": "gradual_pruning", "iteration": 4, "detail": {"target": 0.5}},
              {"kind": "dynamism", "scenario": "moe", "iteration": 2, "detail": {}, "work": {"1": 3.0}}]
    assert [ml.event_scalars(e) for e in events] == [
        {"dynmo/layer_freezing_events": 1.0, "dynmo/frozen_layers": 2.0},
        {"dynmo/gradual_pruning_events": 1.0, "dynmo/pruning_target": 0.5},
        {"dynmo/moe_events": 1.0, "dynmo/layer_1_work": 3.0}]


def test_use_source_refuses_a_folder_that_is_not_megatron_lm(tmp_path):
    with pytest.raises(ml.MegatronLMError, match="not a Megatron-LM source tree"):
        ml.use_source(str(tmp_path))


def test_the_entry_point_exits_2_with_one_line_without_a_megatron_lm_tree(tmp_path):
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "dynmo_plugin.integrations.pretrain_gpt", "--dynmo"],
                          env={**os.environ, ml.SOURCE_ENV: str(tmp_path)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"dynmo_plugin: no pretrain_gpt.py in {tmp_path}: set {ml.SOURCE_ENV} to the root of a "
        f"Megatron-LM checkout at tag {ml.SUPPORTED_TAG}"]


def test_the_entry_point_exits_2_with_one_line_without_cuda(tmp_path):
    """A tree that passes the source checks; the machine (no CUDA) does not."""
    for name, text in {"pretrain_gpt.py": "", "megatron/training/training.py": "",
                       "megatron/core/package_info.py": "MAJOR = 0\nMINOR = 16\nPATCH = 1\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    import subprocess
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "-m", "dynmo_plugin.integrations.pretrain_gpt", "--dynmo"],
                          env={**os.environ, ml.SOURCE_ENV: str(tmp_path), "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # megatron-core's import warnings aside, one line of ours:
    assert [x for x in proc.stderr.splitlines() if x.startswith("dynmo_plugin:")] == [
        "dynmo_plugin: no CUDA GPU here: Megatron-LM's pretrain() asserts CUDA; on CPU train with "
        "the plugin's own launcher (python -m dynmo_plugin.train, docs/usage.md)"]


# ---- with the source: hooks, version checks, parse_args ---------------------------------------
@pytest.fixture()
def mtt():
    ml.use_source(SOURCE)
    import megatron.training.training as mtt
    yield mtt
    ml.disable()


class _StandInWandb:
    """A stand-in, named as such, for Megatron-LM's W&B writer (the wandb module; wandb is
    not installed here): while `run` is set, log() records; once the exit path ran
    wandb.finish(), `run` is None and log() raises, as wandb's pre-init stub does."""

    def __init__(self, run):
        self.run, self.logged = run, []

    def log(self, scalars, step):
        if self.run is None:
            raise RuntimeError("You must call wandb.init() before wandb.log()")
        self.logged.append(step)


@needs_source
def test_an_event_after_megatron_lms_exit_path_finished_wandb_is_not_logged_there(mtt, capsys):
    """Megatron-LM's train() calls wandb.finish() then sys.exit() when an exit condition
    holds (--exit-interval, --exit-signal-handler, a checkpoint repack); the wrapper's
    finally then ends a window still open (DynMo.finish), whose cancelled event reaches
    the writers: it must not replace the exit with wandb's error."""
    from dynmo_plugin.integrations.megatron_lm_writers import Writers
    writers = Writers()
    event = {"iteration": 6, "kind": "profile", "trigger": "profile_interval", "window": [6, 6],
             "layout": "Et|tttL", "overhead_s": {"profiling": 0.0}, "profile": None,
             "cancelled": "the run ended inside the window"}
    writers.wandb = _StandInWandb(run=None)
    writers.event(event)
    assert "dynmo: iteration 6 profile [profile_interval] layout Et|tttL" in capsys.readouterr().out
    writers.wandb = _StandInWandb(run=object())  # during the run: logged
    writers.event(event)
    assert writers.wandb.logged == [6]


class _FinishFails:
    """A test-only fault, named as such: a controller whose end-of-run raises (a real one
    cannot be made to on demand)."""

    def finish(self, last_iteration):
        raise RuntimeError(f"test-only: finish({last_iteration}) failed")


@needs_source
def test_the_report_is_closed_when_ending_the_controller_raises(mtt, tmp_path):
    """train()'s wrapper calls _Run.finish in its finally: if ending the controller raises,
    the error still propagates, and report.json is still written complete with the final
    layout (what the run measured is not lost)."""
    import json
    import types

    from dynmo_plugin.integrations.megatron_lm_writers import Writers, WritersReport
    run = object.__new__(ml._Run)
    run.controller, run._completed, run.restart = _FinishFails(), 4, None
    run.stage, run.writers = types.SimpleNamespace(layout="Ett|tL"), Writers()
    run.report = WritersReport(str(tmp_path / "report.json"), config={}, world={},
                               initial_layout="Et|ttL")
    run.report.add_iteration(4, 5.0, 0.1)
    with pytest.raises(RuntimeError, match=r"test-only: finish\(4\) failed"):
        run.finish()
    summary = json.loads((tmp_path / "report.json").read_text())
    assert summary["layout"] == "Ett|tL"
    assert [row["iteration"] for row in summary["iterations"]] == [4]


@needs_source
def test_enable_wraps_and_disable_restores(mtt):
    names = ("initialize_megatron", "setup_model_and_optimizer",
             "build_train_valid_test_data_iterators", "train_step", "train")
    before = {n: getattr(mtt, n) for n in names}
    ml.enable()
    ml.enable()  # idempotent: wrapped once
    assert all(getattr(mtt, n) is not before[n] and getattr(mtt, n).__wrapped__ is before[n]
               for n in names)
    from megatron.core.optimizer import clip_grads, optimizer

    from dynmo_plugin.megatron.training import grad_norm
    grad_norm.install()  # as the setup wrapper does with --dynmo
    ml.disable()
    assert all(getattr(mtt, n) is before[n] for n in names)
    assert optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32  # Megatron's norm again


@needs_source
def test_enable_binds_the_te_names_megatron_cores_moe_router_reads(mtt, monkeypatch):
    """As on a CUDA machine without Transformer Engine: moe_utils has no te_general_gemm
    (Megatron-Core binds it only inside its TE import), so Megatron-LM's own MoE router
    would raise NameError; enable() binds it to None, the value the router checks."""
    from megatron.core.transformer.moe import moe_utils
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    ml.enable()
    assert moe_utils.te_general_gemm is None


@needs_source
def test_unknown_megatron_lm_versions_are_refused(mtt, monkeypatch):
    from megatron.core import package_info
    assert ml._installed_core_version() == package_info.__version__ == ml.SUPPORTED_CORE
    original = mtt.train_step
    monkeypatch.setattr(ml, "_installed_core_version", lambda: "0.17.0")
    with pytest.raises(ml.MegatronLMError, match=r"megatron-core 0\.17\.0 .*core_v0\.16\.1"):
        ml.enable()
    assert not ml.is_enabled() and mtt.train_step is original
    with pytest.raises(ml.MegatronLMError, match=r"megatron-core 0\.16\.1, but megatron-core 0\.17\.0"):
        ml.use_source(SOURCE)  # a checkout for another megatron-core than the installed one
    monkeypatch.undo()
    monkeypatch.setattr(mtt, "train_step", lambda model, optimizer: None)
    with pytest.raises(ml.MegatronLMError, match=r"train_step is train_step\(model, optimizer\)"):
        ml.enable()
    assert not ml.is_enabled()


@needs_source
def test_flags_parse_inside_megatron_lm_parse_args_chained_with_the_callers(mtt, monkeypatch):
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import destroy_global_vars, get_args

    def user_provider(parser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser

    ml.enable()
    argv = ["pretrain_gpt.py", *MODEL_FLAGS, "--train-iters", "6", "--my-flag", "5", "--dynmo",
            "--dynmo-profile-every", "3", "--dynmo-forced-layouts", "4:Et|tttL",
            "--pipeline-model-parallel-size", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:  # pretrain() calls it so: the caller's provider, Megatron-LM's validation, then ours
        mtt.initialize_megatron(extra_args_provider=user_provider, allow_no_cuda=True,
                                skip_mpu_initialization=True)
        args = get_args()
        assert args.my_flag == 5 and args.dynmo__profiling__every == 3
        cfg = ml._hooks.cfg
        assert cfg.dynmo.enabled and cfg.dynmo.rebalance.forced_layouts == {4: "Et|tttL"}
    finally:
        destroy_global_vars()
        destroy_rerun_state_machine()
    # a bad plugin value inside Megatron-LM's own parser: a ConfigError naming the flag
    monkeypatch.setattr(sys, "argv", argv + ["--dynmo-profile-every", "-1"])
    with pytest.raises(ConfigError, match="--dynmo-profile-every"):
        ml.load_plugin_config(parse_args(ml._chain(user_provider)))


# ---- with the source, under torchrun: Megatron-LM's train() with the plugin ------------------------
@needs_source
def test_forced_migration_inside_megatron_lm_train_matches_a_never_moved_run(tmp_path):
    """PP=2 on gloo: Megatron-LM's own loop, profiled every 2 iterations; before iteration
    4 a forced layout moves layer 2 to stage 1. The loss of every iteration equals that of
    the same run whose layout never moves, to the last bit, and the events reach
    Megatron-LM's TensorBoard writer. The same pair again with virtual pipeline stages
    (8 layers, 2 chunks per rank, Megatron's interleaved 1F1B over train()'s list of DDP
    chunks) and --use-distributed-optimizer on 4 ranks, PP=2 x DP=2 (its state sharded over
    the two DP ranks, gathered and re-sharded through optim_state as in the launcher), with
    --overlap-grad-reduce: the no-sync and grad-sync functions train() bound to its DDP
    chunks end bound to the chunks that replaced them; under Megatron-LM's default
    --rerun-mode validate_results (the harness's other runs disable it)."""
    tb, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    forced = ["--dynmo", "--dynmo-profile-every", "2", "--dynmo-forced-layouts"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*forced, "4:Et|tttL", "--tensorboard-dir", str(tb),
                                                    "--save", str(ckpt), "--save-interval", "4"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", ["--dynmo"])
    check_forced_move(moved, "Et|tttL", 4)
    assert static["layout"] == "Ett|ttL" and static["events"] == []
    assert len(moved_losses) == 6 and moved_losses == static_losses
    assert _sync_bindings(tmp_path / "moved") == {"no_sync": None, "grad_sync": None}
    _check_resume_after_the_move(tmp_path, ckpt, moved_losses)
    vp = ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2",
          "--use-distributed-optimizer", "--overlap-grad-reduce", "--rerun-mode", "validate_results"]
    vp_moved, vp_moved_losses = train_in_megatron_lm(tmp_path / "vp_moved", [*vp, *forced, "4:Et|ttt|tt|ttL"], ranks=4)
    vp_static, vp_static_losses = train_in_megatron_lm(tmp_path / "vp_static", [*vp, "--dynmo"], ranks=4)
    assert vp_moved["config"]["megatron_lm"]["use_distributed_optimizer"] is True
    assert vp_moved["world"]["dp"] == 2
    check_forced_move(vp_moved, "Et|ttt|tt|ttL", 8)
    assert vp_static["layout"] == "Ett|tt|tt|ttL" and vp_static["events"] == []
    assert len(vp_moved_losses) == 6 and vp_moved_losses == vp_static_losses
    assert _sync_bindings(tmp_path / "vp_moved", ranks=4) == {"no_sync": True, "grad_sync": True}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb)).Reload()
    assert [e.step for e in acc.Scalars("dynmo/layer_2_fwd_ms")] == [2, 4, 6]
    assert [e.value for e in acc.Scalars("dynmo/rebalance_applied")] == [1.0]


@needs_source
def test_a_split_by_stage_counts_or_account_for_flags_moves_and_resumes_bit_exact(tmp_path):
    """Megatron-LM's other ways to split the layers (--decoder-first/last-pipeline-num-
    layers, --account-for-embedding/loss-in-pipeline-split) cannot stand beside a layout,
    and pretrain_gpt.py's get_batch builds a config from the args at every micro-batch: a
    move makes the layout the args' only split (every rank raised at the next forward).
    Each run moves and equals the never-moved run from the same split (its initial
    weights) bit for bit. The account-for run saves at iterations 2 and 4 (the move
    between) with --ckpt-assume-constant-structure: the save plans Megatron-LM cached at 2
    are dropped at the move (reused, they named shards of the old layout: "Could not find
    FQN"); it exits at 4 and resumes under the moved layout with the same flags (the model
    built from them raised too), its iterations 5 and 6 those of the never-moved run."""
    forced = ["--dynmo", "--dynmo-profile-every", "2", "--dynmo-forced-layouts"]
    counts = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
    uneven, uneven_losses = train_in_megatron_lm(tmp_path / "uneven", [*counts, *forced, "4:Ett|ttL"])
    account, ckpt = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"], tmp_path / "ckpt"
    account += ["--ckpt-assume-constant-structure", "--ckpt-fully-parallel-save"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "account", [*account, *forced, "4:Et|tttL", "--save", str(ckpt),
                                                                      "--save-interval", "2", "--exit-interval", "4"])
    uneven_static, uneven_static_losses = train_in_megatron_lm(tmp_path / "uneven_static", [*counts, "--dynmo"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", ["--dynmo"])
    moves = [(m["layer"], m["src"], m["dst"]) for e in uneven["events"] if e["kind"] == "rebalance" for m in e["moves"]]
    assert (uneven["initial_layout"], uneven["layout"], moves) == ("Et|tttL", "Ett|ttL", [(2, 1, 0)])
    assert (uneven_static["layout"], static["layout"]) == ("Et|tttL", "Ett|ttL")
    moves = [(m["layer"], m["src"], m["dst"]) for e in moved["events"] if e["kind"] == "rebalance" for m in e["moves"]]
    assert (moved["initial_layout"], moved["layout"], moves) == ("Ett|ttL", "Et|tttL", [(2, 0, 1)])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert len(static_losses) == 6 and uneven_losses == uneven_static_losses and moved_losses == static_losses[:4]
    resumed, resumed_losses = train_in_megatron_lm(tmp_path / "resumed", [*account, "--dynmo", "--load", str(ckpt),
                                                                          "--no-load-rng"])
    assert resumed["initial_layout"] == "Et|tttL" and resumed_losses == static_losses[4:]


@needs_source
def test_tensor_parallel_inside_megatron_lm_moves_bit_exact(tmp_path):
    """TP=2 x PP=2 on 4 ranks: both tensor ranks of stage 0 hand their shards of layer 2
    to their peers of stage 1 (get_batch broadcasts each micro-batch from tensor rank 0);
    every loss equals the never-moved run's. (--sequence-parallel needs Transformer
    Engine's or Apex's norms: the local spec's torch LayerNorm refuses it, so it is a GPU
    check.)"""
    tp = ["--tensor-model-parallel-size", "2"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*tp, "--dynmo", "--dynmo-profile-every", "2",
                                                                    "--dynmo-forced-layouts", "4:Et|tttL"], ranks=4)
    static, static_losses = train_in_megatron_lm(tmp_path / "static", [*tp, "--dynmo"], ranks=4)
    assert (moved["world"]["tp"], moved["world"]["dp"]) == (2, 1)
    check_forced_move(moved, "Et|tttL", 4)
    assert static["layout"] == "Ett|ttL" and static["events"] == []
    assert len(moved_losses) == 6 and moved_losses == static_losses


@needs_source
def test_a_clipped_run_inside_megatron_lm_moves_bit_exact_gradient_norm_included(tmp_path):
    """--clip-grad 1.0, layer 2 moved to stage 1 at iteration 4, against the never-moved
    run (both --dynmo, profiled every 2): every loss and every gradient norm train_step
    returns is the same to the last bit. With Megatron's own norm (each rank's fp32 sum of
    squares, then the ranks' sums) the norm parted from the move on (survey 22b: 1.9575473
    against 1.9575474 at iteration 4)."""
    profiled = ["--clip-grad", "1.0", "--dynmo", "--dynmo-profile-every", "2"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*profiled, "--dynmo-forced-layouts", "4:Et|tttL"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", profiled)
    check_forced_move(moved, "Et|tttL", 4)
    assert static["layout"] == "Ett|ttL"
    assert len(moved_losses) == 6 and moved_losses == static_losses
    norms = [json.loads((tmp_path / run / "grad_norms.json").read_text()) for run in ("moved", "static")]
    assert len(norms[0]) == 6 and all(n > 0 for n in norms[0]) and norms[0] == norms[1], norms


@needs_source
def test_a_ramping_batch_is_profiled_at_its_count_and_its_memory_checked_at_the_whole_batch(tmp_path):
    """--rampup-batch-size 2 2 16 (global batch 8, micro-batch 2: 1 micro-batch per
    iteration at first, 4 once the ramp ends): each profile is taken at the count of its
    window (its stages' `num_microbatches`, the memory record's `microbatches`) and the
    memory checked against a cap is at the whole batch's 4 (`peak_microbatches`: a plan
    chosen during the ramp must still fit after it; tests/balancing/test_profile_problem.py)."""
    run, losses = train_in_megatron_lm(tmp_path / "ramp", ["--rampup-batch-size", "2", "2", "16", "--dynmo",
                                                           "--dynmo-profile-every", "2"],
                                       length=("--train-samples", "48"))
    profiles = [e for e in run["events"] if e["kind"] == "profile"]
    assert len(losses) == 9
    assert [(e["iteration"], e["memory"]["microbatches"], e["memory"]["peak_microbatches"],
             {s["num_microbatches"] for s in e["profile"]["stages"]}) for e in profiles] == [
        (2, 1, 4, {1}), (4, 2, 4, {2}), (6, 3, 4, {3}), (8, 4, 4, {4})]
    _check_interleaved_ramp(tmp_path / "ramp_vp")


def _check_interleaved_ramp(tmp: Path) -> None:
    """With virtual stages (pp 2 x v 2, 8 layers; the interleaved schedule needs at least
    pp micro-batches: ramp 4 4 16, 2 then 4): each chunk's depth at the peak, recorded
    while the batch ramps (`peak_in_flight`), is the depth the schedule holds once it is
    whole, and the memory model at the peak from the first profile covers each rank's
    peak measured then. At the moment's depths it fell short on rank 0."""
    from dataclasses import replace

    from dynmo_plugin.balancing.metrics import rank_memory
    from dynmo_plugin.balancing.profile_problem import problem_from_profile
    from dynmo_plugin.config import DynmoConfig
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.profiling.records import PipelineProfile
    run, _ = train_in_megatron_lm(tmp, ["--rampup-batch-size", "4", "4", "16", "--dynmo", "--dynmo-profile-every",
                                        "2", "--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2"],
                                  length=("--train-samples", "48"))
    first, whole = [e for e in run["events"] if e["kind"] == "profile"][::2][:2]
    assert (first["memory"]["microbatches"], whole["memory"]["microbatches"]) == (2, 4)
    assert [s["peak_in_flight"] for s in first["profile"]["stages"]] == [
        s["in_flight"] for s in whole["profile"]["stages"]]
    profile, layout = PipelineProfile.from_dict(first["profile"]), Layout.parse(first["layout"], 2, 8, 2)
    measured = [s["measured_bytes"] for s in whole["memory"]["stages"]]
    for stages, covers in ((profile.stages, True), ([replace(s, peak_in_flight=0) for s in profile.stages], False)):
        problem = problem_from_profile(replace(profile, stages=stages), layout, DynmoConfig(), 2, peak_microbatches=4)
        modelled = [m + o for m, o in zip(rank_memory(problem, layout), problem.memory_overhead)]
        assert all(m >= x for m, x in zip(modelled, measured)) == covers, (covers, modelled, measured)


@needs_source
def test_full_activation_recompute_inside_megatron_lm_is_profiled_and_moves_bit_exact(tmp_path):
    """Megatron-LM's --recompute-granularity full (each layer's forward run again inside
    its backward, `tensor_parallel.checkpoint`) under the plugin: profiled every 2
    iterations and layer 2 moved to stage 1 before iteration 4, every loss equal to the
    never-moved run's under the same recompute. What each layer holds between forward and
    backward is the input the checkpoint keeps, one fp32 hidden state (32 x 2 x 64 x 4
    bytes), not the recomputed forward's activations (the recomputed forward is timed into
    the backward: tests/megatron/test_profiling_recompute.py). The pair runs with
    --overlap-grad-reduce: train()'s no-sync and grad-sync functions, bound to its one DDP
    chunk per rank, end bound to the chunk that replaced it. With dropout 0.1 the
    recomputed run's losses, layer 2 moved, equal those of the same run without recompute
    or move, bit for bit.
    The stage's own bytes (embedding, head) do not count the kept inputs again: the
    checkpoint saves them after the layer's hooks, inside the stage's counter (they were
    counted twice: 2 x 16384 bytes more a stage than without recompute, not the mask's
    2048 only)."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    overlap = [*recompute, "--overlap-grad-reduce"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*overlap, "--dynmo", "--dynmo-profile-every", "2",
                                                                    "--dynmo-forced-layouts", "4:Et|tttL"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", [*overlap, "--dynmo"])
    check_forced_move(moved, "Et|tttL", 4)
    assert _sync_bindings(tmp_path / "moved") == {"no_sync": True, "grad_sync": True}
    assert static["layout"] == "Ett|ttL" and static["events"] == []
    assert len(moved_losses) == 6 and moved_losses == static_losses
    profiles = [e["profile"] for e in moved["events"] if e["kind"] == "profile"]
    assert {x["act_bytes"] for p in profiles for x in p["layers"]} == {32 * 2 * 64 * 4}
    # the checkpoints keep those inputs inside the stage's own counter too: not counted there
    # again (2 x 16384 bytes a stage more than without recompute; the mask they keep is 2048)
    plain, _ = train_in_megatron_lm(tmp_path / "plain", ["--overlap-grad-reduce", "--dynmo", "--dynmo-profile-every", "2"])
    # over a window of 2 iterations too (the second counted them twice again: 35840 bytes)
    windowed, _ = train_in_megatron_lm(tmp_path / "windowed", [*recompute, "--dynmo", "--dynmo-profile-every", "2",
                                                               "--dynmo-profile-window", "2"])
    extras = [[s["extra_act_bytes"] for s in run["events"][0]["profile"]["stages"]]
              for run in (moved, plain, windowed)]
    assert [a - b for a, b in zip(*extras[:2])] == [2048, 2048] and extras[2] == extras[0], extras
    # with dropout the recomputed forward must draw the first pass's masks (its layer's own
    # streams, at the k-th recompute the k-th micro-batch's: layer_streams), and a moved
    # layer what it drew where it was: the moved, recomputed run equals the plain one
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--dynmo", "--dynmo-profile-every", "2"]
    _, plain_losses = train_in_megatron_lm(tmp_path / "dropout", dropout)
    _, recomputed_losses = train_in_megatron_lm(tmp_path / "dropout_recomputed", [
        *recompute, *dropout, "--dynmo-forced-layouts", "4:Et|tttL"])
    assert recomputed_losses == plain_losses != static_losses  # dropout drew: not the losses without it


@needs_source
def test_distributed_saved_activations_move_bit_exact_and_keep_a_tp_share(tmp_path):
    """--distribute-saved-activations at TP 2 x PP 2: each checkpoint keeps its input as the
    rank's 1/TP slice, swapped in place and gathered back into the tensor it saved in the
    backward. Under the profiler's saved-tensor hooks autograd gave the backward a copy, so
    the received activation on stage 1 stayed a flat slice ("The size of tensor a (2048)
    must match the size of tensor b (64)"); the profiler now steps aside for the
    checkpoint (`profiling.distributed_saves`). Layer 2 moved to stage 1 at iteration 4:
    every loss equals the never-moved run's without the flag; a layer holds half the
    hidden state (8192 bytes, not 16384), and the stage's own bytes are those of the run
    without it (the checkpoint's mask, counted by hand while the hooks step aside)."""
    recompute = ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    moved, moved_losses = train_in_megatron_lm(
        tmp_path / "moved", [*recompute, "--distribute-saved-activations", "--dynmo", "--dynmo-profile-every",
                             "2", "--dynmo-forced-layouts", "4:Et|tttL"], ranks=4)
    whole, whole_losses = train_in_megatron_lm(tmp_path / "whole", [*recompute, "--dynmo", "--dynmo-profile-every",
                                                                     "2"], ranks=4)
    check_forced_move(moved, "Et|tttL", 4)
    assert len(moved_losses) == 6 and moved_losses == whole_losses
    profiles = {name: [e["profile"] for e in run["events"] if e["kind"] == "profile"]
                for name, run in (("moved", moved), ("whole", whole))}
    assert {x["act_bytes"] for p in profiles["moved"] for x in p["layers"]} == {32 * 2 * 64 * 4 // 2}
    assert {x["act_bytes"] for p in profiles["whole"] for x in p["layers"]} == {32 * 2 * 64 * 4}
    extras = {name: {tuple(s["extra_act_bytes"] for s in p["stages"]) for p in ps} for name, ps in profiles.items()}
    assert extras["moved"] == extras["whole"] and len(extras["moved"]) == 1, extras


@needs_source
def test_uniform_recompute_in_chunks_moves_whole_chunks_inside_megatron_lm(tmp_path):
    """--recompute-method uniform --recompute-num-layers 2 (8 layers on 2 stages, a head
    of vocabulary 32768 worth ~2 layers): each profile-only plan puts whole chunks of 2
    on every stage (without them the start's best split is uneven), and a forced move of
    a chunk (layers 3-4 to stage 1) before iteration 4 changes no loss of the never-moved
    run; the moved stages' chunks keep their first layer's input only. `dynmo plan
    --from-run` and `--from-profile` of the report recommend whole chunks too."""
    flags = ["--num-layers", "8", "--vocab-size", "32768", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "2", "--dynmo",
             "--dynmo-profile-every", "2"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*flags, "--dynmo-forced-layouts",
                                                                    "4:Ett|ttttttL"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", flags)
    assert moved["layout"] == "Ett|ttttttL" and static["layout"] == "Etttt|ttttL"
    assert len(moved_losses) == 6 and moved_losses == static_losses
    for run in (moved, static):
        planned = [e["planned_layout"] for e in run["events"] if e["kind"] == "profile"]
        assert len(planned) == 3 and all(len(stage.strip("EL")) % 2 == 0 for p in planned
                                         for stage in p.split("|")), planned
    kept = [x["act_bytes"] for x in [e for e in moved["events"] if e["kind"] == "profile"][-1]["profile"]["layers"]]
    assert kept == [32 * 2 * 64 * 4, 0] * 4
    # `dynmo plan --from-run` and `--from-profile REPORT` read the recompute from the report
    from dynmo_plugin.cli._from_run import recommend, recommend_from_profile
    for recommended in (recommend(str(tmp_path / "static" / "out")),
                        recommend_from_profile(str(tmp_path / "static" / "out" / "report.json"))):
        shown = recommended["pipeline_model_parallel_layout"]
        assert all(len(stage.strip("EL")) % 2 == 0 for stage in shown.split("|")), shown


def _sync_bindings(run: Path, ranks: int = 2) -> dict:
    """Whether train()'s no-sync and grad-sync functions ended bound to the chunks it held
    (None: not set), as the harness recorded them after train(): the one answer of all
    `ranks` ranks (two answers: a mix)."""
    files = sorted(run.glob("sync_bindings_*.json"))
    answers = {(r["no_sync"], r["grad_sync"]) for r in (json.loads(p.read_text()) for p in files)}
    assert len(files) == ranks and len(answers) == 1, (files, answers)
    (no_sync, grad_sync), = answers
    return {"no_sync": no_sync, "grad_sync": grad_sync}


def _check_resume_after_the_move(tmp: Path, ckpt: Path, losses: list) -> None:
    """Megatron-LM's own save_checkpoint wrote iteration 4 (after the move) in torch_dist;
    resumed with --load under the same pipeline size, the moved layout is restored; under
    PP=1 (one rank) Megatron-LM's own split is built. Both continue with iterations 5 and
    6 of the run that never stopped, to the last bit. (--no-load-rng: on CPU the harness
    has no CUDA RNG tracker states to restore; no random numbers are drawn after start-up.)"""
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resume = ["--dynmo", "--load", str(ckpt), "--no-load-rng"]
    # a 2-iteration window opened at 6, the last: train()'s end cancels it (DynMo.finish)
    same, same_losses = train_in_megatron_lm(tmp / "resumed_pp2", [*resume, "--dynmo-profile-every", "3",
                                                                   "--dynmo-profile-window", "2"])
    assert (same["initial_layout"], same["layout"]) == ("Et|tttL", "Et|tttL")
    assert same_losses == losses[4:]
    assert [(e["window"], e.get("cancelled")) for e in same["events"]] == [
        ([6, 6], "the run ended inside the window")]
    other, other_losses = train_in_megatron_lm(tmp / "resumed_pp1", [*resume, "--pipeline-model-parallel-size", "1"],
                               ranks=1)
    assert other["initial_layout"] == "EttttL" and other_losses == losses[4:]
    # the saved layout is restored only where it fits, and an explicit layout wins
    for flags, want in ((["--pipeline-model-parallel-size", "2"], "Et|tttL"),
                        (["--pipeline-model-parallel-size", "4"], None),
                        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                          "Ettt|tL"], "Ettt|tL")):
        args = _parsed(["--dynmo", "--load", str(ckpt), *flags])
        ml.restore_saved_layout(args)
        assert args.pipeline_model_parallel_layout == want


def _parsed(argv: list[str]) -> argparse.Namespace:
    """Megatron-LM's parse_args (not yet validated) of MODEL_FLAGS + argv, with the plugin's flags."""
    from unittest import mock
    ml.use_source(SOURCE)
    from megatron.training.arguments import parse_args
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *MODEL_FLAGS, "--train-iters", "6", *argv]):
        return parse_args(ml._chain(None))


@needs_source
def test_a_per_rank_checkpoint_under_another_split_is_refused_in_one_line(tmp_path):
    """--ckpt-format torch numbers decoder layers within each stage: loaded under another
    split, stage 0 would silently take layer 1's weights for its layer 2. The checkpoint's
    header (tracker file and the per-rank file's `args`, the only part read before the
    model exists) is written here in Megatron-LM's legacy layout. Over the same header: a
    layer-freezing run is not resumed from a checkpoint that lacks the scenario's state, nor
    a run under uniform recompute in chunks of 2 from a layout that splits them."""
    import torch
    folder = tmp_path / "iter_0000004" / "mp_rank_00_000"
    folder.mkdir(parents=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    saved = _parsed(["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttL",
                     "--ckpt-format", "torch"])
    torch.save({"args": saved, "iteration": 4, "checkpoint_version": 3.0}, folder / "model_optim_rng.pt")
    ok = _parsed(["--dynmo", "--load", str(tmp_path), "--pipeline-model-parallel-size", "2"])
    ml.restore_saved_layout(ok)  # the saved split: honoured
    assert ok.pipeline_model_parallel_layout == "Et|tttL"
    # without --dynmo (the hooks on, the plugin off) Megatron-LM loaded it under its uniform
    # split with no error, layers in the wrong stages (survey 22b): refused, naming both fixes
    plain = _parsed(["--load", str(tmp_path), "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ml.MegatronLMError, match=r"saved under layout Et\|tttL at PP 2, TP 1 cannot be loaded under "
                                                 r"this run's layout uniform at PP 2, TP 1 .*; resume with --dynmo \(it "
                                                 r"restores the saved layout\) or with --pipeline-model-parallel-layout "
                                                 r"'Et\|tttL', or save in --ckpt-format torch_dist"):
        ml.restore_saved_layout(plain)
    ml.restore_saved_layout(_parsed(["--load", str(tmp_path), "--pipeline-model-parallel-size", "2",
                                     "--pipeline-model-parallel-layout", "Et|tttL"]))
    # unless it splits this run's uniform recompute chunks (Megatron would index past stage 0)
    chunks = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
    with pytest.raises(ml.MegatronLMError, match=r"its saved layout Et\|tttL: stage 0 holds 1, stage 1 holds 3 "
                                                 "layers, not a multiple of --recompute-num-layers 2"):
        ml.restore_saved_layout(_parsed(["--dynmo", "--load", str(tmp_path), "--pipeline-model-parallel-size", "2",
                                         *chunks]))
    # a scenario whose state the checkpoint lacks is not resumed (frozen layers would train)
    scenario = ["--dynmo-dynamism", "layer_freezing", "--spec", ml.SPEC_MODULE, "layer_freezing"]
    frozen = _parsed(["--dynmo", "--load", str(tmp_path), *scenario])
    with pytest.raises(ml.MegatronLMError, match="--dynmo-dynamism layer_freezing: the scenario's state"):
        ml.refuse_scenario_resume(frozen, ml.load_plugin_config(frozen))
    fresh = _parsed(["--dynmo", "--load", str(tmp_path / "none"), *scenario])
    ml.refuse_scenario_resume(fresh, ml.load_plugin_config(fresh))  # nothing saved there yet
    for flags in (["--pipeline-model-parallel-size", "1"],
                  ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|ttL"]):
        with pytest.raises(ml.MegatronLMError) as e:
            ml.restore_saved_layout(_parsed(["--dynmo", "--load", str(tmp_path), *flags]))
        assert "\n" not in str(e.value)
        assert "--ckpt-format torch checkpoint (layers numbered within each stage) saved under layout " \
            "Et|tttL at PP 2, TP 1 cannot be loaded" in str(e.value)
    # a split by first/last-stage counts or account-for flags is the split too
    first = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"]
    saved = _parsed([*first, "--ckpt-format", "torch"])
    torch.save({"args": saved, "iteration": 4, "checkpoint_version": 3.0}, folder / "model_optim_rng.pt")
    ml.restore_saved_layout(_parsed(["--dynmo", "--load", str(tmp_path), *first]))  # the same split
    for flags in (["--pipeline-model-parallel-size", "2"],
                  [*first[:2], "--account-for-embedding-in-pipeline-split"]):
        with pytest.raises(ml.MegatronLMError, match="saved under layout uniform --decoder-first-pipeline-num-"
                                                     "layers 1 at PP 2, TP 1 cannot be loaded under this run's "
                                                     "layout uniform( --account-for-embedding-in-pipeline-split)? "
                                                     "at PP 2, TP 1 without"):
            ml.restore_saved_layout(_parsed(["--dynmo", "--load", str(tmp_path), *flags]))


# Megatron-LM's saves that reuse the plans cached by the last one, unchecked (--save follows)
_SAVES_UNCHECKED = ["--ckpt-assume-constant-structure", "--ckpt-fully-parallel-save", "--save"]

FREEZING_YAML = """\
rebalance:
  min_gain: 0
dynamism:
  kind: layer_freezing
  freezing: {start: 2, interval: 2, threshold: 10, max_layers: 2}
"""


@needs_source
def test_layer_freezing_through_spec_and_yaml_rebalances_bit_exact_with_static(tmp_path):
    """The launcher's layer-freezing scenario inside Megatron-LM's train(): its layers from
    Megatron-LM's own --spec, its settings from the same --dynmo-config YAML. Snapshot at
    2, reference plasticity at 4, and at 6 (threshold 10: any layer has converged) layers
    1-2 freeze (max_layers 2): the whole of stage 0. The event makes the controller profile
    and move layers onto the cheaper stage 0; the static run (balancer uniform) freezes at
    the same iteration, and every loss of the two runs is the same to the last bit. The
    static run saves at 3, 6 and 9 (with --ckpt-assume-constant-structure): after the
    freeze the optimizer holds no state for layers 1-2, whose rows of each decoder
    tensor's optimizer state no rank wrote, and Megatron's sharding check raised on every
    rank ("Invalid access pattern", with or without that flag); zero placeholders fill
    them (megatron_lm_checkpoint.frozen_optimizer_state). With the distributed optimizer,
    stage 0 (embedding and layers 1-2, all frozen) holds no Adam state, whose step
    Megatron saves: it asserted; the step the other stage holds is lent
    (`steps_everywhere`) and not saved. A bf16 run with SwiGLU (its fc1 sharded by a
    factory) writes for layers 1-2 zero moments and fp32 master weights equal to their
    weights. Both the fp32 and the bf16 checkpoints resume without the scenario (the
    message of a resume with it says to): the bf16 one wrote stage 0's emptied group of
    fp32 masters as `[[]]` into the common state and the resume could not merge it with
    its own list of 10 until the masters moved (`_masters_of_emptied_groups`).

    The move is decided from one timed iteration, and it pays only by what stage 1's head
    (output layer + loss) costs more than stage 0's embedding: freezing drops the layers'
    backward, about their forward's cost at this size, so frozen stage 0 (E + 2 forwards)
    faces layer 4 + head. With a 128-token vocabulary the head weighed ~1 ms, and stage 0
    measured 0.68-0.78 of layer 4 + head (at load 14 its ranks' layers timed 1.5x those of
    the other rank), close enough for one window to read 'already balanced' (a CI run did).
    A 16384-token head (~6.4 ms: stage 0 at ~0.26 of layer 4 + head) keeps the decision
    clear of any such skew."""
    yaml_path = tmp_path / "freezing.yaml"
    yaml_path.write_text(FREEZING_YAML)
    flags = ["--spec", ml.SPEC_MODULE, "layer_freezing", "--dynmo", "--dynmo-config", str(yaml_path),
             "--vocab-size", "16384", "--train-iters", "9", "--tensorboard-dir", str(tmp_path / "tb")]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", flags)
    static, static_losses = train_in_megatron_lm(tmp_path / "static", [
        *flags[:-2], "--dynmo-balancer", "uniform", *_SAVES_UNCHECKED, str(tmp_path / "ckpt"), "--save-interval", "3"])
    distopt, _ = train_in_megatron_lm(tmp_path / "distopt", [
        *flags[:-2], "--dynmo-balancer", "uniform", "--use-distributed-optimizer", "--save",
        str(tmp_path / "ckpt_distopt"), "--save-interval", "3"])
    bf16 = ["--bf16", "--swiglu"]
    train_in_megatron_lm(tmp_path / "bf16", [*flags[:-2], *bf16, "--dynmo-balancer", "uniform", "--save",
                                             str(tmp_path / "ckpt_bf16"), "--save-interval", "9"])
    for ckpt in ("ckpt", "ckpt_distopt", "ckpt_bf16"):
        assert (tmp_path / ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "9"
    _check_frozen_rows(tmp_path / "ckpt_bf16" / "iter_0000009", frozen=2)
    for ckpt, precision in (("ckpt", []), ("ckpt_bf16", bf16)):
        _, resumed_losses = train_in_megatron_lm(tmp_path / f"resumed_{ckpt}", [
            "--dynmo", "--vocab-size", "16384", "--train-iters", "10", *precision, "--load",
            str(tmp_path / ckpt), "--no-load-rng", "--override-opt-param-scheduler"], length=())
        assert len(resumed_losses) == 1 and math.isfinite(resumed_losses[0])
    for report in (moved, static, distopt):
        freezes = [e for e in report["events"] if e["kind"] == "dynamism"]
        assert [(e["iteration"], e["detail"]["frozen_layers"]) for e in freezes] == [(6, [1, 2])]
    rebalances = [e for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert [e["trigger"] for e in rebalances] == ["event:layer_freezing@6"]
    assert moved["layout"] != "Ett|ttL" and static["layout"] == "Ett|ttL"
    assert len(moved_losses) == 9 and moved_losses == static_losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("dynmo/frozen_layers")] == [(6, 2.0)]
    # the scenario needs its spec, and the other scenarios are refused by name
    with pytest.raises(ConfigError, match="add --spec dynmo_plugin.integrations.megatron_lm_specs "
                                          "layer_freezing"):
        ml.load_plugin_config(_parsed(["--dynmo", "--dynmo-config", str(yaml_path)]))
    with pytest.raises(ConfigError, match="support: --dynmo-dynamism early_exit"):
        ml.load_plugin_config(_parsed(["--dynmo", "--dynmo-dynamism", "early_exit"]))
    with pytest.raises(ConfigError, match="builds the gradual_pruning scenario's layers: add "
                                          "--dynmo-dynamism gradual_pruning"):
        ml.load_plugin_config(_parsed(["--dynmo", "--spec", ml.SPEC_MODULE, "gradual_pruning"]))


def _check_frozen_rows(folder: Path, frozen: int) -> None:
    """In a checkpoint saved after layers 1..`frozen` froze: each decoder tensor's Adam
    moments are zero in those layers' rows (and not in the others'), its fp32 master
    weights there equal the layer's weights; SwiGLU's fc1 halves among them. No step
    lent to a frozen stage is in the common state."""
    import torch

    from dynmo_plugin.megatron.checkpoint.dist_ckpt import read_tensors
    tensors = read_tensors(str(folder))
    masters = [k[len("optimizer.state.fp32_param."):] for k in tensors
               if k.startswith("optimizer.state.fp32_param.decoder.layers.")]
    assert any("linear_fc1.weight" in k for k in masters) and len(masters) > 4
    for key in masters:
        weights = tensors[key] if key in tensors else None
        moment = tensors[f"optimizer.state.exp_avg.{key}"]
        assert not moment[:frozen].any() and moment[frozen:].any(), key
        if weights is not None:
            assert torch.equal(tensors[f"optimizer.state.fp32_param.{key}"][:frozen], weights[:frozen].float()), key
    assert "dynmo-step" not in repr(torch.load(folder / "common.pt", weights_only=False))


PRUNING_YAML = """\
rebalance:
  min_gain: 0
dynamism:
  kind: gradual_pruning
  pruning: {start: 2, interval: 2, rounds: 2, initial_sparsity: 0.0, final_sparsity: 0.9,
            granularity: structured}
"""


@needs_source
def test_structured_pruning_through_spec_moves_pruned_layers_bit_exact_with_static(tmp_path):
    """Structured (FFN-neuron) gradual pruning from --spec + YAML inside Megatron-LM's
    train(): rounds at 4 and 6 in both runs; in the moved run a forced layout carries the
    pruned layer 2 to stage 1 before iteration 5 and the controller, profiling after the
    round at 4, carries it back; iteration 6 prunes it again where it is. Six losses equal
    to the static run's (balancer uniform) to the last bit. The static run saves at 2, 4
    and 6 (with --ckpt-assume-constant-structure) across the rounds' rebuilds, which
    shrink the FFN tensors of every layer."""
    yaml_path = tmp_path / "pruning.yaml"
    yaml_path.write_text(PRUNING_YAML)
    flags = ["--spec", ml.SPEC_MODULE, "gradual_pruning", "--dynmo", "--dynmo-config", str(yaml_path)]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*flags, "--dynmo-forced-layouts", "5:Et|tttL"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", [
        *flags, "--dynmo-balancer", "uniform", *_SAVES_UNCHECKED, str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    for report in (moved, static):
        rounds = [e for e in report["events"] if e["kind"] == "dynamism"]
        assert [(e["iteration"], e["detail"]["unit"]) for e in rounds] == [(4, "ffn_neurons"), (6, "ffn_neurons")]
    applied = [(e["trigger"], [(m["layer"], m["src"], m["dst"]) for m in e["moves"]])
               for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == [("forced", [(2, 0, 1)]), ("event:gradual_pruning@4", [(2, 1, 0)])]
    assert len(moved_losses) == 6 and moved_losses == static_losses


NATIVE_MOE = ["--num-experts", "8", "--moe-router-topk", "4", "--moe-layer-freq", "[1,1,0,0]",
              "--moe-expert-capacity-factor", "2.0", "--moe-token-dispatcher-type", "allgather",
              "--disable-bias-linear"]


@needs_source
def test_native_moe_rebalanced_from_router_counts_bit_exact_with_a_never_moved_run(tmp_path):
    """Megatron-LM's own MoE flags (layers 1-2 MoE with 8 experts, top-4, capacity 2.0;
    3-4 dense; the allgather dispatcher, which builds no CUDA stream): every iteration from
    2 the `moe` scenario's event carries each layer's work from the tokens its router sent
    to each expert, and the controller moves MoE layer 2 onto the dense stage. There it is
    rebuilt as an MoE layer (its router still counts tokens), and the six losses equal those
    of the same run whose layout never moves (balancer uniform), to the last bit. That run
    recomputes every layer's forward in the backward (full recompute, which changes no
    number) and its routers' counts equal the moved run's: a recomputed forward is not
    counted again (it was, twice the tokens). Bias-free linears: Megatron's expert MLP
    adds its bias in place on a view, which autograd refuses."""
    flags = [*NATIVE_MOE, "--dynmo", "--dynmo-min-gain", "0", "--tensorboard-dir", str(tmp_path / "tb")]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", flags)
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    static, static_losses = train_in_megatron_lm(tmp_path / "static", [*flags[:-2], "--dynmo-balancer", "uniform",
                                                                       *recompute])
    events = [e for e in moved["events"] if e["kind"] == "dynamism"]
    assert [e["iteration"] for e in events] == [2, 3, 4, 5, 6]
    # the recomputed forward routes the same tokens again inside the backward: counted once
    static_counts = [e["detail"]["tokens_per_expert"] for e in static["events"] if e["kind"] == "dynamism"]
    assert static_counts == [e["detail"]["tokens_per_expert"] for e in events]
    for e in events:
        assert e["scenario"] == "moe" and sorted(e["detail"]["tokens_per_expert"]) == ["1", "2"]
        assert all(len(c) == 8 and sum(c) == 4 * 8 * 32 for c in e["detail"]["tokens_per_expert"].values())
        assert e["work"]["1"] > e["work"]["3"]  # an MoE layer's tokens make it the costlier
    applied = [e for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]]
    decided = [(e["iteration"], e.get("applied"), e.get("reason")) for e in moved["events"]
               if e["kind"] == "rebalance"]   # why, when it did not move (it failed once in CI)
    assert [(e["trigger"].split(":")[0], [(m["layer"], m["src"], m["dst"]) for m in e["moves"]])
            for e in applied] == [("event", [(2, 0, 1)])], decided
    assert moved["layout"] == "Et|tttL" and static["layout"] == "Ett|ttL"
    assert len(moved_losses) == 6 and moved_losses == static_losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.step for e in acc.Scalars("dynmo/moe_events")] == [2, 3, 4, 5, 6]
    assert "dynmo/layer_2_work" in acc.Tags()["scalars"]


@needs_source
def test_a_received_layer_is_built_without_drawing_from_the_run_s_random_streams(tmp_path):
    """MoE input jitter (random draws each step, from the rank's own stream) with one MoE
    layer per stage before and after each move (--moe-layer-freq [1,0,1,0]; dense layer
    2 is forced onto stage 1 at 4): each rank draws the same numbers either way, so the
    losses must equal the never-moved run's. The received layer's throw-away weight
    initialisation drew from the receiving rank's stream first, and every later draw
    there changed: the losses parted from iteration 4 (survey 22b). Built without drawing
    now (`scratch.rng_streams_kept`). The layers draw from the rank's streams here
    (--dynmo-rank-rng): from their own, nothing a rank builds could shift them."""
    jitter = [*NATIVE_MOE[:4], "--moe-layer-freq", "[1,0,1,0]", *NATIVE_MOE[6:], "--moe-input-jitter-eps", "0.1",
              "--dynmo", "--dynmo-balancer", "uniform", "--dynmo-profile-every", "2", "--dynmo-rank-rng"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*jitter, "--dynmo-forced-layouts", "4:Et|tttL"])
    _, static_losses = train_in_megatron_lm(tmp_path / "static", jitter)
    assert [(m["layer"], m["src"], m["dst"]) for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]
            for m in e["moves"]][:1] == [(2, 0, 1)]
    assert len(moved_losses) == 6 and moved_losses == static_losses


@needs_source
def test_a_step_megatron_runs_again_in_place_is_counted_once(tmp_path):
    """Megatron-LM's default --rerun-mode validate_results runs a step's forward and
    backward again in place when a check fires (here --check-for-spiky-loss, forced by its
    own error injection; the check is not fatal, so training goes on). The MoE routers'
    counts start over at the rerun (they were twice the tokens at that iteration: 2048 per
    layer) and the profile window open over it is dropped with the reason (its stage times
    were two runs'). That was the balanced start's window, which comes again later (it
    was lost: its iteration had passed). The losses equal the run's without the check or
    the start (a move changes no number), dropout and MoE input jitter on: the rerun
    draws what the first run drew (each layer's streams start the step over)."""
    flags = [*NATIVE_MOE, "--dynmo", "--dynmo-balancer", "uniform", "--dynmo-profile-every", "1",
             "--hidden-dropout", "0.1", "--moe-input-jitter-eps", "0.1"]
    checked = ["--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--rerun-mode", "validate_results",
               "--error-injection-rate", "6", "--error-injection-type", "correct_result"]
    rerun, rerun_losses = train_in_megatron_lm(tmp_path / "rerun", [*flags, *checked, "--dynmo-start-balanced-at", "2"])
    _, plain_losses = train_in_megatron_lm(tmp_path / "plain", flags)
    assert len(rerun_losses) == 6 and rerun_losses == plain_losses
    events = [e for e in rerun["events"] if e["kind"] == "dynamism"]
    assert [e["iteration"] for e in events] == [2, 3, 4, 5, 6]
    assert all(sum(c) == 4 * 8 * 32 for e in events for c in e["detail"]["tokens_per_expert"].values())
    dropped = [(e["iteration"], e["trigger"], e["cancelled"]) for e in rerun["events"] if e.get("cancelled")]
    assert dropped == [(2, "start", "Megatron-LM ran iteration 2 again in place (its rerun state machine): "
                                    "the window timed it twice")], dropped
    # the balanced start its window was: still to come (it was lost), after the events' rebalances
    assert [e["iteration"] for e in rerun["events"] if e.get("trigger") == "start" and e["kind"] == "rebalance"] == [5]


@needs_source
def test_native_moe_under_expert_parallelism_moves_bit_exact(tmp_path):
    """--expert-model-parallel-size 2 on 4 ranks (PP 2 x DP 2: each rank of a stage holds 4
    of the 8 experts of an MoE layer, their gradients reduced over the expert data-parallel
    group; the harness had built every MPU group but TP and PP at size 1, so EP never ran): MoE layer 2 moves to stage 1 before iteration 4, each rank sending its own
    experts to its place in the other stage, and the six losses equal the never-moved
    run's to the last bit. The router's counts still reach the scenario's events (the
    uniform balancer: only the forced move, whatever the events' gains on a loaded
    machine)."""
    flags = [*NATIVE_MOE, "--expert-model-parallel-size", "2", "--dynmo", "--dynmo-balancer", "uniform"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*flags, "--dynmo-profile-every", "2",
                                                                    "--dynmo-forced-layouts", "4:Et|tttL"], ranks=4)
    static, static_losses = train_in_megatron_lm(tmp_path / "static", flags, ranks=4)
    assert (moved["world"]["dp"], moved["world"]["world_size"]) == (2, 4)
    layers = [e["profile"]["layers"] for e in moved["events"] if e["kind"] == "profile"][0]
    # 4 of 8 experts per rank: 148224 fp32 parameters an MoE layer (279296 with all 8)
    assert [x["param_bytes"] for x in layers] == [4 * 148224] * 2 + [4 * 49408] * 2
    applied = [(e["iteration"], e["trigger"], [(m["layer"], m["src"], m["dst"]) for m in e["moves"]])
               for e in moved["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied == [(4, "forced", [(2, 0, 1)])]
    assert (moved["layout"], static["layout"]) == ("Et|tttL", "Ett|ttL")
    assert [e["iteration"] for e in moved["events"] if e["kind"] == "dynamism"] == [2, 3, 4, 5, 6]
    assert len(moved_losses) == 6 and moved_losses == static_losses


@needs_source
def test_checkpoint_repack_4_to_2_ranks_resumes_bit_exact(tmp_path):
    """--dynmo-repack in checkpoint mode on 4 ranks (PP=4): a forced 2-stage layout before
    iteration 4 makes Megatron-LM's own exit path save after iteration 4 and leave
    train(), the report naming the restart; restarted on 2 ranks (PP=2) with --load, the
    chosen layout Et|tttL is built and iterations 5 and 6 equal those of the PP=4 run that
    never stopped, to the last bit (its first four equal the stopped run's)."""
    ckpt = tmp_path / "ckpt"
    pp4 = ["--pipeline-model-parallel-size", "4", "--dynmo"]
    _, full = train_in_megatron_lm(tmp_path / "pp4", pp4, ranks=4)
    stopped, first = train_in_megatron_lm(tmp_path / "stopped", [*pp4, "--dynmo-repack", "--dynmo-repack-mode", "checkpoint",
                                                  "--dynmo-forced-layouts", "4:Et|tttL", "--save", str(ckpt),
                                                  "--save-interval", "1000"], ranks=4)
    assert [it["iteration"] for it in stopped["iterations"]] == [1, 2, 3, 4] and first == full[:4]
    repack = next(e["repack"] for e in stopped["events"] if e.get("repack"))
    assert (repack["mode"], repack["next_layout"], repack["world_size_after"]) == ("checkpoint", "Et|tttL", 2)
    assert f"--pipeline-model-parallel-size 2 --load {ckpt}" in repack["restart"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed, second = train_in_megatron_lm(tmp_path / "resumed", ["--dynmo", "--load", str(ckpt), "--no-load-rng"])
    assert resumed["initial_layout"] == "Et|tttL" and second == full[4:]


@needs_source
def test_a_move_at_dp_3_with_the_distributed_optimizer_and_overlapped_reduction_is_bit_exact(tmp_path):
    """PP 2 x DP 3 on 6 ranks, --use-distributed-optimizer --overlap-grad-reduce: layer 2
    moved at iteration 4, all 8 losses equal the never-moved run's. gloo's
    reduce-scatter over 3 ranks sums an element in an order set by its offset in the
    bucket, which a move changes: with it (--dynmo-native-grad-reduce) iteration 6 read
    5.007970810 moved against 5.007971287. Under --dynmo each bucket is reduced in rank
    order (`grad_reduce`), here asynchronously, finished where finish_grad_sync waits."""
    flags = ["--global-batch-size", "12", "--use-distributed-optimizer", "--overlap-grad-reduce",
             "--dynmo", "--dynmo-profile-every", "2"]
    length = ("--train-iters", "8")
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*flags, "--dynmo-forced-layouts", "4:Et|tttL"],
                                               ranks=6, length=length)
    static, static_losses = train_in_megatron_lm(tmp_path / "static", flags, ranks=6, length=length)
    assert moved["world"]["dp"] == 3
    assert [(e["iteration"], e["layout_after"]) for e in moved["events"] if e["kind"] == "rebalance"] == [
        (4, "Et|tttL")]
    assert len(moved_losses) == 8 and moved_losses == static_losses
    _assert_same_parameters(tmp_path, 6)


@needs_source
def test_a_move_at_tp_3_with_qk_layernorm_is_bit_exact_parameters_included(tmp_path):
    """PP 2 x TP 3 on 6 ranks (DP 1: no data-parallel reduction), --qk-layernorm: layer 2
    moved at iteration 4, every loss and every final parameter equal the never-moved
    run's. finalize_model_grads all-reduces the q/k layernorms' gradients of every layer
    the stage holds (and under --sequence-parallel its norms and biases) as one flat
    buffer over the tensor ranks, where a move changes each layer's offset: with gloo's
    own all-reduce (--dynmo-native-grad-reduce) 156 of 204 parameters differed after 6
    iterations (survey 24). Under --dynmo that buffer is reduced in rank order
    (`grad_reduce`)."""
    flags = ["--tensor-model-parallel-size", "3", "--qk-layernorm", "--hidden-size", "48",
             "--num-attention-heads", "3", "--kv-channels", "256", "--dynmo", "--dynmo-profile-every", "2"]
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*flags, "--dynmo-forced-layouts", "4:Et|tttL"],
                                               ranks=6)
    static, static_losses = train_in_megatron_lm(tmp_path / "static", flags, ranks=6)
    assert moved["world"]["tp"] == 3
    check_forced_move(moved, "Et|tttL", 4)
    assert len(moved_losses) == 6 and moved_losses == static_losses
    _assert_same_parameters(tmp_path, 6)


def _assert_same_parameters(tmp_path: Path, ranks: int) -> None:
    """The moved and the static runs' final parameters (the harness's dumps), equal to
    the last bit: equal losses can hide parameters that already differ (survey 24)."""
    import torch
    from launch import load_params
    moved, static = load_params(tmp_path / "moved", range(ranks)), load_params(tmp_path / "static", range(ranks))
    assert moved.keys() == static.keys() and len(moved) > 0
    assert [n for n in moved if not torch.equal(moved[n], static[n])] == []
