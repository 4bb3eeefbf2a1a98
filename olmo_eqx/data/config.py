"""The data group of the run config (`data.*`): which tokens to train on and how they are cut
and ordered. `olmo_eqx.config` assembles it with the other groups into `Config`."""

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass(frozen=True)
class DataConfig:
    """Which tokens to train on and how they are cut and ordered (docs/olmo3.md section 4)."""

    # "embedded": the corpus shipped with the package (Python stdlib source, 4096-token BPE).
    # Otherwise an OLMo-core mix manifest (.txt; needs data_root and tokenizer) or a glob of
    # token files.
    source: str = "embedded"
    data_root: Optional[str] = None
    tokenizer: Optional[str] = None
    # A mix manifest's lines are read under data_root only; true lets a line leave it (`../x.npy`,
    # an absolute local path) on purpose.
    allow_outside_root: bool = False
    # Named held-out sets, name -> token files (a path or glob), each evaluated on its own
    # (per-domain held-out loss). Empty with the embedded source: its held-out split.
    heldout: dict[str, str] = field(default_factory=dict)
    # A held-out file that is also a training file (the same real file, or a copy) is refused:
    # its loss is training loss. true allows it on purpose (a "train sample" set).
    allow_heldout_in_training: bool = False
    # The token files' dtype (they have no header); null: OLMo-core's rule, uint16 below 65536
    # ids, else uint32. A file whose first page shows the other dtype is refused either way.
    token_dtype: Optional[Literal["uint16", "uint32"]] = None
    sequence_length: int = 256
    global_batch_size: int = 8
    seed: int = 34521
    # Zero the loss of instances with >= 32 repeats of an n-gram (OLMo 3's instance filter).
    filter_repeated_ngrams: bool = False
    # Intra-document masking (OLMo 3 stage 3): tokens attend only within their document,
    # documents split after each EOS token. RoPE positions keep running across documents
    # (as in the 2025 OLMo 3 runs) unless reset_positions_per_document.
    document_masking: bool = False
    reset_positions_per_document: bool = False
    # The EOS id that ends documents; None: the embedded corpus' own, else dolma2's 100257.
    eos_token_id: Optional[int] = None
    # Token files at URLs (http(s)://, s3://, gs://; docs/data.md "Remote token files"): a
    # transient failure (5xx, timeout, reset) is retried up to remote_attempts times in all,
    # after jittered backoffs doubling from remote_backoff_s; each request waits at most
    # remote_timeout_s (a wall-clock deadline: headers and body); remote_concurrency range requests
    # are kept in flight per process.
    remote_attempts: int = 8
    remote_backoff_s: float = 0.1
    remote_timeout_s: float = 60.0
    remote_concurrency: int = 64
    # Batches read ahead of the train step (each one a local batch of int32 tokens in memory).
    prefetch_batches: int = 2

    def __post_init__(self):
        if self.sequence_length < 2:
            raise ValueError(f"sequence_length={self.sequence_length} must be >= 2")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size={self.global_batch_size} must be >= 1")
        if self.remote_attempts < 1 or self.remote_concurrency < 1 or self.prefetch_batches < 1:
            raise ValueError("data.remote_attempts, data.remote_concurrency and data.prefetch_batches must be >= 1")
        if self.reset_positions_per_document and not self.document_masking:
            raise ValueError("reset_positions_per_document=true needs document_masking=true")
