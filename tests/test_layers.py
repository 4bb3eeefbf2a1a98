"""README.md's "Layout": the layers as import-linter checks them (pyproject.toml,
[tool.importlinter]; the contracts hold on this tree, and an upward import breaks them), and
the size bounds (no module over 600 lines, the `Checkpointer` class at most 300)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports` on the packages under `root`, with the config there
    (its report without colours in `stdout`)."""
    env = {**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    result.stdout = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    return result


def test_the_layers_and_the_models_contract_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_every_module_has_a_layer():
    """A new module must be placed in the layers (pyproject.toml), or nothing checks its imports."""
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = {name.strip() for layer in contract["layers"] for name in layer.replace(":", "|").split("|")}
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for path in (ROOT / "olmo_eqx").rglob("*.py")}

    def placed(module):
        return any(module == layer or module.startswith(layer + ".") for layer in layers)

    unplaced = sorted(m for m in modules if not placed(m) and m not in ("olmo_eqx", "olmo_eqx.train", "olmo_eqx.interop"))
    assert unplaced == []


def copy_of_the_tree(tmp_path: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "olmo_eqx", tmp_path / "olmo_eqx", ignore=ignore)
    shutil.copytree(ROOT / "plugins", tmp_path / "olmo_eqx_plugins", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(module: Path, line: str) -> None:
    module.write_text(module.read_text() + f"\n{line}\n")


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """Retention (checkpoint, below the loop) importing the train loop: refused, and named."""
    root = copy_of_the_tree(tmp_path)
    add_import(root / "olmo_eqx" / "checkpoint" / "retention.py", "import olmo_eqx.train.loop  # upward")
    result = lint_imports(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nothing imports upward BROKEN" in " ".join(result.stdout.split())
    assert "olmo_eqx.checkpoint.retention -> olmo_eqx.train.loop" in result.stdout
    assert "Contracts: 1 kept, 1 broken." in result.stdout


def test_a_model_importing_checkpoint_code_breaks_the_models_contract(tmp_path):
    root = copy_of_the_tree(tmp_path)
    add_import(root / "olmo_eqx" / "models" / "zoo.py", "from olmo_eqx.checkpoint.format import COMMIT_MARKER  # forbidden")
    result = lint_imports(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "olmo_eqx.models.zoo -> olmo_eqx.checkpoint.format" in result.stdout
    assert "Contracts: 0 kept, 2 broken." in result.stdout  # the models sit below checkpoint too


MAX_MODULE_LINES = 600
MAX_CHECKPOINTER_LINES = 300


def test_no_module_over_600_lines():
    """Every module of the library and of the built-in stages: a file a newcomer reads whole."""
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for folder in ("olmo_eqx", "plugins") for path in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 90  # the tree was found
    assert {str(path): n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_the_checkpointer_class_is_at_most_300_lines():
    import ast

    tree = ast.parse((ROOT / "olmo_eqx" / "checkpoint" / "checkpointer.py").read_text())
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Checkpointer"]
    assert cls.end_lineno - cls.lineno + 1 <= MAX_CHECKPOINTER_LINES
