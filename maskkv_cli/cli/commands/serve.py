"""``maskkv serve``: an OpenAI-compatible server for the stored documents, and a page to ask them
(``maskkv_cli/server/``, ``docs/server.md``)."""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from maskkv_cli.cli.common import fail, guarded, note
from maskkv_cli.cli.options import LongOpt, ServeBatchOpt
from maskkv_cli.cli.run_options import CACHE, MODEL, SAMPLER, RunOptions, run_options
from maskkv_cli.prompting.fit import check_long
from maskkv_cli.runtime.devices import resolve_device

MIB = 1 << 20
MOST_MIB = 1 << 20  # a size limit of 1 TiB at most (an infinite one cannot be counted in bytes)
SERVE_PACKAGES = ("starlette", "uvicorn", "multipart")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@guarded
@run_options(*CACHE, *SAMPLER, *MODEL, "quiet")
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on; 127.0.0.1 keeps the server to this "
                                      "machine, 0.0.0.0 opens it to the network (then set --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: a free one, "
                                      "printed at start).")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="MASKKV_API_KEY", help="Require this key on every /v1 request, as `Authorization: "
        "Bearer KEY` (the openai client's api_key).", show_default=False)] = None,
    queue: Annotated[int, typer.Option("--queue", min=0, help="Requests that may wait while the running ones "
                                       "run; more are refused with 429 and Retry-After.")] = 8,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="A request's time limit in seconds, waiting "
                                           "in the queue included (then 504).")] = 300.0,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", min=0.001, max=MOST_MIB,
                                               help="Largest JSON request body, MiB (then 413).")] = 1.0,
    max_upload_mb: Annotated[float, typer.Option("--max-upload-mb", min=0.001, max=MOST_MIB,
                                                 help="Largest document upload, MiB (then 413).")] = 32.0,
    long: LongOpt = "truncate",
    batch_size: ServeBatchOpt = "auto",
    *,
    opts: RunOptions,
) -> None:
    """Serve the model over HTTP with OpenAI's chat completions API, for the documents in the store: the openai
    client, editors and agents can ask them, and the page at / asks them in a browser. The options below set
    what a request does not (a request's `maskkv` object may give policy, budget or ratio, layer budgets,
    threshold, long and documents).

    Examples:

        maskkv serve                                  # then open http://127.0.0.1:8000/

        maskkv serve --model GSAI-ML/LLaDA-8B-Instruct --budget 128 --port 8080

        maskkv serve --model inclusionAI/LLaDA2.1-mini --quantize int4   # /v1/models names it LLaDA2.1-mini:int4

        MASKKV_API_KEY=secret maskkv serve --host 0.0.0.0   # on the network, with a key

        curl -F file=@report.pdf http://127.0.0.1:8000/v1/documents   # upload: its id

    docs/server.md has the API, the openai client, the limits and running behind a proxy.
    """
    import importlib.util

    missing = [p for p in SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise fail(f"maskkv serve needs {', '.join(missing)}: install them with pip install 'maskkv[serve]'", 2)
    from maskkv_cli.engine.batch_memory import parse_batch_size
    from maskkv_cli.server import ServerConfig, create_app
    from maskkv_cli.server import serve as run_server
    from maskkv_cli.server.run import ListenError, bind

    settings = opts.settings()
    settings.cache()  # a bad --budget or --ratio stops here, before the model loads
    check_long(long)
    config = ServerConfig(api_key=api_key or None, queue=queue, timeout_s=timeout,
                          max_body_bytes=int(max_body_mb * MIB), max_upload_bytes=int(max_upload_mb * MIB),
                          settings=settings, long=long, batch_size=parse_batch_size(batch_size))
    try:
        sock = bind(host, port)  # before the model loads: an address in use fails at once
    except ListenError as exc:
        raise fail(f"{exc}; choose another --port or --host, or stop what uses it") from None
    try:
        if not _loopback(host) and not api_key:
            note(f"listening on {host} without --api-key: anyone who can reach this port can use the model and read "
                 "the stored documents; set --api-key (or MASKKV_API_KEY)", opts.quiet, False)
        session = opts.load_session(resolve_device(opts.device), long=long)  # --long: at start, not per request
        app = create_app(session, config)
    except BaseException:
        sock.close()
        raise

    server = app.state.server
    if server.batch_note:
        note(server.batch_note, opts.quiet, False)

    def ready(url: str) -> None:
        together = f", {server.batch_size} requests at once" if server.batch_size > 1 else ""
        weights = "" if opts.quantization == "none" else f" ({opts.quantization} weights)"
        typer.echo(f"maskkv serve: {session.model_path}{weights} at {url}/ (the page) and {url}/v1 (the API)"
                   f"{together}; Ctrl-C stops", err=True)

    try:
        run_server(app, sock, on_ready=ready, log_level="warning" if opts.quiet else "info")
    except KeyboardInterrupt:  # Ctrl-C after the graceful shutdown (uvicorn raises the signal again): a normal end
        pass
    typer.echo("maskkv serve: stopped", err=True)
