"""Decode speed of `olmo_eqx.generate` (KV cache) on this machine's default device.

    python scripts/bench_generate.py [--model olmo3_tiny] [--batch 1 8] [--prompt 32] [--new 256]

Decode tokens/s = new tokens of all rows / (time of prompt + N new - time of prompt + 1 new),
both after compilation, so the prefill and the first token cancel out. Random weights: speed
does not depend on them.
"""

import argparse
import time

import jax
import numpy as np

import olmo_eqx


def timed(fn, repeats: int = 3) -> float:
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo3_tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=256)
    args = parser.parse_args()
    config = olmo_eqx.get_model_config(args.model)
    model = olmo_eqx.OLMo(config, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    print(f"{args.model}: {olmo_eqx.count_params(config):,} parameters, window {config.sliding_window}, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
    for batch in args.batch:
        prompts = rng.integers(2, config.vocab_size, size=(batch, args.prompt)).tolist()
        one = timed(lambda: olmo_eqx.generate(model, prompts, 1))
        many = timed(lambda: olmo_eqx.generate(model, prompts, args.new + 1))
        rate = batch * args.new / (many - one)
        print(f"batch {batch}: prompt {args.prompt} + {args.new} new tokens: prefill+1 {one * 1e3:.1f} ms, "
              f"decode {rate:,.0f} tokens/s ({(many - one) / args.new * 1e3:.2f} ms per step)")


if __name__ == "__main__":
    main()
