"""What the processes of a multi-controller run (`jax.distributed`) agree on, through the
runtime's own key-value store (the coordination service every process already talks to).

    agree(name, compute)     process 0 computes a JSON value, every process gets the same one
                             (a directory listing decided once, never re-listed by a process
                             while process 0 deletes in it)
    gather(name, value)      every process's value, on every process (each verifies its share
                             of a checkpoint's files; all learn the verdict)
    post / fetch             one value handed from one process to another (each process's
                             digests of the checkpoint files it wrote, to process 0)
    FailureWatch             a process that fails announces it; every other process stops
                             within seconds with that message, instead of waiting in a
                             collective or the shutdown barrier for the runtime's timeouts

Single-process runs never touch the store: `agree` just computes, the watch does nothing.
"""

import contextlib
import itertools
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Optional

import jax

_FAILED_KEY = "olmo_eqx/failed"
_SEEN_KEY = "olmo_eqx/failure_seen"
# How long a failing process waits for the others to take note before it exits: process 0
# hosts the runtime's coordination service, and its exit aborts the others (SIGABRT) before
# they could say why.
ACK_TIMEOUT_MS = 10_000
_counter = itertools.count()
# How long one wait for an agreed value may take: process 0 may be finishing a save first.
AGREE_TIMEOUT_MS = 10 * 60 * 1000
# How often the watch looks for a failure (seconds): the delay before the other processes stop.
POLL_S = 1.0


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def agree(name: str, compute: Callable[[], Any]) -> Any:
    """`compute()` as process 0 sees it, on every process (JSON-serialisable values). Every
    process must call it at the same points, in the same order (like a collective)."""
    if jax.process_count() == 1:
        return compute()
    key = f"olmo_eqx/agree/{name}/{next(_counter)}"
    client = _client()
    if jax.process_index() == 0:
        value = compute()
        client.key_value_set(key, json.dumps(value))
        return value
    return json.loads(client.blocking_key_value_get(key, AGREE_TIMEOUT_MS))


def gather(name: str, value: Any) -> list:
    """Every process's `value` (JSON-serialisable), in process order, on every process; a
    collective like `agree`."""
    if jax.process_count() == 1:
        return [value]
    prefix = f"olmo_eqx/gather/{name}/{next(_counter)}"
    client = _client()
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{prefix}/{i}", AGREE_TIMEOUT_MS)) for i in range(jax.process_count())]


def post(key: str, value: Any) -> None:
    """Put a JSON value in the store under `key` (read with `fetch` by any process)."""
    _client().key_value_set(key, json.dumps(value))


def fetch(key: str, timeout_ms: int = AGREE_TIMEOUT_MS) -> Any:
    """The value `post`ed under `key`, waiting for it up to `timeout_ms`."""
    return json.loads(_client().blocking_key_value_get(key, timeout_ms))


def _stop_now(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)  # not sys.exit: the shutdown barrier would wait for the processes that are gone


class FailureWatch:
    """While active, a failure announced by any process (`announce`) stops this one within
    `POLL_S` seconds, printing the failing process's message (exit status 2)."""

    def __init__(self):
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "FailureWatch":
        if jax.process_count() > 1:
            self._thread = threading.Thread(target=self._watch, name="olmo_eqx-failure-watch", daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        client = _client()
        while not self._done.is_set():
            try:
                message = client.key_value_try_get(_FAILED_KEY)
            except Exception:  # not set yet (or the service is going away at a normal exit)
                message = None
            if message is not None and not self._done.is_set():
                with contextlib.suppress(Exception):
                    client.key_value_set(f"{_SEEN_KEY}/{jax.process_index()}", "1")
                _stop_now(message)
            self._done.wait(POLL_S)

    @staticmethod
    def announce(error: BaseException) -> None:
        """Tell every process that this one failed with `error`; then stop this one too."""
        message = f"process {jax.process_index()} of {jax.process_count()} failed: {error}".splitlines()[0]
        client = _client()
        try:
            client.key_value_set(_FAILED_KEY, message)
        except Exception:  # another process announced first: its message stands, and is the
            # cause (this process's own error is then the collective its peer left, e.g. gloo's
            # "Connection closed by peer", when the watch had no time to see the announcement)
            with contextlib.suppress(Exception):
                message = client.key_value_try_get(_FAILED_KEY) or message
        for other in range(jax.process_count()):
            if other != jax.process_index():
                with contextlib.suppress(Exception):  # gone already, or too slow: stop anyway
                    client.blocking_key_value_get(f"{_SEEN_KEY}/{other}", ACK_TIMEOUT_MS)
        _stop_now(message)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self._thread is not None and not isinstance(exc, SystemExit):
            self.announce(exc)
        self._done.set()
