"""The blocking part of a local-tier save: copying this host's shards of the train state from
the devices to host memory (`np.array(shard.data)` per shard, as `LocalTier.save` does); the
writes to the RAM disk then go on in Orbax's threads.

    python scripts/bench_local_save.py [--gib 2.7] [--repeats 3]

--gib: the host's share of the state (the 7B stage-1 preset on 128 v5p chips, 32 hosts:
7.3B float32 parameters and two float32 Adam moments, 88 GB / 32 = about 2.7 GB), split evenly
over the local devices in 256 MiB arrays. Needs only jax and numpy.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.7)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    devices = jax.local_devices()
    chunk = 256 << 20
    per_device = int(args.gib * (1 << 30) / len(devices))
    arrays = []
    for device in devices:
        for offset in range(0, per_device, chunk):
            size = min(chunk, per_device - offset) // 4
            arrays.append(jax.device_put(jnp.arange(size, dtype=jnp.float32), device))
    jax.block_until_ready(arrays)
    total = sum(a.nbytes for a in arrays)
    times = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        copies = [np.array(a, copy=True) for a in arrays]
        times.append(time.perf_counter() - began)
        del copies
    best = min(times)
    print(f"{len(devices)} {devices[0].device_kind} device(s), {total / 2**30:.2f} GiB in {len(arrays)} arrays: "
          f"device-to-host copy {best:.2f} s (best of {args.repeats}: {', '.join(f'{t:.2f}' for t in times)}), "
          f"{total / best / 2**30:.1f} GiB/s")


if __name__ == "__main__":
    main()
