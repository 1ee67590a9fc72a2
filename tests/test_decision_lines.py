"""What a decision's console line says (dynmo_plugin.decision_lines)."""
from __future__ import annotations

from dynmo_plugin.decision_lines import describe, explain
from dynmo_plugin.events import RebalanceEvent


def _kept(source: str) -> RebalanceEvent:
    return RebalanceEvent(iteration=16, trigger="event:mixture_of_depths@16", layout_before="Ettttt|tttL",
                          layout_after="Ettttt|tttL", applied=False, overhead_s={},
                          reason=explain("gain 0.4% is below the noise floor 6.9%"), profile_source=source)


def test_a_decision_kept_on_an_untimed_estimate_says_how_to_time_it():
    """configs/mod.yaml: the event at 16 kept its layout on the work model's estimate (0.4%
    gain) while every later timed profile found 8%; the line named --dynmo-min-gain only."""
    line = describe(_kept("estimated"))
    assert line == (": kept Ettttt|tttL: gain 0.4% is below the noise floor 6.9% (change: --dynmo-min-gain); "
                    "decided from the scenario's work model on the last timed profile, untimed "
                    "(--dynmo-profile-retime-every 0 times every event)")
    assert describe(_kept("timed")) == (": kept Ettttt|tttL: gain 0.4% is below the noise floor 6.9% "
                                        "(change: --dynmo-min-gain)")


def test_an_applied_decisions_reason_asks_for_no_change():
    repack = "4 -> 2 stages: pays: saves 16.2 GPU-s vs 1 s rebuild x x margin 1"
    assert explain(repack) == "4 -> 2 stages: pays: saves 16.2 GPU-s vs 1 s rebuild x x --dynmo-gate-margin 1"
    refused = "4 -> 2 stages: does not pay: 1 s rebuild"
    assert explain(refused).endswith("(change: --dynmo-gate-margin, --dynmo-event-gap)")
