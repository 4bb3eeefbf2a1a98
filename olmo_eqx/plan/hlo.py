"""Reading a compiled program's HLO: the collective traffic of one step, loop trip counts applied."""

import re
from collections import defaultdict

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


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
