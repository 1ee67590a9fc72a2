"""Test infrastructure: refuse to fork a process that runs more than one thread.

A fork copies the whole address space but only the calling thread: a lock that another
thread held at that instant (a TCPStore server's, the allocator's, a logging handler's)
stays held forever in the child, which then hangs at its first use of it. The test
launcher (tests/zygote.py) forks only from single-threaded processes; this guard makes
a fork from a multi-threaded one fail loudly instead of hanging at random, in each of
the launcher's processes (the zygote, its fork server, torchrun's agents).

Threads are counted twice: Python's (threading.active_count) and the kernel's
(/proc/self/task), which also sees the native threads of C++ libraries (a TCPStore
server's event loop, gloo's, OpenMP's) that Python does not know about.
"""
from __future__ import annotations

import os
import threading

_real_fork = os.fork
_installed = False
_guarded_pid: int | None = None  # the process install() was last called in


class ForkWithThreadsError(RuntimeError):
    """A fork was attempted from a process with more than one live thread."""


def thread_counts() -> tuple[int, int]:
    """(Python threads, native threads) of this process."""
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: Python's count is all there is
        native = threading.active_count()
    return threading.active_count(), native


def refusal() -> str | None:
    """The one line saying why this process must not fork now, or None when it may."""
    python, native = thread_counts()
    if python <= 1 and native <= 1:
        return None
    names = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    return (f"fork refused in pid {os.getpid()}: {native} native threads ({python} Python: "
            f"main{''.join(', ' + n for n in names)}) are running; a fork would copy any lock "
            "they hold, held forever in the child (fork before starting threads, or use "
            "a fork server)")


def _checked_fork() -> int:
    if os.getpid() == _guarded_pid and (line := refusal()) is not None:
        raise ForkWithThreadsError(line)
    return _real_fork()


def _before_any_fork() -> None:
    """The backstop for forks that do not go through os.fork (os.forkpty, a subprocess
    with preexec_fn): an at-fork handler cannot stop the fork, so the process aborts
    with the line instead of letting a child hang."""
    if os.getpid() == _guarded_pid and (line := refusal()) is not None:
        os.write(2, f"{line}\n".encode())
        os.abort()


def install() -> None:
    """Guard this process. Its forks are not guarded until they call install() too: the
    launcher's processes do, the workers - the program under test - do not (Megatron-Core's
    checkpoint writer forks from a worker running dozens of threads, as it would under a
    plain torchrun)."""
    global _installed, _guarded_pid
    _guarded_pid = os.getpid()
    if not _installed:
        os.fork = _checked_fork
        os.register_at_fork(before=_before_any_fork)
        _installed = True


def fork() -> int:
    """os.fork, refused with ForkWithThreadsError from a multi-threaded process, whether or
    not the guard is installed here (pytest's own process forks the zygote with it)."""
    if (line := refusal()) is not None:
        raise ForkWithThreadsError(line)
    return _real_fork()


__all__ = ["ForkWithThreadsError", "fork", "install", "refusal", "thread_counts"]
