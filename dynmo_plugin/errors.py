"""Exception types shared by every wing.

`UserError` marks a problem the user caused and can fix (bad flag, bad YAML, a plan
that cannot exist). Entry points print its message on one line and exit with status 2,
never a traceback; everything else is a bug and keeps its traceback.
"""
from __future__ import annotations

__all__ = ["UserError", "USER_ERROR_EXIT", "DecisionFailed"]

USER_ERROR_EXIT = 2


class UserError(ValueError):
    """Bad input: the message names the problem and what to do about it.

    `agreed`: every rank raised it with the same message (it joins every rank's cause,
    `consensus.ControlPlane.agree`), so rank 0 alone prints it."""

    agreed = False


class DecisionFailed(RuntimeError):
    """A decision made on one rank and broadcast (`consensus.ControlPlane.decide`) raised
    there; every rank receives the same message, so every rank can fall back alike."""
