"""Which tokens a run trains and evaluates on: `data.source` and `data.heldout` turned into
datasets (the embedded corpus, an OLMo-core mix manifest, or a glob of token files), and how
its batches mark documents (`data.document_masking`)."""

from olmo_eqx.config import DataConfig
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.heldout import HeldOutSet, heldout_sets
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.token_files import DataFileError


def build_datasets(data: DataConfig, vocab_size: int) -> tuple[InstanceDataset, list[HeldOutSet]]:
    """The training instances and the named held-out sets of `data`."""
    seq = data.sequence_length
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
            sources = read_mix(data.source, data.data_root, data.tokenizer)
        else:
            sources = [source_from_paths("train", data.source)]
        train = InstanceDataset(sources, seq, vocab_size, filter_repeated_ngrams=data.filter_repeated_ngrams)
    if data.heldout:
        heldout = heldout_sets([source_from_paths(name, paths) for name, paths in data.heldout.items()], seq, vocab_size)
    return train, heldout


DOLMA2_EOS = 100257  # OLMo 3's tokenizer (allenai/dolma2-tokenizer)


def document_options(data: DataConfig) -> dict:
    """How batches mark documents (`global_batch_arrays` keywords): nothing unless document masking."""
    if not data.document_masking:
        return {}
    eos = data.eos_token_id
    if eos is None:
        eos = embedded_corpus().eos_id if data.source == "embedded" else DOLMA2_EOS
    return {"eos_id": eos, "reset_positions": data.reset_positions_per_document}
