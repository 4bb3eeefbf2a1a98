"""`python -m olmo_eqx.data.serve DIR`: serve a directory of token files over HTTP with byte ranges.

olmo_eqx reads remote token files by byte-range requests only (olmo_eqx/data/remote.py), and
Python's own `python -m http.server` answers a range request with the whole file (200), which a
run refuses. This is the same server plus single `Range: bytes=a-b` answers (206 with
Content-Range; 416 past the end), enough to try training from a URL on one machine:

    python -m olmo_eqx.data.serve ~/.cache/olmo_eqx/embedded-v1 &      # the embedded corpus' files
    python -m olmo_eqx +stage=pretrain data.source=http://127.0.0.1:8000/train.npy \
        +data.heldout.stdlib=http://127.0.0.1:8000/heldout.npy

For real data use a server or object store of your own (any that serves ranges).
"""

import argparse
import io
import os
import re
import sys
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class RangeRequestHandler(SimpleHTTPRequestHandler):
    """`SimpleHTTPRequestHandler` answering a single byte range of a file."""

    def send_head(self):  # noqa: D102 (http.server's hook)
        header = self.headers.get("Range")
        path = self.translate_path(self.path)
        if header is None or os.path.isdir(path):
            return super().send_head()
        match = _RANGE.fullmatch(header.strip())
        if match is None or not (match[1] or match[2]):
            self.send_error(400, f"only a single byte range is served, not {header!r}")
            return None
        try:
            file = open(path, "rb")
        except OSError:
            self.send_error(404, "File not found")
            return None
        with file:
            size = os.fstat(file.fileno()).st_size
            if match[1]:
                start, end = int(match[1]), min(int(match[2]) if match[2] else size - 1, size - 1)
            else:  # a suffix: the last N bytes
                start, end = max(size - int(match[2]), 0), size - 1
            if start >= size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            file.seek(start)
            body = file.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return io.BytesIO(body)

    def log_message(self, format: str, *args) -> None:
        pass  # a line per instance read would drown the terminal


def make_server(directory: Path, port: int = 8000, bind: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server of `directory` (not yet serving: call `serve_forever`); port 0 picks a free one."""
    handler = partial(RangeRequestHandler, directory=str(directory))
    return ThreadingHTTPServer((bind, port), handler)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m olmo_eqx.data.serve", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="the directory to serve")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--bind", default="127.0.0.1", help="the address to listen on (default: this machine only)")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"error: {args.directory} is not a directory; give the directory of the token files to serve", file=sys.stderr)
        sys.exit(2)
    try:
        server = make_server(args.directory.resolve(), args.port, args.bind)
    except OSError as e:
        print(f"error: cannot listen on {args.bind}:{args.port} ({e.strerror}); choose another --port", file=sys.stderr)
        sys.exit(2)
    host, port = server.server_address[:2]
    print(f"serving {args.directory.resolve()} at http://{host}:{port}/ with byte ranges (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
