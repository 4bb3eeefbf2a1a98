"""What checkpoint verification costs: save and restore of a real train state (weights and
Adam moments) with and without the digest manifest, before and after digests were split
between processes (issue 25, item 4).

    python scripts/bench_checkpoint_digests.py [--model olmo3_60m] [--processes 2] [--repeats 2]

--processes 1 (in this process): save and restore without and with the manifest, and the
hashing alone with one thread, with `HASH_THREADS`, and one process's share of 2.

--processes 2 (or more): a real multi-controller job (`jax.distributed` over localhost, one CPU
device per process, the state sharded over both) saves and restores the state in three modes:

    none     no manifest written, nothing verified
    before   as before item 4, emulated here: process 0 hashes every file of the step, one after
             another, in Orbax's finalising thread; on restore every process verifies every file
    after    today's code: each process hashes the files it wrote (`HASH_THREADS` threads, off
             the training thread), process 0 assembles the manifest; on restore each file is
             verified by one process and the verdicts are shared

"save" runs until the step is committed (`save` + `wait_until_finished`), "blocked" is the part
the training thread waits for (`save` alone), "restore" is a fresh reader's verified restore;
each is the slowest process's time, the best of --repeats. "verified": every restore verified
the step and its manifest lists every file of it; the MiB each process hashed are counted. The table ends with the projection for
a state of --project-gib on --project-hosts hosts from the hash rate of one core measured here.
Numbers depend on the disk and the page cache: every file is read right after it was written,
so mostly from memory.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("none", "before", "after")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def hash_rate(step_dir: Path, size: int) -> tuple[float, float, float]:
    """(wall s, CPU s, bytes per CPU second) to hash the whole step on one thread: the CPU
    time is the cost of one core's hashing whatever else the machine runs."""
    import olmo_eqx.checkpoint.digests as digests

    threads, digests.HASH_THREADS = digests.HASH_THREADS, 1
    try:
        cpu = time.process_time()
        wall, _ = timed(lambda: digests.verify_digests(step_dir))
        cpu = time.process_time() - cpu
    finally:
        digests.HASH_THREADS = threads
    return wall, cpu, size / cpu


def build_state(model: str):
    import jax

    from olmo_eqx.models.zoo import get_model_config
    from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
    from olmo_eqx.train.optim import OptimConfig
    from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state

    config, optim = get_model_config(model), OptimConfig(lr=1e-3)
    mesh, rules = make_mesh(MeshConfig()), ShardingRules()
    state = init_train_state(config, optim, mesh, rules, jax.random.key(0))
    return with_moments(state), sharded_abstract_train_state(config, optim, mesh, rules)


def with_moments(state):
    """`state` with random Adam moments: fresh ones are zeros, which the checkpoint's
    compression shrinks to almost nothing, unlike a trained state's."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    arrays = [x for x in jax.tree.leaves(state.opt_state) if isinstance(x, jax.Array) and x.ndim and jnp.issubdtype(x.dtype, jnp.floating)]

    def fill(xs):
        keys = jax.random.split(jax.random.key(1), len(xs))
        return [x + 1e-3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(xs, keys)]

    filled = jax.jit(fill, out_shardings=[x.sharding for x in arrays])(arrays)
    replaced = dict(zip(map(id, arrays), filled))
    opt_state = jax.tree.map(lambda x: replaced.get(id(x), x), state.opt_state)
    return eqx.tree_at(lambda s: s.opt_state, state, opt_state)


def step_size(step_dir: Path) -> tuple[int, int]:
    import olmo_eqx.checkpoint.digests as digests

    files = digests._files(step_dir)
    return sum(p.stat().st_size for p in files), len(files)


def projection(rate: float, gib: float, hosts: int, threads: int) -> list[str]:
    """The 7B's digest cost from `rate` (bytes/s one core hashes), before and after item 4."""
    total, per_host = gib * 2**30, gib * 2**30 / hosts
    return [
        f"projection: {gib:.0f} GiB of state on {hosts} hosts, hashing at {rate / 2**30:.2f} GiB/s per core (CPU time measured above):",
        f"  before: save  {total / rate:6.0f} s of hashing by process 0 alone before each commit",
        f"          restore {total / rate:4.0f} s on every host, {gib * hosts / 1024:.1f} TiB read from the shared filesystem",
        f"  after:  save and restore {per_host / rate:5.1f} s per host on one core ({per_host / 2**30:.2f} GiB each), "
        f"{per_host / rate / threads:.2f} s with {threads} threads; {gib:.0f} GiB read once in all",
    ]


# -- one process ------------------------------------------------------------------------------


def single(args) -> None:
    import jax

    import olmo_eqx.checkpoint as checkpoint
    import olmo_eqx.checkpoint.local_steps as local_steps  # where the Checkpointer looks these up
    import olmo_eqx.checkpoint.digests as digests

    state, target = build_state(args.model)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)

    def save_and_restore(name: str, manifest: bool) -> tuple[float, float]:
        write = digests.write_digests
        if not manifest:
            local_steps.write_digests = lambda step_dir, files=None: None
        try:
            with checkpoint.Checkpointer(root / name, keep_last=None) as c:
                save_s, _ = timed(lambda: (c.save(1, state), c.wait_until_finished()))
            with checkpoint.Checkpointer(root / name, keep_last=None, read_only=True) as c:
                restore_s, _ = timed(lambda: jax.block_until_ready(c.restore(1, target=target).state))
        finally:
            local_steps.write_digests = write
        return save_s, restore_s

    save_and_restore("warmup", True)  # compile Orbax's and TensorStore's paths once
    plain = save_and_restore("plain", False)
    sealed = save_and_restore("sealed", True)
    step_dir = root / "sealed" / "1"
    size, files = step_size(step_dir)
    print(f"{args.model}: state {size / 2**30:.2f} GiB in {files} files, 1 process, {digests.HASH_THREADS} hash threads")
    print(f"save:    {plain[0]:6.2f}s without manifest | {sealed[0]:6.2f}s with (hashing included)")
    print(f"restore: {plain[1]:6.2f}s without manifest | {sealed[1]:6.2f}s with (verification included)")
    threads = digests.HASH_THREADS
    serial, cpu, rate = hash_rate(step_dir, size)
    parallel, _ = timed(lambda: digests.verify_digests(step_dir))
    half, _ = timed(lambda: digests.verify_digests(step_dir, (0, 2)))
    print(f"verify:  {serial:6.2f}s one thread (before; {cpu:.2f}s CPU) | {parallel:6.2f}s {threads} threads | "
          f"{half:6.2f}s one process's half of 2 (after, per process)")
    print("\n".join(projection(rate, args.project_gib, args.project_hosts, threads)))
    shutil.rmtree(root, ignore_errors=True)


# -- several processes ------------------------------------------------------------------------


def emulate(mode: str):
    """Patch the Checkpointer into `mode` (see the module docstring); returns the undo."""
    import jax

    import olmo_eqx.checkpoint as checkpoint
    import olmo_eqx.checkpoint.local_steps as local_steps  # where the Checkpointer looks these up
    import olmo_eqx.checkpoint.digests as digests

    Checkpointer = checkpoint.Checkpointer
    saved = (Checkpointer._write_manifest, Checkpointer._hash_own_files, local_steps.verify_digests, digests.HASH_THREADS)

    def undo():
        Checkpointer._write_manifest, Checkpointer._hash_own_files, local_steps.verify_digests, digests.HASH_THREADS = saved

    if mode == "none":
        Checkpointer._write_manifest = lambda self: None
        Checkpointer._hash_own_files = lambda self, key: None
    elif mode == "before":
        def write_manifest_before(self):  # the code before item 4: process 0, every file, serially
            tmp_dirs = sorted(self._local.glob(f"{self._saving}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime)
            if tmp_dirs:
                digests.write_digests(tmp_dirs[-1])

        Checkpointer._write_manifest = write_manifest_before
        Checkpointer._hash_own_files = lambda self, key: None
        local_steps.verify_digests = lambda step_dir, part=(0, 1): digests.verify_digests(step_dir)  # all of it, each
        digests.HASH_THREADS = 1
    elif mode != "after":
        raise ValueError(mode)
    return undo


def worker(args) -> None:
    """One process of the multi-controller job; process 0 prints the table."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from olmo_eqx.infra.cluster import start_cluster

    start_cluster()
    from jax.experimental import multihost_utils

    import olmo_eqx.checkpoint as checkpoint
    import olmo_eqx.checkpoint.local_steps as local_steps  # where the Checkpointer looks these up
    import olmo_eqx.checkpoint.digests as digests
    from olmo_eqx.run.processes import gather

    state, target = build_state(args.model)
    root = Path(args.dir)
    me, count = jax.process_index(), jax.process_count()
    # Bytes this process hashes, saving and restoring (the split is observed, not assumed).
    hashed, phase, digest = {"save_bytes": 0, "restore_bytes": 0}, ["save_bytes"], digests._digest

    counting = threading.Lock()  # several hashing threads

    def observed(path):
        with counting:
            hashed[phase[0]] += os.path.getsize(path)
        return digest(path)

    digests._digest = observed

    def sync(name):
        multihost_utils.sync_global_devices(name)

    def once(name: str, mode: str) -> dict:
        undo = emulate(mode)
        hashed.update(save_bytes=0, restore_bytes=0)
        try:
            phase[0] = "save_bytes"
            sync(f"{name}-start")
            with checkpoint.Checkpointer(root / name, keep_last=None) as c:
                start = time.perf_counter()
                c.save(1, state)
                blocked = time.perf_counter() - start
                c.wait_until_finished()
                saved = time.perf_counter() - start
            sync(f"{name}-saved")
            # The manifest lists every file of the step (none left unverified), where there is one.
            step_dir = root / name / "1"
            listed = json.loads((step_dir / digests.DIGEST_FILE).read_text())["files"] if digests.has_digests(step_dir) else None
            complete = listed is None or set(listed) == {f.relative_to(step_dir).as_posix() for f in digests._files(step_dir)}
            phase[0] = "restore_bytes"
            with checkpoint.Checkpointer(root / name, keep_last=None, read_only=True) as c:
                restored, out = timed(lambda: jax.block_until_ready(c.restore(1, target=target).state))
                verified = 1 in c._verified
            sync(f"{name}-restored")
        finally:
            undo()
        times = gather(f"bench-{name}", {"blocked": blocked, "save": saved, "restore": restored, "verified": verified and complete, **hashed})
        return ({k: max(t[k] for t in times) for k in ("blocked", "save", "restore")}
                | {"verified": all(t["verified"] for t in times)}
                | {f"{k}_mib": [round(t[f"{k}_bytes"] / 2**20, 1) for t in times] for k in ("save", "restore")})

    once("warmup", "after")  # compile Orbax's and TensorStore's paths once
    results = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            results[mode].append(once(f"{mode}-{r}", mode))
            if me == 0:
                print(f"  {mode} #{r}: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results[mode][-1].items()}),
                      flush=True)
    sync("done")
    if me == 0:
        step_dir = root / "after-0" / "1"
        size, files = step_size(step_dir)
        threads = digests.HASH_THREADS
        serial, cpu, rate = hash_rate(step_dir, size)
        print(f"\n{args.model}: state (weights + Adam moments) {size / 2**30:.2f} GiB in {files} files, {count} processes "
              f"x 1 CPU device, {threads} hash threads; best of {args.repeats}, slowest process")
        print(f"{'mode':<8} | {'save (committed)':>16} | {'blocked':>8} | {'restore':>8} | verified | "
              f"MiB hashed per process: on save | on restore")
        print(f"{'-' * 8}-+-{'-' * 16}-+-{'-' * 8}-+-{'-' * 8}-+----------+-{'-' * 40}")
        for mode in MODES:
            best = {k: min(r[k] for r in results[mode]) for k in ("blocked", "save", "restore")}
            last = results[mode][-1]
            print(f"{mode:<8} | {best['save']:15.2f}s | {best['blocked']:7.2f}s | {best['restore']:7.2f}s | "
                  f"{'yes' if all(r['verified'] for r in results[mode]) else 'no':<8} | "
                  f"{' + '.join(map(str, last['save_mib']))} | {' + '.join(map(str, last['restore_mib']))}")
        print(f"hashing: the whole step on one thread of process 0: {serial:.2f}s, {cpu:.2f}s of CPU ({rate / 2**30:.2f} GiB per CPU second)")
        print("\n".join(projection(rate, args.project_gib, args.project_hosts, threads)))
    sync("printed")


def launch(args) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from localcluster import launch_local_cluster

    shutil.rmtree(args.dir, ignore_errors=True)
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--dir", args.dir,
               "--repeats", str(args.repeats), "--project-gib", str(args.project_gib), "--project-hosts", str(args.project_hosts)]
    processes = launch_local_cluster(command, n_processes=args.processes, devices_per_process=1, merge_stderr=True)
    outputs = [p.communicate()[0] for p in processes]
    shutil.rmtree(args.dir, ignore_errors=True)
    codes = [p.returncode for p in processes]
    print(outputs[0] if codes[0] == 0 else outputs[0][-5000:])
    for i, (code, out) in enumerate(zip(codes, outputs)):
        if code != 0:
            print(f"process {i} exited {code}:\n{out[-3000:]}", file=sys.stderr)
    return max(codes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo3_60m")
    parser.add_argument("--dir", default="/tmp/bench_digests")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode with several processes (best kept)")
    parser.add_argument("--project-gib", type=float, default=87.0, help="the 7B's state with Adam")
    parser.add_argument("--project-hosts", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.processes > 1:
        sys.exit(launch(args))
    else:
        single(args)


if __name__ == "__main__":
    main()
