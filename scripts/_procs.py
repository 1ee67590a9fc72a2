"""Shared by the scripts that watch or stop a run's processes: the processes below a
pid, from /proc's parent links (Linux). torchrun starts each rank in a session of its
own, so neither a process-group kill nor a session's CPU accounting reaches them; the
parent links do, while the agent lives."""
from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first; [] where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            ppid = int(Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found
