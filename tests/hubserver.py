"""A small Hugging Face Hub stand-in for tests: real HTTP on 127.0.0.1, the routes and headers huggingface_hub uses.

- ``GET /api/models/ORG/NAME/revision/REV``: model info with the commit sha and each file's size (``blobs``).
- ``HEAD``/``GET /ORG/NAME/resolve/REV/FILE``: small files answer 200 with ``ETag`` (git blob sha1),
  ``X-Repo-Commit`` and ``Content-Length``; ``*.safetensors`` (LFS) answer 302 to a second server on another port
  (the CDN, so the client drops its token as it does for the real CDN) with ``X-Linked-Etag`` (sha256) and
  ``X-Linked-Size``.
- The CDN serves blobs with ``Range`` support (206 and ``Content-Range``).
- Errors as the Hub sends them: ``X-Error-Code`` RepoNotFound (401 without a token, 404 with one),
  RevisionNotFound (404), EntryNotFound (404), GatedRepo (401 without a token, 403 with a wrong one).

``drop_once[FILE] = N``: the first GET of FILE sends its headers and N bytes, then closes the connection.
Every request is logged (method, path, Range, Authorization). Both servers stop when the ``with`` block ends,
or by themselves after ``lifetime`` seconds.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], gated: dict[str, str] | None = None, lifetime: float = 120.0) -> None:
        self.repos = {rid: {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
                      for rid, folder in repos.items()}
        self.gated = gated or {}  # repo id -> the token that may read it
        self.drop_once: dict[str, int] = {}
        self.log: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.lifetime = lifetime
        self.hub = self._server(self._hub_handler())
        self.cdn = self._server(self._cdn_handler())
        self.endpoint = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self.blobs = {hashlib.sha256(data).hexdigest(): data
                      for files in self.repos.values() for data in files.values()}

    # ----- lifecycle -----

    @staticmethod
    def _server(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        return server

    def __enter__(self) -> FakeHub:
        self.threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
                        for s in (self.hub, self.cdn)]
        for t in self.threads:
            t.start()
        self.timer = threading.Timer(self.lifetime, self.close)  # never outlives a hung test
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.timer.cancel()
        for s in (self.hub, self.cdn):
            s.shutdown()
            s.server_close()

    # ----- what happened -----

    def requests(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.log if kind is None or r["server"] == kind]

    def downloads(self) -> list[dict[str, Any]]:
        """GETs of file contents (small files from the hub, weights from the CDN)."""
        return [r for r in self.requests()
                if r["method"] == "GET" and ("/resolve/" in r["path"] or r["server"] == "cdn")]

    # ----- handlers -----

    def _record(self, server: str, handler: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.log.append({"server": server, "method": handler.command, "path": handler.path,
                             "range": handler.headers.get("Range"),
                             "authorization": handler.headers.get("Authorization")})

    def _hub_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(_Base):
            def do_GET(self) -> None:
                hub._record("hub", self)
                hub._hub(self, body=True)

            def do_HEAD(self) -> None:
                hub._record("hub", self)
                hub._hub(self, body=False)

        return Handler

    def _cdn_handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(_Base):
            def do_GET(self) -> None:
                hub._record("cdn", self)
                hub._cdn(self, body=True)

            def do_HEAD(self) -> None:
                hub._record("cdn", self)
                hub._cdn(self, body=False)

        return Handler

    def _hub(self, h: _Base, body: bool) -> None:
        path = h.path.split("?", 1)[0]
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if api:
            self._model_info(h, api.group(1), api.group(2) or "main")
            return
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            h.reply(404, b"", {"X-Error-Code": "RepoNotFound"})
            return
        repo_id, rev, name = m.groups()
        files = self.repos.get(repo_id)
        if files is None:
            h.reply(404, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            return
        if rev not in ("main", COMMIT):
            h.reply(404, b"", {"X-Error-Code": "RevisionNotFound"})
            return
        if repo_id in self.gated:
            auth = h.headers.get("Authorization")
            if auth != f"Bearer {self.gated[repo_id]}":
                h.reply(403 if auth else 401, b"", {"X-Error-Code": "GatedRepo",
                                                    "X-Error-Message": "Access to this model is restricted."})
                return
        if name not in files:
            h.reply(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            return
        data = files[name]
        if name.endswith(".safetensors"):
            sha = hashlib.sha256(data).hexdigest()
            h.reply(302, b"", {"Location": f"{self.cdn_url}/blobs/{sha}", "X-Repo-Commit": COMMIT,
                               "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                               "ETag": f'"{_git_sha(data)}"'})
            return
        h.reply(200, data if body else b"", {"ETag": f'"{_git_sha(data)}"', "X-Repo-Commit": COMMIT},
                length=len(data), drop=self._take_drop(name) if body else None)

    def _model_info(self, h: _Base, repo_id: str, rev: str) -> None:
        files = self.repos.get(repo_id)
        if files is None:  # like the Hub: 401 to a caller without a token, 404 with one
            h.reply(404 if h.headers.get("Authorization") else 401, b'{"error":"Repository not found"}',
                    {"X-Error-Code": "RepoNotFound"})
            return
        if rev not in ("main", COMMIT):
            h.reply(404, b'{"error":"Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
            return
        siblings = []
        for name, data in files.items():
            entry: dict[str, Any] = {"rfilename": name, "size": len(data), "blobId": _git_sha(data)}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        info = {"id": repo_id, "sha": COMMIT, "private": False, "gated": "manual" if repo_id in self.gated else False,
                "siblings": siblings}
        payload = json.dumps(info).encode()
        h.reply(200, payload, {"Content-Type": "application/json"})

    def _cdn(self, h: _Base, body: bool) -> None:
        m = re.fullmatch(r"/blobs/([0-9a-f]{64})", h.path.split("?", 1)[0])
        data = self.blobs.get(m.group(1)) if m else None
        if data is None:
            h.reply(404, b"")
            return
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))  # type: ignore[union-attr]
        part = data[start:]
        headers = {"ETag": f'"{m.group(1)}"', "Accept-Ranges": "bytes"}  # type: ignore[union-attr]
        if rng:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        name = next((n for files in self.repos.values() for n, d in files.items() if d is data), "")
        h.reply(206 if rng else 200, part if body else b"", headers, length=len(part),
                drop=self._take_drop(name) if body else None)

    def _take_drop(self, name: str) -> int | None:
        with self.lock:
            return self.drop_once.pop(name, None)


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # a stuck client cannot hold a handler thread for ever

    def log_message(self, *args: Any) -> None:  # keep test output clean
        return None

    def reply(self, status: int, payload: bytes, headers: dict[str, str] | None = None, length: int | None = None,
              drop: int | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload) if length is None else length))
        self.end_headers()
        if drop is not None:  # a connection lost in the middle of the body
            self.wfile.write(payload[:drop])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if payload:
            self.wfile.write(payload)


def _git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
