"""What the server's tests share: a needle document, plain HTTP requests (the standard library's client, so that a
malformed request is exactly what the test wrote), a multipart upload, and waiting for the server's figures."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

QUESTION = "What is the special magic number for harbor?"
NEEDLE_ANSWER = "4821"
API_KEY = "test-key-7d1f"


def corpus(name: str) -> str:
    return (resources.files("maskkv_cli") / "assets" / "corpus" / name).read_text(encoding="utf-8")


def needle_text(chars: int = 4000) -> str:
    """A text of the shipped corpus with one needle fact in it (the embedded model finds it)."""
    text = corpus("bees.txt")[:chars]
    cut = len(text) // 2
    return text[:cut] + " The special magic number for harbor is 4821. " + text[cut:]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float = 60) -> Reply:
    """One HTTP request as given (no retries, no rewriting); the answer's status, headers and body."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def post_json(url: str, path: str, data: Any, key: str | None = API_KEY) -> Reply:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return request(url, "POST", path, json.dumps(data).encode(), headers)


def multipart(filename: str, content: bytes, field: str = "file") -> tuple[bytes, str]:
    """A multipart/form-data body with one file field, and its content type."""
    boundary = uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    return head + content + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def upload(url: str, filename: str, content: bytes, key: str | None = API_KEY, field: str = "file") -> Reply:
    body, kind = multipart(filename, content, field)
    headers = {"Content-Type": kind}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return request(url, "POST", "/v1/documents", body, headers)


def health(url: str) -> dict[str, Any]:
    return request(url, "GET", "/health").json()


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "the condition") -> float:
    """Poll ``condition`` until it holds; return the seconds it took (fail after ``timeout``)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.02)
    return time.monotonic() - start


def assert_openai_error(reply: Reply, status: int, code: str | None = None) -> dict[str, Any]:
    """The reply is OpenAI's error shape with ``status`` (and ``code``), one line, no traceback."""
    assert reply.status == status, (reply.status, reply.body[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error
