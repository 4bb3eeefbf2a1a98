"""Compile time of the forward+backward pass as depth grows: the layer scan keeps it flat.

    python scripts/compile_time.py [--layers 4 8 16 32] [--model olmo3_tiny]
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from olmo_eqx import get_model_config
from olmo_eqx.models.registry import abstract_model


def compile_seconds(n_layers: int, model_name: str, seq: int) -> float:
    config = get_model_config(model_name, n_layers=n_layers)
    model = abstract_model(config)
    tokens = jax.ShapeDtypeStruct((2, seq), jnp.int32)

    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def loss(params, t):
        return jnp.mean(jax.nn.logsumexp(eqx.combine(params, static)(t), axis=-1))

    start = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--model", default="olmo3_tiny")
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    compile_seconds(args.layers[0], args.model, args.seq)  # warm up tracing caches
    for n in args.layers:
        print(f"{args.model} n_layers={n:3d}: compile {compile_seconds(n, args.model, args.seq):6.2f} s", flush=True)


if __name__ == "__main__":
    main()
