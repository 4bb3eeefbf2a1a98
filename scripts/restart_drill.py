"""The restart drill: a short pretrain run killed with SIGKILL at random moments, five times,
rerun after each kill; one row per kill (the step it had reached, the step the rerun resumed
from and from which tier, the steps lost), and whether the final state is bitwise the state of
an uninterrupted run.

    python scripts/restart_drill.py [--steps 200] [--kills 5] [--seed 0] [--processes 1,2] [--keep DIR]

Each configuration runs with the local tier (`checkpoint.local_every=5 checkpoint.every=50`)
and without it (`checkpoint.every=50`), on one process and on two (`jax.distributed` over
127.0.0.1, tests/localcluster.py; a kill takes down both, as a preemption of the job would).
A kill lands when the run has recorded a step drawn uniformly from what is left of the run, so
it falls anywhere: in a step, in a save, in the start-up of the next session.

Real `python -m olmo_eqx +stage=pretrain` processes of the nano model (8 x 64 tokens a step,
one CPU device per process), one shared compilation cache. A second table gives each run's
goodput report (`olmo_eqx.run.goodput`, as summary.json holds it) over all its sessions, and
checks it against this script's own clock: the sessions' wall time plus the time down between
them must be the drill's time from the first start to the last exit, within 2% (exit status 1
otherwise, as for a resume that is not bitwise).
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads the final checkpoints

BASE = ["+stage=pretrain", "model=olmo3_nano", "data.sequence_length=64", "data.global_batch_size=8",
        "schedule.warmup_steps=10", "trainer.log_every=10", "trainer.eval_every=0", "trainer.loggers=[jsonl]",
        "trainer.plot=false", "checkpoint.keep_last=2"]
# The goodput record rewritten at every step: the nano model's steps take milliseconds, so at the
# default heartbeat (1 s, far shorter than a real model's step) a kill would leave a second of
# steps unrecorded, counted as time down between sessions instead of steps trained twice.
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "OLMO_EQX_GOODPUT_HEARTBEAT_S": "0"}
CONFIGS = {
    "local tier (local_every=5, every=50)": ["checkpoint.every=50", "checkpoint.local_every=5"],
    "persistent only (every=50)": ["checkpoint.every=50", "checkpoint.local_every=0"],
}


def command(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "olmo_eqx", *BASE, f"trainer.steps={steps}", *overrides, f"hydra.run.dir={run_dir}"]


def start(run_dir: Path, steps: int, processes: int, *overrides: str) -> list[subprocess.Popen]:
    argv = command(run_dir, steps, *overrides)
    if processes == 1:
        return [subprocess.Popen(argv, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)]
    from localcluster import launch_local_cluster

    return launch_local_cluster(argv, n_processes=processes, devices_per_process=1, merge_stderr=True,
                                env={k: v for k, v in ENV.items() if k != "XLA_FLAGS"})


def last_step(run_dir: Path) -> int:
    """The newest step metrics.jsonl records as trained (0 when none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        if "loss" in record:
            steps.append(record["step"])
    return max(steps)


def arrays(step_dir: Path) -> list[np.ndarray]:
    """Every array of a persistent step (model and train state) as numpy."""
    import logging

    from olmo_eqx.checkpoint.format import step_arrays

    logging.getLogger("absl").setLevel(logging.ERROR)  # "Metadata file does not exist": read as numpy, no sharding needed
    return step_arrays(step_dir)


def finish(procs: list[subprocess.Popen]) -> str:
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a run failed (exit {[p.returncode for p in procs]}):\n{outputs[0][-3000:]}")
    return outputs[0]


def resumed_from(output: str) -> tuple[int, str]:
    line = next((line for line in output.splitlines() if line.startswith("Resuming from")), None)
    if line is None:
        return 0, "start"
    step = int(re.search(r"\(step (\d+)", line).group(1))
    return step, "local" if line.startswith("Resuming from the local tier") else "persistent"


def drill(root: Path, name: str, overrides: list[str], steps: int, kills: int, processes: int,
          rng: random.Random, reference: list[np.ndarray]) -> tuple[list[tuple], dict]:
    run_dir = root / re.sub(r"\W+", "_", f"{name}_{processes}p")
    local = ["checkpoint.local_dir=" + str(run_dir / "local")]  # not /dev/shm: the drill cleans up after itself
    rows = []
    began = time.perf_counter()
    procs = start(run_dir, steps, processes, *overrides, *local)
    for kill in range(1, kills + 1):
        reached = last_step(run_dir)
        target = rng.randint(reached + 1, max(reached + 1, steps - (kills - kill + 1) * 5))
        while last_step(run_dir) < target and all(p.poll() is None for p in procs):
            time.sleep(0.02)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.communicate(timeout=60)
        killed_at = last_step(run_dir)
        procs = start(run_dir, steps, processes, *overrides, *local)
        # The resume line comes before the first step: read until it (or the end) is there.
        seen = ""
        while not re.search(r"^(Resuming from|olmo3_nano: )", seen, re.M) and procs[0].poll() is None:
            seen += procs[0].stdout.readline()
        step, tier = resumed_from(seen)
        rows.append((kill, killed_at, step, tier, killed_at - step))
        procs[0]._seen = seen
    output = getattr(procs[0], "_seen", "") + finish(procs)
    wall = time.perf_counter() - began
    final = arrays(run_dir / "checkpoints" / str(steps))
    bitwise = len(final) == len(reference) and all(np.array_equal(a, b) for a, b in zip(final, reference))
    # The goodput report of every session's final record (summary.json's was taken just before
    # the last session's end), against this script's clock: the sessions' wall time plus the
    # time down between them is the span from the first process's start to the last record.
    from olmo_eqx.run import goodput

    report = goodput.report(goodput.read_sessions(run_dir))
    return rows, {"bitwise": bitwise, "wall_s": wall, "goodput": report, "output": output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", default="1,2", help="process counts to drill, e.g. 1 or 1,2")
    parser.add_argument("--keep", help="run in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="restart_drill_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ENV["JAX_COMPILATION_CACHE_DIR"] = str(root / "jax_cache")
    rng = random.Random(args.seed)
    started = time.time()
    table = []
    try:
        for processes in map(int, args.processes.split(",")):
            reference_dir = root / f"reference_{processes}p"
            finish(start(reference_dir, args.steps, processes, "checkpoint.every=50", "checkpoint.local_every=0"))
            reference = arrays(reference_dir / "checkpoints" / str(args.steps))
            for name, overrides in CONFIGS.items():
                rows, result = drill(root, name, overrides, args.steps, args.kills, processes, rng, reference)
                table.append((f"{name}, {processes} process{'es' if processes > 1 else ''}", rows, result))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{args.steps} steps of olmo3_nano (8 x 64 tokens), {args.kills} kill -9 each, seed {args.seed}\n")
    print("| run | kill | step reached | resumed from | steps lost | final state bitwise |")
    print("|---|---|---|---|---|---|")
    ok = True
    for name, rows, result in table:
        for kill, reached, step, tier, lost in rows:
            print(f"| {name} | {kill} | {reached} | {step} ({tier}) | {lost} | {'yes' if result['bitwise'] else 'NO'} |")
        lost = [row[-1] for row in rows]
        print(f"| {name}: all | | | | max {max(lost)}, mean {np.mean(lost):.1f} | |")
        ok &= result["bitwise"]
    print("\nGoodput (summary.json's report over the final records of all sessions), against this script's clock:\n")
    print("| run | sessions | goodput | wall (sum of buckets) | down between sessions | wall + down / drill clock "
          "| steps trained twice | lost | start-up + compile + restore | checkpoint | data |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, result in table:
        g, b = result["goodput"], result["goodput"]["buckets"]
        assert abs(sum(b.values()) - g["wall_s"]) < 1e-6 * g["wall_s"]
        ratio = (g["wall_s"] + g["down_between_sessions_s"]) / result["wall_s"]
        ok &= abs(ratio - 1) <= 0.02
        print(f"| {name} | {g['sessions']} | {100 * g['goodput']:.1f}% | {g['wall_s']:.1f} s | "
              f"{g['down_between_sessions_s']:.1f} s | {ratio:.3f} | {g['lost_steps']} | {g['lost_s']:.1f} s | "
              f"{b['startup'] + b['compile'] + b['restore']:.1f} s | {b['checkpoint']:.1f} s | {b['data']:.1f} s |")
    print(f"\ndrill took {time.time() - started:.0f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
