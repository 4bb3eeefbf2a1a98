"""Plan a run before renting chips: compile the real train step for the target's chips.

    python -m olmo_eqx.plan model=olmo3_7b model.compute_dtype=bfloat16 model.remat=full \\
        data.sequence_length=8192 data.global_batch_size=512 +plan.target=tpu:v5p:4x4x8

takes the same overrides as `python -m olmo_eqx` (plus `plan.*`), builds the train step that
run would use (model, optimiser, mesh, sharding rules, micro-batches, attention kernel) and
lowers and compiles it for abstract inputs laid out on the target's devices: no weight is
allocated and no chip is needed.

- `+plan.target=tpu:v5p:4x4x8` (v5e, v6e, tpu7x; `:N` after the topology for N slices)
  compiles with XLA:TPU (libtpu: `pip install -e '.[tpu]'`); `gpu:h100:8` / `gpu:h200:16`
  with XLA:GPU (`pip install -e '.[gpu]'`: JAX's CUDA plugin compiles for a described GPU
  without one); `cpu:N` (the default, `cpu:8`; `+plan.devices=N` says the same) on N fake
  CPU devices. Only the target's own compiler gives its figures: XLA:CPU's were about 3x
  XLA:TPU's for the 7B.
- It prints per device: parameters, optimiser state, XLA's memory analysis (arguments,
  temporaries, host memory of offloaded activations) against the chip's HBM, or the
  compiler's own refusal and by how much it is over; the collective traffic of one step by
  kind, from the compiled HLO with loop trip counts applied; the model FLOPs; the kernel
  `attention_impl=auto` resolved to *for the target*.
- With an accelerator target, an **estimate** of the step time and MFU (`+plan.estimate=false`
  skips it): XLA's cost analysis counts a loop's body once, so the step's FLOPs, HBM bytes and
  the compiler's own time (`optimal_seconds`) come from two more compiles, of the model with
  one and two attention cycles unrolled (one cycle = the difference), extrapolated to all
  cycles and micro-batches; attention run by a kernel XLA cannot see into (splash, cuDNN) is
  added from the model's FLOPs formula. Two estimates: the compiler's, and a roofline (the
  slowest of FLOPs at peak, HBM bytes at HBM bandwidth, collective bytes at interconnect
  bandwidth; the chip's published peaks). Neither is a measurement.
- `+plan.search=true` tries layouts (remat policies, micro-batches, attention blocks) and
  names the fastest that fits; `+plan.max_layouts=N` bounds it (default 8).

Options: `+plan.json=PATH` also writes the figures as JSON, `+plan.hlo=PATH` the compiled
HLO text (the target compiler's program, to read what it gathers, fuses and schedules).
"""

import dataclasses
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

from .targets import Chip, Target, gpu_devices, parse_target, tpu_devices

GIB = 1024**3
# What fits where, for XLA:CPU plans (an accelerator target compares with its own chip).
ACCELERATORS = (("TPU v6e", 32), ("H100", 80), ("TPU v5p", 95), ("H200", 141))
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Published MFU figures (MaxText's OLMo 3 reproduction), shown beside the estimates of a plan of
# the same model only: (model name, figure).
PUBLISHED_MFU: tuple[tuple[str, str], ...] = (
    ("olmo3_7b", "MaxText's OLMo 3 7B reproduction 57.4% on v5p (stage 2), 44-50% on TPU7x (stage 1)"),
)

# Where compile_train_step says what it compiles and how long it took (main() prints it; a
# plan from Python stays quiet).
_progress: Optional[Callable[[str], None]] = None
_compiles = 0


@dataclass(frozen=True)
class PlanOptions:
    target: str = "cpu:8"
    json: str = ""
    hlo: str = ""
    estimate: Optional[bool] = None  # None: for accelerator targets
    search: bool = False
    max_layouts: int = 8


def _bool(name: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise SystemExit(f"+plan.{name} must be true or false, got {value!r}")


def parse_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Split `+plan.key=value` options from the run's config overrides."""
    options, overrides = {}, []
    names = ("target", "devices", "json", "hlo", "estimate", "search", "max_layouts")
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key.startswith("plan."):
            name = key[len("plan.") :]
            if name not in names:
                raise SystemExit(f"unknown planner option {arg!r}; the options are " + ", ".join(f"+plan.{n}" for n in names))
            options[name] = value
        else:
            overrides.append(arg)
    if "devices" in options:
        if "target" in options:
            raise SystemExit("give +plan.target or +plan.devices (= +plan.target=cpu:N), not both")
        if not options["devices"].isdigit():
            raise SystemExit(f"+plan.devices must be a whole number, got {options['devices']!r}")
        options["target"] = f"cpu:{options.pop('devices')}"
    if not options.get("max_layouts", "8").isdigit():
        raise SystemExit(f"+plan.max_layouts must be a whole number, got {options['max_layouts']!r}")
    return PlanOptions(
        target=options.get("target", "cpu:8"),
        json=options.get("json", ""),
        hlo=options.get("hlo", ""),
        estimate=_bool("estimate", options["estimate"]) if "estimate" in options else None,
        search=_bool("search", options.get("search", "false")),
        max_layouts=int(options.get("max_layouts", 8)),
    ), overrides


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
    # Shapes carry a layout on accelerators (s32[]{:T(128)} on TPU).
    constants = [
        re.match(r"(-?\d+)\)", rest) for kind, shape, rest in condition if kind == "constant" and shape.split("{")[0] == "s32[]"
    ]
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
# Compiling the train step for a target


class CompileRefused(Exception):
    """The target's compiler refused the program (XLA:TPU: it does not fit in HBM).

    `str()` is the compiler's verdict in a line; `details` its whole message (XLA:TPU lists
    the program's largest allocations there)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


@dataclass
class CompiledStep:
    memory: object  # CompiledMemoryStats
    cost: dict
    hlo: str
    state: object  # the abstract, sharded TrainState
    mesh: object
    rules: object
    # The executable itself: `executable(batch, arrays)` runs it where the devices are real
    # (scripts/measure_step.py), `arrays` being the state's arrays (`eqx.filter(state, eqx.is_array)`).
    executable: object = None


def target_devices(target: Target) -> list:
    """The devices a plan compiles for: fake CPU devices, or a TPU/GPU target's abstract ones."""
    import jax

    if target.platform == "tpu":
        return tpu_devices(target)
    if target.platform == "gpu":
        return gpu_devices(target)
    if jax.device_count() < target.n_devices:
        raise SystemExit(
            f"the planner needs {target.n_devices} fake devices but JAX has {jax.device_count()}: run it as "
            "`python -m olmo_eqx.plan ...` in a fresh process (XLA_FLAGS is set before JAX starts)"
        )
    return jax.devices()[: target.n_devices]


def _cost_analysis(compiled) -> dict:
    import jax

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if not cost:
        # XLA:GPU's executables answer UNIMPLEMENTED; XLA's HLO cost analysis of the same
        # optimised module, run by the CPU client, counts its FLOPs and bytes (no time).
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {key: float(value) for key, value in (cost or {}).items() if "{" not in key}


def _refusal(error: Exception) -> Optional[str]:
    """The compiler's own out-of-memory message, in a line or two, or None for other errors."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if "RESOURCE_EXHAUSTED" in line or "Ran out of memory" in line or "Exceeded" in line]
    return " ".join(keep or lines[:1])[:600]


def compile_train_step(config, devices) -> CompiledStep:
    """Lower and compile `config`'s train step for abstract inputs on `devices` (nothing allocated)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from .sharding import ShardingRules, batch_sharding, make_mesh
    from .train.schedules import make_schedule
    from .train.state import sharded_abstract_train_state
    from .train.step import make_train_step

    mesh = make_mesh(config.mesh, devices)
    rules = ShardingRules()
    state = sharded_abstract_train_state(config.model, config.optim, mesh, rules)
    layout = batch_sharding(mesh, rules)
    shape = (config.data.global_batch_size, config.data.sequence_length)
    batch = {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout),
    }
    # Document masking (stage 3) hands the model segment ids, and positions when they restart.
    if config.data.document_masking:
        batch["segment_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout)
    if config.data.reset_positions_per_document:
        batch["positions"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout)
    schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=config.trainer.micro_batches).step

    # eqx.filter_jit would treat ShapeDtypeStruct leaves as static: jit the array part instead.
    arrays, static = eqx.partition(state, _is_abstract)

    def array_step(batch, arrays):
        new_state, metrics = step(batch, eqx.combine(arrays, static))
        return eqx.filter(new_state, eqx.is_array), metrics

    model = config.model
    what = (f"{model.n_layers} layers, remat {model.remat}, {config.trainer.micro_batches} micro-batch(es) of "
            f"{config.data.global_batch_size // config.trainer.micro_batches} x {config.data.sequence_length}")
    global _compiles
    _compiles += 1
    if _progress:
        _progress(f"  compile {_compiles}: {what} ...")
    started = time.perf_counter()
    try:
        compiled = jax.jit(array_step, donate_argnums=1).lower(batch, arrays).compile()
    except Exception as e:
        if (message := _refusal(e)) is not None:
            if _progress:
                _progress(f"  compile {_compiles}: refused by the compiler after {time.perf_counter() - started:.0f} s")
            raise CompileRefused(message, str(e)) from None
        raise
    if _progress:
        _progress(f"  compile {_compiles}: done in {time.perf_counter() - started:.0f} s")
    return CompiledStep(compiled.memory_analysis(), _cost_analysis(compiled), compiled.as_text(), state, mesh, rules, compiled)


def memory_bytes(memory) -> dict:
    """XLA's memory analysis of one device's program, per kind, and their sum ("total": what
    XLA:CPU and XLA:GPU need; XLA:TPU holds its temporaries alone against HBM, see plan_config)."""
    arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    aliased, temporaries = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    return {
        "arguments": arguments,
        "outputs": outputs,
        "aliased": aliased,
        "temporaries": temporaries,
        # Donated arguments are aliased by the outputs: counted once.
        "total": arguments + outputs - aliased + temporaries,
        "host": getattr(memory, "host_temp_size_in_bytes", 0) + getattr(memory, "host_argument_size_in_bytes", 0),
    }


def _is_abstract(x) -> bool:
    import jax

    return isinstance(x, jax.ShapeDtypeStruct)


def _per_device_bytes(tree) -> int:
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(tree, is_leaf=_is_abstract)
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)


def _batch_shards(mesh, rules) -> int:
    return math.prod(mesh.shape[axis] for axis in rules.batch)


def _with(config, *, model=None, micro_batches=None, global_batch=None):
    """`config` with some model fields, the micro-batch count or the global batch changed."""
    changes = {}
    if model:
        changes["model"] = config.model.replace(**model)
    if micro_batches is not None:
        changes["trainer"] = dataclasses.replace(config.trainer, micro_batches=micro_batches)
    if global_batch is not None:
        changes["data"] = dataclasses.replace(config.data, global_batch_size=global_batch)
    return dataclasses.replace(config, **changes)


def _experts(config, mesh, batch_shards: int) -> Optional[dict]:
    """A mixture of experts' layout: experts per device, and the all-to-all slots of expert
    parallelism (olmoe.py: each device gives each peer T * min(k, E/P) rows per layer, T its
    tokens of one micro-batch), or None for a dense model."""
    model, data = config.model, config.data
    if model.n_experts is None:
        return None
    ep = mesh.shape.get("expert", 1)
    per_device = model.n_experts // ep if model.n_experts % ep == 0 else model.n_experts
    tokens = data.global_batch_size * data.sequence_length // (batch_shards * mesh.shape["context"] * config.trainer.micro_batches)
    slots = tokens * min(model.n_experts_per_token, per_device) if ep > 1 else 0
    return {
        "n_experts": model.n_experts,
        "active": model.n_experts_per_token,
        "expert_parallel": ep,
        "experts_per_device": per_device,
        "tokens_per_device_per_micro_batch": tokens,
        "all_to_all_slots_per_peer": slots,
    }


# ---------------------------------------------------------------------------------------------
# Estimating the step time


def _attention_recomputed(remat: str) -> bool:
    """Whether a remat policy runs attention's forward again in the backward pass."""
    return remat not in ("none", "save_projections", "save_attention", "offload_projections")


def estimate_step(config, devices, chip: Chip, collective_bytes: float, kernel: str) -> dict:
    """Step FLOPs, HBM bytes and time per device, reconciled for the loops XLA counts once.

    XLA's cost analysis counts a while loop's body once, whatever its trip count: the layer
    scan, the loss chunks and the micro-batch loop. Two more compiles give what it cannot:
    the model with one attention cycle and with two, unrolled, on one micro-batch, with the
    loss in one chunk (so no loop is left but attention's own). Their difference is one cycle;
    the step is micro_batches x (one-cycle program + (cycles - 1) x cycle). The optimiser's
    update is then counted once per micro-batch, a small overcount (elementwise, per shard).
    """
    from .flops import attention_flops_per_token

    model, data = config.model, config.data
    micro = config.trainer.micro_batches
    cycles = model.n_layers // model.cycle_length
    unrolled = dict(scan_layers=False, loss_chunk_size=data.sequence_length)
    small = _with(config, micro_batches=1, global_batch=data.global_batch_size // micro)
    one = compile_train_step(_with(small, model=dict(unrolled, n_layers=model.cycle_length)), devices).cost
    two = compile_train_step(_with(small, model=dict(unrolled, n_layers=2 * model.cycle_length)), devices).cost

    def step_total(key: str) -> Optional[float]:
        if key not in one or key not in two:
            return None
        return micro * (one[key] + (cycles - 1) * (two[key] - one[key]))

    flops, hbm_bytes, xla_seconds = step_total("flops"), step_total("bytes accessed"), step_total("optimal_seconds")
    # A Pallas or cuDNN attention kernel is opaque to XLA's cost analysis: add its FLOPs
    # (forward 4 of the formula's 12 per context token, again when remat recomputes it).
    kernel_flops = 0.0
    if kernel in ("splash", "cudnn"):
        tokens = data.global_batch_size * data.sequence_length / len(devices)
        per_token = attention_flops_per_token(model, data.sequence_length)
        kernel_flops = tokens * per_token * (16 / 12 if _attention_recomputed(model.remat) else 1.0)
    flops = (flops or 0.0) + kernel_flops
    compute_s = flops / chip.peak_bf16_flops
    memory_s = (hbm_bytes or 0.0) / chip.hbm_bandwidth
    network_s = collective_bytes / chip.ici_bandwidth
    roofline = max(compute_s, memory_s, network_s)
    bound = ("compute", "HBM", "interconnect")[[compute_s, memory_s, network_s].index(roofline)]
    return {
        "flops": flops,
        "kernel_flops": kernel_flops,
        "hbm_bytes": hbm_bytes,
        "roofline_seconds": roofline,
        "roofline_bound": bound,
        "roofline_terms": {"compute": compute_s, "hbm": memory_s, "interconnect": network_s},
        # XLA's own cost model, plus the kernel's FLOPs at peak (it does not see them either).
        # (XLA:GPU has no time model: the CPU client's analysis gives none worth the name.)
        "xla_seconds": None if not xla_seconds or xla_seconds < 0 else xla_seconds + kernel_flops / chip.peak_bf16_flops,
        # What the compiler said, kept when it is unusable: XLA:TPU has answered a negative
        # `optimal_seconds` for large programs (the 7B on 512 v5p chips: -1.77 s and -1.61 s).
        "xla_optimal_seconds": {"one_cycle": one.get("optimal_seconds"), "two_cycles": two.get("optimal_seconds")},
    }


# ---------------------------------------------------------------------------------------------
# The plan


def plan_config(config, target: Target, devices, *, estimate: bool, hlo_path: str = "") -> dict:
    """Compile `config`'s train step for `target` and return its figures (see the module doc)."""
    import jax.numpy as jnp

    from .flops import flops_per_token
    from .models.attention import resolve_implementation
    from .models.registry import count_params
    from .train.state import TrainState

    model, data = config.model, config.data
    kernel = resolve_implementation(model.attention_impl, jnp.dtype(model.compute_dtype), target.platform)
    tokens = data.global_batch_size * data.sequence_length
    chip = target.per_device
    result = {
        "target": target.spec,
        "target_description": target.describe(),
        "model": model.name,
        "parameters": count_params(model),
        "devices": len(devices),
        "global_batch": data.global_batch_size,
        "sequence_length": data.sequence_length,
        "micro_batches": config.trainer.micro_batches,
        "compute_dtype": model.compute_dtype,
        "param_dtype": model.param_dtype,
        "remat": model.remat,
        "attention_impl": model.attention_impl,
        "attention_kernel": kernel,
        "attention_block_size": model.attention_block_size,
        "loss_chunk_size": model.loss_chunk_size,
        "hbm_per_device": chip.hbm_bytes if chip else None,
        "model_flops_per_device": flops_per_token(model, data.sequence_length) * tokens / len(devices),
        "warnings": [],
    }
    started = time.perf_counter()
    try:
        step = compile_train_step(config, devices)
    except CompileRefused as refusal:
        result.update(fits=False, refused=str(refusal), compile_seconds=time.perf_counter() - started)
        return result
    result["compile_seconds"] = time.perf_counter() - started
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(step.hlo)
    mesh, rules, state = step.mesh, step.rules, step.state
    assert isinstance(state, TrainState)
    params, optimizer = _per_device_bytes(state.model), _per_device_bytes(state.opt_state)
    memory = memory_bytes(step.memory)
    # What the target's compiler holds against the chip's HBM. XLA:TPU compares its temporaries
    # alone ("the total memory required for HLO temporaries (X) exceeds available HBM") and
    # refuses above; a v5e chip ran programs whose arguments + temporaries exceeded its HBM
    # (18.0 GiB on 15.75: docs/planning.md, "Checked on a chip"), so for TPU that sum overstates
    # the need. Elsewhere arguments + outputs + temporaries is the bound.
    memory["needed"] = memory["temporaries"] if target.platform == "tpu" else memory["total"]
    needed = memory["needed"]
    traffic, gathered, unknown_trip = collective_traffic(step.hlo)
    batch_shards = _batch_shards(mesh, rules)
    result.update(
        mesh=dict(mesh.shape),
        per_device_batch=data.global_batch_size / batch_shards,
        bytes={
            "parameters": params,
            "optimizer_state": optimizer,
            "other_state": _per_device_bytes(state) - params - optimizer,
            **memory,
        },
        collectives=traffic,
        collectives_lower_bound=unknown_trip,
        experts=_experts(config, mesh, batch_shards),
        xla_flops_per_device_loops_once=step.cost.get("flops"),
    )
    # An accelerator's compiler refuses what does not fit (XLA:TPU) or only logs it (XLA:GPU):
    # compare with the chip either way; XLA:CPU's figures are compared with the usual chips.
    if chip:
        result["fits"] = needed <= chip.hbm_bytes
    else:
        result["fits_accelerators"] = {name: needed <= gib * GIB for name, gib in ACCELERATORS}
    warnings = result["warnings"]
    if data.global_batch_size % batch_shards:
        warnings.append(
            f"the global batch {data.global_batch_size} is not divisible by the {batch_shards} batch shards "
            f"({' x '.join(rules.batch)}): every device computes the whole batch; choose a multiple of {batch_shards}"
        )
    elif batch_shards < len(devices):
        warnings.append(
            f"each sequence is computed on {len(devices) // batch_shards} devices (the batch is split {batch_shards} ways "
            "over data x fsdp; context splits each sequence, tensor its heads and MLP)"
        )
    # Float tensors only: the embedding lookup all-gathers the int32 token ids (4 bytes a
    # token) so each device can gather its slice of d_model for them, which is cheap.
    shape = (data.global_batch_size, data.sequence_length)
    batch_gathers = [g for g in gathered if g[0] in ("bf16", "f16", "f32") and g[1][:2] == shape]
    result["batch_sized_all_gathers"] = len(batch_gathers)
    if batch_gathers:
        dtype, dims, op = batch_gathers[0]
        warnings.append(
            f"{len(batch_gathers)} all-gather(s) of batch-sized float tensors, e.g. {dtype}{list(dims)} "
            f"({math.prod(dims) * _BYTES[dtype] / GIB:.2f} GiB) from `{op}`: "
            "every device holds that tensor for the whole global batch"
        )
    if estimate and chip:
        add_estimate(result, config, devices, chip)
    return result


def add_estimate(result: dict, config, devices, chip: Chip) -> dict:
    """Add the step-time and MFU estimates (`estimate_step`) to a plan that compiled."""
    started = time.perf_counter()
    collective_bytes = float(sum(t["bytes"] for t in result["collectives"].values()))
    result["estimate"] = est = estimate_step(config, devices, chip, collective_bytes, result["attention_kernel"])
    for name in ("xla_seconds", "roofline_seconds"):
        seconds = est[name]
        est[name.replace("seconds", "mfu")] = (
            result["model_flops_per_device"] / (seconds * chip.peak_bf16_flops) if seconds else None
        )
    est["reconciled_over_model_flops"] = est["flops"] / result["model_flops_per_device"]
    result["estimate_seconds"] = time.perf_counter() - started
    return result


def plan(overrides: list[str], target: Target | str | int = "cpu:8", *, estimate: Optional[bool] = None) -> dict:
    """Compile the run's train step for `target` (see `olmo_eqx.targets`; an int N is `cpu:N`)."""
    from .config import compose_config

    target = parse_target(f"cpu:{target}" if isinstance(target, int) else target) if not isinstance(target, Target) else target
    config = compose_config(overrides)
    devices = target_devices(target)
    return plan_config(config, target, devices, estimate=target.platform != "cpu" if estimate is None else estimate)


# ---------------------------------------------------------------------------------------------
# Searching layouts


def _layouts(config, target: Target, batch_shards: int):
    """Candidate layouts, most memory first within each remat policy: (model changes, micro-batches)."""
    policies = ["save_projections", "save_attention", "full"]
    if target.platform in ("tpu", "gpu"):
        policies.insert(1, "offload_projections")  # host offload: accelerators only
    per_device = config.data.global_batch_size // max(batch_shards, 1)
    micro = [m for m in (1, 2, 4, 8, 16) if per_device and per_device % m == 0] or [1]
    for remat in policies:
        for m in micro:
            yield {"remat": remat}, m


def search(config, target: Target, devices, *, max_layouts: int = 8, estimate: bool = True, report=print) -> dict:
    """Try layouts for `target` and name the fastest that fits (by the estimates' step time).

    Per remat policy, the fewest micro-batches that fit; then, for the best, a larger and a
    smaller attention block. At most `max_layouts` compiles of the step (each layout that fits
    also costs the estimate's two smaller compiles).
    """
    if target.chip is None:
        raise SystemExit("+plan.search needs an accelerator target (+plan.target=tpu:... or gpu:...): a chip to fit and a peak")
    from .sharding import MESH_AXES, ShardingRules

    sizes = dict(zip(MESH_AXES, config.mesh.shape(len(devices))))
    shards = math.prod(sizes[axis] for axis in ShardingRules().batch)  # data x fsdp x expert: the batch shards
    rows, tried = [], 0
    started = time.perf_counter()

    def run(changes: dict, micro: int) -> dict:
        nonlocal tried
        tried += 1
        layout = _with(config, model=changes, micro_batches=micro)
        row = plan_config(layout, target, devices, estimate=estimate)
        rows.append(row)
        report(format_row(row, header=len(rows) == 1))
        return row

    for changes, micro in _layouts(config, target, shards):
        if tried >= max_layouts:
            break
        if any(r["remat"] == changes["remat"] and r["fits"] for r in rows):
            continue  # this policy already fits with fewer micro-batches
        run(changes, micro)
    best = _best(rows)
    if best and config.data.sequence_length >= 1024:
        from .models.attention import DEFAULT_BLOCK, SPLASH_BLOCK

        base = best["attention_block_size"] or (SPLASH_BLOCK if target.platform == "tpu" else DEFAULT_BLOCK)
        for block in (2 * base, base // 2):
            if tried >= max_layouts or block < 128 or block > config.data.sequence_length:
                continue
            run({"remat": best["remat"], "attention_block_size": block}, best["micro_batches"])
        best = _best(rows)
    return {"rows": rows, "best": best, "search_seconds": time.perf_counter() - started}


def _step_seconds(row: dict) -> Optional[float]:
    est = row.get("estimate")
    if not row.get("fits") or not est:
        return None
    return est["xla_seconds"] or est["roofline_seconds"]


def _best(rows: list[dict]) -> Optional[dict]:
    """The fastest layout that fits; near-ties go to the layout with fewer unknowns.

    Neither estimate sees host offload's transfers (over the host link, no published figure
    per chip) nor an opaque kernel's block size: offloading the projections ties with saving
    them in HBM, and splash's blocks all tie. Within 1% of the fastest, prefer no host memory,
    then less HBM, then the kernel's default block.
    """
    timed = [r for r in rows if _step_seconds(r)]
    if not timed:
        return next((r for r in rows if r.get("fits")), None)
    fastest = min(_step_seconds(r) for r in timed)
    close = [r for r in timed if _step_seconds(r) <= 1.01 * fastest]
    used = lambda r, key: r.get("bytes", {}).get(key, 0)  # noqa: E731
    return min(close, key=lambda r: (used(r, "host"), used(r, "needed"), r["attention_block_size"] is not None))


# ---------------------------------------------------------------------------------------------
# Printing


def _gib(n: float) -> str:
    return f"{n / GIB:9.2f} GiB"


def format_row(row: dict, header: bool = False) -> str:
    """One line per layout of a search."""
    lines = []
    if header:
        lines.append(
            f"{'remat':<20} {'micro':>5} {'block':>5} {'GiB/dev':>8} {'fits':>4} {'compile':>8} "
            f"{'step (XLA)':>10} {'MFU':>6} {'step (roofline)':>15} {'MFU':>6}"
        )
    est = row.get("estimate") or {}
    used = row["bytes"]["needed"] / GIB if "bytes" in row else float("nan")
    step = lambda key: f"{est[key]:9.3f}s" if est.get(key) else "        -"  # noqa: E731
    mfu = lambda key: f"{100 * est[key]:5.1f}%" if est.get(key) else "     -"  # noqa: E731
    lines.append(
        f"{row['remat']:<20} {row['micro_batches']:>5} {row['attention_block_size'] or 'auto':>5} {used:8.2f} "
        f"{'yes' if row['fits'] else 'NO':>4} {row['compile_seconds']:7.0f}s {step('xla_seconds'):>10} {mfu('xla_mfu')} "
        f"{step('roofline_seconds'):>15} {mfu('roofline_mfu')}"
        + (f"   +{row['bytes']['host'] / GIB:.2f} GiB host (transfers not estimated)" if row.get("bytes", {}).get("host") else "")
        + (f"   refused: {row['refused'][:160]}" if row.get("refused") else "")
    )
    return "\n".join(lines)


def format_plan(p: dict) -> str:
    lines = [
        f"{p['model']} ({p['parameters']:,} parameters) on {p['target_description']}: {p['devices']} devices"
        + (f", mesh {p['mesh']}" if "mesh" in p else ""),
        f"batch {p['global_batch']} x {p['sequence_length']} ("
        + (f"{p['per_device_batch']:g} per device, " if "per_device_batch" in p else "")
        + f"{p['micro_batches']} micro-batch(es)) | compute {p['compute_dtype']}, params {p['param_dtype']} "
        f"| remat {p['remat']} | attention {p['attention_impl']} -> {p['attention_kernel']} kernel"
        + (f" (block {p['attention_block_size']})" if p["attention_block_size"] else "")
        + f" | loss chunk {p['loss_chunk_size']}",
        f"{'refused' if p.get('refused') else 'compiled'} in {p['compile_seconds']:.0f} s",
        "",
    ]
    hbm = p.get("hbm_per_device")
    if p.get("refused"):
        lines.append(f"does NOT fit: the compiler refused it: {p['refused']}")
        return "\n".join(lines)
    b = p["bytes"]
    lines += [
        "per device:",
        f"  parameters        {_gib(b['parameters'])}",
        f"  optimiser state   {_gib(b['optimizer_state'])}",
        f"  other state       {_gib(b['other_state'])}",
        f"  arguments         {_gib(b['arguments'])}   (state + batch)",
        f"  temporaries       {_gib(b['temporaries'])}   (activations, gathered weights, gradients)",
        f"  outputs - aliased {_gib(b['outputs'] - b['aliased'])}   (the donated state is updated in place)",
        f"  total             {_gib(b['total'])}   (arguments + outputs - aliased + temporaries)",
    ]
    if hbm:
        counted = "temporaries, as XLA:TPU counts against HBM" if p["target"].startswith("tpu") else "total"
        lines.append(f"  needed            {_gib(b['needed'])}   ({counted}) of {_gib(hbm).strip()} HBM: "
                     + ("fits" if p["fits"] else "does NOT fit"))
    if b.get("host"):
        lines.append(f"  host memory       {_gib(b['host'])}   (offloaded activations)")
    if not hbm:
        lines.append("  fits (XLA:CPU's figure): " + ", ".join(
            f"{name} ({g} GiB) {'yes' if p['fits_accelerators'][name] else 'NO'}" for name, g in ACCELERATORS
        ))
    if e := p.get("experts"):
        lines += ["", f"experts: {e['n_experts']} per layer ({e['active']} active per token), {e['experts_per_device']} per device "
                  f"(expert parallelism {e['expert_parallel']})"
                  + (f"; all-to-all slots per peer per layer {e['all_to_all_slots_per_peer']:,} "
                     f"({e['tokens_per_device_per_micro_batch']:,} tokens x min(k, experts per device): dropless worst case)"
                     if e["expert_parallel"] > 1 else "")]
    lines += ["", "collectives per step (per device; bytes of the full tensors)"
              + (" (lower bound: a loop's trip count is unknown)" if p["collectives_lower_bound"] else "") + ":"]
    for kind, t in p["collectives"].items():
        if t["count"]:
            lines.append(f"  {kind:<18} {t['count']:>6} ops  {t['bytes'] / GIB:10.2f} GiB")
    lines.append(f"model FLOPs per device per step: {p['model_flops_per_device']:.3e}")
    lines += [f"warning: {w}" for w in p["warnings"]] or ["the batch is split over every device; no batch-sized all-gathers"]
    if p.get("estimate"):
        lines += ["", format_estimate(p)]
    return "\n".join(lines)


def format_estimate(p: dict) -> str:
    est = p["estimate"]
    terms = est["roofline_terms"]
    lines = [
        "ESTIMATES (from the compiled program and the chip's published peaks; not measurements):",
        f"  step FLOPs per device {est['flops']:.3e} = {est['reconciled_over_model_flops']:.2f} x model FLOPs "
        f"(remat recomputation; loops counted, {est['kernel_flops']:.2e} of it attention kernel FLOPs from the formula)",
        f"  HBM bytes per device  {est['hbm_bytes'] or 0:.3e}",
        f"  roofline: compute {terms['compute']:.3f} s, HBM {terms['hbm']:.3f} s, interconnect {terms['interconnect']:.3f} s"
        f" -> {est['roofline_seconds']:.3f} s per step ({est['roofline_bound']}-bound), MFU {100 * est['roofline_mfu']:.1f}%",
    ]
    if est["xla_seconds"]:
        lines.append(f"  XLA's cost model: {est['xla_seconds']:.3f} s per step, MFU {100 * est['xla_mfu']:.1f}%")
    else:
        raw = est.get("xla_optimal_seconds") or {}
        said = ", ".join(f"{k.replace('_', ' ')} {v:.3f} s" for k, v in raw.items() if v is not None) or "nothing"
        lines.append(f"  XLA's cost model: no usable step time (its optimal_seconds: {said}); the roofline stands alone")
    lines += [f"  (published: {figure})" for model, figure in PUBLISHED_MFU if model == p["model"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    target = parse_target(options.target)
    # Fake devices must be configured before JAX starts its CPU backend; an accelerator target
    # compiles with JAX on the host's CPU (the CUDA plugin would otherwise look for a driver).
    os.environ["JAX_PLATFORMS"] = "cpu"
    if target.platform == "cpu":
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={target.n_devices}".strip()
    import jax

    # The package has imported jax already, which read JAX_PLATFORMS then; its backends
    # start only now, so the setting still takes effect through the config.
    jax.config.update("jax_platforms", "cpu")
    if target.platform != "cpu":
        # A program for abstract chips cannot be loaded back from a persistent compilation
        # cache (there is no client to load it into); a user's JAX_COMPILATION_CACHE_DIR
        # would only collect entries that warn on every later read.
        jax.config.update("jax_enable_compilation_cache", False)
    from .config import compose_config

    config = compose_config(overrides)
    devices = target_devices(target)
    estimate = target.platform != "cpu" if options.estimate is None else options.estimate
    global _progress
    _progress = lambda line: print(line, flush=True)  # noqa: E731
    print(f"compiling the train step for {target.describe()} (a 7B step takes minutes on 2 cores) ...", flush=True)
    if options.search:
        result = search(config, target, devices, max_layouts=options.max_layouts, estimate=estimate)
        best = result["best"]
        print(f"\nsearched {len(result['rows'])} layouts in {result['search_seconds']:.0f} s; ", end="")
        print("none fits" if best is None else f"best: remat {best['remat']}, {best['micro_batches']} micro-batch(es), "
              f"attention block {best['attention_block_size'] or 'auto'}\n\n{format_plan(best)}", flush=True)
    else:
        # The memory plan first: the estimate's two more compiles take as long again.
        result = plan_config(config, target, devices, estimate=False, hlo_path=options.hlo)
        print(format_plan(result), flush=True)
        if estimate and target.chip and not result.get("refused"):
            print("\nestimating the step time (two more compiles: one and two attention cycles unrolled; "
                  "+plan.estimate=false skips them) ...", flush=True)
            add_estimate(result, config, devices, target.per_device)
            print(format_estimate(result), flush=True)
    if options.json:
        import json

        with open(options.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
