"""The age of each live boot's last probe, as Postgres saw it.

Read from ``pg_stat_activity.state_change`` of the backend holding the boot's
lock (``app/liveness.py: boot_probe_ages``); workers write nothing for it. The
boots here are registered in this process without a watchdog, so nothing
probes them unless the test does.
"""

from __future__ import annotations

import os
import re
import socket
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import wait_until
from tests.workers import conftest as worker_fixtures

# The worker tests' boots: live ones registered here, dead ones killed in a child process.
dsn, boot_factory, dead_boot = (worker_fixtures.dsn, worker_fixtures.boot_factory,
                                worker_fixtures.dead_boot)
SECRET = "p" * 40


def probe_ages(app, boot_id=None) -> dict:
    """``{boot_id: ProbeAge}`` read in a transaction of its own (a fresh pg_stat_activity)."""
    from app.extensions import db
    from app.liveness import boot_probe_ages

    with app.app_context():
        try:
            return {p.boot_id: p for p in boot_probe_ages(db.session, boot_id)}
        finally:
            db.session.remove()


def test_a_live_boots_probe_age_is_small_grows_unprobed_and_a_probe_renews_it(app, boot_factory):
    boot = boot_factory()
    first = probe_ages(app)[boot.boot_id]
    assert (first.hostname, first.pid) == (socket.gethostname()[:255], os.getpid())
    assert 0 <= first.age_seconds < 5

    time.sleep(1.5)  # nothing runs on its lock connection meanwhile
    later = probe_ages(app)[boot.boot_id]
    assert later.age_seconds >= 1 and later.age_seconds > first.age_seconds

    assert boot.probe()  # the watchdog's query: the server sees the session busy again
    assert probe_ages(app)[boot.boot_id].age_seconds < 1
    # One boot asked for: only that boot.
    assert list(probe_ages(app, boot.boot_id)) == [boot.boot_id]


def test_a_boot_whose_process_died_is_not_listed(app, boot_factory, dead_boot):
    dead, live = dead_boot(), boot_factory()
    # The backend of a killed client exits once it reads the closed socket: no
    # lock, no boot.
    wait_until(lambda: dead not in probe_ages(app), timeout=10,
               what="the dead boot's lock released")
    assert list(probe_ages(app)) == [live.boot_id]
    assert probe_ages(app, dead) == {}
    live.close()
    wait_until(lambda: probe_ages(app) == {}, timeout=10, what="the closed boot's lock released")


def beat_metrics(app) -> dict:
    """Beat's global gauges, scraped as its metrics server renders them."""
    from app.metrics import GlobalGauges

    registry = CollectorRegistry()
    registry.register(GlobalGauges(app))
    text = generate_latest(registry).decode()
    return {f.name: {s.labels.get("boot"): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def test_the_global_gauges_give_each_live_boots_probe_age_and_their_max(
        app, boot_factory, monkeypatch):
    monkeypatch.setitem(app.config, "POIMEN_METRICS_CACHE_SECONDS", 0)
    none = beat_metrics(app)
    assert none["poimen_boot_probe_age_seconds"] == {}  # no live boot, no series
    assert none["poimen_boot_probe_age_max_seconds"] == {None: 0.0}

    old, new = boot_factory(), boot_factory()
    time.sleep(1.0)
    assert new.probe()
    gauges = beat_metrics(app)
    ages = gauges["poimen_boot_probe_age_seconds"]
    assert set(ages) == {str(old.boot_id), str(new.boot_id)}  # labelled by boot id only
    assert ages[str(old.boot_id)] >= 1 > ages[str(new.boot_id)]
    assert gauges["poimen_boot_probe_age_max_seconds"] == {None: max(ages.values())}
    assert gauges["poimen_live_boots"] == {None: 2}

    old.close()  # dead: its series goes, it is not stuck at its last age
    wait_until(lambda: set(beat_metrics(app)["poimen_boot_probe_age_seconds"])
               == {str(new.boot_id)}, timeout=10, what="the closed boot's series gone")


@pytest.fixture
def console(database_url, tenant):
    """A test client of a console-enabled app, signed in as ``tenant``."""
    from app import create_app

    client = create_app({"POIMEN_CONSOLE_SECRET": SECRET, "TESTING": True}).test_client()
    page = client.get("/console/sign-in").get_data(as_text=True)
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    assert client.post("/console/sign-in",
                       data={"csrf_token": csrf, "token": tenant.token}).status_code == 302
    return client


def holder_line(console, run_id) -> str:
    page = console.get(f"/console/runs/{run_id}")
    assert page.status_code == 200
    return re.search(r'<dd id="holder">(.*?)</dd>', page.get_data(as_text=True), re.S).group(1)


def hold(pg, run_id, boot_id) -> None:
    """Put ``run_id`` in the state a claim by ``boot_id`` leaves."""
    pg.execute("UPDATE runs SET status = 'running', claimed_by = %s, attempt = 1 WHERE id = %s",
               [boot_id, run_id])


def test_a_running_runs_page_says_when_its_live_holder_last_probed(
        console, admit, pg, boot_factory, dead_boot):
    live_run, dead_run = admit(), admit()
    boot, dead = boot_factory(), dead_boot()
    hold(pg, live_run, boot.boot_id)
    hold(pg, dead_run, dead)

    line = holder_line(console, live_run)
    assert str(boot.boot_id) in line and "live" in line
    age = re.search(r"last probe (\d+\.\d) s ago", line)
    assert age and 0 <= float(age.group(1)) < 5, line

    # A dead holder shows as before: dead, and no probe to speak of.
    wait_until(lambda: "dead" in holder_line(console, dead_run), timeout=10,
               what="the killed boot shown dead")
    assert "last probe" not in holder_line(console, dead_run)
