"""Stages are plugins: a third party's stage, registered through its own distribution's entry
points, is listed, configured and run like the built-in ones."""

import json
import textwrap

import pytest

from olmo_eqx.stages import StageError, load_stage, stage_entry_points
from olmo_eqx.config import ConfigError, stage_settings

from clihelp import olmo_eqx

STAGE_MODULE = '''
"""A third-party stage, as another package would ship it."""

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HelloSettings:
    greeting: str = "hello"
    repeat: int = 1
    write: bool = True  # false: only return the summary (README's example stage)

    def __post_init__(self):
        if self.repeat < 1:
            raise ValueError(f"repeat={self.repeat} must be >= 1")


class Hello:
    """Say hello into the run directory (a third-party test stage)."""

    config_class = HelloSettings

    def run(self, config, run_dir):
        summary = {"said": " ".join([config.stage.greeting] * config.stage.repeat), "model": config.model.name}
        if config.stage.write:
            (Path(run_dir) / "summary.json").write_text(json.dumps(summary))
            print("hello stage ran:", summary["said"])
        return summary
'''


@pytest.fixture(scope="module")
def third_party(tmp_path_factory):
    """A directory that, on PYTHONPATH, installs the distribution `hello-stage` with one stage."""
    root = tmp_path_factory.mktemp("site")
    (root / "hello_stage.py").write_text(STAGE_MODULE)
    dist = root / "hello_stage-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-stage\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [olmo_eqx.stages]
            hello = hello_stage:Hello
            """
        )
    )
    return {"PYTHONPATH": str(root)}


def test_third_party_stage_is_listed(third_party):
    result = olmo_eqx(env=third_party)
    assert result.returncode == 0, result.stderr
    assert "hello" in result.stdout and "pretrain" in result.stdout
    assert "third-party test stage" in result.stdout


def test_third_party_stage_runs_with_its_own_settings(third_party, tmp_path):
    result = olmo_eqx("+stage=hello", "stage.greeting=hi", "stage.repeat=2", "model=olmo3_nano", f"hydra.run.dir={tmp_path}", env=third_party)
    assert result.returncode == 0, result.stderr
    assert "hello stage ran: hi hi" in result.stdout
    assert json.loads((tmp_path / "summary.json").read_text()) == {"said": "hi hi", "model": "olmo3_nano"}


def test_third_party_stage_settings_are_checked(third_party, tmp_path):
    # Hydra checks them against the stage's dataclass: typos and wrong types name the key.
    for override, key in [("stage.greetin=hi", "stage.greetin"), ("stage.repeat=many", "stage.repeat")]:
        result = olmo_eqx("+stage=hello", override, f"hydra.run.dir={tmp_path}", env=third_party)
        assert result.returncode != 0
        assert key in result.stderr, result.stderr
        assert not (tmp_path / "summary.json").exists()
    # Even a forced (+) key is refused by the stage's own check before it runs.
    result = olmo_eqx("+stage=hello", "+stage.greetin=hi", f"hydra.run.dir={tmp_path}", env=third_party)
    assert result.returncode == 2 and "stage.greetin" in result.stderr


def test_registry_in_process():
    assert "pretrain" in stage_entry_points()
    stage = load_stage("pretrain")
    assert callable(stage.run)
    assert stage_settings(stage, "pretrain", {}) == {}
    with pytest.raises(ConfigError, match="stage.lr"):
        stage_settings(stage, "pretrain", {"lr": 1})
    with pytest.raises(StageError, match="no stage named 'nope'.*pretrain"):
        load_stage("nope")


def test_a_returned_summary_is_printed_and_saved(third_party, tmp_path):
    # A stage that only returns its summary, as README's example: the command prints and keeps it.
    result = olmo_eqx("+stage=hello", "stage.write=false", "stage.repeat=2", f"hydra.run.dir={tmp_path}", env=third_party)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["said"] == "hello hello" and f"summary: {tmp_path / 'summary.json'}" in result.stdout
    assert '"said": "hello hello"' in result.stdout


def test_sweep_isolates_jobs_and_reports_a_failed_one(third_party, tmp_path):
    # A value refused by the stage's check and one of the wrong type fail their own jobs only.
    result = olmo_eqx("-m", "+stage=hello", "stage.repeat=0,many,2", f"hydra.sweep.dir={tmp_path}", env=third_party)
    assert result.returncode == 1  # the sweep reports its failure, after running every job
    assert "stage: repeat=0 must be >= 1" in result.stderr
    assert "stage.repeat='many' must be of type int" in result.stderr
    assert json.loads((tmp_path / "2" / "summary.json").read_text())["said"] == "hello hello"
    table = result.stdout[result.stdout.index("Sweep summary"):]
    assert "stage.repeat=0" in table and "stage.repeat=many" in table and table.count("failed") == 2
    assert "stage.repeat=2" in table and "ok" in table


def test_sweep_with_a_typo_is_refused_whole_in_one_line(third_party, tmp_path):
    # An unknown key fails every job alike: refused before any starts, naming the key.
    result = olmo_eqx("-m", "+stage=hello", "stage.repeet=1,2", f"hydra.sweep.dir={tmp_path}", env=third_party)
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown key stage.repeet") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "0").exists()
