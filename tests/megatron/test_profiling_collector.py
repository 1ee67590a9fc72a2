"""No garbage collection inside a profiling window (dynmo_plugin/profiling/collector.py).

A generation-2 collection of ~420k objects took 190-260 ms of CPU in grow_check's ranks;
inside a window it landed in one layer's forward span (258.6 ms against ~10 ms) and
doubled the stage's summed spans. Real steps of a real one-rank Megatron stage, with
cyclic garbage made in every step and the collector's threshold at its lowest, so that
outside a window collections certainly run: inside one, none may."""
from __future__ import annotations

import gc

from launch import in_megatron_process
from test_profiling_rest import _one_rank_trainer

from dynmo_plugin.config import ModelArgs
from dynmo_plugin.profiling.collector import CollectorPause


class _Cycle:
    def __init__(self):
        self.me = self


def _garbage(n: int = 2000) -> None:
    for _ in range(n):
        _Cycle()


def _steps(trainer, window, iterations, collections: list) -> int:
    """Collections counted over `iterations` steps (each making cyclic garbage)."""
    before = len(collections)
    for it in iterations:
        if window is not None:
            window.before_iteration()
        _garbage()
        trainer.train_step(it)
        _garbage()
        if window is not None:
            window.step_done()
            window.after_iteration()
    return len(collections) - before


def _check_no_collection_in_a_window(args):
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    collections: list = []
    gc.callbacks.append(lambda phase, info: collections.append(info) if phase == "start" else None)
    gc.set_threshold(10, 1, 1)  # every few hundred allocations collects, generation 2 included
    trainer = _one_rank_trainer(args)
    assert _steps(trainer, None, (1, 2), collections) > 0  # the control: they do run
    window = ProfileWindow(trainer, outside_s=[0.5])
    assert not gc.isenabled()
    assert _steps(trainer, window, (3, 4), collections) == 0
    profile = window.close()
    assert profile.layers and gc.isenabled()  # back on at the close
    assert _steps(trainer, None, (5,), collections) > 0
    # a cancelled window releases it too; a collector already off (Megatron-LM's
    # --manual-gc) stays off after the window
    ProfileWindow(trainer, outside_s=[0.5]).cancel()
    assert gc.isenabled()
    gc.disable()
    window = ProfileWindow(trainer, outside_s=[0.5])
    _steps(trainer, window, (6,), collections)
    window.close()
    assert not gc.isenabled()


def test_no_collection_runs_inside_a_profiling_window():
    in_megatron_process(_check_no_collection_in_a_window,
                        ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                  micro_batch_size=1, global_batch_size=2))


def test_a_pause_restores_what_it_found():
    was = gc.isenabled()
    try:
        gc.enable()
        pause = CollectorPause()
        assert not gc.isenabled()
        pause.release()
        pause.release()
        assert gc.isenabled()
        gc.disable()
        pause = CollectorPause()
        pause.release()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
