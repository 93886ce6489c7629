"""The answer's shapes: OpenAI's ``chat.completion`` and ``chat.completion.chunk`` objects (with maskkv's figures
under ``maskkv``), server-sent events, and ``EventStream``, a streamed response that notices a client that leaves."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from maskkv_cli.server.answering import Completion
from maskkv_cli.server.chat_request import EXTENSION_KEY

__all__ = ["EventStream", "Reply", "sse"]


class Reply:
    """The ids and names one answer's objects share."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def completion(self, done: Completion) -> dict[str, Any]:
        return {**self.head("chat.completion"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "finish_reason": done.finish_reason, "logprobs": None}],
                "usage": usage(done), EXTENSION_KEY: done.figures}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**self.head("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}

    def last_chunk(self, done: Completion) -> dict[str, Any]:
        """The chunk that ends the choice: its finish reason, and maskkv's figures."""
        return {**self.chunk({}, done.finish_reason), EXTENSION_KEY: done.figures}

    def usage_chunk(self, done: Completion) -> dict[str, Any]:
        """OpenAI's extra chunk for ``stream_options.include_usage``: no choices, the usage."""
        return {**self.head("chat.completion.chunk"), "choices": [], "usage": usage(done)}


def usage(done: Completion) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class EventStream:
    """A ``text/event-stream`` response that listens for the client's disconnect while it sends, whatever the
    server's ASGI version, and then calls ``on_disconnect`` (which cancels the generation) and stops sending."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # nginx: pass each event on as it comes

        async def listen(group: anyio.abc.TaskGroup) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.on_disconnect()
            group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(listen, group)
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        except OSError:  # the connection broke under a send
            self.on_disconnect()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
