"""Run the planned train step on the chips at hand, and read the planner's figures against it.

    python scripts/measure_step.py model=olmo3_600m model.compute_dtype=bfloat16 \\
        data.sequence_length=4096 data.global_batch_size=16 trainer.micro_batches=2 \\
        [--plan plan.json] [--steps 8] [--json measured.json] [--profile 3 [--top 30] [--op-table ops.json]]
        [--keep-hlo step.hlo.gz] [--keep-trace trace.xplane.pb.gz]

takes the overrides `python -m olmo_eqx.plan` takes, compiles the same train step with the
planner's own code (`olmo_eqx.plan.compile_train_step`) for every local device (`jax.devices()`:
a TPU, a GPU, or fake CPU devices), initialises the state in its shards, and runs that very
executable on random tokens. With `trainer.micro_batches=auto` (the default) it first takes the
fewest micro-batches that fit these devices, as a run would (against the device's
`memory_stats()["bytes_limit"]`, or `trainer.device_memory_gib`). It prints:

- the compiler's memory analysis of the program (per device), and the device's own count of
  the peak memory in use (`Device.memory_stats()`, where the platform keeps one);
- the compile time, each step's time (each ends on a host fetch of its loss), the median,
  tokens/s and MFU against the device's bf16 peak (`olmo_eqx.train.mfu`), with the model FLOPs
  the planner counts;
- with `--profile N`: N more steps traced with `jax.profiler`, and the device time of the
  traced XLA ops per step, grouped by what they are in the model (projections, attention
  kernel, loss/head, optimizer update, copies/transposes, collectives, norms/elementwise),
  then the top ops with where they come from (`olmo_eqx.train.profile`); `--op-table` writes
  every op as JSON, `--keep-hlo` the compiled step (what `scripts/read_profile.py` reads a
  kept trace against);
- with `--plan` (the planner's `+plan.json=` for the same overrides, made where no chip is, e.g.
  `+plan.target=tpu:v5e:1x1`): planned beside measured, with ratios.

A program the chip's compiler refuses for memory prints the compiler's message and exits 3,
the verdict to hold against the planner's "does not fit". The loss must be finite and fall.
"""

import argparse
import json
import sys
import time
from pathlib import Path

GIB = 1024**3


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the first (default 8)")
    parser.add_argument("--plan", default="", help="the planner's JSON (+plan.json=) for the same overrides")
    parser.add_argument("--json", default="", help="also write the measured figures here")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="then trace this many more steps (jax.profiler) and print the top XLA ops by device time, "
        "grouped by what they are in the model",
    )
    parser.add_argument("--keep-trace", default="", help="with --profile: also keep the trace's .xplane.pb, gzipped, at this path")
    parser.add_argument("--keep-hlo", default="", help="also write the compiled step's HLO text, gzipped, at this path")
    parser.add_argument("--top", type=int, default=15, help="with --profile: how many top ops to print (default 15)")
    parser.add_argument(
        "--op-table", default="",
        help="with --profile: also write every traced op (ms/step, category, origin, result type) here as JSON",
    )
    return parser.parse_known_args(argv)


def _random_batch(config, layout) -> dict:
    """Random tokens (and, under document masking, four documents a sequence) on the devices."""
    import jax
    import jax.numpy as jnp

    shape = (config.data.global_batch_size, config.data.sequence_length)
    ids = jax.random.randint(jax.random.key(1), shape, 0, config.model.vocab_size, dtype=jnp.int32)
    batch = {"input_ids": ids, "loss_mask": jnp.ones(shape, jnp.float32)}
    document = jnp.arange(shape[1]) // max(shape[1] // 4, 1)
    if config.data.document_masking:
        batch["segment_ids"] = jnp.broadcast_to(document, shape).astype(jnp.int32)
    if config.data.reset_positions_per_document:
        positions = jnp.arange(shape[1]) - document * max(shape[1] // 4, 1)
        batch["positions"] = jnp.broadcast_to(positions, shape).astype(jnp.int32)
    return {key: jax.device_put(value, layout) for key, value in batch.items()}


def measure(
    overrides: list[str], steps: int, profile_steps: int = 0, keep_trace: str = "", top: int = 15, op_table_path: str = "",
    keep_hlo: str = "",
) -> dict:
    """Compile and run the planned step on the local devices; the figures as a dict."""
    import equinox as eqx
    import jax

    from olmo_eqx.config import compose_config
    from olmo_eqx.models.flops import flops_per_token
    from olmo_eqx.models.attention import resolve_implementation
    from olmo_eqx.plan import CompileRefused, compile_train_step, memory_bytes
    from olmo_eqx.sharding import batch_sharding
    from olmo_eqx.train.mfu import peak_flops_per_device
    from olmo_eqx.train.state import init_train_state

    config = compose_config(overrides)
    devices = jax.devices()
    model, data = config.model, config.data
    kernel = resolve_implementation(model.attention_impl, jax.numpy.dtype(model.compute_dtype), devices[0].platform)
    result = {
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "jax": jax.__version__,
        "model": model.name,
        "global_batch": data.global_batch_size,
        "sequence_length": data.sequence_length,
        "micro_batches": config.trainer.micro_batches,
        "remat": model.remat,
        "remat_sliding": model.remat_sliding,
        "attention_kernel": kernel,
        "model_flops_per_device": flops_per_token(model, data.sequence_length)
        * data.global_batch_size * data.sequence_length / len(devices),
    }
    print(f"{result['device']} (jax {jax.__version__}) | {model.name}, {data.global_batch_size} x {data.sequence_length} "
          f"in {config.trainer.micro_batches} micro-batch(es), {model.compute_dtype} compute, remat {model.remat}"
          f"{f' (sliding layers {model.remat_sliding})' if model.remat_sliding else ''}, "
          f"attention {kernel}", flush=True)

    started = time.perf_counter()
    if config.trainer.micro_batches == "auto":  # each count it compiles says so
        from olmo_eqx.plan import compile as plan_compile

        plan_compile._progress = lambda line: print(line, flush=True)  # noqa: E731
    try:
        step = compile_train_step(config, devices)
    except CompileRefused as refusal:
        result.update(fits=False, refused=str(refusal), compile_seconds=time.perf_counter() - started)
        print(f"refused by this device's compiler after {result['compile_seconds']:.0f}s: {refusal}", flush=True)
        print(refusal.details, flush=True)
        return result
    result["compile_seconds"] = time.perf_counter() - started
    if step.attempts:  # trainer.micro_batches=auto, as a run on these devices would choose
        config = step.config
        result["micro_batches"] = config.trainer.micro_batches
        result["micro_batches_auto"] = [
            {"micro_batches": a.micro_batches, "fits": a.fits, "needed": a.needed, "refused": a.refused} for a in step.attempts
        ]
        tried = ", ".join(f"{a.micro_batches}: " + ("refused" if a.needed is None else f"{a.needed / GIB:.2f} GiB")
                          for a in sorted(step.attempts, key=lambda a: a.micro_batches))
        print(f"trainer.micro_batches=auto chose {config.trainer.micro_batches} ({tried}; against "
              f"{(devices[0].memory_stats() or {}).get('bytes_limit', 0) / GIB:.2f} GiB bytes_limit) in "
              f"{result['compile_seconds']:.0f}s, all compiles", flush=True)
    if keep_hlo:
        import gzip

        with gzip.open(keep_hlo, "wt") as kept:
            kept.write(step.hlo)
    result["bytes"] = memory_bytes(step.memory)
    b = result["bytes"]
    print(f"compiled in {result['compile_seconds']:.1f}s, per device: arguments {b['arguments'] / GIB:.2f} GiB, "
          f"temporaries {b['temporaries'] / GIB:.2f} GiB (what XLA:TPU holds against HBM), "
          f"arguments + outputs - aliased + temporaries {b['total'] / GIB:.2f} GiB, host {b['host'] / GIB:.2f} GiB",
          flush=True)

    state = init_train_state(model, config.optim, step.mesh, step.rules, jax.random.key(0))
    arrays = eqx.filter(state, eqx.is_array)
    del state
    batch = _random_batch(config, batch_sharding(step.mesh, step.rules))
    arrays, metrics = step.executable(batch, arrays)
    first_loss = float(metrics["loss"])
    times, losses = [], []
    for i in range(steps):
        started = time.perf_counter()
        arrays, metrics = step.executable(batch, arrays)
        losses.append(float(metrics["loss"]))  # a host fetch: the step has finished
        times.append(time.perf_counter() - started)
        print(f"step {i + 2}: {times[-1]:.3f}s | loss {losses[-1]:.4f}", flush=True)
    median = sorted(times)[len(times) // 2]
    peak = peak_flops_per_device(devices[0])
    stats = devices[0].memory_stats() or {}
    result.update(
        fits=True,
        step_seconds=times,
        median_step_seconds=median,
        tokens_per_second=data.global_batch_size * data.sequence_length / median,
        peak_flops_per_device=peak,
        mfu=result["model_flops_per_device"] / (median * peak) if peak else None,
        peak_bytes_in_use=stats.get("peak_bytes_in_use"),
        bytes_limit=stats.get("bytes_limit"),
        losses=[first_loss, *losses],
    )
    line = f"median step {median:.3f}s | {result['tokens_per_second']:,.0f} tokens/s"
    if peak:
        line += f" | MFU {100 * result['mfu']:.1f}% of {peak / 1e12:.3g} TFLOP/s"
    if result["peak_bytes_in_use"]:
        line += f" | peak in use {result['peak_bytes_in_use'] / GIB:.2f} of {(result['bytes_limit'] or 0) / GIB:.2f} GiB"
    print(line, flush=True)
    if profile_steps:
        arrays, result["profile"] = _profile(step, batch, arrays, profile_steps, keep_trace, top, op_table_path)
        print(result["profile"], flush=True)
    if not (losses[-1] == losses[-1] and losses[-1] < first_loss):
        raise SystemExit(f"loss went from {first_loss:.4f} to {losses[-1]:.4f}: not finite or not falling")
    return result


def _profile(
    step, batch, arrays, steps: int, keep_trace: str = "", top: int = 15, op_table_path: str = ""
) -> tuple[object, str]:
    """Trace `steps` more steps; the ops' device time by category and the top ops, as text."""
    import gzip
    import os
    import shutil
    import tempfile

    import jax

    from olmo_eqx.train.profile import format_op_table, leaf_op_names, op_table, traced_op_times

    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        for _ in range(steps):
            arrays, metrics = step.executable(batch, arrays)
        jax.block_until_ready((arrays, metrics))
        jax.profiler.stop_trace()
        xplanes = sorted(Path(directory).rglob("*.xplane.pb"), key=os.path.getmtime)
        if not xplanes:
            return arrays, "profile: the trace wrote no .xplane.pb"
        op_times = traced_op_times(xplanes[-1], leaf_op_names(step.hlo))
        if keep_trace:  # gzipped: a TPU trace of a few steps is tens of MB
            with open(xplanes[-1], "rb") as source, gzip.open(keep_trace, "wb") as kept:
                shutil.copyfileobj(source, kept)
    if not op_times:
        return arrays, "profile: no op events in the trace (on CPU set XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true)"
    table = op_table(op_times, step.hlo, steps)
    if op_table_path:
        Path(op_table_path).write_text(json.dumps(table, indent=1))
    return arrays, format_op_table(table, steps, top)


def compare(planned: dict, measured: dict) -> str:
    """Planned beside measured, one line a figure, with measured / planned."""
    rows = [("fits", planned.get("fits"), measured.get("fits"))]
    if measured.get("fits") and planned.get("bytes"):
        for key in ("arguments", "temporaries", "total"):
            rows.append((f"{key} GiB", planned["bytes"][key] / GIB, measured["bytes"][key] / GIB))
        if measured.get("peak_bytes_in_use"):
            rows.append(("peak in use GiB", planned["bytes"]["total"] / GIB, measured["peak_bytes_in_use"] / GIB))
    estimate = planned.get("estimate") or {}
    if measured.get("fits") and estimate:
        rows.append(("step s (roofline)", estimate.get("roofline_seconds"), measured["median_step_seconds"]))
        rows.append(("step s (XLA cost model)", estimate.get("xla_seconds"), measured["median_step_seconds"]))
        rows.append(("MFU (roofline)", estimate.get("roofline_mfu"), measured["mfu"]))
        rows.append(("MFU (XLA cost model)", estimate.get("xla_mfu"), measured["mfu"]))
    lines = [f"{'':26}{'planned':>12}{'measured':>12}{'ratio':>8}"]
    for name, plan_value, real in rows:
        if isinstance(plan_value, float) and isinstance(real, float) and plan_value:
            lines.append(f"{name:26}{plan_value:12.4g}{real:12.4g}{real / plan_value:8.3f}")
        else:
            lines.append(f"{name:26}{str(plan_value):>12}{str(real):>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    measured = measure(overrides, args.steps, args.profile, args.keep_trace, args.top, args.op_table, args.keep_hlo)
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=2))
    if args.plan:
        planned = json.loads(Path(args.plan).read_text())
        print(f"\nplanned ({planned.get('target')}) against measured ({measured['device']}):")
        print(compare(planned, measured))
    if not measured.get("fits"):
        raise SystemExit(3)


if __name__ == "__main__":
    main()
