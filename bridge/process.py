"""What each relay process does around its loop: logs, metrics, signals.

``python -m bridge.inbox`` and ``python -m bridge.outbox`` are each their own
failure domain; they share only this start-up shape.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("poimen.bridge")


class Relay(Protocol):
    def run(self) -> None: ...

    def stop(self, *_: object) -> None: ...


def configure_logging() -> None:
    """One line per record on stderr, at ``LOG_LEVEL`` (INFO)."""
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(relay: Relay, registry: CollectorRegistry, metrics_port: int | None) -> None:
    """Serve metrics, stop on SIGTERM/SIGINT, and run ``relay`` until it stops."""
    if metrics_port:
        start_http_server(metrics_port, registry=registry)
        log.info("metrics on :%d/metrics", metrics_port)
    # `kill -USR1 <pid>` prints every thread's stack: where a stuck relay is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGTERM, relay.stop)
    signal.signal(signal.SIGINT, relay.stop)
    relay.run()
