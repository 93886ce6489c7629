"""The checks of the library's entry points (``Session``, ``pipeline.ask``, ``ask_many``) on what a caller passes:
a wrong type is a ``TypeError`` naming the argument, a value the model cannot take a ``UsageError``, instead of an
error from deep inside the tokenizer or torch ("TextEncodeInput must be Union[...]", "index out of range in
self")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral
from typing import Any

from maskkv_cli.errors import UsageError
from maskkv_cli.sampling.common import check_vocabulary


def require(where: str, name: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """Raise a ``TypeError`` saying that ``where``'s ``name`` must be ``what`` unless ``value`` is a ``kind``."""
    if not isinstance(value, kind):
        raise TypeError(f"{where}: {name} must be {what}, got {type(value).__name__}")


def question_arguments(where: str, gen: Any, cache: Any, items: Sequence[tuple[Any, Any]]) -> None:
    """``ask``'s and ``ask_many``'s arguments: each text and question a ``str``, the generation and cache settings
    their classes."""
    from maskkv_cli.engine.plan import CacheConfig
    from maskkv_cli.sampling.llada import GenerationConfig

    for item in items:
        if isinstance(item, str | bytes) or not isinstance(item, Sequence) or len(item) != 2:
            raise TypeError(f"{where}: each item must be a (context, question) pair, got {item!r:.60}")
        context, question = item
        require(where, "context", context, str, "a str (the document's text)")
        require(where, "question", question, str, "a str")
    require(where, "gen", gen, GenerationConfig, "a GenerationConfig")
    require(where, "cache", cache, CacheConfig, 'a CacheConfig (e.g. CacheConfig(policy="maskkv", budget=256))')


def batch_size(where: str, size: Any) -> int:
    """A batch size of at least 1 (0 and below were taken as 1 without a word)."""
    require(where, "batch_size", size, Integral, "an int")
    if size < 1 or isinstance(size, bool):
        raise UsageError(f"{where}: batch_size must be at least 1, got {size}")
    return int(size)


def token_ids(where: str, ids: Any, vocab_size: int) -> None:
    """A prompt's ids: a sequence of ints, each a token of a vocabulary of ``vocab_size``."""
    if type(ids) is not list and (isinstance(ids, str | bytes) or not isinstance(ids, Sequence)):
        raise TypeError(f"{where}: ids must be a list of token ids, got {type(ids).__name__}")
    # (plain ints checked by their type alone: the abstract Integral check costs ~20 us a prompt of 80 ids, on every
    # prompt of a batch)
    odd = next((i for i in ids if type(i) is not int and (not isinstance(i, Integral) or isinstance(i, bool))), None)
    if odd is not None:
        raise TypeError(f"{where}: ids must be ints, got {type(odd).__name__} {odd!r}")
    if ids:
        check_vocabulary(where, min(ids), max(ids), vocab_size)


def rope_factor(where: str, factor: Any) -> None:
    """A RoPE base factor: a finite number of at least 1 (0, a negative or nan gave an empty answer, or an internal
    "prompt preference contains non-finite values")."""
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise TypeError(f"{where}: rope_factor must be a number, got {type(factor).__name__}")
    if not (math.isfinite(factor) and factor >= 1):
        raise UsageError(f"{where}: rope_factor must be a finite number of at least 1, got {factor}")
