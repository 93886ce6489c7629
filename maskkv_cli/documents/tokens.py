"""Count tokens in a text, offline.

With a model tokenizer the count is exact for that model.  Without one we use tiktoken's
``cl100k_base`` encoding, but only when its BPE file already sits in tiktoken's local cache:
tiktoken would otherwise download it on first use, and this tool never touches the network.
When the file is missing we fall back to a rough estimate (about four characters per token),
warn once per process, and say so in the returned method string.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Protocol

METHOD_MODEL = "model tokenizer"
METHOD_TIKTOKEN = "tiktoken cl100k_base"
METHOD_ESTIMATE_NOT_CACHED = "estimate (~4 chars/token; tiktoken encoding not cached locally)"
METHOD_ESTIMATE_NO_TIKTOKEN = "estimate (~4 chars/token; tiktoken not installed)"
METHOD_ESTIMATE_BROKEN = "estimate (~4 chars/token; tiktoken encoding could not be loaded)"

CHARS_PER_TOKEN = 4.0

# Where tiktoken fetches cl100k_base from, and the SHA-256 it expects of that file.  The local
# cache file name is the SHA-1 of this URL (see tiktoken.load.read_file_cached).
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


class TokenCountWarning(UserWarning):
    """Token counts are estimates because no tokenizer is available offline."""


class _Encoder(Protocol):
    def encode(self, text: str) -> Any: ...


_lock = threading.Lock()
_encoding: Any = None  # the loaded tiktoken Encoding, once we have it
_failure: str | None = None  # method string to report once loading has failed
_warned = False


def tiktoken_cache_dir() -> Path | None:
    """Return the folder tiktoken caches encodings in, or None when its caching is disabled."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        folder = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        folder = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        folder = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if folder == "":
        return None
    return Path(folder)


def cached_encoding_path(url: str = CL100K_URL, sha256: str = CL100K_SHA256) -> Path | None:
    """Return the cached file for ``url`` if it exists and has the expected content, else None.

    A present file with the wrong content counts as absent: tiktoken would delete it and fetch
    the file again.
    """
    folder = tiktoken_cache_dir()
    if folder is None:
        return None
    path = folder / hashlib.sha1(url.encode()).hexdigest()
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return path if digest == sha256 else None


class _NetworkBlocked(RuntimeError):
    pass


def _load_tiktoken() -> tuple[Any, str | None]:
    """Load cl100k_base from the local cache only; return (encoding, None) or (None, method)."""
    try:
        import tiktoken
        import tiktoken.load as tiktoken_load
    except ImportError:
        return None, METHOD_ESTIMATE_NO_TIKTOKEN
    if cached_encoding_path() is None:
        return None, METHOD_ESTIMATE_NOT_CACHED

    # The file is cached, so tiktoken reads it from disk.  Should its cache rules ever differ
    # from the ones mirrored above, refuse any remote read instead of downloading.
    original_read = tiktoken_load.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _NetworkBlocked(blobpath)
        return original_read(blobpath)

    tiktoken_load.read_file = local_only
    try:
        return tiktoken.get_encoding("cl100k_base"), None
    except _NetworkBlocked:
        return None, METHOD_ESTIMATE_NOT_CACHED
    except Exception:  # a damaged cache or an incompatible tiktoken: estimate instead
        return None, METHOD_ESTIMATE_BROKEN
    finally:
        tiktoken_load.read_file = original_read


def _get_encoding() -> tuple[Any, str | None]:
    global _encoding, _failure
    with _lock:
        if _encoding is None and _failure is None:
            _encoding, _failure = _load_tiktoken()
        return _encoding, _failure


def estimate_tokens(text: str) -> int:
    """Rough token count: one token per ~4 characters."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _warn_once(method: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"Token counts are estimates: {method}. Run tiktoken once with network access to cache "
        "cl100k_base, or use a model tokenizer for exact counts.",
        TokenCountWarning,
        stacklevel=3,
    )


def _encode_with(tokenizer: _Encoder, text: str) -> int:
    try:
        encoded = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[call-arg]
    except TypeError:
        encoded = tokenizer.encode(text)
    ids = getattr(encoded, "ids", encoded)  # tokenizers.Encoding carries its ids in .ids
    return len(ids)


def folder_tokenizer(folder: Path) -> Any | None:
    """The tokenizer of a model folder read with the ``tokenizers`` library when the folder has ``tokenizer.json``
    (no transformers, no torch; it counts as the model's own tokenizer does), else None."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a file the library cannot read: the caller falls back to the full tokenizer
        return None


def count_tokens(text: str, tokenizer: _Encoder | None = None) -> tuple[int, str]:
    """Return ``(count, method)`` for ``text``.

    ``tokenizer`` is any object with ``.encode(text)`` (a Hugging Face tokenizer, a tiktoken
    Encoding...).  Without it, tiktoken's cl100k_base is used when cached locally, otherwise a
    ~4 chars/token estimate.  Never reaches the network and never raises for a missing encoding.
    """
    if tokenizer is not None:
        return _encode_with(tokenizer, text), METHOD_MODEL
    encoding, failure = _get_encoding()
    if encoding is not None:
        return len(encoding.encode(text, disallowed_special=())), METHOD_TIKTOKEN
    method = failure or METHOD_ESTIMATE_NOT_CACHED
    _warn_once(method)
    return estimate_tokens(text), method


def _reset_for_tests() -> None:
    """Forget the loaded encoding and the warned-once flag."""
    global _encoding, _failure, _warned
    with _lock:
        _encoding = None
        _failure = None
        _warned = False
