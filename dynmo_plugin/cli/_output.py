"""Keeping stdout for the sub-command's result, and user values short in messages.

`dynmo plan --json | jq` and `json.load` need stdout to hold exactly one document, but
libraries print there on their own: DeepSpeed's logger writes its "Setting accelerator
to CPU" warning to the `sys.stdout` it saw when it was first imported. Sub-commands do
their work inside `third_party_output_to_stderr()` and print their result after it.
"""
from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Iterator

__all__ = ["third_party_output_to_stderr", "show"]


@contextlib.contextmanager
def third_party_output_to_stderr() -> Iterator[None]:
    """Send everything printed to `sys.stdout` inside the block to stderr instead.

    Loggers created inside the block (DeepSpeed's, on its first import) bind to stderr
    for good, so import such libraries inside it (see
    `dynmo_plugin.balancing.partition.load_partition_balanced`).
    """
    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def show(value: Any, width: int = 40) -> str:
    """`value` as JSON, cut to `width` characters: an error message quoting a user's value
    (a 4000-digit --seed, a long list) stays one short line."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width - 3] + "..."
