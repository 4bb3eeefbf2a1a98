"""Reading a compiled program's HLO: the collective traffic of one step and the memory traffic of
its ops, loop trip counts applied."""

import re
from collections import defaultdict

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")


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


def _loop_start(while_attrs: str, named: dict[str, tuple[str, str, str]]) -> int:
    """Where a scan's counter starts: the first element of the loop's initial tuple, when it is
    a constant. XLA:TPU peels a loop's first iteration out (`loop_peel`) and starts the rest
    at 1 against the same `counter < constant` test; counted from 0 that is one too many."""
    if not (m := re.match(r"%?([\w.\-]+)\)", while_attrs)) or named.get(m.group(1), ("",))[0] != "tuple":
        return 0
    first = re.match(r"%?([\w.\-]+)", named[m.group(1)][2])
    kind, shape, rest = named.get(first.group(1) if first else "", ("", "", ""))
    for _ in range(4):  # through the copies XLA puts between the constant and the tuple
        if kind != "copy" or not (source := re.match(r"%?([\w.\-]+)\)", rest)):
            break
        kind, shape, rest = named.get(source.group(1), ("", "", ""))
    value = re.match(r"(-?\d+)\)", rest) if kind == "constant" and shape.split("{")[0] == "s32[]" else None
    return int(value.group(1)) if value else 0


def _trip_count(while_attrs: str, condition: list[tuple[str, str, str]], start: int = 0) -> int | None:
    """Iterations of a while loop: XLA's annotation, else a scan's `counter < constant` test
    from the counter's start."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', while_attrs):
        return int(m.group(1))
    # Shapes carry a layout on accelerators (s32[]{:T(128)} on TPU).
    constants = [
        re.match(r"(-?\d+)\)", rest) for kind, shape, rest in condition if kind == "constant" and shape.split("{")[0] == "s32[]"
    ]
    constants = [int(c.group(1)) for c in constants if c]
    # A lax.scan / static fori_loop counts from 0 up to one scalar constant.
    return max(constants[0] - start, 0) if len(constants) == 1 and len(condition) <= 4 else None


_Instructions = dict[str, list[tuple[str, str, str]]]


def _program(
    hlo: str,
) -> tuple[_Instructions, dict[str, int], dict[str, list[tuple[str, int]]], set[str], dict[str, dict[str, tuple[str, str, str]]]]:
    """The program's instructions by computation, (kind, shape, rest of the line); how many
    times each computation runs per step (while-loop trip counts applied); the call graph;
    the bodies of loops whose trip count is unknown; and the instructions by computation and
    name, in program order."""
    instructions: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # computation -> (kind, shape, rest)
    named: dict[str, dict[str, tuple[str, str, str]]] = defaultdict(dict)  # computation -> name -> the same
    entry, current = None, None
    for line in hlo.splitlines():
        # Computation headers start in column 0; instructions are indented.
        if not line[:1].isspace() and (m := _COMPUTATION.match(line)):
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current and (m := _INSTRUCTION.match(line)):
            instructions[current].append((m.group(3), m.group(2), m.group(4)))
            named[current][m.group(1)] = instructions[current][-1]
    # How many times each computation runs per step: walk calls from the entry.
    callees: dict[str, list[tuple[str, int]]] = defaultdict(list)
    unknown_loops: set[str] = set()
    for name, instrs in instructions.items():
        for kind, _, rest in instrs:
            if kind == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                condition = re.search(r"condition=%?([\w.\-]+)", rest).group(1)
                trip = _trip_count(rest, instructions.get(condition, []), _loop_start(rest, named[name]))
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
    return instructions, runs, callees, unknown_loops, named


def _collectives(instructions, runs):
    """Every collective that runs: (computation, kind without -start, shape, rest of the line)."""
    for name, instrs in instructions.items():
        for kind, shape, rest in instrs:
            base = kind.removesuffix("-start")
            if base in COLLECTIVES and not kind.endswith("-done") and runs.get(name):
                yield name, base, shape, rest


def _moved_shapes(base: str, shape: str, rest: str) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors a collective's bytes are counted from: a reduce-scatter's input (its
    operands' shapes), every other collective's output."""
    if base == "reduce-scatter":
        shapes = _shapes(rest.split(")")[0])
        if shapes:
            return shapes
    return _shapes(shape)


def collective_traffic(hlo: str) -> tuple[dict[str, dict], list[tuple[str, tuple[int, ...], str]], bool]:
    """Per collective kind: {count, bytes} per step, with while-loop trip counts applied.

    Bytes are those of the full tensor each op produces (all-gather, all-reduce) or consumes
    (reduce-scatter: its input): what a ring moves through every device, to a factor (n-1)/n.
    Also returns what is all-gathered, (dtype, shape, jax op name), and whether some loop's trip count was unknown
    (then the figures are lower bounds).
    """
    instructions, runs, callees, unknown_loops, _ = _program(hlo)

    def has_collective(name: str) -> bool:
        return any(k.removesuffix("-start") in COLLECTIVES for k, _, _ in instructions.get(name, ())) or any(
            has_collective(c) for c, _ in callees.get(name, ())
        )

    # Loops with data-dependent bounds (the blockwise attention's) hold no collectives.
    unknown_trip = any(has_collective(body) for body in unknown_loops)
    traffic = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    gathered = []
    for name, base, shape, rest in _collectives(instructions, runs):
        traffic[base]["count"] += runs[name]
        traffic[base]["bytes"] += runs[name] * _nbytes(_moved_shapes(base, shape, rest))
        if base == "all-gather":
            op = re.search(r'op_name="([^"]*)"', rest)
            gathered.extend((dtype, dims, op.group(1) if op else "?") for dtype, dims in _shapes(shape))
    return traffic, gathered, unknown_trip


# Ops that move no tensor through memory of their own: structure, control flow (their bodies are
# counted), and the start of an asynchronous copy or slice (counted once, at its `-done`).
_NO_TRAFFIC = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "call", "conditional",
    "after-all", "opt-barrier", "partition-id", "replica-id", "copy-start", "slice-start", "add-dependency",
}
# The asynchronous copies and slices XLA:TPU moves tensors between HBM and VMEM (or the host)
# with: their result is the tensor moved, read on one side and written on the other.
_MOVES = ("copy-done", "slice-done")


def op_traffic(hlo: str) -> tuple[dict[str, int], bool]:
    """Bytes each kind of op reads and writes in one step of a compiled program: per top-level
    op (a fusion counts once, its insides are in VMEM or registers), its result plus its
    operands, times how often its computation runs (while-loop trip counts applied, unlike
    XLA's own `bytes accessed`, which counts a loop body once).

    The key is the op's kind (a fusion's name without its number, e.g. `abs_reduce_fusion`)
    and the jax op it came from (`reduce_max`), so that two programs can be compared kind by
    kind (scripts/hlo_traffic.py). Results XLA:TPU keeps in VMEM or SMEM (memory spaces S(1),
    S(2)) count nothing where an op reads or writes them; the asynchronous copy or slice that
    moved them there counts its tensor once. An operand is counted whole: a fusion that reads a slice of a big
    buffer is over-counted, so read the figures as an upper bound of HBM traffic and their
    differences between programs as what changed; an op bound by its vector work rather than
    its bytes (a reduction across lanes) costs more than its bytes say. Also returns whether
    some loop's trip count was unknown (then its body counts once).
    """
    _, runs, _, unknown_loops, named = _program(hlo)
    # A result that XLA:TPU placed in VMEM (layout memory space S(1)) or SMEM (S(2)), e.g. the
    # ConcatBitcast that assembles prefetched pieces, never touches HBM.
    nbytes = {
        name: 0 if re.search(r":[^}]*S\([12]\)", shape) else _nbytes(_shapes(shape))
        for instrs in named.values()
        for name, (_, shape, _) in instrs.items()
    }
    fused = {  # computations that are a fusion's or a reduction's inside
        called
        for instrs in named.values()
        for kind, _, rest in instrs.values()
        if kind not in ("while", "call", "conditional")
        for called in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest)
    }
    traffic: dict[str, int] = defaultdict(int)
    for computation, instrs in named.items():
        if computation in fused or not runs.get(computation):
            continue
        for name, (kind, shape, rest) in instrs.items():
            if kind in _NO_TRAFFIC:
                continue
            if kind in _MOVES:
                moved = _nbytes(_shapes(shape))
            else:
                operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
                moved = nbytes[name] + sum(nbytes.get(o, 0) for o in operands)
            if not moved:
                continue
            op = re.search(r'op_name="([^"]*)"', rest)
            # XLA names a fusion after what it fuses (`abs_reduce_fusion.12`, `fusion.7.remat2`):
            # the name without its number and rematerialization suffixes.
            label = re.sub(r"(\.(\d+|remat\d*|clone))+$", "", name) if kind == "fusion" else kind
            traffic[f"{label} | {op.group(1).rsplit('/', 1)[-1] if op else ''}"] += runs[computation] * moved
    return dict(traffic), bool(unknown_loops)


# ---------------------------------------------------------------------------------------------
# Which devices a collective joins. The ids in an SPMD program's replica groups (and a
# collective-permute's pairs) are partition ids: positions in the program's device assignment,
# which for shardings on one mesh is the mesh's devices in flat order.

_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}"
)


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _iota(dims: list[int], perm: str | None) -> "object":
    import numpy as np

    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(_ints(perm)) if perm else ids


def device_groups(rest: str, n_devices: int) -> list[list[int]]:
    """The groups of partition ids a collective's attributes name (all three of XLA's forms:
    explicit `{{0,1},{2,3}}`, iota `[2,2]<=[4]T(1,0)`, and mesh axes `mesh['axis_0'=2,...]
    {'axis_0'}`), or a collective-permute's source -> target pairs as 2-device groups.
    Raises ValueError on a form it cannot read, so that no collective is silently missed."""
    import numpy as np

    if m := re.search(r"source_target_pairs=\{(.*?)\}\}", rest):
        return [_ints(pair) for pair in re.findall(r"\{([\d,]+)", m.group(1) + "}")]
    if m := _IOTA_GROUPS.search(rest):
        shape = _ints(m.group(1))
        return _iota(_ints(m.group(2)), m.group(3)).reshape(shape).tolist()
    if m := _MESH_GROUPS.search(rest):
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = _iota(_ints(m.group(2)), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes)))
        ids = np.asarray(ids).reshape(sizes)
        over = re.findall(r"'([^']+)'", m.group(4))
        if any(":" in a for a in m.group(4).split(",")) or not set(over) <= set(names):
            raise ValueError(f"replica groups over sub-axes are not read here: {m.group(0)}")
        inner = [names.index(a) for a in over]
        outer = [i for i in range(len(names)) if i not in inner]
        grid = ids.transpose(outer + inner).reshape(-1, int(np.prod([sizes[i] for i in inner])))
        return grid.tolist()
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest):
        groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        # `{}`: one group of every device.
        return [g for g in groups if g] or [list(range(n_devices))]
    raise ValueError(f"no replica groups found in a collective: {rest[:200]}")


def cross_slice_collectives(hlo: str, slice_of: list[int]) -> list[dict]:
    """The collectives of a compiled step that join devices of more than one slice.

    `slice_of[i]`: the slice of partition i (`olmo_eqx.sharding.slice_of_devices(mesh)`). Each
    entry: kind, the tensors it moves (dtype, shape), its bytes (counted as
    `collective_traffic` counts them: the full tensors, per device), its runs per step (loop
    trip counts applied), and the jax op it came from. With the slice axis outermost and
    weights never split over it, only the gradients' reduction (and the loss's scalar sums)
    should be here: a weight all-gather or an activation collective that crossed slices would
    show as another kind, or as tensors that are not gradients.
    """
    instructions, runs, _, _, _ = _program(hlo)
    crossing = []
    # XLA:TPU compiles a multi-slice program per slice: its collectives join the devices of
    # one slice, and what crosses slices leaves as host transfers to the DCN runtime
    # (megascale), a `send` per transfer that names the collective it is part of.
    for name, instrs in instructions.items():
        for kind, shape, rest in instrs:
            if kind != "send" or not runs.get(name) or not (m := _MEGASCALE.search(rest)):
                continue
            op = re.search(r'op_name="([^"]*)"', rest)
            data = _shapes(shape)[:1]  # (data, context, token)
            crossing.append({
                "kind": m.group(1).lower().replace("_", "-"),
                "tensors": data,
                "bytes": _nbytes(data),
                "runs": runs[name],
                "group_size": 0,  # one device per slice; the runtime does not say
                "op": op.group(1) if op else "?",
            })
    if (m := re.search(r"num_partitions=(\d+)", hlo.split("\n", 1)[0])) and int(m.group(1)) < len(slice_of):
        return crossing  # a per-slice program: its own collectives stay inside the slice
    for name, base, shape, rest in _collectives(instructions, runs):
        groups = device_groups(rest, len(slice_of))
        if not any(len({slice_of[i] for i in group}) > 1 for group in groups):
            continue
        moved = _moved_shapes(base, shape, rest)
        op = re.search(r'op_name="([^"]*)"', rest)
        crossing.append({
            "kind": base,
            "tensors": moved,
            "bytes": _nbytes(moved),
            "runs": runs[name],
            "group_size": max(len(g) for g in groups),
            "op": op.group(1) if op else "?",
        })
    return crossing


def cross_slice_summary(crossing: list[dict]) -> dict:
    """Per step: the bytes and count of cross-slice collectives by kind, and how much of it is
    gradient-sized (tensors) against scalars (the loss's sums, the token count)."""
    by_kind: dict[str, dict] = {}
    scalars = 0
    for c in crossing:
        entry = by_kind.setdefault(c["kind"], {"count": 0, "bytes": 0})
        entry["count"] += c["runs"]
        entry["bytes"] += c["runs"] * c["bytes"]
        scalars += c["runs"] * sum(1 for _, dims in c["tensors"] if not dims)
    return {
        "bytes": sum(k["bytes"] for k in by_kind.values()),
        "count": sum(k["count"] for k in by_kind.values()),
        "by_kind": by_kind,
        "scalars": scalars,
        "dtypes": sorted({dtype for c in crossing for dtype, _ in c["tensors"]}),
    }
