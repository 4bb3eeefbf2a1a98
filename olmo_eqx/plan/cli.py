"""`python -m olmo_eqx.plan [overrides] [+plan.key=value ...]`: the planner's command line."""

import sys
from dataclasses import dataclass
from typing import Optional

from olmo_eqx.plan import compile
from olmo_eqx.plan.compile import _with, target_devices
from olmo_eqx.plan.estimate import add_estimate
from olmo_eqx.plan.layouts import search
from olmo_eqx.plan.planner import plan_config
from olmo_eqx.plan.report import format_estimate, format_plan, format_ranked, remat_label
from olmo_eqx.plan.targets import compile_on_this_host, parse_target



@dataclass(frozen=True)
class PlanOptions:
    target: str = "cpu:8"
    json: str = ""
    hlo: str = ""
    estimate: Optional[bool] = None  # None: for accelerator targets
    search: bool = False
    max_layouts: Optional[int] = None  # None: the search's own bound (`layouts.search`)


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
    if "max_layouts" in options and not options["max_layouts"].isdigit():
        raise SystemExit(f"+plan.max_layouts must be a whole number, got {options['max_layouts']!r}")
    return PlanOptions(
        target=options.get("target", "cpu:8"),
        json=options.get("json", ""),
        hlo=options.get("hlo", ""),
        estimate=_bool("estimate", options["estimate"]) if "estimate" in options else None,
        search=_bool("search", options.get("search", "false")),
        max_layouts=int(options["max_layouts"]) if "max_layouts" in options else None,
    ), overrides


def main(argv: list[str] | None = None) -> None:
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    target = parse_target(options.target)
    compile_on_this_host(target)
    from olmo_eqx.config import compose_config

    config = compose_config(overrides)
    devices = target_devices(target)
    try:
        from olmo_eqx.sharding import make_mesh

        make_mesh(config.mesh, devices)
    except ValueError as e:  # a mesh the target's devices cannot hold, in one line
        raise SystemExit(f"error: {e}") from None
    estimate = target.platform != "cpu" if options.estimate is None else options.estimate
    compile._progress = lambda line: print(line, flush=True)  # noqa: E731
    print(f"compiling the train step for {target.describe()} (a 7B step takes minutes on 2 cores) ...", flush=True)
    if options.search:
        result = search(config, target, devices, max_layouts=options.max_layouts, estimate=estimate)
        best = result["best"]
        print(f"\nsearched {len(result['rows'])} layouts in {result['search_seconds']:.0f} s; ", end="")
        print("none fits" if best is None else f"best: remat {remat_label(best)}, {best['micro_batches']} micro-batch(es), "
              f"attention block {best['attention_block_size'] or 'auto'}\n\n{format_plan(best)}", flush=True)
        if len(result["ranked"]) > 1:
            print(format_ranked(result["ranked"]), flush=True)
    else:
        # The memory plan first: the estimate's compiles take as long again.
        result = plan_config(config, target, devices, estimate=False, hlo_path=options.hlo)
        if isinstance(result.get("micro_batches"), int):  # trainer.micro_batches=auto: the count it chose
            config = _with(config, micro_batches=result["micro_batches"])
        print(format_plan(result), flush=True)
        if estimate and target.chip and not result.get("refused"):
            if result.get("xla_cost_loop_free") is not None:
                print("\nestimating the step time (from this program: it has no loops, so no more compiles) ...", flush=True)
            else:
                print("\nestimating the step time (more compiles: one and two layers unrolled, or attention cycles "
                      "where XLA sees the attention, and the once-per-step update; +plan.estimate=false skips them) ...",
                      flush=True)
            add_estimate(result, config, devices, target.per_device)
            print(format_estimate(result) if result["estimate"] else f"warning: {result['warnings'][-1]}", flush=True)
    if options.json:
        import json

        with open(options.json, "w") as f:
            json.dump(result, f, indent=2)
