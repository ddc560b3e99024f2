"""The batching worker's store batcher: deterministic rule tests on real Postgres.

Claims and finishes of many runs in one statement and one commit each
(``claim_queued_batch``, ``poimen_finish_batch``; ``workers/batching.py``), every rule per
run: the claimer's liveness in the claim's statement, the compare-and-set row by row, the
fence of each end, a join counted once per child, and a batch claim whose outcome is
unknown decided per run after its backend is ended. The processes tests (a batch worker
under kill -9, a Postgres restart, the partition) are ``test_batching_processes.py``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
import uuid

import psycopg
import pytest

from app.state.claims import claim_batch, claim_run, finish_batch, finish_params
from app.state.direct import OwnConnection
from app.state.executor import on_session
from tests.processes import wait_until
from tests.proxy import StallingProxy
from workers.batching import Arrivals, Batcher, BatchFailed, ClaimUnknown
from workers.registry import max_takeovers_of

from .conftest import close_for_good
from .test_claims import events_of, hold_as, status_of
from .test_step_entry_dispatch import join_world  # noqa: F401 - a fixture


@pytest.fixture
def own(dsn):
    """A statement executor on a connection of its own, as the batcher's."""
    conn = psycopg.connect(dsn, autocommit=True)
    yield OwnConnection(conn)
    conn.close()


def ends(run_ids, status="succeeded"):
    return [finish_params(run, status=status, result={"n": n}) for n, run in enumerate(run_ids)]


def xact_commits(pg) -> int:
    return pg.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = "
                      "current_database()").fetchone()[0]


# -- the claim of many runs --------------------------------------------------------------------

def test_a_batch_claims_each_queued_run_once_in_one_statement(admit, boot_factory, own, pg):
    runs, boot = [admit() for _ in range(5)], boot_factory()
    claimed = claim_batch(own, runs, boot.boot_id)
    assert set(claimed) == set(runs)
    for run in runs:
        assert status_of(pg, run) == ("running", boot.boot_id, 1)
        assert events_of(pg, run) == ["run.admitted", "run.started"]
        assert claimed[run].attempt == 1 and claimed[run].workflow_name == "echo"
    # A second batch of the same runs (a redelivery) claims none of them.
    assert claim_batch(own, runs, boot_factory().boot_id) == {}
    assert {status_of(pg, run) for run in runs} == {("running", boot.boot_id, 1)}


def test_a_batch_claims_only_the_runs_a_single_claim_would(admit, boot_factory, own, pg, app):
    """Each row's compare-and-set alone: a run another live boot holds, a run not due, a
    cancelled one, one never started by its expiry, a run of a limited group and one under
    a rate limit are not claimed by the batch (they go the single-run way, which ends the
    expired one and counts the others' slots and starts), and the queued one beside them
    is."""
    other = boot_factory()
    held, later, cancelled, limited, free, expired = (admit() for _ in range(6))
    rated = admit("rated-slow", {"customer": "c"})
    pg.execute("UPDATE runs SET expires_at = now() - interval '1 second' WHERE id = %s",
               [expired])
    hold_as(pg, held, other.boot_id)
    pg.execute("UPDATE runs SET not_before = now() + interval '1 hour' WHERE id = %s", [later])
    pg.execute("UPDATE runs SET cancel_requested = true WHERE id = %s", [cancelled])
    pg.execute("UPDATE runs SET concurrency_limit = 2, concurrency_key = 'k' WHERE id = %s",
               [limited])
    boot = boot_factory()
    claimed = claim_batch(own, [held, later, cancelled, limited, free, expired, rated],
                          boot.boot_id)
    assert set(claimed) == {free}
    assert status_of(pg, held) == ("running", other.boot_id, 1)
    for run in (later, cancelled, limited, expired, rated):
        assert status_of(pg, run)[0] == "queued"


def test_a_batch_of_a_boot_without_its_lock_claims_nothing(admit, boot_factory, own, pg):
    """The claimer's liveness is part of the batch's statement: a boot whose lock is gone
    (its process may not know yet) claims none of the runs."""
    runs, boot = [admit() for _ in range(3)], boot_factory()
    close_for_good(pg, boot)  # its lock connection is gone
    assert claim_batch(own, runs, boot.boot_id) == {}
    assert {status_of(pg, run)[0] for run in runs} == {"queued"}


def test_a_tenant_caps_runs_are_left_to_the_slot_claim(admit, boot_factory, own, pg):
    runs, boot = [admit() for _ in range(2)], boot_factory()
    pg.execute("UPDATE tenants SET max_running = 5")
    assert claim_batch(own, runs, boot.boot_id) == {}


# -- the finish of many runs -------------------------------------------------------------------

def test_a_batch_ends_each_run_fenced_in_one_commit(admit, boot_factory, own, pg):
    runs, boot, other = [admit() for _ in range(4)], boot_factory(), boot_factory()
    claim_batch(own, runs[:3], boot.boot_id)
    hold_as(pg, runs[3], other.boot_id)  # taken over by another process's boot
    before = xact_commits(pg)
    done = finish_batch(own, ends(runs), [boot.boot_id])
    assert set(done) == set(runs[:3])  # the run another boot holds is refused
    assert {done[run].status for run in runs[:3]} == {"succeeded"}
    for run in runs[:3]:
        assert status_of(pg, run)[0] == "succeeded"
        assert events_of(pg, run) == ["run.admitted", "run.started", "run.succeeded"]
    assert status_of(pg, runs[3]) == ("running", other.boot_id, 1)
    assert events_of(pg, runs[3]) == ["run.admitted"]
    # One commit for the four ends (this test's reads of the counter commit too, and the
    # statistics may lag: at most the batch's one and the reads').
    assert xact_commits(pg) - before <= 3
    assert finish_batch(own, ends(runs[:3]), [boot.boot_id]) == {}  # ended: refused again


def test_two_children_of_one_join_ending_in_one_batch_wake_their_parent_once(
        app, join_world, own, pg):  # noqa: F811 - the imported fixture
    """Each end counts for the join once, seeing the ends before it in the batch: the
    parent, waiting for both, is re-queued once, with one ``run.joined``."""
    from app.extensions import db
    from app.state.ledger import WAIT

    parent, parent_boot, entry, children, child_boot = join_world
    with app.app_context():
        row = db.session.execute(WAIT.call, {"run": parent, "boots": [parent_boot],
                                              "entry": entry, "actions": "[]",
                                              "outputs": "{}"}).one()
        db.session.commit()
    assert row.run_waits and pg.execute(
        "SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] == "waiting"
    done = finish_batch(own, ends(children), [child_boot])
    assert set(done) == set(children)
    woken = [w["id"] for run in children for w in (done[run].woken or [])]
    assert woken == [str(parent)]
    assert pg.execute("SELECT status FROM runs WHERE id = %s", [parent]).fetchone()[0] \
        == "queued"
    assert events_of(pg, parent).count("run.joined") == 1


def _entry_ends(runs, pg):
    """Four kinds of end, one per run, as ``finish_run``'s keywords: the last entry written
    at the end (no row yet), with and without its events; closed from an open row, failed
    with an error and completed."""
    from app.state.ledger import EntryClose

    opened = []
    for run in runs[2:]:
        opened.append(pg.execute(
            "INSERT INTO step_entries (run_id, entry_no, step_id, status) "
            "VALUES (%s, 0, 'a', 'running') RETURNING id", [run]).fetchone()[0])
    error = {"message": "m", "traceback": "t"}
    closes = [EntryClose(None, 0, "a", "completed", [{"n": 1}], {"x": 1}, None, "b", True),
              EntryClose(None, 0, "a", "completed", [], {}, None, None, False),
              EntryClose(opened[0], 0, "a", "failed", [], {}, error, None, True),
              EntryClose(opened[1], 0, "a", "completed", [], {"y": 2}, None, None, True)]
    statuses = ["succeeded", "succeeded", "failed", "succeeded"]
    return [(run, {"status": status, "result": {"n": n} if status == "succeeded" else None,
                   "error": error if status == "failed" else None, "close": close})
            for n, (run, status, close) in enumerate(zip(runs, statuses, closes, strict=True))]


def _written(pg, run):
    """What an end wrote of ``run``, without the ids and times that differ by run."""
    row = pg.execute("SELECT status, result, error, failures, finished_at IS NOT NULL "
                     "FROM runs WHERE id = %s", [run]).fetchone()
    entries = pg.execute("SELECT entry_no, step_id, status, actions, outputs, error, next_step, "
                         "finished_at IS NOT NULL FROM step_entries WHERE run_id = %s",
                         [run]).fetchall()
    events = [(t, {k: v for k, v in payload.items() if k not in ("run_id", "entry_id")})
              for t, payload in pg.execute("SELECT event_type, payload FROM outbox "
                                           "WHERE run_id = %s ORDER BY id", [run])]
    return row, entries, events


def test_a_batch_ended_set_wise_writes_what_each_run_ended_alone_writes(
        admit, boot_factory, own, pg):
    """A batch of runs that set nothing off is ended set-wise; each run's row, last entry
    (written or closed) and events, in their order, are those ``poimen_finish`` writes for
    the same end of a twin run."""
    from app.state.claims import finish_run

    boot = boot_factory().boot_id
    batched, alone = [admit() for _ in range(4)], [admit() for _ in range(4)]
    claim_batch(own, batched + alone, boot)
    batch_ends = [finish_params(run, **end) for run, end in _entry_ends(batched, pg)]
    done = finish_batch(own, batch_ends, [boot])
    assert set(done) == set(batched)
    assert [done[run].woken for run in batched] == [[], [], [], []]
    for run, end in _entry_ends(alone, pg):
        assert finish_run(own, run, [boot], **end)
    for twin, run in zip(alone, batched, strict=True):
        assert _written(pg, run) == _written(pg, twin)
    assert [t for t, _ in _written(pg, batched[0])[2]] == [
        "run.admitted", "run.started", "step.entered", "step.completed", "run.succeeded"]
    assert [t for t, _ in _written(pg, batched[1])[2]] == [
        "run.admitted", "run.started", "run.succeeded"]
    assert "traceback" not in str(_written(pg, batched[2])[2][-2])  # step.failed's error
    # Ended: a second batch of them is refused, and writes nothing more.
    before = pg.execute("SELECT count(*) FROM outbox").fetchone()[0]
    assert finish_batch(own, batch_ends, [boot]) == {}
    assert pg.execute("SELECT count(*) FROM outbox").fetchone()[0] == before


def test_a_batch_with_a_fan_out_child_is_ended_run_by_run_each_fenced(
        join_world, admit, boot_factory, own, pg):  # noqa: F811 - the imported fixture
    """A batch holding a child of a fan-out is ended run by run; each end is still fenced:
    a run another process took over is refused, its claim kept."""
    _, _, _, children, child_boot = join_world
    other, taken = boot_factory(), admit()
    hold_as(pg, taken, other.boot_id)
    done = finish_batch(own, ends([*children, taken]), [child_boot])
    assert set(done) == set(children)
    assert status_of(pg, taken) == ("running", other.boot_id, 1)
    assert events_of(pg, taken) == ["run.admitted"]


@pytest.mark.parametrize("slot", ["limit", "cap"])
def test_a_batch_holding_a_run_with_a_slot_hands_the_slot_on(slot, admit, boot_factory, own, pg):
    """A run of a limited group, or of a capped tenant, that ends in a batch hands its slot
    to the run waiting for it, as its end alone does."""
    from app.state.claims import ClaimOutcome, claim_slot

    boot = boot_factory().boot_id
    if slot == "limit":
        holder, waiting = (admit("keyed", {"customer": "c", "seconds": 0.5}) for _ in range(2))
    else:
        pg.execute("UPDATE tenants SET max_running = 1")
        holder, waiting = admit(), admit()
    claims = [claim_slot(own, run, boot, max_takeovers=max_takeovers_of, transaction=False)
              for run in (holder, waiting)]
    assert [c.outcome for c in claims] == [ClaimOutcome.CLAIMED, ClaimOutcome.SLOT_WAIT]
    done = finish_batch(own, ends([holder]), [boot])
    assert [w["id"] for w in done[holder].woken] == [str(waiting)]
    assert status_of(pg, waiting)[0] == "queued"


def test_one_bad_value_fails_the_batch_statement_and_nothing_of_it_is_written(
        admit, boot_factory, own, pg):
    """A value ``jsonb`` refuses fails the whole statement (the worker then ends each run
    alone, so only the bad one fails: ``test_batching_processes.py``)."""
    from sqlalchemy.exc import DataError

    runs, boot = [admit() for _ in range(3)], boot_factory()
    claim_batch(own, runs, boot.boot_id)
    bad = ends(runs)
    bad[1]["result"] = '{"text": "nul \\u0000 here"}'
    with pytest.raises(DataError):
        finish_batch(own, bad, [boot.boot_id])
    assert {status_of(pg, run)[0] for run in runs} == {"running"}


# -- the batcher --------------------------------------------------------------------------------

def batcher(dsn, live=lambda boot: True, **kwargs):
    return Batcher(lambda: dsn, window=kwargs.pop("window", 0.05),
                   max_size=kwargs.pop("max_size", 64), live=live, resolve_seconds=10,
                   **kwargs)


def in_threads(calls):
    """Run each of ``calls`` in a thread of its own at once; their values or exceptions."""
    out: list = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except Exception as err:  # noqa: BLE001 - returned for the test to read
            out[i] = err

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_batcher_merges_the_claims_of_many_threads_into_one_statement(
        admit, boot_factory, dsn, pg):
    runs, boot = [admit() for _ in range(8)], boot_factory()
    b = batcher(dsn, window=0.5)
    for _ in runs:
        b.enter()
    claimed = in_threads([lambda run=run: b.claim(run, boot.boot_id) for run in runs])
    assert all(row is not None and row.id == run for row, run in zip(claimed, runs, strict=True))
    # Every thread waiting on it: sent at once, in one statement, not after the window.
    assert b.sizes["claim"] == {8: 1}
    done = in_threads([lambda run=run: b.finish(run, [boot.boot_id], ends([run])[0])
                       for run in runs])
    assert [d.id for d in done] == runs
    assert b.sizes["finish"] == {8: 1}
    assert {status_of(pg, run)[0] for run in runs} == {"succeeded"}


def _in_submit(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``Batcher._submit`` (at its lock, when the test holds it)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_submit":
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("kind", ["claim", "finish"])
def test_a_request_made_while_the_batcher_takes_a_batch_goes_in_the_next_one(
        kind, admit, boot_factory, dsn, pg):
    """A thread that asks while the batcher takes a batch off its queue is sent in the next
    batch: it appends to the queue as it is after the take, never to the list the take
    emptied, where it would wait forever unsent (its run queued, its thread lost). The
    interleaving is forced: the test holds the batcher's lock, lets the asker reach it, and
    takes a batch meanwhile."""
    run, boot = admit(), boot_factory()
    b = batcher(dsn, window=0.01)
    b.enter()
    if kind == "finish":
        assert b.claim(run, boot.boot_id) is not None
    out: list = []

    def ask():
        out.append(b.claim(run, boot.boot_id) if kind == "claim"
                   else b.finish(run, [boot.boot_id], ends([run])[0]))

    asker = threading.Thread(target=ask, daemon=True)  # a lost request would hang the run
    with b._cond:  # held as the batcher's thread holds it while it takes a batch
        asker.start()
        wait_until(lambda: _in_submit(asker), timeout=5, what="the asker at the batcher's lock")
        assert b._take() == ([], [])  # the batcher's take of the batch before
    asker.join(10)
    assert not asker.is_alive(), f"the {kind} was never sent"
    assert out[0] is not None and out[0].id == run
    assert status_of(pg, run)[0] == ("running" if kind == "claim" else "succeeded")


# -- lingering under load (POIMEN_WORKER_BATCH_LINGER_MS) --------------------------------------

def test_the_arrival_rate_expects_requests_only_while_they_come_often():
    arrivals = Arrivals()
    assert arrivals.expected(1.0) == 0.0  # nothing known yet: nothing expected
    for n in range(20):
        arrivals.note(100.0 + n * 0.001)  # one a millisecond
    assert arrivals.expected(0.005) == pytest.approx(5.0, rel=0.05)
    arrivals.note(100.019 + 1.0)  # then a pause of a second counts at once
    assert arrivals.expected(0.005) < 0.05


def _busy(b: Batcher, gap: float = 0.001, ago: float = 0.0) -> None:
    """Requests arrived at ``b`` every ``gap`` seconds until ``ago`` seconds ago (0: it is
    under load now)."""
    last = time.monotonic() - ago
    for n in range(19, -1, -1):
        b._arrivals.note(last - n * gap)


def test_under_load_the_batcher_lingers_until_every_thread_of_the_pool_waits(
        admit, boot_factory, dsn, pg):
    # The first claim finds every run in flight waiting (one): without lingering it would
    # go alone. Under load the batcher waits, up to 30 s here, for the runs about to start;
    # once all three threads of the pool wait on it, nothing more can come: it sends.
    runs, boot = [admit() for _ in range(3)], boot_factory()
    b = batcher(dsn, window=0.0, linger=30.0, threads=3)
    _busy(b)
    b.enter()
    first: list = []
    t = threading.Thread(target=lambda: first.append(b.claim(runs[0], boot.boot_id)))
    t.start()
    wait_until(lambda: _in_submit(t) and b._lingering, timeout=10, what="the batcher to linger")
    started = time.monotonic()
    b.enter()
    b.enter()
    rest = in_threads([lambda run=run: b.claim(run, boot.boot_id) for run in runs[1:]])
    t.join(10)
    assert [r.id for r in [*first, *rest]] == runs
    assert b.sizes["claim"] == {3: 1}  # one statement for the three
    assert time.monotonic() - started < 10  # sent when the pool was full, not at 30 s


def test_the_batcher_lingers_no_longer_than_its_bound(admit, boot_factory, dsn):
    run, boot = admit(), boot_factory()
    b = batcher(dsn, window=0.0, linger=0.3, threads=16)
    _busy(b)
    b.enter()
    started = time.monotonic()
    assert b.claim(run, boot.boot_id).id == run
    waited = time.monotonic() - started
    assert 0.25 <= waited < 5  # it waited for more, and only its bound


@pytest.mark.parametrize("history", ["none", "a pause"])
def test_at_a_low_rate_the_batcher_sends_at_once(history, admit, boot_factory, dsn):
    # No request recently: lingering 30 s would only delay the run (its test would time out).
    run, boot = admit(), boot_factory()
    b = batcher(dsn, window=0.0, linger=30.0, threads=16)
    if history == "a pause":
        _busy(b, ago=2000.0)  # a burst, then a pause far longer than the bound
    b.enter()
    started = time.monotonic()
    claimed = in_threads([lambda: b.claim(run, boot.boot_id)])
    assert claimed[0].id == run
    assert time.monotonic() - started < 10
    assert not b._lingering


def test_a_finish_batch_that_fails_fails_each_request_to_be_sent_alone(
        admit, boot_factory, dsn, pg):
    runs, boot = [admit() for _ in range(3)], boot_factory()
    b = batcher(dsn, window=0.5)
    for _ in runs:
        b.enter()
    in_threads([lambda run=run: b.claim(run, boot.boot_id) for run in runs])
    params = ends(runs)
    params[0]["result"] = '{"text": "nul \\u0000 here"}'
    out = in_threads([lambda i=i: b.finish(runs[i], [boot.boot_id], params[i])
                      for i in range(3)])
    assert all(isinstance(o, BatchFailed) for o in out)
    assert {status_of(pg, run)[0] for run in runs} == {"running"}


def _block_on_row(dsn, run_id):
    """A transaction holding ``run_id``'s row lock: a claim of it waits."""
    conn = psycopg.connect(dsn)
    conn.execute("SELECT 1 FROM runs WHERE id = %s FOR UPDATE", [run_id])
    return conn


def _waiting_on_a_lock(pg) -> bool:
    return pg.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                      "AND datname = current_database()").fetchone()[0] >= 1


class ClaimBehindALock:
    """Two runs claimed in one batch through a proxy, the claim waiting on the second run's
    row lock (held by ``blocker``): the test then breaks the path (``proxy.cut()``), lets
    the lock go (``blocker.rollback()``), and reads each claim's answer (``answers()``)."""

    def __init__(self, runs, boot, dsn, pg, live=lambda boot_id: True):
        self.proxy = StallingProxy.to_postgres(dsn)
        self.blocker = _block_on_row(dsn, runs[1])
        b = batcher(self.proxy.url(dsn), live=live)
        b.enter()
        b.enter()
        self.result: list = []
        self.waiter = threading.Thread(target=lambda: self.result.extend(in_threads(
            [lambda run=run: b.claim(run, boot.boot_id) for run in runs])))
        self.waiter.start()
        wait_until(lambda: _waiting_on_a_lock(pg), timeout=10, what="the claim to wait")

    def answers(self) -> list:
        self.waiter.join(30)
        return self.result

    def close(self) -> None:
        self.blocker.rollback()
        self.blocker.close()
        self.proxy.close()


def test_a_batch_claim_cut_before_it_applied_is_decided_not_claimed_and_never_applies_later(
        admit, boot_factory, dsn, pg):
    """The connection breaks while the claim waits on a row lock. Its backend would go on
    and commit once the lock is free, with nobody to run the runs: the batcher ends that
    backend and awaits it before it reads, so the runs stay queued and go the single-run
    way (None), and the boot is not ended (no run is charged a takeover)."""
    runs, boot = [admit() for _ in range(2)], boot_factory()
    claim = ClaimBehindALock(runs, boot, dsn, pg)
    try:
        claim.proxy.cut()  # decisions go on a new connection, through the same route
        assert claim.answers() == [None, None]
    finally:
        claim.close()
    time.sleep(1.0)  # had the cut backend lived on, it would have committed by now
    assert {status_of(pg, run)[0] for run in runs} == {"queued"}


def test_a_batch_claim_that_applied_with_its_answer_lost_is_decided_claimed(
        admit, boot_factory, dsn, pg):
    """The claim commits but its answer never arrives (the path stalls, then breaks): the
    runs this boot holds after the backend ended are the ones the batch claimed."""
    runs, boot = [admit() for _ in range(2)], boot_factory()
    claim = ClaimBehindALock(runs, boot, dsn, pg)
    try:
        claim.proxy.stall()
        claim.blocker.rollback()  # the claim goes on, commits, answers into the stalled path
        wait_until(lambda: {status_of(pg, r)[0] for r in runs} == {"running"}, timeout=10,
                   what="the claim to commit")
        claim.proxy.cut()
        claim.proxy.resume()
        answers = claim.answers()
    finally:
        claim.close()
    assert [row.id if row is not None else row for row in answers] == runs
    assert {status_of(pg, run) for run in runs} == {("running", boot.boot_id, 1)}


def test_a_batch_claim_of_unknown_outcome_whose_boot_died_is_left_to_the_takeover(
        admit, boot_factory, dsn, pg):
    runs, boot = [admit() for _ in range(2)], boot_factory()
    claim = ClaimBehindALock(runs, boot, dsn, pg, live=lambda boot_id: False)
    try:
        claim.proxy.cut()
        answers = claim.answers()
    finally:
        claim.close()
    assert all(isinstance(answer, ClaimUnknown) for answer in answers)


def test_a_second_delivery_in_this_process_is_a_duplicate_decided_here():
    from workers import boots

    run = uuid.uuid4()
    assert boots.begin_claim(run)
    assert not boots.begin_claim(run)
    boots.end_claim(run)
    assert boots.begin_claim(run)
    boots.end_claim(run)


def test_a_batch_worker_refuses_workflows_with_time_limits(app):
    from workers.batching import refused_workflows
    from workers.registry import load_modules

    load_modules(["tests.workflows.celery_tasks"])
    refused = refused_workflows()
    assert "over-time@1" in refused and "soft-time@1" in refused
    assert "echo@1" not in refused


def test_the_single_claim_still_decides_what_a_batch_did_not_claim(
        admit, boot_factory, own, pg, app):
    """A run the batch did not claim goes the single-run way, which says why."""
    from app.extensions import db
    from app.state.claims import ClaimOutcome

    run, holder, boot = admit(), boot_factory(), boot_factory()
    hold_as(pg, run, holder.boot_id)
    assert claim_batch(own, [run], boot.boot_id) == {}
    with app.app_context():
        claim = claim_run(on_session(db.session), run, boot.boot_id,
                          max_takeovers=max_takeovers_of)
        db.session.commit()
    assert claim.outcome == ClaimOutcome.DUPLICATE and claim.holder == holder.boot_id


def test_a_finish_returns_only_once_its_batch_committed(admit, boot_factory, dsn, pg):
    """A run is reported (the thread's finish returns; its events exist) only once the
    batch's statement returned, committed: while the statement waits on a lock, the
    finish has not returned and the run is still running."""
    run, boot = admit(), boot_factory()
    b = batcher(dsn)
    b.enter()
    assert b.claim(run, boot.boot_id) is not None
    blocker = _block_on_row(dsn, run)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        b.finish(run, [boot.boot_id], ends([run])[0])))
    try:
        thread.start()
        wait_until(lambda: _waiting_on_a_lock(pg), timeout=10, what="the finish to wait")
        time.sleep(0.3)
        assert result == []
        assert status_of(pg, run)[0] == "running"
    finally:
        blocker.rollback()
        blocker.close()
    thread.join(30)
    assert [r.id for r in result] == [run]
    assert status_of(pg, run)[0] == "succeeded"


# -- a claim batch and a finish batch in one transaction ----------------------------------------

def _pair(admit, boot_factory, url):
    """A batcher on ``url`` with two threads in flight: one has claimed ``ended`` (to end
    it), the other is to claim ``claimed``. Sent when both wait, never by the window.
    Returns (batcher, ended, claimed, boot)."""
    ended, claimed, boot = admit(), admit(), boot_factory()
    b = batcher(url, window=5.0)
    b.enter()
    assert b.claim(ended, boot.boot_id) is not None
    b.enter()
    return b, ended, claimed, boot


def _claim_and_finish(b, claim_run_id, finish_run_id, boot, params=None):
    """A thread claiming ``claim_run_id`` and one finishing ``finish_run_id`` (claimed
    before; with ``params``, else a success), both waiting on ``b`` at once: taken in one
    batch. Their answers, in that order, once both returned (``join``), and the
    threads."""
    out: list = [None, None]

    def claim():
        out[0] = _caught(lambda: b.claim(claim_run_id, boot.boot_id))

    def finish():
        out[1] = _caught(lambda: b.finish(finish_run_id, [boot.boot_id],
                                          params or ends([finish_run_id])[0]))

    threads = [threading.Thread(target=claim, daemon=True),
               threading.Thread(target=finish, daemon=True)]
    for t in threads:
        t.start()
    return out, threads


def _caught(call):
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - returned for the test to read
        return err


def _xmin(pg, run_id) -> int:
    return int(pg.execute("SELECT xmin::text FROM runs WHERE id = %s", [run_id]).fetchone()[0])


def test_claims_and_finishes_taken_together_commit_in_one_transaction(
        admit, boot_factory, dsn, pg):
    """A claim and a finish the batcher takes at once are one transaction, one commit:
    the claimed run's row and the ended run's row carry the same transaction id."""
    b, ended, claimed, boot = _pair(admit, boot_factory, dsn)
    out, threads = _claim_and_finish(b, claimed, ended, boot)
    for t in threads:
        t.join(30)
    assert out[0] is not None and out[0].id == claimed, out
    assert out[1] is not None and out[1].id == ended and out[1].status == "succeeded", out
    assert b.sizes == {"claim": {1: 2}, "finish": {1: 1}}
    assert _xmin(pg, claimed) == _xmin(pg, ended)
    assert status_of(pg, claimed) == ("running", boot.boot_id, 1)
    assert status_of(pg, ended)[0] == "succeeded"


@pytest.mark.parametrize("slot", ["limit", "cap"])
def test_a_slot_handed_on_by_a_finish_sent_with_claims_commits_with_them(
        slot, admit, boot_factory, dsn, own, pg):
    """A limited run's end (or a capped tenant's) taken together with a claim: its slot
    is handed on in the same transaction as the claim. Under a tenant cap the batch claim
    refuses the other run (the single-run path claims it under the slot), and the
    transaction still commits the end."""
    from app.state.claims import ClaimOutcome, claim_slot

    boot = boot_factory()
    if slot == "limit":
        holder, waiting = (admit("keyed", {"customer": "c", "seconds": 0.5}) for _ in range(2))
    else:
        pg.execute("UPDATE tenants SET max_running = 1")
        holder, waiting = admit(), admit()
    other = admit()
    claims = [claim_slot(own, run, boot.boot_id, max_takeovers=max_takeovers_of,
                         transaction=False) for run in (holder, waiting)]
    assert [c.outcome for c in claims] == [ClaimOutcome.CLAIMED, ClaimOutcome.SLOT_WAIT]
    b = batcher(dsn, window=5.0)
    b.enter()
    b.enter()
    out, threads = _claim_and_finish(b, other, holder, boot)
    for t in threads:
        t.join(30)
    assert out[1] is not None and [w["id"] for w in out[1].woken] == [str(waiting)], out
    assert status_of(pg, waiting)[0] == "queued"
    assert b.sizes["finish"] == {1: 1} and b.sizes["claim"] == {1: 1}
    if slot == "limit":
        assert out[0] is not None and out[0].id == other, out
        assert _xmin(pg, other) == _xmin(pg, holder)
    else:
        assert out[0] is None, out
        assert status_of(pg, other)[0] == "queued"


def test_a_claim_sent_with_finishes_is_answered_only_once_their_commit(
        admit, boot_factory, dsn, pg):
    """The claim of a batch sent with finishes returns only after the transaction's
    commit: while the finish waits on a lock, the claim has not returned (its body may not
    start) and, outside the transaction, the run is still queued."""
    b, ended, claimed, boot = _pair(admit, boot_factory, dsn)
    blocker = _block_on_row(dsn, ended)
    try:
        out, threads = _claim_and_finish(b, claimed, ended, boot)
        wait_until(lambda: _waiting_on_a_lock(pg), timeout=10, what="the finish to wait")
        time.sleep(0.3)
        assert out == [None, None]
        assert status_of(pg, claimed)[0] == "queued"
    finally:
        blocker.rollback()
        blocker.close()
    for t in threads:
        t.join(30)
    assert out[0].id == claimed and out[1].id == ended
    assert status_of(pg, claimed)[0] == "running" and status_of(pg, ended)[0] == "succeeded"


def _with_a_bad_finish(admit, boot_factory, dsn, **bad):
    """A claim and a finish taken together, the finish with the values ``bad``: their
    answers once both returned, and (ended, claimed, boot)."""
    b, ended, claimed, boot = _pair(admit, boot_factory, dsn)
    out, threads = _claim_and_finish(b, claimed, ended, boot, {**ends([ended])[0], **bad})
    for t in threads:
        t.join(30)
    return out, ended, claimed, boot


def test_a_refused_claim_and_finish_batch_rolls_both_back_and_sends_each_alone(
        admit, boot_factory, dsn, pg):
    """A finish value ``jsonb`` refuses fails the transaction: the claim taken with it is
    not applied (its run stays queued, answered None: the single-run path claims it) and
    the finish fails, to be sent alone."""
    out, ended, claimed, boot = _with_a_bad_finish(
        admit, boot_factory, dsn, result='{"text": "nul \\u0000 here"}')
    assert out[0] is None and isinstance(out[1], BatchFailed), out
    assert status_of(pg, claimed)[0] == "queued"
    assert status_of(pg, ended) == ("running", boot.boot_id, 1)
    assert events_of(pg, claimed) == ["run.admitted"]


def test_a_finish_value_psycopg_cannot_send_leaves_the_claims_decided_per_run(
        admit, boot_factory, dsn, pg):
    """A finish value psycopg refuses before sending (a NUL in a text) raises with the
    claim statement already queued: psycopg's pipeline still syncs on its way out, so
    the claim commits alone. The error has no SQLSTATE, so the batcher takes the outcome
    as unknown and reads each claim: the claim is answered claimed (its run runs), and
    the finish fails, to be sent alone."""
    out, ended, claimed, boot = _with_a_bad_finish(admit, boot_factory, dsn,
                                                   step="nul \x00 here")
    assert out[0] is not None and out[0].id == claimed, out
    assert isinstance(out[1], BatchFailed), out
    assert status_of(pg, claimed) == ("running", boot.boot_id, 1)
    assert status_of(pg, ended) == ("running", boot.boot_id, 1)


@contextlib.contextmanager
def _pair_waiting_on_a_lock(admit, boot_factory, dsn, pg):
    """A claim and a finish taken together through a proxy, the finish waiting on its
    run's row lock (held by ``blocker``): the test then breaks the path and reads the
    answers (``answers()``). Yields a namespace of proxy, blocker, ended, claimed, boot
    and answers."""
    proxy = StallingProxy.to_postgres(dsn)
    b, ended, claimed, boot = _pair(admit, boot_factory, proxy.url(dsn))
    blocker = _block_on_row(dsn, ended)
    try:
        out, threads = _claim_and_finish(b, claimed, ended, boot)
        wait_until(lambda: _waiting_on_a_lock(pg), timeout=10, what="the finish to wait")

        def answers():
            for t in threads:
                t.join(30)
            return out

        yield types.SimpleNamespace(proxy=proxy, blocker=blocker, ended=ended,
                                    claimed=claimed, boot=boot, answers=answers)
    finally:
        blocker.rollback()
        blocker.close()
        proxy.close()


def test_a_claim_and_finish_batch_cut_before_it_applied_is_decided_per_run(
        admit, boot_factory, dsn, pg):
    """The connection breaks while the transaction's finish waits on a row lock: the
    batcher ends the backend and awaits it, so nothing of the transaction applies later;
    the claim is decided not claimed (None, the single-run path) and the finish fails, to
    be sent alone. No boot is ended."""
    with _pair_waiting_on_a_lock(admit, boot_factory, dsn, pg) as pair:
        pair.proxy.cut()
        out = pair.answers()
    ended, claimed, boot = pair.ended, pair.claimed, pair.boot
    assert out[0] is None and isinstance(out[1], BatchFailed), out
    time.sleep(1.0)  # had the cut backend lived on, it would have committed by now
    assert status_of(pg, claimed)[0] == "queued"
    assert status_of(pg, ended) == ("running", boot.boot_id, 1)


def test_a_claim_and_finish_batch_that_applied_with_its_answer_lost_is_decided_claimed(
        admit, boot_factory, dsn, pg):
    """The transaction commits but its answer never arrives: the claim is decided claimed
    (this boot holds the run once the backend ended), and the finish, failed to be sent
    alone, is refused there by its fence, its run already ended by this process."""
    with _pair_waiting_on_a_lock(admit, boot_factory, dsn, pg) as pair:
        pair.proxy.stall()
        pair.blocker.rollback()  # the transaction goes on, commits, answers into the stall
        wait_until(lambda: status_of(pg, pair.ended)[0] == "succeeded", timeout=10,
                   what="the transaction to commit")
        pair.proxy.cut()
        pair.proxy.resume()
        out = pair.answers()
    ended, claimed, boot = pair.ended, pair.claimed, pair.boot
    assert out[0] is not None and out[0].id == claimed, out
    assert isinstance(out[1], BatchFailed), out
    assert status_of(pg, claimed) == ("running", boot.boot_id, 1)
    assert events_of(pg, ended) == ["run.admitted", "run.started", "run.succeeded"]


# -- a batch worker's executions, in this process ---------------------------------------------

@pytest.fixture
def batch_mode(app, fresh_boot):
    """This process as a batch worker: executions claim and finish through a batcher of
    their own (its sizes read by the test)."""
    from workers import batching

    app.config["POIMEN_WORKER_MODE"] = "batch"
    batching._batcher = None
    yield lambda: batching._batcher
    app.config["POIMEN_WORKER_MODE"] = "prefork"
    batching._batcher = None


def execute_all(app, run_ids, limited=False):
    from workers.execution import execute_run

    def one(run_id):
        with app.app_context():
            return execute_run(str(run_id), limited=limited)

    return in_threads([lambda run=run: one(run) for run in run_ids])


def test_a_batch_workers_runs_each_run_once_with_claims_and_finishes_batched(
        app, admit, batch_mode, pg):
    runs = [admit("echo", {"n": n}) for n in range(12)]
    out = execute_all(app, runs)
    assert [o.outcome.value for o in out] == ["claimed"] * 12, out
    assert [o.ended.status.value for o in out] == ["succeeded"] * 12
    for run in runs:
        assert events_of(pg, run) == ["run.admitted", "run.started", "run.succeeded"]
    sizes = batch_mode().sizes
    # Fewer statements than runs, each run in exactly one of them.
    assert sum(n * k for n, k in sizes["claim"].items()) == 12
    assert sum(n * k for n, k in sizes["finish"].items()) == 12
    assert sum(sizes["claim"].values()) < 12 and sum(sizes["finish"].values()) < 12


def test_one_bad_result_in_a_batch_fails_only_its_own_run(app, admit, batch_mode, pg):
    good = [admit("echo", {"n": n}) for n in range(5)]
    bad = admit("unstorable", {})
    out = execute_all(app, [*good[:3], bad, *good[3:]])
    ended = {o.run_id: o.ended.status.value for o in out}
    assert ended[bad] == "failed"
    assert {ended[run] for run in good} == {"succeeded"}
    error = pg.execute("SELECT error FROM runs WHERE id = %s", [bad]).fetchone()[0]
    assert error["type"] == "poimen.ResultNotStorable"


def test_a_second_delivery_of_a_run_in_flight_here_does_nothing(app, admit, batch_mode, pg):
    """Two deliveries of one run reach two threads of one batch worker: one executes it,
    the other is a duplicate (decided in this process or by Postgres), never a second
    execution."""
    runs = [admit("sleep", {"seconds": 0.3}) for _ in range(3)]
    out = execute_all(app, [*runs, *runs])
    outcomes = sorted(o.outcome.value for o in out)
    assert outcomes == ["claimed"] * 3 + ["duplicate"] * 3
    for run in runs:
        assert events_of(pg, run).count("run.started") == 1
        assert status_of(pg, run)[0] == "succeeded"


def test_a_limited_run_in_a_batch_worker_takes_the_slot_claim(app, admit, batch_mode, pg,
                                                              side_effects):
    """A run of a limited workflow never enters a batch (its message names a limited
    workflow): its claim counts its group's slots, its end hands its slot on (the
    single-run statements), and the run it wakes is sent."""
    runs = [admit("keyed", {"customer": "c", "seconds": 0.5}) for _ in range(2)]
    out = execute_all(app, runs, limited=True)
    assert sorted(o.outcome.value for o in out) == ["claimed", "slot_wait"]
    woken = next(o.run_id for o in out if o.outcome.value == "slot_wait")
    assert status_of(pg, woken)[0] == "queued"  # the holder's end handed the slot on
    assert sum(batch_mode().sizes["claim"].values()) == 0
    assert sum(batch_mode().sizes["finish"].values()) == 0
    # A capped tenant's run whose message names no limit: the batch does not claim it,
    # the single-run claim takes it under its slot.
    pg.execute("UPDATE tenants SET max_running = 5")
    capped = admit("echo", {})
    (one,) = execute_all(app, [capped])
    assert one.outcome.value == "claimed" and one.ended.status.value == "succeeded"
    assert sum(batch_mode().sizes["finish"].values()) == 0
