"""Models with Multi-Token Prediction inside Megatron-LM's own train() (docs/mtp.md): the
block profiled as its own unit, decoder layers moved around it, and the block itself
moved live at PP=4 (every rank reads the batches: dynmo_plugin.integrations.megatron_lm_data),
each bit-exact against a never-moved run; the CPU harness is megatron_lm_harness.py."""
from __future__ import annotations

import types

import pytest
from megatron_lm_harness import SKIP_REASON, check_forced_move, megatron_like, train_in_megatron_lm

from dynmo_plugin.integrations import megatron_lm as ml
from dynmo_plugin.layout import Layout

needs_source = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@needs_source
def test_mtp_inside_megatron_lm_train_profiled_and_decoders_moved_bit_exact(tmp_path):
    """--mtp-num-layers 1 under Megatron-LM's own train() (its gpt_builders build the MTP
    block, pretrain_gpt's get_embedding_ranks add the MTP rank): the stage handle reads
    the block's place ('m' on the last rank), profiles hold it as its own unit, a forced
    layout moves a decoder layer around it, and every loss equals the never-moved run's."""
    mtp = ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--dynmo"]  # Megatron-LM: MTP needs rope
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [*mtp, "--dynmo-profile-every", "2",
                                                    "--dynmo-forced-layouts", "4:Et|tttmL"])
    static, static_losses = train_in_megatron_lm(tmp_path / "static", mtp)
    assert static["layout"] == "Ett|ttmL" and static["events"] == []
    check_forced_move(moved, "Et|tttmL", 4)
    profiles = [e["profile"] for e in moved["events"] if e.get("profile")]
    assert profiles and all(p["mtp"]["stage"] == 1 and p["mtp"]["fwd_s"] > 0 for p in profiles)
    assert len(moved_losses) == 6 and moved_losses == static_losses



# PP=4, the block on the last rank with layer 4: it can move to rank 1 or 2 (never rank
# 0). Untied embeddings: the bit-exact case (docs/mtp.md). A large vocabulary makes the
# last rank (the output layer, run for the main and the MTP loss) the bottleneck.
MTP_PP4 = ["--mtp-num-layers", "1", "--position-embedding-type", "rope",
           "--untie-embeddings-and-output-weights", "--vocab-size", "16384",
           "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout", "Et|t|t|tmL",
           "--dynmo", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # the block draws its own


@pytest.fixture(scope="module")
def mtp_static(tmp_path_factory):
    """The never-moved PP=4 MTP run inside Megatron-LM: (report, losses)."""
    report, losses = train_in_megatron_lm(tmp_path_factory.mktemp("mtp_static"), MTP_PP4, ranks=4)
    assert report["layout"] == "Et|t|t|tmL" and report["events"] == []
    return report, losses


@needs_source
def test_the_mtp_block_moves_live_inside_megatron_lm_bit_exact_and_resumes_elsewhere(
        mtp_static, tmp_path):
    """pretrain_gpt.py reads batches on the first, last and MTP ranks only: under --dynmo
    every rank builds the data and reads every micro-batch (megatron_lm_data), and
    get_batch follows the block through Megatron-LM's args. Forced at iteration 3, the
    block, layer 4 and the final norm go from rank 3 to rank 2; at 5 the block stays
    (standalone) while layers 2-4 and the norm, which Megatron keeps beside the last
    decoder layer, move to ranks 0-1. Every loss equals the never-moved run's; the
    checkpoint of iteration 4 (block on rank 2) resumes with it back on rank 3, and
    continues bit for bit."""
    ckpt = tmp_path / "ckpt"
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [
        *MTP_PP4, "--dynmo-forced-layouts", "3:Et|t|ttm|L;5:Ettt|t|m|L", "--save", str(ckpt),
        "--save-interval", "4"], ranks=4)
    events = [e for e in moved["events"] if e["kind"] == "rebalance"]
    assert [(e["iteration"], e["applied"], e["layout_after"]) for e in events] == [
        (3, True, "Et|t|ttm|L"), (5, True, "Ettt|t|m|L")]
    assert [[(m["layer"], m["src"], m["dst"]) for m in e["moves"]] for e in events] == [
        [(4, 3, 2), ("mtp", 3, 2), ("final_layernorm", 3, 2)],
        [(2, 1, 0), (3, 2, 0), (4, 2, 1), ("final_layernorm", 2, 1)]]
    assert len(moved_losses) == 6 and moved_losses == mtp_static[1]
    resumed, resumed_losses = train_in_megatron_lm(tmp_path / "resumed", [
        *MTP_PP4, "--load", str(ckpt), "--no-load-rng"], ranks=4)
    assert resumed["initial_layout"] == "Et|t|t|tmL" and resumed_losses == mtp_static[1][4:]


@needs_source
def test_a_decided_mtp_block_move_inside_megatron_lm_is_bit_exact(mtp_static, tmp_path):
    """The controller, the block unpinned once every rank has batches, decides on the
    measured profile to take the block off the last rank (the bottleneck whatever else
    it holds), and every loss equals the never-moved run's."""
    moved, moved_losses = train_in_megatron_lm(tmp_path / "moved", [
        *MTP_PP4, "--dynmo-rebalance-interval", "3", "--dynmo-profile-window", "1",
        "--dynmo-min-gain", "0", "--dynmo-gate-margin", "0"], ranks=4)
    first = [e for e in moved["events"] if e["kind"] == "rebalance"][0]
    assert first["trigger"] == "rebalance_interval" and first["applied"], first.get("reason")
    rank = Layout.parse(first["layout_after"]).mtp_rank
    assert rank in (1, 2) and ("mtp", 3, rank) in [(m["layer"], m["src"], m["dst"])
                                                   for m in first["moves"]]
    assert len(moved_losses) == 6 and moved_losses == mtp_static[1]


def test_a_forced_mtp_block_move_without_data_on_every_rank_is_refused_in_one_line():
    """A dataset provider of the user's own that builds no data on some rank: the block
    stays where it starts, and a forced layout that moves it stops the run at start in
    one line (decoder layers still move around it)."""
    from dynmo_plugin.integrations.megatron_lm import _Run
    mtp = dict(pipeline_model_parallel_layout="Et|t|ttmL", num_layers=4,
               pipeline_model_parallel_size=3, mtp_num_layers=1,
               untie_embeddings_and_output_weights=True)
    run = object.__new__(_Run)
    run.stage = types.SimpleNamespace(mtp_moves_live=None)
    run.cfg = ml.load_plugin_config(megatron_like(
        argv=["--dynmo", "--dynmo-forced-layouts", "3:Et|tttm|L"], **mtp))
    with pytest.raises(ml.MegatronLMError, match="a forced layout moves the MTP block to another rank"):
        run.data_built(False)
    assert run.stage.mtp_moves_live is False
    run.data_built(True)
    assert run.stage.mtp_moves_live is True
    run.cfg = ml.load_plugin_config(megatron_like(
        argv=["--dynmo", "--dynmo-forced-layouts", "3:Ett|t|tmL"], **mtp))
    run.data_built(False)
    assert run.stage.mtp_moves_live is False
