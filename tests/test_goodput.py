"""The goodput report: the ledger's buckets (a fake clock), the report across sessions, and real
runs of the nano model (forked `python -m olmo_eqx`) whose buckets must add up to a wall clock
kept by the test: a run stopped at trainer.stop_at, resumed and killed with SIGKILL, and resumed
again, which trained some steps twice."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from olmo_eqx.run import goodput
from olmo_eqx.run.goodput import BUCKETS, REPORT_BUCKETS, Ledger, report, report_line

from clihelp import TINY, olmo_eqx, xla_flags
from forked_command import start_command, start_server


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_the_innermost_bucket_wins_and_every_second_lands_in_one():
    clock = FakeClock()
    ledger = Ledger(started_ago=3.0, origin="process start", clock=clock, wall=lambda: 5000.0)
    assert ledger.start_epoch == 4997.0
    clock.tick(1.0)  # startup, the base
    with ledger.bucket("eval"):
        clock.tick(2.0)
        with ledger.bucket("data"):
            clock.tick(0.5)
            with ledger.bucket("checkpoint") as inner:
                clock.tick(0.25)
                inner.charge("steps")  # the open stretch, and what follows until it closes
                clock.tick(0.25)
            clock.tick(0.5)
        clock.tick(1.0)
    ledger.phase("other")
    clock.tick(4.0)
    totals = ledger.totals()
    assert totals == {"startup": 4.0, "restore": 0.0, "compile": 0.0, "steps": 0.5, "data": 1.0, "checkpoint": 0.0,
                      "eval": 3.0, "other": 4.0}
    assert sum(totals.values()) == ledger.wall_s() == 12.5
    with pytest.raises(ValueError, match="'dat' is not one of startup, restore"):
        ledger.bucket("dat").__enter__()


def test_compile_spans_move_once_and_never_more_than_the_stretch():
    clock = FakeClock()
    ledger = Ledger(clock=clock)
    ledger.phase("steps")
    clock.tick(10.0)
    ledger.compiled(1000.0, 1001.0)  # a jit traced inside the next one's trace
    ledger.compiled(999.0, 1003.0)
    ledger.compiled(1002.0, 1004.0)  # overlaps the last: 1 s more
    assert ledger.totals()["compile"] == pytest.approx(5.0)
    assert ledger.totals()["steps"] == pytest.approx(5.0)
    with ledger.bucket("eval"):
        clock.tick(1.0)
        ledger.compiled(0.0, 30.0)  # longer than the stretch it came in: the stretch at most
    assert ledger.totals() == pytest.approx({**dict.fromkeys(BUCKETS, 0.0), "compile": 6.0, "steps": 5.0})
    assert sum(ledger.totals().values()) == pytest.approx(ledger.wall_s())


def test_a_wait_for_data_behind_a_running_step_costs_nothing():
    import jax
    import jax.numpy as jnp

    chain = jax.jit(lambda x: jnp.sin(x @ x @ x @ x))
    x = jnp.ones((1500, 1500))
    done = chain(x).block_until_ready()
    for in_flight, bucket in ((chain(x), "steps"), (done, "data"), (None, "data")):
        ledger = Ledger()
        with ledger.waiting_for_data(None if in_flight is None else {"loss": in_flight}):
            pass
        other = "data" if bucket == "steps" else "steps"
        assert ledger.totals()[bucket] > 0 and ledger.totals()[other] == 0, (bucket, ledger.totals())


def test_the_record_beats_on_its_own_and_stops_at_the_end(tmp_path, monkeypatch):
    from olmo_eqx.run.run_dir import RunDir

    monkeypatch.setenv(goodput.HEARTBEAT_ENV, "0.05")
    ledger = Ledger()
    ledger.write_to(RunDir(tmp_path), start_step=0)
    path = tmp_path / "goodput" / "session-0001.json"
    first = json.loads(path.read_text())["heartbeat"]
    time.sleep(0.5)  # a long compile or evaluation: no call of the loop's
    assert json.loads(path.read_text())["heartbeat"] > first + 0.2
    ledger.end("finished")
    final = path.read_text()
    time.sleep(0.2)
    assert path.read_text() == final and json.loads(final)["ended"] == "finished"
    assert not list(tmp_path.glob("goodput/.*"))  # no partial file left behind
    elsewhere = Ledger()  # a process other than 0 writes nothing
    elsewhere.write_to(RunDir(tmp_path / "process1", enabled=False), start_step=0)
    elsewhere.end("finished")
    assert not (tmp_path / "process1").exists()


def test_a_bad_heartbeat_setting_is_one_line(tmp_path):
    result = olmo_eqx(*TINY, f"hydra.run.dir={tmp_path / 'run'}", env={goodput.HEARTBEAT_ENV: "soon"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == ("error: OLMO_EQX_GOODPUT_HEARTBEAT_S='soon' is not a number of seconds >= 0; "
                                     "unset it for 1 s, or set 0 to write the session's record at every step")
    assert not (tmp_path / "run").exists()


def test_a_long_sessions_record_keeps_few_points_and_the_newest_whole():
    clock = FakeClock()
    ledger = Ledger(clock=clock)
    ledger.phase("steps")
    for step in range(1, 20_001):
        clock.tick(0.5)
        ledger.step_done(step, logged=step % 10 == 0)
    points = ledger.record()["steps_at"]
    assert len(points) <= goodput.MAX_POINTS + 1 and points[-1] == [20_000, 10_000.0]
    newest = [s for s, _ in points[-goodput.MAX_POINTS // 2:]]
    assert newest == list(range(20_000 - 10 * (len(newest) - 1), 20_001, 10))
    assert all(t == pytest.approx(s / 2) for s, t in points)  # every kept point exact
    assert goodput._steps_s_at(points, 12_345) == pytest.approx(12_345 / 2)


def session(number, started, buckets, start_step, last_step, steps_at):
    wall = sum(buckets.values())
    return {"session": number, "started": started, "heartbeat": started + wall, "buckets": buckets,
            "start_step": start_step, "last_step": last_step, "steps_at": steps_at}


def test_steps_trained_again_move_to_lost_and_the_downtime_stays_outside():
    first = session(1, 0.0, {"startup": 2.0, "compile": 3.0, "steps": 48.0, "checkpoint": 1.0}, 0, 48,
                    [[0, 0.0], [40, 40.0], [48, 48.0]])
    second = session(2, 60.0, {"startup": 2.0, "restore": 1.0, "steps": 10.0, "other": 1.0}, 45, 55,
                     [[45, 0.0], [50, 5.0], [55, 10.0]])  # killed: resumed from 45, the local tier's step
    third = session(3, 80.0, {"startup": 1.0, "steps": 5.0}, 50, 55, [[50, 0.0], [55, 5.0]])
    result = report([third, first, second])  # any order: by start
    assert result["sessions"] == 3 and result["lost_steps"] == 3 + 5
    # Steps 46-48 of the first (interpolated between its points 40 and 48), 51-55 of the second.
    assert result["lost_s"] == pytest.approx(3.0 + 5.0)
    assert [s["lost_steps"] for s in result["per_session"]] == [3, 5, 0]
    assert result["buckets"]["steps"] == pytest.approx(48 + 10 + 5 - 8)
    assert sum(result["buckets"].values()) == pytest.approx(result["wall_s"]) and result["wall_s"] == pytest.approx(74.0)
    assert result["goodput"] == pytest.approx(55 / 74)
    assert result["down_between_sessions_s"] == pytest.approx((60 - 54) + (80 - 74))
    assert set(result["buckets"]) == set(REPORT_BUCKETS)
    line = report_line(result)
    assert line.startswith("goodput 74.3% of 74.0 s (from each process's start) over 3 sessions: steps 55.0 s, lost 8.0 s, ")
    assert line.endswith("(8 step(s) trained again); 12.0 s down between sessions (not in the wall time)")
    # A later session that went back further than an earlier one started loses all of it.
    back = report([first, second, session(3, 80.0, {"steps": 1.0}, 0, 1, [[0, 0.0], [1, 1.0]])])
    assert [s["lost_steps"] for s in back["per_session"]] == [48, 10, 0]


def test_the_goodput_plot_has_a_bar_per_session(tmp_path):
    pytest.importorskip("matplotlib")
    from olmo_eqx.run.plots import goodput_plot

    result = report([session(1, 0.0, {"steps": 4.0, "compile": 2.0}, 0, 4, [[4, 4.0]]),
                     session(2, 9.0, {"steps": 2.0}, 2, 4, [[4, 2.0]])])
    assert goodput_plot(result, tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert goodput_plot(None, tmp_path / "none.png") is None


# --- real runs ---------------------------------------------------------------------------------

# trainer.steps is the same in every session (a resume compares it); each session stops earlier.
STEPS = [*TINY, "trainer.steps=200", "trainer.log_every=1"]


def session_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "goodput").glob("session-*.json"))


def last_step_recorded(run_dir: Path) -> int:
    files = session_files(run_dir)
    try:
        return json.loads(files[-1].read_text())["last_step"] if files else 0
    except ValueError:
        return 0


def process_start(pid: int) -> float:
    """When process `pid` started (epoch seconds), read by the test itself: its start in clock
    ticks since boot (/proc/PID/stat) against the seconds since boot (/proc/uptime)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


@pytest.fixture(scope="module")
def three_sessions(tmp_path_factory) -> dict:
    """Session 1 stops at trainer.stop_at=6 (saved); session 2 resumes and, with no save of its
    own, is killed (SIGKILL) past step 8; session 3 resumes from step 6 again and ends at 12.
    Each session's wall clock as the test sees it: from its process's start to its record's last
    write (the file's modification time)."""
    run_dir = tmp_path_factory.mktemp("goodput") / "run"
    # Every step's record written at once, so the kill comes after a known step's heartbeat.
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), goodput.HEARTBEAT_ENV: "0"}
    start_server(env)  # imports done before the first session starts (when env can be forked)
    started, results = [], []

    def start(*overrides: str):
        asked = time.time()
        command = start_command([*STEPS, *overrides, f"hydra.run.dir={run_dir}"], env=env)
        started.append(process_start(command.pid))
        assert asked - 0.05 <= started[-1] < asked + 5  # /proc's ticks are 10 ms
        return command

    results.append(start("trainer.stop_at=6").wait(300))
    assert results[0].returncode == 0, results[0].stderr[-3000:]

    command = start("checkpoint.every=0")
    deadline = time.time() + 120
    while (len(session_files(run_dir)) < 2 or last_step_recorded(run_dir) < 9) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(command.pid, signal.SIGKILL)
    results.append(command.wait(60))
    assert results[1].returncode == -signal.SIGKILL, results[1].stderr[-3000:]

    results.append(start("trainer.stop_at=12").wait(300))
    assert results[2].returncode == 0, results[2].stderr[-3000:]
    return {"run_dir": run_dir, "started": started, "results": results}


def test_a_sessions_buckets_add_up_to_the_wall_clock_within_two_percent(three_sessions):
    run_dir, started = three_sessions["run_dir"], three_sessions["started"]
    files = session_files(run_dir)
    assert [f.name for f in files] == ["session-0001.json", "session-0002.json", "session-0003.json"]
    for path, t0 in zip(files, started):
        record = json.loads(path.read_text())
        assert record["from"] == "process start"
        assert sum(record["buckets"].values()) == pytest.approx(record["wall_s"], rel=1e-9)
        seen = path.stat().st_mtime - t0  # the test's clock: the process's start to the record's last write
        assert record["wall_s"] == pytest.approx(seen, rel=0.02), (path.name, record["wall_s"], seen)
        assert record["buckets"]["steps"] > 0 and record["buckets"]["startup"] > 0
    first = json.loads(files[0].read_text())
    # Session 1: auto micro-batches compiled the step, session 1 saved step 6 at its end.
    assert first["ended"] == "stopped" and first["start_step"] == 0 and first["last_step"] == 6
    assert first["buckets"]["compile"] > 0 and first["buckets"]["checkpoint"] > 0 and first["buckets"]["eval"] > 0
    assert json.loads(files[1].read_text())["ended"] is None  # killed: its last heartbeat
    assert json.loads(files[2].read_text())["buckets"]["restore"] > 0


def test_a_stop_and_a_kill_are_three_sessions_and_the_steps_trained_twice_are_lost(three_sessions):
    run_dir = three_sessions["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    result = summary["goodput"]
    sessions = [json.loads(f.read_text()) for f in session_files(run_dir)]
    killed = sessions[1]
    assert result["sessions"] == 3 and [s["start_step"] for s in sessions] == [0, 6, 6]
    # Session 2 trained steps 7..N (N >= 9), none saved: session 3 trained them again.
    assert killed["last_step"] >= 9 and result["lost_steps"] == killed["last_step"] - 6
    assert [s["lost_steps"] for s in result["per_session"]] == [0, killed["last_step"] - 6, 0]
    # How each ended, as the final summary says it: the writer names its own session's end.
    assert [s["ended"] for s in result["per_session"]] == ["stopped", None, "stopped"]
    killed_steps = killed["buckets"]["steps"]
    assert 0 < result["lost_s"] <= killed_steps
    assert result["per_session"][1]["buckets"]["steps"] == pytest.approx(killed_steps - result["lost_s"])
    # The parts add up to the wall time: the sessions' own records, and the test's clock.
    assert sum(result["buckets"].values()) == pytest.approx(result["wall_s"], rel=1e-9)
    seen = sum(f.stat().st_mtime - t0 for f, t0 in zip(session_files(run_dir), three_sessions["started"]))
    assert result["wall_s"] == pytest.approx(seen, rel=0.02)
    assert result["goodput"] == pytest.approx(result["buckets"]["steps"] / result["wall_s"])
    assert result["down_between_sessions_s"] > 0
    line = three_sessions["results"][2].stdout.strip().splitlines()[-1]
    assert line.startswith("goodput ") and " over 3 sessions: " in line and "trained again" in line
    assert f"{result['lost_steps']} step(s) trained again" in line
