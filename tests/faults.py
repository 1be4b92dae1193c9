"""A fault-injecting HTTP proxy in front of a real server: requests pass through unchanged
unless a rule says to answer them with an error instead. Used to make a real MLflow server
fail in exactly the ways the tests name (5xx on every call, on writes only, on one endpoint)."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

# (method, path, body) -> True to fail the request
Rule = Callable[[str, str, bytes], bool]


def fail_all(method: str, path: str, body: bytes) -> bool:
    return True


def fail_writes(method: str, path: str, body: bytes) -> bool:
    return method != "GET"


def fail_registry(method: str, path: str, body: bytes) -> bool:
    """The model registry (champion reads, versions, aliases); runs and their logs pass."""
    return "registered-models" in path or "model-versions" in path


def after(trigger: str, rule: Rule) -> Rule:
    """`rule`, but only once a request whose path contains `trigger` has gone through."""
    seen = threading.Event()

    def conditional(method: str, path: str, body: bytes) -> bool:
        if seen.is_set():
            return rule(method, path, body)
        if trigger in path:
            seen.set()
        return False

    return conditional


def once(rule: Rule) -> Rule:
    """`rule`, for the first request it matches only."""
    hit = threading.Event()

    def first(method: str, path: str, body: bytes) -> bool:
        if hit.is_set() or not rule(method, path, body):
            return False
        hit.set()
        return True

    return first


@dataclass
class FaultProxy:
    """Serves on 127.0.0.1:<port> and forwards to `upstream`; `rule` may be changed at any time."""

    upstream: str
    rule: Rule | None = None
    failed: list[str] = field(default_factory=list)  # "METHOD path" of every request it failed
    # What a failed request is answered: (status, JSON body); a 503 unless a test says otherwise.
    answer: tuple[int, dict] = (503, {"error_code": "TEMPORARILY_UNAVAILABLE", "message": "injected fault"})

    def __post_init__(self):
        proxy = self
        target = urlsplit(self.upstream)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()  # the blank line after the last chunk
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                body = self._body()
                rule = proxy.rule
                if rule is not None and rule(self.command, self.path, body):
                    proxy.failed.append(f"{self.command} {self.path}")
                    status, answer = proxy.answer
                    payload = json.dumps(answer).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("host", "connection", "transfer-encoding", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            def do_HEAD(self):
                rule = proxy.rule
                if rule is not None and rule("HEAD", self.path, b""):
                    proxy.failed.append(f"HEAD {self.path}")
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request("HEAD", self.path, headers=headers)
                resp = conn.getresponse()
                resp.read()
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.end_headers()
                conn.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def training_workers(parent: int) -> list[int]:
    """The pids of torch-elastic's worker processes under `pyflyte run` (pid `parent`), oldest
    first: local rank 0 is started first. Read from /proc. A forked worker has its parent's
    command line; a spawned one runs multiprocessing's `spawn_main`."""
    own = (Path("/proc") / str(parent) / "cmdline").read_bytes()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:  # the field after the state: ppid
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if cmdline == own or b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return sorted(found)
