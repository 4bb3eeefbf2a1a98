"""`trainer.profile_steps=[start, stop]`: a jax.profiler trace of those steps in `<run dir>/profile`.

The trace covers dispatch and execution of steps start..stop: it starts before step `start`
is dispatched and stops once step `stop`'s results are ready (so asynchronous execution on an
accelerator is inside it). It writes `profile/plugins/profile/<timestamp>/<host>.xplane.pb`,
which TensorBoard's profile plugin (`pip install tensorboard-plugin-profile`, then
`tensorboard --logdir <run dir>/profile`) or XProf opens; `perfetto_trace.json.gz` next to it
opens in https://ui.perfetto.dev. Process 0 only.
"""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import jax

PROFILE_DIR = "profile"


class StepProfiler:
    """Start and stop one trace around a range of steps; a no-op without a range."""

    def __init__(self, steps: Optional[tuple[int, int]], run_dir: Path, enabled: bool, say: Callable[[str], None]):
        self.steps = steps if enabled else None
        self.directory = Path(run_dir) / PROFILE_DIR
        self.say = say
        self.active = False

    def before_step(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0] and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.steps[1]:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """End the trace (also when the run stops inside the range); waits for `outputs` first."""
        if not self.active:
            return
        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active = False
        self.say(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory} "
                 "(open: tensorboard --logdir with tensorboard-plugin-profile, or the perfetto_trace.json.gz in ui.perfetto.dev)")


# ---------------------------------------------------------------------------------------------
# Reading a trace: where a compiled step's time goes, by XLA op and by what the op is in the
# model. `scripts/measure_step.py --profile` (TPU, GPU, CPU) and `scripts/bench_train.py
# --profile` (CPU) print these.

# What an op is in the model, judged in this order (the first that matches wins).
CATEGORIES = (
    "collectives",
    "attention kernel",
    "loss/head",
    "projections",
    "copies/transposes",
    "optimizer update",
    "norms/RoPE/elementwise",
    "other",
)
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_MATMULS = ("dot", "convolution")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_SOURCE = re.compile(r'source_file="([^"]*)"')
_CONTAINER = re.compile(r"^\S+\s+(while|conditional|call|async-start|async-done)\(|^\(.*?\)\s+(while|conditional|call)\(")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """HLO text -> {computation: [(instruction, opcode, rest of line)]}."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    current: list[tuple[str, str, str]] = []
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = computations.setdefault(name.lstrip("%"), [])
        elif (match := _INSTRUCTION.match(line)) is not None:
            current.append(match.groups())
    return computations


def _frame_files(hlo: str) -> dict[str, list[str]]:
    """{stack frame id: the source files of its frames, innermost first} from the tables at the
    top of a module's text (FileNames, FileLocations, StackFrames), which newer XLA writes in
    place of each op's `source_file`."""
    tables: dict[str, dict[str, str]] = {}
    section = ""
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            section = ""
        elif section:
            key, _, value = line.partition(" ")
            tables[section][key] = value
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    location_file = {
        k: files.get(m.group(1), "") for k, v in tables.get("FileLocations", {}).items()
        if (m := re.search(r"file_name_id=(\d+)", v))
    }
    frames = {
        k: (re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v))
        for k, v in tables.get("StackFrames", {}).items()
    }
    chains: dict[str, list[str]] = {}
    for frame in frames:
        chain, seen, current = [], set(), frame
        while current in frames and current not in seen:
            seen.add(current)
            location, parent = frames[current]
            if location is not None:
                chain.append(location_file.get(location.group(1), ""))
            # The text writes a frame's parent as its id + 1 (0: none).
            current = str(int(parent.group(1)) - 1) if parent is not None else ""
        chains[frame] = chain
    return chains


# Files whose calls say what an op is even when its innermost frame is elsewhere (the head's
# matmul runs in the model's `dense`, called by the loss).
_ORIGINS = ("splash.py", "attention.py", "loss.py", "optim.py")


def _origin(files: list[str]) -> str:
    """The file that says most about an op: one of `_ORIGINS` in its stack below the train step
    (which calls everything), else optax, else its innermost frame's file."""
    inner = files[: next((i for i, f in enumerate(files) if f.endswith("step.py")), len(files)) or 1]
    for marker in _ORIGINS:
        if (found := next((f for f in inner if f.endswith(marker)), None)) is not None:
            return found
    return next((f for f in files if "optax" in f), files[0] if files else "")


def op_categories(hlo: str) -> dict[str, tuple[str, str]]:
    """{HLO instruction name: (category, where it comes from)} for a compiled module's text.

    A fusion is a matmul when its fused computation holds a dot or convolution; where an op
    comes from is the source file and JAX op name XLA keeps in its metadata, so a matmul of
    `train/loss.py` is the head, one of the model file a projection, and so on.
    """
    computations = _computations(hlo)
    frame_files = _frame_files(hlo)

    def opcodes(computation: str, depth: int = 0) -> set[str]:
        found: set[str] = set()
        for _, opcode, rest in computations.get(computation, []):
            found.add(opcode)
            if depth < 4 and (called := _CALLS.search(rest)) is not None:
                found |= opcodes(called.group(1), depth + 1)
        return found

    categories: dict[str, tuple[str, str]] = {}
    for instructions in computations.values():
        for name, opcode, rest in instructions:
            source = (_SOURCE.search(rest) or [None, ""])[1]
            if not source and (frame := _FRAME.search(rest)) is not None:
                source = _origin(frame_files.get(frame.group(1), []))
            op_name = (_OP_NAME.search(rest) or [None, ""])[1]
            where = f"{Path(source).name}: {op_name.split('/')[-1]}" if source or op_name else ""
            called = _CALLS.search(rest)
            inside = opcodes(called.group(1)) if called is not None else set()
            kinds = inside | {opcode}
            text = f"{source} {op_name}".lower()
            if any(k.startswith(c) for k in kinds for c in _COLLECTIVES):
                category = "collectives"
            elif opcode == "custom-call" or "splash" in text or "pallas" in text or "attention.py" in text:
                category = "attention kernel"
            elif source.endswith("loss.py"):
                category = "loss/head"
            elif kinds & set(_MATMULS):
                category = "projections"
            elif opcode in ("copy", "transpose", "copy-start", "copy-done") or (
                inside and inside <= {"copy", "transpose", "bitcast", "parameter", "tuple", "get-tuple-element"}
            ):
                category = "copies/transposes"
            elif source.endswith(("optim.py", "step.py")) or "optax" in source:
                category = "optimizer update"
            elif source:
                category = "norms/RoPE/elementwise"
            else:
                category = "other"
            categories[name] = (category, where)
    return categories


def leaf_op_names(hlo: str) -> set[str]:
    """The module's instructions that do work themselves (not loops, conditionals or calls,
    whose trace events span the ops inside them)."""
    return {
        name
        for instructions in _computations(hlo).values()
        for name, opcode, _ in instructions
        if opcode not in ("while", "conditional", "call")
    }


def traced_op_times(xplane: Path, hlo_names: Optional[set[str]] = None) -> dict[str, float]:
    """Nanoseconds per XLA op name in a trace: the device's "XLA Ops" line on an accelerator,
    the host's thunk events on CPU (with `--xla_cpu_enable_xprof_traceme=true`), there only
    those named in `hlo_names` when given (the host also traces the runtime's own scopes)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    device: dict[str, float] = {}
    host: dict[str, float] = {}
    for plane in data.planes:
        on_device = plane.name.startswith("/device:") and "CPU" not in plane.name
        if not on_device and plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if on_device and line.name != "XLA Ops":
                continue
            totals = device if on_device else host
            for event in line.events:
                # A TPU event is named by its whole HLO instruction ("%fusion.12 = bf16[...] fusion(...)").
                name, _, instruction = event.name.partition(" = ")
                name = name.lstrip("%")
                # Loops and calls span the ops inside them, which have events of their own.
                if _CONTAINER.search(instruction):
                    continue
                # Thunk events carry the HLO op's name; skip Python/runtime scopes.
                if not on_device and (
                    (hlo_names is not None and name not in hlo_names)
                    or any(name.startswith(p) for p in ("$", "PjRt", "Thunk", "jit_", "TfrtCpu"))
                ):
                    continue
                totals[name] = totals.get(name, 0.0) + event.duration_ns
    return device or host


def time_by_category(op_times: dict[str, float], hlo: str) -> tuple[dict[str, float], dict[str, tuple[str, str]]]:
    """(nanoseconds per category, the category and origin of each op) for a trace of `hlo`."""
    categories = op_categories(hlo)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for name, ns in op_times.items():
        totals[categories.get(name.lstrip("%"), ("other", ""))[0]] += ns
    return totals, categories


def op_table(op_times: dict[str, float], hlo: str, steps: int) -> list[dict]:
    """Every traced op, slowest first: ms per step, category, origin, opcode and result type
    (the whole table behind `format_profile`'s top ops, for comparing two traces)."""
    _, categories = time_by_category(op_times, hlo)
    types = {}
    for line in hlo.splitlines():
        if (match := _INSTRUCTION.match(line)) is not None:
            name, opcode, _ = match.groups()
            # The result type sits between "=" and the opcode (a tuple's holds spaces).
            types[name] = (opcode, line.split("=", 1)[1].split(f" {opcode}(", 1)[0].strip())
    rows = []
    for name, ns in sorted(op_times.items(), key=lambda item: -item[1]):
        category, where = categories.get(name.lstrip("%"), ("other", ""))
        opcode, result = types.get(name.lstrip("%"), ("", ""))
        rows.append(dict(op=name, ms_per_step=ns / steps / 1e6, category=category, where=where, opcode=opcode, result=result))
    return rows


def format_profile(op_times: dict[str, float], hlo: str, steps: int, top: int = 15) -> str:
    """The time per step by category, then the top ops with their category and origin."""
    return format_op_table(op_table(op_times, hlo, steps), steps, top)


def format_op_table(table: list[dict], steps: int, top: int = 15) -> str:
    """`format_profile` from an `op_table` already made (so it is made once when both are wanted)."""
    total = sum(row["ms_per_step"] for row in table) or 1.0
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for row in table:
        by_category[row["category"]] += row["ms_per_step"]
    lines = [f"traced op time: {total:.1f} ms/step over {steps} steps", "by what the op is in the model:"]
    for category, ms in sorted(by_category.items(), key=lambda item: -item[1]):
        if ms:
            lines.append(f"  {ms:9.2f} ms  {ms / total:6.1%}  {category}")
    lines.append(f"top {top} ops:")
    for row in table[:top]:
        lines.append(f"  {row['ms_per_step']:9.2f} ms  {row['ms_per_step'] / total:6.1%}  {row['op']:28} {row['category']:24} {row['where']}")
    return "\n".join(lines)
