"""Token files at URLs (`http(s)://`, `s3://`, `gs://`), read with byte-range requests only.

A remote token file is never downloaded whole: its size comes from one metadata request (or
the run's size cache, `SizeCache`), and each instance is one `Range: bytes=a-b` request for
its `sequence_length` tokens. Every range answer carries the object's current total size
(`Content-Range: bytes a-b/TOTAL`); it is compared with the recorded size, so a file changed
since the run recorded it is refused at its first read, whatever the cache says. The range
answered must be the range asked for, and each file's version (ETag, GCS generation, S3
version id) is pinned when first seen, so a same-size rewrite mid-run stops the run too.
Each request (HTTP, GCS or S3) has a wall-clock deadline (`RetryPolicy.timeout_s`), and
`cancel` cuts the requests in flight (a stop signal must not wait on a slow server).

Clients (docs/data.md, "Remote token files", says why these):
    http(s)://host/path   the standard library's `http.client`, one kept-alive connection per
                          thread and host.
    s3://bucket/key       boto3 (`pip install olmo_eqx[remote]`): credentials, region and
                          endpoint (`AWS_ENDPOINT_URL` for S3-compatible stores) from boto3's
                          standard chain: environment, ~/.aws, instance metadata.
    gs://bucket/object    GCS's JSON API over the same HTTP client; a bearer token from
                          Application Default Credentials (google-auth) when installed and
                          configured, else anonymous (public buckets); `STORAGE_EMULATOR_HOST`
                          points it at an emulator, as for Google's own clients.

Errors: transient ones (5xx, 429, timeouts, refused or reset connections) are retried with
jittered exponential backoff and counted (`RemoteReader.stats`, shown in the run's metrics);
a permanent one (404, 403, a file shorter than recorded, a server that ignores ranges) or a
transient one that outlasts its attempts raises `RemoteFileError`: one line naming the URL.

Small files (a tokenizer.json) are read whole with `RemoteReader.fetch` and kept by
`local_copy` in `$OLMO_EQX_CACHE/remote` (default ~/.cache/olmo_eqx/remote). HTTP redirects
are followed (at most 5 in a row).
"""

import http.client
import json
import os
import threading
import urllib.parse
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.run.secrets import credentials_refusal, has_credentials, hide_credentials  # noqa: F401

from olmo_eqx.data.stores import (  # noqa: F401  (SCHEMES, url_tail, the stores: also imported from here)
    SCHEMES, GcsStore, HttpStore, RemoteFileError, RetryPolicy, S3Store, _google_credentials, _Permanent, _Transient,
    is_url, url_tail,
)


# ---------------------------------------------------------------------------------------------
# The reader every remote token file shares


def _check_range(answered: tuple[int, int, int], start: int, length: int, received: int) -> None:
    """The answer to `Range: bytes=start-(start+length-1)` must be that range (cut at the file's
    end) and no longer: only the total used to be checked, so another range said plainly in
    Content-Range was trained on, and an over-long body broke a numpy assignment."""
    first, last, total = answered
    wanted = (start, min(start + length, total) - 1)
    if (first, last) != wanted:
        raise _Permanent(
            f"asked for bytes {wanted[0]}-{wanted[1]}, the server answered bytes {first}-{last} (Content-Range): "
            "it does not serve byte ranges correctly; serve the files from one that does"
        )
    if received > last - first + 1:
        raise _Permanent(
            f"asked for bytes {first}-{last}, the server sent {received} bytes, {received - (last - first + 1)} too "
            "many: it does not serve byte ranges correctly; serve the files from one that does"
        )


class RemoteReader:
    """Sizes and byte ranges of remote files, with retries; thread-safe; one per dataset build.

    `stats` counts requests, retried failures and bytes since construction. Errors name the
    file as `label` (a token file by default) and its URL; `hints` replaces the advice given
    for an HTTP status (e.g. {404: "check the URL"}).
    """

    def __init__(self, policy: RetryPolicy = RetryPolicy(), concurrency: int = 64, label: str = "token file",
                 hints: Mapping[int, str] | None = None):
        self.policy = policy
        self.concurrency = int(concurrency)
        self.label, self.hints = label, dict(hints or {})
        self._stores: dict[str, object] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"data_requests": 0, "data_retries": 0, "data_bytes": 0}
        # url -> the version of the file first seen (ETag, generation, ...): every later answer
        # must be of that version, so a file rewritten mid-run (even at the same size) stops it.
        self._pinned: dict[str, str] = {}
        self._cancelled = threading.Event()

    def _store(self, url: str):
        if has_credentials(url):  # refused before any request: never retried as "unreachable"
            raise RemoteFileError(credentials_refusal(url, self.label))
        scheme = url.split("://", 1)[0]
        kind = {"https": "http"}.get(scheme, scheme)
        with self._lock:
            if kind not in self._stores:
                cls = {"http": HttpStore, "s3": S3Store, "gs": GcsStore}[kind]
                self._stores[kind] = cls(self.policy.timeout_s, self._cancelled)
            return self._stores[kind]

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The threads that keep this reader's requests in flight (shared by all its files)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="olmo-eqx-remote")
            return self._pool

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def cancel(self) -> None:
        """Stop reading, now: requests in flight are cut and no retry follows (a stop signal
        must end the run within seconds, whatever the servers are doing)."""
        self._cancelled.set()
        with self._lock:
            stores = list(self._stores.values())
        for store in stores:
            store.cancel()

    def _pin(self, url: str, identity: str | None) -> None:
        if identity is None:
            return
        first = self._pinned.setdefault(url, identity)
        if first != identity:
            raise _Permanent(
                f"it changed on the server during the run ({first} -> {identity}): a run's data must not change "
                "under it. Restore the original file and rerun to resume (the checkpoints are intact), or start a "
                "new run on the new data"
            )

    def _retrying(self, url: str, what: str, fn):
        policy, last = self.policy, None
        for attempt in range(policy.attempts):
            if attempt:
                self._count("data_retries")
                self._cancelled.wait(policy.delay(attempt - 1))
            if self._cancelled.is_set():
                raise RemoteFileError(f"{self.label} {url}: {what} stopped: the run is stopping") from None
            self._count("data_requests")
            try:
                return fn()
            except _Transient as e:
                last = e
            except _Permanent as e:
                reason = f"HTTP {e.status}: {self.hints[e.status]}" if e.status in self.hints else e
                raise RemoteFileError(f"{self.label} {url}: {reason}") from None
        raise RemoteFileError(
            f"{self.label} {url}: {what} failed {policy.attempts} times, last with {last}: the server is unreachable "
            "or overloaded; rerun to resume when it answers"
        ) from None

    def size(self, url: str) -> int:
        store = self._store(url)

        def attempt() -> int:
            size, identity = store.size(url)
            self._pin(url, identity)
            return size

        return self._retrying(url, "its size request", attempt)

    def read(self, url: str, start: int, length: int, expected_size: int) -> bytes:
        """Bytes [start, start + length) of `url`, which must still be `expected_size` bytes long."""
        store = self._store(url)

        def attempt() -> bytes:
            body, answered, identity = store.read(url, start, length)
            total = answered[2]
            if total != expected_size:
                raise _Permanent(
                    f"it is now {total} bytes, but the run recorded {expected_size}: the file changed since. Point "
                    "the run at the original data (or remove the run dir's data_sizes.json to start afresh)"
                )
            _check_range(answered, start, length, len(body))
            self._pin(url, identity)
            if len(body) < length:
                raise _Transient(f"{len(body)} of {length} bytes arrived")  # a cut-short body
            return body

        body = self._retrying(url, f"reading bytes {start}-{start + length - 1}", attempt)
        self._count("data_bytes", len(body))
        return body

    def fetch(self, url: str, chunk: int = 1 << 26) -> bytes:
        """All of a (small) file, by range reads of `chunk` bytes from its start: the first
        answer's Content-Range gives its size, so a file under `chunk` bytes takes one request
        and no size request (which a presigned or redirected URL may not answer)."""
        store, parts, start, total = self._store(url), [], 0, None
        while total is None or start < total:
            def attempt(start=start, total=total) -> tuple[bytes, int]:
                body, answered, identity = store.read(url, start, chunk)
                size = answered[2]
                if total is not None and size != total:
                    raise _Permanent(f"it changed while being read (now {size} bytes, {total} before)")
                _check_range(answered, start, min(chunk, size - start), len(body))
                self._pin(url, identity)
                if len(body) < min(chunk, size - start):
                    raise _Transient(f"{len(body)} of {min(chunk, size - start)} bytes arrived")
                return body, size

            body, total = self._retrying(url, f"reading bytes {start}-{start + chunk - 1}", attempt)
            parts.append(body)
            start += len(body)
            self._count("data_bytes", len(body))
        return b"".join(parts)

    def sizes(self, urls: Iterable[str], known: Mapping[str, int] = {}) -> dict[str, int]:
        """The size of every URL: from `known` where it has one, the rest fetched concurrently."""
        urls = list(dict.fromkeys(urls))
        missing = [u for u in urls if u not in known]
        fetched = dict(zip(missing, self.pool.map(self.size, missing)))
        return {u: int(known[u]) if u in known else fetched[u] for u in urls}

    def __getstate__(self) -> dict:
        # Locks, threads and connections do not pickle: a copy in another process opens its own.
        state = self.__dict__.copy()
        state.update(_lock=None, _pool=None, _stores={}, _cancelled=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._cancelled = threading.Event()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class SizeCache:
    """The sizes of a run's remote files, kept in its run dir (`data_sizes.json`), so a restart
    of a 950-file mix makes no size requests. A size that changed since is still caught: every
    range answer carries the current size (`RemoteReader.read`)."""

    FILE = "data_sizes.json"

    def __init__(self, path: Path | None):
        self.path = Path(path) if path is not None else None

    def load(self) -> dict[str, int]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return {str(k): int(v) for k, v in json.loads(self.path.read_text())["sizes"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataFileError(f"size cache {self.path} is damaged ({e}): delete it and rerun (sizes are refetched)")

    def save(self, sizes: Mapping[str, int]) -> None:
        if self.path is None or not sizes or sizes == self.load():
            return
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"sizes": dict(sizes)}, indent=0))
        os.replace(tmp, self.path)


def cache_dir() -> Path:
    """Where small remote files (a tokenizer) are kept once fetched: `$OLMO_EQX_CACHE/remote`,
    default `~/.cache/olmo_eqx/remote`."""
    return Path(os.environ.get("OLMO_EQX_CACHE") or Path.home() / ".cache" / "olmo_eqx") / "remote"


def local_copy(url: str, label: str = "file", policy: RetryPolicy = RetryPolicy()) -> Path:
    """A local copy of the small remote file `url` (e.g. a tokenizer.json), fetched once through
    `RemoteReader.fetch` (range reads from its start, with the usual retries) and kept
    as `cache_dir()/<first 16 hex digits of the URL's sha256>/<its file name>` (with `url.txt`
    naming where it came from); later calls use that copy and make no request. Delete the
    directory to fetch it again. A missing file (404) raises `RemoteFileError`, one line naming
    the URL."""
    import hashlib

    directory = cache_dir() / hashlib.sha256(url.encode()).hexdigest()[:16]
    path = directory / (urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1] or "file")
    if path.is_file():
        return path
    reader = RemoteReader(policy, concurrency=1, label=label, hints={404: "it does not exist: check the URL"})
    body = reader.fetch(url)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "url.txt").write_text(url + "\n")
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # concurrent fetchers each rename a whole file
    tmp.write_bytes(body)
    os.replace(tmp, path)
    return path
