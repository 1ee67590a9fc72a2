"""Config checks against the rule each states, restated here (mutation survivors of
config.checks, wave 7): the interleaved schedule's micro-batch count over an enumerated
grid of TP x PP x DP and batch sizes, and a forced layout keeping the MTP block on its
starting rank in both directions (the live run of tests/megatron/test_mtp_runs.py checks
one direction, outside the pure tests)."""
from __future__ import annotations

import itertools

import pytest

from dynmo_plugin.config import ConfigError
from dynmo_plugin.train import build_parser, validate

MODEL = ["--num-layers", "12", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "5"]


def _outcome(argv: list[str], world_size: int) -> str:
    try:
        validate(build_parser().parse_args(MODEL + argv), world_size)
    except ConfigError as e:
        return str(e)
    return "ok"


GRID = [(tp, pp, dp, mbs, gbs) for tp, pp, dp, mbs in itertools.product((1, 2), (2, 3), (1, 2), (1, 2))
        for gbs in range(mbs * dp, 13 * mbs * dp, mbs * dp)]   # gbs a multiple of mbs x DP


@pytest.mark.parametrize("tp, pp, dp, mbs, gbs", GRID)
def test_interleaving_needs_the_micro_batches_in_groups_of_pp(tp, pp, dp, mbs, gbs):
    """Megatron's rule: gbs / (mbs x DP) micro-batches, DP = world / (TP x PP), a multiple of PP."""
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", str(mbs),
            "--global-batch-size", str(gbs)]
    got = _outcome(argv, world_size=tp * pp * dp)
    micro = gbs // (mbs * dp)
    if micro % pp:
        assert f"micro-batches ({micro} = " in got and f"multiple of --pipeline-model-parallel-size ({pp})" in got
    else:
        assert got == "ok"


MTP = ["--micro-batch-size", "1", "--global-batch-size", "8", "--dynmo",
       "--pipeline-model-parallel-size", "3", "--mtp-num-layers", "1"]
ON_RANK_1 = "Etttttt|ttttttm|L"       # the block standalone on rank 1, rank 2 keeps the head
ON_RANK_2 = "Etttt|tttt|ttttmL"


@pytest.mark.parametrize("start, forced", [
    ([], ON_RANK_1),                                              # starts on the last rank
    (["--pipeline-model-parallel-layout", ON_RANK_1], ON_RANK_2),
])
def test_a_forced_layout_may_move_the_mtp_block_live_with_one_chunk_per_rank(start, forced):
    """One chunk per rank: the block moves live (megatron/migration/mtp_move.py, issue 37);
    with virtual stages it is refused (tests/config/test_layout_mtp.py)."""
    assert _outcome(MTP + start + ["--dynmo-forced-layouts", f"2:{forced}"], world_size=3) == "ok"


@pytest.mark.parametrize("start, forced", [
    ([], "Ett|tttt|ttttttmL"),
    (["--pipeline-model-parallel-layout", ON_RANK_1], "Etttttttt|ttttm|L"),
])
def test_a_forced_layout_may_move_decoder_layers_around_the_mtp_block(start, forced):
    assert _outcome(MTP + start + ["--dynmo-forced-layouts", f"2:{forced}"], world_size=3) == "ok"


PP4_REPACK = ["--micro-batch-size", "1", "--global-batch-size", "8", "--dynmo", "--mtp-num-layers", "1",
              "--pipeline-model-parallel-size", "4", "--untie-embeddings-and-output-weights",
              "--dynmo-repack"]


def test_a_repack_leaving_the_block_off_the_last_surviving_rank_names_that_rank():
    """A forced repack onto 3 of 4 ranks with the block standalone on rank 1: refused, and
    the message names the last surviving rank, 2 (= the 3 ranks left - 1), where 'mL'
    would land it (mutation survivor config.checks:410 printed the rank count, 3)."""
    got = _outcome(PP4_REPACK + ["--dynmo-forced-layouts", "2:Etttttt|ttttttm|L"], world_size=4)
    assert "repacks with the MTP block on rank 1; a repack lands it on the last surviving rank (2)" in got
    assert _outcome(PP4_REPACK + ["--dynmo-forced-layouts", "2:Etttttt|tttt|ttmL"], world_size=4) == "ok"
