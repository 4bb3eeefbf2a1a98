"""Inputs refused before Hydra makes a run dir (issue 50): a run dir name longer than the file
system allows, and a config file that is not plain YAML (a `!!python/...` tag, a syntax
error); each one line, exit status 2, no traceback, nothing left behind."""

import pytest

from clihelp import olmo_eqx


@pytest.mark.parametrize(
    "what, said",
    [
        ("long_name", "a name in this path is longer than the file system allows"),
        ("python_tag", "evil.yaml, line 2: could not determine a constructor for the tag"),
        ("bad_yaml", "evil.yaml, line 3 is not valid YAML"),
    ],
)
def test_a_long_run_dir_name_and_a_non_plain_yaml_file_are_one_line(tmp_path, what, said):
    model = tmp_path / "conf" / "model"
    model.mkdir(parents=True)
    run_dir = tmp_path / "runs" / ("a" * 300 if what == "long_name" else "run")
    body = {"python_tag": 'd_model: !!python/object/apply:os.system ["touch pwned"]\n',
            "bad_yaml": "d_model: [1, 2\n"}.get(what, "d_model: 64\n")
    (model / "evil.yaml").write_text("name: evil\n" + body)
    result = olmo_eqx(f"--config-dir={tmp_path / 'conf'}", "+stage=pretrain", "model=evil", f"hydra.run.dir={run_dir}",
                      cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], result.stderr
    if what == "python_tag":
        assert "remove the tag" in lines[0]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "pwned").exists()
