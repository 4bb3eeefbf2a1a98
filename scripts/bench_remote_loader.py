"""How fast olmo_eqx reads token files over HTTP, per process, and how long a 950-file mix takes
to start with and without the run's size cache. Prints figures; it is not a test.

    python scripts/bench_remote_loader.py                       # 50 ms per request, 1% 503s
    python scripts/bench_remote_loader.py --latency 0.1 --error-rate 0.05 --seconds 20

A `tests/rangeserver.py` server (in its own process, so its threads do not share this one's
interpreter lock) serves uint32 token files from a temporary directory on 127.0.0.1, adding
`--latency` seconds to every request and answering `--error-rate` of them with 503. The
loader reads batches of `--batch` sequences of `--seq` tokens exactly as the train loop does
(`DataLoader` + `Prefetcher` with `--prefetch` batches read at once), and the figure is
sequences handed out per second. Memory held by the loader is bounded by
(prefetch queue + batches being read) x batch x seq x 8 bytes (int32 ids + float32 mask),
printed with the figures.
"""

import argparse
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's range server

from olmo_eqx.data.instances import InstanceDataset  # noqa: E402
from olmo_eqx.data.loader import DataLoader, Prefetcher  # noqa: E402
from olmo_eqx.data.mixes import source_from_paths  # noqa: E402
from olmo_eqx.data.remote import RemoteReader, RetryPolicy  # noqa: E402
from olmo_eqx.data.token_files import write_token_file  # noqa: E402

VOCAB = 100278  # dolma2: uint32 files, as the official mix


def serve(root: str, latency: float, error_rate: float, pipe) -> None:
    from rangeserver import RangeServer

    server = RangeServer(Path(root), latency_s=latency, error_rate=error_rate)
    pipe.send(server.url)
    pipe.recv()  # until the benchmark is done
    pipe.send((server.requests, server.errors_sent))


def start_server(root: Path, latency: float, error_rate: float):
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.Process(target=serve, args=(str(root), latency, error_rate, theirs), daemon=True)
    process.start()
    return ours.recv(), ours, process


def throughput(args, root: Path) -> None:
    rng = np.random.default_rng(0)
    tokens_per_file = args.seq * 256 + 17
    for i in range(args.train_files):
        write_token_file(root / "train" / f"part-{i:03d}.npy", rng.integers(0, VOCAB, tokens_per_file), VOCAB)
    url, pipe, process = start_server(root, args.latency, args.error_rate)
    urls = [f"{url}/train/part-{i:03d}.npy" for i in range(args.train_files)]
    reader = RemoteReader(RetryPolicy(attempts=8, backoff_s=0.1), concurrency=args.concurrency)
    dataset = InstanceDataset([source_from_paths("train", urls)], args.seq, VOCAB, reader=reader)
    loader = DataLoader(dataset, args.batch, seed=1)
    served, started = 0, None
    with Prefetcher(loader, depth=args.prefetch, workers=args.prefetch) as batches:
        while True:
            batch = next(batches)
            if started is None:  # from the first batch on: the pipeline is full
                started, stats0 = time.perf_counter(), dict(reader.stats)
                continue
            served += len(batch.instance_ids)
            if time.perf_counter() - started >= args.seconds:
                break
    elapsed = time.perf_counter() - started
    pipe.send("done")
    requests, errors = pipe.recv()
    process.join()
    retries = reader.stats["data_retries"] - stats0["data_retries"]
    held = (2 * args.prefetch) * args.batch * args.seq * 8  # queue + batches being read
    print(f"throughput: {served / elapsed:,.0f} sequences/s of {args.seq} tokens per process "
          f"({served * args.seq / elapsed / 1e6:.2f}M tokens/s) | {args.latency * 1e3:.0f} ms per request, "
          f"{args.error_rate:.0%} answered 503 | batch {args.batch}, {args.prefetch} batches read at once, "
          f"{args.concurrency} requests in flight | {retries} retries in {elapsed:.1f}s "
          f"(server: {requests} requests, {errors} 503s) | loader memory bound {held / 2**20:.0f} MiB")


def startup(args, root: Path) -> None:
    """InstanceDataset over a `--mix-files` mix: sizes fetched (no cache) or given (the cache)."""
    rng = np.random.default_rng(1)
    # Above 8 pages (32 KiB), so the content sample is 8 range reads per file, as for real files.
    for i in range(args.mix_files):
        write_token_file(root / "mix" / f"part-{i:04d}.npy", rng.integers(0, VOCAB, 12 * 1024), VOCAB)
    url, pipe, process = start_server(root, args.latency, 0.0)
    urls = [f"{url}/mix/part-{i:04d}.npy" for i in range(args.mix_files)]
    timings = {}
    sizes = None
    for kind in ("without the size cache", "with the size cache"):
        reader = RemoteReader(RetryPolicy(), concurrency=args.concurrency)
        begun = time.perf_counter()
        dataset = InstanceDataset([source_from_paths("mix", urls)], args.seq, VOCAB, reader=reader, sizes=sizes)
        timings[kind] = (time.perf_counter() - begun, dict(reader.stats))
        sizes = dataset.remote_sizes
        reader.close()
    pipe.send("done")
    pipe.recv()
    process.join()
    for kind, (seconds, stats) in timings.items():
        print(f"start-up of a {args.mix_files}-file mix {kind}: {seconds:.1f}s ({stats['data_requests']} requests: "
              f"sizes and 8 content-sample pages per file, {args.latency * 1e3:.0f} ms each, "
              f"{args.concurrency} in flight)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds added to every request")
    parser.add_argument("--error-rate", type=float, default=0.01, help="fraction of requests answered 503")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to measure throughput")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64, help="sequences per batch (this process's rows)")
    parser.add_argument("--prefetch", type=int, default=4, help="batches read at once (data.prefetch_batches)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (data.remote_concurrency)")
    parser.add_argument("--train-files", type=int, default=8)
    parser.add_argument("--mix-files", type=int, default=950)
    parser.add_argument("--skip-startup", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="olmo_eqx_bench_"))
    try:
        throughput(args, root)
        if not args.skip_startup:
            startup(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
