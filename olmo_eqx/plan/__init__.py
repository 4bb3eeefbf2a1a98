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
  kind, from the compiled HLO with loop trip counts applied (with several slices, `mesh.slice=N`
  and a `tpu:...:N` target, also what crosses slices over DCN); the model FLOPs; the kernel
  `attention_impl=auto` resolved to *for the target*.
- With an accelerator target, an **estimate** of the step time and MFU (`+plan.estimate=false`
  skips it): XLA's cost analysis counts a loop's body once, so the step's FLOPs, HBM bytes and
  the compiler's own time (`optimal_seconds`) come from more compiles, of the model with
  one and two layers unrolled (one layer = the difference; attention cycles where XLA sees
  the attention), extrapolated to all layers and micro-batches, less the once-per-step
  update counted once (its own compile); attention run by a kernel XLA cannot see into
  (splash, cuDNN) is added from the model's FLOPs formula, on a TPU at the share of the MXU
  its heads fill. Two estimates: the compiler's, and a roofline (the
  slowest of FLOPs at peak, HBM bytes at HBM bandwidth, collective bytes at interconnect
  bandwidth; the chip's published peaks). Neither is a measurement.
- `+plan.search=true` tries layouts (remat policies, micro-batches, attention blocks) and
  names the fastest that fits; `+plan.max_layouts=N` bounds it (default: one layout
  per remat policy and the two attention blocks).

Options: `+plan.json=PATH` also writes the figures as JSON, `+plan.hlo=PATH` the compiled
HLO text (the target compiler's program, to read what it gathers, fuses and schedules).

The package, one step of a plan a module (each imports only those above it in this list):

    targets.py    what a plan compiles for: fake CPU devices, TPU or GPU chips and their peaks
    hlo.py        reading the compiled HLO: collective traffic with loop trip counts applied, and what crosses slices
    compile.py    compiling the train step for a target's devices (`compile_train_step`)
    estimate.py   the step-time and MFU estimates (`estimate_step`, `add_estimate`)
    planner.py    the plan of one config (`plan_config`, `plan`)
    layouts.py    searching layouts for the fastest that fits (`search`)
    report.py     printing plans, rows and estimates
    cli.py        `python -m olmo_eqx.plan` (`main`)
"""

from olmo_eqx.plan.targets import Chip, Target, gpu_devices, parse_target, tpu_devices
from olmo_eqx.plan.hlo import COLLECTIVES, collective_traffic, cross_slice_collectives, cross_slice_summary
from olmo_eqx.plan.compile import CompiledStep, CompileRefused, compile_train_step, memory_bytes, target_devices
from olmo_eqx.plan.estimate import add_estimate, estimate_step
from olmo_eqx.plan.planner import ACCELERATORS, GIB, plan, plan_config
from olmo_eqx.plan.layouts import _best, search
from olmo_eqx.plan.report import PUBLISHED_MFU, format_estimate, format_plan, format_row
from olmo_eqx.plan.cli import PlanOptions, main, parse_args

__all__ = [
    "ACCELERATORS", "COLLECTIVES", "Chip", "CompileRefused", "CompiledStep", "GIB", "PUBLISHED_MFU", "PlanOptions", "Target",
    "add_estimate", "collective_traffic", "compile_train_step", "cross_slice_collectives", "cross_slice_summary", "estimate_step", "format_estimate", "format_plan",
    "format_row", "gpu_devices", "main", "memory_bytes", "parse_args", "parse_target", "plan", "plan_config", "search",
    "target_devices", "tpu_devices",
]
