"""The liveness lease, rule by rule, deterministically (``lease.py``, docs/internals/execution.md).

Each bound is witnessed on its own, against the real Postgres, with the path to
it made silent by a proxy that stops forwarding with its sockets open (the
hung middlebox: no RST, no FIN, the server sees a healthy idle peer). The
whole-system cases, with a kernel black hole and real workers, are in
``tests/chaos/test_partition.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psycopg
import pytest

from lease import KILL_SECONDS, LeaseOrderingError, LeaseSettings, check_ordering, probe_lock
from lease import problems as lease_problems
from poimenconfig import DEFAULT_TAKEOVER_DELAY, lease_settings
from tests.conftest import libpq_url
from tests.processes import ROOT, start_beat, start_worker, wait_until
from tests.proxy import StallingProxy


@pytest.fixture
def dsn(database_url) -> str:
    return libpq_url(database_url)


@pytest.fixture
def proxy(dsn):
    proxy = StallingProxy.to_postgres(dsn)
    yield proxy
    proxy.close()


def lock_holders(pg, key: int, namespace: int) -> list[int]:
    return [r[0] for r in pg.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = CAST(%s AS oid) "
        "AND objid = CAST(%s AS oid) AND granted "
        # Advisory locks are per database: other sessions' databases share the server.
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        [namespace, key])]


# -- the ordering -------------------------------------------------------------------------------

def test_the_default_lease_keeps_its_ordering():
    settings = LeaseSettings()
    assert lease_problems(settings) == []
    assert settings.client_seconds + KILL_SECONDS < settings.server_seconds
    # No stranded run: the server lets go within T_s, beat's repair sees the lock free on
    # its next tick (10 s), and the rescuer's delivery comes once the boot is gone (T_c +
    # kill + margin after that, plus a second's slack; at least POIMEN_TAKEOVER_DELAY):
    # under 60 s.
    from app.liveness import GONE_SLACK
    from lease import dead_after

    assert settings.server_seconds + 10 + max(dead_after(settings) + GONE_SLACK,
                                              settings.takeover_delay) < 60


def test_the_fast_test_timings_keep_the_ordering():
    """Process tests run workers under ``fast_env``: they must start (a worker refuses a
    lease that breaks the ordering) and keep the rule the defaults keep."""
    from tests.conftest import FAST_TIMINGS

    settings = lease_settings(FAST_TIMINGS)
    assert lease_problems(settings) == []
    assert settings.probe_interval < 1 and settings.takeover_delay < DEFAULT_TAKEOVER_DELAY


@pytest.mark.parametrize("env, named", [
    ({"POIMEN_LEASE_CLIENT_SECONDS": "30"}, "POIMEN_LEASE_CLIENT_SECONDS (30)"),
    ({"POIMEN_LEASE_SERVER_SECONDS": "3", "POIMEN_TAKEOVER_DELAY": "0"},
     "POIMEN_LEASE_SERVER_SECONDS (3)"),
    ({"POIMEN_BOOT_PROBE_INTERVAL": "5"}, "POIMEN_BOOT_PROBE_INTERVAL (5)"),
])
def test_settings_that_break_the_ordering_are_refused_naming_them(env, named):
    settings = lease_settings(env)
    with pytest.raises(LeaseOrderingError) as err:
        check_ordering(settings)
    assert named in str(err.value)


def test_the_takeover_delay_does_not_count_toward_the_ordering():
    """T_s = 8, T_c = 10, delay 6: T_c + kill + margin (13) <= T_s + delay (14), but a lock
    Postgres drops early, or a re-drive sent with no delay, comes without the delay: the
    server's bound must cover the client's on its own."""
    settings = lease_settings({"POIMEN_LEASE_SERVER_SECONDS": "8",
                               "POIMEN_LEASE_CLIENT_SECONDS": "10",
                               "POIMEN_TAKEOVER_DELAY": "6"})
    with pytest.raises(LeaseOrderingError) as err:
        check_ordering(settings)
    message = str(err.value)
    assert "POIMEN_LEASE_CLIENT_SECONDS (10) + kill (1) + margin (2) = 13 exceeds " \
           "POIMEN_LEASE_SERVER_SECONDS (8)" in message
    assert "POIMEN_TAKEOVER_DELAY does not count" in message
    # The same with T_s = 13 is safe, whatever the delay.
    assert lease_problems(lease_settings({"POIMEN_LEASE_SERVER_SECONDS": "13",
                                          "POIMEN_LEASE_CLIENT_SECONDS": "10",
                                          "POIMEN_TAKEOVER_DELAY": "0"})) == []


BREAKS_THE_ORDERING = {"POIMEN_LEASE_CLIENT_SECONDS": "25", "POIMEN_LEASE_SERVER_SECONDS": "20",
                       "POIMEN_TAKEOVER_DELAY": "2"}


@pytest.mark.processes
@pytest.mark.parametrize("start", [start_worker, start_beat], ids=["worker", "beat"])
def test_a_process_refuses_to_start_with_settings_that_break_the_ordering(
        start, test_env, tmp_path):
    proc = start({**test_env, **BREAKS_THE_ORDERING, "LOG_FORMAT": "json"}, tmp_path)
    try:
        proc.proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"started with settings that break the lease ordering:\n{proc.log()[-3000:]}")
    assert proc.proc.returncode != 0
    assert "refuses to start" in proc.log() and "POIMEN_LEASE_CLIENT_SECONDS (25)" in proc.log()
    # Under LOG_FORMAT=json the refusal is a record like every other line.
    lines = [line for line in proc.log().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") and json.loads(line) for line in lines), \
        [line for line in lines if not line.startswith("{")][:3]


@pytest.mark.processes
def test_the_outbox_relay_refuses_to_start_with_settings_that_break_the_ordering(test_env):
    done = subprocess.run([sys.executable, "-m", "bridge.outbox"], cwd=ROOT, timeout=60,
                          env={**test_env, **BREAKS_THE_ORDERING, "METRICS_PORT": "0"},
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "POIMEN_LEASE_CLIENT_SECONDS (25)" in done.stderr + done.stdout


# -- the client's bound: probes with a deadline --------------------------------------------------

def test_a_probe_into_a_silent_path_gives_up_at_its_deadline(proxy, dsn):
    with psycopg.connect(proxy.url(dsn), autocommit=True) as conn:
        assert probe_lock(conn, "SELECT true", 1.0) is True
        proxy.stall()
        started = time.monotonic()
        assert probe_lock(conn, "SELECT true", 1.0) is None
        assert 0.9 <= time.monotonic() - started < 2.0


def test_a_boot_probe_through_a_hung_proxy_is_not_confirmed_within_its_deadline(proxy, dsn,
                                                                              monkeypatch):
    """Boot.probe (the watchdog's) answers False within its deadline; psycopg's own execute
    would wait until TCP gives up, forever behind a hung proxy."""
    from workers.boots import Boot

    monkeypatch.setenv("POIMEN_LEASE_CLIENT_SECONDS", "3")  # probe deadline 1 s
    boot = Boot.register(proxy.url(dsn))
    prober = None
    try:
        assert boot.probe()
        confirmed = boot.confirmed_at
        proxy.stall()
        answer: list[bool] = []
        prober = threading.Thread(target=lambda: answer.append(boot.probe()), daemon=True)
        started = time.monotonic()
        prober.start()
        prober.join(10)
        assert answer == [False], "the probe hung into a silent path"
        assert time.monotonic() - started < 3
        assert boot.confirmed_at == confirmed  # an unanswered probe renews nothing
    finally:
        proxy.close()
        if prober is not None:
            # A probe that hung (a broken deadline) ends once the proxy is gone; closing
            # the connection under it from this thread would abort the interpreter (libpq).
            prober.join(10)
        boot.close()


# -- the server's bound: idle_session_timeout on the lock session ----------------------------------

def test_the_server_ends_a_lock_session_behind_a_hung_proxy_after_t_s(proxy, dsn, pg,
                                                                      monkeypatch):
    """TCP cannot see a hung proxy (its kernel acknowledges everything): only the bound
    Poimen sets on the session ends it, and the lock with it."""
    from app.liveness import LOCK_NAMESPACE
    from workers.boots import Boot

    monkeypatch.setenv("POIMEN_LEASE_SERVER_SECONDS", "3")
    boot = Boot.register(proxy.url(dsn))
    try:
        # Renewed by probes, the session outlives T_s.
        for _ in range(8):
            time.sleep(0.5)
            assert boot.probe()
        assert lock_holders(pg, boot.lock_key, LOCK_NAMESPACE) == [boot.backend_pid]
        proxy.stall()
        silent_from = time.monotonic()
        wait_until(lambda: not lock_holders(pg, boot.lock_key, LOCK_NAMESPACE), timeout=20,
                   interval=0.1, what="the server to end the silent lock session")
        let_go_after = time.monotonic() - silent_from
        # Never sooner than T_s after the last probe; within T_s and a little after it.
        assert 2.4 <= let_go_after < 6, let_go_after
    finally:
        proxy.close()
        boot.close()


def test_the_lock_session_carries_the_lease_settings(dsn, monkeypatch):
    from workers.boots import Boot

    monkeypatch.setenv("POIMEN_LEASE_SERVER_SECONDS", "17")
    boot = Boot.register(dsn)
    try:
        show = {name: boot.conn.execute(f"SHOW {name}").fetchone()[0] for name in (
            "idle_session_timeout", "statement_timeout", "idle_in_transaction_session_timeout")}
        assert show == {"idle_session_timeout": "17s", "statement_timeout": "0",
                        "idle_in_transaction_session_timeout": "0"}
        assert boot.server_bound == "idle_session_timeout 17s"
    finally:
        boot.close()


def test_tcp_never_ends_a_lock_session_sooner_than_t_s():
    """A DBA's aggressive server keepalives would let go early: the session overrides them
    (on TCP connections; unix sockets have none)."""
    from lease import server_bound_statements

    settings = LeaseSettings(server_seconds=17)
    sets = dict(line.removeprefix("SET ").split(" = ") for line in
                server_bound_statements(settings, idle_session_timeout=False))
    assert int(sets["tcp_keepalives_idle"]) >= 17
    assert int(sets["tcp_user_timeout"]) >= 17_000
    assert "idle_session_timeout" not in sets  # PostgreSQL 12-13: TCP is the bound
    assert "SET idle_session_timeout = 17000" in server_bound_statements(
        settings, idle_session_timeout=True)


# -- the client's bound: the fence ----------------------------------------------------------------

FENCED_CHILD = textwrap.dedent("""
    import uuid
    from workers import boots
    boot = boots.current_boot(lambda: {dsn!r})
    boots.hold(uuid.uuid4(), boot.boot_id)
    print("held", boot.backend_pid, flush=True)
    # The body: busy, and deaf to signals' politeness (it never checks anything).
    while True:
        sum(range(10_000))
""")


def start_fenced_child(dsn: str, env: dict, **lease: str) -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", FENCED_CHILD.format(dsn=dsn)], cwd=ROOT, text=True,
        env={**env, "PYTHONPATH": str(ROOT), **lease}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    line = child.stdout.readline()
    assert line.startswith("held"), child.stderr.read()
    return child, int(line.split()[1])


@pytest.mark.processes
def test_a_process_whose_lease_is_not_confirmed_within_t_c_is_killed(proxy, dsn, test_env):
    """The path goes silent while a busy body runs: the kernel kills the process T_c after
    the last confirmed probe, without reaching Postgres (test_the_fence_kills_at_its_deadline
    shows a body holding the GIL in C is no obstacle)."""
    child, _ = start_fenced_child(proxy.url(dsn), test_env, POIMEN_LEASE_CLIENT_SECONDS="3",
                                  POIMEN_BOOT_PROBE_INTERVAL="0.5")
    try:
        time.sleep(4)  # longer than T_c: probes renew the lease while the path is fine
        assert child.poll() is None, child.stderr.read()
        proxy.stall()
        stalled = time.monotonic()
        child.wait(15)
        killed_after = time.monotonic() - stalled
        assert child.returncode == -9
        # The last confirmed probe started at most one interval before the stall.
        assert killed_after <= 3 + KILL_SECONDS, killed_after
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.processes
def test_a_process_whose_lock_was_cut_and_not_adopted_is_killed_at_t_c(dsn, pg, test_env):
    """The server let go early (pg_terminate_backend): nothing adopts the run in this
    process, so the fence still ends the body T_c after the last confirmation."""
    child, backend = start_fenced_child(dsn, test_env, POIMEN_LEASE_CLIENT_SECONDS="3",
                                        POIMEN_BOOT_PROBE_INTERVAL="0.5")
    try:
        assert pg.execute("SELECT pg_terminate_backend(%s)", [backend]).fetchone()[0]
        cut = time.monotonic()
        child.wait(15)
        assert child.returncode == -9
        assert time.monotonic() - cut <= 3 + KILL_SECONDS
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.processes
def test_the_fence_kills_at_its_deadline_and_a_disarmed_fence_does_not():
    code = textwrap.dedent("""
        import re, sys, time
        from lease import KillFence
        fence = KillFence()
        fence.arm(time.monotonic() + 30)
        fence.disarm()
        time.sleep(1.2)  # a disarmed fence never fires
        fence.arm(time.monotonic() + 0.5)
        print("armed", time.monotonic(), flush=True)
        while True:
            re.match(r"(a+)+$", "a" * 26 + "b")
    """)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, env={"PYTHONPATH": str(ROOT)})
    line = child.stdout.readline()
    armed = time.monotonic()
    assert line.startswith("armed")
    child.wait(10)
    assert child.returncode == -9
    assert time.monotonic() - armed < 0.5 + KILL_SECONDS


def test_a_boot_not_confirmed_lately_starts_nothing_new(dsn, proxy, monkeypatch):
    """current_boot replaces a boot whose lease is stale instead of claiming under it."""
    from workers import boots

    monkeypatch.setenv("POIMEN_LEASE_CLIENT_SECONDS", "3")
    monkeypatch.setenv("POIMEN_BOOT_PROBE_INTERVAL", "60")  # no watchdog probe meanwhile
    boots.end_current_boot()
    try:
        first = boots.current_boot(lambda: dsn)
        assert boots.current_boot(lambda: dsn) is first
        first.confirmed_at -= 3  # as if no probe had answered for T_c
        second = boots.current_boot(lambda: dsn)
        assert second.boot_id != first.boot_id and first.lost.is_set()
    finally:
        boots.end_current_boot()


# -- the outbox relay's lease -----------------------------------------------------------------------

def test_a_silent_relay_stops_confirming_before_the_standby_may_take_the_lock(proxy, dsn):
    from bridge.outbox import RelayLock

    settings = LeaseSettings(probe_interval=0.5, client_seconds=2, server_seconds=4,
                             takeover_delay=0)
    active = RelayLock(proxy.url(dsn), f"poimen-outbox-test/{uuid.uuid4()}", settings)
    standby = RelayLock(dsn, f"poimen-outbox-test/{uuid.uuid4()}", settings)
    try:
        assert active.try_acquire()
        assert not standby.try_acquire()
        time.sleep(2.5)
        assert active.confirmed()  # renewed by its lease thread
        proxy.stall()
        stalled = time.monotonic()
        wait_until(lambda: not active.confirmed(), timeout=10, interval=0.05,
                   what="the active relay to stop confirming")
        stopped = time.monotonic() - stalled
        wait_until(standby.try_acquire, timeout=20, interval=0.2,
                   what="the standby to take the lock")
        taken = time.monotonic() - stalled
        assert stopped <= 2 + 0.2 and stopped < taken, (stopped, taken)
    finally:
        proxy.close()
        active.release()
        standby.release()
