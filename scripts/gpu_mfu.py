"""MFU of a 7B-shaped slice on an accelerator: a short, prepared device check.

    python scripts/gpu_mfu.py                          # 4 layers of the 7B, seq 8192, bf16, cuDNN, remat save_projections
    python scripts/gpu_mfu.py --layers 8 --batch 2 --remat full --attention blockwise

The slice is OLMo 3 7B's block (d_model 4096, 32 heads of 128, MLP 11008, window 4096 on 3 of
4 layers) with the full padded vocabulary, float32 parameters and Adam moments, bf16 compute,
trained with the real `make_train_step` (pure FSDP over every local device) on random tokens.
It prints the compile time, each timed step, tokens/s and MFU against the device's bf16 peak
(`olmo_eqx.train.mfu`; H100/H200 989.5 TFLOP/s dense), and the loss, which must be finite and
fall a little. A few minutes at most, most of it compilation.
"""

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="sequences per device")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--remat", default="save_projections")
    parser.add_argument("--attention", default="auto")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from olmo_eqx.flops import flops_per_token
    from olmo_eqx.models.attention import resolve_implementation
    from olmo_eqx.models.zoo import get_model_config
    from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh
    from olmo_eqx.train.mfu import peak_flops_per_device
    from olmo_eqx.train.optim import OptimConfig
    from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
    from olmo_eqx.train.state import init_train_state
    from olmo_eqx.train.step import make_train_step

    config = get_model_config(
        "olmo3_7b", n_layers=args.layers, compute_dtype="bfloat16", remat=args.remat, attention_impl=args.attention,
        max_sequence_length=args.seq,
    )
    devices = jax.device_count()
    optim = OptimConfig(lr=3e-4)
    schedule = make_schedule(ScheduleConfig(name="constant"), optim.lr, 1000)
    mesh, rules = make_mesh(MeshConfig()), ShardingRules()
    batch, seq = args.batch * devices, args.seq
    print(f"{devices} x {jax.devices()[0].device_kind} | 7B slice: {args.layers} layers, batch {batch} x {seq}, bf16 compute, "
          f"remat {args.remat}, attention {args.attention} -> {resolve_implementation(args.attention, jnp.bfloat16)}", flush=True)

    state = init_train_state(config, optim, schedule, mesh, rules, jax.random.key(0))
    layout = batch_sharding(mesh, rules)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, config.vocab_size, dtype=jnp.int32)
    data = {"input_ids": jax.device_put(ids, layout), "loss_mask": jax.device_put(jnp.ones((batch, seq)), layout)}
    train_step = make_train_step(optim, schedule, mesh=mesh, rules=rules)

    started = time.perf_counter()
    state, metrics = train_step(state, data)
    first_loss = float(metrics["loss"])
    print(f"compile + first step: {time.perf_counter() - started:.1f}s, loss {first_loss:.4f}", flush=True)
    peak = peak_flops_per_device()
    model_flops = flops_per_token(config, seq) * batch * seq
    times = []
    for i in range(args.steps):
        started = time.perf_counter()
        state, metrics = train_step(state, data)
        loss = float(metrics["loss"])  # a host fetch: the step has finished
        times.append(time.perf_counter() - started)
        mfu = model_flops / times[-1] / devices / peak if peak else float("nan")
        print(f"step {i + 1}: {times[-1]:.3f}s | loss {loss:.4f} | MFU {100 * mfu:.1f}%", flush=True)
    median = sorted(times)[len(times) // 2]
    tokens_per_s = batch * seq / median
    line = f"median step {median:.3f}s | {tokens_per_s:,.0f} tokens/s | {model_flops / median / devices / 1e12:.1f} TFLOP/s per device"
    if peak:
        line += f" | MFU {100 * model_flops / median / devices / peak:.1f}% of {peak / 1e12:.1f} TFLOP/s"
    print(line)
    if not (loss == loss and loss < first_loss):
        raise SystemExit(f"loss went from {first_loss:.4f} to {loss:.4f}: not finite or not falling")


if __name__ == "__main__":
    main()
