"""The settings of one server: who may call it, how much a request may send, the queue and the time limit, and the
run settings a request starts from (the command line's ``--policy``, ``--budget``, ...; a request's own win)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from maskkv_cli.app.run_settings import RunSettings
from maskkv_cli.errors import UsageError

__all__ = ["MIB", "ServerConfig"]

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None  # when set, every /v1 request must carry it as a Bearer token
    queue: int = 8  # requests that may wait behind the running ones; more get 429
    timeout_s: float = 300.0  # a request's time limit, waiting in the queue included
    max_body_bytes: int = 1 * MIB  # a JSON request body
    max_upload_bytes: int = 32 * MIB  # a document upload (the multipart body)
    settings: RunSettings = field(default_factory=RunSettings)  # what a request does not say
    long: str = "truncate"  # a document longer than the window: truncate, parts or rope-scale
    store_root: Path | None = None  # the document store (default: the one `maskkv ingest` fills)
    batch_size: int | None = 1  # requests whose generations run together; None: as many as fit (auto)

    def __post_init__(self) -> None:
        if self.queue < 0:
            raise UsageError(f"--queue must be 0 or more, got {self.queue}")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be a positive number or auto, got {self.batch_size}")
        if self.timeout_s <= 0 or self.max_body_bytes <= 0 or self.max_upload_bytes <= 0:
            raise UsageError("--timeout, --max-body-mb and --max-upload-mb must be positive")
