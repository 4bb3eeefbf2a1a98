"""A small HTTP file server for the remote-data tests and the loader benchmark (no tests here).

Serves a directory on 127.0.0.1 with HEAD, single `Range: bytes=a-b` GETs (206 with
Content-Range), and GCS's JSON API paths (`/storage/v1/b/B/o/O` metadata and
`/download/storage/v1/b/B/o/O?alt=media`, the object being the file B/O), so `gs://` URLs can
be served with `STORAGE_EMULATOR_HOST`; also the JSON API's writes, for checkpoints on `gs://`
(listing `/storage/v1/b/B/o?prefix=`, media uploads, deletes, `rewriteTo` copies). Faults are injectable while it runs: a latency per
request, a fraction of answers that are 503, paths answering 404, a server that dies after
a given number of requests (killed mid-run), and stop / restart on the same port. Paths in
`redirects` answer 302 to their target (a hub's `resolve` URL sends clients on like that).
Misbehaving range answers too: another range than asked (said in Content-Range), more bytes
than asked, a body trickled a byte at a time, a store refusing writes (403); and `on_request(n)`, called before the n-th
request is answered (e.g. to rewrite a file mid-run). Answers carry the file's version as real
servers do: an ETag and Last-Modified from its mtime and size (as nginx), and on GCS's paths
its `x-goog-generation` (its mtime in ns).

`TrickleProxy` puts the trickle in front of any other server (moto's S3): a TCP proxy whose
answers, once `trickle_s` is set, go back a byte at a time, headers and body alike.
"""

import json
import random
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class RangeServer:
    def __init__(self, root: Path, latency_s: float = 0.0, error_rate: float = 0.0, seed: int = 0):
        self.root = Path(root)
        self.latency_s, self.error_rate = latency_s, error_rate
        self.missing: set[str] = set()  # paths answered with 404
        self.redirects: dict[str, str] = {}  # path -> Location answered with 302
        self.ignore_ranges = False  # answer range requests with the whole file (200)
        self.dies_after: int | None = None  # from this many requests on, cut every connection unanswered
        self.wrong_range = False  # answer every range request with bytes 0-(length-1), saying so
        self.extra_bytes = 0  # append this many bytes to every 206 body (Content-Range as asked)
        self.trickle_s = 0.0  # send 206 bodies one byte every trickle_s seconds
        self.on_request = None  # called with the request count before each read is answered
        self.refuse_writes = False  # answer GCS uploads, copies and deletes with 403
        self.requests = 0
        self.size_requests = 0  # HEADs and GCS metadata GETs
        self.errors_sent = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RangeServer":
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real object stores

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                outer._answer(self, head=True)

            def do_GET(self):
                if not outer._gcs_write(self, "GET"):
                    outer._answer(self, head=False)

            def do_POST(self):
                outer._gcs_write(self, "POST")

            def do_DELETE(self):
                outer._gcs_write(self, "DELETE")

        # Bind the same port again after a stop, so clients see a server that came back.
        class Server(ThreadingHTTPServer):
            allow_reuse_address = True
            # Several processes upload a checkpoint's files 8 at a time each (remote.UPLOAD_THREADS);
            # socketserver's backlog of 5 would reset connections a real store accepts.
            request_queue_size = 128

        self._server = Server(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="rangeserver").start()
        return self

    def stop(self) -> None:
        """Stop answering: new connections are refused (open ones are cut at their next request)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _send(self, handler, status: int, body: bytes = b"", headers: dict = {}, head: bool = False) -> None:
        handler.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            handler.send_header(k, v)
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def _gcs_write(self, handler, method: str) -> bool:
        """GCS JSON API listing and writes on the served dir (bucket B = the dir B); False when
        the request is none of those (a read, answered by `_answer`)."""
        parts = urllib.parse.urlsplit(handler.path)
        path, query = urllib.parse.unquote(parts.path), urllib.parse.parse_qs(parts.query)
        with self._lock:
            self.requests += 1
        if method == "GET":
            if not (path.startswith("/storage/v1/b/") and path.endswith("/o")):
                with self._lock:
                    self.requests -= 1  # counted by `_answer`
                return False
            bucket = self.root / path[len("/storage/v1/b/"):-len("/o")]
            prefix = query.get("prefix", [""])[0]
            items = [{"name": f.relative_to(bucket).as_posix(), "size": str(f.stat().st_size)}
                     for f in sorted(bucket.rglob("*")) if f.is_file() and f.relative_to(bucket).as_posix().startswith(prefix)]
            self._send(handler, 200, json.dumps({"items": items}).encode())
            return True
        body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        if self.refuse_writes:
            self._send(handler, 403, b"forbidden")
            return True
        if method == "POST" and path.startswith("/upload/storage/v1/b/"):
            bucket = path[len("/upload/storage/v1/b/"):].partition("/")[0]
            target = self.root / bucket / query["name"][0]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            self._send(handler, 200, json.dumps({"name": query["name"][0], "size": str(len(body))}).encode())
            return True
        bucket, _, name = path[len("/storage/v1/b/"):].partition("/o/")
        if method == "POST" and "/rewriteTo/b/" in name:
            source, _, rest = name.partition("/rewriteTo/b/")
            to_bucket, _, to_name = rest.partition("/o/")
            target = self.root / to_bucket / to_name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((self.root / bucket / source).read_bytes())
            self._send(handler, 200, json.dumps({"done": True}).encode())
            return True
        if method == "DELETE":
            file = self.root / bucket / name
            if not file.is_file():
                self._send(handler, 404, b"not found")
            else:
                file.unlink()
                self._send(handler, 204)
            return True
        self._send(handler, 400, b"unsupported")
        return True

    def _answer(self, handler, head: bool) -> None:
        with self._lock:
            dead = self._server is None or (self.dies_after is not None and self.requests >= self.dies_after)
            self.requests += 1
        if dead:  # stopped, or killed: cut the connection without an answer
            handler.close_connection = True
            return
        if self.on_request is not None:
            self.on_request(self.requests)
        with self._lock:
            fail = self.error_rate and self._rng.random() < self.error_rate
            self.errors_sent += bool(fail)
        if self.latency_s:
            time.sleep(self.latency_s)
        if fail:
            return self._send(handler, 503, b"slow down", head=head)
        parts = urllib.parse.urlsplit(handler.path)
        path, metadata, gcs = urllib.parse.unquote(parts.path), False, False
        for prefix, is_meta in (("/download/storage/v1/b/", False), ("/storage/v1/b/", True)):
            if path.startswith(prefix):  # GCS JSON API: /b/BUCKET/o/OBJECT
                bucket, _, name = path[len(prefix):].partition("/o/")
                path, metadata, gcs = f"/{bucket}/{name}", is_meta, True
                break
        if path in self.redirects:
            return self._send(handler, 302, b"", {"Location": self.redirects[path]}, head=head)
        file = self.root / path.lstrip("/")
        if path in self.missing or not file.is_file():
            return self._send(handler, 404, b"not found", head=head)
        stat = file.stat()
        size = stat.st_size
        version = {"ETag": f'"{stat.st_mtime_ns:x}-{size:x}"',
                   "Last-Modified": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(stat.st_mtime)),
                   **({"x-goog-generation": str(stat.st_mtime_ns)} if gcs else {})}
        if metadata or head:
            with self._lock:
                self.size_requests += 1
        if metadata:
            return self._send(handler, 200, json.dumps({"size": str(size), "generation": str(stat.st_mtime_ns)}).encode(),
                              head=head)
        if head:
            handler.send_response(200)
            handler.send_header("Content-Length", str(size))
            for k, v in version.items():
                handler.send_header(k, v)
            handler.end_headers()
            return
        spec = handler.headers.get("Range")
        if not spec or self.ignore_ranges:
            return self._send(handler, 200, file.read_bytes())
        start, _, end = spec.removeprefix("bytes=").partition("-")
        start, end = int(start), min(int(end), size - 1)
        if start >= size:
            return self._send(handler, 416, b"", {"Content-Range": f"bytes */{size}"})
        if self.wrong_range:
            start, end = 0, end - start
        with open(file, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1) + b"\0" * self.extra_bytes
        headers = {"Content-Range": f"bytes {start}-{end}/{size}", **version}
        if not self.trickle_s:
            return self._send(handler, 206, body, headers)
        self._send(handler, 206, b"", {**headers, "Content-Length": str(len(body))}, head=True)
        for i in range(len(body)):  # each byte well within the client's socket timeout
            time.sleep(self.trickle_s)
            try:
                handler.wfile.write(body[i:i + 1])
                handler.wfile.flush()
            except OSError:  # the client gave up
                return


class TrickleProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` (host, port): requests pass at once; answers pass
    at once too, or, while `trickle_s` is set, one byte every `trickle_s` seconds (each gap far
    under a client's socket timeout, so only a wall-clock deadline ends such a read)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream, self.trickle_s = upstream, 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # stopped
                return
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if not (answers and self.trickle_s):
                    dst.sendall(data)
                    continue
                for i in range(len(data)):
                    time.sleep(self.trickle_s)
                    dst.sendall(data[i:i + 1])
        except OSError:  # either side gave up
            pass
        for sock in (src, dst):  # one side closed: so does the other
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
