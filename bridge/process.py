"""What each relay process does around its loop: logs, metrics, signals.

``python -m bridge.inbox`` and ``python -m bridge.outbox`` are each their own
failure domain; they share only this start-up shape.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import random
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

import logconfig

log = logging.getLogger("poimen.bridge")

# No `_created` series: a timestamp per counter that Prometheus does not use
# (noise in every scrape).
disable_created_metrics()


class Relay(Protocol):
    def run(self) -> None: ...

    def stop(self, *_: object) -> None: ...


def configure_logging() -> None:
    """One line per record on stderr, in ``LOG_FORMAT`` at ``LOG_LEVEL`` (``logconfig``)."""
    logconfig.configure(capture_stdout=True)


class _QuietHandler(WSGIRequestHandler):
    # wsgiref writes one plain-text line per request to stderr: not in a JSON log.
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def start_metrics_server(port: int, registry: CollectorRegistry, healthy: Callable[[], bool] = lambda: True,
                         addr: str = "0.0.0.0") -> ThreadingWSGIServer:  # noqa: S104
    """Serve ``/metrics`` from ``registry`` and ``/healthz`` on ``port``, in a daemon thread.

    ``/healthz`` answers 200 while ``healthy()`` (the process is up and its
    loop alive), else 503; any other path is a 404, so a probe of ``/healthz``
    never reads as healthy by getting the metrics page.
    """
    metrics_app = make_wsgi_app(registry)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/metrics", "/metrics/"):
            page: Iterable[bytes] = metrics_app(environ, start_response)
            return page
        if path == "/healthz":
            ok = healthy()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [json.dumps({"status": "ok" if ok else "unhealthy"}).encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: /metrics and /healthz only\n"]

    server = make_server(addr, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True).start()
    return server


def serve(relay: Relay, registry: CollectorRegistry, metrics_port: int | None) -> None:
    """Serve metrics and ``/healthz``, stop on SIGTERM/SIGINT, and run ``relay`` until it stops."""
    if metrics_port:
        start_metrics_server(metrics_port, registry)
        log.info("metrics on :%d/metrics, health on :%d/healthz", metrics_port, metrics_port)
    # `kill -USR1 <pid>` prints every thread's stack: where a stuck relay is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, relay.stop)
    signal.signal(signal.SIGINT, relay.stop)
    relay.run()


def backoff_delay(attempt: int, initial: float, cap: float) -> float:
    """Return the wait before retry ``attempt`` (1-based): capped exponential, jittered.

    Half the delay is fixed and half random, so relays that lost a dependency
    together do not come back together, yet none retries much sooner than planned.
    """
    ceiling = min(cap, initial * 2.0 ** min(attempt - 1, 30))
    return ceiling / 2 + random.uniform(0, ceiling / 2)
