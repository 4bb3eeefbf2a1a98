"""Plan a run's memory before renting chips: compile the real train step on N fake CPU devices.

    python -m olmo_eqx.plan model=olmo3_7b model.compute_dtype=bfloat16 model.remat=full \\
        data.sequence_length=8192 data.global_batch_size=512 +plan.devices=128

takes the same overrides as `python -m olmo_eqx` (plus `plan.*`), builds the train step that
run would use (model, optimiser, mesh, sharding rules, micro-batches) and lowers and compiles
it for abstract inputs laid out on `plan.devices` fake CPU devices: no weight is allocated.
It prints per device:

- parameters, optimiser state and the rest of the train state (from the state's shardings);
- XLA's compiled memory analysis: arguments, outputs (aliased with the donated state),
  temporaries, and the total a device must hold;
- whether that fits named accelerators (TPU v5p 95 GiB, v6e 32 GiB, H100 80 GiB, H200 141 GiB);
- the collective traffic of one step by kind (all-gather, reduce-scatter, all-reduce, ...), read
  from the compiled HLO with loop trip counts applied;
- the model FLOPs per device per step (olmo_eqx.flops), and XLA's own count;
- whether the layout replicates the batch (rules that do not split it, or all-gathers of
  batch-sized activations in the HLO).

Options: `+plan.devices=N` (default 8), `+plan.json=PATH` (also write the figures as JSON).
The figures are XLA:CPU's: an accelerator's compiler fuses and schedules differently, so treat
them as a close estimate, and leave a few GiB of headroom for the runtime.
"""

import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

GIB = 1024**3
ACCELERATORS = (("TPU v6e", 32), ("H100", 80), ("TPU v5p", 95), ("H200", 141))
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class PlanOptions:
    devices: int = 8
    json: str = ""


def parse_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Split `+plan.key=value` options from the run's config overrides."""
    options, overrides = {}, []
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key.startswith("plan."):
            name = key[len("plan.") :]
            if name not in PlanOptions.__dataclass_fields__:
                raise SystemExit(f"unknown planner option {arg!r}; the options are +plan.devices=N and +plan.json=PATH")
            options[name] = value
        else:
            overrides.append(arg)
    try:
        return PlanOptions(devices=int(options.get("devices", 8)), json=options.get("json", "")), overrides
    except ValueError:
        raise SystemExit(f"+plan.devices must be a whole number, got {options.get('devices')!r}") from None


# ---------------------------------------------------------------------------------------------
# Reading the compiled HLO

_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) ([\w\-]+)\((.*)$")


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)]


def _nbytes(shapes) -> int:
    total = 0
    for dtype, dims in shapes:
        n = _BYTES[dtype]
        for d in dims:
            n *= d
        total += n
    return total


def _trip_count(while_attrs: str, condition: list[tuple[str, str, str]]) -> int | None:
    """Iterations of a while loop: XLA's annotation, else a scan's `counter < constant` test."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', while_attrs):
        return int(m.group(1))
    constants = [re.match(r"(-?\d+)\)", rest) for kind, shape, rest in condition if kind == "constant" and shape == "s32[]"]
    constants = [int(c.group(1)) for c in constants if c]
    # A lax.scan / static fori_loop counts from 0 up to one scalar constant.
    return constants[0] if len(constants) == 1 and len(condition) <= 4 else None


def collective_traffic(hlo: str) -> tuple[dict[str, dict], list[tuple[str, tuple[int, ...], str]], bool]:
    """Per collective kind: {count, bytes} per step, with while-loop trip counts applied.

    Bytes are those of the full tensor each op produces (all-gather, all-reduce) or consumes
    (reduce-scatter: its input): what a ring moves through every device, to a factor (n-1)/n.
    Also returns what is all-gathered, (dtype, shape, jax op name), and whether some loop's trip count was unknown
    (then the figures are lower bounds).
    """
    instructions: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # computation -> (kind, shape, rest)
    entry, current = None, None
    for line in hlo.splitlines():
        # Computation headers start in column 0; instructions are indented.
        if not line[:1].isspace() and (m := _COMPUTATION.match(line)):
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current and (m := _INSTRUCTION.match(line)):
            instructions[current].append((m.group(2), m.group(1), m.group(3)))
    # How many times each computation runs per step: walk calls from the entry.
    callees: dict[str, list[tuple[str, int]]] = defaultdict(list)
    unknown_loops: set[str] = set()
    for name, instrs in instructions.items():
        for kind, _, rest in instrs:
            if kind == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                condition = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
                trip = _trip_count(rest, instructions.get(condition, []))
                if trip is None:
                    unknown_loops.add(body)
                callees[name].append((body, trip or 1))
            else:
                for attr in ("to_apply", "calls", "true_computation", "false_computation"):
                    for callee in re.findall(rf"{attr}=%?([\w.\-]+)", rest):
                        callees[name].append((callee, 1))
                if m := re.search(r"branch_computations=\{([^}]*)\}", rest):
                    callees[name].extend((c.strip().lstrip("%"), 1) for c in m.group(1).split(","))
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, n in callees.get(name, ()):
            visit(callee, times * n)

    visit(entry, 1)

    def has_collective(name: str) -> bool:
        return any(k.removesuffix("-start") in COLLECTIVES for k, _, _ in instructions.get(name, ())) or any(
            has_collective(c) for c, _ in callees.get(name, ())
        )

    # Loops with data-dependent bounds (the blockwise attention's) hold no collectives.
    unknown_trip = any(has_collective(body) for body in unknown_loops)
    traffic = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    gathered = []
    for name, instrs in instructions.items():
        for kind, shape, rest in instrs:
            base = kind.removesuffix("-start")
            if base not in COLLECTIVES or kind.endswith("-done") or not runs.get(name):
                continue
            # reduce-scatter: count the input it reduces (the operands' shapes), else the output.
            shapes = _shapes(rest.split(")")[0]) if base == "reduce-scatter" else _shapes(shape)
            if base == "reduce-scatter" and not shapes:
                shapes = _shapes(shape)
            traffic[base]["count"] += runs[name]
            traffic[base]["bytes"] += runs[name] * _nbytes(shapes)
            if base == "all-gather":
                op = re.search(r'op_name="([^"]*)"', rest)
                gathered.extend((dtype, dims, op.group(1) if op else "?") for dtype, dims in _shapes(shape))
    return traffic, gathered, unknown_trip


# ---------------------------------------------------------------------------------------------
# The plan


def plan(overrides: list[str], devices: int) -> dict:
    """Compile the run's train step on `devices` fake CPU devices and return its figures."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from olmo_eqx.config import compose_config
    from olmo_eqx.flops import flops_per_token
    from olmo_eqx.models.olmo3 import count_params
    from olmo_eqx.sharding import ShardingRules, batch_sharding, make_mesh
    from olmo_eqx.train.schedules import make_schedule
    from olmo_eqx.train.state import TrainState, sharded_abstract_train_state
    from olmo_eqx.train.step import make_train_step

    if jax.device_count() < devices:
        raise SystemExit(
            f"the planner needs {devices} fake devices but JAX has {jax.device_count()}: run it as "
            "`python -m olmo_eqx.plan ...` in a fresh process (XLA_FLAGS is set before JAX starts)"
        )
    config = compose_config(overrides)
    model, data = config.model, config.data
    mesh = make_mesh(config.mesh, jax.devices()[:devices])
    rules = ShardingRules()
    state = sharded_abstract_train_state(model, config.optim, mesh, rules)
    batch_layout = batch_sharding(mesh, rules)
    shape = (data.global_batch_size, data.sequence_length)
    batch = {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_layout),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=batch_layout),
    }
    schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=config.trainer.micro_batches).step

    # eqx.filter_jit would treat ShapeDtypeStruct leaves as static: jit the array part instead.
    is_abstract = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    arrays, static = eqx.partition(state, is_abstract)

    def array_step(batch, arrays):
        new_state, metrics = step(batch, eqx.combine(arrays, static))
        return eqx.filter(new_state, eqx.is_array), metrics

    compiled = jax.jit(array_step, donate_argnums=1).lower(batch, arrays).compile()
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()

    def per_device_bytes(tree) -> int:
        leaves = jax.tree.leaves(tree, is_leaf=is_abstract)
        return sum(
            math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves
        )

    assert isinstance(state, TrainState)
    params = per_device_bytes(state.model)
    optimizer = per_device_bytes(state.opt_state)
    other_state = per_device_bytes(state) - params - optimizer
    arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    aliased, temporaries = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    total = arguments + outputs - aliased + temporaries

    traffic, gathered, unknown_trip = collective_traffic(hlo)
    batch_shards = 1
    for axis in rules.batch:
        batch_shards *= mesh.shape[axis]
    warnings = []
    if data.global_batch_size % batch_shards:
        warnings.append(
            f"the global batch {data.global_batch_size} is not divisible by the {batch_shards} batch shards "
            f"({' x '.join(rules.batch)}): every device computes the whole batch; choose a multiple of {batch_shards}"
        )
    elif batch_shards < devices:
        warnings.append(
            f"each sequence is computed on {devices // batch_shards} devices (the batch is split {batch_shards} ways "
            "over data x fsdp; context splits each sequence, tensor its heads and MLP)"
        )
    # Float tensors only: the embedding lookup all-gathers the int32 token ids (4 bytes a
    # token) so each device can gather its slice of d_model for them, which is cheap.
    batch_gathers = [g for g in gathered if g[0] in ("bf16", "f16", "f32") and g[1][:2] == shape]
    if batch_gathers:
        dtype, dims, op = batch_gathers[0]
        warnings.append(
            f"{len(batch_gathers)} all-gather(s) of batch-sized float tensors, e.g. {dtype}{list(dims)} "
            f"({dims[0] * dims[1] * (dims[2] if len(dims) > 2 else 1) * _BYTES[dtype] / GIB:.2f} GiB) from `{op}`: "
            "every device holds that tensor for the whole global batch"
        )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    tokens = data.global_batch_size * data.sequence_length
    return {
        "model": model.name,
        "parameters": count_params(model),
        "devices": devices,
        "mesh": dict(mesh.shape),
        "global_batch": data.global_batch_size,
        "per_device_batch": data.global_batch_size / batch_shards,
        "sequence_length": data.sequence_length,
        "micro_batches": config.trainer.micro_batches,
        "compute_dtype": model.compute_dtype,
        "param_dtype": model.param_dtype,
        "remat": model.remat,
        "attention_impl": model.attention_impl,
        "loss_chunk_size": model.loss_chunk_size,
        "bytes": {
            "parameters": params,
            "optimizer_state": optimizer,
            "other_state": other_state,
            "arguments": arguments,
            "outputs": outputs,
            "aliased": aliased,
            "temporaries": temporaries,
            "total": total,
        },
        "fits": {name: total <= gib * GIB for name, gib in ACCELERATORS},
        "collectives": traffic,
        "collectives_lower_bound": unknown_trip,
        "model_flops_per_device": flops_per_token(model, data.sequence_length) * tokens / devices,
        "xla_flops_per_device": float(cost.get("flops", 0.0)) if cost else None,
        "batch_sized_all_gathers": len(batch_gathers),
        "warnings": warnings,
    }


def format_plan(p: dict) -> str:
    b = p["bytes"]
    gib = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
    lines = [
        f"{p['model']} ({p['parameters']:,} parameters) on {p['devices']} devices, mesh {p['mesh']}",
        f"batch {p['global_batch']} x {p['sequence_length']} ({p['per_device_batch']:g} per device, "
        f"{p['micro_batches']} micro-batch(es)) | compute {p['compute_dtype']}, params {p['param_dtype']} "
        f"| remat {p['remat']} | attention {p['attention_impl']} | loss chunk {p['loss_chunk_size']}",
        "",
        "per device:",
        f"  parameters        {gib(b['parameters'])}",
        f"  optimiser state   {gib(b['optimizer_state'])}",
        f"  other state       {gib(b['other_state'])}",
        f"  arguments         {gib(b['arguments'])}   (state + batch)",
        f"  temporaries       {gib(b['temporaries'])}   (activations, gathered weights, gradients)",
        f"  outputs - aliased {gib(b['outputs'] - b['aliased'])}   (the donated state is updated in place)",
        f"  total             {gib(b['total'])}",
        "  fits: " + ", ".join(f"{name} ({g} GiB) {'yes' if p['fits'][name] else 'NO'}" for name, g in ACCELERATORS),
        "",
        "collectives per step (per device; bytes of the full tensors)" + (" (lower bound: a loop's trip count is unknown)" if p["collectives_lower_bound"] else "") + ":",
    ]
    for kind, t in p["collectives"].items():
        if t["count"]:
            lines.append(f"  {kind:<18} {t['count']:>6} ops  {t['bytes'] / GIB:10.2f} GiB")
    lines.append(f"model FLOPs per device per step: {p['model_flops_per_device']:.3e}" + (
        f" (XLA counts {p['xla_flops_per_device']:.3e}; it counts each loop body once)" if p["xla_flops_per_device"] else ""
    ))
    lines += [f"warning: {w}" for w in p["warnings"]] or ["the batch is split over every device; no batch-sized all-gathers"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    # Fake devices must be configured before JAX starts its CPU backend.
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={options.devices}".strip()
    result = plan(overrides, options.devices)
    print(format_plan(result), flush=True)
    if options.json:
        import json

        with open(options.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
