"""Running the app with uvicorn: in the foreground (``maskkv serve``), or in a background thread (``BackgroundServer``,
for tests and notebooks). The listening socket is bound first (``bind``), before the model loads and uvicorn starts:
an address in use fails at once, and port 0 means a free port whose number is known at once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from maskkv_cli.errors import reason

__all__ = ["BackgroundServer", "ListenError", "bind", "serve", "url_of"]

GRACE_S = 5  # on shutdown, how long open requests may go on before they are cancelled


class ListenError(Exception):
    """The address cannot be listened on (in use, not this machine's, no permission)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: a free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} ({reason(exc)})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port} ({reason(exc)})") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def uvicorn_server(app: Any, log_level: str, access_log: bool) -> Any:
    """uvicorn's server for ``app``. When ``app.state.on_stopping`` is a callable, it is called as soon as a shutdown
    begins, before the open requests' grace period (the app's lifespan hears of the shutdown only after it), so that
    they can still be answered."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            on_stopping = getattr(getattr(app, "state", None), "on_stopping", None)
            if callable(on_stopping):
                on_stopping()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=GRACE_S,
                            lifespan="on")
    return Server(config)


def serve(app: Any, sock: socket.socket, on_ready: Callable[[str], None] | None = None, *,
          log_level: str = "info", access_log: bool = True) -> None:
    """Serve ``app`` on the listening socket ``sock`` (``bind``) until interrupted (Ctrl-C or SIGTERM: open requests
    get ``GRACE_S`` seconds, then are cancelled); the socket is closed at the end. ``on_ready`` gets the URL."""
    try:
        if on_ready is not None:
            on_ready(url_of(sock))
        uvicorn_server(app, log_level, access_log).run(sockets=[sock])
    finally:
        sock.close()


class BackgroundServer:
    """``with BackgroundServer(app) as url:`` serves ``app`` on a free loopback port in a thread, and stops it (and
    waits for it) on leaving the block."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn_server(app, log_level, access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="maskkv-serve", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.sock.close()
