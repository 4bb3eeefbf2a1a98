"""Data sources: OLMo-core mix manifests, plain path lists and globs.

A source is a labelled list of token files, optionally with a target share (`ratio`) of the
training instances. Labels travel with every instance so metrics can be split per source.

OLMo-core's manifests (`data/mixes/*.txt`) hold one `label,relative/path/{TOKENIZER}/part.npy`
per line; the path is relative to a data root and `{TOKENIZER}` names the tokenizer's
directory (e.g. `allenai/dolma2-tokenizer`). A data root or a path may be a URL (`http(s)://`,
`s3://`, `gs://`: `olmo_eqx.data.remote`); URLs are kept as strings, never as `Path`s (which
would fold `//`).
"""

import glob
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping, Sequence

from olmo_eqx.data.remote import is_url
from olmo_eqx.data.token_files import DataFileError

TOKENIZER_PLACEHOLDER = "{TOKENIZER}"


@dataclass(frozen=True)
class Source:
    """A labelled list of token files; `ratio` is its target share of the mix (None: natural size)."""

    label: str
    paths: tuple[Path | str, ...]  # str: a URL
    ratio: float | None = None

    def __post_init__(self):
        if not self.paths:
            raise DataFileError(f"data source {self.label!r} has no files")
        if self.ratio is not None and not self.ratio > 0:
            raise DataFileError(f"data source {self.label!r}: ratio must be > 0, got {self.ratio}")


def _expand(path_or_glob: str | os.PathLike) -> list[Path | str]:
    text = os.fspath(path_or_glob)
    if is_url(text):
        if glob.has_magic(text):
            raise DataFileError(
                f"{text!r}: a glob cannot be expanded at a URL (HTTP has no listing); list the files in a "
                "mix manifest (data.source=mix.txt, data.data_root=URL)"
            )
        return [text]
    if glob.has_magic(text):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise DataFileError(f"glob {text!r} matches no files: check the pattern and the data root")
        return [Path(m) for m in matches]
    if os.path.isdir(text):
        pattern = os.path.join(text, "*.npy")
        raise DataFileError(
            f"{text} is a directory, not a token file: give its files as a glob, e.g. '{pattern}' (or "
            f"'{os.path.join(text, '**', '*.npy')}' with subdirectories), or a mix manifest (.txt)"
        )
    return [Path(text)]


def real_file(path: Path | str) -> str:
    """What a path names once symlinks and `..` are resolved (a URL as given): the key by which
    files are counted, deduplicated and compared, so a link to a file is that file."""
    return path if is_url(path) else os.path.realpath(os.fspath(path))


def refuse_repeated_files(paths: Sequence[Path | str], where: str) -> None:
    """Refuse two paths naming one real file: a glob through a symlink loop (`dir/loop -> ..`)
    or a link next to its target would train on the file once per path, silently."""
    seen: dict[str, Path | str] = {}
    for path in paths:
        first = seen.setdefault(real_file(path), path)
        if first is not path:
            raise DataFileError(
                f"{where}: {first} and {path} are the same file ({real_file(path)}), a symlink loop or a link to a "
                "listed file, so it would be read twice as often; list each file once (remove the link or narrow the glob)"
            )


def source_from_paths(
    label: str, paths: Sequence[str | os.PathLike] | str | os.PathLike, ratio: float | None = None
) -> Source:
    """A source from explicit paths and/or globs (globs expand sorted, so the order is stable);
    two of them naming one real file are refused (`refuse_repeated_files`)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    expanded = [p for item in paths for p in _expand(item)]
    refuse_repeated_files(expanded, f"data source {label!r} ({', '.join(os.fspath(p) for p in paths)})")
    return Source(label=label, paths=tuple(expanded), ratio=ratio)


OLMO_CORE_PREFIX = "olmo_core:"


# OLMo-core's `DataMix.build` (olmo_core/data/mixes/__init__.py, ai2-olmo-core 3.0.0) does not
# put the tokenizer's name into every mix as given: the OLMo 3 mixes' files live under
# `allenai/dolma3-tokenizer/` (the same tokenizer, renamed) and the held-out sets under
# `v3_small_dolma2-tokenizer/`. `olmo_core:` manifests follow the same rule, or their URLs 404.
_OLMO3_MIXES = frozenset({
    "OLMo-mix-0625-official", "OLMo-mix-0925-official", "OLMo-midtraining-mix-0625-100B",
    "OLMo-midtraining-mix-0925-ingredient1-100B", "OLMo-midtraining-mix-0925-ingredient2-100B",
    "OLMo-longmino-mix-0625", "OLMo-longmino-mix-0925",
})
_DOLMA2 = "allenai/dolma2-tokenizer"


def olmo_core_tokenizer_dir(mix: str, tokenizer: str) -> str:
    """What OLMo-core substitutes for `{TOKENIZER}` in its mix `mix` (a manifest's file name)
    given the tokenizer `tokenizer` (as `DataMix.build` does)."""
    stem = mix.removesuffix(".txt")
    if stem in ("v3-small-ppl-validation", "c4-ppl-validation"):
        return {_DOLMA2: "dolma2-tokenizer", "allenai/gpt-neox-olmo-dolma-v1_5": "gptneox20b"}.get(tokenizer, tokenizer)
    if stem == "code-fresh-ppl-validation" and tokenizer == _DOLMA2:
        return "dolma2-tokenizer"
    if stem == "OLMo-mix-0625" and tokenizer == "allenai/dolma2-tokenizer-sigdig":
        return "dolma2-tokenizer-sigdig"
    if stem in _OLMO3_MIXES and tokenizer == _DOLMA2:
        return "allenai/dolma3-tokenizer"
    return tokenizer


def olmo_core_manifest(name: str) -> Path:
    """`olmo_core/data/mixes/NAME` of the installed `ai2-olmo-core` wheel, found without
    importing it (olmo_core imports torch): OLMo-core's mixes, read as the data files they are."""
    import importlib.util

    spec = importlib.util.find_spec("olmo_core")  # a top-level package: located, not executed
    if spec is None or not spec.submodule_search_locations:
        raise DataFileError(
            f"mix {OLMO_CORE_PREFIX}{name} needs the ai2-olmo-core wheel's manifests: "
            "pip install --no-deps ai2-olmo-core (its data files only; torch is not needed)"
        )
    mixes = Path(list(spec.submodule_search_locations)[0]) / "data" / "mixes"
    path = mixes / name
    if not path.is_file():
        known = sorted(p.name for p in mixes.glob("*.txt"))
        raise DataFileError(f"ai2-olmo-core ships no mix {name!r}; it has {known}")
    return path


def _leaves_root(rel_path: str, url_root: bool) -> bool:
    # Lexical, without resolving links: a data root that is a farm of symlinks into a shared
    # store is still "under the root"; what is refused is a line that *says* to leave it.
    # Under a URL root a leading "/" is joined onto the root (OLMo-core's `DataMix.build` does
    # the same), so only ".." leaves it there.
    if not url_root and os.path.isabs(rel_path):
        return True
    normal = posixpath.normpath(rel_path.replace(os.sep, "/").lstrip("/"))
    return normal == ".." or normal.startswith("../")


def read_mix(
    manifest: str | os.PathLike,
    data_root: str | os.PathLike,
    tokenizer: str,
    ratios: Mapping[str, float] | None = None,
    allow_outside_root: bool = False,
) -> list[Source]:
    """Read an OLMo-core mix manifest into sources, one per label, in order of first appearance.

    `ratios` maps labels to target shares; give one for every label or none at all.
    Blank lines and lines starting with `#` are skipped. `manifest` may be `olmo_core:NAME`, a
    mix of the installed OLMo-core (`olmo_core_manifest`). A line that leaves the data root (`..`,
    or an absolute local path) is refused unless `allow_outside_root` (`data.allow_outside_root`).
    """
    text = os.fspath(manifest)
    manifest = olmo_core_manifest(text[len(OLMO_CORE_PREFIX):]) if text.startswith(OLMO_CORE_PREFIX) else Path(text)
    if text.startswith(OLMO_CORE_PREFIX):
        tokenizer = olmo_core_tokenizer_dir(text[len(OLMO_CORE_PREFIX):], tokenizer)
    if not manifest.is_file():
        raise DataFileError(f"mix manifest {manifest} does not exist")
    root = os.fspath(data_root)
    if "://" in root and not is_url(root):
        raise DataFileError(f"data root {root!r}: the URL schemes read are http(s)://, s3:// and gs://")
    by_label: dict[str, list[Path | str]] = {}
    # A file listed twice is read twice as often: silent double weight. OLMo-core's own mixes
    # do that on purpose (dolma17 lists its wiki files twice), so `olmo_core:` mixes keep it.
    seen: dict[str, int] = {}
    repeats_allowed = text.startswith(OLMO_CORE_PREFIX)
    for line_no, raw in enumerate(manifest.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        label, sep, rel_path = line.partition(",")
        if not sep or not label.strip() or not rel_path.strip():
            raise DataFileError(
                f"{manifest}:{line_no}: expected `label,relative/path/{TOKENIZER_PLACEHOLDER}/part.npy`, got {raw!r}"
            )
        rel_path = rel_path.strip().replace(TOKENIZER_PLACEHOLDER, tokenizer)
        if not allow_outside_root and _leaves_root(rel_path, is_url(root)):
            raise DataFileError(
                f"{manifest}:{line_no}: {rel_path} lies outside the data root {root}; a mix reads only files under "
                "data.data_root: fix the line, or set data.allow_outside_root=true if it is meant"
            )
        path = f"{root.rstrip('/')}/{rel_path.lstrip('/')}" if is_url(root) else Path(root) / rel_path
        first = seen.setdefault(real_file(path), line_no)
        if first != line_no and not repeats_allowed:
            raise DataFileError(
                f"{manifest}:{line_no}: {rel_path} is already listed on line {first} (the same file: "
                f"{real_file(path)}); a file listed twice would get double weight: remove one of the two lines"
            )
        by_label.setdefault(label.strip(), []).append(path)
    if not by_label:
        raise DataFileError(f"mix manifest {manifest} lists no files")
    ratios = dict(ratios or {})
    unknown = set(ratios) - set(by_label)
    if unknown:
        raise DataFileError(f"ratios name labels not in {manifest}: {sorted(unknown)}; labels are {list(by_label)}")
    if ratios and set(ratios) != set(by_label):
        raise DataFileError(f"give a ratio for every label of {manifest} or none; missing {sorted(set(by_label) - set(ratios))}")
    return [Source(label, tuple(paths), ratios.get(label)) for label, paths in by_label.items()]
