"""The data pipeline: OLMo-core token files and mixes, a step-indexed sampler, held-out sets,
an integrity guard, the embedded default corpus and a tokenize tool. See docs/data.md."""

from olmo_eqx.data.embedded import EmbeddedCorpus, embedded_corpus
from olmo_eqx.data.guard import AuditReport, RepeatError, RepeatGuard
from olmo_eqx.data.heldout import HeldOutSet, heldout_sets, split_train_heldout
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import Batch, DataLoader, Prefetcher, global_batch_arrays, to_global_array
from olmo_eqx.data.mixes import Source, read_mix, source_from_paths
from olmo_eqx.data.sampler import LoaderState, StepSampler
from olmo_eqx.data.token_files import DataFileError, TokenFile, token_dtype_for_vocab, write_token_file

__all__ = [
    "AuditReport",
    "Batch",
    "DataFileError",
    "DataLoader",
    "EmbeddedCorpus",
    "HeldOutSet",
    "InstanceDataset",
    "LoaderState",
    "Prefetcher",
    "RepeatError",
    "RepeatGuard",
    "Source",
    "StepSampler",
    "TokenFile",
    "embedded_corpus",
    "global_batch_arrays",
    "heldout_sets",
    "read_mix",
    "source_from_paths",
    "split_train_heldout",
    "to_global_array",
    "token_dtype_for_vocab",
    "write_token_file",
]
