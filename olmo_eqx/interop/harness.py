"""An lm-evaluation-harness model: `--model olmo_eqx --model_args checkpoint=<run | step | HF dir>`.

    python -m olmo_eqx.interop.harness --model olmo_eqx --model_args checkpoint=runs/tiny --tasks hellaswag

`python -m olmo_eqx.interop.harness` is lm-eval's own command line (same arguments) with this model
registered first: lm-eval 0.4.x finds models only in its registry (`@register_model`) and has
no entry-point discovery, so the bare `lm_eval` command cannot see a model another package
defines. From Python, importing this module registers it:

    import lm_eval, olmo_eqx.interop.harness
    lm_eval.simple_evaluate(model="olmo_eqx", model_args="checkpoint=runs/tiny", tasks=[...])

Model args: `checkpoint` (required: what `checkpoint.load` accepts), `tokenizer` (a
tokenizer.json; default: found as the eval stage finds it), `batch_size` (rows per global
batch), `max_length` (default: the model's max_sequence_length), `max_gen_toks` (256),
`attention_impl`, `compute_dtype`.

The three request kinds reuse the eval stage's pieces: `loglikelihood` is OLMES's (and
lm-eval's) tokenisation and the eval stage's batched scorer (`score_requests`), so per request
it gives exactly the eval stage's numbers; `loglikelihood_rolling` cuts the text into lm-eval's
rolling windows (EOS first, every token predicted once, with as much context as fits) and scores
them with the same scorer; `generate_until` runs `olmo_eqx.generate` (KV cache) in batches.
"""

import sys
from typing import Optional

import jax
import numpy as np
from lm_eval.api.model import LM
from tqdm import tqdm

import lm_eval.models  # noqa: F401  (fills lm-eval's registry first: it loads it only when empty)
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from olmo_eqx.evaluation.downstream import score_encoded, score_requests
from olmo_eqx.errors import EvalError, RunError
from olmo_eqx.evaluation.requests import Encoded, Request
from olmo_eqx.evaluation.scoring import Scorer, round_batch_size
from olmo_eqx.interop.generate import generate
from olmo_eqx.infra.cluster import cluster_line, start_cluster
from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh


def _int(value, name: str) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EvalError(f"--model_args {name}={value!r}: expected an integer") from None


class OLMoEqxLM(LM):
    """A checkpoint of ours (or a local HF OLMo directory) as an lm-eval model, on every device."""

    def __init__(
        self,
        checkpoint: Optional[str] = None,
        tokenizer: Optional[str] = None,
        batch_size=16,
        max_length=None,
        max_gen_toks=256,
        attention_impl: str = "auto",
        compute_dtype: str = "float32",
        model=None,
        **unused,
    ):
        super().__init__()
        from olmo_eqx.config import compose_config
        from olmo_eqx.evaluation.run import load_subject

        cluster = start_cluster()
        self.mesh, self.rules = make_mesh(MeshConfig()), ShardingRules()
        if jax.process_index() == 0:  # stderr: lm-eval's own output is stdout
            print(cluster_line(cluster, self.mesh), file=sys.stderr, flush=True)
        self.scorer = Scorer(self.mesh, self.rules)
        # lm-eval passes batch_size "auto" or a string; a fixed size keeps compiled shapes few.
        requested = 16 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else _int(batch_size, "batch_size")
        self.batch_size = round_batch_size(requested, self.mesh, self.rules)
        if checkpoint is None:
            raise EvalError("--model_args checkpoint=<run dir | checkpoints dir | step dir | HF checkpoint dir> is required")
        overrides = [f"model.attention_impl={attention_impl}", f"model.compute_dtype={compute_dtype}"]
        subject = load_subject(str(checkpoint), None, tokenizer, compose_config(overrides), self.mesh, self.rules,
                               key="--model_args checkpoint")
        if subject.tokenizer is None:
            raise EvalError(f"{subject.name}: the model's tokenizer is unknown; add tokenizer=<tokenizer.json> to --model_args")
        self.subject, self.model, self.tokenizer = subject, subject.model, subject.tokenizer
        if self.tokenizer.eos_id is None:
            raise EvalError(f"{self.tokenizer.path}: lm-eval needs an EOS token (the prefix of empty contexts)")
        self.max_length = _int(max_length, "max_length") or self.model.config.max_sequence_length
        self.max_gen_toks = _int(max_gen_toks, "max_gen_toks")

    # lm-eval's names for what it asks of a model --------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text])[0]

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # The three request kinds -----------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token is the argmax)."""
        ours = [Request(i, 0, 0, *r.args) for i, r in enumerate(requests)]
        scores, _ = score_requests(self.scorer, self.model, self.tokenizer, ours, self.batch_size, self.max_length)
        return [(float(lp), bool(g)) for lp, g in zip(scores.logprob, scores.greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p of every token of each text, EOS first, in lm-eval's rolling windows."""
        windows, owner = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.eot_token_id, self.max_length, 1)):
                windows.append(Encoded(list(context), list(predicted)))
                owner.append(i)
        scores, _ = score_encoded(self.scorer, self.model, windows, self.batch_size, self.max_length)
        totals = np.zeros(len(requests), np.float64)
        np.add.at(totals, np.asarray(owner, np.int64), scores.logprob)
        return [float(t) for t in totals]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Completions, cut before the first `until` string; batched per generation setting."""
        results: list[Optional[str]] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sampled = bool(kwargs.pop("do_sample", False)) and float(kwargs.get("temperature", 1.0) or 0.0) > 0
            temperature = float(kwargs.pop("temperature", 1.0) or 0.0) if sampled else 0.0
            key = (max_new, temperature, _int(kwargs.pop("top_k", None), "top_k"),
                   None if kwargs.get("top_p") is None else float(kwargs.pop("top_p")))
            groups.setdefault(key, []).append(i)
            settings.append(until)
        for (max_new, temperature, top_k, top_p), members in groups.items():
            for start in tqdm(range(0, len(members), self.batch_size), disable=disable_tqdm, desc="generate_until"):
                batch = members[start:start + self.batch_size]
                contexts = [requests[i].args[0] for i in batch]
                # Keep the right end of long prompts so prompt + completion fits max_length.
                keep = max(self.max_length - max_new, 1)
                prompts = [(ids or [self.eot_token_id])[-keep:] for ids in self.tokenizer.encode_batch(contexts)]
                new = generate(self.model, prompts, max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                               key=jax.random.key(start), stop_ids=[self.eot_token_id], mesh=self.mesh, rules=self.rules)
                for i, tokens in zip(batch, new):
                    text = self.tok_decode(tokens)
                    for stop in settings[i]:
                        if stop and stop in text:
                            text = text[: text.index(stop)]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results


# Registered once: `python -m olmo_eqx.interop.harness` runs this file as __main__, and anything it
# imports may import it again as olmo_eqx.interop.harness (lm-eval refuses a second, different target).
if "olmo_eqx" not in model_registry:
    model_registry.register("olmo_eqx", target=OLMoEqxLM)


def _refuse_a_missing_checkpoint(argv: list[str]) -> None:
    """Our model's `checkpoint=` is checked before lm-eval's command line starts: that indexes
    every task lm-eval ships before it builds the model (about 9 s), too long to wait for a
    one-line refusal of a typo'd path. The model checks it again (and reads it) as before."""
    import argparse

    from olmo_eqx.checkpoint.paths import CheckpointNotFoundError, resolve_checkpoint

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    parser.add_argument("--model_args")
    known, _ = parser.parse_known_args(argv)
    if known.model != "olmo_eqx" or not known.model_args:
        return
    args = dict(part.split("=", 1) for part in known.model_args.split(",") if "=" in part)
    checkpoint = args.get("checkpoint", "").strip()
    if not checkpoint or "://" in checkpoint:  # remote stores: left to the model, which retries
        return
    try:
        resolve_checkpoint(checkpoint, allow_hf=True)
    except CheckpointNotFoundError as e:
        raise EvalError(f"--model_args checkpoint={checkpoint}: {e}") from e


def main() -> None:
    """lm-eval's command line with `--model olmo_eqx` available; our model's refusals (a bad
    checkpoint, tokenizer or model arg) in one line, exit status 2."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "python -m olmo_eqx.interop.harness"
    try:
        _refuse_a_missing_checkpoint(sys.argv[1:])
        cli_evaluate()
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
