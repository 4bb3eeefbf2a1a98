"""Read a jax.profiler trace against the compiled program's HLO: time per step by what each op
is in the model, the top ops, and optionally the whole op table as JSON.

    python scripts/read_profile.py --xplane DIR_OR_FILE --hlo DIR_OR_FILE --steps 3 [--top 25] [--table ops.json]

For a trace this project did not take too: a run's `trainer.profile_steps` trace, or another
trainer's (MaxText's `profiler=xplane` writes `<run>/tensorboard/plugins/profile/*/*.xplane.pb`
and, with XLA's `--xla_dump_to`, the compiled step as `*jit_train_step*after_optimizations.txt`).
A directory is searched for the newest `.xplane.pb` (the trace) or the largest
`*after_optimizations.txt` (the HLO, the step being the biggest module). Categories come from
the source files in the HLO's metadata, which name this project's files; another trainer's ops
fall into the generic groups (matmuls as projections, elementwise, copies).
"""

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path


def _find(path: Path, pattern: str, key) -> Path | None:
    """`path` itself, or the file under it matching `pattern` that `key` ranks last (None: none)."""
    if path.is_file():
        return path
    found = sorted(path.rglob(pattern), key=key) if path.is_dir() else []
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--xplane", required=True, help="the .xplane.pb (or .xplane.pb.gz), or a directory holding it")
    parser.add_argument(
        "--hlo", required=True,
        help="the compiled module's HLO text (gzipped too: measure_step's --keep-hlo), or a directory of XLA's dump",
    )
    parser.add_argument("--steps", type=int, required=True, help="how many steps the trace covers")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--table", default="", help="also write every op (ms/step, category, origin, shape) here as JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from olmo_eqx.train.profile import format_op_table, leaf_op_names, op_table, traced_op_times

    xplane = _find(Path(args.xplane), "*.xplane.pb", os.path.getmtime)  # the newest trace
    hlo_path = _find(Path(args.hlo), "*after_optimizations.txt", os.path.getsize)  # the step: the biggest module
    for given, found, what in ((args.xplane, xplane, "a .xplane.pb"), (args.hlo, hlo_path, "an *after_optimizations.txt")):
        if found is None:
            parser.error(f"{given} is neither a file nor a folder holding {what}")
    hlo = gzip.decompress(hlo_path.read_bytes()).decode() if hlo_path.suffix == ".gz" else hlo_path.read_text()
    print(f"trace {xplane}\nprogram {hlo_path}")
    with tempfile.TemporaryDirectory() as directory:
        if xplane.suffix == ".gz":  # the reader wants a plain file; the user's folder stays as it was
            plain = Path(directory) / "trace.xplane.pb"
            plain.write_bytes(gzip.decompress(xplane.read_bytes()))
            xplane = plain
        op_times = traced_op_times(xplane, leaf_op_names(hlo))
    if not op_times:
        parser.error(f"no op of {hlo_path} has events in {args.xplane}: a trace of another program, or a CPU trace "
                     "taken without XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true")
    table = op_table(op_times, hlo, args.steps)
    print(format_op_table(table, args.steps, args.top))
    if args.table:
        Path(args.table).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
