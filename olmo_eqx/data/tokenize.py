"""Tokenize text or JSONL into OLMo-core token files.

    python -m olmo_eqx.data.tokenize --tokenizer tokenizer.json --out-dir tokens/ \
        data/*.jsonl.gz notes/*.txt [--text-field text] [--workers 4] [--eos-token '<|endoftext|>']

The tokenizer is a HF tokenizer.json: a local path or an `http(s)://`, `s3://` or `gs://` URL,
fetched once into the cache (`olmo_eqx.data.remote.local_copy`).

One output `<name>.npy` (headerless, uint16 below 65536 ids else uint32) per input file;
EOS after every document; no BOS. A `.txt` file is one document; a `.jsonl`/`.json` file
holds one JSON object per line whose `--text-field` is a document. `.gz` and `.zst`
(needs the `zstandard` package) are decompressed on the fly. Files are processed in
parallel (one process each); progress goes to stderr, a summary to stdout.
"""

import argparse
import glob
import gzip
import io
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator, Sequence

import numpy as np

from olmo_eqx.data.remote import is_url, local_copy
from olmo_eqx.data.token_files import DataFileError, token_dtype_for_vocab

# Token strings of EOS in the tokenizers OLMo uses (dolma2's, the embedded corpus's, and others').
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>")

_DOCS_PER_BATCH = 512
_PROGRESS_EVERY_DOCS = 100_000  # a progress line within large files
_SUFFIXES = (".jsonl", ".json", ".txt")
_COMPRESSED = (".gz", ".zst")


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataFileError(
                f"{path} is zstd-compressed: install the optional dependency with `pip install zstandard`"
            ) from None
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _base_name(path: Path) -> tuple[str, str]:
    """(stem, kind) with compression and format suffixes stripped; kind is 'jsonl' or 'txt'."""
    name = path.name
    for suffix in _COMPRESSED:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)], "txt" if suffix == ".txt" else "jsonl"
    raise DataFileError(f"{path}: unsupported file type; expected .txt, .jsonl or .json, optionally .gz/.zst")


def iter_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The documents of one input file (see the module docstring for the formats)."""
    _, kind = _base_name(path)
    with _open_text(path) as handle:
        if kind == "txt":
            yield handle.read()
            return
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataFileError(f"{path}:{line_no}: not valid JSON ({error})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DataFileError(f"{path}:{line_no}: no string field {text_field!r}; pass --text-field")
            yield record[text_field]


@dataclass(frozen=True)
class FileJob:
    source: Path
    output: Path
    tokenizer_path: Path
    eos_id: int
    vocab_size: int
    dtype: str
    text_field: str


@dataclass(frozen=True)
class FileResult:
    source: Path
    output: Path
    documents: int
    tokens: int
    seconds: float


_tokenizer_cache: dict[str, object] = {}


def tokenize_file(job: FileJob) -> FileResult:
    """Tokenize one input file into its token file (written to a temp name, then renamed)."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    key = str(job.tokenizer_path)
    if key not in _tokenizer_cache:
        tokenizer = Tokenizer.from_file(key)
        # A document that merely mentions "<|endoftext|>" must not end there: encode special
        # tokens' text as ordinary text; the only EOS ids are the ones appended below.
        tokenizer.encode_special_tokens = True
        _tokenizer_cache[key] = tokenizer
    tokenizer = _tokenizer_cache[key]
    dtype = np.dtype(job.dtype).newbyteorder("<")
    tmp = job.output.with_name(job.output.name + f".tmp{os.getpid()}")
    documents = tokens = 0
    eos = np.array([job.eos_id], dtype=np.int64)

    def flush(texts: list[str], out) -> int:
        pieces = []
        for encoding in tokenizer.encode_batch(texts):
            pieces += [np.asarray(encoding.ids, dtype=np.int64), eos]
        ids = np.concatenate(pieces)
        if int(ids.max()) >= job.vocab_size:
            raise DataFileError(f"{job.tokenizer_path} produced id {int(ids.max())} >= vocab size {job.vocab_size}")
        ids.astype(dtype).tofile(out)
        return ids.size

    with open(tmp, "wb") as out:
        batch: list[str] = []
        for text in iter_documents(job.source, job.text_field):
            batch.append(text)
            documents += 1
            if len(batch) == _DOCS_PER_BATCH:
                tokens += flush(batch, out)
                batch = []
            if documents % _PROGRESS_EVERY_DOCS == 0:
                print(f"  {job.source.name}: {documents} docs so far", file=sys.stderr, flush=True)
        if batch:
            tokens += flush(batch, out)
    os.replace(tmp, job.output)
    return FileResult(job.source, job.output, documents, tokens, time.perf_counter() - started)


def _expand_inputs(inputs: Sequence[str]) -> list[Path]:
    paths: list[Path] = []
    for item in inputs:
        if os.path.isdir(item):
            paths += sorted(p for p in Path(item).rglob("*") if p.is_file())
        elif glob.has_magic(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise DataFileError(f"input glob {item!r} matches no files")
            paths += [Path(m) for m in matches]
        elif os.path.isfile(item):
            paths.append(Path(item))
        else:
            raise DataFileError(f"input {item} does not exist")
    return paths


def _tokenizer_facts(tokenizer_path: Path, eos_token: str) -> tuple[int, int]:
    from tokenizers import Tokenizer

    if not tokenizer_path.is_file():
        raise DataFileError(f"tokenizer {tokenizer_path} does not exist: pass a HF tokenizer.json (a path or a URL)")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise DataFileError(f"{tokenizer_path} has no token {eos_token!r}: pass the EOS with --eos-token")
    return eos_id, tokenizer.get_vocab_size()


def tokenize_files(
    inputs: Sequence[str],
    tokenizer_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    eos_token: str = "<|endoftext|>",
    text_field: str = "text",
    workers: int = 1,
    dtype: str | None = None,
    progress: bool = True,
) -> list[FileResult]:
    """Tokenize every input file into `out_dir`; returns one result per file, in input order.
    `tokenizer_path`: a local tokenizer.json or its URL (fetched once, `local_copy`)."""
    tokenizer_path = local_copy(tokenizer_path, "tokenizer") if is_url(tokenizer_path) else Path(tokenizer_path)
    eos_id, vocab_size = _tokenizer_facts(tokenizer_path, eos_token)
    dtype = np.dtype(dtype).name if dtype else token_dtype_for_vocab(vocab_size).name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = [p for p in _expand_inputs(inputs)]
    outputs: dict[Path, Path] = {}
    for source in sources:
        output = out_dir / f"{_base_name(source)[0]}.npy"
        if output in outputs.values():
            raise DataFileError(f"two inputs would both write {output}; rename one or tokenize them separately")
        outputs[source] = output
    jobs = [FileJob(s, outputs[s], tokenizer_path, eos_id, vocab_size, dtype, text_field) for s in sources]
    results: dict[Path, FileResult] = {}
    if workers > 1 and len(jobs) > 1:
        # spawn, not fork: the tokenizers library's thread pool does not survive a fork.
        with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for result in pool.imap_unordered(tokenize_file, jobs):
                results[result.source] = result
                _report(result, len(results), len(jobs), progress)
    else:
        for job in jobs:
            result = tokenize_file(job)
            results[result.source] = result
            _report(result, len(results), len(jobs), progress)
    return [results[s] for s in sources]


def _report(result: FileResult, done: int, total: int, progress: bool) -> None:
    if progress:
        print(
            f"[{done}/{total}] {result.source} -> {result.output.name}: "
            f"{result.documents} docs, {result.tokens} tokens ({result.seconds:.1f}s)",
            file=sys.stderr,
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m olmo_eqx.data.tokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="files, directories or globs (.txt, .jsonl, .json; .gz/.zst)")
    parser.add_argument("--tokenizer", required=True,
                        help="a HF tokenizer.json: a local path or an http(s)://, s3:// or gs:// URL (fetched once, cached)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--eos-token", default="<|endoftext|>")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--dtype", default=None, help="override the token dtype (uint16/uint32)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        results = tokenize_files(
            args.inputs, args.tokenizer, args.out_dir, args.eos_token, args.text_field, args.workers, args.dtype
        )
    except DataFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    docs = sum(r.documents for r in results)
    tokens = sum(r.tokens for r in results)
    print(
        f"tokenized {len(results)} files: {docs} documents, {tokens} tokens "
        f"in {time.perf_counter() - started:.1f}s -> {args.out_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
