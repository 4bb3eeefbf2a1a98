"""The clients behind `olmo_eqx.data.remote` (which says what they guarantee), one per scheme:

    http(s)://host/path   the standard library's `http.client`, one kept-alive connection per
                          thread and host (`HttpStore`).
    s3://bucket/key       boto3 (`S3Store`; `pip install olmo_eqx[remote]`).
    gs://bucket/object    GCS's JSON API over the same HTTP client (`GcsStore`), with
                          Application Default Credentials when google-auth is installed.

Each answers a byte range with the object's total size and version, and raises `_Transient`
(retried by `RemoteReader`) or `_Permanent`; the URL helpers, `RetryPolicy` and
`RemoteFileError` live here too, below the reader.
"""


import http.client
import json
import os
import random
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from olmo_eqx.data.token_files import DataFileError


SCHEMES = ("http://", "https://", "s3://", "gs://")


def is_url(path) -> bool:
    """True for the URLs this module reads (local paths, `file` included, are not URLs)."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def url_tail(url: str, parts: int = 3) -> str:
    """The last `parts` components of a URL's path: what a checkpoint records of a file, so the
    same files under another root (or mounted locally) are recognised."""
    path = urllib.parse.urlsplit(url).path if not url.startswith(("s3://", "gs://")) else url.split("://", 1)[1]
    return "/".join([p for p in path.split("/") if p][-parts:])


class RemoteFileError(DataFileError):
    """A remote token file that cannot be read: the message names the URL and the fix."""


class _Transient(Exception):
    """A failure worth retrying (the server or the network may recover)."""


class _Permanent(Exception):
    """A failure no retry can fix (missing, forbidden, changed); `status`: its HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RetryPolicy:
    """How long a transient failure is retried: `attempts` tries, the k-th retry after about
    `backoff_s * 2**k` seconds (jittered, at most `max_backoff_s`)."""

    attempts: int = 8
    backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    timeout_s: float = 60.0

    def delay(self, retry: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**retry) * (0.5 + random.random())


# ---------------------------------------------------------------------------------------------
# HTTP(S) and GCS: one kept-alive connection per thread and host


def _content_range(header: str | None) -> tuple[int, int, int]:
    """(first, last, total) of `Content-Range: bytes first-last/total`."""
    try:
        span, total = header.strip().removeprefix("bytes ").split("/")
        first, last = span.split("-")
        return int(first), int(last), int(total)
    except (AttributeError, ValueError):
        raise _Permanent(f"the server's answer to a range request has no usable Content-Range ({header!r})")


class _Cut:
    """A wall-clock deadline on one request: at `timeout_s` (or on `cancel`) the connection's
    socket is shut down, which ends a `recv` blocked on a server that sends a byte now and then
    (each gap under the socket timeout, so that timeout alone never fires). `conn` is any
    http.client connection (urllib3's, under botocore, are too); for S3 it is only known once
    botocore's pool hands one out, so it may be attached later."""

    def __init__(self, conn: http.client.HTTPConnection | None, timeout_s: float):
        self.conn, self.fired = conn, False
        self._timer = threading.Timer(timeout_s, self.cut)
        self._timer.daemon = True
        self._timer.start()

    def attach(self, conn: http.client.HTTPConnection) -> None:
        self.conn = conn
        if self.fired:  # the deadline passed (or the run stopped) before a connection was free
            self.cut()

    def cut(self) -> None:
        self.fired = True
        sock = getattr(self.conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def done(self) -> None:
        self._timer.cancel()


def _classify(status: int, url: str, what: str) -> Exception:
    if status in (408, 429) or status >= 500:
        return _Transient(f"HTTP {status}")
    hint = {404: "it does not exist: check the data root and the tokenizer name in the paths",
            403: "access is denied: check the credentials (docs/data.md, 'Credentials')",
            401: "the server wants credentials: check them (docs/data.md, 'Credentials')",
            416: "the range lies past its end: the file is shorter than the run recorded"}
    return _Permanent(f"HTTP {status} on {what}: {hint.get(status, 'the server refused the request')}", status)


_MAX_REDIRECTS = 5


class HttpStore:
    """`http(s)://` URLs (and GCS's JSON API underneath `GcsStore`)."""

    def __init__(self, timeout_s: float, cancelled: threading.Event | None = None):
        self.timeout_s = timeout_s
        self._local = threading.local()
        self.cancelled = cancelled or threading.Event()
        self._inflight: set[_Cut] = set()
        self._inflight_lock = threading.Lock()

    def cancel(self) -> None:
        """Cut every request in flight (the run is stopping)."""
        with self._inflight_lock:
            for cut in list(self._inflight):
                cut.cut()

    def headers(self, url: str) -> dict:
        return {}

    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        pool = self._local.__dict__.setdefault("pool", {})
        conn = pool.get((scheme, netloc))
        if conn is None:
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = pool[(scheme, netloc)] = cls(netloc, timeout=self.timeout_s)
        return conn

    def _request(self, method: str, url: str, headers: dict) -> tuple[int, dict, bytes]:
        """One request; redirects (a hub's `resolve` URL to its file's location) are followed."""
        for _ in range(_MAX_REDIRECTS):
            status, answer, body = self._request_once(method, url, headers)
            if status not in (301, 302, 303, 307, 308) or "location" not in answer:
                return status, answer, body
            url = urllib.parse.urljoin(url, answer["location"])
        raise _Permanent(f"more than {_MAX_REDIRECTS} redirects, the last to {url}")

    def _request_once(self, method: str, url: str, headers: dict) -> tuple[int, dict, bytes]:
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        conn = self._connection(parts.scheme, parts.netloc)
        deadline = _Cut(conn, self.timeout_s)
        with self._inflight_lock:
            self._inflight.add(deadline)
        try:
            conn.request(method, target, headers={**self.headers(url), **headers})
            response = conn.getresponse()
            body = response.read()
            if deadline.fired:
                # Cut: http.client takes an end of input within the headers for their end, so
                # an answer cut there arrives without error, its later headers missing.
                raise ConnectionAbortedError("cut")
            return response.status, {k.lower(): v for k, v in response.getheaders()}, body
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut short
            conn.close()  # a broken connection is reopened by the next request
            if deadline.fired and not self.cancelled.is_set():
                raise _Transient(f"no complete answer within {self.timeout_s:g}s (data.remote_timeout_s)") from e
            raise _Transient(f"{type(e).__name__}: {e}") from e
        finally:
            deadline.done()
            with self._inflight_lock:
                self._inflight.discard(deadline)

    def size_url(self, url: str) -> tuple[str, str]:
        return "HEAD", url

    def data_url(self, url: str) -> str:
        return url

    @staticmethod
    def identity(headers: Mapping[str, str]) -> str | None:
        """What names this version of the file: GCS's generation, else the ETag, else Last-Modified."""
        for key in ("x-goog-generation", "etag", "last-modified"):
            if headers.get(key):
                return f"{key} {headers[key]}"
        return None

    def size(self, url: str) -> tuple[int, str | None]:
        method, target = self.size_url(url)
        status, headers, body = self._request(method, target, {})
        if status != 200:
            raise _classify(status, url, "its size request")
        if method == "GET":  # GCS's object metadata
            metadata = json.loads(body)
            generation = metadata.get("generation")
            return int(metadata["size"]), f"x-goog-generation {generation}" if generation else None
        if "content-length" not in headers:
            raise _Permanent("the server sends no Content-Length: its size is unknown")
        return int(headers["content-length"]), self.identity(headers)

    def read(self, url: str, start: int, length: int) -> tuple[bytes, tuple[int, int, int], str | None]:
        status, headers, body = self._request("GET", self.data_url(url), {"Range": f"bytes={start}-{start + length - 1}"})
        if status == 200:
            raise _Permanent("the server ignored the Range header and sent the whole file: olmo_eqx reads "
                             "token files by byte ranges only; serve them from a server that supports ranges "
                             "(on one machine: python -m olmo_eqx.data.serve DIR, not python -m http.server)")
        if status != 206:
            raise _classify(status, url, f"bytes {start}-{start + length - 1}")
        return body, _content_range(headers.get("content-range")), self.identity(headers)


class GcsStore(HttpStore):
    """`gs://bucket/object` through GCS's JSON API (`alt=media` with a range)."""

    def __init__(self, timeout_s: float, cancelled: threading.Event | None = None):
        super().__init__(timeout_s, cancelled)
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            self.endpoint = emulator if "://" in emulator else f"http://{emulator}"
            self._credentials = None
        else:
            self.endpoint = "https://storage.googleapis.com"
            self._credentials = _google_credentials()
        self._lock = threading.Lock()

    def headers(self, url: str) -> dict:
        if self._credentials is None:
            return {}
        with self._lock:  # refresh an expired token once, not from every thread
            if not self._credentials.valid:
                import google.auth.transport.requests

                self._credentials.refresh(google.auth.transport.requests.Request())
            return {"Authorization": f"Bearer {self._credentials.token}"}

    def _object(self, url: str) -> str:
        bucket, _, name = url[len("gs://"):].partition("/")
        return f"{self.endpoint}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"

    def size_url(self, url: str) -> tuple[str, str]:
        return "GET", self._object(url)

    def data_url(self, url: str) -> str:
        base = self._object(url)
        return base.replace("/storage/v1/", "/download/storage/v1/", 1) + "?alt=media"


def _google_credentials():
    """Application Default Credentials when google-auth finds some; None (anonymous) otherwise."""
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:
        return None
    try:
        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
    except DefaultCredentialsError:
        return None
    return credentials


# ---------------------------------------------------------------------------------------------
# S3 through boto3


class _CutShort(Exception):
    """A call whose deadline passed before it had a connection (not an OSError, which urllib3
    would wrap and botocore might retry)."""


class S3Store:
    """`s3://bucket/key` through boto3; its own retries are off, so ours are counted.

    botocore's read timeout bounds each socket read only, so, as for HTTP, every call has a
    wall-clock deadline (a `_Cut`) and `cancel` cuts the calls in flight: botocore's connection
    pools are made to attach the connection each call gets to that call's `_Cut`, whose timer
    shuts its socket down (headers or body, whichever is being read)."""

    def __init__(self, timeout_s: float, cancelled: threading.Event | None = None):
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError as e:
            raise DataFileError("s3:// token files need boto3: pip install 'olmo_eqx[remote]'") from e
        self._errors = botocore.exceptions
        # total_max_attempts, not max_attempts: in botocore's Config the latter counts retries
        # (max_attempts=1 is one uncounted retry), and a retry after a cut would start afresh.
        config = botocore.config.Config(
            retries={"total_max_attempts": 1, "mode": "standard"}, connect_timeout=timeout_s,
            read_timeout=timeout_s, max_pool_connections=256,
        )
        self._client = boto3.session.Session().client("s3", config=config)
        self.timeout_s = timeout_s
        self.cancelled = cancelled or threading.Event()
        self._current = threading.local()  # .cut: the _Cut of this thread's call in flight
        self._inflight: set[_Cut] = set()
        self._inflight_lock = threading.Lock()
        self._watch_connections()

    def _watch_connections(self) -> None:
        """Subclass the connection pools of this client's HTTP session (botocore's
        `URLLib3Session._pool_classes_by_scheme`, a dict its pool managers share and read when
        they open a pool for a host) so that a connection taken from a pool is attached to the
        calling thread's `_Cut`. Private to botocore (there since 2018); without it a read has
        botocore's per-read timeout only, which is said once."""
        current = self._current
        try:
            classes = self._client._endpoint.http_session._pool_classes_by_scheme
        except AttributeError:
            import warnings

            warnings.warn("this botocore has no URLLib3Session._pool_classes_by_scheme: s3:// reads have no "
                          "wall-clock deadline and a stop signal waits for them (docs/data.md)", stacklevel=2)
            return
        for scheme, base in list(classes.items()):
            class Watched(base):
                def _get_conn(self, timeout=None):
                    conn = super()._get_conn(timeout)
                    cut = getattr(current, "cut", None)
                    if cut is not None:
                        if cut.fired:  # past the deadline, or stopping: no new connection
                            self._put_conn(conn)
                            raise _CutShort()
                        cut.attach(conn)
                    return conn

            classes[scheme] = Watched

    @staticmethod
    def _split(url: str) -> tuple[str, str]:
        bucket, _, key = url[len("s3://"):].partition("/")
        return bucket, key

    def _call(self, what: str, fn, body: bool = False, **kwargs):
        """`fn(**kwargs)`, and with `body` its streamed body read too (as `response["Body"]`,
        bytes), within one deadline."""
        errors = self._errors
        cut = self._current.cut = _Cut(None, self.timeout_s)
        with self._inflight_lock:
            self._inflight.add(cut)
        try:
            response = fn(**kwargs)
            if body:
                response["Body"] = response["Body"].read()
            if cut.fired:  # an answer cut within its headers arrives without error, headers missing
                raise ConnectionAbortedError("cut")
            return response
        except errors.ClientError as e:
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "NoSuchBucket"):
                status = 404
            raise _classify(status or 500, what, what) from e
        except (errors.BotoCoreError, OSError, _CutShort) as e:  # connection refused / reset / timeout / cut
            if isinstance(e, (errors.NoCredentialsError, errors.PartialCredentialsError)):
                raise _Permanent(f"no AWS credentials: {e} (docs/data.md, 'Credentials')") from e
            if cut.fired and not self.cancelled.is_set():
                raise _Transient(f"no complete answer within {self.timeout_s:g}s (data.remote_timeout_s)") from e
            raise _Transient(f"{type(e).__name__}: {e}") from e
        finally:
            self._current.cut = None
            cut.done()
            with self._inflight_lock:
                self._inflight.discard(cut)

    @staticmethod
    def identity(response: Mapping) -> str | None:
        """The object's version id in a versioned bucket, else its ETag."""
        for key in ("VersionId", "ETag"):
            if response.get(key):
                return f"{key} {response[key]}"
        return None

    def cancel(self) -> None:
        """Cut every call in flight (the run is stopping)."""
        with self._inflight_lock:
            for cut in list(self._inflight):
                cut.cut()

    def size(self, url: str) -> tuple[int, str | None]:
        bucket, key = self._split(url)
        response = self._call("its size request", self._client.head_object, Bucket=bucket, Key=key)
        return int(response["ContentLength"]), self.identity(response)

    def read(self, url: str, start: int, length: int) -> tuple[bytes, tuple[int, int, int], str | None]:
        bucket, key = self._split(url)
        what = f"bytes {start}-{start + length - 1}"
        response = self._call(what, self._client.get_object, body=True, Bucket=bucket, Key=key,
                              Range=f"bytes={start}-{start + length - 1}")
        return response["Body"], _content_range(response.get("ContentRange")), self.identity(response)
