"""Held-out loss, perplexity and bits per byte per named set (domain), and the KL divergence
between two models on the same text.

Sets are token files in the model's vocabulary, cut into instances of `sequence_length`
tokens exactly as training's held-out evaluation cuts them (`olmo_eqx.data.HeldOutSet`): read
in order, position t predicts token t + 1, an instance's first token is never a target. So the
loss of the embedded corpus's whole held-out set over the first N batches equals the held-out
loss the training loop logs with the same batch size and `trainer.eval_batches=N`.

For the embedded default the held-out modules are also split into two domains by name:
`python-stdlib-heldout/tests` (test suites) and `python-stdlib-heldout/library`.
"""

import math
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from olmo_eqx.data.heldout import HeldOutSet, document_bounds, heldout_sets
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.token_files import DataFileError, TokenFile, write_token_file
from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.scoring import Scorer


def _module_domain(module: str) -> str:
    parts = module.split(".")
    return "tests" if any(p in ("test", "tests") or p.startswith("test_") for p in parts) else "library"


def embedded_domain_sets(corpus, sequence_length: int, vocab_size: int, work_dir: Path) -> list[HeldOutSet]:
    """The embedded held-out modules split into `tests` and `library` (token files in `work_dir`)."""
    tokens = np.concatenate([np.asarray(TokenFile(p, corpus.vocab_size).tokens) for p in corpus.heldout_files])
    modules = list(corpus.manifest.get("heldout_modules", []))
    bounds = document_bounds(tokens, corpus.eos_id)
    if len(modules) != len(bounds):
        return []  # an older cache without module names: no domain split
    parts: dict[str, list[np.ndarray]] = {}
    for module, (start, end) in zip(modules, bounds):
        parts.setdefault(_module_domain(module), []).append(tokens[start:end])
    sets = []
    for domain in sorted(parts):
        path = write_token_file(work_dir / f"heldout-{domain}.npy", np.concatenate(parts[domain]), corpus.vocab_size)
        source = source_from_paths(f"{corpus.heldout_source().label}/{domain}", [str(path)])
        dataset = InstanceDataset([source], sequence_length, vocab_size)
        if len(dataset):
            sets.append(HeldOutSet(source.label, dataset))
    return sets


def build_heldout_sets(
    named_globs: dict[str, str],
    data_source: str,
    data_heldout: dict[str, str],
    sequence_length: int,
    vocab_size: int,
    work_dir: Optional[Path] = None,
    domains: bool = True,
    data_root: Optional[str] = None,
    tokenizer: Optional[str] = None,
) -> list[HeldOutSet]:
    """The sets to evaluate: `named_globs` (name -> glob of token files) when given, else the
    run's own held-out data (`data.heldout`, name -> glob, under the names training logs them
    by; or the embedded corpus's split and its domains). Files may be URLs; a value ending in
    `.txt` is a mix manifest (OLMo-core's `olmo_core:v3-small-ppl-validation.txt`) under
    `data_root` with `tokenizer`, one set per label, as in training."""
    try:
        for globs in (named_globs, data_heldout):
            if globs:
                sources = []
                for name, glob in globs.items():
                    if glob.endswith(".txt"):
                        if not (data_root and tokenizer):
                            raise EvalError(f"held-out set {name}={glob!r} is a mix manifest: set data.data_root and data.tokenizer")
                        sources += read_mix(glob, data_root, tokenizer)
                    else:
                        sources.append(source_from_paths(name, glob))
                return heldout_sets(sources, sequence_length, vocab_size)
        if data_source != "embedded":
            return []
        from olmo_eqx.data.embedded import embedded_corpus

        corpus = embedded_corpus()
        if corpus.vocab_size > vocab_size:
            raise EvalError(
                f"the embedded corpus has {corpus.vocab_size} token ids but the model only {vocab_size}: "
                "give held-out token files in the model's vocabulary with stage.heldout={name: glob}"
            )
        sets = [corpus.heldout_set(sequence_length)]
        if domains:
            work_dir = Path(work_dir or tempfile.mkdtemp(prefix="olmo_eqx-heldout-"))
            sets += embedded_domain_sets(corpus, sequence_length, vocab_size, work_dir)
        return sets
    except DataFileError as e:
        raise EvalError(str(e)) from e


def _batches(heldout: HeldOutSet, batch_size: int, max_batches: Optional[int]):
    for j, batch in enumerate(heldout.batches(batch_size)):
        if max_batches is not None and j == max_batches:
            return
        ids = batch.input_ids
        targets = np.pad(ids[:, 1:], ((0, 0), (0, 1)))
        mask = np.pad(batch.loss_mask[:, 1:] > 0, ((0, 0), (0, 1)))
        yield ids, targets, mask


def evaluate_heldout(
    scorer: Scorer,
    model,
    heldout: HeldOutSet,
    batch_size: int,
    max_batches: Optional[int] = None,
    byte_lengths: Optional[np.ndarray] = None,
) -> dict:
    """{set, loss, perplexity, bpb, tokens, bytes} of `model` on the first `max_batches` batches."""
    ce = tokens = 0.0
    n_bytes = 0
    for ids, targets, mask in _batches(heldout, batch_size, max_batches):
        scores = scorer.score(model, ids, targets, mask)
        ce -= float(np.sum(scores.logprob, dtype=np.float64))
        tokens += float(np.sum(scores.count))
        if byte_lengths is not None:
            n_bytes += int(np.sum(byte_lengths[targets] * mask))
    loss = ce / max(tokens, 1.0)
    return {
        "set": heldout.name,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bpb": ce / math.log(2) / n_bytes if n_bytes else None,
        "tokens": int(tokens),
        "bytes": n_bytes if byte_lengths is not None else None,
    }


def evaluate_kl(
    scorer: Scorer, model_a, model_b, heldout: HeldOutSet, batch_size: int, max_batches: Optional[int] = None
) -> dict:
    """Mean token-level KL(p_a || p_b) in nats over the set's target tokens (and both losses)."""
    kl = ce_a = ce_b = tokens = 0.0
    for ids, targets, mask in _batches(heldout, batch_size, max_batches):
        sums = scorer.kl(model_a, model_b, ids, targets, mask)
        kl += float(np.sum(sums.kl, dtype=np.float64))
        ce_a += float(np.sum(sums.ce_a, dtype=np.float64))
        ce_b += float(np.sum(sums.ce_b, dtype=np.float64))
        tokens += float(np.sum(sums.count))
    n = max(tokens, 1.0)
    return {"set": heldout.name, "kl": kl / n, "loss_a": ce_a / n, "loss_b": ce_b / n, "tokens": int(tokens)}
