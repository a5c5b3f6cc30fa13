"""Run the app under uvicorn until SIGTERM (or Ctrl-C), then stop gracefully.

On SIGTERM: the listening socket closes, the engine refuses new requests and ends the waiting ones at once, the
running ones get `shutdown_grace_s` seconds to finish and then end with finish_reason "shutdown"; every stream
sends its last event and [DONE], the lifespan shutdown waits for the engine, and `serve` returns (exit code 0).
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import logging
import math
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from llmeasyquant.errors import ConfigError

if TYPE_CHECKING:
    from llmeasyquant.runtime.engine import Engine

log = logging.getLogger(__name__)

SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "sse_starlette": "sse-starlette",
                 "prometheus_client": "prometheus-client"}
# uvicorn waits this long past the engine's grace for connections to close before it cancels them.
UVICORN_MARGIN_S = 10.0


def require_serve_extra() -> None:
    """Raise ConfigError naming the extra to install when the server's packages are missing."""
    missing = [package for module, package in SERVE_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"llmeasyquant serve needs {', '.join(missing)}: pip install 'llmeasyquant[serve]'")


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          api_key: str | None = None, shutdown_grace_s: float = 30.0) -> None:
    """Serve `engine` with the OpenAI API on host:port until SIGTERM or Ctrl-C (see the module docstring)."""
    require_serve_extra()
    import uvicorn

    from llmeasyquant.serving.app import build_app

    if shutdown_grace_s < 0:
        raise ConfigError(f"the shutdown grace must be 0 or more seconds, got {shutdown_grace_s}")
    app = build_app(engine, served_model_name, api_key, shutdown_grace_s)
    if not api_key and not _loopback(host):
        log.warning("listening on %s without an API key: anyone who can reach it can use it (--api-key)", host)
    sock = _listen(host, port)
    config = uvicorn.Config(app, log_config=None, lifespan="on",
                            timeout_graceful_shutdown=math.ceil(shutdown_grace_s + UVICORN_MARGIN_S))
    server = _graceful_server_class(uvicorn, app.state.server)(config)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    log.info("serving %s at http://%s:%d/v1 (SIGTERM or Ctrl-C stops it)", app.state.server.model_name, shown,
             bound_port)
    with _sigterm_returns():
        server.run(sockets=[sock])
    log.info("stopped")


def _graceful_server_class(uvicorn: Any, state: Any) -> type:
    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # The engine hears of the stop before uvicorn waits for the connections to close: it ends the waiting
            # requests now and the running ones within the grace, so their streams finish and the connections
            # close. Waiting for the lifespan shutdown instead would leave the streams running until uvicorn's
            # own timeout cut them without a last event.
            state.begin_shutdown()
            await super().shutdown(sockets)

    return GracefulServer


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, so that a port in use is a one-line error rather than uvicorn's exit."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve --host {host!r} ({exc.strerror}): give an address such as 127.0.0.1") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port, or stop what "
                          "holds it") from None
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def _sigterm_returns() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it, once it has shut down, to the handler that was there before.
    A SIGTERM handler that does nothing makes the graceful stop the end of it: serve() returns, the command exits
    0. (Ctrl-C still ends in KeyboardInterrupt, which the CLI reports as interrupted.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
