"""Does splitting the batch pay? The same global batch trained on 1 and on N fake CPU devices.

    python scripts/bench_devices.py                      # 12.6M OLMo 3, batch 16 x 256, 1 vs 8 devices
    python scripts/bench_devices.py --devices 1 4 8 --steps 10 --batch 32

Each device count runs in its own process (the fake device count is fixed when JAX starts),
one after the other, on the same model, batch and train step (`make_train_step`, pure FSDP).
With the batch split, N fake devices on the same cores run about as fast as one (each does
1/N of the work); if they are several times slower, every device is computing the whole batch.
"""

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = dict(
    name="bench_12m", vocab_size=8192, padded_vocab_size=8192, d_model=256, n_layers=8, n_heads=4, n_kv_heads=4,
    head_dim=64, mlp_hidden=1024, sliding_window=128,
)


def worker(devices: int, batch: int, seq: int, steps: int) -> dict:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp

    from olmo_eqx.models.config import ModelConfig
    from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh
    from olmo_eqx.train.optim import OptimConfig
    from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
    from olmo_eqx.train.state import init_train_state
    from olmo_eqx.train.step import make_train_step

    config, optim = ModelConfig(**MODEL), OptimConfig(lr=1e-3)
    schedule = make_schedule(ScheduleConfig(name="constant"), optim.lr, 1000)
    mesh = make_mesh(MeshConfig())
    state = init_train_state(config, optim, mesh, ShardingRules(), jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size, dtype=jnp.int32)
    layout = batch_sharding(mesh)
    data = {"input_ids": jax.device_put(ids, layout), "loss_mask": jax.device_put(jnp.ones((batch, seq)), layout)}
    step = make_train_step(optim, schedule, mesh=mesh)
    started = time.perf_counter()
    state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
    times.sort()
    median = times[len(times) // 2]
    return {"devices": jax.device_count(), "median_step_s": median, "tokens_per_s": batch * seq / median,
            "first_step_s": compile_s, "loss": float(metrics["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.seq, args.steps)))
        return
    rows = []
    for n in args.devices:
        command = [sys.executable, __file__, "--worker", str(n), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['devices']} device(s): {r['tokens_per_s']:8,.0f} tokens/s (median step {r['median_step_s']:.3f}s, "
              f"first step {r['first_step_s']:.1f}s, loss {r['loss']:.4f})", flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows[1:]:
        print(f"{r['devices']} devices / {rows[0]['devices']}: {r['tokens_per_s'] / base:.2f}x the tokens/s "
              f"on the same global batch {args.batch} x {args.seq}")


if __name__ == "__main__":
    main()
