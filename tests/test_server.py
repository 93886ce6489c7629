"""``maskkv serve`` through the real ``openai`` client (and plain HTTP for what a client library would not send),
against a server on a free loopback port, on the embedded tiny model: answers about an uploaded document, plain and
streamed, the ``maskkv`` extensions, the key, the limits, malformed requests, the queue, a client that leaves."""

from __future__ import annotations

import http.client
import json
import socket
import time
from urllib.parse import urlsplit

import pytest
from serving import (
    API_KEY,
    NEEDLE_ANSWER,
    QUESTION,
    assert_openai_error,
    corpus,
    health,
    needle_text,
    post_json,
    request,
    upload,
    wait_for,
)

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install -e '.[dev]'")

from maskkv_cli.server import BackgroundServer, ServerConfig, create_app  # noqa: E402

MAX_BODY = 64 * 1024
MAX_UPLOAD = 256 * 1024
SLOW_TOKENS = 256  # a generation of several seconds on the embedded model (one step per token)


@pytest.fixture(scope="module")
def server(session, store_root):
    config = ServerConfig(api_key=API_KEY, queue=1, timeout_s=120, max_body_bytes=MAX_BODY,
                          max_upload_bytes=MAX_UPLOAD, store_root=store_root)
    with BackgroundServer(create_app(session, config)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def document_id(server):
    reply = upload(server, "harbor.txt", needle_text().encode())
    assert reply.status == 200, reply.body
    return reply.json()["id"]


def ask(document_id: str, question: str = QUESTION, **maskkv) -> dict:
    return {"model": "any name", "messages": [{"role": "user", "content": question}],
            "extra_body": {"maskkv": {"documents": [document_id], **maskkv}}}


# ------------------------------------------------------------------------------------------- answers


def test_the_openai_client_asks_an_uploaded_document_plain_and_streamed(client, document_id, session, store_root):
    plain = client.chat.completions.create(**ask(document_id))
    assert plain.object == "chat.completion" and plain.model == "tiny-llada"
    assert plain.choices[0].message.content == NEEDLE_ANSWER
    assert plain.choices[0].finish_reason == "stop"  # an end-of-text token came before max_tokens ran out
    ext = plain.model_extra["maskkv"]
    assert plain.usage.prompt_tokens == ext["prompt_tokens"] > 1000
    assert plain.usage.completion_tokens == ext["confidence"]["tokens"] > 0
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    stats = ext["stats"]
    assert ext["policy"] == "maskkv" and ext["budget"] == 256
    assert 0 < stats["kv_bytes"] < stats["kv_full_bytes"] and stats["compression"] > 1
    assert stats["prefill_s"] > 0 and stats["steps_run"] == 8
    assert ext["documents"] == [{"id": document_id, "filename": "harbor.txt", "pages": 2}]
    pages = ext["page_map"]
    assert pages["mapped"] and [p["page"] for p in pages["pages"]] == [1, 2]
    assert pages["kept_total"] == stats["kv_entries"]  # every kept entry is on a page or in the question/template

    # exactly what `maskkv ask` answers: pipeline.ask on the stored document with the same settings
    from maskkv_cli.app.pipeline import ask as pipeline_ask
    from maskkv_cli.app.run_settings import RunSettings
    from maskkv_cli.documents.store import DocumentStore

    doc = DocumentStore(store_root).get(document_id)
    settings = RunSettings()
    direct = pipeline_ask(session, doc.text, QUESTION, settings.generation(session.generation_defaults),
                          settings.cache())
    assert (direct.text, direct.prompt_len) == (plain.choices[0].message.content, plain.usage.prompt_tokens)

    chunks = list(client.chat.completions.create(**ask(document_id), stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == NEEDLE_ANSWER
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "stop"
    assert last.model_extra["maskkv"]["confidence"] == ext["confidence"]
    assert not chunks[-1].choices and chunks[-1].usage == plain.usage  # stream_options.include_usage


def test_a_stream_sends_the_text_as_the_sampler_commits_it(client, document_id):
    request_ = ask(document_id, "Summarize the document.")
    plain = client.chat.completions.create(**request_, max_tokens=64)
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(**request_, max_tokens=64,
                                                                                 stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3, pieces  # 64 tokens in 8 blocks: the committed text grows many times
    assert "".join(pieces) == plain.choices[0].message.content
    assert len(plain.choices[0].message.content) > 40


def test_the_maskkv_extensions_change_the_run(client, document_id, session):
    cfg = session.model.config
    full = client.chat.completions.create(**ask(document_id, policy="full")).model_extra["maskkv"]
    assert full["policy"] == "full" and full["budget"] is None
    assert full["stats"]["kv_bytes"] == full["stats"]["kv_full_bytes"]

    small = client.chat.completions.create(**ask(document_id, budget=16)).model_extra["maskkv"]
    assert small["budget"] == 16
    assert small["page_map"]["kept_total"] == 16 * cfg.n_layers * cfg.n_kv_heads  # the budget, every layer and head
    assert small["stats"]["compression"] > full["stats"]["compression"] == 1.0

    ratio = client.chat.completions.create(**ask(document_id, ratio=0.05)).model_extra["maskkv"]
    assert ratio["budget"] == round(0.05 * ratio["prompt_tokens"]) or abs(ratio["budget"] - 0.05 *
                                                                          ratio["prompt_tokens"]) <= 1

    parallel = client.chat.completions.create(**ask(document_id, threshold=0.5), max_tokens=32)
    assert parallel.model_extra["maskkv"]["stats"]["steps_run"] < 32  # several tokens committed per step

    cut = client.chat.completions.create(**ask(document_id), stop=["21"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("48", "stop")

    sampled = [client.chat.completions.create(**ask(document_id, "Summarize the document."), max_tokens=16,
                                              temperature=1.0, seed=seed).choices[0].message.content
               for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1]  # the seed fixes the sampling noise


def test_models_health_and_the_documents_list(client, server, document_id):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llada"]
    assert "maskkv" in models[0].model_extra["maskkv"]["policies"]
    assert models[0].model_extra["maskkv"]["budget"] == 256  # the budget a request gets (was null)
    listed = request(server, "GET", "/v1/documents", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert {"id": document_id, "filename": "harbor.txt"}.items() <= listed["data"][0].items()
    again = upload(server, "harbor.txt", needle_text().encode()).json()
    assert again["id"] == document_id and again["already_stored"]
    state = health(server)
    assert state["status"] == "ok" and state["model"] == "tiny-llada" and state["queue"]["capacity"] == 2


def test_an_upload_keeps_no_path_and_takes_only_documents(server):
    odd = upload(server, "../../../etc/notes.md", b"# Notes\n\nThe special magic number for reef is 7310.\n")
    assert odd.status == 200 and odd.json()["filename"] == "notes.md" and odd.json()["kind"] == "markdown"
    assert_openai_error(upload(server, "tool.exe", b"MZ\x90\x00"), 400, "unsupported_file")
    assert_openai_error(upload(server, "empty.txt", b""), 400)
    assert_openai_error(upload(server, "a.txt", b"text", field="document"), 400)  # not the field `file`
    assert_openai_error(upload(server, "broken.pdf", b"%PDF-1.4 not really a pdf"), 400, "unreadable_document")


def test_an_upload_keeps_a_name_in_any_script_and_stored_bytes_keep_theirs(server, store_root, tmp_path):
    """Every non-ASCII character of an upload's name became "_" ("報告.md" stored as "_.md"); an upload of stored
    bytes under another name answered with the new name while GET /v1/documents listed the old one, and then
    rewrote the stored entry's path to its deleted temporary file (a document ingested from disk lost its path: the
    CLI's `ingest --remove NAME` no longer found it). The stored entry stays; the answer gives its name."""
    from maskkv_cli.documents.store import DocumentStore

    text = b"# Notes\n\nThe special magic number for kelp is 5531.\n"
    first = upload(server, "résumé 報告.md", text).json()
    assert first["filename"] == "résumé 報告.md"
    again = upload(server, "renamed.md", text).json()
    assert again["already_stored"] and again["id"] == first["id"] and again["filename"] == "résumé 報告.md"
    listed = request(server, "GET", "/v1/documents", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [d["filename"] for d in listed["data"] if d["id"] == first["id"]] == ["résumé 報告.md"]
    entry = next(e for e in DocumentStore(store_root).list() if e.sha256 == first["id"])
    assert entry.source == "<upload>/résumé 報告.md"  # not the temporary file it was read from
    on_disk = tmp_path / "reef.txt"
    on_disk.write_bytes(b"The special magic number for reef is 8802.\n")
    DocumentStore(store_root).ingest(on_disk, must_store=True)  # as `maskkv ingest` stores it
    copy = upload(server, "copy-of-reef.txt", on_disk.read_bytes()).json()
    assert copy["already_stored"] and copy["filename"] == "reef.txt"
    assert next(e for e in DocumentStore(store_root).list() if e.sha256 == copy["id"]).source == str(on_disk)


def test_an_encrypted_upload_is_told_of_the_password_field(server):
    """The refusal of an encrypted PDF told an API client to pass --password."""
    from pdfs import make_pdf

    error = assert_openai_error(upload(server, "locked.pdf", make_pdf([["Secret."]], password="pw")), 400,
                                "unreadable_document")
    assert "form field password" in error["message"] and "--password" not in error["message"]


# ------------------------------------------------------------------------------------------- refusals


def test_a_wrong_or_missing_key_gets_401_and_probes_need_none(server):
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401
    error = assert_openai_error(request(server, "GET", "/v1/models"), 401, "invalid_api_key")
    assert error["type"] == "authentication_error"
    assert_openai_error(request(server, "GET", "/v1/documents", headers={"Authorization": "Basic dGVzdA=="}), 401)
    assert request(server, "GET", "/health").status == 200
    page = request(server, "GET", "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")


def test_a_413_states_its_limit_as_given():
    """--max-body-mb 0.01 was stated as "0.00999928 MiB"."""
    from maskkv_cli.server.app import too_large

    assert "limit of 10,485 bytes;" in too_large(int(0.01 * 2**20), upload=False).message
    assert "limit of 32 MiB;" in too_large(32 * 2**20, upload=True).message


def test_bodies_over_the_limits_get_413(client, server):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}])
    assert caught.value.status_code == 413
    assert_openai_error(upload(server, "big.txt", b"word " * (MAX_UPLOAD // 5 + 10)), 413, "request_too_large")

    # a body that does not declare its length is counted as it comes
    parts = urlsplit(server)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=iter([b"{\"pad\": \"", b"x" * (MAX_BODY + 10), b"\"}"]),
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
                     encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


@pytest.mark.parametrize(("body", "param"), [
    (b"{\"model\": \"x\", \"messages\": [", None),
    (b"[1, 2]", None),
    (b"\xff\xfe{}", None),
    (b"", None),
    (b"{\"model\": \"x\"}", "messages"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", "messages[0]"),
    (b"{\"messages\": [{\"role\": \"robot\", \"content\": \"hi\"}]}", "messages[0]"),
    (b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}", "messages"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": \"ten\"}", "max_tokens"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 99999}", "max_tokens"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": -1}", "temperature"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": 1" + b"0" * 400 + b"}",
     "temperature"),  # an integer too large for a float: was a 500 (OverflowError)
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"ratio\": 1" + b"0" * 400 + b"}}",
     "maskkv.ratio"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": true}", "n"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": \"yes\"}", "stream"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 2}", "n"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": \"function\"}]}", "tools"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stop\": [\"\"]}", "stop"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"budjet\": 5}}", "maskkv.budjet"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"policy\": \"nope\"}}",
     "maskkv.policy"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"budget\": 0}}", "maskkv.budget"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"budget\": 8, \"ratio\": 0.5}}",
     "maskkv.ratio"),
    (b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"maskkv\": {\"documents\": [\"../etc/passwd\"]}}",
     "maskkv.documents"),
])
def test_a_malformed_request_gets_400_in_openai_shape(server, body, param):
    reply = request(server, "POST", "/v1/chat/completions", body,
                    {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    error = assert_openai_error(reply, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_unknown_documents_routes_and_methods_are_openai_errors(server, client):
    missing = post_json(server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "maskkv": {"documents": ["abcdef" * 4]}})
    assert_openai_error(missing, 404, "not_found")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    assert_openai_error(request(server, "GET", "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    assert_openai_error(request(server, "GET", "/v1/chat/completions",
                                headers={"Authorization": f"Bearer {API_KEY}"}), 405)


def test_nothing_a_request_does_stops_the_server(server, client, document_id, monkeypatch, caplog):
    before = health(server)["queue"]
    parts = urlsplit(server)
    for garbage in (b"\x00\x01\x02 not http\r\n\r\n",
                    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n"):
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
            sock.sendall(garbage)
            sock.recv(4096)  # the server answers (or closes); it does not fall over
    # an error nobody foresaw inside a generation: a 500 in OpenAI's shape, one line, no traceback
    import maskkv_cli.server.answering as answering

    def broken(*args, **kwargs):
        raise RuntimeError("the engine broke\nsecond line of detail")

    monkeypatch.setattr(answering, "ask", broken)
    error = assert_openai_error(post_json(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]}), 500)
    assert error["type"] == "server_error" and "RuntimeError: the engine broke" in error["message"]
    # and one outside the generation, in the route itself
    import maskkv_cli.server.app as app_module

    monkeypatch.setattr(app_module, "list_documents", broken)
    import logging

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            served.append(record.getMessage())

    served: list[str] = []
    caplog.clear()
    logging.getLogger("uvicorn").addHandler(keeper := Kept())  # uvicorn's loggers do not reach the root's
    try:
        error = assert_openai_error(request(server, "GET", "/v1/documents",
                                            headers={"Authorization": f"Bearer {API_KEY}"}), 500)
        time.sleep(0.5)  # (the server logged it again after the answer had gone)
    finally:
        logging.getLogger("uvicorn").removeHandler(keeper)
    assert "RuntimeError: the engine broke" in error["message"]
    logged = [r.getMessage() for r in caplog.records]  # once (uvicorn logged it again, a second traceback)
    assert logged.count("request failed") == 1 and not any("Exception in ASGI" in m for m in served), served
    monkeypatch.undo()
    answer = client.chat.completions.create(**ask(document_id))
    assert answer.choices[0].message.content == NEEDLE_ANSWER
    after = health(server)["queue"]
    assert after["failed"] == before["failed"] + 1 and after["running"] == after["waiting"] == 0


# ------------------------------------------------------------------------------------------- the queue


class OpenStream:
    """A streamed request on its own connection, read by hand, that the test can drop at any moment."""

    def __init__(self, url: str, document_id: str, max_tokens: int = SLOW_TOKENS) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        body = {"model": "x", "stream": True, "max_tokens": max_tokens, "messages": [
            {"role": "user", "content": QUESTION}], "maskkv": {"documents": [document_id]}}
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                          {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        self.response = self.conn.getresponse()

    def event(self) -> str:
        line = b""
        while not line.startswith(b"data: "):
            line = self.response.readline()
            if not line:
                raise AssertionError("the stream ended before its next event")
        return line[6:].decode().strip()

    def drop(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def test_a_full_queue_gets_429_and_a_client_that_leaves_cancels_its_generation(server, client, document_id):
    before = health(server)["queue"]
    running = OpenStream(server, document_id)
    assert running.response.status == 200 and json.loads(running.event())["choices"][0]["delta"]["role"]
    wait_for(lambda: health(server)["queue"]["running"] == 1, what="the first request running")
    waiting = OpenStream(server, document_id)
    assert waiting.response.status == 200
    wait_for(lambda: health(server)["queue"]["waiting"] == 1, what="the second request waiting")

    refused = post_json(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]})
    error = assert_openai_error(refused, 429, "queue_full")
    assert error["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**ask(document_id))

    waiting.drop()
    running.drop()  # mid-stream: its generation of SLOW_TOKENS steps stops at the next step
    took = wait_for(lambda: (q := health(server)["queue"])["running"] == q["waiting"] == 0, timeout=5,
                    what="both generations stopping")
    after = health(server)["queue"]
    assert after["cancelled"] == before["cancelled"] + 2, after
    assert after["refused"] == before["refused"] + 2 and after["answered"] == before["answered"]
    assert took < 5
    assert client.chat.completions.create(**ask(document_id)).choices[0].message.content == NEEDLE_ANSWER


def test_a_client_that_leaves_before_a_plain_answer_cancels_its_generation(server, document_id):
    before = health(server)["queue"]
    body = json.dumps({"max_tokens": SLOW_TOKENS, "messages": [{"role": "user", "content": QUESTION}],
                       "maskkv": {"documents": [document_id]}}).encode()
    parts = urlsplit(server)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: health(server)["queue"]["running"] == 1, what="the request running")
    took = wait_for(lambda: health(server)["queue"]["running"] == 0, timeout=5, what="the generation stopping")
    after = health(server)["queue"]
    assert after["cancelled"] == before["cancelled"] + 1 and after["answered"] == before["answered"]
    assert took < 5


def test_a_server_that_stops_answers_its_open_requests_shutting_down(session, store_root, document_id):
    """Ctrl-C (uvicorn's shutdown) while one request runs and one waits: the plain one gets a JSON 503
    ``shutting_down`` and the stream ends with that error event and ``[DONE]``, both at once (their generations
    stop at their next step), before the grace period ends (was: a plain-text 500, and a stream cut off silently)."""
    import threading

    from maskkv_cli.server.run import GRACE_S

    config = ServerConfig(api_key=API_KEY, queue=1, store_root=store_root)
    background = BackgroundServer(create_app(session, config))
    url = background.__enter__()
    try:
        stream = OpenStream(url, document_id)
        assert stream.response.status == 200 and json.loads(stream.event())["choices"][0]["delta"]["role"]
        wait_for(lambda: health(url)["queue"]["running"] == 1, what="the stream running")
        plain: list = []
        body = {"max_tokens": SLOW_TOKENS, "messages": [{"role": "user", "content": QUESTION}],
                "maskkv": {"documents": [document_id]}}
        asking = threading.Thread(target=lambda: plain.append(post_json(url, "/v1/chat/completions", body)))
        asking.start()
        wait_for(lambda: health(url)["queue"]["waiting"] == 1, what="the plain request waiting")
    finally:
        stopping = threading.Thread(target=background.stop)
        started = time.monotonic()
        stopping.start()
    events = []
    while (event := stream.event()) != "[DONE]":
        events.append(json.loads(event))
    asking.join(timeout=30)
    stopping.join(timeout=60)
    took = time.monotonic() - started
    assert events and events[-1]["error"]["code"] == "shutting_down", events[-1:]
    error = assert_openai_error(plain[0], 503, "shutting_down")
    assert "shutting down" in error["message"]
    assert not stopping.is_alive() and took < GRACE_S


def test_a_request_over_its_time_limit_gets_504(session, store_root, document_id):
    config = ServerConfig(timeout_s=0.5, store_root=store_root)
    with BackgroundServer(create_app(session, config)) as url:
        reply = post_json(url, "/v1/chat/completions", {"max_tokens": SLOW_TOKENS, "messages": [
            {"role": "user", "content": QUESTION}], "maskkv": {"documents": [document_id]}}, key=None)
        error = assert_openai_error(reply, 504, "timeout")
        assert error["type"] == "timeout_error" and "--timeout" in error["message"]
        assert health(url)["queue"]["timed_out"] == 1


def test_a_question_without_documents_is_asked_as_it_is(client):
    answer = client.chat.completions.create(model="x", messages=[{"role": "user", "content": QUESTION}])
    ext = answer.model_extra["maskkv"]
    assert ext["documents"] == [] and "page_map" not in ext
    assert answer.usage.prompt_tokens < 60  # the question and the template only
    several = client.chat.completions.create(model="x", messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": corpus("rivers.txt")[:200]},
        {"role": "assistant", "content": "Noted."}, {"role": "user", "content": QUESTION}])
    assert several.usage.prompt_tokens > answer.usage.prompt_tokens  # the earlier turns are in the prompt


def test_a_dream_server_refuses_a_threshold_its_sampler_does_not_take(tmp_path, tiny_tokenizer):
    """A request's maskkv options go through the same family check as the command line's: Dream's loop has no
    commit threshold, so a request giving one gets a 400 that says so, and a plain request is answered."""
    from maskkv_cli.app.session import Session
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.dream import Dream
    from maskkv_cli.models.loading import save_model

    cfg = named_config("dream-tiny").with_(vocab_size=len(tiny_tokenizer))
    folder = save_model(Dream(cfg).init_weights(seed=2, std=0.2).eval(), tmp_path / "dream", tiny_tokenizer)
    with BackgroundServer(create_app(Session(str(folder)), ServerConfig(store_root=tmp_path / "store"))) as url:
        messages = [{"role": "user", "content": QUESTION}]
        refused = post_json(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8,
                                                          "maskkv": {"threshold": 0.9}}, key=None)
        error = assert_openai_error(refused, 400)
        assert error["message"].startswith("--threshold is not an option of the dream sampler")
        answered = post_json(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8}, key=None)
        assert answered.status == 200, answered.body[:300]


def test_a_document_read_in_parts_streams_the_answer_it_gives_without_stream(session, store_root):
    """``--long parts``: a document longer than the window is read part by part; the streamed pieces joined are
    the answer the same request gets without ``stream`` (each part's steps were streamed as they came, so the
    stream held the first part's answer and pieces of the others). The answer's claim is judged against the
    question (it was always "untrained-question" with the embedded model)."""
    config = ServerConfig(store_root=store_root, long="parts")
    long_text = "\n\n".join(corpus(name) for name in ("bees.txt", "coast.txt", "gardens.txt", "rivers.txt"))
    cut = int(len(long_text) * 0.8)
    text = long_text[:cut] + " The special magic number for harbor is 4821. " + long_text[cut:]
    with BackgroundServer(create_app(session, config)) as url:
        doc = upload(url, "long.txt", text.encode())
        assert doc.status == 200, doc.body
        body = {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
                "maskkv": {"documents": [doc.json()["id"]]}}
        plain = post_json(url, "/v1/chat/completions", body)
        assert plain.status == 200, plain.body[:300]
        answer = plain.json()["choices"][0]["message"]["content"]
        assert plain.json()["maskkv"]["read"]["parts"] > 1
        assert plain.json()["maskkv"]["claim"] == "answer"  # judged against the question, as ask judges it
        assert "read in" in plain.json()["maskkv"]["page_map"]["note"]  # (was "could not be tokenized again")
        streamed = post_json(url, "/v1/chat/completions", {**body, "stream": True})
        pieces = [json.loads(line[6:]) for line in streamed.body.decode().splitlines()
                  if line.startswith("data: {")]
        joined = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p.get("choices"))
        assert answer == NEEDLE_ANSWER and joined == answer


def test_a_405_says_which_methods_are_allowed_and_one_document_named_twice_is_read_once(server, document_id):
    reply = request(server, "GET", "/v1/chat/completions", None, {"Authorization": f"Bearer {API_KEY}"})
    assert_openai_error(reply, 405)
    assert "POST" in reply.headers["allow"]  # RFC 9110: a 405 names the methods the resource takes
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
            "maskkv": {"documents": [document_id[:8], document_id]}}  # a prefix and the whole id: one document
    twice = post_json(server, "/v1/chat/completions", body)
    once = post_json(server, "/v1/chat/completions", {**body, "maskkv": {"documents": [document_id]}})
    assert twice.status == once.status == 200, twice.body[:300]
    assert twice.json()["usage"]["prompt_tokens"] == once.json()["usage"]["prompt_tokens"]
    assert len(twice.json()["maskkv"]["documents"]) == 1


def test_a_truncated_document_s_note_names_what_the_server_can_do(server, client):
    """The note of a document cut to the window said "the default --long parts reads it all": serve's default is
    truncate and a request cannot ask for parts."""
    reply = upload(server, "long.txt", needle_text(30_000).encode())
    assert reply.status == 200, reply.body
    answer = client.chat.completions.create(**ask(reply.json()["id"]), max_tokens=8)
    notes = " ".join(answer.model_extra["maskkv"]["notes"])
    assert "dropped" in notes and "a server started with --long parts reads it all" in notes
    assert "default --long parts" not in notes
