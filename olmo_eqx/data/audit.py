"""Audit the data order before a run: simulate P processes over S steps.

    python -m olmo_eqx.data.audit                          # the embedded corpus
    python -m olmo_eqx.data.audit --files 'tokens/*.npy' --vocab-size 100278 \
        --heldout 'val/*.npy' --eos-id 100257 --batch-size 512 --sequence-length 8192
    python -m olmo_eqx.data.audit --mix OLMo-mix.txt --data-root /data --tokenizer allenai/dolma2-tokenizer ...

For each process count it builds that many `DataLoader`s (the trainer's code path), reads
their instance ids for S steps (default: one epoch and one step, at most 10000) and checks
that every step's rows, joined in process order, are the one-process global batch, that no
instance repeats within an epoch, and that complete epochs leave no gaps. With held-out
files it also checks that no held-out document occurs in the training files. Exit status
1 on any problem.
"""

import argparse
import sys
from collections.abc import Sequence

from olmo_eqx.data.guard import AuditReport, audit_stream
from olmo_eqx.data.heldout import heldout_overlap
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.token_files import DataFileError, TokenFile

MAX_DEFAULT_STEPS = 10_000


def loader_streams(dataset: InstanceDataset, global_batch_size: int, seed: int):
    """A stream factory reading instance ids exactly as `DataLoader` serves them."""

    def streams(process_index: int, process_count: int):
        loader = DataLoader(dataset, global_batch_size, seed, process_index, process_count, guard=False)
        step = 0
        while True:
            yield loader.local_instance_ids(step)
            step += 1

    return streams


def audit_loader(
    dataset: InstanceDataset, global_batch_size: int, seed: int, process_counts: Sequence[int], steps: int | None = None
) -> list[AuditReport]:
    """One report per process count for the real loader over `dataset`."""
    streams = loader_streams(dataset, global_batch_size, seed)
    reference = DataLoader(dataset, global_batch_size, seed, guard=False).sampler
    if steps is None:
        steps = min(reference.steps_per_epoch + 1, MAX_DEFAULT_STEPS)
    return [audit_stream(streams, reference, p, steps) for p in process_counts]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m olmo_eqx.data.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="*", help="training token files or globs (default: the embedded corpus)")
    parser.add_argument("--mix", help="an OLMo-core mix manifest instead of --files")
    parser.add_argument("--data-root", default=".", help="root the mix's relative paths start from")
    parser.add_argument("--tokenizer", default="allenai/dolma2-tokenizer", help="replaces {TOKENIZER} in the mix")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size (required with --files/--mix)")
    parser.add_argument("--heldout", nargs="*", help="held-out token files or globs to check for overlap")
    parser.add_argument("--eos-id", type=int, help="EOS id that ends documents (required with --heldout)")
    parser.add_argument("--sequence-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=24, help="global batch size in instances")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", default="1,2,3,4", help="comma-separated process counts to simulate")
    parser.add_argument("--steps", type=int, help="steps to simulate (default: one epoch + 1, at most 10000)")
    args = parser.parse_args(argv)

    try:
        if args.files or args.mix:
            if args.vocab_size is None:
                parser.error("--vocab-size is required with --files or --mix")
            if args.mix:
                sources = read_mix(args.mix, args.data_root, args.tokenizer)
            else:
                sources = [source_from_paths("train", args.files)]
            vocab_size, eos_id = args.vocab_size, args.eos_id
            heldout_paths = list(source_from_paths("heldout", args.heldout).paths) if args.heldout else []
        else:
            from olmo_eqx.data.embedded import embedded_corpus

            corpus = embedded_corpus()
            sources, vocab_size, eos_id = [corpus.train_source()], corpus.vocab_size, corpus.eos_id
            heldout_paths = list(corpus.heldout_files)
        dataset = InstanceDataset(sources, args.sequence_length, vocab_size)
        counts = [int(p) for p in args.processes.split(",")]
        for p in counts:
            if args.batch_size % p:
                parser.error(f"--batch-size {args.batch_size} is not divisible by {p} processes")
        print(f"auditing {dataset} (fingerprint {dataset.fingerprint()}), global batch {args.batch_size}, seed {args.seed}")
        reports = audit_loader(dataset, args.batch_size, args.seed, counts, args.steps)
        overlap = 0
        if heldout_paths:
            if eos_id is None:
                parser.error("--eos-id is required with --heldout")
            overlap = heldout_overlap(dataset.files, [TokenFile(p, vocab_size) for p in heldout_paths], eos_id)
    except DataFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for report in reports:
        print(report.summary())
    if heldout_paths:
        print(f"{'OK' if not overlap else 'PROBLEM'}: {overlap} held-out document(s) also in training data")
    return 0 if all(r.ok for r in reports) and not overlap else 1


if __name__ == "__main__":
    sys.exit(main())
