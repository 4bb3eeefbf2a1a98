"""`python -m olmo_eqx +stage=generate checkpoint.load=<run | checkpoints | step | HF dir> stage.prompts=[...]`.

Completes each prompt with `olmo_eqx.generate` (KV cache; greedy unless stage.temperature > 0),
decoded with the checkpoint's tokenizer (found as the eval stage finds it: stage.tokenizer, the
HF directory's, or the training data's, e.g. the embedded corpus's), printed (and kept in
`generate.log`) and written to `generations.json` and `summary.json` in the run directory.
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config

# Each ends inside a line or on its indent: the tokenizer merges a newline with the indent after
# it ("\n        " is one token), so a prompt ending on a lone "\n" asks for a token the model
# rarely saw there, and a small model answers with newlines.
DEFAULT_PROMPTS = (
    "class TestList(unittest.TestCase):\n\n    def test_append(self):\n        self.assert",
    "import os\n\n\ndef ",
    "class Stack:\n    ",
)


@dataclass(frozen=True)
class GenerateSettings:
    """What `+stage=generate` completes, and how."""

    # Prompts (text; "\n" written as \n on the command line is a newline); an empty prompt
    # starts from the EOS token.
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    # A file of prompts, added after `prompts`: .jsonl (a JSON string or {"prompt": ...} per
    # line) or text (one prompt per line, "\n" written as \n).
    prompts_file: Optional[str] = None
    max_new_tokens: int = 64
    # 0: greedy. Otherwise sample from softmax(logits / temperature), cut by top_k / top_p.
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    # Stop a completion at the tokenizer's EOS token.
    stop_at_eos: bool = True
    # The model's tokenizer.json; null: the HF directory's, else the training data's (embedded).
    tokenizer: Optional[str] = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1")


def read_prompts(path: str) -> list[str]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"stage.prompts_file={path} does not exist; give a .jsonl or a text file of prompts")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if file.suffix != ".jsonl":
        return [line.replace("\\n", "\n") for line in lines]
    prompts = []
    for number, line in enumerate(lines, start=1):
        row = json.loads(line)
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str):
            raise ValueError(f"{file}:{number}: expected a JSON string or {{\"prompt\": ...}}, got {line[:80]!r}")
        prompts.append(prompt)
    return prompts


class Generate:
    """Complete prompts with a checkpoint (ours or HF), KV-cached; prints and writes generations.json."""

    description = "Complete stage.prompts with checkpoint.load (ours or HF): KV-cached generation, greedy or sampled"
    config_class = GenerateSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.stages import StageError

        try:
            return self._run(config, Path(run_dir).resolve())
        except ValueError as e:  # a bad prompt file or sampling setting; EvalError is one too
            raise StageError(str(e)) from e

    def _run(self, config: Config, run_dir: Path) -> dict:
        import jax

        from olmo_eqx.config import stage_settings
        from olmo_eqx.errors import EvalError
        from olmo_eqx.evaluation.run import load_subject
        from olmo_eqx.interop.generate import check_prompt_lengths, generate
        from olmo_eqx.run.run_dir import RunDir
        from olmo_eqx.infra.cluster import cluster_line, start_cluster
        from olmo_eqx.sharding import ShardingRules, make_mesh

        settings = stage_settings(self, "generate", config.stage or {})
        if not config.checkpoint.load:
            raise EvalError("generate needs a model: checkpoint.load=<run dir | checkpoints dir | step dir | HF dir>")
        cluster = start_cluster()
        mesh, rules = make_mesh(config.mesh), ShardingRules()
        subject = load_subject(config.checkpoint.load, None, settings.tokenizer, config, mesh, rules)
        tokenizer = subject.tokenizer
        if tokenizer is None:
            raise EvalError(f"{subject.name}: the model's tokenizer is unknown; set stage.tokenizer=<tokenizer.json>")
        prompts = [p.replace("\\n", "\n") for p in settings.prompts]
        prompts += (read_prompts(settings.prompts_file) if settings.prompts_file else [])
        if not prompts:
            raise EvalError("no prompts: set stage.prompts=[...] or stage.prompts_file=<file>")
        if any(not p for p in prompts) and tokenizer.eos_id is None:
            raise EvalError("an empty prompt needs the tokenizer's EOS token to start from, and it has none")
        ids = [encoded or [tokenizer.eos_id] for encoded in tokenizer.encode_batch(prompts)]
        check_prompt_lengths([len(i) for i in ids], settings.max_new_tokens, subject.model.config.max_sequence_length)
        stop_ids = [tokenizer.eos_id] if settings.stop_at_eos and tokenizer.eos_id is not None else []
        started = time.perf_counter()
        new = generate(subject.model, ids, settings.max_new_tokens, temperature=settings.temperature,
                       top_k=settings.top_k, top_p=settings.top_p, key=jax.random.key(settings.seed),
                       stop_ids=stop_ids, mesh=mesh, rules=rules)
        seconds = time.perf_counter() - started
        completions = [
            {"prompt": prompt, "completion": tokenizer.decode(tokens), "prompt_tokens": len(prompt_ids),
             "new_tokens": len(tokens), "stopped": bool(tokens) and tokens[-1] in stop_ids}
            for prompt, prompt_ids, tokens in zip(prompts, ids, new)
        ]
        n_new = sum(c["new_tokens"] for c in completions)
        result = {
            "model": subject.name, "source": str(subject.location), "kind": subject.location.kind,
            "step": subject.location.step, "tokenizer": str(tokenizer.path), "settings": asdict(settings),
            "completions": completions, "new_tokens": n_new, "seconds": seconds,
            # Compilation included: a first call's figure, not the decode speed.
            "tokens_per_s": n_new / seconds if seconds else None,
        }
        with RunDir(run_dir, enabled=jax.process_index() == 0, log_name="generate.log") as out:
            out.print(cluster_line(cluster, mesh))
            out.print(f"generate: {subject.name} ({subject.location.kind}) | tokenizer {tokenizer.path} | "
                      f"{'greedy' if settings.temperature == 0 else f'temperature {settings.temperature}'} | "
                      f"{len(prompts)} prompt(s), up to {settings.max_new_tokens} new tokens")
            for c in completions:
                out.print(f"\n--- prompt ({c['prompt_tokens']} tokens) + completion ({c['new_tokens']} tokens"
                          f"{', stopped at EOS' if c['stopped'] else ''}) ---\n{c['prompt']}{c['completion']}")
            results = out.write_json("generations.json", result)
            out.print(f"\n{n_new} new tokens in {seconds:.1f}s (compilation included) | {results}")
            out.write_summary({"model": subject.name, "completions": len(completions), "new_tokens": n_new,
                               "seconds": seconds, "results": str(results)})
        return result
