"""A chat completion request, read and checked: OpenAI's fields that maskkv honours, and its own under ``maskkv``.

Checked here, before the request queues, so that a malformed one costs nothing and gets a 400 naming the field.
Fields OpenAI defines that change nothing for a diffusion model here (``top_p``, the penalties, ``user``,
``logit_bias``, ...) are accepted and ignored, as other local servers do; fields that ask for something maskkv cannot
give (``n`` > 1, ``tools``, ``logprobs``) are refused, so that a client never takes silence for support.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from maskkv_cli.defaults import LAYER_BUDGET_CHOICES
from maskkv_cli.server.errors import bad_request

__all__ = ["EXTENSION_KEY", "ChatRequest", "Extensions", "conversation_question", "parse_chat"]

EXTENSION_KEY = "maskkv"  # the one key a request's (and an answer's) maskkv fields live under
MAX_STOPS = 4  # as OpenAI's API
ROLES = ("system", "developer", "user", "assistant")
LONG_MODES = ("truncate", "rope-scale")
DOCUMENT_ID = re.compile(r"[0-9a-fA-F]{6,64}")
EXTENSION_FIELDS = ("policy", "budget", "ratio", "threshold", "layer_budgets", "documents", "long")
REFUSED = {
    "tools": "tools (function calling) are not supported; send plain messages",
    "functions": "functions (function calling) are not supported; send plain messages",
    "logprobs": "logprobs are not supported; maskkv reports the answer's confidence under \"maskkv\" instead",
    "top_logprobs": "top_logprobs are not supported; maskkv reports the answer's confidence under \"maskkv\" instead",
}


@dataclass(frozen=True)
class Extensions:
    """The request's ``maskkv`` object: how the prompt cache is compressed, and which stored documents to read."""

    policy: str | None = None
    budget: int | None = None
    ratio: float | None = None
    threshold: float | None = None
    layer_budgets: str | None = None
    documents: tuple[str, ...] = ()  # ids (SHA-256 or a unique prefix of 6+ hex digits) in the document store
    long: str | None = None  # a document longer than the window: truncate or rope-scale


@dataclass(frozen=True)
class ChatRequest:
    question: str  # what the model is asked: the last user message, after the earlier turns if any
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    maskkv: Extensions = field(default_factory=Extensions)


def parse_chat(body: bytes) -> ChatRequest:
    """Read a ``POST /v1/chat/completions`` body; an ``APIError`` (400) names the first field that is wrong."""
    data = json_object(body)
    for key, why in REFUSED.items():
        if data.get(key) not in (None, False, [], 0):
            raise bad_request(why, key, "unsupported_parameter")
    n = data.get("n")
    if n is not None and (n != 1 or isinstance(n, bool) or not isinstance(n, int | float)):  # (True == 1)
        raise bad_request(f"n must be 1 (one answer per request); got {shown(n)}", "n", "unsupported_parameter")
    max_tokens = optional_int(data, "max_completion_tokens", 1) or optional_int(data, "max_tokens", 1)
    stream_options = data.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string (any name: this server runs one model)", "model")
    return ChatRequest(
        question=conversation_question(data.get("messages")),
        max_tokens=max_tokens,
        temperature=optional_float(data, "temperature", 0.0, 2.0),
        seed=optional_int(data, "seed", 0, 2**63 - 1),
        stop=stops(data.get("stop")),
        stream=optional_bool(data, "stream"),
        include_usage=optional_bool(stream_options or {}, "include_usage", "stream_options.include_usage"),
        model=model,
        maskkv=extensions(data.get(EXTENSION_KEY)),
    )


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text; send a JSON object", code="invalid_json") from None
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object",
                          code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body nests its JSON too deeply; send a JSON object of messages",
                          code="invalid_json") from None
    try:  # JSON may escape half of a UTF-16 pair ("\ud800"), which no text can hold (the tokenizer fails on it)
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body holds a lone UTF-16 surrogate (half of an escaped character pair); "
                          "send whole characters", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not a {type(data).__name__}",
                          code="invalid_json")
    return data


def message_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts whose parts are all ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                  "supported", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts", where)


def conversation_question(messages: Any) -> str:
    """The text the model is asked. One user message is asked as it is (the prompt ``maskkv ask`` builds for the
    same question); earlier turns, system messages included, come before it as ``Role: text`` lines."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", where)
        turns.append((role, message_text(msg.get("content"), where)))
    role, last = turns[-1]
    if role != "user":
        raise bad_request(f"the last message must be the user's question; it is a {role} message", "messages")
    if not last.strip():
        raise bad_request("the last user message is empty; write the question", "messages")
    if len(turns) == 1:
        return last
    earlier = "\n".join(f"{r.capitalize()}: {text.strip()}" for r, text in turns[:-1] if text.strip())
    return f"{earlier}\n\n{last}" if earlier else last


def stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items) or len(items) > MAX_STOPS:
        raise bad_request(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return tuple(items)


def extensions(value: Any) -> Extensions:
    """The request's ``maskkv`` object; an unknown field in it is an error (a typo must not pass silently)."""
    if value is None:
        return Extensions()
    if not isinstance(value, dict):
        raise bad_request(f"{EXTENSION_KEY} must be an object such as {{\"policy\": \"maskkv\", \"budget\": 64}}",
                          EXTENSION_KEY)
    unknown = sorted(set(value) - set(EXTENSION_FIELDS))
    if unknown:
        raise bad_request(f"unknown {EXTENSION_KEY} field {unknown[0]!r}; the fields are {', '.join(EXTENSION_FIELDS)}",
                          f"{EXTENSION_KEY}.{unknown[0]}")
    prefix = f"{EXTENSION_KEY}."
    policy = optional_str(value, "policy", prefix)
    if policy is not None:
        from maskkv_cli.policies.base import policy_names

        if policy not in policy_names():
            raise bad_request(f"unknown policy {policy!r}; choose one of {', '.join(policy_names())} (GET /v1/models "
                              "lists them)", f"{prefix}policy")
    budget = optional_int(value, "budget", 1, None, prefix)
    ratio = optional_float(value, "ratio", 0.0, 1.0, prefix, open_low=True)
    if budget is not None and ratio is not None:
        raise bad_request(f"give either {prefix}budget or {prefix}ratio, not both", f"{prefix}ratio")
    return Extensions(
        policy=policy,
        budget=budget,
        ratio=ratio,
        threshold=optional_float(value, "threshold", 0.0, 1.0, prefix, open_high=True),
        layer_budgets=choice(value, "layer_budgets", LAYER_BUDGET_CHOICES, prefix),
        documents=document_ids(value.get("documents"), f"{prefix}documents"),
        long=choice(value, "long", LONG_MODES, prefix),
    )


def document_ids(value: Any, param: str) -> tuple[str, ...]:
    """Store ids only: a SHA-256 or a prefix of at least 6 hex digits (never a path on the server)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise bad_request(f"{param} must be a list of document ids (from POST or GET /v1/documents)", param)
    for item in items:
        if not DOCUMENT_ID.fullmatch(item):
            raise bad_request(f"{param}: {item[:80]!r} is not a document id; give the id POST /v1/documents "
                              "returned (hex, 6 to 64 characters), listed by GET /v1/documents", param)
    return tuple(dict.fromkeys(i.lower() for i in items))


# ------------------------------------------------------------------------------------------- typed fields


def optional_bool(data: dict[str, Any], key: str, param: str | None = None) -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{param or key} must be true or false; got {value!r}", param or key)
    return value


def optional_str(data: dict[str, Any], key: str, prefix: str = "") -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{prefix}{key} must be a string; got {value!r}", prefix + key)
    return value


def choice(data: dict[str, Any], key: str, allowed: tuple[str, ...], prefix: str = "") -> str | None:
    value = optional_str(data, key, prefix)
    if value is not None and value not in allowed:
        raise bad_request(f"{prefix}{key} must be one of {', '.join(allowed)}; got {value!r}", prefix + key)
    return value


def optional_int(data: dict[str, Any], key: str, low: int, high: int | None = None, prefix: str = "") -> int | None:
    value = data.get(key)
    if value is None:
        return None
    top = "" if high is None else f" to {high}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise bad_request(f"{prefix}{key} must be an integer from {low}{top}; got {shown(value)}", prefix + key)
    return value


def optional_float(data: dict[str, Any], key: str, low: float, high: float, prefix: str = "", *,
                   open_low: bool = False, open_high: bool = False) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits (JSON numbers are unbounded)
            number = math.inf if value > 0 else -math.inf
    above = number > low if open_low else number >= low
    below = number < high if open_high else number <= high
    if not (above and below):
        span = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise bad_request(f"{prefix}{key} must be a number in {span}; got {shown(value)}", prefix + key)
    return number


def shown(value: Any, most: int = 40) -> str:
    """``repr(value)`` for an error message, cut to ``most`` characters (a number of 400 digits is refused too)."""
    text = repr(value)
    return text if len(text) <= most else f"{text[: most - 3]}..."
