"""SIGTERM/SIGINT as a flag the train loop checks between steps (finish the step, save, exit 0)."""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import jax
import numpy as np


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps."""

    def __init__(self):
        self.signal: Optional[str] = None

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
            raise KeyboardInterrupt
        flag.signal = signal.Signals(signum).name
        say(f"\n{flag.signal} received: finishing this step, then saving a checkpoint")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
