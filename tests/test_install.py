"""The install is the same for everyone: constraints.txt covers pyproject.toml, holds no
pre-release, and is what this environment runs on (CI and the README install with it)."""

import functools
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Extras for other hardware (platform-specific wheels) are not in the lock (.ci/lock).
UNLOCKED_EXTRAS = {"tpu", "gpu"}  # compilers for other hardware: platform-specific wheels


def locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    extras = [r for extra, reqs in project["optional-dependencies"].items() if extra not in UNLOCKED_EXTRAS for r in reqs]
    return [Requirement(r) for r in project["dependencies"] + extras]


def test_extras_are_named_as_every_pip_finds_them():
    # pip 23 did not match `.[lm_eval]` against the built metadata's normalised `lm-eval`.
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", extra), f"extra {extra!r}: use lowercase and hyphens"


def test_the_lock_holds_no_local_version_label():
    # `torch==2.13.0+cpu` resolves only where PyTorch's own index (or a local wheel) is
    # configured; the public index has `torch==2.13.0`, which a local build also satisfies.
    labelled = sorted(f"{n}=={v}" for n, v in locked().items() if v.local)
    assert not labelled, f"constraints.txt pins local versions {labelled}: run .ci/lock, which drops the labels"


def test_the_lock_covers_every_requirement_and_holds_no_pre_release():
    pins = locked()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in constraints.txt: run .ci/lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}: run .ci/lock"
        )
    assert not chosen_pre_releases(pins), "constraints.txt holds pre-releases: check pyproject.toml's bounds"


@functools.cache
def installed() -> dict[str, str]:
    """Name -> version of what imports here (the first on sys.path wins, as for imports)."""
    names = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    return {name: metadata.version(name) for name in names}


@functools.cache
def pinned_by_a_dependent() -> set[tuple[str, Version]]:
    """(name, version) of every pre-release an installed package requires exactly (`==`): some
    packages publish only pre-releases (opentelemetry-semantic-conventions 0.Nb0, wandb's
    cwevals) and their dependents pin one; pip had no choice there."""
    exact = set()
    for name in installed():
        for text in metadata.requires(name) or []:
            specs = list(Requirement(text).specifier)
            if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version \
                    and Version(specs[0].version).is_prerelease:
                exact.add((canonicalize_name(Requirement(text).name), Version(specs[0].version)))
    return exact


def chosen_pre_releases(versions: dict) -> list[str]:
    """The pre-releases among `versions` that pip chose (none pins them exactly)."""
    return sorted(f"{n}=={v}" for n, v in versions.items()
                  if Version(str(v)).is_prerelease and (n, Version(str(v))) not in pinned_by_a_dependent())


def test_nothing_installed_is_a_pre_release():
    pre = chosen_pre_releases(installed())
    assert not pre, f"pre-releases installed: {pre}; install with `-c constraints.txt` (README.md)"


@pytest.mark.parametrize("requirement", requirements(), ids=str)
def test_the_project_runs_on_the_locked_versions(requirement):
    name = canonicalize_name(requirement.name)
    version = installed().get(name)
    if version is None:
        pytest.fail(f"{name} is not installed: pip install -c constraints.txt -e '.[test]'")
    # A local build of the locked version (torch 2.13.0+cpu for 2.13.0) is that version (PEP 440).
    assert Version(Version(version).public) == locked()[name], (
        f"{name} {version} is installed but constraints.txt says {locked()[name]}: "
        "pip install -c constraints.txt -e '.[test]' (or run .ci/lock if the lock is what is old)"
    )
