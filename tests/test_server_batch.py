"""``maskkv serve`` with a batch size above 1: requests in flight together share their generations' forward passes,
each answer equal to what the request gets alone; a client that leaves stops only its own generation."""

from __future__ import annotations

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
from serving import API_KEY, QUESTION, corpus, health, post_json, upload, wait_for

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")

from maskkv_cli.server import BackgroundServer, ServerConfig, create_app  # noqa: E402

BATCH = 4


@pytest.fixture(scope="module")
def documents(session, store_root):
    """Three documents of different lengths, each with its own needle, uploaded through a one-at-a-time server."""
    texts = {name: corpus(name)[:chars] + f" The special magic number for harbor is {number}. "
             for name, chars, number in (("bees.txt", 900, 4821), ("rivers.txt", 1800, 7310), ("trains.txt", 2600,
                                                                                                 1962))}
    with BackgroundServer(create_app(session, ServerConfig(api_key=API_KEY, store_root=store_root))) as url:
        return [upload(url, name, text.encode()).json()["id"] for name, text in texts.items()]


def _requests(documents: list[str]) -> list[dict]:
    questions = (QUESTION, "What is the special magic number for apple?", "Who keeps the bees?")
    return [{"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": q}],
             "maskkv": {"documents": [d], "policy": policy, "budget": 16}}
            for d in documents for q in questions for policy in ("maskkv",)] + [
        {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
         "maskkv": {"documents": [documents[0]], "policy": "snapkv", "budget": 8}}]


def _answers(url: str, bodies: list[dict]) -> list[tuple]:
    def one(body: dict) -> tuple:
        reply = post_json(url, "/v1/chat/completions", body)
        assert reply.status == 200, reply.body
        data = reply.json()
        ext = data["maskkv"]
        return (data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"], data["usage"],
                ext["confidence"], ext["stats"]["kv_entries"], ext["stats"]["steps_run"])

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def test_requests_in_flight_share_forwards_and_get_their_own_answers(session, store_root, documents, monkeypatch):
    import maskkv_cli.sampling.driver as driver

    lanes: list[int] = []
    real = driver.step_logits
    monkeypatch.setattr(driver, "step_logits", lambda model, given: lanes.append(len(given)) or real(model, given))
    bodies = _requests(documents)
    one_at_a_time = ServerConfig(api_key=API_KEY, store_root=store_root, queue=len(bodies))
    with BackgroundServer(create_app(session, one_at_a_time)) as url:
        alone = _answers(url, bodies)
        scaled = _answers(url, [{**bodies[0], "maskkv": {**bodies[0]["maskkv"], "long": "rope-scale"}}])
    assert set(lanes) == {1}  # the one-at-a-time server never shares a step
    config = ServerConfig(api_key=API_KEY, store_root=store_root, batch_size=BATCH, queue=len(bodies))
    with BackgroundServer(create_app(session, config)) as url:
        together = _answers(url, bodies)
        assert health(url)["queue"]["capacity"] == BATCH + len(bodies)
        # rope-scale is a request's own RoPE table: it runs beside the others and gets its answer alone
        assert _answers(url, [{**bodies[0], "maskkv": {**bodies[0]["maskkv"], "long": "rope-scale"}}]) == scaled
    assert together == alone
    assert max(lanes) > 1  # requests really stepped together
    assert session.engine is None  # the server's generation service stopped with it


def test_a_client_that_leaves_stops_only_its_own_generation(session, store_root, documents):
    config = ServerConfig(api_key=API_KEY, store_root=store_root, batch_size=BATCH, queue=2, timeout_s=120)
    body = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}],
            "maskkv": {"documents": [documents[1]]}}
    with BackgroundServer(create_app(session, config)) as url:
        expected = post_json(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        slow = {"model": "x", "stream": True, "max_tokens": 256, "messages": [{"role": "user", "content": QUESTION}],
                "maskkv": {"documents": [documents[0]]}}
        conn.request("POST", "/v1/chat/completions", json.dumps(slow).encode(),
                     {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        wait_for(lambda: health(url)["queue"]["running"] == 1, what="the slow request running")
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(post_json, url, "/v1/chat/completions", body)
            wait_for(lambda: health(url)["queue"]["running"] == 2, what="both requests running")
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            reply = other.result(timeout=60)
        assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"] == expected
        wait_for(lambda: health(url)["queue"]["running"] == 0, timeout=10, what="the slow generation stopping")
        assert health(url)["queue"]["cancelled"] == 1


def test_the_batch_size_a_server_runs(session, store_root, monkeypatch):
    """auto: as many window-long prompts as fit by the memory model, at most 1 + queue, said in a line; a number as
    given, for a block-causal model too (its steps share the engine like every family's)."""
    from maskkv_cli.server.app import serving_batch_size

    size, line = serving_batch_size(session, ServerConfig(batch_size=None, queue=3))
    assert size == 4 and line.startswith("batch size auto: 4")
    assert serving_batch_size(session, ServerConfig(batch_size=6)) == (6, None)
    monkeypatch.setattr(session.model, "config", session.model.config.with_(attention="block_causal"))
    assert session.model.config.block_causal
    assert serving_batch_size(session, ServerConfig(batch_size=6)) == (6, None)
