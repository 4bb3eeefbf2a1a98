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
from pathlib import Path


def _newest(path: Path, pattern: str, key) -> Path:
    if path.is_file():
        return path
    found = sorted(path.rglob(pattern), key=key)
    if not found:
        raise SystemExit(f"no {pattern} under {path}")
    return found[-1]


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

    from olmo_eqx.train.profile import format_profile, leaf_op_names, op_table, traced_op_times

    xplane = _newest(Path(args.xplane), "*.xplane.pb", os.path.getmtime)
    hlo_path = _newest(Path(args.hlo), "*after_optimizations.txt", os.path.getsize)
    hlo = gzip.decompress(hlo_path.read_bytes()).decode() if hlo_path.suffix == ".gz" else hlo_path.read_text()
    if xplane.suffix == ".gz":
        plain = xplane.with_suffix("")
        plain.write_bytes(gzip.decompress(xplane.read_bytes()))
        xplane = plain
    print(f"trace {xplane}\nprogram {hlo_path}")
    op_times = traced_op_times(xplane, leaf_op_names(hlo))
    if not op_times:
        raise SystemExit("no op events in the trace")
    print(format_profile(op_times, hlo, args.steps, top=args.top))
    if args.table:
        Path(args.table).write_text(json.dumps(op_table(op_times, hlo, args.steps), indent=1))


if __name__ == "__main__":
    main()
