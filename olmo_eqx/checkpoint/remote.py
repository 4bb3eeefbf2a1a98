"""Checkpoints on object stores (`s3://bucket/prefix`, `gs://bucket/prefix` as `checkpoint.dir`).

Orbax cannot write there in this project's environment: it creates, lists and renames its
directories through etils' `epath`, whose `s3://` and `gs://` backends need `s3fs`/`gcsfs` or
TensorFlow (`ImportError: Install s3fs to access S3`), and its TensorStore specs carry no S3
endpoint. Nor would a direct write keep our guarantees: an object store has no rename, so
Orbax's "write a tmp dir, rename it on commit" does not exist there. So every save is made by
Orbax into a local *staging* directory with all of the local machinery (the digests written
before the commit, `digests.py`), then uploaded, and each restore downloads the
step and verifies it before Orbax reads it. Layout under the checkpoint URL:

    <url>/<step>/<file>...            the step's files, uploaded first (any order)
    <url>/<step>/committed.json       written LAST: the step's manifest (size and SHA-256 of
                                      every file). A step exists only once this object exists;
                                      an upload killed midway leaves objects no listing counts.
    <url>/<step>/set_aside.json       a marker: the step failed verification (or was saved
                                      during a divergence). Listings skip it; retention never
                                      counts nor deletes it; its objects stay where they are.
    <url>/set_aside/<step>-<why>-<time>/...   where a marked step's objects are copied (then
                                      removed from <url>/<step>/) only when a new save needs
                                      its step number back.
    <url>/owner.json                  the run dir that trains into the prefix
                                      (`claim_checkpoint_url`): another run dir is refused at
                                      its start, and an upload checks the claim still holds.

Retention deletes a step by removing its `committed.json` first (so a kill mid-delete never
leaves a step that looks complete), then its other objects; it never removes the newest step
this process verified (uploaded, or downloaded and checked) nor a marked one.

Several processes (`jax.distributed`; a TPU pod's hosts share no file system): each process
stages into a dir of its own (`<staging>-process<i>`, on its own host) and uploads the files
it wrote; process 0 writes the one `committed.json` only once every process said its part
landed (`run.processes.gather`) and the store lists every file of the step's manifest at its
size. The arrays are then saved without OCDBT and without Orbax's per-process array metadata:
both assume one file system. Orbax's finalize merges the processes' `ocdbt.process_<i>/` dirs
by globbing them on process 0's disk (`merge_ocdbt_per_process_files`, which skips what it does
not find there), and checks every process's `array_metadatas/process_<i>` there too; with two
processes on separate dirs, Orbax 0.12.8's default save never completed (both waited in its
commit). Without them every shard is one zarr chunk file written by one process (process 0
writes the metadata and the JSON items), nothing is merged, and the union of the parts is the
step, which Orbax restores on any process count and mesh. Process i > 0 hashes its files when process 0 writes the manifest
(`digests.py`); its part stays in its tmp dir (Orbax renames only process 0's) until the
commit. A resume on any process count: process 0 lists, every process downloads the step into
its own staging dir and verifies it, and all learn each verdict (a damaged step is marked once
and every process falls back together). A process killed mid-upload leaves objects that no
listing counts; the rerun of the same processes with their staging dirs uploads the step (each
part verified against the manifest, the parts covering it), and a rerun elsewhere names it.

Credentials are each store's standard chain: boto3's for S3 (environment, ~/.aws, instance
metadata; `AWS_ENDPOINT_URL` for S3-compatible stores), Application Default Credentials for
GCS (`STORAGE_EMULATOR_HOST` for an emulator); GCS requests that fail transiently (429, 5xx, a
dropped connection) are retried with backoff, as GCS asks of its clients. Readers (eval, a
later stage's `checkpoint.load`) download into a staging dir of their own process, shared by
its readers and removed at exit. Limits: every process of a resume downloads the whole step
(Orbax picks the chunks each reads only after the download), and the upload of a save runs in
the training thread at the first step after its local commit (or the next save, or the close).
A run killed in between leaves the step committed in its staging dir(s): the next writer of the
URL on that machine (those machines), with that staging dir, uploads it; a rerun elsewhere
cannot, so the run dir keeps `StagedRecord` (`checkpoint_staged.json`: each step committed
locally and not yet uploaded, with its host, path and process count), and that rerun says which
newer step it is not resuming from, and where it is. Tested on moto's S3 server and on
`tests/rangeserver.py`'s emulation of GCS's JSON API, with one process and with two
(`tests/test_checkpoint_bucket.py`).
"""

import hashlib
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from olmo_eqx.errors import RunError

COMMITTED = "committed.json"
SET_ASIDE_MARKER = "set_aside.json"
SET_ASIDE_PREFIX = "set_aside"
SCHEMES = ("s3://", "gs://")
# Tries of one GCS request that failed transiently (429, 5xx, a dropped connection).
GCS_ATTEMPTS = 4
# Objects uploaded at once by one process (a step has a file per array and per shard).
UPLOAD_THREADS = 8


class ObjectStoreError(RunError):
    """An object store that cannot be read or written: the message names the URL and the fix."""


def is_object_store(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


STAGED_RECORD = "checkpoint_staged.json"


class StagedRecord:
    """A run dir's record of the steps committed in a staging dir but not (yet) uploaded:
    `{"<step>": {"host": ..., "path": ...}}`, rewritten whole (tmp file, rename). A step is
    added just before its local commit and dropped once a step at least as new is uploaded,
    so what is left after a lost host is what only that host's disk holds."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()

    def entries(self) -> dict[int, dict]:
        try:
            return {int(step): where for step, where in json.loads(self.path.read_text()).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError) as e:  # unreadable: only a hint is lost
            logging.getLogger(__name__).warning("ignoring %s: %s", self.path, e)
            return {}

    def _write(self, entries: dict[int, dict]) -> None:
        try:
            if not entries:
                self.path.unlink(missing_ok=True)
                return
            tmp = self.path.with_name(f"{self.path.name}.tmp")
            tmp.write_text(json.dumps({str(k): v for k, v in sorted(entries.items())}, indent=1) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            # Called from Orbax's finalising thread too, where an error would fail the save:
            # the record is a hint for a rerun elsewhere, and a full run dir stops the run anyway.
            logging.getLogger(__name__).warning("could not update %s: %s", self.path, e)

    def staged(self, step: int, path: Path, processes: int = 1) -> None:
        """Step `step` is committed at `path` (the first process's part, with `processes`)."""
        with self._lock:
            entries = self.entries()
            entries[int(step)] = {"host": socket.gethostname(), "path": str(path),
                                  **({"processes": processes} if processes > 1 else {})}
            self._write(entries)

    def uploaded(self, step: int) -> None:
        """Step `step` is in the store: older staged steps will never be resumed from either."""
        with self._lock:
            entries = self.entries()
            if entries:
                self._write({k: v for k, v in entries.items() if k > step})

    def dropped(self, step: int) -> None:
        with self._lock:
            entries = self.entries()
            if int(step) in entries:
                self._write({k: v for k, v in entries.items() if k != int(step)})


def default_staging(url: str) -> Path:
    """Where the checkpoints of `url` are staged locally: `$OLMO_EQX_CHECKPOINT_STAGING` (or
    ~/.cache/olmo_eqx/checkpoint-staging) / a digest of the URL."""
    root = os.environ.get("OLMO_EQX_CHECKPOINT_STAGING") or Path.home() / ".cache" / "olmo_eqx" / "checkpoint-staging"
    return Path(root).expanduser().resolve() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


class S3Objects:
    """The objects under `s3://bucket/prefix`, through boto3."""

    def __init__(self, url: str):
        try:
            import boto3
            import botocore.exceptions
        except ImportError as e:
            raise ObjectStoreError(f"checkpoint.dir={url} needs boto3: pip install 'olmo_eqx[remote]'") from e
        self.url = url.rstrip("/")
        self.bucket, _, prefix = self.url[len("s3://"):].partition("/")
        self.prefix = prefix + "/" if prefix else ""
        self._errors = botocore.exceptions
        self._client = boto3.session.Session().client("s3")

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _call(self, what: str, fn, **kwargs):
        import boto3.exceptions

        try:
            return fn(**kwargs)
        except (self._errors.BotoCoreError, self._errors.ClientError, boto3.exceptions.Boto3Error, OSError) as e:
            raise ObjectStoreError(
                f"checkpoint store {self.url}: {what} failed: {type(e).__name__}: {e}. Check the bucket, "
                "the credentials (AWS_* environment, ~/.aws) and AWS_ENDPOINT_URL"
            ) from e

    def list(self, under: str = "") -> dict[str, int]:
        """name (relative to the prefix) -> size, for every object under `under`."""
        found, token = {}, None
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": self._key(under)}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("listing", self._client.list_objects_v2, **kwargs)
            for item in page.get("Contents", []):
                found[item["Key"][len(self.prefix):]] = int(item["Size"])
            if not page.get("IsTruncated"):
                return found
            token = page["NextContinuationToken"]

    def put_file(self, name: str, path: Path) -> None:
        self._call(f"upload of {name}", self._client.upload_file, Filename=str(path), Bucket=self.bucket, Key=self._key(name))

    def put_bytes(self, name: str, data: bytes) -> None:
        self._call(f"write of {name}", self._client.put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    def get_file(self, name: str, path: Path) -> None:
        self._call(f"download of {name}", self._client.download_file, Bucket=self.bucket, Key=self._key(name), Filename=str(path))

    def get_bytes(self, name: str) -> bytes:
        return self._call(f"read of {name}", self._client.get_object, Bucket=self.bucket, Key=self._key(name))["Body"].read()

    def copy(self, name: str, to: str) -> None:
        self._call(f"copy of {name}", self._client.copy_object, Bucket=self.bucket, Key=self._key(to),
                   CopySource={"Bucket": self.bucket, "Key": self._key(name)})

    def delete(self, name: str) -> None:
        self._call(f"delete of {name}", self._client.delete_object, Bucket=self.bucket, Key=self._key(name))


def _transient(error: OSError) -> bool:
    """A failure GCS asks clients to retry with backoff: 408, 429, 5xx, a dropped connection.
    Every request here is idempotent (a media upload replaces the object whole). Refused
    connections, unknown hosts and timeouts are answered at once: retrying would only wait."""
    status = getattr(error, "code", None)
    if isinstance(status, int):
        return status in (408, 429) or status >= 500
    reason = getattr(error, "reason", error)
    return isinstance(reason, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)) or (
        type(reason).__name__ == "RemoteDisconnected")


class GcsObjects:
    """The objects under `gs://bucket/prefix`, through GCS's JSON API (the standard library's
    HTTP client; a bearer token from Application Default Credentials when configured)."""

    def __init__(self, url: str):
        from olmo_eqx.data.remote import _google_credentials

        self.url = url.rstrip("/")
        self.bucket, _, prefix = self.url[len("gs://"):].partition("/")
        self.prefix = prefix + "/" if prefix else ""
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        self.endpoint = (emulator if "://" in emulator else f"http://{emulator}") if emulator else "https://storage.googleapis.com"
        self._credentials = None if emulator else _google_credentials()

    def _request(self, what: str, method: str, url: str, data: Optional[bytes] = None) -> bytes:
        headers = {}
        if self._credentials is not None:
            if not self._credentials.valid:
                import google.auth.transport.requests

                self._credentials.refresh(google.auth.transport.requests.Request())
            headers["Authorization"] = f"Bearer {self._credentials.token}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        for attempt in range(GCS_ATTEMPTS):
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    return response.read()
            except OSError as e:
                if attempt + 1 < GCS_ATTEMPTS and _transient(e):
                    time.sleep(0.5 * 2**attempt)
                    continue
                raise ObjectStoreError(
                    f"checkpoint store {self.url}: {what} failed: {e}. Check the bucket and the credentials "
                    "(gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS)"
                ) from e
        raise AssertionError("unreachable")

    def _object(self, name: str) -> str:
        return f"{self.endpoint}/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(self.prefix + name, safe='')}"

    def list(self, under: str = "") -> dict[str, int]:
        found, token = {}, None
        while True:
            query = {"prefix": self.prefix + under, **({"pageToken": token} if token else {})}
            url = f"{self.endpoint}/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}"
            page = json.loads(self._request("listing", "GET", url))
            for item in page.get("items", []):
                found[item["name"][len(self.prefix):]] = int(item["size"])
            token = page.get("nextPageToken")
            if not token:
                return found

    def put_bytes(self, name: str, data: bytes) -> None:
        query = urllib.parse.urlencode({"uploadType": "media", "name": self.prefix + name})
        self._request(f"write of {name}", "POST", f"{self.endpoint}/upload/storage/v1/b/{self.bucket}/o?{query}", data)

    def put_file(self, name: str, path: Path) -> None:
        self.put_bytes(name, Path(path).read_bytes())

    def get_bytes(self, name: str) -> bytes:
        url = self._object(name).replace("/storage/v1/", "/download/storage/v1/", 1) + "?alt=media"
        return self._request(f"read of {name}", "GET", url)

    def get_file(self, name: str, path: Path) -> None:
        Path(path).write_bytes(self.get_bytes(name))

    def copy(self, name: str, to: str) -> None:
        target = urllib.parse.quote(self.prefix + to, safe="")
        self._request(f"copy of {name}", "POST", f"{self._object(name)}/rewriteTo/b/{self.bucket}/o/{target}", b"")

    def delete(self, name: str) -> None:
        self._request(f"delete of {name}", "DELETE", self._object(name))


def open_store(url: str):
    return S3Objects(url) if url.startswith("s3://") else GcsObjects(url)


OWNER_OBJECT = "owner.json"
# url -> the run dir this process claimed it for: every upload checks the claim still holds.
_CLAIMED: dict[str, str] = {}


def _owned_error(url: str, owner: str, run_dir: str) -> str:
    return (
        f"checkpoint.dir={url} belongs to the run dir {owner} (its {OWNER_OBJECT}), not {run_dir}: two run dirs on one "
        f"checkpoint prefix would resume from and delete each other's steps. Continue that run in {owner}, or give this "
        f"run another checkpoint.dir (delete {url}/{OWNER_OBJECT} only if that run is yours and done)"
    )


def _owner(store, url: str) -> Optional[str]:
    if OWNER_OBJECT not in store.list(OWNER_OBJECT):
        return None
    try:
        return str(json.loads(store.get_bytes(OWNER_OBJECT))["run_dir"])
    except (ValueError, KeyError, TypeError):
        return None


def claim_checkpoint_url(url: str, run_dir: Path) -> Optional[str]:
    """`claim_checkpoint_dir` for an object-store prefix: its `owner.json` object names the run
    dir that trains into it. Another run dir is refused (`CheckpointDirOwnedError`); whether
    that one still exists cannot be told from here (it may live on another host), so a prefix is
    never taken over silently. Raises `ObjectStoreError` when the store cannot be read or written."""
    from olmo_eqx.checkpoint.paths import CheckpointDirOwnedError

    url, run = url.rstrip("/"), str(run_dir)
    store = open_store(url)
    owner = _owner(store, url)
    if owner is not None and owner != run:
        raise CheckpointDirOwnedError(_owned_error(url, owner, run))
    if owner is None:
        store.put_bytes(OWNER_OBJECT, (json.dumps({"run_dir": run, "host": os.uname().nodename}) + "\n").encode())
    _CLAIMED[url] = run
    return None


class RemoteSteps:
    """The steps of one checkpoint URL: upload, listing, download, marking, deletion."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.store = open_store(url)

    def _by_step(self) -> dict[int, dict[str, int]]:
        steps: dict[int, dict[str, int]] = {}
        for name, size in self.store.list().items():
            head, _, rest = name.partition("/")
            if head.isdigit() and rest:
                steps.setdefault(int(head), {})[rest] = size
        return steps

    def committed_steps(self) -> list[int]:
        """Steps with a `committed.json` and no set-aside marker, oldest first."""
        return sorted(s for s, files in self._by_step().items() if COMMITTED in files and SET_ASIDE_MARKER not in files)

    def occupied(self, step: int) -> dict[str, int]:
        """The objects under `<url>/<step>/` (committed or not)."""
        head = f"{step}/"
        return {name[len(head):]: size for name, size in self.store.list(head).items()}

    def check_owner(self) -> None:
        """A prefix this process claimed for a run dir that another run dir has claimed since
        (two runs started on it at once) is refused before anything is written."""
        claimed = _CLAIMED.get(self.url)
        if claimed is not None and (owner := _owner(self.store, self.url)) not in (None, claimed):
            raise ObjectStoreError(_owned_error(self.url, owner, claimed))

    def put_part(self, step: int, files: dict[str, Path]) -> None:
        """Upload `files` ({name in the step: local path}) under `<url>/<step>/`,
        `UPLOAD_THREADS` at a time, then check the sizes the store lists. Writes no commit."""
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            list(pool.map(lambda name: self.store.put_file(f"{step}/{name}", files[name]), sorted(files)))
        listed = self.occupied(step)
        for name, path in sorted(files.items()):
            if listed.get(name) != path.stat().st_size:
                raise ObjectStoreError(
                    f"checkpoint store {self.url}: {step}/{name} lists {listed.get(name)} bytes after its upload "
                    f"of {path.stat().st_size}; step {step} was not committed (the staged copy is kept at {path})"
                )

    def commit(self, step: int, manifest: dict, unsealed: list[str]) -> dict:
        """Write `<url>/<step>/committed.json` once the listing holds every file of `manifest`
        (a step's `digests.json`) at its size and every `unsealed` one: the step then exists.
        With several processes each uploaded its own part; this is the one check that all landed."""
        listed = self.occupied(step)
        for name in sorted(manifest["files"]):
            if listed.get(name) != manifest["files"][name]["size"]:
                raise ObjectStoreError(
                    f"checkpoint store {self.url}: {step}/{name} lists {listed.get(name)} bytes, saved with "
                    f"{manifest['files'][name]['size']}; step {step} was not committed"
                )
        if missing := [name for name in unsealed if name not in listed]:
            raise ObjectStoreError(f"checkpoint store {self.url}: {step}/{missing[0]} is missing; step {step} was not committed")
        committed = {"step": step, "algorithm": manifest["algorithm"], "files": manifest["files"], "unsealed": sorted(unsealed)}
        self.check_owner()
        self.store.put_bytes(f"{step}/{COMMITTED}", (json.dumps(committed, indent=1) + "\n").encode())
        return committed

    def upload(self, step: int, step_dir: Path) -> dict:
        """Upload the committed local step `step_dir` (which holds its `digests.json`), then its
        `committed.json` last. Returns the manifest. The sizes the store then lists are checked."""
        self.check_owner()
        manifest = json.loads((step_dir / "digests.json").read_text())
        files = {p.relative_to(step_dir).as_posix(): p for p in step_dir.rglob("*") if p.is_file()}
        self.put_part(step, files)
        return self.commit(step, manifest, [name for name in files if name not in manifest["files"]])

    def committed(self, step: int) -> dict:
        """The commit manifest of step `step` (`committed.json`)."""
        return json.loads(self.store.get_bytes(f"{step}/{COMMITTED}"))

    def download(self, step: int, target: Path) -> None:
        """Every object of committed step `step` into the fresh directory `target`, with the
        committed manifest as its `digests.json` (what `verify_digests` checks)."""
        from olmo_eqx.checkpoint.digests import DigestMismatch

        try:
            committed = self.committed(step)
            names = list(committed["files"]) + list(committed.get("unsealed", []))
        except (ValueError, KeyError, TypeError) as e:
            raise DigestMismatch(COMMITTED, f"the commit manifest is unreadable ({type(e).__name__}: {e})") from e
        present = self.occupied(step)
        for name in names:
            if name not in present:
                raise DigestMismatch(name, f"missing from the store ({self.url}/{step}/{name})")
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            self.store.get_file(f"{step}/{name}", target / name)
        (target / "digests.json").write_text(json.dumps({"algorithm": committed["algorithm"], "files": committed["files"]}, indent=1) + "\n")

    def mark_set_aside(self, step: int, reason: str) -> str:
        marker = f"{self.url}/{step}/{SET_ASIDE_MARKER}"
        body = {"step": step, "reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.store.put_bytes(f"{step}/{SET_ASIDE_MARKER}", (json.dumps(body) + "\n").encode())
        return marker

    def relocate(self, step: int) -> Optional[str]:
        """Free step number `step` for a new save: copy a marked (or uncommitted) step's objects
        to `set_aside/<step>-<why>-<time>/`, then delete the originals (marker and commit last).
        Returns where they went (None when nothing was there)."""
        objects = self.occupied(step)
        if not objects:
            return None
        try:
            reason = json.loads(self.store.get_bytes(f"{step}/{SET_ASIDE_MARKER}"))["reason"]
        except Exception:
            reason = "uncommitted upload" if COMMITTED not in objects else "in the way"
        slug = "-".join("".join(c if c.isalnum() else " " for c in reason.lower()).split())[:40]
        where = f"{SET_ASIDE_PREFIX}/{step}-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
        for name in objects:
            self.store.copy(f"{step}/{name}", f"{where}/{name}")
        last = (SET_ASIDE_MARKER, COMMITTED)
        for name in sorted(objects, key=lambda n: n in last):
            self.store.delete(f"{step}/{name}")
        return f"{self.url}/{where}"

    def delete(self, step: int) -> None:
        """Retention's delete: the commit object first, then the rest."""
        objects = self.occupied(step)
        if COMMITTED in objects:
            self.store.delete(f"{step}/{COMMITTED}")
        for name in objects:
            if name != COMMITTED:
                self.store.delete(f"{step}/{name}")
