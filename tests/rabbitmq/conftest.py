"""RabbitMQ for the broker tests: ``POIMEN_TEST_AMQP_URL``, or the local default when its
port answers. Without one, every test here is skipped, and said so on stderr so the
``.ci/run`` output shows it: a green run without RabbitMQ proves nothing about it.

Each session gets a virtual host of its own when ``rabbitmqctl`` can make one on this
machine (queues, exchanges, Celery's control and event exchanges all live in it, so
sessions never see each other's messages); otherwise it shares the URL's vhost and
relies on the session's unique queue name (``POIMEN_QUEUE``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
_skipped: list[str] = []  # why, once: repeated in the terminal summary, where CI shows it


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped:
        terminalreporter.write_sep("!", _skipped[0], red=True, bold=True)


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672),
                                      timeout=2):
            return True
    except OSError:
        return False


def _rabbitmqctl(*args: str) -> bool:
    try:
        return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def amqp_url(database_url) -> str:
    """The broker URL this session's processes use (a vhost of its own when possible)."""
    url = os.environ.get("POIMEN_TEST_AMQP_URL") or DEFAULT_AMQP_URL
    if not _answers(url):
        reason = (f"RabbitMQ tests SKIPPED: no broker answers at {urlsplit(url).hostname}:"
                  f"{urlsplit(url).port or 5672} (set POIMEN_TEST_AMQP_URL)")
        print(f"\n*** {reason} ***", file=sys.stderr)
        _skipped.append(reason)
        pytest.skip(reason)
    parts = urlsplit(url)
    local = parts.hostname in ("127.0.0.1", "localhost", "::1")
    vhost = f"poimen-test-{uuid.uuid4().hex[:8]}"
    user = parts.username or "guest"
    if local and shutil.which("rabbitmqctl") and _rabbitmqctl("add_vhost", vhost):
        _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        yield urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))
        _rabbitmqctl("delete_vhost", vhost)
    else:
        print(f"\n*** RabbitMQ tests share the vhost of {parts.hostname}; isolated by the "
              "queue name only ***", file=sys.stderr)
        yield url


@pytest.fixture
def amqp_env(fast_env, amqp_url) -> dict[str, str]:
    """The child processes' environment with Celery on RabbitMQ (Redis stays for the rest),
    with fast probes, repair and takeover (``FAST_TIMINGS``)."""
    return {**fast_env, "CELERY_BROKER_URL": amqp_url}
