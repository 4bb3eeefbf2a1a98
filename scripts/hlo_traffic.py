"""Where a train step's memory traffic goes, by kind of op, from its compiled program: no chip needed.

    python scripts/hlo_traffic.py model=olmo3_600m model.compute_dtype=bfloat16 model.remat=save_context \
        trainer.micro_batches=8 model.loss_chunk_size=512 data.sequence_length=4096 data.global_batch_size=16 \
        --target tpu:v5e:1x1 --change model.quantization=int8

The step is compiled as the planner compiles it (`olmo_eqx.plan`: XLA:TPU's own compiler for a
`tpu:...` target, on this CPU machine), and every top-level op's bytes (result plus operands,
times its loop's trip count; `olmo_eqx.plan.hlo.op_traffic`) are summed by kind. With
`--change`, the same config with those overrides is compiled too and the kinds are listed by
how much they changed: what a change adds in passes over memory shows here before any chip time
is spent (on a v5e, 819 GB/s, every 100 GB a step is about 120 ms where the step is bound by
memory). The figures are upper bounds (an operand counts whole even where a fusion reads a
slice of it), and an op bound by its vector work (int8's absmax across lanes) costs more than
its bytes say: compare programs with them, and take step times from the chip
(scripts/measure_step.py).
"""

import argparse
import sys


def compile_hlo(overrides: list[str], target) -> tuple[str, dict]:
    """The compiled train step's HLO text and XLA's cost analysis for `overrides` on `target`
    (a `olmo_eqx.plan.targets.Target`)."""
    from olmo_eqx.config import compose_config
    from olmo_eqx.plan.compile import compile_train_step, target_devices
    from olmo_eqx.plan.planner import target_budget

    config = compose_config(overrides)
    step = compile_train_step(config, target_devices(target), budget=target_budget(target))
    return step.hlo, step.cost


def _unit(values) -> tuple[str, float]:
    """GB for a real model's step, MB or kB for a test-sized one."""
    largest = max(map(abs, values), default=0)
    return ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6) if largest >= 1e6 else ("kB", 1e3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="config overrides of the step (as for python -m olmo_eqx)")
    parser.add_argument("--target", default="tpu:v5e:1x1", help="plan target: tpu:GEN:TOPOLOGY or cpu:N (default tpu:v5e:1x1)")
    parser.add_argument("--change", nargs="+", default=[], metavar="KEY=VALUE", help="compare against the step with these overrides added")
    parser.add_argument("--top", type=int, default=20, help="how many kinds of op to list (default 20)")
    args = parser.parse_args(argv)
    from olmo_eqx.config import ConfigError
    from olmo_eqx.plan.targets import compile_on_this_host, parse_target
    from olmo_eqx.train.memory import CompileRefused

    try:
        target = parse_target(args.target)
    except SystemExit as e:  # the target's refusal names the forms it takes
        print(f"error: {e.code}", file=sys.stderr)
        return 2
    compile_on_this_host(target)  # as `python -m olmo_eqx.plan` compiles
    from olmo_eqx.plan.hlo import op_traffic

    programs = [("base", args.overrides)] + ([("changed", args.overrides + args.change)] if args.change else [])
    traffic = []
    for label, overrides in programs:
        print(f"compiling the {label} step for {args.target}: {' '.join(overrides) or '(defaults)'}", file=sys.stderr, flush=True)
        try:
            hlo, cost = compile_hlo(overrides, target)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except CompileRefused as e:  # it does not fit the target: nothing to count
            print(f"error: the {label} step does not fit {args.target}: {e}", file=sys.stderr)
            return 2
        by_kind, unknown = op_traffic(hlo)
        traffic.append(by_kind)
        unit, scale = _unit([sum(by_kind.values())])
        print(f"{label}: {sum(by_kind.values()) / scale:.1f} {unit} a step by op (loops' trip counts applied"
              f"{'; a loop of unknown length counted once' if unknown else ''}); XLA's `bytes accessed` "
              f"{cost.get('bytes accessed', 0) / 1e9:.1f} GB, {cost.get('flops', 0) / 1e12:.1f} TFLOP (loop bodies once)")
    if len(traffic) == 1:
        unit, scale = _unit(traffic[0].values())
        print(f"\n{unit + '/step':>9}  kind of op | jax op")
        for kind, n in sorted(traffic[0].items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{n / scale:9.1f}  {kind}")
        return 0
    base, changed = traffic
    delta = {kind: changed.get(kind, 0) - base.get(kind, 0) for kind in base.keys() | changed.keys()}
    rows = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[: args.top]
    unit, scale = _unit([n for _, n in rows])
    print(f"\nchange: {sum(delta.values()) / scale:+.1f} {unit} a step ({' '.join(args.change)})")
    print(f"{'change':>9} {'base':>9} {'changed':>9}  kind of op | jax op ({unit} a step)")
    for kind, n in rows:
        print(f"{n / scale:+9.1f} {base.get(kind, 0) / scale:9.1f} {changed.get(kind, 0) / scale:9.1f}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
