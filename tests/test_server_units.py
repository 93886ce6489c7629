"""The server's parts without a server: reading a chat request, the committed text a stream sends, the queue."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed: pip install -e '.[serve]'")

from maskkv_cli.server.answering import CommittedText, cut_at_stop, pending_stop  # noqa: E402
from maskkv_cli.server.chat_request import conversation_question, parse_chat  # noqa: E402
from maskkv_cli.server.errors import APIError  # noqa: E402
from maskkv_cli.server.runner import Cancelled, QueueFull, Runner, TimedOut  # noqa: E402

# ------------------------------------------------------------------------------------------- requests


def test_a_chat_request_reads_openai_fields_and_the_maskkv_object() -> None:
    req = parse_chat(b'{"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text",'
                     b' "text": "Who?"}]}],'
                     b' "max_completion_tokens": 32, "temperature": 0.5, "seed": 7, "stop": "END", "stream": true,'
                     b' "stream_options": {"include_usage": true}, "top_p": 0.9, "user": "u1",'
                     b' "maskkv": {"policy": "snapkv", "budget": 64, "threshold": 0.9, "documents": ["ABCDEF12"],'
                     b' "long": "rope-scale"}}')
    assert (req.question, req.max_tokens, req.temperature, req.seed, req.stop) == ("Who?", 32, 0.5, 7, ("END",))
    assert req.stream and req.include_usage and req.model == "gpt-4o"
    ext = req.maskkv
    assert (ext.policy, ext.budget, ext.threshold, ext.documents, ext.long) == ("snapkv", 64, 0.9, ("abcdef12",),
                                                                                 "rope-scale")


def test_one_user_message_is_the_question_and_earlier_turns_come_before_it() -> None:
    assert conversation_question([{"role": "user", "content": "  Who wrote it? "}]) == "  Who wrote it? "
    asked = conversation_question([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Who?"}])
    assert asked == "System: Be brief.\nUser: Hi\nAssistant: Hello.\n\nWho?"


@pytest.mark.parametrize(("body", "param", "words"), [
    (b'{"messages": []}', "messages", "non-empty"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0]", "text parts"),
    (b'{"messages": [{"role": "user", "content": "   "}]}', "messages", "empty"),
    (b'{"messages": [{"role": "user", "content": "q"}], "seed": true}', "seed", "integer"),
    (b'{"messages": [{"role": "user", "content": "q"}], "stop": ["a", "b", "c", "d", "e"]}', "stop", "up to 4"),
    (b'{"messages": [{"role": "user", "content": "q"}], "logprobs": true}', "logprobs", "confidence"),
    (b'{"messages": [{"role": "user", "content": "q"}], "stream_options": 3}', "stream_options", "object"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": []}', "maskkv", "object"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": {"ratio": 0}}', "maskkv.ratio", "(0, 1]"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": {"threshold": 1}}', "maskkv.threshold", "[0, 1)"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": {"long": "cut"}}', "maskkv.long", "truncate"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": {"documents": ["abc"]}}', "maskkv.documents",
     "6 to 64"),
    (b'{"messages": [{"role": "user", "content": "q"}], "maskkv": {"documents": "/etc/passwd"}}',
     "maskkv.documents", "not a document id"),
])
def test_a_wrong_field_is_named_in_one_line(body: bytes, param: str, words: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat(body)
    error = caught.value
    assert error.status == 400 and error.param == param and words in error.message and "\n" not in error.message


@pytest.mark.parametrize(("body", "words"), [
    (b'{"messages": [{"role": "user", "content": "hi\\ud800"}]}', "lone UTF-16 surrogate"),  # half an emoji
    (b'{"messages": [{"role": "user", "content": "q"}], "stop": ["\\udfff"]}', "lone UTF-16 surrogate"),
    (b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests its JSON too deeply"),
])
def test_bodies_python_reads_but_no_text_can_hold_are_a_400(body: bytes, words: str) -> None:
    """Valid JSON that still cannot be a request (a lone surrogate, which the tokenizer fails on; nesting deeper
    than the parser recurses) is a 400 invalid_json in one line, not a 500 with a traceback."""
    with pytest.raises(APIError) as caught:
        parse_chat(body)
    error = caught.value
    assert error.status == 400 and error.code == "invalid_json" and words in error.message


# ------------------------------------------------------------------------------------------- streamed text


@pytest.fixture(scope="module")
def tokenizer():
    from maskkv_cli.models.catalog import shipped_model
    from maskkv_cli.prompting import load_tokenizer

    return load_tokenizer(shipped_model())


MASK, EOS = 5, 1


def committed(tokenizer, answer: str, order: list[int] | None = None, stops: tuple[str, ...] = ()) -> tuple[
        list[str], CommittedText, list[int]]:
    """Commit ``answer``'s tokens (then EOS padding) in ``order`` (default left to right) one step at a time."""
    ids = tokenizer.encode(answer, add_special_tokens=False) + [EOS, EOS]
    pieces: list[str] = []
    text = CommittedText(tokenizer, {EOS}, MASK, stops, pieces.append)
    state = [MASK] * len(ids)
    for i in order or range(len(ids)):
        state[i] = ids[i]
        text.update(state)
    return pieces, text, ids


def test_committed_text_is_sent_as_it_grows_and_adds_up_to_the_answer(tokenizer) -> None:
    answer = "On a warm morning of early summer, a flowering lime tree hums."
    pieces, text, ids = committed(tokenizer, answer)
    assert len(pieces) > 5 and "".join(pieces) == answer
    assert text.finish(answer) == (answer, False) and "".join(pieces) == answer


def test_a_token_committed_out_of_order_waits_for_the_ones_before_it(tokenizer) -> None:
    answer = "The special magic number for harbor is 4821."
    n = len(tokenizer.encode(answer, add_special_tokens=False)) + 2
    order = list(range(n - 1, -1, -1))  # right to left: nothing is final until the first token is
    pieces, _, _ = committed(tokenizer, answer, order)
    assert pieces == [answer]


def test_a_stop_string_cuts_the_stream_and_its_start_is_held_back(tokenizer) -> None:
    pieces, text, _ = committed(tokenizer, "alpha beta END gamma", stops=("END",))
    assert "".join(pieces) == "alpha beta "  # "E", then "EN", were held back: they might have begun the stop
    assert text.finish("alpha beta END gamma") == ("alpha beta ", True)
    assert "".join(pieces) == "alpha beta "  # nothing after the stop string, ever
    assert cut_at_stop("x END y STOP", ("STOP", "END")) == ("x ", True)
    assert pending_stop("the answer is E", ("END",)) == 1 and pending_stop("the answer", ("END",)) == 0


# ------------------------------------------------------------------------------------------- the queue


def test_the_queue_admits_one_running_and_its_waiting_room_then_refuses() -> None:
    runner = Runner(queue=1, limit_s=30)
    gate = threading.Event()
    try:
        first = runner.submit(lambda job: gate.wait(10) and "first")
        second = runner.submit(lambda job: "second")
        with pytest.raises(QueueFull) as caught:
            runner.submit(lambda job: "third")
        assert caught.value.retry_after >= 1 and caught.value.capacity == 2
        gate.set()
        assert (first.future.result(10), second.future.result(10)) == ("first", "second")
        counts = runner.snapshot()
        assert (counts["answered"], counts["refused"], counts["running"], counts["waiting"]) == (2, 1, 0, 0)
    finally:
        gate.set()
        runner.close()


def test_a_cancelled_job_stops_at_its_next_check_and_a_waiting_one_never_runs() -> None:
    runner = Runner(queue=1, limit_s=30)
    started = threading.Event()
    ran: list[str] = []

    def steps(job):
        started.set()
        for _ in range(1000):
            job.check()
            time.sleep(0.01)
        return "finished"

    try:
        running = runner.submit(steps)
        waiting = runner.submit(lambda job: ran.append("waiting"))
        assert started.wait(10)
        waiting.cancel()
        running.cancel()
        with pytest.raises(Cancelled):
            running.future.result(10)
        assert waiting.future.cancelled()  # it never started: its place was given back when it was cancelled
        waiting.cancel()  # again (the client's handler and its stream both say so): counted once
        assert ran == [] and runner.snapshot()["cancelled"] == 2
    finally:
        runner.close()


def _stopped_job_frees_its_tensors(work_error: type[BaseException] | None) -> BaseException:
    """Run a job whose work holds a tensor and then stops (cancelled, or raising ``work_error``); return the future's
    error once the tensor is known to be freed (with the cycle collector off: by reference counts alone)."""
    import weakref

    import torch

    runner = Runner(queue=0, limit_s=30)
    held: list[weakref.ref[torch.Tensor]] = []

    def work(job):
        cache = torch.zeros(16)  # a generation's prompt cache, held by this frame when the error passes through it
        held.append(weakref.ref(cache))
        if work_error is not None:
            raise work_error("the engine broke")
        job.cancel()
        job.check()

    try:
        job = runner.submit(work)
        with pytest.raises(Exception) as caught:  # noqa: PT011
            job.future.result(10)
        deadline = time.monotonic() + 10
        while runner.snapshot()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held and held[0]() is None  # freed as the work unwound, though the future still holds the error
        return caught.value
    finally:
        runner.close()


def test_a_stopped_jobs_tensors_are_freed_without_the_cycle_collector(no_cycle_collector: None) -> None:
    """A cancelled, timed-out or failed job's traceback would hold its frames (a generation, its prompt cache) in a
    cycle with the job's future; the runner hands the error over without it. An error nobody foresaw keeps its stack
    as text for the server's log."""
    assert isinstance(_stopped_job_frees_its_tensors(None), Cancelled)
    error = _stopped_job_frees_its_tensors(RuntimeError)
    assert isinstance(error, RuntimeError)
    frames, tb = [], error.__traceback__
    while tb is not None:  # the traceback now: where the future raised it here, nothing of the work's
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "work" not in frames and "_run" not in frames
    notes = "\n".join(getattr(error, "__notes__", []))
    assert notes.startswith("Traceback (most recent call last):") and ", in work\n" in notes


def test_an_errors_cause_and_context_lose_their_tracebacks_too() -> None:
    """``raise A from B`` while handling C: B is A's cause, C its context, and each holds frames of its own."""
    from maskkv_cli.server.runner import without_frames

    def fail() -> None:
        try:
            raise ValueError("cause")
        except ValueError as exc:
            cause = exc
        try:
            raise KeyError("context")
        except KeyError:
            raise RuntimeError("error") from cause

    with pytest.raises(RuntimeError) as caught:
        fail()
    error = caught.value
    chain = [error, error.__cause__, error.__context__]
    assert isinstance(chain[1], ValueError) and isinstance(chain[2], KeyError)
    assert all(e.__traceback__ is not None for e in chain)
    without_frames(error, keep_stack=False)
    assert all(e.__traceback__ is None for e in chain) and not getattr(error, "__notes__", None)


def test_the_time_limit_counts_from_admission() -> None:
    runner = Runner(queue=0, limit_s=0.2)

    def slow(job):
        while True:
            job.check()
            time.sleep(0.01)

    try:
        job = runner.submit(slow)
        with pytest.raises(TimedOut):
            job.future.result(10)
        assert runner.snapshot()["timed_out"] == 1
    finally:
        runner.close()


def test_a_request_cancelled_while_it_waits_gives_its_queue_place_back_at_once() -> None:
    """A client that leaves while its request waits: the place is free at once (it was held until a worker
    reached the request, so others got 429 meanwhile), the request never runs, and it counts as cancelled once."""
    import threading

    from maskkv_cli.server.runner import QueueFull, Runner

    release, ran = threading.Event(), []
    runner = Runner(queue=1, limit_s=60)
    try:
        first = runner.submit(lambda job: (release.wait(10), ran.append("first")))
        waiting = runner.submit(lambda job: ran.append("waiting"))
        with pytest.raises(QueueFull):
            runner.submit(lambda job: ran.append("refused"))
        waiting.cancel()
        assert runner.snapshot()["waiting"] == 0 and runner.snapshot()["cancelled"] == 1
        third = runner.submit(lambda job: ran.append("third"))  # its place
        release.set()
        first.future.result(10)
        third.future.result(10)
        assert ran == ["first", "third"] and waiting.future.cancelled()
        assert runner.snapshot()["cancelled"] == 1 and runner.snapshot()["answered"] == 2
    finally:
        release.set()
        runner.close()


def test_a_document_stored_by_an_older_maskkv_is_read_again_or_named(tmp_path) -> None:
    """GET /v1/documents lists an entry of an older store format, which the store does not give (``get``): asking
    it was "no stored document has the id" for an id the list shows. It is parsed again from its file when that is
    still there, else the 404 says why."""
    import json

    from maskkv_cli.documents.store import DocumentStore
    from maskkv_cli.server.documents import resolve_documents

    store = DocumentStore(tmp_path / "store")
    source = tmp_path / "notes.txt"
    source.write_text("The special magic number for harbor is 4821.\n")
    doc, _ = store.ingest(source)
    entry = store.path_for(doc.sha256)
    older = {**json.loads(entry.read_text()), "format": 1}
    entry.write_text(json.dumps(older))
    assert store.get(doc.sha256) is None and [e.sha256 for e in store.list()] == [doc.sha256]
    (again,) = resolve_documents(store, (doc.sha256[:8],))
    assert again.sha256 == doc.sha256 and "4821" in again.text
    entry.write_text(json.dumps(older))
    source.unlink()
    with pytest.raises(APIError) as missing:
        resolve_documents(store, (doc.sha256,))
    assert missing.value.status == 404 and "stored by an older maskkv" in str(missing.value)
