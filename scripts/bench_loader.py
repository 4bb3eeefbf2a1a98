"""Benchmark the data loader: tokens/s served, and the memory the order needs at 10^9 instances.

    python scripts/bench_loader.py                       # embedded corpus, olmo3_tiny-shaped batches
    python scripts/bench_loader.py --batch 64 --seq 1024 --seconds 5
    python scripts/bench_loader.py --files 'tokens/*.npy' --vocab-size 100278

The loader must serve at least 100x the tokens a training step consumes; `--step-rate` is
the train steps/s to compare against (olmo3_tiny on CPU: about 5-20).
"""

import argparse
import time
import tracemalloc

import numpy as np

from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader, Prefetcher
from olmo_eqx.data.mixes import source_from_paths
from olmo_eqx.data.permutation import FeistelPermutation
from olmo_eqx.data.sampler import StepSampler


def tokens_per_second(batches, seconds: float) -> tuple[float, int]:
    started, steps, tokens = time.perf_counter(), 0, 0
    while time.perf_counter() - started < seconds:
        batch = next(batches)
        tokens += batch.input_ids.size
        steps += 1
    return tokens / (time.perf_counter() - started), steps


def order_memory(n: int, batch: int) -> dict[str, int]:
    """Bytes the order needs for n instances: its state, and the peak while computing the last batch of an epoch."""
    tracemalloc.start()
    sampler = StepSampler(n, batch, seed=34521)
    ids = sampler.global_batch(sampler.steps_per_epoch - 1)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(np.unique(ids)) == batch
    permutation = FeistelPermutation(n, 34521)
    state = sum(k.nbytes for k in permutation._keys) + 3 * 8  # round keys + n, seed, half_bits
    return {"state_bytes": state, "peak_bytes_computing_a_batch": peak, "materialised_int64_bytes": 8 * n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="*", help="token files/globs (default: the embedded corpus)")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8, help="global batch size (olmo3_tiny: 8)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (olmo3_tiny: 256)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--step-rate", type=float, default=20.0, help="train steps/s to compare with")
    parser.add_argument("--filter", action="store_true", help="with the repeated n-gram instance filter")
    args = parser.parse_args()

    if args.files:
        dataset = InstanceDataset([source_from_paths("bench", args.files)], args.seq, args.vocab_size, filter_repeated_ngrams=args.filter)
    else:
        from olmo_eqx.data.embedded import embedded_corpus

        dataset = embedded_corpus().train_dataset(args.seq, filter_repeated_ngrams=args.filter)
    print(f"dataset: {dataset}, global batch {args.batch} x {args.seq}")
    need = 100 * args.batch * args.seq * args.step_rate
    print(f"target: 100 x {args.batch * args.seq} tokens/step x {args.step_rate:g} steps/s = {need:,.0f} tokens/s")

    plain, steps = tokens_per_second(iter(DataLoader(dataset, args.batch, seed=0)), args.seconds)
    print(f"DataLoader.next_batch (guard on): {plain:,.0f} tokens/s ({steps / args.seconds:,.0f} batches/s)")
    with Prefetcher(DataLoader(dataset, args.batch, seed=0), depth=4) as prefetcher:
        fetched, _ = tokens_per_second(prefetcher, args.seconds)
    print(f"Prefetcher (background thread):  {fetched:,.0f} tokens/s")
    print(f"verdict: {'OK' if min(plain, fetched) >= need else 'TOO SLOW'} ({min(plain, fetched) / need:.1f}x the target)")

    memory = order_memory(10**9, 512)
    print(
        "order for 10^9 instances (batch 512): "
        f"{memory['state_bytes']} bytes of state, peak {memory['peak_bytes_computing_a_batch']:,} bytes while "
        f"computing a batch, vs {memory['materialised_int64_bytes'] / 1e9:.0f} GB for a materialised int64 permutation"
    )
    print(f"run-time RepeatGuard bitmap at 10^9 instances: {10**9 // 8 / 1e6:.0f} MB per process (touched lazily)")


if __name__ == "__main__":
    main()
