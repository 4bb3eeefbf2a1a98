"""Which tokens a run trains and evaluates on: `data.source` and `data.heldout` turned into
datasets (the embedded corpus, an OLMo-core mix manifest, or a glob of token files), and how
its batches mark documents (`data.document_masking`)."""

from pathlib import Path
from typing import Optional

from olmo_eqx.data.config import DataConfig
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.heldout import HeldOutSet, heldout_sets
from olmo_eqx.data.instances import InstanceDataset, sample_digest
from olmo_eqx.data.mixes import read_mix, real_file, source_from_paths
from olmo_eqx.data.remote import RemoteReader, RetryPolicy, SizeCache
from olmo_eqx.data.token_files import DataFileError


def remote_reader(data: DataConfig) -> RemoteReader:
    """The reader of `data`'s token files at URLs, with its retry settings."""
    policy = RetryPolicy(attempts=data.remote_attempts, backoff_s=data.remote_backoff_s, timeout_s=data.remote_timeout_s)
    return RemoteReader(policy, concurrency=data.remote_concurrency)


def build_datasets(
    data: DataConfig, vocab_size: int, size_cache: Optional[Path] = None
) -> tuple[InstanceDataset, list[HeldOutSet]]:
    """The training instances and the named held-out sets of `data`.

    size_cache: a run's `data_sizes.json` (`SizeCache`): the sizes of remote files found there
    are not requested again; `remote_sizes(...)` gives what to store back.
    """
    seq = data.sequence_length
    # One reader for training and held-out files: their requests share its threads and counts.
    reader, known = remote_reader(data), SizeCache(size_cache).load()
    heldout = []
    if data.source == "embedded":
        corpus = embedded_corpus()
        if corpus.vocab_size > vocab_size:
            raise DataFileError(
                f"the embedded corpus has {corpus.vocab_size} token ids but model.vocab_size is {vocab_size}; "
                f"use a model with vocab_size >= {corpus.vocab_size} (e.g. model=olmo3_tiny)"
            )
        train = corpus.train_dataset(seq, filter_repeated_ngrams=data.filter_repeated_ngrams)
        if not data.heldout:
            heldout = [corpus.heldout_set(seq)]
    else:
        if data.source.endswith(".txt"):
            if not (data.data_root and data.tokenizer):
                raise DataFileError(f"data.source={data.source!r} is a mix manifest: set data.data_root and data.tokenizer")
            sources = read_mix(data.source, data.data_root, data.tokenizer, allow_outside_root=data.allow_outside_root)
        else:
            sources = [source_from_paths("train", data.source)]
        train = InstanceDataset(sources, seq, vocab_size, dtype=data.token_dtype, filter_repeated_ngrams=data.filter_repeated_ngrams,
                                reader=reader, sizes=known)
    if data.heldout:
        named = []
        for name, paths in data.heldout.items():
            if paths.endswith(".txt"):  # a manifest (OLMo-core's ppl-validation mixes): one set per label
                if not (data.data_root and data.tokenizer):
                    raise DataFileError(f"data.heldout.{name}={paths!r} is a mix manifest: set data.data_root and data.tokenizer")
                named += read_mix(paths, data.data_root, data.tokenizer, allow_outside_root=data.allow_outside_root)
            else:
                named.append(source_from_paths(name, paths))
        heldout = heldout_sets(named, seq, vocab_size, dtype=data.token_dtype, reader=reader, sizes=known)
        if not data.allow_heldout_in_training:
            refuse_heldout_in_training(train, heldout)
    return train, heldout


def refuse_heldout_in_training(train: InstanceDataset, heldout: list[HeldOutSet]) -> None:
    """Refuse a held-out file that is also a training file: held-out loss would then be training
    loss, blind to memorisation (the one signal the OLMo 3 reproduction's repeat bug gave).

    Compared by real file (links resolved; URLs as given) and, for local files of one byte size,
    by a digest of sampled pages (a copy of a training file), which reads a few pages only.
    """
    by_real = {real_file(f.path): f for f in train.files}
    by_size: dict[int, list] = {}
    for f in train.files:
        if not f.remote:
            by_size.setdefault(f.size, []).append(f)
    for heldout_set in heldout:
        for f in heldout_set.dataset.files:
            same = by_real.get(real_file(f.path))
            if same is None and not f.remote and by_size.get(f.size):
                digest = sample_digest(f)
                same = next((t for t in by_size[f.size] if sample_digest(t) == digest), None)
            if same is not None:
                raise DataFileError(
                    f"held-out set {heldout_set.name!r} reads {f.path}, which is the training file {same.path} "
                    "(or a copy of it): its loss would be training loss; give held-out files that are not trained on "
                    "(olmo_eqx.data.heldout.split_train_heldout splits files by document), or set "
                    "data.allow_heldout_in_training=true if a training sample is meant"
                )


def remote_sizes(train: InstanceDataset, heldout: list[HeldOutSet]) -> dict[str, int]:
    """The sizes of every remote file of a run (what its `SizeCache` stores)."""
    sizes = dict(train.remote_sizes)
    for heldout_set in heldout:
        sizes.update(heldout_set.dataset.remote_sizes)
    return sizes


DOLMA2_EOS = 100257  # OLMo 3's tokenizer (allenai/dolma2-tokenizer)


def check_against_model(data: DataConfig, vocab_size: int, max_sequence_length: int) -> None:
    """Refuse data settings the model cannot honour (`DataFileError`), before anything runs.

    An EOS id outside the vocabulary never occurs in the tokens, so document masking would find
    no boundary and silently attend across every document; a sequence longer than the model's
    `max_sequence_length` runs positions past what the model (and its RoPE scaling) was built for.
    """
    if data.sequence_length > max_sequence_length:
        raise DataFileError(
            f"data.sequence_length={data.sequence_length} is above the model's max_sequence_length="
            f"{max_sequence_length}: set data.sequence_length<={max_sequence_length}, or a model with a longer "
            "context (model.max_sequence_length=..., or +stage=long_context to extend it with YaRN)"
        )
    options = document_options(data)
    if options and not 0 <= options["eos_id"] < vocab_size:
        given = "data.eos_token_id" if data.eos_token_id is not None else "the default EOS id (dolma2's)"
        raise DataFileError(
            f"{given}={options['eos_id']} is outside the model's vocabulary [0, {vocab_size}) while "
            "data.document_masking=true: no document boundary would ever be found; set data.eos_token_id to "
            "the tokenizer's EOS id"
        )


def document_options(data: DataConfig) -> dict:
    """How batches mark documents (`global_batch_arrays` keywords): nothing unless document masking."""
    if not data.document_masking:
        return {}
    eos = data.eos_token_id
    if eos is None:
        eos = embedded_corpus().eos_id if data.source == "embedded" else DOLMA2_EOS
    return {"eos_id": eos, "reset_positions": data.reset_positions_per_document}
