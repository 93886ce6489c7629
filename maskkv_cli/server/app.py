"""The ASGI app of ``maskkv serve``: OpenAI's chat completions and models, maskkv's documents, the health figures
and the page that asks documents.

``create_app(session, config)`` serves one loaded model. The routes:

- ``GET /``: the page (one static HTML file, no build step, nothing fetched from elsewhere);
- ``GET /health``: ``ok``, the model and the queue's figures (no key needed, for probes);
- ``GET /v1/models``: the one model (a request's ``model`` may name it or be any string);
- ``POST /v1/chat/completions``: OpenAI's request and answer (``stream: true``: server-sent events, a chunk whenever
  committed text grows), with maskkv's fields under ``maskkv``;
- ``POST /v1/documents`` (a multipart field ``file``), ``GET /v1/documents``: the document store.

``Gate`` stands in front of every route: the API key, then the body size limits. Every refusal is OpenAI's error
shape (``errors.APIError``); an error nobody foresaw is a 500 whose body names it in one line, with the traceback in
the server's log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from maskkv_cli.app.session import Session
from maskkv_cli.documents.store import DocumentStore
from maskkv_cli.errors import MaskKVError, UsageError
from maskkv_cli.models.quantize import quantization_of
from maskkv_cli.sampling.service import GenerationService
from maskkv_cli.server.answering import Completion, answer_chat, plan_request
from maskkv_cli.server.chat_request import EXTENSION_KEY, parse_chat
from maskkv_cli.server.config import ServerConfig
from maskkv_cli.server.documents import ingest_upload, list_documents, resolve_documents, upload_field
from maskkv_cli.server.errors import APIError
from maskkv_cli.server.responses import EventStream, Reply, sse
from maskkv_cli.server.runner import Cancelled, Job, QueueFull, Runner, ShuttingDown, TimedOut

__all__ = ["Gate", "create_app", "model_id"]

log = logging.getLogger("maskkv.server")
DONE = object()  # the end of a stream's pieces


def model_id(model_path: str, quantization: str = "none") -> str:
    """What ``/v1/models`` calls the model: a folder's name, or the Hugging Face id as given; ``:int8`` / ``:int4``
    after it when its weights are quantized, so that a client (or a cache in front of the server) never takes a
    quantized model's answers for the unquantized one's."""
    path = Path(model_path)
    name = path.name if path.exists() else model_path
    return name if quantization == "none" else f"{name}:{quantization}"


def page_html() -> str:
    return (resources.files("maskkv_cli.server") / "static" / "index.html").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------- the gate


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over the server's limit of {limit:,} bytes")
        self.limit = limit


def too_large(limit: int, upload: bool) -> APIError:
    what = ("the upload is over the server's limit of" if upload else "the request body is over the server's limit of")
    flag = "--max-upload-mb" if upload else "--max-body-mb"
    size = f"{limit / (1 << 20):.4g} MiB" if limit >= 1 << 20 else f"{limit:,} bytes"  # (not "0.00999928 MiB")
    return APIError(413, f"{what} {size}; send less, or start the server with a larger {flag}",
                    code="request_too_large")


class Gate:
    """ASGI middleware: a /v1 request needs the API key (when one is set, as ``Authorization: Bearer KEY``, compared
    in constant time); a body may not exceed its route's limit (uploads have their own), whether it declares its
    length or not. An exception no handler took (a bug) is answered here as the API's 500, logged once (Starlette's
    last handler answers it too, then raises it again for the server to log a second time)."""

    def __init__(self, app: Any, api_key: str | None, max_body: int, max_upload: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body, self.max_upload = max_body, max_upload

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None and scope["path"].startswith("/v1/") and not self.authorized(headers):
            error = APIError(401, "a valid API key is required: send it as Authorization: Bearer KEY (the key the "
                             "server was started with, --api-key or MASKKV_API_KEY)", kind="authentication_error",
                             code="invalid_api_key", headers={"www-authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        upload = scope["path"].rstrip("/") == "/v1/documents"
        limit = self.max_upload if upload else self.max_body
        declared = headers.get("content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await error_response(too_large(limit, upload))(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except Exception as exc:
            if started:  # a stream already under way: nothing can be answered any more
                raise
            await error_response(job_error(exc))(scope, receive, send)

    def authorized(self, headers: dict[str, bytes]) -> bool:
        value = headers.get("authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and self.key is not None and hmac.compare_digest(token.strip(), self.key)


def error_response(error: APIError) -> JSONResponse:
    headers = dict(error.headers)
    if error.status == 429 and "retry-after" not in headers:
        headers["retry-after"] = "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def job_error(exc: BaseException) -> APIError:
    """What a failed generation answers (the job's exception, or one raised while preparing it)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TimedOut):
        return APIError(504, f"{exc}; ask for fewer max_tokens, or start the server with a longer --timeout",
                        kind="timeout_error", code="timeout")
    if isinstance(exc, Cancelled):
        return APIError(499, "the client closed the request", code="cancelled")
    if isinstance(exc, ShuttingDown):
        return APIError(503, "the server is shutting down; send the request again once it is back",
                        kind="server_error", code="shutting_down")
    if isinstance(exc, QueueFull):
        return APIError(429, f"{exc}; retry after {exc.retry_after} s", kind="rate_limit_error", code="queue_full",
                        headers={"retry-after": str(exc.retry_after)})
    if isinstance(exc, UsageError):
        return APIError(400, str(exc))
    if isinstance(exc, MaskKVError):
        return APIError(500, str(exc), kind="server_error")
    if type(exc).__name__ == "OutOfMemoryError":
        return APIError(503, "the device ran out of memory; ask with a smaller maskkv.budget, fewer max_tokens or a "
                        "shorter document", kind="server_error", code="out_of_memory")
    log.error("request failed", exc_info=exc)
    first = str(exc).splitlines()[0] if str(exc) else ""
    return APIError(500, f"internal error ({type(exc).__name__}: {first}); the server's log has the details",
                    kind="server_error")


# ---------------------------------------------------------------------------------------------------- the app


class Server:
    """The routes' shared state: the session, the store, the runner, the settings."""

    def __init__(self, session: Session, config: ServerConfig) -> None:
        self.session = session
        self.config = config
        self.store = DocumentStore(config.store_root)
        self.batch_size, self.batch_note = serving_batch_size(session, config)
        if self.batch_size > 1:
            session.engine = GenerationService(session.model, self.batch_size)
        self.runner = Runner(config.queue, config.timeout_s, workers=self.batch_size)
        self.model = model_id(session.model_path, quantization_of(session.model))
        self.embedded = session.embedded
        self.page = page_html()
        self.ingesting = anyio.CapacityLimiter(2)  # PDF parsing at once: the rest of the uploads wait

    def stopping(self) -> None:
        """The server has begun to stop: every open request is answered "shutting down" (the running ones at their
        next step) while the connections are still open; new ones are refused the same way."""
        self.runner.shut_down()

    def close(self) -> None:
        """Stop the requests (the running ones at their next step), then the generation service."""
        self.runner.close()
        engine, self.session.engine = self.session.engine, None
        if engine is not None:
            engine.close()

    # -- routes ------------------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers={"cache-control": "no-cache"})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model, "queue": self.runner.snapshot()})

    async def models(self, request: Request) -> Response:
        from maskkv_cli.defaults import DEFAULT_BUDGET
        from maskkv_cli.policies.base import get_policy, policy_names

        s = self.config.settings
        evicts = get_policy(s.policy).evicts  # the budget a request gets: the server's, else the default's
        budget = DEFAULT_BUDGET if s.budget is None and s.ratio is None and evicts else s.budget
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "maskkv",
            EXTENSION_KEY: {"policies": policy_names(), "policy": s.policy, "budget": budget, "ratio": s.ratio,
                            "window": self.session.window, "max_tokens": s.gen_length or
                            self.session.generation_defaults.get("gen_length"), "embedded": self.embedded}}]})

    async def documents(self, request: Request) -> Response:
        return JSONResponse(await anyio.to_thread.run_sync(list_documents, self.store))

    async def upload(self, request: Request) -> Response:
        try:
            form = await request.form(max_files=1, max_fields=4)
        except BodyTooLarge:
            raise
        except Exception as exc:  # a malformed multipart body
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise APIError(400, f"the upload is not a readable multipart/form-data body ({first}); send the file "
                           "as the field file, e.g. curl -F file=@report.pdf", param="file") from None
        try:
            filename, upload = upload_field(form)
            password = form.get("password")
            data = await upload.read()
        finally:
            await form.close()
        if not data:
            raise APIError(400, f"{filename} is empty (0 bytes); upload a file that contains text", param="file")
        work = partial(ingest_upload, self.store, filename, data, password if isinstance(password, str) else None)
        return JSONResponse(await anyio.to_thread.run_sync(work, limiter=self.ingesting))

    async def chat(self, request: Request) -> Response:
        req = parse_chat(await request.body())
        docs = await anyio.to_thread.run_sync(resolve_documents, self.store, req.maskkv.documents)
        plan = plan_request(req, self.config.settings, self.config.long, self.session)
        reply = Reply(self.model)
        if not req.stream:
            job = self.runner.submit(partial(answer_chat, session=self.session, plan=plan, req=req, docs=docs,
                                             embedded=self.embedded))
            done: Completion = await self.outcome(job, request)
            return JSONResponse(reply.completion(done))
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the server is stopping
                loop.call_soon_threadsafe(pieces.put_nowait, item)

        job = self.runner.submit(partial(answer_chat, session=self.session, plan=plan, req=req, docs=docs,
                                         embedded=self.embedded, send=put))
        job.future.add_done_callback(lambda _: put(DONE))
        return EventStream(self.stream(job, pieces, reply, req.include_usage), job.cancel)  # type: ignore[return-value]

    # -- helpers -----------------------------------------------------------------------------------

    async def outcome(self, job: Job[Completion], request: Request) -> Completion:
        """The job's completion, cancelling it when the client disconnects before it ends."""
        result = asyncio.wrap_future(job.future)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when nobody waits for it
        gone = asyncio.ensure_future(disconnected(request.receive))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            gone.cancel()
        if not result.done():
            job.cancel()
            raise APIError(499, "the client closed the request", code="cancelled")
        try:
            return result.result()
        except Exception as exc:
            raise job_error(exc) from None

    async def stream(self, job: Job[Completion], pieces: asyncio.Queue[Any], reply: Reply,
                     include_usage: bool) -> AsyncIterator[bytes]:
        try:
            yield sse(reply.chunk({"role": "assistant", "content": ""}))
            while (piece := await pieces.get()) is not DONE:
                yield sse(reply.chunk({"content": piece}))
            try:
                done = job.future.result()
            except Exception as exc:  # the stream has begun: the error is its last event
                yield sse(job_error(exc).body())
            else:
                yield sse(reply.last_chunk(done))
                if include_usage:
                    yield sse(reply.usage_chunk(done))
            yield sse("[DONE]")
        finally:
            job.cancel()  # a no-op once the job is over; else the client has gone


def serving_batch_size(session: Session, config: ServerConfig) -> tuple[int, str | None]:
    """How many requests' generations run together: the configured size, or for auto the most window-long prompts
    that fit by the memory model (at most the running and waiting requests the queue admits), with the line saying
    so."""
    if config.batch_size is not None:
        return config.batch_size, None
    from maskkv_cli.engine.batch_memory import MAX_AUTO_BATCH

    settings = config.settings
    size, line = session.batch_size(None, [session.window] * min(MAX_AUTO_BATCH, 1 + config.queue),
                                    settings.generation(session.generation_defaults), settings.cache())
    return size, line


async def disconnected(receive: Callable[[], Any]) -> None:
    """Return when the client closes the connection (the body has been read: only a disconnect can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(session: Session, config: ServerConfig | None = None) -> Starlette:
    """The app serving ``session``'s model with ``config`` (default: ``ServerConfig()``)."""
    from starlette.middleware import Middleware

    config = config or ServerConfig()
    server = Server(session, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await anyio.to_thread.run_sync(server.close)

    async def api_error(request: Request, exc: Exception) -> Response:
        return error_response(exc if isinstance(exc, APIError) else job_error(exc))

    async def body_too_large(request: Request, exc: Exception) -> Response:
        upload = request.url.path.rstrip("/") == "/v1/documents"
        return error_response(too_large(exc.limit if isinstance(exc, BodyTooLarge) else 0, upload))

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {404: f"no such endpoint: {request.method} {request.url.path}; the API is under /v1 (see GET "
                        "/v1/models) and the page is at /",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(exc))
        headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}  # a 405 names its Allow methods
        return error_response(APIError(status, message, kind="invalid_request_error", code="not_found"
                                       if status == 404 else None, headers=headers or None))

    routes = [
        Route("/", server.index),
        Route("/health", server.health),
        Route("/v1/models", server.models),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/documents", server.documents, methods=["GET"]),
        Route("/v1/documents", server.upload, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {APIError: api_error, BodyTooLarge: body_too_large, HTTPException: http_error,
                                MaskKVError: api_error, QueueFull: api_error, Exception: api_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(Gate, api_key=config.api_key, max_body=config.max_body_bytes,
                                           max_upload=config.max_upload_bytes)])
    app.state.server = server
    app.state.on_stopping = server.stopping  # called by ``server.run`` as soon as a shutdown begins
    return app
