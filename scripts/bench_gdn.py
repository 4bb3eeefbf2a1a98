"""A Gated DeltaNet layer against a blockwise-attention layer on CPU: tokens/s and memory.

    python scripts/bench_gdn.py                       # both parts
    python scripts/bench_gdn.py --part memory         # compiles only
    python scripts/bench_gdn.py --part speed --seqs 2048,4096 [--only gdn|attention]

On 2 cores shared with other work the attention layer's compile grew with the sequence (46 s
at 2K, 236 s at 8K, 500 s at 16K) and so did the hybrid model's in the memory part (636 s at
16K): the long rows take the most time, in compiling as much as in running.

**memory**: the forward + backward pass of one GDN token mixer (projections, convolutions,
the chunked delta rule, gated norm, output projection) and of a small OLMo-Hybrid model
(`olmo_hybrid_tiny`'s shapes, its 4 layers: 3 GDN + 1 attention, the blockwise kernel; hidden
states, no head) at 16K, 32K and 64K tokens, read from the compiled program's
`memory_analysis()` (XLA's temporaries: nothing is run). Beside them the same GDN layer with
the delta rule run token by token (`gated_deltanet.recurrent` under `lax.scan`, whose backward
pass keeps every token's state), and the bytes of one float32 state per token and head
(T x heads x key_dim x value_dim x 4): what a backward pass that kept per-token states would
hold at least.

**speed**: forward + backward (gradients of the input and every weight) of one token mixer,
batch 1, at 2K ... 64K tokens: the GDN layer, and an attention layer of the same q/k/v widths
(q/k/v/o projections and the project's blockwise kernel, `attention.blockwise_attention`,
full causal, the CPU block). Prints tokens/s (best of the repetitions; fewer at long
sequences), compiled temporaries, and the ratio. Pin the cores with `taskset`, and compare
figures of one run only.
"""

import argparse
import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from olmo_eqx.models import gated_deltanet
from olmo_eqx.models.attention import AttentionMask, blockwise_attention, default_block_size
from olmo_eqx.models.olmo_hybrid import GatedDeltaNet, OLMoHybrid
from olmo_eqx.models.zoo import get_model_config

MIB = 1024**2


def gdn_config(d_model: int, heads: int, key_dim: int, value_dim: int, chunk: int):
    base = get_model_config("olmo_hybrid_tiny")
    return dataclasses.replace(
        base, d_model=d_model, gdn_heads=heads, gdn_key_heads=heads, gdn_key_dim=key_dim, gdn_value_dim=value_dim,
        gdn_chunk_size=chunk,
    )


def gdn_layer(config, *, recurrent: bool = False):
    """(params, f(params, x) -> y) of one GDN token mixer; `recurrent` runs the per-token scan."""
    layer = GatedDeltaNet(config, key=jax.random.key(0))
    params, static = eqx.partition(layer, eqx.is_array)

    def f(params, x):
        module = eqx.combine(params, static)
        if not recurrent:
            return module(x, config=config)
        args, _ = module.inputs(x, config=config)
        o, _ = gated_deltanet.recurrent(*args)
        return module.output(o, x, lambda a, _: a)

    return params, f


def attention_layer(d_model: int, heads: int, head_dim: int):
    """(params, f(params, x) -> y) of one attention token mixer: q/k/v/o and the blockwise kernel."""
    keys = jax.random.split(jax.random.key(1), 4)
    features = heads * head_dim
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * 0.02  # noqa: E731
    params = {"q": w(keys[0], (d_model, features)), "k": w(keys[1], (d_model, features)),
              "v": w(keys[2], (d_model, features)), "o": w(keys[3], (features, d_model))}

    def f(params, x):
        b, t, _ = x.shape
        split = lambda a: a.reshape(b, t, heads, head_dim)  # noqa: E731
        q, k, v = (split(x @ params[n]) for n in "qkv")
        return blockwise_attention(q, k, v, AttentionMask(), block_size=default_block_size("cpu")).reshape(b, t, -1) @ params["o"]

    return params, f


def forward_backward(f):
    """Gradients of sum(f(params, x) * cotangent) with respect to params and x: one layer's training work."""

    def loss(params, x, cotangent):
        return jnp.sum(f(params, x) * cotangent)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def compiled(f, params, seq: int, d_model: int):
    x = jax.ShapeDtypeStruct((1, seq, d_model), jnp.float32)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    started = time.perf_counter()
    program = forward_backward(f).lower(abstract, x, x).compile()
    return program, time.perf_counter() - started


def model_program(seq: int):
    """Forward + backward of olmo_hybrid_tiny's hidden states (3 GDN + 1 attention layer) at `seq`."""
    config = get_model_config("olmo_hybrid_tiny")
    model = eqx.filter_eval_shape(lambda: OLMoHybrid(config, key=jax.random.key(0)))
    params, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))

    def loss(params, tokens):
        return jnp.mean(jnp.square(eqx.combine(params, static).hidden_states(tokens)))

    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(params, tokens).compile(), config


def memory(args) -> None:
    config = gdn_config(args.d_model, args.heads, args.key_dim, args.value_dim, args.chunk)
    params, f = gdn_layer(config)
    _, f_recurrent = gdn_layer(config, recurrent=True)
    h, dk, dv = config.gdn_heads, config.gdn_key_dim, config.gdn_value_dim
    print(f"GDN layer: d_model {config.d_model}, {h} heads, key {dk}, value {dv}, chunk {config.gdn_chunk_size}, batch 1, "
          "float32; forward + backward, XLA:CPU's compiled temporaries (MiB)")
    print(f"{'seq':>7} {'chunked':>9} {'per 1K tok':>10} {'recurrent':>10} {'states/token':>13} "
          f"{'hybrid tiny':>12} {'per 1K tok':>10}")
    for seq in args.memory_seqs:
        chunked, chunked_s = compiled(f, params, seq, config.d_model)
        recurrent, recurrent_s = compiled(f_recurrent, params, seq, config.d_model)
        started = time.perf_counter()
        model, tiny = model_program(seq)
        model_s = time.perf_counter() - started
        chunked_mib = chunked.memory_analysis().temp_size_in_bytes / MIB
        recurrent_mib = recurrent.memory_analysis().temp_size_in_bytes / MIB
        model_mib = model.memory_analysis().temp_size_in_bytes / MIB
        states_mib = seq * h * dk * dv * 4 / MIB
        print(f"{seq:>7} {chunked_mib:>9.1f} {1024 * chunked_mib / seq:>10.2f} {recurrent_mib:>10.1f} {states_mib:>13.1f} "
              f"{model_mib:>12.1f} {1024 * model_mib / seq:>10.2f}   (compiled in {chunked_s:.0f} / {recurrent_s:.0f} / "
              f"{model_s:.0f} s)", flush=True)
    print(f"(hybrid tiny: d_model {tiny.d_model}, layers {list(tiny.layer_pattern)}, GDN {tiny.gdn_heads} heads "
          f"key {tiny.gdn_key_dim} value {tiny.gdn_value_dim}; hidden states only, no head or loss)")
    print("states/token: one float32 state per token and head, T x heads x key x value x 4 bytes, what a backward "
          "pass keeping per-token states holds at least")


def time_it(fn, params, x, cot, repeats: int) -> float:
    best = float("inf")  # `fn` is compiled already: no call pays for a compile
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(params, x, cot))
        best = min(best, time.perf_counter() - started)
    return best


def speed(args) -> None:
    config = gdn_config(args.d_model, args.heads, args.key_dim, args.value_dim, args.chunk)
    gdn_params, gdn = gdn_layer(config)
    att_params, att = attention_layer(args.d_model, args.heads, args.head_dim)
    print(f"forward + backward of one token mixer, batch 1, float32, d_model {args.d_model}; {jax.device_count()} CPU "
          f"device, {args.threads or 'all'} threads")
    print(f"  GDN: {args.heads} heads, key {args.key_dim}, value {args.value_dim}, chunk {args.chunk}")
    print(f"  attention: {args.heads} heads of {args.head_dim}, blockwise kernel, block {default_block_size('cpu')}, "
          "full causal")
    print(f"{'seq':>7} {'reps':>4} | {'GDN tok/s':>10} {'temp MiB':>9} {'compile':>8} | "
          f"{'attn tok/s':>10} {'temp MiB':>9} {'compile':>8} | {'GDN / attn':>10}")
    for seq in args.seqs:
        repeats = max(1, min(args.repeats, (args.repeats * 8192) // seq))
        x = jax.random.normal(jax.random.key(2), (1, seq, args.d_model), jnp.float32)
        cot = jax.random.normal(jax.random.key(3), (1, seq, args.d_model), jnp.float32)
        row = []
        for name, params, f in (("gdn", gdn_params, gdn), ("attention", att_params, att)):
            if args.only and name != args.only:
                row.append(None)
                continue
            program, compile_s = compiled(f, params, seq, args.d_model)
            seconds = time_it(program, params, x, cot, repeats)
            row.append((seq / seconds, program.memory_analysis().temp_size_in_bytes / MIB, compile_s))
        cells = [f"{t:>10,.0f} {m:>9.1f} {c:>7.1f}s" if r else f"{'-':>10} {'-':>9} {'-':>8}" for r in row
                 for t, m, c in [r or (0, 0, 0)]]
        ratio = f"{row[0][0] / row[1][0]:>9.2f}x" if all(row) else f"{'-':>10}"
        print(f"{seq:>7} {repeats:>4} | {cells[0]} | {cells[1]} | {ratio}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("memory", "speed", "both"), default="both")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    parser.add_argument("--seqs", type=ints, default=[2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--memory-seqs", type=ints, default=[16384, 32768, 65536])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64, help="attention's head dim")
    parser.add_argument("--key-dim", type=int, default=64, help="GDN's key dim")
    parser.add_argument("--value-dim", type=int, default=64, help="GDN's value dim")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="at 8K and below; fewer at longer sequences")
    parser.add_argument("--only", choices=("gdn", "attention"), help="time one of the two layers")
    parser.add_argument("--threads", type=int, default=0, help="(informational) cores the run is pinned to")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    if args.part in ("memory", "both"):
        memory(args)
    if args.part in ("speed", "both"):
        if args.part == "both":
            print()
        speed(args)


if __name__ == "__main__":
    main()
