"""Where a run's wall time went: a per-session time ledger, written as it goes, and the report
across every session of a run dir (restarts included).

    ledger = Ledger.for_session()              # the session began when its process did
    with ledger.active():                      # compiles anywhere in the session count as compile
        ...                                    # outside any bucket: the phase ("startup")
        with ledger.bucket("data"):            # nested buckets: the innermost wins
            batch = next(batches)
        ledger.phase("steps")

Every second of a session belongs to exactly one bucket (`BUCKETS`): the ledger keeps one
stack of buckets and one monotonic clock, and at every switch credits the seconds since the
previous switch to the bucket on top. So the buckets add up to the session's wall time by
construction. JAX's own compile events (`jax.monitoring`: tracing, lowering, XLA's compile or
its persistent-cache read) move their seconds from the bucket they happened in to `compile`,
wherever they happen (the first step, the first evaluation, a helper jit in a save).

Process 0 rewrites its session's record (`goodput/session-<n>.json` in the run dir) whole at
saves, every `HEARTBEAT_S` seconds (from a thread of its own) and at the end, so a session
killed with `kill -9` still counts up to its last heartbeat. `report` reads them all: the wall time
is the sum of the sessions' (last heartbeat - start); steps trained in one session and trained
again by a later one (it resumed from an older checkpoint) move from `steps` to `lost`.
"""

import contextlib
import contextvars
import functools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from olmo_eqx.errors import RunError
from olmo_eqx.run.run_dir import RunDir

BUCKETS = ("startup", "restore", "compile", "steps", "data", "checkpoint", "eval", "other")
# The report's buckets: the steps' time split into what counted and what was trained again.
REPORT_BUCKETS = (*BUCKETS, "lost")
GOODPUT_DIR = "goodput"
PLOT_FILE = "goodput.png"
# How often (seconds) a running session's record is rewritten besides saves and the end: what
# a `kill -9` leaves out of the wall time at most. The environment may set another.
HEARTBEAT_S = 1.0
HEARTBEAT_ENV = "OLMO_EQX_GOODPUT_HEARTBEAT_S"
# JAX's compile events (jax/_src/dispatch.py): tracing to a jaxpr, lowering it, XLA's compile.
COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
_FORMAT = 1
# The most [step, steps seconds] points a session's record keeps (`Ledger.point`).
MAX_POINTS = 512


class GoodputError(RunError):
    """A goodput setting from the environment is not usable."""


def heartbeat_s() -> float:
    """Seconds between a running session's heartbeats: `OLMO_EQX_GOODPUT_HEARTBEAT_S`, else `HEARTBEAT_S`."""
    value = os.environ.get(HEARTBEAT_ENV, "")
    if not value:
        return HEARTBEAT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise GoodputError(f"{HEARTBEAT_ENV}={value!r} is not a number of seconds >= 0; unset it for "
                           f"{HEARTBEAT_S:g} s, or set 0 to write the session's record at every step")
    return seconds


# The ledger of the session running in this context. A ContextVar, not a global: the thread
# that compiles the first step (`olmo_eqx.run.signals.while_interruptible`) runs in a copy of
# the session's context and counts; threads of their own (the data prefetcher, Orbax's save
# threads) overlap the session's time and do not.
_ACTIVE: contextvars.ContextVar[Optional["Ledger"]] = contextvars.ContextVar("olmo_eqx_goodput", default=None)
_listening = False
# Whether a session of this process already began at the process's start (a second one, in the
# same process, begins when it is asked for).
_process_start_taken = False


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux: its start in /proc/self/stat against the
    boot-time clock, 10 ms resolution); None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Field 22 (starttime, clock ticks since boot); the command name (field 2) may hold spaces.
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def started_for_this_run() -> bool:
    """Whether this process is `python -m olmo_eqx` (its start is the session's start), not a
    notebook or a test calling `train` long after it started."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) in ("olmo_eqx.__main__", "olmo_eqx")


class Segment:
    """One open bucket (what `Ledger.bucket` yields): `charge(name)` credits the seconds since
    the last switch, and those to come until it closes, to another bucket instead."""

    def __init__(self, ledger: "Ledger", index: int):
        self._ledger, self._index = ledger, index

    def charge(self, name: str) -> None:
        self._ledger._check(name)
        self._ledger._stack[self._index] = name


class Ledger:
    """A session's seconds, each in one bucket (see the module docstring).

    clock: monotonic seconds (injectable for tests); wall: epoch seconds, read once to date
    the session; started_ago: seconds of the session before the ledger was made (the process's
    start-up), credited to `base`."""

    def __init__(self, *, base: str = "startup", started_ago: float = 0.0, origin: str = "train() call",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._check(base)
        self._clock = clock
        now = clock()
        self._origin_clock = now - started_ago
        self.start_epoch = wall() - started_ago
        self.origin = origin
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.seconds[base] += started_ago
        self._stack = [base]
        self._since = now
        # JAX's compile spans since the last switch, and the seconds they moved to `compile`.
        self._spans: list[tuple[float, float]] = []
        self._moved = 0.0
        self._lock = threading.Lock()  # the compile thread's events against the main thread's switches
        self.start_step: Optional[int] = None
        self.last_step: Optional[int] = None
        self._points: list[list] = []  # [step, cumulative steps seconds] at log steps and saves
        self.ended: Optional[str] = None
        self.outcome = "stopped"
        self._writer: Optional["SessionFile"] = None
        self._written = -float("inf")
        self._write_lock = threading.Lock()  # the beating thread's writes against the loop's
        self._stopped = threading.Event()
        self.heartbeat_s = heartbeat_s()

    @classmethod
    def for_session(cls) -> "Ledger":
        """A ledger from the process's start when this process is `python -m olmo_eqx` (imports,
        Hydra and everything before `train` count as start-up) and this is its first session,
        else from now."""
        global _process_start_taken
        age = process_age_s() if started_for_this_run() and not _process_start_taken else None
        if age is None:
            return cls()
        _process_start_taken = True
        return cls(started_ago=age, origin="process start")

    @staticmethod
    def _check(name: str) -> None:
        if name not in BUCKETS:
            raise ValueError(f"goodput bucket {name!r} is not one of {', '.join(BUCKETS)}")

    def _switch(self) -> float:
        """Credit the seconds since the last switch to the bucket on top; the clock now."""
        now = self._clock()
        self.seconds[self._stack[-1]] += now - self._since - self._moved
        self._since, self._spans, self._moved = now, [], 0.0
        return now

    @contextlib.contextmanager
    def bucket(self, name: str) -> Iterator[Segment]:
        """The seconds inside count to `name` (a bucket opened inside wins while it is open)."""
        self._check(name)
        with self._lock:
            self._switch()
            self._stack.append(name)
            index = len(self._stack) - 1
        try:
            yield Segment(self, index)
        finally:
            with self._lock:
                self._switch()
                del self._stack[index:]

    def phase(self, name: str) -> None:
        """What counts outside any open bucket from now on."""
        self._check(name)
        with self._lock:
            self._switch()
            self._stack[0] = name

    def compiled(self, start: float, end: float) -> None:
        """A compile that ran from `start` to `end` (epoch seconds, JAX's event span) in the
        current stretch: its seconds move to `compile`. Overlapping spans (a jit traced inside
        another's trace) count once, and never more than the stretch itself."""
        with self._lock:
            self._spans.append((start, end))
            moved = min(_union(self._spans), self._clock() - self._since)
            if moved > self._moved:
                self.seconds["compile"] += moved - self._moved
                self._moved = moved

    def totals(self) -> dict[str, float]:
        """Seconds per bucket so far, the current stretch included (they add up to `wall_s`)."""
        with self._lock:
            seconds = dict(self.seconds)
            seconds[self._stack[-1]] += self._clock() - self._since - self._moved
        return seconds

    def wall_s(self) -> float:
        return self._clock() - self._origin_clock

    # -- steps, for the progress a later session trains again ----------------------------------

    def step_done(self, step: int, *, logged: bool = False, saved: bool = False) -> None:
        """Step `step` is trained (and logged, or saved): at log steps and saves the steps'
        seconds so far are kept, for the steps a later session may train again; a save's record
        is written at once."""
        self.last_step = step
        if logged or saved:
            self.point(step)
        self.heartbeat(force=saved)

    @contextlib.contextmanager
    def waiting_for_data(self, in_flight: Any) -> Iterator[None]:
        """A wait for the next batch: `data`, unless the step dispatched before it (its outputs
        `in_flight`, None when fetched) was still running when the batch came. Then the device
        was busy through the whole wait and nothing was lost: `steps`."""
        with self.bucket("data") as wait:
            yield
            if in_flight is not None and still_running(in_flight):
                wait.charge("steps")

    def point(self, step: int) -> None:
        steps_s = self.totals()["steps"]
        if self._points and self._points[-1][0] == step:
            self._points[-1][1] = steps_s
            return
        self._points.append([step, steps_s])
        if len(self._points) > MAX_POINTS:
            # A long session's record stays small: the newer half kept whole (what a restart resumes
            # from), every other older point dropped (steps take about as long as their neighbours).
            half = MAX_POINTS // 2
            self._points[:-half] = self._points[:-half][::2]

    # -- the session's record ------------------------------------------------------------------

    def record(self) -> dict:
        seconds = self.totals()
        wall = sum(seconds.values())
        points = list(self._points)
        if self.last_step is not None and (not points or points[-1][0] != self.last_step):
            points.append([self.last_step, seconds["steps"]])
        return {
            "format": _FORMAT,
            "session": self._writer.number if self._writer is not None else None,
            "started": self.start_epoch,
            "heartbeat": self.start_epoch + wall,
            "wall_s": wall,
            "from": self.origin,
            "buckets": seconds,
            "start_step": self.start_step,
            "last_step": self.last_step if self.last_step is not None else self.start_step,
            "steps_at": [[int(s), round(t, 6)] for s, t in points],
            "ended": self.ended,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def write_to(self, out: RunDir, start_step: int) -> None:
        """The session resumed from `start_step` (0: a fresh start) writes its record into the
        run dir `out` (process 0's; elsewhere nothing is written) from now on: at `heartbeat`,
        `end`, and every `heartbeat_s` seconds from a thread of its own, so that a session
        killed in a minutes-long compile, evaluation or save still counts up to then."""
        self.start_step = start_step
        if not out.enabled:
            return
        self._writer = SessionFile(out.path, out.replace_text)
        self.heartbeat(force=True)
        if self.heartbeat_s > 0:
            threading.Thread(target=self._beat, name="olmo-eqx-goodput", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s):
            try:
                self.heartbeat()
            except Exception:  # noqa: BLE001  (a full disk: the loop's own writes say so, once)
                return

    def heartbeat(self, force: bool = False) -> None:
        """Rewrite the session's record, if `heartbeat_s` has passed since the last time (or `force`)."""
        if self._writer is None:
            return
        with self._write_lock:
            now = self._clock()
            if self.ended is None and (force or now - self._written >= self.heartbeat_s):
                self._written = now
                self._writer.write(self.record())

    def finish(self, summary: dict) -> dict:
        """The session's summary, noted for its last record: finished or stopped."""
        self.outcome = outcome(summary)
        return summary

    def end(self, how: str) -> None:
        """The session ends ("finished", "stopped", "interrupted", "failed: <error>"): its last record."""
        self._stopped.set()
        if self._writer is None:
            return
        with self._write_lock:
            self.ended = how
            self._writer.write(self.record())

    @contextlib.contextmanager
    def active(self) -> Iterator["Ledger"]:
        """The session, while open: this ledger is the one of module-level `bucket` and of JAX's
        compile events; at its end the last record says how it ended (`finish`, or the error)."""
        _listen_to_compiles()
        token = _ACTIVE.set(self)
        try:
            yield self
        except BaseException as e:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                self.end("interrupted" if isinstance(e, (SystemExit, KeyboardInterrupt)) else f"failed: {type(e).__name__}")
            raise
        else:
            self.end(self.outcome)
        finally:
            _ACTIVE.reset(token)


def counted(name: str) -> Callable:
    """A method's calls count to bucket `name` of its object's `ledger`."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def counted_method(self, *args: Any, **kwargs: Any) -> Any:
            with self.ledger.bucket(name):
                return method(self, *args, **kwargs)

        return counted_method

    return decorate


def bucket(name: str):
    """The active session's `Ledger.bucket(name)`, or nothing when no session is active (code
    below the loop, `olmo_eqx.train.setup`'s restore, marks its time without holding the ledger)."""
    ledger = _ACTIVE.get()
    return ledger.bucket(name) if ledger is not None else contextlib.nullcontext()


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -float("inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _on_span(event: str, start: float, end: float, **_kwargs: Any) -> None:
    if event in COMPILE_EVENTS and (ledger := _ACTIVE.get()) is not None:
        ledger.compiled(start, end)


def _listen_to_compiles() -> None:
    """Register (once per process) for JAX's compile events."""
    global _listening
    if not _listening:
        from jax import monitoring

        monitoring.register_event_time_span_listener(_on_span)
        _listening = True


def still_running(tree: Any) -> bool:
    """Whether any array in `tree` (a step's outputs) is still being computed on its device."""
    import jax

    return any(isinstance(leaf, jax.Array) and not leaf.is_ready() for leaf in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------
# The records on disk


class SessionFile:
    """One session's record, `goodput/session-<n>.json` in the run dir, `n` one past the last
    session's; each write replaces the file whole (a kill leaves the previous heartbeat)."""

    def __init__(self, run_dir: Path, write: Callable[[str, str], Any]):
        """write(name relative to the run dir, text): the run dir's atomic writer (RunDir.replace_text)."""
        self.number = 1 + max((n for n, _ in _session_files(Path(run_dir))), default=0)
        self.name = f"{GOODPUT_DIR}/session-{self.number:04d}.json"
        self._write = write

    def write(self, record: dict) -> None:
        self._write(self.name, json.dumps(record, indent=1) + "\n")


def _session_files(run_dir: Path) -> list[tuple[int, Path]]:
    directory = run_dir / GOODPUT_DIR
    found = []
    for path in directory.glob("session-*.json") if directory.is_dir() else []:
        number = path.stem.removeprefix("session-")
        if number.isdigit():
            found.append((int(number), path))
    return sorted(found)


def read_sessions(run_dir: Path) -> list[dict]:
    """The run dir's session records, oldest first (an unreadable one is skipped: a record is
    replaced whole, so only a foreign file can be)."""
    sessions = []
    for number, path in _session_files(Path(run_dir)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("buckets"), dict):
            record["session"] = number
            sessions.append(record)
    return sessions


def _steps_s_at(points: list[list], step: int) -> float:
    """The session's cumulative steps seconds at `step`, linear between its kept points (0 at
    or before its first step)."""
    before = (None, 0.0)
    for s, t in points:
        if s == step:
            return t
        if s > step:
            if before[0] is None:
                return 0.0
            (s0, t0), (s1, t1) = before, (s, t)
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        before = (s, t)
    return before[1]


def report(sessions: list[dict]) -> dict:
    """The run's goodput across `sessions` (records as `Ledger.record` makes them).

    A session's steps past the step a later session resumed from (the lowest start of any
    later session) were trained again: their seconds move from `steps` to `lost`. The time
    between one session's last heartbeat and the next one's start (the process down, or
    killed before its first heartbeat) is `down_between_sessions_s`, outside `wall_s`.
    """
    sessions = sorted(sessions, key=lambda s: s.get("started", 0.0))
    total = dict.fromkeys(REPORT_BUCKETS, 0.0)
    per_session, down = [], 0.0
    lost_steps = 0
    for i, session in enumerate(sessions):
        buckets = {name: float(session["buckets"].get(name, 0.0)) for name in BUCKETS}
        start, last = session.get("start_step"), session.get("last_step")
        later = [s.get("start_step") for s in sessions[i + 1:] if s.get("start_step") is not None]
        lost_s, lost_n = 0.0, 0
        if later and start is not None and last is not None and min(later) < last:
            resumed = max(min(later), start)
            points = session.get("steps_at") or []
            lost_s = min(buckets["steps"], max(0.0, _steps_s_at(points, last) - _steps_s_at(points, resumed)))
            lost_n = last - resumed
        buckets["steps"] -= lost_s
        buckets["lost"] = lost_s
        lost_steps += lost_n
        for name, seconds in buckets.items():
            total[name] += seconds
        wall = sum(buckets.values())
        if i:
            down += max(0.0, session["started"] - sessions[i - 1]["heartbeat"])
        per_session.append({
            "session": session.get("session", i + 1), "wall_s": wall, "buckets": buckets, "lost_s": lost_s,
            "lost_steps": lost_n, "start_step": start, "last_step": last, "ended": session.get("ended"),
        })
    wall = sum(total.values())
    return {
        "wall_s": wall,
        "goodput": total["steps"] / wall if wall > 0 else None,
        "buckets": total,
        "lost_s": total["lost"],
        "lost_steps": lost_steps,
        "sessions": len(sessions),
        "down_between_sessions_s": down,
        "per_session": per_session,
    }


def outcome(summary: dict) -> str:
    """How a session whose summary this is ended: "finished" (its stage completed) or "stopped"."""
    return "finished" if summary.get("stage_completed") else "stopped"


def run_report(run_dir: Path, ledger: Ledger, ended: Optional[str] = None) -> dict:
    """The report of the run dir's sessions, this one (`ledger`) as it stands now: `ended` where
    the caller knows how it ends (the final summary), else "running"."""
    record = ledger.record()
    record["ended"] = record["ended"] or ended or "running"
    return report([*(s for s in read_sessions(run_dir) if s["session"] != record["session"]), record])


def report_line(goodput: dict) -> str:
    """`goodput 81.2% of 312.4 s over 6 sessions: steps 260.1 s, compile 21.0 s, ...`."""
    share = "n/a" if goodput["goodput"] is None else f"{100 * goodput['goodput']:.1f}%"
    n = goodput["sessions"]
    parts = [f"{name} {seconds:.1f} s" for name, seconds in
             sorted(goodput["buckets"].items(), key=lambda kv: -kv[1]) if seconds >= 0.05]
    sessions = f"{n} session{'s' if n != 1 else ''}"
    line = f"goodput {share} of {goodput['wall_s']:.1f} s (from each process's start) over {sessions}: {', '.join(parts)}"
    if goodput["lost_steps"]:
        line += f" ({goodput['lost_steps']} step(s) trained again)"
    if n > 1:
        line += f"; {goodput['down_between_sessions_s']:.1f} s down between sessions (not in the wall time)"
    return line
