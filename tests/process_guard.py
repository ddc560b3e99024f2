"""The ``processes`` mark, and the guard that keeps it true.

``make check`` (the fast lane) runs ``-m "not processes"``: it is only as fast as
the mark is complete. So the mark is applied by one rule rather than by memory:

* a test that uses a fixture of :data:`PROCESS_FIXTURES` (directly or through
  another fixture), or is marked ``slow`` (several real processes), is marked at
  collection;
* a test that starts a process itself carries ``@pytest.mark.processes`` (or its
  module's ``pytestmark``);
* the guard: while an unmarked test sets up or runs, every process start
  (``subprocess``, ``os.fork``, ``os.posix_spawn``, ``os.system``, ``os.exec*``;
  Python's audit events) is recorded, and the test fails naming what it started.
  Setting up :data:`INFRASTRUCTURE` (the session's migrated database) is exempt,
  and so is teardown (a module-scoped server stopped after the module's last test,
  whichever test that is).

The same collection hook puts each test in its lane (``tests/lanes.py``): ``system``
(the ``processes`` mark), ``db`` (it reaches a fixture of :data:`SERVICE_FIXTURES`),
``unit`` (any other test).

Registered by ``tests/conftest.py`` (``pytest_plugins``); a pytest session in the
same interpreter (``tests/test_wiring.py`` runs one) shares the one audit hook.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest

# Fixtures that start real processes (gunicorn, Celery, relays, Postgres, a browser,
# a child that is killed), or that exist only for tests which do.
PROCESS_FIXTURES = frozenset({
    "processes",          # tests/conftest.py: the list a test appends its Process-es to
    "live_api",           # tests/conftest.py: gunicorn for the session
    "dead_boot",          # tests/workers/conftest.py: a boot registered by a SIGKILLed child
    "private_postgres",   # tests/chaos/conftest.py: a PostgreSQL of its own (and chaos_*)
    "console_url",        # tests/console/conftest.py: gunicorn for the browser tests
    "browser",            # tests/console/conftest.py: headless Chromium
    "amqp_url",           # tests/rabbitmq/conftest.py: Celery workers on RabbitMQ
    "tansu",              # tests/conftest.py: a tansu broker for consumer-group tests
})

# Fixtures every test on a service reaches (directly or through another fixture): the
# services' environment, the session's migrated database, a Redis client.
SERVICE_FIXTURES = frozenset({"base_env", "database_url", "redis_client"})

# The lanes (tests/lanes.py), assigned at collection by one rule: `system` is the
# `processes` mark; `db` a test that reaches a service fixture; `unit` every other test.
LANES = ("unit", "db", "system")

# Session infrastructure every test shares: migrated once per session, by a child
# ``flask db upgrade`` (poimen_dev/scratch.py), whichever test needs it first.
INFRASTRUCTURE = frozenset({"database_url"})

EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                    "os.spawn", "os.system", "os.exec"})


class _Watch:
    """What the innermost watched phase recorded (None: not watching)."""

    stack: list[list[str] | None] = []
    installed = False


def _audit(event: str, args: tuple) -> None:
    if event in EVENTS and _Watch.stack and _Watch.stack[-1] is not None:
        what = args[1] if event == "subprocess.Popen" else args[:1]
        argv = [what] if isinstance(what, (str, bytes)) else list(what or ())
        # The command only, never its environment (it carries credentials).
        _Watch.stack[-1].append(f"{event} {' '.join(map(str, argv[:4]))}".strip())


def install() -> None:
    """Add the audit hook once per interpreter (audit hooks cannot be removed)."""
    if not _Watch.installed:
        sys.addaudithook(_audit)
        _Watch.installed = True


@contextmanager
def watching(record: bool):
    """Record process starts in the block when ``record``; not when nested unrecorded."""
    _Watch.stack.append([] if record else None)
    try:
        yield _Watch.stack[-1]
    finally:
        _Watch.stack.pop()


def starts_processes(item: pytest.Item) -> bool:
    return item.get_closest_marker("processes") is not None


def _fail_if_started(item: pytest.Item, started: list[str] | None, phase: str) -> None:
    if started:
        pytest.fail(
            f"{item.nodeid} started a process in its {phase} without the `processes` mark "
            f"({'; '.join(sorted(set(started)))}): mark it @pytest.mark.processes, or add the "
            "fixture that starts it to tests/process_guard.py PROCESS_FIXTURES",
            pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    install()
    for lane, what in (("unit", "reaches no service"),
                       ("db", "an in-process test on Postgres, Redis or Kafka"),
                       ("system", "starts processes (the `processes` mark)")):
        config.addinivalue_line("markers", f"{lane}: lane of a test that {what}; assigned at "
                                "collection (tests/process_guard.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # tryfirst: before -m deselects by marks.
    for item in items:
        if (PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                or item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.processes)
        item.add_marker(lane_of(item))


def lane_of(item: pytest.Item) -> str:
    if starts_processes(item):
        return "system"
    if SERVICE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "db"
    return "unit"


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.argname in INFRASTRUCTURE:
        with watching(False):
            return (yield)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with watching(not starts_processes(item)) as started:
        result = yield
    _fail_if_started(item, started, "setup")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with watching(not starts_processes(item)) as started:
        result = yield
    _fail_if_started(item, started, "call")
    return result
