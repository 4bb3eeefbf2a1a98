"""The fault drill: break a short pretrain run of the default model on purpose, every way the
fault tables of issues 11, 25, 42 and 50 list, and print one row per fault: what happened, and
whether anything good was lost.

    python scripts/fault_drill.py [--keep DIR] [--issues 11,25,42,50data,50-outputs,50s]   # a few minutes on 2 CPU cores

Issue 42's rows serve token files from tests/rangeserver.py (a misbehaving HTTP range server)
and checkpoints from moto's S3 server, both on 127.0.0.1.

Every run is a real `python -m olmo_eqx +stage=pretrain` process on real files (one CPU
device, one shared compilation cache). When run as root, a chmod'ed directory does not stop
writes, so the unwritable checkpoint dir is then a path under a regular file; a full disk is
RLIMIT_FSIZE in the child (writes fail with EFBIG).
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

# Short runs of the default model (olmo3_tiny, 8 x 256 tokens): 20 steps, a checkpoint every 5.
BASE = ["+stage=pretrain", "trainer.steps=20", "schedule.warmup_steps=5", "trainer.log_every=5", "trainer.eval_every=0", "checkpoint.every=5", "checkpoint.keep_last=4"]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
FULL_DISK = (
    "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'olmo_eqx', *sys.argv[1:]])"
)


def command(run_dir: Path, *overrides: str, full_disk: bool = False) -> list[str]:
    launcher = ["-c", FULL_DISK] if full_disk else ["-m", "olmo_eqx"]
    return [sys.executable, *launcher, *BASE, *overrides, f"hydra.run.dir={run_dir}"]


def run(run_dir: Path, *overrides: str, full_disk: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *overrides, full_disk=full_disk), capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)


def said(result: subprocess.CompletedProcess) -> str:
    """The line the user is told: the `error:` line, else the last warning or fallback note."""
    lines = (result.stderr + result.stdout).splitlines()
    for marker in ("error: ", "is unusable", "warning: ", "Resuming from"):
        found = [line for line in lines if marker in line]
        if found:
            return found[-1][:150]
    return lines[-1][:150] if lines else ""


def steps(run_dir: Path) -> list[int]:
    checkpoints = run_dir / "checkpoints"
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.exists() else []


def hashes(run_dir: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.rglob("*")) if p.is_file() and ".hydra" not in p.parts}


def largest(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def drill(root: Path, groups: tuple[str, ...] = ("11", "25")) -> list[tuple[str, str, bool]]:
    """The rows of the issues named in `groups` (\"11\", \"25\"), after one good run they share."""
    rows = []
    good = root / "good"
    if {"11", "25", "42", "50data", "50-outputs"} & set(groups):  # issue 50's signals and secrets need no good run
        result = run(good)
        assert result.returncode == 0 and steps(good) == [5, 10, 15, 20], result.stderr[-2000:]

    def copy(name: str) -> Path:
        shutil.copytree(good, root / name, ignore=shutil.ignore_patterns("summary.json"))
        return root / name

    if "11" in groups:
        rows += drill_issue_11(root, good, copy)
    if "25" in groups:
        rows += drill_issue_25(root, good, copy)
    if "42" in groups:
        rows += drill_issue_42(root, good, copy)
    if "50data" in groups:
        rows += drill_issue_50_data(root, good, copy)
    if "50-outputs" in groups:
        rows += drill_issue_50_outputs(root, good, copy)
    if "50s" in groups:
        rows += drill_issue_50_signals_and_secrets(root)
    return rows


def drill_issue_11(root: Path, good: Path, copy) -> list[tuple[str, str, bool]]:
    """The faults of issue 11: training gone bad, damaged checkpoints, refused resumes, two
    processes on one run dir, a stale lock, storage, a junk checkpoint.load."""
    rows = []

    # Training gone bad.
    r = run(root / "lr", "optim.lr=1e30")
    s = summary(root / "lr")
    rows.append(("optim.lr=1e30", f"exit {r.returncode}, summary diverged at step {s.get('diverged', {}).get('step')}: {said(r)}",
                 r.returncode != 0 and not s.get("stage_completed") and steps(root / "lr") == []))

    data = root / "data"
    data.mkdir()
    tokens = np.random.default_rng(0).integers(0, 4096, 256 * 40).astype(np.uint16)
    tokens[256 * 3 + 11] = 5000
    tokens.tofile(data / "part0.npy")
    r = run(root / "ids", f"data.source={data}/part*.npy")
    rows.append(("token file with ids >= vocab", f"exit {r.returncode}: {said(r)}", r.returncode != 0 and "loss nan" not in r.stdout))

    # Damaged newest checkpoint: every kind falls back to step 15 and finishes.
    def damage_weights(d):
        with open(largest(d / "checkpoints" / "20" / "model"), "r+b") as f:
            f.seek(4096)
            f.write(os.urandom(4096))

    def truncate_weights(d):
        w = largest(d / "checkpoints" / "20" / "model")
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])

    def truncate_loader(d):
        p = d / "checkpoints" / "20" / "loader" / "metadata"
        p.write_text(p.read_text()[:20])

    def drop_marker(d):
        (d / "checkpoints" / "20" / "commit_success.txt").unlink()

    for name, damage in [("4 KiB of newest weights overwritten", damage_weights), ("newest commit marker deleted", drop_marker),
                         ("half of newest weights truncated", truncate_weights), ("newest loader JSON truncated", truncate_loader)]:
        d = copy(name.replace(" ", "_"))
        damage(d)
        r = run(d)
        again = run(d)  # the crash loop of a left-over step dir would show here
        aside = sorted(p.name for p in (d / "checkpoints" / "set_aside").iterdir()) if (d / "checkpoints" / "set_aside").exists() else []
        ok = r.returncode == 0 and again.returncode == 0 and 15 in steps(d) and 20 in steps(d) and len(aside) == 1
        rows.append((name, f"exit {r.returncode}, rerun exit {again.returncode}, set aside {aside}: {said(r)}", ok))

    # Refused resumes leave the run dir byte for byte.
    for override in ("model.d_model=96", "data.seed=7", "data.global_batch_size=16", "data.sequence_length=128"):
        before = hashes(good)
        r = run(good, override)
        rows.append((f"resume with {override}", f"exit {r.returncode}: {said(r)}", r.returncode != 0 and hashes(good) == before))

    # Two processes on one run dir.
    d = root / "two"
    first = subprocess.Popen(command(d, "trainer.steps=100000", "checkpoint.every=0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, **ENV})
    deadline = time.time() + 300
    while time.time() < deadline and not ((d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.5)
    second = run(d)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=300)
    records = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows.append(("two processes on one run dir", f"second: exit {second.returncode}: {said(second)}",
                 second.returncode != 0 and first.returncode == 0 and len(records) == len(set(records)) and bool(steps(d))))

    # A lock left by a dead process.
    d = copy("stale_lock")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / "run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid}))
    r = run(d, "trainer.steps=25", "checkpoint.accept_changes=[trainer.steps]")
    rows.append(("stale lock (dead pid, same host)", f"exit {r.returncode}: {said(r)}", r.returncode == 0 and 25 in steps(d)))

    # Storage.
    if os.geteuid() == 0:
        (root / "a_file").write_text("x")
        unwritable = root / "a_file" / "checkpoints"
        label = "unwritable checkpoint dir (a path under a file: running as root)"
    else:
        (root / "read_only").mkdir()
        os.chmod(root / "read_only", 0o555)
        unwritable, label = root / "read_only" / "checkpoints", "read-only checkpoint dir"
    started = time.time()
    r = run(root / "ro", f"checkpoint.dir={unwritable}")
    rows.append((label, f"exit {r.returncode} after {time.time() - started:.0f}s: {said(r)}",
                 r.returncode != 0 and "parameters" not in r.stdout))

    d = copy("full")
    shutil.rmtree(d / "checkpoints" / "20")
    r = run(d, full_disk=True)
    leftovers = [p.name for p in (d / "checkpoints").iterdir() if not p.name.isdigit()]
    again = run(d)
    rows.append(("disk full during a save (RLIMIT_FSIZE 1 MiB)",
                 f"exit {r.returncode}, leftovers {leftovers}, rerun exit {again.returncode}: {said(r)}",
                 r.returncode != 0 and not leftovers and again.returncode == 0 and steps(d)[-1] == 20))

    junk = root / "junk" / "7"
    (junk / "model").mkdir(parents=True)
    (junk / "commit_success.txt").write_text("x")
    r = subprocess.run([sys.executable, "-m", "olmo_eqx", "+stage=anneal", f"checkpoint.load={junk}", f"hydra.run.dir={root / 'junk_run'}"],
                       capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    rows.append(("junk step dir as checkpoint.load", f"exit {r.returncode}: {said(r)}", r.returncode != 0 and "Traceback" not in r.stderr))
    return rows


def drill_issue_25(root: Path, good: Path, copy) -> list[tuple[str, str, bool]]:
    """The faults of issue 25: divergence mid-run, a partial metrics line, data changed by
    content, where checkpoints live, what the summary names, late signals, foreign weights,
    two processes saving every step."""
    rows = []
    # Loss goes NaN mid-run, saving every step: the last good checkpoint (20) must survive.
    d = copy("nan_mid_run")
    r = run(d, "trainer.steps=40", "optim.lr=1e30", "checkpoint.every=1", "optim.skip_step_min_history=2")
    again = run(d, "trainer.steps=40", "trainer.stop_at=22")
    rows.append(("loss NaN mid-run, checkpoint.every=1", f"exit {r.returncode}, kept {steps(d)}, rerun: {said(again)}",
                 r.returncode != 0 and 20 in steps(d) and "last good checkpoint" in r.stderr and "checkpoints/20" in said(again)))

    d = copy("partial_line")
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "lo')
    r = run(d, "trainer.steps=25", "checkpoint.accept_changes=[trainer.steps]")
    aside = list(d.glob("metrics.jsonl.partial-*"))
    rows.append(("partial last line in metrics.jsonl", f"exit {r.returncode}, set aside {[p.name for p in aside]}",
                 r.returncode == 0 and len(aside) == 1 and (d / "loss.png").exists()))

    data = root / "swap_data"
    data.mkdir()
    rng = np.random.default_rng(1)
    for i in range(2):
        rng.integers(0, 4096, 256 * 40).astype(np.uint16).tofile(data / f"part{i}.npy")
    r0 = run(root / "swap", f"data.source={data}/part*.npy", "trainer.stop_at=5")
    a, b = (data / "part0.npy").read_bytes(), (data / "part1.npy").read_bytes()
    (data / "part0.npy").write_bytes(b), (data / "part1.npy").write_bytes(a)
    r = run(root / "swap", f"data.source={data}/part*.npy")
    rows.append(("two same-size token files swapped", f"exit {r.returncode}: {said(r)}",
                 r0.returncode == 0 and r.returncode != 0 and "part0.npy (source" in r.stderr and steps(root / "swap") == [5]))

    here, there = root / "cwd_a", root / "cwd_b"
    here.mkdir(), there.mkdir()
    first = subprocess.run(command(root / "rel", "checkpoint.dir=ckpt", "trainer.stop_at=5"), cwd=here, capture_output=True,
                           text=True, env={**os.environ, **ENV}, timeout=600)
    r = subprocess.run(command(root / "rel", "checkpoint.dir=ckpt"), cwd=there, capture_output=True, text=True,
                       env={**os.environ, **ENV}, timeout=600)
    rows.append(("relative checkpoint.dir, rerun from another dir", f"exit {r.returncode}: {said(r)}",
                 first.returncode == 0 and r.returncode != 0 and not (there / "ckpt").exists()))
    r = run(root / "rel_other", f"checkpoint.dir={here / 'ckpt'}")
    rows.append(("two run dirs, one checkpoint.dir", f"exit {r.returncode}: {said(r)}",
                 r.returncode != 0 and str(root / "rel") in said(r) and sorted(int(p.name) for p in (here / "ckpt").iterdir() if p.name.isdigit()) == [5]))

    d = copy("stop_at_below")
    r = run(d, "trainer.stop_at=10")
    named = summary(d).get("checkpoint")
    rows.append(("resume of a step-20 run with trainer.stop_at=10", f"exit {r.returncode}, summary names {named}",
                 r.returncode == 0 and named is not None and Path(named).is_dir()))

    d = copy("late_signal")
    late = subprocess.Popen(command(d, "trainer.steps=22"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV})
    for line in late.stdout:
        if line.startswith("done"):
            late.send_signal(signal.SIGTERM)
            break
    late.communicate(timeout=300)
    rows.append(("SIGTERM after \"done\"", f"exit {late.returncode}", late.returncode == 0 and summary(d).get("stage_completed")))

    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes((2**60).to_bytes(8, "little") + b"{}")
    r = subprocess.run([sys.executable, "-m", "olmo_eqx", "+stage=eval", f"checkpoint.load={llama}",
                        f"hydra.run.dir={root / 'llama_eval'}"], capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    rows.append(("eval of a HF dir of another architecture", f"exit {r.returncode}: {said(r)}",
                 r.returncode != 0 and "Traceback" not in r.stderr and not (root / "llama_eval").exists()))

    # Evaluations of a run still training, saving every step with keep_last=1: each reads the
    # step it pinned (or the newest, saying so), never a step retention removed under it.
    d = root / "live"
    writer = subprocess.Popen(command(d, "trainer.steps=100000", "checkpoint.every=1", "checkpoint.keep_last=1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ENV})
    deadline = time.time() + 300
    while time.time() < deadline and len(steps(d)) < 1:
        time.sleep(0.5)
    evals = [subprocess.run([sys.executable, "-m", "olmo_eqx", "+stage=eval", f"checkpoint.load={d}", "stage.tasks=[]",
                             "stage.heldout_batches=1", f"hydra.run.dir={root / f'live_eval{i}'}"],
                            capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600) for i in range(3)]
    saved = steps(d)
    writer.send_signal(signal.SIGTERM)
    writer.communicate(timeout=300)
    read = [json.loads((root / f"live_eval{i}" / "eval.json").read_text())["step"] if r.returncode == 0 else None
            for i, r in enumerate(evals)]
    fell_back = sum("was removed" in r.stderr for r in evals)
    rows.append(("3 evals of a run saving every step (keep_last=1)",
                 f"exits {[r.returncode for r in evals]}, read steps {read} while it saved up to {saved[-1] if saved else None}, "
                 f"{fell_back} fell back: {said(evals[-1])}",
                 all(r.returncode == 0 for r in evals) and writer.returncode == 0 and len(saved) >= 1))

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from localcluster import launch_local_cluster

    d = root / "two_processes"
    procs = launch_local_cluster(command(d, "trainer.stop_at=8", "checkpoint.every=1", "checkpoint.keep_last=1"),
                                 merge_stderr=True)
    codes = [(p.communicate(timeout=600), p.returncode)[1] for p in procs]
    rows.append(("2 processes, checkpoint.every=1 keep_last=1", f"exits {codes}, kept {steps(d)}",
                 codes == [0, 0] and 8 in steps(d)))
    return rows


def drill_issue_42(root: Path, good: Path, copy) -> list[tuple[str, str, bool]]:
    """The faults of issue 42: misbehaving range servers, a rewritten file, a trickle and
    SIGTERM, two run dirs on one s3:// prefix, full and unwritable run dirs, a manifest listing
    a file twice, config changes at resume, settings out of range, a runaway loss."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from rangeserver import RangeServer

    rows = []
    r = run(root / "neg_lr", "optim.lr=-1")
    rows.append(("optim.lr=-1", f"exit {r.returncode}: {said(r)}", r.returncode == 2 and "optim.lr=-1.0 must be > 0" in r.stderr))

    d = copy("resume_changed")
    before = hashes(d)
    r = run(d, "optim.lr=3e-2", "trainer.steps=100")
    rows.append(("resume with optim.lr x10 and trainer.steps 20 -> 100", f"exit {r.returncode}: {said(r)}",
                 r.returncode == 2 and "checkpoint.accept_changes=[optim.lr,trainer.steps]" in r.stderr and hashes(d) == before))

    # A loss that runs away: every loss is above ln(vocab) - 6, so the rule fires after 3 steps;
    # no step after 15 is healthy (step 21 is measured on step 20's weights), so the stop names
    # 15 as the last good checkpoint and sets the later saves aside.
    d = copy("runaway")
    r = run(d, "trainer.steps=30", "checkpoint.every=1", "checkpoint.accept_changes=[trainer.steps]",
            "trainer.runaway_loss_margin=-6")
    rows.append(("finite loss running away (runaway_loss_margin=-6)", f"exit {r.returncode}, kept {steps(d)}: {said(r)}",
                 r.returncode == 2 and "the loss ran away" in r.stderr and steps(d) == [15]
                 and "the last good checkpoint is" in r.stderr))

    # Token files over HTTP from a server that misbehaves.
    served = root / "served"
    rng = np.random.default_rng(42)
    served.mkdir()
    for i in range(2):
        rng.integers(0, 4096, 256 * 40).astype(np.uint16).tofile(served / f"part{i}.npy")
    (root / "mix.txt").write_text("train,part0.npy\ntrain,part1.npy\n")
    (root / "twice.txt").write_text("train,part0.npy\ntrain,part1.npy\ntrain,part0.npy\n")
    server = RangeServer(served)
    data = [f"data.source={root / 'mix.txt'}", f"data.data_root={server.url}", "data.tokenizer=x",
            "data.remote_attempts=2", "data.remote_backoff_s=0.01"]
    try:
        r = run(root / "twice", f"data.source={root / 'twice.txt'}", *data[1:])
        rows.append(("mix manifest listing a file twice", f"exit {r.returncode}: {said(r)}",
                     r.returncode == 2 and "is already listed on line 1" in r.stderr))
        for fault, setting in (("a server answering another range", ("wrong_range", True)),
                               ("a 206 with more bytes than asked", ("extra_bytes", 3))):
            setattr(server, *setting)
            r = run(root / setting[0], *data)
            setattr(server, setting[0], type(setting[1])())
            rows.append((fault, f"exit {r.returncode}: {said(r)}",
                         r.returncode == 2 and server.url in said(r) and "does not serve byte ranges" in r.stderr))

        # The same-size rewrite and the trickle start once the run has trained 8 steps.
        def when_trained(run_dir: Path, steps_done: int, action, *overrides) -> tuple[subprocess.Popen, float, str]:
            process = subprocess.Popen(command(run_dir, *data, "trainer.log_every=1", *overrides), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
            for line in process.stdout:
                if line.startswith(f"step {steps_done:>6}/"):
                    action(process)
                    break
            acted = time.time()
            output = process.communicate(timeout=600)[0]
            return process, time.time() - acted, output

        part = served / "part1.npy"
        original = part.read_bytes()

        def rewrite(_process):
            stamp = part.stat().st_mtime_ns
            part.write_bytes(original[512:] + original[:512])
            os.utime(part, ns=(stamp + 10**9, stamp + 10**9))

        d = root / "rewritten"
        process, _, output = when_trained(d, 8, rewrite)
        part.write_bytes(original)
        rows.append(("token file rewritten mid-run at the same size", f"exit {process.returncode}, kept {steps(d)}: "
                     f"{[line for line in output.splitlines() if 'error' in line][-1:]}",
                     process.returncode == 2 and "changed on the server during the run" in output and steps(d)[-1] <= 10))

        def trickle_then_term(process):
            server.trickle_s = 2.0
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)

        d = root / "trickle"
        process, took, output = when_trained(d, 8, trickle_then_term)
        server.trickle_s = 0.0
        again = run(d, *data)
        rows.append(("server trickling 1 byte / 2 s, then SIGTERM", f"exit {process.returncode} {took:.0f}s after the signal, "
                     f"kept {steps(d)}, rerun exit {again.returncode}: {said(again)}",
                     process.returncode == 0 and took < 30 and again.returncode == 0 and steps(d)[-1] == 20))
    finally:
        server.stop()

    # Two run dirs on one s3:// prefix (moto's S3 server).
    import boto3
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    s3_env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "drill", "AWS_SECRET_ACCESS_KEY": "drill",
              "AWS_DEFAULT_REGION": "us-east-1", "OLMO_EQX_CHECKPOINT_STAGING": str(root / "staging")}
    ENV.update(s3_env)
    os.environ.update({k: v for k, v in s3_env.items() if k.startswith("AWS_")})
    try:
        boto3.client("s3").create_bucket(Bucket="drill")
        first = run(root / "s3_a", "checkpoint.dir=s3://drill/ckpt", "trainer.stop_at=5")
        second = run(root / "s3_b", "checkpoint.dir=s3://drill/ckpt")
        rows.append(("two run dirs on one s3:// prefix", f"exit {second.returncode}: {said(second)}",
                     first.returncode == 0 and second.returncode == 2 and str(root / "s3_a") in said(second)))
    finally:
        for key in s3_env:
            ENV.pop(key, None)
        moto.stop()

    # Full and unwritable run dirs.
    d = copy("metrics_full")
    kept = (d / "metrics.jsonl").read_bytes()
    limit = 64 << 20
    (d / "metrics.jsonl").write_bytes(kept + b'{"pad": "' + b"x" * (limit - len(kept) - 200) + b'"}\n')
    r = subprocess.run([sys.executable, "-c", FULL_DISK.replace("1 << 20", str(limit)), *BASE, "trainer.steps=25",
                        "checkpoint.accept_changes=[trainer.steps]", f"hydra.run.dir={d}"],
                       capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    (d / "metrics.jsonl").write_bytes(kept)
    again = run(d, "trainer.steps=25", "checkpoint.accept_changes=[trainer.steps]")
    rows.append(("metrics.jsonl on a full disk", f"exit {r.returncode}, rerun exit {again.returncode}: {said(r)}",
                 r.returncode == 2 and "metrics.jsonl" in said(r) and again.returncode == 0 and 25 in steps(d)))

    d = copy("save_full")
    r = run(d, "trainer.steps=40", "checkpoint.accept_changes=[trainer.steps]", "trainer.log_every=1", full_disk=True)
    trained = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    rows.append(("disk full during a mid-run save (step 25 of 40)", f"exit {r.returncode}, last step {max(trained)}: {said(r)}",
                 r.returncode == 2 and "saving checkpoint step 25" in r.stderr and max(trained) < 30 and steps(d)[-1] == 20))

    (root / "a_file").write_text("x")
    r = run(root / "a_file" / "run")
    rows.append(("run dir that cannot be made (under a file)", f"exit {r.returncode}: {said(r)}",
                 r.returncode == 2 and "Traceback" not in r.stderr))
    return rows


def drill_issue_50_data(root: Path, good: Path, copy) -> list[tuple[str, str, bool]]:
    """Issue 50's "data is what was meant" rows (1-8, and a directory as data.source): each a clean
    one-line refusal (exit 2) that trains nothing, or for a file truncated mid-run, one line
    instead of a bus error, with the run's lock released."""
    rows = []
    data = root / "data50"
    (data / "tok").mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 4096, 256 * 400)
    tokens.astype(np.uint16).tofile(data / "tok" / "part0.npy")
    tokens[: 256 * 40].astype(np.uint16).tofile(data / "heldout.npy")

    def refused(name: str, expect: str, *overrides: str, run_dir: Optional[Path] = None, cmd: Optional[list[str]] = None) -> None:
        d = run_dir or root / re.sub(r"[^A-Za-z0-9]+", "_", name)[:60]
        r = (subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600) if cmd
             else run(d, *overrides))
        lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
        rows.append((name, f"exit {r.returncode}: {said(r)}",
                     r.returncode == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in r.stderr
                     and steps(d) == []))

    (data / "tok" / "loop").symlink_to("..")
    refused("glob through a symlink loop", "are the same file", f"data.source={data}/tok/**/*.npy")
    (data / "tok" / "loop").unlink()
    (data / "tok" / "alias.npy").symlink_to("part0.npy")
    (data / "twice.txt").write_text("a,{TOKENIZER}/part0.npy\nb,{TOKENIZER}/alias.npy\n")
    refused("manifest lists a file and a link to it", "is already listed on line 1 (the same file", f"data.source={data}/twice.txt", f"data.data_root={data}", "data.tokenizer=tok")
    (data / "outside.txt").write_text("a,../heldout.npy\n")
    refused("manifest line ../x.npy", "data.allow_outside_root=true", f"data.source={data}/outside.txt", f"data.data_root={data}/tok", "data.tokenizer=tok")
    tokens.astype(np.uint32).tofile(data / "wide.npy")
    refused("uint32 file for a uint16 vocab", "data.token_dtype=uint32", f"data.source={data}/wide.npy")
    refused("held-out file is a training file", "which is the training file", f"data.source={data}/tok/part0.npy", f"+data.heldout.val={data}/tok/alias.npy")
    refused("eos_token_id=99999 with document masking", "data.eos_token_id=99999 is outside", "data.document_masking=true", "data.eos_token_id=99999")
    refused("eos_token_id=-1 with document masking", "data.eos_token_id=-1 is outside", "data.document_masking=true", "data.eos_token_id=-1")
    refused("sequence_length above max_sequence_length", "max_sequence_length=1024", "data.sequence_length=2048")
    refused("generate: prompt + new tokens past max_sequence_length", "prompt 1 is 1 tokens", run_dir=root / "generate50",
            cmd=[sys.executable, "-m", "olmo_eqx", "+stage=generate", f"checkpoint.load={good}", "stage.prompts=[def]",
                 "stage.max_new_tokens=1024", f"hydra.run.dir={root / 'generate50'}"])
    refused("data.source= a directory", "is a directory", f"data.source={data}/tok")

    # A local token file truncated under a running job.
    d = root / "truncated50"
    shutil.copy(data / "tok" / "part0.npy", data / "shrinks.npy")
    job = subprocess.Popen(command(d, f"data.source={data}/shrinks.npy", "trainer.steps=100000", "checkpoint.every=0"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
    deadline = time.time() + 300
    while time.time() < deadline and not ((d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.5)
    os.truncate(data / "shrinks.npy", 256 * 2 * 3)
    output, _ = job.communicate(timeout=300)
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    rows.append(("local token file truncated mid-run", f"exit {job.returncode}: {(lines or [output[-150:]])[-1][:150]}",
                 job.returncode == 2 and len(lines) == 1 and "Traceback" not in output and not (d / "run.lock").exists()))
    return rows


def drill_issue_50_outputs(root: Path, good: Path, copy) -> list[tuple[str, str, bool]]:
    """Issue 50's "outputs never destroy" and "imports are checked" rows (10-14) and the refused
    runs' extras: soup weights, HF weights and config.json, export targets, a refused resume's
    .hydra/, a run dir name too long, a config file with a !!python tag."""
    rows = []

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "olmo_eqx", *args], capture_output=True, text=True,
                              env={**os.environ, **ENV}, timeout=600)

    def contents(d: Path) -> dict:  # .hydra/ included: a refused run must leave it too
        return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != "olmo_eqx.log"}

    def one_line(r: subprocess.CompletedProcess) -> bool:
        return r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1

    # Row 10: soup weights.
    for i, weights in enumerate(("[inf,1.0]", "[1e308,1e308]")):
        d = root / f"soup_{i}"
        r = cli("+stage=soup", f"stage.checkpoints=[{good},{good}]", f"stage.weights={weights}", f"hydra.run.dir={d}")
        rows.append((f"soup stage.weights={weights}", f"exit {r.returncode}: {said(r)}", one_line(r) and not d.exists()))

    # Rows 13-14: export into a non-empty directory, and into the training run's own directory.
    hf = root / "hf"
    r = cli("+stage=export", f"checkpoint.load={good}", f"hydra.run.dir={hf}")
    assert r.returncode == 0, r.stderr[-2000:]
    mine = root / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}\n')
    (mine / "model-00002-of-00002.safetensors").write_bytes(b"mine")
    before = contents(mine)
    r = cli("+stage=export", f"checkpoint.load={good}", f"hydra.run.dir={mine}")
    rows.append(("export into a non-empty directory", f"exit {r.returncode}: {said(r)}",
                 one_line(r) and contents(mine) == before))
    d = copy("export_into_run")
    before = contents(d)
    r = cli("+stage=export", f"checkpoint.load={d}", f"hydra.run.dir={d}", "stage.overwrite=true")
    rows.append(("export into the training run's own directory", f"exit {r.returncode}: {said(r)}",
                 one_line(r) and contents(d) == before))

    # Rows 11-12: HF weights with a nan, config.json with a string size or zero heads.
    from safetensors.numpy import load_file, save_file

    nan = root / "hf_nan"
    shutil.copytree(hf, nan)
    tensors = load_file(str(nan / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(nan / "model.safetensors"), metadata={"format": "pt"})
    for stage in ("generate", "eval"):
        r = cli(f"+stage={stage}", f"checkpoint.load={nan}", f"hydra.run.dir={root / ('nan_' + stage)}")
        rows.append((f"HF weights with a nan ({stage})", f"exit {r.returncode}: {said(r)}",
                     one_line(r) and "up_proj" in r.stderr and not (root / ("nan_" + stage)).exists()))
    for field, value in (("num_hidden_layers", "four"), ("num_attention_heads", 0)):
        bad = root / f"hf_{field}"
        shutil.copytree(hf, bad)
        config = json.loads((bad / "config.json").read_text())
        config[field] = value
        (bad / "config.json").write_text(json.dumps(config))
        r = cli("+stage=eval", f"checkpoint.load={bad}", f"hydra.run.dir={root / ('eval_' + field)}")
        rows.append((f"HF config.json {field}={json.dumps(value)}", f"exit {r.returncode}: {said(r)}",
                     one_line(r) and f'"{field}"' in r.stderr))

    # A refused resume leaves the run's .hydra/ (its overrides.yaml) as it was.
    d = copy("refused_resume")
    before = contents(d)
    r = run(d, "model.d_model=96")
    rows.append(("refused resume: .hydra/overrides.yaml", f"exit {r.returncode}: {said(r)}",
                 r.returncode == 2 and contents(d) == before))

    # A 300-character run dir name; a config file with a !!python tag.
    r = run(root / "long" / ("a" * 300))
    rows.append(("300-character run dir name", f"exit {r.returncode}: {said(r)}", one_line(r) and not (root / "long").exists()))
    conf = root / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "evil.yaml").write_text('name: evil\nd_model: !!python/object/apply:os.system ["touch pwned"]\n')
    # Hydra's options come before the overrides.
    r = subprocess.run([sys.executable, "-m", "olmo_eqx", f"--config-dir={root / 'conf'}", *BASE, "model=evil",
                        f"hydra.run.dir={root / 'evil'}"], capture_output=True, text=True, env={**os.environ, **ENV},
                       timeout=600, cwd=root)
    rows.append(("config file with a !!python tag", f"exit {r.returncode}: {said(r)}",
                 one_line(r) and not (root / "pwned").exists() and not (root / "evil").exists()))
    return rows


def drill_issue_50_signals_and_secrets(root: Path) -> list[tuple[str, str, bool]]:
    """Issue 50's signals and secrets, and a new user's snags: a secret read from the
    environment, a password in a data URL, a stage given without its +."""
    rows = []
    secret = "s3cr3t-Ab9Zk2Lq"
    os.environ["OLMO_EQX_DRILL_SECRET"] = secret  # the child inherits it, as from a user's shell
    try:
        r = run(root / "secret", "trainer.steps=5", "schedule.warmup_steps=1",
                f"checkpoint.dir={root}/checkpoints-${{oc.env:OLMO_EQX_DRILL_SECRET}}")
    finally:
        del os.environ["OLMO_EQX_DRILL_SECRET"]
    # The run dir, and each checkpoint's config (Orbax's own files name the directory they are in).
    written = [p for p in (root / "secret").rglob("*") if p.is_file()]
    written += [p for p in (root / f"checkpoints-{secret}").glob("*/config/*") if p.name != "commit_success.txt"]
    leaked = [str(p) for p in written if secret.encode() in p.read_bytes()]
    rows.append(("${oc.env:SECRET} in an override", f"exit {r.returncode}, written in the clear in {leaked or 'no file'}: {said(r)}",
                 r.returncode == 0 and secret not in r.stdout + r.stderr and not leaked))

    r = run(root / "password", "data.source=http://alice:hunter22@127.0.0.1:9/tokens.npy")
    rows.append(("http://user:pass@host/... as data.source", f"exit {r.returncode}: {said(r)}",
                 r.returncode == 2 and "hunter22" not in r.stdout + r.stderr and "unreachable" not in r.stderr
                 and not (root / "password").exists()))

    r = subprocess.run([sys.executable, "-m", "olmo_eqx", "stage=pretrain", f"hydra.run.dir={root / 'plus'}"],
                       capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600)
    rows.append(("stage=pretrain without the +", f"exit {r.returncode}: {said(r)}",
                 r.returncode == 2 and "did you mean +stage=pretrain?" in r.stderr and not (root / "plus").exists()))

    quiet = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    r = subprocess.run([sys.executable, "-c", "import jax, olmo_eqx; print(jax.devices()[0].platform)"],
                       capture_output=True, text=True, env=quiet, timeout=600)
    rows.append(("import jax, olmo_eqx (libtpu installed, no TPU)", f"exit {r.returncode}, on {r.stdout.strip()}, "
                 f"{len(r.stderr.splitlines())} lines on stderr", r.returncode == 0 and r.stderr == ""))

    def signalled(name: str, marker: str, signals: tuple[int, ...], *overrides: str) -> tuple[int, str, float]:
        """(exit status, output, seconds from the first signal to the end) of a run sent `signals`
        0.3 s after it prints `marker`, 0.1 s apart."""
        process = subprocess.Popen(command(root / name, "trainer.steps=100000", "trainer.log_every=1", *overrides),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
        lines = []
        for line in process.stdout:
            lines.append(line)
            if marker in line:
                break
        time.sleep(0.3)
        sent = time.perf_counter()
        for s in signals:  # 0.1 s apart: two signals before Python's handler runs count as one
            process.send_signal(s)
            time.sleep(0.1)
        rest, _ = process.communicate(timeout=600)
        return process.returncode, "".join(lines) + rest, time.perf_counter() - sent

    for micro, marker in (("auto", "trainer.micro_batches=auto: the train step"), ("1", "compiling the train step")):
        code, output, took = signalled(f"compile_{micro}", marker, (signal.SIGTERM,), f"trainer.micro_batches={micro}")
        line = next((x for x in output.splitlines() if "SIGTERM" in x), output.splitlines()[-1])
        rows.append((f"SIGTERM during the first compile (micro_batches={micro})", f"exit {code} {took:.1f}s after: {line[:100]}",
                     code == 128 + signal.SIGTERM and took < 10 and "Traceback" not in output))
    code, output, took = signalled("ctrl_c", "step      2/", (signal.SIGINT, signal.SIGINT))
    # Exit 130 at the second; or, where the stop was saved before it came (a tiny model saves in
    # a fraction of a second), the first's clean stop: never a traceback.
    line = next((x for x in output.splitlines() if "SIGINT again" in x or "stopped at step" in x), output.splitlines()[-1])
    rows.append(("two Ctrl-C mid-run", f"exit {code} {took:.1f}s after: {line[:100]}",
                 code in (0, 128 + signal.SIGINT) and took < 10 and "Traceback" not in output))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="run the drill in this directory and keep it (default: a temporary one)")
    parser.add_argument("--issues", default="11,25,42,50data,50-outputs,50s",
                        help="whose rows to run: any of 11, 25, 42, 50data, 50-outputs, 50s (issue 50's signals and secrets) (default: all)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="fault_drill_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    ENV["JAX_COMPILATION_CACHE_DIR"] = str(root / "jax_cache")
    started = time.time()
    try:
        rows = drill(root, tuple(args.issues.split(",")))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    width = max(len(f) for f, _, _ in rows)
    print(f"{'fault':<{width}} | what happened | nothing lost")
    print(f"{'-' * width}-+---------------+-------------")
    for fault, what, ok in rows:
        print(f"{fault:<{width}} | {what} | {'yes' if ok else 'NO'}")
    print(f"\n{len(rows)} faults in {time.time() - started:.0f}s; {sum(ok for *_, ok in rows)} lost nothing")
    sys.exit(0 if all(ok for *_, ok in rows) else 1)


if __name__ == "__main__":
    main()
