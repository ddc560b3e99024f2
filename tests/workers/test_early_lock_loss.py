"""Early lock loss: a boot's lock that Postgres drops at once (a restart,
a failover, ``pg_terminate_backend``) frees nothing the boot holds until the server first
saw it free T_c + kill + margin ago: its process may run its bodies until then.

The statement tests run on the savepoint fixture (``db_session``): real Postgres, real
boots (advisory locks on their own connections), explicit order. The process tests cut a
real worker's lock session while a ``concurrency_limit=1`` body writes a timestamp every
50 ms, and check that two bodies never wrote in the same interval.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from sqlalchemy import text

from app.state.claims import ClaimOutcome, claim_run
from app.state.executor import on_session
from tests.conftest import TABLES, connect
from tests.processes import ROOT, start_worker, wait_until
from workers.registry import max_takeovers_of

# -- statements: the bound on the server's side ------------------------------------------------


@pytest.fixture(autouse=True)
def empty_tables(database_url):
    """Repair's statements here read the whole table (every dead boot's run, every waiting
    run): rows that other tests of the session committed must not be in it."""
    with connect(database_url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")


def _admit_stamped(tenant_id, path: str = "/dev/null", customer: str = "k", seconds=1.0):
    from app.admission import admit_run
    from app.extensions import db

    return admit_run(on_session(db.session), tenant_id=tenant_id, workflow_ref="stamped",
                     input={"customer": customer, "path": path, "seconds": seconds}).run.id


def _row(session, run_id):
    return session.execute(text("SELECT status, wait_reason, claimed_by FROM runs WHERE id = :r"),
                           {"r": run_id}).one()


def _seen_dead(session, boot_id):
    """Set the boot's first-seen-dead stamp ``ago`` seconds before the transaction's now()."""
    def at(ago: float) -> None:
        session.execute(text("UPDATE worker_boots SET first_seen_dead_at = "
                             "now() - make_interval(secs => :ago) WHERE boot_id = :b"),
                        {"ago": ago, "b": boot_id})
    return at


def test_a_boot_lost_less_than_its_bound_ago_keeps_its_slot_and_its_run(
        db_session, tx_tenant, boot_factory, dead_boot):
    """Its lock is free, first seen so less than T_c + kill + margin ago: its run holds
    its slot (a second run of the key waits, repair wakes nothing), and neither a
    delivery nor repair takes it over. Past the bound it is wreckage as before."""
    from app.state.runs import mark_dead_boot_runs_sent, wake_waiting_runs

    session = db_session
    holder = dead_boot(gone=False)  # SIGKILLed a moment ago: its lock is free, never seen
    rescuer = boot_factory()
    held = _admit_stamped(tx_tenant.id)
    session.execute(text("UPDATE runs SET status = 'running', claimed_by = :b, attempt = 1 "
                         "WHERE id = :r"), {"b": holder, "r": held})
    nxt = _admit_stamped(tx_tenant.id)

    def deliver(run_id):
        return claim_run(on_session(session), run_id, rescuer.boot_id,
                         max_takeovers=max_takeovers_of)

    # A delivery of the held run finds the lock free: it stamps when, and takes nothing.
    assert deliver(held).outcome == ClaimOutcome.DUPLICATE
    stamp, bound = session.execute(text(
        "SELECT first_seen_dead_at, dead_after_seconds FROM worker_boots WHERE boot_id = :b"),
        {"b": holder}).one()
    assert stamp is not None and bound >= 3  # T_c + kill (1) + margin (2)
    assert _row(session, held) == ("running", None, holder)
    # The slot is still taken: the next run of the key waits.
    assert deliver(nxt).outcome == ClaimOutcome.SLOT_WAIT
    assert _row(session, nxt)[:2] == ("waiting", "concurrency")

    # Repair re-sends it to be delivered once the boot is gone, not before.
    [resend] = mark_dead_boot_runs_sent(on_session(session), min_age=0, limit=None)
    assert resend.id == held and resend.gone_in >= bound - 1

    seen_dead = _seen_dead(session, holder)
    seen_dead(bound - 1)  # lost a moment short of its bound
    assert deliver(held).outcome == ClaimOutcome.DUPLICATE
    [resend] = mark_dead_boot_runs_sent(on_session(session), min_age=0, limit=None)
    assert 0.9 <= resend.gone_in <= 1.1
    assert wake_waiting_runs(on_session(session), limit=None) == []
    assert _row(session, held) == ("running", None, holder)
    assert _row(session, nxt)[:2] == ("waiting", "concurrency")

    seen_dead(bound + 1)  # past it: the process has been killed by its fence
    [resend] = mark_dead_boot_runs_sent(on_session(session), min_age=0, limit=None)
    assert resend.id == held and resend.gone_in == 0
    assert [r.id for r in wake_waiting_runs(on_session(session), limit=None)] == [nxt]
    assert deliver(held).outcome == ClaimOutcome.TAKEN_OVER
    assert _row(session, held) == ("running", None, rescuer.boot_id)


def test_a_process_adopts_its_limited_run_into_the_slot_its_lost_boot_still_holds(
        db_session, tx_tenant, boot_factory, dead_boot):
    """The process whose lock was cut adopts its run under a new boot within its bound:
    the slot its lost boot still holds is that very run's, not counted against it."""
    from app.state.claims import Adoption, adopt_run
    from app.state.runs import mark_dead_boot_runs_sent

    session = db_session
    lost, new = dead_boot(gone=False), boot_factory()
    mine = _admit_stamped(tx_tenant.id)
    session.execute(text("UPDATE runs SET status = 'running', claimed_by = :b, attempt = 1 "
                         "WHERE id = :r"), {"b": lost, "r": mine})
    [resend] = mark_dead_boot_runs_sent(on_session(session), min_age=0, limit=None)  # repair's tick
    assert resend.id == mine and resend.gone_in > 0  # it stamped the lost boot: not gone
    assert adopt_run(on_session(session), mine, lost, new.boot_id, [lost]) == Adoption.ADOPTED
    assert _row(session, mine) == ("running", None, new.boot_id)


def test_a_revoke_ends_a_lost_boots_run_only_once_the_boot_is_gone(
        db_session, tx_tenant, dead_boot):
    """Celery's revoke of a run whose holder's lock is free ends it cancelled (and hands
    its slot on) only once the holder is gone: its body may run until then."""
    from app.state.runs import end_abandoned

    session = db_session
    lost = dead_boot(gone=False)
    run_id = _admit_stamped(tx_tenant.id)
    session.execute(text("UPDATE runs SET status = 'running', claimed_by = :b, attempt = 1, "
                         "cancel_requested = true WHERE id = :r"), {"b": lost, "r": run_id})
    assert end_abandoned(on_session(session), run_id) is False  # it stamps the holder, ends nothing
    assert _row(session, run_id) == ("running", None, lost)
    bound = session.execute(text("SELECT dead_after_seconds FROM worker_boots "
                                 "WHERE boot_id = :b"), {"b": lost}).scalar_one()
    _seen_dead(session, lost)(bound + 1)
    assert end_abandoned(on_session(session), run_id) is True
    assert _row(session, run_id)[0] == "cancelled"


def test_repair_stamps_every_boot_whose_lock_is_free_and_never_moves_a_stamp(
        db_session, boot_factory, dead_boot):
    """Beat's repair sees every lost boot within one tick, so a boot nobody delivers to is
    gone within a tick of its bound; a live boot is never stamped; a stamp stays."""
    from app.state.boots import mark_dead_boots

    session = db_session
    live, lost = boot_factory(), dead_boot(gone=False)

    def stamp(boot_id):
        return session.execute(text("SELECT first_seen_dead_at FROM worker_boots "
                                    "WHERE boot_id = :b"), {"b": boot_id}).scalar_one()

    assert mark_dead_boots(on_session(session)) >= 1
    first = stamp(lost)
    assert first is not None and stamp(live.boot_id) is None
    mark_dead_boots(on_session(session))
    assert stamp(lost) == first


# -- processes: a lock cut under a running body --------------------------------------------------

# Lease settings for the cut: probes 5 s apart (T_c 15 s: two probes and a deadline; T_s
# 20 s: T_c + kill + margin = 18 <= T_s), so the process that lost its lock runs on for
# up to 5 s before its watchdog notices, the window in which a second body could start.
SLOW_PROBES = {"POIMEN_BOOT_PROBE_INTERVAL": "5", "POIMEN_LEASE_CLIENT_SECONDS": "15",
               "POIMEN_LEASE_SERVER_SECONDS": "20", "POIMEN_TAKEOVER_DELAY": "0"}


def executions(path: Path) -> dict[tuple, tuple[float, float]]:
    """(run, attempt, pid) -> (first, last) timestamp a body wrote."""
    spans: dict = defaultdict(list)
    for line in path.read_text().splitlines():
        at, pid, attempt, run = line.split()
        spans[(run, int(attempt), int(pid))].append(float(at))
    return {key: (min(stamps), max(stamps)) for key, stamps in spans.items()}


def overlaps(spans: dict) -> list[tuple]:
    """Every pair of executions whose intervals meet, with how long (seconds)."""
    items = sorted(spans.items(), key=lambda item: item[1])
    found = []
    for i, (a, (_a0, a1)) in enumerate(items):
        for b, (b0, b1) in items[i + 1:]:
            if b0 < a1:
                found.append((a, b, round(min(a1, b1) - b0, 3)))
    return found


def lock_backend_right_after_a_probe(pg, run_id, timeout: float = 30) -> int:
    """The lock session of ``run_id``'s boot, once a probe has just ended on it (so the
    next one is a whole probe interval away)."""
    from app.liveness import LOCK_NAMESPACE

    query = (
        "SELECT l.pid, a.state_change, clock_timestamp() - a.state_change < interval '0.3 s' "
        "FROM runs r JOIN worker_boots b ON b.boot_id = r.claimed_by "
        "JOIN pg_locks l ON l.locktype = 'advisory' AND l.classid = CAST(%s AS oid) "
        "AND l.objid = CAST(b.lock_key AS oid) AND l.objsubid = 2 AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "JOIN pg_stat_activity a ON a.pid = l.pid WHERE r.id = %s AND a.state = 'idle'")
    first = pg.execute(query, [LOCK_NAMESPACE, run_id]).fetchone()
    assert first is not None, "the run's boot holds no lock"
    found: list = []

    def probed() -> bool:
        row = pg.execute(query, [LOCK_NAMESPACE, run_id]).fetchone()
        if row is not None and row[1] != first[1] and row[2]:
            found.append(row[0])
            return True
        return False

    wait_until(probed, timeout=timeout, interval=0.02, what="a probe on the lock session")
    return found[0]


def body_started(path: Path, run_id) -> bool:
    return path.exists() and str(run_id) in path.read_text()


def status(pg, run_id) -> str:
    return pg.execute("SELECT status FROM runs WHERE id = %s", [run_id]).fetchone()[0]


@pytest.mark.processes
def test_a_lock_cut_then_a_second_run_of_the_key_never_runs_two_bodies_at_once(
        admit, test_env, pg, tmp_path, processes):
    """concurrency_limit=1; the running body's lock session is terminated and a second run
    of the key is admitted at once: it waits until the first body has ended."""
    stamps = tmp_path / "stamps.txt"
    env = {**test_env, **SLOW_PROBES}
    first = admit("stamped", {"customer": "k", "path": str(stamps), "seconds": 8})
    processes.append(start_worker(env, tmp_path, "victim", concurrency=2))
    wait_until(lambda: body_started(stamps, first), timeout=60, what="the first body to start")

    pg.execute("SELECT pg_terminate_backend(%s)", [lock_backend_right_after_a_probe(pg, first)])
    second = admit("stamped", {"customer": "k", "path": str(stamps), "seconds": 2})

    for run_id in (first, second):
        wait_until(lambda run_id=run_id: status(pg, run_id) in ("succeeded", "failed"),
                   timeout=120, what=f"run {run_id} to end")
    spans = executions(stamps)
    assert {key[0] for key in spans} == {str(first), str(second)}
    assert overlaps(spans) == [], f"two bodies ran at once: {overlaps(spans)}"


@pytest.mark.processes
def test_a_lock_cut_then_runs_redrive_never_runs_two_bodies_at_once(
        admit, test_env, pg, tmp_path, processes):
    """The running body's lock session is terminated and an operator runs ``flask runs
    redrive`` at once: the run held by the boot that lost its lock is not re-sent while
    that boot's body may still run."""
    stamps = tmp_path / "stamps.txt"
    env = {**test_env, **SLOW_PROBES}
    run_id = admit("stamped", {"customer": "k", "path": str(stamps), "seconds": 8})
    processes.append(start_worker(env, tmp_path, "victim", concurrency=2))
    wait_until(lambda: body_started(stamps, run_id), timeout=60, what="the body to start")

    pg.execute("SELECT pg_terminate_backend(%s)", [lock_backend_right_after_a_probe(pg, run_id)])
    done = subprocess.run([sys.executable, "-m", "flask", "--app", "app", "runs", "redrive"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]

    wait_until(lambda: status(pg, run_id) in ("succeeded", "failed"), timeout=120,
               what="the run to end")
    spans = executions(stamps)
    assert overlaps(spans) == [], f"two bodies ran at once: {overlaps(spans)} ({done.stdout})"
    assert status(pg, run_id) == "succeeded"
