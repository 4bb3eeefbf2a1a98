"""What checkpoint verification costs: save and restore of a real train state (weights and
Adam moments) with and without the digest manifest, and the hashing alone with one thread
(as it was: one file after another), with `HASH_THREADS`, and one process's share of 2.

    python scripts/bench_checkpoint_digests.py [--model olmo3_60m] [--dir /tmp/bench_digests]

Prints one line per measurement and a projection for a state of --project-gib on
--project-hosts hosts from the measured per-core hash rate. Numbers depend on the disk and
the page cache: every file is read right after it was written, so mostly from memory.
"""

import argparse
import shutil
import time
from pathlib import Path

import jax


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo3_60m")
    parser.add_argument("--dir", default="/tmp/bench_digests")
    parser.add_argument("--project-gib", type=float, default=87.0, help="the 7B's state with Adam")
    parser.add_argument("--project-hosts", type=int, default=64)
    args = parser.parse_args()

    import olmo_eqx.checkpoint as checkpoint
    import olmo_eqx.checkpoint_digests as digests
    from olmo_eqx.models.zoo import get_model_config
    from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
    from olmo_eqx.train.optim import OptimConfig
    from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
    from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state

    config, optim = get_model_config(args.model), OptimConfig(lr=1e-3)
    mesh, rules = make_mesh(MeshConfig()), ShardingRules()
    state = init_train_state(config, optim, make_schedule(ScheduleConfig(), optim.lr, 100), mesh, rules, jax.random.key(0))
    target = sharded_abstract_train_state(config, optim, mesh, rules)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)

    def save_and_restore(name: str, manifest: bool) -> tuple[float, float]:
        write = digests.write_digests
        if not manifest:
            checkpoint.write_digests = lambda step_dir: None
        try:
            with checkpoint.Checkpointer(root / name, keep_last=None) as c:
                save_s, _ = timed(lambda: (c.save(1, state), c.wait_until_finished()))
            with checkpoint.Checkpointer(root / name, keep_last=None, read_only=True) as c:
                restore_s, _ = timed(lambda: jax.block_until_ready(c.restore(1, target=target).state))
        finally:
            checkpoint.write_digests = write
        return save_s, restore_s

    save_and_restore("warmup", True)  # compile Orbax's and TensorStore's paths once
    plain = save_and_restore("plain", False)
    sealed = save_and_restore("sealed", True)
    step_dir = root / "sealed" / "1"
    size = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    files = len(digests._files(step_dir))
    print(f"{args.model}: state {size / 2**30:.2f} GiB in {files} files, {jax.process_count()} process(es), "
          f"{digests.HASH_THREADS} hash threads")
    print(f"save:    {plain[0]:6.2f}s without manifest | {sealed[0]:6.2f}s with (hashing included)")
    print(f"restore: {plain[1]:6.2f}s without manifest | {sealed[1]:6.2f}s with (verification included)")
    threads = digests.HASH_THREADS
    digests.HASH_THREADS = 1
    serial, _ = timed(lambda: digests.verify_digests(step_dir))
    digests.HASH_THREADS = threads
    parallel, _ = timed(lambda: digests.verify_digests(step_dir))
    half, _ = timed(lambda: digests.verify_digests(step_dir, (0, 2)))
    print(f"verify:  {serial:6.2f}s one thread (before) | {parallel:6.2f}s {threads} threads | "
          f"{half:6.2f}s one process's half of 2 (after, per process)")
    rate = size / serial  # bytes/s of one core
    per_host = args.project_gib * 2**30 / args.project_hosts
    print(f"projection, {args.project_gib:.0f} GiB on {args.project_hosts} hosts at {rate / 2**30:.2f} GiB/s per core: "
          f"before: save {args.project_gib * 2**30 / rate:.0f}s on process 0, restore {args.project_gib * 2**30 / rate:.0f}s "
          f"on every host ({args.project_gib * args.project_hosts / 1024:.1f} TiB read); after: save and restore "
          f"{per_host / rate:.1f}s per host on one core, each host hashing what it wrote / its share "
          f"({args.project_gib:.0f} GiB read once), less with HASH_THREADS cores")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
