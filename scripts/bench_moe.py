"""The MoE layer's speed on CPU: dropless (sorted + ragged_dot) vs the dense reference vs a dense
SwiGLU MLP of the same *active* size, forward + backward.

    python scripts/bench_moe.py                         # d_model 256, 8 experts of 256, top-2, 2048 tokens
    python scripts/bench_moe.py --experts 64 --top-k 8 --hidden 64
    python scripts/bench_moe.py --profile               # top XLA ops of the dropless layer (XLA:CPU trace)
    taskset -c 0 python scripts/bench_moe.py            # one core

Three layers over the same [tokens, d_model] input, each timed as one jitted forward +
backward (gradients of a scalar of the output w.r.t. the input and every weight):

- `dropless`: olmoe.py's training path: router (softmax, top-k), the k assignments sorted by
  expert, three `jax.lax.ragged_dot` grouped matmuls, unsort, weighted sum.
- `dense_reference`: the same router, every expert on every token, masked (E/k times the MLP work).
- `dense_mlp`: one SwiGLU MLP of hidden k * expert_hidden: the FLOPs a token's active experts do,
  without a router (what a perfect grouped matmul would cost).

Printed: median seconds and tokens/s of each over `--rounds` alternating rounds, and the ratios.
Not a test: timings on shared cores are noisy; compare ratios within one run.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build(args):
    import jax
    import jax.numpy as jnp

    from olmo_eqx.models.config import ModelConfig
    from olmo_eqx.models.olmo3 import swiglu
    from olmo_eqx.models.olmoe import MoE, dense_reference, dropless, route

    config = ModelConfig(
        name="bench_moe", architecture="olmoe", d_model=args.d_model, n_layers=1, n_heads=4, n_kv_heads=4,
        head_dim=args.d_model // 4, mlp_hidden=args.hidden, n_experts=args.experts, n_experts_per_token=args.top_k,
        sliding_window=None,
    )
    k_moe, k_mlp, k_x = jax.random.split(jax.random.key(0), 3)
    moe = MoE(config, key=k_moe)
    active = args.top_k * args.hidden
    kg, ku, kd = jax.random.split(k_mlp, 3)
    mlp = {
        "gate": 0.02 * jax.random.normal(kg, (args.d_model, active)),
        "up": 0.02 * jax.random.normal(ku, (args.d_model, active)),
        "down": 0.02 * jax.random.normal(kd, (active, args.d_model)),
    }
    x = jax.random.normal(k_x, (args.tokens, args.d_model))

    def moe_loss(combine):
        def loss(params, x):
            router, experts = params
            routing = route(x, router, config)
            return jnp.sum(jnp.square(combine(x, routing, experts)))

        return loss

    def mlp_loss(params, x):
        return jnp.sum(jnp.square(swiglu(x @ params["gate"], x @ params["up"]) @ params["down"]))

    moe_params = (moe.router, moe.experts)
    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1)))  # noqa: E731
    return {
        "dropless": (grad(moe_loss(dropless)), moe_params),
        "dense_reference": (grad(moe_loss(dense_reference)), moe_params),
        "dense_mlp": (grad(mlp_loss), mlp),
    }, x


def time_one(fn, params, x, repeats: int) -> float:
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare(args) -> None:
    import jax

    layers, x = build(args)
    for fn, params in layers.values():  # compile and warm up
        jax.block_until_ready(fn(params, x))
    seconds = {name: [] for name in layers}
    for _ in range(args.rounds):
        for name, (fn, params) in layers.items():
            seconds[name].append(time_one(fn, params, x, args.repeats))
    print(
        f"MoE layer forward+backward on {jax.device_count()} CPU device(s), {os.cpu_count()} cores: "
        f"{args.tokens} tokens, d_model {args.d_model}, {args.experts} experts of hidden {args.hidden}, top-{args.top_k} "
        f"(dense MLP hidden {args.top_k * args.hidden}); median of {args.rounds} rounds x {args.repeats}"
    )
    base = statistics.median(seconds["dense_mlp"])
    for name, values in seconds.items():
        s = statistics.median(values)
        print(f"  {name:<16} {s * 1e3:8.2f} ms  {args.tokens / s:12,.0f} tokens/s  {s / base:6.2f} x dense_mlp")


def profile(args) -> None:
    # Thunk-level trace events; the flag must be set before JAX starts its backend.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true"
    import jax
    from jax.profiler import ProfileData

    layers, x = build(args)
    fn, params = layers[args.profile_layer]
    jax.block_until_ready(fn(params, x))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(args.repeats):
            jax.block_until_ready(fn(params, x))
        jax.profiler.stop_trace()
        [xplane] = Path(tmp).rglob("*.xplane.pb")
        totals: dict[str, float] = {}
        for plane in ProfileData.from_file(str(xplane)).planes:
            if plane.name != "/host:CPU":
                continue
            for line in plane.lines:
                for event in line.events:
                    if any(event.name.startswith(p) for p in ("$", "PjRt", "Thunk", "jit_", "TfrtCpu")):
                        continue
                    totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns
    total = sum(totals.values())
    print(f"{args.profile_layer}: traced op time {total / args.repeats / 1e6:.1f} ms per forward+backward")
    by_kind: dict[str, float] = {}
    for name, ns in totals.items():
        kind = name.rstrip("0123456789").rstrip(".")
        by_kind[kind] = by_kind.get(kind, 0.0) + ns
    for title, table in (("by kind of op", by_kind), ("by op", totals)):
        print(f"top {args.top} {title} (ms per forward+backward, share of traced op time):")
        for name, ns in sorted(table.items(), key=lambda item: -item[1])[: args.top]:
            print(f"  {ns / args.repeats / 1e6:8.2f} ms  {ns / total:6.1%}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256, help="each expert's SwiGLU hidden width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="profile one layer instead (top XLA ops by time)")
    parser.add_argument("--profile-layer", default="dropless", choices=("dropless", "dense_reference", "dense_mlp"))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    profile(args) if args.profile else compare(args)


if __name__ == "__main__":
    sys.exit(main())
