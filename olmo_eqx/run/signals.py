"""SIGTERM/SIGINT as a flag the train loop checks between steps (finish the step, save, exit 0).

Before a session's first step has finished there is nothing new to save (the state is the
checkpoint it resumed, or a fresh start a rerun makes again), and that step is mostly
compilation, seconds to many minutes of XLA that a flag would wait for. So a signal then stops
the run at once: one line, exit status 128 + the signal's number, nothing written. For a
Python signal handler to run at all during a compilation, the compiling call runs in a thread
of its own (`while_interruptible`) while the main thread waits. A second Ctrl-C always stops at
once, without a traceback (the last checkpoint stays: saves are atomic).
"""

import contextvars
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import jax
import numpy as np


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps."""

    def __init__(self):
        self.signal: Optional[str] = None
        # True while a signal would find nothing to save (before the session's first step).
        self.nothing_to_save = False

    def __bool__(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals(say: Callable[[str], None]) -> Iterator[StopFlag]:
    """Turn SIGTERM/SIGINT into a flag for the duration (a second SIGINT still interrupts).

    say: how to tell the user (the run dir's printer, so the note also lands in the log).
    """
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signal handlers can only be installed from the main thread
        return

    def handler(signum, _frame):
        if flag and signum == signal.SIGINT:
            stop_now(say, "SIGINT again: stopping now without saving (the last checkpoint is intact)", signum)
        flag.signal = signal.Signals(signum).name
        if flag.nothing_to_save:
            stop_now(say, f"\n{flag.signal} received before this session's first step finished: nothing new to save, "
                          "stopping now; rerun to resume", signum)
        say(f"\n{flag.signal} received: finishing this step, then saving a checkpoint")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_now(say: Callable[[str], None], line: str, signum: int) -> None:
    """Say `line` and end the process at once, exit status 128 + `signum` (the shell's for a
    process stopped by that signal): no traceback, no waiting on a compilation or a save in
    flight (the kernel releases the run's lock; an unfinished save is never taken for a
    checkpoint)."""
    try:
        say(line)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


def while_interruptible(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a thread of its own, the main thread waiting for it: a signal handler,
    which Python runs only in the main thread and only between bytecodes, then runs within
    moments even while `fn` is inside a minutes-long XLA compilation. What `fn` raises is
    raised here."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def work():
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (handed to the waiting thread, raised there)
            outcome["error"] = e
        finally:
            done.set()

    # A daemon: a process stopping during a compilation does not wait for it.
    # The caller's context variables go with it (a traced function may read them).
    context = contextvars.copy_context()
    threading.Thread(target=lambda: context.run(work), name="olmo-eqx-compile", daemon=True).start()
    while not done.wait(1.0):
        pass
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def ignore_signals_after_completion(say: Callable[[str], None]) -> None:
    """From now on a SIGTERM or a first SIGINT is noted and ignored: the run is saved and its
    summary written, so what is left (closing files, the runtime's teardown) must not turn a
    completed run into exit status -15. A second SIGINT still interrupts."""
    if threading.current_thread() is not threading.main_thread():
        return
    seen: list[int] = []

    def handler(signum, _frame):
        if signum == signal.SIGINT and seen.count(signal.SIGINT):
            raise KeyboardInterrupt
        seen.append(signum)
        say(f"{signal.Signals(signum).name} after the run completed: ignored (nothing is left to save)")

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, handler)


def any_process(flag: bool) -> bool:
    """True when any process saw a stop signal (every process must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))
